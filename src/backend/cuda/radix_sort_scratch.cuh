// Scratch sizing for the kernels that sort (int32 key, int32 value) pairs with cub's radix sort (the embedding's
// deterministic backward in model_ops.cu, the MoE routing plan in moe_route.cu): their buffers are carved out of one
// scratch tensor at 256-byte boundaries.
#pragma once

#include <cub/device/device_radix_sort.cuh>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/check.h"

namespace lathe::cuda {

inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// cub's temporary storage for sorting n (int32, int32) pairs.
inline size_t radix_sort_pairs_temp_bytes(int64_t n) {
  size_t bytes = 0;
  LATHE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                   static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                   static_cast<int32_t*>(nullptr), n));
  return bytes;
}

}  // namespace lathe::cuda
