// CUDA optimizer kernels: the AdamW step (op `adamw`, formula in ops/op_table.h) on f32 masters and moments with
// f32, bf16 or f16 gradients, computed in float with IEEE division and sqrt (no fast-math), in the same order of
// operations as the CPU reference (backend/cpu/optim.cpp). Pointers are not __restrict__: outputs alias inputs.
// The optional bf16/f16 parameter output is the new f32 master stored through the same conversion as the cast kernel
// (elementwise.cu: store of a float, round to nearest even), so it is bitwise what adamw followed by cast writes.
// Covered by the adamw op-check cases (f32 gradients) and tests/unit/test_optim.cpp (bf16 gradients, on a GPU).
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/optim_launchers.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

// P: the parameter's dtype (__nv_bfloat16, __half), or void for no parameter output.
template <typename G, typename P>
__global__ void adamw_kernel(int64_t n, const float* w, const G* grad, const float* m, const float* v, float* w_out,
                             float* m_out, float* v_out, P* param, AdamWScalars s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = s.grad_scale * load(grad, i);
    const float mi = s.beta1 * m[i] + s.one_minus_beta1 * g;
    const float vi = s.beta2 * fabsf(v[i]) + s.one_minus_beta2 * g * g;
    const float wi = w[i] - s.lr_wd * w[i] - s.step_size * mi / (sqrtf(vi) / s.sqrt_bc2 + s.eps);
    w_out[i] = wi;
    m_out[i] = mi;
    v_out[i] = vi;
    if constexpr (!std::is_void_v<P>) store(param, i, wi);
  }
}

template <typename G, typename P>
void launch(int64_t n, const float* w, const void* grad, const float* m, const float* v, float* w_out, float* m_out,
            float* v_out, void* param, const AdamWScalars& s, cudaStream_t stream) {
  adamw_kernel<G, P><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, w, static_cast<const G*>(grad), m, v, w_out,
                                                                     m_out, v_out, static_cast<P*>(param), s);
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
