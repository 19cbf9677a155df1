// Lexer for the Jinja interpreter: splits a template into data tokens and the tokens inside tags.
// Convention: whitespace control is applied here, to the data, exactly as Jinja 3 does it: '-' strips
// all whitespace on its side, '+' disables the automatic stripping, trim_blocks drops one newline
// after %} and #}, lstrip_blocks drops the blanks before {% and {# when nothing else precedes them on
// their line. Tag ends are only recognised while brackets are balanced, so {{ {'a': {}} }} works.
// Covered by tests/data/test_chat_template.cpp (JinjaWhitespace.*, JinjaErrors.MalformedTemplates*).
#include "core/error.h"
#include "data/jinja_internal.h"

namespace lathe::jinja {

std::string source_location(std::string_view source, size_t pos) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < pos && i < source.size(); ++i) {
    if (source[i] == '\n') {
      ++line;
      column = 1;
    } else if ((static_cast<unsigned char>(source[i]) & 0xC0) != 0x80) {
      ++column;
    }
  }
  return fmt::format("line {}, column {}", line, column);
}

namespace {

bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

// Length of `s` without its trailing Python whitespace (str.rstrip()).
size_t rstrip_length(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t len;
    if (!is_py_space(utf8_decode_at(s, start, len)) || start + len != end) break;
    end = start;
  }
  return end;
}

// Position of the first non-whitespace code point at or after `pos` (Python's \s*).
size_t skip_space(std::string_view s, size_t pos) {
  while (pos < s.size()) {
    size_t len;
    if (!is_py_space(utf8_decode_at(s, pos, len))) break;
    pos += len;
  }
  return pos;
}

class Lexer {
 public:
  Lexer(const std::string& source, const Options& options) : src_(source), options_(options) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;  // the previous tag's end consumed a newline (or this is the start)
    while (pos < src_.size()) {
      size_t tag = find_tag(pos);
      if (tag == std::string::npos) {
        emit_text(src_.substr(pos), pos);
        break;
      }
      char type = src_[tag + 1];
      char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
      size_t inner = tag + 2 + (sign ? 1 : 0);
      size_t raw_body = 0;
      bool raw = type == '%' && is_raw_begin(inner, raw_body);
      emit_text(control_whitespace(src_.substr(pos, tag - pos), sign, type != '{', line_starting), pos);
      if (type == '#') {
        pos = lex_comment(tag, inner);
      } else if (raw) {
        pos = lex_raw(tag, raw_body);
      } else {
        pos = lex_tag(type == '{', tag, inner);
      }
      line_starting = src_[pos - 1] == '\n';
    }
    tokens_.push_back(Token{Token::Kind::End, src_.size(), {}});
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(size_t pos, const std::string& message) const {
    LATHE_FAIL("jinja: syntax error at {}: {}", source_location(src_, pos), message);
  }

  size_t find_tag(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }

  bool starts_with(size_t pos, std::string_view s) const { return src_.compare(pos, s.size(), s) == 0; }

  // The data before a tag, after the tag's whitespace control: '-' strips all trailing whitespace;
  // otherwise lstrip_blocks removes the blanks between the last newline and a block/comment tag.
  std::string control_whitespace(std::string text, char sign, bool is_block, bool line_starting) const {
    if (sign == '-') {
      text.resize(rstrip_length(text));
    } else if (sign != '+' && is_block && options_.lstrip_blocks) {
      size_t newline = text.rfind('\n');
      size_t start = newline == std::string::npos ? 0 : newline + 1;
      if ((newline != std::string::npos || line_starting) && start < text.size() &&
          skip_space(text, start) == text.size()) {
        text.resize(start);
      }
    }
    return text;
  }

  void emit_text(std::string text, size_t pos) {
    if (!text.empty()) tokens_.push_back(Token{Token::Kind::Text, pos, std::move(text)});
  }

  // Position after a block or comment end marker and the whitespace it consumes.
  size_t after_block_end(size_t marker_end, char sign) const {
    if (sign == '-') return skip_space(src_, marker_end);
    if (sign != '+' && options_.trim_blocks && marker_end < src_.size() && src_[marker_end] == '\n') {
      return marker_end + 1;
    }
    return marker_end;
  }

  size_t lex_comment(size_t tag, size_t inner) {
    size_t end = src_.find("#}", inner);
    if (end == std::string::npos) fail(tag, "unclosed comment '{#' (missing '#}')");
    char sign = end > inner && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : 0;
    return after_block_end(end + 2, sign);
  }

