// The moe_route op against the host routing reference (model/moe_routing.h, itself checked by hand, by finite
// differences and, through the MoE models, against transformers): on the CPU, bitwise the reference's probabilities,
// choices, weights and plan (f32 and f64 logits); on CUDA, where a GPU exists, the same choices and plan exactly,
// probabilities and weights within float rounding, and bitwise the same outputs run to run. Logits rounded to bf16 (a
// bf16 model's router) make exact ties common: every device must break them toward the lower expert index, as the
// reference does. Also a non-finite logit (reported, the plan still valid) and an empty batch. And expert
// parallelism's exchange ops (moe_ep_messages, moe_ep_slots, moe_ep_regroup, moe_ep_sources) on a routing worked out by
// hand, on every device present.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "backend/runtime.h"
#include "model/moe_routing.h"
#include "ops/ops.h"
#include "support/error_of.h"

using namespace lathe;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

struct Routed {
  std::vector<double> probs, weights, inv_sum;
  std::vector<int32_t> picked, offsets, token, pair, position;
};

std::vector<double> doubles(const Tensor& t) {
  const Tensor h = runtime().copy_to(t, Device::cpu());
  std::vector<double> v(static_cast<size_t>(h.numel()));
  for (int64_t i = 0; i < h.numel(); ++i) v[size_t(i)] = load_as_double(h.data_ptr(), h.dtype(), i);
  return v;
}

std::vector<int32_t> ints(const Tensor& t) {
  const Tensor h = runtime().copy_to(t, Device::cpu());
  const int32_t* p = h.data<int32_t>();
  return std::vector<int32_t>(p, p + h.numel());
}

Routed route_on(Device device, const std::vector<double>& logits, int64_t tokens, int64_t experts, DType dtype,
                MoeRouteAttrs attrs) {
  ExecContext ctx = runtime().context(device);
  const Tensor x = cast(ctx, runtime().from_host(logits.data(), {tokens, experts}, DType::F64, device), dtype);
  const MoeRouting m = moe_route(ctx, x, attrs);
  return {doubles(m.probs), doubles(m.weights), doubles(m.inv_sum), ints(m.picked),
          ints(m.offsets), ints(m.token),       ints(m.pair),       ints(m.position)};
}

// Normal logits, optionally rounded to bf16 first (as a bf16 model's router logits are): many exact ties.
std::vector<double> random_logits(int64_t n, uint32_t seed, bool bf16_ties) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, 1.5);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) {
    x = d(rng);
    if (bf16_ties) {  // keep 8 significant bits
      int exp = 0;
      const double m = std::frexp(x, &exp);
      x = std::ldexp(std::nearbyint(std::ldexp(m, 8)), exp - 8);
    }
  }
  return v;
}

// The reference for logits of `dtype` (f32: routed in float, as the op; f64: in double).
RouterChoice reference(const std::vector<double>& logits, int64_t tokens, int64_t experts, DType dtype,
                       MoeRouteAttrs a) {
  if (dtype == DType::F64) return route_tokens(logits, tokens, experts, a.top_k, a.norm_topk_prob);
  const std::vector<float> f(logits.begin(), logits.end());
  return route_tokens(f, tokens, experts, a.top_k, a.norm_topk_prob);
}

