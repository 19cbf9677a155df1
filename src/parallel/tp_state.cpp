#include "parallel/tp_state.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"

namespace lathe {

std::string slice_state_name(const std::string& group, int rank, int ranks) {
  return fmt::format("optimizer.{}-{}-of-{}.safetensors", group, rank, ranks);
}

namespace {

// Where an old file's piece of a tensor sits in the whole (its "shard.<param>" metadata: global shape, offset and
// sections), as boxes; no metadata: the file holds the whole.
std::vector<PieceBox> old_boxes(const io::SafetensorsFile& f, const std::string& param, const io::SafetensorsTensor& t) {
  const auto it = f.metadata().find("shard." + param);
  if (it == f.metadata().end()) return piece_boxes({}, t.shape);
  std::optional<ShardLayout> l = parse_shard_metadata(it->second);
  LATHE_CHECK(!l || l->flat_begin < 0, "tp: {}: {} is a ZeRO piece ({}); ZeRO shards are re-cut by "
              "assemble_optimizer_state, not as tp slices", f.path(), param, it->second);
  LATHE_CHECK(l && l->global_shape.size() == t.shape.size(), "tp: {}: the metadata shard.{} ({}) does not place the "
              "tensor", f.path(), param, it->second);
  return piece_boxes(*l, t.shape);
}

// Row-major bytes of `rows` x `cols` elements of `elem` bytes at (row, col) of a `width`-wide 2-D buffer.
void put_box(std::vector<uint8_t>& to, int64_t width, int64_t row, int64_t col, const std::vector<uint8_t>& box,
             int64_t rows, int64_t cols, size_t elem) {
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(box.begin() + std::ptrdiff_t(size_t(r * cols) * elem), size_t(cols) * elem,
                to.begin() + std::ptrdiff_t(size_t((row + r) * width + col) * elem));
}

}  // namespace

void reslice_tp_state(const std::vector<std::string>& files, const std::vector<Parameter>& params,
                      const std::string& out_path) {
  LATHE_CHECK(!files.empty(), "tp: no optimizer state files to re-cut");
  std::vector<io::SafetensorsFile> old;
  for (const std::string& f : files) old.push_back(io::SafetensorsFile::open(f));
  std::vector<io::TensorRef> refs;
  std::vector<std::vector<uint8_t>> bytes;
  bytes.reserve(params.size() * 3);
  for (const Parameter& p : params) {
    LATHE_CHECK(p.shard.flat_begin < 0, "tp: {} is a ZeRO piece: its state is assembled by assemble_optimizer_state",
                p.name);
    const std::vector<int64_t> mine_shape(p.value.shape().begin(), p.value.shape().end());
    const std::vector<PieceBox> mine = piece_boxes(p.shard, p.value.shape());
    const int64_t width = p.value.numel() / p.value.size(0);  // ours viewed as 2-D
    for (const char* suffix : {".master", ".exp_avg", ".exp_avg_sq"}) {
      const std::string name = p.name + suffix;
      const io::SafetensorsTensor* first = nullptr;  // in the first file that holds it (pp: one stage's file)
      for (size_t f = 0; f < old.size() && !first; ++f) first = old[f].find(name);
      if (!first) {
        LATHE_CHECK(std::string(suffix) == ".master", "tp: {}: {} is missing from the {} old optimizer files",
                    old[0].path(), name, old.size());
        continue;  // parameters that are their own masters
      }
      const DType dtype = first->dtype;
      const size_t elem = dtype_size(dtype);
      std::vector<uint8_t> b(size_t(p.value.numel()) * elem);
      // Each old file's boxes' overlaps with ours (a box held by several files, or whole in each, taken once).
      int64_t covered = 0;
      std::set<std::pair<int64_t, int64_t>> seen;
      for (const io::SafetensorsFile& f : old) {
        const io::SafetensorsTensor* t = f.find(name);
        if (!t) continue;  // another slice's file (pipeline stages hold different tensors; the count below checks)
        LATHE_CHECK(t->dtype == dtype && t->shape.size() == mine_shape.size(),
                    "tp: {}: {} is of another dtype or of another rank", f.path(), name);
        for (const PieceBox& ob : old_boxes(f, p.name, *t)) {
          if (!seen.insert({ob.row, ob.col}).second) continue;
          for (const PieceBox& mb : mine) {
            const int64_t r0 = std::max(ob.row, mb.row), r1 = std::min(ob.row + ob.rows, mb.row + mb.rows);
            const int64_t c0 = std::max(ob.col, mb.col), c1 = std::min(ob.col + ob.cols, mb.col + mb.cols);
            if (r0 >= r1 || c0 >= c1) continue;
            const int64_t rows = r1 - r0, cols = c1 - c0;
            std::vector<uint8_t> part(size_t(rows * cols) * elem);
            f.read_box_into(name, {ob.local_row + r0 - ob.row, ob.local_col + c0 - ob.col}, {rows, cols}, dtype,
                            part.data(), part.size());
            put_box(b, width, mb.local_row + r0 - mb.row, mb.local_col + c0 - mb.col, part, rows, cols, elem);
            covered += rows * cols;
          }
        }
      }
      LATHE_CHECK(covered == p.value.numel(), "tp: {}: the {} old optimizer files hold {} of {}'s {} elements",
                  files[0], files.size(), covered, name, p.value.numel());
      bytes.push_back(std::move(b));
      refs.push_back({name, dtype, mine_shape, bytes.back().data(), bytes.back().size()});
    }
  }
  std::map<std::string, std::string> meta;
  for (const auto& [key, value] : old[0].metadata())
    if (key.rfind("shard.", 0) != 0) meta[key] = value;
  for (const Parameter& p : params)
    if (!p.whole()) meta["shard." + p.name] = shard_metadata(p.shard);
  io::write_safetensors(out_path, refs, meta);
}

}  // namespace lathe
