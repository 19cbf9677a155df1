// ZeRO over a data-parallel group: each rank keeps the optimizer state (f32 masters, AdamW moments) of 1/dp of the
// parameters. The parameters, in their order, form one flat space cut into the gradient buckets of GradReducer
// (parallel/grad_reducer.h); each bucket is padded to dp x C_b and rank r owns [r C_b, (r + 1) C_b) of it, so a
// bucket's reduce-scatter hands each rank the sum of what it owns. The owned pieces are Parameters whose values are
// views into the whole parameters and whose ShardLayout names the whole tensor (so weight decay, checkpoints and
// export see the logical tensor); their gradients are views into the reducer's sums. After the update each bucket's
// ranges are all-gathered back into every rank's parameters. With the MPI backend's exact sums a rank's gradient
// range is bitwise the slice of the plain all-reduce.
// Covered by tests/e2e/test_train_dp.cpp (ZeRO-1 and ZeRO-2 against plain data parallelism, resharding on load).
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
// another dp size, other buckets, with ZeRO from a whole state, or whole from ZeRO shards.
void assemble_optimizer_state(const std::string& dir, const nlohmann::json& layout, const std::vector<StatePiece>& pieces,
                              int64_t elements, const std::string& out_path);

class ZeroShards {
 public:
  // `params` must outlive this object; they are contiguous, on one device, of one dtype; `buckets` cover them.
  ZeroShards(std::vector<Parameter>& params, std::vector<GradBucket> buckets, Communicator& dp);

  std::vector<Parameter>& owned() { return owned_; }  // this rank's pieces: what its optimizer updates
  // The owned pieces' gradients: views into `sums` (GradReducer::sums(), ReduceScatter mode).
  void take_grads(const std::vector<Tensor>& sums);
  // Each owned piece's bucket (non-decreasing): AdamW::prepare's segments, so that its update reports each bucket.
  std::vector<size_t> owned_buckets() const;

  // After the update, every rank's updated ranges into every parameter's value: one all-gather per bucket, in bucket
  // order on every rank, on `comm` (the dp group's second communicator, ProcessGroups::dp_grads, whose work runs on
  // `side`). begin_gather sets up a step's gathers; gather_through(b), called as the update of bucket b is queued,
  // launches the gathers of buckets up to b not launched yet, each after an event that follows the compute stream's
  // work so far, so that a bucket's all-gather runs while the next buckets' update does. finish_gather launches the
  // rest, makes the compute stream wait for them all, and waits on the host for them (each bounded by the group's
  // timeout, so a stalled rank is reported by its collective); it returns the device time (ms) from the end of the
  // update to the end of the last gather: the part of the all-gathers the update did not hide. The memory a gather
  // uses is released only after the compute stream has waited for it (the rule of parallel/grad_reducer.h); at most
  // two gathers are in flight.
  void begin_gather(const ExecContext& compute, Communicator& comm, Stream& side);
  void gather_through(size_t bucket);
  double finish_gather();
  void drop_grads();  // the owned pieces' gradients, at the end of a step

  // {"dp", "elements", "buckets": [each bucket's elements]}: how a checkpoint's optimizer shards are cut.
  nlohmann::json layout() const;

  // Resharding on load: the optimizer state of this rank's pieces, assembled (assemble_optimizer_state) from a
  // checkpoint in `dir` saved under `old_layout` (another dp size, other buckets, or null: the whole state).
  void reshard_state(const std::string& dir, const nlohmann::json& old_layout, const std::string& out_path) const;

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
  std::vector<Parameter>* params_;
  std::vector<GradBucket> buckets_;
  Communicator* dp_;
  std::vector<int64_t> offsets_;  // each parameter's first element in the flat space
  int64_t total_ = 0;
  std::vector<Parameter> owned_;
  std::vector<Piece> pieces_;  // per owned piece
  // The step's gathers (begin_gather .. finish_gather).
  std::optional<ExecContext> compute_;
  Communicator* gather_comm_ = nullptr;
  Stream* side_ = nullptr;
  size_t next_gather_ = 0;
  std::vector<Gathering> gathering_;
  std::vector<CommWork> works_;
  std::unique_ptr<Event> updated_, gathered_;
  std::vector<std::unique_ptr<Event>> written_, done_;  // per bucket, recorded again each step
};

}  // namespace lathe