  // {% raw %} (with optional - or + on either side): sets `body` to where the raw text starts.
  bool is_raw_begin(size_t inner, size_t& body) const {
    size_t p = inner;
    while (p < src_.size() && is_ascii_space(src_[p])) ++p;
    if (!starts_with(p, "raw")) return false;
    p += 3;
    while (p < src_.size() && is_ascii_space(src_[p])) ++p;
    if (starts_with(p, "-%}")) {
      body = skip_space(src_, p + 3);
      return true;
    }
    if (starts_with(p, "%}")) {
      body = p + 2;  // Jinja applies no trim_blocks after {% raw %}
      return true;
    }
    return false;
  }

  size_t lex_raw(size_t tag, size_t body) {
    for (size_t i = src_.find("{%", body); i != std::string::npos; i = src_.find("{%", i + 1)) {
      char sign = i + 2 < src_.size() && (src_[i + 2] == '-' || src_[i + 2] == '+') ? src_[i + 2] : 0;
      size_t p = i + 2 + (sign ? 1 : 0);
      while (p < src_.size() && is_ascii_space(src_[p])) ++p;
      if (!starts_with(p, "endraw")) continue;
      p += 6;
      while (p < src_.size() && is_ascii_space(src_[p])) ++p;
      char end_sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) end_sign = src_[p++];
      if (!starts_with(p, "%}")) continue;
      // The raw text was preceded by the begin tag's end, which never leaves a line start here.
      emit_text(control_whitespace(src_.substr(body, i - body), sign, true, src_[body - 1] == '\n'), body);
      return after_block_end(p + 2, end_sign);
    }
    fail(tag, "unclosed '{% raw %}' (missing '{% endraw %}')");
  }

  size_t lex_tag(bool is_var, size_t tag, size_t inner) {
    tokens_.push_back(Token{is_var ? Token::Kind::VarBegin : Token::Kind::BlockBegin, tag, {}});
    std::vector<char> closers;  // expected closing brackets, innermost last
    size_t p = inner;
    while (true) {
      while (p < src_.size() && is_ascii_space(src_[p])) ++p;
      if (p >= src_.size()) fail(tag, is_var ? "unclosed '{{' (missing '}}')" : "unclosed '{%' (missing '%}')");
      if (closers.empty()) {
        if (is_var && (starts_with(p, "-}}") || starts_with(p, "}}"))) {
          tokens_.push_back(Token{Token::Kind::VarEnd, p, {}});
          return src_[p] == '-' ? skip_space(src_, p + 3) : p + 2;
        }
        if (!is_var && (starts_with(p, "-%}") || starts_with(p, "+%}") || starts_with(p, "%}"))) {
          tokens_.push_back(Token{Token::Kind::BlockEnd, p, {}});
          char sign = src_[p] == '%' ? 0 : src_[p];
          return after_block_end(p + (sign ? 3 : 2), sign);
        }
      }
      char c = src_[p];
      if (is_name_start(c)) {
        size_t start = p;
        while (p < src_.size() && is_name_char(src_[p])) ++p;
        tokens_.push_back(Token{Token::Kind::Name, start, src_.substr(start, p - start)});
      } else if (is_digit(c)) {
        p = lex_number(p);
      } else if (c == '\'' || c == '"') {
        p = lex_string(p);
      } else {
        p = lex_operator(p, closers);
      }
    }
  }

  size_t lex_digits(size_t p) const {
    while (p < src_.size() && (is_digit(src_[p]) || (src_[p] == '_' && p + 1 < src_.size() && is_digit(src_[p + 1])))) ++p;
    return p;
  }

  size_t lex_number(size_t start) {
    // 0x.., 0o.., 0b.. integers, as Jinja's integer pattern allows.
    if (src_[start] == '0' && start + 2 < src_.size() && std::string_view("xXoObB").find(src_[start + 1]) != std::string_view::npos) {
      int base = (src_[start + 1] | 0x20) == 'x' ? 16 : (src_[start + 1] | 0x20) == 'o' ? 8 : 2;
      size_t p = start + 2;
      std::string digits;
      while (p < src_.size() && (src_[p] == '_' || (hex_value(src_[p]) >= 0 && hex_value(src_[p]) < base))) {
        if (src_[p] != '_') digits += src_[p];
        ++p;
      }
      if (!digits.empty()) {
        Token token{Token::Kind::Int, start, src_.substr(start, p - start)};
        try {
          token.integer = std::stoll(digits, nullptr, base);
        } catch (const std::exception&) {
          fail(start, fmt::format("number '{}' is out of range", token.text));
        }
        tokens_.push_back(std::move(token));
        return p;
      }
    }
    size_t p = lex_digits(start);
    bool is_float = false;
    // Jinja's float pattern refuses a number right after '.', so x.0.1 is x[0][1].
    bool after_dot = start > 0 && src_[start - 1] == '.';
    if (!after_dot && p + 1 < src_.size() && src_[p] == '.' && is_digit(src_[p + 1])) {
      p = lex_digits(p + 1);
      is_float = true;
    }
    if (!after_dot && p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && is_digit(src_[q])) {
        p = lex_digits(q);
        is_float = true;
      }
    }
    std::string digits;
    for (size_t i = start; i < p; ++i) {
      if (src_[i] != '_') digits += src_[i];
    }
    Token token{is_float ? Token::Kind::Float : Token::Kind::Int, start, digits};
    if (is_float) {
      token.number = std::strtod(digits.c_str(), nullptr);  // like Python: 1e400 is inf, 5e-324 subnormal
    } else {
      try {
        token.integer = std::stoll(digits);
      } catch (const std::exception&) {
        fail(start, fmt::format("integer '{}' does not fit in 64 bits", digits));
      }
    }
    tokens_.push_back(std::move(token));
    return p;
  }

  static int hex_value(char c) {
    if (is_digit(c)) return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  // String literals are unescaped as Python's unicode-escape codec does; unknown escapes stay as
  // written (backslash included).
  size_t lex_string(size_t start) {
    char quote = src_[start];
    std::string value;
    size_t p = start + 1;
    while (true) {
      if (p >= src_.size()) fail(start, "unclosed string literal");
      char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) fail(start, "unclosed string literal");
      char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\\': value += '\\'; break;
        case '\'': value += '\''; break;
        case '"': value += '"'; break;
        case 'a': value += '\a'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'n': value += '\n'; break;
        case 'r': value += '\r'; break;
        case 't': value += '\t'; break;
        case 'v': value += '\v'; break;
        case '\n': break;  // line continuation
        case 'x': case 'u': case 'U': {
          int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          char32_t cp = 0;
          for (int k = 0; k < digits; ++k) {
            int h = p < src_.size() ? hex_value(src_[p]) : -1;
            if (h < 0) fail(p - 2 - k, fmt::format("truncated \\{} escape in string literal", e));
            cp = cp * 16 + h;
            ++p;
          }
          if (cp > 0x10FFFF) fail(p, "illegal Unicode character in string literal");
          utf8_append(value, cp);
          break;
        }
        case 'N':
          fail(p - 2, "\\N{...} escapes are not supported in string literals");
        default:
          if (e >= '0' && e <= '7') {
            char32_t cp = e - '0';
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k) cp = cp * 8 + (src_[p++] - '0');
            utf8_append(value, cp);
          } else {
            value += '\\';
            value += e;
          }
      }
    }
    tokens_.push_back(Token{Token::Kind::String, start, std::move(value)});
    return p + 1;
  }

  size_t lex_operator(size_t p, std::vector<char>& closers) {
    static constexpr std::string_view kTwoChar[] = {"//", "**", "==", "!=", "<=", ">="};
    for (std::string_view op : kTwoChar) {
      if (starts_with(p, op)) {
        tokens_.push_back(Token{Token::Kind::Op, p, std::string(op)});
        return p + 2;
      }
    }
    char c = src_[p];
    if (std::string_view("+-*/%~<>=.,:|()[]{}").find(c) == std::string_view::npos) {
      size_t len;
      char32_t cp = utf8_decode_at(src_, p, len);
      std::string shown;
      utf8_append(shown, cp);
      fail(p, fmt::format("unexpected character '{}' in a tag", shown));
    }
    if (c == '(' || c == '[' || c == '{') closers.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    if (c == ')' || c == ']' || c == '}') {
      if (closers.empty()) fail(p, fmt::format("unexpected '{}'", c));
      if (closers.back() != c) fail(p, fmt::format("unexpected '{}', expected '{}'", c, closers.back()));
      closers.pop_back();
    }
    tokens_.push_back(Token{Token::Kind::Op, p, std::string(1, c)});
    return p + 1;
  }

  const std::string& src_;
  const Options& options_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(const std::string& source, const Options& options) {
  return Lexer(source, options).run();
}

}  // namespace lathe::jinja
