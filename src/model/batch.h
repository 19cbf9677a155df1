// A packed batch: documents concatenated along one token axis, with cu_seqlens marking their boundaries and
// positions restarting at 0 in each document (no attention across documents, no padding).
// Covered by tests/models/test_qwen3.cpp.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "backend/runtime.h"

namespace lathe {

// LoRA routing: a contiguous run of rows served by one adapter of the model's LoraBank (model/lora.h).
struct BatchSegment {
  int64_t rows_end = 0;       // the segment is rows [previous segment's rows_end, rows_end)
  int adapter = -1;           // index into the bank; -1 = the base model alone
  double loss_scale = 1.0;    // the segment's mean loss is multiplied by this in the gradient
  uint64_t dropout_seed = 0;  // LoRA dropout masks of this segment derive from it (training only)
};

// What a decoder keeps between steps, as the model's layers see it: when a batch carries one (PackedBatch::cache), each
// document of the batch is the next tokens of one cached sequence, and the layers continue those sequences, so the
// layer maths is the model's own whether it trains or decodes (generate.h's decoders implement this).
class DecodeCache {
 public:
  virtual ~DecodeCache() = default;
  // Attention layers: stores the new tokens' rotated keys and values and returns the attention output (T, Hq, D) of
  // their queries over their sequence's cached tokens and themselves (causal among themselves).
  virtual Tensor attend(ExecContext& ctx, int64_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v) = 0;
  // Gated DeltaNet layers, per sequence in the batch's document order: the last W - 1 pre-convolution rows before the
  // new tokens (B, W - 1, C) and the recurrent state before them (B, H_v, d_k, d_v); set_gdn hands over the new ones.
  virtual Tensor conv_history(int64_t layer) = 0;
  virtual Tensor gdn_state(int64_t layer) = 0;
  virtual void set_gdn(int64_t layer, Tensor conv_history, Tensor state) = 0;
  // An index table of this step's row gathers, on the device: `values` depend only on the batch's document lengths
  // (never on token ids), so a cache may keep the table for every step of the same shape, and a recorded graph
  // (rollout_engine.h) needs it kept. `key` names the table within a step.
  virtual Tensor table(const std::string& key, const std::vector<int32_t>& values) = 0;
};

// A loss of each labelled token's log-probability in place of the cross-entropy (the RL policy losses,
// rl/policy_loss.h). Called once per forward with every labelled row's log-probability, in row order; it writes each
// row's loss term and the term's derivative by that log-probability. The batch's loss is the sum of the terms (they
// carry their own weights); the backward scales each row's cross-entropy gradient by the derivative.
using RowLoss =
    std::function<void(std::span<const double> logp, std::span<double> loss, std::span<double> dloss_dlogp)>;

struct PackedBatch {
  Tensor ids;         // (T) i32
  Tensor positions;   // (T) i32
  Tensor cu_seqlens;  // (B + 1) i32
  Tensor labels;      // (T) i32, the target of each position; -100 = no loss
  int64_t num_labelled = 0;
  std::vector<int32_t> host_ids, host_labels, host_cu;  // host copies (validation, bookkeeping)
  // Empty: no adapter. Otherwise the segments cover every row and end on document boundaries
  // (set_segments checks); the loss is then the sum over segments of loss_scale x the segment's mean loss.
  std::vector<BatchSegment> segments;
  // Decoding, in place of segments: each row's adapter on the device (T) i32, the bank's size for none; the layers
  // gather each row's adapter columns by it (LoraSlot::column_masks), so a recorded decode step serves any mix of
  // adapters. Not for adapters on the experts (their grouped GEMMs take host segments).
  Tensor row_adapters;
  DecodeCache* cache = nullptr;  // decoding: the layers continue the cached sequence (no backward)
  const RowLoss* row_loss = nullptr;  // a loss of the labelled log-probabilities (segments scale their rows)
  // With a row loss: where set, the forward also writes each labelled row's entropy of the next-token distribution
  // (-sum p log p, in row order) here (the RL loop's policy entropy).
  std::vector<double>* row_entropy = nullptr;

  int64_t tokens() const { return int64_t(host_ids.size()); }
  bool adapted() const { return !segments.empty() || row_adapters.defined(); }  // rows carry adapters
};

// Builds a batch on `device` from host vectors (validated: boundaries, id and label ranges).
PackedBatch make_packed_batch(Runtime& rt, Device device, std::vector<int32_t> ids, std::vector<int32_t> cu_seqlens,
                              std::vector<int32_t> labels, int64_t vocab_size);

// A decoding batch (for a DecodeCache): document i holds tokens[i], the next tokens of a sequence that has past[i]
// tokens already (positions past[i], past[i] + 1, ...); no labels.
PackedBatch continuation_batch(Runtime& rt, Device device, const std::vector<std::vector<int32_t>>& tokens,
                               const std::vector<int64_t>& past, int64_t vocab_size);

// Sets `b.segments` after checking that they are ordered, end on document boundaries and cover every row.
void set_segments(PackedBatch& b, std::vector<BatchSegment> segments);

// Labels for next-token prediction within each document: labels[i] = ids[i + 1], -100 at document ends.
std::vector<int32_t> next_token_labels(const std::vector<int32_t>& ids, const std::vector<int32_t>& cu_seqlens);

}  // namespace lathe
