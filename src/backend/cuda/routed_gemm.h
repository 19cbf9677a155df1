// Launcher of grouped_matmul_routed's CUDA kernels (routed_gemm.cu): the expert GEMMs of a decoding step with the
// groups read on the device. Registered in grouped_gemm.cpp. Free of fmt for nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

// Whether the skinny kernel takes these operands: K and w's block stride whole 16-byte packs, x, w and y 16-byte
// aligned.
bool routed_skinny_applies(DType dtype, int64_t k, int64_t w_stride, const void* x, const void* w, const void* y);

// y (rows, n) = x (rows, k) w[e]^T per group e of `offsets` (experts + 1 used), w's blocks `w_stride` elements apart;
// skinny: the per-expert skinny kernel (where routed_skinny_applies), else a thread per output element.
void launch_routed_gemm(DType dtype, bool skinny, int64_t rows, int64_t n, int64_t k, int64_t experts,
                        int64_t w_stride, const void* x, const void* w, const int32_t* offsets, void* y,
                        cudaStream_t stream);

}  // namespace lathe::cuda
