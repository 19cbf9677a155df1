// Evaluator of the Jinja interpreter: walks the syntax tree, writing output into a string.
// Convention: scoping is Jinja's: every for-loop iteration, macro call and {% set %}...{% endset %}
// body gets a child scope, so `set` inside them does not leak out (that is what namespace() is for);
// `if` opens no scope. Errors thrown as TemplateError by value operations are rethrown here as
// lathe::Error with the line and column of the innermost expression or statement.
// Covered by tests/data/test_chat_template.cpp.
#include "core/error.h"
#include "data/jinja_internal.h"

#include <algorithm>

namespace lathe::jinja {

struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(std::string_view name) const {
    for (const Scope* s = this; s; s = s->parent.get()) {
      for (const auto& [key, value] : s->vars) {
        if (key == name) return &value;
      }
    }
    return nullptr;
  }

  void set(const std::string& name, Value value) {
    for (auto& [key, existing] : vars) {
      if (key == name) {
        existing = std::move(value);
        return;
      }
    }
    vars.emplace_back(name, std::move(value));
  }
};

namespace {

using ScopePtr = std::shared_ptr<Scope>;

ScopePtr child_scope(const ScopePtr& parent) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  return s;
}

constexpr int kMaxCallDepth = 200;

class Renderer {
 public:
  explicit Renderer(const Program& program) : program_(program) {}
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;

  // A macro holds the scope it was defined in, and that scope holds the macro: clearing the scopes
  // that closures captured breaks those cycles once the render is over (or has failed).
  ~Renderer() {
    for (const ScopePtr& scope : closures_) scope->vars.clear();
  }

  enum class Flow { Normal, Break, Continue };

