// Values of the Jinja interpreter and the Python semantics of their operations: truthiness,
// str()/repr(), json.dumps, equality and ordering, arithmetic, attribute and item lookup, slicing.
// Convention: behaviour follows Python 3 as Jinja runs on it (1 == 1.0 == True, 7 // -2 == -4,
// str(1.0) == '1.0', strings indexed by code point), with Jinja's default Undefined: it prints as
// '', is falsy and iterates as empty, and any other use (arithmetic, attribute access, calls)
// raises an error naming what was undefined.
// Covered by tests/data/test_chat_template.cpp (JinjaBasics.*, JinjaExpression.*, JinjaFilters.ToJson*).
#include "core/error.h"
#include "data/jinja_internal.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace lathe::jinja {

// ---- construction -----------------------------------------------------------------------------

Value Value::undefined(std::string hint) {
  Value v;
  v.text = std::move(hint);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::None;
  return v;
}
Value Value::from_bool(bool b) {
  Value v;
  v.kind = Kind::Bool;
  v.boolean = b;
  return v;
}
Value Value::from_int(int64_t i) {
  Value v;
  v.kind = Kind::Int;
  v.integer = i;
  return v;
}
Value Value::from_float(double f) {
  Value v;
  v.kind = Kind::Float;
  v.number = f;
  return v;
}
Value Value::from_string(std::string s) {
  Value v;
  v.kind = Kind::String;
  v.text = std::move(s);
  return v;
}
Value Value::from_list(std::vector<Value> items, bool is_tuple) {
  Value v;
  v.kind = Kind::List;
  v.list = std::make_shared<const List>(List{std::move(items), is_tuple});
  return v;
}
Value Value::from_dict(Dict d) {
  Value v;
  v.kind = Kind::Dict;
  v.dict = std::make_shared<Dict>(std::move(d));
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return from_bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return from_int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > uint64_t(INT64_MAX)) return from_float(double(u));
      return from_int(int64_t(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return from_float(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return from_string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item));
      return from_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      d.entries.reserve(j.size());
      for (const auto& [key, item] : j.items()) d.entries.emplace_back(key, from_json(item));
      return from_dict(std::move(d));
    }
    default: LATHE_FAIL("jinja: unsupported JSON value of type {} in the context", j.type_name());
  }
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::set(const std::string& key, Value value) {
  for (auto& [k, v] : entries) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(key, std::move(value));
}

// ---- UTF-8 ------------------------------------------------------------------------------------

char32_t utf8_decode_at(std::string_view s, size_t i, size_t& len) {
  unsigned char c = s[i];
  int extra = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
  len = 1;
  if (extra <= 0 || i + extra >= s.size()) return c;
  char32_t cp = c & (0x3F >> extra);
  for (int k = 1; k <= extra; ++k) {
    unsigned char b = s[i + k];
    if ((b & 0xC0) != 0x80) return c;
    cp = (cp << 6) | (b & 0x3F);
  }
  len = extra + 1;
  return cp;
}

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t len;
    out.push_back(utf8_decode_at(s, i, len));
    i += len;
  }
  return out;
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) utf8_append(out, c);
  return out;
}

bool is_py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// ---- printing ---------------------------------------------------------------------------------

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return false;
    case Value::Kind::Bool: return v.boolean;
    case Value::Kind::Int: return v.integer != 0;
    case Value::Kind::Float: return v.number != 0;
    case Value::Kind::String: return !v.text.empty();
    case Value::Kind::List: return !v.list->items.empty();
    case Value::Kind::Dict: return !v.dict->entries.empty();
    default: return true;
  }
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "Undefined";
    case Value::Kind::None: return "NoneType";
    case Value::Kind::Bool: return "bool";
    case Value::Kind::Int: return "int";
    case Value::Kind::Float: return "float";
    case Value::Kind::String: return "str";
    case Value::Kind::List: return v.list->is_tuple ? "tuple" : "list";
    case Value::Kind::Dict: return "dict";
    case Value::Kind::Namespace: return "Namespace";
    case Value::Kind::Macro: return "Macro";
    case Value::Kind::Function: return "function";
    case Value::Kind::Loop: return "LoopContext";
  }
  return "?";
}

