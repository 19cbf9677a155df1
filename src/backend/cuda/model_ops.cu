// CUDA kernels of the transformer-layer ops (the CPU kernels in backend/cpu/model_ops.cpp are the spec):
// embedding gather / scatter-add, RMSNorm rows (+ backward), rotate-half rope, SwiGLU (+ backward), causal
// packed attention (+ backward; one warp per row, online softmax) and cross-entropy rows.
// Convention: bf16/f16 are read and written through load/store and every sum is fp32; reductions that must be
// deterministic (rmsnorm dw, attention dk/dv) use fixed orders, never atomics. Covered by tests/ops.
#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/model_launchers.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename F> void dispatch(DType dt, const char* what, F f) {
  switch (dt) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    case DType::F16: f(__half{}); return;
    default: throw_cuda_error(what, cudaErrorInvalidValue, __FILE__, __LINE__);
  }
}

// ---------------------------------------------------------------- embedding

// One block per token row (grid-stride over rows), threads over the hidden dim.
template <typename T>
__global__ void embedding_kernel(int64_t n_tokens, int64_t hidden, int64_t vocab, const T* w, const int32_t* ids,
                                 T* out) {
  for (int64_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    const int64_t id = ids[t];
    const bool valid = id >= 0 && id < vocab;  // ids are validated on the host before upload; never read outside w
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x)
      store(out, t * hidden + c, valid ? load(w, id * hidden + c) : 0.0f);
  }
}

// fp32 atomicAdd into acc: the order of the adds for a repeated id varies from run to run, so the result is not
// bitwise deterministic (the CPU reference sums in order, in double).
template <typename T>
__global__ void embedding_scatter_add_kernel(int64_t n_tokens, int64_t hidden, int64_t vocab, const T* dy,
                                             const int32_t* ids, float* acc) {
  for (int64_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    const int64_t id = ids[t];
    if (id < 0 || id >= vocab) continue;  // validated on the host before upload; skipped here, cannot throw
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) atomicAdd(acc + id * hidden + c, load(dy, t * hidden + c));
  }
}

template <typename T> __global__ void float_to_kernel(int64_t n, const float* src, T* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(dst, i, src[i]);
}

int rows_grid(int64_t rows) { return grid_for(rows, 1); }

// ---------------------------------------------------------------- rmsnorm

template <typename T>
__global__ void rmsnorm_kernel(int64_t rows, int64_t h, float eps, float offset, const T* x, const T* w, T* y) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * h;
    float ss = 0;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float v = load(xr, j);
      ss += v * v;
    }
    ss = block_reduce<float, false>(ss, scratch);
    const float inv = rsqrtf(ss / float(h) + eps);
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) store(y, r * h + j, load(xr, j) * inv * (offset + load(w, j)));
  }
}

// dx_j = inv * g_j - x_j * inv^3 / H * sum_k g_k x_k with g = dy * (offset + w). Each block also accumulates
// dw_j = sum over its rows of dy_j x_j inv into its own row of `partial` (gridDim.x, h); a thread always owns
// the same columns, so the read-modify-writes need no atomics and the order is fixed.
template <typename T>
__global__ void rmsnorm_backward_kernel(int64_t rows, int64_t h, float eps, float offset, const T* x, const T* w,
                                        const T* dy, T* dx, float* partial) {
  __shared__ float scratch[32];
  float* pdw = partial + blockIdx.x * h;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) pdw[j] = 0.0f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * h;
    const T* dyr = dy + r * h;
    float ss = 0, dot = 0;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float xv = load(xr, j);
      ss += xv * xv;
      dot += load(dyr, j) * (offset + load(w, j)) * xv;
    }
    ss = block_reduce<float, false>(ss, scratch);
    dot = block_reduce<float, false>(dot, scratch);
    const float inv = rsqrtf(ss / float(h) + eps);
    const float coef = inv * inv * inv * dot / float(h);
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float xv = load(xr, j), dyv = load(dyr, j);
      store(dx, r * h + j, inv * dyv * (offset + load(w, j)) - xv * coef);
      pdw[j] += dyv * xv * inv;
    }
  }
}