  Flow exec(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const auto& stmt : body) {
      Flow flow;
      try {
        flow = exec_stmt(*stmt, scope, out);
      } catch (const TemplateError& e) {
        fail(stmt->pos, e);
      }
      if (flow != Flow::Normal) return flow;
    }
    return Flow::Normal;
  }

 private:
  [[noreturn]] void fail(size_t pos, const TemplateError& e) const {
    std::string where = source_location(program_.source, pos);
    if (e.raised) LATHE_FAIL("jinja: the template raised an error at {}: {}", where, e.message);
    LATHE_FAIL("jinja: error at {}: {}", where, e.message);
  }

  Flow exec_stmt(const Stmt& s, const ScopePtr& scope, std::string& out) {
    switch (s.kind) {
      case Stmt::Kind::Text:
        out += s.text;
        return Flow::Normal;
      case Stmt::Kind::Output:
        out += to_str(eval(*s.expr, scope));
        return Flow::Normal;
      case Stmt::Kind::If:
        for (const Branch& branch : s.branches) {
          if (!branch.condition || truthy(eval(*branch.condition, scope))) return exec(branch.body, scope, out);
        }
        return Flow::Normal;
      case Stmt::Kind::For: return exec_for(s, scope, out);
      case Stmt::Kind::Set: {
        Value value = eval(*s.expr, scope);
        if (s.attr_target) {
          const Value* target = scope->find(s.targets[0]);
          if (!target || !target->is(Value::Kind::Namespace)) {
            throw TemplateError{fmt::format("cannot set attribute '{}' on '{}': only namespace() objects allow it",
                                            s.targets[1], s.targets[0])};
          }
          target->dict->set(s.targets[1], std::move(value));
        } else {
          assign(*scope, s.targets, value);
        }
        return Flow::Normal;
      }
      case Stmt::Kind::SetBlock: {
        std::string captured;
        exec(s.body, child_scope(scope), captured);
        scope->set(s.targets[0], Value::from_string(std::move(captured)));
        return Flow::Normal;
      }
      case Stmt::Kind::Macro: {
        Value macro;
        macro.kind = Value::Kind::Macro;
        macro.macro = std::make_shared<const Macro>(Macro{&s, scope});
        closures_.push_back(scope);
        scope->set(s.text, std::move(macro));
        return Flow::Normal;
      }
      case Stmt::Kind::Break: return Flow::Break;
      case Stmt::Kind::Continue: return Flow::Continue;
      case Stmt::Kind::Generation: return exec(s.body, child_scope(scope), out);
    }
    return Flow::Normal;
  }

  // Binds one name, or unpacks a sequence into several (`for k, v in ...`, `set a, b = ...`).
  static void assign(Scope& scope, const std::vector<std::string>& targets, const Value& value) {
    if (targets.size() == 1) {
      scope.set(targets[0], value);
      return;
    }
    if (!value.is(Value::Kind::List) || value.list->items.size() != targets.size()) {
      throw TemplateError{fmt::format("cannot unpack {} into {} names", to_repr(value), targets.size())};
    }
    for (size_t i = 0; i < targets.size(); ++i) scope.set(targets[i], value.list->items[i]);
  }

  Flow exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
    std::vector<Value> items;
    Value iterable = eval(*s.expr, scope);
    try {
      items = iterate(iterable);
    } catch (const TemplateError& e) {
      fail(s.expr->pos, e);
    }
    if (s.condition) {  // `for x in xs if cond`: loop.length and friends count the kept items
      std::vector<Value> kept;
      for (Value& item : items) {
        ScopePtr probe = child_scope(scope);
        assign(*probe, s.targets, item);
        if (truthy(eval(*s.condition, probe))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec(s.else_body, scope, out);
    auto shared_items = std::make_shared<const List>(List{std::move(items), false});
    for (size_t i = 0; i < shared_items->items.size(); ++i) {
      ScopePtr iteration = child_scope(scope);
      assign(*iteration, s.targets, shared_items->items[i]);
      Value loop;
      loop.kind = Value::Kind::Loop;
      loop.loop = std::make_shared<const LoopState>(LoopState{shared_items, int64_t(i)});
      iteration->set("loop", std::move(loop));
      if (exec(s.body, iteration, out) == Flow::Break) break;
    }
    return Flow::Normal;
  }

  // ---- expressions ----

  Value eval(const Expr& e, const ScopePtr& scope) {
    try {
      return eval_expr(e, scope);
    } catch (const TemplateError& error) {
      fail(e.pos, error);
    }
  }

  CallArgs eval_args(const std::vector<Arg>& args, const ScopePtr& scope) {
    CallArgs out;
    for (const Arg& arg : args) {
      Value v = eval(*arg.value, scope);
      if (arg.name.empty()) {
        out.positional.push_back(std::move(v));
      } else {
        out.keyword.emplace_back(arg.name, std::move(v));
      }
    }
    return out;
  }

  Value eval_expr(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case Expr::Kind::Literal: return e.literal;
      case Expr::Kind::Name: {
        const Value* found = scope->find(e.name);
        return found ? *found : Value::undefined(e.name);
      }
      case Expr::Kind::List:
      case Expr::Kind::Tuple: {
        std::vector<Value> items;
        for (const auto& item : e.operands) items.push_back(eval(*item, scope));
        return Value::from_list(std::move(items), e.kind == Expr::Kind::Tuple);
      }
      case Expr::Kind::Dict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.operands.size(); i += 2) {
          Value key = eval(*e.operands[i], scope);
          if (!key.is_string()) throw TemplateError{fmt::format("dict literal keys must be strings, not {}", type_name(key))};
          d.set(key.text, eval(*e.operands[i + 1], scope));
        }
        return Value::from_dict(std::move(d));
      }
      case Expr::Kind::Attr: return get_attr(eval(*e.operands[0], scope), e.name);
      case Expr::Kind::Item: {
        Value obj = eval(*e.operands[0], scope);
        return get_item(obj, eval(*e.operands[1], scope));
      }
      case Expr::Kind::Slice: {
        Value obj = eval(*e.operands[0], scope);
        auto bound = [&](size_t i) { return e.operands[i] ? eval(*e.operands[i], scope) : Value::none(); };
        Value start = bound(1), stop = bound(2), step = bound(3);
        return slice(obj, start, stop, step);
      }
      case Expr::Kind::Call: return eval_call(e, scope);
      case Expr::Kind::Filter: {
        Value subject = eval(*e.operands[0], scope);
        return apply_filter(e.name, subject, eval_args(e.args, scope));
      }
      case Expr::Kind::Test: {
        Value subject = eval(*e.operands[0], scope);
        return Value::from_bool(apply_test(e.name, subject, eval_args(e.args, scope)) != e.negated);
      }
      case Expr::Kind::Unary: {
        Value v = eval(*e.operands[0], scope);
        if (v.is_undefined()) undefined_error(v);
        if (!v.is_number()) throw TemplateError{fmt::format("bad operand type for unary {}: '{}'", e.name, type_name(v))};
        if (e.name == "+") return v.is(Value::Kind::Float) ? v : Value::from_int(v.as_int());
        if (v.is(Value::Kind::Float)) return Value::from_float(-v.number);
        if (v.as_int() == INT64_MIN) throw TemplateError{"integer overflow"};
        return Value::from_int(-v.as_int());
      }
      case Expr::Kind::Binary: {
        Value left = eval(*e.operands[0], scope);
        return binary_op(e.name, left, eval(*e.operands[1], scope));
      }
      case Expr::Kind::Compare: {
        Value left = eval(*e.operands[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.operands[i + 1], scope);
          if (!compare_op(e.ops[i], left, right)) return Value::from_bool(false);
          left = std::move(right);
        }
        return Value::from_bool(true);
      }
      case Expr::Kind::And: {
        Value left = eval(*e.operands[0], scope);
        return truthy(left) ? eval(*e.operands[1], scope) : left;
      }
      case Expr::Kind::Or: {
        Value left = eval(*e.operands[0], scope);
        return truthy(left) ? left : eval(*e.operands[1], scope);
      }
      case Expr::Kind::Not: return Value::from_bool(!truthy(eval(*e.operands[0], scope)));
      case Expr::Kind::Cond:
        if (truthy(eval(*e.operands[1], scope))) return eval(*e.operands[0], scope);
        return e.operands[2] ? eval(*e.operands[2], scope) : Value::undefined("conditional expression without else");
    }
    return Value::undefined();
  }

  static bool compare_op(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "in") return contains(b, a);
    if (op == "not in") return !contains(b, a);
    int c = compare(a, b);
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }

  Value eval_call(const Expr& e, const ScopePtr& scope) {
    const Expr& callee = *e.operands[0];
    if (callee.kind == Expr::Kind::Attr) {  // a method: s.strip(), d.items(), loop.cycle(...)
      Value obj = eval(*callee.operands[0], scope);
      if (obj.is_undefined()) get_attr(obj, callee.name);  // throws, naming what was undefined
      CallArgs args = eval_args(e.args, scope);
      if (auto result = call_method(obj, callee.name, args)) return *result;
      Value f = get_attr(obj, callee.name);
      if (f.is_undefined()) {
        throw TemplateError{fmt::format("'{}' object has no method '{}'", type_name(obj), callee.name)};
      }
      return call_value(f, args);
    }
    Value f = eval(callee, scope);
    CallArgs args = eval_args(e.args, scope);
    return call_value(f, args);
  }

  Value call_value(const Value& f, const CallArgs& args) {
    switch (f.kind) {
      case Value::Kind::Function: return call_global(f.text, args);
      case Value::Kind::Macro: return call_macro(*f.macro, args);
      case Value::Kind::Undefined:
        if (f.text.empty()) throw TemplateError{"cannot call an undefined value"};
        throw TemplateError{fmt::format("'{}' is undefined (called as a function)", f.text)};
      default: throw TemplateError{fmt::format("'{}' object is not callable", type_name(f))};
    }
  }

  Value call_macro(const Macro& macro, const CallArgs& args) {
    const Stmt& def = *macro.definition;
    if (args.positional.size() > def.params.size()) {
      throw TemplateError{fmt::format("macro '{}' takes at most {} argument(s) ({} given)", def.text, def.params.size(),
                                      args.positional.size())};
    }
    std::vector<std::optional<Value>> bound(def.params.size());
    for (size_t i = 0; i < args.positional.size(); ++i) bound[i] = args.positional[i];
    for (const auto& [name, value] : args.keyword) {
      auto it = std::find_if(def.params.begin(), def.params.end(), [&](const Arg& p) { return p.name == name; });
      if (it == def.params.end()) throw TemplateError{fmt::format("macro '{}' has no parameter named '{}'", def.text, name)};
      size_t i = it - def.params.begin();
      if (bound[i]) throw TemplateError{fmt::format("macro '{}' got multiple values for '{}'", def.text, name)};
      bound[i] = value;
    }
    ScopePtr scope = child_scope(macro.closure);
    for (size_t i = 0; i < def.params.size(); ++i) {
      const Arg& param = def.params[i];
      if (bound[i]) {
        scope->set(param.name, *bound[i]);
      } else {
        scope->set(param.name, param.value ? eval(*param.value, scope) : Value::undefined(param.name));
      }
    }
    if (++call_depth_ > kMaxCallDepth) throw TemplateError{fmt::format("macro recursion deeper than {}", kMaxCallDepth)};
    std::string out;
    exec(def.body, scope, out);
    --call_depth_;
    return Value::from_string(std::move(out));
  }

  const Program& program_;
  int call_depth_ = 0;
  std::vector<ScopePtr> closures_;  // scopes captured by macros, cleared by the destructor
};

// Jinja normalises \r\n and \r to \n and, unless asked otherwise, drops one trailing newline.
std::string normalise_source(std::string_view source, bool keep_trailing_newline) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!keep_trailing_newline && !out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

Template::Template(std::string_view source, const Options& options) {
  auto program = std::make_shared<Program>();
  program->source = normalise_source(source, options.keep_trailing_newline);
  parse(*program, tokenize(program->source, options));
  program_ = std::move(program);
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  LATHE_CHECK(context.is_object(), "jinja: the render context must be a JSON object, not {}", context.type_name());
  auto globals = std::make_shared<Scope>();
  for (const std::string& name : global_function_names()) {
    Value f;
    f.kind = Value::Kind::Function;
    f.text = name;
    globals->set(name, std::move(f));
  }
  for (const auto& [key, value] : context.items()) globals->set(key, Value::from_json(value));
  std::string out;
  Renderer(*program_).exec(program_->body, globals, out);
  return out;
}

}  // namespace lathe::jinja
