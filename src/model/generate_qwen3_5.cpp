// Qwen35Decoder: cached decoding of the Qwen3.5 hybrid model through the model's own layers. The decoder holds the
// caches (a KV cache for the attention layers, a conv history and a recurrent state per Gated DeltaNet layer) and
// hands them to the layers as the batch's DecodeCache; Qwen35Model::gdn_forward's decoding branch says how the conv
// history and the state continue the sequence. Covered by tests/models/test_generate_qwen3_5.cpp.
#include "model/generate_qwen3_5.h"

#include "ops/ops.h"

namespace lathe {

namespace {

Tensor zeros(ExecContext& ctx, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, ctx.allocator);
  if (t.nbytes() > 0) ctx.backend.fill_bytes(t.data_ptr(), 0, t.nbytes(), ctx.stream);
  return t;
}

}  // namespace

// The caches of one call as the model's layers see them: attention layers extend the KV cache at `past`; GDN layers
// read the committed conv history and state and leave the new ones for feed_logits to commit.
class Qwen35Decoder::View final : public DecodeCache {
 public:
  View(Qwen35Decoder& d, int64_t past, const Tensor& cu_seqlens) : d_(&d), past_(past), cu_seqlens_(cu_seqlens) {}
  Tensor attend(ExecContext& ctx, int64_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v) override {
    return d_->kv_.extend(ctx, d_->layers_.at(size_t(layer)).slot, qr, kr, v, past_, cu_seqlens_);
  }
  // One sequence: the conv history (W - 1, C) as a batch of one.
  Tensor conv_history(int64_t layer) override {
    const Tensor& h = d_->conv_[gdn_slot(layer)];
    return h.view({1, h.size(0), h.size(1)});
  }
  Tensor gdn_state(int64_t layer) override { return d_->state_[gdn_slot(layer)]; }
  void set_gdn(int64_t layer, Tensor conv_history, Tensor state) override {
    d_->new_conv_[gdn_slot(layer)] = conv_history.view({conv_history.size(1), conv_history.size(2)});
    d_->new_state_[gdn_slot(layer)] = std::move(state);
  }

 private:
  size_t gdn_slot(int64_t layer) const {
    const Layer& l = d_->layers_.at(size_t(layer));
    LATHE_ASSERT(l.linear);
    return l.slot;
  }
  Qwen35Decoder* d_;
  int64_t past_;
  Tensor cu_seqlens_;
};

Qwen35Decoder::Qwen35Decoder(Runtime& rt, Qwen35Model& model, int64_t capacity)
    : rt_(&rt), model_(&model),
      kv_(0, model.config().num_kv_heads, model.config().head_dim, model.options().dtype) {
  const ModelConfig& c = model.config();
  size_t n_gdn = 0, n_attn = 0;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    Layer l;
    l.linear = c.layer_types[size_t(i)] == "linear_attention";
    l.slot = l.linear ? n_gdn++ : n_attn++;
    layers_.push_back(l);
  }
  kv_ = KvCache(n_attn, c.num_kv_heads, c.head_dim, model.options().dtype);
  conv_.resize(n_gdn);
  state_.resize(n_gdn);
  reset();
  reserve(std::max<int64_t>(capacity, 1));
}

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
  Tensor logits;
  for (size_t first = 0; first < ids.size(); first += chunk) {
    const int64_t n = int64_t(chunk), past = length_;
    reserve(past + n);
    const std::vector<int32_t> step(ids.begin() + std::ptrdiff_t(first), ids.begin() + std::ptrdiff_t(first + chunk));
    PackedBatch b = continuation_batch(*rt_, device, {step}, {past}, c.vocab_size);
    View view(*this, past, b.cu_seqlens);
    b.cache = &view;
    new_conv_ = conv_;
    new_state_ = state_;
    const Tensor step_logits = model_->last_logits(b);  // (1, V)
    // Only now: a failed step leaves every cache as it was (KV rows past the length are never read).
    conv_.swap(new_conv_);
    state_.swap(new_state_);
    new_conv_.clear();
    new_state_.clear();
    length_ = past + n;
    if (first + chunk < ids.size()) continue;  // logits of the last position only
    logits = step_logits;
  }
  return logits;
}

}  // namespace lathe
