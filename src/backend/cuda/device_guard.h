// Makes a CUDA device current for the lifetime of a scope, restoring the previous one afterwards.
#pragma once

#include "backend/cuda/check.h"

namespace lathe::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    LATHE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) LATHE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace lathe::cuda
