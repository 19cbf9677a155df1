// Pipeline parallelism's driver (docs/parallel.md, "Pipeline parallelism"): one step's micro-batches through this
// rank's stages of a CausalLm built with ModelOptions::pp, in the order of the schedule's lockstep timeline
// (model/pipeline_schedule.h). At each tick the rank runs its action — one stage's forward or backward of one
// micro-batch — then one grouped exchange with its neighbours: the residual stream's two terms forward (2, rows, H),
// its gradient back (rows, H); for models with mixture-of-experts layers also the routing totals forward (the aux loss
// is every layer's) and the aux loss's derivative back. Every rank of the pipeline passes the same micro-batches.
// Covered by tests/parallel/test_pipeline_parallel.cpp (MPI).
#pragma once

#include <vector>

#include "model/causal_lm.h"

namespace lathe {

// Forwards (and with `backward`, backwards: the gradients accumulate in the model's parameters, `loss_scale` times
// each micro-batch's loss) of `micro` through the pipeline. Returns each micro-batch's LossResult on the rank that
// holds the head (pp rank pp - 1), empty results elsewhere; broadcast_losses shares them over the pipeline.
std::vector<LossResult> run_pipeline(CausalLm& model, const std::vector<PackedBatch>& micro, bool backward,
                                     double loss_scale);

// Each batch's label log-probabilities (CausalLm::label_logprobs' layout: one a position, 0 where unlabelled),
// forward only, on every rank of the pipeline group.
std::vector<std::vector<double>> pipeline_label_logprobs(CausalLm& model, const std::vector<PackedBatch>& batches);

// The logits (documents, V) after each document's last token (CausalLm::last_logits: a decoding step, through the
// stages), on every rank of the pipeline group: the last stage's, broadcast in the model's dtype (as one process has
// them).
Tensor pipeline_last_logits(CausalLm& model, const PackedBatch& batch);

// `v` as the last rank of the pipeline holds it (n numbers; the others' are resized to n and overwritten), on every
// rank of the pipeline group, which all call it.
void from_last_stage(CausalLm& model, std::vector<double>& v, size_t n);

// The last rank's results (loss sums, labelled counts, segments, aux loss, expert loads) on every rank of the
// pipeline group, which all call it.
void broadcast_losses(CausalLm& model, std::vector<LossResult>& losses);

// The gradient of a tied embedding, which the first stage (the embedding) and the last (the LM head) each hold in
// part: both get the sum (first + last, in that order on both). Nothing when the head is untied or pp is 1.
void sum_tied_embedding_grads(CausalLm& model);

}  // namespace lathe
