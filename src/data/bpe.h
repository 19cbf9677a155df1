// The byte-level BPE model: vocab, merge ranks and the merge loop, plus a bounded word cache.
// Convention: words are raw UTF-8 bytes, not GPT-2 "byte-level" strings; each byte starts as the id
// of its byte-level character and merges are looked up by (left id, right id), which gives the same
// ids as HF's BPE on the mapped string without building it.
// Covered by tests/data/test_tokenizer.cpp (Bpe* tests and the corpus parity tests).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lathe::data {

class BpeModel {
 public:
  // `vocab`: byte-level token string -> id. `merges`: byte-level pairs; rank = position in the list
  // (a repeated pair keeps its last rank, as HF's map does). `where` names the file for errors.
  BpeModel(std::vector<std::pair<std::string, int32_t>> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges,
           std::string_view where);
  ~BpeModel();
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of one pre-tokenized word (raw bytes, non-empty). Thread-safe; uses the cache.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  // The same without the cache; `use_heap` picks the O(n log n) priority-queue merge loop instead of
  // the rank-array scan used for short words (both give identical ids; tests compare them).
  void encode_word_uncached(std::string_view word, std::vector<int32_t>& out, bool use_heap) const;

  std::optional<int32_t> token_to_id(std::string_view byte_level_token) const;
  // The byte-level token string, or nullopt for an id outside the vocab.
  std::optional<std::string_view> id_to_token(int32_t id) const;
  // One past the largest vocab id.
  int32_t id_limit() const { return static_cast<int32_t>(id_to_token_.size()); }
  size_t vocab_count() const { return token_to_id_.size(); }
  size_t merge_count() const { return merge_count_; }

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  // Open-addressing table (left id, right id) -> (rank, merged id).
  struct MergeEntry {
    uint64_t key;  // (left << 32) | right; kEmptyKey marks a free slot
    int32_t rank;
    int32_t merged;
  };
  static constexpr uint64_t kEmptyKey = ~uint64_t{0};

  const MergeEntry* find_merge(int32_t left, int32_t right) const;
  void insert_merge(int32_t left, int32_t right, int32_t rank, int32_t merged);
  void merge_scan(std::vector<int32_t>& symbols) const;
  void merge_heap(std::vector<int32_t>& symbols) const;

  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_to_id_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> id_present_;
  std::array<int32_t, 256> byte_ids_{};
  std::vector<MergeEntry> merges_;
  uint64_t merge_mask_ = 0;
  size_t merge_count_ = 0;
  bool ignore_merges_ = false;

  class WordCache;
  std::unique_ptr<WordCache> cache_;
};

}  // namespace lathe::data
