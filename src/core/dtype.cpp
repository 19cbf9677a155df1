#include "core/dtype.h"

#include <cmath>

#include "core/error.h"

namespace lathe {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::U8: case DType::Bool: return 1;
  }
  LATHE_FAIL("dtype: invalid dtype value {}", int(t));
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::Bool: return "bool";
  }
  return "invalid";
}

DType dtype_from_name(std::string_view name) {
  for (DType t : kAllDTypes)
    if (dtype_name(t) == name) return t;
  LATHE_FAIL("dtype: unknown dtype '{}' (expected one of f32, f64, bf16, f16, i32, i64, u8, bool)", name);
}

bool is_floating(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::BF16 || t == DType::F16;
}

float f16_to_float(F16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  uint32_t exp = (v.bits >> 10) & 0x1fu;
  uint32_t man = v.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf or NaN
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | (uint32_t(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

F16 float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return F16{uint16_t(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return F16{uint16_t(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {  // result is subnormal or zero: round abs * 2^24 to an integer
    float a;
    std::memcpy(&a, &abs, 4);
    const float scaled = a * 16777216.0f;  // exact scaling by 2^24
    return F16{uint16_t(sign | uint16_t(std::nearbyint(scaled)))};
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // nearest even at bit 13
  return F16{uint16_t(sign | ((rounded - (112u << 23)) >> 13))};
}

double load_as_double(const void* data, DType t, int64_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(data)[i];
    case DType::F64: return static_cast<const double*>(data)[i];
    case DType::BF16: return bf16_to_float(static_cast<const BF16*>(data)[i]);
    case DType::F16: return f16_to_float(static_cast<const F16*>(data)[i]);
    case DType::I32: return static_cast<const int32_t*>(data)[i];
    case DType::I64: return double(static_cast<const int64_t*>(data)[i]);
    case DType::U8: return static_cast<const uint8_t*>(data)[i];
    case DType::Bool: return static_cast<const uint8_t*>(data)[i] != 0;
  }
  LATHE_FAIL("dtype: invalid dtype value {}", int(t));
}

void store_from_double(void* data, DType t, int64_t i, double v) {
  switch (t) {
    case DType::F32: static_cast<float*>(data)[i] = float(v); return;
    case DType::F64: static_cast<double*>(data)[i] = v; return;
    case DType::BF16: static_cast<BF16*>(data)[i] = float_to_bf16(float(v)); return;
    case DType::F16: static_cast<F16*>(data)[i] = float_to_f16(float(v)); return;
    case DType::I32: static_cast<int32_t*>(data)[i] = int32_t(v); return;
    case DType::I64: static_cast<int64_t*>(data)[i] = int64_t(v); return;
    case DType::U8: static_cast<uint8_t*>(data)[i] = uint8_t(v); return;
    case DType::Bool: static_cast<uint8_t*>(data)[i] = v != 0.0; return;
  }
  LATHE_FAIL("dtype: invalid dtype value {}", int(t));
}

}  // namespace lathe
