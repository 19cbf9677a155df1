// CUDA optimizer kernels: the AdamW step (op `adamw`, formula in ops/op_table.h) on f32 masters and moments, or on
// bf16 parameters and moments (bf16 optimizer states: the parameter is its own master), with f32, bf16 or f16
// gradients, computed in float with IEEE division and sqrt (no fast-math), in the same order of operations as the CPU
// reference (backend/cpu/optim.cpp). Pointers are not __restrict__: outputs alias inputs.
// The optional bf16/f16 parameter output is the new f32 master stored through the same conversion as the cast kernel
// (elementwise.cu: store of a float, round to nearest even), so it is bitwise what adamw followed by cast writes; bf16
// states are widened on load and stored through that same conversion.
// Aligned tensors move in 16-byte accesses (8 elements a thread step), others element by element; the arithmetic is
// one shared function, so both paths give the same bits. adamw_list: one launch over a table of tensors, each cut
// into chunks of kAdamWListChunk elements, one block a chunk (a block finds its tensor by binary search over the
// table's first-chunk indices); the same per-element function, so each tensor gets bitwise what adamw gives it.
// Covered by the adamw op-check cases (f32 and bf16 keys) and tests/unit/test_optim.cpp (bf16 gradients and bf16
// states against the CPU, on a GPU).
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/optim_launchers.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

// One element's update: (w, g, m, v) -> (w_out, m_out, v_out); g is the raw gradient. Every operation is an explicit
// round-to-nearest intrinsic (no contraction left to the compiler), so each instantiation of the kernel (f32 or bf16
// states, packed or not) computes bitwise the same floats: bf16 states are exactly f32 states then a cast.
__device__ __forceinline__ void adamw_one(float w, float g_raw, float m, float v, const AdamWScalars& s, float& w_out,
                                          float& m_out, float& v_out) {
  const float g = __fmul_rn(s.grad_scale, g_raw);
  m_out = __fmaf_rn(s.beta1, m, __fmul_rn(s.one_minus_beta1, g));
  v_out = __fmaf_rn(s.beta2, fabsf(v), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_out), s.sqrt_bc2), s.eps);
  w_out = __fsub_rn(__fmaf_rn(-s.lr_wd, w, w), __fdiv_rn(__fmul_rn(s.step_size, m_out), denom));
}

// S: the state's dtype (float: f32 masters and moments; __nv_bfloat16: bf16 parameter and moments, widened to float
// for the arithmetic and rounded on store). P: the parameter's dtype (__nv_bfloat16, __half), or void for no
// parameter output (always void for bf16 states).
template <typename S, typename G, typename P> struct AdamWPointers {
  const S* w;
  const G* grad;
  const S* m;
  const S* v;
  S *w_out, *m_out, *v_out;
  P* param;
};

// Elements i .. i + kN - 1 (kN = 8: 16-byte accesses of the 2-byte arrays, two of each f32 array; or 1). Every input
// is loaded before any output is stored, so outputs may alias inputs.
template <int kN, typename S, typename G, typename P>
__device__ __forceinline__ void adamw_elements(const AdamWPointers<S, G, P>& t, int64_t i, const AdamWScalars& s) {
  const Pack<S, kN> wv = load_pack<S, kN>(t.w + i), mv = load_pack<S, kN>(t.m + i), vv = load_pack<S, kN>(t.v + i);
  const Pack<G, kN> gv = load_pack<G, kN>(t.grad + i);
  Pack<float, kN> wo;
  Pack<S, kN> ws, ms, vs;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    float mo, vo;
    adamw_one(load(wv.e, k), load(gv.e, k), load(mv.e, k), load(vv.e, k), s, wo.e[k], mo, vo);
    store(ws.e, k, wo.e[k]);
    store(ms.e, k, mo);
    store(vs.e, k, vo);
  }
  store_pack(t.w_out + i, ws);
  store_pack(t.m_out + i, ms);
  store_pack(t.v_out + i, vs);
  if constexpr (!std::is_void_v<P>) {
    Pack<P, kN> pv;
#pragma unroll
    for (int k = 0; k < kN; ++k) store(pv.e, k, wo.e[k]);
    store_pack(t.param + i, pv);
  }
}

// kN elements a thread step: 8 when every pointer is 16-byte aligned, else 1; the n % kN elements past the last whole
// pack are done one by one.
template <typename S, typename G, typename P, int kN>
__global__ void adamw_kernel(int64_t n, AdamWPointers<S, G, P> t, AdamWScalars s) {
  const int64_t packs = n / kN;
  for (int64_t p = global_thread(); p < packs; p += grid_threads()) adamw_elements<kN>(t, p * kN, s);
  for (int64_t i = packs * kN + global_thread(); i < n; i += grid_threads()) adamw_elements<1>(t, i, s);
}

// Elements [begin, end) of one tensor of a list, by one block: 16-byte packs where the tensor is `packed` (begin is
// a multiple of 8), then the elements past the last whole pack one by one.
template <typename S, typename G, typename P>
__global__ void adamw_list_kernel(const AdamWListEntry* table, int n_tensors, AdamWScalars s) {
  const AdamWListEntry& e = table[chunk_owner(table, n_tensors)];
  const AdamWPointers<S, G, P> t{static_cast<const S*>(e.w),  static_cast<const G*>(e.grad),
                                 static_cast<const S*>(e.m),  static_cast<const S*>(e.v),
                                 static_cast<S*>(e.w_out),    static_cast<S*>(e.m_out),
                                 static_cast<S*>(e.v_out),    static_cast<P*>(e.param)};
  const int64_t begin = (int64_t(blockIdx.x) - e.first_chunk) * kAdamWListChunk;
  const int64_t end = min(e.n, begin + kAdamWListChunk);
  int64_t first_single = begin;
  if (e.packed) {
    const int64_t packs = (end - begin) / 8;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) adamw_elements<8>(t, begin + p * 8, s);
    first_single = begin + packs * 8;
  }
  for (int64_t i = first_single + threadIdx.x; i < end; i += blockDim.x) adamw_elements<1>(t, i, s);
}

