// Helpers shared by the model tests (tests/models): one Runtime per test binary, a tensor as host f64 values, the
// relative L2 error every parity check reports, a row-major transpose (PEFT's lora_B layout) and i32 tensors of a
// fixture file. Header-only; the tests say `using namespace lathe::test_support;`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/runtime.h"
#include "io/safetensors.h"
#include "ops/ops.h"

namespace lathe::test_support {

inline Runtime& runtime() {
  static Runtime rt;
  return rt;
}

// The values of `t` (any device, any floating dtype) as host doubles.
inline std::vector<double> to_f64(const Tensor& t) {
  ExecContext ctx = runtime().context(t.device());
  const Tensor h = runtime().copy_to(cast(ctx, t, DType::F64), Device::cpu());
  return std::vector<double>(h.data<double>(), h.data<double>() + h.numel());
}

// ||got - want|| / ||want|| over want.size() elements (float or double vectors, computed in double).
template <typename A, typename B>
double rel_l2(const A& got, const B& want) {
  double e = 0, n = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double(got[i]) - double(want[i]);
    e += d * d;
    n += double(want[i]) * double(want[i]);
  }
  return std::sqrt(e / std::max(n, 1e-300));
}

// The (cols, rows) row-major transpose of a (rows, cols) row-major matrix.
inline std::vector<double> transpose(const std::vector<double>& x, int64_t rows, int64_t cols) {
  std::vector<double> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = x[size_t(r * cols + c)];
  return t;
}

inline std::vector<int32_t> read_i32(const io::SafetensorsFile& f, const char* name) {
  const io::SafetensorsTensor& t = f.get(name);
  std::vector<int32_t> v(size_t(t.numel));
  f.read_into(name, DType::I32, v.data(), v.size() * 4);
  return v;
}

}  // namespace lathe::test_support
