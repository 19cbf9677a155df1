// Qwen3 forward and backward. Shapes: T tokens, H hidden, Hq/Hkv heads of D, I intermediate, V vocab.
#include "model/qwen3.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <tuple>

#include "io/safetensors.h"
#include "model/decoder_stack.h"
#include "model/lora.h"
#include "ops/ops.h"

namespace lathe {

namespace fs = std::filesystem;

struct Qwen3Model::LayerActs {
  Tensor x;        // (T, H) layer input (the sum of the stream it was given)
  Tensor xn;       // (T, H) input RMSNorm
  Tensor qkv;      // (T, (Hq + 2 Hkv) D) the q, k and v projections side by side (q, k before their RMSNorm)
  Tensor qr, kr;   // (T, Hq, D), (T, Hkv, D) normed and rotated
  Tensor v;        // (T, Hkv, D) v's heads
  Tensor o, lse;   // (T, Hq, D) attention output, (T, Hq) f32 log-sum-exp
  // Context parallelism: qr, kr, v, o and lse are every row's for the rank's cp-th of the heads (the all-to-all's
  // layout, what attention and its backward take); o_rows is o for the rank's rows and every head (o_proj's input).
  Tensor o_rows;
  Tensor h;        // (T, H) after the attention residual
  Tensor hn;       // (T, H) post-attention RMSNorm
  MlpActs mlp;     // the MLP's (dense or experts)
  ResidualStream out;  // the layer output h + mlp.out, added in the next norm
};

namespace {

const std::vector<LoraTarget> kQkv = {LoraTarget::q_proj, LoraTarget::k_proj, LoraTarget::v_proj};

QkNormRopeAttrs qk_attrs(const ModelConfig& c) {
  return {c.num_heads, c.num_kv_heads, NormAttrs{c.rms_norm_eps, 0.0}, RopeAttrs{c.rope_theta, 0, false}};
}

}  // namespace

Qwen3Model::Qwen3Model(Runtime& rt, ModelConfig config, ModelOptions options)
    : CausalLm(rt, std::move(config), options) {
  LATHE_CHECK(config_.model_type == "qwen3" || config_.model_type == "qwen3_moe",
              "model: Qwen3Model needs a qwen3 or qwen3_moe config, got model_type '{}'", config_.model_type);
  build_parameter_list();
}

void Qwen3Model::build_parameter_list() {
  const ModelConfig& c = config_;
  const int64_t q_out = c.num_heads * c.head_dim, kv_out = c.num_kv_heads * c.head_dim;
  // Pipeline parallelism: `here` says whether this rank holds what is declared next (declare).
  bool here = holds_embedding() || (holds_head() && c.tie_word_embeddings);
  auto add = [&](std::string name, Shape shape) { return declare(std::move(name), std::move(shape), here); };
  std::vector<Layer> elsewhere;  // another pipeline stage's layers: declared, not held
  embed_ = add("model.embed_tokens.weight", {c.vocab_size, c.hidden_size});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    here = holds_layer(i);
    const std::string p = fmt::format("model.layers.{}.", i);
    Layer l{};
    l.index = i;
    l.input_norm = add(p + "input_layernorm.weight", {c.hidden_size});
    l.q_proj = add(p + "self_attn.q_proj.weight", {q_out, c.hidden_size});
    l.k_proj = add(p + "self_attn.k_proj.weight", {kv_out, c.hidden_size});
    l.v_proj = add(p + "self_attn.v_proj.weight", {kv_out, c.hidden_size});
    l.o_proj = add(p + "self_attn.o_proj.weight", {c.hidden_size, q_out});
    l.q_norm = add(p + "self_attn.q_norm.weight", {c.head_dim});
    l.k_norm = add(p + "self_attn.k_norm.weight", {c.head_dim});
    l.post_norm = add(p + "post_attention_layernorm.weight", {c.hidden_size});
    l.mlp = declare_mlp(i, p, add);
    (here ? layers_ : elsewhere).push_back(l);
  }
  here = holds_head();
  final_norm_ = add("model.norm.weight", {c.hidden_size});
  if (!c.tie_word_embeddings) lm_head_ = add("lm_head.weight", {c.vocab_size, c.hidden_size});
  allocate_declared();
  for (const Layer& l : layers_) pack_rows({l.q_proj, l.k_proj, l.v_proj});  // one GEMM for q, k and v
  pack_mlp_rows();
  shard_experts();  // expert parallelism: this rank's experts
  // Tensor parallelism: column-parallel q, k, v, gate, up; row-parallel o, down; with more ranks than key/value heads
  // each k and v head is held by tp / heads consecutive ranks (the ones whose query heads read it). A sparse layer's
  // mixture-of-experts block is whole on every rank (its input and output are the group's common stream).
  const int kv_replicas = int(tp_size() * c.num_kv_heads / global_config_.num_kv_heads);
  for (const std::vector<Layer>* held : {&layers_, &elsewhere})
  for (const Layer& l : *held) {
    shard_over_tp(l.q_proj, 0);
    for (int i : {l.k_proj, l.v_proj}) shard_over_tp(i, 0, kv_replicas);
    shard_over_tp(l.o_proj, 1);
    if (!l.mlp.sparse) {  // a mixture-of-experts block stays whole on every rank
      for (int i : {l.mlp.gate, l.mlp.up}) shard_over_tp(i, 0);
      shard_over_tp(l.mlp.down, 1);
    }
  }
  // The vocab-parallel embedding and LM head: each rank its vocab_size / tp rows (a tied head is the same tensor),
  // where tp divides the vocabulary (tensor_parallel_config); otherwise whole on every rank.
  if (vocab_parallel()) {
    shard_over_tp(embed_, 0);
    if (lm_head_ != -1) shard_over_tp(lm_head_, 0);
  }
}

