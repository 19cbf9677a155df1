// The rollout engine's kernels: attention of new tokens over a paged KV cache, row scatters into the cache, and each
// row's argmax and log-sum-exp of the logits.
//
// paged_attention, split over the context (as flash-decoding does): a block per (query token, group of up to 8 query
// heads sharing one kv head, split of the context); its four warps take the split's positions in turn, each reading a
// key and value row once through the block table for all the block's heads (a lane holds D / 32 values), summing the
// dot products across the warp and keeping an online softmax per head (running max and sum, rescaled accumulators,
// f32). Rows of 128, 256 or 512 bytes in pages of a power of two positions take paged_decode.cu's pipelined kernel
// instead (registered ahead of this one); this one serves the other head dims and block sizes, and unaligned operands.
// The warps' partial results merge in shared memory; with one split the block writes the output, else each
// split's unnormalised output, max and sum go to a workspace and a second kernel merges the splits. The launcher picks
// the splits so that about two blocks an SM run: a decode step of few sequences splits a long context many ways (a
// warp per position was latency-bound: 34 ms a step for the 1.7B shape on an H200 at batch 1), a prefill chunk of
// many tokens does not split.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/paged_device.cuh"
#include "backend/cuda/paged_launchers.h"
#include "backend/sample_hash.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

constexpr int kSplitWarps = 4;
constexpr int kMinSplitPositions = 32;

// G query heads a block, P values of a row a lane (D <= 32 P).
template <typename T, int G, int P>
__global__ void paged_attention_kernel(int64_t q_heads, int64_t kv_heads, int64_t d, int64_t bs, int64_t batch,
                                       int64_t width, int64_t split_len, float scale, const T* q, const T* kc,
                                       const T* vc, const int32_t* table, const int32_t* cu, const int32_t* ctx, T* o,
                                       float* part) {
  __shared__ float merge_acc[kSplitWarps][G][32 * P];
  __shared__ float merge_m[kSplitWarps][G], merge_l[kSplitWarps][G];
  const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32);
  const auto [i, h0, split, splits, b, kh, begin, end] = block_query(G, q_heads, kv_heads, batch, split_len, cu, ctx);
  float qv[G][P], acc[G][P], mx[G], sum[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    mx[g] = -INFINITY;
    sum[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < P; ++e) {
      const int64_t c = lane + 32 * e;
      qv[g][e] = c < d ? float(load(q, (i * q_heads + h0 + g) * d + c)) * scale : 0.0f;
      acc[g][e] = 0.0f;
    }
  }
  for (int64_t j = begin + warp; j < end; j += kSplitWarps) {
    const int64_t row = (int64_t(table[b * width + j / bs]) * bs + j % bs) * kv_heads + kh;
    float kv[P], vv[P];
#pragma unroll
    for (int e = 0; e < P; ++e) {
      const int64_t c = lane + 32 * e;
      kv[e] = c < d ? float(load(kc, row * d + c)) : 0.0f;
      vv[e] = c < d ? float(load(vc, row * d + c)) : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < P; ++e) dot += qv[g][e] * kv[e];
      dot = warp_sum(dot);
      const float nm = fmaxf(mx[g], dot), corr = expf(mx[g] - nm), p = expf(dot - nm);
      sum[g] = sum[g] * corr + p;
#pragma unroll
      for (int e = 0; e < P; ++e) acc[g][e] = acc[g][e] * corr + p * vv[e];
      mx[g] = nm;
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < P; ++e)
      if (lane + 32 * e < d) merge_acc[warp][g][lane + 32 * e] = acc[g][e];
    if (lane == 0) merge_m[warp][g] = mx[g], merge_l[warp][g] = sum[g];
  }
  __syncthreads();
  merge_slots<kSplitWarps, G, 32 * P>(merge_acc, merge_m, merge_l, d, i, q_heads, h0, split, splits, o, part);
}

// The block's largest (value, index) pair, the lowest index on ties (index -1: a thread without one), left in
// best_v[0] and best_i[0] (shared arrays of blockDim.x entries, a power of two).
template <typename V>
__device__ void block_argmax(V v, int64_t i, V* best_v, int64_t* best_i) {
  best_v[threadIdx.x] = v;
  best_i[threadIdx.x] = i;
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
}

