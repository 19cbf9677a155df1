// Token routing of a mixture-of-experts layer (issue 9), the host reference the GPU kernels will be judged against:
// the router's softmax over experts, top-k, the optional renormalisation of the k weights (norm_topk_prob),
// the routing plan (every (token, slot) pair sorted by expert: counts, offsets, permutation), the split of a plan by
// expert owner (for expert parallelism), per-expert load statistics, and transformers' auxiliary load-balancing loss
// (`load_balancing_loss_func` of the Qwen MoE families, without an attention mask: packed batches have no padding).
// Conventions:
//  - logits (T, E) row-major; probs = softmax per row, in the logits' type: float for f32 logits (transformers' router
//    works in fp32; the MoE layer passes f32 logits for f32, bf16 and f16 models), double for double logits (an f64
//    model, matching the f64 reference exactly); the model rounds the combine weights to its dtype;
//  - top-k picks the k largest probabilities, larger first; equal probabilities go to the lower expert index first
//    (torch.topk leaves ties unspecified; exact ties do not occur with real logits);
//  - weight[t][j] = probs[t][expert[t][j]], divided by their sum over the k when norm_topk_prob;
//  - the plan orders the pairs by expert, and within an expert by token then slot, so it is a pure function of the
//    choices (deterministic), and an expert that receives no token has count 0.
// The MoE layer (model/moe_layer.cpp) routes with route_tokens / plan_routing and computes the aux loss and the load
// statistics here; its router backward runs on the device with route_tokens_backward's formulas (the reference the
// tests check by finite differences). Covered by tests/models/test_moe_routing.cpp.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace lathe {

struct RouterChoice {
  int64_t tokens = 0, experts = 0, top_k = 0;
  std::vector<double> probs;     // (T, E) softmax of the logits
  std::vector<int32_t> expert;  // (T, k) chosen experts, larger probability first
  std::vector<double> weight;    // (T, k) combine weights
};

// Softmax, top-k and (when norm_topk_prob) renormalisation of a (T, E) block of router logits. Refuses k outside
// [1, E] and non-finite logits (a NaN has no place in a top-k) with a clear error.
RouterChoice route_tokens(std::span<const double> logits, int64_t tokens, int64_t experts, int64_t top_k,
                          bool norm_topk_prob);
// The same from f32 logits, computed in float as transformers' fp32 router does (an f32 / bf16 model's routing);
// probs and weights are the float results widened.
RouterChoice route_tokens(std::span<const float> logits, int64_t tokens, int64_t experts, int64_t top_k,
                          bool norm_topk_prob);

// d(logits) (T, E) from d(weight) (T, k), for the fixed choices of `r` (top-k is piecewise constant): through the
// renormalisation (when norm_topk_prob) and the softmax, in double.
std::vector<double> route_tokens_backward(const RouterChoice& r, std::span<const double> d_weight, bool norm_topk_prob);

// The (token, slot) pairs of a batch sorted by expert: pairs offsets[e] .. offsets[e + 1] - 1 of `token` / `slot`
// go to expert e (counts[e] of them). `position[t * k + j]` is where pair (t, j) landed: the combine step reads
// expert outputs back through it in a fixed order (no scatter-add races).
struct RoutingPlan {
  int64_t tokens = 0, experts = 0, top_k = 0;
  std::vector<int64_t> counts;    // (E)
  std::vector<int64_t> offsets;   // (E + 1), offsets[0] = 0, offsets[E] = T k
  std::vector<int32_t> token;     // (T k) token of each sorted pair
  std::vector<int32_t> slot;      // (T k) its slot j in [0, k)
  std::vector<int64_t> position;  // (T k) sorted position of pair (t, j), the inverse permutation
};
RoutingPlan plan_routing(const RouterChoice& r);

// The part of a plan that experts [first, first + count) own (one rank of expert parallelism): their pairs, with
// counts and offsets re-based to the first owned expert; `position` keeps the indices into the whole plan's order.
RoutingPlan plan_for_owner(const RoutingPlan& plan, int64_t first, int64_t count);

// Load statistics of one layer's plan: tokens per expert, and max / mean of them (1 = perfectly balanced).
struct ExpertLoad {
  std::vector<int64_t> tokens_per_expert;
  double max_over_mean = 0.0;
};
ExpertLoad expert_load(const RoutingPlan& plan);
ExpertLoad expert_load(std::span<const int64_t> counts);  // from the pairs routed to each expert

// What the load-balancing loss needs of one layer's routing: the pairs routed to each expert and the sum over the
// layer's T rows of probs[., e] (the MoE layer reads both from the device; routing_totals computes them on the host).
struct RoutingTotals {
  int64_t tokens = 0;
  std::vector<int64_t> counts;    // (E)
  std::vector<double> prob_sums;  // (E)
};
RoutingTotals routing_totals(const RouterChoice& r);

// transformers' load-balancing loss over the router choices of every MoE layer, their rows concatenated (N rows in
// all): loss = E * sum_e f_e P_e with f_e = (pairs routed to e) / N and P_e = (sum over rows of probs[., e]) / N.
// f_e sums to k over the experts (it is not divided by k, as in transformers). `d_logits` (one (T_l, E) block per
// layer, may be null) receives d(loss)/d(logits): only P depends on the logits (f is piecewise constant). `d_probs`
// (may be null) receives d(loss)/d(probs[r, e]) = E f_e / N, the same (E) vector for every row r of every layer.
double load_balancing_loss(const std::vector<const RouterChoice*>& layers,
                           std::vector<std::vector<double>>* d_logits = nullptr, std::vector<double>* d_probs = nullptr);
// The same from each layer's totals (no d_logits: the MoE layer applies d_probs through the softmax on the device).
double load_balancing_loss_totals(const std::vector<RoutingTotals>& layers, std::vector<double>* d_probs = nullptr);

}  // namespace lathe
