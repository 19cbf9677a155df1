// The rollout engine: many sequences generated at once, continuously batched, over a paged KV cache, through the
// model's own layers (the batch's DecodeCache is the engine's step view; no family's layer maths is repeated here).
//
// - Paged KV cache (PagedKvPool): each attention layer's rotated keys and values live in fixed-size blocks of
//   `block_size` tokens, (blocks x block_size, Hkv, D) per layer; a sequence holds a block table. The pool is sized
//   once (EngineOptions::cache_blocks or cache_bytes); blocks are handed out as sequences grow and returned when they
//   finish.
// - Gated DeltaNet layers keep a conv history and a recurrent state per running sequence, in `max_running` slots.
// - Continuous batching: every step runs one model call over the running sequences' next tokens (one each while
//   decoding) and chunks of waiting prompts, at most `max_step_tokens` tokens; sequences join and leave every step.
//   A prompt longer than what a step has room for is prefilled in chunks over several steps.
// - Preemption by recomputation: when the pool has no free block for a step, the most recently admitted running
//   sequence gives its blocks and slot back and waits again with everything it has so far (prompt and generated
//   tokens), which it prefills again when readmitted; its sampler's state is kept, so its tokens are the same.
// - Prefix sharing: the n samples of a request run as one sequence until its prompt is in the cache; then the other
//   samples fork from it: they share its whole prompt blocks (reference counts), get a copy of its last, partial
//   block and of its GDN history and state, and draw their first token from the same logits. Nothing writes to a
//   shared block: every sequence's next tokens go to its own partial block or to new ones. A sample that finds no
//   free block or slot at the fork waits and computes its prompt itself.
// - Adapters per request: a request may name an adapter of the LoRA bank attached to the model (CausalLm::attach_lora);
//   each sequence of a step is a segment of the batch (PackedBatch::segments) with its adapter, so one model call
//   serves every tenant, through the same segment machinery as multi-tenant training.
// - Sampling: greedy and temperature / top-k / top-p / min-p draws on the device (row_argmax_logsumexp, sample_rows: a
//   Gumbel argmax over counter-based variates keyed by the request's seed and the sample's index, above a top-k /
//   top-p cut), penalties and banned ids too (penalize_rows first); only a request whose allowed vocabulary differs
//   from the step's draws on the host (sample_next, model/generate.h), with one mt19937_64 per sequence seeded from
//   the same two.
//   Either way a sequence's tokens do not depend on what else is in the batch. Each token comes with its
//   log-probability under the model's distribution (log-softmax of the raw logits) and under the distribution it was
//   drawn from.
//
// Attention over the pages: every new token's key and value goes to its cache row (scatter_rows), then the sequences
// with a past attend the pages in one paged_attention call (ops/op_table.h: query length 1 or a chunk, GQA, over the
// block tables) and the first chunks of new sequences attend among themselves through the training attention op.
// Gated DeltaNet histories and states are gathered from their slots (a row gather) and written back (scatter_rows).
// Decode steps (one new token for every sequence) run at fixed shapes, padded, recorded once per shape as a graph and
// replayed (StepGraphs, FixedSteps in the .cpp). Generator (model/generate.h) runs single prompts through the engine.
// Covered by tests/models/test_rollout.cpp.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

#include "model/causal_lm.h"
#include "model/generate.h"

