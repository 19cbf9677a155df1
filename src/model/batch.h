// A packed batch: documents concatenated along one token axis, with cu_seqlens marking their boundaries and
// positions restarting at 0 in each document (no attention across documents, no padding).
// Covered by tests/models/test_qwen3.cpp.
#pragma once

#include <vector>

#include "backend/runtime.h"

namespace lathe {

struct PackedBatch {
  Tensor ids;         // (T) i32
  Tensor positions;   // (T) i32
  Tensor cu_seqlens;  // (B + 1) i32
  Tensor labels;      // (T) i32, the target of each position; -100 = no loss
  int64_t num_labelled = 0;
  std::vector<int32_t> host_ids, host_labels, host_cu;  // host copies (validation, bookkeeping)

  int64_t tokens() const { return int64_t(host_ids.size()); }
};

// Builds a batch on `device` from host vectors (validated: boundaries, id and label ranges).
PackedBatch make_packed_batch(Runtime& rt, Device device, std::vector<int32_t> ids, std::vector<int32_t> cu_seqlens,
                              std::vector<int32_t> labels, int64_t vocab_size);

// Labels for next-token prediction within each document: labels[i] = ids[i + 1], -100 at document ends.
std::vector<int32_t> next_token_labels(const std::vector<int32_t>& ids, const std::vector<int32_t>& cu_seqlens);

}  // namespace lathe
