// Rotary angles computed exactly as transformers does (float32 inverse frequencies theta^(-2i/R), float32
// product with the position, float32 cos/sin), so even the f64 reference matches Hugging Face bit for bit
// in its angles. Shared by the CPU kernel; the CUDA kernel follows the same recipe.
#pragma once

#include <cmath>
#include <cstdint>

namespace lathe::cpu {

inline float rope_inv_freq(double theta, int64_t i, int64_t rotary_dim) {
  const float exponent = float(2 * i) / float(rotary_dim);
  return 1.0f / std::pow(float(theta), exponent);
}

}  // namespace lathe::cpu