namespace lathe {

// How decode steps (every running sequence one new token) run.
enum class StepGraphs {
  kAuto,    // kOn where the model and device can be recorded (measured faster by median step at batch 1, 64 and 256
            // for the dense and hybrid shapes, docs/rollout.md), otherwise kOff
  kOn,      // recorded: a model or device that cannot is refused when the engine is made
  kPadded,  // padded to the recorded shapes and run eagerly (what a graph replays, on any device and family: tests)
  kOff,     // every step as it comes
};

struct EngineOptions {
  int64_t block_size = 16;         // tokens per KV block
  int64_t cache_blocks = 0;        // blocks in the pool; 0: as many as cache_memory_fraction or cache_bytes hold
  double cache_memory_fraction = 0.0;  // > 0: this fraction of the device's free memory when the engine is made
  int64_t cache_bytes = int64_t(1) << 30;
  // > 0: the pool holds no more blocks than this, however much memory is free: a caller that knows its requests
  // passes what they can use (blocks_needed), so a memory fraction does not take room the rest of the run needs.
  int64_t max_cache_blocks = 0;
  int64_t max_step_tokens = 2048;  // tokens one model call takes (decodes and prefill chunks together)
  int64_t max_running = 64;        // sequences in the running batch (and Gated DeltaNet state slots)
  bool share_prefixes = true;      // the n samples of a request share its prompt's cache, computed once
  StepGraphs graphs = StepGraphs::kAuto;  // decode steps as CUDA graphs (steps of LoRA batches run eagerly)
  bool time_forwards = false;      // time each step's layers on the device (EngineStats::*_forward_ms; events)
};

// The KV blocks n samples of a prompt of `prompt_tokens` use at most (each its own, no prefix shared) with up to
// `max_new_tokens` new tokens each.
int64_t blocks_needed(const EngineOptions& o, int64_t prompt_tokens, int64_t max_new_tokens, int64_t n);
// The device memory an engine's cache takes with `blocks` KV blocks: the attention layers' blocks (and the pad rows'
// scratch block) and, for Gated DeltaNet layers, max_running (+ 1 scratch) conv and recurrent state slots.
int64_t cache_bytes(const ModelConfig& c, const ModelOptions& mo, const EngineOptions& o, int64_t blocks);

struct RolloutRequest {
  std::vector<int32_t> prompt;     // at least one token
  int n = 1;                       // samples of this prompt
  int64_t max_new_tokens = 256;
  SamplingOptions sampling;        // temperature 0: greedy
  uint64_t seed = 0;               // sample i draws from mt19937_64 seeded by (seed, i)
  std::vector<int32_t> stop_ids;   // any of them ends a sample (it is kept in its tokens)
  int adapter = -1;                // the LoRA adapter of the model's attached bank that serves it; -1: the base
  int64_t allowed_vocab = 0;       // ids at or above it are never drawn (0: the model's vocabulary)
  std::vector<int32_t> banned_ids;  // never drawn (a tokenizer's holes)
  // Called with each sample's generated tokens, once each, in order; true ends the sample with finish reason kStop
  // (the token kept): stop strings, matched on the decoded text by the caller (TextStream).
  std::function<bool(int sample, int32_t token)> on_token;
};

struct RolloutResult {
  int64_t request = 0;             // submit()'s number
  int sample = 0;                  // 0 .. n - 1
  std::vector<int32_t> tokens;     // generated ids
  std::vector<double> logprobs;    // each token's log-probability under the model's distribution
  std::vector<double> sampling_logprobs;  // and under the distribution it was drawn from (SampledToken::logprob)
  FinishReason finish_reason = FinishReason::kLength;  // kEos: a stop id; kStop: on_token; kLength: the limits
};

struct EngineStats {
  int64_t steps = 0, step_tokens = 0, preemptions = 0, peak_blocks_used = 0, peak_running = 0;
  int64_t shared_prompt_tokens = 0;  // prompt tokens samples took from their request's first sample, not computed
  int64_t padded_steps = 0;          // decode steps run eagerly at a fixed shape (each graph's first step included)
  int64_t graphs_recorded = 0, graph_replays = 0;
  // With EngineOptions::time_forwards: the device time from before a step's layers to after its LM head, summed over
  // the decode steps that replayed a graph and over those that ran eagerly (both only for decode steps).
  double replay_forward_ms = 0, eager_forward_ms = 0;
  int64_t eager_decode_steps = 0;
};

class RolloutEngine {
 public:
  // The model's parameters are read at every step (a weight update in between is used as it is then).
  RolloutEngine(Runtime& rt, CausalLm& model, EngineOptions options = {});
  ~RolloutEngine();
  RolloutEngine(const RolloutEngine&) = delete;
  RolloutEngine& operator=(const RolloutEngine&) = delete;

  // Queues a request's n samples; returns its number (0, 1, ...). Checked here: tokens in the vocabulary, a prompt
  // that fits the model's context and the cache.
  int64_t submit(RolloutRequest request);
  // One model call over the next tokens of the running and newly admitted sequences; false when nothing is left.
  // Under expert parallelism (ModelOptions::ep) every rank of the group steps while any has work (each forward is the
  // group's collective): a rank with none runs a filler forward, and true is returned.
  bool step();
  // The samples finished since the last call, in the order they finished.
  std::vector<RolloutResult> take_finished();
  // Steps until every submitted sample is finished; returns them ordered by request, then sample.
  std::vector<RolloutResult> run();
  // Drops a request's samples that are not finished (they are not reported).
  void abort(int64_t request);

