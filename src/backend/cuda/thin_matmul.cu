// CUDA kernels of `matmul` for thin batched products, C[b] = alpha A[b] B[b] + beta C[b] with A[b] (m, K) and B[b]
// (K, n) row-major, no transposes, one batch per leading index (the MoE combine: (1, k) x (k, D), its gradient's
// (k, 1) x (1, D) outer products and the (k, D) x (D, 1) dots). cuBLAS runs these at under 1 TFLOP/s and far from
// the memory bound (H100: 5.6 ms of a 74 ms Qwen3-30B-A3B-shape step, docs/benchmarks.md); they move bytes, so each
// kernel reads every operand once:
// - small K (<= kMaxThinK): a thread computes one 16-byte pack of a row of C (8 columns of bf16/f16, 4 of f32) where n,
//   the batch strides and the pointers allow, else one column, summing the K products in order in fp32;
// - n = 1 (a batch of matrix-vector products): a warp per row of C, each lane a strided part of the dot in fp32, then
//   a fixed shuffle tree.
// Both apply alpha and beta in fp32 and round once, as cuBLAS does; both are deterministic (no atomics, fixed
// orders). Covered by the matmul op cases with thin batched shapes (testing/op_cases.cpp), on every CUDA dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/thin_matmul.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

// One thread per kN columns of one row of C (grid-stride over batch x m x n / kN).
template <typename T, int kN>
__global__ void small_k_kernel(ThinMatmul p, const T* a, const T* b, T* c) {
  const int64_t packs = p.n / kN, total = p.batch * p.m * packs;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t col = (i % packs) * kN, row = (i / packs) % p.m, batch = i / (packs * p.m);
    const T* ar = a + batch * p.stride_a + row * p.k;
    const T* bb = b + batch * p.stride_b + col;
    float acc[kN] = {};
    for (int64_t l = 0; l < p.k; ++l) {
      const float x = float(load(ar, l));
      const Pack<T, kN> y = load_pack<T, kN>(bb + l * p.n);
#pragma unroll
      for (int e = 0; e < kN; ++e) acc[e] = fmaf(x, float(load(y.e, e)), acc[e]);
    }
    T* cr = c + batch * p.stride_c + row * p.n + col;
    Pack<T, kN> out;
    if (p.beta != 0.0f) {
      const Pack<T, kN> old = load_pack<T, kN>(cr);
#pragma unroll
      for (int e = 0; e < kN; ++e) store(out.e, e, p.alpha * acc[e] + p.beta * float(load(old.e, e)));
    } else {
#pragma unroll
      for (int e = 0; e < kN; ++e) store(out.e, e, p.alpha * acc[e]);
    }
    store_pack(cr, out);
  }
}

// One warp per row of C (n = 1): lane l sums the products l, l + 32, ... of the row in order, then a shuffle tree.
template <typename T>
__global__ void matvec_kernel(ThinMatmul p, const T* a, const T* b, T* c) {
  const int lane = int(threadIdx.x % 32);
  const int64_t rows = p.batch * p.m, warps = grid_threads() / 32;
  for (int64_t r = global_thread() / 32; r < rows; r += warps) {
    const int64_t batch = r / p.m;
    const T* ar = a + batch * p.stride_a + (r % p.m) * p.k;
    const T* bv = b + batch * p.stride_b;
    float acc = 0;
    for (int64_t l = lane; l < p.k; l += 32) acc = fmaf(float(load(ar, l)), float(load(bv, l)), acc);
    acc = warp_sum(acc);
    if (lane == 0) {
      T* cr = c + batch * p.stride_c + r % p.m;
      const float v = p.beta != 0.0f ? p.alpha * acc + p.beta * float(load(cr, 0)) : p.alpha * acc;
      store(cr, 0, v);
    }
  }
}

}  // namespace

bool thin_matmul_shape(const ThinMatmul& p) { return p.k <= kMaxThinK || p.n == 1; }

void launch_thin_matmul(DType dtype, const ThinMatmul& p, const void* a, const void* b, void* c, cudaStream_t stream) {
  if (p.batch * p.m * p.n == 0) return;
  dispatch_f32_bf16_f16(dtype, "thin matmul (dtype must be f32, bf16 or f16)", [&](auto tag) {
    using T = decltype(tag);
    const auto* pa = static_cast<const T*>(a);
    const auto* pb = static_cast<const T*>(b);
    auto* pc = static_cast<T*>(c);
    if (p.n == 1 && p.k > kMaxThinK) {
      matvec_kernel<T><<<grid_for(p.batch * p.m * 32, kThreads), kThreads, 0, stream>>>(p, pa, pb, pc);
      LATHE_CUDA_LAUNCH_CHECK("thin matmul matvec_kernel");
      return;
    }
    constexpr int kV = kPackOf16<T>;
    const bool packed = p.n % kV == 0 && p.stride_b % kV == 0 && p.stride_c % kV == 0 && aligned16(b) && aligned16(c);
    if (packed) {
      small_k_kernel<T, kV><<<grid_for(p.batch * p.m * (p.n / kV), kThreads), kThreads, 0, stream>>>(p, pa, pb, pc);
    } else {
      small_k_kernel<T, 1><<<grid_for(p.batch * p.m * p.n, kThreads), kThreads, 0, stream>>>(p, pa, pb, pc);
    }
    LATHE_CUDA_LAUNCH_CHECK("thin matmul small_k_kernel");
  });
}

}  // namespace lathe::cuda
