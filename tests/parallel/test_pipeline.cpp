// src/model/pipeline_schedule.h: stage layouts (even by default, 3 layers on 2 stages is 2 + 1; explicit counts;
// refusals naming the constraint), the 1F1B and interleaved orders, and the lockstep timeline. The timeline is checked
// by replaying it independently (every action's input arrived in an earlier tick's message from the right rank, every
// micro-batch's forward and backward run once on every stage), against 1F1B's memory bound (rank r never holds more
// than pp - r micro-batches' activations) and against the bubble fractions published for the two schedules (Narayanan
// et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", section 2.2): (p - 1) / (m + p - 1) for
// 1F1B and (p - 1) / (v m + p - 1) interleaved, with a forward and a backward costing one tick each.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "core/error.h"
#include "model/pipeline_schedule.h"
#include "support/error_of.h"

using namespace lathe;
using lathe::test_support::error_of;

TEST(PipelineLayout, EvenSplitGivesTheFirstStagesTheExtraLayers) {
  EXPECT_EQ(PipelineLayout(3, 2, 1).counts(), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(PipelineLayout(10, 4, 1).counts(), (std::vector<int64_t>{3, 3, 2, 2}));
  const PipelineLayout l(8, 2, 2);  // interleaved: rank 0 holds stages 0 and 2
  EXPECT_EQ(l.counts(), (std::vector<int64_t>{2, 2, 2, 2}));
  for (int64_t layer : {0, 1, 4, 5}) EXPECT_TRUE(l.rank_holds_layer(0, layer)) << layer;
  for (int64_t layer : {2, 3, 6, 7}) EXPECT_TRUE(l.rank_holds_layer(1, layer)) << layer;
  EXPECT_EQ(l.stage_of_layer(5), 2);
  EXPECT_EQ(l.first_layer(3), 6);
  EXPECT_EQ(l.end_layer(3), 8);
  EXPECT_EQ(l.describe(), "pp 2 x vpp 2: layers 0-1 | 2-3 | 4-5 | 6-7");
}

TEST(PipelineLayout, ExplicitCountsAndRefusals) {
  EXPECT_EQ(PipelineLayout(5, 2, 1, {1, 4}).first_layer(1), 1);
  EXPECT_NE(error_of([] { PipelineLayout(3, 2, 2); }).find("3 layers cannot be split into 4 pipeline stages"),
            std::string::npos);
  EXPECT_NE(error_of([] { PipelineLayout(5, 2, 1, {5}); }).find("1 layer counts for 2 pipeline stages"),
            std::string::npos);
  EXPECT_NE(error_of([] { PipelineLayout(5, 2, 1, {2, 2}); }).find("add up to 4 layers; the model has 5"),
            std::string::npos);
  EXPECT_NE(error_of([] { PipelineLayout(5, 2, 1, {0, 5}); }).find("stage 0 has 0 layers"), std::string::npos);
  EXPECT_NE(error_of([] { PipelineLayout(5, 1, 2); }).find("need pipeline parallelism"), std::string::npos);
  EXPECT_NE(error_of([] { pipeline_order(PipelineLayout(8, 2, 2), 0, 3); }).find("not a multiple of it"),
            std::string::npos);
}

// The least largest stage: found by trying every split (small enough to enumerate), against the layout's.
TEST(PipelineLayout, BalancedByCostMinimisesTheLargestStage) {
  const std::vector<std::vector<double>> stacks = {
      {3, 1, 1, 3, 1, 1, 3, 1},  // a hybrid: one full-attention layer in every three, costlier
      {1, 1, 1, 1, 1, 1},        // equal layers: as even as possible
      {5, 1, 1, 1, 1, 1, 1, 1}};
  for (const std::vector<double>& costs : stacks) {
    const int64_t n = int64_t(costs.size());
    double brute = 1e300;  // two stages x two virtual: three cuts among n - 1 places
    for (int64_t a = 1; a < n; ++a)
      for (int64_t b = a + 1; b < n; ++b)
        for (int64_t c = b + 1; c < n; ++c) {
          double sums[4] = {0, 0, 0, 0};
          for (int64_t i = 0; i < n; ++i) sums[(i >= a) + (i >= b) + (i >= c)] += costs[size_t(i)];
          brute = std::min(brute, *std::max_element(sums, sums + 4));
        }
    const PipelineLayout l = balanced_pipeline_layout(costs, 2, 2);
    double largest = 0;
    for (int st = 0; st < l.stages(); ++st) {
      double sum = 0;
      for (int64_t i = l.first_layer(st); i < l.end_layer(st); ++i) sum += costs[size_t(i)];
      largest = std::max(largest, sum);
    }
    EXPECT_DOUBLE_EQ(largest, brute);
  }
  EXPECT_EQ(balanced_pipeline_layout({1, 1, 1}, 2, 1).counts(), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(balanced_pipeline_layout({4, 1, 1, 1, 1}, 2, 1).counts(), (std::vector<int64_t>{1, 4}));
}

TEST(PipelineOrder, OneForwardOneBackwardAfterTheWarmUp) {
  const PipelineLayout l(8, 4, 1);
  const std::vector<PipeAction> o = pipeline_order(l, 1, 6);  // warm-up pp - 1 - 1 = 2 forwards
  ASSERT_EQ(o.size(), 12u);
  const std::vector<std::pair<PipeOp, int>> want = {
      {PipeOp::Forward, 0}, {PipeOp::Forward, 1}, {PipeOp::Forward, 2}, {PipeOp::Backward, 0},
      {PipeOp::Forward, 3}, {PipeOp::Backward, 1}, {PipeOp::Forward, 4}, {PipeOp::Backward, 2},
      {PipeOp::Forward, 5}, {PipeOp::Backward, 3}, {PipeOp::Backward, 4}, {PipeOp::Backward, 5}};
  for (size_t i = 0; i < o.size(); ++i) {
    EXPECT_EQ(o[i].op, want[i].first) << i;
    EXPECT_EQ(o[i].micro, want[i].second) << i;
  }
}

namespace {

// Replays `tl` with its own bookkeeping: returns the largest number of micro-batches whose activations a rank holds
// at once (forwards run whose backward has not), per rank.
std::vector<int> replay(const PipelineLayout& l, int64_t m, const PipelineTimeline& tl, bool forward_only = false) {
  const int pp = l.pp();
  std::set<std::tuple<int, int, int>> arrived;  // (op, stage, micro) delivered to the stage's rank
  std::set<std::tuple<int, int, int>> done;     // (op, stage, micro) run
  std::vector<int> holding(size_t(pp), 0), most(size_t(pp), 0);
  std::vector<size_t> next(size_t(pp), 0);
  for (const PipeTick& t : tl.ticks) {
    for (int r = 0; r < pp; ++r) {
      if (t.action[size_t(r)] < 0) continue;
      EXPECT_EQ(size_t(t.action[size_t(r)]), next[size_t(r)]++) << "rank " << r << " out of order";
      const PipeAction a = tl.orders[size_t(r)][size_t(t.action[size_t(r)])];
      const int v = l.stage(r, a.chunk);
      if (a.op == PipeOp::Forward) {
        if (v > 0) EXPECT_TRUE(arrived.count({0, v, a.micro})) << "stage " << v << " micro " << a.micro;
        most[size_t(r)] = std::max(most[size_t(r)], ++holding[size_t(r)]);
      } else {
        EXPECT_TRUE(done.count({0, v, a.micro}));
        if (v + 1 < l.stages()) EXPECT_TRUE(arrived.count({1, v, a.micro})) << "stage " << v << " micro " << a.micro;
        --holding[size_t(r)];
      }
      EXPECT_TRUE(done.insert({int(a.op), v, a.micro}).second);
    }
    for (const PipeMessage& msg : t.messages) {  // delivered after the tick: usable from the next one
      EXPECT_EQ(msg.to, l.rank_of(msg.stage));
      EXPECT_EQ(msg.from, l.rank_of(msg.op == PipeOp::Forward ? msg.stage - 1 : msg.stage + 1));
      arrived.insert({int(msg.op), msg.stage, msg.micro});
    }
  }
  EXPECT_EQ(done.size(), size_t((forward_only ? 1 : 2) * l.stages() * m));
  return most;
}

}  // namespace

TEST(PipelineTimeline, OneF1BRunsEveryActionOnceWithinItsMemoryBoundAndBubble) {
  for (int pp : {1, 2, 3, 4})
    for (int64_t m : {1, 2, 4, 7, 8}) {
      const PipelineLayout l(8, pp, 1);
      const PipelineTimeline tl = pipeline_timeline(l, m);
      const std::vector<int> most = replay(l, m, tl);
      for (int r = 0; r < pp; ++r) EXPECT_LE(most[size_t(r)], pp - r) << "pp " << pp << " m " << m << " rank " << r;
      if (m >= pp) EXPECT_DOUBLE_EQ(tl.idle_fraction(), double(pp - 1) / double(m + pp - 1)) << pp << " " << m;
    }
}

TEST(PipelineTimeline, InterleavedRunsEveryActionOnceAndShrinksTheBubble) {
  for (int pp : {2, 4})
    for (int vpp : {2, 3})
      for (int64_t m : {int64_t(pp), int64_t(2 * pp), int64_t(3 * pp)}) {
        const PipelineLayout l(int64_t(pp * vpp * 2), pp, vpp);
        const PipelineTimeline tl = pipeline_timeline(l, m);
        replay(l, m, tl);
        EXPECT_DOUBLE_EQ(tl.idle_fraction(), double(pp - 1) / double(vpp * m + pp - 1))
            << "pp " << pp << " vpp " << vpp << " m " << m;
      }
}

TEST(PipelineTimeline, ForwardOnlyTakesAnyMicroBatchCount) {
  for (int vpp : {1, 2}) {
    const PipelineLayout l(8, 4, vpp);
    const PipelineTimeline tl = pipeline_timeline(l, 3, true);
    replay(l, 3, tl, true);
    EXPECT_EQ(tl.ticks.size(), size_t(3 + 4 * vpp - 1)) << vpp;  // micro-batch m reaches stage v at tick m + v
  }
}
