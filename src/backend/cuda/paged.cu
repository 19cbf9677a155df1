// The rollout engine's kernels: attention of new tokens over a paged KV cache, row scatters into the cache, and each
// row's argmax and log-sum-exp of the logits.
//
// paged_attention: one warp per (query token, query head), four heads a block; the warp walks the sequence's positions
// 0 .. the query's own, reads each key row through the block table (a lane holds D / 32 values), sums the dot product
// across the warp, and keeps an online softmax (running max and sum, rescaled accumulators) in f32. Decoding is bound
// by reading the cache, which each of the `group` heads sharing a kv head reads again (from L2, mostly).
// Covered by the paged_attention, scatter_rows and row_argmax_logsumexp op-check cases
// (src/testing/op_cases_paged.cpp).
#include <cmath>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/paged_launchers.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = 4;
constexpr int kPerLane = kMaxPagedHeadDim / 32;

template <typename T>
__global__ void paged_attention_kernel(int64_t q_heads, int64_t kv_heads, int64_t d, int64_t bs, int64_t batch,
                                       int64_t width, float scale, const T* q, const T* kc, const T* vc,
                                       const int32_t* table, const int32_t* cu, const int32_t* ctx, T* o) {
  const int lane = int(threadIdx.x % 32);
  const int64_t i = blockIdx.x;
  const int64_t h = int64_t(blockIdx.y) * kWarpsPerBlock + threadIdx.x / 32;
  if (h >= q_heads) return;
  int64_t lo = 0, hi = batch;  // the sequence b with cu[b] <= i < cu[b + 1]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= i) lo = mid;
    else hi = mid;
  }
  const int64_t b = lo, n = cu[b + 1] - cu[b], pos = ctx[b] - n + (i - cu[b]);
  const int64_t kh = h / (q_heads / kv_heads);
  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t c = lane + 32 * e;
    qv[e] = c < d ? float(load(q, (i * q_heads + h) * d + c)) : 0.0f;
    acc[e] = 0.0f;
  }
  float mx = -INFINITY, sum = 0.0f;
  for (int64_t j = 0; j <= pos; ++j) {
    const int64_t row = (int64_t(table[b * width + j / bs]) * bs + j % bs) * kv_heads + kh;
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t c = lane + 32 * e;
      if (c < d) dot += qv[e] * float(load(kc, row * d + c));
    }
    dot = warp_sum(dot) * scale;
    const float nm = fmaxf(mx, dot), corr = expf(mx - nm), p = expf(dot - nm);
    sum = sum * corr + p;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t c = lane + 32 * e;
      if (c < d) acc[e] = acc[e] * corr + p * float(load(vc, row * d + c));
    }
    mx = nm;
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int64_t c = lane + 32 * e;
    if (c < d) store(o, (i * q_heads + h) * d + c, acc[e] / sum);
  }
}

// One block per row: each thread's strided max with the lowest index (ids below `limit`) and online sum of exp over
// the whole row (online_logsumexp_add, as the cross-entropy's), then block reductions: the log-sum-exp by
// block_reduce, the argmax by a tree over (value, lowest index) in shared memory.
template <typename T, typename S>
__global__ void row_argmax_logsumexp_kernel(int64_t v, int64_t limit, const T* x, int32_t* arg, S* best, S* lse) {
  __shared__ float best_v[kThreads], scratch[32];
  __shared__ int64_t best_i[kThreads];
  __shared__ int nan_seen;
  const T* row = x + int64_t(blockIdx.x) * v;
  if (threadIdx.x == 0) nan_seen = 0;
  __syncthreads();
  float bv = -INFINITY, m = -INFINITY, sum = 0.0f;
  int64_t bi = -1;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const float f[1] = {float(load(row, j))};
    if (isnan(f[0])) nan_seen = 1;
    if (j < limit && (bi < 0 || f[0] > bv)) bv = f[0], bi = j;
    online_logsumexp_add(m, sum, f);
  }
  const float mx = block_reduce<float, true>(m, scratch);
  const float total = block_reduce<float, false>(m == -INFINITY ? sum : sum * expf(m - mx), scratch);
  best_v[threadIdx.x] = bv;
  best_i[threadIdx.x] = bi;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const int o = threadIdx.x + stride;
      const bool take = best_i[o] >= 0 && (best_i[threadIdx.x] < 0 || best_v[o] > best_v[threadIdx.x] ||
                                           (best_v[o] == best_v[threadIdx.x] && best_i[o] < best_i[threadIdx.x]));
      if (take) best_v[threadIdx.x] = best_v[o], best_i[threadIdx.x] = best_i[o];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    arg[blockIdx.x] = int32_t(best_i[0] < 0 ? 0 : best_i[0]);
    best[blockIdx.x] = S(best_v[0]);
    lse[blockIdx.x] = nan_seen ? S(NAN) : mx == -INFINITY ? S(mx) : S(mx + logf(total));
  }
}

template <typename E>
__global__ void scatter_rows_kernel(int64_t rows, int64_t width, const E* src, const int32_t* index, E* out) {
  for (int64_t x = global_thread(); x < rows * width; x += grid_threads())
    out[int64_t(index[x / width]) * width + x % width] = src[x];
}

}  // namespace

void launch_paged_attention(DType dtype, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t batch, int64_t table_width, float scale, const void* q,
                            const void* k_cache, const void* v_cache, const int32_t* table, const int32_t* cu_q,
                            const int32_t* context_lens, void* o, cudaStream_t stream) {
  if (tokens == 0) return;
  const dim3 grid(unsigned(tokens), unsigned((q_heads + kWarpsPerBlock - 1) / kWarpsPerBlock));
  dispatch_f32_bf16_f16(dtype, "paged_attention dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    paged_attention_kernel<T><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(
        q_heads, kv_heads, head_dim, block_size, batch, table_width, scale, static_cast<const T*>(q),
        static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), table, cu_q, context_lens, static_cast<T*>(o));
  });
  LATHE_CUDA_LAUNCH_CHECK("paged_attention_kernel");
}

void launch_row_argmax_logsumexp(DType dtype, int64_t rows, int64_t v, int64_t limit, const void* x, int32_t* arg,
                                 float* best, float* lse, cudaStream_t stream) {
  if (rows == 0) return;
  dispatch_f32_bf16_f16(dtype, "row_argmax_logsumexp dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    row_argmax_logsumexp_kernel<T, float><<<unsigned(rows), kThreads, 0, stream>>>(
        v, limit > 0 ? limit : v, static_cast<const T*>(x), arg, best, lse);
  });
  LATHE_CUDA_LAUNCH_CHECK("row_argmax_logsumexp_kernel");
}

void launch_scatter_rows(int64_t rows, int64_t row_bytes, const void* src, const int32_t* index, void* out,
                         cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  const auto run = [&](auto e) {
    using E = decltype(e);
    const int64_t width = row_bytes / int64_t(sizeof(E));
    scatter_rows_kernel<E><<<grid_for(rows * width, kThreads), kThreads, 0, stream>>>(
        rows, width, static_cast<const E*>(src), index, static_cast<E*>(out));
  };
  // The widest element that divides the rows and the addresses.
  const uint64_t fit = uint64_t(row_bytes) | reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(out);
  if (fit % 16 == 0) run(uint4{});
  else if (fit % 8 == 0) run(uint64_t{});
  else if (fit % 4 == 0) run(uint32_t{});
  else run(uint16_t{});
  LATHE_CUDA_LAUNCH_CHECK("scatter_rows_kernel");
}

}  // namespace lathe::cuda
