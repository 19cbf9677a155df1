// The mixture-of-experts MLP of a sparse layer, shared by the families that have one (qwen3_moe in Qwen3Model,
// qwen3_5_moe_text and qwen3_next in Qwen35Model); CausalLm::moe_forward / moe_backward compute it
// (model/moe_layer.cpp, docs/moe.md):
//   logits = x Wr^T (T, E) -> routing on the device (the moe_route op: softmax, top-k, norm_topk_prob, the plan
//   sorted by expert; model/moe_routing.h is its host reference) -> xs = x[plan.token] (P = T k rows, sorted by
//   expert) -> [gate | up] = one grouped GEMM with gate_up_proj (E, 2I, D) -> swiglu -> yd = grouped GEMM with
//   down_proj (E, D, I) -> each token's k rows read back through plan.position and combined by a batched (1 x k)
//   (k x D) product with its weights (a gather and a fixed-order sum: no scatter-add, deterministic)
//   [+ sigmoid(x Wg^T) * shared_expert(x) when the family has a shared expert].
// The routing of a layer is computed once per forward (begin_forward invalidates it) and reused by the recomputing
// backward, so both passes see the same choices.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "model/moe_routing.h"

namespace lathe {

struct LoraSlot;
struct ExecContext;

// Parameter indices of one sparse layer (-1: absent).
struct MoeParams {
  int router = -1;                                       // mlp.gate.weight (E, D)
  int gate_up = -1, down = -1;                           // mlp.experts.gate_up_proj (E, 2I, D), down_proj (E, D, I)
  int shared_gate = -1, shared_up = -1, shared_down = -1;  // mlp.shared_expert.{gate,up,down}_proj.weight
  int shared_gate_w = -1;                                // mlp.shared_expert_gate.weight (1, D)
};

// One layer's routing for the current batch, computed on the model's device by the moe_route op. Its row groups (the
// plan's offsets per expert) reach the host at once (one wait per layer: CausalLm::RouteRead::now), or stay on the
// device for the grouped GEMMs that read them there (the routed ops), a decoding step's (RouteRead::never) and a
// training step's (RouteRead::at_batch_end, whose aux loss, loads and non-finite check are read once the batch's
// backward is queued: CausalLm::moe_read_routing). docs/moe.md, "Groups on the device".
struct MoeRoute {
  bool valid = false;
  Tensor device_offsets;  // (E + 2) i32, moe_route's, where they stay on the device (undefined otherwise)
  Tensor sums;            // (E) the probabilities' column sums on the device (RouteRead::at_batch_end)
  bool decoding = false;  // RouteRead::never: a decoding step's, a few rows an expert (GroupedMatmulAttrs::few_rows)
  // (E + 1) the plan's row offsets per expert (the grouped GEMMs' groups) on the host: read at once, or, for groups on
  // the device, only where a GEMM has no kernel that reads them there (CausalLm::expert_groups; empty until then).
  std::vector<int64_t> offsets;
  RoutingTotals totals;  // pairs per expert and the probabilities' column sums (aux loss, expert load; RouteRead::now)
  Tensor token_ids;     // (P) i32: the token of each sorted row (gathers xs from x)
  Tensor position_ids;  // (T k) i32: the sorted row of pair (t, j) (gathers each token's k expert outputs)
  Tensor pair_ids;      // (P) i32: the pair t k + j of each sorted row (the inverse gather)
  Tensor weights;       // (T, k) combine weights in the model dtype (transformers rounds them to it)
  Tensor ones;          // (T, 1, k) ones: sums a token's k rows as a batched product (the backward of the gather)
  // the router's backward on the device, in the routing dtype (f32; f64 for an f64 model):
  Tensor probs;         // (T, E) the softmax
  Tensor picked_ids;    // (T k) i32: t E + expert of pair (t, j), where d(probs) lands
  Tensor picked_w;      // (T, k) the combine weights before rounding (norm_topk_prob: p_j / S)
  Tensor inv_sum;       // (T, 1) 1 / S, S = the sum of the k picked probabilities (norm_topk_prob only)
  Tensor d_aux;         // (1, E) d(coef x loss_scale x aux loss)/d(probs[r, .]), the same for every row, when on
  // The plan at pad_rows rows per expert (moe_pad_plan) when the batched expert GEMMs apply (pad_rows > 0):
  int64_t pad_rows = 0;
  Tensor pad_token, pad_pair;  // (E pad_rows) i32
  Tensor pad_position;         // (T k) i32
  // Expert parallelism (CausalLm::plan_expert_exchange). Pairs: the pairs sent to and received from each rank of the
  // ep group, the received pairs' groups by local expert (offsets, El + 1), and the row orders between the received
  // (by sending rank, then expert) and the grouped (by local expert, then sending rank) layouts; small per-pair values
  // (the combine weight, the received token row, LoRA masks) travel this way. Tokens: each token's row goes once to
  // every rank holding at least one of its experts (not once per expert there), the tokens for each rank in token
  // order; the experts' rank expands them to its pairs and sums its pairs' outputs per token before they go back.
  std::vector<int64_t> ep_send, ep_recv, ep_offsets;
  Tensor ep_grouped;  // (R) i32: the received pair of each grouped pair
  Tensor ep_received; // (R) i32: the grouped pair of each received pair
  std::vector<int64_t> ep_token_send, ep_token_recv;  // tokens sent to / received from each rank
  Tensor ep_tokens;   // (sum of ep_token_send) i32: the tokens sent, by receiving rank, in token order each
  Tensor ep_unique;   // (R) i32: each grouped pair's row among the received tokens
  Tensor ep_weights;  // (R, 1) each grouped pair's combine weight (MoeRoute::weights, the model dtype)
  // Each received token's grouped pairs (U, S) i32, S = min(k, experts a rank), -1 past them, their weights and
  // ones (U, S); each of this rank's tokens' rows in the buffer that comes back, by rank (T, ep) i32 (-1: none), and
  // ones (T, ep): the sums of gather_sum.
  Tensor ep_pairs, ep_pair_weights, ep_pair_ones;
  Tensor ep_back, ep_back_ones;
};

// The LoRA term of an expert parameter's slot (model/lora.h) for one batch: for rows x (P, in) sorted by expert,
// u = (x A_e^T) * mask (P, R) -- the mask keeps each row's own adapter's columns, times its scaling -- and
// y (P, out) += u BT_e; two grouped GEMMs each way over the slot's (E, R, in) and (E, R, out) views.
// The forward keeps it (mask and u) in MoeActs for the backward.
// Under expert parallelism the rows are this rank's experts' rows from every rank (grouped by local expert), the mask
// came with them, and the slot's experts [first, first + count) are the ones used: the bank stays whole on every rank,
// the other experts' gradients zero here (a sum over the data-parallel ranks, as every adapter gradient has, adds the
// owners' parts).
struct ExpertLora {
  const LoraSlot* slot = nullptr;  // nullptr: no adapter here
  Tensor mask;                     // (P, R)
  Tensor u;                        // (P, R), set by forward
  int64_t first = 0, count = -1;   // the experts used (count -1: all)

