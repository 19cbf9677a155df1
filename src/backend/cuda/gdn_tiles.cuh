// Device building blocks of the chunked Gated DeltaNet kernels (gated_delta.cu): ldmatrix and mma.sync m16n8k16 on
// bf16 with fp32 accumulation, the Tile a block's 8 warps hold, bf16 pair loads and stores, and the cp.async copies of
// a chunk's rows into shared memory and the 16-byte stores back. Internal to that file (an unnamed namespace, as
// gdn_device.cuh). Covered through the chunked kernels by tests/ops (testing/op_cases_gated_delta.cpp).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/gdn_device.cuh"

namespace lathe::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kChunk = 64;  // tokens a chunk: the rows of a chunk's tiles

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// The first two 8 x 8 matrices of ldsm_x4's (the addresses of lanes 0-15): one n-fragment's B over a k-step of 16.
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const bf16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x2_t(uint32_t (&r)[2], const bf16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// An (M, N) fp32 product tile spread over the 8 warps of a block: warp w owns rows [m0, m0 + 16 MT) and columns
// [n0, n0 + 8 NT). Accumulator element e of fragment (mi, ni) is (m0 + 16 mi + lane/4 + 8 (e >= 2),
// n0 + 8 ni + 2 (lane % 4) + e % 2).
template <int M, int N> struct Tile {
  static_assert(kThreads == 8 * 32, "a block is 8 warps");
  static constexpr int WM = (M / 16) >= 8 ? 8 : M / 16;
  static constexpr int WN = 8 / WM;
  static constexpr int MT = M / 16 / WM;
  static constexpr int NT = N / 8 / WN;
  static_assert(NT == 1 || NT % 2 == 0, "two n-fragments per ldmatrix.x4, or one per .x2");
  float acc[MT][NT][4];
  __device__ static int m0() { return (threadIdx.x / 32 / WN) * MT * 16; }
  __device__ static int n0() { return (threadIdx.x / 32 % WN) * NT * 8; }
  __device__ void zero() {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0;
  }
  // f(row, col, value&) on every element this thread holds.
  template <typename F> __device__ void each(F f) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          f(m0() + mi * 16 + lane / 4 + (e >= 2 ? 8 : 0), n0() + ni * 8 + 2 * (lane % 4) + (e & 1), acc[mi][ni][e]);
  }
  // f(row, col, x[col], x[col + 1]) for each pair of adjacent columns this thread holds (col even): for 8-byte
  // (float2) or 4-byte (bf16x2) global accesses.
  template <typename F> __device__ void each_pair(F f) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          f(m0() + mi * 16 + lane / 4 + 8 * half, n0() + ni * 8 + 2 * (lane % 4), acc[mi][ni][2 * half],
            acc[mi][ni][2 * half + 1]);
  }
  // acc += f(row) * other.acc (the same tile mapping).
  template <typename F> __device__ void add_rows(const Tile& other, F f) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[mi][ni][e] += f(m0() + mi * 16 + lane / 4 + (e >= 2 ? 8 : 0)) * other.acc[mi][ni][e];
  }
  // part[wn * M + row] = sum over this warp's columns of f(row, col, value); the caller adds the WN parts in
  // order (a fixed-order row reduction).
  template <typename F> __device__ void row_sums(float* part, F f) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = m0() + mi * 16 + lane / 4 + 8 * half;
        float s = 0;
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e) s += f(row, n0() + ni * 8 + 2 * (lane % 4) + e, acc[mi][ni][2 * half + e]);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (lane % 4 == 0) part[(threadIdx.x / 32 % WN) * M + row] = s;
      }
  }
  // acc += op(A) op(B) over k in [0, K). A is stored (M, K) row-major, or (K, M) when kAKM; B is stored (N, K)
  // (the product reads B^T), or (K, N) when kBKN. Both bf16 in shared memory with 16-byte aligned rows.
  template <bool kAKM, bool kBKN> __device__ void mma(const bf16* A, int lda, const bf16* B, int ldb, int K) {
    const int lane = threadIdx.x % 32, am = m0(), bn = n0();
    for (int k0 = 0; k0 < K; k0 += 16) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        if constexpr (kAKM)
          ldsm_x4_t(a[mi], A + (k0 + lane % 8 + (lane / 16) * 8) * lda + am + mi * 16 + ((lane / 8) % 2) * 8);
        else
          ldsm_x4(a[mi], A + (am + mi * 16 + lane % 16) * lda + k0 + (lane / 16) * 8);
      }
      if constexpr (NT == 1) {  // one n-fragment a warp (the 16-column scans' (64, 16) tiles)
        uint32_t b[2];
        if constexpr (kBKN)
          ldsm_x2_t(b, B + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ldb + bn);
        else
          ldsm_x2(b, B + (bn + lane % 8) * ldb + k0 + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) mma_bf16(acc[mi][0], a[mi], b[0], b[1]);
      } else {
#pragma unroll
        for (int nj = 0; nj < NT; nj += 2) {
          uint32_t b[4];
          if constexpr (kBKN)
            ldsm_x4_t(b, B + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ldb + bn + nj * 8 + (lane / 16) * 8);
          else
            ldsm_x4(b, B + (bn + nj * 8 + lane % 8 + (lane / 16) * 8) * ldb + k0 + ((lane / 8) % 2) * 8);
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            mma_bf16(acc[mi][nj], a[mi], b[0], b[1]);
            mma_bf16(acc[mi][nj + 1], a[mi], b[2], b[3]);
          }
        }
      }
    }
  }
};

