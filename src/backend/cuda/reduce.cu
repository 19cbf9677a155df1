// CUDA reductions: sum over any dims of a strided tensor (one block per output element), the sum of squares of a
// whole strided tensor (the global gradient norm), and row softmax and its backward (one block per row, fp32
// statistics; fp64 for f64). sum_squares is deterministic without atomics: a grid whose size depends on the element
// count alone writes one partial per block (grid-stride over the elements, fixed block tree), then one block sums
// the partials in a fixed order; a tensor that one block covers takes that block only, writing the result directly.
// A contiguous, aligned tensor is read in 16-byte packs. sum_squares_list: one launch for many tensors, each cut into
// chunks (one block a chunk, found by binary search over the table), then one warp per tensor over its chunk partials.
// Covered by tests/ops (every row on cuda) and tests/unit/test_optim.cpp.
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

// Block b's partial of sum(x^2) over elements b * blockDim.x + threadIdx.x + k * gridDim.x * blockDim.x, into dst[b].
template <typename T>
__global__ void sum_squares_kernel(int64_t n, const T* x, StridedLayout lx, bool contiguous,
                                   typename Compute<T>::type* dst) {
  using A = typename Compute<T>::type;
  __shared__ A scratch[32];
  A acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const A v = load(x, contiguous ? i : strided_offset(i, lx));
    acc += v * v;
  }
  acc = block_reduce<A, false>(acc, scratch);
  if (threadIdx.x == 0) dst[blockIdx.x] = acc;
}

// The same over a contiguous, 16-byte aligned x read in packs of kN elements (grid-stride over the packs); the n % kN
// elements past the last whole pack go to the first threads of block 0.
template <typename T, int kN>
__global__ void sum_squares_packed_kernel(int64_t n, const T* x, typename Compute<T>::type* dst) {
  using A = typename Compute<T>::type;
  __shared__ A scratch[32];
  A acc = 0;
  const int64_t packs = n / kN;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < packs; p += int64_t(gridDim.x) * blockDim.x) {
    const Pack<T, kN> v = load_pack<T, kN>(x + p * kN);
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const A e = load(v.e, k);
      acc += e * e;
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < n - packs * kN) {
    const A e = load(x, packs * kN + threadIdx.x);
    acc += e * e;
  }
  acc = block_reduce<A, false>(acc, scratch);
  if (threadIdx.x == 0) dst[blockIdx.x] = acc;
}

// Block b: the partial sum of squares of its chunk of the tensor whose chunks include b.
template <typename T>
__global__ void sum_squares_list_kernel(const SumSquaresListEntry* table, int n_tensors,
                                        typename Compute<T>::type* partials) {
  using A = typename Compute<T>::type;
  __shared__ A scratch[32];
  const SumSquaresListEntry& t = table[chunk_owner(table, n_tensors)];
  const T* x = static_cast<const T*>(t.x);
  const int64_t begin = (int64_t(blockIdx.x) - t.first_chunk) * kSumSquaresListChunk;
  const int64_t end = min(t.n, begin + kSumSquaresListChunk);
  A acc = 0;
  int64_t first_single = begin;
  if (t.packed) {
    constexpr int kN = kPackOf16<T>;
    const int64_t packs = (end - begin) / kN;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T, kN> v = load_pack<T, kN>(x + begin + p * kN);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const A e = load(v.e, k);
        acc += e * e;
      }
    }
    first_single = begin + packs * kN;
  }
  for (int64_t i = first_single + threadIdx.x; i < end; i += blockDim.x) {
    const A e = load(x, i);
    acc += e * e;
  }
  acc = block_reduce<A, false>(acc, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Warp w: out[w] = the sum of tensor w's chunk partials (lane l takes chunks l, l + 32, ... in order, then a fixed
// shuffle tree).
template <typename A>
__global__ void sum_list_partials_kernel(const SumSquaresListEntry* table, int n_tensors, int64_t chunks,
                                         const A* partials, A* out) {
  const int w = int(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32), lane = int(threadIdx.x % 32);
  if (w >= n_tensors) return;
  const int64_t first = table[w].first_chunk;
  const int64_t last = w + 1 < n_tensors ? table[w + 1].first_chunk : chunks;
  A acc = 0;
  for (int64_t c = first + lane; c < last; c += 32) acc += partials[c];
  acc = warp_sum(acc);
  if (lane == 0) out[w] = acc;
}

// One block: out = the sum of the n partials, each thread taking every blockDim.x-th one in order.
template <typename A>
__global__ void sum_partials_kernel(int64_t n, const A* partial, A* out) {
  __shared__ A scratch[32];
  A acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  acc = block_reduce<A, false>(acc, scratch);
  if (threadIdx.x == 0) *out = acc;
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

int64_t sum_squares_partials(int64_t n) {
  constexpr int64_t kPerThread = 16;  // below this many elements per thread, fewer blocks
  constexpr int64_t kMaxBlocks = 1024;  // one wave of 256-thread blocks on an H100 (132 SMs x 8)
  const int64_t blocks = (n + kThreads * kPerThread - 1) / (kThreads * kPerThread);
  return blocks <= 1 ? 0 : (blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

void launch_sum_squares(DType dtype, int64_t n, const void* x, const StridedLayout& lx, bool contiguous,
                        void* partials, void* out, cudaStream_t stream) {
  const int64_t blocks = sum_squares_partials(n);
  dispatch_float(dtype, [&](auto t) {
    using T = decltype(t);
    using A = typename Compute<T>::type;
    const auto* px = static_cast<const T*>(x);
    A* dst = static_cast<A*>(blocks == 0 ? out : partials);  // one block writes the result itself
    const int grid = blocks == 0 ? 1 : int(blocks);
    if (contiguous && aligned16(px))
      sum_squares_packed_kernel<T, kPackOf16<T>><<<grid, kThreads, 0, stream>>>(n, px, dst);
    else
      sum_squares_kernel<T><<<grid, kThreads, 0, stream>>>(n, px, lx, contiguous, dst);
    if (blocks == 0) return;
    sum_partials_kernel<A><<<1, kThreads, 0, stream>>>(blocks, static_cast<const A*>(partials), static_cast<A*>(out));
  });
  LATHE_CUDA_LAUNCH_CHECK("sum_squares_kernel");
}

void launch_sum_squares_list(DType dtype, const SumSquaresListEntry* table, int n_tensors, int64_t chunks,
                             void* partials, void* out, cudaStream_t stream) {
  if (n_tensors == 0) return;
  dispatch_float(dtype, [&](auto t) {
    using T = decltype(t);
    using A = typename Compute<T>::type;
    if (chunks > 0)
      sum_squares_list_kernel<T><<<unsigned(chunks), kThreads, 0, stream>>>(table, n_tensors,
                                                                            static_cast<A*>(partials));
    sum_list_partials_kernel<A><<<unsigned((n_tensors + kThreads / 32 - 1) / (kThreads / 32)), kThreads, 0, stream>>>(
        table, n_tensors, chunks, static_cast<const A*>(partials), static_cast<A*>(out));
  });
  LATHE_CUDA_LAUNCH_CHECK("sum_squares_list_kernel");
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
