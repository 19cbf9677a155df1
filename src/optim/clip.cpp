// Global gradient norm: one sum_squares_list op per gradient dtype (one launch on CUDA for a model's bf16 gradients),
// writing each gradient's total into one element of a preallocated device vector, then one read of that vector and
// its sum on the host in double, in a fixed order (dtype groups in order of first appearance, parameter order within
// each). No copy of any gradient is made (bf16 gradients are squared where they lie) and the result is deterministic:
// each op's order is fixed (ops/op_table.h) and so is the host sum. Covered by tests/unit/test_optim.cpp.
#include "optim/clip.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "ops/ops.h"

namespace lathe {

namespace {

// Queues the sums of squares into `totals` ((n) f32, or f64 when every gradient is f64); undefined when no parameter
// has a gradient.
Tensor launch_sums(ExecContext& ctx, const std::vector<const Parameter*>& params) {
  std::vector<Tensor> grads;
  bool all_f64 = true;
  for (const Parameter* p : params) {
    if (!p->grad.defined()) continue;
    LATHE_CHECK(is_floating(p->grad.dtype()), "optim: gradient of {} is {}, not floating point", p->name,
                p->grad.describe());
    LATHE_CHECK(p->grad.device() == ctx.device, "optim: gradient of {} is {}, the norm is taken on {}", p->name,
                p->grad.describe(), ctx.device.str());
    grads.push_back(p->grad.is_contiguous() ? p->grad : contiguous(ctx, p->grad));
    all_f64 = all_f64 && p->grad.dtype() == DType::F64;
  }
  if (grads.empty()) return Tensor();
  const DType acc = all_f64 ? DType::F64 : DType::F32;  // sum_squares gives f32 for every dtype but f64
  const int64_t n = int64_t(grads.size());
  Tensor totals = Tensor::empty({n}, acc, ctx.allocator);  // (n): sum(g^2) of each gradient
  std::vector<DType> order;  // gradient dtypes in order of first appearance
  for (const Tensor& g : grads)
    if (std::find(order.begin(), order.end(), g.dtype()) == order.end()) order.push_back(g.dtype());
  int64_t at = 0;
  for (DType dt : order) {
    std::vector<Tensor> group;
    for (const Tensor& g : grads)
      if (g.dtype() == dt) group.push_back(g);
    const Tensor slots = totals.narrow(0, at, int64_t(group.size()));
    if (dt == DType::F64 && acc != DType::F64) {  // f64 gradients among f32 ones: their f64 totals, narrowed
      const Tensor wide = Tensor::empty({int64_t(group.size())}, DType::F64, ctx.allocator);
      sum_squares_list_into(ctx, group, wide);
      copy_into(ctx, wide, slots);
    } else {
      sum_squares_list_into(ctx, group, slots);
    }
    at += int64_t(group.size());
  }
  return totals;
}

// The norm from the totals: read back at once (waiting for them) and added on the host in double, in order.
double norm_from(ExecContext& ctx, const Tensor& totals) {
  if (!totals.defined()) return 0.0;
  LATHE_CHECK(totals.device() == ctx.device, "optim: gradient totals on {}, the norm is read on {}",
              totals.device().str(), ctx.device.str());
  const bool f64 = totals.dtype() == DType::F64;
  const size_t n = size_t(totals.numel());
  std::vector<double> host(n);
  std::vector<float> host_f32(f64 ? 0 : n);
  ctx.backend.copy(f64 ? static_cast<void*>(host.data()) : static_cast<void*>(host_f32.data()), Device::cpu(),
                   totals.data_ptr(), ctx.device, totals.nbytes(), ctx.stream);
  ctx.stream.synchronize();
  if (!f64) std::copy(host_f32.begin(), host_f32.end(), host.begin());
  double total = 0;
  for (double t : host) total += t;
  return std::sqrt(total);
}

}  // namespace

double PendingGradNorm::read() {
  LATHE_CHECK(!read_, "optim: a pending gradient norm is read once");
  read_ = true;
  double squares = 0;
  for (size_t i = 0; i < totals_.size(); ++i) {
    const double n = norm_from(*ctx_, totals_[i]);
    squares += weights_.empty() ? n * n : weights_[i] * n * n;
  }
  return std::sqrt(squares);
}

PendingGradNorm launch_grad_norm(ExecContext& ctx, const std::vector<Parameter*>& params) {
  return PendingGradNorm(ctx, {launch_sums(ctx, std::vector<const Parameter*>(params.begin(), params.end()))});
}

PendingGradNorm launch_grad_norm(ExecContext& ctx, const std::vector<Parameter>& params, Communicator* tp,
                                 Communicator* ep, const Parameter* skip) {
  // Whole tensors; slices held by one rank each; slices held by `replicas` ranks each (counted once per set); experts.
  std::vector<const Parameter*> whole, experts;
  std::map<int, std::vector<const Parameter*>> sliced;  // by replicas
  for (const Parameter& p : params) {
    if (&p == skip) continue;
    if (tp && tp->size() > 1 && p.shard.group == "tp") sliced[p.shard.replicas].push_back(&p);
    else if (ep && ep->size() > 1 && p.shard.group == "ep") experts.push_back(&p);
    else whole.push_back(&p);
  }
  std::vector<Tensor> totals = {launch_sums(ctx, whole)};
  std::vector<double> weights = {1.0};
  if (!experts.empty()) {
    Tensor t = launch_sums(ctx, experts);
    if (t.defined()) ep->all_reduce(t).wait();  // every rank's experts
    totals.push_back(t);
    weights.push_back(1.0);
  }
  for (const auto& [replicas, group] : sliced) {
    Tensor t = launch_sums(ctx, group);
    if (t.defined()) tp->all_reduce(t).wait();  // every rank's slices
    totals.push_back(t);
    weights.push_back(1.0 / double(replicas));
  }
  return PendingGradNorm(ctx, std::move(totals), std::move(weights));
}

double global_grad_norm(ExecContext& ctx, const std::vector<Parameter*>& params) {
  return launch_grad_norm(ctx, params).read();
}

double global_grad_norm(ExecContext& ctx, const std::vector<Parameter>& params) {
  return launch_grad_norm(ctx, params).read();
}

double clip_factor(double grad_norm, double max_norm) {
  LATHE_CHECK(std::isfinite(grad_norm), "optim: clip_factor of a non-finite gradient norm ({})", grad_norm);
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (grad_norm + 1e-6));
}

}  // namespace lathe