// Python's repr of a float: the shortest round-tripping digits, positional when the decimal
// exponent is in [-4, 16), else scientific with at least two exponent digits.
std::string python_float_repr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  auto result = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  std::string sci(buf, result.ptr);  // e.g. "-1.2345e+02"
  bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  size_t e = sci.find('e');
  int exponent = std::stoi(sci.substr(e + 1));
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  std::string out = negative ? "-" : "";
  int point = exponent + 1;  // digits before the decimal point
  if (point > -4 && point <= 16) {
    if (point <= 0) {
      out += "0." + std::string(-point, '0') + digits;
    } else if (size_t(point) >= digits.size()) {
      out += digits + std::string(point - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, point) + "." + digits.substr(point);
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  }
  return out;
}

namespace {

// Characters Python's repr() escapes although they are not ASCII (str.isprintable() is false):
// C1 controls, non-space separators, format characters, surrogates and private use.
bool py_printable(char32_t c) {
  if (c < 0x20 || c == 0x7F) return false;
  if (c < 0x7F) return true;
  if (c <= 0xA0 || c == 0xAD) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x206F)) return false;
  if (c == 0x3000 || c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFB)) return false;
  if ((c >= 0xD800 && c <= 0xF8FF) || c >= 0xF0000) return false;
  return true;
}

std::string repr_string(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : utf8_decode(s)) {
    if (c == char32_t(quote) || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (py_printable(c)) {
      utf8_append(out, c);
    } else if (c <= 0xFF) {
      out += fmt::format("\\x{:02x}", uint32_t(c));
    } else if (c <= 0xFFFF) {
      out += fmt::format("\\u{:04x}", uint32_t(c));
    } else {
      out += fmt::format("\\U{:08x}", uint32_t(c));
    }
  }
  out += quote;
  return out;
}

}  // namespace

std::string to_repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "Undefined";
    case Value::Kind::None: return "None";
    case Value::Kind::Bool: return v.boolean ? "True" : "False";
    case Value::Kind::Int: return std::to_string(v.integer);
    case Value::Kind::Float: return python_float_repr(v.number);
    case Value::Kind::String: return repr_string(v.text);
    case Value::Kind::List: {
      const auto& items = v.list->items;
      std::string out = v.list->is_tuple ? "(" : "[";
      for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + to_repr(items[i]);
      if (v.list->is_tuple && items.size() == 1) out += ",";
      return out + (v.list->is_tuple ? ")" : "]");
    }
    case Value::Kind::Dict:
    case Value::Kind::Namespace: {
      std::string out = v.kind == Value::Kind::Namespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [key, item] : v.dict->entries) {
        out += (first ? "" : ", ") + repr_string(key) + ": " + to_repr(item);
        first = false;
      }
      return out + (v.kind == Value::Kind::Namespace ? "}>" : "}");
    }
    case Value::Kind::Macro: return fmt::format("<Macro '{}'>", v.macro->definition->text);
    case Value::Kind::Function: return fmt::format("<function {}>", v.text);
    case Value::Kind::Loop: return fmt::format("<LoopContext {}/{}>", v.loop->index0 + 1, v.loop->items->items.size());
  }
  return "?";
}

std::string to_str(const Value& v) {
  if (v.kind == Value::Kind::String) return v.text;
  if (v.kind == Value::Kind::Undefined) return "";
  return to_repr(v);
}

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", uint32_t(c));
        } else if (ensure_ascii && c > 0x7E) {
          if (c >= 0x10000) {
            char32_t u = c - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", uint32_t(0xD800 | (u >> 10)), uint32_t(0xDC00 | (u & 0x3FF)));
          } else {
            out += fmt::format("\\u{:04x}", uint32_t(c));
          }
        } else {
          utf8_append(out, c);
        }
    }
  }
  out += '"';
}

