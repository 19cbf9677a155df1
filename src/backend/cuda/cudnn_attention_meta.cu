// Device helper of the cuDNN attention kernels (cudnn_attention.cpp): the per-document tensors cuDNN's ragged graphs
// take (lengths and element offsets), derived from cu_seqlens on the device, so a call needs no host copy of them.
// Covered by tests/ops through the cuDNN attention kernels.
#include <cstdint>

#include "backend/cuda/check.h"

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

}  // namespace

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