__device__ __forceinline__ void st_bf2(bf16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ float2 ld_bf2(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

// 4-byte asynchronous copy global -> shared (always valid).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
// Waits for every cp.async this thread issued; a barrier must follow before other threads read the data.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Starts copying rows [t0, t0 + n) of head `head` of a (T, heads, width) bf16 tensor, columns [col0, col0 + COLS),
// into a (64, ld) shared tile; rows n..63 become zero. Complete with cp_async_wait_all() and a barrier. Every block
// has kThreads threads: a thread copies the same 16 bytes of every kStep-th row, its offsets formed once and stepped,
// so that the scans, which copy every chunk, spend few instructions on indices (docs/benchmarks.md, session 38).
template <int COLS>
__device__ __forceinline__ void load_tile(bf16* dst, int ld, const bf16* src, int64_t t0, int n, int64_t heads,
                                          int64_t head, int64_t width, int col0) {
  constexpr int kVec = COLS / 8, kStep = kThreads / kVec;  // 16-byte vectors a row; rows a pass of the block
  static_assert(kThreads % kVec == 0, "whole rows a pass");
  const int r0 = int(threadIdx.x / kVec), c = int(threadIdx.x % kVec) * 8;
  if (kStep > kChunk && r0 >= kChunk) return;
  const int64_t stride = heads * width;
  const int64_t at = (t0 + r0) * stride + head * width + col0 + c;
#pragma unroll
  for (int i = 0; i < (kChunk + kStep - 1) / kStep; ++i) {
    const bool valid = r0 + i * kStep < n;
    cp_async16(dst + (r0 + i * kStep) * ld + c, valid ? src + at + i * kStep * stride : src, valid);
  }
}

// Starts copying the chunk's b (rows [t0, t0 + n) of head `head` of the (T, heads) fp32 cumsum) into sb[0..64); rows
// past n repeat row n - 1. Complete like load_tile.
__device__ __forceinline__ void load_b(float* sb, const float* b, int64_t t0, int n, int64_t heads, int64_t head) {
  if (threadIdx.x < kChunk) cp_async4(sb + threadIdx.x, b + (t0 + min(int(threadIdx.x), n - 1)) * heads + head);
}

// Copies rows [0, n) x COLS of a shared tile (row stride ld) to rows [t0, t0 + n) of head `head` of a
// (T, heads, width) bf16 tensor at column col0 (16-byte vectors, kThreads threads as load_tile; the caller
// synchronises before).
template <int COLS>
__device__ __forceinline__ void store_tile(bf16* dst, int64_t t0, int n, int64_t heads, int64_t head, int64_t width,
                                           int col0, const bf16* src, int ld) {
  constexpr int kVec = COLS / 8, kStep = kThreads / kVec;
  static_assert(kThreads % kVec == 0, "whole rows a pass");
  const int r0 = int(threadIdx.x / kVec), c = int(threadIdx.x % kVec) * 8;
  const int64_t stride = heads * width;
  int64_t at = (t0 + r0) * stride + head * width + col0 + c;
  for (int r = r0; r < n; r += kStep, at += kStep * stride)
    *reinterpret_cast<uint4*>(dst + at) = *reinterpret_cast<const uint4*>(src + r * ld + c);
}

}  // namespace

}  // namespace lathe::cuda
