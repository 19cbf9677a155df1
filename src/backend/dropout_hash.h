// The dropout mask as one integer function, shared by the CPU kernel (.cpp) and the CUDA kernel (.cu), so
// that both devices drop exactly the same elements. Counter-based: the uniform of element n under `seed` is
// splitmix64(seed ^ (n * golden ratio)) >> 40, a 24-bit integer k, i.e. u = k / 2^24 in [0, 1). The comparison
// u >= p is done in integers against k_min = ceil(p 2^24), computed once on the host, so no floating-point
// rounding can differ between devices. Covered by tests/ops/test_segment_ops.cpp and the dropout op-check cases.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LATHE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LATHE_HOST_DEVICE inline
#endif

namespace lathe {

inline constexpr uint64_t kDropoutGolden = 0x9E3779B97F4A7C15ull;
inline constexpr int kDropoutBits = 24;

// splitmix64's output function (Steele, Lea, Flood 2014) applied to one counter value.
LATHE_HOST_DEVICE uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + kDropoutGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The 24-bit uniform integer of element `n` (the segment-local index) under `seed`.
LATHE_HOST_DEVICE uint32_t dropout_bits(uint64_t seed, uint64_t n) {
  return uint32_t(splitmix64(seed ^ (n * kDropoutGolden)) >> (64 - kDropoutBits));
}

// Smallest 24-bit value that is kept for drop probability p in [0, 1): keep iff bits >= k_min, which is
// u >= p for u = bits / 2^24. p * 2^24 is exact in double, so this is an exact ceiling. Host only.
inline uint32_t dropout_threshold(double p) {
  const double scaled = p * double(1u << kDropoutBits);
  uint32_t k = uint32_t(scaled);
  if (double(k) < scaled) ++k;
  return k;
}

LATHE_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t n, uint32_t k_min) {
  return dropout_bits(seed, n) >= k_min;
}

}  // namespace lathe
