// Host reference of mixture-of-experts routing (conventions and formulas in model/moe_routing.h): plain loops, in the
// logits' type for the softmax and top-k, in double for the rest. Covered by tests/models/test_moe_routing.cpp.
#include "model/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace lathe {

namespace {

// dlogit_i = p_i (dp_i - sum_e p_e dp_e) for one row.
void softmax_backward_row(const double* p, const double* dp, int64_t n, double* dlogit) {
  double dot = 0;
  for (int64_t e = 0; e < n; ++e) dot += p[e] * dp[e];
  for (int64_t e = 0; e < n; ++e) dlogit[e] = p[e] * (dp[e] - dot);
}

template <typename T>
RouterChoice route(std::span<const T> logits, int64_t tokens, int64_t experts, int64_t top_k, bool norm_topk_prob) {
  LATHE_CHECK(tokens >= 0 && experts >= 1 && top_k >= 1 && top_k <= experts,
              "moe: routing needs tokens >= 0 and 1 <= top_k <= experts, got {} tokens, {} experts, top_k {}", tokens,
              experts, top_k);
  LATHE_CHECK(int64_t(logits.size()) == tokens * experts, "moe: router logits hold {} values, {} tokens x {} experts "
              "need {}", logits.size(), tokens, experts, tokens * experts);
  RouterChoice r;
  r.tokens = tokens;
  r.experts = experts;
  r.top_k = top_k;
  r.probs.resize(size_t(tokens * experts));
  r.expert.resize(size_t(tokens * top_k));
  r.weight.resize(size_t(tokens * top_k));
  // Each token alone (threads split the tokens; the result does not depend on how). The softmax, the top-k and the
  // renormalisation run in T (the logits' type: float for an f32 / bf16 model, as transformers' fp32 router; double
  // for an f64 model); probs and weights are stored widened to double.
  int64_t bad = -1;  // the first non-finite logit, refused after the parallel region
#pragma omp parallel
  {
    std::vector<int32_t> order(static_cast<size_t>(top_k));
    std::vector<T> p(static_cast<size_t>(experts));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* x = logits.data() + t * experts;
      bool finite = true;
      for (int64_t e = 0; e < experts; ++e) finite = finite && std::isfinite(x[e]);
      if (!finite) {
#pragma omp critical
        bad = bad < 0 ? t : std::min(bad, t);
        continue;
      }
      const T mx = *std::max_element(x, x + experts);
      T sum = 0;
      for (int64_t e = 0; e < experts; ++e) sum += (p[size_t(e)] = std::exp(x[e] - mx));
      double* probs = r.probs.data() + t * experts;
      for (int64_t e = 0; e < experts; ++e) probs[e] = double(p[size_t(e)] /= sum);
      // The k largest, larger first, ties to the lower index (a total order): one pass, inserting into the sorted
      // top-k list (most experts fail the first comparison).
      auto better = [&](int32_t a, int32_t b) {
        return p[size_t(a)] > p[size_t(b)] || (p[size_t(a)] == p[size_t(b)] && a < b);
      };
      int64_t n = 0;
      for (int32_t e = 0; e < int32_t(experts); ++e) {
        if (n == top_k && !better(e, order[size_t(n - 1)])) continue;
        int64_t i = n < top_k ? n++ : n - 1;
        for (; i > 0 && better(e, order[size_t(i - 1)]); --i) order[size_t(i)] = order[size_t(i - 1)];
        order[size_t(i)] = e;
      }
      T picked = 0;
      for (int64_t j = 0; j < top_k; ++j) picked += p[size_t(order[size_t(j)])];
      for (int64_t j = 0; j < top_k; ++j) {
        const int32_t e = order[size_t(j)];
        r.expert[size_t(t * top_k + j)] = e;
        r.weight[size_t(t * top_k + j)] = double(norm_topk_prob ? p[size_t(e)] / picked : p[size_t(e)]);
      }
    }
  }
  if (bad >= 0) {
    const T* x = logits.data() + bad * experts;
    const int64_t e = std::find_if(x, x + experts, [](T v) { return !std::isfinite(v); }) - x;
    LATHE_FAIL("moe: router logit of token {}, expert {} is {}", bad, e, x[e]);
  }
  return r;
}

}  // namespace

