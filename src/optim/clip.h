// Global-norm gradient clipping: the L2 norm of all gradients taken together, and torch's clipping factor. The
// factor is not applied to the gradients here: the trainer passes it to AdamW::step as part of grad_scale, so
// clipping costs no extra pass over the gradients. Covered by tests/unit/test_optim.cpp.
#pragma once

#include <utility>
#include <vector>

#include "backend/registry.h"
#include "comm/communicator.h"
#include "core/parameter.h"

namespace lathe {

// sqrt(sum over parameters of sum(g^2)) for every parameter with a gradient (0 when none has one). The gradients'
// sums of squares are one sum_squares_list op per gradient dtype on the context's device (where the gradients must
// be), accumulated in f32 (f64 when every gradient is f64) with no copy of a contiguous gradient; the per-gradient
// totals are read back at once and added on the host in double. NaN or Inf when a gradient holds one or its own sum
// of squares overflows: the caller must treat that as a bad step (skip it), never clip with it.
double global_grad_norm(ExecContext& ctx, const std::vector<Parameter*>& params);
double global_grad_norm(ExecContext& ctx, const std::vector<Parameter>& params);

// The same norm in two halves: launch_grad_norm queues the sums of squares and returns at once; read() waits for them
// and returns the norm (once). A trainer prepares its optimizer update in between (AdamW::prepare), so the host work
// overlaps the device's. global_grad_norm is launch_grad_norm(...).read().
class PendingGradNorm {
 public:
  double read();

  // Wraps queued totals (each (n) sum(g^2) of n gradients, f32 or f64; undefined: no gradient) on `ctx`'s stream,
  // each counted with its weight (empty: 1 each); `ctx` must outlive it.
  PendingGradNorm(ExecContext& ctx, std::vector<Tensor> totals, std::vector<double> weights = {})
      : ctx_(&ctx), totals_(std::move(totals)), weights_(std::move(weights)) {}

 private:
  ExecContext* ctx_;
  std::vector<Tensor> totals_;
  std::vector<double> weights_;
  bool read_ = false;
};
PendingGradNorm launch_grad_norm(ExecContext& ctx, const std::vector<Parameter*>& params);
// Tensor parallelism (`tp` a group of more than one rank): the totals of the gradients of slices split over the group
// (ShardLayout group "tp") are summed over it before the norm, a slice that `replicas` ranks hold counted once; every
// other gradient, whole on each rank, counts once.
// `ep`: the expert-parallel group, whose ranks each hold their experts ("ep" slices: their squares summed over it).
// `skip`: a parameter left out (pipeline parallelism: a tied embedding's copy on the last stage; the first counts it).
PendingGradNorm launch_grad_norm(ExecContext& ctx, const std::vector<Parameter>& params, Communicator* tp = nullptr,
                                 Communicator* ep = nullptr, const Parameter* skip = nullptr);

// The factor torch.nn.utils.clip_grad_norm_ scales gradients by: min(1, max_norm / (grad_norm + 1e-6)).
// 1 when max_norm <= 0 (clipping off). grad_norm must be finite.
double clip_factor(double grad_norm, double max_norm);

}  // namespace lathe
