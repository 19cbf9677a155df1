// ZeRO over a data-parallel group: each rank keeps the optimizer state (f32 masters, AdamW moments) of 1/dp of the
// parameters. The parameters, in their order, form one flat space cut into the gradient buckets of GradReducer
// (parallel/grad_reducer.h); each bucket is padded to dp x C_b and rank r owns [r C_b, (r + 1) C_b) of it, so a
// bucket's reduce-scatter hands each rank the sum of what it owns. The owned pieces are Parameters whose values are
// views into the whole parameters and whose ShardLayout names the whole tensor (so weight decay, checkpoints and
// export see the logical tensor); their gradients are views into the reducer's sums. After the update each bucket's
// ranges are all-gathered back into every rank's parameters. With the MPI backend's exact sums a rank's gradient
// range is bitwise the slice of the plain all-reduce. Under tensor parallelism the parameters are the rank's tp slices
// and the group is the dp (x cp) ranks of its tp slot, which hold the same slices: a piece of a slice keeps the slice's
// layout (global shape, offset, sections, group "tp", replicas) with its flat_begin inside the slice, so the gradient
// norm sums it over the tp group and a shared k/v slice's piece is summed over its replicas; a whole tensor's piece
// has the group "dp". Every tp rank's slices have the same shapes, so each cuts its flat space alike. Under pipeline
// parallelism the parameters are the stage's; under expert parallelism the rank's experts are a second group
// (ZeroGroup), cut over the edp ranks that hold the same experts, and the dense parameters the first, over dp x cp.
// Covered by tests/e2e/test_train_dp.cpp (ZeRO-1 and ZeRO-2 against plain data parallelism, resharding on load;
// TensorParallel.ZeroCutsEachSliceOverItsReplicas, PipelineParallel.ZeroCutsEachStageOverItsDataParallelRanks,
// ExpertParallel.ZeroCutsTheDenseStateOverDpAndTheExpertsOverTheirHolders).
#pragma once

#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/registry.h"
#include "comm/communicator.h"
#include "core/parameter.h"
#include "parallel/grad_reducer.h"

namespace lathe {

// A piece of optimizer state to assemble: elements [begin, begin + elements) of the flat space, inside the parameter
// `name` of shape `shape` that spans [param_begin, param_end) of it.
struct StatePiece {
  std::string name;
  Shape shape;  // the tensor AdamW::load expects: the whole parameter's shape, or {elements} for a ZeRO piece
  int64_t param_begin = 0, param_end = 0, begin = 0, elements = 0;
  ShardLayout shard;  // the piece's place, as the optimizer that loads it holds it (whole: empty)
};

// The optimizer state (masters and moments) of `pieces`, assembled from the optimizer files of the checkpoint in `dir`
// and written to `out_path` in the format AdamW::load reads: each piece from the old files whose ranges cover it; the
// step count and hyper-parameters are the old files'. `layout`: the checkpoint's ZeRO layout ({"dp", "elements",
// "buckets"}: files optimizer.rank-R-of-N.safetensors, rank r holding its chunk of each bucket) or null (the whole
// state in optimizer.safetensors). `elements`: the model's, checked against the layout's. So a run can resume at
// another dp size, other buckets, with ZeRO from a whole state, or whole from ZeRO shards. `slice`: the files of one
// tensor-parallel slot ("tp-R-of-T": zero_state_name), or "" for a model whole on every rank.
void assemble_optimizer_state(const std::string& dir, const nlohmann::json& layout, const std::vector<StatePiece>& pieces,
                              int64_t elements, const std::string& out_path, const std::string& slice = "");

// Every parameter of `params` as a piece of a state of whole tensors, in order: `global`, each the whole tensor (the
// flat space of one process holding every tensor); else as this rank holds it (its tp slice, its layout kept, in the
// flat space of the rank's tensors).
std::vector<StatePiece> whole_state_pieces(const std::vector<Parameter>& params, bool global);

// The whole state of each slot of a checkpoint's slicing group (tp slots or pipeline stages) that kept its optimizer
// state in ZeRO shards: slot t's files (zero_state_name of `kind`-t-of-N) re-assembled into
// slice_state_name(kind, t, N) in `out_dir` from `slots[t]` (its layout with "tensors": ZeroShards::tensors), each
// tensor with its slice's place (the old files' "shard.<name>", the ZeRO piece's flat_begin dropped). Returns the
// files, which reslice_tp_state reads as a checkpoint of those slices without ZeRO.
std::vector<std::string> assemble_slot_states(const std::string& dir, const nlohmann::json& slots,
                                              const std::string& kind, const std::string& out_dir);

// The optimizer file of ZeRO rank `rank` of `ranks` ("optimizer.rank-R-of-N.safetensors"), under tp of one tp slot
// (`slice` "tp-R-of-T": "optimizer.tp-R-of-T.rank-R-of-N.safetensors"); ranks 0: the slot's whole state
// ("optimizer.safetensors", "optimizer.tp-R-of-T.safetensors").
std::string zero_state_name(const std::string& slice, int rank, int ranks);

// Parameters that ZeRO cuts over the ranks that hold them, `ranks` (the dp x cp ranks of a tp or pp slot; under ep,
// for the experts, the edp ranks), with their gradient buckets (GradReducer's, over `params`) and the communicator of
// their all-gathers (the same ranks on the gradient stream: ProcessGroups::weight_sums, edp_grads).
struct ZeroGroup {
  std::vector<Parameter*> params;
  std::vector<GradBucket> buckets;
  Communicator* ranks = nullptr;
  Communicator* gathers = nullptr;
};

class ZeroShards {
 public:
  // The groups' parameters, one group after the other, form the flat space (a group's buckets placed after the groups'
  // before it); each bucket is cut over its group's ranks. The parameters must outlive this object; they are
  // contiguous, on one device, of one dtype; each group's buckets cover its parameters.
  explicit ZeroShards(std::vector<ZeroGroup> groups);