RouterChoice route_tokens(std::span<const double> logits, int64_t tokens, int64_t experts, int64_t top_k,
                          bool norm_topk_prob) {
  return route(logits, tokens, experts, top_k, norm_topk_prob);
}

RouterChoice route_tokens(std::span<const float> logits, int64_t tokens, int64_t experts, int64_t top_k,
                          bool norm_topk_prob) {
  return route(logits, tokens, experts, top_k, norm_topk_prob);
}

std::vector<double> route_tokens_backward(const RouterChoice& r, std::span<const double> d_weight, bool norm_topk_prob) {
  LATHE_CHECK(int64_t(d_weight.size()) == r.tokens * r.top_k, "moe: d_weight holds {} values, the choice has {} x {}",
              d_weight.size(), r.tokens, r.top_k);
  std::vector<double> d_logits(size_t(r.tokens * r.experts));
#pragma omp parallel
  {
    std::vector<double> dp(size_t(r.experts));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < r.tokens; ++t) {
      const double* p = r.probs.data() + t * r.experts;
      const int32_t* ex = r.expert.data() + t * r.top_k;
      const double* dw = d_weight.data() + t * r.top_k;
      std::fill(dp.begin(), dp.end(), 0.0);
      if (norm_topk_prob) {  // w_j = p_j / S, S = sum of the k picked: dp_j = (dw_j - sum_i dw_i w_i) / S
        double picked = 0, dot = 0;
        for (int64_t j = 0; j < r.top_k; ++j) picked += p[ex[j]];
        for (int64_t j = 0; j < r.top_k; ++j) dot += dw[j] * (p[ex[j]] / picked);
        for (int64_t j = 0; j < r.top_k; ++j) dp[size_t(ex[j])] = (dw[j] - dot) / picked;
      } else {
        for (int64_t j = 0; j < r.top_k; ++j) dp[size_t(ex[j])] = dw[j];
      }
      softmax_backward_row(p, dp.data(), r.experts, d_logits.data() + t * r.experts);
    }
  }
  return d_logits;
}

RoutingPlan plan_routing(const RouterChoice& r) {
  RoutingPlan plan;
  plan.tokens = r.tokens;
  plan.experts = r.experts;
  plan.top_k = r.top_k;
  const int64_t pairs = r.tokens * r.top_k;
  plan.counts.assign(size_t(r.experts), 0);
  for (int32_t e : r.expert) {
    LATHE_CHECK(e >= 0 && e < r.experts, "moe: routed expert {} outside [0, {})", e, r.experts);
    ++plan.counts[size_t(e)];
  }
  plan.offsets.assign(size_t(r.experts + 1), 0);
  for (int64_t e = 0; e < r.experts; ++e) plan.offsets[size_t(e + 1)] = plan.offsets[size_t(e)] + plan.counts[size_t(e)];
  plan.token.resize(size_t(pairs));
  plan.slot.resize(size_t(pairs));
  plan.position.resize(size_t(pairs));
  std::vector<int64_t> next(plan.offsets.begin(), plan.offsets.end() - 1);  // next free place of each expert
  for (int64_t t = 0; t < r.tokens; ++t)  // token order, then slot order: a stable counting sort
    for (int64_t j = 0; j < r.top_k; ++j) {
      const int64_t at = next[size_t(r.expert[size_t(t * r.top_k + j)])]++;
      plan.token[size_t(at)] = int32_t(t);
      plan.slot[size_t(at)] = int32_t(j);
      plan.position[size_t(t * r.top_k + j)] = at;
    }
  return plan;
}

RoutingPlan plan_for_owner(const RoutingPlan& plan, int64_t first, int64_t count) {
  LATHE_CHECK(first >= 0 && count >= 0 && first + count <= plan.experts,
              "moe: experts [{}, {}) are not a range of the plan's {} experts", first, first + count, plan.experts);
  RoutingPlan part;
  part.tokens = plan.tokens;
  part.experts = count;
  part.top_k = plan.top_k;
  const int64_t begin = plan.offsets[size_t(first)], end = plan.offsets[size_t(first + count)];
  part.counts.assign(plan.counts.begin() + first, plan.counts.begin() + first + count);
  for (int64_t e = first; e <= first + count; ++e) part.offsets.push_back(plan.offsets[size_t(e)] - begin);
  part.token.assign(plan.token.begin() + begin, plan.token.begin() + end);
  part.slot.assign(plan.slot.begin() + begin, plan.slot.begin() + end);
  for (int64_t i = begin; i < end; ++i) part.position.push_back(i);
  return part;
}

