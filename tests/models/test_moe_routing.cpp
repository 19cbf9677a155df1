// MoE routing reference (src/model/moe_routing.h): softmax / top-k / renormalisation and the routing plan on a case
// worked out by hand, the split by expert owner, load statistics, transformers' load-balancing loss by its formula
// (E sum_e f_e P_e, load_balancing_loss_func), both backwards against central finite differences, and bad input.
// The finite differences run in double with h = 1e-5: truncation and rounding stay below 1e-9.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/error.h"
#include "model/moe_routing.h"

using namespace lathe;

namespace {

// Token 0: exp(logits) = 1, 2, 3, 1 (probs 1/7, 2/7, 3/7, 1/7); token 1: all equal (a tie, broken by index).
const std::vector<double> kLogits = {0.0, std::log(2.0), std::log(3.0), 0.0, 0.0, 0.0, 0.0, 0.0};

std::vector<double> random_logits(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, 1.5);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST(MoeRouting, SoftmaxTopKAndRenormalisationByHand) {
  for (bool norm : {false, true}) {
    const RouterChoice r = route_tokens(kLogits, 2, 4, 2, norm);
    EXPECT_NEAR(r.probs[0], 1.0 / 7, 1e-7);
    EXPECT_NEAR(r.probs[2], 3.0 / 7, 1e-7);
    EXPECT_NEAR(r.probs[5], 0.25, 1e-7);
    EXPECT_EQ(r.expert, (std::vector<int32_t>{2, 1, 0, 1}));
    const std::vector<double> want = norm ? std::vector<double>{0.6, 0.4, 0.5, 0.5}
                                          : std::vector<double>{3.0 / 7, 2.0 / 7, 0.25, 0.25};
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(r.weight[i], want[i], 1e-7) << "weight " << i;
  }
}

TEST(MoeRouting, PlanSortsPairsByExpertAndSplitsByOwner) {
  const RoutingPlan plan = plan_routing(route_tokens(kLogits, 2, 4, 2, true));
  // Pairs (token, slot) -> expert: (0,0) -> 2, (0,1) -> 1, (1,0) -> 0, (1,1) -> 1; expert 3 gets nothing.
  EXPECT_EQ(plan.counts, (std::vector<int64_t>{1, 2, 1, 0}));
  EXPECT_EQ(plan.offsets, (std::vector<int64_t>{0, 1, 3, 4, 4}));
  EXPECT_EQ(plan.token, (std::vector<int32_t>{1, 0, 1, 0}));
  EXPECT_EQ(plan.slot, (std::vector<int32_t>{0, 1, 1, 0}));
  EXPECT_EQ(plan.position, (std::vector<int64_t>{3, 1, 0, 2}));
  const RoutingPlan owner = plan_for_owner(plan, 1, 2);  // experts 1 and 2
  EXPECT_EQ(owner.counts, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(owner.offsets, (std::vector<int64_t>{0, 2, 3}));
  EXPECT_EQ(owner.token, (std::vector<int32_t>{0, 1, 0}));
  EXPECT_EQ(owner.slot, (std::vector<int32_t>{1, 1, 0}));
  EXPECT_EQ(owner.position, (std::vector<int64_t>{1, 2, 3}));
  const RoutingPlan none = plan_for_owner(plan, 3, 1);  // an owner whose expert receives no token
  EXPECT_EQ(none.counts, (std::vector<int64_t>{0}));
  EXPECT_TRUE(none.token.empty());
  const ExpertLoad load = expert_load(plan);
  EXPECT_EQ(load.tokens_per_expert, (std::vector<int64_t>{1, 2, 1, 0}));
  EXPECT_DOUBLE_EQ(load.max_over_mean, 2.0);  // 4 pairs over 4 experts: mean 1, max 2
}

TEST(MoeRouting, PlanIsAPermutationOfEveryPair) {
  const int64_t t = 37, e = 8, k = 3;
  const RouterChoice r = route_tokens(random_logits(t * e, 1), t, e, k, true);
  const RoutingPlan plan = plan_routing(r);
  std::vector<int> seen(size_t(t * k), 0);
  for (int64_t i = 0; i < t * k; ++i) {
    const int64_t pair = int64_t(plan.token[size_t(i)]) * k + plan.slot[size_t(i)];
    ++seen[size_t(pair)];
    EXPECT_EQ(plan.position[size_t(pair)], i);
    const int32_t expert = r.expert[size_t(pair)];
    EXPECT_GE(i, plan.offsets[size_t(expert)]);
    EXPECT_LT(i, plan.offsets[size_t(expert) + 1]);
  }
  for (int s : seen) EXPECT_EQ(s, 1);
}

TEST(MoeRouting, LoadBalancingLossByItsFormula) {
  // One layer, the hand case: N = 2 rows, f = routed / N = (1/2, 1, 1/2, 0), P = mean probs over the two tokens.
  const RouterChoice r = route_tokens(kLogits, 2, 4, 2, true);
  const double p0 = (1.0 / 7 + 0.25) / 2, p1 = (2.0 / 7 + 0.25) / 2, p2 = (3.0 / 7 + 0.25) / 2;
  const double want = 4 * (0.5 * p0 + 1.0 * p1 + 0.5 * p2);
  EXPECT_NEAR(load_balancing_loss({&r}), want, 1e-7);
  // Two layers are one concatenation of rows: the same as one layer holding both blocks.
  const std::vector<double> a = random_logits(5 * 6, 2), b = random_logits(3 * 6, 3);
  std::vector<double> ab = a;
  ab.insert(ab.end(), b.begin(), b.end());
  const RouterChoice ra = route_tokens(a, 5, 6, 2, true), rb = route_tokens(b, 3, 6, 2, true);
  const RouterChoice rab = route_tokens(ab, 8, 6, 2, true);
  EXPECT_NEAR(load_balancing_loss({&ra, &rb}), load_balancing_loss({&rab}), 1e-7);
}

TEST(MoeRouting, BackwardsMatchFiniteDifferences) {
  const int64_t t = 6, e = 5, k = 2;
  const std::vector<double> logits = random_logits(t * e, 4), dw = random_logits(t * k, 5);
  const double h = 1e-5;
  for (bool norm : {false, true}) {
    const RouterChoice r = route_tokens(logits, t, e, k, norm);
    const std::vector<double> d = route_tokens_backward(r, dw, norm);
    double worst = 0;
    for (int64_t i = 0; i < t * e; ++i) {
      std::vector<double> plus = logits, minus = logits;
      plus[size_t(i)] += h;
      minus[size_t(i)] -= h;
      const RouterChoice rp = route_tokens(plus, t, e, k, norm), rm = route_tokens(minus, t, e, k, norm);
      ASSERT_EQ(rp.expert, r.expert) << "the step changed the top-k choice; pick other logits";
      ASSERT_EQ(rm.expert, r.expert);
      double jp = 0, jm = 0;
      for (int64_t j = 0; j < t * k; ++j) jp += double(dw[size_t(j)]) * rp.weight[size_t(j)];
      for (int64_t j = 0; j < t * k; ++j) jm += double(dw[size_t(j)]) * rm.weight[size_t(j)];
      worst = std::max(worst, std::abs((jp - jm) / (2 * h) - double(d[size_t(i)])));
    }
    std::printf("route_tokens_backward (norm %d): worst |fd - analytic| %.2e\n", int(norm), worst);
    EXPECT_LT(worst, 1e-8);  // a wrong term is >= 1e-2
  }
  const std::vector<double> a = random_logits(4 * e, 6), b = random_logits(3 * e, 7);
  const RouterChoice ra = route_tokens(a, 4, e, k, true), rb = route_tokens(b, 3, e, k, true);
  std::vector<std::vector<double>> grads;
  load_balancing_loss({&ra, &rb}, &grads);
  ASSERT_EQ(grads.size(), 2u);
  double worst = 0;
  for (int64_t i = 0; i < 4 * e; ++i) {  // perturb the first layer's logits
    std::vector<double> plus = a, minus = a;
    plus[size_t(i)] += h;
    minus[size_t(i)] -= h;
    const RouterChoice rp = route_tokens(plus, 4, e, k, true), rm = route_tokens(minus, 4, e, k, true);
    ASSERT_EQ(rp.expert, ra.expert);
    ASSERT_EQ(rm.expert, ra.expert);
    const double fd = (load_balancing_loss({&rp, &rb}) - load_balancing_loss({&rm, &rb})) / (2 * h);
    worst = std::max(worst, std::abs(fd - double(grads[0][size_t(i)])));
  }
  std::printf("load_balancing_loss gradient: worst |fd - analytic| %.2e\n", worst);
  EXPECT_LT(worst, 1e-8);
}

TEST(MoeRouting, BadInputIsAClearError) {
  EXPECT_THROW(route_tokens(kLogits, 2, 4, 5, true), Error);                 // k > experts
  EXPECT_THROW(route_tokens(kLogits, 3, 4, 2, true), Error);                 // size mismatch
  std::vector<double> nan = kLogits;
  nan[3] = std::nanf("");
  EXPECT_THROW(route_tokens(nan, 2, 4, 2, true), Error);
  const RoutingPlan plan = plan_routing(route_tokens(kLogits, 2, 4, 2, true));
  EXPECT_THROW(plan_for_owner(plan, 3, 2), Error);  // experts 3..4 of 4
  const RouterChoice r4 = route_tokens(kLogits, 2, 4, 2, true);
  const RouterChoice r2 = route_tokens(std::vector<double>{0, 1, 1, 0}, 2, 2, 1, true);
  EXPECT_THROW(load_balancing_loss({&r4, &r2}), Error);  // layers with different expert counts
}