void json_value(std::string& out, const Value& v, const JsonStyle& style, int depth) {
  std::string newline;
  std::string inner_newline;
  if (style.indent) {
    newline = "\n";
    for (int i = 0; i < depth; ++i) newline += *style.indent;
    inner_newline = newline + *style.indent;
  }
  switch (v.kind) {
    case Value::Kind::None: out += "null"; return;
    case Value::Kind::Bool: out += v.boolean ? "true" : "false"; return;
    case Value::Kind::Int: out += std::to_string(v.integer); return;
    case Value::Kind::Float:
      if (std::isnan(v.number)) {
        out += "NaN";
      } else if (std::isinf(v.number)) {
        out += v.number > 0 ? "Infinity" : "-Infinity";
      } else {
        out += python_float_repr(v.number);
      }
      return;
    case Value::Kind::String: json_string(out, v.text, style.ensure_ascii); return;
    case Value::Kind::List: {
      const auto& items = v.list->items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += "[" + inner_newline;
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += style.item_separator + inner_newline;
        json_value(out, items[i], style, depth + 1);
      }
      out += newline + "]";
      return;
    }
    case Value::Kind::Dict: {
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& entry : v.dict->entries) entries.push_back(&entry);
      if (entries.empty()) {
        out += "{}";
        return;
      }
      if (style.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
      }
      out += "{" + inner_newline;
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += style.item_separator + inner_newline;
        json_string(out, entries[i]->first, style.ensure_ascii);
        out += style.key_separator;
        json_value(out, entries[i]->second, style, depth + 1);
      }
      out += newline + "}";
      return;
    }
    default:
      if (v.is_undefined()) undefined_error(v);
      throw TemplateError{fmt::format("tojson: object of type {} is not JSON serializable", type_name(v))};
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonStyle& style) {
  std::string out;
  json_value(out, v, style, 0);
  return out;
}

// ---- comparison -------------------------------------------------------------------------------

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_float() == b.as_float();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return true;
    case Value::Kind::String:
    case Value::Kind::Function: return a.text == b.text;
    case Value::Kind::List: {
      const auto& x = a.list->items;
      const auto& y = b.list->items;
      if (a.list->is_tuple != b.list->is_tuple || x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!equals(x[i], y[i])) return false;
      }
      return true;
    }
    case Value::Kind::Dict: {
      if (a.dict->entries.size() != b.dict->entries.size()) return false;
      for (const auto& [key, item] : a.dict->entries) {
        const Value* other = b.dict->find(key);
        if (!other || !equals(item, *other)) return false;
      }
      return true;
    }
    case Value::Kind::Namespace: return a.dict == b.dict;
    case Value::Kind::Macro: return a.macro == b.macro;
    case Value::Kind::Loop: return a.loop == b.loop;
    default: return false;
  }
}

int compare(const Value& a, const Value& b) {
  if (a.is_undefined()) undefined_error(a);
  if (b.is_undefined()) undefined_error(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
    double x = a.as_float(), y = b.as_float();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.text.compare(b.text) < 0 ? -1 : a.text == b.text ? 0 : 1;  // code-point order
  if (a.is(Value::Kind::List) && b.is(Value::Kind::List) && a.list->is_tuple == b.list->is_tuple) {
    const auto& x = a.list->items;
    const auto& y = b.list->items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  throw TemplateError{fmt::format("ordering is not supported between instances of '{}' and '{}'", type_name(a), type_name(b))};
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Value::Kind::Undefined: return false;  // Undefined iterates as empty
    case Value::Kind::String:
      if (!item.is_string()) {
        throw TemplateError{fmt::format("'in <string>' requires a string as left operand, not {}", type_name(item))};
      }
      return container.text.find(item.text) != std::string::npos;
    case Value::Kind::List:
      return std::any_of(container.list->items.begin(), container.list->items.end(),
                         [&](const Value& x) { return equals(x, item); });
    case Value::Kind::Dict: return item.is_string() && container.dict->find(item.text) != nullptr;
    default: throw TemplateError{fmt::format("argument of type '{}' is not iterable", type_name(container))};
  }
}

// ---- arithmetic -------------------------------------------------------------------------------

namespace {

[[noreturn]] void unsupported(std::string_view op, const Value& a, const Value& b) {
  throw TemplateError{fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a), type_name(b))};
}

Value repeat(const Value& seq, int64_t times) {
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += seq.text;
    return Value::from_string(std::move(out));
  }
  std::vector<Value> out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), seq.list->items.begin(), seq.list->items.end());
  return Value::from_list(std::move(out), seq.list->is_tuple);
}

int64_t checked_int(std::string_view op, int64_t x, int64_t y) {
  int64_t r = 0;
  bool overflow = op == "+" ? __builtin_add_overflow(x, y, &r)
                  : op == "-" ? __builtin_sub_overflow(x, y, &r)
                              : __builtin_mul_overflow(x, y, &r);
  if (overflow) throw TemplateError{"integer overflow (Lathe's integers are 64-bit)"};
  return r;
}

}  // namespace

