#include "parallel/zero.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include <filesystem>

#include "core/error.h"
#include "io/safetensors.h"

namespace lathe {

namespace {

// Rank r's range [lo, hi) of the flat space inside a bucket of `elements` from `begin`, cut in chunks of `chunk`.
std::pair<int64_t, int64_t> rank_range(int64_t begin, int64_t elements, int64_t chunk, int64_t r) {
  return {std::min(begin + elements, begin + r * chunk), std::min(begin + elements, begin + (r + 1) * chunk)};
}

// The place of the piece of `p` from its element `flat_begin`: inside the whole tensor, or inside p's tp slice (the
// slice's layout kept, so that the norm and the replicas' sums see a tp piece).
ShardLayout piece_layout(const Parameter& p, int64_t flat_begin) {
  ShardLayout shard = p.shard;
  if (p.whole()) shard = {p.value.shape(), std::vector<int64_t>(p.value.shape().size(), 0), -1, "dp", 1, {}};
  LATHE_CHECK(shard.flat_begin < 0, "zero: {} is a ZeRO piece already", p.name);
  shard.flat_begin = flat_begin;
  return shard;
}

}  // namespace

std::string zero_state_name(const std::string& slice, int rank, int ranks) {
  const std::string prefix = slice.empty() ? "optimizer" : "optimizer." + slice;
  return ranks == 0 ? prefix + ".safetensors" : fmt::format("{}.rank-{}-of-{}.safetensors", prefix, rank, ranks);
}

std::vector<StatePiece> whole_state_pieces(const std::vector<Parameter>& params, bool global) {
  std::vector<StatePiece> pieces;
  int64_t at = 0;
  for (const Parameter& p : params) {
    const Shape shape = global ? p.global_shape() : p.value.shape();
    const int64_t n = shape_numel(shape);
    pieces.push_back({p.name, shape, at, at + n, at, n, global ? ShardLayout{} : p.shard});
    at += n;
  }
  return pieces;
}

ZeroShards::ZeroShards(std::vector<ZeroGroup> groups) {
  LATHE_CHECK(!groups.empty() && groups.size() <= 2 && !groups[0].params.empty(), "zero: no parameters to shard, or "
              "more groups than the dense parameters and the experts");
  const DType dtype = groups[0].params[0]->value.dtype();
  const Device device = groups[0].params[0]->value.device();
  for (size_t k = 0; k < groups.size(); ++k) {
    ZeroGroup& group = groups[k];
    LATHE_CHECK(!group.buckets.empty() && group.buckets.back().end == group.params.size() && group.ranks &&
                group.gathers, "zero: the buckets of group {} do not cover its parameters", k);
    const size_t first = params_.size();
    for (GradBucket g : group.buckets) {  // placed after the groups before
      g.first += first;
      g.end += first;
      g.begin += total_;
      buckets_.push_back(g);
      group_of_.push_back(k);
    }
    for (Parameter* p : group.params) {
      LATHE_CHECK(p->value.is_contiguous() && p->value.dtype() == dtype && p->value.device() == device,
                  "zero: {} is not contiguous, or of another dtype or device than the other parameters", p->name);
      params_.push_back(p);
      offsets_.push_back(total_);
      total_ += p->value.numel();
    }
    ranks_.push_back(group.ranks);
    gathers_.push_back(group.gathers);
    if (k == 0) first_group_params_ = params_.size();
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const GradBucket& g = buckets_[b];
    const Communicator& ranks = *ranks_[group_of_[b]];
    const auto [lo, hi] = rank_range(g.begin, g.elements, g.chunk(ranks.size()), ranks.rank());
    for (size_t i = g.first; i < g.end; ++i) {
      const Parameter& p = *params_[i];
      const int64_t plo = std::max(lo, offsets_[i]), phi = std::min(hi, offsets_[i] + p.value.numel());
      if (plo >= phi) continue;
      owned_.push_back({p.name, p.value.view({-1}).narrow(0, plo - offsets_[i], phi - plo), {},
                        piece_layout(p, plo - offsets_[i])});
      pieces_.push_back({b, i, plo});
    }
  }
}

void ZeroShards::take_grads(const std::vector<Tensor>& sums) {
  LATHE_ASSERT(sums.size() == buckets_.size());
  for (size_t k = 0; k < owned_.size(); ++k) {
    const Piece& piece = pieces_[k];
    const GradBucket& g = buckets_[piece.bucket];
    const Communicator& ranks = *ranks_[group_of_[piece.bucket]];
    const int64_t rank_begin = rank_range(g.begin, g.elements, g.chunk(ranks.size()), ranks.rank()).first;
    LATHE_ASSERT(sums[piece.bucket].defined());
    owned_[k].grad = sums[piece.bucket].narrow(0, piece.begin - rank_begin, owned_[k].value.numel());
  }
}

std::vector<size_t> ZeroShards::owned_buckets() const {
  std::vector<size_t> out;
  for (const Piece& p : pieces_) out.push_back(p.bucket);
  return out;
}

void ZeroShards::begin_gather(const ExecContext& compute, Stream& side) {
  LATHE_CHECK(!compute_, "zero: a step's gathers began twice");
  compute_.emplace(compute);
  side_ = &side;
  next_gather_ = 0;
  if (!updated_) {
    updated_ = compute.backend.create_event(compute.device.index);
    gathered_ = compute.backend.create_event(compute.device.index);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      written_.push_back(compute.backend.create_event(compute.device.index));
      done_.push_back(compute.backend.create_event(compute.device.index));
    }
  }
}

