// Built-ins of the Jinja interpreter: filters, tests, and the global functions transformers provides
// (range, namespace, dict, raise_exception, strftime_now). Methods of values are in jinja_strings.cpp.
// Convention: each built-in takes Python-style arguments bound by name and position (Params), and
// tojson is transformers' override, not Jinja's: json.dumps(x, ensure_ascii=False, indent=None,
// separators=None, sort_keys=False), so no HTML escaping and keys keep their order.
// Covered by tests/data/test_chat_template.cpp (JinjaFilters*, JinjaTests*, JinjaGlobals* tests).
#include "core/error.h"
#include "data/jinja_internal.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>

namespace lathe::jinja {
namespace {

int64_t length_of(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return 0;
    case Value::Kind::String: return int64_t(utf8_decode(v.text).size());
    case Value::Kind::List: return int64_t(v.list->items.size());
    case Value::Kind::Dict: return int64_t(v.dict->entries.size());
    default: throw TemplateError{fmt::format("object of type '{}' has no len()", type_name(v))};
  }
}

// Sort key helper: strings compare case-insensitively unless asked otherwise (Jinja's default).
Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::from_string(py_lower(v.text));
  return v;
}

// Jinja's attribute paths for map/sort/...: "a.b" looks up a then b; a digit part is an index.
Value lookup_path(const Value& v, const std::string& path) {
  Value current = v;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    current = digits ? get_item(current, Value::from_int(std::stoll(part))) : get_attr(current, part);
    if (dot == std::string::npos) return current;
    start = dot + 1;
  }
}

std::vector<Value> sorted(std::vector<Value> items, bool reverse, bool case_sensitive, const Value& attribute) {
  auto key = [&](const Value& v) {
    return sort_key(attribute.is_string() ? lookup_path(v, attribute.text) : v, case_sensitive);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    return reverse ? compare(key(b), key(a)) < 0 : compare(key(a), key(b)) < 0;
  });
  return items;
}