// `tol` 0: bitwise; else the floating outputs within tol (absolute; they are probabilities in [0, 1]).
void expect_reference(const Routed& got, const RouterChoice& r, MoeRouteAttrs a, double tol, const std::string& where) {
  const RoutingPlan plan = plan_routing(r);
  const int64_t t = r.tokens, e = r.experts, k = r.top_k;
  for (size_t i = 0; i < r.probs.size(); ++i)
    ASSERT_NEAR(got.probs[i], r.probs[i], tol) << where << ": probs[" << i << "]";
  for (int64_t i = 0; i < t * k; ++i) {
    ASSERT_EQ(got.picked[size_t(i)], (i / k) * e + r.expert[size_t(i)]) << where << ": pair " << i;
    ASSERT_NEAR(got.weights[size_t(i)], r.weight[size_t(i)], tol) << where << ": weight of pair " << i;
  }
  for (int64_t i = 0; i < t; ++i) {
    double s = 0;  // S in rank order, in double: within rounding of the op's (exact 1 without renormalisation)
    for (int64_t j = 0; j < k; ++j) s += r.probs[size_t(i * e + r.expert[size_t(i * k + j)])];
    ASSERT_NEAR(got.inv_sum[size_t(i)], a.norm_topk_prob ? 1.0 / s : 1.0, 1e-5 / s) << where << ": inv_sum " << i;
  }
  for (int64_t i = 0; i <= e; ++i)
    ASSERT_EQ(got.offsets[size_t(i)], plan.offsets[size_t(i)]) << where << ": offset " << i;
  ASSERT_EQ(got.offsets[size_t(e + 1)], -1) << where << ": no non-finite logit";
  for (int64_t i = 0; i < t * k; ++i) {
    ASSERT_EQ(got.token[size_t(i)], plan.token[size_t(i)]) << where << ": token of row " << i;
    ASSERT_EQ(got.pair[size_t(i)], plan.token[size_t(i)] * int32_t(k) + plan.slot[size_t(i)])
        << where << ": pair " << i;
    ASSERT_EQ(got.position[size_t(i)], plan.position[size_t(i)]) << where << ": position " << i;
  }
}

struct Shape3 {
  int64_t tokens, experts, top_k;
  bool norm, ties;
};
const Shape3 kShapes[] = {{200, 128, 8, true, false}, {300, 128, 8, true, true}, {50, 60, 4, false, false},
                          {64, 512, 10, true, true},  {7, 4, 4, false, false},   {5, 1, 1, true, false}};

}  // namespace

TEST(MoeRoute, CpuIsTheHostReferenceBitwise) {
  uint32_t seed = 1;
  for (const Shape3& s : kShapes)
    for (DType dt : {DType::F32, DType::F64}) {
      const std::vector<double> logits = random_logits(s.tokens * s.experts, seed++, s.ties);
      const MoeRouteAttrs a{s.top_k, s.norm};
      const std::string where = fmt::format("cpu {} t={} e={} k={}", dtype_name(dt), s.tokens, s.experts, s.top_k);
      expect_reference(route_on(Device::cpu(), logits, s.tokens, s.experts, dt, a),
                       reference(logits, s.tokens, s.experts, dt, a), a, 0.0, where);
    }
}

TEST(MoeRoute, TiesGoToTheLowerExpertAndEmptyExpertsHaveNoRows) {
  // Token 0: exp(logits) 1, 2, 3, 1; token 1: all equal. Pairs (token, slot) -> expert: (0,0) 2, (0,1) 1, (1,0) 0,
  // (1,1) 1; expert 3 receives nothing.
  const std::vector<double> logits = {0.0, std::log(2.0), std::log(3.0), 0.0, 0.0, 0.0, 0.0, 0.0};
  std::vector<Device> devices = {Device::cpu()};
  if (runtime().has_device(Device::cuda(0))) devices.push_back(Device::cuda(0));
  for (Device d : devices) {
    const Routed r = route_on(d, logits, 2, 4, DType::F32, {2, true});
    EXPECT_EQ(r.picked, (std::vector<int32_t>{2, 1, 4, 5})) << d.str();
    EXPECT_NEAR(r.weights[0], 0.6, 1e-6) << d.str();
    EXPECT_NEAR(r.weights[3], 0.5, 1e-6) << d.str();
    EXPECT_EQ(r.offsets, (std::vector<int32_t>{0, 1, 3, 4, 4, -1})) << d.str();
    EXPECT_EQ(r.token, (std::vector<int32_t>{1, 0, 1, 0})) << d.str();
    EXPECT_EQ(r.pair, (std::vector<int32_t>{2, 1, 3, 0})) << d.str();
    EXPECT_EQ(r.position, (std::vector<int32_t>{3, 1, 0, 2})) << d.str();
  }
}

