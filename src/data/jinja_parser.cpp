// Parser for the Jinja interpreter: tokens -> statement and expression tree.
// Convention: operator precedence is Jinja's, not Python's: filters and tests bind tighter than
// every binary operator (messages|length - 1 is (messages|length) - 1), '~' sits between '+'/'-'
// and '*'/'/', and 'not' is looser than comparisons. Unknown filters, tests and tags are refused
// here, at parse time, with their line and column.
// Covered by tests/data/test_chat_template.cpp (JinjaExpression.*, JinjaStatements.*, JinjaErrors.*).
#include "core/error.h"
#include "data/jinja_internal.h"

#include <algorithm>

namespace lathe::jinja {
namespace {

ExprPtr make_expr(Expr::Kind kind, size_t pos) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->pos = pos;
  return e;
}

ExprPtr make_binary(Expr::Kind kind, std::string op, ExprPtr left, ExprPtr right) {
  ExprPtr e = make_expr(kind, left->pos);
  e->name = std::move(op);
  e->operands.push_back(std::move(left));
  e->operands.push_back(std::move(right));
  return e;
}

std::unique_ptr<Stmt> make_stmt(Stmt::Kind kind, size_t pos) {
  auto s = std::make_unique<Stmt>();
  s->kind = kind;
  s->pos = pos;
  return s;
}

// Tags that exist in Jinja but that chat templates do not need; refused with a clear message.
constexpr std::string_view kUnsupportedTags[] = {"include", "extends", "block", "import", "from", "call",
                                                 "filter", "with", "autoescape", "do", "trans", "pluralize"};
constexpr std::string_view kEndTags[] = {"elif", "else", "endif", "endfor", "endset", "endmacro",
                                         "endgeneration", "endraw", "endblock", "endcall", "endfilter", "endwith"};

class Parser {
 public:
  Parser(const std::string& source, const std::vector<Token>& tokens) : src_(source), tokens_(tokens) {}

  Body parse_template() {
    std::string found;
    return parse_body({}, found);
  }

 private:
  // ---- token helpers ----
  const Token& cur() const { return tokens_[i_]; }
  const Token& peek() const { return tokens_[std::min(i_ + 1, tokens_.size() - 1)]; }
  void advance() {
    if (i_ + 1 < tokens_.size()) ++i_;
  }
  bool is_op(std::string_view op) const { return cur().kind == Token::Kind::Op && cur().text == op; }
  bool is_name(std::string_view name) const { return cur().kind == Token::Kind::Name && cur().text == name; }

  [[noreturn]] void fail(size_t pos, const std::string& message) const {
    LATHE_FAIL("jinja: syntax error at {}: {}", source_location(src_, pos), message);
  }

  std::string describe(const Token& t) const {
    switch (t.kind) {
      case Token::Kind::Text: return "template data";
      case Token::Kind::VarBegin: return "'{{'";
      case Token::Kind::VarEnd: return "'}}'";
      case Token::Kind::BlockBegin: return "'{%'";
      case Token::Kind::BlockEnd: return "'%}'";
      case Token::Kind::Name: return fmt::format("'{}'", t.text);
      case Token::Kind::String: return fmt::format("string literal {}", to_repr(Value::from_string(t.text)));
      case Token::Kind::Int:
      case Token::Kind::Float: return fmt::format("number {}", t.text);
      case Token::Kind::Op: return fmt::format("'{}'", t.text);
      case Token::Kind::End: return "the end of the template";
    }
    return "?";
  }

  void expect_op(std::string_view op) {
    if (!is_op(op)) fail(cur().pos, fmt::format("expected '{}' but found {}", op, describe(cur())));
    advance();
  }

  std::string expect_name() {
    if (cur().kind != Token::Kind::Name) fail(cur().pos, fmt::format("expected a name but found {}", describe(cur())));
    std::string name = cur().text;
    advance();
    return name;
  }

  void expect_block_end() {
    if (cur().kind != Token::Kind::BlockEnd) fail(cur().pos, fmt::format("expected '%}}' but found {}", describe(cur())));
    advance();
  }

  // ---- statements ----

