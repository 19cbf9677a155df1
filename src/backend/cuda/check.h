// Error checks for CUDA runtime and cuBLASLt calls, and for kernel launches. Each throws lathe::Error
// naming the failing statement (or kernel), the error, the current device and file:line. This header is
// included from .cu files, so it declares plain functions only (no fmt).
#pragma once

#include <cuda_runtime.h>

namespace lathe::cuda {

[[noreturn]] void throw_cuda_error(const char* what, cudaError_t err, const char* file, int line);
[[noreturn]] void throw_cublas_error(const char* what, int status, const char* file, int line);

}  // namespace lathe::cuda

#define LATHE_CUDA_CHECK(stmt)                                                           \
  do {                                                                                   \
    cudaError_t lathe_err_ = (stmt);                                                     \
    if (lathe_err_ != cudaSuccess) ::lathe::cuda::throw_cuda_error(#stmt, lathe_err_, __FILE__, __LINE__); \
  } while (0)

#define LATHE_CUBLAS_CHECK(stmt)                                                         \
  do {                                                                                   \
    int lathe_st_ = int(stmt);                                                           \
    if (lathe_st_ != 0) ::lathe::cuda::throw_cublas_error(#stmt, lathe_st_, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: reports launch-configuration errors with the kernel's name.
#define LATHE_CUDA_LAUNCH_CHECK(kernel_name)                                             \
  do {                                                                                   \
    cudaError_t lathe_err_ = cudaGetLastError();                                         \
    if (lathe_err_ != cudaSuccess)                                                       \
      ::lathe::cuda::throw_cuda_error("launch of kernel " kernel_name, lathe_err_, __FILE__, __LINE__); \
  } while (0)
