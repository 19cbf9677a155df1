// CUDA kernel of gated_delta_rule_state: the gated delta rule token by token from given states (research note
// gated-deltanet.md §2.2), for prefill and decoding. One block per (document, value head); its state S (d_k, d_v)
// stays in shared memory in the accumulation type (float; double for f64) for the whole document. Thread j owns
// column j of S (a loop when d_v exceeds the block), which is all a token needs for that column:
//     S[:, j] *= e^g;  u_j = beta (v_j - S[:, j] . k);  S[:, j] += k u_j;  o_j = S[:, j] . (s q)
// so the only synchronisation is around loading each token's key and query into shared memory. Simple and
// correct first: a prefill of T tokens is T sequential steps (the chunked kernels are for training).
// For d_k = d_v = 128 (Qwen3.5 and Qwen3-Next), cuda/gated_delta_rule_state_registers instead keeps the state in
// registers: 512 threads a block, thread (r, j) holding rows [32 r, 32 r + 32) of column j, so a decoding step reads
// and writes the state once, coalesced, with 32 loads in flight a thread (the shared-memory kernel's 128 threads
// load 64 KiB one element at a time each, and its block's 64 KiB of shared memory leave three blocks an SM). The two
// column sums of each token (S[:, j] . k and S[:, j] . q) are each four partial sums added in a fixed order through
// shared memory (deterministic; another order than the shared-memory kernel's, so the last bits may differ).
// Convention: cu_seqlens is read on the device and not validated (as the attention kernels); boundaries are clamped
// to [0, T] so that bad ones cannot read out of bounds. Covered by the gated_delta_rule_state op-check cases
// (src/testing/op_cases_gdn_state.cpp) and tests/models/test_generate_qwen3_5.cpp (CUDA decoding vs CPU).
#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/gdn_state_launchers.h"

namespace lathe::cuda {

namespace {

constexpr int kMaxThreads = 256;
constexpr size_t kDefaultSmemBytes = 48 * 1024;  // above this a kernel must opt in
constexpr int kRegisterDim = 128;                 // d_k = d_v of the register kernel

template <typename T, typename G>
__global__ void gdn_state_kernel(GdnStateDims d, const T* q, const T* k, const T* v, const G* g, const G* beta,
                                 const int32_t* cu, int64_t tokens,
                                 const typename Compute<T>::type* state, T* o,
                                 typename Compute<T>::type* final_state) {
  using A = typename Compute<T>::type;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int64_t dk = d.k_dim, dv = d.v_dim;
  A* s = reinterpret_cast<A*>(smem_raw);  // (d_k, d_v)
  A* key = s + dk * dv;                    // (d_k)
  A* query = key + dk;                     // (d_k), times the scale
  const int64_t n = blockIdx.x / d.v_heads, h = blockIdx.x % d.v_heads;
  const int64_t kh = h / (d.v_heads / d.k_heads);
  const int64_t state_off = (n * d.v_heads + h) * dk * dv;
  for (int64_t i = threadIdx.x; i < dk * dv; i += blockDim.x) s[i] = state[state_off + i];
  int64_t begin = cu[n], end = cu[n + 1];
  begin = begin < 0 ? 0 : begin > tokens ? tokens : begin;
  end = end < begin ? begin : end > tokens ? tokens : end;
  const A scale = A(d.scale);
  for (int64_t t = begin; t < end; ++t) {
    __syncthreads();  // the previous token's key and query are no longer read (and the state load is done)
    const int64_t kq = (t * d.k_heads + kh) * dk;
    for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
      key[i] = load(k, kq + i);
      query[i] = scale * load(q, kq + i);
    }
    __syncthreads();
    const int64_t th = t * d.v_heads + h;  // row of g and beta; (th, j) indexes v and o
    const A alpha = exp(A(load(g, th)));
    const A b = load(beta, th);
    for (int64_t j = threadIdx.x; j < dv; j += blockDim.x) {
      A pred = 0;
      for (int64_t i = 0; i < dk; ++i) {
        const A x = s[i * dv + j] * alpha;
        s[i * dv + j] = x;
        pred += x * key[i];
      }
      const A u = b * (A(load(v, th * dv + j)) - pred);
      A out = 0;
      for (int64_t i = 0; i < dk; ++i) {
        const A x = s[i * dv + j] + key[i] * u;
        s[i * dv + j] = x;
        out += x * query[i];
      }
      store(o, th * dv + j, out);
    }
  }
  __syncthreads();  // columns were written by their owners; the copy-out below reads them all
  for (int64_t i = threadIdx.x; i < dk * dv; i += blockDim.x) final_state[state_off + i] = s[i];
}

template <typename T, typename G, int DK, int DV, int kGroups>
__global__ void __launch_bounds__(DV * kGroups)
    gdn_state_registers_kernel(GdnStateDims d, const T* q, const T* k, const T* v, const G* g, const G* beta,
                               const int32_t* cu, int64_t tokens, const typename Compute<T>::type* state, T* o,
                               typename Compute<T>::type* final_state) {
  using A = typename Compute<T>::type;
  constexpr int R = DK / kGroups;  // rows of S a thread holds
  __shared__ A key[DK], query[DK];
  __shared__ A part[kGroups][DV];
  const int j = int(threadIdx.x) % DV, grp = int(threadIdx.x) / DV, i0 = grp * R;
  const int64_t n = blockIdx.x / d.v_heads, h = blockIdx.x % d.v_heads;
  const int64_t kh = h / (d.v_heads / d.k_heads);
  const int64_t state_off = (n * d.v_heads + h) * DK * DV;
  A s[R];
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = state[state_off + (i0 + r) * DV + j];
  int64_t begin = cu[n], end = cu[n + 1];
  begin = begin < 0 ? 0 : begin > tokens ? tokens : begin;
  end = end < begin ? begin : end > tokens ? tokens : end;
  const A scale = A(d.scale);
  for (int64_t t = begin; t < end; ++t) {
    __syncthreads();  // the previous token's key, query and sums are read
    const int64_t kq = (t * d.k_heads + kh) * DK;
    for (int i = int(threadIdx.x); i < DK; i += int(blockDim.x)) {
      key[i] = load(k, kq + i);
      query[i] = scale * load(q, kq + i);
    }
    __syncthreads();
    const int64_t th = t * d.v_heads + h;
    const A alpha = exp(A(load(g, th)));
    const A b = load(beta, th);
    A pred = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      s[r] *= alpha;
      pred += s[r] * key[i0 + r];
    }
    part[grp][j] = pred;
    __syncthreads();
    A total = 0;
#pragma unroll
    for (int x = 0; x < kGroups; ++x) total += part[x][j];
    const A u = b * (A(load(v, th * DV + j)) - total);
    A out = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      s[r] += key[i0 + r] * u;
      out += s[r] * query[i0 + r];
    }
    __syncthreads();  // every group has read the first sums
    part[grp][j] = out;
    __syncthreads();
    if (grp == 0) {
      A sum = 0;
#pragma unroll
      for (int x = 0; x < kGroups; ++x) sum += part[x][j];
      store(o, th * DV + j, sum);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) final_state[state_off + (i0 + r) * DV + j] = s[r];
}