Value binary_op(std::string_view op, const Value& a, const Value& b) {
  if (op == "~") return Value::from_string(to_str(a) + to_str(b));
  if (a.is_undefined()) undefined_error(a);
  if (b.is_undefined()) undefined_error(b);
  bool ints = a.is_integral() && b.is_integral();
  bool nums = a.is_number() && b.is_number();
  int64_t x = a.as_int(), y = b.as_int();
  if (op == "+") {
    if (ints) return Value::from_int(checked_int(op, x, y));
    if (nums) return Value::from_float(a.as_float() + b.as_float());
    if (a.is_string() && b.is_string()) return Value::from_string(a.text + b.text);
    if (a.is(Value::Kind::List) && b.is(Value::Kind::List) && a.list->is_tuple == b.list->is_tuple) {
      std::vector<Value> items = a.list->items;
      items.insert(items.end(), b.list->items.begin(), b.list->items.end());
      return Value::from_list(std::move(items), a.list->is_tuple);
    }
    unsupported(op, a, b);
  }
  if (op == "-") {
    if (ints) return Value::from_int(checked_int(op, x, y));
    if (nums) return Value::from_float(a.as_float() - b.as_float());
    unsupported(op, a, b);
  }
  if (op == "*") {
    if (ints) return Value::from_int(checked_int(op, x, y));
    if (nums) return Value::from_float(a.as_float() * b.as_float());
    if ((a.is_string() || a.is(Value::Kind::List)) && b.is_integral()) return repeat(a, b.as_int());
    if ((b.is_string() || b.is(Value::Kind::List)) && a.is_integral()) return repeat(b, a.as_int());
    unsupported(op, a, b);
  }
  if (op == "%" && a.is_string()) {
    throw TemplateError{"printf-style string formatting ('...' % x) is not supported; use '~' to build strings"};
  }
  if (!nums) unsupported(op, a, b);
  if (op == "/") {
    if (b.as_float() == 0) throw TemplateError{"division by zero"};
    return Value::from_float(a.as_float() / b.as_float());
  }
  if (op == "//" || op == "%") {
    if (b.as_float() == 0) throw TemplateError{op == "//" ? "integer division by zero" : "modulo by zero"};
    if (ints) {
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {  // Python rounds the quotient toward negative infinity
        --q;
        m += y;
      }
      return Value::from_int(op == "//" ? q : m);
    }
    double p = a.as_float(), q = b.as_float();
    double fq = std::floor(p / q);
    if (op == "//") return Value::from_float(fq);
    double m = std::fmod(p, q);
    if (m != 0 && ((m < 0) != (q < 0))) m += q;
    return Value::from_float(m);
  }
  if (op == "**") {
    if (ints && y >= 0) {
      int64_t result = 1;
      for (int64_t i = 0; i < y; ++i) result = checked_int("*", result, x);
      return Value::from_int(result);
    }
    return Value::from_float(std::pow(a.as_float(), b.as_float()));
  }
  throw TemplateError{fmt::format("unknown operator '{}'", op)};
}

// ---- lookup -----------------------------------------------------------------------------------

void undefined_error(const Value& v) {
  if (v.text.empty()) throw TemplateError{"a value is undefined"};
  throw TemplateError{fmt::format("'{}' is undefined", v.text)};
}

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Value::Kind::Undefined:
      throw TemplateError{obj.text.empty() ? fmt::format("cannot read attribute '{}' of an undefined value", name)
                                           : fmt::format("cannot read attribute '{}': '{}' is undefined", name, obj.text)};
    case Value::Kind::Dict:
    case Value::Kind::Namespace: {
      const Value* found = obj.dict->find(name);
      return found ? *found : Value::undefined(name);
    }
    case Value::Kind::Loop: {
      const LoopState& loop = *obj.loop;
      const auto& items = loop.items->items;
      int64_t length = int64_t(items.size());
      if (name == "index0") return Value::from_int(loop.index0);
      if (name == "index") return Value::from_int(loop.index0 + 1);
      if (name == "revindex0") return Value::from_int(length - loop.index0 - 1);
      if (name == "revindex") return Value::from_int(length - loop.index0);
      if (name == "first") return Value::from_bool(loop.index0 == 0);
      if (name == "last") return Value::from_bool(loop.index0 == length - 1);
      if (name == "length") return Value::from_int(length);
      if (name == "depth") return Value::from_int(1);  // only recursive loops (unsupported) go deeper
      if (name == "depth0") return Value::from_int(0);
      if (name == "previtem") return loop.index0 > 0 ? items[loop.index0 - 1] : Value::undefined("loop.previtem");
      if (name == "nextitem") return loop.index0 + 1 < length ? items[loop.index0 + 1] : Value::undefined("loop.nextitem");
      return Value::undefined("loop." + name);
    }
    default: return Value::undefined(name);
  }
}