// dw_j = sum of the partial rows in a fixed order (deterministic), in two passes so that many threads share the
// work: pass 1 sums groups of kNormGroup partial rows (grid.y = group), pass 2 sums the group sums into dw.
constexpr int64_t kNormGroup = 64;

__global__ void column_group_sum_kernel(int64_t n_partial, int64_t h, const float* partial, float* sums) {
  const int64_t g = blockIdx.y;
  const int64_t end = min(n_partial, (g + 1) * kNormGroup);
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < h; j += int64_t(gridDim.x) * blockDim.x) {
    float acc = 0;
    for (int64_t b = g * kNormGroup; b < end; ++b) acc += partial[b * h + j];
    sums[g * h + j] = acc;
  }
}

template <typename T> __global__ void column_sum_kernel(int64_t n_partial, int64_t h, const float* partial, T* dw) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < h; j += int64_t(gridDim.x) * blockDim.x) {
    float acc = 0;
    for (int64_t b = 0; b < n_partial; ++b) acc += partial[b * h + j];
    store(dw, j, acc);
  }
}

// Blocks of the rmsnorm backward = rows of partial dw: enough blocks to fill the GPU even with 32-thread blocks
// (q/k norms over head_dim 128); each walks rows / kNormPartials rows.
constexpr int64_t kNormPartials = 2048;

int norm_threads(int64_t h) { return h >= 1024 ? 256 : (h >= 256 ? 128 : 32); }

// ---------------------------------------------------------------- rope

// One thread per (token, pair i): the angle's cos and sin are computed once (precise cosf/sinf, as the CPU recipe)
// and applied to the pair (i, i + half) of every head; dims beyond the rotary part are copied by the same threads.
template <typename T>
__global__ void rope_kernel(int64_t tokens, int64_t heads, int64_t d, int64_t half, bool inverse,
                            const __grid_constant__ RopeFrequencies freqs, const T* x, const int32_t* pos, T* y) {
  const int64_t lanes = d - half;  // lanes [0, half) rotate a pair; lanes [half, d - half) copy one pass-through dim
  const int64_t n = tokens * lanes;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / lanes, i = idx % lanes;
    const T* xt = x + t * heads * d;
    T* yt = y + t * heads * d;
    if (i >= half) {  // pass-through dims 2 half .. d
      const int64_t e = i + half;
      for (int64_t h = 0; h < heads; ++h) store(yt, h * d + e, load(xt, h * d + e));
      continue;
    }
    const float angle = float(pos[t]) * freqs.inv_freq[i];
    const float cs = cosf(angle), sn = inverse ? -sinf(angle) : sinf(angle);
    for (int64_t h = 0; h < heads; ++h) {
      const float x1 = load(xt, h * d + i), x2 = load(xt, h * d + i + half);
      store(yt, h * d + i, x1 * cs - x2 * sn);
      store(yt, h * d + i + half, x2 * cs + x1 * sn);
    }
  }
}

// ---------------------------------------------------------------- swiglu

template <typename T> __global__ void swiglu_kernel(int64_t n, const T* g, const T* u, T* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gv = load(g, i);
    store(y, i, gv / (1.0f + expf(-gv)) * load(u, i));
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(int64_t n, const T* g, const T* u, const T* dy, T* dg, T* du) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gv = load(g, i), dyv = load(dy, i), s = 1.0f / (1.0f + expf(-gv));
    store(du, i, dyv * gv * s);
    store(dg, i, dyv * load(u, i) * s * (1.0f + gv * (1.0f - s)));
  }
}

// ---------------------------------------------------------------- attention
// One warp per (row, head); lane l holds dims l, l + 32, ... of a row (C = ceil(D / 32) values, C <= 8).
// Keys (or queries) are streamed kBatch at a time so the warp reductions of a batch overlap.

constexpr int kAttnThreads = 128;
constexpr int kBatch = 4;

