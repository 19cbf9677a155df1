#include "parallel/grad_reducer.h"

#include <algorithm>

#include "core/error.h"
#include "ops/ops.h"

namespace lathe {

std::vector<GradBucket> plan_buckets(const std::vector<Parameter*>& params, const std::vector<int64_t>& complete_after,
                                     int64_t bucket_bytes) {
  LATHE_CHECK(complete_after.size() == params.size() && bucket_bytes > 0, "grad buckets: {} stages for {} parameters",
              complete_after.size(), params.size());
  std::vector<int64_t> offsets(params.size() + 1, 0);
  for (size_t i = 0; i < params.size(); ++i) offsets[i + 1] = offsets[i] + params[i]->value.numel();
  std::vector<GradBucket> out;
  size_t end = params.size();
  while (end > 0) {  // from the last parameter backwards
    GradBucket b;
    b.end = end;
    b.first = end;
    b.dtype = params[end - 1]->value.dtype();
    b.complete_after = complete_after[end - 1];
    int64_t bytes = 0;
    while (b.first > 0 && params[b.first - 1]->value.dtype() == b.dtype && (bytes == 0 || bytes < bucket_bytes)) {
      --b.first;
      bytes += int64_t(params[b.first]->value.nbytes());
      b.complete_after = std::min(b.complete_after, complete_after[b.first]);
    }
    b.begin = offsets[b.first];
    b.elements = offsets[b.end] - b.begin;
    out.push_back(b);
    end = b.first;
  }
  std::reverse(out.begin(), out.end());  // in the flat space's order
  return out;
}

GradReducer::GradReducer(std::vector<Parameter*> params, std::vector<GradBucket> buckets, Communicator& comm,
                         const ExecContext& compute, Stream& side, Mode mode)
    : params_(std::move(params)), buckets_(std::move(buckets)), comm_(&comm), compute_(compute), side_(&side), mode_(mode),
      launched_(buckets_.size(), false), sums_(buckets_.size()) {
  backward_end_ = compute_.backend.create_event(compute_.device.index);
  joined_ = compute_.backend.create_event(compute_.device.index);
  for (size_t b = 0; b < buckets_.size(); ++b) {  // recorded again each time the bucket is reduced
    written_.push_back(compute_.backend.create_event(compute_.device.index));
    done_.push_back(compute_.backend.create_event(compute_.device.index));
  }
}

GradReducer::~GradReducer() { side_->synchronize(); }

void GradReducer::begin_micro_batch(bool reduce) {
  reducing_ = reduce;
  std::fill(launched_.begin(), launched_.end(), false);
}

void GradReducer::grads_done(int64_t layers_left) {
  if (!reducing_) return;
  for (size_t b = buckets_.size(); b-- > 0;)  // the same order on every rank
    if (!launched_[b] && layers_left <= buckets_[b].complete_after) launch(b);
}

void GradReducer::end_micro_batch() {
  if (!reducing_) return;
  backward_end_->record(compute_.stream);
  for (size_t b = buckets_.size(); b-- > 0;)
    if (!launched_[b]) launch(b);
  while (!in_flight_.empty()) retire_oldest();
  joined_->record(compute_.stream);
  reducing_ = false;
}

// The bucket's gradients packed into a buffer and summed over the group, on the side stream, after the backward's
// writes to them.
void GradReducer::launch(size_t b) {
  const GradBucket& g = buckets_[b];
  launched_[b] = true;
  const int dp = comm_->size();
  InFlight f;
  f.bucket = b;
  const int64_t padded = mode_ == Mode::ReduceScatter ? g.chunk(dp) * dp : g.elements;
  f.buffer = Tensor::empty({padded}, g.dtype, compute_.allocator);  // allocated in the default stream's order
  if (mode_ == Mode::ReduceScatter) f.out = Tensor::empty({g.chunk(dp)}, g.dtype, compute_.allocator);
  written_[b]->record(compute_.stream);
  written_[b]->wait(*side_);
  const size_t item = dtype_size(g.dtype);
  char* at = static_cast<char*>(f.buffer.data_ptr());
  for (size_t i = g.first; i < g.end; ++i) {
    Parameter& p = *params_[i];
    const size_t bytes = size_t(p.value.numel()) * item;
    if (p.grad.defined()) {
      LATHE_ASSERT(p.grad.is_contiguous() && p.grad.dtype() == g.dtype);
      compute_.backend.copy(at, compute_.device, p.grad.data_ptr(), compute_.device, bytes, *side_);
    } else {  // no gradient reached it on this rank (an expert without tokens): zero
      compute_.backend.fill_bytes(at, 0, bytes, *side_);
    }
    at += bytes;
  }
  if (padded > g.elements)
    compute_.backend.fill_bytes(at, 0, size_t(padded - g.elements) * item, *side_);
  works_.push_back(mode_ == Mode::ReduceScatter ? comm_->reduce_scatter(f.buffer, f.out) : comm_->all_reduce(f.buffer));
  if (mode_ == Mode::AllReduceInPlace) {
    at = static_cast<char*>(f.buffer.data_ptr());
    for (size_t i = g.first; i < g.end; ++i) {
      Parameter& p = *params_[i];
      const size_t bytes = size_t(p.value.numel()) * item;
      LATHE_CHECK(p.grad.defined(), "grad buckets: {} has no gradient tensor to sum into", p.name);
      compute_.backend.copy(p.grad.data_ptr(), compute_.device, at, compute_.device, bytes, *side_);
      at += bytes;
    }
  }
  done_[b]->record(*side_);
  in_flight_.push_back(std::move(f));
  if (in_flight_.size() > 2) retire_oldest();
}

// The default stream waits for the oldest bucket's sum; only then are the tensors the side stream used released.
void GradReducer::retire_oldest() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.erase(in_flight_.begin());
  done_[f.bucket]->wait(compute_.stream);
  const GradBucket& g = buckets_[f.bucket];
  int64_t at = 0;
  for (size_t i = g.first; i < g.end; ++i) {
    Parameter& p = *params_[i];
    const int64_t n = p.value.numel();
    if (mode_ == Mode::AllReduce) p.grad = f.buffer.narrow(0, at, n).view(p.value.shape());
    else if (mode_ == Mode::ReduceScatter) p.grad = Tensor();
    at += n;
  }
  if (mode_ == Mode::ReduceScatter) {
    Tensor& sum = sums_[f.bucket];
    sum = sum.defined() ? add(compute_, sum, f.out) : f.out;  // ZeRO-2: over the step's micro-batches
  }
}

double GradReducer::wait() {
  for (CommWork& w : works_) w.wait();
  works_.clear();
  joined_->synchronize();
  return joined_->elapsed_ms_since(*backward_end_);
}

void GradReducer::clear() {
  for (Tensor& s : sums_) s = Tensor();
}

}  // namespace lathe