  const EngineStats& stats() const { return stats_; }
  int64_t running() const { return int64_t(running_.size()); }
  int64_t cache_blocks() const;

 private:
  struct Sequence;
  struct StepCoords;
  class StepView;
  class Pool;
  class TableStore;
  class FixedSteps;

  StepCoords step_coords(const std::vector<Sequence*>& batch, const std::vector<int64_t>& chunk) const;
  // The step's logits (B, V) after each batch sequence's chunk (timed on the device for time_forwards).
  Tensor step_logits(const std::vector<Sequence*>& batch, const std::vector<int64_t>& chunk);
  Tensor step_logits_untimed(const std::vector<Sequence*>& batch, const std::vector<int64_t>& chunk);
  static bool decode_step(const std::vector<Sequence*>& batch, const std::vector<int64_t>& chunk);
  bool fixed_shape_step(const std::vector<Sequence*>& batch, const std::vector<int64_t>& chunk) const;

  bool schedule(std::vector<Sequence*>& batch, std::vector<int64_t>& chunk);
  bool any_rank_busy(bool busy);  // expert parallelism: the ranks' step agreement
  void filler_forward();
  void admit(Sequence& s);
  bool fork(Sequence& leader, Sequence& follower);
  int64_t allowed_vocab(const Sequence& s) const;
  bool plain_greedy(const Sequence& s, int64_t limit) const;
  bool device_drawn(const Sequence& s, int64_t limit) const;
  // The draws made on the device, in three groups: sampled from the logits (sample_rows: token, logit, logprob),
  // sampled from penalised rows (penalize_rows, then sample_rows) and greedy over penalised rows (row_argmax_logsumexp:
  // token, logit). A group's outputs start at out[first[group]] (-1: no draw in it); sequence q's draw is entry i of
  // its group. A penalised draw's logit is the penalised one; `entries` (id -> generated count, -1 banned) and the
  // penalties undo that for the model's log-probability (unpenalized).
  struct DeviceDraws {
    enum Group { kSampled, kPenalisedSampled, kPenalisedGreedy };
    struct Draw {
      Group group;
      size_t i;
      double repetition = 1, frequency = 0;  // as the kernel used them (f32 for a low-precision model)
      std::unordered_map<int32_t, int32_t> entries;
    };
    std::unordered_map<const Sequence*, Draw> index;
    int first[3] = {-1, -1, -1};
    std::vector<Tensor> out;  // empty when nothing was drawn on the device
  };
  static double unpenalized(const DeviceDraws::Draw& d, int32_t token, double logit);
  DeviceDraws draw_on_device(ExecContext& cx, const Tensor& logits, const std::vector<Sequence*>& batch,
                             const std::vector<size_t>& ready, int64_t limit);
  // Draws the next token of `s` from `row` (its logits) on the host.
  SampledToken draw(Sequence& s, std::span<const double> row, std::vector<float>& scratch);
  // Appends the token with its log-probabilities; true when that finishes `s`.
  bool take(Sequence& s, int32_t token, double logprob, double sampling_logprob);
  bool reserve_blocks(Sequence& s, int64_t tokens);
  void preempt(Sequence& s);
  void release(Sequence& s);
  void finish(Sequence& s, FinishReason why);

  Runtime* rt_;
  CausalLm* model_;
  EngineOptions options_;
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<TableStore> tables_;  // the eager steps' index tables
  std::unique_ptr<FixedSteps> fixed_;   // null: every step eager (StepGraphs::kOff, or kAuto where none records)
  std::unique_ptr<Event> forward_start_, forward_end_;  // EngineOptions::time_forwards
  std::deque<std::unique_ptr<Sequence>> waiting_;  // front: next to admit (preempted sequences go first)
  std::vector<std::unique_ptr<Sequence>> running_;  // in admission order
  std::vector<RolloutResult> finished_;
  int64_t next_request_ = 0;
  EngineStats stats_;
};

}  // namespace lathe
