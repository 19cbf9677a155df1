// Internals of the Jinja interpreter shared by its source files: values, tokens, the syntax tree and
// the operations on values. Not part of the public API (see jinja.h).
// Convention: values follow Python semantics (what Jinja runs on), not JSON or C++ semantics:
// strings are indexed and measured in code points, printing uses Python's str()/repr(), and
// errors that know no template position are thrown as TemplateError and located by the evaluator.
// Covered by tests/data/test_chat_template.cpp.
#pragma once

#include "data/jinja.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lathe::jinja {

struct Value;
struct List;
struct Dict;
struct Macro;
struct LoopState;

// A Python/Jinja value. Lists and dicts are shared and immutable once built; a namespace (the only
// mutable value) is shared by reference, which is what makes `set ns.x = ...` visible everywhere.
struct Value {
  enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Macro, Function, Loop };

  Kind kind = Kind::Undefined;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  std::string text;  // String; the name of a Function; for Undefined, what was looked up
  std::shared_ptr<const List> list;
  std::shared_ptr<Dict> dict;  // Dict (never mutated after construction) and Namespace
  std::shared_ptr<const Macro> macro;
  std::shared_ptr<const LoopState> loop;

  static Value undefined(std::string hint = {});
  static Value none();
  static Value from_bool(bool b);
  static Value from_int(int64_t i);
  static Value from_float(double f);
  static Value from_string(std::string s);
  static Value from_list(std::vector<Value> items, bool is_tuple = false);
  static Value from_dict(Dict d);
  static Value from_json(const nlohmann::ordered_json& j);

  bool is(Kind k) const { return kind == k; }
  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
  bool is_integral() const { return kind == Kind::Int || kind == Kind::Bool; }
  bool is_mapping() const { return kind == Kind::Dict; }
  int64_t as_int() const { return kind == Kind::Bool ? int64_t(boolean) : integer; }
  double as_float() const { return kind == Kind::Float ? number : double(as_int()); }
};

struct List {
  std::vector<Value> items;
  bool is_tuple = false;  // prints as (1, 2); as in Python, a tuple never equals a list
};

// String-keyed, insertion-ordered mapping (Python dicts keep insertion order). Lookup is linear:
// chat-template dicts have a handful of keys.
struct Dict {
  std::vector<std::pair<std::string, Value>> entries;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value value);
};

// Thrown by value operations and built-ins, which do not know where in the template they run; the
// evaluator rethrows it as lathe::Error with the line and column of the expression.
struct TemplateError {
  std::string message;
  bool raised = false;  // raise_exception() called by the template itself
};

// ---- Tokens -----------------------------------------------------------------------------------

struct Token {
  enum class Kind : uint8_t { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };
  Kind kind;
  size_t pos;        // byte offset in the (newline-normalised) source
  std::string text;  // Text: data after whitespace control; Name; String (unescaped); Op
  int64_t integer = 0;
  double number = 0;
};

// Splits `source` into data and tag tokens, applying whitespace control (-, +, trim_blocks,
// lstrip_blocks) to the data. `source` is already newline-normalised.
std::vector<Token> tokenize(const std::string& source, const Options& options);

// ---- Syntax tree ------------------------------------------------------------------------------

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Arg {
  std::string name;  // empty for a positional argument
  ExprPtr value;     // may be null for a macro parameter without a default
};

