// Qwen3 forward and backward. Shapes: T tokens, H hidden, Hq/Hkv heads of D, I intermediate, V vocab.
#include "model/qwen3.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <unistd.h>

#include "io/safetensors.h"
#include "model/lora.h"
#include "ops/ops.h"

namespace lathe {

namespace fs = std::filesystem;

struct Qwen3Model::LayerActs {
  Tensor x;        // (T, H) layer input
  Tensor xn;       // (T, H) input RMSNorm
  Tensor q, k, v;  // (T, Hq, D), (T, Hkv, D) projections (q, k before their RMSNorm)
  Tensor qr, kr;   // (T, Hq, D), (T, Hkv, D) normed and rotated
  Tensor o, lse;   // (T, Hq, D) attention output, (T, Hq) f32 log-sum-exp
  Tensor h;        // (T, H) after the attention residual
  Tensor hn;       // (T, H) post-attention RMSNorm
  Tensor g, u;     // (T, I) gate and up projections
  Tensor act;      // (T, I) silu(g) * u
  Tensor out;      // (T, H) layer output
};

namespace {

Tensor linear(ExecContext& ctx, const Tensor& x, const Tensor& w) {  // x (T, in) @ w(out, in)^T
  return matmul(ctx, x, w, {false, true});
}

}  // namespace

Qwen3Model::Qwen3Model(Runtime& rt, ModelConfig config, ModelOptions options)
    : rt_(&rt), config_(std::move(config)), options_(options) {
  rt.check_device(options_.device);
  build_parameter_list();
}

ExecContext Qwen3Model::ctx() { return rt_->context(options_.device); }

void Qwen3Model::build_parameter_list() {
  const ModelConfig& c = config_;
  const int64_t q_out = c.num_heads * c.head_dim, kv_out = c.num_kv_heads * c.head_dim;
  std::vector<std::pair<std::string, Shape>> specs;
  auto add = [&](std::string name, Shape shape) {
    specs.emplace_back(std::move(name), std::move(shape));
    return int(specs.size()) - 1;
  };
  embed_ = add("model.embed_tokens.weight", {c.vocab_size, c.hidden_size});
  for (int64_t i = 0; i < c.num_layers; ++i) {
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
    l.gate_proj = add(p + "mlp.gate_proj.weight", {c.intermediate_size, c.hidden_size});
    l.up_proj = add(p + "mlp.up_proj.weight", {c.intermediate_size, c.hidden_size});
    l.down_proj = add(p + "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size});
    layers_.push_back(l);
  }
  final_norm_ = add("model.norm.weight", {c.hidden_size});
  if (!c.tie_word_embeddings) lm_head_ = add("lm_head.weight", {c.vocab_size, c.hidden_size});
  ExecContext cx = ctx();
  for (auto& [name, shape] : specs) params_.push_back({name, Tensor::empty(shape, options_.dtype, cx.allocator), {}});
}

Parameter& Qwen3Model::parameter(const std::string& name) {
  for (Parameter& p : params_)
    if (p.name == name) return p;
  LATHE_FAIL("model: no parameter named '{}'", name);
}

const Tensor& Qwen3Model::lm_head() const { return w(lm_head_ >= 0 ? lm_head_ : embed_); }

Qwen3Model Qwen3Model::load(Runtime& rt, const std::string& dir, const ModelOptions& options) {
  Qwen3Model m(rt, load_model_config(dir), options);
  const io::SafetensorsModel st = io::SafetensorsModel::open(dir);
  std::set<std::string> expected;
  for (Parameter& p : m.params_) {
    expected.insert(p.name);
    const io::SafetensorsTensor* t = st.find(p.name);
    LATHE_CHECK(t != nullptr, "model: {}: tensor '{}' is missing from the checkpoint", dir, p.name);
    LATHE_CHECK(t->shape == p.value.shape(), "model: {}: tensor '{}' has shape {} but the config implies {}", dir, p.name,
                shape_str(t->shape), shape_str(p.value.shape()));
    std::vector<float> host(size_t(p.value.numel()));
    st.read_into(p.name, DType::F32, host.data(), host.size() * sizeof(float));
    ExecContext cx = rt.context(options.device);
    const Tensor f32 = rt.from_host(host.data(), p.value.shape(), DType::F32, options.device);
    p.value = cast(cx, f32, options.dtype);
  }
  // Anything else in the checkpoint would be silently unused: refuse it, except a stored copy of a tied head.
  std::vector<std::string> unexpected;
  for (const std::string& name : st.names())
    if (!expected.count(name) && !(name == "lm_head.weight" && m.config_.tie_word_embeddings)) unexpected.push_back(name);
  LATHE_CHECK(unexpected.empty(), "model: {}: {} tensors the qwen3 model does not use, e.g. '{}'", dir, unexpected.size(),
              unexpected.empty() ? "" : unexpected.front());
  return m;
}

Qwen3Model Qwen3Model::random(Runtime& rt, const ModelConfig& config, const ModelOptions& options, uint64_t seed,
                              double std) {
  Qwen3Model m(rt, config, options);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, float(std));
  for (Parameter& p : m.params_) {
    std::vector<float> host(size_t(p.value.numel()));
    const bool norm = p.value.dim() == 1;
    for (float& x : host) x = norm ? 1.0f : normal(rng);
    ExecContext cx = rt.context(options.device);
    p.value = cast(cx, rt.from_host(host.data(), p.value.shape(), DType::F32, options.device), options.dtype);
  }
  return m;
}

void Qwen3Model::zero_grads() {
  for (Parameter& p : params_) p.grad = Tensor();
}

void Qwen3Model::add_grad(int index, const Tensor& g) {
  if (!options_.train_base) return;
  Tensor& grad = params_[size_t(index)].grad;
  ExecContext cx = ctx();
  grad = grad.defined() ? add(cx, grad, g) : g;
}

void Qwen3Model::add_linear_grad(int index, const Tensor& dy, const Tensor& x) {
  if (!options_.train_base) return;
  Tensor& grad = params_[size_t(index)].grad;
  ExecContext cx = ctx();
  if (grad.defined()) matmul_into(cx, dy, x, grad, {true, false, 1.0f, 1.0f});
  else grad = matmul(cx, dy, x, {true, false});
}

namespace {

// The segment table of one LoRA slot for a batch: each segment keeps its adapter's columns of the slot, scaled;
// dropout probabilities and seeds (per segment, per slot) only when training.
SegmentAttrs lora_segments(const LoraBank& bank, const LoraBank::Slot& slot, const PackedBatch& b, bool training) {
  SegmentAttrs s;
  s.rows.push_back(0);
  for (const BatchSegment& seg : b.segments) {
    s.rows.push_back(seg.rows_end);
    const bool on = seg.adapter >= 0;
    s.col_begin.push_back(on ? slot.col_begin[size_t(seg.adapter)] : 0);
    s.col_end.push_back(on ? slot.col_end[size_t(seg.adapter)] : 0);
    s.scale.push_back(on ? bank.config(seg.adapter).scaling() : 0.0);
    s.p.push_back(on && training ? bank.config(seg.adapter).dropout : 0.0);
    // splitmix-style mixing of the segment's seed with the slot's place in the model
    uint64_t z = seg.dropout_seed + 0x9E3779B97F4A7C15ull * uint64_t(1 + slot.layer * kLoraTargetCount + int(slot.target));
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    s.seed.push_back(z ^ (z >> 31));
  }
  return s;
}

bool any_dropout(const SegmentAttrs& s) {
  return std::any_of(s.p.begin(), s.p.end(), [](double p) { return p > 0; });
}

}  // namespace

Tensor Qwen3Model::project(const Layer& l, LoraTarget t, int weight, const Tensor& x, const PackedBatch& b, bool training) {
  ExecContext cx = ctx();
  Tensor y = linear(cx, x, w(weight));
  const LoraBank::Slot* slot = lora_ && !b.segments.empty() ? lora_->slot(l.index, t) : nullptr;
  if (!slot) return y;
  // y += mask(dropout(x) A_cat^T) BT_cat: every adapter in two GEMMs, each row keeping its own adapter's columns.
  const SegmentAttrs seg = lora_segments(*lora_, *slot, b, training);
  const Tensor xd = any_dropout(seg) ? dropout(cx, x, seg) : x;
  const Tensor u = segment_mask(cx, matmul(cx, xd, slot->a, {false, true}), seg);
  matmul_into(cx, u, slot->bt, y, {false, false, 1.0f, 1.0f});
  return y;
}

void Qwen3Model::project_backward(const Layer& l, LoraTarget t, int weight, const Tensor& x, const Tensor& dy, Tensor& dx,
                                  const PackedBatch& b) {
  ExecContext cx = ctx();
  if (dx.defined()) matmul_into(cx, dy, w(weight), dx, {false, false, 1.0f, 1.0f});
  else dx = matmul(cx, dy, w(weight));
  add_linear_grad(weight, dy, x);
  LoraBank::Slot* slot = lora_ && !b.segments.empty() ? lora_->slot(l.index, t) : nullptr;
  if (!slot) return;
  const SegmentAttrs seg = lora_segments(*lora_, *slot, b, true);
  const bool drop = any_dropout(seg);
  const Tensor xd = drop ? dropout(cx, x, seg) : x;  // the same masks as the forward (same seeds)
  const Tensor u = segment_mask(cx, matmul(cx, xd, slot->a, {false, true}), seg);
  matmul_into(cx, u, dy, slot->grad_bt, {true, false, 1.0f, 1.0f});  // dBT += U^T dy
  const Tensor du = segment_mask(cx, matmul(cx, dy, slot->bt, {false, true}), seg);
  matmul_into(cx, du, xd, slot->grad_a, {true, false, 1.0f, 1.0f});  // dA += dU^T x
  if (drop) dx = add(cx, dx, dropout(cx, matmul(cx, du, slot->a), seg));
  else matmul_into(cx, du, slot->a, dx, {false, false, 1.0f, 1.0f});
}

Qwen3Model::LayerActs Qwen3Model::layer_forward(const Layer& l, const Tensor& x, const PackedBatch& b, bool training) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = x.size(0);
  const NormAttrs norm{c.rms_norm_eps, 0.0};
  const RopeAttrs rot{c.rope_theta, 0, false};
  LayerActs a;
  a.x = x;
  a.xn = rmsnorm(cx, x, w(l.input_norm), norm);
  a.q = project(l, LoraTarget::q_proj, l.q_proj, a.xn, b, training).view({t, c.num_heads, c.head_dim});
  a.k = project(l, LoraTarget::k_proj, l.k_proj, a.xn, b, training).view({t, c.num_kv_heads, c.head_dim});
  a.v = project(l, LoraTarget::v_proj, l.v_proj, a.xn, b, training).view({t, c.num_kv_heads, c.head_dim});
  a.qr = rope(cx, rmsnorm(cx, a.q, w(l.q_norm), norm), b.positions, rot);
  a.kr = rope(cx, rmsnorm(cx, a.k, w(l.k_norm), norm), b.positions, rot);
  std::vector<Tensor> att = attention(cx, a.qr, a.kr, a.v, b.cu_seqlens, {});
  a.o = att[0];
  a.lse = att[1];
  a.h = add(cx, x, project(l, LoraTarget::o_proj, l.o_proj, a.o.view({t, -1}), b, training));
  a.hn = rmsnorm(cx, a.h, w(l.post_norm), norm);
  a.g = project(l, LoraTarget::gate_proj, l.gate_proj, a.hn, b, training);
  a.u = project(l, LoraTarget::up_proj, l.up_proj, a.hn, b, training);
  a.act = swiglu(cx, a.g, a.u);
  a.out = add(cx, a.h, project(l, LoraTarget::down_proj, l.down_proj, a.act, b, training));
  return a;
}