  Tensor a() const;
  Tensor bt() const;
  // y += the term (and u is kept).
  void forward(ExecContext& cx, const Tensor& x, const std::vector<int64_t>& offsets, Tensor& y);
  // The slot's gradients accumulate (dBT_e += u_e^T dy_e, dA_e += du_e^T x_e) and dx += du A_e.
  void backward(ExecContext& cx, const Tensor& x, const Tensor& dy, const std::vector<int64_t>& offsets,
                Tensor& dx) const;
};

// What the backward of one sparse layer reads.
struct MoeActs {
  Tensor x;                 // (T, D) the MLP input (post-attention norm)
  bool padded = false;      // the expert rows below are the padded plan's (E M rows, MoeRoute::pad_rows = M)
  Tensor xs;                // (P, D) x gathered in expert order
  Tensor gu, act;           // (P, 2I) [gate | up] per row, (P, I)
  Tensor picked;            // (T, k, D) each token's k expert outputs (under ep: undefined, `yd` instead)
  Tensor yd;                // ep: (R, D) this rank's experts' outputs, by grouped pair
  Tensor sh_gu, sh_act, sh_y, sh_sig;  // shared expert: (T, 2Is) [gate | up], (T, Is), (T, D), sigmoid gate (T, 1)
  ExpertLora lora_gate_up, lora_down;  // the experts' LoRA terms (slot nullptr when not adapted)
  Tensor out;               // (T, D)
};

// The MLP of one layer, what both families share (CausalLm::declare_mlp / mlp_forward / mlp_backward): a SwiGLU of
// intermediate_size through CausalLm::project (so LoRA applies), or, in a sparse layer, the mixture of experts.
struct MlpParams {
  bool sparse = false;
  int gate = -1, up = -1, down = -1;  // mlp.{gate,up,down}_proj.weight of a dense MLP
  MoeParams moe;                      // a sparse layer's
};
struct MlpActs {
  Tensor gu, act;        // (T, 2I) [gate | up] per row and (T, I), a dense MLP's
  MoeActs moe;           // a sparse layer's
  Tensor out;            // (T, D) the MLP's output (before the residual)
};

// Load statistics of one sparse layer for one batch (metrics): tokens routed to each expert, max / mean.
struct ExpertLoadStat {
  int64_t layer = 0;
  std::vector<int64_t> tokens_per_expert;
  double max_over_mean = 0.0;
};

}  // namespace lathe