template <typename S, typename G, typename P>
void launch(int64_t n, const void* w, const void* grad, const void* m, const void* v, void* w_out, void* m_out,
            void* v_out, void* param, const AdamWScalars& s, cudaStream_t stream) {
  const AdamWPointers<S, G, P> t{static_cast<const S*>(w), static_cast<const G*>(grad), static_cast<const S*>(m),
                                 static_cast<const S*>(v), static_cast<S*>(w_out),      static_cast<S*>(m_out),
                                 static_cast<S*>(v_out),   static_cast<P*>(param)};
  const bool packed = aligned16(w) && aligned16(grad) && aligned16(m) && aligned16(v) && aligned16(w_out) &&
                      aligned16(m_out) && aligned16(v_out) && (!param || aligned16(param));
  if (packed)
    adamw_kernel<S, G, P, 8><<<grid_for(n / 8 + 1, kThreads), kThreads, 0, stream>>>(n, t, s);
  else
    adamw_kernel<S, G, P, 1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, t, s);
}

template <typename G>
void launch_for_param(DType state_dtype, DType param_dtype, int64_t n, const void* w, const void* grad, const void* m,
                      const void* v, void* w_out, void* m_out, void* v_out, void* param, const AdamWScalars& s,
                      cudaStream_t stream) {
  if (state_dtype == DType::BF16) {
    if (param)
      throw_cuda_error("adamw (bf16 states take no parameter output)", cudaErrorInvalidValue, __FILE__, __LINE__);
    return launch<__nv_bfloat16, G, void>(n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
  }
  if (state_dtype != DType::F32)
    throw_cuda_error("adamw (state dtype not f32 or bf16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  if (!param) return launch<float, G, void>(n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
  switch (param_dtype) {
    case DType::BF16: return launch<float, G, __nv_bfloat16>(n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
    case DType::F16: return launch<float, G, __half>(n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
    default: throw_cuda_error("adamw (parameter dtype not bf16 or f16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  }
}

template <typename G>
void launch_list_for_param(DType state_dtype, DType param_dtype, bool with_param, const AdamWListEntry* table,
                           int n_tensors, int64_t chunks, const AdamWScalars& s, cudaStream_t stream) {
  const unsigned grid = unsigned(chunks);
  if (state_dtype == DType::BF16) {
    if (with_param)
      throw_cuda_error("adamw_list (bf16 states take no parameter output)", cudaErrorInvalidValue, __FILE__, __LINE__);
    adamw_list_kernel<__nv_bfloat16, G, void><<<grid, kThreads, 0, stream>>>(table, n_tensors, s);
    return;
  }
  if (state_dtype != DType::F32)
    throw_cuda_error("adamw_list (state dtype not f32 or bf16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  if (!with_param) return adamw_list_kernel<float, G, void><<<grid, kThreads, 0, stream>>>(table, n_tensors, s);
  switch (param_dtype) {
    case DType::BF16:
      return adamw_list_kernel<float, G, __nv_bfloat16><<<grid, kThreads, 0, stream>>>(table, n_tensors, s);
    case DType::F16: return adamw_list_kernel<float, G, __half><<<grid, kThreads, 0, stream>>>(table, n_tensors, s);
    default:
      throw_cuda_error("adamw_list (parameter dtype not bf16 or f16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  }
}

}  // namespace

void launch_adamw_list(DType state_dtype, DType grad_dtype, DType param_dtype, bool with_param,
                       const AdamWListEntry* table, int n_tensors, int64_t chunks, const AdamWScalars& s,
                       cudaStream_t stream) {
  if (chunks == 0) return;
  dispatch_f32_bf16_f16(grad_dtype, "adamw_list (gradient dtype not f32, bf16 or f16)", [&](auto g) {
    launch_list_for_param<decltype(g)>(state_dtype, param_dtype, with_param, table, n_tensors, chunks, s, stream);
  });
  LATHE_CUDA_LAUNCH_CHECK("adamw_list_kernel");
}

void launch_adamw(DType state_dtype, DType grad_dtype, int64_t n, const void* w, const void* grad, const void* m,
                  const void* v, void* w_out, void* m_out, void* v_out, DType param_dtype, void* param,
                  const AdamWScalars& s, cudaStream_t stream) {
  if (n == 0) return;
  switch (grad_dtype) {
    case DType::F32:
      launch_for_param<float>(state_dtype, param_dtype, n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
      break;
    case DType::BF16:
      launch_for_param<__nv_bfloat16>(state_dtype, param_dtype, n, w, grad, m, v, w_out, m_out, v_out, param, s,
                                      stream);
      break;
    case DType::F16:
      launch_for_param<__half>(state_dtype, param_dtype, n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
      break;
    default: throw_cuda_error("adamw (gradient dtype not f32, bf16 or f16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  }
  LATHE_CUDA_LAUNCH_CHECK("adamw_kernel");
}

}  // namespace lathe::cuda
