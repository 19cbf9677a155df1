// CUDA kernels of the gated delta rule (research note gated-deltanet.md §2-§4; the CPU specification is
// backend/cpu/gdn_reference.cpp), forward and backward, for f32, bf16 and f16 (float math); the other Gated DeltaNet ops
// (sigmoid, the log-decay, the conv1d) are in gdn_pointwise.cu. The rule also takes g and beta (and gives dg, dbeta)
// in f32 beside bf16/f16 q, k, v: the model's log-decay stays fp32 end to end, as in transformers.
//
// The gated delta rule has two implementations; neither depends on attrs.chunk (the result does not either):
//  * chunked, bf16 with d_k = d_v = 128 (the model's): the WY form with chunks of 64 tokens starting at each
//    document's first token, on tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulation).
//      forward : prep (per chunk and value head, parallel): b = cumsum g, L, R = (I + L)^-1 by blocked forward
//                substitution in fp32, W = R diag(beta e^b) K, U = R diag(beta) V, P = tril(Q K^T Gamma) (bf16);
//                scan (per document, value head, half or quarter of d_v): the state in fp32 registers; per chunk
//                Delta = U - W S, O = s [e^b Q S + tril(Q K^T Gamma) Delta], S = e^{b_n} S + (Gamma_n K)^T Delta.
//      backward: prep again (also saving R), the forward scan saving the chunk-start states H[c] and Delta, a
//                reverse scan (dS in registers) saving dH[c] and dDelta, then per chunk and value head (parallel,
//                two kernels of two blocks per SM each) dq, dk, dv, dbeta, dg through the output and state terms and
//                through the WY form (§3.5 steps 5-7). Intermediates (W, U, R, H, dH, Delta) are bf16 as in fla.
//      saved states: a training forward (attrs.save_states) also writes H[c] from its scan; the backward given them
//                skips its forward scan and forms Delta = U - W H[c] chunk-parallel (delta_kernel) from the same bf16
//                operands with the same mma, so its gradients are bitwise those of the recomputing backward.
//      chunk cache: where it applies (ops.h) the saving forward also keeps b, W, U, P, R and its scan's Delta in the
//                op's chunk cache; the backward given it and the states runs neither prep nor delta_kernel.
//  * recurrent, every other dtype / dim: one block per (document, value head) walks the tokens with the state
//    (d_k x d_v fp32) in shared memory (and writes it before every 64-token chunk where states are saved); the
//    backward recomputes states from checkpoints every 64 tokens (it does not read saved states).
// GQA: value head h reads key head h / (H_v / H_k); dq and dk are first written per value head (fp32 scratch)
// and then summed over each group in a fixed order, so every output is bitwise reproducible (no atomics). Without
// GQA (H_v = H_k) the chunked kernels write dq and dk in bf16 directly (same rounding, no group-sum pass).
// The chunked kernels' tensor-core and shared-memory building blocks (Tile, ldmatrix, mma, tile loads) are in
// gdn_tiles.cuh.
// Covered by tests/ops (testing/op_cases_gated_delta.cpp), tests/ops/test_gdn_cuda.cpp (determinism) and
// tests/models/test_qwen3_5_cuda.cpp.
#include <cuda_bf16.h>

#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/gated_delta_launchers.h"
#include "backend/cuda/gdn_device.cuh"
#include "backend/cuda/gdn_tiles.cuh"

namespace lathe::cuda {

namespace {

// f(T{}, G{}): T the dtype of q, k, v; G that of g, beta (T itself, or float where `gate` is F32).
template <typename F> void dispatch_gates(DType dt, DType gate, F f) {
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    if (gate == DType::F32) f(T{}, float{});
    else f(T{}, T{});
  });
}

// offsets[d] = number of 64-token chunks in documents before d (offsets[docs] = total).
__global__ void chunk_offsets_kernel(const int32_t* cu, int64_t docs, int64_t tokens, int32_t* offsets) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int32_t acc = 0;
  for (int64_t d = 0; d < docs; ++d) {
    offsets[d] = acc;
    const Span sp = doc_span(cu, d, tokens);
    acc += int32_t((sp.end - sp.start + kChunk - 1) / kChunk);
  }
  offsets[docs] = acc;
}

// Zeroes the saved-state rows past the last chunk: bytes [offsets[docs] * row_bytes, rows * row_bytes).
__global__ void zero_state_tail_kernel(const int32_t* offsets, int64_t docs, int64_t rows, int64_t row_bytes,
                                       unsigned char* states) {
  const int64_t end = rows * row_bytes;
  for (int64_t i = int64_t(offsets[docs]) * row_bytes + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x)
    states[i] = 0;
}

struct ChunkLoc {
  int64_t doc, t0;
  int n;
};
// Chunk `id` of the packed batch (chunks numbered document by document), or false past the last one.
__device__ bool locate_chunk(const int32_t* offsets, const int32_t* cu, int64_t docs, int64_t tokens, int64_t id,
                             ChunkLoc& c) {
  if (id >= offsets[docs]) return false;
  int64_t lo = 0, hi = docs + 1;  // first index with offsets[idx] > id
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= id) lo = mid + 1;
    else hi = mid;
  }
  c.doc = lo - 1;
  const Span sp = doc_span(cu, c.doc, tokens);
  c.t0 = sp.start + (id - offsets[c.doc]) * kChunk;
  c.n = int(min(int64_t(kChunk), sp.end - c.t0));
  return true;
}

int64_t max_chunks(const GdnShape& s) { return s.tokens / kChunk + s.docs; }

// ------------------------------------------------------------------------------- delta rule: shared pieces
// Sum over each group of value heads: out (T, H_k, d) = sum_{h in group} src (T, H_v, d), in head order.
// Rows of `dim` values: output row (t, k) sums the `group` consecutive source rows (t, k * group + j).
template <typename T>
__global__ void group_sum_kernel(int64_t tokens, int64_t hk, int64_t group, int64_t dim, const float* src, T* out) {
  const int64_t n = tokens * hk * dim;
  if (dim % 8 == 0) {  // 8 values a thread: two float4 reads per source row, one 16-byte bf16 store (8 of f32)
    for (int64_t i = 8 * global_thread(); i < n; i += 8 * grid_threads()) {
      const int64_t d = i % dim, row = i / dim;  // row = t * hk + k; its first source row is row * group
      float s[8] = {};
      for (int64_t j = 0; j < group; ++j) {
        const Pack<float, 8> x = load_pack<float, 8>(src + (row * group + j) * dim + d);
#pragma unroll
        for (int k = 0; k < 8; ++k) s[k] += x.e[k];
      }
      Pack<T, 8> o;
#pragma unroll
      for (int k = 0; k < 8; ++k) store(o.e, k, s[k]);
      store_pack(out + i, o);
    }
    return;
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % dim, row = i / dim;
    float s = 0;
    for (int64_t j = 0; j < group; ++j) s += src[(row * group + j) * dim + d];
    store(out, i, s);
  }
}

struct RecurrentArgs {
  int64_t tokens, docs, hk, hv, group, dk, dv;
  float scale;
  const int32_t* cu;
};

// ------------------------------------------------------------------- delta rule: recurrent (any dims/dtype)
// One block per (document, value head); S (d_k, d_v) fp32 in shared memory; token by token:
// S <- e^g S; u = beta (v - S^T k); S <- S + k u^T; o = s S^T q.
// `states` (optional): the state before every 64-token chunk, row offsets[doc] + chunk (the op's saved states).
template <typename T, typename G>
__global__ void __launch_bounds__(kThreads) recurrent_forward_kernel(RecurrentArgs a, const T* q, const T* k,
                                                                      const T* v, const G* g, const G* beta, T* o,
                                                                      const int32_t* offsets, T* states) {
  extern __shared__ float sm[];
  const int64_t dk = a.dk, dv = a.dv;
  float* S = sm;            // (dk, dv)
  float* sk = S + dk * dv;  // (dk)
  float* sq = sk + dk;      // (dk)
  float* su = sq + dk;      // (dv)
  const int64_t doc = blockIdx.x, h = blockIdx.y, kh = h / a.group;
  const Span sp = doc_span(a.cu, doc, a.tokens);
  for (int64_t e = threadIdx.x; e < dk * dv; e += blockDim.x) S[e] = 0;
  __syncthreads();
  for (int64_t t = sp.start; t < sp.end; ++t) {
    if (states && (t - sp.start) % kChunk == 0) {
      T* row = states + ((offsets[doc] + (t - sp.start) / kChunk) * a.hv + h) * dk * dv;
      for (int64_t e = threadIdx.x; e < dk * dv; e += blockDim.x) store(row, e, S[e]);
    }
    for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
      sk[i] = load(k, (t * a.hk + kh) * dk + i);
      sq[i] = load(q, (t * a.hk + kh) * dk + i);
    }
    const float alpha = expf(load(g, t * a.hv + h)), b = load(beta, t * a.hv + h);
    __syncthreads();
    for (int64_t j = threadIdx.x; j < dv; j += blockDim.x) {
      float pred = 0;
      for (int64_t i = 0; i < dk; ++i) pred += S[i * dv + j] * sk[i];
      su[j] = b * (load(v, (t * a.hv + h) * dv + j) - alpha * pred);
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < dk * dv; e += blockDim.x) S[e] = alpha * S[e] + sk[e / dv] * su[e % dv];
    __syncthreads();
    for (int64_t j = threadIdx.x; j < dv; j += blockDim.x) {
      float acc = 0;
      for (int64_t i = 0; i < dk; ++i) acc += S[i * dv + j] * sq[i];
      store(o, (t * a.hv + h) * dv + j, a.scale * acc);
    }
    __syncthreads();
  }
}

constexpr int64_t kCkpt = 64;  // recurrent backward: tokens between state checkpoints