std::optional<double> parse_float(std::string s) {
  s = py_strip(s, Value::none(), true, true);
  std::string lower = py_lower(s);
  if (lower == "inf" || lower == "+inf" || lower == "infinity" || lower == "+infinity") return INFINITY;
  if (lower == "-inf" || lower == "-infinity") return -INFINITY;
  if (lower == "nan" || lower == "+nan" || lower == "-nan") return NAN;
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  if (s.empty()) return std::nullopt;
  size_t used = 0;
  try {
    double d = std::stod(s, &used);
    if (used == s.size()) return d;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// ---- filters ----

using Filter = std::function<Value(const Value&, const CallArgs&)>;

Value filter_select(const Value& v, const CallArgs& args, bool by_attribute, bool keep) {
  std::string what = std::string(keep ? "select" : "reject") + (by_attribute ? "attr" : "");
  size_t first_test_arg = 0;
  std::string attribute;
  if (by_attribute) {
    if (args.positional.empty()) throw TemplateError{what + " needs an attribute name"};
    attribute = expect_string(args.positional[0], what);
    first_test_arg = 1;
  }
  std::string test;
  CallArgs test_args;
  if (args.positional.size() > first_test_arg) {
    test = expect_string(args.positional[first_test_arg], what);
    if (!has_test(test)) throw TemplateError{fmt::format("{}: unknown test '{}'", what, test)};
    test_args.positional.assign(args.positional.begin() + first_test_arg + 1, args.positional.end());
    test_args.keyword = args.keyword;
  }
  std::vector<Value> out;
  for (const Value& item : iterate(v)) {
    Value subject = by_attribute ? lookup_path(item, attribute) : item;
    bool passed = test.empty() ? truthy(subject) : apply_test(test, subject, test_args);
    if (passed == keep) out.push_back(item);
  }
  return Value::from_list(std::move(out));
}

Value filter_map(const Value& v, const CallArgs& args) {
  std::vector<Value> out;
  if (args.positional.empty()) {
    Params p("map", args, {"attribute", "default"});
    if (!p.has(0)) throw TemplateError{"map needs a filter name or attribute="};
    std::string attribute = to_str(p.get(0));
    for (const Value& item : iterate(v)) {
      Value x = lookup_path(item, attribute);
      out.push_back(x.is_undefined() && p.has(1) ? p.get(1) : x);
    }
    return Value::from_list(std::move(out));
  }
  std::string filter = expect_string(args.positional[0], "map");
  if (!has_filter(filter)) throw TemplateError{fmt::format("map: unknown filter '{}'", filter)};
  CallArgs rest{{args.positional.begin() + 1, args.positional.end()}, args.keyword};
  for (const Value& item : iterate(v)) out.push_back(apply_filter(filter, item, rest));
  return Value::from_list(std::move(out));
}

Value filter_tojson(const Value& v, const CallArgs& args) {
  Params p("tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonStyle style;
  style.ensure_ascii = truthy(p.get(0, Value::from_bool(false)));
  if (p.has(1)) {
    Value indent = p.get(1);
    style.indent = indent.is_string() ? indent.text : std::string(std::max<int64_t>(0, expect_int(indent, "tojson indent")), ' ');
    style.item_separator = ",";
  }
  if (p.has(2)) {
    std::vector<Value> seps = iterate(p.get(2));
    if (seps.size() != 2 || !seps[0].is_string() || !seps[1].is_string()) {
      throw TemplateError{"tojson separators must be a pair of strings"};
    }
    style.item_separator = seps[0].text;
    style.key_separator = seps[1].text;
  }
  style.sort_keys = truthy(p.get(3, Value::from_bool(false)));
  return Value::from_string(to_json(v, style));
}

Value filter_indent(const Value& v, const CallArgs& args) {
  Params p("indent", args, {"width", "first", "blank"});
  Value width = p.get(0, Value::from_int(4));
  std::string indention = width.is_string() ? width.text : std::string(std::max<int64_t>(0, expect_int(width, "indent")), ' ');
  std::vector<std::string> lines = py_splitlines(to_str(v) + "\n", false);
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) out += "\n";
    bool indent_line = i > 0 && (truthy(p.get(2, Value::from_bool(false))) || !lines[i].empty());
    out += (indent_line ? indention : "") + lines[i];
  }
  if (truthy(p.get(1, Value::from_bool(false)))) out = indention + out;
  return Value::from_string(out);
}

// Python's round(x, n): correctly rounded to n decimals (ties to even on the exact binary value),
// which is what printf's %.*f computes; an int stays an int.
double python_round(double x, int64_t precision) {
  if (!std::isfinite(x)) return x;
  if (precision < 0 || precision > 300) {
    double scale = std::pow(10.0, double(-precision));
    return precision < 0 ? std::nearbyint(x / scale) * scale : x;
  }
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%.*f", int(precision), x);
  return std::strtod(buf, nullptr);
}

Value filter_round(const Value& v, const CallArgs& args) {
  Params p("round", args, {"precision", "method"});
  int64_t precision = p.has(0) ? expect_int(p.get(0), "round precision") : 0;
  std::string method = p.has(1) ? expect_string(p.get(1), "round method") : "common";
  if (!v.is_number()) throw TemplateError{fmt::format("round expects a number, not {}", type_name(v))};
  if (method == "common") {
    if (v.is_integral() && precision >= 0) return Value::from_int(v.as_int());
    return Value::from_float(python_round(v.as_float(), precision));
  }
  if (method != "ceil" && method != "floor") throw TemplateError{"round method must be 'common', 'ceil' or 'floor'"};
  double scale = std::pow(10.0, double(precision));
  double x = v.as_float() * scale;
  return Value::from_float((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
}

const std::map<std::string, Filter, std::less<>>& filters() {
  static const std::map<std::string, Filter, std::less<>> table = [] {
    std::map<std::string, Filter, std::less<>> t;
    t["abs"] = [](const Value& v, const CallArgs& a) {
      no_args("abs", a);
      if (v.is_integral()) return Value::from_int(std::llabs(v.as_int()));
      if (v.is(Value::Kind::Float)) return Value::from_float(std::fabs(v.number));
      throw TemplateError{fmt::format("bad operand type for abs(): '{}'", type_name(v))};
    };
    t["capitalize"] = [](const Value& v, const CallArgs& a) { no_args("capitalize", a); return Value::from_string(py_capitalize(to_str(v))); };
    t["default"] = [](const Value& v, const CallArgs& a) {
      Params p("default", a, {"default_value", "boolean"});
      bool boolean = truthy(p.get(1, Value::from_bool(false)));
      if (v.is_undefined() || (boolean && !truthy(v))) return p.get(0, Value::from_string(""));
      return v;
    };
    t["d"] = t["default"];
    t["dictsort"] = [](const Value& v, const CallArgs& a) {
      Params p("dictsort", a, {"case_sensitive", "by", "reverse"});
      if (!v.is_mapping()) throw TemplateError{fmt::format("dictsort expects a mapping, not {}", type_name(v))};
      bool by_value = p.has(1) && to_str(p.get(1)) == "value";
      bool case_sensitive = truthy(p.get(0, Value::from_bool(false)));
      std::vector<Value> items;
      for (const auto& [key, item] : v.dict->entries) items.push_back(Value::from_list({Value::from_string(key), item}, true));
      Value attribute = Value::from_string(by_value ? "1" : "0");
      return Value::from_list(sorted(std::move(items), truthy(p.get(2, Value::from_bool(false))), case_sensitive, attribute));
    };
    t["escape"] = [](const Value& v, const CallArgs& a) {
      no_args("escape", a);
      std::string out;
      for (char c : to_str(v)) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
      }
      return Value::from_string(out);
    };
    t["e"] = t["escape"];
    t["first"] = [](const Value& v, const CallArgs& a) {
      no_args("first", a);
      std::vector<Value> items = iterate(v);
      return items.empty() ? Value::undefined("first item") : items.front();
    };
    t["last"] = [](const Value& v, const CallArgs& a) {
      no_args("last", a);
      std::vector<Value> items = iterate(v);
      return items.empty() ? Value::undefined("last item") : items.back();
    };
    t["float"] = [](const Value& v, const CallArgs& a) {
      Params p("float", a, {"default"});
      if (v.is_number()) return Value::from_float(v.as_float());
      std::optional<double> d = v.is_string() ? parse_float(v.text) : std::nullopt;
      return d ? Value::from_float(*d) : p.get(0, Value::from_float(0.0));
    };
    t["int"] = [](const Value& v, const CallArgs& a) {
      Params p("int", a, {"default", "base"});
      Value fallback = p.get(0, Value::from_int(0));
      if (v.is_integral()) return Value::from_int(v.as_int());
      if (v.is(Value::Kind::Float)) return std::isfinite(v.number) ? Value::from_int(int64_t(v.number)) : fallback;
      if (!v.is_string()) return fallback;
      int base = p.has(1) ? int(expect_int(p.get(1), "int base")) : 10;
      std::string s = py_strip(v.text, Value::none(), true, true);
      s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
      try {
        size_t used = 0;
        int64_t i = std::stoll(s, &used, base);
        if (used == s.size()) return Value::from_int(i);
      } catch (const std::exception&) {
      }
      std::optional<double> d = parse_float(v.text);
      return d && std::isfinite(*d) ? Value::from_int(int64_t(*d)) : fallback;
    };
    t["items"] = [](const Value& v, const CallArgs& a) {
      no_args("items", a);
      if (v.is_undefined()) return Value::from_list({});
      if (!v.is_mapping()) throw TemplateError{fmt::format("items expects a mapping, not {}", type_name(v))};
      std::vector<Value> items;
      for (const auto& [key, item] : v.dict->entries) items.push_back(Value::from_list({Value::from_string(key), item}, true));
      return Value::from_list(std::move(items));
    };
    t["join"] = [](const Value& v, const CallArgs& a) {
      Params p("join", a, {"d", "attribute"});
      std::string separator = p.has(0) ? to_str(p.get(0)) : "";
      std::string out;
      bool first = true;
      for (const Value& item : iterate(v)) {
        out += (first ? "" : separator) + to_str(p.has(1) ? lookup_path(item, to_str(p.get(1))) : item);
        first = false;
      }
      return Value::from_string(out);
    };
    t["length"] = [](const Value& v, const CallArgs& a) { no_args("length", a); return Value::from_int(length_of(v)); };
    t["count"] = t["length"];
    t["list"] = [](const Value& v, const CallArgs& a) { no_args("list", a); return Value::from_list(iterate(v)); };
    t["lower"] = [](const Value& v, const CallArgs& a) { no_args("lower", a); return Value::from_string(py_lower(to_str(v))); };
    t["upper"] = [](const Value& v, const CallArgs& a) { no_args("upper", a); return Value::from_string(py_upper(to_str(v))); };
    t["title"] = [](const Value& v, const CallArgs& a) { no_args("title", a); return Value::from_string(jinja_title(to_str(v))); };
    t["map"] = filter_map;
    for (const char* name : {"max", "min"}) {
      bool is_max = std::string_view(name) == "max";
      t[name] = [is_max, name](const Value& v, const CallArgs& a) {
        Params p(name, a, {"case_sensitive", "attribute"});
        std::vector<Value> items = sorted(iterate(v), false, truthy(p.get(0, Value::from_bool(false))), p.get(1));
        if (items.empty()) return Value::undefined(fmt::format("{} of an empty sequence", name));
        return is_max ? items.back() : items.front();
      };
    }
    t["replace"] = [](const Value& v, const CallArgs& a) {
      Params p("replace", a, {"old", "new", "count"});
      int64_t count = p.has(2) ? expect_int(p.get(2), "replace count") : -1;
      return Value::from_string(py_replace(to_str(v), to_str(p.get(0)), to_str(p.get(1)), count));
    };
    t["reverse"] = [](const Value& v, const CallArgs& a) {
      no_args("reverse", a);
      if (v.is_string()) {
        std::u32string s = utf8_decode(v.text);
        std::reverse(s.begin(), s.end());
        return Value::from_string(utf8_encode(s));
      }
      std::vector<Value> items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::from_list(std::move(items));
    };
    t["round"] = filter_round;
    t["safe"] = [](const Value& v, const CallArgs& a) { no_args("safe", a); return v; };
    t["select"] = [](const Value& v, const CallArgs& a) { return filter_select(v, a, false, true); };
    t["reject"] = [](const Value& v, const CallArgs& a) { return filter_select(v, a, false, false); };
    t["selectattr"] = [](const Value& v, const CallArgs& a) { return filter_select(v, a, true, true); };
    t["rejectattr"] = [](const Value& v, const CallArgs& a) { return filter_select(v, a, true, false); };
    t["sort"] = [](const Value& v, const CallArgs& a) {
      Params p("sort", a, {"reverse", "case_sensitive", "attribute"});
      return Value::from_list(sorted(iterate(v), truthy(p.get(0, Value::from_bool(false))),
                                     truthy(p.get(1, Value::from_bool(false))), p.get(2)));
    };
    t["string"] = [](const Value& v, const CallArgs& a) { no_args("string", a); return Value::from_string(to_str(v)); };
    t["sum"] = [](const Value& v, const CallArgs& a) {
      Params p("sum", a, {"attribute", "start"});
      Value total = p.get(1, Value::from_int(0));
      for (const Value& item : iterate(v)) total = binary_op("+", total, p.has(0) ? lookup_path(item, to_str(p.get(0))) : item);
      return total;
    };
    t["tojson"] = filter_tojson;
    t["trim"] = [](const Value& v, const CallArgs& a) {
      Params p("trim", a, {"chars"});
      return Value::from_string(py_strip(to_str(v), p.get(0), true, true));
    };
    t["unique"] = [](const Value& v, const CallArgs& a) {
      Params p("unique", a, {"case_sensitive", "attribute"});
      bool case_sensitive = truthy(p.get(0, Value::from_bool(false)));
      std::vector<Value> out, seen;
      for (const Value& item : iterate(v)) {
        Value key = sort_key(p.has(1) ? lookup_path(item, to_str(p.get(1))) : item, case_sensitive);
        if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) {
          seen.push_back(key);
          out.push_back(item);
        }
      }
      return Value::from_list(std::move(out));
    };
    t["indent"] = filter_indent;
    t["wordcount"] = [](const Value& v, const CallArgs& a) {
      no_args("wordcount", a);
      return Value::from_int(int64_t(py_split(to_str(v), Value::none(), -1, false).size()));
    };
    return t;
  }();
  return table;
}

// ---- tests ----

using Test = std::function<bool(const Value&, const CallArgs&)>;

Value one_arg(std::string_view what, const CallArgs& args) {
  Params p(what, args, {"other"});
  return p.get(0);
}

const std::map<std::string, Test, std::less<>>& tests() {
  static const std::map<std::string, Test, std::less<>> table = [] {
    std::map<std::string, Test, std::less<>> t;
    auto kind_test = [&t](const char* name, std::function<bool(const Value&)> predicate) {
      t[name] = [name, predicate](const Value& v, const CallArgs& a) {
        no_args(name, a);
        return predicate(v);
      };
    };
    kind_test("defined", [](const Value& v) { return !v.is_undefined(); });
    kind_test("undefined", [](const Value& v) { return v.is_undefined(); });
    kind_test("none", [](const Value& v) { return v.is(Value::Kind::None); });
    kind_test("boolean", [](const Value& v) { return v.is(Value::Kind::Bool); });
    kind_test("true", [](const Value& v) { return v.is(Value::Kind::Bool) && v.boolean; });
    kind_test("false", [](const Value& v) { return v.is(Value::Kind::Bool) && !v.boolean; });
    kind_test("integer", [](const Value& v) { return v.is(Value::Kind::Int); });
    kind_test("float", [](const Value& v) { return v.is(Value::Kind::Float); });
    kind_test("number", [](const Value& v) { return v.is_number(); });
    kind_test("string", [](const Value& v) { return v.is_string(); });
    kind_test("mapping", [](const Value& v) { return v.is_mapping(); });
    kind_test("iterable", [](const Value& v) {
      return v.is_string() || v.is(Value::Kind::List) || v.is_mapping() || v.is_undefined();
    });
    kind_test("sequence", [](const Value& v) {
      return v.is_string() || v.is(Value::Kind::List) || v.is_mapping() || v.is_undefined();
    });
    kind_test("callable", [](const Value& v) { return v.is(Value::Kind::Macro) || v.is(Value::Kind::Function); });
    kind_test("escaped", [](const Value&) { return false; });
    kind_test("lower", [](const Value& v) { std::string s = to_str(v); return py_lower(s) == s && py_upper(s) != s; });
    kind_test("upper", [](const Value& v) { std::string s = to_str(v); return py_upper(s) == s && py_lower(s) != s; });
    kind_test("odd", [](const Value& v) { return equals(binary_op("%", v, Value::from_int(2)), Value::from_int(1)); });
    kind_test("even", [](const Value& v) { return equals(binary_op("%", v, Value::from_int(2)), Value::from_int(0)); });
    t["divisibleby"] = [](const Value& v, const CallArgs& a) {
      Params p("divisibleby", a, {"num"});
      return equals(binary_op("%", v, p.get(0)), Value::from_int(0));
    };
    t["sameas"] = [](const Value& v, const CallArgs& a) {
      Value other = one_arg("sameas", a);
      if (v.kind != other.kind) return false;
      if (v.is(Value::Kind::List)) return v.list == other.list;
      if (v.is_mapping() || v.is(Value::Kind::Namespace)) return v.dict == other.dict;
      return equals(v, other);
    };
    t["in"] = [](const Value& v, const CallArgs& a) { return contains(one_arg("in", a), v); };
    auto compare_test = [&t](std::initializer_list<const char*> names, std::function<bool(const Value&, const Value&)> op) {
      for (const char* name : names) {
        t[name] = [name, op](const Value& v, const CallArgs& a) { return op(v, one_arg(name, a)); };
      }
    };
    compare_test({"eq", "equalto", "=="}, [](const Value& x, const Value& y) { return equals(x, y); });
    compare_test({"ne", "!="}, [](const Value& x, const Value& y) { return !equals(x, y); });
    compare_test({"lt", "lessthan", "<"}, [](const Value& x, const Value& y) { return compare(x, y) < 0; });
    compare_test({"le", "<="}, [](const Value& x, const Value& y) { return compare(x, y) <= 0; });
    compare_test({"gt", "greaterthan", ">"}, [](const Value& x, const Value& y) { return compare(x, y) > 0; });
    compare_test({"ge", ">="}, [](const Value& x, const Value& y) { return compare(x, y) >= 0; });
    t["filter"] = [](const Value& v, const CallArgs& a) { no_args("filter", a); return v.is_string() && has_filter(v.text); };
    t["test"] = [](const Value& v, const CallArgs& a) { no_args("test", a); return v.is_string() && has_test(v.text); };
    return t;
  }();
  return table;
}

}  // namespace

