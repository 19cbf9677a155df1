// Byte-level BPE: merge-table construction, the two merge loops and the sharded word cache.
// Convention: ties between equal ranks go to the leftmost pair, exactly like HF's (rank, position)
// heap; short words use an O(n^2) rank-array scan (faster in practice), long ones an O(n log n) heap.
// Covered by tests/data/test_tokenizer.cpp (Bpe* tests, corpus parity tests).
#include "data/bpe.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>

#include "core/error.h"
#include "data/pretokenize.h"

namespace lathe::data {

namespace {

constexpr int32_t kNoRank = INT32_MAX;
// Words up to this many bytes use the rank-array scan; longer ones the heap.
constexpr size_t kScanMaxBytes = 64;
// Words up to this many bytes are cached; longer ones rarely repeat.
constexpr size_t kCacheMaxBytes = 128;
constexpr size_t kCacheShards = 16;  // indexed by the top 4 hash bits

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Fibonacci hashing of the 64-bit pair key; the table size is a power of two.
uint64_t pair_hash(uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> 20; }

// Hash of a short byte string: 8-byte little-endian chunks folded with multiply-xorshift. Never 0.
uint64_t word_hash(std::string_view s) {
  uint64_t h = 0x243F6A8885A308D3ull ^ (s.size() * 0x9E3779B97F4A7C15ull);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t chunk;
    std::memcpy(&chunk, s.data() + i, 8);
    h = (h ^ chunk) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  if (i < s.size()) {
    uint64_t chunk = 0;
    std::memcpy(&chunk, s.data() + i, s.size() - i);
    h = (h ^ chunk) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  h *= 0x94D049BB133111EBull;
  h ^= h >> 29;
  return h | 1;
}

}  // namespace

// A bounded cache word -> ids: shards of flat open-addressing tables whose keys and ids live in two
// arenas, guarded by one mutex each so that encoding threads rarely meet. A full shard is simply
// cleared: cheap, and hot words come back at once.
class BpeModel::WordCache {
 public:
  bool lookup(std::string_view word, uint64_t hash, std::vector<int32_t>& out) {
    Shard& shard = shards_[hash >> 60];  // top bits: slots use the low ones
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (shard.slots.empty()) return false;
    for (size_t i = hash & kSlotMask;; i = (i + 1) & kSlotMask) {
      const Slot& slot = shard.slots[i];
      if (slot.hash == 0) return false;
      if (slot.hash == hash && slot.key_len == word.size() &&
          std::memcmp(shard.keys.data() + slot.key_offset, word.data(), word.size()) == 0) {
        const int32_t* ids = shard.ids.data() + slot.ids_offset;
        out.insert(out.end(), ids, ids + slot.id_count);
        return true;
      }
    }
  }
  void insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t count) {
    Shard& shard = shards_[hash >> 60];  // top bits: slots use the low ones
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (shard.slots.empty()) shard.slots.resize(kSlotMask + 1);
    if (shard.used >= kMaxEntries) {
      std::fill(shard.slots.begin(), shard.slots.end(), Slot{});
      shard.keys.clear();
      shard.ids.clear();
      shard.used = 0;
    }
    for (size_t i = hash & kSlotMask;; i = (i + 1) & kSlotMask) {
      Slot& slot = shard.slots[i];
      if (slot.hash == hash && slot.key_len == word.size() &&
          std::memcmp(shard.keys.data() + slot.key_offset, word.data(), word.size()) == 0) {
        return;  // another thread got here first
      }
      if (slot.hash != 0) continue;
      slot = Slot{hash, static_cast<uint32_t>(shard.keys.size()), static_cast<uint32_t>(shard.ids.size()),
                  static_cast<uint16_t>(word.size()), static_cast<uint16_t>(count)};
      shard.keys.append(word);
      shard.ids.insert(shard.ids.end(), ids, ids + count);
      ++shard.used;
      return;
    }
  }