// Persistent blocks over (document, value head) pairs. `ckpt` holds the state before every kCkpt-th token of each
// document (indexed by the global chunk id), `tok` this block's states inside one checkpoint interval, `us` the
// writes u of that interval. dq, dk go to per-value-head fp32 scratch.
template <typename T, typename G>
__global__ void __launch_bounds__(kThreads) recurrent_backward_kernel(
    RecurrentArgs a, const T* q, const T* k, const T* v, const G* g, const G* beta, const T* d_o,
    const int32_t* offsets, float* ckpt, float* tok_all, float* us_all, float* dqh, float* dkh, T* dv_out, G* dg_out,
    G* dbeta_out) {
  extern __shared__ float sm[];
  __shared__ float scratch[32];
  const int64_t dk = a.dk, dv = a.dv, ss = dk * dv;
  float* dS = sm;            // (dk, dv)
  float* sk = dS + ss;       // (dk)
  float* sq = sk + dk;       // (dk)
  float* sdo = sq + dk;      // (dv)
  float* sdu = sdo + dv;     // (dv)
  float* sdp = sdu + dv;     // (dv) dpred
  float* tok = tok_all + int64_t(blockIdx.x) * (kCkpt + 1) * ss;
  float* us = us_all + int64_t(blockIdx.x) * kCkpt * dv;
  for (int64_t pair = blockIdx.x; pair < a.docs * a.hv; pair += gridDim.x) {
    const int64_t doc = pair / a.hv, h = pair % a.hv, kh = h / a.group;
    const Span sp = doc_span(a.cu, doc, a.tokens);
    const int64_t nck = (sp.end - sp.start + kCkpt - 1) / kCkpt;
    // Forward: the checkpoints. tok[0] is the running state.
    for (int64_t e = threadIdx.x; e < ss; e += blockDim.x) tok[e] = 0;
    for (int64_t c = 0; c < nck; ++c) {
      float* ck = ckpt + (int64_t(offsets[doc]) + c) * a.hv * ss + h * ss;
      __syncthreads();
      for (int64_t e = threadIdx.x; e < ss; e += blockDim.x) ck[e] = tok[e];
      const int64_t t_end = min(sp.end, sp.start + (c + 1) * kCkpt);
      for (int64_t t = sp.start + c * kCkpt; t < t_end; ++t) {
        __syncthreads();
        for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) sk[i] = load(k, (t * a.hk + kh) * dk + i);
        const float alpha = expf(load(g, t * a.hv + h)), b = load(beta, t * a.hv + h);
        __syncthreads();
        for (int64_t j = threadIdx.x; j < dv; j += blockDim.x) {
          float pred = 0;
          for (int64_t i = 0; i < dk; ++i) pred += tok[i * dv + j] * sk[i];
          sdu[j] = b * (load(v, (t * a.hv + h) * dv + j) - alpha * pred);
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < ss; e += blockDim.x) tok[e] = alpha * tok[e] + sk[e / dv] * sdu[e % dv];
      }
    }
    // Reverse, one checkpoint interval at a time.
    for (int64_t e = threadIdx.x; e < ss; e += blockDim.x) dS[e] = 0;
    for (int64_t c = nck - 1; c >= 0; --c) {
      const int64_t t0 = sp.start + c * kCkpt, n = min(kCkpt, sp.end - t0);
      const float* ck = ckpt + (int64_t(offsets[doc]) + c) * a.hv * ss + h * ss;
      __syncthreads();
      for (int64_t e = threadIdx.x; e < ss; e += blockDim.x) tok[e] = ck[e];
      for (int64_t r = 0; r < n; ++r) {  // tok[r + 1] = state after token t0 + r; us[r] = its write u
        const int64_t t = t0 + r;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) sk[i] = load(k, (t * a.hk + kh) * dk + i);
        const float alpha = expf(load(g, t * a.hv + h)), b = load(beta, t * a.hv + h);
        __syncthreads();
        const float* s0 = tok + r * ss;
        float* s1 = tok + (r + 1) * ss;
        for (int64_t j = threadIdx.x; j < dv; j += blockDim.x) {
          float pred = 0;
          for (int64_t i = 0; i < dk; ++i) pred += s0[i * dv + j] * sk[i];
          us[r * dv + j] = b * (load(v, (t * a.hv + h) * dv + j) - alpha * pred);
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < ss; e += blockDim.x) s1[e] = alpha * s0[e] + sk[e / dv] * us[r * dv + e % dv];
      }
      for (int64_t r = n - 1; r >= 0; --r) {
        const int64_t t = t0 + r;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
          sk[i] = load(k, (t * a.hk + kh) * dk + i);
          sq[i] = load(q, (t * a.hk + kh) * dk + i);
        }
        for (int64_t j = threadIdx.x; j < dv; j += blockDim.x) sdo[j] = load(d_o, (t * a.hv + h) * dv + j);
        const float alpha = expf(load(g, t * a.hv + h)), b = load(beta, t * a.hv + h);
        const float* s_old = tok + r * ss;
        const float* s_new = tok + (r + 1) * ss;
        const float* u = us + r * dv;
        __syncthreads();
        // o = s S_new^T q: dq = s S_new do; dS += s q do^T.
        for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
          float acc = 0;
          for (int64_t j = 0; j < dv; ++j) acc += s_new[i * dv + j] * sdo[j];
          dqh[(t * a.hv + h) * dk + i] = a.scale * acc;
        }
        for (int64_t e = threadIdx.x; e < ss; e += blockDim.x) dS[e] += a.scale * sq[e / dv] * sdo[e % dv];
        __syncthreads();
        // S_new = S_bar + k u^T: du = dS^T k, dk = dS u. u = beta (v - S_bar^T k).
        float db_part = 0;
        for (int64_t j = threadIdx.x; j < dv; j += blockDim.x) {
          float du = 0, pred = 0;
          for (int64_t i = 0; i < dk; ++i) {
            du += dS[i * dv + j] * sk[i];
            pred += s_old[i * dv + j] * sk[i];
          }
          pred *= alpha;
          db_part += du * (load(v, (t * a.hv + h) * dv + j) - pred);
          sdu[j] = du;
          sdp[j] = -b * du;
          store(dv_out, (t * a.hv + h) * dv + j, b * du);
        }
        const float dbeta = block_reduce<float, false>(db_part, scratch);
        __syncthreads();
        for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
          float acc = 0, acc2 = 0;
          for (int64_t j = 0; j < dv; ++j) {
            acc += dS[i * dv + j] * u[j];
            acc2 += s_old[i * dv + j] * sdp[j];
          }
          dkh[(t * a.hv + h) * dk + i] = acc + alpha * acc2;
        }
        __syncthreads();
        // dS is now dS_bar; S_bar = e^g S_old: dg = <S_bar, dS_bar>, dS_old = e^g dS_bar.
        float dg_part = 0;
        for (int64_t e = threadIdx.x; e < ss; e += blockDim.x) {
          const float d = dS[e] + sk[e / dv] * sdp[e % dv];
          dg_part += alpha * s_old[e] * d;
          dS[e] = alpha * d;
        }
        const float dgv = block_reduce<float, false>(dg_part, scratch);
        if (threadIdx.x == 0) {
          store(dg_out, t * a.hv + h, dgv);
          store(dbeta_out, t * a.hv + h, dbeta);
        }
      }
    }
    __syncthreads();
  }
}

// ------------------------------------------------------------------ delta rule: chunked, tensor cores (bf16)
constexpr int kD = 128;            // d_k = d_v
constexpr int kLdD = kD + 8;       // bf16 row stride of (rows, 128) tiles: 272 bytes, 16-byte aligned, no conflicts
constexpr int kLdC = kChunk + 8;   // bf16 row stride of (rows, 64) tiles
constexpr int kLdF = kChunk + 4;   // fp32 row stride of (64, 64) tiles: 16-byte aligned rows (float4 reads)
constexpr int kVTile = 64;         // d_v columns per block of the chunk-parallel backward kernels

struct ChunkArgs {
  int64_t tokens, docs, hk, hv, group;
  float scale;
  const int32_t* cu;
  const int32_t* offsets;
  const bf16 *q, *k, *v, *d_o;
  const void *g, *beta;  // bf16, or f32 where gates_f32 (dg, dbeta likewise)
  bool gates_f32;
  float* b;          // (T, H_v) chunk-local cumsum of g
  bf16 *w, *u;       // (T, H_v, 128)
  bf16* p;           // (T, H_v, 64): row t of its chunk's tril(Q K^T Gamma) (the intra-chunk output matrix)
  bf16* r;           // (T, H_v, 64): row t of its chunk's R (backward only)
  bf16 *hs, *dhs;    // (chunks, H_v, 128, 128): chunk-start states, gradients of chunk-end states
  bf16 *delta, *ddelta;  // (T, H_v, 128)
  float *dqh, *dkh;  // (T, H_v, 128)
  bf16 *dq, *dk;     // (T, H_k, 128) outputs written directly when H_v = H_k (no group sum); else null
  bf16* dw;          // (T, H_v, 128) dW = -dDelta H^T
  float* dbp;        // (T, H_v) the step-5 part of db
  bf16 *o, *dv;
  void *dg, *dbeta;
};

// g, beta (and dg, dbeta) of a chunked call: bf16 or f32.
__device__ __forceinline__ float gate_at(const ChunkArgs& a, const void* p, int64_t i) {
  return a.gates_f32 ? static_cast<const float*>(p)[i] : __bfloat162float(static_cast<const bf16*>(p)[i]);
}
__device__ __forceinline__ void gate_store(const ChunkArgs& a, void* p, int64_t i, float x) {
  if (a.gates_f32) static_cast<float*>(p)[i] = x;
  else static_cast<bf16*>(p)[i] = __float2bfloat16(x);
}

// Loads g, beta of a chunk and forms b = cumsum(g) (rows past n repeat b_{n-1}).
__device__ void chunk_gates(const ChunkArgs& a, int64_t t0, int n, int64_t h, float* sb, float* sbeta) {
  if (threadIdx.x < kChunk) {
    const int r = threadIdx.x;
    sb[r] = r < n ? gate_at(a, a.g, (t0 + r) * a.hv + h) : 0.0f;
    sbeta[r] = r < n ? gate_at(a, a.beta, (t0 + r) * a.hv + h) : 0.0f;
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // inclusive scan of 64 values: two per lane
    const int lane = threadIdx.x;
    float x0 = sb[2 * lane], x1 = x0 + sb[2 * lane + 1];
    float s = x1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    const float before = s - x1;
    sb[2 * lane] = before + x0;
    sb[2 * lane + 1] = s;
  }
  __syncthreads();
}

