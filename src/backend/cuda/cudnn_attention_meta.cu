// Device helpers of the cuDNN attention kernels (cudnn_attention.cpp): the per-document tensors cuDNN's ragged graphs
// take (lengths and element offsets), derived from cu_seqlens on the device, so a call needs no host copy of them; and
// the row copies between packed documents and a padded (documents x longest) batch.
// Covered by tests/ops through the cuDNN attention kernels.
#include <cstdint>

#include "backend/cuda/check.h"
#include "core/error.h"

namespace lathe::cuda {

namespace {

// One thread per document b < batch, plus one for the end offsets (b == batch).
__global__ void ragged_meta_kernel(const int32_t* cu, int64_t batch, int32_t q_row, int32_t kv_row, int32_t stats_row,
                                   int32_t* seq_len, int32_t* q_offsets, int32_t* kv_offsets, int32_t* stats_offsets) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b > batch) return;
  const int32_t start = cu[b];
  if (b < batch) seq_len[b] = cu[b + 1] - start;
  q_offsets[b] = start * q_row;
  kv_offsets[b] = start * kv_row;
  stats_offsets[b] = start * stats_row;
}

// Block (row, b): padded row b * s + row of document b. to_padded: copied from packed row cu[b] + min(row, len - 1)
// (padding rows repeat the document's last row: finite values, hidden by the padding mask); otherwise packed row
// cu[b] + row copied from it, for row < len.
__global__ void padded_rows_kernel(const uint32_t* src, uint32_t* dst, const int32_t* cu, int64_t s, int64_t words,
                                   bool to_padded) {
  const int64_t row = blockIdx.x, b = blockIdx.y;
  const int64_t start = cu[b], len = cu[b + 1] - start;
  if (len <= 0 || (!to_padded && row >= len)) return;
  const int64_t packed = start + (row < len ? row : len - 1), padded = b * s + row;
  const uint32_t* from = src + (to_padded ? packed : padded) * words;
  uint32_t* to = dst + (to_padded ? padded : packed) * words;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) to[i] = from[i];
}

}  // namespace

void launch_cudnn_padded_rows(const void* src, void* dst, const int32_t* cu, int64_t batch, int64_t s,
                              int64_t row_bytes, bool to_padded, cudaStream_t stream) {
  LATHE_ASSERT(row_bytes % 4 == 0 && batch <= 65535);
  const int64_t words = row_bytes / 4;
  const int threads = int(words >= 256 ? 256 : (words + 31) / 32 * 32);
  padded_rows_kernel<<<dim3(unsigned(s), unsigned(batch)), threads, 0, stream>>>(
      static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), cu, s, words, to_padded);
  LATHE_CUDA_LAUNCH_CHECK("padded_rows_kernel");
}

// seq_len[b] = cu[b+1] - cu[b] (b < batch); *_offsets[b] = cu[b] * row elements (b <= batch).
void launch_cudnn_ragged_meta(const int32_t* cu, int64_t batch, int32_t q_row, int32_t kv_row, int32_t stats_row,
                              int32_t* seq_len, int32_t* q_offsets, int32_t* kv_offsets, int32_t* stats_offsets,
                              cudaStream_t stream) {
  const int threads = 256;
  const unsigned blocks = unsigned((batch + 1 + threads - 1) / threads);
  ragged_meta_kernel<<<blocks, threads, 0, stream>>>(cu, batch, q_row, kv_row, stats_row, seq_len, q_offsets,
                                                     kv_offsets, stats_offsets);
  LATHE_CUDA_LAUNCH_CHECK("ragged_meta_kernel");
}

}  // namespace lathe::cuda