// Document [start, end) of token i: first index b with cu[b] > i by binary search. cu_seqlens is validated on
// the host before upload; the clamps only keep malformed values from indexing outside [0, tokens).
struct DocSpan {
  int64_t start, end;
};
__device__ DocSpan document_of(const int32_t* cu, int64_t n_cu, int64_t i, int64_t tokens) {
  int64_t lo = 0, hi = n_cu;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= i) lo = mid + 1;
    else hi = mid;
  }
  int64_t start = lo > 0 ? cu[lo - 1] : 0, end = lo < n_cu ? cu[lo] : tokens;
  start = start < 0 ? 0 : (start > i ? i : start);
  end = end <= i ? i + 1 : (end > tokens ? tokens : end);
  return {start, end};
}

template <int C, typename T> __device__ void load_row(const T* p, int d, int lane, bool valid, float (&r)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) r[c] = valid && lane + 32 * c < d ? float(load(p, lane + 32 * c)) : 0.0f;
}
template <int C, typename T> __device__ void store_row(T* p, int d, int lane, const float (&r)[C], float mul) {
#pragma unroll
  for (int c = 0; c < C; ++c)
    if (lane + 32 * c < d) store(p, lane + 32 * c, r[c] * mul);
}
template <int C> __device__ float lane_dot(const float (&a)[C], const float (&b)[C]) {
  float s = 0;
#pragma unroll
  for (int c = 0; c < C; ++c) s += a[c] * b[c];
  return s;
}
// Sums each of the kBatch values over the warp (interleaved butterflies).
__device__ void warp_sum_batch(float (&s)[kBatch]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int b = 0; b < kBatch; ++b) s[b] += __shfl_xor_sync(kFullMask, s[b], o);
}

struct WarpIndex {
  int64_t first, stride;
  int lane;
};
__device__ WarpIndex warp_index() {
  const int warps = blockDim.x / 32;
  return {blockIdx.x * int64_t(warps) + threadIdx.x / 32, int64_t(gridDim.x) * warps, int(threadIdx.x % 32)};
}

template <typename T, int C>
__global__ void __launch_bounds__(kAttnThreads)
    attention_forward_kernel(AttentionDims dm, const T* q, const T* k, const T* v, const int32_t* cu, T* o, float* lse) {
  const WarpIndex wi = warp_index();
  const int d = int(dm.head_dim), lane = wi.lane;
  const int64_t rows = dm.tokens * dm.q_heads, group = dm.q_heads / dm.kv_heads;
  for (int64_t w = wi.first; w < rows; w += wi.stride) {
    // Rows in reverse: the last tokens of a document see the most keys, so they start first. Consecutive warps
    // are the heads of one token: same key count, and GQA groups share their K/V rows through L1.
    const int64_t r = rows - 1 - w, i = r / dm.q_heads, kh = (r % dm.q_heads) / group;
    const DocSpan doc = document_of(cu, dm.n_cu, i, dm.tokens);
    float qr[C], acc[C];
    load_row(q + r * d, d, lane, true, qr);
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.0f;
    float m = -INFINITY, l = 0.0f;  // running max and sum of exp(s - m)
    for (int64_t j0 = doc.start; j0 <= i; j0 += kBatch) {
      float kr[kBatch][C], vr[kBatch][C], s[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t base = ((j0 + b) * dm.kv_heads + kh) * d;
        load_row(k + base, d, lane, j0 + b <= i, kr[b]);
        load_row(v + base, d, lane, j0 + b <= i, vr[b]);
        s[b] = lane_dot(qr, kr[b]);
      }
      warp_sum_batch(s);
      float m_new = m;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        s[b] = j0 + b <= i ? s[b] * dm.scale : -INFINITY;
        m_new = fmaxf(m_new, s[b]);
      }
      const float corr = expf(m - m_new);  // m_new is finite: key j0 <= i is always valid
      l *= corr;
#pragma unroll
      for (int c = 0; c < C; ++c) acc[c] *= corr;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const float p = expf(s[b] - m_new);
        l += p;
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c] += p * vr[b][c];
      }
      m = m_new;
    }
    store_row(o + r * d, d, lane, acc, 1.0f / l);
    if (lane == 0) lse[r] = m + logf(l);
  }
}

