// UTF-8 helpers, NFC through ICU, the GPT-2 byte table and PCRE2-based regex splitting.
// Convention: patterns from tokenizer.json are Oniguruma syntax (what HF tokenizers runs); they pass
// through onig_to_pcre2 so that PCRE2 gives Oniguruma's answers, and constructs that could differ are
// refused instead of guessed.
// Covered by tests/data/test_tokenizer.cpp (Utf8*, Nfc*, OnigToPcre2*, RegexSplit*, ByteLevel*).
#include "data/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string>

#include "core/error.h"

namespace lathe::data {

// ---- UTF-8 ----------------------------------------------------------------------------------------

namespace {

// Length of the well-formed sequence starting at s[i] (Unicode Table 3-7), or, when ill-formed, the
// negated length of its maximal subpart (at least 1 byte), as substitution of maximal subparts needs.
int utf8_sequence_length(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return -1;  // C0, C1, F5..FF or a stray continuation byte
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return -k;
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return -k;
  }
  return need + 1;
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    uint64_t chunk;
    if (i + 8 <= s.size() && (std::memcpy(&chunk, s.data() + i, 8), (chunk & 0x8080808080808080ull) == 0)) {
      i += 8;  // eight ASCII bytes
      continue;
    }
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const int n = utf8_sequence_length(s, i);
    if (n < 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

std::string replace_invalid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const int n = utf8_sequence_length(bytes, i);
    if (n > 0) {
      out.append(bytes.data() + i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += -n;
    }
  }
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

char32_t next_code_point(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  int extra = b0 >= 0xF0 ? 3 : b0 >= 0xE0 ? 2 : 1;
  char32_t cp = b0 & (0x3F >> extra);
  ++i;
  for (int k = 0; k < extra && i < s.size(); ++k, ++i) cp = (cp << 6) | (static_cast<unsigned char>(s[i]) & 0x3F);
  return cp;
}

// ---- NFC ----------------------------------------------------------------------------------------

namespace {

const icu::Normalizer2& nfc_instance() {
  static const icu::Normalizer2* nfc = [] {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(status);
    LATHE_CHECK(U_SUCCESS(status) && n != nullptr, "tokenizer: ICU NFC normalizer unavailable: {}",
                u_errorName(status));
    return n;
  }();
  return *nfc;
}

bool is_ascii(std::string_view s) {
  unsigned char acc = 0;
  for (char c : s) acc |= static_cast<unsigned char>(c);
  return acc < 0x80;
}

}  // namespace

bool nfc_normalize(std::string_view text, std::string& out) {
  if (is_ascii(text)) return false;
  const icu::Normalizer2& nfc = nfc_instance();
  UErrorCode status = U_ZERO_ERROR;
  const icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
  const bool already = nfc.isNormalizedUTF8(piece, status);
  LATHE_CHECK(U_SUCCESS(status), "tokenizer: ICU NFC check failed: {}", u_errorName(status));
  if (already) return false;
  out.clear();
  out.reserve(text.size() + text.size() / 8);
  icu::StringByteSink<std::string> sink(&out);
  nfc.normalizeUTF8(0, piece, sink, nullptr, status);
  LATHE_CHECK(U_SUCCESS(status), "tokenizer: ICU NFC normalization failed: {}", u_errorName(status));
  return true;
}

// ---- Byte level ----------------------------------------------------------------------------------

const std::array<char32_t, 256>& byte_to_unicode() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

std::string bytes_to_byte_level(std::string_view bytes) {
  const auto& table = byte_to_unicode();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) append_utf8(out, table[static_cast<unsigned char>(c)]);
  return out;
}

bool byte_level_to_bytes(std::string_view byte_level, std::string& out) {
  // Every table entry is below U+0144, so a flat inverse array covers it.
  static const std::array<int16_t, 324> inverse = [] {
    std::array<int16_t, 324> inv;
    inv.fill(-1);
    const auto& table = byte_to_unicode();
    for (int b = 0; b < 256; ++b) inv[table[b]] = static_cast<int16_t>(b);
    return inv;
  }();
  const size_t start = out.size();
  size_t i = 0;
  while (i < byte_level.size()) {
    const char32_t cp = next_code_point(byte_level, i);
    if (cp >= inverse.size() || inverse[cp] < 0) {
      out.resize(start);
      return false;
    }
    out += static_cast<char>(inverse[cp]);
  }
  return true;
}

// ---- Oniguruma -> PCRE2 --------------------------------------------------------------------------

namespace {

// Oniguruma's Unicode \s (doc/RE: TAB..CR, NEL, Line/Paragraph/Space separators), as class members.
constexpr std::string_view kOnigSpaceMembers = "\\t\\n\\x{0B}\\f\\r\\x{85}\\p{Zl}\\p{Zp}\\p{Zs}";

}  // namespace

std::string onig_to_pcre2(std::string_view p, std::string_view where) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  size_t class_start = 0;  // index in p just after '[' or '[^'
  auto refuse = [&](size_t at, std::string_view what) {
    LATHE_FAIL("tokenizer: {}: regex construct {} at offset {} of {:?} is not supported (its Oniguruma "
               "meaning differs from PCRE2 or is not implemented)",
               where, what, at, std::string(p));
  };
  size_t i = 0;
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\') {
      LATHE_CHECK(i + 1 < p.size(), "tokenizer: {}: regex {:?} ends with a lone backslash", where, std::string(p));
      const char e = p[i + 1];
      switch (e) {
        case 's':
          if (in_class) out += kOnigSpaceMembers;
          else out += fmt::format("[{}]", kOnigSpaceMembers);
          i += 2;
          continue;
        case 'S':
          if (in_class) refuse(i, "\\S inside a character class");
          out += fmt::format("[^{}]", kOnigSpaceMembers);
          i += 2;
          continue;
        case 'v':  // Oniguruma: the VT character; PCRE2: any vertical space
          out += "\\x{0B}";
          i += 2;
          continue;
        case 'p':
        case 'P': {
          const size_t close = p.find('}', i);
          LATHE_CHECK(i + 2 < p.size() && p[i + 2] == '{' && close != std::string_view::npos,
                      "tokenizer: {}: malformed \\p property at offset {} of {:?}", where, i, std::string(p));
          out.append(p.substr(i, close + 1 - i));
          i = close + 1;
          continue;
        }
        case 'x': {
          if (i + 2 < p.size() && p[i + 2] == '{') {
            const size_t close = p.find('}', i);
            LATHE_CHECK(close != std::string_view::npos, "tokenizer: {}: malformed \\x{{}} at offset {} of {:?}",
                        where, i, std::string(p));
            out.append(p.substr(i, close + 1 - i));
            i = close + 1;
            continue;
          }
          // \xHH is a raw byte in Oniguruma: only the ASCII half means the same code point.
          size_t j = i + 2;
          while (j < p.size() && j < i + 4 && std::isxdigit(static_cast<unsigned char>(p[j]))) ++j;
          if (j == i + 2 || std::stoi(std::string(p.substr(i + 2, j - i - 2)), nullptr, 16) >= 0x80) {
            refuse(i, "\\xHH for a non-ASCII byte");
          }
          out.append(p.substr(i, j - i));
          i = j;
          continue;
        }
        case 'u': {  // Ruby syntax \uHHHH; PCRE2 spells it \x{HHHH}
          const bool hex4 = i + 6 <= p.size() && std::all_of(p.begin() + i + 2, p.begin() + i + 6, [](char h) {
            return std::isxdigit(static_cast<unsigned char>(h)) != 0;
          });
          if (!hex4) refuse(i, "\\u not followed by four hex digits");
          out += fmt::format("\\x{{{}}}", p.substr(i + 2, 4));
          i += 6;
          continue;
        }
        case 'w': case 'W': case 'b': case 'B': case 'h': case 'H': case 'R': case 'X': case 'K':
        case 'k': case 'g': case 'N': case 'G': case 'Q': case 'E': case 'o': case 'c': case 'C': case 'M':
        case 'Z':
          refuse(i, fmt::format("\\{}", e));
          break;
        default:
          if (e >= '1' && e <= '9') refuse(i, "a backreference");
          out += c;
          out += e;
          i += 2;
          continue;
      }
    }
    if (in_class) {
      if (c == ']' && i != class_start) {
        in_class = false;
      } else if (c == '[') {
        // POSIX brackets ([:alnum:]) have other Unicode meanings in PCRE2; nested sets need &&-logic.
        refuse(i, p.substr(i, 2) == "[:" ? "a POSIX bracket class" : "a nested character class");
      } else if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') {
        refuse(i, "class intersection &&");
      }
      out += c;
      ++i;
      continue;
    }
    switch (c) {
      case '[':
        in_class = true;
        out += c;
        ++i;
        if (i < p.size() && p[i] == '^') {
          out += '^';
          ++i;
        }
        class_start = i;
        continue;
      case '^':
      case '$':
        refuse(i, fmt::format("anchor {} (line anchor in Oniguruma's Ruby syntax)", c));
        break;
      case '{':
        if (i + 1 < p.size() && p[i + 1] == ',') {  // Oniguruma's {,n} means {0,n}
          out += "{0";
          ++i;
          continue;
        }
        break;
      case '(':
        if (i + 1 < p.size() && p[i + 1] == '?') {
          const char g = i + 2 < p.size() ? p[i + 2] : '\0';
          if (g == ':' || g == '=' || g == '!' || g == '>') break;
          if (g == '<' && i + 3 < p.size() && (p[i + 3] == '=' || p[i + 3] == '!')) break;
          if (g == '<' || g == '\'') break;  // named group
          if (g == '#') refuse(i, "a (?#...) comment");
          // Inline options: only i (case folding agrees); m and x mean other things in Ruby syntax.
          size_t j = i + 2;
          while (j < p.size() && (p[j] == 'i' || p[j] == '-')) ++j;
          if (j == i + 2 || j >= p.size() || (p[j] != ':' && p[j] != ')')) refuse(i, "inline options other than i");
        }
        break;
      default:
        break;
    }
    out += c;
    ++i;
  }
  LATHE_CHECK(!in_class, "tokenizer: {}: unterminated character class in {:?}", where, std::string(p));
  return out;
}