Qwen3Model Qwen3Model::load(Runtime& rt, const std::string& dir, const ModelOptions& options) {
  Qwen3Model m(rt, load_model_config(dir), options);
  const io::SafetensorsModel st = io::SafetensorsModel::open(dir);
  const std::set<std::string> expected = m.read_parameters(st);
  // Anything else in the checkpoint would be silently unused: refuse it, except a stored copy of a tied head.
  std::vector<std::string> unexpected;
  for (const std::string& name : st.names())
    if (!expected.count(name) && !(name == "lm_head.weight" && m.config_.tie_word_embeddings) &&
        !m.held_elsewhere(name))
      unexpected.push_back(name);
  LATHE_CHECK(unexpected.empty(), "model: {}: {} tensors the {} model does not use, e.g. '{}'", dir, unexpected.size(),
              m.config_.model_type, unexpected.empty() ? "" : unexpected.front());
  return m;
}

Qwen3Model Qwen3Model::random(Runtime& rt, const ModelConfig& config, const ModelOptions& options, uint64_t seed,
                              double std) {
  Qwen3Model m(rt, config, options);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, float(std));
  // The whole tensor's values (the same draws at any tp, ep or pp layout), then this rank's slice, if it holds any.
  m.for_each_declared([&](const std::string&, const Shape& shape, Parameter* p) {
    std::vector<float> host(size_t(shape_numel(shape)));
    const bool norm = shape.size() == 1;
    if (!norm && host.size() >= kCounterDrawnElements) counter_normal(host, rng(), std);
    else
      for (float& x : host) x = norm ? 1.0f : normal(rng);
    if (!p) return;
    if (!p->whole()) host = slice_of(host, *p);
    ExecContext cx = rt.context(options.device);
    copy_into(cx, rt.from_host(host.data(), p->value.shape(), DType::F32, options.device), p->value);  // cast in place
  });
  return m;
}

Qwen3Model::LayerActs Qwen3Model::layer_forward(const Layer& l, const ResidualStream& x, const PackedBatch& b,
                                                bool training) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = block_tokens(b);
  const NormAttrs norm{c.rms_norm_eps, 0.0};
  LayerActs a;
  Tensor xn;
  std::tie(xn, a.x) = norm_stream(x, w(l.input_norm), norm);
  a.xn = block_input(xn, t);  // sequence parallelism: every rank's rows of the stream
  a.qkv = project_rows(l.index, kQkv, {l.q_proj, l.k_proj, l.v_proj}, a.xn, b, training);  // this rank's heads
  const std::vector<Tensor> heads =
      qk_norm_rope(cx, a.qkv, w(l.q_norm), w(l.k_norm), stack_positions(b), qk_attrs(c));
  // cp: every row of the batch for a cp-th of the heads, over whole documents, and back
  const bool cp = context_parallel();
  a.qr = cp ? heads_to_sequence(heads[0]) : heads[0];
  a.kr = cp ? heads_to_sequence(heads[1]) : heads[1];
  a.v = cp ? heads_to_sequence(heads[2]) : heads[2];
  std::tie(a.o, a.lse) = attend(l.index, a.qr, a.kr, a.v, b);  // a decoding batch: over its cache
  a.o_rows = cp ? sequence_to_heads(a.o) : a.o;
  // h = x + o_proj(o) and hn = post_norm(h) in one pass
  // tensor parallelism: every rank's heads summed (onto the stream's rows under sequence parallelism)
  const Tensor attn_out =
      block_output(project(l.index, LoraTarget::o_proj, l.o_proj, a.o_rows.view({t, -1}), b, training));
  std::vector<Tensor> post = residual_rmsnorm(cx, a.x, attn_out, w(l.post_norm), norm);
  a.hn = block_input(post[0], t);
  a.h = post[1];
  a.mlp = mlp_forward(l.index, l.mlp, a.hn, b, training);
  a.out = {a.h, a.mlp.out};
  return a;
}

