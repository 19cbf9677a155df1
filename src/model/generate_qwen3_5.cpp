// Qwen35Decoder: cached decoding of the Qwen3.5 hybrid model. Shapes: n new tokens, D hidden, H/Hkv heads of d
// (attention), Hk/Hv heads of dk/dv (GDN), K = Hk dk, V = Hv dv, C = 2K + V conv channels, W conv width.
// The conv cache: the conv of [cached W - 1 pre-conv rows ; n new rows] as one document, keeping the last n outputs,
// equals the conv over the whole sequence (zero rows before the start are what the op's zero history gives), and
// the new cache is the last W - 1 rows of that concatenation: O(W C) per token. The whole q|k|v block of
// in_proj_qkv is used at once (the model uses three row blocks; the conv is depthwise, so this is the same maths).
// The recurrent cache: gated_delta_rule_state from the cached state, one document; its final state is the new cache.
// Covered by tests/models/test_generate_qwen3_5.cpp.
#include "model/generate_qwen3_5.h"

#include <cmath>
#include <numeric>

#include "ops/ops.h"

namespace lathe {

namespace {

Tensor zeros(ExecContext& ctx, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, ctx.allocator);
  if (t.nbytes() > 0) ctx.backend.fill_bytes(t.data_ptr(), 0, t.nbytes(), ctx.stream);
  return t;
}

}  // namespace

Qwen35Decoder::Qwen35Decoder(Runtime& rt, Qwen35Model& model, int64_t capacity)
    : rt_(&rt), model_(&model),
      kv_(0, model.config().num_kv_heads, model.config().head_dim, model.options().dtype) {
  const ModelConfig& c = model.config();
  auto find = [&](const std::string& name) {
    Parameter& p = model.parameter(name);  // throws, naming it, when missing
    return int(&p - model.parameters().data());
  };
  const std::string root = c.multimodal_layout ? "model.language_model." : "model.";
  embed_ = find(root + "embed_tokens.weight");
  final_norm_ = find(root + "norm.weight");
  lm_head_ = c.tie_word_embeddings ? embed_ : find("lm_head.weight");
  size_t n_gdn = 0, n_attn = 0;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = fmt::format("{}layers.{}.", root, i);
    Layer l;
    l.index = i;
    l.linear = c.layer_types[size_t(i)] == "linear_attention";
    l.slot = l.linear ? n_gdn++ : n_attn++;
    l.input_norm = find(p + "input_layernorm.weight");
    l.post_norm = find(p + "post_attention_layernorm.weight");
    if (l.linear) {
      const std::string a = p + "linear_attn.";
      l.conv = find(a + "conv1d.weight");
      l.dt_bias = find(a + "dt_bias");
      l.a_log = find(a + "A_log");
      l.gnorm = find(a + "norm.weight");
      l.out_proj = find(a + "out_proj.weight");
    } else {
      const std::string a = p + "self_attn.";
      l.q_proj = find(a + "q_proj.weight");
      l.k_proj = find(a + "k_proj.weight");
      l.v_proj = find(a + "v_proj.weight");
      l.o_proj = find(a + "o_proj.weight");
      l.q_norm = find(a + "q_norm.weight");
      l.k_norm = find(a + "k_norm.weight");
    }
    layers_.push_back(l);
  }
  kv_ = KvCache(n_attn, c.num_kv_heads, c.head_dim, model.options().dtype);
  ExecContext cx = ctx();
  std::vector<double> l2(size_t(c.linear_key_head_dim), 1.0 / std::sqrt(double(c.linear_key_head_dim)));
  l2_weight_ = cast(cx, rt.from_host(l2.data(), {c.linear_key_head_dim}, DType::F64, model.options().device),
                  model.options().dtype);
  conv_.resize(n_gdn);
  state_.resize(n_gdn);
  reset();
  reserve(std::max<int64_t>(capacity, 1));
}

const Tensor& Qwen35Decoder::w(int index) const { return model_->parameters()[size_t(index)].value; }

ExecContext Qwen35Decoder::ctx() const { return rt_->context(model_->options().device); }

void Qwen35Decoder::reset() {
  const ModelConfig& c = model_->config();
  const int64_t channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                           c.linear_num_value_heads * c.linear_value_head_dim;
  const DType dtype = model_->options().dtype;
  ExecContext cx = ctx();
  for (size_t i = 0; i < conv_.size(); ++i) {
    conv_[i] = zeros(cx, {c.linear_conv_kernel_dim - 1, channels}, dtype);  // (W - 1, C)
    state_[i] = zeros(cx, {1, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim},
                      gdn_state_dtype(dtype));                               // (1, Hv, dk, dv)
  }
  length_ = 0;
}

void Qwen35Decoder::reserve(int64_t tokens) {
  ExecContext cx = ctx();
  kv_.reserve(cx, tokens, length_);
}

