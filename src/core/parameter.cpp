#include "core/parameter.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace lathe {

std::string shard_metadata(const ShardLayout& l) {
  const std::string sections =
      l.sections.empty() ? "" : fmt::format(", \"sections\": [{}]", fmt::join(l.sections, ", "));
  return fmt::format("{{\"global_shape\": [{}], \"offset\": [{}], \"flat_begin\": {}, \"group\": \"{}\"{}}}",
                     fmt::join(l.global_shape, ", "), fmt::join(l.offset, ", "), l.flat_begin, l.group, sections);
}

namespace {

// The dimension a piece is split along (-1: it is the whole, as a lone kv head held by every rank).
int split_dim(const ShardLayout& l, const Shape& local) {
  for (size_t d = 0; d < local.size(); ++d)
    if (l.global_shape[d] != local[d]) return int(d);
  return -1;
}

}  // namespace

std::vector<PieceBox> piece_boxes(const ShardLayout& l, const Shape& local) {
  const Shape& global = l.global_shape.empty() ? local : l.global_shape;
  LATHE_CHECK(!global.empty() && global.size() == local.size(), "shard: a piece of {} dimensions in a tensor of {}",
              local.size(), global.size());
  const int64_t cols = shape_numel(global) / global[0];  // the whole viewed as 2-D
  if (l.global_shape.empty()) return {{0, global[0], 0, cols, 0}};
  const int dim = split_dim(l, local);
  if (dim > 0) {
    LATHE_CHECK(global.size() == 2 && l.sections.empty(), "shard: only a 2-D tensor is split along dimension 1");
    return {{0, local[0], l.offset[1], local[1], 0}};
  }
  if (l.sections.empty()) return {{l.offset[0], local[0], 0, cols, 0}};
  int64_t total = 0;
  for (int64_t s : l.sections) total += s;
  LATHE_CHECK(total == global[0] && local[0] > 0 && global[0] % local[0] == 0,
              "shard: sections of {} rows in a tensor of {}, a piece of {}", total, global[0], local[0]);
  const int64_t parts = global[0] / local[0], part = l.offset[0] / (l.sections[0] / parts);
  std::vector<PieceBox> boxes;
  int64_t start = 0, local_row = 0;
  for (int64_t s : l.sections) {
    LATHE_CHECK(s % parts == 0, "shard: a section of {} rows does not split in {}", s, parts);
    boxes.push_back({start + part * (s / parts), s / parts, 0, cols, local_row});
    start += s;
    local_row += s / parts;
  }
  return boxes;
}

ShardLayout part_layout(const ShardLayout& l, const Shape& local, int64_t part) {
  ShardLayout out = l;
  const int dim = split_dim(l, local);
  if (dim < 0) return out;
  const int64_t first = l.sections.empty() ? local[size_t(dim)] : l.sections[0] / (l.global_shape[0] / local[0]);
  out.offset[size_t(dim)] = part * first;
  return out;
}

}  // namespace lathe
