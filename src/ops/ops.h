// The ops as functions: each validates its inputs (shape inference), allocates its output on the context's
// device and runs whatever the registry resolves. `*_into` variants write into a caller-provided output.
// Covered by tests/ops (every op x device x dtype, backward by finite differences).
#pragma once

#include <vector>

#include "backend/registry.h"

namespace lathe {

struct TensorSpec {
  Shape shape;
  DType dtype;
};

// Output shapes and dtypes of `op` for these inputs; throws with the op's name on invalid inputs.
std::vector<TensorSpec> infer_outputs(OpId op, const std::vector<Tensor>& inputs, const OpAttrs& attrs);

// Shape that `a` and `b` broadcast to (numpy rules); throws if they do not.
Shape broadcast_shapes(const Shape& a, const Shape& b);

// Builds the call for `op` with freshly allocated outputs and runs it.
std::vector<Tensor> call_op(ExecContext& ctx, OpId op, std::vector<Tensor> inputs, OpAttrs attrs = {});

Tensor matmul(ExecContext& ctx, const Tensor& a, const Tensor& b, MatmulAttrs attrs = {});
// y = x w^T for x (n, in) and a weight w (out, in) as Hugging Face stores it.
Tensor linear(ExecContext& ctx, const Tensor& x, const Tensor& w);
void matmul_into(ExecContext& ctx, const Tensor& a, const Tensor& b, Tensor& out, MatmulAttrs attrs);
// In an unbatched product (2-D a and b), matmul and matmul_into take a, b and out as they are when each is 2-D with
// contiguous rows at least a row apart (rows_contiguous, core/tensor.h: a matrix or a column slice of a wider one,
// such as one projection's columns of a fused q/k/v output), addressed by its leading dimension; anything else is
// made contiguous first. Every matmul kernel takes that layout (matmul_layout).
Support matmul_layout(const OpCall& call);
Tensor add(ExecContext& ctx, const Tensor& a, const Tensor& b);
Tensor mul(ExecContext& ctx, const Tensor& a, const Tensor& b);
Tensor scale(ExecContext& ctx, const Tensor& x, double alpha);
Tensor cast(ExecContext& ctx, const Tensor& x, DType to);
// dst = src (same shape) written into an existing tensor or view whose elements are distinct (rows of a cache or of a
// stacked buffer, a column slice), through the cast op.
void copy_into(ExecContext& ctx, const Tensor& src, const Tensor& dst);
Tensor contiguous(ExecContext& ctx, const Tensor& x);  // x itself when already contiguous
// A new tensor of zeros (all-zero bits: 0 in every dtype), written on the context's stream.
Tensor zeros(ExecContext& ctx, const Shape& shape, DType dtype);
Tensor sum(ExecContext& ctx, const Tensor& x, std::vector<int> dims = {}, bool keepdim = false);
Tensor mean(ExecContext& ctx, const Tensor& x, std::vector<int> dims = {}, bool keepdim = false);
// sum(x^2) over every element as a 0-d tensor: f32 (f64 for an f64 x), whatever x's strides.
Tensor sum_squares(ExecContext& ctx, const Tensor& x);
// The same written into `out`, a 0-d tensor of that dtype (an element of a preallocated vector of totals, say).
void sum_squares_into(ExecContext& ctx, const Tensor& x, const Tensor& out);
// out (n), f32 (f64 for f64 inputs) = the sum of squares of each of the n contiguous tensors xs (one dtype), in one op.
void sum_squares_list_into(ExecContext& ctx, const std::vector<Tensor>& xs, const Tensor& out);
Tensor softmax(ExecContext& ctx, const Tensor& x);  // over the last dimension
Tensor softmax_backward(ExecContext& ctx, const Tensor& y, const Tensor& dy);
Tensor silu(ExecContext& ctx, const Tensor& x);
Tensor silu_backward(ExecContext& ctx, const Tensor& x, const Tensor& dy);
Tensor swiglu(ExecContext& ctx, const Tensor& gate, const Tensor& up);  // silu(gate) * up
std::vector<Tensor> swiglu_backward(ExecContext& ctx, const Tensor& gate, const Tensor& up, const Tensor& dy);
// swiglu of the halves of gu (..., 2 I): gate [0, I) and up [I, 2 I) of each row side by side (a fused gate/up
// projection's output) -> (..., I); the backward's dgu has gu's layout. Bitwise swiglu / swiglu_backward.
Tensor swiglu_halves(ExecContext& ctx, const Tensor& gu);
Tensor swiglu_halves_backward(ExecContext& ctx, const Tensor& gu, const Tensor& dy);
// `first` >= 0: weight is the vocab-parallel slice of ids [first, first + V) (EmbeddingAttrs::first).
Tensor embedding(ExecContext& ctx, const Tensor& weight, const Tensor& ids, int64_t first = -1);
Tensor embedding_backward(ExecContext& ctx, const Tensor& dy, const Tensor& ids, int64_t vocab, int64_t first = -1);
// dweight (V, H), contiguous, dy's dtype) += embedding_backward(dy, ids, V) (EmbeddingAttrs::accumulate).
void embedding_backward_into(ExecContext& ctx, const Tensor& dy, const Tensor& ids, Tensor& dweight,
                             int64_t first = -1);
Tensor rmsnorm(ExecContext& ctx, const Tensor& x, const Tensor& w, NormAttrs attrs);
std::vector<Tensor> rmsnorm_backward(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy,
                                     NormAttrs attrs);  // {dx, dw}
// {y, h}: h = x + r, y = rmsnorm(h; w) in one pass; the backward's {dx, dw} has dx = rmsnorm_backward's + dres
// (ops/op_table.h, before NormAttrs).
std::vector<Tensor> residual_rmsnorm(ExecContext& ctx, const Tensor& x, const Tensor& r, const Tensor& w,
                                     NormAttrs attrs);
std::vector<Tensor> residual_rmsnorm_backward(ExecContext& ctx, const Tensor& h, const Tensor& w, const Tensor& dy,
                                              const Tensor& dres, NormAttrs attrs);
// rmsnorm(x; w) * silu(z) in one op (formula at NormAttrs in ops/op_table.h).
Tensor gated_rmsnorm(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& z, NormAttrs attrs);
std::vector<Tensor> gated_rmsnorm_backward(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& z,
                                           const Tensor& dy, NormAttrs attrs);  // {dx, dw, dz}
Tensor rope(ExecContext& ctx, const Tensor& x, const Tensor& positions, RopeAttrs attrs);
// {q, k, v} from a fused projection's output qkv (T, (Hq + 2 Hkv) D): q and k normalised per head and rotated, v
// copied; the backward's {dqkv, dwq, dwk} (ops/op_table.h, at QkNormRopeAttrs).
std::vector<Tensor> qk_norm_rope(ExecContext& ctx, const Tensor& qkv, const Tensor& wq, const Tensor& wk,
                                 const Tensor& positions, QkNormRopeAttrs attrs);
std::vector<Tensor> qk_norm_rope_backward(ExecContext& ctx, const Tensor& qkv, const Tensor& wq, const Tensor& wk,
                                          const Tensor& positions, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                          QkNormRopeAttrs attrs);
// (T, n_0 + n_1 + ...) from parts (T, n_i), side by side.
Tensor concat_columns(ExecContext& ctx, const std::vector<Tensor>& parts);
std::vector<Tensor> attention(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& cu_seqlens, AttentionAttrs attrs);  // {o, lse}
std::vector<Tensor> attention_backward(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& o, const Tensor& lse, const Tensor& d_o,
                                       const Tensor& cu_seqlens, AttentionAttrs attrs);  // {dq, dk, dv}
// op_table.h: the rollout engine's attention over its paged cache, and its in-place row writes into the cache.
Tensor paged_attention(ExecContext& ctx, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& block_table, const Tensor& cu_q, const Tensor& context_lens, PagedAttentionAttrs attrs);
void scatter_rows_into(ExecContext& ctx, const Tensor& src, const Tensor& index, Tensor& dst);
Tensor gather_sum(ExecContext& ctx, const Tensor& rows, const Tensor& index, const Tensor& weights);
std::vector<Tensor> row_argmax_logsumexp(ExecContext& ctx, const Tensor& x, int64_t limit = 0);  // {arg, max, lse}
Tensor penalize_rows(ExecContext& ctx, const Tensor& x, const Tensor& rows, const Tensor& params,
                     const Tensor& entries);
std::vector<Tensor> sample_rows(ExecContext& ctx, const Tensor& x, const Tensor& rows, const Tensor& params,
                                const Tensor& keys, int64_t limit = 0);  // {token, logit, logprob}
std::vector<Tensor> cross_entropy(ExecContext& ctx, const Tensor& logits, const Tensor& labels,
                                  CrossEntropyAttrs attrs);  // {loss} or {loss, dlogits}
// The cross-entropy of a vocab-parallel slice of the logits given the rows' whole log-sum-exp (cross_entropy_slice):
// {loss part} or {loss part, dlogits}.
std::vector<Tensor> cross_entropy_slice(ExecContext& ctx, const Tensor& logits, const Tensor& labels, const Tensor& lse,
                                        CrossEntropyAttrs attrs);
// One AdamW step in place: master, m and v (contiguous, one dtype) are both inputs and outputs of the adamw op.
// With a defined `param` (contiguous bf16/f16, the master's shape), the same kernel also writes the new master rounded
// into it (attrs.rounded_to is set from param's dtype), instead of a separate cast afterwards. A bf16 master is the
// parameter itself (bf16 optimizer states) and takes no `param`.
void adamw_update(ExecContext& ctx, Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWAttrs& attrs,
                  const Tensor& param = {});
// adamw_update of every group in one adamw_list op (one launch on CUDA). Groups share the attributes and the dtypes
// of (master, grad); `param` is defined in every group or in none.
struct AdamWGroup {
  Tensor master, grad, m, v, param;
};
void adamw_update_list(ExecContext& ctx, const std::vector<AdamWGroup>& groups, const AdamWAttrs& attrs);
// The checked adamw_list call adamw_update_list runs (for callers that build it before the attrs' lr and grad_scale are
// known, then run it with run_op).
OpCall adamw_update_list_call(const std::vector<AdamWGroup>& groups, const AdamWAttrs& attrs);
// Row-segment ops on x (T, C) for multi-tenant LoRA (formulas at SegmentAttrs in ops/op_table.h).
Tensor segment_mask(ExecContext& ctx, const Tensor& x, const SegmentAttrs& attrs);
Tensor dropout(ExecContext& ctx, const Tensor& x, const SegmentAttrs& attrs);

// Gated DeltaNet pieces (formulas at GatedDeltaAttrs in ops/op_table.h; shapes in ops/gated_delta.cpp).
Tensor sigmoid(ExecContext& ctx, const Tensor& x);
Tensor sigmoid_backward(ExecContext& ctx, const Tensor& y, const Tensor& dy);
Tensor causal_conv1d(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens);
std::vector<Tensor> causal_conv1d_backward(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy,
                                           const Tensor& cu_seqlens);  // {dx, dw}
Tensor gdn_decay(ExecContext& ctx, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias);
std::vector<Tensor> gdn_decay_backward(ExecContext& ctx, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias,
                                       const Tensor& dg);  // {da, dA_log, ddt_bias}
// {o, states, chunk_cache}: states has 0 rows unless attrs.save_states, chunk_cache unless gdn_chunk_cache_applies
// (pass both to the backward).
std::vector<Tensor> gated_delta_rule(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                     GatedDeltaAttrs attrs = {});
// {dq, dk, dv, dg, dbeta}; `states` and `chunk_cache` from the forward, or undefined / 0 rows to recompute them.
std::vector<Tensor> gated_delta_rule_backward(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& g, const Tensor& beta, const Tensor& d_o,
                                              const Tensor& cu_seqlens, const Tensor& states = {},
                                              GatedDeltaAttrs attrs = {}, const Tensor& chunk_cache = {});
// The chunk cache of the CUDA chunked kernels: per (token, value head), W, U and Delta = U - W H (128 each), P and R
// (64 each) and b (one f32 in two bf16 slots), stored planar (all W, then all U, ...). It applies where those kernels run a forward
// that saves its states: attrs.save_states, inputs on a CUDA device, bf16 q/k/v with d_k = d_v = 128, every input
// contiguous and 16-byte aligned (the kernels' own condition, gdr_chunked_supports).
inline constexpr int64_t kGdnChunkCacheWidth = 3 * 128 + 2 * 64 + 2;
bool gdn_chunk_cache_applies(const std::vector<Tensor>& inputs, const GatedDeltaAttrs& attrs);
// True for the outputs of `op` that are caches only a kernel's own backward reads (not compared by op-check).
bool is_opaque_output(OpId op, size_t index);
// Rows of the saved chunk-start states for `tokens` tokens in `docs` documents: a bound on the 64-token chunks.
inline int64_t gdn_state_rows(int64_t tokens, int64_t docs) { return tokens / 64 + docs; }
// The rule from given per-document states (prefill / decoding): {o (T, H_v, d_v), final_state (N, H_v, d_k, d_v)}.
// `state` is f32 (f64 for f64 inputs); the dtype the state must have is gdn_state_dtype(q.dtype()).
std::vector<Tensor> gated_delta_rule_state(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                           const Tensor& state, GatedDeltaAttrs attrs = {});
inline DType gdn_state_dtype(DType input) { return input == DType::F64 ? DType::F64 : DType::F32; }
// Shape inference of the ops above (called by infer_outputs).
std::vector<TensorSpec> infer_gated_delta_outputs(OpId op, const std::vector<Tensor>& inputs, const OpAttrs& attrs);
// Their backward compositions (called by op_backward).
std::vector<Tensor> gated_delta_op_backward(ExecContext& ctx, OpId op, const std::vector<Tensor>& inputs,
                                            const OpAttrs& attrs, const std::vector<Tensor>& outputs,
                                            const Tensor& grad_output);

// Grouped GEMM over the row groups of a mixture-of-experts layer (formulas at GroupedMatmulAttrs in ops/op_table.h;
// shapes, backward and layout rules in ops/grouped_matmul.cpp). x and dy are made contiguous; a w whose expert blocks
// are not contiguous (expert_blocks_contiguous) is copied first.
Tensor grouped_matmul(ExecContext& ctx, const Tensor& x, const Tensor& w, const GroupedMatmulAttrs& attrs);
// dw (E, N, K) with dw[e] = dy[rows of e]^T x[rows of e] (zero for an empty group); attrs.trans_w is not read.
Tensor grouped_matmul_weight_grad(ExecContext& ctx, const Tensor& dy, const Tensor& x, const GroupedMatmulAttrs& attrs);
// The same written into `out`, (E, N, K) of dy's dtype on the context's device, contiguous or a view with contiguous
// expert blocks (the gate or up half of a fused (E, 2I, H) gradient, narrowed on dim 1).
void grouped_matmul_weight_grad_into(ExecContext& ctx, const Tensor& dy, const Tensor& x, const Tensor& out,
                                     const GroupedMatmulAttrs& attrs);
// True for a 3-D tensor whose blocks t[e] are each contiguous (row stride = the last dim, element stride 1; size-1
// dims excepted) and at least a block apart in dim 0, so that no two overlap: the weight layout every grouped_matmul
// kernel takes. A contiguous tensor qualifies, and so does a narrow on dim 1 of a contiguous (E, 2I, H) one.
bool expert_blocks_contiguous(const Tensor& t);
// The layout predicate of every grouped_matmul(_weight_grad) kernel: x and dy contiguous, w and dw with contiguous
// expert blocks, y contiguous.
Support grouped_matmul_layout(const OpCall& call);
// Shape inference of the four ops (called by infer_outputs) and the backward compositions of the first two (called by
// op_backward).
std::vector<TensorSpec> infer_grouped_matmul_outputs(OpId op, const std::vector<Tensor>& inputs, const OpAttrs& attrs);
std::vector<Tensor> grouped_matmul_op_backward(ExecContext& ctx, OpId op, const std::vector<Tensor>& inputs,
                                               const OpAttrs& attrs, const Tensor& grad_output);

// The routed ops (formulas at GroupedMatmulAttrs: the groups of moe_route's offsets (E + 2) read on the device, no wait
// for the host), only where a kernel of the exact dtype takes the call: false, with nothing computed, where none does,
// so that a caller holding the groups can read them to the host and run grouped_matmul(_weight_grad) instead (the MoE
// layer: docs/moe.md, "Groups on the device"). few_rows: a decoding step's rows (GroupedMatmulAttrs::few_rows). The
// weight grad is written into `out` ((E, N, K) of dy's dtype with contiguous expert blocks), dw[e] += when
// `accumulate`. x and dy are made contiguous.
bool try_grouped_matmul_routed(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w,
                               bool few_rows, Tensor& y);
bool try_grouped_matmul_weight_grad_routed_into(ExecContext& ctx, const Tensor& dy, const Tensor& x,
                                                const Tensor& offsets, const Tensor& out, bool accumulate);

// A mixture-of-experts layer's routing for one batch on the logits' device (formulas and layouts at MoeRouteAttrs in
// ops/op_table.h): the router choice and the plan of pairs sorted by expert, in one op.
struct MoeRouting {
  Tensor probs, weights, picked, inv_sum;  // (T, E), (T, k), (T, k) i32, (T, 1)
  Tensor offsets;                          // (E + 2) i32: the plan's offsets, then the first non-finite token or -1
  Tensor token, pair, position;            // (P) i32 each
};
MoeRouting moe_route(ExecContext& ctx, const Tensor& logits, MoeRouteAttrs attrs);
// That plan with rows_per_expert rows per expert (formulas at MoePadAttrs): the index maps of a batched expert GEMM.
struct MoePadPlan {
  Tensor token, pair;  // (E M) i32 each
  Tensor position;     // (P) i32
};
MoePadPlan moe_pad_plan(ExecContext& ctx, const Tensor& offsets, const Tensor& pair, MoePadAttrs attrs);
// Expert parallelism's exchange plan over `ranks` ranks (formulas at MoeExchangeAttrs).
struct MoeEpMessages {
  Tensor back;     // (T, n) i32
  Tensor tokens;   // (T n) i32
  Tensor summary;  // (E + 2 + n) i32
};
MoeEpMessages moe_ep_messages(ExecContext& ctx, const Tensor& picked, const Tensor& offsets, int64_t ranks);
struct MoeEpSlots {
  Tensor slot_row, slot_pair;  // (T n, S) i32 each
};
MoeEpSlots moe_ep_slots(ExecContext& ctx, const Tensor& picked, const Tensor& position, const Tensor& back,
                        const Tensor& bases);
struct MoeEpRegroup {
  Tensor grouped, received;  // (rows) i32 each
};
MoeEpRegroup moe_ep_regroup(ExecContext& ctx, const Tensor& blocks, int64_t rows);
struct MoeEpSources {
  Tensor token, slot;  // (rows) i32 each
};
MoeEpSources moe_ep_sources(ExecContext& ctx, const Tensor& pairs, int64_t rows);

// Sums `grad` over the dimensions that broadcasting added or stretched, giving a tensor of `shape`.
Tensor reduce_to_shape(ExecContext& ctx, const Tensor& grad, const Shape& shape);

// Gradients of every input of `op` (undefined tensors for inputs without one), given its inputs, its
// outputs and the gradient of its first output. Built from ops, so it runs on any device.
std::vector<Tensor> op_backward(ExecContext& ctx, OpId op, const std::vector<Tensor>& inputs,
                                const OpAttrs& attrs, const std::vector<Tensor>& outputs, const Tensor& grad_output);

// The positive dims that a reduction over `dims` (empty = all) of a `rank`-d tensor covers, sorted.
std::vector<int> normalize_reduce_dims(const std::vector<int>& dims, int rank);

}  // namespace lathe
