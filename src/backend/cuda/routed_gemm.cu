// CUDA kernels of grouped_matmul_routed (ops/op_table.h): a decoding step's expert GEMMs, y[rows of e] = x[rows of e]
// w[e]^T with the groups read from moe_route's offsets on the device, so that no host wait splits the step and it can
// be recorded as a graph. Decoding gives few rows per expert (a batch of B tokens routes B k rows over E experts), so
// the product is memory-bound like the skinny linear (skinny_linear.cu), whose scheme this follows per expert:
// - cuda/routed_skinny: a block per (column range, expert); a block whose expert has no rows returns at once. The
//   expert's rows go in chunks of kRows: the chunk is staged in shared memory (zeros past the group's end; read from
//   global memory instead when kRows x K does not fit), then each warp takes two rows of w[e] at a time, its lanes
//   reading 16-byte packs in a strided sweep (four unrolled: eight loads in flight a lane) against the chunk's packs,
//   accumulating in fp32; a fixed shuffle tree sums the lanes. Deterministic (no atomics, fixed orders). Needs 16-byte
//   aligned operands, K and w's block stride multiples of a pack.
// - cuda/routed_rows: a thread per output element (grid-stride), its group found by a binary search over the offsets:
//   any size or alignment (the op cases' odd shapes).
// Covered by the grouped_matmul_routed op cases (testing/op_cases_moe.cpp) against the CPU's f64 reference.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/routed_gemm.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kRows = 8;                        // rows of a chunk
constexpr int64_t kMaxStagedBytes = 48 * 1024;  // a chunk staged in the default shared memory

// The rows [begin, end) of group e, clamped to [0, rows].
__device__ __forceinline__ void group_range(const int32_t* offsets, int64_t e, int64_t rows, int64_t& begin,
                                            int64_t& end) {
  begin = min(max(int64_t(offsets[e]), int64_t(0)), rows);
  end = min(max(int64_t(offsets[e + 1]), begin), rows);
}

template <typename T, bool kStaged>
__global__ void routed_skinny_kernel(int64_t rows, int64_t n, int64_t k, int64_t w_stride, const T* __restrict__ x,
                                     const T* __restrict__ w, const int32_t* __restrict__ offsets,
                                     T* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int V = kPackOf16<T>;
  const int64_t e = blockIdx.y, packs = k / V;
  int64_t begin, end;
  group_range(offsets, e, rows, begin, end);
  if (begin >= end) return;  // the same for the whole block
  const T* we = w + e * w_stride;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t r0 = begin; r0 < end; r0 += kRows) {
    const int count = int(min(int64_t(kRows), end - r0));
    const T* xr = x + r0 * k;
    if constexpr (kStaged) {
      uint4* xs = reinterpret_cast<uint4*>(smem);
      __syncthreads();  // the previous chunk is read
      for (int64_t i = threadIdx.x; i < kRows * packs; i += blockDim.x)
        xs[i] = i / packs < count ? reinterpret_cast<const uint4*>(xr)[i] : make_uint4(0, 0, 0, 0);
      __syncthreads();
      xr = reinterpret_cast<const T*>(smem);
    }
    for (int64_t col = (int64_t(blockIdx.x) * warps + warp) * 2; col < n; col += int64_t(gridDim.x) * warps * 2) {
      const int64_t second = col + 1 < n ? col + 1 : col;
      const uint4* w0 = reinterpret_cast<const uint4*>(we + col * k);
      const uint4* w1 = reinterpret_cast<const uint4*>(we + second * k);
      float acc0[kRows] = {}, acc1[kRows] = {};
#pragma unroll 4
      for (int64_t p = lane; p < packs; p += 32) {
        const Pack<T, V> a = load_pack<T, V>(reinterpret_cast<const T*>(w0 + p));
        const Pack<T, V> b = load_pack<T, V>(reinterpret_cast<const T*>(w1 + p));
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (!kStaged && r >= count) break;  // staged rows past the group are zeros
          const Pack<T, V> xv = load_pack<T, V>(xr + r * k + p * V);
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float xe = float(load(xv.e, i));
            acc0[r] = fmaf(float(load(a.e, i)), xe, acc0[r]);
            acc1[r] = fmaf(float(load(b.e, i)), xe, acc1[r]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float s0 = warp_sum(acc0[r]), s1 = warp_sum(acc1[r]);
        if (lane == 0 && r < count) {
          store(y, (r0 + r) * n + col, s0);
          if (second != col) store(y, (r0 + r) * n + second, s1);
        }
      }
    }
  }
}

template <typename T>
__global__ void routed_rows_kernel(int64_t rows, int64_t n, int64_t k, int64_t experts, int64_t w_stride, const T* x,
                                   const T* w, const int32_t* offsets, T* y) {
  for (int64_t idx = global_thread(); idx < rows * n; idx += grid_threads()) {
    const int64_t row = idx / n, col = idx % n;
    int64_t lo = 0, hi = experts;  // the last group whose clamped start is at most `row`
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2, start = min(max(int64_t(offsets[mid]), int64_t(0)), rows);
      if (start <= row) lo = mid;
      else hi = mid;
    }
    int64_t begin, end;
    group_range(offsets, lo, rows, begin, end);
    if (row < begin || row >= end) continue;  // no group holds it
    const T* wr = w + lo * w_stride + col * k;
    float acc = 0.0f;
    for (int64_t i = 0; i < k; ++i) acc = fmaf(float(load(x, row * k + i)), float(load(wr, i)), acc);
    store(y, row * n + col, acc);
  }
}

}  // namespace

bool routed_skinny_applies(DType dtype, int64_t k, int64_t w_stride, const void* x, const void* w, const void* y) {
  const int64_t pack = 16 / int64_t(dtype_size(dtype));
  return k % pack == 0 && w_stride % pack == 0 && aligned16(x) && aligned16(w) && aligned16(y);
}

void launch_routed_gemm(DType dtype, bool skinny, int64_t rows, int64_t n, int64_t k, int64_t experts,
                        int64_t w_stride, const void* x, const void* w, const int32_t* offsets, void* y,
                        cudaStream_t stream) {
  if (rows == 0 || n == 0 || experts == 0) return;
  dispatch_f32_bf16_f16(dtype, "grouped_matmul_routed dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const T* xt = static_cast<const T*>(x);
    const T* wt = static_cast<const T*>(w);
    T* yt = static_cast<T*>(y);
    if (!skinny) {
      const int64_t blocks = std::min<int64_t>((rows * n + kThreads - 1) / kThreads, int64_t(multiprocessors()) * 8);
      routed_rows_kernel<T><<<unsigned(blocks), kThreads, 0, stream>>>(rows, n, k, experts, w_stride, xt, wt, offsets,
                                                                       yt);
      LATHE_CUDA_CHECK(cudaGetLastError());
      return;
    }
    const int warps = kThreads / 32;
    const int64_t columns = (n + 2 * warps - 1) / (2 * warps);
    const dim3 grid(unsigned(std::max<int64_t>(1, columns)), unsigned(experts));
    const int64_t staged = int64_t(kRows) * k * int64_t(sizeof(T));
    if (staged <= kMaxStagedBytes)
      routed_skinny_kernel<T, true><<<grid, kThreads, size_t(staged), stream>>>(rows, n, k, w_stride, xt, wt, offsets,
                                                                                yt);
    else
      routed_skinny_kernel<T, false><<<grid, kThreads, 0, stream>>>(rows, n, k, w_stride, xt, wt, offsets, yt);
    LATHE_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace lathe::cuda