// ---- RegexSplitter -------------------------------------------------------------------------------

struct RegexSplitter::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
  Behavior behavior = Behavior::kIsolated;
};

namespace {

// Per-thread scratch for matching: one match-data block (any pattern; only the whole-match pair is
// read) and one JIT stack large enough for long whitespace runs under \s+(?!\S).
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_jit_stack* stack = nullptr;
  pcre2_match_context* context = nullptr;
  MatchScratch() {
    data = pcre2_match_data_create(1, nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    context = pcre2_match_context_create(nullptr);
    LATHE_CHECK(data && stack && context, "tokenizer: out of memory creating PCRE2 match data");
    pcre2_jit_stack_assign(context, nullptr, stack);
    // The default limit (10M backtracking steps) is reachable by a multi-megabyte run of white space
    // under \s*[\r\n]+; the tokenizer patterns backtrack linearly, so a large limit only costs time.
    pcre2_set_match_limit(context, 4000000000u);
  }
  ~MatchScratch() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

MatchScratch& match_scratch() {
  thread_local MatchScratch scratch;
  return scratch;
}

}  // namespace

RegexSplitter::RegexSplitter(const std::string& pattern, bool literal, Behavior behavior, std::string_view where)
    : impl_(std::make_unique<Impl>()) {
  impl_->behavior = behavior;
  int error = 0;
  PCRE2_SIZE offset = 0;
  // PCRE2_LITERAL refuses PCRE2_UCP (it has no classes to apply it to).
  const uint32_t options = PCRE2_UTF | PCRE2_NO_UTF_CHECK | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error,
                              &offset, nullptr);
  if (impl_->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    LATHE_FAIL("tokenizer: {}: cannot compile regex {:?}: {} at offset {}", where, pattern,
               reinterpret_cast<const char*>(message), offset);
  }
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
}

