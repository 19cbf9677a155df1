// The layout planner (plan.h; formulas in words: docs/plan.md). Sizes follow what the layer code keeps: Qwen3's and
// Qwen3.5's LayerActs (model/qwen3.cpp, model/qwen3_5.cpp, their context_parallel() branches included), MlpActs and
// MoeActs (model/moe_layer.h), the loss head (DecoderStack::loss, CausalLm::head_loss), the parameters each tp rank
// holds (Qwen3Model's shard_over_tp calls) and AdamW's states. Under context parallelism a rank's tensors have one of
// two row counts: its ceil(T / cp) rows of the micro-batch (the stream, norms, projections, MLPs) or, inside a mixer
// after the head all-to-all, every row (padded to cp x its rows) for a cp-th of its heads (Rows).
#include "train/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "data/tokenizer.h"
#include "model/causal_lm.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "parallel/grid.h"
#include "train/flops.h"

namespace lathe {

namespace {

constexpr int64_t kMiB = int64_t(1) << 20;
constexpr int64_t kLossChunkRows = 2048;  // ModelOptions::loss_chunk_rows, the trainer's
constexpr int64_t kBucketsAlive = 3;      // gradient buckets alive at once: the one filling and two in flight

DType model_dtype(const TrainConfig& c) {
  if (!c.dtype.empty()) return dtype_from_name(c.dtype);
  return c.device == "cpu" ? DType::F32 : DType::BF16;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool on_cuda(const TrainConfig& c) { return c.device.rfind("cuda", 0) == 0; }

// Ring volumes: what one of n ranks sends for a collective over S bytes (an all-gather sends what a reduce-scatter
// does; an all-to-all of a rank's S bytes keeps 1/n of them).
int64_t all_reduce_bytes(int64_t s, int64_t n) { return n > 1 ? 2 * (n - 1) * s / n : 0; }
int64_t reduce_scatter_bytes(int64_t s, int64_t n) { return n > 1 ? (n - 1) * s / n : 0; }
int64_t all_to_all_bytes(int64_t s, int64_t n) { return n > 1 ? (n - 1) * s / n : 0; }

// The head counts and intermediate size of one tp rank: the model's own local config (tensor_parallel_config), and
// how many ranks share each of its key/value heads.
struct LocalSizes {
  int64_t heads, kv_heads, intermediate, kv_replicas;
};

LocalSizes local_sizes(const ModelConfig& whole, const ModelConfig& local, int64_t tp) {
  return {local.num_heads, local.num_kv_heads, local.intermediate_size,
          tp * local.num_kv_heads / std::max<int64_t>(whole.num_kv_heads, 1)};
}

// The rows a rank's tensors have for one micro-batch of T tokens.
struct Rows {
  int64_t tokens;  // T
  int64_t block;   // a block's rows (the norms' outputs, the projections, the MLP): T; ceil(T / cp) under cp
  int64_t stream;  // the residual stream's (x, h, a layer's output): block; ceil(block / tp) under sequence parallelism
  int64_t core;    // a mixer core's after cp's head all-to-all: every row, padded to cp x block; T without cp
  int64_t cp;      // the parts of a tp rank's heads in the core (1 without cp)
  int64_t docs;    // documents the core sees: the micro-batch's, and the padding rows' own under cp
};

Rows rows_of(int64_t t, int64_t tp, int64_t cp, bool sp, int64_t docs) {
  Rows r;
  r.tokens = t;
  r.block = ceil_div(t, cp);
  r.stream = sp && tp > 1 ? ceil_div(r.block, tp) : r.block;
  r.core = cp * r.block;
  r.cp = cp;
  r.docs = docs + (r.core > t ? 1 : 0);
  return r;
}

// Parameters outside the layers: the embedding, an untied LM head (both vocab-parallel: `m` is a rank's local config,
// its vocab_size the rank's rows) and the final norm (whole on every rank).
int64_t outside_layer_elements(const ModelConfig& m) {
  return m.vocab_size * m.hidden_size * (m.tie_word_embeddings ? 1 : 2) + m.hidden_size;
}

bool gdn_layer(const ModelConfig& m, int64_t i) {
  return m.is_hybrid() && m.layer_types[size_t(i)] != "full_attention";
}

// Bytes of a dense SwiGLU MLP's or a sparse layer's activations (MlpActs / MoeActs, with the layer's cached route).
int64_t mlp_activation_bytes(const ModelConfig& m, const LocalSizes& l, int64_t i, int64_t t, int64_t b) {
  const int64_t h = m.hidden_size;
  if (!m.sparse_layer(i)) return b * t * (3 * l.intermediate + h);  // gu (T, 2I), act (T, I), out (T, H)
  const int64_t k = m.num_experts_per_tok, p = t * k, im = m.moe_intermediate_size;
  int64_t bytes = b * (p * h + 3 * p * im + t * k * h + t * h);  // xs, gu and act per routed row, picked, out
  bytes += 4 * (t * m.num_experts + 3 * p + 3 * t * k) + b * t * k;  // the route: probs, row ids, weights
  if (m.shared_expert_intermediate_size > 0)
    bytes += b * t * (3 * m.shared_expert_intermediate_size + h + 1);  // sh_gu, sh_act, sh_y, sh_sig
  return bytes;
}

// A tp rank's mixer heads as cp's head all-to-all splits them over the core (CausalLm::heads_to_sequence; qwen3_5.cpp's
// CpChannels): a rank's core takes heads / cp query heads and max(kv / cp, 1) key/value heads (with fewer key/value
// heads than ranks, a head goes to each of the cp / kv ranks whose query heads read it); of a Gated DeltaNet layer
// Hv / cp value heads and the key heads those read, max(Hk / cp, 1). `sent_*`: what a rank puts into the all-to-all per
// row (shared heads once for each rank). Without cp the core is the rank's own heads.
struct CoreHeads {
  int64_t q, kv, sent_kv;          // attention
  int64_t key_width, value_width;  // Gated DeltaNet: a core's key channels (for q and for k) and value channels
  int64_t value_heads;             // Gated DeltaNet value heads in a core
  int64_t width() const { return 2 * key_width + value_width; }  // a core's [q | k | v] channels
};

CoreHeads core_heads(const ModelConfig& m, const LocalSizes& l, int64_t cp) {
  CoreHeads c;
  c.q = l.heads / cp;
  c.kv = std::max<int64_t>(l.kv_heads / cp, 1);
  c.sent_kv = std::max(l.kv_heads, cp);
  c.key_width = std::max<int64_t>(m.linear_num_key_heads / cp, 1) * m.linear_key_head_dim;
  c.value_width = m.linear_num_value_heads * m.linear_value_head_dim / cp;
  c.value_heads = m.linear_num_value_heads / cp;
  return c;
}

// Bytes layer i keeps from its forward for its backward (LayerActs), dtype size b. `chunk_cache`: the CUDA chunked
// Gated DeltaNet kernels save their per-chunk factors too (gdn_chunk_cache_applies).
int64_t layer_activation_bytes(const ModelConfig& m, const LocalSizes& l, int64_t i, const Rows& r, int64_t b,
                               bool chunk_cache) {
  const int64_t h = m.hidden_size, d = m.head_dim, rows = r.block, core = r.core;
  const CoreHeads ch = core_heads(m, l, r.cp);
  // x and h (the stream's rows), xn and hn (the blocks' inputs: gathered whole under sp, the rank's rows under cp)
  const int64_t stream = 2 * b * r.stream * h + 2 * b * rows * h;
  const int64_t mlp = mlp_activation_bytes(m, l, i, rows, b);
  // cp: the attention core's output on the rank's rows for every head (o_rows), a tensor of its own
  const int64_t o_rows = r.cp > 1 ? b * rows * l.heads * d : 0;
  // In the core (every row, the core's heads): qr, kr, v, o; the log-sum-exp in f32.
  const int64_t attn_core = b * core * d * (2 * ch.q + 2 * ch.kv) + 4 * core * ch.q;
  if (!m.is_hybrid()) return stream + b * rows * d * (l.heads + 2 * l.kv_heads) + attn_core + o_rows + mlp;  // + qkv
  if (!gdn_layer(m, i))  // + mix, q, gate, k, sg, y on the rows
    return stream + b * rows * (h + d * (4 * l.heads + l.kv_heads)) + attn_core + o_rows + mlp;
  // Gated DeltaNet. On the rows: mix; z, core, gy. In the core (every row, the rank's channel blocks): qkv and conv;
  // qa, ka, va; qn, kn; b, a, beta and g (at least f32); the chunk-start states ((rows / 64 + documents), its value
  // heads, dk, dv); on CUDA the chunk cache (rows, its value heads, kGdnChunkCacheWidth).
  const int64_t dk = m.linear_key_head_dim, dv = m.linear_value_head_dim;
  const int64_t vd = m.linear_num_value_heads * dv, hv = ch.value_heads;
  const int64_t gate_b = std::max<int64_t>(b, 4);
  const int64_t states = gdn_state_rows(core, r.docs) * hv * dk * dv;
  const int64_t gdn = b * rows * (h + 3 * vd) + b * core * (3 * ch.width() + 2 * ch.key_width + 2 * hv) +
                      gate_b * core * 2 * hv + b * states + (chunk_cache ? b * core * hv * kGdnChunkCacheWidth : 0);
  return stream + gdn + mlp;
}

// What train.recompute_keeps_attention keeps of layer i beside its input: an attention layer's o and log-sum-exp (f32)
// over the core's rows and heads (CausalLm::attend); nothing for a Gated DeltaNet layer.
int64_t kept_attention_bytes(const ModelConfig& m, const LocalSizes& l, int64_t i, const Rows& r, int64_t b) {
  if (m.is_hybrid() && gdn_layer(m, i)) return 0;
  const int64_t q = core_heads(m, l, r.cp).q;
  return b * r.core * m.head_dim * q + 4 * r.core * q;
}

// Whether Gated DeltaNet layers pass states along the cp group instead of taking the head all-to-all: the rank's
// (local) heads are too few for it (Qwen35Model::gdn_passes_states, the same test).
bool gdn_passes_states(const ModelConfig& m, int64_t cp) {
  const int64_t hk = m.linear_num_key_heads, hv = m.linear_num_value_heads;
  return cp > 1 && !(hk % cp == 0 || (cp % hk == 0 && hv % cp == 0));
}

// What train.recompute_keeps_gdn keeps of layer i beside its input: a Gated DeltaNet layer's delta rule output on the
// block's rows, its chunk-start states and (CUDA, `chunk_cache`) its chunk cache, as layer_activation_bytes counts them;
// under cp where the layer passes states along the group (gdn_passes_states) its output and the state it received;
// nothing for an attention layer.
int64_t kept_gdn_bytes(const ModelConfig& m, const LocalSizes& l, int64_t i, const Rows& r, int64_t b,
                       bool chunk_cache, DType dtype) {
  if (!m.is_hybrid() || !gdn_layer(m, i)) return 0;
  if (gdn_passes_states(m, r.cp))
    return b * r.block * m.linear_num_value_heads * m.linear_value_head_dim +
           int64_t(dtype_size(gdn_state_dtype(dtype))) * m.linear_num_value_heads * m.linear_key_head_dim *
               m.linear_value_head_dim;
  const CoreHeads ch = core_heads(m, l, r.cp);
  const int64_t dk = m.linear_key_head_dim, dv = m.linear_value_head_dim, hv = ch.value_heads;
  const int64_t states = gdn_state_rows(r.core, r.docs) * hv * dk * dv;
  return b * r.block * m.linear_num_value_heads * dv + b * states +
         (chunk_cache ? b * r.core * hv * kGdnChunkCacheWidth : 0);
}

// cuDNN's deterministic attention backward's workspace for `docs` documents of a micro-batch of `tokens` (each at most
// data.max_seq_len, the longest rounded up to 128) and `q` query heads: the dP staging and the softmax sums.
int64_t deterministic_attention_staging(const TrainConfig& c, int64_t tokens, int64_t docs, int64_t q) {
  const int64_t longest = ceil_div(std::min(c.max_seq_len, tokens), 128) * 128;
  return docs * q * longest * (2 * longest + 4);
}

// The tiled attention backward's scratch where cuDNN's does not run: two floats a row and query head of the core
// (flash_attention_backward_scratch_floats).
int64_t tiled_attention_scratch(const Rows& r, int64_t q) { return 8 * r.core * q; }

// cuDNN's padded copy for a backward above head dim 128 of documents of unequal lengths (cudnn_attention.cpp,
// pad_inputs): q, o, dO, dq, k, v, dk, dv and the softmax sums as (documents, longest) rows, each block 256-byte
// aligned. The documents are the plan's (max_seq_len tokens each, the rest in one more, and cp's padding rows in their
// own); cuDNN takes the padded batch only where it at most doubles the rows, and the tiled kernel runs otherwise.
// `q`, `kv`: the core's query and key/value heads.
int64_t padded_attention_backward(const TrainConfig& c, const ModelConfig& m, const Rows& r, int64_t q, int64_t kv,
                                  int64_t b) {
  const int64_t longest = std::min(c.max_seq_len, r.tokens);
  const bool uniform = r.docs == 1 || (r.tokens % longest == 0 && r.core == r.tokens);
  if (m.head_dim <= 128 || uniform) return 0;
  const int64_t rows = r.docs * longest;
  if (rows > 2 * r.core) return tiled_attention_scratch(r, q);
  const int64_t q_row = q * m.head_dim * b, kv_row = kv * m.head_dim * b;
  const auto aligned = [](int64_t bytes) { return ceil_div(bytes, 256) * 256; };
  int64_t bytes = 0;
  for (const int64_t row : {q_row, kv_row, kv_row, q_row, 4 * q, q_row, q_row, kv_row, kv_row})
    bytes += aligned(rows * row);
  return bytes;
}

// Scratch that the CUDA kernels of a mixer's core take for their backward (0 on the CPU), for one layer of each kind.
struct CoreScratch {
  int64_t attention = 0, gdn = 0;
};

// `r`'s core on CUDA, for a rank's local layers `m` (bf16 or f16 models):
// - attention: cuDNN's fused backward (bf16/f16, head dim up to 256; cudnn_attention.cpp), whose deterministic engine
//   stages dS in its workspace, B x Hq x S^2 x 2 bytes for B documents of S rows (the longest rounded up to 128),
//   beside the softmax sums B x Hq x S in f32; the documents are taken as max_seq_len tokens each. Where that passes
//   1/16 of the device's memory cuDNN's backward is refused and the tiled kernel runs, with 2 x T x Hq floats. Above
//   head dim 128, documents of unequal lengths add the padded copy (padded_attention_backward). The nondeterministic
//   engine's workspace is not known ahead and not counted.
// - Gated DeltaNet: the chunked kernels' backward workspace (bf16, dk = dv = 128; gated_delta.cu carve_chunked, given
//   the forward's states and chunk cache): per row and value head the f32 dq and dk, the bf16 dDelta and dW and db;
//   per saved state its gradient. Elsewhere the recurrent kernel's (carve_recurrent): f32 state checkpoints, dq and dk
//   and its blocks' token states.
CoreScratch core_scratch(const TrainConfig& c, const ModelConfig& m, const LocalSizes& l, const Rows& r, DType dtype,
                         int64_t device_bytes) {
  CoreScratch s;
  if (!on_cuda(c)) return s;
  const int64_t b = int64_t(dtype_size(dtype));
  const CoreHeads ch = core_heads(m, l, r.cp);
  if (b == 2 && m.head_dim <= 256) {
    const int64_t staging = c.deterministic ? deterministic_attention_staging(c, r.tokens, r.docs, ch.q) : 0;
    // cuDNN's backward is refused where the staging passes 1/16 of the device's memory (cudnn_attention.cpp, prepare):
    // the tiled kernel runs instead.
    s.attention = device_bytes > 0 && staging > device_bytes / 16
                      ? tiled_attention_scratch(r, ch.q)
                      : staging + padded_attention_backward(c, m, r, ch.q, ch.kv, b);
  }
  if (m.is_hybrid()) {
    const int64_t dk = m.linear_key_head_dim, dv = m.linear_value_head_dim, hv = ch.value_heads;
    const int64_t states = gdn_state_rows(r.core, r.docs) * hv * dk * dv;
    if (dtype == DType::BF16 && dk == 128 && dv == 128) {
      s.gdn = r.core * hv * (2 * dv + 10 * dk + 4) + 2 * states;
    } else {
      const int64_t blocks = std::min(r.docs * hv, dk * dv >= 64 * 64 ? int64_t(128) : int64_t(1024));
      constexpr int64_t kCheckpoint = 64;  // tokens between the recurrent backward's state checkpoints
      s.gdn = 4 * (states + 2 * r.core * hv * dk + blocks * ((kCheckpoint + 1) * dk * dv + kCheckpoint * dv));
    }
  }
  return s;
}

// The largest temporaries of layer i's backward besides the gradients: the incoming stream gradient (dout) and either
// the MLP's (dact, dgu) or, after it, the MLP's input gradient and the mixer's input gradient (dhn, dh) with the
// mixer's own: its output's gradient d_o (again in the core's layout under cp), the core's input gradients and the
// kernel's scratch, or the stacked dqkv beside them.
int64_t layer_backward_temporary_bytes(const ModelConfig& m, const LocalSizes& l, int64_t i, const Rows& r, int64_t b,
                                       const CoreScratch& scratch, bool cpu) {
  const int64_t h = m.hidden_size, d = m.head_dim, rows = r.block;
  const CoreHeads ch = core_heads(m, l, r.cp);
  const int64_t inter = m.sparse_layer(i) ? m.num_experts_per_tok * m.moe_intermediate_size : l.intermediate;
  const bool gdn = gdn_layer(m, i);
  // On the rows: the projections' stacked output gradient, and the mixer's output gradient; in the core: its input
  // and output gradients.
  const int64_t qkv = gdn ? 2 * m.linear_num_key_heads * m.linear_key_head_dim +
                                m.linear_num_value_heads * m.linear_value_head_dim
                          : (l.heads + 2 * l.kv_heads) * d;
  const int64_t out = gdn ? m.linear_num_value_heads * m.linear_value_head_dim : l.heads * d;
  const int64_t core_in = gdn ? ch.width() : (ch.q + 2 * ch.kv) * d, core_out = gdn ? ch.value_width : ch.q * d;
  const int64_t dout = b * r.stream * h;
  // dact and dgu; on the CPU swiglu_halves_backward is a composite (ops/composite.cpp) that copies out the gate and up
  // halves and makes their gradients before it writes dgu: four (rows, I) more.
  const int64_t mlp = b * rows * (3 + (cpu && !m.sparse_layer(i) ? 4 : 0)) * inter;
  const int64_t core = b * rows * out + (r.cp > 1 ? b * r.core * core_out : 0) + b * r.core * core_in +
                       (gdn ? scratch.gdn : scratch.attention);
  const int64_t mixer = b * rows * h + b * r.stream * h + std::max(core, b * rows * (2 * qkv + out));
  return dout + std::max(mlp, mixer);
}

// Bytes one rank sends through ep in one micro-batch of a sparse layer of T tokens (CausalLm::tokens_to_experts and
// experts_to_tokens): each token's row (H wide) once to every other rank holding one of its k experts and a row back,
// forward (again when recomputing) and backward. Which ranks those are depends on the router; planned for a uniform
// one: another rank holds none of a token's experts with probability C(E - E/ep, k) / C(E, k). Besides, once: with
// each token sent, its pairs' rows there and weights (2 S f32 values, f64 in an f64 model; S = min(k, E / ep)); and
// the routed pairs' weight gradients (the model dtype) back (the counts' all-gather is E + 2 + ep numbers).
int64_t ep_layer_bytes(const ModelConfig& m, int64_t ep, int64_t t, int64_t b, int64_t forward_passes, DType dtype) {
  const int64_t e = m.num_experts, k = m.num_experts_per_tok, away = e - e / ep, slots = std::min(k, e / ep);
  double none = 1.0;
  for (int64_t i = 0; i < k; ++i) none *= double(away - i) / double(e - i);
  const double tokens = double((ep - 1) * t) * (1.0 - std::max(none, 0.0));  // tokens sent to other ranks
  const int64_t value = dtype == DType::F64 ? 8 : 4;
  return 2 * (forward_passes + 1) * std::llround(tokens * double(b * m.hidden_size)) +
         std::llround(tokens * double(2 * slots * value)) + all_to_all_bytes(t * k * b, ep);
}

// Bytes one rank sends through cp in one micro-batch of layer i, over `forward_passes` forwards (2 when recomputing)
// and a backward. The head all-to-alls, the same tensors each pass (the backward's the other way): attention's q, k,
// v there and o back; Gated DeltaNet's in_proj_qkv output (the rank's blocks for every core) and b, a there and the
// core's output back. A Gated DeltaNet layer that passes states (model/gdn_context.h) instead sends, each forward,
// its conv's last W - 1 input rows (all-gathered) and the rule's final state to the next rank, and in the backward
// the history rows' gradients (all-reduced over every rank's W - 1 rows) and the received state's gradient back.
// `rule_kept` (train.recompute_keeps_gdn on a recomputing layer): the recompute takes the forward's rule output, on the
// rows already, so its core's output is sent back once (and a layer passing states sends its state once).
int64_t layer_cp_bytes(const ModelConfig& m, const LocalSizes& l, int64_t i, const Rows& r, int64_t b,
                       int64_t forward_passes, bool rule_kept, DType dtype) {
  if (r.cp <= 1) return 0;
  const bool gdn = gdn_layer(m, i);
  if (gdn && gdn_passes_states(m, r.cp)) {
    const int64_t history = b * (m.linear_conv_kernel_dim - 1) *
                            (2 * m.linear_num_key_heads * m.linear_key_head_dim +
                             m.linear_num_value_heads * m.linear_value_head_dim);
    const int64_t state = int64_t(dtype_size(gdn_state_dtype(dtype))) * m.linear_num_value_heads *
                          m.linear_key_head_dim * m.linear_value_head_dim;
    const int64_t state_sends = rule_kept ? 1 : forward_passes;  // a recompute taking the kept state sends none
    return forward_passes * reduce_scatter_bytes(r.cp * history, r.cp) + state_sends * state +  // (the all-gather)
           all_reduce_bytes(r.cp * history, r.cp) + state;
  }
  const CoreHeads ch = core_heads(m, l, r.cp);
  const int64_t output = gdn ? m.linear_num_value_heads * m.linear_value_head_dim : 0;
  const int64_t width = gdn ? r.cp * ch.width() + 2 * m.linear_num_value_heads + output
                            : (2 * l.heads + 2 * ch.sent_kv) * m.head_dim;
  const bool once = gdn && rule_kept && forward_passes > 1;
  return (forward_passes + 1) * all_to_all_bytes(b * r.block * width, r.cp) -
         (once ? all_to_all_bytes(b * r.block * output, r.cp) : 0);
}

// What one pipeline rank holds and does: its layers (all of them without pp), the embedding, the head, the most
// micro-batches' activations it keeps at once (in units of its layers' whole: 1F1B keeps pp - rank micro-batches),
// and how many of its virtual stages send the stream forward and its gradient back.
struct StageShare {
  std::vector<int64_t> layers;
  bool embedding = true, head = true;
  double held = 1;
  int64_t sends_forward = 0, sends_backward = 0;
  int64_t held_kept(int64_t kept_all) const { return int64_t(held * double(kept_all) + 0.5); }
};

}  // namespace

ModelConfig planned_model_config(const TrainConfig& c) {
  if (!c.model_path.empty()) return load_model_config(c.model_path);
  nlohmann::json cfg = c.model_config;
  if (!cfg.contains("model_type")) cfg["model_type"] = "qwen3";
  if (!cfg.contains("vocab_size")) cfg["vocab_size"] = data::Tokenizer::from_dir(c.tokenizer).vocab_size();
  return parse_model_config(cfg, "model.config");
}

namespace {

// One pipeline rank's part of a layout (the whole model without pp): its memory and what it sends.
LayoutPlan plan_stage(const TrainConfig& c, const ModelConfig& whole, const PlanLayout& layout, int64_t device_bytes,
                      const StageShare& st) {
  LayoutPlan plan;
  plan.layout = layout;
  const DType dtype = model_dtype(c);
  const int64_t b = int64_t(dtype_size(dtype));
  const ModelConfig local = tensor_parallel_config(whole, int(layout.tp));  // this rank's layers
  const ModelConfig& m = local;
  const int64_t t = c.micro_batch_tokens, h = m.hidden_size, layers = int64_t(st.layers.size());
  const int64_t docs = ceil_div(t, c.max_seq_len);  // documents a packed micro-batch holds, at least
  const Rows rows = rows_of(t, layout.tp, layout.cp, c.sp, docs);
  const LocalSizes l = local_sizes(whole, local, layout.tp);
  const bool lora = c.lora_rank > 0 || !c.tenants.empty();
  // The ranks that hold the same weights (ProcessGroups::weight_replicas): the gradients are summed, and ZeRO cuts the
  // optimizer state, over dp, or dp x cp under context parallelism.
  const int64_t replicas = layout.dp * layout.cp, micro_batches = c.grad_accum;
  const bool zero = layout.zero > 0 && replicas > 1;
  // The CUDA chunked Gated DeltaNet kernels' saved factors (ops.h, gdn_chunk_cache_applies: bf16, dk = dv = 128).
  const bool chunk_cache = on_cuda(c) && dtype == DType::BF16 && m.linear_key_head_dim == 128 &&
                           m.linear_value_head_dim == 128;

  // Parameters, gradients (every trainable parameter's, in the model dtype) and AdamW's states: whole on every cp rank
  // (the tp slice's).
  // Expert parallelism: the rank holds num_experts / ep of every sparse layer's experts (gate_up and down).
  // Pipeline parallelism: the rank's layers; the embedding on the first stage, the final norm and the LM head (a tied
  // one a copy of the embedding) on the last.
  int64_t sparse_layers = 0, layer_elements = 0;
  for (int64_t i : st.layers) {
    sparse_layers += m.sparse_layer(i);
    layer_elements += local.layer_parameter_count(i);
  }
  const int64_t vocab_rows = m.vocab_size * h;
  const int64_t outside = st.embedding && st.head ? outside_layer_elements(m)
                                                  : (st.embedding ? vocab_rows : 0) + (st.head ? vocab_rows + h : 0);
  const int64_t expert_elements = sparse_layers * 3 * m.num_experts * m.moe_intermediate_size * h;
  const int64_t weight_elements =  // the rank's slices and the whole tensors
      layer_elements + outside - (layout.ep > 1 ? expert_elements - expert_elements / layout.ep : 0);
  RankMemory& mem = plan.memory;
  mem.weights = weight_elements * b;
  const int64_t grads = lora ? 0 : mem.weights;  // LoRA: the frozen base has none (adapters: docs/plan.md)
  const int64_t state_bytes = int64_t(adamw_state_bytes_per_element(dtype, dtype_from_name(c.optimizer_states)));
  const int64_t states = lora ? 0 : weight_elements * state_bytes;
  // ZeRO cuts what the dp x cp ranks share over them, and under ep the rank's experts over the edp = dp x cp / ep
  // ranks that hold the same ones.
  const int64_t own = zero && layout.ep > 1 && !lora ? expert_elements / layout.ep : 0;
  const int64_t edp = std::max<int64_t>(1, replicas / layout.ep);
  mem.optimizer = zero ? (states - own * state_bytes) / replicas + own * state_bytes / edp : states;
  const int64_t grad_shard = zero ? (grads - own * b) / replicas + own * b / edp : 0;  // the rank's summed share
  mem.gradients = zero && layout.zero == 2 ? grad_shard : grads;
  // LM head (tied: the embedding) and final norm, on the last stage
  const int64_t head_grad = lora || !st.head ? 0 : m.vocab_size * h * b + h * b;
  const int64_t layer_grad = lora ? 0 : (grads - outside * b) / std::max<int64_t>(layers, 1);
  const int64_t bucket = int64_t(c.bucket_mb * double(kMiB));

  // Activations: every layer's LayerActs, or for a layer that recomputes (train.recompute, train.recompute_layers)
  // its input (the stream's rows; with train.recompute_keeps_attention also its attention outputs, with
  // train.recompute_keeps_gdn its delta rule results), and one recomputed layer's LayerActs.
  // (acts and kept by the rank's layers in order; under pp the other micro-batches' kept activations stay too.)
  std::vector<int64_t> acts(static_cast<size_t>(layers)), kept(static_cast<size_t>(layers));
  for (int64_t k = 0; k < layers; ++k) {
    const int64_t i = st.layers[size_t(k)];
    acts[size_t(k)] = layer_activation_bytes(m, l, i, rows, b, chunk_cache);
    kept[size_t(k)] = !c.recomputes(i) ? acts[size_t(k)]
                      : b * rows.stream * h +
                            (c.recompute_keeps_attention ? kept_attention_bytes(m, l, i, rows, b) : 0) +
                            (c.recompute_keeps_gdn ? kept_gdn_bytes(m, l, i, rows, b, chunk_cache, dtype) : 0);
  }
  int64_t kept_all = 0, recomputed_acts = 0;
  for (int64_t k = 0; k < layers; ++k) {
    kept_all += kept[size_t(k)];
    if (c.recomputes(st.layers[size_t(k)])) recomputed_acts = std::max(recomputed_acts, acts[size_t(k)]);
  }
  const int64_t others_kept = std::max<int64_t>(st.held_kept(kept_all) - kept_all, 0);  // other micro-batches'
  mem.activations = kept_all + others_kept + recomputed_acts;
  // The loss head, on the block's rows (the batch's, or under cp the rank's: CausalLm::head_rows): the final norm's
  // output and stream on the stream's rows, their gather into the block's rows (padded; sp), the labelled rows and their
  // gradient (block rows, H) x2, one chunk's logits and their gradient (rows padded to 64 columns) and its per-row
  // losses.
  const int64_t head_rows = rows.block;
  const int64_t padded_block = rows.stream < rows.block ? layout.tp * rows.stream : rows.block;  // sp's padding
  const int64_t gathered = rows.stream < head_rows ? b * padded_block * h : 0;
  const int64_t chunk = std::min(head_rows, kLossChunkRows), padded_vocab = (m.vocab_size + 63) / 64 * 64;
  mem.loss_head = !st.head ? 0
                            : 2 * b * rows.stream * h + gathered + 2 * b * head_rows * h +
                                  2 * b * chunk * padded_vocab + 4 * chunk;

  // The peak: the step's phases, micro-batch by micro-batch (the second repeats in every later one).
  const int64_t persistent = mem.weights + mem.optimizer + others_kept;
  // What the loss keeps through the backward (DecoderStack::loss): the final norm's output and stream, the last
  // layer's output terms (part of its activations until its backward), the head's input gradient (block rows, H) and,
  // under sp, its rows. (Each layer's input goes with its activations, or with its entry once it recomputed.)
  const int64_t x_bytes = b * rows.stream * h;
  // (A stage without the head: the stream it received or sends, (2, rows, H), and the gradient it got.)
  const int64_t carried =
      st.head ? 2 * x_bytes + b * head_rows * h + (rows.stream < head_rows ? x_bytes : 0) : 3 * x_bytes;
  const CoreScratch scratch = core_scratch(c, m, l, rows, dtype, device_bytes);  // the CUDA kernels' backward scratch
  int64_t peak = persistent;
  for (int64_t mb = 0; mb < std::min<int64_t>(micro_batches, 2); ++mb) {
    const bool first = mb == 0, last = mb + 1 == micro_batches;
    // ZeRO reduces (and drops) whole gradients as the backward completes their buckets: every micro-batch under
    // ZeRO-2, the last under ZeRO-1; otherwise the last micro-batch's buckets are summed through packed buffers.
    const bool reduced_here = zero && (layout.zero == 2 || last);
    const int64_t before = first ? 0 : zero && layout.zero == 2 ? grad_shard : grads;
    // Buckets packed for the sum, at most two in flight (GradReducer, AllReduce: once summed, a bucket's buffer holds
    // its gradients and theirs are freed); a bucket is complete once the backward has passed all of its layers.
    auto in_flight = [&](int64_t complete) {
      return replicas > 1 && !zero && last && !lora ? std::min(2 * bucket, complete / bucket * bucket) : 0;
    };
    auto whole_grads = [&](int64_t made) {  // gradients alive once `made` bytes of them were written this micro-batch
      const int64_t alive = first || (zero && layout.zero == 2) ? made : grads;
      return reduced_here ? std::min(alive, kBucketsAlive * bucket) + (first ? 0 : grad_shard) : alive;
    };
    // The end of the forward and the loss head (the head's gradient is made in its first chunk).
    const int64_t head_made = std::min(head_grad, grads);
    peak = std::max(peak, persistent + std::max(before, whole_grads(head_made)) + kept_all + mem.loss_head);
    // The backward, last layer first: layers 0..i - 1 keep what they kept, layer i its whole activations (recomputed
    // where it recomputes) and the stream's two terms it is given; the gradients up to layer i exist, and the layer's
    // temporaries.
    int64_t kept_below = kept_all;
    for (int64_t k = layers - 1; k >= 0; --k) {  // the rank's k-th layer, layer i of the model
      const int64_t i = st.layers[size_t(k)];
      kept_below -= kept[size_t(k)];
      const int64_t made = head_made + (layers - k) * layer_grad;
      const int64_t above = c.recomputes(i) || k < layers - 1 ? 2 * x_bytes : 0;
      const int64_t live = persistent + std::max(before, whole_grads(made)) + kept_below + acts[size_t(k)] + above +
                           carried + layer_backward_temporary_bytes(m, l, i, rows, b, scratch, c.device == "cpu") +
                           in_flight((layers - 1 - k) * layer_grad);
      peak = std::max(peak, live);
    }
    // The end of the backward: every gradient, the last buckets in flight (the whole gradients when they fit one), the
    // first layer's input gradient and what the loss keeps.
    const int64_t end = persistent + std::max(before, whole_grads(grads)) + 2 * x_bytes + carried;
    peak = std::max(peak, end + (replicas > 1 && !zero && last && !lora ? std::min(2 * bucket, grads) : 0));
  }
  mem.peak = peak;

  // Communication per optimizer step. The gradient sum over the weight replicas, dp (x cp) (ZeRO: reduce-scatter, then
  // the parameters' all-gather).
  // Under ep the experts' gradients are summed over their holders (edp = dp / ep) instead.
  const int64_t rank_experts = layout.ep > 1 ? expert_elements / layout.ep * b : 0;
  const int64_t dp_grads = lora ? 0 : grads - rank_experts;
  const int64_t reductions = layout.zero == 2 ? micro_batches : 1;  // ZeRO: reduce-scatters, then one all-gather
  if (!zero) plan.comm_grads_bytes += all_reduce_bytes(dp_grads, replicas);
  else plan.comm_grads_bytes += (reductions + 1) * reduce_scatter_bytes(dp_grads, replicas);
  if (layout.ep > 1 && !lora && !zero) plan.comm_grads_bytes += all_reduce_bytes(rank_experts, edp);
  else if (layout.ep > 1 && !lora) plan.comm_grads_bytes += (reductions + 1) * reduce_scatter_bytes(rank_experts, edp);
  // tp: each layer's sums of (rows, H) activations and the q/k norm gains' gradients, each micro-batch.
  // A layer's forward passes: the recomputing backward runs the forward's collectives again.
  const auto forward_passes = [&](int64_t i) -> int64_t { return c.recomputes(i) ? 2 : 1; };
  if (layout.tp > 1) {
    const int64_t stream = b * rows.block * h;
    for (int64_t i : st.layers)
      plan.comm_tp_bytes += micro_batches * ((2 * forward_passes(i) + 2) * all_reduce_bytes(stream, layout.tp) +
                                             2 * all_reduce_bytes(b * m.head_dim, layout.tp));
    // The vocab-parallel embedding's rows summed (forward) and the LM head's input gradient (backward), each (block
    // rows, H); the loss's per-row log-sum-exps and label logits are a value a row.
    plan.comm_tp_bytes += micro_batches * ((st.embedding ? all_reduce_bytes(b * rows.block * h, layout.tp) : 0) +
                                           (st.head ? all_reduce_bytes(b * rows.block * h, layout.tp) +
                                                          4 * rows.block * (layout.tp + 2)
                                                    : 0));
    if (l.kv_replicas > 1)  // shared k/v slices' gradients summed over the ranks holding them, once a step
      plan.comm_tp_bytes += layers * all_reduce_bytes(2 * l.kv_heads * m.head_dim * h * b, l.kv_replicas);
  }
  // cp: each mixer's head all-to-alls or passed states (forward, again when recomputing, and backward), each
  // micro-batch (the loss head runs on the rank's rows: only its loss sums, a few values, go over the group; the
  // gradient sum is part of the weight replicas' above).
  if (layout.cp > 1)
    for (int64_t i : st.layers)
      plan.comm_cp_bytes +=
          micro_batches * layer_cp_bytes(m, l, i, rows, b, forward_passes(i), c.recompute_keeps_gdn, dtype);
  if (layout.ep > 1)
    for (int64_t i : st.layers)
      if (m.sparse_layer(i))
        plan.comm_ep_bytes += micro_batches * ep_layer_bytes(m, layout.ep, rows.block, b, forward_passes(i), dtype);
  // pp: each micro-batch's stream (2, rows, H) to the next stage and its gradient (rows, H) to the previous, for each
  // of the rank's virtual stages that has one.
  plan.comm_pp_bytes = micro_batches * (st.sends_forward * 2 + st.sends_backward) * x_bytes;
  // A tied embedding's gradient, held by the first and the last stage, goes to the other once a step.
  if (whole.tie_word_embeddings && st.embedding != st.head && !lora) plan.comm_pp_bytes += vocab_rows * b;
  plan.comm_bytes =
      plan.comm_grads_bytes + plan.comm_tp_bytes + plan.comm_cp_bytes + plan.comm_ep_bytes + plan.comm_pp_bytes;
  return plan;
}

}  // namespace

PipelineLayout planned_pipeline(const TrainConfig& c, const ModelConfig& model, int pp) {
  const bool balanced = c.pp_layers == std::vector<std::string>{"balanced"};
  std::vector<int64_t> counts;
  for (const std::string& n : c.pp_layers)
    if (!balanced) counts.push_back(std::stoll(n));  // digits (config.cpp checks)
  if (!balanced && (!counts.empty() || !model.is_hybrid())) return PipelineLayout(model.num_layers, pp, int(c.vpp), counts);
  return balanced_pipeline_layout(layer_flops_per_token(model, c.max_seq_len), pp, int(c.vpp));
}

LayoutPlan plan_layout(const TrainConfig& c, const ModelConfig& whole, const PlanLayout& layout, int64_t device_bytes) {
  StageShare all;
  for (int64_t i = 0; i < whole.num_layers; ++i) all.layers.push_back(i);
  if (layout.pp <= 1) return plan_stage(c, whole, layout, device_bytes, all);
  // Every pipeline rank's part; the layout's memory is the rank with the highest peak, its communication the most any
  // rank sends.
  const PipelineLayout pl = planned_pipeline(c, whole, int(layout.pp));
  const PipelineTimeline tl = pipeline_timeline(pl, c.grad_accum);
  LayoutPlan plan;
  for (int r = 0; r < pl.pp(); ++r) {
    StageShare st;
    for (int64_t i = 0; i < whole.num_layers; ++i)
      if (pl.rank_holds_layer(r, i)) st.layers.push_back(i);
    st.embedding = pl.holds_embedding(r);
    st.head = pl.holds_head(r);
    // The chunks' shares of the rank's layers, and the most of their forwards the schedule holds at once.
    std::vector<double> chunk_share(size_t(pl.vpp()));
    for (int ch = 0; ch < pl.vpp(); ++ch) {
      const int v = pl.stage(r, ch);
      chunk_share[size_t(ch)] = double(pl.end_layer(v) - pl.first_layer(v)) / double(st.layers.size());
      st.sends_forward += v + 1 < pl.stages();
      st.sends_backward += v > 0;
    }
    double held = 0;
    for (const PipeTick& tick : tl.ticks) {
      if (tick.action[size_t(r)] < 0) continue;
      const PipeAction& a = tl.orders[size_t(r)][size_t(tick.action[size_t(r)])];
      held += (a.op == PipeOp::Forward ? 1 : -1) * chunk_share[size_t(a.chunk)];
      st.held = std::max(st.held, held);
    }
    LayoutPlan stage = plan_stage(c, whole, layout, device_bytes, st);
    if (r == 0 || stage.memory.peak > plan.memory.peak) {
      const std::vector<RankMemory> stages = std::move(plan.stages);
      const int64_t most_sent = std::max(plan.comm_bytes, stage.comm_bytes);
      plan = stage;
      plan.stages = stages;
      plan.heaviest_stage = r;
      plan.comm_bytes = most_sent;
    } else {
      plan.comm_bytes = std::max(plan.comm_bytes, stage.comm_bytes);
    }
    plan.stages.push_back(stage.memory);
  }
  return plan;
}

std::vector<std::string> layout_overrides(const PlanLayout& layout) {
  return {fmt::format("parallel.tp={}", layout.tp), fmt::format("parallel.cp={}", layout.cp),
          fmt::format("parallel.dp={}", layout.dp), fmt::format("parallel.zero={}", layout.zero),
          fmt::format("parallel.ep={}", layout.ep), fmt::format("parallel.pp={}", layout.pp)};
}

namespace {

// The notes of TrainingPlan for the configured layout (docs/parallel.md, "Long documents"; the thresholds are the
// kernels' own: cudnn_attention.cpp's 1/16 of the device for the deterministic backward's dP staging).
std::vector<std::string> speed_notes(const TrainConfig& c, const ModelConfig& whole, int64_t device_bytes) {
  std::vector<std::string> notes;
  const DType dtype = model_dtype(c);
  const bool half = dtype == DType::BF16 || dtype == DType::F16;
  if (!on_cuda(c) || !half || whole.num_heads == 0) return notes;
  const int64_t s = c.max_seq_len, q = std::max<int64_t>(whole.num_heads / (c.tp * c.cp), 1);
  const int64_t staging =
      deterministic_attention_staging(c, c.micro_batch_tokens, ceil_div(c.micro_batch_tokens, s), q);
  if (c.deterministic && whole.head_dim <= 256 && device_bytes > 0 && staging > device_bytes / 16)
    notes.push_back(fmt::format("attention backward: cuDNN's deterministic backward would stage {:.1f} GiB for a "
                                "micro-batch of {}-token documents (above 1/16 of the device), so the tiled kernel "
                                "runs it; train.deterministic: false takes cuDNN's accumulating backward (no "
                                "staging: 24% -> 39% MFU for the Qwen3-1.7B shape at 65,536 tokens on an H200)",
                                double(staging) / double(int64_t(1) << 30), s));
  if (c.recompute && !c.recompute_keeps_attention && s >= 16384)
    notes.push_back(fmt::format("train.recompute runs every attention layer's forward again in the backward; "
                                "train.recompute_keeps_attention: true keeps their outputs instead (about one layer "
                                "input's size more a layer), worth it at {} tokens a document", s));
  return notes;
}

// Under train.recompute, where the configured layout fits: the fewest layers that must recompute for it to fit with
// kTightShare of the memory to spare (the first N: train.recompute_layers), when fewer than now.
void recompute_note(TrainingPlan& plan, const TrainConfig& c,
                    const std::function<TrainConfig(const PlanLayout&)>& config_at) {
  const auto configured = std::find_if(plan.layouts.begin(), plan.layouts.end(),
                                       [](const LayoutPlan& l) { return l.configured; });
  if (!c.recompute || configured == plan.layouts.end() || !configured->fits) return;
  const int64_t layers = plan.model.num_layers, now = c.recompute_layers < 0 ? layers : c.recompute_layers;
  TrainConfig at = config_at(configured->layout);
  for (int64_t n = 0; n < now; ++n) {
    at.recompute_layers = n;
    const LayoutPlan lp = plan_layout(at, plan.model, configured->layout, plan.memory_bytes);
    if (double(lp.memory.peak) > (1.0 - kTightShare) * double(plan.memory_bytes)) continue;
    const std::string setting = n == 0 ? "train.recompute: false (no layer recomputes)"
                                       : fmt::format("train.recompute_layers: {} (the first {} of the {} layers "
                                                     "recompute, the others keep their activations)", n, n, layers);
    plan.notes.push_back(fmt::format("{} still fits this layout, at a peak of {:.1f} GiB a rank against {:.1f} GiB "
                                     "now: a recomputing layer runs its forward twice",
                                     setting, double(lp.memory.peak) / double(int64_t(1) << 30),
                                     double(configured->memory.peak) / double(int64_t(1) << 30)));
    return;
  }
}

}  // namespace

TrainingPlan plan_layouts(const TrainConfig& c, int64_t nproc, int64_t memory_bytes,
                          const std::function<TrainConfig(const PlanLayout&)>& config_at) {
  LATHE_CHECK(nproc >= 1, "plan: --nproc must be at least 1 (got {})", nproc);
  // The configured layout must fill the N ranks (the trainer's own check of the grid).
  const ParallelGrid configured(int(nproc), ParallelSizes{int(c.tp), int(c.cp), int(c.ep), int(c.dp), int(c.pp)});
  TrainingPlan plan;
  plan.nproc = nproc;
  plan.memory_bytes = memory_bytes;
  plan.model = planned_model_config(c);
  plan.notes = speed_notes(c, plan.model, memory_bytes);
  for (int64_t tp = 1; tp <= nproc; ++tp) {
    if (nproc % tp != 0) continue;
    for (int64_t cp = 1; cp <= nproc / tp; ++cp) {
      if (nproc / tp % cp != 0) continue;
      for (int64_t pp = 1; pp <= nproc / tp / cp; ++pp) {
      if (nproc / tp / cp % pp != 0) continue;
      const int64_t dp = nproc / tp / cp / pp;
      for (int64_t zero = 0; zero <= (dp * cp > 1 ? 2 : 0); ++zero)
      for (int64_t ep = 1; ep <= dp * cp; ++ep) {  // over the dp x cp ranks; under cp a multiple of it
        if (dp * cp % ep != 0 || (ep > 1 && (plan.model.num_experts == 0 || plan.model.num_experts % ep != 0)) ||
            (ep > 1 && cp > 1 && ep % cp != 0))
          continue;
        const PlanLayout layout{tp, cp, dp, zero, ep, pp};
        std::string refused;
        TrainConfig at = c;
        try {
          at = config_at(layout);
          check_tensor_parallel(plan.model, int(tp));
          check_context_parallel(plan.model, int(tp), int(cp));
          if (pp > 1) planned_pipeline(at, plan.model, int(pp));  // enough layers for the stages
        } catch (const Error& e) {
          refused = e.what();
        }
        LayoutPlan lp;
        if (refused.empty()) lp = plan_layout(at, plan.model, layout, memory_bytes);
        lp.layout = layout;
        lp.refused = refused;
        lp.configured = tp == configured.sizes().tp && cp == configured.sizes().cp && dp == configured.sizes().dp &&
                        zero == c.zero && ep == configured.sizes().ep && pp == configured.sizes().pp;
        lp.fits = refused.empty() && lp.memory.peak <= memory_bytes;
        lp.tight = lp.fits && double(lp.memory.peak) > (1.0 - kTightShare) * double(memory_bytes);
        plan.layouts.push_back(std::move(lp));
      }
      }
    }
  }
  recompute_note(plan, c, config_at);
  return plan;
}

namespace {

std::string bytes_text(int64_t bytes) {
  const double mib = double(bytes) / double(kMiB);
  return mib >= 1024 ? fmt::format("{:.2f} GiB", mib / 1024) : fmt::format("{:.1f} MiB", mib);
}

std::string layout_name(const PlanLayout& l) {
  std::string name = l.ep > 1 ? fmt::format("tp={} cp={} ep={} dp={} zero={}", l.tp, l.cp, l.ep, l.dp, l.zero)
                              : fmt::format("tp={} cp={} dp={} zero={}", l.tp, l.cp, l.dp, l.zero);
  return l.pp > 1 ? name + fmt::format(" pp={}", l.pp) : name;
}

// A refusal's first problem, on one line ("config: 1 problem in X:\n  - parallel.tp: ..." -> "parallel.tp: ...").
std::string short_reason(const std::string& why) {
  const size_t item = why.find("\n  - ");
  std::string first = item == std::string::npos ? why : why.substr(item + 5);
  const size_t end = first.find('\n');
  return end == std::string::npos ? first : first.substr(0, end);
}

}  // namespace

std::string format_plan(const TrainingPlan& plan) {
  std::string out = fmt::format("lathe plan: {} ({} parameters), {} ranks, {} per rank\n", plan.model.model_type,
                                plan.model.parameter_count(), plan.nproc, bytes_text(plan.memory_bytes));
  out += fmt::format("  {:<30} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>10} {:>12}\n", "layout", "weights",
                     "gradients", "optimizer", "activations", "loss head", "peak", "fits", "comm/step");
  std::vector<std::string> fitting;
  for (const LayoutPlan& l : plan.layouts) {
    const std::string name = (l.configured ? "* " : "  ") + layout_name(l.layout);
    if (!l.refused.empty()) {
      out += fmt::format("{:<32} refused: {}\n", name, short_reason(l.refused));
      continue;
    }
    const RankMemory& m = l.memory;
    out += fmt::format("{:<32} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>10} {:>12}\n", name, bytes_text(m.weights),
                       bytes_text(m.gradients), bytes_text(m.optimizer), bytes_text(m.activations),
                       bytes_text(m.loss_head), bytes_text(m.peak), l.tight ? "tight" : l.fits ? "fits" : "DOES NOT",
                       bytes_text(l.comm_bytes));
    if (l.fits) fitting.push_back(layout_name(l.layout) + (l.tight ? " (tight)" : ""));
  }
  out += fmt::format("  (* the configured layout; memory per rank; comm: bytes each rank sends per optimizer step; "
                     "tight: fits with less than {:.0f}% of the memory to spare, and the allocator may stall the "
                     "steps)\n", kTightShare * 100);
  out += fitting.empty() ? "no layout fits\n" : fmt::format("fits: {}\n", fmt::join(fitting, "; "));
  for (const std::string& note : plan.notes) out += "note: " + note + "\n";
  return out;
}

nlohmann::json plan_to_json(const TrainingPlan& plan) {
  nlohmann::json j = {{"nproc", plan.nproc},
                      {"memory_bytes", plan.memory_bytes},
                      {"model_type", plan.model.model_type},
                      {"parameters", plan.model.parameter_count()},
                      {"layouts", nlohmann::json::array()},
                      {"notes", plan.notes}};
  for (const LayoutPlan& l : plan.layouts) {
    const RankMemory& m = l.memory;
    nlohmann::json row = {{"tp", l.layout.tp}, {"cp", l.layout.cp}, {"dp", l.layout.dp}, {"zero", l.layout.zero},
                          {"ep", l.layout.ep}, {"pp", l.layout.pp},
                          {"configured", l.configured}, {"refused", l.refused.empty() ? nlohmann::json() : nlohmann::json(l.refused)},
                          {"weights_bytes", m.weights}, {"gradients_bytes", m.gradients},
                          {"optimizer_bytes", m.optimizer}, {"activations_bytes", m.activations},
                          {"loss_head_bytes", m.loss_head}, {"peak_bytes", m.peak},
                          {"comm_bytes_per_step", l.comm_bytes},
                          {"comm_bytes_per_step_by_group", {{"grads", l.comm_grads_bytes}, {"tp", l.comm_tp_bytes},
                                                            {"cp", l.comm_cp_bytes}, {"ep", l.comm_ep_bytes},
                                                            {"pp", l.comm_pp_bytes}}},
                          {"fits", l.fits}, {"tight", l.tight}};
    if (!l.stages.empty()) {  // pipeline parallelism: every pipeline rank's peak, and which one is the layout's
      row["heaviest_stage"] = l.heaviest_stage;
      for (const RankMemory& st : l.stages) row["stage_peak_bytes"].push_back(st.peak);
    }
    j["layouts"].push_back(std::move(row));
  }
  return j;
}

}  // namespace lathe