void ZeroShards::gather_through(size_t bucket) {
  LATHE_CHECK(compute_, "zero: gather_through outside a step's gathers");
  while (next_gather_ <= bucket && next_gather_ < buckets_.size()) launch_gather(next_gather_++);
}

double ZeroShards::finish_gather() {
  LATHE_CHECK(compute_, "zero: finish_gather outside a step's gathers");
  updated_->record(compute_->stream);
  while (next_gather_ < buckets_.size()) launch_gather(next_gather_++);
  gathered_->record(*side_);
  while (!gathering_.empty()) retire_oldest_gather();
  compute_.reset();
  for (CommWork& w : works_) w.wait();
  works_.clear();
  gathered_->synchronize();
  return std::max(0.0, gathered_->elapsed_ms_since(*updated_));
}

// Bucket b's range of this rank copied out of the parameters, all-gathered, and every rank's range copied back, on the
// side stream after the compute stream's work so far (the update of bucket b and those before it).
void ZeroShards::launch_gather(size_t b) {
  const GradBucket& g = buckets_[b];
  Communicator& comm = *gathers_[group_of_[b]];
  const int dp = comm.size();
  const int64_t chunk = g.chunk(dp);
  const size_t item = dtype_size(g.dtype);
  const auto [lo, hi] = rank_range(g.begin, g.elements, chunk, comm.rank());
  ExecContext& cx = *compute_;
  Gathering f{b, Tensor::empty({chunk}, g.dtype, cx.allocator), Tensor::empty({chunk * dp}, g.dtype, cx.allocator)};
  written_[b]->record(cx.stream);
  written_[b]->wait(*side_);
  // Between the bucket's flat range [begin, begin + elements) and `flat` (which starts at flat element `from`).
  const auto move = [&](const Tensor& flat, int64_t from, int64_t begin, int64_t end, bool to_flat) {
    for (size_t i = g.first; i < g.end; ++i) {
      Parameter& p = *params_[i];
      const int64_t a = std::max(begin, offsets_[i]), e = std::min(end, offsets_[i] + p.value.numel());
      if (a >= e) continue;
      char* param_bytes = static_cast<char*>(p.value.data_ptr()) + size_t(a - offsets_[i]) * item;
      char* flat_bytes = static_cast<char*>(flat.data_ptr()) + size_t(a - from) * item;
      cx.backend.copy(to_flat ? flat_bytes : param_bytes, cx.device, to_flat ? param_bytes : flat_bytes, cx.device,
                      size_t(e - a) * item, *side_);
    }
  };
  if (hi > lo) move(f.mine, lo, lo, hi, true);
  works_.push_back(comm.all_gather(f.mine, f.all));
  move(f.all, g.begin, g.begin, g.begin + g.elements, false);
  done_[b]->record(*side_);
  gathering_.push_back(std::move(f));
  if (gathering_.size() > 2) retire_oldest_gather();
}

// The compute stream waits for the oldest gather; only then is its memory released.
void ZeroShards::retire_oldest_gather() {
  done_[gathering_.front().bucket]->wait(compute_->stream);
  gathering_.erase(gathering_.begin());
}