RegexSplitter::~RegexSplitter() {
  if (impl_) pcre2_code_free(impl_->code);
}

void RegexSplitter::split(std::string_view text, std::vector<std::string_view>& out) const {
  MatchScratch& scratch = match_scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const bool keep_matches = impl_->behavior == Behavior::kIsolated;
  size_t gap_start = 0;  // start of the text not yet emitted
  size_t search = 0;
  while (search <= text.size()) {
    const int rc = impl_->jit
                       ? pcre2_jit_match(impl_->code, subject, text.size(), search, 0, scratch.data, scratch.context)
                       : pcre2_match(impl_->code, subject, text.size(), search, PCRE2_NO_UTF_CHECK, scratch.data,
                                     scratch.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      LATHE_FAIL("tokenizer: regex split failed on a text piece of {} bytes: {}", text.size(),
                 reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.data);
    const size_t start = ov[0], end = ov[1];
    if (start > gap_start) out.push_back(text.substr(gap_start, start - gap_start));
    if (end > start) {
      if (keep_matches) out.push_back(text.substr(start, end - start));
      gap_start = end;
      search = end;
    } else {
      // An empty match only marks a boundary; resume one character later, as Oniguruma's iterator does.
      gap_start = start;
      if (start >= text.size()) break;
      size_t next = start;
      next_code_point(text, next);
      search = next;
    }
  }
  if (gap_start < text.size()) out.push_back(text.substr(gap_start));
}

}  // namespace lathe::data