template <typename T, typename G>
void launch_gated(const GdnStateDims& d, const void* q, const void* k, const void* v, const void* g, const void* beta,
                  const int32_t* cu, int64_t tokens, const void* state, void* o, void* final_state,
                  size_t smem, bool registers, cudaStream_t stream) {
  using A = typename Compute<T>::type;
  if (registers) {
    constexpr int kGroups = 4;
    gdn_state_registers_kernel<T, G, kRegisterDim, kRegisterDim, kGroups>
        <<<unsigned(d.docs * d.v_heads), kRegisterDim * kGroups, 0, stream>>>(
            d, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const G*>(g),
            static_cast<const G*>(beta), cu, tokens, static_cast<const A*>(state), static_cast<T*>(o),
            static_cast<A*>(final_state));
    return;
  }
  const auto kernel = gdn_state_kernel<T, G>;
  if (smem > kDefaultSmemBytes)
    LATHE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int threads = int(d.v_dim >= kMaxThreads ? kMaxThreads : (d.v_dim + 31) / 32 * 32);
  kernel<<<unsigned(d.docs * d.v_heads), threads, smem, stream>>>(
      d, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const G*>(g),
      static_cast<const G*>(beta), cu, tokens, static_cast<const A*>(state), static_cast<T*>(o),
      static_cast<A*>(final_state));
}

// g and beta in the inputs' dtype, or in f32 beside bf16/f16 inputs (the model's fp32 log-decay).
template <typename T>
void launch_typed(const GdnStateDims& d, bool f32_gates, const void* q, const void* k, const void* v, const void* g,
                  const void* beta, const int32_t* cu, int64_t tokens, const void* state, void* o, void* final_state,
                  size_t smem, bool registers, cudaStream_t stream) {
  if (f32_gates)
    launch_gated<T, float>(d, q, k, v, g, beta, cu, tokens, state, o, final_state, smem, registers, stream);
  else
    launch_gated<T, T>(d, q, k, v, g, beta, cu, tokens, state, o, final_state, smem, registers, stream);
}

}  // namespace

bool gdn_state_registers_apply(int64_t k_dim, int64_t v_dim) { return k_dim == kRegisterDim && v_dim == kRegisterDim; }

size_t gdn_state_smem_bytes(DType dtype, int64_t k_dim, int64_t v_dim) {
  const size_t acc = dtype == DType::F64 ? sizeof(double) : sizeof(float);
  return size_t(k_dim * v_dim + 2 * k_dim) * acc;
}

void launch_gdn_state(DType dtype, DType gate_dtype, const GdnStateDims& d, const void* q, const void* k, const void* v,
                      const void* g, const void* beta, const int32_t* cu, int64_t tokens, const void* state, void* o,
                      void* final_state, bool registers, cudaStream_t stream) {
  if (d.docs == 0 || d.v_heads == 0) return;
  if (registers && !gdn_state_registers_apply(d.k_dim, d.v_dim))
    throw_cuda_error("gdn_state_registers_kernel (d_k or d_v not 128)", cudaErrorInvalidValue, __FILE__, __LINE__);
  const size_t smem = gdn_state_smem_bytes(dtype, d.k_dim, d.v_dim);
  const bool f32_gates = gate_dtype == DType::F32 && dtype != DType::F32;
  const auto run = [&](auto t) {
    launch_typed<decltype(t)>(d, f32_gates, q, k, v, g, beta, cu, tokens, state, o, final_state, smem, registers,
                              stream);
  };
  switch (dtype) {
    case DType::F32: run(float{}); break;
    case DType::F64: run(double{}); break;
    case DType::BF16: run(__nv_bfloat16{}); break;
    case DType::F16: run(__half{}); break;
    default:
      throw_cuda_error("gdn_state_kernel (dtype not f32, f64, bf16 or f16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  }
  LATHE_CUDA_LAUNCH_CHECK("gdn_state_kernel");
}

}  // namespace lathe::cuda