bool has_filter(std::string_view name) { return filters().count(name) != 0; }
bool has_test(std::string_view name) { return tests().count(name) != 0; }

Value apply_filter(std::string_view name, const Value& value, const CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end()) throw TemplateError{fmt::format("unknown filter '{}'", name)};
  return it->second(value, args);
}

bool apply_test(std::string_view name, const Value& value, const CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) throw TemplateError{fmt::format("unknown test '{}'", name)};
  return it->second(value, args);
}

const std::vector<std::string>& global_function_names() {
  static const std::vector<std::string> names = {"range", "namespace", "dict", "raise_exception", "strftime_now"};
  return names;
}

Value call_global(std::string_view name, const CallArgs& args) {
  if (name == "range") {
    if (!args.keyword.empty()) throw TemplateError{"range() takes no keyword arguments"};
    const auto& p = args.positional;
    if (p.empty() || p.size() > 3) throw TemplateError{"range() takes 1 to 3 arguments"};
    int64_t start = p.size() == 1 ? 0 : expect_int(p[0], "range");
    int64_t stop = expect_int(p.size() == 1 ? p[0] : p[1], "range");
    int64_t step = p.size() == 3 ? expect_int(p[2], "range") : 1;
    if (step == 0) throw TemplateError{"range() step must not be zero"};
    std::vector<Value> out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (out.size() >= 100000) throw TemplateError{"range() is too big (Jinja's sandbox allows 100000 items)"};
      out.push_back(Value::from_int(i));
    }
    return Value::from_list(std::move(out));
  }
  if (name == "namespace" || name == "dict") {
    Dict d;
    if (args.positional.size() > 1) throw TemplateError{fmt::format("{}() takes at most one positional argument", name)};
    if (!args.positional.empty()) {
      const Value& init = args.positional[0];
      if (!init.is_mapping()) throw TemplateError{fmt::format("{}() positional argument must be a mapping", name)};
      d = *init.dict;
    }
    for (const auto& [key, value] : args.keyword) d.set(key, value);
    Value v = Value::from_dict(std::move(d));
    if (name == "namespace") v.kind = Value::Kind::Namespace;
    return v;
  }
  if (name == "raise_exception") {
    Params p("raise_exception", args, {"message"});
    throw TemplateError{to_str(p.get(0, Value::from_string(""))), true};
  }
  if (name == "strftime_now") {
    Params p("strftime_now", args, {"format"});
    std::string format = expect_string(p.get(0), "strftime_now");
    std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[512];
    size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &local);
    return Value::from_string(std::string(buf, n));
  }
  throw TemplateError{fmt::format("unknown function '{}'", name)};
}

}  // namespace lathe::jinja

