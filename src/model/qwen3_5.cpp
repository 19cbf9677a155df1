// Qwen3.5 text model forward and backward. Shapes: T tokens, D hidden, H/Hkv heads of d (full attention),
// Hk/Hv heads of dk/dv (Gated DeltaNet), K = Hk dk, V = Hv dv, I intermediate, voc vocabulary.
// Conventions: every norm is zero-centred ((1 + w), NormAttrs offset 1) except the GDN output norm (plain w); the
// L2 norm of q and k is x / sqrt(sum x^2 + 1e-6) = rmsnorm(x; w = dk^-1/2, eps 1e-6/dk) (an identity, reusing the
// rmsnorm op; the weight is rounded to the model dtype: 1e-4 relative in bf16, far below the output's rounding); the
// GDN output norm rmsnorm(core; w) * silu(z) is one op, gated_rmsnorm (rounded once, like transformers' fp32
// expression). Every projection is a whole HF matrix through CausalLm::project (so LoRA sees the module HF and
// peft see): q_proj's output (T, 2 H d) is split per head into [query | gate], and in_proj_qkv's (T, 2K + V) runs
// through the depthwise conv as one tensor and is then split into [q | k | v] — both splits are row gathers of the
// output viewed as (T N / width, width) (the embedding op); their backward stacks the parts' gradients and gathers
// the whole back with the inverse index (a split is a partition: no scatter-add).
// In bf16/f16 models the log-decay g and beta are computed in fp32 and fed to the rule in fp32 (as transformers).
// The loss head, save() and the LoRA path are CausalLm's.
#include "model/qwen3_5.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "io/safetensors.h"
#include "model/decoder_stack.h"
#include "model/gdn_context.h"
#include "model/lora.h"
#include "ops/ops.h"

