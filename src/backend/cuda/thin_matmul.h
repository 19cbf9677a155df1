// Launcher of the thin batched matmul kernels (thin_matmul.cu): C[b] = alpha A[b] B[b] + beta C[b] for row-major,
// untransposed A[b] (m, K), B[b] (K, n), C[b] (m, n) where K is small or n is 1. Registered for `matmul` before
// cuBLASLt (gemm.cpp), for batched calls of those shapes only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

struct ThinMatmul {
  int64_t batch, m, n, k;
  int64_t stride_a, stride_b, stride_c;  // elements between batches (0: one B for every batch)
  float alpha, beta;                     // beta != 0 reads C
};

// Products of at most this many terms per element go to the small-K kernel.
inline constexpr int64_t kMaxThinK = 16;

// Whether the thin kernels take this shape: K <= kMaxThinK, or n = 1.
bool thin_matmul_shape(const ThinMatmul& p);

void launch_thin_matmul(DType dtype, const ThinMatmul& p, const void* a, const void* b, void* c, cudaStream_t stream);

}  // namespace lathe::cuda