Tensor Qwen3Model::layer_backward(const Layer& l, const LayerActs& a, const Tensor& dout, const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = dout.size(0);
  const NormAttrs norm{c.rms_norm_eps, 0.0};
  const RopeAttrs inv{c.rope_theta, 0, true};
  // MLP: out = h + down(swiglu(gate(hn), up(hn)))
  Tensor dact, dhn;
  project_backward(l, LoraTarget::down_proj, l.down_proj, a.act, dout, dact, b);
  const std::vector<Tensor> dgu = swiglu_backward(cx, a.g, a.u, dact);
  project_backward(l, LoraTarget::gate_proj, l.gate_proj, a.hn, dgu[0], dhn, b);
  project_backward(l, LoraTarget::up_proj, l.up_proj, a.hn, dgu[1], dhn, b);
  const std::vector<Tensor> dpost = rmsnorm_backward(cx, a.h, w(l.post_norm), dhn, norm);
  add_grad(l.post_norm, dpost[1]);
  const Tensor dh = add(cx, dout, dpost[0]);
  // Attention: h = x + o_proj(attention(rope(qnorm(q)), rope(knorm(k)), v))
  Tensor d_o;
  project_backward(l, LoraTarget::o_proj, l.o_proj, a.o.view({t, -1}), dh, d_o, b);
  const std::vector<Tensor> dqkv =
      attention_backward(cx, a.qr, a.kr, a.v, a.o, a.lse, d_o.view({t, c.num_heads, c.head_dim}), b.cu_seqlens, {});
  const std::vector<Tensor> dq = rmsnorm_backward(cx, a.q, w(l.q_norm), rope(cx, dqkv[0], b.positions, inv), norm);
  const std::vector<Tensor> dk = rmsnorm_backward(cx, a.k, w(l.k_norm), rope(cx, dqkv[1], b.positions, inv), norm);
  add_grad(l.q_norm, dq[1]);
  add_grad(l.k_norm, dk[1]);
  Tensor dxn;
  project_backward(l, LoraTarget::q_proj, l.q_proj, a.xn, dq[0].view({t, -1}), dxn, b);
  project_backward(l, LoraTarget::k_proj, l.k_proj, a.xn, dk[0].view({t, -1}), dxn, b);
  project_backward(l, LoraTarget::v_proj, l.v_proj, a.xn, dqkv[2].view({t, -1}), dxn, b);
  const std::vector<Tensor> din = rmsnorm_backward(cx, a.x, w(l.input_norm), dxn, norm);
  add_grad(l.input_norm, din[1]);
  return add(cx, dh, din[0]);
}

