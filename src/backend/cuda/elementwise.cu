// CUDA elementwise kernels: broadcast add/mul, SiLU backward, scale, SiLU, and casts between dtypes.
// Grid-stride loops; compute in float (double for f64); strided inputs through StridedLayout.
// Covered by tests/ops (every row on cuda).
#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T, BinaryOp kOp>
__global__ void binary_kernel(int64_t n, const T* a, StridedLayout la, const T* b, StridedLayout lb, bool contiguous,
                              T* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const auto x = load(a, contiguous ? i : strided_offset(i, la));
    const auto y = load(b, contiguous ? i : strided_offset(i, lb));
    using A = typename Compute<T>::type;
    A r;
    if constexpr (kOp == BinaryOp::add) {
      r = x + y;
    } else if constexpr (kOp == BinaryOp::mul) {
      r = x * y;
    } else {  // silu_backward: x, dy
      const A s = A(1) / (A(1) + exp(-x));
      r = y * s * (A(1) + x * (A(1) - s));
    }
    store(out, i, r);
  }
}

template <typename T, UnaryOp kOp>
__global__ void unary_kernel(int64_t n, const T* x, StridedLayout lx, bool contiguous, double alpha, T* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const auto v = load(x, contiguous ? i : strided_offset(i, lx));
    using A = typename Compute<T>::type;
    if constexpr (kOp == UnaryOp::scale) {
      store(out, i, A(alpha) * v);
    } else {
      store(out, i, v / (A(1) + exp(-v)));
    }
  }
}

template <typename From, typename To>
__global__ void cast_kernel(int64_t n, const From* x, StridedLayout lx, bool contiguous, To* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const auto v = load(x, contiguous ? i : strided_offset(i, lx));
    if constexpr (std::is_same_v<To, __nv_bfloat16> || std::is_same_v<To, __half>) {
      store(out, i, float(v));
    } else {
      store(out, i, v);
    }
  }
}

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
    const int grid = grid_for(n, kThreads);
    switch (op) {
      case BinaryOp::add: binary_kernel<T, BinaryOp::add><<<grid, kThreads, 0, stream>>>(n, pa, la, pb, lb, contiguous, po); break;
      case BinaryOp::mul: binary_kernel<T, BinaryOp::mul><<<grid, kThreads, 0, stream>>>(n, pa, la, pb, lb, contiguous, po); break;
      case BinaryOp::silu_backward:
        binary_kernel<T, BinaryOp::silu_backward><<<grid, kThreads, 0, stream>>>(n, pa, la, pb, lb, contiguous, po);
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
    const int grid = grid_for(n, kThreads);
    if (op == UnaryOp::scale) unary_kernel<T, UnaryOp::scale><<<grid, kThreads, 0, stream>>>(n, px, lx, contiguous, alpha, po);
    else unary_kernel<T, UnaryOp::silu><<<grid, kThreads, 0, stream>>>(n, px, lx, contiguous, alpha, po);
  });
  LATHE_CUDA_LAUNCH_CHECK("unary_kernel");
}

void launch_cast(DType from, DType to, int64_t n, const void* x, const StridedLayout& lx, bool contiguous, void* out,
                 cudaStream_t stream) {
  if (n == 0) return;
  dispatch<true>(from, [&](auto f) {
    dispatch<true>(to, [&](auto t) {
      using From = decltype(f);
      using To = decltype(t);
      cast_kernel<From, To><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, static_cast<const From*>(x), lx,
                                                                            contiguous, static_cast<To*>(out));
    });
  });
  LATHE_CUDA_LAUNCH_CHECK("cast_kernel");
}

}  // namespace lathe::cuda
