// Qwen3.5 text model forward and backward. Shapes: T tokens, D hidden, H/Hkv heads of d (full attention),
// Hk/Hv heads of dk/dv (Gated DeltaNet), K = Hk dk, V = Hv dv, I intermediate, voc vocabulary.
// Conventions: every norm is zero-centred ((1 + w), NormAttrs offset 1) except the GDN output norm (plain w); the
// L2 norm of q and k is x / sqrt(sum x^2 + 1e-6) = rmsnorm(x; 1, eps 1e-6/dk) / sqrt(dk) (exact identity, reuses
// the rmsnorm op); the q_proj rows of head h are [query | gate], split by gathering rows of q_proj seen as (2H, d D)
// (the embedding op, whose backward is the scatter-add); in_proj_qkv is used as three row blocks [q | k | v] (each a
// contiguous view), each with its own conv channels, so nothing is ever concatenated.
// Duplication: the loss head (label gather, chunked logits, segment weights) repeats Qwen3Model::loss, whose parts
// are private; factor them out when a third model family arrives.
#include "model/qwen3_5.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "io/safetensors.h"
#include "ops/ops.h"

namespace lathe {

namespace fs = std::filesystem;

struct Qwen35Model::LayerActs {
  Tensor x, xn;         // (T, D) layer input and its input norm
  Tensor mix;           // (T, D) mixer output (before the residual)
  // full attention
  Tensor wquery, wgate;  // (H d, D) rows of q_proj
  Tensor q, gate, k, v;  // (T, H, d), (T, H d), (T, Hkv, d) x2: projections (q, k before their norm)
  Tensor qr, kr;         // normed and rotated
  Tensor o, lse, sg, y;  // (T, H, d), (T, H), sigmoid(gate) (T, H d), o * sg (T, H d)
  // Gated DeltaNet
  Tensor c[3], p[3];     // per section q, k, v: projection and conv output (T, K | K | V)
  Tensor qa, ka, va;     // silu(p): (T, Hk, dk), (T, Hk, dk), (T, Hv, dv)
  Tensor qn, kn;         // L2-normalised
  Tensor z, bproj, aproj, beta, g;  // (T, V), (T, Hv) x4
  Tensor core, gn, sz, gy;          // (T, Hv, dv): rule output, its norm, silu(z), gn * sz
  // MLP
  Tensor h, hn, gt, up, act, out;
};

namespace {

Tensor linear(ExecContext& ctx, const Tensor& x, const Tensor& w) { return matmul(ctx, x, w, {false, true}); }

void copy_into(ExecContext& ctx, const Tensor& src, const Tensor& dst) {  // dst: a contiguous view
  run_op(ctx, OpCall{OpId::cast, {src}, {dst}, CastAttrs{dst.dtype()}});
}

}  // namespace

Qwen35Model::Qwen35Model(Runtime& rt, ModelConfig config, ModelOptions options)
    : rt_(&rt), config_(std::move(config)), options_(options) {
  rt.check_device(options_.device);
  LATHE_CHECK(config_.is_qwen3_5(), "model: Qwen35Model needs a qwen3_5 config, got model_type '{}'", config_.model_type);
  build_parameter_list();
  const ModelConfig& c = config_;
  std::vector<double> ones(size_t(c.linear_key_head_dim), 1.0);
  ExecContext cx = ctx();
  ones_dk_ = cast(cx, rt.from_host(ones.data(), {c.linear_key_head_dim}, DType::F64, options_.device), options_.dtype);
  std::vector<int32_t> even, odd;
  for (int64_t h = 0; h < c.num_heads; ++h) even.push_back(int32_t(2 * h)), odd.push_back(int32_t(2 * h + 1));
  even_rows_ = rt.from_host(even.data(), {c.num_heads}, DType::I32, options_.device);
  odd_rows_ = rt.from_host(odd.data(), {c.num_heads}, DType::I32, options_.device);
}

ExecContext Qwen35Model::ctx() { return rt_->context(options_.device); }

void Qwen35Model::build_parameter_list() {
  const ModelConfig& c = config_;
  const std::string root = c.multimodal_layout ? "model.language_model." : "model.";
  const int64_t d = c.head_dim, kd = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t vd = c.linear_num_value_heads * c.linear_value_head_dim, hv = c.linear_num_value_heads;
  std::vector<std::pair<std::string, Shape>> specs;
  auto add = [&](std::string name, Shape shape) {
    specs.emplace_back(std::move(name), std::move(shape));
    return int(specs.size()) - 1;
  };
  embed_ = add(root + "embed_tokens.weight", {c.vocab_size, c.hidden_size});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = fmt::format("{}layers.{}.", root, i);
    Layer l;
    l.index = i;
    l.linear = c.layer_types[size_t(i)] == "linear_attention";
    l.input_norm = add(p + "input_layernorm.weight", {c.hidden_size});
    if (l.linear) {
      l.in_qkv = add(p + "linear_attn.in_proj_qkv.weight", {2 * kd + vd, c.hidden_size});
      l.in_z = add(p + "linear_attn.in_proj_z.weight", {vd, c.hidden_size});
      l.in_b = add(p + "linear_attn.in_proj_b.weight", {hv, c.hidden_size});
      l.in_a = add(p + "linear_attn.in_proj_a.weight", {hv, c.hidden_size});
      l.conv = add(p + "linear_attn.conv1d.weight", {2 * kd + vd, 1, c.linear_conv_kernel_dim});
      l.dt_bias = add(p + "linear_attn.dt_bias", {hv});
      l.a_log = add(p + "linear_attn.A_log", {hv});
      l.gnorm = add(p + "linear_attn.norm.weight", {c.linear_value_head_dim});
      l.out_proj = add(p + "linear_attn.out_proj.weight", {c.hidden_size, vd});
    } else {
      l.q_proj = add(p + "self_attn.q_proj.weight", {2 * c.num_heads * d, c.hidden_size});
      l.k_proj = add(p + "self_attn.k_proj.weight", {c.num_kv_heads * d, c.hidden_size});
      l.v_proj = add(p + "self_attn.v_proj.weight", {c.num_kv_heads * d, c.hidden_size});
      l.o_proj = add(p + "self_attn.o_proj.weight", {c.hidden_size, c.num_heads * d});
      l.q_norm = add(p + "self_attn.q_norm.weight", {d});
      l.k_norm = add(p + "self_attn.k_norm.weight", {d});
    }
    l.post_norm = add(p + "post_attention_layernorm.weight", {c.hidden_size});
    l.gate_proj = add(p + "mlp.gate_proj.weight", {c.intermediate_size, c.hidden_size});
    l.up_proj = add(p + "mlp.up_proj.weight", {c.intermediate_size, c.hidden_size});
    l.down_proj = add(p + "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size});
    layers_.push_back(l);
  }
  final_norm_ = add(root + "norm.weight", {c.hidden_size});
  if (!c.tie_word_embeddings) lm_head_ = add("lm_head.weight", {c.vocab_size, c.hidden_size});
  ExecContext cx = ctx();
  for (auto& [name, shape] : specs) params_.push_back({name, Tensor::empty(shape, options_.dtype, cx.allocator), {}});
}

Parameter& Qwen35Model::parameter(const std::string& name) {
  for (Parameter& p : params_)
    if (p.name == name) return p;
  LATHE_FAIL("model: no parameter named '{}'", name);
}

const Tensor& Qwen35Model::lm_head() const { return w(lm_head_ >= 0 ? lm_head_ : embed_); }

Qwen35Model Qwen35Model::load(Runtime& rt, const std::string& dir, const ModelOptions& options) {
  Qwen35Model m(rt, load_model_config(dir), options);
  for (const std::string& note : m.config_.notes) fmt::print(stderr, "model: {}: note: {}\n", dir, note);
  const io::SafetensorsModel st = io::SafetensorsModel::open(dir);
  std::set<std::string> expected;
  ExecContext cx = rt.context(options.device);
  for (Parameter& p : m.params_) {
    expected.insert(p.name);
    const io::SafetensorsTensor* t = st.find(p.name);
    LATHE_CHECK(t != nullptr, "model: {}: tensor '{}' is missing from the checkpoint", dir, p.name);
    LATHE_CHECK(t->shape == p.value.shape(), "model: {}: tensor '{}' has shape {} but the config implies {}", dir, p.name,
                shape_str(t->shape), shape_str(p.value.shape()));
    // f64 on the host keeps f32/f64 checkpoints exact (A_log is stored in f32 in Qwen3.5 releases).
    std::vector<double> host(size_t(p.value.numel()));
    st.read_into(p.name, DType::F64, host.data(), host.size() * sizeof(double));
    p.value = cast(cx, rt.from_host(host.data(), p.value.shape(), DType::F64, options.device), options.dtype);
  }
  // Tensors of the vision tower and the MTP head are kept aside (reported); anything else would be silently
  // unused: refused, except a stored copy of a tied head.
  const std::string visual = "model.visual.";
  std::vector<std::string> unexpected;
  int64_t kept = 0;
  for (const std::string& name : st.names()) {
    if (expected.count(name) || (name == "lm_head.weight" && m.config_.tie_word_embeddings)) continue;
    const bool vision = m.config_.multimodal_layout && name.rfind(visual, 0) == 0;
    const bool mtp = name.rfind("mtp.", 0) == 0;
    if (!vision && !mtp) {
      unexpected.push_back(name);
      continue;
    }
    const io::SafetensorsTensor& t = st.get(name);
    Passthrough keep{name, t.dtype, t.shape, std::vector<uint8_t>(t.byte_size())};
    st.read_into(name, t.dtype, keep.bytes.data(), keep.bytes.size());
    m.passthrough_.push_back(std::move(keep));
    ++kept;
  }
  LATHE_CHECK(unexpected.empty(), "model: {}: {} tensors the qwen3_5 text model does not use, e.g. '{}'", dir,
              unexpected.size(), unexpected.empty() ? "" : unexpected.front());
  if (kept)
    fmt::print(stderr, "model: {}: note: {} tensors of the vision tower / MTP head are not used; they are kept and "
               "written back unchanged by save\n", dir, kept);
  return m;
}

Qwen35Model Qwen35Model::random(Runtime& rt, const ModelConfig& config, const ModelOptions& options, uint64_t seed,
                                double std) {
  Qwen35Model m(rt, config, options);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, std);
  std::uniform_real_distribution<double> uniform(0.01, 16.0);
  for (Parameter& p : m.params_) {
    std::vector<double> host(size_t(p.value.numel()));
    const bool gated_norm = p.name.find("linear_attn.norm.weight") != std::string::npos;
    for (double& x : host) {
      if (p.name.find("A_log") != std::string::npos) x = std::log(uniform(rng));
      else if (gated_norm || p.name.find("dt_bias") != std::string::npos) x = 1.0;
      else if (p.value.dim() == 1) x = 0.0;  // zero-centred norms
      else x = normal(rng);
    }
    ExecContext cx = rt.context(options.device);
    p.value = cast(cx, rt.from_host(host.data(), p.value.shape(), DType::F64, options.device), options.dtype);
  }
  return m;
}