// dq_i = sum_j dS_ij k_j with P_ij = exp(s_ij - lse_i), dS_ij = P_ij (do_i . v_j - D_i) scale; also writes
// D_i = do_i . o_i to `delta` for the dk/dv kernel (which runs after it on the same stream).
template <typename T, int C>
__global__ void __launch_bounds__(kAttnThreads)
    attention_backward_dq_kernel(AttentionDims dm, const T* q, const T* k, const T* v, const T* o, const float* lse,
                                 const T* dout, const int32_t* cu, T* dq, float* delta) {
  const WarpIndex wi = warp_index();
  const int d = int(dm.head_dim), lane = wi.lane;
  const int64_t rows = dm.tokens * dm.q_heads, group = dm.q_heads / dm.kv_heads;
  for (int64_t w = wi.first; w < rows; w += wi.stride) {
    const int64_t r = rows - 1 - w, i = r / dm.q_heads, kh = (r % dm.q_heads) / group;
    const DocSpan doc = document_of(cu, dm.n_cu, i, dm.tokens);
    float qr[C], dor[C], acc[C];
    load_row(q + r * d, d, lane, true, qr);
    load_row(dout + r * d, d, lane, true, dor);
    load_row(o + r * d, d, lane, true, acc);
    float di = lane_dot(dor, acc);
    for (int off = 16; off > 0; off >>= 1) di += __shfl_xor_sync(kFullMask, di, off);
    if (lane == 0) delta[r] = di;
    const float lse_r = lse[r];
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.0f;
    for (int64_t j0 = doc.start; j0 <= i; j0 += kBatch) {
      float kr[kBatch][C], s[kBatch], dp[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t base = ((j0 + b) * dm.kv_heads + kh) * d;
        float vr[C];
        load_row(k + base, d, lane, j0 + b <= i, kr[b]);
        load_row(v + base, d, lane, j0 + b <= i, vr);
        s[b] = lane_dot(qr, kr[b]);
        dp[b] = lane_dot(dor, vr);
      }
      warp_sum_batch(s);
      warp_sum_batch(dp);
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const float ds = j0 + b <= i ? expf(s[b] * dm.scale - lse_r) * (dp[b] - di) * dm.scale : 0.0f;
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c] += ds * kr[b][c];
      }
    }
    store_row(dq + r * d, d, lane, acc, 1.0f);
  }
}

// dk_j = sum dS_ij q_i, dv_j = sum P_ij do_i over the (query, head) pairs that see key j: queries i in
// [j, end of j's document) and the q heads of kv head kh, in a fixed order (deterministic, no atomics).
template <typename T, int C>
__global__ void __launch_bounds__(kAttnThreads)
    attention_backward_dkdv_kernel(AttentionDims dm, const T* q, const T* k, const T* v, const float* lse,
                                   const T* dout, const int32_t* cu, const float* delta, T* dk, T* dv) {
  const WarpIndex wi = warp_index();
  const int d = int(dm.head_dim), lane = wi.lane;
  const int64_t rows = dm.tokens * dm.kv_heads, group = dm.q_heads / dm.kv_heads;
  for (int64_t r = wi.first; r < rows; r += wi.stride) {  // early keys (most queries) first
    const int64_t j = r / dm.kv_heads, kh = r % dm.kv_heads;
    const DocSpan doc = document_of(cu, dm.n_cu, j, dm.tokens);
    float kr[C], vr[C], dka[C], dva[C];
    load_row(k + r * d, d, lane, true, kr);
    load_row(v + r * d, d, lane, true, vr);
#pragma unroll
    for (int c = 0; c < C; ++c) dka[c] = dva[c] = 0.0f;
    // Pairs p = (i - j) * group + (h - kh * group): the q rows of one token's group are adjacent in memory.
    const int64_t pairs = (doc.end - j) * group;
    for (int64_t p0 = 0; p0 < pairs; p0 += kBatch) {
      float qr[kBatch][C], dor[kBatch][C], s[kBatch], dp[kBatch];
      int64_t qrow[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t p = p0 + b;
        qrow[b] = (j + p / group) * dm.q_heads + kh * group + p % group;
        load_row(q + qrow[b] * d, d, lane, p < pairs, qr[b]);
        load_row(dout + qrow[b] * d, d, lane, p < pairs, dor[b]);
        s[b] = lane_dot(qr[b], kr);
        dp[b] = lane_dot(dor[b], vr);
      }
      warp_sum_batch(s);
      warp_sum_batch(dp);
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (p0 + b >= pairs) continue;
        const float pij = expf(s[b] * dm.scale - lse[qrow[b]]);
        const float ds = pij * (dp[b] - delta[qrow[b]]) * dm.scale;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          dka[c] += ds * qr[b][c];
          dva[c] += pij * dor[b][c];
        }
      }
    }
    store_row(dk + r * d, d, lane, dka, 1.0f);
    store_row(dv + r * d, d, lane, dva, 1.0f);
  }
}