TEST(MoeRoute, NonFiniteLogitIsReportedAndThePlanStaysValid) {
  const int64_t t = 9, e = 6, k = 2;
  std::vector<double> logits = random_logits(t * e, 7, false);
  logits[size_t(5 * e + 1)] = std::numeric_limits<double>::infinity();
  logits[size_t(3 * e + 4)] = std::nan("");
  std::vector<Device> devices = {Device::cpu()};
  if (runtime().has_device(Device::cuda(0))) devices.push_back(Device::cuda(0));
  for (Device d : devices) {
    const Routed r = route_on(d, logits, t, e, DType::F32, {k, true});
    EXPECT_EQ(r.offsets[size_t(e + 1)], 3) << d.str() << ": the first token with a non-finite logit";
    EXPECT_EQ(r.offsets[size_t(e)], t * k) << d.str();
    std::vector<int> seen(size_t(t * k), 0);  // the plan is still a permutation of every pair
    for (int32_t p : r.pair) ++seen.at(size_t(p));
    for (int64_t i = 0; i < t * k; ++i) {
      EXPECT_EQ(seen[size_t(i)], 1) << d.str() << ": pair " << i;
      EXPECT_EQ(r.pair[size_t(r.position[size_t(i)])], i) << d.str() << ": position of pair " << i;
    }
  }
}

TEST(MoeRoute, EmptyBatchHasEmptyGroups) {
  std::vector<Device> devices = {Device::cpu()};
  if (runtime().has_device(Device::cuda(0))) devices.push_back(Device::cuda(0));
  for (Device d : devices) {
    const Routed r = route_on(d, {}, 0, 5, DType::F32, {2, true});
    EXPECT_EQ(r.offsets, (std::vector<int32_t>{0, 0, 0, 0, 0, 0, -1})) << d.str();
    EXPECT_TRUE(r.token.empty() && r.pair.empty() && r.position.empty()) << d.str();
  }
}