void Qwen35Model::zero_grads() {
  for (Parameter& p : params_) p.grad = Tensor();
}

void Qwen35Model::add_grad(int index, const Tensor& g) {
  if (!options_.train_base) return;
  Tensor& grad = params_[size_t(index)].grad;
  ExecContext cx = ctx();
  grad = grad.defined() ? add(cx, grad, g.view(grad.shape())) : contiguous(cx, g).view(params_[size_t(index)].value.shape());
}

Tensor& Qwen35Model::grad_buffer(int index) {
  Parameter& p = params_[size_t(index)];
  if (!p.grad.defined()) {
    ExecContext cx = ctx();
    p.grad = Tensor::empty(p.value.shape(), p.value.dtype(), cx.allocator);
    cx.backend.fill_bytes(p.grad.data_ptr(), 0, p.grad.nbytes(), cx.stream);
  }
  return p.grad;
}

void Qwen35Model::add_linear_grad(int index, const Tensor& dy, const Tensor& x, int64_t row0) {
  if (!options_.train_base) return;
  ExecContext cx = ctx();
  Tensor& grad = params_[size_t(index)].grad;
  if (row0 == 0 && dy.size(-1) == params_[size_t(index)].value.size(0) && !grad.defined()) {
    grad = matmul(cx, dy, x, {true, false});
    return;
  }
  Tensor rows = grad_buffer(index).narrow(0, row0, dy.size(-1));
  matmul_into(cx, dy, x, rows, {true, false, 1.0f, 1.0f});
}

