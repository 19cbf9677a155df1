// Global gradient norm from existing ops (cast, mul, sum, add) and one host read; the clipping factor.
// Per tensor, squares are summed over the last dim first and then over the rows, so a large gradient is reduced by
// many blocks instead of one on the GPU. Covered by tests/unit/test_optim.cpp.
#include "optim/clip.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"

namespace lathe {

namespace {

// sum(g^2) as a 0-d tensor of dtype `acc`.
Tensor squared_sum(ExecContext& ctx, const Tensor& grad, DType acc) {
  Tensor g = grad.dtype() == acc ? contiguous(ctx, grad) : cast(ctx, grad, acc);
  if (g.dim() >= 2) g = g.view({-1, g.size(-1)});
  Tensor sq = mul(ctx, g, g);
  if (sq.dim() == 2) sq = sum(ctx, sq, {1});
  return sum(ctx, sq);
}

double norm_of(ExecContext& ctx, const std::vector<const Parameter*>& params) {
  bool all_f64 = true, any = false;
  for (const Parameter* p : params) {
    if (!p->grad.defined()) continue;
    LATHE_CHECK(is_floating(p->grad.dtype()), "optim: gradient of {} is {}, not floating point", p->name,
                p->grad.describe());
    any = true;
    all_f64 = all_f64 && p->grad.dtype() == DType::F64;
  }
  if (!any) return 0.0;
  const DType acc = all_f64 ? DType::F64 : DType::F32;
  Tensor total;  // 0-d, dtype acc
  for (const Parameter* p : params) {
    if (!p->grad.defined()) continue;
    const Tensor s = squared_sum(ctx, p->grad, acc);
    total = total.defined() ? add(ctx, total, s) : s;
  }
  double d = 0;
  float f = 0;
  ctx.backend.copy(all_f64 ? static_cast<void*>(&d) : static_cast<void*>(&f), Device::cpu(), total.data_ptr(),
                   ctx.device, dtype_size(acc), ctx.stream);
  ctx.stream.synchronize();
  return std::sqrt(all_f64 ? d : double(f));
}

}  // namespace

double global_grad_norm(ExecContext& ctx, const std::vector<Parameter*>& params) {
  return norm_of(ctx, std::vector<const Parameter*>(params.begin(), params.end()));
}

double global_grad_norm(ExecContext& ctx, const std::vector<Parameter>& params) {
  std::vector<const Parameter*> ptrs;
  for (const Parameter& p : params) ptrs.push_back(&p);
  return norm_of(ctx, ptrs);
}

double clip_factor(double grad_norm, double max_norm) {
  LATHE_CHECK(std::isfinite(grad_norm), "optim: clip_factor of a non-finite gradient norm ({})", grad_norm);
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (grad_norm + 1e-6));
}

}  // namespace lathe
