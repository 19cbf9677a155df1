// rl.mode async's event order (rl/async_schedule.h), against lists written out by hand: which weights version each
// rollout is sampled with, where the weights go out, what the trainer takes before it trains a rollout and before a
// checkpoint, and the same after a resume.
#include <gtest/gtest.h>

#include "rl/async_schedule.h"

using namespace lathe;

namespace {

AsyncEvent W(int64_t v) { return {AsyncEvent::Kind::kWeights, v}; }
AsyncEvent S(int64_t n) { return {AsyncEvent::Kind::kSamples, n}; }

}  // namespace

TEST(AsyncSchedule, VersionsLagByTheStaleness) {
  EXPECT_EQ(async_version(0, 0), 0);
  EXPECT_EQ(async_version(3, 0), 3);
  EXPECT_EQ(async_version(0, 1), 0);
  EXPECT_EQ(async_version(1, 1), 0);
  EXPECT_EQ(async_version(2, 1), 1);
  EXPECT_EQ(async_version(1, 2), 0);
  EXPECT_EQ(async_version(5, 2), 3);
}

// k = 0: the colocated loop — the weights of version n before rollout n (version 0 is the start's).
TEST(AsyncSchedule, NoStalenessAlternatesWeightsAndSamples) {
  const std::vector<AsyncEvent> e = async_events(0, 0, 4, 0);
  EXPECT_EQ(e, (std::vector<AsyncEvent>{S(0), W(1), S(1), W(2), S(2), W(3), S(3)}));
  // Before training rollout m the trainer takes everything through S(m).
  EXPECT_EQ(async_events_before_training(e, 0, 0), 1u);
  EXPECT_EQ(async_events_before_training(e, 1, 1), 3u);
  EXPECT_EQ(async_events_before_training(e, 3, 2), 5u);
  // A checkpoint at version m needs no rollout sampled earlier: nothing taken.
  EXPECT_EQ(async_events_before_checkpoint(e, 1, 1, 0), 1u);
}

// k = 1: rollout n + 1 is sampled (with version n) while the trainer trains rollout n.
TEST(AsyncSchedule, OneStepStaleSamplesAheadOfTheTrainer) {
  const std::vector<AsyncEvent> e = async_events(0, 0, 5, 1);
  EXPECT_EQ(e, (std::vector<AsyncEvent>{S(0), S(1), W(1), S(2), W(2), S(3), W(3), S(4)}));
  EXPECT_EQ(async_events_before_training(e, 0, 0), 1u);  // S(0): rollout 1 is sampled meanwhile
  EXPECT_EQ(async_events_before_training(e, 1, 1), 3u);  // S(1), then W(1) (the weights after rollout 0's updates)
  EXPECT_EQ(async_events_before_training(e, 3, 2), 5u);  // S(2), W(2)
  EXPECT_EQ(async_events_before_training(e, 7, 4), 8u);  // S(4); no W(4): no rollout is sampled with it
  // A checkpoint at version 2 (rollouts 0 and 1 trained) keeps rollout 2, sampled with version 1: S(2) is taken.
  EXPECT_EQ(async_events_before_checkpoint(e, 3, 2, 1), 4u);
  // Resumed there (the trainer and the rollout ranks hold version 2, rollout 2 kept): rollout 3 needs no new
  // weights, rollout 4 version 3.
  EXPECT_EQ(async_events(2, 3, 5, 1), (std::vector<AsyncEvent>{S(3), W(3), S(4)}));
}

// k = 2: two rollouts ahead; a checkpoint keeps the two sampled with older weights.
TEST(AsyncSchedule, TwoStepsStale) {
  const std::vector<AsyncEvent> e = async_events(0, 0, 5, 2);
  EXPECT_EQ(e, (std::vector<AsyncEvent>{S(0), S(1), S(2), W(1), S(3), W(2), S(4)}));
  EXPECT_EQ(async_events_before_training(e, 0, 0), 1u);
  EXPECT_EQ(async_events_before_training(e, 1, 1), 4u);  // S(1), S(2), W(1)
  EXPECT_EQ(async_events_before_checkpoint(e, 4, 2, 2), 5u);  // rollout 3 (version 1) taken before a checkpoint at 2
  EXPECT_EQ(async_events(2, 4, 5, 2), (std::vector<AsyncEvent>{S(4)}));  // rollout 4 is version 2's
  EXPECT_EQ(describe(W(3)), "weights v3");
  EXPECT_EQ(describe(S(4)), "samples of rollout 4");
}
