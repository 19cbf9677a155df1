// CUDA optimizer kernels: the AdamW step (op `adamw`, formula in ops/op_table.h) on f32 masters and moments with
// f32, bf16 or f16 gradients, computed in float with IEEE division and sqrt (no fast-math), in the same order of
// operations as the CPU reference (backend/cpu/optim.cpp). Pointers are not __restrict__: outputs alias inputs.
// Covered by the adamw op-check cases (f32 gradients) and tests/unit/test_optim.cpp (bf16 gradients, on a GPU).
#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/optim_launchers.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

template <typename G>
__global__ void adamw_kernel(int64_t n, const float* w, const G* grad, const float* m, const float* v, float* w_out,
                             float* m_out, float* v_out, AdamWScalars s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = s.grad_scale * load(grad, i);
    const float mi = s.beta1 * m[i] + s.one_minus_beta1 * g;
    const float vi = s.beta2 * fabsf(v[i]) + s.one_minus_beta2 * g * g;
    const float wi = w[i] - s.lr_wd * w[i] - s.step_size * mi / (sqrtf(vi) / s.sqrt_bc2 + s.eps);
    w_out[i] = wi;
    m_out[i] = mi;
    v_out[i] = vi;
  }
}

template <typename G>
void launch(int64_t n, const float* w, const void* grad, const float* m, const float* v, float* w_out, float* m_out,
            float* v_out, const AdamWScalars& s, cudaStream_t stream) {
  adamw_kernel<G><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, w, static_cast<const G*>(grad), m, v, w_out,
                                                                  m_out, v_out, s);
}

}  // namespace

void launch_adamw(DType grad_dtype, int64_t n, const float* w, const void* grad, const float* m, const float* v,
                  float* w_out, float* m_out, float* v_out, const AdamWScalars& s, cudaStream_t stream) {
  if (n == 0) return;
  switch (grad_dtype) {
    case DType::F32: launch<float>(n, w, grad, m, v, w_out, m_out, v_out, s, stream); break;
    case DType::BF16: launch<__nv_bfloat16>(n, w, grad, m, v, w_out, m_out, v_out, s, stream); break;
    case DType::F16: launch<__half>(n, w, grad, m, v, w_out, m_out, v_out, s, stream); break;
    default: throw_cuda_error("adamw (gradient dtype not f32, bf16 or f16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  }
  LATHE_CUDA_LAUNCH_CHECK("adamw_kernel");
}

}  // namespace lathe::cuda
