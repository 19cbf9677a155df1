// Packing tokenized samples into fixed-capacity micro-batches, and the resumable, sharded,
// prefetching loader that cycles over a corpus forever.
// Convention: all ranks see ONE global stream of batches (epoch 0's batches, then epoch 1's, ...);
// rank r of world w takes global batches r, r+w, r+2w, ... straight across epoch boundaries, so
// every rank has a batch at every step and nothing is dropped. The saved state is the global
// position of the next round (epoch, cursor): identical on every rank, and valid for another world
// size. Labels are next-token targets within each document (labels[i] = ids[i+1] when token i+1 is
// a target, else -100; the last token of a document is always -100), as model/batch.h expects.
// Covered by tests/data/test_packing.cpp.
#pragma once

#include "data/token_file.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lathe::data {

enum class PackingAlgorithm {
  kBestFit,     // each sample, in shuffled order, goes to the open batch it fills most tightly
  kSequential,  // samples in shuffled order fill one batch at a time (order kept exactly)
};
PackingAlgorithm parse_packing_algorithm(const std::string& name);  // "best_fit" or "sequential"
const char* packing_algorithm_name(PackingAlgorithm a);

struct LoaderOptions {
  int64_t capacity = 8192;  // tokens per micro-batch; every sample must fit (max_seq_len <= capacity)
  uint64_t seed = 0;        // epoch e is shuffled with seed + e
  bool shuffle = true;
  PackingAlgorithm packing = PackingAlgorithm::kBestFit;
  int rank = 0, world = 1;  // data-parallel rank and size
  int prefetch = 4;         // batches prepared ahead on a background thread; 0 = prepared in next()
};

// One packed micro-batch, in the layout make_packed_batch (model/batch.h) takes. Not padded: T is
// the sum of the documents' lengths, at most the capacity.
struct Batch {
  std::vector<int32_t> ids;         // (T)
  std::vector<int32_t> labels;      // (T) target of each position, -100 = no loss
  std::vector<int32_t> cu_seqlens;  // (B + 1) document b is rows [cu[b], cu[b + 1])
  std::vector<int64_t> samples;     // (B) corpus index of each document
  int64_t epoch = 0;                // the epoch this batch belongs to
  int64_t index = 0;                // its position in that epoch's global batch list
  int64_t capacity = 0;
  int64_t num_labelled = 0;         // labels != -100

  int64_t tokens() const { return int64_t(ids.size()); }
  double efficiency() const { return capacity > 0 ? double(tokens()) / double(capacity) : 0.0; }
};

// The global batches of one epoch: batch b holds samples[offsets[b] .. offsets[b + 1]).
struct EpochPlan {
  std::vector<uint32_t> samples;   // corpus indices, grouped by batch
  std::vector<int64_t> offsets;    // (batches + 1)
  int64_t tokens = 0;

  int64_t batches() const { return int64_t(offsets.size()) - 1; }
  double efficiency(int64_t capacity) const;  // tokens / (batches * capacity)
};

// The deterministic plan of epoch `epoch` (shuffled with seed + epoch when options.shuffle).
EpochPlan plan_epoch(const Corpus& corpus, const LoaderOptions& options, int64_t epoch);

// Builds batch `index` of `plan` (ids, labels, cu_seqlens, samples).
Batch build_batch(const Corpus& corpus, const EpochPlan& plan, int64_t index, int64_t capacity);

// Where a loader stands: the global position of the first batch of the next round.
struct LoaderPosition {
  int64_t epoch = 0;
  int64_t cursor = 0;  // index into that epoch's batch list
  bool operator==(const LoaderPosition&) const = default;
};

// Totals over the batches a loader has returned.
struct PackingStats {
  int64_t batches = 0, samples = 0, tokens = 0, labelled = 0, capacity_tokens = 0;
  double efficiency() const { return capacity_tokens > 0 ? double(tokens) / double(capacity_tokens) : 0.0; }
};

// Cycles over `corpus` forever: shuffle, pack, shard, prefetch. The trainer decides when to stop.
class PackedLoader {
 public:
  // Starts at the beginning, or at `state` (from state() of an earlier loader over the same corpus
  // with the same seed, capacity, shuffle and packing; rank and world may differ). Throws
  // lathe::Error naming the mismatch when the state does not fit.
  PackedLoader(std::shared_ptr<const Corpus> corpus, const LoaderOptions& options,
               const nlohmann::json& state = nullptr);
  ~PackedLoader();  // stops and joins the prefetch thread
  PackedLoader(const PackedLoader&) = delete;
  PackedLoader& operator=(const PackedLoader&) = delete;

  // The next batch of this rank. Rethrows an error of the prefetch thread (and keeps rethrowing it).
  Batch next();

  // A small JSON object from which a new loader continues with exactly the batches this one would
  // return next: {"version", "epoch", "cursor", "seed", "capacity", "shuffle", "packing",
  // "corpus": {"samples", "tokens", "fingerprint"}, "rank", "world", "batches_returned"}.
  nlohmann::json state() const;
  LoaderPosition position() const;
  const PackingStats& stats() const { return stats_; }
  const LoaderOptions& options() const { return options_; }
  // Global batches in epoch 0 (later epochs differ slightly with best-fit packing).
  int64_t batches_in_first_epoch() const { return first_epoch_batches_; }

 private:
  struct Worker;
  std::shared_ptr<const Corpus> corpus_;
  LoaderOptions options_;
  uint64_t fingerprint_ = 0;
  LoaderPosition position_;
  int64_t returned_ = 0;
  int64_t first_epoch_batches_ = 0;
  PackingStats stats_;
  std::unique_ptr<Worker> worker_;
};

// A digest of the corpus' sample lengths (what the loader's state is checked against).
uint64_t corpus_fingerprint(const Corpus& corpus);

}  // namespace lathe::data