template <int C> struct LaneValues {
  static constexpr int value = C;
};
// Calls f(LaneValues<C>{}) with C = ceil(head_dim / 32) rounded up to 1, 2, 4 or 8.
template <typename F> void dispatch_head_dim(int64_t head_dim, F f) {
  if (head_dim <= 32) f(LaneValues<1>{});
  else if (head_dim <= 64) f(LaneValues<2>{});
  else if (head_dim <= 128) f(LaneValues<4>{});
  else if (head_dim <= kMaxAttentionHeadDim) f(LaneValues<8>{});
  else throw_cuda_error("attention (head dim above 256)", cudaErrorInvalidValue, __FILE__, __LINE__);
}

// ---------------------------------------------------------------- cross-entropy

// One block per row: a per-thread online (max, sum of exp) over a block-stride pass, combined across the
// block; a second pass writes the gradient. Ignored rows skip the statistics.
template <typename T>
__global__ void cross_entropy_kernel(int64_t rows, int64_t vocab, int64_t ignore_index, float grad_scale, const T* x,
                                     const int32_t* labels, float* loss, T* dx) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * vocab;
    const int64_t label = labels[r];
    if (label == ignore_index) {
      if (threadIdx.x == 0) loss[r] = 0.0f;
      if (dx)
        for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) store(dx, r * vocab + j, 0.0f);
      continue;
    }
    float m = -INFINITY, s = 0.0f;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      const float xv = load(xr, j);
      if (xv > m) {
        s = s * expf(m - xv) + 1.0f;
        m = xv;
      } else if (xv != -INFINITY) {  // NaN still reaches the sum, as in the reference
        s += expf(xv - m);
      }
    }
    const float mx = block_reduce<float, true>(m, scratch);
    const float total = block_reduce<float, false>(m == -INFINITY ? 0.0f : s * expf(m - mx), scratch);
    const float lse = mx + logf(total);
    // Labels are validated on the host before upload; an out-of-range one gives a NaN loss, not a bad read.
    const bool valid = label >= 0 && label < vocab;
    if (threadIdx.x == 0) loss[r] = valid ? lse - float(load(xr, label)) : NAN;
    if (dx)
      for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x)
        store(dx, r * vocab + j, grad_scale * (expf(float(load(xr, j)) - lse) - (j == label ? 1.0f : 0.0f)));
  }
}

}  // namespace

void launch_embedding(DType dtype, int64_t n_tokens, int64_t hidden, int64_t vocab, const void* weight,
                      const int32_t* ids, void* out, cudaStream_t stream) {
  if (n_tokens == 0 || hidden == 0) return;
  dispatch(dtype, "embedding dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    embedding_kernel<T><<<rows_grid(n_tokens), 128, 0, stream>>>(n_tokens, hidden, vocab, static_cast<const T*>(weight),
                                                                  ids, static_cast<T*>(out));
  });
  LATHE_CUDA_LAUNCH_CHECK("embedding_kernel");
}

