// The op table: every op the engine knows, declared once (X-macro), with its attribute structs.
// A backward that is a plain composition of other ops lives in ops/grad.cpp; a backward that needs its own
// kernel is an op of its own here (softmax_backward, silu_backward).
// Covered by tests/ops (every op x device x dtype).
#pragma once

#include <optional>
#include <string_view>
#include <variant>
#include <vector>

#include "core/dtype.h"

namespace lathe {

// X(name, number of inputs); -1: any number, at least one (the *_list ops over a list of tensors)
#define LATHE_OP_LIST(X) \
  X(matmul, 2)           \
  X(add, 2)              \
  X(mul, 2)              \
  X(scale, 1)            \
  X(cast, 1)             \
  X(sum, 1)              \
  X(sum_squares, 1)      \
  X(sum_squares_list, -1) \
  X(mean, 1)             \
  X(softmax, 1)          \
  X(softmax_backward, 2) \
  X(silu, 1)             \
  X(silu_backward, 2)    \
  X(swiglu, 2)           \
  X(swiglu_backward, 3)  \
  X(swiglu_halves, 1)    \
  X(swiglu_halves_backward, 2) \
  X(embedding, 2)        \
  X(embedding_backward, 2) \
  X(rmsnorm, 2)          \
  X(rmsnorm_backward, 3) \
  X(residual_rmsnorm, 3) \
  X(residual_rmsnorm_backward, 4) \
  X(gated_rmsnorm, 3)    \
  X(gated_rmsnorm_backward, 4) \
  X(rope, 2)             \
  X(qk_norm_rope, 4)     \
  X(qk_norm_rope_backward, 7) \
  X(attention, 4)        \
  X(attention_backward, 7) \
  X(paged_attention, 6)  \
  X(scatter_rows, 3)     \
  X(gather_sum, 3)       \
  X(row_argmax_logsumexp, 1) \
  X(sample_rows, 4)      \
  X(penalize_rows, 4)    \
  X(cross_entropy, 2)    \
  X(cross_entropy_slice, 3) \
  X(adamw, 4)            \
  X(adamw_list, -1)      \
  X(segment_mask, 1)     \
  X(dropout, 1)          \
  X(sigmoid, 1)          \
  X(sigmoid_backward, 2) \
  X(causal_conv1d, 3)    \
  X(causal_conv1d_backward, 4) \
  X(gdn_decay, 3)        \
  X(gdn_decay_backward, 4) \
  X(gated_delta_rule, 6) \
  X(gated_delta_rule_backward, 9) \
  X(gated_delta_rule_state, 7) \
  X(grouped_matmul, 2)   \
  X(grouped_matmul_weight_grad, 2) \
  X(grouped_matmul_routed, 3) \
  X(grouped_matmul_weight_grad_routed, 3) \
  X(moe_route, 1)        \
  X(moe_pad_plan, 2)     \
  X(moe_ep_messages, 2)  \
  X(moe_ep_slots, 4)     \
  X(moe_ep_regroup, 1)   \
  X(moe_ep_sources, 1)

enum class OpId {
#define LATHE_X(name, n_in) name,
  LATHE_OP_LIST(LATHE_X)
#undef LATHE_X
  kCount
};

inline constexpr int kOpCount = int(OpId::kCount);

std::string_view op_name(OpId op);
int op_num_inputs(OpId op);
OpId op_from_name(std::string_view name);  // throws on an unknown name

// out = alpha * op(A) @ op(B) + beta * out, where op(X) = X^T when trans_x. A: (..., M, K) (or (..., K, M)
// when trans_a); B: (..., K, N) with the same leading dims as A, or 2-D B shared by every batch (then
// trans_a must be false and the batch folds into M). Accumulation in fp32 (fp64 for f64).
struct MatmulAttrs {
  bool trans_a = false;
  bool trans_b = false;
  float alpha = 1.0f;
  float beta = 0.0f;  // non-zero reads the output tensor's current contents
};

struct ScaleAttrs {
  double alpha = 1.0;
};

struct CastAttrs {
  DType to = DType::F32;
};

// Reduction over `dims` (empty = all dims).
// sum_squares(x) -> 0-d sum of x^2 over every element of x (any shape, any strides; 0 for an empty x), in f32 for
// f32/bf16/f16 inputs and f64 for f64 ones: the accumulation dtype, so a global gradient norm of bf16 gradients
// needs no f32 copy of them. No attributes. Deterministic: every kernel sums in an order fixed by the element count
// alone (CUDA: fixed per-block partials, then one block over the partials; no atomics). Not differentiable.
// sum_squares_list(x_0, ..., x_{n-1}) -> (n): sum_squares of each input in one op (one launch on CUDA: the global
// gradient norm over every parameter). Inputs share one floating dtype and are contiguous; the output is f32 (f64 for
// f64). Deterministic in the same sense (CUDA: fixed chunks of each tensor, then each tensor's chunk sums in order);
// its sums may differ from sum_squares' in the last bits (another fixed order). Not differentiable.
struct ReduceAttrs {
  std::vector<int> dims;
  bool keepdim = false;
};

// embedding(weight (V, H), ids (T) i32) -> (T, H). embedding_backward(dy (T, H), ids) -> dweight (V, H):
// rows of dy summed per id; `vocab` gives V. With `accumulate`, the output's current contents are kept and each id's
// sum is added into its row (one rounding of old + sum per element; rows no id names stay bitwise as they were): a
// tied LM head's gradient takes the embedding's without a full-size zero fill and add (embedding_backward_into).
// `first` >= 0: the weight is a vocab-parallel slice (CausalLm under tensor parallelism), its rows the ids
// [first, first + V) of the whole vocabulary: ids outside give zero rows and add to no row (another slice holds them);
// -1 (default): the whole vocabulary, and an id outside it is an error.
struct EmbeddingAttrs {
  int64_t vocab = 0;
  bool accumulate = false;
  int64_t first = -1;
};

// y = x / rms(x) * (offset + w) over the last dim, rms = sqrt(mean(x^2) + eps). offset is 0 for Qwen3,
// 1 for the zero-centred norms of Qwen3.5. rmsnorm_backward(x, w, dy) -> (dx, dw).
// gated_rmsnorm(x (..., h), w (h), z (x's shape)) -> y = x / rms(x) * (offset + w) * silu(z), silu(z) = z sigmoid(z):
// the output norm of Qwen3.5's Gated DeltaNet, computed in fp32 (f64 for f64) and rounded once, at y.
// gated_rmsnorm_backward(x, w, z, dy) -> (dx, dw, dz): with r = 1 / rms(x), n = x r (offset + w), s = silu(z),
//   dz = dy n silu'(z), and g = dy s the gradient of the plain norm's output, as rmsnorm_backward:
//   dx = r ((offset + w) g - x r^2 mean(x (offset + w) g)), dw = sum over rows of g x r.
// dw is deterministic on every device (fixed-order sums, no atomics).
// residual_rmsnorm(x, r, w (h)) -> (y, h): the pre-norm residual stream's add and norm in one pass. h = x + r rounded
// to the dtype as the add op rounds it, y = rmsnorm(h; w) computed from that rounded h: bitwise the add op then the
// rmsnorm op on a device whose kernels round the same way. Differentiated through y (the op's first output):
// dx = dr = rmsnorm_backward(h, w, dy).dx. residual_rmsnorm_backward(h, w, dy, dres) -> (dx, dw): rmsnorm_backward's
// dx plus dres (the gradient that reaches h along the residual path), rounded once, and its dw.
struct NormAttrs {
  double eps = 1e-6;
  double offset = 0.0;
};

// Rotary embedding of x (T, heads, D) at positions (T) i32, rotate-half layout (pairs i and i + R/2) on the
// first R = rotary_dim dims (0 = all of D); inverse rotates by -angle (the backward).
struct RopeAttrs {
  double theta = 10000.0;
  int64_t rotary_dim = 0;
  bool inverse = false;
};

// qk_norm_rope(qkv (T, (Hq + 2 Hkv) D), wq (D), wk (D), positions (T) i32) -> (q (T, Hq, D), k (T, Hkv, D),
// v (T, Hkv, D)): the output of a fused q/k/v projection split into heads, q's heads normalised with wq and k's with
// wk (rmsnorm, `norm`) and rotated (rope, `rope`; inverse must be false), v's heads copied. The arithmetic of rmsnorm
// then rope on heads copied out of qkv (the normalised value is rounded to the dtype before it is rotated), within one
// rounding of those ops (tests/ops/test_fused_ops.cpp). qk_norm_rope_backward(qkv, wq, wk, positions, dq, dk, dv) ->
// (dqkv (T, (Hq + 2 Hkv) D), dwq, dwk): the inverse rotation of dq and dk rounded to the dtype, then rmsnorm_backward
// per head; dv copied into v's columns. Differentiated through q (the op's first output); dwq and dwk are
// deterministic.
struct QkNormRopeAttrs {
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  NormAttrs norm;
  RopeAttrs rope;
};

// Causal attention over packed documents: q (T, Hq, D), k and v (T, Hkv, D) with Hq % Hkv == 0, cu_seqlens
// (B + 1) i32 with document b at rows [cu[b], cu[b+1]). Outputs o (T, Hq, D) and lse (T, Hq) f32 (f64 for f64), the
// log-sum-exp of the scaled scores of each row. attention_backward(q, k, v, o, lse, do, cu) -> dq, dk, dv.
// `deterministic` (attention_backward only): true asks for bitwise-repeatable gradients; false also admits kernels
// whose dQ is summed in fp32 across key tiles in whatever order the hardware schedules them (cuDNN's other backward
// variant, the one torch's SDPA runs): equal within rounding, not bitwise run to run, and faster.
struct AttentionAttrs {
  double scale = 0.0;  // 0 = 1/sqrt(D)
  bool deterministic = true;
};

// Attention of new tokens over a paged KV cache (the rollout engine, model/rollout_engine.h). paged_attention(q (T, Hq, D),
// k_cache and v_cache (S, Hkv, D) with S a multiple of block_size, block_table (B, M) i32, cu_q (B + 1) i32,
// context_lens (B) i32) -> o (T, Hq, D): sequence b's queries are rows [cu_q[b], cu_q[b+1]) of q, its last n_b tokens of
// context_lens[b]; query i of it (position context_lens[b] - n_b + i) attends the sequence's positions 0 .. that
// position, position j's key and value at cache row block_table[b][j / block_size] * block_size + j % block_size. GQA:
// query head h reads kv head h / (Hq / Hkv). Scores and the softmax in f32 (f64 for f64). Forward only.
struct PagedAttentionAttrs {
  double scale = 0.0;  // 0 = 1/sqrt(D)
  int64_t block_size = 16;
};

// scatter_rows(src (T, ...), index (T) i32, dst (N, ...)) -> dst' (N, ...): dst with row index[i] replaced by src row i
// (indices distinct and in [0, N)); the other rows as dst. scatter_rows_into writes dst in place (the engine's KV
// writes). Not differentiable.

// gather_sum(rows (N, D), index (M, S) i32, weights (M, S)) -> (M, D): out[m] = sum_j weights[m, j] rows[index[m, j]]
// over j = 0..S-1 in that order, skipping index -1 (any other index in [0, N)); accumulated in f32 (f64 for f64) and
// rounded once. Expert parallelism's sums of a token's rows (model/moe_layer.cpp) and its weighted gathers (S = 1).
// Not differentiable.

// row_argmax_logsumexp(x (N, V)) -> argmax (N) i32 over ids [0, limit) (the lowest id on ties; limit 0 = V), its value
// x[argmax] (N) and lse (N), the log-sum-exp of the whole row, both f32 (f64 for f64): the rollout engine's greedy token
// and its log-probability under the model's distribution (x[argmax] - lse) without copying the logits to the host. A
// NaN in a row makes its lse NaN.
struct ArgmaxAttrs {
  int64_t limit = 0;
};

// sample_rows(x (N, V), rows (M) i32, params (M, 4), keys (M, 3) i32) -> token (M) i32, logit (M) and logprob (M) (f32;
// f64 for f64): M draws, draw i from row rows[i] of x (several draws may share a row: the samples of a prompt), with
// params[i] = (temperature T > 0, min-p m in [0, 1), top-k k >= 0, top-p p in (0, 1]) in f32 (f64 for an f64 x). With
// z_j = x_j / T over the ids j < limit (0 = V) whose logit is finite, and c_j = ordered_key(float(z_j))
// (backend/sample_hash.h), the kept ids are those with
// - c_j >= C_k, C_k the largest key with at least k ids at or above it (the k-th largest z, ties kept; all for k = 0 or
//   k at least the finite ids: transformers' top-k),
// - c_j >= C_p, C_p the smallest key such that the ids of the top-k set with a key above it have less than p x the
//   top-k set's mass sum exp(z - max z) (all for p = 1: transformers' top-p, which keeps an id while the mass strictly
//   above it is below p, applied after top-k),
// - z_j >= max z + log m (all for m = 0: the ids whose probability is at least m x the largest, transformers' min-p),
// and the token is the argmax over the kept ids of z_j + G_j (the lowest id on ties), G_j = -log(-log u_j) a Gumbel
// variate, so the token is drawn from softmax(z) over the kept ids (token -1, logit and logprob NaN, where no id has a
// finite logit). u_j = sample_uniform(key, counter, j) (backend/sample_hash.h) with key = keys[i][0] | keys[i][1] <<
// 32 (as unsigned) and counter = keys[i][2]: a draw depends on its key, counter and row only, never on the other
// draws. logit = x[token]; logprob = z_token - log sum over the kept ids of exp(z), the token's log-probability under
// the distribution it was drawn from. The rollout engine's device sampling (penalize_rows first where a request has
// penalties or banned ids). Not differentiable.

// penalize_rows(x (N, V), rows (M) i32, params (M, 2), entries (E, 3) i32) -> y (M, V) (f32; f64 for f64): row i of y is
// row rows[i] of x with the rollout engine's logit penalties, in the order transformers applies them before the
// temperature: for each entry (i, j, c) (one at most per (i, j)), c >= 0 marks id j as seen in draw i's prompt or
// response, c the times it was generated: with params[i] = (repetition p > 0, frequency f), y[i][j] = x / p where the
// logit x > 0, x * p otherwise (transformers' repetition penalty), then minus f * c (the frequency penalty, as vLLM's);
// c = -1 bans id j: y[i][j] = -inf. Ids without an entry are copied. Not differentiable.

// cross_entropy(logits (N, V), labels (N) i32) -> loss (N) f32 (f64 for f64; 0 where label == ignore_index) and, with
// `with_grad`, dlogits (N, V) = grad_scale * (softmax(logits) - onehot(label)) (zero rows where ignored).
// cross_entropy_slice(logits (N, V), labels (N) i32, lse (N) f32 (f64 for f64)): the same over a vocab-parallel slice
// of the LM head (model/lm_head.h): the logits are the columns [first, first + V) of the whole vocabulary, labels are
// whole-vocabulary ids and lse is each row's log-sum-exp over the whole vocabulary (combined over the slices). The
// loss part is lse - x[label] where this slice holds the label, 0 where another does (the slices' parts sum to the
// row's loss) or the row is ignored; dlogits = grad_scale * (exp(x - lse) - onehot(label)), the one-hot only where
// held: this slice's columns of the whole row's gradient.
struct CrossEntropyAttrs {
  int64_t ignore_index = -100;
  bool with_grad = false;
  double grad_scale = 1.0;
  int64_t first = 0;  // cross_entropy_slice: the whole-vocabulary id of column 0
};

// adamw(master, grad, m, v) -> (master', m', v'[, param']): one AdamW step (Loshchilov & Hutter's decoupled weight decay,
// with the conventions of torch.optim.AdamW). With g = grad_scale * grad, b1t = 1 - beta1^step, b2t = 1 - beta2^step:
//   m' = beta1 m + (1 - beta1) g        v' = beta2 |v| + (1 - beta2) g^2
//   master' = master - lr weight_decay master - (lr / b1t) m' / (sqrt(v') / sqrt(b2t) + eps)
// master, m and v share one dtype (the key dtype: f32, f64 in the reference, or bf16 below); grad may be any float
// dtype (bf16 gradients update f32 masters; CUDA takes f32, bf16 and f16). |v| equals v for every state this op
// produces; it keeps the op total on arbitrary inputs (the op check draws them from [-2, 2]). Elementwise: the
// outputs may be the input tensors themselves, which is how the optimizer updates in place (adamw_update in ops.h).
// Not differentiable.
// With `rounded_to` set (bf16 or f16), a fourth output param' = master' converted to that dtype exactly as the cast
// op converts it (round to nearest even from the stored master'), so a low-precision parameter is refreshed from its
// f32 master in the same pass: bitwise equal to adamw followed by cast.
// Key dtype bf16 (optimizer states in bf16, no master: Hugging Face's "bf16 parameters" recipe): master is the bf16
// parameter itself, m and v are bf16, grad is bf16 or f32 in practice. Inputs are widened exactly, the
// formula runs in f32 or wider (the CPU reference: double, as for f32 keys; CUDA: float), master' uses the unrounded
// m' and v', and each output is rounded to f32 and then to nearest even into bf16 on store: the bf16-key result is
// the f32-key result on the widened inputs, each output cast to bf16. An update smaller than half a bf16 ulp of the
// weight is lost. rounded_to is refused with a bf16 key (the master already is the parameter).
// adamw_list(w_0, g_0, m_0, v_0, w_1, g_1, ...) -> (w_0', m_0', v_0'[, p_0'], w_1', ...): adamw on each group of four
// with the same attributes, in one op (one launch on CUDA: "multi-tensor AdamW"), bitwise what adamw gives each group.
// Every group has the first group's dtypes (master, grad); each group's tensors share a shape of their own.
struct AdamWAttrs {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;         // 1-based number of this update, for bias correction
  double grad_scale = 1.0;  // multiplies the gradient: 1/accumulation, the clipping factor
  std::optional<DType> rounded_to;  // bf16/f16: also write the rounded new master (fourth output)
};

// Row segments of x (T, C) for multi-tenant LoRA: segment s owns rows [rows[s], rows[s+1]) (contiguous, in order;
// gaps and a tail beyond rows[S] belong to no segment). Each op reads only its own fields and ignores the others.
// segment_mask(x) -> y: y[i, j] = scale[s] x[i, j] for i in segment s and col_begin[s] <= j < col_end[s], else 0
//   (selected, not multiplied: an Inf or NaN outside the kept blocks gives 0). Linear and self-adjoint.
// dropout(x) -> y: in segment s, keep (i, j) iff u(seed[s], n) >= p[s] with n = (i - rows[s] + row_shift[s]) W +
//   col_offset + j, the element's index in its segment's rows of width W = row_width (0: C) (backend/dropout_hash.h:
//   an integer hash, bit-identical on every device; a segment gets the same mask wherever it sits in the batch, and a
//   rank holding part of it draws that part's mask: row_shift for a context-parallel rank's rows that begin inside
//   the segment, col_offset / row_width for a tensor-parallel rank's columns of a row-parallel module's input); kept
//   values are x / (1 - p[s]), dropped ones 0. Rows outside every segment pass through unchanged. Linear and
//   self-adjoint for fixed attrs (the backward is dropout of dy).
struct SegmentAttrs {
  std::vector<int64_t> rows;       // S + 1 row offsets, rows[0] = 0, non-decreasing, rows[S] <= T
  std::vector<int64_t> col_begin;  // S entries (segment_mask): columns [col_begin[s], col_end[s]) are kept
  std::vector<int64_t> col_end;
  std::vector<double> scale;       // S entries (segment_mask): kept values are multiplied by scale[s]
  std::vector<double> p;           // S entries (dropout): drop probability of segment s, in [0, 1)
  std::vector<uint64_t> seed;      // S entries (dropout)
  std::vector<int64_t> row_shift;  // S entries or none (dropout): rows of segment s before its first row here
  int64_t col_offset = 0;          // dropout: x's columns are [col_offset, col_offset + C) of rows of row_width
  int64_t row_width = 0;           //   columns (0: C)
};

// Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention; research note gated-deltanet.md §2, formulas and packing
// conventions in backend/cpu/gdn_reference.h). All take packed documents with cu_seqlens (N + 1) i32; nothing crosses a
// document boundary in either pass.
// sigmoid(x) -> y; sigmoid_backward(y, dy) -> dy y (1 - y) (takes the output, like softmax_backward).
// causal_conv1d(x (T, C), w (C, W), cu) -> y (T, C): depthwise causal convolution, y[t, c] = sum_j w[c, j]
//   x[t - (W - 1) + j, c] over sources inside t's document (zero history at each document start). NO activation:
//   the layer applies silu (op silu) on the result, so the op stays linear. causal_conv1d_backward(x, w, dy, cu) ->
//   (dx, dw).
// gdn_decay(a (T, H), A_log (H), dt_bias (H)) -> g (T, H) = -exp(A_log) softplus(a + dt_bias), the log-decay;
//   gdn_decay_backward(a, A_log, dt_bias, dg) -> (da, dA_log, ddt_bias).
// gated_delta_rule(q, k (T, H_k, d_k), v (T, H_v, d_v), g, beta (T, H_v), cu) -> (o (T, H_v, d_v), states): the
//   gated delta rule per (document, value head) from a zero state, value head h reading key head h / (H_v / H_k); q
//   and k are used as given (L2-normalise them first), the query scale is applied inside; g must be <= 0.
//   states: where attrs.save_states, (T / 64 + N, H_v, d_k, d_v) in v's dtype: row c is the state before the c-th
//   64-token chunk of the batch (chunks start at each document's first token and are numbered document by
//   document; a document's first chunk starts from zero), the rows past the last chunk are zero; else (0, H_v, d_k,
//   d_v). A cache for the backward, which then skips its own forward scan.
//   chunk_cache: (T, H_v, kGdnChunkCacheWidth) in v's dtype where gdn_chunk_cache_applies (save_states and the CUDA
//   chunked kernels' layout), else 0 rows: the chunked kernels' per-chunk WY factors (b, W, U, P, R), opaque (only
//   that kernel's backward reads it; op-check does not compare it), so the backward skips its own prep pass.
//   gated_delta_rule_backward(q, k, v, g, beta, do, cu, states, chunk_cache) -> (dq, dk, dv, dg, dbeta), dq/dk summed
//   over each group; states and chunk_cache are the forward's (or have 0 rows: recomputed). The result does not
//   depend on them beyond rounding: the CPU and recurrent CUDA kernels always recompute; the chunked CUDA kernels
//   read them.
// gated_delta_rule_state(q, k, v, g, beta, cu, state (N, H_v, d_k, d_v)) -> (o (T, H_v, d_v), final_state (N, H_v,
//   d_k, d_v)): the same rule, document n starting from state[n] instead of zero; final_state[n] is the state after
//   its last token (state[n] itself for an empty document). The states are in the accumulation dtype (f32; f64 for
//   f64 inputs). Prefill and decoding with a recurrent state cache (a decoding step is a document of one token).
//   Forward only (not differentiable).
struct GatedDeltaAttrs {
  double scale = 0.0;   // query scale; 0 = d_k^{-1/2}
  int64_t chunk = 64;   // chunk length of the chunked (WY) algorithm; the result does not depend on it
  bool save_states = false;  // gated_delta_rule: also return the chunk-start states (for the backward)
};

// Grouped GEMM over row groups (the experts of a mixture-of-experts layer, rows sorted by expert): group e owns rows
// [offsets[e], offsets[e+1]) of x; offsets has E + 1 entries, offsets[0] = 0, non-decreasing, offsets[E] = P.
// grouped_matmul(x (P, K), w) -> y (P, N):  y[rows of e] = x[rows of e] w[e]^T for w (E, N, K) when trans_w (the
//   default: Hugging Face's (out, in) weights), or x[rows of e] w[e] for w (E, K, N) when !trans_w (the backward's
//   dx = dy w[e]). An empty group contributes nothing; P may be 0.
// grouped_matmul_weight_grad(dy (P, N), x (P, K)) -> dw (E, N, K): dw[e] = dy[rows of e]^T x[rows of e], zero for an
//   empty group. E comes from offsets.
// w (and a weight-grad output written with the _into form) may be a view whose expert blocks are any stride >= N K
// apart in dim 0 as long as each expert's (N, K) block is contiguous (row stride K, element stride 1; for !trans_w the
// (K, N) block, row stride N): the gate and up halves of a fused gate_up_proj (E, 2I, H), narrowed on dim 1.
// Accumulation in fp32 (f64 for f64). Deterministic.
// Backward (ops/grouped_matmul.cpp): for y = grouped_matmul(x, w), dx = grouped_matmul(dy, w, !trans_w) and dw =
// grouped_matmul_weight_grad(dy, x) (trans_w) or (x, dy) (!trans_w: w[e] is (K, N), its gradient x_e^T dy_e). The
// weight grad is bilinear too: for dw = weight_grad(a, b), da = grouped_matmul(b, ddw) and db = grouped_matmul(a, ddw,
// trans_w = false).
// grouped_matmul_routed(x (P, K), w, offsets (E + 2) i32) -> y (P, N) and
// grouped_matmul_weight_grad_routed(dy (P, N), x (P, K), offsets (E + 2) i32) -> dw (E, N, K): the two ops above with
//   their groups read where they are (moe_route's offsets, on x's device; the last entry, the non-finite flag, is not
//   read) instead of from host attributes, so that no wait for the host splits a step: a decoding step's expert GEMMs
//   (recorded as a graph) and a training step's (docs/moe.md, "Groups on the device"). attrs.offsets stays empty;
//   trans_w (the forward), accumulate (the weight grad, into an output) and few_rows are read. Each group's range is
//   clamped to [0, P] (a row no group covers is left as the output was allocated: moe_route's groups cover every
//   row). Not differentiable: the MoE layer composes its backward from them.
struct GroupedMatmulAttrs {
  std::vector<int64_t> offsets;
  bool trans_w = true;
  // grouped_matmul_weight_grad written into an existing output (grouped_matmul_weight_grad_into): dw[e] += instead of
  // =, an empty group's block left as it is (a model's expert gradients accumulating over micro-batches in place).
  bool accumulate = false;
  // The routed ops: the rows are a decoding step's, a few an expert (memory-bound: kernels built for that take them,
  // cuda/routed_skinny and routed_rows), not a training step's (tensor-core kernels: cuda/hopper_grouped_gemm). Which
  // kernels may run, not what is computed.
  bool few_rows = false;
};

// moe_route(logits (T, E) f32 or f64) -> (probs, weights, picked, inv_sum, offsets, token, pair, position): a
// mixture-of-experts layer's routing for one batch, computed where the logits are (model/moe_routing.h has the host
// reference and the conventions; P = T k pairs):
//   probs (T, E): the softmax of each row, in the logits' dtype (transformers' fp32 router);
//   weights (T, k): the k largest probabilities, larger first, ties to the lower expert index, divided by their sum S
//     when norm_topk_prob (S summed in rank order, in the logits' dtype);
//   picked (T, k) i32: t E + e for the expert e of pair (t, j), the flat index into probs;
//   inv_sum (T, 1): 1 / S when norm_topk_prob, else 1;
//   offsets (E + 2) i32: pairs offsets[e] .. offsets[e + 1] - 1 of the plan go to expert e (offsets[0] = 0,
//     offsets[E] = P); offsets[E + 1] is the first token with a non-finite logit, or -1 (the caller refuses the batch:
//     a NaN has no place in a top-k);
//   token (P) i32, pair (P) i32: the token t and the pair t k + j of each sorted row, sorted by expert, then token,
//     then slot (a pure function of the choices: deterministic);
//   position (T k) i32: the sorted row of pair t k + j (the inverse permutation).
// Not differentiable (the router's backward is composed from its outputs: model/moe_layer.cpp).
struct MoeRouteAttrs {
  int64_t top_k = 1;
  bool norm_topk_prob = false;
};

// moe_pad_plan(offsets (E + 2) i32, pair (P) i32) -> (pad_token (E M) i32, pad_pair (E M) i32, pad_position (P) i32):
// moe_route's plan laid out with M = rows_per_expert rows per expert (M >= every expert's count; the caller derives M
// from the same offsets), so that the experts' GEMMs are one batched GEMM over (E, M, .) blocks. Padded row
// q = e M + r holds sorted row offsets[e] + r when r < count(e): pad_pair[q] its pair, pad_token[q] = pair / top_k;
// a padding row has pad_token 0 (any valid token: its results are never read) and pad_pair P (one past the last
// pair: the caller's gradient rows carry a zero row there). pad_position[t k + j] is the padded row of pair (t, j).
// Not differentiable.
struct MoePadAttrs {
  int64_t rows_per_expert = 0;
  int64_t top_k = 1;
};

// Expert parallelism's exchange plan, on the device (model/moe_layer.cpp, CausalLm::plan_expert_exchange): E experts
// split over `ranks` ranks, E / ranks consecutive ones each (rank r holds experts [r E / ranks, (r + 1) E / ranks)).
// Not differentiable; integer outputs, exact.
//
// moe_ep_messages(picked (T, k) i32, offsets (E + 2) i32) -> (back (T, n) i32, tokens (T n) i32, summary (E + 2 + n)
// i32), n = ranks, picked and offsets as moe_route makes them: token t goes to rank r when one of its experts is
// there, once however many. The messages, one per rank in rank order, each its tokens in ascending order, make one
// list: tokens[u] is its u-th token (-1 past the list's end); back[t, r] is token t's place u in it for rank r (-1:
// not sent there); summary is `offsets` and then the length of each rank's message (what the ep group all-gathers).
//
// moe_ep_slots(picked (T, k) i32, position (T k) i32, back (T, n) i32, bases (E) i32) -> (slot_row (T n, S) i32,
// slot_pair (T n, S) i32), S = min(k, E / n), position and back as above: for the sorted row p of pair (t, j)
// (p = position[t k + j]) of expert e on rank r, u = back[t, r] and f the rank of e among t's experts on rank r
// (ascending): slot_row[u, f] = bases[e] + p and slot_pair[u, f] = p. Slots not filled so (also every row past the
// list's end) hold -1 and 0.
//
// moe_ep_regroup(blocks (2 B + 1) i32) -> (grouped (rows) i32, received (rows) i32): a permutation of `rows` rows cut
// into B blocks: the blocks start at blocks[b] in one order (blocks[0 .. B], ascending, blocks[B] = rows) and at
// blocks[B + 1 + b] in the other; row q of block b in the first order is row received[q] = blocks[B + 1 + b] + q -
// blocks[b] in the other, and grouped is the inverse (grouped[received[q]] = q).
//
// moe_ep_sources(pairs (U, S) i32) -> (token (rows) i32, slot (rows) i32): the inverse of a table that names each of
// `rows` rows exactly once (-1: an empty slot): for pairs[u, f] = g >= 0, token[g] = u and slot[g] = u S + f. (The
// experts' rank: each received token's slots name its pairs' grouped rows; this gives each grouped row its token.)
struct MoeExchangeAttrs {
  int64_t ranks = 1;
  int64_t rows = 0;  // moe_ep_regroup's and moe_ep_sources'
};

using OpAttrs = std::variant<std::monostate, MatmulAttrs, ScaleAttrs, CastAttrs, ReduceAttrs, EmbeddingAttrs,
                             NormAttrs, RopeAttrs, QkNormRopeAttrs, AttentionAttrs, PagedAttentionAttrs, ArgmaxAttrs,
                             CrossEntropyAttrs, AdamWAttrs,
                             SegmentAttrs, GatedDeltaAttrs, GroupedMatmulAttrs, MoeRouteAttrs, MoePadAttrs,
                             MoeExchangeAttrs>;

}  // namespace lathe