// R = (I + L)^-1 for strictly lower L (64 x 64 fp32, stride kLdF): the four 16 x 16 diagonal blocks by forward
// substitution (a warp each, a lane per column), then R_IJ = -R_II sum_{J <= M < I} L_IM R_MJ by increasing I - J.
__device__ void solve_unit_lower(const float* L, float* R, float* X) {
  for (int e = threadIdx.x; e < kChunk * kLdF; e += blockDim.x) R[e] = 0;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 4 && lane < 16) {
    const int base = 16 * warp;
    float x[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      float val = m == lane ? 1.0f : 0.0f;
#pragma unroll
      for (int j = 0; j < m; ++j) val -= L[(base + m) * kLdF + base + j] * x[j];
      x[m] = val;
      R[(base + m) * kLdF + base + lane] = val;
    }
  }
  __syncthreads();
  // Off-diagonal blocks: a thread computes 4 adjacent columns of one row (float4 reads of R and X).
  for (int d = 1; d < 4; ++d) {
    const int pairs = 4 - d;
    for (int e = threadIdx.x; e < pairs * 64; e += blockDim.x) {
      const int J = e / 64, I = J + d, i = (e % 64) / 4, j = 4 * (e % 4);
      float4 acc = make_float4(0, 0, 0, 0);
      for (int m = 16 * J; m < 16 * I; ++m) {
        const float l = L[(16 * I + i) * kLdF + m];
        const float4 r = *reinterpret_cast<const float4*>(R + m * kLdF + 16 * J + j);
        acc.x += l * r.x, acc.y += l * r.y, acc.z += l * r.z, acc.w += l * r.w;
      }
      *reinterpret_cast<float4*>(X + J * 256 + i * 16 + j) = acc;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < pairs * 64; e += blockDim.x) {
      const int J = e / 64, I = J + d, i = (e % 64) / 4, j = 4 * (e % 4);
      float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        const float rr = R[(16 * I + i) * kLdF + 16 * I + m];
        const float4 x = *reinterpret_cast<const float4*>(X + J * 256 + m * 16 + j);
        acc.x += rr * x.x, acc.y += rr * x.y, acc.z += rr * x.z, acc.w += rr * x.w;
      }
      *reinterpret_cast<float4*>(R + (16 * I + i) * kLdF + 16 * J + j) = make_float4(-acc.x, -acc.y, -acc.z, -acc.w);
    }
    __syncthreads();
  }
}

// Per chunk and value head: b, R, W = R diag(beta e^b) K, U = R diag(beta) V (and R itself when asked).
constexpr size_t kPrepSmem = sizeof(bf16) * (3 * kChunk * kLdD + kChunk * kLdC) +
                             sizeof(float) * (2 * kChunk * kLdF + 3 * 256 + 2 * kChunk);