  // Parses statements until a block tag whose keyword is in `enders`; the keyword is consumed and
  // returned in `found`, the rest of that tag is left to the caller.
  Body parse_body(std::initializer_list<std::string_view> enders, std::string& found) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.kind == Token::Kind::End) {
        if (enders.size() == 0) return body;
        const auto& [tag, pos] = open_.back();
        fail(pos, fmt::format("'{{% {} %}}' is never closed (expected '{{% {} %}}')", tag, *(enders.end() - 1)));
      }
      if (t.kind == Token::Kind::Text) {
        auto s = make_stmt(Stmt::Kind::Text, t.pos);
        s->text = t.text;
        body.push_back(std::move(s));
        advance();
      } else if (t.kind == Token::Kind::VarBegin) {
        auto s = make_stmt(Stmt::Kind::Output, t.pos);
        advance();
        s->expr = parse_tuple(true, false);
        if (cur().kind != Token::Kind::VarEnd) fail(cur().pos, fmt::format("expected '}}}}' but found {}", describe(cur())));
        advance();
        body.push_back(std::move(s));
      } else if (t.kind == Token::Kind::BlockBegin) {
        advance();
        if (cur().kind != Token::Kind::Name) fail(cur().pos, fmt::format("expected a tag name but found {}", describe(cur())));
        if (std::find(enders.begin(), enders.end(), cur().text) != enders.end()) {
          found = cur().text;
          advance();
          return body;
        }
        body.push_back(parse_statement(t.pos));
      } else {
        fail(t.pos, fmt::format("unexpected {}", describe(t)));
      }
    }
  }

  // `pos` is where the tag's '{%' starts: statements and their errors are located there.
  std::unique_ptr<Stmt> parse_statement(size_t pos) {
    std::string keyword = cur().text;
    advance();
    if (keyword == "if") return parse_if(pos);
    if (keyword == "for") return parse_for(pos);
    if (keyword == "set") return parse_set(pos);
    if (keyword == "macro") return parse_macro(pos);
    if (keyword == "break" || keyword == "continue") {
      if (loop_depth_ == 0) fail(pos, fmt::format("'{{% {} %}}' outside a for loop", keyword));
      expect_block_end();
      return make_stmt(keyword == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue, pos);
    }
    if (keyword == "generation") {
      // transformers' {% generation %} marks assistant text for masks; rendering passes it through.
      auto s = make_stmt(Stmt::Kind::Generation, pos);
      expect_block_end();
      open_.emplace_back("generation", pos);
      std::string found;
      s->body = parse_body({"endgeneration"}, found);
      open_.pop_back();
      expect_block_end();
      return s;
    }
    if (std::find(std::begin(kEndTags), std::end(kEndTags), keyword) != std::end(kEndTags)) {
      if (open_.empty()) fail(pos, fmt::format("unexpected '{{% {} %}}': no block is open", keyword));
      fail(pos, fmt::format("unexpected '{{% {} %}}' inside '{{% {} %}}' opened at {}", keyword, open_.back().first,
                            source_location(src_, open_.back().second)));
    }
    if (std::find(std::begin(kUnsupportedTags), std::end(kUnsupportedTags), keyword) != std::end(kUnsupportedTags)) {
      fail(pos, fmt::format("'{{% {} %}}' is not supported by Lathe's chat-template interpreter", keyword));
    }
    fail(pos, fmt::format("unknown tag '{}'", keyword));
  }

  std::unique_ptr<Stmt> parse_if(size_t pos) {
    auto s = make_stmt(Stmt::Kind::If, pos);
    open_.emplace_back("if", pos);
    ExprPtr condition = parse_tuple(false, false);
    expect_block_end();
    while (true) {
      std::string found;
      Body body = parse_body({"elif", "else", "endif"}, found);
      s->branches.push_back(Branch{std::move(condition), std::move(body)});
      if (found == "elif") {
        condition = parse_tuple(false, false);
        expect_block_end();
        continue;
      }
      expect_block_end();
      if (found == "else") {
        s->branches.push_back(Branch{nullptr, parse_body({"endif"}, found)});
        expect_block_end();
      }
      break;
    }
    open_.pop_back();
    return s;
  }

  // Names separated by commas, optionally parenthesised: `a`, `k, v`, `(k, v)`.
  std::vector<std::string> parse_target_names() {
    bool parens = is_op("(");
    if (parens) advance();
    std::vector<std::string> names{expect_name()};
    while (is_op(",")) {
      advance();
      if (cur().kind != Token::Kind::Name) break;  // trailing comma
      names.push_back(expect_name());
    }
    if (parens) expect_op(")");
    return names;
  }

  std::unique_ptr<Stmt> parse_for(size_t pos) {
    auto s = make_stmt(Stmt::Kind::For, pos);
    open_.emplace_back("for", pos);
    s->targets = parse_target_names();
    if (!is_name("in")) fail(cur().pos, fmt::format("expected 'in' but found {}", describe(cur())));
    advance();
    s->expr = parse_tuple(false, false);
    if (is_name("if")) {
      advance();
      s->condition = parse_expression(true);
    }
    if (is_name("recursive")) fail(cur().pos, "recursive for loops are not supported");
    expect_block_end();
    ++loop_depth_;
    std::string found;
    s->body = parse_body({"else", "endfor"}, found);
    --loop_depth_;
    expect_block_end();
    if (found == "else") {
      s->else_body = parse_body({"endfor"}, found);
      expect_block_end();
    }
    open_.pop_back();
    return s;
  }

  std::unique_ptr<Stmt> parse_set(size_t pos) {
    auto s = make_stmt(Stmt::Kind::Set, pos);
    if (cur().kind == Token::Kind::Name && peek().kind == Token::Kind::Op && peek().text == ".") {
      s->attr_target = true;
      s->targets.push_back(expect_name());
      advance();  // '.'
      s->targets.push_back(expect_name());
      expect_op("=");
      s->expr = parse_tuple(true, false);
      expect_block_end();
      return s;
    }
    s->targets = parse_target_names();
    if (is_op("=")) {
      advance();
      s->expr = parse_tuple(true, false);
      expect_block_end();
      return s;
    }
    if (is_op("|")) fail(cur().pos, "filtered block assignment ('{% set x | filter %}') is not supported");
    if (s->targets.size() != 1) fail(pos, "a block assignment ('{% set x %}...{% endset %}') takes exactly one name");
    expect_block_end();
    s->kind = Stmt::Kind::SetBlock;
    open_.emplace_back("set", pos);
    std::string found;
    s->body = parse_body({"endset"}, found);
    expect_block_end();
    open_.pop_back();
    return s;
  }

  std::unique_ptr<Stmt> parse_macro(size_t pos) {
    auto s = make_stmt(Stmt::Kind::Macro, pos);
    s->text = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!s->params.empty()) {
        expect_op(",");
        if (is_op(")")) break;
      }
      size_t param_pos = cur().pos;
      Arg param{expect_name(), nullptr};
      if (is_op("=")) {
        advance();
        param.value = parse_expression(true);
      } else if (!s->params.empty() && s->params.back().value) {
        fail(param_pos, fmt::format("macro '{}': parameter '{}' without a default follows one with a default",
                                    s->text, param.name));
      }
      s->params.push_back(std::move(param));
    }
    advance();  // ')'
    expect_block_end();
    open_.emplace_back("macro", pos);
    int saved_depth = loop_depth_;
    loop_depth_ = 0;
    std::string found;
    s->body = parse_body({"endmacro"}, found);
    loop_depth_ = saved_depth;
    expect_block_end();
    open_.pop_back();
    return s;
  }

  // ---- expressions ----

  bool is_tuple_end() const {
    return cur().kind == Token::Kind::VarEnd || cur().kind == Token::Kind::BlockEnd || cur().kind == Token::Kind::End ||
           is_op(")");
  }

  // Comma-separated expressions; a single one without a comma is returned as itself.
  ExprPtr parse_tuple(bool with_condexpr, bool explicit_parens) {
    size_t pos = cur().pos;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end()) break;
      items.push_back(parse_expression(with_condexpr));
      if (!is_op(",")) break;
      is_tuple = true;
    }
    if (!is_tuple) {
      if (items.size() == 1) return std::move(items[0]);
      if (!explicit_parens) fail(cur().pos, fmt::format("expected an expression but found {}", describe(cur())));
    }
    ExprPtr e = make_expr(Expr::Kind::Tuple, pos);
    e->operands = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    if (!with_condexpr) return parse_or();
    ExprPtr value = parse_or();
    while (is_name("if")) {
      advance();
      ExprPtr e = make_expr(Expr::Kind::Cond, value->pos);
      ExprPtr condition = parse_or();
      ExprPtr otherwise;
      if (is_name("else")) {
        advance();
        otherwise = parse_expression(true);
      }
      e->operands.push_back(std::move(value));
      e->operands.push_back(std::move(condition));
      e->operands.push_back(std::move(otherwise));
      value = std::move(e);
    }
    return value;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      advance();
      left = make_binary(Expr::Kind::Or, "or", std::move(left), parse_and());
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      advance();
      left = make_binary(Expr::Kind::And, "and", std::move(left), parse_not());
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      ExprPtr e = make_expr(Expr::Kind::Not, cur().pos);
      advance();
      e->operands.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr first = parse_math1();
    ExprPtr e = make_expr(Expr::Kind::Compare, first->pos);
    e->operands.push_back(std::move(first));
    while (true) {
      static constexpr std::string_view kOps[] = {"==", "!=", "<", ">", "<=", ">="};
      if (cur().kind == Token::Kind::Op && std::find(std::begin(kOps), std::end(kOps), cur().text) != std::end(kOps)) {
        e->ops.push_back(cur().text);
        advance();
      } else if (is_name("in")) {
        e->ops.push_back("in");
        advance();
      } else if (is_name("not") && peek().kind == Token::Kind::Name && peek().text == "in") {
        e->ops.push_back("not in");
        advance();
        advance();
      } else {
        break;
      }
      e->operands.push_back(parse_math1());
    }
    if (e->ops.empty()) return std::move(e->operands[0]);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().text;
      advance();
      left = make_binary(Expr::Kind::Binary, op, std::move(left), parse_concat());
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      advance();
      left = make_binary(Expr::Kind::Binary, "~", std::move(left), parse_math2());
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().text;
      advance();
      left = make_binary(Expr::Kind::Binary, op, std::move(left), parse_pow());
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      advance();
      left = make_binary(Expr::Kind::Binary, "**", std::move(left), parse_unary(true));
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      node = make_expr(Expr::Kind::Unary, cur().pos);
      node->name = cur().text;
      advance();
      node->operands.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    ExprPtr e = make_expr(Expr::Kind::Literal, t.pos);
    switch (t.kind) {
      case Token::Kind::Name:
        if (t.text == "true" || t.text == "True") {
          e->literal = Value::from_bool(true);
        } else if (t.text == "false" || t.text == "False") {
          e->literal = Value::from_bool(false);
        } else if (t.text == "none" || t.text == "None") {
          e->literal = Value::none();
        } else {
          e->kind = Expr::Kind::Name;
          e->name = t.text;
        }
        advance();
        return e;
      case Token::Kind::String: {
        std::string s;
        while (cur().kind == Token::Kind::String) {  // adjacent literals concatenate, as in Python
          s += cur().text;
          advance();
        }
        e->literal = Value::from_string(std::move(s));
        return e;
      }
      case Token::Kind::Int:
        e->literal = Value::from_int(t.integer);
        advance();
        return e;
      case Token::Kind::Float:
        e->literal = Value::from_float(t.number);
        advance();
        return e;
      case Token::Kind::Op:
        if (t.text == "(") {
          advance();
          ExprPtr inner = parse_tuple(true, true);
          expect_op(")");
          return inner;
        }
        if (t.text == "[") return parse_list();
        if (t.text == "{") return parse_dict();
        break;
      default:
        break;
    }
    fail(t.pos, fmt::format("expected an expression but found {}", describe(t)));
  }

  ExprPtr parse_list() {
    ExprPtr e = make_expr(Expr::Kind::List, cur().pos);
    advance();
    while (!is_op("]")) {
      if (!e->operands.empty()) {
        expect_op(",");
        if (is_op("]")) break;
      }
      e->operands.push_back(parse_expression(true));
    }
    advance();
    return e;
  }

  ExprPtr parse_dict() {
    ExprPtr e = make_expr(Expr::Kind::Dict, cur().pos);
    advance();
    while (!is_op("}")) {
      if (!e->operands.empty()) {
        expect_op(",");
        if (is_op("}")) break;
      }
      e->operands.push_back(parse_expression(true));
      expect_op(":");
      e->operands.push_back(parse_expression(true));
    }
    advance();
    return e;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".")) {
        advance();
        if (cur().kind == Token::Kind::Name) {
          ExprPtr e = make_expr(Expr::Kind::Attr, node->pos);
          e->name = cur().text;
          e->operands.push_back(std::move(node));
          node = std::move(e);
        } else if (cur().kind == Token::Kind::Int) {  // x.0 is x[0]
          ExprPtr e = make_expr(Expr::Kind::Item, node->pos);
          ExprPtr index = make_expr(Expr::Kind::Literal, cur().pos);
          index->literal = Value::from_int(cur().integer);
          e->operands.push_back(std::move(node));
          e->operands.push_back(std::move(index));
          node = std::move(e);
        } else {
          fail(cur().pos, fmt::format("expected an attribute name after '.' but found {}", describe(cur())));
        }
        advance();
      } else if (is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        ExprPtr e = make_expr(Expr::Kind::Call, node->pos);
        e->operands.push_back(std::move(node));
        e->args = parse_call_args();
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    size_t pos = cur().pos;
    advance();  // '['
    ExprPtr start, stop, step;
    bool is_slice = false;
    if (!is_op(":")) start = parse_expression(true);
    if (is_op(":")) {
      is_slice = true;
      advance();
      if (!is_op("]") && !is_op(":")) stop = parse_expression(true);
      if (is_op(":")) {
        advance();
        if (!is_op("]")) step = parse_expression(true);
      }
    }
    if (is_op(",")) fail(cur().pos, "subscripts with several indices are not supported");
    expect_op("]");
    ExprPtr e = make_expr(is_slice ? Expr::Kind::Slice : Expr::Kind::Item, node->pos);
    if (!is_slice && !start) fail(pos, "empty subscript");
    e->operands.push_back(std::move(node));
    e->operands.push_back(std::move(start));
    if (is_slice) {
      e->operands.push_back(std::move(stop));
      e->operands.push_back(std::move(step));
    }
    return e;
  }

  std::vector<Arg> parse_call_args() {
    expect_op("(");
    std::vector<Arg> args;
    bool seen_keyword = false;
    while (!is_op(")")) {
      if (!args.empty()) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) fail(cur().pos, "'*args' and '**kwargs' in calls are not supported");
      if (cur().kind == Token::Kind::Name && peek().kind == Token::Kind::Op && peek().text == "=") {
        std::string name = expect_name();
        advance();  // '='
        args.push_back(Arg{std::move(name), parse_expression(true)});
        seen_keyword = true;
      } else {
        if (seen_keyword) fail(cur().pos, "positional argument follows keyword argument");
        args.push_back(Arg{{}, parse_expression(true)});
      }
    }
    advance();  // ')'
    return args;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        advance();
        size_t pos = cur().pos;
        std::string name = expect_name();
        if (!has_filter(name)) fail(pos, fmt::format("unknown filter '{}'", name));
        ExprPtr e = make_expr(Expr::Kind::Filter, node->pos);
        e->name = std::move(name);
        e->operands.push_back(std::move(node));
        if (is_op("(")) e->args = parse_call_args();
        node = std::move(e);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        ExprPtr e = make_expr(Expr::Kind::Call, node->pos);
        e->operands.push_back(std::move(node));
        e->args = parse_call_args();
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_test(ExprPtr node) {
    advance();  // 'is'
    ExprPtr e = make_expr(Expr::Kind::Test, node->pos);
    if (is_name("not")) {
      e->negated = true;
      advance();
    }
    size_t pos = cur().pos;
    e->name = expect_name();
    if (!has_test(e->name)) fail(pos, fmt::format("unknown test '{}'", e->name));
    e->operands.push_back(std::move(node));
    if (is_op("(")) {
      e->args = parse_call_args();
    } else {
      // A single argument without parentheses: `x is divisibleby 3`, `x is sameas false`.
      const Token& t = cur();
      bool starts_operand = t.kind == Token::Kind::String || t.kind == Token::Kind::Int ||
                            t.kind == Token::Kind::Float || is_op("[") || is_op("{") ||
                            (t.kind == Token::Kind::Name && t.text != "else" && t.text != "or" && t.text != "and" &&
                             t.text != "if" && t.text != "is" && t.text != "not" && t.text != "in");
      if (starts_operand) e->args.push_back(Arg{{}, parse_postfix(parse_primary())});
    }
    return e;
  }

  const std::string& src_;
  const std::vector<Token>& tokens_;
  size_t i_ = 0;
  int loop_depth_ = 0;
  std::vector<std::pair<std::string, size_t>> open_;  // open block tags, for error messages
};

}  // namespace

void parse(Program& program, const std::vector<Token>& tokens) {
  program.body = Parser(program.source, tokens).parse_template();
}

}  // namespace lathe::jinja
