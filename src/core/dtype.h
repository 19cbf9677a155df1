// Element types and host-side conversions between them.
// bf16 and f16 are stored as raw 16-bit patterns (struct BF16 / F16); conversion to f32 is exact and
// conversion from f32 rounds to nearest even, as CUDA's __float2bfloat16 and __float2half do.
// Covered by tests/unit/test_core.cpp.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace lathe {

enum class DType : uint8_t { F32, F64, BF16, F16, I32, I64, U8, Bool };

inline constexpr DType kAllDTypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16,
                                       DType::I32, DType::I64, DType::U8,   DType::Bool};

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
DType dtype_from_name(std::string_view name);  // throws on an unknown name
bool is_floating(DType t);

struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float bf16_to_float(BF16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline BF16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return BF16{uint16_t(u >> 16)};
}

float f16_to_float(F16 v);
F16 float_to_f16(float f);

// Maps a C++ element type to its DType.
template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::F32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::F64; };
template <> struct DTypeOf<BF16> { static constexpr DType value = DType::BF16; };
template <> struct DTypeOf<F16> { static constexpr DType value = DType::F16; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::I32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::I64; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::U8; };
template <> struct DTypeOf<bool> { static constexpr DType value = DType::Bool; };

// Loads element i of a buffer of type t as double / stores a double into it (with rounding).
double load_as_double(const void* data, DType t, int64_t i);
void store_from_double(void* data, DType t, int64_t i, double v);

}  // namespace lathe