__global__ void __launch_bounds__(kThreads) prep_kernel(ChunkArgs a, bool store_r) {
  ChunkLoc c;
  if (!locate_chunk(a.offsets, a.cu, a.docs, a.tokens, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y, kh = h / a.group;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Kb = reinterpret_cast<bf16*>(smem);  // (64, kLdD)
  bf16* Vb = Kb + kChunk * kLdD;             // (64, kLdD)
  bf16* Qb = Vb + kChunk * kLdD;             // (64, kLdD); later P staging (64, kLdC)
  bf16* Rb = Qb + kChunk * kLdD;             // (64, kLdC)
  float* Lf = reinterpret_cast<float*>(Rb + kChunk * kLdC);
  float* Rf = Lf + kChunk * kLdF;
  float* X = Rf + kChunk * kLdF;
  float* sb = X + 3 * 256;
  float* sbeta = sb + kChunk;
  load_tile<kD>(Kb, kLdD, a.k, c.t0, c.n, a.hk, kh, kD, 0);
  load_tile<kD>(Vb, kLdD, a.v, c.t0, c.n, a.hv, h, kD, 0);
  load_tile<kD>(Qb, kLdD, a.q, c.t0, c.n, a.hk, kh, kD, 0);
  cp_async_wait_all();
  chunk_gates(a, c.t0, c.n, h, sb, sbeta);  // starts with a barrier
  if (threadIdx.x < c.n) a.b[(c.t0 + threadIdx.x) * a.hv + h] = sb[threadIdx.x];
  {
    Tile<64, 64> kk;
    kk.zero();
    kk.mma<false, false>(Kb, kLdD, Kb, kLdD, kD);
    const int n = c.n;
    kk.each_pair([&](int r, int s, float x0, float x1) {
      const float m0 = (s < r && r < n) ? sbeta[r] * __expf(sb[r] - sb[s]) : 0.0f;
      const float m1 = (s + 1 < r && r < n) ? sbeta[r] * __expf(sb[r] - sb[s + 1]) : 0.0f;
      *reinterpret_cast<float2*>(Lf + r * kLdF + s) = make_float2(m0 * x0, m1 * x1);
    });
  }
  Tile<64, 64> pq;  // P = tril(Q K^T Gamma)
  pq.zero();
  pq.mma<false, false>(Qb, kLdD, Kb, kLdD, kD);
  __syncthreads();
  {
    const int n = c.n;
    pq.each_pair([&](int r, int s, float x0, float x1) {  // staged in the Q buffer, stored after the solve
      const float m0 = (s <= r && r < n) ? __expf(sb[r] - sb[s]) : 0.0f;
      const float m1 = (s + 1 <= r && r < n) ? __expf(sb[r] - sb[s + 1]) : 0.0f;
      st_bf2(Qb + r * kLdC + s, m0 * x0, m1 * x1);
    });
  }
  for (int e = threadIdx.x; e < c.n * kD / 2; e += blockDim.x) {  // K <- diag(beta e^b) K, V <- diag(beta) V
    const int r = e / (kD / 2), col = 2 * (e % (kD / 2));
    __nv_bfloat162* pk = reinterpret_cast<__nv_bfloat162*>(Kb + r * kLdD + col);
    __nv_bfloat162* pv = reinterpret_cast<__nv_bfloat162*>(Vb + r * kLdD + col);
    const float2 fk = __bfloat1622float2(*pk), fv = __bfloat1622float2(*pv);
    const float mk = sbeta[r] * __expf(sb[r]), mv = sbeta[r];
    *pk = __floats2bfloat162_rn(fk.x * mk, fk.y * mk);
    *pv = __floats2bfloat162_rn(fv.x * mv, fv.y * mv);
  }
  solve_unit_lower(Lf, Rf, X);  // starts and ends with a barrier
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int r = e / kChunk, s = e % kChunk;
    Rb[r * kLdC + s] = __float2bfloat16(Rf[r * kLdF + s]);
  }
  __syncthreads();
  const int n = c.n;
  const int64_t t0 = c.t0;
  store_tile<kChunk>(a.p, t0, n, a.hv, h, kChunk, 0, Qb, kLdC);
  if (store_r)
    for (int e = threadIdx.x; e < n * kChunk; e += blockDim.x) {
      const int r = e / kChunk, s = e % kChunk;
      a.r[((t0 + r) * a.hv + h) * kChunk + s] = Rb[r * kLdC + s];
    }
  Tile<64, 128> wt, ut;
  wt.zero();
  wt.mma<false, true>(Rb, kLdC, Kb, kLdD, kChunk);
  ut.zero();
  ut.mma<false, true>(Rb, kLdC, Vb, kLdD, kChunk);
  __syncthreads();  // staged through Kb, Vb for 16-byte stores
  wt.each_pair([&](int r, int col, float x0, float x1) { st_bf2(Kb + r * kLdD + col, x0, x1); });
  ut.each_pair([&](int r, int col, float x0, float x1) { st_bf2(Vb + r * kLdD + col, x0, x1); });
  __syncthreads();
  store_tile<kD>(a.w, t0, n, a.hv, h, kD, 0, Kb, kLdD);
  store_tile<kD>(a.u, t0, n, a.hv, h, kD, 0, Vb, kLdD);
}

// The forward state scan over the chunks of one (document, value head, kScanV columns of d_v); the state lives in
// fp32 registers (a (128, kScanV) tile). kStates: save H[c] and Delta for the backward instead of computing outputs.
// kDouble: every tile a chunk reads (W, U, Q, P, K and b) has two buffers, and the next chunk's are fetched into the
// other as soon as this one starts, so a chunk waits on no load issued less than a chunk before (where the blocks fit
// one wave of one block an SM; session 36). Without it the block's shared memory stays small enough for two blocks an
// SM (where the grid has more blocks than SMs): W, U, Q and P of the next chunk are fetched once this one has read
// them, K and b at the chunk's start.
// The state update S <- e^{b_n} S + (Gamma_n K)^T Delta takes Gamma_n on Delta's rows (K^T (Gamma_n Delta)): a
// (64, kScanV) tile formed with Delta, instead of scaling K's (64, 128) tile in every block and chunk, which was a
// large part of the walk (docs/benchmarks.md, session 36).
constexpr size_t scan_smem(bool double_buffered) {
  const int bufs = double_buffered ? 2 : 1;
  return sizeof(bf16) * (bufs * (3 * kChunk * kLdD + 2 * kChunk * kLdC) + 2 * kChunk * kLdC + kD * kLdC) +
         sizeof(float) * bufs * kChunk;
}
// The blocks an SM a scan variant is built for: two for the single-buffered variants of up to 32 columns (their
// registers and shared memory leave room for a second block where the grid exceeds one wave), else one.
constexpr int scan_blocks_per_sm(int columns, bool double_buffered) {
  return !double_buffered && columns <= 32 ? 2 : 1;
}
// kScanV: d_v columns per block (state tile (128, kScanV)), 64, 32 or 16.
template <bool kStates, int kScanV, bool kDouble>
__global__ void __launch_bounds__(kThreads, scan_blocks_per_sm(kScanV, kDouble)) scan_forward_kernel(ChunkArgs a) {
  const int64_t doc = blockIdx.x, h = blockIdx.y, kh = h / a.group;
  const int jv0 = blockIdx.z * kScanV;
  const Span sp = doc_span(a.cu, doc, a.tokens);
  if (sp.end <= sp.start) return;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kBufs = kDouble ? 2 : 1;
  bf16* Wbuf = reinterpret_cast<bf16*>(smem);  // kBufs x (64, kLdD) each: W, Q, K
  bf16* Qbuf = Wbuf + kBufs * kChunk * kLdD;
  bf16* Kbuf = Qbuf + kBufs * kChunk * kLdD;
  bf16* Ubuf = Kbuf + kBufs * kChunk * kLdD;   // kBufs x (64, kLdC) each: U, P = tril(Q K^T Gamma)
  bf16* Pbuf = Ubuf + kBufs * kChunk * kLdC;
  bf16* Db = Pbuf + kBufs * kChunk * kLdC;     // (64, kLdC) Delta
  bf16* Gb = Db + kChunk * kLdC;               // (64, kLdC) Gamma_n Delta: row r times e^{b_n - b_r}
  bf16* Sb = Gb + kChunk * kLdC;               // (128, kLdC) the state in bf16
  float* sbuf = reinterpret_cast<float*>(Sb + kD * kLdC);  // kBufs x 64: b
  // Starts the loads of chunk [t, t + m) into buffer `buf`: W, U, Q and P (`wuqp`), K and b (`kb`).
  const auto load = [&](int buf, int64_t t, int m, bool wuqp, bool kb) {
    if (wuqp) {
      load_tile<kD>(Wbuf + buf * kChunk * kLdD, kLdD, a.w, t, m, a.hv, h, kD, 0);
      load_tile<kScanV>(Ubuf + buf * kChunk * kLdC, kLdC, a.u, t, m, a.hv, h, kD, jv0);
      if (!kStates) {
        load_tile<kD>(Qbuf + buf * kChunk * kLdD, kLdD, a.q, t, m, a.hk, kh, kD, 0);
        load_tile<kChunk>(Pbuf + buf * kChunk * kLdC, kLdC, a.p, t, m, a.hv, h, kChunk, 0);
      }
    }
    if (kb) {
      load_tile<kD>(Kbuf + buf * kChunk * kLdD, kLdD, a.k, t, m, a.hk, kh, kD, 0);
      load_b(sbuf + buf * kChunk, a.b, t, m, a.hv, h);
    }
  };
  Tile<128, kScanV> S;
  S.zero();
  const int64_t first_chunk = a.offsets[doc];
  for (int64_t t0 = sp.start, ci = 0; t0 < sp.end; t0 += kChunk, ++ci) {
    const int n = int(min(int64_t(kChunk), sp.end - t0));
    const int64_t t_next = t0 + kChunk;
    const int n_next = int(min(int64_t(kChunk), sp.end - t_next));  // <= 0: no next chunk
    const int buf = kDouble ? int(ci & 1) : 0;
    const bf16* Wb = Wbuf + buf * kChunk * kLdD;
    const bf16* Qb = Qbuf + buf * kChunk * kLdD;
    const bf16* Kb = Kbuf + buf * kChunk * kLdD;
    const bf16* Ub = Ubuf + buf * kChunk * kLdC;
    const bf16* Pb = Pbuf + buf * kChunk * kLdC;
    const float* sb = sbuf + buf * kChunk;
    if (ci == 0 || !kDouble) load(buf, t0, n, ci == 0, true);  // (else fetched during the previous chunk)
    S.each_pair([&](int i, int j, float x0, float x1) { st_bf2(Sb + i * kLdC + j, x0, x1); });
    cp_async_wait_all();
    __syncthreads();
    // The other buffers were last read by the previous chunk, which every thread has finished.
    if (kDouble && n_next > 0) load(buf ^ 1, t_next, n_next, true, true);
    if (kStates || a.hs)  // H[c] (the backward's, or the op's saved states), 16-byte stores
      store_tile<kScanV>(a.hs + ((first_chunk + ci) * a.hv + h) * kD * kD, 0, kD, 1, 0, kD, jv0, Sb, kLdC);
    const float b_last = sb[n - 1];
    {
      Tile<64, kScanV> d;
      d.zero();
      d.template mma<false, true>(Wb, kLdD, Sb, kLdC, kD);
      d.each_pair([&](int r, int j, float x0, float x1) {
        const float2 u = ld_bf2(Ub + r * kLdC + j);
        const float d0 = u.x - x0, d1 = u.y - x1, m = __expf(b_last - sb[r]);
        st_bf2(Db + r * kLdC + j, d0, d1);
        st_bf2(Gb + r * kLdC + j, m * d0, m * d1);
      });
    }
    __syncthreads();
    if (!kDouble && n_next > 0) {  // W and U are consumed: prefetch the next chunk's
      load_tile<kD>(Wbuf, kLdD, a.w, t_next, n_next, a.hv, h, kD, 0);
      load_tile<kScanV>(Ubuf, kLdC, a.u, t_next, n_next, a.hv, h, kD, jv0);
    }
    if (kStates || a.delta) store_tile<kScanV>(a.delta, t0, n, a.hv, h, kD, jv0, Db, kLdC);  // the backward's Delta
    if (!kStates) {
      Tile<64, kScanV> o;
      o.zero();
      o.template mma<false, true>(Qb, kLdD, Sb, kLdC, kD);
      o.each([&](int r, int, float& x) { x *= __expf(sb[r]); });
      o.template mma<false, true>(Pb, kLdC, Db, kLdC, kChunk);
      const float s = a.scale;
      o.each_pair([&](int r, int j, float x0, float x1) {
        if (r < n)
          *reinterpret_cast<__nv_bfloat162*>(a.o + ((t0 + r) * a.hv + h) * kD + jv0 + j) =
              __floats2bfloat162_rn(s * x0, s * x1);
      });
    }
    __syncthreads();
    if (!kDouble && !kStates && n_next > 0) {  // Q and P are consumed
      load_tile<kD>(Qbuf, kLdD, a.q, t_next, n_next, a.hk, kh, kD, 0);
      load_tile<kChunk>(Pbuf, kLdC, a.p, t_next, n_next, a.hv, h, kChunk, 0);
    }
    const float e_last = __expf(b_last);
    S.each([&](int, int, float& x) { x *= e_last; });
    S.template mma<true, true>(Kb, kLdD, Gb, kLdC, kChunk);
    __syncthreads();
  }
}

// The reverse scan: dS (gradient of the state leaving the chunk) in fp32 registers; per chunk, saves dH[c] = dS and
// dDelta = s P^T dO + Gamma_n K dS (P from the prep kernel), then dS <- e^{b_n} dS + s (e^b Q)^T dO - W^T dDelta.
// As in the forward, Gamma_n and s e^b go on the (64, kScanV) tiles (the product K dS's rows, and dO's for the state
// term: Q^T (s e^b dO)), not on K's and Q's (64, 128) tiles in every block. kDouble as in the forward: W, Q, K, dO, P
// and b of the chunk before are fetched into the other buffers as soon as this one starts; without it W, Q, dO, P and
// b are fetched at the chunk's start and K once this one has read it.
constexpr size_t scan_bwd_smem(bool double_buffered) {
  const int bufs = double_buffered ? 2 : 1;
  return sizeof(bf16) * (bufs * (3 * kChunk * kLdD + 2 * kChunk * kLdC) + 2 * kChunk * kLdC + kD * kLdC) +
         sizeof(float) * bufs * kChunk;
}
template <int kScanV, bool kDouble>
__global__ void __launch_bounds__(kThreads, scan_blocks_per_sm(kScanV, kDouble)) scan_backward_kernel(ChunkArgs a) {
  const int64_t doc = blockIdx.x, h = blockIdx.y, kh = h / a.group;
  const int jv0 = blockIdx.z * kScanV;
  const Span sp = doc_span(a.cu, doc, a.tokens);
  if (sp.end <= sp.start) return;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kBufs = kDouble ? 2 : 1;
  bf16* Wbuf = reinterpret_cast<bf16*>(smem);  // kBufs x (64, kLdD) each: W, Q, K
  bf16* Qbuf = Wbuf + kBufs * kChunk * kLdD;
  bf16* Kbuf = Qbuf + kBufs * kChunk * kLdD;
  bf16* dObuf = Kbuf + kBufs * kChunk * kLdD;  // kBufs x (64, kLdC) each: dO, P = tril(Q K^T Gamma) (prep kernel)
  bf16* Pbuf = dObuf + kBufs * kChunk * kLdC;
  bf16* dOs = Pbuf + kBufs * kChunk * kLdC;    // (64, kLdC) s e^b dO: row r times s e^{b_r}
  bf16* nDb = dOs + kChunk * kLdC;             // (64, kLdC) -dDelta
  bf16* dSb = nDb + kChunk * kLdC;             // (128, kLdC)
  float* sbuf = reinterpret_cast<float*>(dSb + kD * kLdC);  // kBufs x 64: b
  // Starts the loads of chunk [t, t + m) into buffer `buf`: W, Q, dO, P and b (`wqop`), K (`k`).
  const auto load = [&](int buf, int64_t t, int m, bool wqop, bool k) {
    if (wqop) {
      load_tile<kD>(Wbuf + buf * kChunk * kLdD, kLdD, a.w, t, m, a.hv, h, kD, 0);
      load_tile<kD>(Qbuf + buf * kChunk * kLdD, kLdD, a.q, t, m, a.hk, kh, kD, 0);
      load_tile<kScanV>(dObuf + buf * kChunk * kLdC, kLdC, a.d_o, t, m, a.hv, h, kD, jv0);
      load_tile<kChunk>(Pbuf + buf * kChunk * kLdC, kLdC, a.p, t, m, a.hv, h, kChunk, 0);
      load_b(sbuf + buf * kChunk, a.b, t, m, a.hv, h);
    }
    if (k) load_tile<kD>(Kbuf + buf * kChunk * kLdD, kLdD, a.k, t, m, a.hk, kh, kD, 0);
  };
  Tile<128, kScanV> dS;
  dS.zero();
  const int64_t first_chunk = a.offsets[doc];
  const int64_t chunks = (sp.end - sp.start + kChunk - 1) / kChunk;
  for (int64_t ci = chunks - 1; ci >= 0; --ci) {
    const int64_t t0 = sp.start + ci * kChunk;
    const int n = int(min(int64_t(kChunk), sp.end - t0));
    const int buf = kDouble ? int(ci & 1) : 0;
    const bf16* Wb = Wbuf + buf * kChunk * kLdD;
    const bf16* Qb = Qbuf + buf * kChunk * kLdD;
    const bf16* Kb = Kbuf + buf * kChunk * kLdD;
    const bf16* dOb = dObuf + buf * kChunk * kLdC;
    const bf16* Pb = Pbuf + buf * kChunk * kLdC;
    const float* sb = sbuf + buf * kChunk;
    // (K of a later chunk, and with kDouble everything, was fetched during the chunk after)
    if (ci == chunks - 1 || !kDouble) load(buf, t0, n, true, ci == chunks - 1);
    dS.each_pair([&](int i, int j, float x0, float x1) { st_bf2(dSb + i * kLdC + j, x0, x1); });
    cp_async_wait_all();
    __syncthreads();
    // The other buffers were last read by the chunk after, which every thread has finished.
    if (kDouble && ci > 0) load(buf ^ 1, t0 - kChunk, kChunk, true, true);
    store_tile<kScanV>(a.dhs + ((first_chunk + ci) * a.hv + h) * kD * kD, 0, kD, 1, 0, kD, jv0, dSb, kLdC);
    const float b_last = sb[n - 1], s = a.scale;
#pragma unroll
    for (unsigned e = threadIdx.x; e < kChunk * kScanV / 2; e += kThreads) {  // (read after the next barrier)
      const int r = int(e / (kScanV / 2)), col = 2 * int(e % (kScanV / 2));
      const float2 f = ld_bf2(dOb + r * kLdC + col);
      const float m = s * __expf(sb[r]);
      st_bf2(dOs + r * kLdC + col, m * f.x, m * f.y);
    }
    {
      Tile<64, kScanV> dd, kd;  // dDelta = s P^T dO + Gamma_n (K dS)
      dd.zero();
      dd.template mma<true, true>(Pb, kLdC, dOb, kLdC, kChunk);
      dd.each([&](int, int, float& x) { x *= s; });
      kd.zero();
      kd.template mma<false, true>(Kb, kLdD, dSb, kLdC, kD);
      dd.add_rows(kd, [&](int r) { return __expf(b_last - sb[r]); });
      dd.each_pair([&](int r, int j, float x0, float x1) {
        *reinterpret_cast<__nv_bfloat162*>(nDb + r * kLdC + j) = __floats2bfloat162_rn(-x0, -x1);
        if (r < n)
          *reinterpret_cast<__nv_bfloat162*>(a.ddelta + ((t0 + r) * a.hv + h) * kD + jv0 + j) =
              __floats2bfloat162_rn(x0, x1);
      });
    }
    __syncthreads();
    if (!kDouble && ci > 0) load(0, t0 - kChunk, kChunk, false, true);  // K is consumed
    const float e_last = __expf(b_last);
    dS.each([&](int, int, float& x) { x *= e_last; });
    dS.template mma<true, true>(Qb, kLdD, dOs, kLdC, kChunk);
    dS.template mma<true, true>(Wb, kLdD, nDb, kLdC, kChunk);
    __syncthreads();
  }
}

// The chunk-parallel part of the backward (§3.5 steps 5-7), in two kernels so that each fits two blocks per SM:
// chunk_backward_state_kernel (through the output and state terms; d_v streamed in halves of 64) writes dq, the
// step-5 part of dk, dW = -dDelta H^T and the step-5 part of db; chunk_backward_wy_kernel (through the WY form)
// adds the rest of dk and writes dv, dbeta and dg (the reverse cumsum of db inside the chunk).
// Copies columns [col0, col0 + 64) of a (128, 128) bf16 state block (row stride 128) into shared (128, kLdC).
__device__ void load_state_half(bf16* dst, const bf16* src, int col0) {
  for (int e = threadIdx.x; e < kD * kVTile / 8; e += blockDim.x) {
    const int r = e / (kVTile / 8), c = (e % (kVTile / 8)) * 8;
    cp_async16(dst + r * kLdC + c, src + r * kD + col0 + c, true);
  }
}

// Delta = U - W H[c] per (chunk, value head, half of d_v) from saved chunk-start states, chunk-parallel: the same
// bf16 operands and mma as the forward scan (which computes Delta on its way), so the same values.
constexpr size_t kDeltaSmem = sizeof(bf16) * (kChunk * kLdD + kChunk * kLdC + kD * kLdC);
__global__ void __launch_bounds__(kThreads) delta_kernel(ChunkArgs a) {
  ChunkLoc c;
  if (!locate_chunk(a.offsets, a.cu, a.docs, a.tokens, blockIdx.x, c)) return;
  const int64_t h = blockIdx.y;
  const int jv0 = blockIdx.z * kVTile;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Wb = reinterpret_cast<bf16*>(smem);  // (64, kLdD)
  bf16* Ub = Wb + kChunk * kLdD;             // (64, kLdC) U, then Delta
  bf16* Sb = Ub + kChunk * kLdC;             // (128, kLdC) columns [jv0, jv0 + 64) of H[c]
  load_tile<kD>(Wb, kLdD, a.w, c.t0, c.n, a.hv, h, kD, 0);
  load_tile<kVTile>(Ub, kLdC, a.u, c.t0, c.n, a.hv, h, kD, jv0);
  load_state_half(Sb, a.hs + (int64_t(blockIdx.x) * a.hv + h) * kD * kD, jv0);
  cp_async_wait_all();
  __syncthreads();
  Tile<64, 64> d;
  d.zero();
  d.mma<false, true>(Wb, kLdD, Sb, kLdC, kD);
  d.each_pair([&](int r, int j, float x0, float x1) {  // each element read and written by the same thread
    const float2 u = ld_bf2(Ub + r * kLdC + j);
    st_bf2(Ub + r * kLdC + j, u.x - x0, u.y - x1);
  });
  __syncthreads();
  store_tile<kVTile>(a.delta, c.t0, c.n, a.hv, h, kD, jv0, Ub, kLdC);
}

constexpr size_t kStateBwdSmem = sizeof(bf16) * (2 * kChunk * kLdD + 2 * kD * kLdC + 4 * kChunk * kLdC) +
                                 sizeof(float) * (3 * kChunk + 6 * kChunk + 32);
__global__ void __launch_bounds__(kThreads, 2) chunk_backward_state_kernel(ChunkArgs a) {
  ChunkLoc c;
  const int64_t id = blockIdx.x;
  if (!locate_chunk(a.offsets, a.cu, a.docs, a.tokens, id, c)) return;
  const int64_t h = blockIdx.y, kh = h / a.group, t0 = c.t0;
  const int n = c.n;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qb = reinterpret_cast<bf16*>(smem);  // (64, kLdD)
  bf16* Kb = Qb + kChunk * kLdD;             // (64, kLdD)
  bf16* Hh = Kb + kChunk * kLdD;             // (128, kLdC) half of H; later dW (64, kLdD) staging
  bf16* dHh = Hh + kD * kLdC;                // (128, kLdC) half of dH
  bf16* dOh = dHh + kD * kLdC;               // (64, kLdC) halves of dO, Delta, dDelta
  bf16* Dh = dOh + kChunk * kLdC;
  bf16* dDh = Dh + kChunk * kLdC;
  bf16* Pt = dDh + kChunk * kLdC;            // (64, kLdC) P~ = s tril(dO Delta^T Gamma)
  float* sb = reinterpret_cast<float*>(Pt + kChunk * kLdC);
  float* er = sb + kChunk;  // e^{b_r}
  float* gr = er + kChunk;  // e^{b_n - b_r}
  float* partA = gr + kChunk;
  float* partB = partA + 2 * kChunk;
  float* partC = partB + 2 * kChunk;
  float* red = partC + 2 * kChunk;
  const bf16* hs = a.hs + (id * a.hv + h) * kD * kD;
  const bf16* dhs = a.dhs + (id * a.hv + h) * kD * kD;
  const float s = a.scale;

  // Pass A over the halves of d_v: M = dO Delta^T and dQ1 = dO H^T.
  Tile<64, 64> m;
  Tile<64, 128> dq;
  m.zero();
  dq.zero();
  load_tile<kD>(Qb, kLdD, a.q, t0, n, a.hk, kh, kD, 0);
  load_tile<kD>(Kb, kLdD, a.k, t0, n, a.hk, kh, kD, 0);
  if (threadIdx.x < kChunk) sb[threadIdx.x] = a.b[(t0 + min(int(threadIdx.x), n - 1)) * a.hv + h];
  for (int half = 0; half < 2; ++half) {
    const int col0 = half * kVTile;
    load_state_half(Hh, hs, col0);
    load_tile<kVTile>(dOh, kLdC, a.d_o, t0, n, a.hv, h, kD, col0);
    load_tile<kVTile>(Dh, kLdC, a.delta, t0, n, a.hv, h, kD, col0);
    cp_async_wait_all();
    __syncthreads();
    m.mma<false, false>(dOh, kLdC, Dh, kLdC, kVTile);
    dq.mma<false, false>(dOh, kLdC, Hh, kLdC, kVTile);
    __syncthreads();
  }
  // Pass B: start loading while P~ and dQ are formed.
  load_state_half(Hh, hs, 0);
  load_state_half(dHh, dhs, 0);
  load_tile<kVTile>(Dh, kLdC, a.delta, t0, n, a.hv, h, kD, 0);
  load_tile<kVTile>(dDh, kLdC, a.ddelta, t0, n, a.hv, h, kD, 0);
  if (threadIdx.x < kChunk) {
    const int r = threadIdx.x;
    er[r] = __expf(sb[r]);
    gr[r] = __expf(sb[n - 1] - sb[r]);
  }
  m.each_pair([&](int r, int i, float x0, float x1) {
    const float m0 = (i <= r && r < n) ? s * __expf(sb[r] - sb[i]) : 0.0f;
    const float m1 = (i + 1 <= r && r < n) ? s * __expf(sb[r] - sb[i + 1]) : 0.0f;
    st_bf2(Pt + r * kLdC + i, m0 * x0, m1 * x1);
  });
  __syncthreads();
  dq.each([&](int r, int, float& x) { x *= s * er[r]; });  // dQ = s e^b (dO H^T) + P~ K
  dq.mma<false, true>(Pt, kLdC, Kb, kLdD, kChunk);
  dq.row_sums(partA, [&](int r, int i, float x) { return x * __bfloat162float(Qb[r * kLdD + i]); });
  dq.each_pair([&](int r, int i, float x0, float x1) {
    if (r >= n) return;
    if (a.dq) st_bf2(a.dq + ((t0 + r) * a.hv + h) * kD + i, x0, x1);
    else *reinterpret_cast<float2*>(a.dqh + ((t0 + r) * a.hv + h) * kD + i) = make_float2(x0, x1);
  });
  Tile<64, 128> dk, dw;
  dk.zero();
  dw.zero();
  float hdh = 0;
  for (int half = 0; half < 2; ++half) {
    if (half == 1) {
      const int col0 = kVTile;
      load_state_half(Hh, hs, col0);
      load_state_half(dHh, dhs, col0);
      load_tile<kVTile>(Dh, kLdC, a.delta, t0, n, a.hv, h, kD, col0);
      load_tile<kVTile>(dDh, kLdC, a.ddelta, t0, n, a.hv, h, kD, col0);
    }
    cp_async_wait_all();
    __syncthreads();
    dk.mma<false, false>(Dh, kLdC, dHh, kLdC, kVTile);   // Delta dH^T
    dw.mma<false, false>(dDh, kLdC, Hh, kLdC, kVTile);   // dDelta H^T
    for (int e = threadIdx.x; e < kD * kVTile / 2; e += blockDim.x) {
      const int i = e / (kVTile / 2), j = 2 * (e % (kVTile / 2));
      const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Hh + i * kLdC + j));
      const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dHh + i * kLdC + j));
      hdh += x.x * y.x + x.y * y.y;
    }
    __syncthreads();
  }
  hdh = block_reduce<float, false>(hdh, red);
  dk.row_sums(partB, [&](int r, int i, float x) { return gr[r] * x * __bfloat162float(Kb[r * kLdD + i]); });
  dk.each([&](int r, int, float& x) { x *= gr[r]; });
  dk.mma<true, true>(Pt, kLdC, Qb, kLdD, kChunk);  // + P~^T Q
  dk.row_sums(partC, [&](int r, int i, float x) { return x * __bfloat162float(Kb[r * kLdD + i]); });
  dk.each_pair([&](int r, int i, float x0, float x1) {
    if (r < n) *reinterpret_cast<float2*>(a.dkh + ((t0 + r) * a.hv + h) * kD + i) = make_float2(x0, x1);
  });
  bf16* dWs = Hh;  // (64, kLdD) staging, free after the last barrier
  dw.each_pair([&](int r, int i, float x0, float x1) { st_bf2(dWs + r * kLdD + i, -x0, -x1); });
  __syncthreads();
  store_tile<kD>(a.dw, t0, n, a.hv, h, kD, 0, dWs, kLdD);
  if (threadIdx.x < kChunk && int(threadIdx.x) < n) {
    const int r = threadIdx.x;
    float v = (partA[r] + partA[kChunk + r]) - (partC[r] + partC[kChunk + r]);
    if (r == n - 1) {  // e^{b_n} <H, dH> + sum_i gamma_i <(Delta dH^T)_i, k_i>
      float last = __expf(sb[n - 1]) * hdh;
      for (int i = 0; i < n; ++i) last += partB[i] + partB[kChunk + i];
      v += last;
    }
    a.dbp[(t0 + r) * a.hv + h] = v;
  }
}