namespace lathe {

struct Qwen35Model::LayerActs {
  Tensor x, xn;         // (T, D) layer input (the stream's rows under sp) and its input norm (every rank's rows)
  Tensor mix;           // (T, D) mixer output (before the residual)
  // full attention
  Tensor q, gate, k, v;  // (T, H, d), (T, H d), (T, Hkv, d) x2: projections (q, k before their norm)
  Tensor qr, kr;         // normed and rotated
  Tensor o, lse, sg, y;  // (T, H, d), (T, H), sigmoid(gate) (T, H d), o * sg (T, H d)
  // Context parallelism: qr, kr, v, o and lse are every row's for the rank's cp-th of the heads (the all-to-all's
  // layout); o_rows is o on the rank's rows for every head. A Gated DeltaNet layer keeps qkv (its rank's channel
  // blocks [q | k | v], every row), conv, qa..kn, bproj, aproj, beta, g in that layout too; core, z and gy are rows.
  Tensor o_rows;
  // Gated DeltaNet
  Tensor qkv, conv;      // (T, 2K + V): in_proj_qkv's output and the conv's
  Tensor conv_history;   // decoding: (B, W - 1, C), each sequence's last pre-conv rows after this batch
  Tensor qa, ka, va;     // silu(conv) split: (T, Hk, dk), (T, Hk, dk), (T, Hv, dv)
  Tensor qn, kn;         // L2-normalised
  Tensor z, bproj, aproj, beta, g;  // (T, V), (T, Hv) x4; beta and g at least f32 (gdn_gate_dtype)
  Tensor core, gy;                  // (T, Hv, dv): rule output, gated_rmsnorm(core; w, z) (out_proj's input)
  Tensor states;                    // the rule's saved chunk-start states (training), read by its backward
  Tensor chunk_cache;               // the rule's chunk cache (training, CUDA chunked kernels), read by its backward
  Tensor state_in;                  // context parallelism passing states: the state the previous rank passed
  // MLP
  Tensor h, hn;
  MlpActs mlp;
  ResidualStream out;  // h + mlp.out, added in the next norm
};

namespace {

Tensor as_dtype(ExecContext& ctx, const Tensor& x, DType t) { return x.dtype() == t ? x : cast(ctx, x, t); }

// Context parallelism's channel blocks of a Gated DeltaNet layer: part j of `parts` takes [q_j | k_j | v_j], a
// parts-th of the value channels and the key heads its value heads read: a parts-th of the key heads, or, where the
// key heads are fewer than the parts, the one key head its value heads read (then held by parts / H_k parts).
struct CpChannels {
  int64_t kd, vd, dk, parts;
  int64_t key_heads() const { return kd / dk; }
  bool shared_keys() const { return key_heads() < parts; }
  int64_t kc() const { return std::max<int64_t>(key_heads() / parts, 1) * dk; }  // key channels a part
  int64_t vc() const { return vd / parts; }
  int64_t width() const { return 2 * kc() + vc(); }
  int64_t key_at(int64_t j) const { return j * key_heads() / parts * dk; }  // part j's first key channel
  // {the whole's first channel, the part's, how many} for part j's q, k and v blocks.
  std::array<std::array<int64_t, 3>, 3> blocks(int64_t j) const {
    const int64_t w = width(), k = kc(), v = vc();
    return {{{key_at(j), j * w, k}, {kd + key_at(j), j * w + k, k}, {2 * kd + j * v, j * w + 2 * k, v}}};
  }
};

CpChannels cp_channels(const ModelConfig& c, int64_t parts) {
  return {c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim,
          c.linear_key_head_dim, parts};
}

// x's dim `dim` (the [q | k | v] sections, K, K and V wide) regrouped part by part, part j's blocks contiguous
// (to_parts: the dim becomes parts x width), and back (from_parts: the parts' blocks summed where parts share a key
// head). Rows of a conv weight (dim 0) or columns of in_proj_qkv's output (dim 1).
Tensor qkv_to_parts(ExecContext& cx, const Tensor& x, int dim, const CpChannels& ch, bool to_parts) {
  Shape shape = x.shape();
  shape[size_t(dim)] = to_parts ? ch.parts * ch.width() : 2 * ch.kd + ch.vd;
  Tensor out = Tensor::empty(shape, x.dtype(), cx.allocator);
  const bool sum = !to_parts && ch.shared_keys();
  if (sum) cx.backend.fill_bytes(out.data_ptr(), 0, out.nbytes(), cx.stream);
  for (int64_t j = 0; j < ch.parts; ++j)
    for (const auto& [whole, part, n] : ch.blocks(j)) {
      const Tensor from = x.narrow(dim, to_parts ? whole : part, n);
      Tensor to = out.narrow(dim, to_parts ? part : whole, n);
      copy_into(cx, sum ? add(cx, contiguous(cx, to), contiguous(cx, from)) : from, to);
    }
  return out;
}

}  // namespace

DType gdn_gate_dtype(DType model) { return model == DType::BF16 || model == DType::F16 ? DType::F32 : model; }

Qwen35Model::Qwen35Model(Runtime& rt, ModelConfig config, ModelOptions options)
    : CausalLm(rt, std::move(config), options) {
  LATHE_CHECK(config_.is_hybrid(), "model: Qwen35Model needs a qwen3_5 config, got model_type '{}'", config_.model_type);
  build_parameter_list();
  const ModelConfig& c = config_;
  std::vector<double> l2(size_t(c.linear_key_head_dim), 1.0 / std::sqrt(double(c.linear_key_head_dim)));
  ExecContext cx = ctx();
  l2_weight_ = cast(cx, rt.from_host(l2.data(), {c.linear_key_head_dim}, DType::F64, options_.device), options_.dtype);
}

void Qwen35Model::build_parameter_list() {
  const ModelConfig& c = config_;
  const std::string root = c.multimodal_layout ? "model.language_model." : "model.";
  const int64_t d = c.head_dim, kd = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t vd = c.linear_num_value_heads * c.linear_value_head_dim, hv = c.linear_num_value_heads;
  // Pipeline parallelism: `here` says whether this rank holds what is declared next (declare).
  bool here = holds_embedding() || (holds_head() && c.tie_word_embeddings);
  auto add = [&](std::string name, Shape shape) { return declare(std::move(name), std::move(shape), here); };
  std::vector<Layer> elsewhere;  // another pipeline stage's layers: declared, not held
  embed_ = add(root + "embed_tokens.weight", {c.vocab_size, c.hidden_size});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    here = holds_layer(i);
    const std::string p = fmt::format("{}layers.{}.", root, i);
    Layer l;
    l.index = i;
    l.linear = c.layer_types[size_t(i)] == "linear_attention";
    l.input_norm = add(p + "input_layernorm.weight", {c.hidden_size});
    if (l.linear) {
      if (c.fused_gdn_projections) {
        l.in_qkvz = add(p + "linear_attn.in_proj_qkvz.weight", {2 * kd + 2 * vd, c.hidden_size});
        l.in_ba = add(p + "linear_attn.in_proj_ba.weight", {2 * hv, c.hidden_size});
      } else {
        l.in_qkv = add(p + "linear_attn.in_proj_qkv.weight", {2 * kd + vd, c.hidden_size});
        l.in_z = add(p + "linear_attn.in_proj_z.weight", {vd, c.hidden_size});
        l.in_b = add(p + "linear_attn.in_proj_b.weight", {hv, c.hidden_size});
        l.in_a = add(p + "linear_attn.in_proj_a.weight", {hv, c.hidden_size});
      }
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
    l.mlp = declare_mlp(i, p, add);
    (here ? layers_ : elsewhere).push_back(l);
  }
  here = holds_head();
  final_norm_ = add(root + "norm.weight", {c.hidden_size});
  if (!c.tie_word_embeddings) lm_head_ = add("lm_head.weight", {c.vocab_size, c.hidden_size});
  allocate_declared();
  pack_mlp_rows();
  shard_experts();  // expert parallelism: this rank's experts
  shard_layers(layers_);
  shard_layers(elsewhere);  // their whole shapes, for random initialisation
  // The vocab-parallel embedding and LM head: each rank its vocab_size / tp rows (a tied head is the same tensor),
  // where tp divides the vocabulary (tensor_parallel_config); otherwise whole on every rank.
  if (vocab_parallel()) {
    shard_over_tp(embed_, 0);
    if (lm_head_ != -1) shard_over_tp(lm_head_, 0);
  }
}

// Tensor parallelism (docs/parallel.md): the attention layers as Qwen3's (q_proj's rows are per head [query | gate],
// so a rank's heads are contiguous rows); Gated DeltaNet's projections column-parallel by key heads with their value
// heads (in_proj_qkv and the conv's channels [q | k | v] as three sections; Qwen3-Next's fused in_proj_qkvz and
// in_proj_ba are already grouped by key head, so contiguous), A_log and dt_bias by value head, out_proj row-parallel.
// The norms' gains (q/k norm, the gated output norm) stay whole: their gradients are summed over the group.
void Qwen35Model::shard_layers(const std::vector<Layer>& layers) {
  const ModelConfig& c = config_;
  const ModelConfig& g = global_config_;
  const int kv_replicas = c.num_kv_heads > 0 ? int(tp_size() * c.num_kv_heads / g.num_kv_heads) : 1;
  const int64_t kd = g.linear_num_key_heads * g.linear_key_head_dim;
  const int64_t vd = g.linear_num_value_heads * g.linear_value_head_dim;
  for (const Layer& l : layers) {
    if (l.linear) {
      if (c.fused_gdn_projections) {
        for (int i : {l.in_qkvz, l.in_ba}) shard_over_tp(i, 0);
      } else {
        shard_over_tp(l.in_qkv, 0, 1, {kd, kd, vd});
        for (int i : {l.in_z, l.in_b, l.in_a}) shard_over_tp(i, 0);
      }
      shard_over_tp(l.conv, 0, 1, {kd, kd, vd});
      for (int i : {l.a_log, l.dt_bias}) shard_over_tp(i, 0);
      shard_over_tp(l.out_proj, 1);
    } else {
      shard_over_tp(l.q_proj, 0);
      for (int i : {l.k_proj, l.v_proj}) shard_over_tp(i, 0, kv_replicas);
      shard_over_tp(l.o_proj, 1);
    }
    if (!l.mlp.sparse) {
      for (int i : {l.mlp.gate, l.mlp.up}) shard_over_tp(i, 0);
      shard_over_tp(l.mlp.down, 1);
    }
  }
}

Qwen35Model Qwen35Model::load(Runtime& rt, const std::string& dir, const ModelOptions& options) {
  Qwen35Model m(rt, load_model_config(dir), options);
  for (const std::string& note : m.config_.notes) fmt::print(stderr, "model: {}: note: {}\n", dir, note);
  const io::SafetensorsModel st = io::SafetensorsModel::open(dir);
  const std::set<std::string> expected = m.read_parameters(st);
  // Tensors of the vision tower and the MTP head are kept aside (reported); anything else would be silently
  // unused: refused, except a stored copy of a tied head.
  const std::string visual = "model.visual.";
  std::vector<std::string> unexpected;
  int64_t kept = 0;
  for (const std::string& name : st.names()) {
    if (expected.count(name) || (name == "lm_head.weight" && m.config_.tie_word_embeddings)) continue;
    if (m.held_elsewhere(name) || !m.holds_embedding()) continue;  // pipeline: the first stage keeps (and saves) it
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
  LATHE_CHECK(unexpected.empty(), "model: {}: {} tensors the {} model does not use, e.g. '{}'", dir,
              unexpected.size(), m.config_.model_type, unexpected.empty() ? "" : unexpected.front());
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
  // The whole tensor's values (the same draws at any tp, ep or pp layout), then this rank's piece, if it holds any.
  m.for_each_declared([&](const std::string& name, const Shape& shape, Parameter* p) {
    std::vector<double> host(size_t(shape_numel(shape)));
    const bool gated_norm = name.find("linear_attn.norm.weight") != std::string::npos;
    if (shape.size() > 1 && host.size() >= kCounterDrawnElements) counter_normal(host, rng(), std);  // a matrix
    else
      for (double& x : host) {
        if (name.find("A_log") != std::string::npos) x = std::log(uniform(rng));
        else if (gated_norm || name.find("dt_bias") != std::string::npos) x = 1.0;
        else if (shape.size() == 1) x = 0.0;  // zero-centred norms
        else x = normal(rng);
      }
    if (!p) return;
    if (!p->whole()) host = slice_of(host, *p);
    ExecContext cx = rt.context(options.device);
    copy_into(cx, rt.from_host(host.data(), p->value.shape(), DType::F64, options.device), p->value);  // cast in place
  });
  return m;
}

DType Qwen35Model::save_dtype(const std::string& name, DType requested) const {
  // A_log is f32 in Qwen3.5 releases: keep it at least f32.
  return name.find("A_log") != std::string::npos ? DType::F32 : requested;
}

std::vector<io::TensorRef> Qwen35Model::extra_tensors() const {
  std::vector<io::TensorRef> refs;
  for (const Passthrough& t : passthrough_) refs.push_back({t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()});
  return refs;
}

void Qwen35Model::end_forward() {
  if (split_.cache) split_ = SplitIndex{};
}

// Kept while the tokens are the same; a decoding batch's (from its cache's tables) only for its own forward
// (end_forward drops it).
const Qwen35Model::SplitIndex& Qwen35Model::split_index(int64_t tokens, DecodeCache* cache) {
  if (split_.tokens == tokens && split_.cache == cache) return split_;
  const ModelConfig& c = config_;
  // Row indices, into (T N / width, width), of the column blocks [off, off + len) of each token's row.
  std::vector<std::vector<int32_t>> host;  // the ids of each block, in the order they are made
  int tables = 0;                           // index tables made (their keys in the cache)
  const auto to_device = [&](const std::vector<int32_t>& ids) {
    if (cache) return cache->table(fmt::format("split.{}", tables++), ids);
    return rt_->upload(ids.data(), {int64_t(ids.size())}, DType::I32, options_.device);
  };
  auto columns = [&](int64_t n, int64_t width, const std::vector<std::pair<int64_t, int64_t>>& blocks) {
    std::vector<int32_t> ids;
    for (int64_t t = 0; t < tokens; ++t)
      for (auto [off, len] : blocks)
        for (int64_t j = 0; j < len / width; ++j) ids.push_back(int32_t(t * (n / width) + off / width + j));
    LATHE_CHECK(tokens * (n / width) < (int64_t(1) << 31), "model: {} tokens exceed the index range of the splits", tokens);
    Columns made{width, n, to_device(ids)};
    host.push_back(std::move(ids));
    return made;
  };
  // The inverse of the last `parts` blocks made, which partition the rows of the whole: row r of the whole is row
  // merge[r] of those blocks' rows stacked in order.
  auto merge = [&](size_t parts) {
    std::vector<int32_t> inv;
    int32_t row = 0;
    for (size_t b = host.size() - parts; b < host.size(); ++b)
      for (int32_t id : host[b]) {
        if (size_t(id) >= inv.size()) inv.resize(size_t(id) + 1, -1);
        inv[size_t(id)] = row++;
      }
    LATHE_ASSERT(size_t(row) == inv.size() && std::find(inv.begin(), inv.end(), -1) == inv.end());
    return to_device(inv);
  };
  split_ = SplitIndex{};
  split_.tokens = tokens;
  split_.cache = cache;
  if (c.num_heads > 0 && c.head_dim > 0) {
    const int64_t d = c.head_dim;
    std::vector<std::pair<int64_t, int64_t>> query, gate;
    for (int64_t h = 0; h < c.num_heads; ++h) query.push_back({2 * h * d, d}), gate.push_back({(2 * h + 1) * d, d});
    split_.query = columns(2 * c.num_heads * d, d, query);
    split_.gate = columns(2 * c.num_heads * d, d, gate);
    split_.merge_query_gate = merge(2);
  }
  const int64_t kd = c.linear_num_key_heads * c.linear_key_head_dim, vd = c.linear_num_value_heads * c.linear_value_head_dim;
  if (kd > 0 && vd > 0) {
    const int64_t width = std::gcd(kd, vd), n = 2 * kd + vd;
    split_.qkv[0] = columns(n, width, {{0, kd}});
    split_.qkv[1] = columns(n, width, {{kd, kd}});
    split_.qkv[2] = columns(n, width, {{2 * kd, vd}});
    split_.merge_qkv = merge(3);
  }
  if (c.fused_gdn_projections) {
    const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, hk = c.linear_num_key_heads;
    const int64_t r = c.linear_num_value_heads / hk, block = 2 * dk + 2 * r * dv;
    std::vector<std::pair<int64_t, int64_t>> qkv, z, b, a;
    for (auto [off, len] : {std::pair{int64_t(0), dk}, std::pair{dk, dk}, std::pair{2 * dk, r * dv}})
      for (int64_t h = 0; h < hk; ++h) qkv.push_back({h * block + off, len});
    for (int64_t h = 0; h < hk; ++h) {
      z.push_back({h * block + 2 * dk + r * dv, r * dv});
      b.push_back({h * 2 * r, r});
      a.push_back({h * 2 * r + r, r});
    }
    const int64_t width = std::gcd(dk, r * dv);
    split_.next_qkv = columns(hk * block, width, qkv);
    split_.next_z = columns(hk * block, width, z);
    split_.merge_qkvz = merge(2);
    split_.next_b = columns(hk * 2 * r, r, b);
    split_.next_a = columns(hk * 2 * r, r, a);
    split_.merge_ba = merge(2);
  }
  return split_;
}

Tensor Qwen35Model::gather_columns(const Tensor& y, const Columns& c) {
  ExecContext cx = ctx();
  const int64_t t = y.size(0);
  return embedding(cx, y.view({-1, c.width}), c.ids).view({t, -1});
}

Tensor Qwen35Model::merge_columns(const std::vector<Tensor>& dparts, const std::vector<const Columns*>& blocks,
                                  const Tensor& merge) {
  ExecContext cx = ctx();
  const int64_t t = dparts[0].size(0), width = blocks[0]->width, n = blocks[0]->n;
  Tensor stacked = Tensor::empty({t * n / width, width}, dparts[0].dtype(), cx.allocator);
  int64_t row = 0;
  for (size_t i = 0; i < dparts.size(); ++i) {
    const int64_t rows = blocks[i]->ids.size(0);
    copy_into(cx, dparts[i].view({rows, width}), stacked.narrow(0, row, rows));  // whole rows: contiguous
    row += rows;
  }
  return embedding(cx, stacked, merge).view({t, n});
}

Tensor Qwen35Model::l2norm(const Tensor& x) {
  ExecContext cx = ctx();
  const double dk = double(config_.linear_key_head_dim);
  return rmsnorm(cx, x, l2_weight_, {1e-6 / dk, 0.0});
}

Tensor Qwen35Model::l2norm_backward(const Tensor& x, const Tensor& dy) {
  ExecContext cx = ctx();
  const double dk = double(config_.linear_key_head_dim);
  return rmsnorm_backward(cx, x, l2_weight_, dy, {1e-6 / dk, 0.0})[0];
}

void Qwen35Model::attention_forward(const Layer& l, LayerActs& a, const PackedBatch& b, bool training) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = a.xn.size(0), d = c.head_dim, hd = c.num_heads * d;
  const NormAttrs norm{c.rms_norm_eps, 1.0};
  const SplitIndex& split = split_index(t, b.cache);
  const Tensor yq = project(l.index, LoraTarget::q_proj, l.q_proj, a.xn, b, training);  // (T, 2 H d)
  a.q = gather_columns(yq, split.query).view({t, c.num_heads, d});
  a.gate = gather_columns(yq, split.gate);
  a.k = project(l.index, LoraTarget::k_proj, l.k_proj, a.xn, b, training).view({t, c.num_kv_heads, d});
  a.v = project(l.index, LoraTarget::v_proj, l.v_proj, a.xn, b, training).view({t, c.num_kv_heads, d});
  const RopeAttrs rot{c.rope_theta, c.rotary_dim(), false};
  const Tensor positions = stack_positions(b);
  a.qr = rope(cx, rmsnorm(cx, a.q, w(l.q_norm), norm), positions, rot);
  a.kr = rope(cx, rmsnorm(cx, a.k, w(l.k_norm), norm), positions, rot);
  // cp: every row of the batch for a cp-th of the heads, over whole documents, and back
  const bool cp = context_parallel();
  if (cp) {
    a.qr = heads_to_sequence(a.qr);
    a.kr = heads_to_sequence(a.kr);
    a.v = heads_to_sequence(a.v);
  }
  std::tie(a.o, a.lse) = attend(l.index, a.qr, a.kr, a.v, b);  // a decoding batch: over its cache
  a.o_rows = cp ? sequence_to_heads(a.o) : a.o;
  a.sg = sigmoid(cx, a.gate);
  a.y = mul(cx, a.o_rows.view({t, hd}), a.sg);
  a.mix = project(l.index, LoraTarget::o_proj, l.o_proj, a.y, b, training);
}

void Qwen35Model::gdn_forward(const Layer& l, LayerActs& a, const PackedBatch& b, bool training) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = a.xn.size(0), hv = c.linear_num_value_heads;
  const int64_t dv = c.linear_value_head_dim, vd = hv * dv;
  const SplitIndex& split = split_index(t, b.cache);
  if (c.fused_gdn_projections) {  // qwen3_next: the conv input, z, b and a are column gathers of two projections
    const Tensor qkvz = project(l.index, LoraTarget::in_proj_qkvz, l.in_qkvz, a.xn, b, training);
    const Tensor ba = project(l.index, LoraTarget::in_proj_ba, l.in_ba, a.xn, b, training);
    a.qkv = gather_columns(qkvz, split.next_qkv);
    a.z = gather_columns(qkvz, split.next_z).view({t, hv, dv});
    a.bproj = gather_columns(ba, split.next_b);
    a.aproj = gather_columns(ba, split.next_a);
  } else {
    a.qkv = project(l.index, LoraTarget::in_proj_qkv, l.in_qkv, a.xn, b, training);  // (T, 2K + V)
    a.z = project(l.index, LoraTarget::in_proj_z, l.in_z, a.xn, b, training).view({t, hv, dv});
    a.bproj = project(l.index, LoraTarget::in_proj_b, l.in_b, a.xn, b, training);
    a.aproj = project(l.index, LoraTarget::in_proj_a, l.in_a, a.xn, b, training);
  }
  if (context_parallel() && !b.cache) {
    if (gdn_passes_states()) gdn_core_over_chain(l, a, b);
    else gdn_core_over_ranks(l, a, b, training);
  } else {
    gdn_core(l, a, b, training);
  }
  a.gy = gated_rmsnorm(cx, a.core, w(l.gnorm), a.z, {c.rms_norm_eps, 0.0});  // rmsnorm(core; w) * silu(z)
  a.mix = project(l.index, LoraTarget::out_proj, l.out_proj, a.gy.view({t, vd}), b, training);
}

