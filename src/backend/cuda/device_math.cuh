// Device-side helpers shared by the CUDA kernels: element loads/stores in the compute type (float, or
// double for f64), packs of consecutive elements moved as 16-byte accesses, strided offsets, grid-stride
// indices, and warp/block reductions. Covered by tests/ops through the kernels that use them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "backend/cuda/check.h"
#include "backend/cuda/launchers.h"

namespace lathe::cuda {

// The current device's streaming multiprocessors (read once: the engine runs on one device a process).
inline int multiprocessors() {
  static const int sms = [] {
    int device = 0, n = 0;
    LATHE_CUDA_CHECK(cudaGetDevice(&device));
    LATHE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  }();
  return sms;
}

template <typename T> struct Compute { using type = float; };
template <> struct Compute<double> { using type = double; };
template <> struct Compute<int32_t> { using type = int64_t; };
template <> struct Compute<int64_t> { using type = int64_t; };

template <typename T> __device__ __forceinline__ typename Compute<T>::type load(const T* p, int64_t i) {
  return typename Compute<T>::type(p[i]);
}
template <> __device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
template <> __device__ __forceinline__ float load(const __half* p, int64_t i) { return __half2float(p[i]); }

template <typename T, typename V> __device__ __forceinline__ void store(T* p, int64_t i, V v) { p[i] = T(v); }
template <> __device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16(v); }
template <> __device__ __forceinline__ void store(__half* p, int64_t i, float v) { p[i] = __float2half(v); }

// kN consecutive elements of T held in registers. When kN * sizeof(T) is a multiple of 16 (16 / sizeof(T)
// elements, or more for the wide side of a cast), load_pack / store_pack move them as 16-byte accesses and the
// address must be 16-byte aligned (check with aligned16 on the host); otherwise element by element (kN = 1 is
// the scalar fallback of the packed kernels).
template <typename T, int kN> struct Pack {
  T e[kN];
};

template <typename T, int kN> __device__ __forceinline__ Pack<T, kN> load_pack(const T* p) {
  Pack<T, kN> v;
  if constexpr (sizeof(v) % 16 == 0) {
#pragma unroll
    for (int c = 0; c < int(sizeof(v) / 16); ++c) {
      const uint4 bits = reinterpret_cast<const uint4*>(p)[c];
      memcpy(reinterpret_cast<char*>(&v) + 16 * c, &bits, 16);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) v.e[k] = p[k];
  }
  return v;
}

template <typename T, int kN> __device__ __forceinline__ void store_pack(T* p, const Pack<T, kN>& v) {
  if constexpr (sizeof(v) % 16 == 0) {
#pragma unroll
    for (int c = 0; c < int(sizeof(v) / 16); ++c) {
      uint4 bits;
      memcpy(&bits, reinterpret_cast<const char*>(&v) + 16 * c, 16);
      reinterpret_cast<uint4*>(p)[c] = bits;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) p[k] = v.e[k];
  }
}

// Calls f(T{}) with T the device type of an f32, bf16 or f16 `dt`; any other dtype throws, naming `what`.
template <typename F> void dispatch_f32_bf16_f16(DType dt, const char* what, F f) {
  switch (dt) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    case DType::F16: f(__half{}); return;
    default: throw_cuda_error(what, cudaErrorInvalidValue, __FILE__, __LINE__);
  }
}

// Elements of T in one 16-byte access.
template <typename T> constexpr int kPackOf16 = int(16 / sizeof(T));

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16-byte asynchronous copy global -> shared; with valid == false the 16 bytes are zero-filled (nothing is read).
// cp_async_commit closes this thread's copies issued since the last commit into a group; cp_async_wait<N> returns
// once at most N of its groups are still in flight (a thread then reads what it copied itself; other threads' copies
// need a barrier too). The copy itself is no compiler barrier: order it after reads of its destination with one.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ int64_t global_thread() { return blockIdx.x * int64_t(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ int64_t grid_threads() { return int64_t(gridDim.x) * blockDim.x; }

__device__ __forceinline__ int64_t strided_offset(int64_t linear, const StridedLayout& l) {
  int64_t off = 0;
  for (int d = l.ndim - 1; d >= 0; --d) {
    const int64_t i = linear % l.shape[d];
    linear /= l.shape[d];
    off += i * l.stride[d];
  }
  return off;
}

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename A> __device__ __forceinline__ A warp_max(A v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reduction; every thread gets the result. `scratch` holds 32 values.
template <typename A, bool kMax> __device__ A block_reduce(A v, A* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  A r = lane < warps ? scratch[lane] : (kMax ? A(-INFINITY) : A(0));
  r = kMax ? warp_max(r) : warp_sum(r);
  return r;
}

// Adds values f[0..kN) to a thread's online (max m, sum of exp s): the values' max first, then one rescale of the
// running sum. A -inf value adds nothing; a NaN one reaches the sum (fmaxf skips it, expf passes it), as in the
// reference. While m is -inf, s is 0 or NaN. The block's log-sum-exp is then mx + log(total) with
// mx = block_reduce<float, true>(m) and total = block_reduce<float, false>(m == -inf ? s : s * expf(m - mx)).
template <int kN>
__device__ __forceinline__ void online_logsumexp_add(float& m, float& s, const float (&f)[kN]) {
  float pm = -INFINITY;
#pragma unroll
  for (int k = 0; k < kN; ++k) pm = fmaxf(pm, f[k]);
  const float nm = fmaxf(m, pm);
  float add = 0.0f;
#pragma unroll
  for (int k = 0; k < kN; ++k) add += f[k] == -INFINITY ? 0.0f : expf(f[k] - nm);
  s = (m == nm ? s : s * expf(m - nm)) + add;
  m = nm;
}

// The list kernels (one launch over a table of tensors, each cut into chunks, one block a chunk): the entry whose
// chunks include this block, the last one whose first_chunk is <= blockIdx.x (entries without chunks share their
// successor's first_chunk and are passed over).
template <typename Entry> __device__ __forceinline__ int chunk_owner(const Entry* table, int n) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].first_chunk <= int64_t(blockIdx.x)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

inline int grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return int(blocks < 65536 * 8 ? (blocks > 0 ? blocks : 1) : 65536 * 8);
}

}  // namespace lathe::cuda