constexpr size_t kWyBwdSmem = sizeof(bf16) * (4 * kChunk * kLdD + 2 * kChunk * kLdC) + sizeof(float) * (12 * kChunk);
__global__ void __launch_bounds__(kThreads, 2) chunk_backward_wy_kernel(ChunkArgs a) {
  ChunkLoc c;
  const int64_t id = blockIdx.x;
  if (!locate_chunk(a.offsets, a.cu, a.docs, a.tokens, id, c)) return;
  const int64_t h = blockIdx.y, kh = h / a.group, t0 = c.t0;
  const int n = c.n;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Kb = reinterpret_cast<bf16*>(smem);  // (64, kLdD)
  bf16* Vb = Kb + kChunk * kLdD;             // (64, kLdD); later kk (fp32, 64 x kLdF)
  bf16* dWb = Vb + kChunk * kLdD;            // (64, kLdD) dW
  bf16* dDb = dWb + kChunk * kLdD;           // (64, kLdD) dDelta = dU; later dL (fp32, 64 x kLdF)
  bf16* Rb = dDb + kChunk * kLdD;            // (64, kLdC) R
  bf16* dRb = Rb + kChunk * kLdC;            // (64, kLdC) dR; later X = R^T dR; later B + B^T
  float* sb = reinterpret_cast<float*>(dRb + kChunk * kLdC);
  float* sbeta = sb + kChunk;
  float* er = sbeta + kChunk;    // e^{b_r}
  float* be = er + kChunk;       // beta_r e^{b_r}
  float* partD = be + kChunk;    // (2, 64) <k, dKbe>
  float* partE = partD + 2 * kChunk;  // (2, 64) <v, dVbe>
  float* db = partE + 2 * kChunk;
  float* dbeta = db + kChunk;
  float* kkf = reinterpret_cast<float*>(Vb);
  float* dLf = reinterpret_cast<float*>(dDb);

  load_tile<kD>(Kb, kLdD, a.k, t0, n, a.hk, kh, kD, 0);
  load_tile<kD>(Vb, kLdD, a.v, t0, n, a.hv, h, kD, 0);
  load_tile<kD>(dWb, kLdD, a.dw, t0, n, a.hv, h, kD, 0);
  load_tile<kD>(dDb, kLdD, a.ddelta, t0, n, a.hv, h, kD, 0);
  load_tile<kChunk>(Rb, kLdC, a.r, t0, n, a.hv, h, kChunk, 0);
  if (threadIdx.x < kChunk) {
    const int r = threadIdx.x;
    sb[r] = a.b[(t0 + min(r, n - 1)) * a.hv + h];
    sbeta[r] = r < n ? gate_at(a, a.beta, (t0 + r) * a.hv + h) : 0.0f;
    er[r] = __expf(sb[r]);
    be[r] = sbeta[r] * er[r];
  }
  Tile<64, 128> dk;  // the step-5 part from chunk_backward_state_kernel
  {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int ni = 0; ni < decltype(dk)::NT; ++ni)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = dk.m0() + lane / 4 + 8 * half, i = dk.n0() + ni * 8 + 2 * (lane % 4);
        const float2 v = r < n ? *reinterpret_cast<const float2*>(a.dkh + ((t0 + r) * a.hv + h) * kD + i)
                               : make_float2(0.0f, 0.0f);
        dk.acc[0][ni][2 * half] = v.x;
        dk.acc[0][ni][2 * half + 1] = v.y;
      }
  }
  cp_async_wait_all();
  __syncthreads();
  {  // dR = dW Kbe^T + dU Vbe^T = diag-columns: beta_s [e_s (dW K^T) + dU V^T]
    Tile<64, 64> dr;
    dr.zero();
    dr.mma<false, false>(dWb, kLdD, Kb, kLdD, kD);
    dr.each([&](int, int c2, float& x) { x *= er[c2]; });
    dr.mma<false, false>(dDb, kLdD, Vb, kLdD, kD);
    dr.each_pair([&](int r, int c2, float x0, float x1) {
      st_bf2(dRb + r * kLdC + c2, x0 * sbeta[c2], x1 * sbeta[c2 + 1]);
    });
  }
  {  // dKbe = R^T dW: dK += beta e^b dKbe
    Tile<64, 128> t;
    t.zero();
    t.mma<true, true>(Rb, kLdC, dWb, kLdD, kChunk);
    t.row_sums(partD, [&](int r, int i, float x) { return x * __bfloat162float(Kb[r * kLdD + i]); });
    dk.add_rows(t, [&](int r) { return be[r]; });
  }
  {  // dVbe = R^T dU: dV = beta dVbe
    Tile<64, 128> t;
    t.zero();
    t.mma<true, true>(Rb, kLdC, dDb, kLdD, kChunk);
    t.row_sums(partE, [&](int r, int i, float x) { return x * __bfloat162float(Vb[r * kLdD + i]); });
    t.each_pair([&](int r, int i, float x0, float x1) {
      if (r < n)
        *reinterpret_cast<__nv_bfloat162*>(a.dv + ((t0 + r) * a.hv + h) * kD + i) =
            __floats2bfloat162_rn(sbeta[r] * x0, sbeta[r] * x1);
    });
  }
  __syncthreads();  // dR complete; V, dW, dU dead from here
  Tile<64, 64> x, kk;
  x.zero();
  x.mma<true, true>(Rb, kLdC, dRb, kLdC, kChunk);  // X = R^T dR
  kk.zero();
  kk.mma<false, false>(Kb, kLdD, Kb, kLdD, kD);
  __syncthreads();
  x.each_pair([&](int r, int c2, float v0, float v1) { st_bf2(dRb + r * kLdC + c2, v0, v1); });
  kk.each_pair([&](int r, int c2, float v0, float v1) {
    *reinterpret_cast<float2*>(kkf + r * kLdF + c2) = make_float2(v0, v1);
  });
  __syncthreads();
  {  // dL = -tril_-1(X R^T)
    Tile<64, 64> y;
    y.zero();
    y.mma<false, false>(dRb, kLdC, Rb, kLdC, kChunk);
    y.each_pair([&](int r, int c2, float v0, float v1) {
      *reinterpret_cast<float2*>(dLf + r * kLdF + c2) =
          make_float2((c2 < r && r < n) ? -v0 : 0.0f, (c2 + 1 < r && r < n) ? -v1 : 0.0f);
    });
  }
  __syncthreads();
  // Bs = B + B^T with B = diag(beta) (dL Gamma), into the X buffer.
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int r = e / kChunk, c2 = e % kChunk;
    float v = 0;
    if (c2 < r) v = sbeta[r] * dLf[r * kLdF + c2] * __expf(sb[r] - sb[c2]);
    else if (r < c2) v = sbeta[c2] * dLf[c2 * kLdF + r] * __expf(sb[c2] - sb[r]);
    dRb[r * kLdC + c2] = __float2bfloat16(v);
  }
  {  // per row (4 threads a row, 16 columns each): dbeta_r and the WY part of db_r
    const int r = threadIdx.x / 4, p = threadIdx.x % 4;
    float dbe = 0, dbr = 0;
    for (int c2 = 16 * p; c2 < 16 * p + 16; ++c2) {
      if (c2 < r) {  // L_rc = beta_r kk_rc Gamma_rc
        const float t = dLf[r * kLdF + c2] * kkf[r * kLdF + c2] * __expf(sb[r] - sb[c2]);
        dbe += t;
        dbr += sbeta[r] * t;
      } else if (r < c2) {
        dbr -= dLf[c2 * kLdF + r] * sbeta[c2] * kkf[c2 * kLdF + r] * __expf(sb[c2] - sb[r]);
      }
    }
    dbe += __shfl_xor_sync(0xffffffffu, dbe, 1);
    dbe += __shfl_xor_sync(0xffffffffu, dbe, 2);
    dbr += __shfl_xor_sync(0xffffffffu, dbr, 1);
    dbr += __shfl_xor_sync(0xffffffffu, dbr, 2);
    if (p == 0 && r < n) {
      const float kdkbe = partD[r] + partD[kChunk + r];
      dbeta[r] = dbe + er[r] * kdkbe + partE[r] + partE[kChunk + r];
      db[r] = dbr + be[r] * kdkbe + a.dbp[(t0 + r) * a.hv + h];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // dg = reverse cumsum of db inside the chunk
    float acc = 0;
    for (int r = n - 1; r >= 0; --r) {
      acc += db[r];
      gate_store(a, a.dg, (t0 + r) * a.hv + h, acc);
      gate_store(a, a.dbeta, (t0 + r) * a.hv + h, dbeta[r]);
    }
  }
  dk.mma<false, true>(dRb, kLdC, Kb, kLdD, kChunk);  // + (B + B^T) K
  dk.each_pair([&](int r, int i, float x0, float x1) {
    if (r >= n) return;
    if (a.dk) st_bf2(a.dk + ((t0 + r) * a.hv + h) * kD + i, x0, x1);
    else *reinterpret_cast<float2*>(a.dkh + ((t0 + r) * a.hv + h) * kD + i) = make_float2(x0, x1);
  });
}

