// CUDA optimizer kernels: the AdamW step (op `adamw`, formula in ops/op_table.h) on f32 masters and moments with
// f32, bf16 or f16 gradients, computed in float with IEEE division and sqrt (no fast-math), in the same order of
// operations as the CPU reference (backend/cpu/optim.cpp). Pointers are not __restrict__: outputs alias inputs.
// The optional bf16/f16 parameter output is the new f32 master stored through the same conversion as the cast kernel
// (elementwise.cu: store of a float, round to nearest even), so it is bitwise what adamw followed by cast writes.
// Aligned tensors move in 16-byte accesses (8 elements a thread step), others element by element; the arithmetic is
// one shared function, so both paths give the same bits.
// Covered by the adamw op-check cases (f32 gradients) and tests/unit/test_optim.cpp (bf16 gradients, on a GPU).
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/optim_launchers.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

// One element's update: (w, g, m, v) -> (w_out, m_out, v_out); g is the raw gradient.
__device__ __forceinline__ void adamw_one(float w, float g_raw, float m, float v, const AdamWScalars& s, float& w_out,
                                          float& m_out, float& v_out) {
  const float g = s.grad_scale * g_raw;
  m_out = s.beta1 * m + s.one_minus_beta1 * g;
  v_out = s.beta2 * fabsf(v) + s.one_minus_beta2 * g * g;
  w_out = w - s.lr_wd * w - s.step_size * m_out / (sqrtf(v_out) / s.sqrt_bc2 + s.eps);
}

// P: the parameter's dtype (__nv_bfloat16, __half), or void for no parameter output. kN elements a thread step: 8
// (16-byte accesses of the bf16/f16 arrays, two of each f32 array) when every pointer is 16-byte aligned, else 1.
// A thread loads all of its elements before it stores any, so outputs may alias inputs; the n % kN elements past
// the last whole pack are done one by one.
template <typename G, typename P, int kN>
__global__ void adamw_kernel(int64_t n, const float* w, const G* grad, const float* m, const float* v, float* w_out,
                             float* m_out, float* v_out, P* param, AdamWScalars s) {
  const int64_t packs = n / kN;
  for (int64_t p = global_thread(); p < packs; p += grid_threads()) {
    const int64_t i = p * kN;
    const Pack<float, kN> wv = load_pack<float, kN>(w + i), mv = load_pack<float, kN>(m + i),
                          vv = load_pack<float, kN>(v + i);
    const Pack<G, kN> gv = load_pack<G, kN>(grad + i);
    Pack<float, kN> wo, mo, vo;
#pragma unroll
    for (int k = 0; k < kN; ++k) adamw_one(wv.e[k], load(gv.e, k), mv.e[k], vv.e[k], s, wo.e[k], mo.e[k], vo.e[k]);
    store_pack(w_out + i, wo);
    store_pack(m_out + i, mo);
    store_pack(v_out + i, vo);
    if constexpr (!std::is_void_v<P>) {
      Pack<P, kN> pv;
#pragma unroll
      for (int k = 0; k < kN; ++k) store(pv.e, k, wo.e[k]);
      store_pack(param + i, pv);
    }
  }
  for (int64_t i = packs * kN + global_thread(); i < n; i += grid_threads()) {
    float wi, mi, vi;
    adamw_one(w[i], load(grad, i), m[i], v[i], s, wi, mi, vi);
    w_out[i] = wi;
    m_out[i] = mi;
    v_out[i] = vi;
    if constexpr (!std::is_void_v<P>) store(param, i, wi);
  }
}

template <typename G, typename P>
void launch(int64_t n, const float* w, const void* grad, const float* m, const float* v, float* w_out, float* m_out,
            float* v_out, void* param, const AdamWScalars& s, cudaStream_t stream) {
  const auto* g = static_cast<const G*>(grad);
  auto* pp = static_cast<P*>(param);
  const bool packed = aligned16(w) && aligned16(grad) && aligned16(m) && aligned16(v) && aligned16(w_out) &&
                      aligned16(m_out) && aligned16(v_out) && (!param || aligned16(param));
  if (packed)
    adamw_kernel<G, P, 8><<<grid_for(n / 8 + 1, kThreads), kThreads, 0, stream>>>(n, w, g, m, v, w_out, m_out, v_out,
                                                                                  pp, s);
  else
    adamw_kernel<G, P, 1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, w, g, m, v, w_out, m_out, v_out, pp, s);
}

template <typename G>
void launch_for_param(DType param_dtype, int64_t n, const float* w, const void* grad, const float* m, const float* v,
                      float* w_out, float* m_out, float* v_out, void* param, const AdamWScalars& s,
                      cudaStream_t stream) {
  if (!param) return launch<G, void>(n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
  switch (param_dtype) {
    case DType::BF16: return launch<G, __nv_bfloat16>(n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
    case DType::F16: return launch<G, __half>(n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
    default: throw_cuda_error("adamw (parameter dtype not bf16 or f16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  }
}

}  // namespace

void launch_adamw(DType grad_dtype, int64_t n, const float* w, const void* grad, const float* m, const float* v,
                  float* w_out, float* m_out, float* v_out, DType param_dtype, void* param, const AdamWScalars& s,
                  cudaStream_t stream) {
  if (n == 0) return;
  switch (grad_dtype) {
    case DType::F32:
      launch_for_param<float>(param_dtype, n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
      break;
    case DType::BF16:
      launch_for_param<__nv_bfloat16>(param_dtype, n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
      break;
    case DType::F16:
      launch_for_param<__half>(param_dtype, n, w, grad, m, v, w_out, m_out, v_out, param, s, stream);
      break;
    default: throw_cuda_error("adamw (gradient dtype not f32, bf16 or f16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  }
  LATHE_CUDA_LAUNCH_CHECK("adamw_kernel");
}

}  // namespace lathe::cuda