struct Expr {
  enum class Kind : uint8_t {
    Literal, Name, List, Tuple, Dict, Attr, Item, Slice, Call, Filter, Test,
    Unary, Binary, Compare, And, Or, Not, Cond
  };
  Kind kind;
  size_t pos = 0;
  Value literal;                  // Literal
  std::string name;               // Name; Attr attribute; Filter/Test name; Unary/Binary operator
  bool negated = false;           // Test written 'is not'
  std::vector<ExprPtr> operands;  // subject first; Dict: key, value, key, value...;
                                  // Slice: object, start, stop, step (null when omitted);
                                  // Cond: value-if-true, condition, value-if-false (may be null)
  std::vector<Arg> args;          // Call/Filter/Test arguments
  std::vector<std::string> ops;   // Compare: the operators between consecutive operands
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Branch {
  ExprPtr condition;  // null for 'else'
  Body body;
};

struct Stmt {
  enum class Kind : uint8_t { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, Generation };
  Kind kind;
  size_t pos = 0;
  std::string text;                  // Text: the data; Macro: its name
  ExprPtr expr;                      // Output: the value; For: the iterable; Set: the value
  ExprPtr condition;                 // For: the 'if' filter (may be null)
  std::vector<std::string> targets;  // For/Set/SetBlock: names; Set with attr_target: namespace, attribute
  bool attr_target = false;          // Set: `set ns.attr = ...`
  std::vector<Branch> branches;      // If
  Body body;                         // For, SetBlock, Macro, Generation
  Body else_body;                    // For
  std::vector<Arg> params;           // Macro
};

struct Program {
  std::string source;  // newline-normalised, for error locations
  Body body;
};

// "line L, column C" (1-based; the column counts code points) of byte offset `pos` in `source`.
std::string source_location(std::string_view source, size_t pos);

// Parses the tokens of `program.source` into `program.body`.
void parse(Program& program, const std::vector<Token>& tokens);

// ---- Operations on values (jinja_value.cpp) ---------------------------------------------------

bool truthy(const Value& v);
std::string type_name(const Value& v);         // Python's name for the type: 'str', 'dict', ...
std::string to_str(const Value& v);            // Python str(); Undefined prints as ""
std::string to_repr(const Value& v);           // Python repr()
std::string python_float_repr(double f);
struct JsonStyle {
  std::optional<std::string> indent;  // per-level indent; none = one line
  bool ensure_ascii = false;
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonStyle& style);  // Python json.dumps
bool equals(const Value& a, const Value& b);
int compare(const Value& a, const Value& b);  // <0, 0, >0; throws TemplateError when unordered
bool contains(const Value& container, const Value& item);  // Python `item in container`
Value binary_op(std::string_view op, const Value& a, const Value& b);
Value get_attr(const Value& obj, const std::string& name);  // Jinja's obj.name
Value get_item(const Value& obj, const Value& key);         // Jinja's obj[key]
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
std::vector<Value> iterate(const Value& v);  // what `for x in v` visits
[[noreturn]] void undefined_error(const Value& v);

// UTF-8 helpers: Python measures and indexes strings in code points.
// Decodes the code point at s[i] and sets `len` to its byte length; an invalid byte decodes as
// itself with length 1, so scans always advance.
char32_t utf8_decode_at(std::string_view s, size_t i, size_t& len);
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
void utf8_append(std::string& out, char32_t c);
bool is_py_space(char32_t c);  // Python str.isspace()

// ---- Built-ins (jinja_builtins.cpp) -----------------------------------------------------------

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// Binds positional and keyword arguments to a built-in's parameter names, as Python does.
// Throws TemplateError on too many, unknown or repeated arguments.
class Params {
 public:
  Params(std::string_view what, const CallArgs& args, std::initializer_list<std::string_view> names)
      : names_(names), values_(names.size()) {
    if (args.positional.size() > names.size()) {
      throw TemplateError{fmt::format("{}() takes at most {} argument(s) ({} given)", what, names.size(), args.positional.size())};
    }
    for (size_t i = 0; i < args.positional.size(); ++i) values_[i] = args.positional[i];
    for (const auto& [name, value] : args.keyword) {
      auto it = std::find(names_.begin(), names_.end(), name);
      if (it == names_.end()) throw TemplateError{fmt::format("{}() got an unexpected keyword argument '{}'", what, name)};
      size_t i = it - names_.begin();
      if (values_[i]) throw TemplateError{fmt::format("{}() got multiple values for argument '{}'", what, name)};
      values_[i] = value;
    }
  }
  bool has(size_t i) const { return values_[i] && !values_[i]->is(Value::Kind::None); }
  Value get(size_t i, Value fallback = Value::none()) const { return values_[i] ? *values_[i] : fallback; }

 private:
  std::vector<std::string_view> names_;
  std::vector<std::optional<Value>> values_;
};

inline void no_args(std::string_view what, const CallArgs& args) { Params(what, args, {}); }

inline std::string expect_string(const Value& v, std::string_view what) {
  if (!v.is_string()) throw TemplateError{fmt::format("{} expects a string, not {}", what, type_name(v))};
  return v.text;
}

inline int64_t expect_int(const Value& v, std::string_view what) {
  if (!v.is_integral()) throw TemplateError{fmt::format("{} expects an integer, not {}", what, type_name(v))};
  return v.as_int();
}

bool has_filter(std::string_view name);
bool has_test(std::string_view name);
Value apply_filter(std::string_view name, const Value& value, const CallArgs& args);
bool apply_test(std::string_view name, const Value& value, const CallArgs& args);
// A method call such as s.startswith(x) or d.items(); nullopt when `obj` has no such method.
std::optional<Value> call_method(const Value& obj, const std::string& name, const CallArgs& args);
// The global functions: range, namespace, dict, raise_exception, strftime_now.
const std::vector<std::string>& global_function_names();
Value call_global(std::string_view name, const CallArgs& args);

// ---- Python str operations (jinja_strings.cpp) ------------------------------------------------

std::string py_lower(const std::string& s);
std::string py_upper(const std::string& s);
std::string py_title(const std::string& s);       // str.title()
std::string jinja_title(const std::string& s);    // the |title filter, which splits words differently
std::string py_capitalize(const std::string& s);
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right);  // chars: none or str
std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right);
std::vector<std::string> py_splitlines(const std::string& s, bool keepends);
std::string py_replace(const std::string& s, const std::string& old, const std::string& with, int64_t count);

// Per-loop state behind the `loop` variable.
struct LoopState {
  std::shared_ptr<const List> items;
  int64_t index0 = 0;
};

struct Scope;
struct Macro {
  const Stmt* definition;         // owned by the Program, which outlives every render
  std::shared_ptr<Scope> closure; // the scope the macro was defined in
};

}  // namespace lathe::jinja
