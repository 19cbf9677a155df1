// Raw-pointer launchers of the CUDA row-segment kernels (segment_ops.cu): segment_mask and dropout on contiguous
// x (rows, cols), formulas at SegmentAttrs in ops/op_table.h. The segment table travels to the kernel by value (a
// kernel argument, read through the constant bank), hence the fixed maximum of kMaxSegments; the registration
// (segment_ops_register.cpp) refuses more. Covered by the segment_mask / dropout op-check cases. Free of fmt for nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

constexpr int kMaxSegments = 64;

// Segment s owns rows [rows[s], rows[s+1]); rows[0] = 0, non-decreasing; rows beyond rows[count] are in none.
struct SegmentTable {
  int32_t count = 0;
  int64_t rows[kMaxSegments + 1] = {};
  int64_t col_begin[kMaxSegments] = {};  // segment_mask: kept columns [col_begin, col_end)
  int64_t col_end[kMaxSegments] = {};
  double scale[kMaxSegments] = {};       // segment_mask: multiplier of the kept values
  double keep_prob[kMaxSegments] = {};   // dropout: 1 - p, the divisor of the kept values
  uint64_t seed[kMaxSegments] = {};      // dropout
  uint32_t k_min[kMaxSegments] = {};     // dropout: dropout_threshold(p) (backend/dropout_hash.h)
  int64_t row_shift[kMaxSegments] = {};  // dropout: the segment's rows before its first row here
  int64_t col_offset = 0, row_width = 0; // dropout: x's columns within the segment's rows (SegmentAttrs); width > 0
};

// y (rows, cols) = the kept blocks of x scaled, 0 elsewhere (x is not read there).
void launch_segment_mask(DType dtype, int64_t rows, int64_t cols, const void* x, void* y, const SegmentTable& table,
                         cudaStream_t stream);
// y (rows, cols) = dropout of x per segment, x itself on rows outside every segment.
void launch_segment_dropout(DType dtype, int64_t rows, int64_t cols, const void* x, void* y, const SegmentTable& table,
                            cudaStream_t stream);

}  // namespace lathe::cuda
