// CUDA elementwise kernels: broadcast add/mul, SiLU backward, scale, SiLU, and casts between dtypes.
// Two paths per op, with the same per-element math (the *_value functions): when every operand is contiguous
// and 16-byte aligned, a packed kernel moves 16 bytes per thread and step (8 bf16/f16, 4 f32, 2 f64; a cast takes
// its width from the narrower type) and finishes the n % width tail element by element; otherwise a grid-stride
// loop of single elements, strided inputs through StridedLayout. Compute in float (double for f64).
// Covered by tests/ops (every row on cuda; sizes with and without a tail, transposed inputs for the strided path).
#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

template <BinaryOp kOp, typename A> __device__ __forceinline__ A binary_value(A x, A y) {
  if constexpr (kOp == BinaryOp::add) {
    return x + y;
  } else if constexpr (kOp == BinaryOp::mul) {
    return x * y;
  } else {  // silu_backward: x, dy
    const A s = A(1) / (A(1) + exp(-x));
    return y * s * (A(1) + x * (A(1) - s));
  }
}

template <UnaryOp kOp, typename A> __device__ __forceinline__ A unary_value(A v, double alpha) {
  if constexpr (kOp == UnaryOp::scale) return A(alpha) * v;
  else return v / (A(1) + exp(-v));
}

// The value stored into a `To` element: half types round from float, the others convert directly.
template <typename To, typename V> __device__ __forceinline__ auto cast_value(V v) {
  if constexpr (std::is_same_v<To, __nv_bfloat16> || std::is_same_v<To, __half>) return float(v);
  else return v;
}

// ---------------------------------------------------------------- strided path

template <typename T, BinaryOp kOp>
__global__ void binary_kernel(int64_t n, const T* a, StridedLayout la, const T* b, StridedLayout lb, bool contiguous,
                              T* out) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const auto x = load(a, contiguous ? i : strided_offset(i, la));
    const auto y = load(b, contiguous ? i : strided_offset(i, lb));
    store(out, i, binary_value<kOp>(x, y));
  }
}

template <typename T, UnaryOp kOp>
__global__ void unary_kernel(int64_t n, const T* x, StridedLayout lx, bool contiguous, double alpha, T* out) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    store(out, i, unary_value<kOp>(load(x, contiguous ? i : strided_offset(i, lx)), alpha));
}

// A strided output too (copies into a column slice: ops/ops.h concat_columns).
template <typename From, typename To>
__global__ void cast_kernel(int64_t n, const From* x, StridedLayout lx, bool contiguous, To* out, StridedLayout lo,
                            bool out_contiguous) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    store(out, out_contiguous ? i : strided_offset(i, lo),
          cast_value<To>(load(x, contiguous ? i : strided_offset(i, lx))));
}

// ---------------------------------------------------------------- packed path

// kN elements from index i (kN = 1 for the tail).
template <typename T, BinaryOp kOp, int kN>
__device__ __forceinline__ void binary_pack(int64_t i, const T* a, const T* b, T* out) {
  const Pack<T, kN> pa = load_pack<T, kN>(a + i), pb = load_pack<T, kN>(b + i);
  Pack<T, kN> r;
#pragma unroll
  for (int k = 0; k < kN; ++k) store(r.e, k, binary_value<kOp>(load(pa.e, k), load(pb.e, k)));
  store_pack(out + i, r);
}

template <typename T, UnaryOp kOp, int kN>
__device__ __forceinline__ void unary_pack(int64_t i, const T* x, double alpha, T* out) {
  const Pack<T, kN> px = load_pack<T, kN>(x + i);
  Pack<T, kN> r;
#pragma unroll
  for (int k = 0; k < kN; ++k) store(r.e, k, unary_value<kOp>(load(px.e, k), alpha));
  store_pack(out + i, r);
}

template <typename From, typename To, int kN> __device__ __forceinline__ void cast_pack(int64_t i, const From* x, To* out) {
  const Pack<From, kN> px = load_pack<From, kN>(x + i);
  Pack<To, kN> r;
#pragma unroll
  for (int k = 0; k < kN; ++k) store(r.e, k, cast_value<To>(load(px.e, k)));
  store_pack(out + i, r);
}

// Each kernel: packs of kN elements over [0, n - n % kN) in a grid-stride loop, then the tail one element a thread.
template <typename T, BinaryOp kOp, int kN>
__global__ void binary_packed_kernel(int64_t n, const T* a, const T* b, T* out) {
  const int64_t full = n - n % kN;
  for (int64_t i = global_thread() * kN; i < full; i += grid_threads() * kN) binary_pack<T, kOp, kN>(i, a, b, out);
  for (int64_t i = full + global_thread(); i < n; i += grid_threads()) binary_pack<T, kOp, 1>(i, a, b, out);
}

template <typename T, UnaryOp kOp, int kN>
__global__ void unary_packed_kernel(int64_t n, const T* x, double alpha, T* out) {
  const int64_t full = n - n % kN;
  for (int64_t i = global_thread() * kN; i < full; i += grid_threads() * kN) unary_pack<T, kOp, kN>(i, x, alpha, out);
  for (int64_t i = full + global_thread(); i < n; i += grid_threads()) unary_pack<T, kOp, 1>(i, x, alpha, out);
}