Tensor Qwen3Model::forward_hidden(const PackedBatch& b, std::vector<LayerActs>* acts, std::vector<Tensor>* inputs,
                                  bool training) {
  ExecContext cx = ctx();
  LATHE_CHECK(b.ids.device() == options_.device, "model: batch is on {} but the model is on {}", b.ids.device().str(),
              options_.device.str());
  for (int32_t id : b.host_ids)
    LATHE_CHECK(id >= 0 && id < config_.vocab_size, "model: token id {} is outside the vocabulary (size {})", id,
                config_.vocab_size);
  if (lora_ && !b.segments.empty()) lora_->refresh();  // the adapters' current values into the slots
  Tensor x = embedding(cx, w(embed_), b.ids);
  for (const Layer& l : layers_) {
    if (inputs) inputs->push_back(x);
    LayerActs a = layer_forward(l, x, b, training);
    x = a.out;
    if (acts) acts->push_back(std::move(a));
  }
  return x;
}

Tensor Qwen3Model::logits(const PackedBatch& b) {
  ExecContext cx = ctx();
  const Tensor x = forward_hidden(b, nullptr, nullptr, false);
  return linear(cx, rmsnorm(cx, x, w(final_norm_), {config_.rms_norm_eps, 0.0}), lm_head());
}