// row_argmax_logsumexp in two kernels, so that a few long rows (a decoding step's logits: one row a sequence, the
// vocabulary wide) spread over the SMs: a block per (row, chunk of the row) — each thread's strided max with the lowest
// index (ids below `limit`) and online sum of exp (online_logsumexp_add, as the cross-entropy's), then block
// reductions: the log-sum-exp by block_reduce, the argmax by a tree over (value, lowest index) in shared memory —
// writes (max, sum, best value, best index) of its chunk (max NaN where the chunk holds a NaN); then a warp per row
// merges its chunks. (One block a row took 250 us for one row of 151,936 logits on an H200.)
template <typename T>
__global__ void row_summary_chunk_kernel(int64_t v, int64_t limit, int64_t chunk_len, const T* x, float* part) {
  __shared__ float best_v[kThreads], scratch[32];
  __shared__ int64_t best_i[kThreads];
  __shared__ int nan_seen;
  const T* row = x + int64_t(blockIdx.x) * v;
  const int64_t begin = int64_t(blockIdx.y) * chunk_len, end = min(begin + chunk_len, v);
  if (threadIdx.x == 0) nan_seen = 0;
  __syncthreads();
  float bv = -INFINITY, m = -INFINITY, sum = 0.0f;
  int64_t bi = -1;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const float f[1] = {float(load(row, j))};
    if (isnan(f[0])) nan_seen = 1;
    if (j < limit && (bi < 0 || f[0] > bv)) bv = f[0], bi = j;
    online_logsumexp_add(m, sum, f);
  }
  const float mx = block_reduce<float, true>(m, scratch);
  const float total = block_reduce<float, false>(m == -INFINITY ? sum : sum * expf(m - mx), scratch);
  block_argmax(bv, bi, best_v, best_i);
  if (threadIdx.x == 0) {
    float* p = part + (int64_t(blockIdx.x) * gridDim.y + blockIdx.y) * 4;
    p[0] = nan_seen ? NAN : mx;
    p[1] = total;
    p[2] = best_v[0];
    p[3] = float(best_i[0]);  // exact: vocabularies stay below 2^24; -1: no id below the limit in this chunk
  }
}

template <typename S>
__global__ void row_summary_merge_kernel(int64_t chunks, const float* part, int32_t* arg, S* best, S* lse) {
  const int64_t r = blockIdx.x;
  const float* p = part + r * chunks * 4;
  const int lane = int(threadIdx.x);
  float m = -INFINITY, bv = -INFINITY, bi = -1.0f;
  bool nan = false;
  for (int64_t c = lane; c < chunks; c += 32) {
    nan = nan || isnan(p[c * 4]);
    m = fmaxf(m, p[c * 4]);
  }
  m = warp_max(m);
  nan = __any_sync(0xffffffffu, nan);
  float total = 0.0f;
  for (int64_t c = lane; c < chunks; c += 32) {
    const float* q = p + c * 4;
    if (q[0] != -INFINITY) total += q[1] * expf(q[0] - m);
    // Chunks are in id order: the lowest index wins ties, as in one pass over the row.
    if (q[3] >= 0 && (bi < 0 || q[2] > bv || (q[2] == bv && q[3] < bi))) bv = q[2], bi = q[3];
  }
  total = warp_sum(total);
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o), oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) bv = ov, bi = oi;
  }
  if (lane == 0) {
    arg[r] = int32_t(bi < 0 ? 0 : bi);
    best[r] = S(bv);
    lse[r] = nan ? S(NAN) : m == -INFINITY ? S(m) : S(m + logf(total));
  }
}

template <typename E>
__global__ void scatter_rows_kernel(int64_t rows, int64_t width, const E* src, const int32_t* index, E* out) {
  for (int64_t x = global_thread(); x < rows * width; x += grid_threads())
    out[int64_t(index[x / width]) * width + x % width] = src[x];
}

}  // namespace

int64_t paged_attention_splits(int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t max_context) {
  const int64_t blocks = tokens * (q_heads / heads_a_block(q_heads / kv_heads));
  const int64_t want = (2 * multiprocessors() + blocks - 1) / blocks;
  return std::max<int64_t>(1, std::min(want, (max_context + kMinSplitPositions - 1) / kMinSplitPositions));
}