void ZeroShards::drop_grads() {
  for (Parameter& p : owned_) p.grad = Tensor();
}

nlohmann::json ZeroShards::group_layout(size_t group) const {
  nlohmann::json sizes = nlohmann::json::array();
  int64_t elements = 0;
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (group_of_[b] == group) {
      sizes.push_back(buckets_[b].elements);
      elements += buckets_[b].elements;
    }
  return {{"dp", ranks_[group]->size()}, {"elements", elements}, {"buckets", sizes}};
}

nlohmann::json ZeroShards::tensors() const {
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < first_group_params_; ++i) out.push_back({params_[i]->name, params_[i]->value.shape()});
  return out;
}

nlohmann::json ZeroShards::layout() const {
  nlohmann::json out = group_layout(0);
  if (ranks_.size() > 1) out["experts"] = group_layout(1);
  return out;
}

void ZeroShards::reshard_state(const std::string& dir, const nlohmann::json& old_layout, const std::string& out_path,
                               const std::string& slice) const {
  std::vector<StatePiece> pieces;
  for (size_t k = 0; k < owned_.size(); ++k) {
    const size_t i = pieces_[k].param;
    pieces.push_back({owned_[k].name, owned_[k].value.shape(), offsets_[i], offsets_[i] + params_[i]->value.numel(),
                      pieces_[k].begin, owned_[k].value.numel(), owned_[k].shard});
  }
  assemble_optimizer_state(dir, old_layout, pieces, total_, out_path, slice);
}

namespace {

// The places of the tensors that slot `slice`'s ZeRO shards (`ranks` files) hold as tp or ep slices (their pieces'
// "shard.<name>" metadata, the flat_begin dropped); a tensor not listed is whole.
std::map<std::string, ShardLayout> slice_places(const std::string& dir, const std::string& slice, int ranks) {
  std::map<std::string, ShardLayout> places;
  for (int r = 0; r < ranks; ++r) {
    const io::SafetensorsFile f =
        io::SafetensorsFile::open((std::filesystem::path(dir) / zero_state_name(slice, r, ranks)).string());
    for (const auto& [key, value] : f.metadata()) {
      if (key.rfind("shard.", 0) != 0) continue;
      std::optional<ShardLayout> l = parse_shard_metadata(value);
      LATHE_CHECK(l, "zero: {}: the metadata {} ({}) does not place its tensor", f.path(), key, value);
      if (l->group == "dp") continue;  // a whole tensor's piece
      l->flat_begin = -1;
      places[key.substr(6)] = *l;
    }
  }
  return places;
}

}  // namespace

std::vector<std::string> assemble_slot_states(const std::string& dir, const nlohmann::json& slots,
                                              const std::string& kind, const std::string& out_dir) {
  std::vector<std::string> files;
  const int n = int(slots.size());
  for (int t = 0; t < n; ++t) {
    const nlohmann::json& slot = slots[size_t(t)];
    LATHE_CHECK(slot.is_object() && slot.contains("tensors") && !slot.contains("experts"), "zero: {}: the ZeRO shards "
                "of slot {} of {} {} do not list their tensors (saved under ep, or before they were listed): they "
                "resume only at their own layout", dir, t, kind, n);
    const std::string slice = fmt::format("{}-{}-of-{}", kind, t, n);
    const std::map<std::string, ShardLayout> places = slice_places(dir, slice, slot.value("dp", 0));
    std::vector<StatePiece> pieces;
    int64_t at = 0;
    for (const auto& e : slot["tensors"]) {
      const std::string name = e.at(0).get<std::string>();
      const Shape shape = e.at(1).get<Shape>();
      const int64_t elements = shape_numel(shape);
      const auto place = places.find(name);
      pieces.push_back({name, shape, at, at + elements, at, elements,
                        place == places.end() ? ShardLayout{} : place->second});
      at += elements;
    }
    nlohmann::json layout = slot;
    layout.erase("tensors");
    files.push_back((std::filesystem::path(out_dir) / zero_state_name(slice, 0, 0)).string());
    assemble_optimizer_state(dir, layout, pieces, at, files.back(), slice);
  }
  return files;
}