template <typename K> void allow_smem(K kernel, size_t bytes) {
  LATHE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// ------------------------------------------------------------------------------------------------ workspace
struct Carve {
  char* p;
  size_t used = 0;
  template <typename T> T* take(size_t count) {
    T* r = reinterpret_cast<T*>(p ? p + used : nullptr);
    used += (count * sizeof(T) + 255) / 256 * 256;
    return r;
  }
};

struct ChunkScratch {
  int32_t* offsets;
  float* b;
  bf16 *w, *u, *p, *r, *hs, *dhs, *delta, *ddelta;
  float *dqh, *dkh;
  bf16* dw;
  float* dbp;
};
// The WY factors and Delta in the op's chunk cache (T, H_v, kChunkCacheWidth), planar: W, U, Delta (T H_v 128 each),
// P, R (T H_v 64 each), then b (T H_v f32 in the last 2 T H_v bf16 slots); every part 16-byte aligned. `delta`: point
// Delta there too (the forward, which writes it from its scan; the backward where the forward's states are given).
void point_at_cache(ChunkScratch& x, const GdnShape& s, void* cache, bool delta) {
  const size_t th = size_t(s.tokens * s.v_heads);
  bf16* base = static_cast<bf16*>(cache);
  x.w = base;
  x.u = base + th * kD;
  if (delta) x.delta = base + 2 * th * kD;
  x.p = base + 3 * th * kD;
  x.r = base + 3 * th * kD + th * kChunk;
  x.b = reinterpret_cast<float*>(base + 3 * th * kD + 2 * th * kChunk);
}
static_assert(3 * kD + 2 * kChunk + 2 == kChunkCacheWidth, "the chunk cache holds W, U, Delta, P, R and b");

// `own_states`: the backward carves H[c] itself (false when the forward's saved states are given). `cache`: the WY
// factors (b, W, U, P, R) live in the op's chunk cache (point_at_cache) instead of the workspace, and so does Delta
// in a backward given the states too.
ChunkScratch carve_chunked(Carve& c, const GdnShape& s, bool backward, bool own_states = true, bool cache = false) {
  const size_t th = size_t(s.tokens * s.v_heads), mc = size_t(max_chunks(s) * s.v_heads);
  ChunkScratch x{};
  x.offsets = c.take<int32_t>(size_t(s.docs + 1));
  if (!cache) {
    x.b = c.take<float>(th);
    x.w = c.take<bf16>(th * kD);
    x.u = c.take<bf16>(th * kD);
    x.p = c.take<bf16>(th * kChunk);
    if (backward) x.r = c.take<bf16>(th * kChunk);
  }
  if (backward) {
    if (own_states) x.hs = c.take<bf16>(mc * kD * kD);
    x.dhs = c.take<bf16>(mc * kD * kD);
    if (!cache || own_states) x.delta = c.take<bf16>(th * kD);
    x.ddelta = c.take<bf16>(th * kD);
    x.dqh = c.take<float>(th * kD);
    x.dkh = c.take<float>(th * kD);
    x.dw = c.take<bf16>(th * kD);
    x.dbp = c.take<float>(th);
  }
  return x;
}

struct RecurrentScratch {
  int32_t* offsets;
  float *ckpt, *tok, *us, *dqh, *dkh;
  int blocks;
};
RecurrentScratch carve_recurrent(Carve& c, const GdnShape& s) {
  const int64_t ss = s.k_dim * s.v_dim, pairs = s.docs * s.v_heads;
  RecurrentScratch x{};
  x.blocks = int(std::min<int64_t>(pairs, ss >= 64 * 64 ? 128 : 1024));
  x.offsets = c.take<int32_t>(size_t(s.docs + 1));
  x.ckpt = c.take<float>(size_t(max_chunks(s) * s.v_heads * ss));
  x.tok = c.take<float>(size_t(x.blocks) * size_t((kCkpt + 1) * ss));
  x.us = c.take<float>(size_t(x.blocks) * size_t(kCkpt * s.v_dim));
  x.dqh = c.take<float>(size_t(s.tokens * s.v_heads * s.k_dim));
  x.dkh = c.take<float>(size_t(s.tokens * s.v_heads * s.k_dim));
  return x;
}

ChunkArgs chunk_args(const GdnShape& s, DType gate_dtype, const void* q, const void* k, const void* v, const void* g,
                     const void* beta, const int32_t* cu, const ChunkScratch& x) {
  ChunkArgs a{};
  a.tokens = s.tokens;
  a.docs = s.docs;
  a.hk = s.k_heads;
  a.hv = s.v_heads;
  a.group = s.v_heads / s.k_heads;
  a.scale = s.scale;
  a.cu = cu;
  a.offsets = x.offsets;
  a.q = static_cast<const bf16*>(q);
  a.k = static_cast<const bf16*>(k);
  a.v = static_cast<const bf16*>(v);
  a.g = g;
  a.beta = beta;
  a.gates_f32 = gate_dtype == DType::F32;
  a.b = x.b;
  a.w = x.w;
  a.u = x.u;
  a.p = x.p;
  a.r = x.r;
  a.hs = x.hs;
  a.dhs = x.dhs;
  a.delta = x.delta;
  a.ddelta = x.ddelta;
  a.dqh = x.dqh;
  a.dkh = x.dkh;
  a.dw = x.dw;
  a.dbp = x.dbp;
  return a;
}

void launch_offsets(const GdnShape& s, const int32_t* cu, int32_t* offsets, cudaStream_t stream) {
  chunk_offsets_kernel<<<1, 32, 0, stream>>>(cu, s.docs, s.tokens, offsets);
  LATHE_CUDA_LAUNCH_CHECK("gdn chunk_offsets_kernel");
}

void launch_prep(const ChunkArgs& a, const GdnShape& s, bool store_r, cudaStream_t stream) {
  allow_smem(prep_kernel, kPrepSmem);
  prep_kernel<<<dim3(unsigned(max_chunks(s)), unsigned(s.v_heads)), kThreads, kPrepSmem, stream>>>(a, store_r);
  LATHE_CUDA_LAUNCH_CHECK("gdn prep_kernel");
}

RecurrentArgs recurrent_args(const GdnShape& s, const int32_t* cu) {
  return RecurrentArgs{s.tokens, s.docs, s.k_heads, s.v_heads, s.v_heads / s.k_heads, s.k_dim, s.v_dim, s.scale, cu};
}

}  // namespace

