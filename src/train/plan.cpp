// The layout planner (plan.h; formulas in words: docs/plan.md). Sizes follow what the layer code keeps: Qwen3's and
// Qwen3.5's LayerActs (model/qwen3.cpp, model/qwen3_5.cpp), MlpActs and MoeActs (model/moe_layer.h), the loss head
// (CausalLm::head_loss), the parameters each tp rank holds (Qwen3Model's shard_over_tp calls) and AdamW's states.
#include "train/plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/dtype.h"
#include "core/error.h"
#include "data/tokenizer.h"
#include "model/causal_lm.h"
#include "optim/adamw.h"
#include "parallel/grid.h"

namespace lathe {

namespace {

constexpr int64_t kMiB = int64_t(1) << 20;
constexpr int64_t kLossChunkRows = 2048;  // ModelOptions::loss_chunk_rows, the trainer's
constexpr int64_t kGdnChunk = 64;         // gated_delta_rule saves one state per 64-token chunk (ops/op_table.h)
constexpr int64_t kBucketsAlive = 3;      // gradient buckets alive at once: the one filling and two in flight

DType model_dtype(const TrainConfig& c) {
  if (!c.dtype.empty()) return dtype_from_name(c.dtype);
  return c.device == "cpu" ? DType::F32 : DType::BF16;
}

// Ring volumes: what one of n ranks sends for a collective over S bytes.
int64_t all_reduce_bytes(int64_t s, int64_t n) { return n > 1 ? 2 * (n - 1) * s / n : 0; }
int64_t reduce_scatter_bytes(int64_t s, int64_t n) { return n > 1 ? (n - 1) * s / n : 0; }

// The head counts and intermediate size of one tp rank: the model's own local config (tensor_parallel_config), and
// how many ranks share each of its key/value heads.
struct LocalSizes {
  int64_t heads, kv_heads, intermediate, kv_replicas;
};

LocalSizes local_sizes(const ModelConfig& whole, const ModelConfig& local, int64_t tp) {
  return {local.num_heads, local.num_kv_heads, local.intermediate_size,
          tp * local.num_kv_heads / std::max<int64_t>(whole.num_kv_heads, 1)};
}

// Parameters outside the layers: the embedding, an untied LM head (both vocab-parallel: `m` is a rank's local config,
// its vocab_size the rank's rows) and the final norm (whole on every rank).
int64_t outside_layer_elements(const ModelConfig& m) {
  return m.vocab_size * m.hidden_size * (m.tie_word_embeddings ? 1 : 2) + m.hidden_size;
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

// Bytes layer i keeps from its forward for its backward (LayerActs), T tokens of dtype size b; `stream_parts`: the
// ranks the residual stream's rows are split over (tp under sequence parallelism, else 1).
int64_t layer_activation_bytes(const ModelConfig& m, const LocalSizes& l, int64_t i, int64_t t, int64_t b,
                               int64_t docs, int64_t stream_parts) {
  const int64_t h = m.hidden_size, d = m.head_dim;
  // x and h (the stream's rows), xn and hn (the blocks' whole inputs, gathered under sp)
  const int64_t stream = 2 * b * ((t + stream_parts - 1) / stream_parts) * h + 2 * b * t * h;
  const int64_t mlp = mlp_activation_bytes(m, l, i, t, b);
  if (!m.is_hybrid()) {
    // qkv, qr, kr, v, o; lse in f32
    const int64_t attn = b * t * d * (2 * (l.heads + 2 * l.kv_heads) + l.heads) + 4 * t * l.heads;
    return stream + attn + mlp;
  }
  if (m.layer_types[size_t(i)] == "full_attention") {
    // mix; q, gate, k, v; qr, kr; o, sg, y; lse in f32
    const int64_t attn = b * t * (h + d * (6 * l.heads + 3 * l.kv_heads) + d * l.kv_heads) + 4 * t * l.heads;
    return stream + attn + mlp;
  }
  // Gated DeltaNet: mix; qkv and conv (T, 2K + V); qa, ka, va; qn, kn; z; core, gy; b, a, beta, g (T, Hv); the
  // chunk-start states (T / 64 + docs, Hv, dk, dv)
  const int64_t kd = m.linear_num_key_heads * m.linear_key_head_dim;
  const int64_t vd = m.linear_num_value_heads * m.linear_value_head_dim, hv = m.linear_num_value_heads;
  const int64_t gate_b = std::max<int64_t>(b, 4);  // beta and g at least f32
  const int64_t states = (t / kGdnChunk + docs) * hv * m.linear_key_head_dim * m.linear_value_head_dim;
  const int64_t gdn = b * t * (h + 2 * (2 * kd + vd) + (2 * kd + vd) + 2 * kd + 3 * vd + 2 * hv) +
                      gate_b * t * 2 * hv + b * states;
  return stream + gdn + mlp;
}

// The largest temporaries of a layer's backward besides the stream gradients: the MLP's (dact, dgu) or the
// attention's (d_o, dq, dk, dv and the stacked dqkv).
int64_t layer_backward_temporary_bytes(const ModelConfig& m, const LocalSizes& l, int64_t i, int64_t t, int64_t b) {
  const int64_t inter = m.sparse_layer(i) ? m.num_experts_per_tok * m.moe_intermediate_size : l.intermediate;
  const int64_t qkv = m.is_hybrid() && m.layer_types[size_t(i)] != "full_attention"
                          ? 2 * m.linear_num_key_heads * m.linear_key_head_dim +
                                m.linear_num_value_heads * m.linear_value_head_dim
                          : (l.heads + 2 * l.kv_heads) * m.head_dim;
  return b * t * std::max(3 * inter, 2 * qkv + l.heads * m.head_dim);
}

}  // namespace

ModelConfig planned_model_config(const TrainConfig& c) {
  if (!c.model_path.empty()) return load_model_config(c.model_path);
  nlohmann::json cfg = c.model_config;
  if (!cfg.contains("model_type")) cfg["model_type"] = "qwen3";
  if (!cfg.contains("vocab_size")) cfg["vocab_size"] = data::Tokenizer::from_dir(c.tokenizer).vocab_size();
  return parse_model_config(cfg, "model.config");
}

LayoutPlan plan_layout(const TrainConfig& c, const ModelConfig& whole, const PlanLayout& layout) {
  LayoutPlan plan;
  plan.layout = layout;
  const DType dtype = model_dtype(c);
  const int64_t b = int64_t(dtype_size(dtype));
  const ModelConfig local = tensor_parallel_config(whole, int(layout.tp));  // this rank's layers
  const ModelConfig& m = local;
  const int64_t t = c.micro_batch_tokens, h = m.hidden_size, layers = m.num_layers;
  const int64_t docs = (t + c.max_seq_len - 1) / c.max_seq_len;  // documents a packed micro-batch holds, at least
  const LocalSizes l = local_sizes(whole, local, layout.tp);
  const bool lora = c.lora_rank > 0 || !c.tenants.empty();
  const int64_t dp = layout.dp, micro_batches = c.grad_accum;
  const bool zero = layout.zero > 0 && dp > 1;

  // Parameters, gradients (every trainable parameter's, in the model dtype) and AdamW's states.
  const int64_t weight_elements = local.parameter_count();  // the rank's slices and the whole tensors
  RankMemory& mem = plan.memory;
  mem.weights = weight_elements * b;
  const int64_t grads = lora ? 0 : mem.weights;  // LoRA: the frozen base has none (adapters: docs/plan.md)
  const int64_t states =
      lora ? 0 : weight_elements * int64_t(adamw_state_bytes_per_element(dtype, dtype_from_name(c.optimizer_states)));
  mem.optimizer = zero ? states / dp : states;
  mem.gradients = zero && layout.zero == 2 ? grads / dp : grads;
  const int64_t grad_shard = zero ? grads / dp : 0;  // ZeRO: the rank's summed share, after the first reduction
  const int64_t head_grad = lora ? 0 : m.vocab_size * h * b + h * b;  // LM head (tied: the embedding) and final norm
  const int64_t layer_grad = lora ? 0 : (grads - outside_layer_elements(m) * b) / std::max<int64_t>(layers, 1);
  const int64_t bucket = int64_t(c.bucket_mb * double(kMiB));

  // Activations: every layer's LayerActs, or under recomputation each layer's input and one layer recomputed.
  std::vector<int64_t> acts(static_cast<size_t>(layers)), kept(static_cast<size_t>(layers));
  for (int64_t i = 0; i < layers; ++i) {
    acts[size_t(i)] = layer_activation_bytes(m, l, i, t, b, docs, c.sp ? layout.tp : 1);
    kept[size_t(i)] = c.recompute ? b * t * h : acts[size_t(i)];
  }
  int64_t kept_all = 0;
  for (int64_t a : kept) kept_all += a;
  mem.activations = kept_all + (c.recompute ? *std::max_element(acts.begin(), acts.end()) : 0);
  // The loss head: the final norm's output and stream (T, H) x2, the labelled rows and their gradient (T, H) x2, one
  // chunk's logits and their gradient (rows padded to 64 columns) and its per-row losses.
  const int64_t chunk = std::min(t, kLossChunkRows), padded_vocab = (m.vocab_size + 63) / 64 * 64;
  mem.loss_head = 4 * b * t * h + 2 * b * chunk * padded_vocab + 4 * chunk;

  // The peak: the step's phases, micro-batch by micro-batch (the second repeats in every later one).
  const int64_t persistent = mem.weights + mem.optimizer;
  const int64_t stream = b * t * h;
  int64_t peak = persistent;
  for (int64_t mb = 0; mb < std::min<int64_t>(micro_batches, 2); ++mb) {
    const bool first = mb == 0, last = mb + 1 == micro_batches;
    // ZeRO reduces (and drops) whole gradients as the backward completes their buckets: every micro-batch under
    // ZeRO-2, the last under ZeRO-1; plain dp sums the last micro-batch's buckets through packed buffers.
    const bool reduced_here = zero && (layout.zero == 2 || last);
    const int64_t before = first ? 0 : zero && layout.zero == 2 ? grad_shard : grads;
    const int64_t dp_buffers = dp > 1 && !zero && last && !lora ? 2 * std::min(grads, 2 * bucket) : 0;
    auto whole_grads = [&](int64_t made) {  // gradients alive once `made` bytes of them were written this micro-batch
      const int64_t alive = first || (zero && layout.zero == 2) ? made : grads;
      return reduced_here ? std::min(alive, kBucketsAlive * bucket) + (first ? 0 : grad_shard) : alive;
    };
    // The end of the forward and the loss head (the head's gradient is made in its first chunk).
    const int64_t head_made = std::min(head_grad, grads);
    peak = std::max(peak, persistent + std::max(before, whole_grads(head_made)) + kept_all + mem.loss_head);
    // The backward, last layer first: layers 0..i keep their activations (layer i whole), gradients up to layer i
    // exist, and the stream's gradient with the layer's temporaries.
    int64_t kept_below = kept_all;
    for (int64_t i = layers - 1; i >= 0; --i) {
      kept_below -= kept[size_t(i)];
      const int64_t made = head_made + (layers - i) * layer_grad;
      const int64_t live = persistent + std::max(before, whole_grads(made)) + kept_below + acts[size_t(i)] +
                           2 * stream + layer_backward_temporary_bytes(m, l, i, t, b) + dp_buffers;
      peak = std::max(peak, live);
    }
  }
  mem.peak = peak;

  // Communication per optimizer step: the dp gradient sum (ZeRO: reduce-scatter, then the parameters' all-gather) and
  // tp's per-layer sums of (T, H) activations and the q/k norm gains' gradients, each micro-batch.
  const int64_t dp_grads = lora ? 0 : grads;
  if (!zero) plan.comm_bytes += all_reduce_bytes(dp_grads, dp);
  else
    plan.comm_bytes += (layout.zero == 2 ? micro_batches : 1) * reduce_scatter_bytes(dp_grads, dp) +
                       reduce_scatter_bytes(mem.weights, dp);  // an all-gather sends what a reduce-scatter does
  if (layout.tp > 1) {
    const int64_t forward_sums = c.recompute ? 4 : 2;  // the recomputing backward runs the forward's sums again
    const int64_t per_layer =
        (forward_sums + 2) * all_reduce_bytes(stream, layout.tp) + 2 * all_reduce_bytes(b * m.head_dim, layout.tp);
    plan.comm_bytes += micro_batches * layers * per_layer;
    // The vocab-parallel embedding's rows summed (forward) and the LM head's input gradient (backward), each (T, H);
    // the loss's per-row log-sum-exps and label logits are T values a chunk.
    plan.comm_bytes += micro_batches * (2 * all_reduce_bytes(stream, layout.tp) + 4 * t * (layout.tp + 2));
    if (l.kv_replicas > 1)  // shared k/v slices' gradients summed over the ranks holding them, once a step
      plan.comm_bytes += layers * all_reduce_bytes(2 * l.kv_heads * m.head_dim * h * b, l.kv_replicas);
  }
  return plan;
}

std::vector<std::string> layout_overrides(const PlanLayout& layout) {
  return {fmt::format("parallel.tp={}", layout.tp), fmt::format("parallel.dp={}", layout.dp),
          fmt::format("parallel.zero={}", layout.zero)};
}

TrainingPlan plan_layouts(const TrainConfig& c, int64_t nproc, int64_t memory_bytes,
                          const std::function<TrainConfig(const PlanLayout&)>& config_at) {
  LATHE_CHECK(nproc >= 1, "plan: --nproc must be at least 1 (got {})", nproc);
  // The configured layout must fill the N ranks (the trainer's own check of the grid).
  const ParallelGrid configured(int(nproc), ParallelSizes{int(c.tp), int(c.cp), int(c.ep), int(c.dp), int(c.pp)});
  TrainingPlan plan;
  plan.nproc = nproc;
  plan.memory_bytes = memory_bytes;
  plan.model = planned_model_config(c);
  for (int64_t tp = 1; tp <= nproc; ++tp) {
    if (nproc % tp != 0) continue;
    const int64_t dp = nproc / tp;
    for (int64_t zero = 0; zero <= (dp > 1 ? 2 : 0); ++zero) {
      const PlanLayout layout{tp, dp, zero};
      std::string refused;
      TrainConfig at = c;
      try {
        at = config_at(layout);
        check_tensor_parallel(plan.model, int(tp));
      } catch (const Error& e) {
        refused = e.what();
      }
      LayoutPlan lp;
      if (refused.empty()) lp = plan_layout(at, plan.model, layout);
      lp.layout = layout;
      lp.refused = refused;
      lp.configured = tp == configured.sizes().tp && dp == configured.sizes().dp && zero == c.zero;
      lp.fits = refused.empty() && lp.memory.peak <= memory_bytes;
      plan.layouts.push_back(std::move(lp));
    }
  }
  return plan;
}

namespace {

std::string bytes_text(int64_t bytes) {
  const double mib = double(bytes) / double(kMiB);
  return mib >= 1024 ? fmt::format("{:.2f} GiB", mib / 1024) : fmt::format("{:.1f} MiB", mib);
}

std::string layout_name(const PlanLayout& l) { return fmt::format("tp={} dp={} zero={}", l.tp, l.dp, l.zero); }

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
  out += fmt::format("  {:<20} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>10} {:>12}\n", "layout", "weights",
                     "gradients", "optimizer", "activations", "loss head", "peak", "fits", "comm/step");
  std::vector<std::string> fitting;
  for (const LayoutPlan& l : plan.layouts) {
    const std::string name = (l.configured ? "* " : "  ") + layout_name(l.layout);
    if (!l.refused.empty()) {
      out += fmt::format("{:<22} refused: {}\n", name, short_reason(l.refused));
      continue;
    }
    const RankMemory& m = l.memory;
    out += fmt::format("{:<22} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>10} {:>12}\n", name, bytes_text(m.weights),
                       bytes_text(m.gradients), bytes_text(m.optimizer), bytes_text(m.activations),
                       bytes_text(m.loss_head), bytes_text(m.peak), l.fits ? "fits" : "DOES NOT", bytes_text(l.comm_bytes));
    if (l.fits) fitting.push_back(layout_name(l.layout));
  }
  out += "  (* the configured layout; memory per rank; comm: bytes each rank sends per optimizer step)\n";
  out += fitting.empty() ? "no layout fits\n" : fmt::format("fits: {}\n", fmt::join(fitting, "; "));
  return out;
}

nlohmann::json plan_to_json(const TrainingPlan& plan) {
  nlohmann::json j = {{"nproc", plan.nproc},
                      {"memory_bytes", plan.memory_bytes},
                      {"model_type", plan.model.model_type},
                      {"parameters", plan.model.parameter_count()},
                      {"layouts", nlohmann::json::array()}};
  for (const LayoutPlan& l : plan.layouts) {
    const RankMemory& m = l.memory;
    nlohmann::json row = {{"tp", l.layout.tp}, {"dp", l.layout.dp}, {"zero", l.layout.zero},
                          {"configured", l.configured}, {"refused", l.refused.empty() ? nlohmann::json() : nlohmann::json(l.refused)},
                          {"weights_bytes", m.weights}, {"gradients_bytes", m.gradients},
                          {"optimizer_bytes", m.optimizer}, {"activations_bytes", m.activations},
                          {"loss_head_bytes", m.loss_head}, {"peak_bytes", m.peak},
                          {"comm_bytes_per_step", l.comm_bytes}, {"fits", l.fits}};
    j["layouts"].push_back(std::move(row));
  }
  return j;
}

}  // namespace lathe