void launch_paged_attention(DType dtype, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t batch, int64_t table_width, int64_t splits, float scale,
                            const void* q, const void* k_cache, const void* v_cache, const int32_t* table,
                            const int32_t* cu_q, const int32_t* context_lens, void* o, float* workspace,
                            cudaStream_t stream) {
  if (tokens == 0) return;
  const int64_t g = heads_a_block(q_heads / kv_heads);
  const int64_t split_len = (table_width * block_size + splits - 1) / splits;
  const dim3 grid(unsigned(tokens), unsigned(q_heads / g), unsigned(splits));
  dispatch_f32_bf16_f16(dtype, "paged_attention dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const auto run = [&](auto heads) {
      constexpr int G = decltype(heads)::value;
      const auto args = [&](auto kernel) {
        kernel<<<grid, 32 * kSplitWarps, 0, stream>>>(
            q_heads, kv_heads, head_dim, block_size, batch, table_width, split_len, scale, static_cast<const T*>(q),
            static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), table, cu_q, context_lens,
            static_cast<T*>(o), workspace);
      };
      if (head_dim <= 128) args(paged_attention_kernel<T, G, 4>);
      else args(paged_attention_kernel<T, G, 8>);
    };
    with_heads_a_block(q_heads / kv_heads, run);
    LATHE_CUDA_LAUNCH_CHECK("paged_attention_kernel");
    merge_paged_splits(tokens, q_heads, head_dim, splits, workspace, static_cast<T*>(o), stream);
  });
}

namespace {

// sample_rows in four kernels, as row_argmax_logsumexp over (draw, chunk of the row) blocks: each chunk's largest
// finite logit below the limit; each draw's top-k / top-p cut (a block per draw); then, with the row's largest z,
// each chunk's sum of exp(z - max z) over its kept ids and its Gumbel argmax (score and id, in double as the CPU
// kernel); then a thread per draw merges its chunks (the lowest id wins a tie, as one pass over the row would).
template <typename T>
__global__ void sample_max_kernel(int64_t v, int64_t limit, int64_t chunk_len, const T* x, const int32_t* rows,
                                  float* part) {
  __shared__ float scratch[32];
  const T* row = x + int64_t(rows[blockIdx.x]) * v;
  const int64_t begin = int64_t(blockIdx.y) * chunk_len, end = min(begin + chunk_len, limit);
  float m = -INFINITY;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const float f = float(load(row, j));
    if (isfinite(f)) m = fmaxf(m, f);
  }
  m = block_reduce<float, true>(m, scratch);
  if (threadIdx.x == 0) part[int64_t(blockIdx.x) * gridDim.y + blockIdx.y] = m;
}

// The top-k / top-p cut of each draw (op_table.h), a block per draw, by bisection over the f32 order keys: C_k, the
// largest key with at least k ids at or above it (32 halvings of the key range, each a count over the row), then C_p,
// the smallest key above which the top-k set has less than p of its mass (33 halvings, each a sum); 0 (keep all) where
// neither is asked. In double, as the CPU kernel.
template <typename T, typename S>
__global__ void sample_cut_kernel(int64_t v, int64_t limit, int64_t chunks, const T* x, const int32_t* rows,
                                  const S* params, const float* maxes, uint32_t* cuts) {
  __shared__ double scratch[32];
  const int64_t i = blockIdx.x;
  const double t = double(params[4 * i]), top_p = double(params[4 * i + 3]);
  const int64_t top_k = int64_t(params[4 * i + 2]);
  float xmax = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) xmax = fmaxf(xmax, maxes[i * chunks + c]);
  const double zmax = double(xmax) / t;
  if ((top_k <= 0 && !(top_p < 1)) || !isfinite(zmax)) {  // block-uniform
    if (threadIdx.x == 0) cuts[i] = 0;
    return;
  }
  const T* row = x + int64_t(rows[i]) * v;
  // Over the ids with a finite z below the limit and a key >= floor: how many have a key >= bound (mass = false), or
  // the mass exp(z - zmax) of those with a key > bound (mass = true).
  const auto reduce = [&](int64_t floor, int64_t bound, bool mass) {
    double acc = 0;
    for (int64_t j = threadIdx.x; j < limit; j += blockDim.x) {
      const double z = double(load(row, j)) / t;
      if (!isfinite(z)) continue;
      const int64_t k = int64_t(ordered_key(float(z)));
      if (k < floor) continue;
      if (mass ? k > bound : k >= bound) acc += mass ? exp(z - zmax) : 1.0;
    }
    return block_reduce<double, false>(acc, scratch);
  };
  int64_t cut = 0;
  if (top_k > 0 && double(top_k) < reduce(0, 0, false)) {
    int64_t lo = 0, hi = int64_t(1) << 32;  // count(>= lo) >= k; count(>= hi) < k
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (reduce(0, mid, false) >= double(top_k)) lo = mid;
      else hi = mid;
    }
    cut = lo;
  }
  if (top_p < 1) {
    const double target = top_p * reduce(cut, -1, true);  // the top-k set's mass
    int64_t lo = -1, hi = (int64_t(1) << 32) - 1;          // mass(> lo) >= target; mass(> hi) < target
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (reduce(cut, mid, true) < target) hi = mid;
      else lo = mid;
    }
    cut = max(cut, hi);
  }
  if (threadIdx.x == 0) cuts[i] = uint32_t(cut);
}