const Tensor& Qwen35Decoder::conv_state(size_t layer) const {
  LATHE_CHECK(layer < layers_.size() && layers_[layer].linear, "generate: layer {} is not a Gated DeltaNet layer",
              layer);
  return conv_[layers_[layer].slot];
}

const Tensor& Qwen35Decoder::recurrent_state(size_t layer) const {
  LATHE_CHECK(layer < layers_.size() && layers_[layer].linear, "generate: layer {} is not a Gated DeltaNet layer",
              layer);
  return state_[layers_[layer].slot];
}

int64_t Qwen35Decoder::gdn_cache_bytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < conv_.size(); ++i) total += conv_[i].nbytes() + state_[i].nbytes();
  return total;
}

std::vector<float> Qwen35Decoder::feed(std::span<const int32_t> ids) {
  ExecContext cx = ctx();
  const Tensor logits = feed_logits(ids);
  const Tensor host = rt_->copy_to(logits.dtype() == DType::F32 ? logits : cast(cx, logits, DType::F32), Device::cpu());
  return std::vector<float>(host.data<float>(), host.data<float>() + host.numel());
}

Tensor Qwen35Decoder::feed_logits(std::span<const int32_t> ids) {
  const ModelConfig& c = model_->config();
  check_feed(ids, c.vocab_size);
  // After the prefill, tokens go one at a time: the attention step has no causal mask within new tokens.
  const size_t chunk = length_ == 0 ? ids.size() : 1;
  const Device device = model_->options().device;
  ExecContext cx = ctx();
  Tensor logits;
  for (size_t first = 0; first < ids.size(); first += chunk) {
    const int64_t n = int64_t(chunk), past = length_;
    reserve(past + n);
    std::vector<int32_t> pos(chunk);
    std::iota(pos.begin(), pos.end(), int32_t(past));
    const Tensor ids_t = rt_->from_host(ids.data() + first, {n}, DType::I32, device);  // (n)
    const Tensor positions = rt_->from_host(pos.data(), {n}, DType::I32, device);     // (n)
    new_conv_ = conv_;
    new_state_ = state_;
    Tensor x = embedding(cx, w(embed_), ids_t);  // (n, D)
    for (const Layer& l : layers_) x = layer_step(l, x, positions, past);
    // Only now: a failed step leaves every cache as it was (KV rows past the length are never read).
    conv_.swap(new_conv_);
    state_.swap(new_state_);
    new_conv_.clear();
    new_state_.clear();
    length_ = past + n;
    if (first + chunk < ids.size()) continue;  // logits of the last position only
    const Tensor xf = rmsnorm(cx, x.narrow(0, n - 1, 1), w(final_norm_), {c.rms_norm_eps, 1.0});  // (1, D)
    logits = linear(cx, xf, w(lm_head_));                                                         // (1, V)
  }
  return logits;
}

// Qwen35Model::layer_forward for n new tokens at positions past.. (zero-centred norms: offset 1).
Tensor Qwen35Decoder::layer_step(const Layer& l, const Tensor& x, const Tensor& positions, int64_t past) {
  ExecContext cx = ctx();
  const NormAttrs norm{model_->config().rms_norm_eps, 1.0};
  const Tensor xn = rmsnorm(cx, x, w(l.input_norm), norm);                                             // (n, D)
  const Tensor h = add(cx, x, l.linear ? gdn_step(l, xn) : attention_step(l, xn, positions, past));    // (n, D)
  const Tensor hn = rmsnorm(cx, h, w(l.post_norm), norm);                                              // (n, D)
  return add(cx, h, model_->mlp_eval(l.index, hn));                                    // (n, D), dense or experts
}

// Gated attention (Qwen35Model::attention_forward): q_proj gives per head [query (d) | gate (d)]; q/k zero-centred
// RMSNorm, partial RoPE; the keys and values go to the KV cache; output * sigmoid(gate); o_proj.
Tensor Qwen35Decoder::attention_step(const Layer& l, const Tensor& xn, const Tensor& positions, int64_t past) {
  ExecContext cx = ctx();
  const ModelConfig& c = model_->config();
  const int64_t n = xn.size(0), d = c.head_dim, hd = c.num_heads * d;
  const NormAttrs norm{c.rms_norm_eps, 1.0};
  const RopeAttrs rot{c.rope_theta, c.rotary_dim(), false};
  const Tensor qg = linear(cx, xn, w(l.q_proj)).view({n, c.num_heads, 2, d});        // (n, H, [query | gate], d)
  const Tensor q = contiguous(cx, qg.narrow(2, 0, 1)).view({n, c.num_heads, d});     // (n, H, d)
  const Tensor gate = contiguous(cx, qg.narrow(2, 1, 1)).view({n, hd});              // (n, H d)
  const Tensor k = linear(cx, xn, w(l.k_proj)).view({n, c.num_kv_heads, d});         // (n, Hkv, d)
  const Tensor v = linear(cx, xn, w(l.v_proj)).view({n, c.num_kv_heads, d});         // (n, Hkv, d)
  const Tensor qr = rope(cx, rmsnorm(cx, q, w(l.q_norm), norm), positions, rot);     // (n, H, d)
  const Tensor kr = rope(cx, rmsnorm(cx, k, w(l.k_norm), norm), positions, rot);     // (n, Hkv, d)
  kv_.write(cx, l.slot, kr, v, past);
  Tensor o;  // (n, H, d)
  if (past == 0) {
    const int32_t cu[2] = {0, int32_t(n)};
    o = attention(cx, qr, kr, v, rt_->from_host(cu, {2}, DType::I32, model_->options().device), {})[0];
  } else {
    LATHE_ASSERT(n == 1);
    o = kv_.attend(cx, l.slot, qr, past + 1);
  }
  const Tensor y = mul(cx, o.view({n, hd}), sigmoid(cx, gate));  // (n, H d)
  return linear(cx, y, w(l.o_proj));                              // (n, D)
}