Tensor Qwen35Model::conv_weight(const Layer& l) const {
  const Tensor& conv = w(l.conv);
  return conv.view({conv.size(0), config_.linear_conv_kernel_dim});
}

// Context parallelism: the rows of the conv weight (2K + V, W) for this rank's channels, [q_j | k_j | v_j].
Tensor Qwen35Model::rank_conv_weight(const Layer& l) {
  ExecContext cx = ctx();
  const CpChannels ch = cp_channels(config_, cp_size());
  const Tensor whole = conv_weight(l);
  Tensor out = Tensor::empty({ch.width(), whole.size(1)}, whole.dtype(), cx.allocator);
  for (const auto& [at, part, n] : ch.blocks(cp_rank()))
    copy_into(cx, whole.narrow(0, at, n), out.narrow(0, part - cp_rank() * ch.width(), n));
  return out;
}

// Context parallelism: the rank's channel blocks of every row (the head all-to-all of in_proj_qkv's output by its
// [q | k | v] sections, and of b and a by value head), the conv, the L2 norms, the decay and the delta rule over whole
// documents for the rank's cp-th of the heads (its rows of the conv weight, A_log and dt_bias), the output back on the
// rank's rows.
void Qwen35Model::gdn_core_over_ranks(const Layer& l, LayerActs& a, const PackedBatch& b, bool training) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const CpChannels ch = cp_channels(config_, cp_size());
  const int64_t parts = ch.parts, rank = cp_rank(), rows = a.xn.size(0), hv = c.linear_num_value_heads;
  const int64_t kc = ch.kc(), vc = ch.vc(), hvc = hv / parts, width = ch.width();
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  a.qkv = heads_to_sequence(qkv_to_parts(cx, a.qkv, 1, ch, true).view({rows, parts, width}));
  const int64_t n = a.qkv.size(0);  // every row, padded
  a.qkv = a.qkv.view({n, width});
  const Tensor& cu = cp_cu_seqlens(b);
  a.conv = causal_conv1d(cx, a.qkv, rank_conv_weight(l), cu);
  const Tensor act = silu(cx, a.conv);
  a.qa = contiguous(cx, act.narrow(1, 0, kc)).view({n, kc / dk, dk});
  a.ka = contiguous(cx, act.narrow(1, kc, kc)).view({n, kc / dk, dk});
  a.va = contiguous(cx, act.narrow(1, 2 * kc, vc)).view({n, hvc, dv});
  a.qn = l2norm(a.qa);
  a.kn = l2norm(a.ka);
  a.bproj = heads_to_sequence(a.bproj.view({rows, parts, hvc})).view({n, hvc});
  a.aproj = heads_to_sequence(a.aproj.view({rows, parts, hvc})).view({n, hvc});
  const DType gd = gdn_gate_dtype(options_.dtype);
  a.beta = sigmoid(cx, as_dtype(cx, a.bproj, gd));
  a.g = gdn_decay(cx, as_dtype(cx, a.aproj, gd), as_dtype(cx, w(l.a_log).narrow(0, rank * hvc, hvc), gd),
                  as_dtype(cx, w(l.dt_bias).narrow(0, rank * hvc, hvc), gd));
  // the backward's recompute: what the forward kept
  if (take_kept_rule(a.core, a.states, a.chunk_cache, a.state_in)) return;
  GatedDeltaAttrs rule;
  rule.save_states = training;
  std::vector<Tensor> r = gated_delta_rule(cx, a.qn, a.kn, a.va, a.g, a.beta, cu, rule);
  a.core = sequence_to_heads(r[0]);  // (rows, Hv, dv)
  a.states = r[1];
  a.chunk_cache = r[2];
  keep_rule(a.core, a.states, a.chunk_cache, a.state_in);
}

