// Python str operations for the Jinja interpreter (case mapping, strip, split, replace...) and the
// methods templates call on strings, dicts, lists and `loop`: s.startswith(x), d.items(), ...
// Convention: strings are measured and indexed in code points, as Python does; case mapping is per
// code point (no multi-character mappings such as 'ß' -> 'SS').
// Covered by tests/data/test_chat_template.cpp (JinjaExpression.StringMethods and friends).
#include "core/error.h"
#include "data/jinja_internal.h"

#include <algorithm>
#include <cwctype>
#include <locale.h>

namespace lathe::jinja {
namespace {

// Case mapping is per code point with the C library's Unicode tables (the C.UTF-8 locale, queried
// without touching the global locale), so é <-> É works; Python's multi-character mappings
// ('ß'.upper() == 'SS') are not reproduced. Without that locale, only ASCII letters change case.
locale_t utf8_locale() {
  static locale_t locale = newlocale(LC_CTYPE_MASK, "C.UTF-8", locale_t(0));
  return locale;
}

char32_t upper_char(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 'a' + 'A' : c;
  return utf8_locale() ? char32_t(towupper_l(wint_t(c), utf8_locale())) : c;
}

char32_t lower_char(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c - 'A' + 'a' : c;
  return utf8_locale() ? char32_t(towlower_l(wint_t(c), utf8_locale())) : c;
}

bool is_cased(char32_t c) { return upper_char(c) != c || lower_char(c) != c; }

std::string map_case(const std::string& s, char32_t (*f)(char32_t)) {
  std::u32string text = utf8_decode(s);
  for (char32_t& c : text) c = f(c);
  return utf8_encode(text);
}
}  // namespace

std::string py_lower(const std::string& s) { return map_case(s, lower_char); }  // Python str.lower()
std::string py_upper(const std::string& s) { return map_case(s, upper_char); }  // Python str.upper()

// Python str.title(): a cased character after an uncased one is upper-cased, the others lowered.
std::string py_title(const std::string& s) {
  std::u32string text = utf8_decode(s);
  bool previous_cased = false;
  for (char32_t& c : text) {
    bool cased = is_cased(c);
    c = cased ? (previous_cased ? lower_char(c) : upper_char(c)) : c;
    previous_cased = cased;
  }
  return utf8_encode(text);
}

// Jinja's |title filter (not str.title()): words start after runs of '-', whitespace, '(', '{',
// '[' and '<'; each word gets its first character upper-cased and the rest lowered.
std::string jinja_title(const std::string& s) {
  std::u32string text = utf8_decode(s);
  auto is_break = [](char32_t c) { return is_py_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<'; };
  bool word_start = true;
  for (char32_t& c : text) {
    if (is_break(c)) {
      word_start = true;
      continue;
    }
    c = word_start ? upper_char(c) : lower_char(c);
    word_start = false;
  }
  return utf8_encode(text);
}

// Python str.capitalize(): the first character upper-cased, the rest lowered.
std::string py_capitalize(const std::string& s) {
  std::u32string text = utf8_decode(s);
  for (size_t i = 0; i < text.size(); ++i) text[i] = i == 0 ? upper_char(text[i]) : lower_char(text[i]);
  return utf8_encode(text);
}

// str.strip/lstrip/rstrip: `chars` none strips whitespace, else any of its code points.
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::u32string text = utf8_decode(s);
  std::u32string set = chars.is_string() ? utf8_decode(chars.text) : std::u32string();
  bool whitespace = chars.is_undefined() || chars.is(Value::Kind::None);
  if (!whitespace && !chars.is_string()) throw TemplateError{"strip arg must be None or str"};
  auto strippable = [&](char32_t c) { return whitespace ? is_py_space(c) : set.find(c) != std::u32string::npos; };
  size_t begin = 0, end = text.size();
  if (left) {
    while (begin < end && strippable(text[begin])) ++begin;
  }
  if (right) {
    while (end > begin && strippable(text[end - 1])) --end;
  }
  return utf8_encode(text.substr(begin, end - begin));
}

std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (sep.is_undefined() || sep.is(Value::Kind::None)) {  // runs of whitespace, no empty parts
    std::u32string text = utf8_decode(s);
    std::vector<std::u32string> words;
    if (!from_right) {
      size_t i = 0;
      while (true) {
        while (i < text.size() && is_py_space(text[i])) ++i;
        if (i >= text.size()) break;
        if (maxsplit >= 0 && int64_t(words.size()) == maxsplit) {  // the rest, trailing blanks kept
          words.push_back(text.substr(i));
          break;
        }
        size_t j = i;
        while (j < text.size() && !is_py_space(text[j])) ++j;
        words.push_back(text.substr(i, j - i));
        i = j;
      }
    } else {
      size_t i = text.size();
      while (true) {
        while (i > 0 && is_py_space(text[i - 1])) --i;
        if (i == 0) break;
        if (maxsplit >= 0 && int64_t(words.size()) == maxsplit) {  // the rest, leading blanks kept
          words.push_back(text.substr(0, i));
          break;
        }
        size_t j = i;
        while (j > 0 && !is_py_space(text[j - 1])) --j;
        words.push_back(text.substr(j, i - j));
        i = j;
      }
      std::reverse(words.begin(), words.end());
    }
    for (const auto& w : words) parts.push_back(utf8_encode(w));
    return parts;
  }
  std::string separator = expect_string(sep, "split");
  if (separator.empty()) throw TemplateError{"split: empty separator"};
  if (!from_right) {
    size_t start = 0;
    while (maxsplit < 0 || int64_t(parts.size()) < maxsplit) {
      size_t found = s.find(separator, start);
      if (found == std::string::npos) break;
      parts.push_back(s.substr(start, found - start));
      start = found + separator.size();
    }
    parts.push_back(s.substr(start));
  } else {
    size_t end = s.size();
    while (maxsplit < 0 || int64_t(parts.size()) < maxsplit) {
      if (end < separator.size()) break;
      size_t found = s.rfind(separator, end - separator.size());
      if (found == std::string::npos) break;
      parts.push_back(s.substr(found + separator.size(), end - found - separator.size()));
      end = found;
    }
    parts.push_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
  }
  return parts;
}