std::vector<double> Qwen3Model::label_logprobs(const PackedBatch& b) {
  ExecContext cx = ctx();
  const Tensor xf = rmsnorm(cx, forward_hidden(b, nullptr, nullptr, false), w(final_norm_), {config_.rms_norm_eps, 0.0});
  std::vector<double> out;
  for (int64_t r0 = 0; r0 < b.tokens(); r0 += options_.loss_chunk_rows) {
    const int64_t n = std::min(options_.loss_chunk_rows, b.tokens() - r0);
    const Tensor logits = linear(cx, xf.narrow(0, r0, n), lm_head());
    const Tensor loss = rt_->copy_to(cross_entropy(cx, logits, b.labels.narrow(0, r0, n), {})[0], Device::cpu());
    for (int64_t i = 0; i < n; ++i) out.push_back(-load_as_double(loss.data_ptr(), loss.dtype(), i));
  }
  return out;
}

LossResult Qwen3Model::loss(const PackedBatch& b, bool backward, double loss_scale) {
  ExecContext cx = ctx();
  std::vector<LayerActs> acts;
  std::vector<Tensor> inputs;
  const bool keep = backward && !options_.recompute;
  const Tensor x_last = forward_hidden(b, keep ? &acts : nullptr, backward ? &inputs : nullptr, backward);
  const NormAttrs norm{config_.rms_norm_eps, 0.0};
  const Tensor xf = rmsnorm(cx, x_last, w(final_norm_), norm);
  LossResult result;
  result.labelled = b.num_labelled;
  // Only labelled positions need logits: gather their rows (the embedding op is a row gather, its backward a
  // scatter-add), so prompt tokens of SFT data cost nothing in the LM head.
  std::vector<int32_t> rows, targets;
  for (int64_t i = 0; i < b.tokens(); ++i) {
    if (b.host_labels[size_t(i)] == -100) continue;
    rows.push_back(int32_t(i));
    targets.push_back(b.host_labels[size_t(i)]);
  }
  const int64_t n_rows = int64_t(rows.size());
  // The gathered rows of each segment are contiguous; each segment's mean loss has its own gradient scale.
  struct Piece {
    int64_t begin, end;
    double grad_scale;
  };
  std::vector<Piece> pieces;
  if (b.segments.empty()) {
    pieces.push_back({0, n_rows, n_rows ? loss_scale / double(n_rows) : 0.0});
  } else {
    int64_t r = 0;
    for (const BatchSegment& seg : b.segments) {
      const int64_t begin = r;
      while (r < n_rows && rows[size_t(r)] < seg.rows_end) ++r;
      pieces.push_back({begin, r, r > begin ? loss_scale * seg.loss_scale / double(r - begin) : 0.0});
      result.segments.push_back({0.0, r - begin});
    }
  }
  Tensor xs, dxs, row_index, target_t;
  if (n_rows > 0) {
    row_index = rt_->from_host(rows.data(), {n_rows}, DType::I32, options_.device);
    target_t = rt_->from_host(targets.data(), {n_rows}, DType::I32, options_.device);
    xs = embedding(cx, xf, row_index);  // (n_rows, H)
    if (backward) dxs = Tensor::empty(xs.shape(), xs.dtype(), cx.allocator);
  }
  const int head = lm_head_ >= 0 ? lm_head_ : embed_;
  for (size_t pi = 0; pi < pieces.size(); ++pi) {
    const Piece& piece = pieces[pi];
    for (int64_t r0 = piece.begin; r0 < piece.end; r0 += options_.loss_chunk_rows) {
      const int64_t n = std::min(options_.loss_chunk_rows, piece.end - r0);
      const Tensor xc = xs.narrow(0, r0, n);
      const Tensor logits = linear(cx, xc, lm_head());  // (n, V), freed after this chunk
      const std::vector<Tensor> ce =
          cross_entropy(cx, logits, target_t.narrow(0, r0, n), {-100, backward, piece.grad_scale});
      const Tensor loss_rows = rt_->copy_to(ce[0], Device::cpu());
      double chunk_sum = 0;
      for (int64_t i = 0; i < n; ++i) chunk_sum += load_as_double(loss_rows.data_ptr(), loss_rows.dtype(), i);
      result.loss_sum += chunk_sum;
      if (!result.segments.empty()) result.segments[pi].loss_sum += chunk_sum;
      if (backward) {
        Tensor dxc = dxs.narrow(0, r0, n);
        matmul_into(cx, ce[1], lm_head(), dxc, {});
        add_linear_grad(head, ce[1], xc);
      }
    }
  }
  result.loss = b.num_labelled ? result.loss_sum / double(b.num_labelled) : 0.0;
  if (!backward) return result;

  // Gradient of the final norm's output: the labelled rows' gradients scattered back (zero elsewhere).
  Tensor dxf;
  if (n_rows > 0) {
    dxf = embedding_backward(cx, dxs, row_index, b.tokens());
  } else {
    dxf = Tensor::empty(xf.shape(), xf.dtype(), cx.allocator);
    cx.backend.fill_bytes(dxf.data_ptr(), 0, dxf.nbytes(), cx.stream);
  }
  const std::vector<Tensor> dfinal = rmsnorm_backward(cx, x_last, w(final_norm_), dxf, norm);
  add_grad(final_norm_, dfinal[1]);
  Tensor dx = dfinal[0];
  for (int64_t i = int64_t(layers_.size()) - 1; i >= 0; --i) {
    const LayerActs a = keep ? std::move(acts[size_t(i)]) : layer_forward(layers_[size_t(i)], inputs[size_t(i)], b, true);
    if (keep) acts.pop_back();
    dx = layer_backward(layers_[size_t(i)], a, dx, b);
  }
  if (options_.train_base) add_grad(embed_, embedding_backward(cx, dx, b.ids, config_.vocab_size));
  if (lora_ && !b.segments.empty()) lora_->collect_grads();
  return result;
}