void Qwen35Model::linear_backward_input(const Tensor& wt, const Tensor& dy, Tensor& dx) {
  ExecContext cx = ctx();
  if (dx.defined()) matmul_into(cx, dy, wt, dx, {false, false, 1.0f, 1.0f});
  else dx = matmul(cx, dy, wt);
}

Tensor Qwen35Model::l2norm(const Tensor& x) {
  ExecContext cx = ctx();
  const double dk = double(config_.linear_key_head_dim);
  return scale(cx, rmsnorm(cx, x, ones_dk_, {1e-6 / dk, 0.0}), 1.0 / std::sqrt(dk));
}

Tensor Qwen35Model::l2norm_backward(const Tensor& x, const Tensor& dy) {
  ExecContext cx = ctx();
  const double dk = double(config_.linear_key_head_dim);
  return rmsnorm_backward(cx, x, ones_dk_, scale(cx, dy, 1.0 / std::sqrt(dk)), {1e-6 / dk, 0.0})[0];
}

void Qwen35Model::attention_forward(const Layer& l, LayerActs& a, const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = a.x.size(0), d = c.head_dim, hd = c.num_heads * d;
  const NormAttrs norm{c.rms_norm_eps, 1.0};
  const Tensor rows = w(l.q_proj).view({2 * c.num_heads, d * c.hidden_size});
  a.wquery = embedding(cx, rows, even_rows_).view({hd, c.hidden_size});
  a.wgate = embedding(cx, rows, odd_rows_).view({hd, c.hidden_size});
  a.q = linear(cx, a.xn, a.wquery).view({t, c.num_heads, d});
  a.gate = linear(cx, a.xn, a.wgate);
  a.k = linear(cx, a.xn, w(l.k_proj)).view({t, c.num_kv_heads, d});
  a.v = linear(cx, a.xn, w(l.v_proj)).view({t, c.num_kv_heads, d});
  const RopeAttrs rot{c.rope_theta, c.rotary_dim(), false};
  a.qr = rope(cx, rmsnorm(cx, a.q, w(l.q_norm), norm), b.positions, rot);
  a.kr = rope(cx, rmsnorm(cx, a.k, w(l.k_norm), norm), b.positions, rot);
  std::vector<Tensor> att = attention(cx, a.qr, a.kr, a.v, b.cu_seqlens, {});
  a.o = att[0];
  a.lse = att[1];
  a.sg = sigmoid(cx, a.gate);
  a.y = mul(cx, a.o.view({t, hd}), a.sg);
  a.mix = linear(cx, a.y, w(l.o_proj));
}

