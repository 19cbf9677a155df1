// ZeRO-1 over a data-parallel group: each rank keeps the optimizer state (f32 masters, AdamW moments) of 1/dp of the
// parameters. The parameters, in their order, form one flat space of T elements, padded to dp x C; rank r owns
// [r C, (r + 1) C). Each step the gradients are packed into that space and reduce-scattered (rank r receives the sum of
// its range), rank r's optimizer updates its pieces of the parameters in place, and the updated ranges are
// all-gathered back into every rank's parameters. The pieces are Parameters whose values are views into the whole
// parameters and whose ShardLayout names the whole tensor (so weight decay, checkpoints and export see the logical
// tensor). With the MPI backend's exact sums, a rank's gradient range is bitwise the slice of the plain all-reduce.
// Covered by tests/e2e/test_train_dp.cpp (ZeRO-1 against plain data parallelism).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/registry.h"
#include "comm/communicator.h"
#include "core/parameter.h"

namespace lathe {

class ZeroShards {
 public:
  // `params` must outlive this object; they are contiguous, on one device, of one dtype.
  ZeroShards(std::vector<Parameter>& params, Communicator& dp);

  std::vector<Parameter>& owned() { return owned_; }  // this rank's pieces: what its optimizer updates
  // Sums every rank's gradients; this rank's range lands in owned()'s gradients (views into a buffer of the step).
  void reduce_scatter_grads(ExecContext& ctx);
  // Every rank's updated range into every parameter's value.
  void all_gather_values(ExecContext& ctx);
  void drop_grads();  // the owned pieces' gradients, at the end of a step

  // {"dp", "elements", "chunk"}: how a checkpoint's optimizer shards are cut.
  nlohmann::json layout() const;

  // Resharding on load: the optimizer state of this rank's pieces, assembled from the shard files
  // (optimizer.rank-R-of-N.safetensors) that a ZeRO-1 checkpoint in `dir` wrote under `old_layout` (another dp size),
  // written to `out_path` in the format AdamW::load reads. Each piece's master and moments come from the old shards
  // whose ranges cover it; the step count and hyper-parameters are the old files'. The model must be the same
  // (the same element count).
  void reshard_state(const std::string& dir, const nlohmann::json& old_layout, const std::string& out_path) const;

 private:
  // Copies between the parameters (values or gradients) and `flat`, for the flat range [begin, end).
  void move(ExecContext& ctx, bool grads, Tensor& flat, int64_t begin, int64_t end, bool to_flat);

  std::vector<Parameter>* params_;
  Communicator* dp_;
  std::vector<int64_t> offsets_;  // each parameter's first element in the flat space
  int64_t total_ = 0, chunk_ = 0, begin_ = 0, end_ = 0;
  std::vector<Parameter> owned_;
  std::vector<int64_t> owned_at_;     // each owned piece's first element inside this rank's range
  std::vector<size_t> owned_param_;   // each owned piece's parameter
};

}  // namespace lathe