template <typename From, typename To, int kN>
__global__ void cast_packed_kernel(int64_t n, const From* x, To* out) {
  const int64_t full = n - n % kN;
  for (int64_t i = global_thread() * kN; i < full; i += grid_threads() * kN) cast_pack<From, To, kN>(i, x, out);
  for (int64_t i = full + global_thread(); i < n; i += grid_threads()) cast_pack<From, To, 1>(i, x, out);
}

// Threads for n elements in packs of kN: one pack each (at least one thread for a tail-only n).
int packed_grid(int64_t n, int kN) { return grid_for((n + kN - 1) / kN, kThreads); }

// ---------------------------------------------------------------- launch

// Calls f(T{}) with T the device type of `dt`; float types only unless kInts.
template <bool kInts, typename F> void dispatch(DType dt, F f) {
  switch (dt) {
    case DType::F32: f(float{}); return;
    case DType::F64: f(double{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    case DType::F16: f(__half{}); return;
    default: break;
  }
  if constexpr (kInts) {
    if (dt == DType::I32) { f(int32_t{}); return; }
    if (dt == DType::I64) { f(int64_t{}); return; }
  }
  throw_cuda_error("elementwise dispatch (unsupported dtype)", cudaErrorInvalidValue, __FILE__, __LINE__);
}

template <typename T, BinaryOp kOp>
void launch_binary_op(int64_t n, const T* a, const StridedLayout& la, const T* b, const StridedLayout& lb,
                      bool contiguous, T* out, cudaStream_t stream) {
  constexpr int kN = kPackOf16<T>;
  if (contiguous && aligned16(a) && aligned16(b) && aligned16(out))
    binary_packed_kernel<T, kOp, kN><<<packed_grid(n, kN), kThreads, 0, stream>>>(n, a, b, out);
  else
    binary_kernel<T, kOp><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, a, la, b, lb, contiguous, out);
}

template <typename T, UnaryOp kOp>
void launch_unary_op(int64_t n, const T* x, const StridedLayout& lx, bool contiguous, double alpha, T* out,
                     cudaStream_t stream) {
  constexpr int kN = kPackOf16<T>;
  if (contiguous && aligned16(x) && aligned16(out))
    unary_packed_kernel<T, kOp, kN><<<packed_grid(n, kN), kThreads, 0, stream>>>(n, x, alpha, out);
  else
    unary_kernel<T, kOp><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, x, lx, contiguous, alpha, out);
}

}  // namespace

bool cast_supported(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::BF16 || t == DType::F16 || t == DType::I32 ||
         t == DType::I64;
}

void launch_binary(BinaryOp op, DType dtype, int64_t n, const void* a, const StridedLayout& la, const void* b,
                   const StridedLayout& lb, bool contiguous, void* out, cudaStream_t stream) {
  if (n == 0) return;
  dispatch<false>(dtype, [&](auto t) {
    using T = decltype(t);
    const auto* pa = static_cast<const T*>(a);
    const auto* pb = static_cast<const T*>(b);
    auto* po = static_cast<T*>(out);
    switch (op) {
      case BinaryOp::add: launch_binary_op<T, BinaryOp::add>(n, pa, la, pb, lb, contiguous, po, stream); break;
      case BinaryOp::mul: launch_binary_op<T, BinaryOp::mul>(n, pa, la, pb, lb, contiguous, po, stream); break;
      case BinaryOp::silu_backward:
        launch_binary_op<T, BinaryOp::silu_backward>(n, pa, la, pb, lb, contiguous, po, stream);
        break;
    }
  });
  LATHE_CUDA_LAUNCH_CHECK("binary_kernel");
}

void launch_unary(UnaryOp op, DType dtype, int64_t n, const void* x, const StridedLayout& lx, bool contiguous,
                  double alpha, void* out, cudaStream_t stream) {
  if (n == 0) return;
  dispatch<false>(dtype, [&](auto t) {
    using T = decltype(t);
    const auto* px = static_cast<const T*>(x);
    auto* po = static_cast<T*>(out);
    if (op == UnaryOp::scale) launch_unary_op<T, UnaryOp::scale>(n, px, lx, contiguous, alpha, po, stream);
    else launch_unary_op<T, UnaryOp::silu>(n, px, lx, contiguous, alpha, po, stream);
  });
  LATHE_CUDA_LAUNCH_CHECK("unary_kernel");
}

void launch_cast(DType from, DType to, int64_t n, const void* x, const StridedLayout& lx, bool contiguous, void* out,
                 const StridedLayout& lo, bool out_contiguous, cudaStream_t stream) {
  if (n == 0) return;
  dispatch<true>(from, [&](auto f) {
    dispatch<true>(to, [&](auto t) {
      using From = decltype(f);
      using To = decltype(t);
      const auto* px = static_cast<const From*>(x);
      auto* po = static_cast<To*>(out);
      // Packs of 16 bytes of the narrower type: both sides start on 16-byte boundaries.
      constexpr int kN = sizeof(From) < sizeof(To) ? kPackOf16<From> : kPackOf16<To>;
      if (contiguous && out_contiguous && aligned16(px) && aligned16(po))
        cast_packed_kernel<From, To, kN><<<packed_grid(n, kN), kThreads, 0, stream>>>(n, px, po);
      else
        cast_kernel<From, To><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, px, lx, contiguous, po, lo,
                                                                              out_contiguous);
    });
  });
  LATHE_CUDA_LAUNCH_CHECK("cast_kernel");
}

}  // namespace lathe::cuda