namespace {

// Python's index normalisation: negative counts from the end; nullopt when out of range.
std::optional<size_t> normalise_index(int64_t index, size_t size) {
  if (index < 0) index += int64_t(size);
  if (index < 0 || index >= int64_t(size)) return std::nullopt;
  return size_t(index);
}

}  // namespace

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) {
    throw TemplateError{obj.text.empty() ? fmt::format("cannot index an undefined value with {}", to_repr(key))
                                         : fmt::format("cannot index with {}: '{}' is undefined", to_repr(key), obj.text)};
  }
  if (key.is_string()) {
    return get_attr(obj, key.text);  // dict keys, namespace and loop attributes; else undefined
  }
  if (key.is_integral()) {
    if (obj.is(Value::Kind::List)) {
      auto i = normalise_index(key.as_int(), obj.list->items.size());
      return i ? obj.list->items[*i] : Value::undefined(fmt::format("[{}]", key.as_int()));
    }
    if (obj.is_string()) {
      std::u32string chars = utf8_decode(obj.text);
      auto i = normalise_index(key.as_int(), chars.size());
      return i ? Value::from_string(utf8_encode(chars.substr(*i, 1))) : Value::undefined(fmt::format("[{}]", key.as_int()));
    }
  }
  return Value::undefined(to_repr(key));
}

Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  auto bound = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is(Value::Kind::None)) return std::nullopt;
    if (!v.is_integral()) throw TemplateError{fmt::format("slice {} must be an integer or none, not {}", what, type_name(v))};
    return v.as_int();
  };
  auto start = bound(start_v, "start");
  auto stop = bound(stop_v, "stop");
  int64_t step = bound(step_v, "step").value_or(1);
  if (step == 0) throw TemplateError{"slice step cannot be zero"};
  bool is_string = obj.is_string();
  if (!is_string && !obj.is(Value::Kind::List)) {
    if (obj.is_undefined()) undefined_error(obj);
    throw TemplateError{fmt::format("'{}' object is not subscriptable", type_name(obj))};
  }
  std::u32string chars = is_string ? utf8_decode(obj.text) : std::u32string();
  int64_t n = is_string ? int64_t(chars.size()) : int64_t(obj.list->items.size());
  // Python's PySlice_AdjustIndices.
  auto adjust = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t i = *v;
    if (i < 0) {
      i += n;
      if (i < 0) i = step < 0 ? -1 : 0;
    } else if (i >= n) {
      i = step < 0 ? n - 1 : n;
    }
    return i;
  };
  int64_t lo = adjust(start, step < 0 ? n - 1 : 0);
  int64_t hi = adjust(stop, step < 0 ? -1 : n);
  std::vector<int64_t> picked;
  for (int64_t i = lo; step > 0 ? i < hi : i > hi; i += step) picked.push_back(i);
  if (is_string) {
    std::u32string out;
    for (int64_t i : picked) out += chars[i];
    return Value::from_string(utf8_encode(out));
  }
  std::vector<Value> out;
  for (int64_t i : picked) out.push_back(obj.list->items[i]);
  return Value::from_list(std::move(out), obj.list->is_tuple);
}

std::vector<Value> iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return {};
    case Value::Kind::List: return v.list->items;
    case Value::Kind::Dict: {
      std::vector<Value> keys;
      for (const auto& entry : v.dict->entries) keys.push_back(Value::from_string(entry.first));
      return keys;
    }
    case Value::Kind::String: {
      std::vector<Value> chars;
      for (char32_t c : utf8_decode(v.text)) chars.push_back(Value::from_string(utf8_encode(std::u32string(1, c))));
      return chars;
    }
    default: throw TemplateError{fmt::format("'{}' object is not iterable", type_name(v))};
  }
}

}  // namespace lathe::jinja
