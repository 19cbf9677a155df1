#include "parallel/zero.h"

#include <algorithm>

#include "core/error.h"

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

}  // namespace lathe
