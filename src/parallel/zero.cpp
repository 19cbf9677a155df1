#include "parallel/zero.h"

#include <algorithm>

#include <fmt/format.h>

#include <filesystem>

#include "core/error.h"
#include "io/safetensors.h"

namespace lathe {

ZeroShards::ZeroShards(std::vector<Parameter>& params, Communicator& dp) : params_(&params), dp_(&dp) {
  LATHE_CHECK(!params.empty(), "zero: no parameters to shard");
  const DType dtype = params[0].value.dtype();
  for (const Parameter& p : params) {
    LATHE_CHECK(p.value.is_contiguous() && p.value.dtype() == dtype && p.value.device() == params[0].value.device(),
                "zero: {} is not contiguous, or of another dtype or device than the other parameters", p.name);
    offsets_.push_back(total_);
    total_ += p.value.numel();
  }
  const int64_t n = dp.size();
  chunk_ = (total_ + n - 1) / n;
  begin_ = std::min(total_, chunk_ * dp.rank());
  end_ = std::min(total_, begin_ + chunk_);
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = params[i];
    const int64_t lo = std::max(begin_, offsets_[i]), hi = std::min(end_, offsets_[i] + p.value.numel());
    if (lo >= hi) continue;
    ShardLayout shard{p.value.shape(), std::vector<int64_t>(p.value.shape().size(), 0), lo - offsets_[i], "dp"};
    owned_.push_back({p.name, p.value.view({-1}).narrow(0, lo - offsets_[i], hi - lo), {}, shard});
    owned_at_.push_back(lo - begin_);
    owned_param_.push_back(i);
  }
}

void ZeroShards::move(ExecContext& ctx, bool grads, Tensor& flat, int64_t begin, int64_t end, bool to_flat) {
  const size_t item = dtype_size(flat.dtype());
  for (size_t i = 0; i < params_->size(); ++i) {
    Parameter& p = (*params_)[i];
    const int64_t lo = std::max(begin, offsets_[i]), hi = std::min(end, offsets_[i] + p.value.numel());
    if (lo >= hi) continue;
    Tensor& t = grads ? p.grad : p.value;
    char* param_bytes = static_cast<char*>(t.data_ptr()) + size_t(lo - offsets_[i]) * item;
    char* flat_bytes = static_cast<char*>(flat.data_ptr()) + size_t(lo - begin) * item;
    ctx.backend.copy(to_flat ? flat_bytes : param_bytes, ctx.device, to_flat ? param_bytes : flat_bytes, ctx.device,
                     size_t(hi - lo) * item, ctx.stream);
  }
}

void ZeroShards::reduce_scatter_grads(ExecContext& ctx) {
  const DType dtype = (*params_)[0].value.dtype();
  for (Parameter& p : *params_)
    if (!p.grad.defined()) {  // no gradient reached it on this rank (an expert without tokens): zero
      p.grad = Tensor::empty(p.value.shape(), dtype, ctx.allocator);
      ctx.backend.fill_bytes(p.grad.data_ptr(), 0, p.grad.nbytes(), ctx.stream);
    }
  const int64_t n = dp_->size();
  Tensor flat = Tensor::empty({chunk_ * n}, dtype, ctx.allocator);
  ctx.backend.fill_bytes(flat.data_ptr(), 0, flat.nbytes(), ctx.stream);  // the padding past T
  move(ctx, true, flat, 0, total_, true);
  Tensor mine = Tensor::empty({chunk_}, dtype, ctx.allocator);
  dp_->reduce_scatter(flat, mine);
  for (size_t k = 0; k < owned_.size(); ++k) owned_[k].grad = mine.narrow(0, owned_at_[k], owned_[k].value.numel());
}

void ZeroShards::all_gather_values(ExecContext& ctx) {
  const DType dtype = (*params_)[0].value.dtype();
  const int64_t n = dp_->size();
  Tensor mine = Tensor::empty({chunk_}, dtype, ctx.allocator);
  if (end_ > begin_) move(ctx, false, mine, begin_, end_, true);
  Tensor flat = Tensor::empty({chunk_ * n}, dtype, ctx.allocator);
  dp_->all_gather(mine, flat);
  move(ctx, false, flat, 0, total_, false);
}

void ZeroShards::drop_grads() {
  for (Parameter& p : owned_) p.grad = Tensor();
}

nlohmann::json ZeroShards::layout() const { return {{"dp", dp_->size()}, {"elements", total_}, {"chunk", chunk_}}; }

void ZeroShards::reshard_state(const std::string& dir, const nlohmann::json& old_layout, const std::string& out_path) const {
  const int64_t old_dp = old_layout.value("dp", int64_t(0)), old_chunk = old_layout.value("chunk", int64_t(0));
  LATHE_CHECK(old_layout.value("elements", int64_t(-1)) == total_ && old_dp >= 1 && old_chunk * old_dp >= total_,
              "zero: {}'s optimizer shards ({}) are of another model than this one ({} elements)", dir, old_layout.dump(),
              total_);
  std::vector<io::SafetensorsFile> old;
  for (int64_t r = 0; r < old_dp; ++r)
    old.push_back(io::SafetensorsFile::open(
        (std::filesystem::path(dir) / fmt::format("optimizer.rank-{}-of-{}.safetensors", r, old_dp)).string()));
  std::vector<std::vector<float>> values;  // the new file's tensors, as f32 until written
  std::vector<io::TensorRef> refs;
  std::vector<std::vector<uint8_t>> bytes;
  values.reserve(owned_.size() * 3);
  bytes.reserve(owned_.size() * 3);
  for (size_t k = 0; k < owned_.size(); ++k) {
    const size_t i = owned_param_[k];
    const int64_t piece_begin = offsets_[i] + owned_[k].shard.flat_begin, n = owned_[k].value.numel();
    for (const char* suffix : {".master", ".exp_avg", ".exp_avg_sq"}) {
      const std::string name = owned_[k].name + suffix;
      std::vector<float> v(size_t(n), 0.0f);
      DType dtype = DType::F32;
      int64_t covered = 0;
      for (int64_t r = 0; r < old_dp; ++r) {  // old rank r holds [r C, (r + 1) C) of the flat space
        const int64_t lo = std::max(piece_begin, r * old_chunk), hi = std::min(piece_begin + n, (r + 1) * old_chunk);
        const io::SafetensorsTensor* t = lo < hi ? old[size_t(r)].find(name) : nullptr;
        if (!t) continue;
        dtype = t->dtype;
        const std::vector<float> part = old[size_t(r)].read_as_f32(name);
        const int64_t part_begin = std::max(r * old_chunk, offsets_[i]);  // the old piece's first flat element
        for (int64_t x = lo; x < hi; ++x) v[size_t(x - piece_begin)] = part[size_t(x - part_begin)];
        covered += hi - lo;
      }
      if (covered == 0 && std::string(suffix) == ".master") continue;  // parameters that are their own masters
      LATHE_CHECK(covered == n, "zero: {}: the old shards hold {} of {}'s {} elements", dir, covered, name, n);
      std::vector<uint8_t> b(size_t(n) * dtype_size(dtype));
      for (int64_t x = 0; x < n; ++x) store_from_double(b.data(), dtype, x, v[size_t(x)]);
      bytes.push_back(std::move(b));
      refs.push_back({name, dtype, {n}, bytes.back().data(), bytes.back().size()});
    }
  }
  io::write_safetensors(out_path, refs, old[0].metadata());
}

}  // namespace lathe