void Qwen35Model::gdn_forward(const Layer& l, LayerActs& a, const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = a.x.size(0), hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, kd = hk * dk, vd = hv * dv;
  const int64_t off[3] = {0, kd, 2 * kd}, len[3] = {kd, kd, vd};
  const Tensor wconv = w(l.conv).view({2 * kd + vd, c.linear_conv_kernel_dim});
  Tensor act[3];
  for (int s = 0; s < 3; ++s) {
    a.c[s] = linear(cx, a.xn, w(l.in_qkv).narrow(0, off[s], len[s]));
    a.p[s] = causal_conv1d(cx, a.c[s], wconv.narrow(0, off[s], len[s]), b.cu_seqlens);
    act[s] = silu(cx, a.p[s]);
  }
  a.qa = act[0].view({t, hk, dk});
  a.ka = act[1].view({t, hk, dk});
  a.va = act[2].view({t, hv, dv});
  a.qn = l2norm(a.qa);
  a.kn = l2norm(a.ka);
  a.z = linear(cx, a.xn, w(l.in_z)).view({t, hv, dv});
  a.bproj = linear(cx, a.xn, w(l.in_b));
  a.aproj = linear(cx, a.xn, w(l.in_a));
  a.beta = sigmoid(cx, a.bproj);
  a.g = gdn_decay(cx, a.aproj, w(l.a_log), w(l.dt_bias));
  a.core = gated_delta_rule(cx, a.qn, a.kn, a.va, a.g, a.beta, b.cu_seqlens);
  a.gn = rmsnorm(cx, a.core, w(l.gnorm), {c.rms_norm_eps, 0.0});
  a.sz = silu(cx, a.z);
  a.gy = mul(cx, a.gn, a.sz);
  a.mix = linear(cx, a.gy.view({t, vd}), w(l.out_proj));
}

