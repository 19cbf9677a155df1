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

std::string tp_state_name(int rank, int ranks) { return fmt::format("optimizer.tp-{}-of-{}.safetensors", rank, ranks); }

namespace {

// An old file's box of a tensor: where its slice sits in the whole (its "shard.<param>" metadata), or the whole.
struct Box {
  std::vector<int64_t> offset, shape;
};

Box box_in(const io::SafetensorsFile& f, const std::string& param, const io::SafetensorsTensor& t) {
  const auto it = f.metadata().find("shard." + param);
  if (it == f.metadata().end()) return {std::vector<int64_t>(t.shape.size(), 0), t.shape};
  const nlohmann::json j = nlohmann::json::parse(it->second, nullptr, false);
  LATHE_CHECK(j.is_object() && j.contains("offset") && j["offset"].size() == t.shape.size(),
              "tp: {}: the metadata shard.{} ({}) does not place the tensor", f.path(), param, it->second);
  return {j["offset"].get<std::vector<int64_t>>(), t.shape};
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
    LATHE_CHECK(p.value.dim() == 2 || p.whole(), "tp: {} is split but not 2-D", p.name);
    const std::vector<int64_t> mine_offset = p.whole() ? std::vector<int64_t>(size_t(p.value.dim()), 0) : p.shard.offset;
    const std::vector<int64_t> mine_shape(p.value.shape().begin(), p.value.shape().end());
    for (const char* suffix : {".master", ".exp_avg", ".exp_avg_sq"}) {
      const std::string name = p.name + suffix;
      const io::SafetensorsTensor* first = old[0].find(name);
      if (!first) {
        LATHE_CHECK(std::string(suffix) == ".master", "tp: {}: {} is missing", old[0].path(), name);
        continue;  // parameters that are their own masters
      }
      const DType dtype = first->dtype;
      const size_t elem = dtype_size(dtype);
      std::vector<uint8_t> b(size_t(p.value.numel()) * elem);
      int64_t covered = 0;
      if (!old[0].metadata().count("shard." + p.name)) {  // whole in every old file: ours is a box of it, or all of it
        if (p.whole()) old[0].read_into(name, dtype, b.data(), b.size());
        else old[0].read_box_into(name, mine_offset, mine_shape, dtype, b.data(), b.size());
        covered = p.value.numel();
      }
      if (covered == 0) {  // split in the old files: each one's overlap with ours (a box held by several, once)
        std::set<std::vector<int64_t>> seen;
        for (const io::SafetensorsFile& f : old) {
          const io::SafetensorsTensor* t = f.find(name);
          LATHE_CHECK(t && t->dtype == dtype && t->shape.size() == 2, "tp: {}: {} is missing, of another dtype or not "
                      "2-D", f.path(), name);
          const Box ob = box_in(f, p.name, *t);
          if (!seen.insert(ob.offset).second) continue;
          std::vector<int64_t> lo(2), hi(2);  // the overlap, in the whole tensor's coordinates
          for (size_t d = 0; d < 2; ++d) {
            lo[d] = std::max(ob.offset[d], mine_offset[d]);
            hi[d] = std::min(ob.offset[d] + ob.shape[d], mine_offset[d] + mine_shape[d]);
          }
          if (lo[0] >= hi[0] || lo[1] >= hi[1]) continue;
          const int64_t rows = hi[0] - lo[0], cols = hi[1] - lo[1];
          std::vector<uint8_t> part(size_t(rows * cols) * elem);
          f.read_box_into(name, {lo[0] - ob.offset[0], lo[1] - ob.offset[1]}, {rows, cols}, dtype, part.data(),
                          part.size());
          for (int64_t r = 0; r < rows; ++r)
            std::copy_n(part.begin() + std::ptrdiff_t(size_t(r * cols) * elem), size_t(cols) * elem,
                        b.begin() + std::ptrdiff_t(size_t((lo[0] - mine_offset[0] + r) * mine_shape[1] + lo[1] -
                                                          mine_offset[1]) * elem));
          covered += rows * cols;
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