void assemble_optimizer_state(const std::string& dir, const nlohmann::json& layout, const std::vector<StatePiece>& pieces,
                              int64_t elements, const std::string& out_path, const std::string& slice) {
  // The old files and the flat range each old rank holds in each old bucket: a whole state is one rank, one bucket.
  int64_t old_dp = 1;
  std::vector<int64_t> old_sizes = {elements};
  if (!layout.is_null()) {
    old_dp = layout.value("dp", int64_t(0));
    old_sizes.clear();
    int64_t sum = 0;
    bool valid = layout.contains("buckets") && layout["buckets"].is_array();
    if (valid)
      for (const auto& n : layout["buckets"]) {
        valid = valid && n.is_number_integer() && n.get<int64_t>() > 0;
        old_sizes.push_back(valid ? n.get<int64_t>() : 0);
        sum += old_sizes.back();
      }
    LATHE_CHECK(valid && old_dp >= 1 && sum == elements && layout.value("elements", int64_t(-1)) == elements,
                "zero: {}'s optimizer shards ({}) are not of this model ({} elements)", dir, layout.dump(), elements);
  }
  std::vector<io::SafetensorsFile> old;
  for (int64_t r = 0; r < old_dp; ++r)
    old.push_back(io::SafetensorsFile::open(
        (std::filesystem::path(dir) / zero_state_name(slice, int(r), layout.is_null() ? 0 : int(old_dp))).string()));
  std::vector<io::TensorRef> refs;
  std::vector<std::vector<uint8_t>> bytes;
  bytes.reserve(pieces.size() * 3);
  for (const StatePiece& piece : pieces) {
    const int64_t n = piece.elements;
    for (const char* suffix : {".master", ".exp_avg", ".exp_avg_sq"}) {
      const std::string name = piece.name + suffix;
      std::vector<float> v(size_t(n), 0.0f);
      DType dtype = DType::F32;
      int64_t covered = 0;
      int64_t bucket_begin = 0;
      for (int64_t size : old_sizes) {  // old rank r holds its chunk of each old bucket
        const int64_t chunk = (size + old_dp - 1) / old_dp;
        for (int64_t r = 0; r < old_dp; ++r) {
          const auto [rlo, rhi] = rank_range(bucket_begin, size, chunk, r);
          // The old piece of this parameter on rank r (a parameter lies in one bucket), and its overlap with ours.
          const int64_t old_lo = std::max(rlo, piece.param_begin), old_hi = std::min(rhi, piece.param_end);
          const int64_t lo = std::max(old_lo, piece.begin), hi = std::min(old_hi, piece.begin + n);
          const io::SafetensorsTensor* t = lo < hi ? old[size_t(r)].find(name) : nullptr;
          if (!t) continue;
          dtype = t->dtype;
          const std::vector<float> part = old[size_t(r)].read_as_f32(name);
          LATHE_CHECK(int64_t(part.size()) == old_hi - old_lo, "zero: {}: the {} of rank {} holds {} elements, the "
                      "layout says {}", dir, name, r, part.size(), old_hi - old_lo);
          for (int64_t x = lo; x < hi; ++x) v[size_t(x - piece.begin)] = part[size_t(x - old_lo)];
          covered += hi - lo;
        }
        bucket_begin += size;
      }
      if (covered == 0 && std::string(suffix) == ".master") continue;  // parameters that are their own masters
      LATHE_CHECK(covered == n, "zero: {}: the old optimizer files hold {} of {}'s {} elements", dir, covered, name, n);
      std::vector<uint8_t> b(size_t(n) * dtype_size(dtype));
      for (int64_t x = 0; x < n; ++x) store_from_double(b.data(), dtype, x, v[size_t(x)]);
      bytes.push_back(std::move(b));
      refs.push_back({name, dtype, std::vector<int64_t>(piece.shape.begin(), piece.shape.end()), bytes.back().data(),
                      bytes.back().size()});
    }
  }
  // The old files' hyper-parameters and step counts (a parameter's own count, "step.<name>", is in the file of the
  // rank that held it), and the new pieces' places.
  std::map<std::string, std::string> meta;
  for (const io::SafetensorsFile& f : old)
    for (const auto& [key, value] : f.metadata())
      if (key.rfind("shard.", 0) != 0) meta[key] = value;
  for (const StatePiece& piece : pieces)
    if (!piece.shard.global_shape.empty()) meta["shard." + piece.name] = shard_metadata(piece.shard);
  io::write_safetensors(out_path, refs, meta);
}

}  // namespace lathe
