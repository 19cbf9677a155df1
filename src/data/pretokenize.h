// Text-level pieces of the tokenizer pipeline: UTF-8 checks and lossy repair, NFC (ICU), the GPT-2
// byte<->unicode table, and regex splitting with PCRE2 (JIT) on Hugging Face's Oniguruma patterns.
// Convention: every function here takes and returns UTF-8 bytes; the byte-level "unicode" strings of
// the vocab never appear at run time (BPE works on raw bytes, see bpe.h).
// Covered by tests/data/test_tokenizer.cpp (Utf8*, Nfc*, RegexSplit*, ByteLevel* tests).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lathe::data {

// ---- UTF-8 ----------------------------------------------------------------------------------------

// Byte offset of the first ill-formed sequence, or std::string_view::npos when `s` is valid UTF-8.
size_t find_invalid_utf8(std::string_view s);

// Copy of `bytes` where each maximal ill-formed subpart is replaced by U+FFFD (the Unicode
// "substitution of maximal subparts" practice, as Rust's String::from_utf8_lossy and WHATWG do).
std::string replace_invalid_utf8(std::string_view bytes);

// Appends the UTF-8 encoding of code point `cp` (must be a valid scalar value).
void append_utf8(std::string& out, char32_t cp);

// Decodes the code point starting at s[i] of valid UTF-8 and advances i.
char32_t next_code_point(std::string_view s, size_t& i);

// ---- NFC ----------------------------------------------------------------------------------------

// Writes NFC(`text`) into `out` and returns true, or returns false (leaving `out` alone) when `text`
// is already in NFC. `text` must be valid UTF-8.
bool nfc_normalize(std::string_view text, std::string& out);

// ---- Byte level ----------------------------------------------------------------------------------

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in byte order, so every byte becomes one visible character.
const std::array<char32_t, 256>& byte_to_unicode();

// The byte-level string of raw bytes (each byte replaced by its character, UTF-8 encoded).
std::string bytes_to_byte_level(std::string_view bytes);

// Inverse of bytes_to_byte_level. Returns false when some character is not in the table (the
// caller then uses the raw bytes, as the HF ByteLevel decoder does).
bool byte_level_to_bytes(std::string_view byte_level, std::string& out);

// ---- Regex split ---------------------------------------------------------------------------------

// Translates an Oniguruma (Ruby syntax) pattern, as found in tokenizer.json, to PCRE2 syntax with the
// same meaning under PCRE2_UTF|PCRE2_UCP. \s and \S become explicit classes holding exactly
// Oniguruma's Unicode white space (TAB..CR, U+0085, Z*), because PCRE2's \s also matches U+180E.
// Throws lathe::Error (mentioning `where`) for constructs whose meaning differs between the engines
// (\w \b \h ^ $ nested classes, inline flags other than i, ...).
std::string onig_to_pcre2(std::string_view pattern, std::string_view where);

// A compiled pattern that splits text like HF's Split pre-tokenizer with invert=false. Thread-safe:
// per-thread match data and JIT stacks live in thread_local storage.
class RegexSplitter {
 public:
  enum class Behavior { kIsolated, kRemoved };

  // `pattern` is PCRE2 syntax already (see onig_to_pcre2) unless `literal` is set.
  RegexSplitter(const std::string& pattern, bool literal, Behavior behavior, std::string_view where);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // Appends the non-empty pieces of `text` (valid UTF-8) to `out`, in order. With kIsolated the
  // pieces cover `text`; with kRemoved the matches are dropped.
  void split(std::string_view text, std::vector<std::string_view>& out) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lathe::data