 private:
  struct Slot {
    uint64_t hash = 0;  // 0 marks a free slot (word_hash never returns 0)
    uint32_t key_offset = 0;
    uint32_t ids_offset = 0;
    uint16_t key_len = 0;
    uint16_t id_count = 0;
  };
  static constexpr size_t kSlotMask = 8191;                    // 8192 slots per shard
  static constexpr size_t kMaxEntries = (kSlotMask + 1) / 2;  // load factor <= 0.5
  struct Shard {
    std::mutex mutex;
    std::vector<Slot> slots;  // allocated on first insert
    std::string keys;
    std::vector<int32_t> ids;
    size_t used = 0;
  };
  std::array<Shard, kCacheShards> shards_;
};

BpeModel::BpeModel(std::vector<std::pair<std::string, int32_t>> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges,
                   std::string_view where)
    : ignore_merges_(ignore_merges), cache_(std::make_unique<WordCache>()) {
  LATHE_CHECK(!vocab.empty(), "tokenizer: {}: model.vocab is empty", where);
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab) {
    LATHE_CHECK(id >= 0, "tokenizer: {}: model.vocab[{:?}] has negative id {}", where, token, id);
    max_id = std::max(max_id, id);
  }
  // Tables are indexed by id: refuse absurdly sparse ids rather than allocate gigabytes.
  LATHE_CHECK(static_cast<size_t>(max_id) < 4 * vocab.size() + 1024,
              "tokenizer: {}: model.vocab ids are too sparse (largest id {} for {} tokens)", where, max_id,
              vocab.size());
  id_to_token_.resize(static_cast<size_t>(max_id) + 1);
  id_present_.assign(static_cast<size_t>(max_id) + 1, false);
  token_to_id_.reserve(vocab.size());
  for (auto& [token, id] : vocab) {
    LATHE_CHECK(!id_present_[id], "tokenizer: {}: model.vocab maps both {:?} and {:?} to id {}", where,
                id_to_token_[id], token, id);
    id_present_[id] = true;
    id_to_token_[id] = token;
    const bool inserted = token_to_id_.emplace(std::move(token), id).second;
    LATHE_CHECK(inserted, "tokenizer: {}: model.vocab has a duplicate token {:?}", where, id_to_token_[id]);
  }

  // Every byte must have a symbol, otherwise HF would silently drop it (no unk, no byte fallback).
  std::string one;
  for (int b = 0; b < 256; ++b) {
    one.clear();
    append_utf8(one, byte_to_unicode()[b]);
    const auto it = token_to_id_.find(one);
    LATHE_CHECK(it != token_to_id_.end(),
                "tokenizer: {}: model.vocab lacks the byte-level symbol {:?} for byte 0x{:02X}; such bytes "
                "could not be encoded",
                where, one, b);
    byte_ids_[b] = it->second;
  }

  size_t slots = 1024;
  while (slots < merges.size() * 2) slots *= 2;
  merges_.assign(slots, MergeEntry{kEmptyKey, 0, 0});
  merge_mask_ = slots - 1;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const auto ia = token_to_id_.find(a);
    const auto ib = token_to_id_.find(b);
    const auto im = token_to_id_.find(a + b);
    LATHE_CHECK(ia != token_to_id_.end() && ib != token_to_id_.end() && im != token_to_id_.end(),
                "tokenizer: {}: model.merges[{}] = ({:?}, {:?}) uses a token missing from model.vocab ({:?})",
                where, rank, a, b,
                ia == token_to_id_.end() ? a : ib == token_to_id_.end() ? b : a + b);
    insert_merge(ia->second, ib->second, static_cast<int32_t>(rank), im->second);
  }
}

BpeModel::~BpeModel() = default;

const BpeModel::MergeEntry* BpeModel::find_merge(int32_t left, int32_t right) const {
  const uint64_t key = pair_key(left, right);
  for (uint64_t slot = pair_hash(key) & merge_mask_;; slot = (slot + 1) & merge_mask_) {
    const MergeEntry& e = merges_[slot];
    if (e.key == key) return &e;
    if (e.key == kEmptyKey) return nullptr;
  }
}

void BpeModel::insert_merge(int32_t left, int32_t right, int32_t rank, int32_t merged) {
  const uint64_t key = pair_key(left, right);
  for (uint64_t slot = pair_hash(key) & merge_mask_;; slot = (slot + 1) & merge_mask_) {
    MergeEntry& e = merges_[slot];
    if (e.key == kEmptyKey) ++merge_count_;
    if (e.key == kEmptyKey || e.key == key) {
      e = MergeEntry{key, rank, merged};
      return;
    }
  }
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view byte_level_token) const {
  const auto it = token_to_id_.find(byte_level_token);
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string_view> BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || id >= id_limit() || !id_present_[id]) return std::nullopt;
  return std::string_view(id_to_token_[id]);
}

