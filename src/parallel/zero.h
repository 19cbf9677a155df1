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
  // Every rank's updated ranges into every parameter's value, one all-gather per bucket.
  void all_gather_values(ExecContext& ctx);
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
  std::vector<Parameter>* params_;
  std::vector<GradBucket> buckets_;
  Communicator* dp_;
  std::vector<int64_t> offsets_;  // each parameter's first element in the flat space
  int64_t total_ = 0;
  std::vector<Parameter> owned_;
  std::vector<Piece> pieces_;  // per owned piece
};

}  // namespace lathe