void Qwen35Model::gdn_core(const Layer& l, LayerActs& a, const PackedBatch& b, bool training) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = a.xn.size(0), hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, kd = hk * dk, vd = hv * dv;
  const SplitIndex& split = split_index(t, b.cache);
  const Tensor conv_w = conv_weight(l);
  if (b.cache) {
    // Decoding: per document, the conv of [its sequence's cached W - 1 pre-conv rows ; its new rows] as one document,
    // keeping the last outputs, equals the conv over the whole sequence (zero rows before its start are the op's zero
    // history); its new history is the last W - 1 rows of that concatenation. All documents in one conv call; the
    // rows are arranged by three row gathers (a copy per document was 4 x B small kernels a layer).
    const Tensor hist = b.cache->conv_history(l.index);  // (B, W - 1, C)
    const int64_t docs = int64_t(b.host_cu.size()) - 1, h = hist.size(1), ch = 2 * kd + vd;
    Tensor both = Tensor::empty({docs * h + t, ch}, a.qkv.dtype(), cx.allocator);  // [every history ; every new row]
    if (h > 0) copy_into(cx, hist.view({docs * h, ch}), both.narrow(0, 0, docs * h));
    copy_into(cx, a.qkv, both.narrow(0, docs * h, t));
    std::vector<int32_t> cu = {0}, seq_rows, out_rows, hist_rows;
    for (int64_t i = 0; i < docs; ++i) {
      const int64_t at = cu.back(), first = b.host_cu[size_t(i)], n = b.host_cu[size_t(i + 1)] - first;
      for (int64_t k = 0; k < h; ++k) seq_rows.push_back(int32_t(i * h + k));
      for (int64_t k = 0; k < n; ++k) seq_rows.push_back(int32_t(docs * h + first + k));
      for (int64_t k = 0; k < n; ++k) out_rows.push_back(int32_t(at + h + k));
      for (int64_t k = 0; k < h; ++k) hist_rows.push_back(int32_t(at + n + k));
      cu.push_back(int32_t(at + h + n));
    }
    DecodeCache& cache = *b.cache;
    const Tensor seq = embedding(cx, both, cache.table("conv.seq_rows", seq_rows));
    const Tensor conv = causal_conv1d(cx, seq, conv_w, cache.table("conv.cu", cu));
    a.conv = embedding(cx, conv, cache.table("conv.out_rows", out_rows));
    a.conv_history = h > 0 ? embedding(cx, seq, cache.table("conv.hist_rows", hist_rows)).view({docs, h, ch})
                           : Tensor::empty({docs, 0, ch}, a.qkv.dtype(), cx.allocator);
  } else {
    a.conv = causal_conv1d(cx, a.qkv, conv_w, b.cu_seqlens);
  }
  rule_inputs(l, a, split);
  if (b.cache) {  // decoding: the recurrence from the cached state, whose final state is the new cache
    const std::vector<Tensor> r = gated_delta_rule_state(cx, a.qn, a.kn, a.va, a.g, a.beta, b.cu_seqlens,
                                                         b.cache->gdn_state(l.index));
    a.core = r[0];
    b.cache->set_gdn(l.index, a.conv_history, r[1]);
  } else if (!take_kept_rule(a.core, a.states, a.chunk_cache, a.state_in)) {  // else the recompute: the kept ones
    GatedDeltaAttrs rule;
    rule.save_states = training;  // a backward follows: it reads the states instead of recomputing them
    std::vector<Tensor> r = gated_delta_rule(cx, a.qn, a.kn, a.va, a.g, a.beta, b.cu_seqlens, rule);
    a.core = r[0];
    a.states = r[1];
    a.chunk_cache = r[2];
    keep_rule(a.core, a.states, a.chunk_cache, a.state_in);
  }
}