void launch_embedding_backward(DType dtype, int64_t n_tokens, int64_t hidden, int64_t vocab, const void* dy,
                               const int32_t* ids, float* acc, void* dweight, cudaStream_t stream) {
  const int64_t n = vocab * hidden;
  if (n == 0) return;
  LATHE_CUDA_CHECK(cudaMemsetAsync(acc, 0, size_t(n) * sizeof(float), stream));
  dispatch(dtype, "embedding_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    if (n_tokens > 0) {
      embedding_scatter_add_kernel<T><<<rows_grid(n_tokens), 128, 0, stream>>>(n_tokens, hidden, vocab,
                                                                                static_cast<const T*>(dy), ids, acc);
      LATHE_CUDA_LAUNCH_CHECK("embedding_scatter_add_kernel");
    }
    if (static_cast<void*>(acc) != dweight) {
      float_to_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, acc, static_cast<T*>(dweight));
      LATHE_CUDA_LAUNCH_CHECK("float_to_kernel");
    }
  });
}

void launch_rmsnorm(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x, const void* w,
                    void* y, cudaStream_t stream) {
  if (rows == 0 || h == 0) return;
  dispatch(dtype, "rmsnorm dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    rmsnorm_kernel<T><<<rows_grid(rows), norm_threads(h), 0, stream>>>(
        rows, h, float(eps), float(offset), static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y));
  });
  LATHE_CUDA_LAUNCH_CHECK("rmsnorm_kernel");
}

int64_t rmsnorm_backward_scratch_floats(int64_t rows, int64_t h) {
  const int64_t n_partial = rows < kNormPartials ? rows : kNormPartials;
  return (n_partial + (n_partial + kNormGroup - 1) / kNormGroup) * h;  // partial rows, then the group sums
}

void launch_rmsnorm_backward(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                             const void* w, const void* dy, void* dx, void* dw, float* scratch, cudaStream_t stream) {
  if (h == 0) return;
  if (rows == 0) {  // no rows: dw is zero (every dtype's zero is all-zero bytes)
    LATHE_CUDA_CHECK(cudaMemsetAsync(dw, 0, size_t(h) * dtype_size(dtype), stream));
    return;
  }
  const int64_t n_partial = rows < kNormPartials ? rows : kNormPartials;
  dispatch(dtype, "rmsnorm_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    rmsnorm_backward_kernel<T><<<int(n_partial), norm_threads(h), 0, stream>>>(
        rows, h, float(eps), float(offset), static_cast<const T*>(x), static_cast<const T*>(w),
        static_cast<const T*>(dy), static_cast<T*>(dx), scratch);
    LATHE_CUDA_LAUNCH_CHECK("rmsnorm_backward_kernel");
    const int64_t groups = (n_partial + kNormGroup - 1) / kNormGroup;
    float* sums = scratch + n_partial * h;
    column_group_sum_kernel<<<dim3(unsigned(grid_for(h, kThreads)), unsigned(groups)), kThreads, 0, stream>>>(
        n_partial, h, scratch, sums);
    LATHE_CUDA_LAUNCH_CHECK("column_group_sum_kernel");
    column_sum_kernel<T><<<grid_for(h, kThreads), kThreads, 0, stream>>>(groups, h, sums, static_cast<T*>(dw));
    LATHE_CUDA_LAUNCH_CHECK("column_sum_kernel");
  });
}

void launch_rope(DType dtype, int64_t tokens, int64_t heads, int64_t d, int64_t half, bool inverse,
                 const RopeFrequencies& freqs, const void* x, const int32_t* positions, void* y, cudaStream_t stream) {
  const int64_t n = tokens * heads * d;
  if (n == 0) return;
  if (half > kMaxRopeHalf) throw_cuda_error("rope (rotary dim above 512)", cudaErrorInvalidValue, __FILE__, __LINE__);
  dispatch(dtype, "rope dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const int64_t threads = tokens * (d - half);
    rope_kernel<T><<<grid_for(threads, kThreads), kThreads, 0, stream>>>(tokens, heads, d, half, inverse, freqs,
                                                                         static_cast<const T*>(x), positions, static_cast<T*>(y));
  });
  LATHE_CUDA_LAUNCH_CHECK("rope_kernel");
}

