// Gradients summed over a data-parallel group in buckets, while the backward still runs.
//
// The parameters (in their order) form one flat space; plan_buckets cuts it into buckets of whole parameters of one
// dtype, about `bucket_bytes` each, cut from the last parameter backwards because the backward completes the last
// layers first. A bucket is complete once the backward has reported (BackwardHooks::grads_done) the smallest
// `layers_left` of its parameters (CausalLm::grads_complete_after).
//
// GradReducer, during a micro-batch that reduces (the step's last; every one under ZeRO-2): at each report of the
// backward, every bucket that became complete is packed into a buffer and summed over the group on the group's own
// stream (ProcessGroups::grad_stream), after an event that orders it behind the backward's writes:
//   - AllReduce (plain data parallelism): the bucket's parameters' gradients become views into the summed buffer;
//   - AllReduceInPlace: the sums are copied back into the gradients' own tensors (LoRA's, which are views into the
//     adapter bank's storage and must stay so);
//   - ReduceScatter (ZeRO): rank r keeps the sum of its chunk of each bucket (the bucket padded to dp x chunk; rank r
//     owns [r chunk, (r + 1) chunk) of it), accumulated over the step's reducing micro-batches; the parameters' whole
//     gradients are dropped.
// Memory reuse across streams: the caching allocator and the memory plan hand a freed block to the next allocation in
// the host's order, which is safe for work on one stream only. So every tensor the side stream touches (a bucket's
// buffer, its result, the gradients it reads) is released only after the default stream has waited for the event that
// follows the side stream's last use (retire()); from then on the default stream's order covers the side stream's
// work, and the block may be reused. At most two buckets are in flight before the oldest is retired, so a ZeRO-2
// micro-batch frees its gradients as it goes.
// With the MPI backend (CPU) everything runs in order and the sums are exact, so the buckets change nothing numerically.
// Covered by tests/unit/test_grad_buckets.cpp (the plan) and tests/e2e/test_train_dp.cpp (runs against one process).
#pragma once

#include <memory>
#include <vector>

#include "backend/registry.h"
#include "comm/communicator.h"
#include "core/parameter.h"

namespace lathe {

struct GradBucket {
  size_t first = 0, end = 0;        // the parameters [first, end)
  int64_t begin = 0, elements = 0;  // the first element in the flat space, and the element count
  int64_t complete_after = -1;      // complete once the backward reports layers_left <= this
  DType dtype = DType::F32;
  int64_t chunk(int dp) const { return (elements + dp - 1) / dp; }  // each rank's share of the padded bucket
};

// `complete_after`: per parameter (CausalLm::grads_complete_after, or -1 for all: complete at the end).
std::vector<GradBucket> plan_buckets(const std::vector<Parameter*>& params, const std::vector<int64_t>& complete_after,
                                     int64_t bucket_bytes);

class GradReducer {
 public:
  enum class Mode { AllReduce, AllReduceInPlace, ReduceScatter };
  // `comm`'s operations run on `side` (ProcessGroups::dp_grads on grad_stream); `compute` is the backward's.
  GradReducer(std::vector<Parameter*> params, std::vector<GradBucket> buckets, Communicator& comm,
              const ExecContext& compute, Stream& side, Mode mode);
  ~GradReducer();  // waits for the side stream
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // A micro-batch begins: whether its backward reduces the gradients.
  void begin_micro_batch(bool reduce);
  // BackwardHooks::grads_done: launches every bucket that is now complete.
  void grads_done(int64_t layers_left);
  // The micro-batch's backward is queued: what is left is launched, and the default stream waits for all of it.
  void end_micro_batch();
  // The host waits for the step's collectives (each bounded by the group's timeout: a stalled rank is reported by
  // its collective); returns the device time (ms) from the end of the last reducing backward until the sums were in
  // place: the communication the backward did not hide.
  double wait();
  // ReduceScatter: bucket b's summed chunk (chunk(dp) elements); dropped by clear().
  const std::vector<Tensor>& sums() const { return sums_; }
  void clear();  // the end of a step

  const std::vector<GradBucket>& buckets() const { return buckets_; }

 private:
  struct InFlight {
    size_t bucket = 0;
    Tensor buffer, out;
  };
  void launch(size_t b);
  void retire_oldest();

  std::vector<Parameter*> params_;
  std::vector<GradBucket> buckets_;
  Communicator* comm_;
  ExecContext compute_;
  Stream* side_;
  Mode mode_;
  bool reducing_ = false;
  std::vector<bool> launched_;
  std::vector<InFlight> in_flight_;
  std::vector<CommWork> works_;
  std::vector<Tensor> sums_;
  std::unique_ptr<Event> backward_end_, joined_;
  // Per bucket: after the backward's writes to its gradients (the side stream waits), after its sum (the default
  // stream waits). A bucket is retired before it is launched again, so one pair serves every micro-batch.
  std::vector<std::unique_ptr<Event>> written_, done_;
};

}  // namespace lathe
