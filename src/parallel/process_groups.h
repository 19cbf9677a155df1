// The process groups one rank takes part in, made from the ParallelGrid: each kind's communicator is split from the
// world eagerly, in the same order on every rank (a communicator made lazily can stall a job outside any timeout;
// research note parallelism.md §1): data-, tensor-, context-, expert- and pipeline-parallel groups. A single process
// is a world of one with no communicators. Covered by tests/e2e/test_train_dp.cpp.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "parallel/grid.h"

namespace lathe {

struct ProcessGroups {
  ParallelGrid grid;
  int rank = 0;
  std::unique_ptr<Communicator> world, dp;
  // The dp group again, ordered on its own stream: the gradients' buckets are reduced there while the backward still
  // runs on the device's default stream (parallel/grad_reducer.h). Declared before its communicator, which it outlives.
  std::unique_ptr<Stream> grad_stream;
  std::unique_ptr<Communicator> dp_grads;
  std::unique_ptr<Communicator> tp;  // tensor parallelism: the ranks sharing one model replica's layers (tp > 1)
  std::unique_ptr<Communicator> cp;  // context parallelism: the ranks sharing one replica's batches by rows (cp > 1)
  // Context parallelism: the dp x cp ranks of one tp slot (Megatron's dp_cp group), which hold the same weights and
  // whose gradients sum (a cp rank's are its rows' parts), and the same group ordered on grad_stream (cp > 1).
  std::unique_ptr<Communicator> dp_cp, dp_cp_grads;
  // Expert parallelism (ep > 1): the ranks that split one copy of the experts (each its own batches), and the ranks
  // that hold the same experts (their gradients sum over it; ZeRO cuts their state over it), and edp again ordered on
  // grad_stream (ZeRO's reduce-scatter and all-gather of the experts).
  std::unique_ptr<Communicator> ep, edp, edp_grads;
  std::unique_ptr<Communicator> pp;  // pipeline parallelism: the stages of one replica, in stage order (pp > 1)
  // The tp x ep x pp ranks of one replica (above one rank), which hold different slices of the weights (tp slices,
  // experts, stages), each saving its own optimizer state.
  std::unique_ptr<Communicator> slices;

  int dp_rank() const { return dp ? dp->rank() : 0; }
  int tp_rank() const { return tp ? tp->rank() : 0; }
  int tp_size() const { return tp ? tp->size() : 1; }
  int cp_rank() const { return cp ? cp->rank() : 0; }
  int dp_size() const { return dp ? dp->size() : 1; }
  int ep_size() const { return ep ? ep->size() : 1; }
  int pp_rank() const { return pp ? pp->rank() : 0; }
  int pp_size() const { return pp ? pp->size() : 1; }
  int edp_rank() const { return edp ? edp->rank() : 0; }
  bool is_first() const { return rank == 0; }  // the rank that prints and writes the run's files
  // The ranks that hold the same weights: the gradients are summed over them and ZeRO cuts the optimizer state over
  // them (dp_cp under cp, else dp); weight_sums() is the same group on grad_stream.
  Communicator& weight_replicas() const { return dp_cp ? *dp_cp : *dp; }
  Communicator& weight_sums() const { return dp_cp_grads ? *dp_cp_grads : *dp_grads; }
};

// Over `world` (nullptr: a single process). `grad_stream`: a stream of this rank's device for dp_grads.
std::unique_ptr<ProcessGroups> make_process_groups(std::unique_ptr<Communicator> world, const ParallelSizes& sizes,
                                                   std::unique_ptr<Stream> grad_stream);

}  // namespace lathe
