// Device helpers shared by the paged-attention kernels (paged.cu, paged_decode.cu): which query, heads and context
// positions a block works on, and the merge of its slots' online softmaxes. Covered by the paged_attention op cases
// (src/testing/op_cases_paged.cpp).
#pragma once

#include <type_traits>

#include "backend/cuda/device_math.cuh"

namespace lathe::cuda {

// What a paged-attention block works on: query token i (blockIdx.x), its G heads from h0 (blockIdx.y) and their kv
// head kh, split `split` of `splits` (blockIdx.z), the token's sequence b (cu[b] <= i < cu[b + 1], a binary search over
// the batch's query offsets), and the split's positions [begin, end) up to the token's own.
struct BlockQuery {
  int64_t i, h0, split, splits, b, kh, begin, end;
};

__device__ __forceinline__ BlockQuery block_query(int64_t G, int64_t q_heads, int64_t kv_heads, int64_t batch,
                                                  int64_t split_len, const int32_t* cu, const int32_t* ctx) {
  const int64_t i = blockIdx.x, h0 = int64_t(blockIdx.y) * G, split = blockIdx.z;
  int64_t lo = 0, hi = batch;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= i) lo = mid;
    else hi = mid;
  }
  const int64_t b = lo, n = cu[b + 1] - cu[b], pos = ctx[b] - n + (i - cu[b]);
  const int64_t begin = split * split_len;
  return {i, h0, split, int64_t(gridDim.z), b, h0 / (q_heads / kv_heads), begin, min(begin + split_len, pos + 1)};
}

// The block's slots (warps, or groups of lanes) each hold an online softmax over some of the split's positions for
// the block's G heads: accumulators (unnormalised, D columns used of kCols), max and sum in shared memory. Merges
// them; with one split writes the output row, else the split's unnormalised row, max and sum to the workspace.
template <int kSlots, int G, int kCols, typename T>
__device__ void merge_slots(const float (&acc)[kSlots][G][kCols], const float (&mx)[kSlots][G],
                            const float (&sum)[kSlots][G], int64_t d, int64_t i, int64_t q_heads, int64_t h0,
                            int64_t split, int64_t splits, T* o, float* part) {
  for (int64_t x = threadIdx.x; x < G * d; x += blockDim.x) {
    const int g = int(x / d);
    const int64_t c = x % d;
    float m = -INFINITY;
    for (int w = 0; w < kSlots; ++w) m = fmaxf(m, mx[w][g]);
    float l = 0.0f, a = 0.0f;
    for (int w = 0; w < kSlots; ++w) {
      if (mx[w][g] == -INFINITY) continue;  // a slot without positions
      const float f = expf(mx[w][g] - m);
      l += sum[w][g] * f;
      a += acc[w][g][c] * f;
    }
    const int64_t h = h0 + g;
    if (splits == 1) {
      store(o, (i * q_heads + h) * d + c, a / l);
      continue;
    }
    float* p = part + ((i * q_heads + h) * splits + split) * (d + 2);
    p[c] = a;
    if (c == 0) p[d] = m, p[d + 1] = l;  // a split past the query's position: m = -inf, l = 0
  }
}

// The splits of a paged-attention kernel merged: a block per (query token, head), a thread per output column.
template <typename T>
__global__ void paged_attention_merge_kernel(int64_t q_heads, int64_t d, int64_t splits, const float* part, T* o) {
  const int64_t i = blockIdx.x, h = blockIdx.y;
  const float* p = part + (i * q_heads + h) * splits * (d + 2);
  float m = -INFINITY;
  for (int64_t s = 0; s < splits; ++s) m = fmaxf(m, p[s * (d + 2) + d]);
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float l = 0.0f, a = 0.0f;
    for (int64_t s = 0; s < splits; ++s) {
      const float ms = p[s * (d + 2) + d];
      if (ms == -INFINITY) continue;
      const float f = expf(ms - m);
      l += p[s * (d + 2) + d + 1] * f;
      a += p[s * (d + 2) + c] * f;
    }
    store(o, (i * q_heads + h) * d + c, a / l);
  }
}

// The query heads one block serves: the largest of 8, 4, 2, 1 that divides the group.
inline int64_t heads_a_block(int64_t group) {
  for (int64_t g : {8, 4, 2}) if (group % g == 0) return g;
  return 1;
}

// Calls f(std::integral_constant<int, G>{}) with G = heads_a_block(group).
template <typename F>
void with_heads_a_block(int64_t group, F f) {
  const int64_t g = heads_a_block(group);
  if (g == 8) f(std::integral_constant<int, 8>{});
  else if (g == 4) f(std::integral_constant<int, 4>{});
  else if (g == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

// With splits > 1: the splits' partial rows in `part` merged into o (T, Hq, D).
template <typename T>
void merge_paged_splits(int64_t tokens, int64_t q_heads, int64_t d, int64_t splits, const float* part, T* o,
                        cudaStream_t stream) {
  if (splits <= 1) return;
  paged_attention_merge_kernel<T><<<dim3(unsigned(tokens), unsigned(q_heads)), 128, 0, stream>>>(q_heads, d, splits,
                                                                                                   part, o);
  LATHE_CUDA_LAUNCH_CHECK("paged_attention_merge_kernel");
}

}  // namespace lathe::cuda
