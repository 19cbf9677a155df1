// CUDA reductions: sum over any dims of a strided tensor (one block per output element), and row
// softmax and its backward (one block per row, fp32 statistics; fp64 for f64).
// Covered by tests/ops (every row on cuda).
#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void sum_kernel(int64_t n_out, const T* x, StridedLayout kept, StridedLayout red, int64_t n_red, T* out) {
  using A = typename Compute<T>::type;
  __shared__ A scratch[32];
  for (int64_t o = blockIdx.x; o < n_out; o += gridDim.x) {
    const int64_t base = strided_offset(o, kept);
    A acc = 0;
    for (int64_t r = threadIdx.x; r < n_red; r += blockDim.x) acc += load(x, base + strided_offset(r, red));
    acc = block_reduce<A, false>(acc, scratch);
    if (threadIdx.x == 0) store(out, o, acc);
  }
}

template <typename T>
__global__ void softmax_kernel(int64_t rows, int64_t cols, const T* x, T* y) {
  using A = typename Compute<T>::type;
  __shared__ A scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    A mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) mx = max(mx, load(xr, j));
    mx = block_reduce<A, true>(mx, scratch);
    A total = 0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) total += exp(load(xr, j) - mx);
    total = block_reduce<A, false>(total, scratch);
    const A inv = A(1) / total;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) store(yr, j, exp(load(xr, j) - mx) * inv);
  }
}

template <typename T>
__global__ void softmax_backward_kernel(int64_t rows, int64_t cols, const T* y, const T* dy, T* dx) {
  using A = typename Compute<T>::type;
  __shared__ A scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * cols;
    A dot = 0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) dot += load(y, base + j) * load(dy, base + j);
    dot = block_reduce<A, false>(dot, scratch);
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      store(dx, base + j, load(y, base + j) * (load(dy, base + j) - dot));
  }
}

template <typename F> void dispatch_float(DType dt, F f) {
  switch (dt) {
    case DType::F32: f(float{}); return;
    case DType::F64: f(double{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    case DType::F16: f(__half{}); return;
    default: throw_cuda_error("reduction dispatch (unsupported dtype)", cudaErrorInvalidValue, __FILE__, __LINE__);
  }
}

int row_grid(int64_t rows) { return int(rows < 65536 * 8 ? (rows > 0 ? rows : 1) : 65536 * 8); }

}  // namespace

void launch_sum(DType dtype, int64_t n_out, const void* x, const StridedLayout& kept, const StridedLayout& red,
                int64_t n_red, void* out, cudaStream_t stream) {
  if (n_out == 0) return;
  dispatch_float(dtype, [&](auto t) {
    using T = decltype(t);
    sum_kernel<T><<<row_grid(n_out), kThreads, 0, stream>>>(n_out, static_cast<const T*>(x), kept, red, n_red,
                                                            static_cast<T*>(out));
  });
  LATHE_CUDA_LAUNCH_CHECK("sum_kernel");
}

void launch_softmax(DType dtype, int64_t rows, int64_t cols, const void* x, void* y, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  dispatch_float(dtype, [&](auto t) {
    using T = decltype(t);
    softmax_kernel<T><<<row_grid(rows), kThreads, 0, stream>>>(rows, cols, static_cast<const T*>(x), static_cast<T*>(y));
  });
  LATHE_CUDA_LAUNCH_CHECK("softmax_kernel");
}

void launch_softmax_backward(DType dtype, int64_t rows, int64_t cols, const void* y, const void* dy, void* dx,
                             cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  dispatch_float(dtype, [&](auto t) {
    using T = decltype(t);
    softmax_backward_kernel<T><<<row_grid(rows), kThreads, 0, stream>>>(
        rows, cols, static_cast<const T*>(y), static_cast<const T*>(dy), static_cast<T*>(dx));
  });
  LATHE_CUDA_LAUNCH_CHECK("softmax_backward_kernel");
}

}  // namespace lathe::cuda
