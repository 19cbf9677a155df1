// CUDA kernel of `matmul` for y = alpha x W^T with few rows of x (skinny_linear.h): memory-bound, so it is written to
// read W once at the copy rate. A block stages x (m, k) in shared memory; each warp takes two rows of W at a time
// (grid-stride), each lane reading 16-byte packs of both rows in a strided sweep (four sweeps unrolled, so eight loads
// are in flight a lane), multiplying them with x's packs and accumulating the m dots in fp32; a fixed shuffle tree sums
// the lanes and lane 0 writes the m outputs, scaled by alpha and rounded once. Deterministic (no atomics, fixed
// orders). Covered by the matmul op cases with 2-D transposed B and 1-4 rows (testing/op_cases.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/skinny_linear.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T, int M>
__global__ void skinny_linear_kernel(int64_t n, int64_t k, float alpha, const T* __restrict__ x,
                                     const T* __restrict__ w, T* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);
  constexpr int V = kPackOf16<T>;
  const int64_t packs = k / V;
  for (int64_t i = threadIdx.x; i < M * packs; i += blockDim.x)
    reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x)[i];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t row = (int64_t(blockIdx.x) * warps + warp) * 2; row < n; row += int64_t(gridDim.x) * warps * 2) {
    const int64_t second = row + 1 < n ? row + 1 : row;
    const uint4* w0 = reinterpret_cast<const uint4*>(w + row * k);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + second * k);
    float acc0[M] = {}, acc1[M] = {};
#pragma unroll 4
    for (int64_t p = lane; p < packs; p += 32) {
      const Pack<T, V> a = load_pack<T, V>(reinterpret_cast<const T*>(w0 + p));
      const Pack<T, V> b = load_pack<T, V>(reinterpret_cast<const T*>(w1 + p));
#pragma unroll
      for (int r = 0; r < M; ++r) {
        const Pack<T, V> xv = load_pack<T, V>(xs + r * k + p * V);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xe = float(load(xv.e, e));
          acc0[r] = fmaf(float(load(a.e, e)), xe, acc0[r]);
          acc1[r] = fmaf(float(load(b.e, e)), xe, acc1[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const float s0 = warp_sum(acc0[r]), s1 = warp_sum(acc1[r]);
      if (lane == 0) {
        store(y, r * n + row, alpha * s0);
        if (second != row) store(y, r * n + second, alpha * s1);
      }
    }
  }
}

template <typename T, int M>
void launch_rows(int64_t n, int64_t k, float alpha, const void* x, const void* w, void* y, cudaStream_t stream) {
  const int warps = kThreads / 32;
  const int64_t wanted = (n + 2 * warps - 1) / (2 * warps);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t(multiprocessors()) * 16));
  const size_t smem = size_t(M * k) * sizeof(T);
  skinny_linear_kernel<T, M><<<unsigned(blocks), kThreads, smem, stream>>>(
      n, k, alpha, static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y));
  LATHE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_skinny_linear(DType dtype, int64_t m, int64_t n, int64_t k, float alpha, const void* x, const void* w,
                          void* y, cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  dispatch_f32_bf16_f16(dtype, "skinny_linear dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    switch (m) {
      case 1: launch_rows<T, 1>(n, k, alpha, x, w, y, stream); break;
      case 2: launch_rows<T, 2>(n, k, alpha, x, w, y, stream); break;
      case 3: launch_rows<T, 3>(n, k, alpha, x, w, y, stream); break;
      case 4: launch_rows<T, 4>(n, k, alpha, x, w, y, stream); break;
      default: throw_cuda_error("skinny_linear: more than 4 rows", cudaErrorInvalidValue, __FILE__, __LINE__);
    }
  });
}

}  // namespace lathe::cuda
