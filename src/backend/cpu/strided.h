// Index helpers for strided CPU kernels: map a linear index over an output shape to the element offset
// of an input viewed with (possibly zero, for broadcasting) strides.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace lathe::cpu {

// Strides of `t` as seen from an output of shape `out` (numpy broadcasting: missing or size-1 dims get 0).
inline Shape broadcast_strides(const Tensor& t, const Shape& out) {
  Shape strides(out.size(), 0);
  const size_t lead = out.size() - size_t(t.dim());
  for (int i = 0; i < t.dim(); ++i)
    if (t.size(i) != 1) strides[lead + i] = t.strides()[i];
  return strides;
}

inline int64_t strided_offset(int64_t linear, const Shape& shape, const Shape& strides) {
  int64_t off = 0;
  for (int d = int(shape.size()) - 1; d >= 0; --d) {
    const int64_t i = linear % shape[d];
    linear /= shape[d];
    off += i * strides[d];
  }
  return off;
}

}  // namespace lathe::cpu
