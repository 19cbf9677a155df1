// CUDA row-segment kernels: segment_mask and dropout (formulas at SegmentAttrs in ops/op_table.h). A block holds
// blockDim.y rows of blockDim.x threads each (grid-stride over rows, so no per-element division); each row finds
// its segment by binary search in the table. Compute in float (double for f64), IEEE division for x / (1 - p) as
// on the CPU; the dropout mask is the integer hash of backend/dropout_hash.h, so it is bit-identical to the CPU's.
// Covered by the segment_mask / dropout op-check cases (src/testing/op_cases.cpp).
#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/segment_launchers.h"
#include "backend/dropout_hash.h"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;

// The segment of row r, or -1 past the last one: the largest s with rows[s] <= r (empty segments skipped).
__device__ __forceinline__ int find_segment(const SegmentTable& t, int64_t r) {
  int lo = 0, hi = t.count;  // rows[lo] <= r holds (rows[0] = 0); the answer lies in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.rows[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo < t.count ? lo : -1;
}

template <typename T, bool kDropout>
__global__ void segment_kernel(int64_t rows, int64_t cols, const T* x, T* y, SegmentTable table) {
  using A = typename Compute<T>::type;
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < rows; r += int64_t(gridDim.x) * blockDim.y) {
    const int s = find_segment(table, r);
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    if constexpr (kDropout) {
      if (s < 0) {  // outside every segment: pass through
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = xr[j];
        continue;
      }
      // The index of (r, 0) in the segment's rows (SegmentAttrs: row_shift, col_offset, row_width).
      const uint64_t base = uint64_t(r - table.rows[s] + table.row_shift[s]) * uint64_t(table.row_width) +
                            uint64_t(table.col_offset);
      const uint64_t seed = table.seed[s];
      const uint32_t k_min = table.k_min[s];
      const A keep_prob = A(table.keep_prob[s]);
      for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
        store(yr, j, dropout_keep(seed, base + uint64_t(j), k_min) ? A(load(xr, j) / keep_prob) : A(0));
    } else {
      const int64_t cb = s < 0 ? 0 : table.col_begin[s];
      const int64_t ce = s < 0 ? 0 : table.col_end[s];
      const A scale = s < 0 ? A(0) : A(table.scale[s]);
      for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
        store(yr, j, j >= cb && j < ce ? A(scale * load(xr, j)) : A(0));  // selected: x is not read outside
    }
  }
}

template <bool kDropout>
void launch(DType dtype, int64_t rows, int64_t cols, const void* x, void* y, const SegmentTable& table,
            cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  // Threads per row: cols rounded up to a warp, at most kThreads; the rest of the block takes more rows.
  const int per_row = int(cols >= kThreads ? kThreads : (cols + 31) / 32 * 32);
  const dim3 block(per_row, kThreads / per_row);
  const int64_t blocks = (rows + block.y - 1) / block.y;
  const int grid = int(blocks < 65536 * 8 ? blocks : 65536 * 8);
  switch (dtype) {
    case DType::F32:
      segment_kernel<float, kDropout><<<grid, block, 0, stream>>>(rows, cols, static_cast<const float*>(x),
                                                                  static_cast<float*>(y), table);
      break;
    case DType::F64:
      segment_kernel<double, kDropout><<<grid, block, 0, stream>>>(rows, cols, static_cast<const double*>(x),
                                                                   static_cast<double*>(y), table);
      break;
    case DType::BF16:
      segment_kernel<__nv_bfloat16, kDropout><<<grid, block, 0, stream>>>(
          rows, cols, static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), table);
      break;
    case DType::F16:
      segment_kernel<__half, kDropout><<<grid, block, 0, stream>>>(rows, cols, static_cast<const __half*>(x),
                                                                   static_cast<__half*>(y), table);
      break;
    default:
      throw_cuda_error("segment kernel (dtype not f32, f64, bf16 or f16)", cudaErrorInvalidValue, __FILE__, __LINE__);
  }
}

}  // namespace

void launch_segment_mask(DType dtype, int64_t rows, int64_t cols, const void* x, void* y, const SegmentTable& table,
                         cudaStream_t stream) {
  launch<false>(dtype, rows, cols, x, y, table, stream);
  LATHE_CUDA_LAUNCH_CHECK("segment_kernel (segment_mask)");
}

void launch_segment_dropout(DType dtype, int64_t rows, int64_t cols, const void* x, void* y, const SegmentTable& table,
                            cudaStream_t stream) {
  launch<true>(dtype, rows, cols, x, y, table, stream);
  LATHE_CUDA_LAUNCH_CHECK("segment_kernel (dropout)");
}

}  // namespace lathe::cuda