// str.splitlines(): every Python line boundary, "\r\n" counting as one.
std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::u32string text = utf8_decode(s);
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    char32_t c = text[i];
    bool boundary = c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1C && c <= 0x1E) || c == 0x85 ||
                    c == 0x2028 || c == 0x2029;
    if (!boundary) continue;
    size_t end = i;
    if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
    lines.push_back(utf8_encode(text.substr(start, (keepends ? i + 1 : end) - start)));
    start = i + 1;
  }
  if (start < text.size()) lines.push_back(utf8_encode(text.substr(start)));
  return lines;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& with, int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts `with` around every code point
    std::u32string text = utf8_decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= text.size(); ++i) {
      if (count < 0 || done < count) {
        out += with;
        ++done;
      }
      if (i < text.size()) utf8_append(out, text[i]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t found = s.find(old, start);
    if (found == std::string::npos) break;
    out += s.substr(start, found - start) + with;
    start = found + old.size();
    ++done;
  }
  return out + s.substr(start);
}

namespace {

bool is_ascii_alpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

int64_t code_points_before(const std::string& s, size_t byte_offset) {
  int64_t n = 0;
  for (size_t i = 0; i < byte_offset; ++i) n += (static_cast<unsigned char>(s[i]) & 0xC0) != 0x80;
  return n;
}

Value string_list(const std::vector<std::string>& parts) {
  std::vector<Value> items;
  for (const auto& p : parts) items.push_back(Value::from_string(p));
  return Value::from_list(std::move(items));
}

std::optional<Value> string_method(const std::string& s, const std::string& name, const CallArgs& args) {
  if (name == "startswith" || name == "endswith") {
    Params p(name, args, {"prefix"});
    Value arg = p.get(0);
    std::vector<Value> options = arg.is(Value::Kind::List) ? arg.list->items : std::vector<Value>{arg};
    for (const Value& option : options) {
      std::string x = expect_string(option, name);
      bool hit = name == "startswith" ? s.compare(0, x.size(), x) == 0
                                      : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
      if (hit) return Value::from_bool(true);
    }
    return Value::from_bool(false);
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    Params p(name, args, {"chars"});
    return Value::from_string(py_strip(s, p.get(0), name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    Params p(name, args, {"sep", "maxsplit"});
    int64_t maxsplit = p.has(1) ? expect_int(p.get(1), name) : -1;
    return string_list(py_split(s, p.get(0), maxsplit, name == "rsplit"));
  }
  if (name == "splitlines") {
    Params p(name, args, {"keepends"});
    return string_list(py_splitlines(s, truthy(p.get(0, Value::from_bool(false)))));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    no_args(name, args);
    return Value::from_string(name == "upper" ? py_upper(s) : name == "lower" ? py_lower(s)
                              : name == "title" ? py_title(s) : py_capitalize(s));
  }
  if (name == "replace") {
    Params p(name, args, {"old", "new", "count"});
    int64_t count = p.has(2) ? expect_int(p.get(2), name) : -1;
    return Value::from_string(py_replace(s, expect_string(p.get(0), name), expect_string(p.get(1), name), count));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    Params p(name, args, {"sub"});
    std::string sub = expect_string(p.get(0), name);
    if (name == "count") {
      if (sub.empty()) return Value::from_int(int64_t(utf8_decode(s).size()) + 1);
      int64_t n = 0;
      for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
      return Value::from_int(n);
    }
    size_t at = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
    if (at == std::string::npos) {
      if (name == "index" || name == "rindex") throw TemplateError{"substring not found"};
      return Value::from_int(-1);
    }
    return Value::from_int(code_points_before(s, at));
  }
  if (name == "join") {
    Params p(name, args, {"iterable"});
    std::string out;
    bool first = true;
    for (const Value& item : iterate(p.get(0))) {
      out += (first ? "" : s) + expect_string(item, "join");
      first = false;
    }
    return Value::from_string(out);
  }
  if (name == "removeprefix" || name == "removesuffix") {
    Params p(name, args, {"affix"});
    std::string x = expect_string(p.get(0), name);
    if (name == "removeprefix" && s.compare(0, x.size(), x) == 0) return Value::from_string(s.substr(x.size()));
    if (name == "removesuffix" && !x.empty() && s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0) {
      return Value::from_string(s.substr(0, s.size() - x.size()));
    }
    return Value::from_string(s);
  }
  if (name == "isspace" || name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "islower" ||
      name == "isupper") {
    no_args(name, args);
    std::u32string text = utf8_decode(s);
    if (name == "islower" || name == "isupper") {
      bool lower = py_lower(s) == s, upper = py_upper(s) == s;
      return Value::from_bool(name == "islower" ? lower && !upper : upper && !lower);
    }
    auto ok = [&](char32_t c) {
      bool digit = c >= '0' && c <= '9', alpha = is_ascii_alpha(c);
      if (name == "isspace") return is_py_space(c);
      if (name == "isdigit") return digit;
      if (name == "isalpha") return alpha;
      return digit || alpha;
    };
    return Value::from_bool(!text.empty() && std::all_of(text.begin(), text.end(), ok));
  }
  if (name == "format") throw TemplateError{"str.format() is not supported; use '~' to build strings"};
  return std::nullopt;
}

std::optional<Value> dict_method(const Dict& d, const std::string& name, const CallArgs& args) {
  if (name == "items" || name == "keys" || name == "values") {
    no_args(name, args);
    std::vector<Value> out;
    for (const auto& [key, item] : d.entries) {
      Value k = Value::from_string(key);
      out.push_back(name == "items" ? Value::from_list({k, item}, true) : name == "keys" ? k : item);
    }
    return Value::from_list(std::move(out));
  }
  if (name == "get") {
    Params p(name, args, {"key", "default"});
    Value key = p.get(0);
    const Value* found = key.is_string() ? d.find(key.text) : nullptr;
    return found ? *found : p.get(1);
  }
  return std::nullopt;
}

}  // namespace

std::optional<Value> call_method(const Value& obj, const std::string& name, const CallArgs& args) {
  switch (obj.kind) {
    case Value::Kind::String: return string_method(obj.text, name, args);
    case Value::Kind::Dict: return dict_method(*obj.dict, name, args);
    case Value::Kind::List:
      if (name == "index" || name == "count") {
        Params p(name, args, {"value"});
        Value x = p.get(0);
        const auto& items = obj.list->items;
        if (name == "count") {
          return Value::from_int(std::count_if(items.begin(), items.end(), [&](const Value& v) { return equals(v, x); }));
        }
        for (size_t i = 0; i < items.size(); ++i) {
          if (equals(items[i], x)) return Value::from_int(int64_t(i));
        }
        throw TemplateError{"list.index(x): x not in list"};
      }
      return std::nullopt;
    case Value::Kind::Loop:
      if (name == "cycle") {
        if (args.positional.empty()) throw TemplateError{"loop.cycle() needs at least one value"};
        return args.positional[size_t(obj.loop->index0) % args.positional.size()];
      }
      return std::nullopt;
    default: return std::nullopt;
  }
}

}  // namespace lathe::jinja
