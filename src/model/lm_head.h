// The LM head as a component: the logits of rows of the final norm's output and their cross-entropy against labels,
// over a whole head or a vocab-parallel slice of one (tensor parallelism, docs/parallel.md). CausalLm's loss head
// (head_loss, head_row_loss, head_label_logprobs) goes through it; the RL losses are to reuse it.
// Convention: under tp a chunk's logits are this rank's columns only, and cross_entropy combines each row's
// log-sum-exp and its label's logit over the group, so the training loss and the label log-probs never hold a whole
// row of logits on any rank; only whole_logits gathers whole rows (decoding's few rows, evaluation, tests).
// Covered by tests/parallel/test_vocab_parallel.cpp (sliced against whole) and every loss test through CausalLm.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "ops/op_table.h"

namespace lathe {

class Communicator;
class Runtime;
struct ExecContext;

class LmHead {
 public:
  // `w` (V_local, H): rows [first, first + V_local) of the whole head (V = V_local x the group's size); `tp` the group
  // (nullptr, or first < 0: the whole head, no communication).
  LmHead(Runtime& rt, const Tensor& w, Communicator* tp, int64_t first);

  bool sliced() const { return tp_ != nullptr; }
  const Tensor& weight() const { return w_; }
  // This rank's logits of rows x (N, H): (N, V_local), rows padded to 64 elements so that the GEMMs and the
  // cross-entropy read and write whole 16-byte packs whatever the vocabulary's size.
  Tensor logits(ExecContext& cx, const Tensor& x) const;
  // The whole rows' logits (N, V): x W^T, under tp the ranks' pieces gathered (a collective: every rank calls it).
  Tensor whole_logits(ExecContext& cx, const Tensor& x) const;
  // The cross-entropy of a chunk of logits(): {loss (N), dlogits (N, V_local) with attrs.with_grad}, labels being
  // whole-vocabulary ids (or attrs.ignore_index). Sliced (a collective), each row's log-sum-exp is combined from every
  // rank's (one all-gather of N values) and its loss is the label owner's lse - x[label] (one all-reduce of N values):
  // every rank gets the whole rows' losses and its own columns of their gradient, as the whole head gives.
  std::vector<Tensor> cross_entropy(ExecContext& cx, const Tensor& logits, const Tensor& labels,
                                    CrossEntropyAttrs attrs) const;
  // The entropy of each row's distribution (N), from a chunk of logits() (a collective when sliced): lse - E[x].
  std::vector<double> entropy(ExecContext& cx, const Tensor& logits) const;
  // The input gradient dx = dlogits W summed in place over the group: each rank's part comes from its columns only.
  void sum_input_grad(Tensor& dx) const;

 private:
  Runtime* rt_;
  Tensor w_;               // (V_local, H)
  Communicator* tp_;       // null: the whole head
  int64_t first_ = 0;      // the whole-vocabulary id of w_'s row 0
  // Each row's log-sum-exp over the whole vocabulary (N), in the logits' statistics dtype.
  Tensor whole_lse(ExecContext& cx, const Tensor& local_lse) const;
};

}  // namespace lathe