Qwen35Model::LayerActs Qwen35Model::layer_forward(const Layer& l, const Tensor& x, const PackedBatch& b) {
  ExecContext cx = ctx();
  const NormAttrs norm{config_.rms_norm_eps, 1.0};
  LayerActs a;
  a.x = x;
  a.xn = rmsnorm(cx, x, w(l.input_norm), norm);
  if (l.linear) gdn_forward(l, a, b);
  else attention_forward(l, a, b);
  a.h = add(cx, x, a.mix);
  a.hn = rmsnorm(cx, a.h, w(l.post_norm), norm);
  a.gt = linear(cx, a.hn, w(l.gate_proj));
  a.up = linear(cx, a.hn, w(l.up_proj));
  a.act = swiglu(cx, a.gt, a.up);
  a.out = add(cx, a.h, linear(cx, a.act, w(l.down_proj)));
  return a;
}

Tensor Qwen35Model::attention_backward_part(const Layer& l, const LayerActs& a, const Tensor& dh, const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = dh.size(0), d = c.head_dim, hd = c.num_heads * d;
  const NormAttrs norm{c.rms_norm_eps, 1.0};
  const RopeAttrs inv{c.rope_theta, c.rotary_dim(), true};
  add_linear_grad(l.o_proj, dh, a.y);
  const Tensor dy = matmul(cx, dh, w(l.o_proj));  // (T, H d)
  const Tensor d_o = mul(cx, dy, a.sg).view({t, c.num_heads, d});
  const Tensor dgate = sigmoid_backward(cx, a.sg, mul(cx, dy, a.o.view({t, hd})));
  const std::vector<Tensor> dqkv =
      attention_backward(cx, a.qr, a.kr, a.v, a.o, a.lse, d_o, b.cu_seqlens, {});
  const std::vector<Tensor> dq = rmsnorm_backward(cx, a.q, w(l.q_norm), rope(cx, dqkv[0], b.positions, inv), norm);
  const std::vector<Tensor> dk = rmsnorm_backward(cx, a.k, w(l.k_norm), rope(cx, dqkv[1], b.positions, inv), norm);
  add_grad(l.q_norm, dq[1]);
  add_grad(l.k_norm, dk[1]);
  const Tensor dq2 = dq[0].view({t, hd});
  Tensor dxn;
  linear_backward_input(a.wquery, dq2, dxn);
  linear_backward_input(a.wgate, dgate, dxn);
  linear_backward_input(w(l.k_proj), dk[0].view({t, -1}), dxn);
  linear_backward_input(w(l.v_proj), dqkv[2].view({t, -1}), dxn);
  if (options_.train_base) {
    // dq_proj: the query and gate row blocks scattered back to rows 2h and 2h + 1 of (2H, d D).
    const int64_t rows = 2 * c.num_heads, row = d * c.hidden_size;
    const Tensor dwq = matmul(cx, dq2, a.xn, {true, false}).view({c.num_heads, row});
    const Tensor dwg = matmul(cx, dgate, a.xn, {true, false}).view({c.num_heads, row});
    add_grad(l.q_proj, add(cx, embedding_backward(cx, dwq, even_rows_, rows), embedding_backward(cx, dwg, odd_rows_, rows)));
  }
  add_linear_grad(l.k_proj, dk[0].view({t, -1}), a.xn);
  add_linear_grad(l.v_proj, dqkv[2].view({t, -1}), a.xn);
  return dxn;
}