ExpertLoad expert_load(std::span<const int64_t> counts) {
  ExpertLoad load;
  load.tokens_per_expert.assign(counts.begin(), counts.end());
  int64_t pairs = 0, mx = 0;
  for (int64_t n : counts) {
    pairs += n;
    mx = std::max(mx, n);
  }
  const double mean = counts.empty() ? 0.0 : double(pairs) / double(counts.size());
  load.max_over_mean = mean > 0 ? double(mx) / mean : 0.0;
  return load;
}

ExpertLoad expert_load(const RoutingPlan& plan) { return expert_load(plan.counts); }

RoutingTotals routing_totals(const RouterChoice& r) {
  RoutingTotals s;
  s.tokens = r.tokens;
  s.counts.assign(size_t(r.experts), 0);
  s.prob_sums.assign(size_t(r.experts), 0.0);
  for (int32_t e : r.expert) ++s.counts[size_t(e)];
  for (int64_t t = 0; t < r.tokens; ++t)
    for (int64_t e = 0; e < r.experts; ++e) s.prob_sums[size_t(e)] += r.probs[size_t(t * r.experts + e)];
  return s;
}

double load_balancing_loss_totals(const std::vector<RoutingTotals>& layers, std::vector<double>* d_probs) {
  LATHE_CHECK(!layers.empty(), "moe: the load-balancing loss needs at least one layer's routing");
  const size_t experts = layers[0].counts.size();
  int64_t rows = 0;
  std::vector<double> routed(experts, 0.0), prob(experts, 0.0);
  for (const RoutingTotals& l : layers) {
    LATHE_CHECK(l.counts.size() == experts && l.prob_sums.size() == experts, "moe: layers route to {} and {} experts: "
                "the load-balancing loss needs one expert count", experts, l.counts.size());
    rows += l.tokens;
    for (size_t e = 0; e < experts; ++e) {
      routed[e] += double(l.counts[e]);
      prob[e] += l.prob_sums[e];
    }
  }
  if (d_probs) d_probs->assign(experts, 0.0);
  if (rows == 0) return 0.0;
  const double n = double(rows);
  double loss = 0;
  for (size_t e = 0; e < experts; ++e) loss += (routed[e] / n) * (prob[e] / n);
  if (d_probs)  // d loss / d probs[r, e] = E f_e / N
    for (size_t e = 0; e < experts; ++e) (*d_probs)[e] = double(experts) * (routed[e] / n) / n;
  return loss * double(experts);
}

double load_balancing_loss(const std::vector<const RouterChoice*>& layers, std::vector<std::vector<double>>* d_logits,
                           std::vector<double>* d_probs) {
  LATHE_CHECK(!layers.empty(), "moe: the load-balancing loss needs at least one layer's router choices");
  std::vector<RoutingTotals> totals;
  for (const RouterChoice* r : layers) {
    LATHE_CHECK(r->experts == layers[0]->experts && r->top_k == layers[0]->top_k, "moe: layers route to {} / top-{} "
                "and {} / top-{} experts: the load-balancing loss needs one expert count and k", layers[0]->experts,
                layers[0]->top_k, r->experts, r->top_k);
    totals.push_back(routing_totals(*r));
  }
  std::vector<double> dp;
  const double loss = load_balancing_loss_totals(totals, &dp);
  if (d_probs) *d_probs = dp;
  if (d_logits) {  // through each row's softmax
    d_logits->clear();
    for (const RouterChoice* r : layers) {
      const int64_t experts = r->experts;
      std::vector<double> d(size_t(r->tokens * experts));
#pragma omp parallel for schedule(static)
      for (int64_t t = 0; t < r->tokens; ++t)
        softmax_backward_row(r->probs.data() + t * experts, dp.data(), experts, d.data() + t * experts);
      d_logits->push_back(std::move(d));
    }
  }
  return loss;
}

}  // namespace lathe