// The delta rule's inputs from the conv's output (a.conv) and the b and a projections: silu, the q, k, v blocks, the
// L2 norms, beta and the decay.
void Qwen35Model::rule_inputs(const Layer& l, LayerActs& a, const SplitIndex& split) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = a.conv.size(0), hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const Tensor act = silu(cx, a.conv);
  a.qa = gather_columns(act, split.qkv[0]).view({t, hk, dk});
  a.ka = gather_columns(act, split.qkv[1]).view({t, hk, dk});
  a.va = gather_columns(act, split.qkv[2]).view({t, hv, dv});
  a.qn = l2norm(a.qa);
  a.kn = l2norm(a.ka);
  const DType gd = gdn_gate_dtype(options_.dtype);
  a.beta = sigmoid(cx, as_dtype(cx, a.bproj, gd));
  a.g = gdn_decay(cx, as_dtype(cx, a.aproj, gd), as_dtype(cx, w(l.a_log), gd), as_dtype(cx, w(l.dt_bias), gd));
}

// Context parallelism where the heads are too few for the all-to-all: the rank's rows, the conv's history and the
// rule's state passed along the cp group (model/gdn_context.h).
bool Qwen35Model::gdn_passes_states() const {
  const int64_t cp = cp_size(), hk = config_.linear_num_key_heads, hv = config_.linear_num_value_heads;
  return context_parallel() && !(hk % cp == 0 || (cp % hk == 0 && hv % cp == 0));
}