Tensor Qwen35Model::gdn_backward_part(const Layer& l, const LayerActs& a, const Tensor& dh, const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = dh.size(0), hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, kd = hk * dk, vd = hv * dv;
  const int64_t off[3] = {0, kd, 2 * kd}, len[3] = {kd, kd, vd};
  const int64_t width = c.linear_conv_kernel_dim;
  add_linear_grad(l.out_proj, dh, a.gy.view({t, vd}));
  const Tensor dgy = matmul(cx, dh, w(l.out_proj)).view({t, hv, dv});
  // gy = rmsnorm(core; w) * silu(z)
  const Tensor dz = silu_backward(cx, a.z, mul(cx, dgy, a.gn));
  const std::vector<Tensor> dcore = rmsnorm_backward(cx, a.core, w(l.gnorm), mul(cx, dgy, a.sz), {c.rms_norm_eps, 0.0});
  add_grad(l.gnorm, dcore[1]);
  const std::vector<Tensor> dr = gated_delta_rule_backward(cx, a.qn, a.kn, a.va, a.g, a.beta, dcore[0], b.cu_seqlens);
  const std::vector<Tensor> ddecay = gdn_decay_backward(cx, a.aproj, w(l.a_log), w(l.dt_bias), dr[3]);
  add_grad(l.a_log, ddecay[1]);
  add_grad(l.dt_bias, ddecay[2]);
  const Tensor db = sigmoid_backward(cx, a.beta, dr[4]);
  const Tensor dact[3] = {l2norm_backward(a.qa, dr[0]).view({t, kd}), l2norm_backward(a.ka, dr[1]).view({t, kd}),
                          dr[2].view({t, vd})};
  Tensor dxn;
  const Tensor wconv = w(l.conv).view({2 * kd + vd, width});
  for (int s = 0; s < 3; ++s) {
    const Tensor wc = wconv.narrow(0, off[s], len[s]);
    const Tensor dp = silu_backward(cx, a.p[s], dact[s]);
    const std::vector<Tensor> dconv = causal_conv1d_backward(cx, a.c[s], wc, dp, b.cu_seqlens);
    if (options_.train_base) {
      const Tensor slot = grad_buffer(l.conv).view({2 * kd + vd, width}).narrow(0, off[s], len[s]);
      copy_into(cx, add(cx, slot, dconv[1]), slot);
    }
    linear_backward_input(w(l.in_qkv).narrow(0, off[s], len[s]), dconv[0], dxn);
    add_linear_grad(l.in_qkv, dconv[0], a.xn, off[s]);
  }
  linear_backward_input(w(l.in_z), dz.view({t, vd}), dxn);
  linear_backward_input(w(l.in_b), db, dxn);
  linear_backward_input(w(l.in_a), ddecay[0], dxn);
  add_linear_grad(l.in_z, dz.view({t, vd}), a.xn);
  add_linear_grad(l.in_b, db, a.xn);
  add_linear_grad(l.in_a, ddecay[0], a.xn);
  return dxn;
}

Tensor Qwen35Model::layer_backward(const Layer& l, const LayerActs& a, const Tensor& dout, const PackedBatch& b) {
  ExecContext cx = ctx();
  const NormAttrs norm{config_.rms_norm_eps, 1.0};
  // MLP: out = h + down(swiglu(gate(hn), up(hn)))
  add_linear_grad(l.down_proj, dout, a.act);
  const Tensor dact = matmul(cx, dout, w(l.down_proj));
  const std::vector<Tensor> dgu = swiglu_backward(cx, a.gt, a.up, dact);
  Tensor dhn;
  linear_backward_input(w(l.gate_proj), dgu[0], dhn);
  linear_backward_input(w(l.up_proj), dgu[1], dhn);
  add_linear_grad(l.gate_proj, dgu[0], a.hn);
  add_linear_grad(l.up_proj, dgu[1], a.hn);
  const std::vector<Tensor> dpost = rmsnorm_backward(cx, a.h, w(l.post_norm), dhn, norm);
  add_grad(l.post_norm, dpost[1]);
  const Tensor dh = add(cx, dout, dpost[0]);
  // Mixer: h = x + mixer(input_norm(x))
  const Tensor dxn = l.linear ? gdn_backward_part(l, a, dh, b) : attention_backward_part(l, a, dh, b);
  const std::vector<Tensor> din = rmsnorm_backward(cx, a.x, w(l.input_norm), dxn, norm);
  add_grad(l.input_norm, din[1]);
  return add(cx, dh, din[0]);
}

Tensor Qwen35Model::forward_hidden(const PackedBatch& b, std::vector<LayerActs>* acts, std::vector<Tensor>* inputs) {
  ExecContext cx = ctx();
  LATHE_CHECK(b.ids.device() == options_.device, "model: batch is on {} but the model is on {}", b.ids.device().str(),
              options_.device.str());
  for (int32_t id : b.host_ids)
    LATHE_CHECK(id >= 0 && id < config_.vocab_size, "model: token id {} is outside the vocabulary (size {})", id,
                config_.vocab_size);
  Tensor x = embedding(cx, w(embed_), b.ids);
  for (const Layer& l : layers_) {
    if (inputs) inputs->push_back(x);
    LayerActs a = layer_forward(l, x, b);
    x = a.out;
    if (acts) acts->push_back(std::move(a));
  }
  return x;
}

Tensor Qwen35Model::logits(const PackedBatch& b) {
  ExecContext cx = ctx();
  const Tensor x = forward_hidden(b, nullptr, nullptr);
  return linear(cx, rmsnorm(cx, x, w(final_norm_), {config_.rms_norm_eps, 1.0}), lm_head());
}