  std::vector<Parameter>& owned() { return owned_; }  // this rank's pieces: what its optimizer updates
  // The owned pieces' gradients: views into `sums` (the groups' GradReducer::sums(), ReduceScatter mode, one group's
  // after the other's).
  void take_grads(const std::vector<Tensor>& sums);
  // Each owned piece's bucket (non-decreasing): AdamW::prepare's segments, so that its update reports each bucket.
  std::vector<size_t> owned_buckets() const;

  // After the update, every rank's updated ranges into every parameter's value: one all-gather per bucket, in bucket
  // order on every rank, on its group's `gathers` (whose work runs on `side`). begin_gather sets up a step's gathers;
  // gather_through(b), called as the update of bucket b is queued,
  // launches the gathers of buckets up to b not launched yet, each after an event that follows the compute stream's
  // work so far, so that a bucket's all-gather runs while the next buckets' update does. finish_gather launches the
  // rest, makes the compute stream wait for them all, and waits on the host for them (each bounded by the group's
  // timeout, so a stalled rank is reported by its collective); it returns the device time (ms) from the end of the
  // update to the end of the last gather: the part of the all-gathers the update did not hide. The memory a gather
  // uses is released only after the compute stream has waited for it (the rule of parallel/grad_reducer.h); at most
  // two gathers are in flight.
  void begin_gather(const ExecContext& compute, Stream& side);
  void gather_through(size_t bucket);
  double finish_gather();
  void drop_grads();  // the owned pieces' gradients, at the end of a step

  // {"dp", "elements", "buckets": [each bucket's elements]} of the first group (and "experts": the same of the second,
  // under ep): how a checkpoint's optimizer shards are cut.
  nlohmann::json layout() const;
  // The first group's parameters in the flat space's order, each [name, shape as this rank holds it]: what a re-cut of
  // the shards for other slices needs to put each slot's whole tensors back together (assemble_slot_states).
  nlohmann::json tensors() const;

  // Resharding on load: the optimizer state of this rank's pieces, assembled (assemble_optimizer_state) from a
  // checkpoint in `dir` saved under `old_layout` (another dp size, other buckets, or null: the whole state), from the
  // files of `slice` (assemble_optimizer_state).
  void reshard_state(const std::string& dir, const nlohmann::json& old_layout, const std::string& out_path,
                     const std::string& slice = "") const;

 private:
  struct Piece {
    size_t bucket = 0, param = 0;
    int64_t begin = 0;  // the piece's first element in the flat space
  };
  struct Gathering {
    size_t bucket = 0;
    Tensor mine, all;  // this rank's range of the bucket and every rank's
  };
  void launch_gather(size_t b);
  void retire_oldest_gather();
  nlohmann::json group_layout(size_t group) const;
  std::vector<Parameter*> params_;  // every group's, in order
  std::vector<GradBucket> buckets_;  // every group's, placed in the one flat space
  std::vector<size_t> group_of_;     // per bucket
  std::vector<Communicator*> ranks_, gathers_;  // per group
  std::vector<int64_t> offsets_;  // each parameter's first element in the flat space
  int64_t total_ = 0;
  size_t first_group_params_ = 0;
  std::vector<Parameter> owned_;
  std::vector<Piece> pieces_;  // per owned piece
  // The step's gathers (begin_gather .. finish_gather).
  std::optional<ExecContext> compute_;
  Stream* side_ = nullptr;
  size_t next_gather_ = 0;
  std::vector<Gathering> gathering_;
  std::vector<CommWork> works_;
  std::unique_ptr<Event> updated_, gathered_;
  std::vector<std::unique_ptr<Event>> written_, done_;  // per bucket, recorded again each step
};

}  // namespace lathe
