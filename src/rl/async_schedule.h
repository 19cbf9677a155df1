// rl.mode: async (docs/rl.md, "Asynchronous RL"): the order of the events between the training ranks and the rollout
// ranks, which both sides derive from the same numbers, so that no collective of one side can wait on a different one
// of the other.
//
// Versions count the rollouts whose updates the weights hold: version v is the weights after the updates of rollouts
// 0..v-1 (version 0: the start). With rl.max_staleness k, rollout n is sampled with version max(0, n - k): at k = 0
// every rollout is sampled by the weights that train on it (the colocated loop, on separate ranks); at k = 1 the
// rollout ranks sample rollout n + 1 while the trainer trains on rollout n.
// Two kinds of event, each a collective of both sides: the weights of a version go from the first training rank to
// the rollout ranks (kWeights), and a rollout's groups go from the rollout ranks to every training rank (kSamples).
// The rollout ranks walk the list in order, sampling a rollout just before its kSamples event. The trainer walks the
// same list: before it trains rollout m it takes every event up to rollout m's samples and the weights of version m
// (which it holds then: version m is its weights after rollout m - 1's updates), and before a checkpoint it takes the
// samples of every rollout that older weights than its own sample (so a checkpoint holds them, and a resumed run
// needs no weights but its own).
// Covered by tests/unit/test_async_schedule.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lathe {

struct AsyncEvent {
  enum class Kind { kWeights, kSamples };
  Kind kind = Kind::kSamples;
  int64_t index = 0;  // kWeights: the version sent; kSamples: the rollout
  bool operator==(const AsyncEvent&) const = default;
};

// The weights version rollout n is sampled with.
inline int64_t async_version(int64_t rollout, int64_t max_staleness) {
  return rollout > max_staleness ? rollout - max_staleness : 0;
}

// The events of a run from a start where the rollout ranks hold version `held` (sent to them at the start) and
// rollouts [first, total) are still to be sampled: for each such rollout n, the weights of version
// async_version(n, k) when the rollout ranks do not hold it yet, then rollout n's samples.
std::vector<AsyncEvent> async_events(int64_t held, int64_t first, int64_t total, int64_t max_staleness);

// The events the trainer takes before it trains rollout m (its weights are version m): from `next` (the first event
// not taken yet) through rollout m's samples and the weights of version m, where the list has them. The end index.
size_t async_events_before_training(const std::vector<AsyncEvent>& events, size_t next, int64_t m);

// The events the trainer takes before a checkpoint at version m: from `next` through the samples of every rollout
// sampled with a version below m (rollouts up to m + k - 1). Never a weights event (asserted). The end index.
size_t async_events_before_checkpoint(const std::vector<AsyncEvent>& events, size_t next, int64_t m,
                                      int64_t max_staleness);

std::string describe(const AsyncEvent& e);  // "weights v3", "samples of rollout 4"

}  // namespace lathe
