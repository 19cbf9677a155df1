#include "core/parameter.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

namespace lathe {

std::string shard_metadata(const ShardLayout& l) {
  const std::string sections =
      l.sections.empty() ? "" : fmt::format(", \"sections\": [{}]", fmt::join(l.sections, ", "));
  return fmt::format("{{\"global_shape\": [{}], \"offset\": [{}], \"flat_begin\": {}, \"group\": \"{}\"{}}}",
                     fmt::join(l.global_shape, ", "), fmt::join(l.offset, ", "), l.flat_begin, l.group, sections);
}

std::optional<ShardLayout> parse_shard_metadata(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("global_shape") || !j.contains("offset") || !j["global_shape"].is_array() ||
      !j["offset"].is_array() || j["offset"].size() != j["global_shape"].size())
    return std::nullopt;
  try {
    ShardLayout l;
    l.global_shape = j["global_shape"].get<Shape>();
    l.offset = j["offset"].get<std::vector<int64_t>>();
    l.flat_begin = j.value("flat_begin", int64_t(-1));
    l.group = j.value("group", std::string());
    if (j.contains("sections")) l.sections = j["sections"].get<std::vector<int64_t>>();
    return l;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;  // a field of the wrong type
  }
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
  LATHE_CHECK(dim <= 0 || global.size() == 2, "shard: only a 2-D tensor is split along dimension 1");
  if (dim < 0) return {{0, global[0], 0, cols, 0, 0}};
  const std::vector<int64_t> sections = l.sections.empty() ? std::vector<int64_t>{global[size_t(dim)]} : l.sections;
  const int64_t whole = global[size_t(dim)], mine = local[size_t(dim)];
  int64_t total = 0;
  for (int64_t s : sections) total += s;
  LATHE_CHECK(total == whole && mine > 0 && whole % mine == 0,
              "shard: sections of {} in a dimension of {}, a piece of {}", total, whole, mine);
  const int64_t parts = whole / mine, part = l.offset[size_t(dim)] / (sections[0] / parts);
  std::vector<PieceBox> boxes;
  int64_t start = 0, at = 0;  // the section's start in the whole, the part's in the piece
  for (int64_t s : sections) {
    LATHE_CHECK(s % parts == 0, "shard: a section of {} does not split in {}", s, parts);
    const int64_t from = start + part * (s / parts), n = s / parts;
    if (dim == 0) boxes.push_back({from, n, 0, cols, at, 0});
    else boxes.push_back({0, local[0], from, n, 0, at});
    start += s;
    at += n;
  }
  return boxes;
}

ShardLayout split_layout(const Shape& local, int dim, int64_t parts, int64_t part, const std::string& group,
                         int replicas, std::vector<int64_t> sections) {
  ShardLayout s;
  s.global_shape = local;
  s.global_shape[size_t(dim)] *= parts;
  s.offset.assign(local.size(), 0);
  s.offset[size_t(dim)] = (sections.empty() ? local[size_t(dim)] : sections[0] / parts) * part;
  s.group = group;
  s.replicas = replicas;
  s.sections = std::move(sections);
  return s;
}

ShardLayout part_layout(const ShardLayout& l, const Shape& local, int64_t part) {
  ShardLayout out = l;
  const int dim = split_dim(l, local);
  if (dim < 0) return out;
  const int64_t parts = l.global_shape[size_t(dim)] / local[size_t(dim)];
  const int64_t first = l.sections.empty() ? local[size_t(dim)] : l.sections[0] / parts;
  out.offset[size_t(dim)] = part * first;
  return out;
}

}  // namespace lathe