template <typename T, typename S>
__global__ void sample_chunk_kernel(int64_t v, int64_t limit, int64_t chunk_len, const T* x, const int32_t* rows,
                                    const S* params, const int32_t* keys, const float* maxes, const uint32_t* cuts,
                                    double* part) {
  __shared__ double scratch[32], best_s[kThreads];
  __shared__ int64_t best_i[kThreads];
  const int64_t i = blockIdx.x, chunks = gridDim.y;
  const T* row = x + int64_t(rows[i]) * v;
  float xmax = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) xmax = fmaxf(xmax, maxes[i * chunks + c]);
  const double t = double(params[4 * i]), min_p = double(params[4 * i + 1]), zmax = double(xmax) / t;
  const double cut = min_p > 0 ? zmax + log(min_p) : -INFINITY;
  const uint32_t cut_key = cuts[i];
  const uint64_t key = sample_key(keys[3 * i], keys[3 * i + 1]), counter = uint64_t(uint32_t(keys[3 * i + 2]));
  const int64_t begin = int64_t(blockIdx.y) * chunk_len, end = min(begin + chunk_len, limit);
  double sum = 0.0, bs = -INFINITY;
  int64_t bi = -1;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const double z = double(load(row, j)) / t;
    if (!isfinite(z) || z < cut || ordered_key(float(z)) < cut_key) continue;
    sum += exp(z - zmax);
    const double score = z - log(-log(sample_uniform(key, counter, uint64_t(j))));
    if (bi < 0 || score > bs) bs = score, bi = j;
  }
  sum = block_reduce<double, false>(sum, scratch);
  block_argmax(bs, bi, best_s, best_i);
  if (threadIdx.x == 0) {
    double* p = part + (i * chunks + blockIdx.y) * 3;
    p[0] = sum;
    p[1] = best_s[0];
    p[2] = double(best_i[0]);
  }
}

template <typename T, typename S>
__global__ void sample_merge_kernel(int64_t m, int64_t v, int64_t chunks, const T* x, const int32_t* rows,
                                    const S* params, const float* maxes, const double* part, int32_t* token, S* logit,
                                    S* logprob) {
  const int64_t i = global_thread();
  if (i >= m) return;
  float xmax = -INFINITY;
  double total = 0.0, bs = -INFINITY, bi = -1.0;
  for (int64_t c = 0; c < chunks; ++c) {
    xmax = fmaxf(xmax, maxes[i * chunks + c]);
    const double* p = part + (i * chunks + c) * 3;
    total += p[0];
    if (p[2] >= 0 && (bi < 0 || p[1] > bs)) bs = p[1], bi = p[2];  // chunks in id order: a tie keeps the lower id
  }
  if (bi < 0) {
    token[i] = -1;
    logit[i] = logprob[i] = S(NAN);
    return;
  }
  const double t = double(params[4 * i]), x_tok = double(load(x + int64_t(rows[i]) * v, int64_t(bi)));
  token[i] = int32_t(bi);
  logit[i] = S(x_tok);
  logprob[i] = S(x_tok / t - double(xmax) / t - log(total));
}

// penalize_rows: the rows copied into y in f32 (one thread an element), then one thread an entry (the entries name
// distinct (draw, id) pairs, so no two threads write one element).
template <typename T>
__global__ void penalize_copy_kernel(int64_t m, int64_t v, const T* x, const int32_t* rows, float* y) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= m * v) return;
  const int64_t i = k / v, j = k - i * v;
  y[k] = float(load(x + int64_t(rows[i]) * v, j));
}