// ------------------------------------------------------------------------------------------------ launchers
bool gdn_chunked_supported(DType dtype, int64_t k_dim, int64_t v_dim) {
  return dtype == DType::BF16 && k_dim == kD && v_dim == kD;
}

size_t gdn_forward_workspace_bytes(bool chunked, const GdnShape& s, bool save_states, bool cache) {
  Carve c{nullptr};
  if (chunked) carve_chunked(c, s, false, true, cache);
  else if (save_states) c.take<int32_t>(size_t(s.docs + 1));  // the chunk offsets
  return c.used;
}

size_t gdn_backward_workspace_bytes(bool chunked, const GdnShape& s, bool saved_states, bool cache) {
  Carve c{nullptr};
  if (chunked) carve_chunked(c, s, true, !saved_states, cache);
  else carve_recurrent(c, s);
  return c.used;
}

namespace {

// The scans run one block per (document, value head, kScanV columns of d_v): 64 columns, or 32 where 64 would leave
// SMs idle (few documents and heads, as in a micro-batch of two long sequences: 2 x 16 x 2 = 64 blocks on 132 SMs),
// or 16 where even 16-column blocks fit one wave (one long document: 16 value heads x 8 blocks = 128 on one GPU, and
// a cp rank's 8 heads 64, where each block's walk over the chunks is the scan's whole time). The thresholds were
// chosen by timing both sides of each (docs/benchmarks.md).
int scan_columns(const GdnShape& s) {
  const int64_t pairs = s.docs * s.v_heads, sms = multiprocessors();
  return pairs * (kD / 16) <= sms ? 16 : pairs * (kD / 64) < sms ? 32 : 64;
}

// The scans double-buffer every tile they read where their blocks fit one wave of one block an SM: the larger shared
// memory then costs no residency. With more blocks, the smaller variants run two blocks an SM, which hides more
// (both sides timed: docs/benchmarks.md, sessions 7 and 36).
bool scan_double_buffered(const GdnShape& s, int columns) {
  return s.docs * s.v_heads * (kD / columns) <= multiprocessors();
}

template <bool kStates, int V, bool kDouble>
void launch_scan_forward_v(const ChunkArgs& a, const GdnShape& s, cudaStream_t stream) {
  constexpr size_t smem = scan_smem(kDouble);
  allow_smem(scan_forward_kernel<kStates, V, kDouble>, smem);
  scan_forward_kernel<kStates, V, kDouble>
      <<<dim3(unsigned(s.docs), unsigned(s.v_heads), kD / V), kThreads, smem, stream>>>(a);
  LATHE_CUDA_LAUNCH_CHECK("gdn scan_forward_kernel");
}
template <bool kStates> void launch_scan_forward(const ChunkArgs& a, const GdnShape& s, cudaStream_t stream) {
  const int columns = scan_columns(s);
  const bool twice = scan_double_buffered(s, columns);
  if (columns == 16) launch_scan_forward_v<kStates, 16, true>(a, s, stream);  // one wave: always double-buffered
  else if (columns == 32 && twice) launch_scan_forward_v<kStates, 32, true>(a, s, stream);
  else if (columns == 32) launch_scan_forward_v<kStates, 32, false>(a, s, stream);
  else if (twice) launch_scan_forward_v<kStates, 64, true>(a, s, stream);
  else launch_scan_forward_v<kStates, 64, false>(a, s, stream);
}
template <int V, bool kDouble> void launch_scan_backward_v(const ChunkArgs& a, const GdnShape& s, cudaStream_t stream) {
  constexpr size_t smem = scan_bwd_smem(kDouble);
  allow_smem(scan_backward_kernel<V, kDouble>, smem);
  scan_backward_kernel<V, kDouble><<<dim3(unsigned(s.docs), unsigned(s.v_heads), kD / V), kThreads, smem, stream>>>(a);
  LATHE_CUDA_LAUNCH_CHECK("gdn scan_backward_kernel");
}
void launch_scan_backward(const ChunkArgs& a, const GdnShape& s, cudaStream_t stream) {
  const int columns = scan_columns(s);
  const bool twice = scan_double_buffered(s, columns);
  if (columns == 16) launch_scan_backward_v<16, true>(a, s, stream);
  else if (columns == 32 && twice) launch_scan_backward_v<32, true>(a, s, stream);
  else if (columns == 32) launch_scan_backward_v<32, false>(a, s, stream);
  else if (twice) launch_scan_backward_v<64, true>(a, s, stream);
  else launch_scan_backward_v<64, false>(a, s, stream);
}

// Zero fill of the saved-state rows past the last chunk (their count is only known on the device).
void launch_zero_state_tail(const GdnShape& s, size_t elem_bytes, const int32_t* offsets, void* states,
                            cudaStream_t stream) {
  const int64_t row_bytes = s.v_heads * s.k_dim * s.v_dim * int64_t(elem_bytes);
  zero_state_tail_kernel<<<grid_for(s.docs * row_bytes, kThreads), kThreads, 0, stream>>>(
      offsets, s.docs, max_chunks(s), row_bytes, static_cast<unsigned char*>(states));
  LATHE_CUDA_LAUNCH_CHECK("gdn zero_state_tail_kernel");
}

}  // namespace