// Rank-array scan: ranks[i] is the rank of (symbols[i], symbols[i+1]). Each step merges the leftmost
// lowest-ranked pair and refreshes only the two neighbouring ranks.
void BpeModel::merge_scan(std::vector<int32_t>& symbols) const {
  thread_local std::vector<int32_t> ranks, merged;
  size_t n = symbols.size();
  ranks.resize(n);
  merged.resize(n);
  auto refresh = [&](size_t i) {
    const MergeEntry* e = find_merge(symbols[i], symbols[i + 1]);
    ranks[i] = e ? e->rank : kNoRank;
    merged[i] = e ? e->merged : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) refresh(i);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i) {
      if (ranks[i] < ranks[best]) best = i;
    }
    if (ranks[best] == kNoRank) break;
    symbols[best] = merged[best];
    // Close the gap left by symbols[best + 1].
    std::copy(symbols.begin() + best + 2, symbols.begin() + n, symbols.begin() + best + 1);
    std::copy(ranks.begin() + best + 2, ranks.begin() + n, ranks.begin() + best + 1);
    std::copy(merged.begin() + best + 2, merged.begin() + n, merged.begin() + best + 1);
    --n;
    if (best > 0) refresh(best - 1);
    if (best + 1 < n) refresh(best);
  }
  symbols.resize(n);
}

// Priority-queue loop over a doubly linked list of symbols. Heap entries carry the ids they were
// computed for; an entry whose symbols have since changed is stale and skipped.
void BpeModel::merge_heap(std::vector<int32_t>& symbols) const {
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t left;
    int32_t right;
    int32_t merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<int32_t> prev, next;
  thread_local std::vector<Candidate> heap;
  const int32_t n = static_cast<int32_t>(symbols.size());
  prev.resize(n);
  next.resize(n);
  heap.clear();
  for (int32_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  auto push = [&](int32_t pos) {
    const int32_t right_pos = next[pos];
    if (right_pos < 0) return;
    if (const MergeEntry* e = find_merge(symbols[pos], symbols[right_pos])) {
      heap.push_back({e->rank, pos, symbols[pos], symbols[right_pos], e->merged});
      std::push_heap(heap.begin(), heap.end(), std::greater<>{});
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Candidate c = heap.back();
    heap.pop_back();
    const int32_t right_pos = next[c.pos];
    if (symbols[c.pos] != c.left || right_pos < 0 || symbols[right_pos] != c.right) continue;
    symbols[c.pos] = c.merged;
    symbols[right_pos] = -1;
    next[c.pos] = next[right_pos];
    if (next[c.pos] >= 0) prev[next[c.pos]] = c.pos;
    if (prev[c.pos] >= 0) push(prev[c.pos]);
    push(c.pos);
  }
  symbols.erase(std::remove(symbols.begin(), symbols.end(), -1), symbols.end());
}

void BpeModel::encode_word_uncached(std::string_view word, std::vector<int32_t>& out, bool use_heap) const {
  if (ignore_merges_) {
    if (const auto id = token_to_id(bytes_to_byte_level(word))) {
      out.push_back(*id);
      return;
    }
  }
  thread_local std::vector<int32_t> symbols;
  symbols.resize(word.size());
  for (size_t i = 0; i < word.size(); ++i) symbols[i] = byte_ids_[static_cast<unsigned char>(word[i])];
  if (use_heap) merge_heap(symbols);
  else merge_scan(symbols);
  out.insert(out.end(), symbols.begin(), symbols.end());
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_ids_[static_cast<unsigned char>(word[0])]);
    return;
  }
  const bool cacheable = word.size() <= kCacheMaxBytes;
  uint64_t hash = 0;
  if (cacheable) {
    hash = word_hash(word);
    if (cache_->lookup(word, hash, out)) return;
  }
  const size_t before = out.size();
  encode_word_uncached(word, out, word.size() > kScanMaxBytes);
  if (cacheable) cache_->insert(word, hash, out.data() + before, out.size() - before);
}

}  // namespace lathe::data
