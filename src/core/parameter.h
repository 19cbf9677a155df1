// Parameter: a trainable tensor — its Hugging Face name, value and gradient — and, when it is one piece of a
// sharded tensor, where that piece sits in the whole (ShardLayout), so that checkpoints, clipping, weight decay and
// export read the logical tensor without special cases. Lives in core so that the optimizer needs no model header.
// Covered by tests/unit/test_optim.cpp (decay by the global shape).
#pragma once

#include <algorithm>
#include <optional>
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
  // The split dimension of the whole as consecutive sections, each split alike over the group: the piece is the same
  // part of every section, stacked (Gated DeltaNet's in_proj_qkv and conv1d rows, [q | k | v]; the columns of a LoRA
  // B^T over them); the offset along that dimension is then the piece's offset into the first section. Empty: one
  // section.
  std::vector<int64_t> sections;
};

// How a checkpoint records a piece's place (the metadata "shard.<name>" of an optimizer file):
// {"global_shape": [...], "offset": [...], "flat_begin": N, "group": "dp"} (and "sections": [...] where set).
std::string shard_metadata(const ShardLayout& layout);
// The inverse: the layout a "shard.<name>" value records, or nothing where it is not such a record (not a JSON object,
// or without a global_shape and an offset of as many dimensions). flat_begin is -1 where absent.
std::optional<ShardLayout> parse_shard_metadata(const std::string& text);

// A box of a piece in its whole tensor viewed as 2-D (dim 0 by the product of the other dimensions): `rows` rows
// from `row` and `cols` columns from `col` of the whole, held at (local_row, local_col) of the piece (viewed alike).
struct PieceBox {
  int64_t row = 0, rows = 0, col = 0, cols = 0, local_row = 0, local_col = 0;
};

// The boxes of a piece of shape `local` placed by `layout` (one, unless sections split dim 0; a whole tensor: one box
// of all of it). A tensor split along a dimension other than 0 must be 2-D.
std::vector<PieceBox> piece_boxes(const ShardLayout& layout, const Shape& local);

// The layout of a piece of shape `local` that is part `part` of `parts` along `dim` of its whole tensor (each part
// held by `replicas` consecutive ranks of `group`; `sections`: the whole's sizes of the dimension's sections, each
// split alike, ShardLayout::sections).
ShardLayout split_layout(const Shape& local, int dim, int64_t parts, int64_t part, const std::string& group,
                         int replicas = 1, std::vector<int64_t> sections = {});

// The layout of the piece `part` (0-based, in the order of the split) of the same split as `layout`: what another
// rank of the group holds.
ShardLayout part_layout(const ShardLayout& layout, const Shape& local, int64_t part);

struct Parameter {
  std::string name;  // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Tensor value;
  Tensor grad;       // undefined until a backward pass writes it
  ShardLayout shard;

  bool whole() const { return shard.global_shape.empty(); }
  // The logical tensor's shape: what decides weight decay (a norm gain is 1-D whatever its pieces look like).
  const Shape& global_shape() const { return whole() ? value.shape() : shard.global_shape; }
};

// The values of p's piece (piece_boxes) out of its whole tensor's row-major values, `elem` entries of `whole` an
// element (bytes: the dtype's size; typed values: 1).
template <typename T>
std::vector<T> slice_of(const std::vector<T>& whole, const Parameter& p, size_t elem = 1) {
  LATHE_CHECK(p.shard.flat_begin < 0, "parameter {}: a ZeRO piece is not sliced here", p.name);
  const Shape& global = p.global_shape();
  const size_t stride = size_t(shape_numel(global) / global[0]) * elem;  // a row of the whole viewed as 2-D
  const size_t local_stride = size_t(p.value.numel() / p.value.size(0)) * elem;
  std::vector<T> out(size_t(p.value.numel()) * elem);
  for (const PieceBox& b : piece_boxes(p.shard, p.value.shape()))
    for (int64_t i = 0; i < b.rows; ++i)
      std::copy_n(whole.begin() + std::ptrdiff_t(size_t(b.row + i) * stride + size_t(b.col) * elem),
                  size_t(b.cols) * elem,
                  out.begin() + std::ptrdiff_t(size_t(b.local_row + i) * local_stride + size_t(b.local_col) * elem));
  return out;
}

}  // namespace lathe
