// Pipeline parallelism's arithmetic (docs/parallel.md, "Pipeline parallelism"): which layers each stage holds, the
// order in which a rank runs its forwards and backwards of a step's micro-batches (1F1B, or the interleaved 1F1B with
// virtual stages), and the lockstep timeline every rank derives from those orders: at each tick a rank runs at most one
// action, then exchanges the activations and gradients that tick produced with its neighbours, all in one grouped p2p
// call. Every rank computes the same timeline, so each send has its receive posted in the same tick's exchange on the
// peer: no deadlock on MPI or NCCL, whatever the message sizes.
// Virtual stage v = chunk x pp + rank (Megatron's interleaving): rank r holds chunks r, r + pp, ...; virtual stage 0
// holds the embedding (rank 0), the last one the final norm and the LM head (rank pp - 1).
// Pure arithmetic, no communication. Covered by tests/parallel/test_pipeline.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lathe {

class PipelineLayout {
 public:
  PipelineLayout() = default;  // no pipeline: one stage, every layer
  // `num_layers` over pp x vpp virtual stages: `counts` (one a virtual stage, each at least 1, summing to num_layers),
  // or empty for as even as possible (the first stages one layer more: 3 layers on 2 stages is 2 + 1). Refuses
  // (lathe::Error) a split that cannot be made, naming why.
  PipelineLayout(int64_t num_layers, int pp, int vpp, std::vector<int64_t> counts = {});

  int pp() const { return pp_; }
  int vpp() const { return vpp_; }
  int stages() const { return pp_ * vpp_; }
  int rank_of(int stage) const { return stage % pp_; }
  int chunk_of(int stage) const { return stage / pp_; }
  int stage(int rank, int chunk) const { return chunk * pp_ + rank; }
  int64_t first_layer(int stage) const { return starts_[size_t(stage)]; }
  int64_t end_layer(int stage) const { return starts_[size_t(stage)] + layers_[size_t(stage)]; }
  const std::vector<int64_t>& counts() const { return layers_; }
  int stage_of_layer(int64_t layer) const;
  bool rank_holds_layer(int rank, int64_t layer) const { return rank_of(stage_of_layer(layer)) == rank; }
  bool holds_embedding(int rank) const { return rank == 0; }
  bool holds_head(int rank) const { return rank == pp_ - 1; }
  std::string describe() const;  // "pp 2 x vpp 1: layers 0-1 | 2"

 private:
  int pp_ = 1, vpp_ = 1;
  std::vector<int64_t> layers_, starts_;
};

// The split of layers whose costs (any unit, one a layer) are `layer_costs` into pp x vpp stages of consecutive
// layers, at least one each, whose most costly stage costs as little as can be (ties: the earlier stages the larger);
// for stacks whose layers differ (Gated DeltaNet and full attention, dense and sparse MLPs).
PipelineLayout balanced_pipeline_layout(const std::vector<double>& layer_costs, int pp, int vpp);

enum class PipeOp { Forward, Backward };

struct PipeAction {
  PipeOp op;
  int chunk;  // the rank's chunk (virtual stage chunk x pp + rank)
  int micro;  // the step's micro-batch
};

// Rank `rank`'s actions for `micro_batches` micro-batches in the order it runs them: with vpp 1 Megatron's 1F1B (pp -
// rank - 1 warm-up forwards, then one forward and one backward in turn, then the remaining backwards); with vpp > 1 the
// interleaved schedule (forwards in groups of pp micro-batches, chunk by chunk; warm-up (pp - rank - 1) x 2 + (vpp - 1)
// x pp). Refuses a micro-batch count the interleaved schedule cannot take (not a multiple of pp). `forward_only`
// (evaluation, log-probabilities): the forwards alone, each as early as its input can arrive (any count).
std::vector<PipeAction> pipeline_order(const PipelineLayout& layout, int rank, int64_t micro_batches,
                                       bool forward_only = false);

// What crosses between two ranks after a tick: micro-batch `micro`'s activations into virtual stage `stage`
// (op Forward, from stage - 1), or its gradient into `stage` (op Backward, from stage + 1).
struct PipeMessage {
  PipeOp op;
  int stage;
  int micro;
  int from, to;  // ranks
};

struct PipeTick {
  std::vector<int> action;             // per rank: the index into its pipeline_order, or -1 (idle)
  std::vector<PipeMessage> messages;   // produced by this tick's actions, received in this tick's exchange
};

struct PipelineTimeline {
  std::vector<std::vector<PipeAction>> orders;  // per rank
  std::vector<PipeTick> ticks;
  // The share of rank-ticks idle: (ticks x pp - actions) / (ticks x pp), counting a forward and a backward as one tick
  // each (a backward costs about two forwards, so the time's bubble is smaller; bench/ measures it).
  double idle_fraction() const;
};

// Every rank's timeline: at each tick a rank runs its next action once its input was produced at an earlier tick.
PipelineTimeline pipeline_timeline(const PipelineLayout& layout, int64_t micro_batches, bool forward_only = false);

}  // namespace lathe