void launch_gated_delta_rule(DType dtype, DType gate_dtype, bool chunked, const GdnShape& s, const void* q,
                             const void* k, const void* v, const void* g, const void* beta, const int32_t* cu, void* o,
                             void* states, void* cache, void* workspace, cudaStream_t stream) {
  if (s.tokens == 0) {
    if (states) LATHE_CUDA_CHECK(cudaMemsetAsync(states, 0, size_t(max_chunks(s) * s.v_heads * s.k_dim * s.v_dim) *
                                                                dtype_size(dtype), stream));
    return;
  }
  Carve c{static_cast<char*>(workspace)};
  if (chunked) {
    ChunkScratch x = carve_chunked(c, s, false, true, cache != nullptr);
    if (cache) point_at_cache(x, s, cache, true);  // the scan writes Delta there too
    ChunkArgs a = chunk_args(s, gate_dtype, q, k, v, g, beta, cu, x);
    a.o = static_cast<bf16*>(o);
    a.hs = static_cast<bf16*>(states);  // null: not saved
    launch_offsets(s, cu, x.offsets, stream);
    launch_prep(a, s, cache != nullptr, stream);  // R too when the backward will read it from the cache
    launch_scan_forward<false>(a, s, stream);
    if (states) launch_zero_state_tail(s, sizeof(bf16), x.offsets, states, stream);
    return;
  }
  int32_t* offsets = nullptr;
  if (states) {
    offsets = c.take<int32_t>(size_t(s.docs + 1));
    launch_offsets(s, cu, offsets, stream);
    launch_zero_state_tail(s, dtype_size(dtype), offsets, states, stream);
  }
  const size_t smem = sizeof(float) * size_t(s.k_dim * s.v_dim + 2 * s.k_dim + s.v_dim);
  dispatch_gates(dtype, gate_dtype, [&](auto tag, auto gate_tag) {
    using T = decltype(tag);
    using G = decltype(gate_tag);
    allow_smem(recurrent_forward_kernel<T, G>, smem);
    recurrent_forward_kernel<T, G><<<dim3(unsigned(s.docs), unsigned(s.v_heads)), kThreads, smem, stream>>>(
        recurrent_args(s, cu), static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<const G*>(g), static_cast<const G*>(beta), static_cast<T*>(o), offsets, static_cast<T*>(states));
  });
  LATHE_CUDA_LAUNCH_CHECK("gdn recurrent_forward_kernel");
}

void launch_gated_delta_rule_backward(DType dtype, DType gate_dtype, bool chunked, const GdnShape& s, const void* q,
                                      const void* k, const void* v, const void* g, const void* beta, const void* d_o,
                                      const int32_t* cu, const void* states, const void* cache, void* dq, void* dk,
                                      void* dv, void* dg, void* dbeta, void* workspace, cudaStream_t stream) {
  if (s.tokens == 0) return;
  Carve c{static_cast<char*>(workspace)};
  const int64_t group = s.v_heads / s.k_heads;
  const float* dqh = nullptr;
  const float* dkh = nullptr;
  if (chunked) {
    ChunkScratch x = carve_chunked(c, s, true, states == nullptr, cache != nullptr);
    // Read only; Delta from the cache only with the forward's states (else the backward's own scan writes it).
    if (cache) point_at_cache(x, s, const_cast<void*>(cache), states != nullptr);
    ChunkArgs a = chunk_args(s, gate_dtype, q, k, v, g, beta, cu, x);
    if (states) a.hs = static_cast<bf16*>(const_cast<void*>(states));  // read only
    a.d_o = static_cast<const bf16*>(d_o);
    a.dv = static_cast<bf16*>(dv);
    a.dg = dg;
    a.dbeta = dbeta;
    if (group == 1) {  // H_v = H_k: the per-chunk kernels write dq, dk themselves
      a.dq = static_cast<bf16*>(dq);
      a.dk = static_cast<bf16*>(dk);
    }
    launch_offsets(s, cu, x.offsets, stream);
    if (!cache) launch_prep(a, s, true, stream);  // else the forward's WY factors
    const dim3 chunk_grid(unsigned(max_chunks(s)), unsigned(s.v_heads));
    if (!states) {
      launch_scan_forward<true>(a, s, stream);  // H[c] and Delta
    } else if (!cache) {  // H[c] saved by the forward: Delta chunk-parallel instead of the sequential scan
      allow_smem(delta_kernel, kDeltaSmem);
      delta_kernel<<<dim3(chunk_grid.x, chunk_grid.y, kD / kVTile), kThreads, kDeltaSmem, stream>>>(a);
      LATHE_CUDA_LAUNCH_CHECK("gdn delta_kernel");
    }  // else both saved by the forward (the states and the chunk cache)
    launch_scan_backward(a, s, stream);
    allow_smem(chunk_backward_state_kernel, kStateBwdSmem);
    chunk_backward_state_kernel<<<chunk_grid, kThreads, kStateBwdSmem, stream>>>(a);
    LATHE_CUDA_LAUNCH_CHECK("gdn chunk_backward_state_kernel");
    allow_smem(chunk_backward_wy_kernel, kWyBwdSmem);
    chunk_backward_wy_kernel<<<chunk_grid, kThreads, kWyBwdSmem, stream>>>(a);
    LATHE_CUDA_LAUNCH_CHECK("gdn chunk_backward_wy_kernel");
    if (group == 1) return;
    dqh = x.dqh;
    dkh = x.dkh;
  } else {
    const RecurrentScratch x = carve_recurrent(c, s);
    launch_offsets(s, cu, x.offsets, stream);
    const size_t smem = sizeof(float) * size_t(s.k_dim * s.v_dim + 2 * s.k_dim + 3 * s.v_dim);
    dispatch_gates(dtype, gate_dtype, [&](auto tag, auto gate_tag) {
      using T = decltype(tag);
      using G = decltype(gate_tag);
      allow_smem(recurrent_backward_kernel<T, G>, smem);
      recurrent_backward_kernel<T, G><<<unsigned(x.blocks), kThreads, smem, stream>>>(
          recurrent_args(s, cu), static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
          static_cast<const G*>(g), static_cast<const G*>(beta), static_cast<const T*>(d_o), x.offsets, x.ckpt, x.tok,
          x.us, x.dqh, x.dkh, static_cast<T*>(dv), static_cast<G*>(dg), static_cast<G*>(dbeta));
    });
    LATHE_CUDA_LAUNCH_CHECK("gdn recurrent_backward_kernel");
    dqh = x.dqh;
    dkh = x.dkh;
  }
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = s.tokens * s.k_heads * s.k_dim;
    const int grid = grid_for(s.k_dim % 8 == 0 ? n / 8 : n, kThreads);
    group_sum_kernel<T><<<grid, kThreads, 0, stream>>>(s.tokens, s.k_heads, group, s.k_dim, dqh, static_cast<T*>(dq));
    group_sum_kernel<T><<<grid, kThreads, 0, stream>>>(s.tokens, s.k_heads, group, s.k_dim, dkh, static_cast<T*>(dk));
  });
  LATHE_CUDA_LAUNCH_CHECK("gdn group_sum_kernel");
}

}  // namespace lathe::cuda
