// A packed batch: documents concatenated along one token axis, with cu_seqlens marking their boundaries and
// positions restarting at 0 in each document (no attention across documents, no padding).
// Covered by tests/models/test_qwen3.cpp.
#pragma once

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

// Attention over cached keys and values, for decoding: when a batch carries one (PackedBatch::cache), the model's
// attention layers hand it their new tokens' rotated queries, keys and values, and it stores the keys and values and
// returns the attention output (n, Hq, D), over the cache and the new tokens, instead of attending within the batch.
// The layer maths is the model's own either way (generate.h's decoders implement it).
class AttentionCache {
 public:
  virtual ~AttentionCache() = default;
  virtual Tensor attend(ExecContext& ctx, int64_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v) = 0;
};

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
  AttentionCache* cache = nullptr;  // decoding: attention over cached keys and values (no backward)

  int64_t tokens() const { return int64_t(host_ids.size()); }
};

// Builds a batch on `device` from host vectors (validated: boundaries, id and label ranges).
PackedBatch make_packed_batch(Runtime& rt, Device device, std::vector<int32_t> ids, std::vector<int32_t> cu_seqlens,
                              std::vector<int32_t> labels, int64_t vocab_size);

// Sets `b.segments` after checking that they are ordered, end on document boundaries and cover every row.
void set_segments(PackedBatch& b, std::vector<BatchSegment> segments);

// Labels for next-token prediction within each document: labels[i] = ids[i + 1], -100 at document ends.
std::vector<int32_t> next_token_labels(const std::vector<int32_t>& ids, const std::vector<int32_t>& cu_seqlens);

}  // namespace lathe
