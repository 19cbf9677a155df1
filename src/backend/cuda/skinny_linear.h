// Launcher of the skinny linear kernel (skinny_linear.cu): y = alpha x W^T for a few rows of x (M <= kMaxSkinnyRows)
// against a row-major W (N, K), the decoding step's projections at small batch sizes, where cuBLASLt reads the weights
// at about half the copy rate (docs/benchmarks.md, session 19). Registered for `matmul` before cuBLASLt (gemm.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

inline constexpr int64_t kMaxSkinnyRows = 4;
inline constexpr int64_t kMaxSkinnyXBytes = 48 * 1024;  // x is staged in a block's shared memory

// x (m, k), w (n, k), y (m, n), all contiguous; f32, bf16 or f16; k a multiple of one 16-byte pack, x and w 16-byte
// aligned; m in [1, kMaxSkinnyRows] and m x k x the element size at most kMaxSkinnyXBytes.
void launch_skinny_linear(DType dtype, int64_t m, int64_t n, int64_t k, float alpha, const void* x, const void* w,
                          void* y, cudaStream_t stream);

}  // namespace lathe::cuda
