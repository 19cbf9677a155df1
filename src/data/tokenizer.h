// Hugging Face byte-level BPE tokenizer (Qwen2/Qwen3 family) loaded from tokenizer.json.
// Convention: encode() never adds special tokens (HF add_special_tokens=False) but does match added
// tokens written in the text, like HF; anything in tokenizer.json that is not implemented is refused
// at load time with a lathe::Error naming the field and the file, never ignored.
// Covered by tests/data/test_tokenizer.cpp; docs in docs/tokenizer.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lathe::data {

struct TokenizerImpl;  // defined in tokenizer_impl.h

// One entry of tokenizer.json's "added_tokens".
struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;      // skipped by decode(..., skip_special_tokens=true)
  bool single_word = false;  // only matches when not touching word characters on either side
  bool lstrip = false;       // the match absorbs white space on its left
  bool rstrip = false;       // the match absorbs white space on its right
  bool normalized = false;   // matched in the NFC text rather than the raw text
};

class Tokenizer {
 public:
  // Reads `tokenizer_json`, and tokenizer_config.json from the same folder when it exists (for the
  // eos/pad/bos tokens). Throws lathe::Error on unreadable, malformed or unsupported files.
  static Tokenizer from_file(const std::string& tokenizer_json);
  // A model folder holding tokenizer.json (and usually tokenizer_config.json).
  static Tokenizer from_dir(const std::string& dir);
  // From JSON text; `config_json` (tokenizer_config.json text) may be empty. `source` names the
  // origin in error messages.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json,
                             std::string_view source);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of UTF-8 `text`; no special tokens are added. Throws lathe::Error on invalid UTF-8.
  // Thread-safe.
  std::vector<int32_t> encode(std::string_view text) const;
  // Appends to `ids` instead of returning a new vector.
  void encode_into(std::string_view text, std::vector<int32_t>& ids) const;

  // Text of `ids`. Byte sequences that are not valid UTF-8 (a token cut inside a character) become
  // U+FFFD per maximal ill-formed subpart, like HF. Throws lathe::Error on an id outside the vocab
  // (HF silently drops such ids). Thread-safe.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // Added tokens first, then the model vocab (byte-level strings, e.g. "Ġthe"), as HF does.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string_view> id_to_token(int32_t id) const;
  // The ids below `below` (capped at vocab_size()) that no token has: a vocabulary's holes, which a sampler must never
  // draw.
  std::vector<int32_t> ids_without_token(int64_t below) const;

  // One past the largest id of the vocab and the added tokens (151669 for Qwen3; the model's
  // embedding table may be larger).
  int32_t vocab_size() const;
  bool is_special(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;

  // From tokenizer_config.json (eos_token, pad_token, bos_token); nullopt when absent or null.
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;
  std::optional<int32_t> bos_id() const;
  // What ends a chat reply: eos_id(), then <|im_end|> where the vocabulary has it and it differs.
  std::vector<int32_t> end_of_turn_ids() const;

 private:
  explicit Tokenizer(std::unique_ptr<TokenizerImpl> impl);
  std::unique_ptr<TokenizerImpl> impl_;
};

// Copy of `bytes` with each maximal ill-formed UTF-8 subpart replaced by U+FFFD (what decode does);
// handy to clean input text before encode().
std::string replace_invalid_utf8(std::string_view bytes);

}  // namespace lathe::data
