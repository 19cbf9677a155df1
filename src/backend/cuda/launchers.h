// Raw-pointer launchers of the CUDA elementwise and reduction kernels (elementwise.cu, reduce.cu).
// They take sizes, strides and a stream, launch, and check the launch; tensor-level checks and the
// registration live in elementwise_ops.cpp and reduce_ops.cpp. Kept free of fmt so nvcc sees little.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

constexpr int kMaxDims = 8;

// An input seen through the output's shape: element (i0..in) of the output reads offset sum(i_d * stride[d]).
struct StridedLayout {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};
};

enum class BinaryOp { add, mul, silu_backward };  // silu_backward: a = x, b = dy
enum class UnaryOp { scale, silu };

// `contiguous` = every input is laid out exactly like the contiguous output (no index arithmetic needed).
void launch_binary(BinaryOp op, DType dtype, int64_t n, const void* a, const StridedLayout& la, const void* b,
                   const StridedLayout& lb, bool contiguous, void* out, cudaStream_t stream);
void launch_unary(UnaryOp op, DType dtype, int64_t n, const void* x, const StridedLayout& lx, bool contiguous,
                  double alpha, void* out, cudaStream_t stream);
// The output may be strided too (lo, out_contiguous false): a view whose elements are distinct (copy_into checks).
void launch_cast(DType from, DType to, int64_t n, const void* x, const StridedLayout& lx, bool contiguous,
                 void* out, const StridedLayout& lo, bool out_contiguous, cudaStream_t stream);
bool cast_supported(DType t);

// Sum over the `red` sub-space for each of the n_out positions of the `kept` sub-space.
void launch_sum(DType dtype, int64_t n_out, const void* x, const StridedLayout& kept, const StridedLayout& red,
                int64_t n_red, void* out, cudaStream_t stream);
// sum(x^2) over the n elements of x (float, bf16, f16: f32 result; f64: f64) into the 0-d `out`. `partials` is
// scratch of sum_squares_partials(n) elements of the result's dtype (none when 0: one block then covers x).
int64_t sum_squares_partials(int64_t n);
// One tensor of a sum_squares_list launch (device-resident table): n contiguous elements at x, its chunks of
// kSumSquaresListChunk elements being blocks first_chunk, first_chunk + 1, ...; `packed`: x is 16-byte aligned.
constexpr int64_t kSumSquaresListChunk = 1 << 16;
struct SumSquaresListEntry {
  const void* x;
  int64_t n, first_chunk;
  int32_t packed;
};
// out[i] = sum of squares of tensor i of `table`: one block per chunk writes partials[chunk] (`chunks` elements of the
// result's dtype), then one warp per tensor adds its chunks' partials in order. Deterministic, no atomics.
void launch_sum_squares_list(DType dtype, const SumSquaresListEntry* table, int n_tensors, int64_t chunks,
                             void* partials, void* out, cudaStream_t stream);
void launch_sum_squares(DType dtype, int64_t n, const void* x, const StridedLayout& lx, bool contiguous,
                        void* partials, void* out, cudaStream_t stream);
void launch_softmax(DType dtype, int64_t rows, int64_t cols, const void* x, void* y, cudaStream_t stream);
void launch_softmax_backward(DType dtype, int64_t rows, int64_t cols, const void* y, const void* dy, void* dx,
                             cudaStream_t stream);

}  // namespace lathe::cuda