__global__ void penalize_entries_kernel(int64_t e, int64_t m, int64_t v, const float* params, const int32_t* entries,
                                        float* y) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= e) return;
  const int64_t i = entries[3 * k], j = entries[3 * k + 1];
  if (i < 0 || i >= m || j < 0 || j >= v) return;  // the engine makes them in range (the CPU kernel checks)
  const int32_t count = entries[3 * k + 2];
  float& l = y[i * v + j];
  if (count < 0) {
    l = -INFINITY;
    return;
  }
  const float p = params[2 * i], f = params[2 * i + 1];
  l = l > 0 ? l / p : l * p;
  l -= f * float(count);
}

}  // namespace

void launch_penalize_rows(DType dtype, int64_t m, int64_t v, int64_t e, const void* x, const int32_t* rows,
                          const float* params, const int32_t* entries, float* y, cudaStream_t stream) {
  if (m == 0) return;
  dispatch_f32_bf16_f16(dtype, "penalize_rows dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    penalize_copy_kernel<T><<<grid_for(m * v, kThreads), kThreads, 0, stream>>>(m, v, static_cast<const T*>(x), rows, y);
  });
  LATHE_CUDA_LAUNCH_CHECK("penalize_copy_kernel");
  if (e == 0) return;
  penalize_entries_kernel<<<grid_for(e, kThreads), kThreads, 0, stream>>>(e, m, v, params, entries, y);
  LATHE_CUDA_LAUNCH_CHECK("penalize_entries_kernel");
}

void launch_sample_rows(DType dtype, int64_t m, int64_t v, int64_t limit, int64_t chunks, const void* x,
                        const int32_t* rows, const void* params, const int32_t* keys, int32_t* token, void* logit,
                        void* logprob, float* maxes, uint32_t* cuts, double* part, cudaStream_t stream) {
  if (m == 0) return;
  limit = limit > 0 ? limit : v;
  const int64_t chunk_len = (limit + chunks - 1) / chunks;
  const dim3 grid{unsigned(m), unsigned(chunks)};
  dispatch_f32_bf16_f16(dtype, "sample_rows dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const T* px = static_cast<const T*>(x);
    const float* pp = static_cast<const float*>(params);
    sample_max_kernel<T><<<grid, kThreads, 0, stream>>>(v, limit, chunk_len, px, rows, maxes);
    LATHE_CUDA_LAUNCH_CHECK("sample_max_kernel");
    sample_cut_kernel<T, float><<<unsigned(m), 1024, 0, stream>>>(v, limit, chunks, px, rows, pp, maxes, cuts);
    LATHE_CUDA_LAUNCH_CHECK("sample_cut_kernel");
    sample_chunk_kernel<T, float><<<grid, kThreads, 0, stream>>>(v, limit, chunk_len, px, rows, pp, keys, maxes, cuts,
                                                                   part);
    LATHE_CUDA_LAUNCH_CHECK("sample_chunk_kernel");
    sample_merge_kernel<T, float><<<grid_for(m, kThreads), kThreads, 0, stream>>>(
        m, v, chunks, px, rows, pp, maxes, part, token, static_cast<float*>(logit), static_cast<float*>(logprob));
    LATHE_CUDA_LAUNCH_CHECK("sample_merge_kernel");
  });
}

int64_t row_argmax_logsumexp_chunks(int64_t rows, int64_t v) {
  const int64_t want = (2 * multiprocessors() + rows - 1) / std::max<int64_t>(rows, 1);
  return std::max<int64_t>(1, std::min(want, (v + 2047) / 2048));
}

void launch_row_argmax_logsumexp(DType dtype, int64_t rows, int64_t v, int64_t limit, int64_t chunks, const void* x,
                                 int32_t* arg, float* best, float* lse, float* workspace, cudaStream_t stream) {
  if (rows == 0) return;
  const int64_t chunk_len = (v + chunks - 1) / chunks;
  dispatch_f32_bf16_f16(dtype, "row_argmax_logsumexp dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    row_summary_chunk_kernel<T><<<dim3(unsigned(rows), unsigned(chunks)), kThreads, 0, stream>>>(
        v, limit > 0 ? limit : v, chunk_len, static_cast<const T*>(x), workspace);
  });
  LATHE_CUDA_LAUNCH_CHECK("row_summary_chunk_kernel");
  row_summary_merge_kernel<float><<<unsigned(rows), 32, 0, stream>>>(chunks, workspace, arg, best, lse);
  LATHE_CUDA_LAUNCH_CHECK("row_summary_merge_kernel");
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