void launch_swiglu(DType dtype, int64_t n, const void* g, const void* u, void* y, cudaStream_t stream) {
  if (n == 0) return;
  dispatch(dtype, "swiglu dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    swiglu_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, static_cast<const T*>(g), static_cast<const T*>(u),
                                                                      static_cast<T*>(y));
  });
  LATHE_CUDA_LAUNCH_CHECK("swiglu_kernel");
}

void launch_swiglu_backward(DType dtype, int64_t n, const void* g, const void* u, const void* dy, void* dg, void* du,
                            cudaStream_t stream) {
  if (n == 0) return;
  dispatch(dtype, "swiglu_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    swiglu_backward_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        n, static_cast<const T*>(g), static_cast<const T*>(u), static_cast<const T*>(dy), static_cast<T*>(dg),
        static_cast<T*>(du));
  });
  LATHE_CUDA_LAUNCH_CHECK("swiglu_backward_kernel");
}

void launch_attention(DType dtype, const AttentionDims& dims, const void* q, const void* k, const void* v,
                      const int32_t* cu_seqlens, void* o, float* lse, cudaStream_t stream) {
  const int64_t rows = dims.tokens * dims.q_heads;
  if (rows == 0 || dims.head_dim == 0) return;
  dispatch(dtype, "attention dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    dispatch_head_dim(dims.head_dim, [&](auto c) {
      attention_forward_kernel<T, decltype(c)::value><<<grid_for(rows * 32, kAttnThreads), kAttnThreads, 0, stream>>>(
          dims, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), cu_seqlens,
          static_cast<T*>(o), lse);
    });
  });
  LATHE_CUDA_LAUNCH_CHECK("attention_forward_kernel");
}

void launch_attention_backward(DType dtype, const AttentionDims& dims, const void* q, const void* k, const void* v,
                               const void* o, const float* lse, const void* dout, const int32_t* cu_seqlens,
                               void* dq, void* dk, void* dv, float* delta, cudaStream_t stream) {
  const int64_t rows = dims.tokens * dims.q_heads, kv_rows = dims.tokens * dims.kv_heads;
  if (rows == 0 || dims.head_dim == 0) return;
  dispatch(dtype, "attention_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    dispatch_head_dim(dims.head_dim, [&](auto c) {
      constexpr int kC = decltype(c)::value;
      attention_backward_dq_kernel<T, kC><<<grid_for(rows * 32, kAttnThreads), kAttnThreads, 0, stream>>>(
          dims, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(o),
          lse, static_cast<const T*>(dout), cu_seqlens, static_cast<T*>(dq), delta);
      LATHE_CUDA_LAUNCH_CHECK("attention_backward_dq_kernel");
      attention_backward_dkdv_kernel<T, kC><<<grid_for(kv_rows * 32, kAttnThreads), kAttnThreads, 0, stream>>>(
          dims, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), lse,
          static_cast<const T*>(dout), cu_seqlens, delta, static_cast<T*>(dk), static_cast<T*>(dv));
      LATHE_CUDA_LAUNCH_CHECK("attention_backward_dkdv_kernel");
    });
  });
}

void launch_cross_entropy(DType dtype, int64_t rows, int64_t vocab, int64_t ignore_index, double grad_scale,
                          const void* logits, const int32_t* labels, float* loss, void* dlogits, cudaStream_t stream) {
  if (rows == 0) return;
  const int threads = vocab >= 8192 ? 512 : 128;
  dispatch(dtype, "cross_entropy dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    cross_entropy_kernel<T><<<rows_grid(rows), threads, 0, stream>>>(rows, vocab, ignore_index, float(grad_scale),
                                                                     static_cast<const T*>(logits), labels, loss,
                                                                     static_cast<T*>(dlogits));
  });
  LATHE_CUDA_LAUNCH_CHECK("cross_entropy_kernel");
}

}  // namespace lathe::cuda