Tensor Qwen3Model::layer_backward(const Layer& l, const LayerActs& a, const Tensor& dout, const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = block_tokens(b);
  const NormAttrs norm{c.rms_norm_eps, 0.0};
  // MLP: out = h + mlp(hn)
  const Tensor dhn = mlp_backward(l.index, l.mlp, a.hn, a.mlp, dout, b);
  const std::vector<Tensor> dpost = residual_rmsnorm_backward(cx, a.h, w(l.post_norm), dhn, dout, norm);  // dh
  add_norm_grad(l.post_norm, dpost[1]);
  const Tensor& dh = dpost[0];
  // Attention: h = x + o_proj(attention(rope(qnorm(q)), rope(knorm(k)), v))
  Tensor d_o;
  project_backward(l.index, LoraTarget::o_proj, l.o_proj, a.o_rows.view({t, -1}), block_input(dh, t), d_o, b);
  const Tensor d_o_heads = d_o.view({t, c.num_heads, c.head_dim});
  const bool cp = context_parallel();
  std::vector<Tensor> dqkv =
      attention_backward(cx, a.qr, a.kr, a.v, a.o, a.lse, cp ? heads_to_sequence(d_o_heads) : d_o_heads,
                         cp ? cp_cu_seqlens(b) : b.cu_seqlens, {0.0, options_.deterministic});
  if (cp) {  // back to the rank's rows, every head (a key/value head's copies summed)
    dqkv[0] = sequence_to_heads(dqkv[0]);
    for (int i : {1, 2}) dqkv[size_t(i)] = sequence_to_heads(dqkv[size_t(i)], c.num_kv_heads);
  }
  const std::vector<Tensor> dheads = qk_norm_rope_backward(cx, a.qkv, w(l.q_norm), w(l.k_norm), stack_positions(b),
                                                           dqkv[0], dqkv[1], dqkv[2], qk_attrs(c));
  Tensor dq_norm = dheads[1], dk_norm = dheads[2];
  tp_sum(dq_norm);  // tensor parallelism: the norms' gains are every rank's heads'
  tp_sum(dk_norm);
  add_grad(l.q_norm, dq_norm);
  add_grad(l.k_norm, dk_norm);
  Tensor dxn;
  project_rows_backward(l.index, kQkv, {l.q_proj, l.k_proj, l.v_proj}, a.xn, dheads[0], dxn, b);
  const std::vector<Tensor> din =
      residual_rmsnorm_backward(cx, a.x, w(l.input_norm), block_output(dxn), dh, norm);  // dx
  add_norm_grad(l.input_norm, din[1]);
  return din[0];
}

Tensor Qwen3Model::logits(const PackedBatch& b) { return DecoderStack::logits(*this, b); }

std::vector<double> Qwen3Model::label_logprobs(const PackedBatch& b) { return DecoderStack::label_logprobs(*this, b); }

LossResult Qwen3Model::loss(const PackedBatch& b, bool backward, double loss_scale, const BackwardHooks& hooks) {
  return DecoderStack::loss(*this, b, backward, loss_scale, hooks);
}

std::vector<int64_t> Qwen3Model::grads_complete_after() const { return DecoderStack::grads_complete_after(*this); }

Tensor Qwen3Model::last_hidden(const PackedBatch& b) { return DecoderStack::last_hidden(*this, b); }
Tensor Qwen3Model::lm_head_logits(const Tensor& x) { return DecoderStack::lm_head_logits(*this, x); }
std::shared_ptr<StageWork> Qwen3Model::stage_forward(int stage, const PackedBatch& b, const Tensor& in, StageHead head,
                                                double loss_scale) {
  return DecoderStack::stage_forward(*this, stage, b, in, head, loss_scale);
}
Tensor Qwen3Model::stage_backward(StageWork& work, const Tensor& dout, const PackedBatch& b, const Tensor& d_aux) {
  return DecoderStack::stage_backward(*this, work, dout, b, d_aux);
}

}  // namespace lathe
