// Internal state of lathe::data::Tokenizer, shared by tokenizer_load.cpp (builds it from JSON) and
// tokenizer.cpp (encode/decode). Not part of the public API.
// Convention: added tokens are found with a byte trie using leftmost-longest matching, the rule of
// HF's Aho-Corasick AddedVocabulary; "raw" tokens are matched before NFC, "normalized" ones after.
// Covered by tests/data/test_tokenizer.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/bpe.h"
#include "data/pretokenize.h"
#include "data/tokenizer.h"

namespace lathe::data {

// Byte trie over added-token contents.
class AddedTokenTrie {
 public:
  void add(std::string_view content, int32_t token_index);
  bool empty() const { return nodes_.size() <= 1; }
  // Whether some token starts with byte `b` (cheap pre-filter for the scan).
  bool may_start(unsigned char b) const { return first_byte_[b]; }
  // The longest token matching text[pos..]; returns its index and sets `length`, or -1.
  int32_t longest_at(std::string_view text, size_t pos, size_t& length) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t token = -1;
  };
  std::vector<Node> nodes_{1};
  std::array<bool, 256> first_byte_{};
};

struct TokenizerImpl {
  std::string source;  // file name (or caller's label) for messages

  std::unique_ptr<BpeModel> model;
  bool nfc = false;
  std::vector<std::unique_ptr<RegexSplitter>> splits;  // applied in order, then byte-level BPE

  std::vector<AddedToken> added;                          // tokenizer.json order
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> added_by_content;  // -> index in `added`
  AddedTokenTrie raw_trie;         // normalized == false: matched in the raw input
  AddedTokenTrie normalized_trie;  // normalized == true: matched in NFC text (NFC'd content)

  int32_t vocab_size = 0;
  // Per id: what HF's ByteLevel decoder emits for the token (its bytes), and its kind.
  enum class Kind : uint8_t { kAbsent, kModel, kAdded, kSpecial };
  std::vector<std::string> decoded;
  std::vector<Kind> kind;
  std::vector<int32_t> added_index_of_id;  // id -> index into `added`, or -1

  std::optional<int32_t> eos, pad, bos;

  // Encodes text outside raw added tokens: NFC, normalized added tokens, splits, BPE.
  void encode_segment(std::string_view text, std::vector<int32_t>& ids) const;
  // Splits `text` on the tokens of `trie`, emitting ids for tokens and calling `plain` on the rest.
  template <class Plain>
  void split_added(std::string_view text, const AddedTokenTrie& trie, std::vector<int32_t>& ids,
                   Plain&& plain) const;
  void encode_pretokenized(std::string_view text, std::vector<int32_t>& ids) const;
};

}  // namespace lathe::data