void Qwen35Model::gdn_core_over_chain(const Layer& l, LayerActs& a, const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = a.xn.size(0), history = c.linear_conv_kernel_dim - 1;
  const CpChain ch = cp_chain(b.host_cu, t, cp_rank(), cp_size());
  const std::vector<int32_t> conv_cu = conv_offsets(ch, history);
  a.qkv = conv_input_with_history(cx, *options_.cp, ch, a.qkv, history);  // (history + T, 2K + V)
  const Tensor conv = causal_conv1d(cx, a.qkv, conv_weight(l),
                                    rt_->upload(conv_cu.data(), {int64_t(conv_cu.size())}, DType::I32, options_.device));
  a.conv = contiguous(cx, conv.narrow(0, history, t));
  rule_inputs(l, a, split_index(t, nullptr));
  // The backward's recompute: the kept output and received state, so the chain (each rank waiting on the one before)
  // runs once. Every rank of the group recomputes the same layers and keeps alike, so none waits on a skipped send.
  if (take_kept_rule(a.core, a.states, a.chunk_cache, a.state_in)) return;
  const Tensor cu = rt_->upload(ch.cu.data(), {int64_t(ch.cu.size())}, DType::I32, options_.device);
  std::vector<Tensor> r = rule_over_chain(cx, *options_.cp, ch, a.qn, a.kn, a.va, a.g, a.beta, cu);
  a.core = r[0];
  a.state_in = r[1];
  keep_rule(a.core, a.states, a.chunk_cache, a.state_in);
}

Qwen35Model::LayerActs Qwen35Model::layer_forward(const Layer& l, const ResidualStream& x, const PackedBatch& b,
                                                  bool training) {
  ExecContext cx = ctx();
  const NormAttrs norm{config_.rms_norm_eps, 1.0};
  LayerActs a;
  Tensor xn;
  std::tie(xn, a.x) = norm_stream(x, w(l.input_norm), norm);
  a.xn = block_input(xn, block_tokens(b));  // sequence parallelism: every rank's rows of the stream
  if (l.linear) gdn_forward(l, a, b, training);
  else attention_forward(l, a, b, training);
  a.mix = block_output(a.mix);  // tensor parallelism: every rank's heads (summed onto the stream's rows under sp)
  // h = x + mixer output and hn = post_norm(h) in one pass
  std::vector<Tensor> post = residual_rmsnorm(cx, a.x, a.mix, w(l.post_norm), norm);
  a.hn = block_input(post[0], block_tokens(b));
  a.h = post[1];
  a.mlp = mlp_forward(l.index, l.mlp, a.hn, b, training);
  a.out = {a.h, a.mlp.out};
  return a;
}

Tensor Qwen35Model::attention_backward_part(const Layer& l, const LayerActs& a, const Tensor& dh, const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = dh.size(0), d = c.head_dim, hd = c.num_heads * d;
  const NormAttrs norm{c.rms_norm_eps, 1.0};
  const RopeAttrs inv{c.rope_theta, c.rotary_dim(), true};
  const SplitIndex& split = split_index(t, b.cache);
  Tensor dy;  // (T, H d)
  project_backward(l.index, LoraTarget::o_proj, l.o_proj, a.y, dh, dy, b);
  const Tensor d_o = mul(cx, dy, a.sg).view({t, c.num_heads, d});
  const Tensor dgate = sigmoid_backward(cx, a.sg, mul(cx, dy, a.o_rows.view({t, hd})));
  const bool cp = context_parallel();
  std::vector<Tensor> dqkv = attention_backward(cx, a.qr, a.kr, a.v, a.o, a.lse, cp ? heads_to_sequence(d_o) : d_o,
                                                cp ? cp_cu_seqlens(b) : b.cu_seqlens, {0.0, options_.deterministic});
  if (cp) {  // back to the rank's rows, every head (a key/value head's copies summed)
    dqkv[0] = sequence_to_heads(dqkv[0]);
    for (int i : {1, 2}) dqkv[size_t(i)] = sequence_to_heads(dqkv[size_t(i)], config_.num_kv_heads);
  }
  const Tensor positions = stack_positions(b);
  const std::vector<Tensor> dq = rmsnorm_backward(cx, a.q, w(l.q_norm), rope(cx, dqkv[0], positions, inv), norm);
  const std::vector<Tensor> dk = rmsnorm_backward(cx, a.k, w(l.k_norm), rope(cx, dqkv[1], positions, inv), norm);
  Tensor dq_norm = dq[1], dk_norm = dk[1];
  tp_sum(dq_norm);  // tensor parallelism: the norms' gains are every rank's heads'
  tp_sum(dk_norm);
  add_grad(l.q_norm, dq_norm);
  add_grad(l.k_norm, dk_norm);
  // d(q_proj output): the query and gate gradients scattered back to their interleaved columns.
  const Tensor dyq = merge_columns({contiguous(cx, dq[0]), contiguous(cx, dgate)}, {&split.query, &split.gate},
                                   split.merge_query_gate);
  Tensor dxn;
  project_backward(l.index, LoraTarget::q_proj, l.q_proj, a.xn, dyq, dxn, b);
  project_backward(l.index, LoraTarget::k_proj, l.k_proj, a.xn, dk[0].view({t, -1}), dxn, b);
  project_backward(l.index, LoraTarget::v_proj, l.v_proj, a.xn, dqkv[2].view({t, -1}), dxn, b);
  return dxn;
}

