// Parameter: a trainable tensor — its Hugging Face name, value and gradient — and, when it is one piece of a
// sharded tensor, where that piece sits in the whole (ShardLayout), so that checkpoints, clipping, weight decay and
// export read the logical tensor without special cases. Lives in core so that the optimizer needs no model header.
// Covered by tests/unit/test_optim.cpp (decay by the global shape).
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"

namespace lathe {

// A piece of a logical tensor: the box [offset, offset + value's shape) of `global_shape`, and inside that box, for a
// ZeRO slice of the flattened box, the elements [flat_begin, flat_begin + value's numel) in row-major order.
struct ShardLayout {
  Shape global_shape;            // empty: the tensor is whole
  std::vector<int64_t> offset;   // per dimension of global_shape
  int64_t flat_begin = -1;       // -1: the whole box
  std::string group;             // the group whose ranks hold the pieces ("tp", "ep", "dp" for ZeRO), "" when whole
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

}  // namespace lathe
