// Parameter: a trainable tensor — its Hugging Face name, value and gradient — and, when it is one piece of a
// sharded tensor, where that piece sits in the whole (ShardLayout), so that checkpoints, clipping, weight decay and
// export read the logical tensor without special cases. Lives in core so that the optimizer needs no model header.
// Covered by tests/unit/test_optim.cpp (decay by the global shape).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace lathe {

// A piece of a logical tensor: the box [offset, offset + value's shape) of `global_shape`, and inside that box, for a
// ZeRO slice of the flattened box, the elements [flat_begin, flat_begin + value's numel) in row-major order.
struct ShardLayout {
  Shape global_shape;            // empty: the tensor is whole
  std::vector<int64_t> offset;   // per dimension of global_shape
  int64_t flat_begin = -1;       // -1: the whole box
  std::string group;             // the group whose ranks hold the pieces ("tp", "ep", "dp" for ZeRO), "" when whole
  int replicas = 1;              // consecutive ranks of the group holding the same piece (tp above the kv heads)
};

// How a checkpoint records a piece's place (the metadata "shard.<name>" of an optimizer file):
// {"global_shape": [...], "offset": [...], "flat_begin": N, "group": "dp"}.
std::string shard_metadata(const ShardLayout& layout);

struct Parameter {
  std::string name;  // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Tensor value;
  Tensor grad;       // undefined until a backward pass writes it
  ShardLayout shard;

  bool whole() const { return shard.global_shape.empty(); }
  // The logical tensor's shape: what decides weight decay (a norm gain is 1-D whatever its pieces look like).
  const Shape& global_shape() const { return whole() ? value.shape() : shard.global_shape; }
};

// The values of p's box (a 2-D piece: ShardLayout offset and p.value's shape) out of its whole tensor's row-major
// values, `elem` entries of `whole` an element (bytes: the dtype's size; typed values: 1).
template <typename T>
std::vector<T> slice_of(const std::vector<T>& whole, const Parameter& p, size_t elem = 1) {
  LATHE_CHECK(p.value.dim() == 2 && p.shard.flat_begin < 0 && p.shard.global_shape.size() == 2,
              "parameter {}: only 2-D boxes are sliced here", p.name);
  const size_t rows = size_t(p.value.size(0)), cols = size_t(p.value.size(1)) * elem;
  const size_t stride = size_t(p.shard.global_shape[1]) * elem, r0 = size_t(p.shard.offset[0]);
  const size_t c0 = size_t(p.shard.offset[1]) * elem;
  std::vector<T> out(rows * cols);
  for (size_t i = 0; i < rows; ++i)
    std::copy_n(whole.begin() + std::ptrdiff_t((r0 + i) * stride + c0), cols, out.begin() + std::ptrdiff_t(i * cols));
  return out;
}

}  // namespace lathe