// x / sqrt(sum x^2 + 1e-6) over the last dim = rmsnorm(x; w = dk^-1/2, eps 1e-6 / dk), as Qwen35Model::l2norm.
Tensor Qwen35Decoder::l2norm(const Tensor& x) {
  ExecContext cx = ctx();
  const double dk = double(model_->config().linear_key_head_dim);
  return rmsnorm(cx, x, l2_weight_, {1e-6 / dk, 0.0});
}

// Gated DeltaNet (Qwen35Model::gdn_forward) over n new tokens from the cached conv rows and recurrent state; the
// updated caches go to new_conv_ / new_state_ (committed by feed_logits).
Tensor Qwen35Decoder::gdn_step(const Layer& l, const Tensor& xn) {
  ExecContext cx = ctx();
  const ModelConfig& c = model_->config();
  const int64_t n = xn.size(0), hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, kd = hk * dk, vd = hv * dv;
  const int64_t channels = 2 * kd + vd, width = c.linear_conv_kernel_dim, hist = width - 1;
  const Device device = model_->options().device;
  // Conv over [cached rows ; new rows] as one document; the last n outputs are the new tokens'.
  const auto [rows, z_rows, b_rows, a_rows] = model_->gdn_projections_eval(l.index, xn);  // rows: (n, C) pre-conv
  Tensor seq = Tensor::empty({hist + n, channels}, rows.dtype(), cx.allocator);           // (W - 1 + n, C)
  if (hist > 0) copy_into(cx, conv_[l.slot], seq.narrow(0, 0, hist));
  copy_into(cx, rows, seq.narrow(0, hist, n));
  const int32_t cu_conv[2] = {0, int32_t(hist + n)};
  const Tensor conv = causal_conv1d(cx, seq, w(l.conv).view({channels, width}),
                                    rt_->from_host(cu_conv, {2}, DType::I32, device));   // (W - 1 + n, C)
  const Tensor act = silu(cx, conv.narrow(0, hist, n));                                    // (n, C)
  Tensor kept = Tensor::empty({hist, channels}, rows.dtype(), cx.allocator);              // (W - 1, C)
  if (hist > 0) copy_into(cx, seq.narrow(0, n, hist), kept);
  new_conv_[l.slot] = kept;
  const Tensor qa = contiguous(cx, act.narrow(1, 0, kd)).view({n, hk, dk});
  const Tensor ka = contiguous(cx, act.narrow(1, kd, kd)).view({n, hk, dk});
  const Tensor va = contiguous(cx, act.narrow(1, 2 * kd, vd)).view({n, hv, dv});
  const Tensor z = z_rows.view({n, hv, dv});
  const DType gd = gdn_gate_dtype(model_->options().dtype);  // g and beta as in Qwen35Model (f32 in a bf16 model)
  const auto wide = [&](const Tensor& t) { return t.dtype() == gd ? t : cast(cx, t, gd); };
  const Tensor beta = sigmoid(cx, wide(b_rows));                                                   // (n, Hv)
  const Tensor g = gdn_decay(cx, wide(a_rows), wide(w(l.a_log)), wide(w(l.dt_bias)));               // (n, Hv)
  const int32_t cu_rule[2] = {0, int32_t(n)};
  const std::vector<Tensor> rule = gated_delta_rule_state(cx, l2norm(qa), l2norm(ka), va, g, beta,
                                                          rt_->from_host(cu_rule, {2}, DType::I32, device),
                                                          state_[l.slot]);  // o (n, Hv, dv), state (1, Hv, dk, dv)
  new_state_[l.slot] = rule[1];
  // rmsnorm(o; w) * silu(z), the gated norm (plain weight), as the model's.
  const Tensor gy = gated_rmsnorm(cx, rule[0], w(l.gnorm), z, {c.rms_norm_eps, 0.0});  // (n, Hv, dv)
  return linear(cx, gy.view({n, vd}), w(l.out_proj));                         // (n, D)
}

}  // namespace lathe