Tensor Qwen35Model::gdn_backward_part(const Layer& l, const LayerActs& a, const Tensor& dh, const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = dh.size(0), hv = c.linear_num_value_heads;
  const int64_t dv = c.linear_value_head_dim, vd = hv * dv;
  const SplitIndex& split = split_index(t, b.cache);
  Tensor dgy;
  project_backward(l.index, LoraTarget::out_proj, l.out_proj, a.gy.view({t, vd}), dh, dgy, b);
  dgy = dgy.view({t, hv, dv});
  // gy = rmsnorm(core; w) * silu(z): {dcore, dw, dz}
  const std::vector<Tensor> dnorm = gated_rmsnorm_backward(cx, a.core, w(l.gnorm), a.z, dgy, {c.rms_norm_eps, 0.0});
  Tensor dgnorm = dnorm[1];
  tp_sum(dgnorm);  // tensor parallelism: the gain is every rank's value heads'
  add_grad(l.gnorm, dgnorm);
  const Tensor& dz = dnorm[2];
  Tensor dqkv, db, da;  // the projections' output gradients: (T, 2K + V), (T, Hv) x2
  if (!context_parallel() || b.cache) gdn_core_backward(l, a, dnorm[0], b, dqkv, db, da);
  else if (gdn_passes_states()) gdn_core_over_chain_backward(l, a, dnorm[0], b, dqkv, db, da);
  else gdn_core_over_ranks_backward(l, a, dnorm[0], b, dqkv, db, da);
  Tensor dxn;
  if (c.fused_gdn_projections) {
    const Tensor dqkvz = merge_columns({dqkv, contiguous(cx, dz).view({t, vd})}, {&split.next_qkv, &split.next_z},
                                       split.merge_qkvz);
    const Tensor dba = merge_columns({contiguous(cx, db), contiguous(cx, da)}, {&split.next_b, &split.next_a},
                                     split.merge_ba);
    project_backward(l.index, LoraTarget::in_proj_qkvz, l.in_qkvz, a.xn, dqkvz, dxn, b);
    project_backward(l.index, LoraTarget::in_proj_ba, l.in_ba, a.xn, dba, dxn, b);
    return dxn;
  }
  project_backward(l.index, LoraTarget::in_proj_qkv, l.in_qkv, a.xn, dqkv, dxn, b);
  project_backward(l.index, LoraTarget::in_proj_z, l.in_z, a.xn, dz.view({t, vd}), dxn, b);
  project_backward(l.index, LoraTarget::in_proj_b, l.in_b, a.xn, db, dxn, b);
  project_backward(l.index, LoraTarget::in_proj_a, l.in_a, a.xn, da, dxn, b);
  return dxn;
}

// gdn_core's backward: from d(core) to the gradients of in_proj_qkv's output (dqkv), of b and of a; the conv's,
// A_log's and dt_bias's gradients added.
void Qwen35Model::gdn_core_backward(const Layer& l, const LayerActs& a, const Tensor& dcore, const PackedBatch& b,
                                    Tensor& dqkv, Tensor& db, Tensor& da) {
  ExecContext cx = ctx();
  const SplitIndex& split = split_index(dcore.size(0), b.cache);
  const std::vector<Tensor> dr = gated_delta_rule_backward(cx, a.qn, a.kn, a.va, a.g, a.beta, dcore, b.cu_seqlens,
                                                           a.states, {}, a.chunk_cache);
  const Tensor dconv_out = rule_inputs_backward(l, a, dr, split, db, da);
  const std::vector<Tensor> dconv = causal_conv1d_backward(
      cx, a.qkv, conv_weight(l), dconv_out, b.cu_seqlens);
  add_grad(l.conv, dconv[1]);
  dqkv = dconv[0];
}

// rule_inputs' backward from the rule's {dq, dk, dv, dg, dbeta}: A_log's and dt_bias's gradients added, those of the
// b and a projections' outputs set, and the conv output's returned.
Tensor Qwen35Model::rule_inputs_backward(const Layer& l, const LayerActs& a, const std::vector<Tensor>& dr,
                                         const SplitIndex& split, Tensor& db, Tensor& da) {
  ExecContext cx = ctx();
  // g and beta are gdn_gate_dtype: the decay and sigmoid backward run there, the casts' backward casts back.
  const DType gd = gdn_gate_dtype(options_.dtype), md = options_.dtype;
  const std::vector<Tensor> ddecay = gdn_decay_backward(cx, as_dtype(cx, a.aproj, gd), as_dtype(cx, w(l.a_log), gd),
                                                        as_dtype(cx, w(l.dt_bias), gd), dr[3]);
  add_grad(l.a_log, as_dtype(cx, ddecay[1], md));
  add_grad(l.dt_bias, as_dtype(cx, ddecay[2], md));
  db = as_dtype(cx, sigmoid_backward(cx, a.beta, dr[4]), md);
  da = as_dtype(cx, ddecay[0], md);
  // d(silu(conv)): the q, k, v gradients scattered back to their column blocks.
  const Tensor dact = merge_columns({l2norm_backward(a.qa, dr[0]), l2norm_backward(a.ka, dr[1]), contiguous(cx, dr[2])},
                                    {&split.qkv[0], &split.qkv[1], &split.qkv[2]}, split.merge_qkv);
  return silu_backward(cx, a.conv, dact);
}

// gdn_core_over_chain's backward: the rule's along the chain (its state gradient from the next rank, to the previous),
// the conv's over the rank's rows with their history, whose rows' gradient goes to the ranks that hold them.
void Qwen35Model::gdn_core_over_chain_backward(const Layer& l, const LayerActs& a, const Tensor& dcore,
                                               const PackedBatch& b, Tensor& dqkv, Tensor& db, Tensor& da) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = dcore.size(0), history = c.linear_conv_kernel_dim - 1, channels = a.qkv.size(1);
  const CpChain ch = cp_chain(b.host_cu, t, cp_rank(), cp_size());
  const std::vector<Tensor> dr =
      rule_over_chain_backward(*rt_, cx, *options_.cp, ch, a.qn, a.kn, a.va, a.g, a.beta, dcore, a.state_in);
  const Tensor dconv_out = rule_inputs_backward(l, a, dr, split_index(t, nullptr), db, da);
  Tensor dy = zeros(cx, {history + t, channels}, dconv_out.dtype());
  copy_into(cx, dconv_out, dy.narrow(0, history, t));
  const std::vector<int32_t> conv_cu = conv_offsets(ch, history);
  const std::vector<Tensor> dconv = causal_conv1d_backward(
      cx, a.qkv, conv_weight(l), dy,
      rt_->upload(conv_cu.data(), {int64_t(conv_cu.size())}, DType::I32, options_.device));
  add_grad(l.conv, dconv[1]);
  dqkv = contiguous(cx, dconv[0].narrow(0, history, t));
  add_history_grad(cx, *options_.cp, ch, dconv[0].narrow(0, 0, history), dqkv);
}

