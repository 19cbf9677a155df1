// The LM head component (see lm_head.h). Shapes: N rows, H hidden, V the whole vocabulary, Vl = V / tp a rank's.
#include "model/lm_head.h"

#include <cmath>

#include "backend/runtime.h"
#include "comm/communicator.h"
#include "ops/ops.h"

namespace lathe {

LmHead::LmHead(Runtime& rt, const Tensor& w, Communicator* tp, int64_t first)
    : rt_(&rt), w_(w), tp_(tp && tp->size() > 1 && first >= 0 ? tp : nullptr), first_(tp_ ? first : 0) {}

Tensor LmHead::logits(ExecContext& cx, const Tensor& x) const {
  Tensor out = empty_padded_rows(x.size(0), w_.size(0), x.dtype(), cx.allocator);  // (N, Vl)
  matmul_into(cx, x, w_, out, {false, true});
  return out;
}

Tensor LmHead::whole_logits(ExecContext& cx, const Tensor& x) const {
  if (!tp_) return linear(cx, x, w_);
  const int n = tp_->size();
  const Tensor mine = linear(cx, x, w_);  // (N, Vl)
  const int64_t rows = mine.size(0), cols = mine.size(1);
  Tensor all = Tensor::empty({int64_t(n) * rows * cols}, mine.dtype(), cx.allocator);  // the pieces in rank order
  tp_->all_gather(mine.view({rows * cols}), all);
  Tensor whole = Tensor::empty({rows, int64_t(n) * cols}, mine.dtype(), cx.allocator);  // rank r: columns [r Vl, ...)
  for (int r = 0; r < n; ++r)
    copy_into(cx, all.narrow(0, r * rows * cols, rows * cols).view({rows, cols}), whole.narrow(1, r * cols, cols));
  return whole;
}

Tensor LmHead::whole_lse(ExecContext& cx, const Tensor& local_lse) const {
  const int n = tp_->size();
  const int64_t rows = local_lse.size(0);
  Tensor all = Tensor::empty({int64_t(n) * rows}, local_lse.dtype(), cx.allocator);
  tp_->all_gather(local_lse, all);
  // Row i's ranks' log-sum-exps side by side (N, tp): their log-sum-exp is the whole row's (the same bits on every
  // rank: every rank combines the same gathered values in the same order).
  return row_argmax_logsumexp(cx, all.view({n, rows}).transpose(0, 1))[2];
}

std::vector<Tensor> LmHead::cross_entropy(ExecContext& cx, const Tensor& logits, const Tensor& labels,
                                          CrossEntropyAttrs attrs) const {
  if (!tp_) return lathe::cross_entropy(cx, logits, labels, attrs);
  const Tensor lse = whole_lse(cx, row_argmax_logsumexp(cx, logits)[2]);
  attrs.first = first_;
  std::vector<Tensor> out = cross_entropy_slice(cx, logits, labels, lse, attrs);
  tp_->all_reduce(out[0]);  // each row's loss from the rank holding its label (0 from the others)
  return out;
}

std::vector<double> LmHead::entropy(ExecContext& cx, const Tensor& logits) const {
  // lse - E[x], E[x] = sum_j softmax_j x_j; sliced, each rank's columns give E_local x exp(lse_local - lse).
  const std::vector<Tensor> stats = row_argmax_logsumexp(cx, logits);
  const Tensor local_mean = sum(cx, mul(cx, softmax(cx, logits), logits), {1});
  const Tensor lse = tp_ ? whole_lse(cx, stats[2]) : stats[2];
  const Tensor h_lse = rt_->copy_to(cast(cx, lse, DType::F64), Device::cpu());
  const Tensor h_mean = rt_->copy_to(cast(cx, local_mean, DType::F64), Device::cpu());
  const int64_t rows = logits.size(0);
  std::vector<double> mean(h_mean.data<double>(), h_mean.data<double>() + rows);
  if (tp_) {
    const Tensor h_local = rt_->copy_to(cast(cx, stats[2], DType::F64), Device::cpu());
    for (int64_t i = 0; i < rows; ++i)
      mean[size_t(i)] *= std::exp(h_local.data<double>()[i] - h_lse.data<double>()[i]);
    Tensor part = rt_->from_host(mean.data(), {rows}, DType::F64, logits.device());
    tp_->all_reduce(part).wait();
    const Tensor h_part = rt_->copy_to(part, Device::cpu());
    mean.assign(h_part.data<double>(), h_part.data<double>() + rows);
  }
  std::vector<double> out(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) out[size_t(i)] = h_lse.data<double>()[i] - mean[size_t(i)];
  return out;
}

void LmHead::sum_input_grad(Tensor& dx) const {
  if (tp_) tp_->all_reduce(dx);
}

}  // namespace lathe