std::vector<double> Qwen35Model::label_logprobs(const PackedBatch& b) {
  ExecContext cx = ctx();
  const Tensor xf = rmsnorm(cx, forward_hidden(b, nullptr, nullptr), w(final_norm_), {config_.rms_norm_eps, 1.0});
  std::vector<double> out;
  for (int64_t r0 = 0; r0 < b.tokens(); r0 += options_.loss_chunk_rows) {
    const int64_t n = std::min(options_.loss_chunk_rows, b.tokens() - r0);
    const Tensor logits = linear(cx, xf.narrow(0, r0, n), lm_head());
    const Tensor loss = rt_->copy_to(cross_entropy(cx, logits, b.labels.narrow(0, r0, n), {})[0], Device::cpu());
    for (int64_t i = 0; i < n; ++i) out.push_back(-load_as_double(loss.data_ptr(), loss.dtype(), i));
  }
  return out;
}

LossResult Qwen35Model::loss(const PackedBatch& b, bool backward, double loss_scale) {
  ExecContext cx = ctx();
  std::vector<LayerActs> acts;
  std::vector<Tensor> inputs;
  const bool keep = backward && !options_.recompute;
  const Tensor x_last = forward_hidden(b, keep ? &acts : nullptr, backward ? &inputs : nullptr);
  const NormAttrs norm{config_.rms_norm_eps, 1.0};
  const Tensor xf = rmsnorm(cx, x_last, w(final_norm_), norm);
  LossResult result;
  result.labelled = b.num_labelled;
  std::vector<int32_t> rows, targets;
  for (int64_t i = 0; i < b.tokens(); ++i) {
    if (b.host_labels[size_t(i)] == -100) continue;
    rows.push_back(int32_t(i));
    targets.push_back(b.host_labels[size_t(i)]);
  }
  const int64_t n_rows = int64_t(rows.size());
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
    xs = embedding(cx, xf, row_index);
    if (backward) dxs = Tensor::empty(xs.shape(), xs.dtype(), cx.allocator);
  }
  const int head = lm_head_ >= 0 ? lm_head_ : embed_;
  for (size_t pi = 0; pi < pieces.size(); ++pi) {
    const Piece& piece = pieces[pi];
    for (int64_t r0 = piece.begin; r0 < piece.end; r0 += options_.loss_chunk_rows) {
      const int64_t n = std::min(options_.loss_chunk_rows, piece.end - r0);
      const Tensor xc = xs.narrow(0, r0, n);
      const Tensor logits = linear(cx, xc, lm_head());
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
    const LayerActs a = keep ? std::move(acts[size_t(i)]) : layer_forward(layers_[size_t(i)], inputs[size_t(i)], b);
    if (keep) acts.pop_back();
    dx = layer_backward(layers_[size_t(i)], a, dx, b);
  }
  if (options_.train_base) add_grad(embed_, embedding_backward(cx, dx, b.ids, config_.vocab_size));
  return result;
}

void Qwen35Model::save(const std::string& dir, DType dtype, uint64_t max_shard_bytes) const {
  LATHE_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16, "model: cannot save weights as {}",
              dtype_name(dtype));
  ExecContext cx = rt_->context(options_.device);
  std::vector<Tensor> host;
  std::vector<io::TensorRef> refs;
  for (const Parameter& p : params_) {
    // A_log and the gated norm weight are f32 in Qwen3.5 releases: keep them at least f32.
    const bool keep_f32 = p.name.find("A_log") != std::string::npos;
    const DType dt = keep_f32 ? DType::F32 : dtype;
    host.push_back(rt_->copy_to(cast(cx, p.value, dt), Device::cpu()));
    refs.push_back({p.name, dt, p.value.shape(), host.back().data_ptr(), host.back().nbytes()});
  }
  for (const Passthrough& t : passthrough_) refs.push_back({t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()});
  const fs::path target = fs::absolute(dir);
  const fs::path tmp = target.string() + fmt::format(".tmp-{}", getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  io::write_sharded_safetensors(tmp.string(), refs, max_shard_bytes, {{"format", "pt"}});
  nlohmann::json cfg = config_.raw;
  const char* name = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  cfg["torch_dtype"] = cfg["dtype"] = name;
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