void Qwen3Model::save(const std::string& dir, DType dtype, uint64_t max_shard_bytes) const {
  LATHE_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16, "model: cannot save weights as {}",
              dtype_name(dtype));
  ExecContext cx = rt_->context(options_.device);
  std::vector<Tensor> host;
  std::vector<io::TensorRef> refs;
  for (const Parameter& p : params_) {
    host.push_back(rt_->copy_to(cast(cx, p.value, dtype), Device::cpu()));
    refs.push_back({p.name, dtype, p.value.shape(), host.back().data_ptr(), host.back().nbytes()});
  }
  // Write into a fresh sibling folder, then swap it in, so a crash never leaves a half-written model at `dir`.
  const fs::path target = fs::absolute(dir);
  const fs::path tmp = target.string() + fmt::format(".tmp-{}", getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  io::write_sharded_safetensors(tmp.string(), refs, max_shard_bytes, {{"format", "pt"}});
  nlohmann::json cfg = config_.raw;
  cfg["torch_dtype"] = cfg["dtype"] = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  {
    std::ofstream f(tmp / "config.json");
    f << cfg.dump(2) << "\n";
    LATHE_CHECK(f.good(), "model: cannot write {}", (tmp / "config.json").string());
  }
  const fs::path old = target.string() + fmt::format(".old-{}", getpid());
  if (fs::exists(target)) fs::rename(target, old);
  fs::rename(tmp, target);
  fs::remove_all(old);
}

}  // namespace lathe