// Expert parallelism's exchange plan (MoeExchangeAttrs) on a routing worked out by hand: 3 tokens, 4 experts, top 2,
// 2 ranks of 2 experts. Token 0 picks experts 3 and 0 (both ranks), token 1 experts 1 and 0 (rank 0), token 2
// experts 2 and 3 (rank 1); on every device that has the ops.
TEST(MoeExchange, PlansAHandWorkedRouting) {
  std::vector<Device> devices = {Device::cpu()};
  if (runtime().has_device(Device::cuda(0))) devices.push_back(Device::cuda(0));
  const std::vector<int32_t> picked = {3, 0, 4 + 1, 4 + 0, 8 + 2, 8 + 3};
  // Sorted by expert, then pair: expert 0 pairs 1, 3; expert 1 pair 2; expert 2 pair 4; expert 3 pairs 0, 5.
  const std::vector<int32_t> offsets = {0, 2, 3, 4, 6, -1}, position = {4, 0, 2, 1, 3, 5};
  for (Device d : devices) {
    ExecContext ctx = runtime().context(d);
    const Tensor pk = runtime().from_host(picked.data(), {3, 2}, DType::I32, d);
    const MoeEpMessages m =
        moe_ep_messages(ctx, pk, runtime().from_host(offsets.data(), {6}, DType::I32, d), 2);
    // Rank 0's message: tokens 0 and 1; rank 1's: tokens 0 and 2.
    EXPECT_EQ(ints(m.tokens), (std::vector<int32_t>{0, 1, 0, 2, -1, -1})) << d.str();
    EXPECT_EQ(ints(m.back), (std::vector<int32_t>{0, 2, 1, -1, -1, 3})) << d.str();
    EXPECT_EQ(ints(m.summary), (std::vector<int32_t>{0, 2, 3, 4, 6, -1, 2, 2})) << d.str();
    // Slots (S = 2), bases 10, 20, 30, 40: token 0's expert 0 (row 0) at u 0, its expert 3 (row 4) at u 2; token 1's
    // experts 0 (row 1) and 1 (row 2) at u 1; token 2's experts 2 (row 3) and 3 (row 5) at u 3.
    const std::vector<int32_t> bases = {10, 20, 30, 40};
    const MoeEpSlots s = moe_ep_slots(ctx, pk, runtime().from_host(position.data(), {6}, DType::I32, d), m.back,
                                      runtime().from_host(bases.data(), {4}, DType::I32, d));
    EXPECT_EQ(ints(s.slot_row), (std::vector<int32_t>{10, -1, 11, 22, 44, -1, 33, 45, -1, -1, -1, -1})) << d.str();
    EXPECT_EQ(ints(s.slot_pair), (std::vector<int32_t>{0, 0, 1, 2, 4, 0, 3, 5, 0, 0, 0, 0})) << d.str();
    // Regroup: 2 senders x 2 local experts with 1, 1, 2, 1 rows, received by sender and regrouped by expert.
    const std::vector<int32_t> blocks = {0, 1, 2, 4, 5, 0, 3, 1, 4};
    const MoeEpRegroup g = moe_ep_regroup(ctx, runtime().from_host(blocks.data(), {9}, DType::I32, d), 5);
    EXPECT_EQ(ints(g.received), (std::vector<int32_t>{0, 3, 1, 2, 4})) << d.str();
    EXPECT_EQ(ints(g.grouped), (std::vector<int32_t>{0, 2, 3, 1, 4})) << d.str();
    // Sources: 3 received tokens' slots naming rows 2; 0, 3; 1.
    const std::vector<int32_t> pairs = {2, -1, 0, 3, 1, -1};
    const MoeEpSources src = moe_ep_sources(ctx, runtime().from_host(pairs.data(), {3, 2}, DType::I32, d), 4);
    EXPECT_EQ(ints(src.token), (std::vector<int32_t>{1, 2, 0, 1})) << d.str();
    EXPECT_EQ(ints(src.slot), (std::vector<int32_t>{2, 4, 0, 3})) << d.str();
  }
}

TEST(MoeExchange, SourcesRefuseARowNamedTwiceOrNever) {
  ExecContext ctx = runtime().context(Device::cpu());
  const auto sources_error = [&](const std::vector<int32_t>& pairs) {
    return test_support::error_of(
        [&] { moe_ep_sources(ctx, runtime().from_host(pairs.data(), {2, 2}, DType::I32, Device::cpu()), 3); });
  };
  EXPECT_NE(sources_error({0, 1, 1, -1}).find("named twice"), std::string::npos) << sources_error({0, 1, 1, -1});
  EXPECT_NE(sources_error({0, -1, 2, -1}).find("no slot names row 1"), std::string::npos)
      << sources_error({0, -1, 2, -1});
}

TEST(MoeRouteCuda, MatchesTheReferenceAndRepeatsBitwise) {
  if (!runtime().has_device(Device::cuda(0))) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 100;
  std::vector<Shape3> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({4096, 128, 8, true, true});  // the Qwen3-30B-A3B benchmark's layer
  for (const Shape3& s : shapes) {
    const std::vector<double> logits = random_logits(s.tokens * s.experts, seed++, s.ties);
    const MoeRouteAttrs a{s.top_k, s.norm};
    const std::string where = fmt::format("cuda t={} e={} k={}", s.tokens, s.experts, s.top_k);
    const Routed first = route_on(Device::cuda(0), logits, s.tokens, s.experts, DType::F32, a);
    expect_reference(first, reference(logits, s.tokens, s.experts, DType::F32, a), a, 1e-6, where);
    const Routed again = route_on(Device::cuda(0), logits, s.tokens, s.experts, DType::F32, a);
    EXPECT_TRUE(again.probs == first.probs && again.weights == first.weights && again.picked == first.picked &&
                again.offsets == first.offsets && again.pair == first.pair && again.position == first.position)
        << where << ": a second run differs";
  }
}