// gdn_core_over_ranks' backward: d(core) on the rank's rows to every row of the rank's heads, the rule's, decay's and
// conv's backward there, and the gradients back to the rank's rows; the rank's rows of the conv weight's, A_log's and
// dt_bias's gradients added (zero elsewhere: the cp group's sum makes them whole).
void Qwen35Model::gdn_core_over_ranks_backward(const Layer& l, const LayerActs& a, const Tensor& dcore,
                                               const PackedBatch& b, Tensor& dqkv, Tensor& db, Tensor& da) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const CpChannels ch = cp_channels(config_, cp_size());
  const int64_t parts = ch.parts, rank = cp_rank(), rows = dcore.size(0), n = a.qkv.size(0);
  const int64_t hv = c.linear_num_value_heads, kc = ch.kc(), vc = ch.vc(), hvc = hv / parts, width = ch.width();
  const Tensor& cu = cp_cu_seqlens(b);
  const std::vector<Tensor> dr = gated_delta_rule_backward(cx, a.qn, a.kn, a.va, a.g, a.beta, heads_to_sequence(dcore),
                                                           cu, a.states, {}, a.chunk_cache);
  const DType gd = gdn_gate_dtype(options_.dtype), md = options_.dtype;
  const std::vector<Tensor> ddecay =
      gdn_decay_backward(cx, as_dtype(cx, a.aproj, gd), as_dtype(cx, w(l.a_log).narrow(0, rank * hvc, hvc), gd),
                         as_dtype(cx, w(l.dt_bias).narrow(0, rank * hvc, hvc), gd), dr[3]);
  const auto rank_part = [&](const Tensor& g, int64_t whole, int64_t at) {  // zeros, the rank's part at `at`
    Tensor full = zeros(cx, {whole, g.numel() / g.size(0)}, md);
    copy_into(cx, as_dtype(cx, g, md).view({g.size(0), -1}), full.narrow(0, at, g.size(0)));
    return full;
  };
  add_grad(l.a_log, rank_part(ddecay[1], hv, rank * hvc));
  add_grad(l.dt_bias, rank_part(ddecay[2], hv, rank * hvc));
  const Tensor db_all = as_dtype(cx, sigmoid_backward(cx, a.beta, dr[4]), md), da_all = as_dtype(cx, ddecay[0], md);
  db = sequence_to_heads(db_all.view({n, 1, hvc})).view({rows, hv});
  da = sequence_to_heads(da_all.view({n, 1, hvc})).view({rows, hv});
  Tensor dact = Tensor::empty({n, width}, a.conv.dtype(), cx.allocator);  // [dq | dk | dv] of the rank's heads
  copy_into(cx, l2norm_backward(a.qa, dr[0]).view({n, kc}), dact.narrow(1, 0, kc));
  copy_into(cx, l2norm_backward(a.ka, dr[1]).view({n, kc}), dact.narrow(1, kc, kc));
  copy_into(cx, contiguous(cx, dr[2]).view({n, vc}), dact.narrow(1, 2 * kc, vc));
  const std::vector<Tensor> dconv =
      causal_conv1d_backward(cx, a.qkv, rank_conv_weight(l), silu_backward(cx, a.conv, dact), cu);
  add_grad(l.conv, qkv_to_parts(cx, rank_part(dconv[1], parts * width, rank * width), 0, ch, false));
  dqkv = qkv_to_parts(cx, sequence_to_heads(dconv[0].view({n, 1, width})).view({rows, parts * width}), 1, ch, false);
}

Tensor Qwen35Model::layer_backward(const Layer& l, const LayerActs& a, const Tensor& dout, const PackedBatch& b) {
  ExecContext cx = ctx();
  const NormAttrs norm{config_.rms_norm_eps, 1.0};
  // MLP: out = h + mlp(hn)
  const Tensor dhn = mlp_backward(l.index, l.mlp, a.hn, a.mlp, dout, b);
  const std::vector<Tensor> dpost = residual_rmsnorm_backward(cx, a.h, w(l.post_norm), dhn, dout, norm);  // dh
  add_norm_grad(l.post_norm, dpost[1]);
  const Tensor& dh = dpost[0];
  // Mixer: h = x + mixer(input_norm(x)), over every rank's rows of the stream under sequence parallelism
  const Tensor dh_all = block_input(dh, block_tokens(b));
  Tensor dxn = l.linear ? gdn_backward_part(l, a, dh_all, b) : attention_backward_part(l, a, dh_all, b);
  // tensor parallelism: the column-parallel projections' parts of the input gradient summed
  const std::vector<Tensor> din = residual_rmsnorm_backward(cx, a.x, w(l.input_norm), block_output(dxn), dh, norm);
  add_norm_grad(l.input_norm, din[1]);
  return din[0];
}

Tensor Qwen35Model::logits(const PackedBatch& b) { return DecoderStack::logits(*this, b); }

std::vector<double> Qwen35Model::label_logprobs(const PackedBatch& b) { return DecoderStack::label_logprobs(*this, b); }

LossResult Qwen35Model::loss(const PackedBatch& b, bool backward, double loss_scale, const BackwardHooks& hooks) {
  return DecoderStack::loss(*this, b, backward, loss_scale, hooks);
}

std::vector<int64_t> Qwen35Model::grads_complete_after() const { return DecoderStack::grads_complete_after(*this); }

Tensor Qwen35Model::last_hidden(const PackedBatch& b) { return DecoderStack::last_hidden(*this, b); }
Tensor Qwen35Model::lm_head_logits(const Tensor& x) { return DecoderStack::lm_head_logits(*this, x); }
std::shared_ptr<StageWork> Qwen35Model::stage_forward(int stage, const PackedBatch& b, const Tensor& in, StageHead head,
                                                double loss_scale) {
  return DecoderStack::stage_forward(*this, stage, b, in, head, loss_scale);
}
Tensor Qwen35Model::stage_backward(StageWork& work, const Tensor& dout, const PackedBatch& b, const Tensor& d_aux) {
  return DecoderStack::stage_backward(*this, work, dout, b, d_aux);
}

}  // namespace lathe
