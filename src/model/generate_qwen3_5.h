// Cached decoding of the Qwen3.5 hybrid model (Qwen35Model): per layer, a Gated DeltaNet layer keeps a conv state
// (the last W - 1 pre-convolution rows of its q|k|v channels) and a recurrent state (H_v, d_k, d_v), both of a size
// fixed by the config, so each decoded token costs the same whatever the sequence length; a gated-attention layer
// keeps a KV cache (KvCache of generate.h). The prompt runs as one prefill that fills every cache (GDN layers through
// the gated_delta_rule_state op from a zero state, attention as one packed causal document), then one token per
// step (research note gated-deltanet.md §2.3).
// The layers are the model's own (Qwen35Model::layer_forward through CausalLm::last_logits): the decoder is the
// DecodeCache the batch carries, so no copy of the layer maths lives here. tests/models/test_generate_qwen3_5.cpp
// compares every decoding step's logits with Qwen35Model::logits of the full sequence.
#pragma once

#include "model/generate.h"
#include "model/qwen3_5.h"

namespace lathe {

class Qwen35Decoder : public Decoder {
 public:
  // `capacity`: initial KV-cache length in tokens (attention layers); it doubles when a sequence outgrows it.
  Qwen35Decoder(Runtime& rt, Qwen35Model& model, int64_t capacity = 256);

  std::vector<float> feed(std::span<const int32_t> ids) override;
  // As feed(), but the logits stay a tensor (1, vocab_size) of the model's dtype on its device (exact f64 checks).
  Tensor feed_logits(std::span<const int32_t> ids);
  void reset() override;  // zero the GDN states, empty the KV caches (memory kept)
  void reserve(int64_t tokens) override;
  int64_t length() const override { return length_; }
  int64_t capacity() const { return kv_.capacity(); }

  // The caches of layer `layer`, which must be a GDN layer: the pre-conv rows (W - 1, 2 H_k d_k + H_v d_v) of the
  // model's dtype, and the recurrent state (1, H_v, d_k, d_v) in f32 (f64 for an f64 model).
  const Tensor& conv_state(size_t layer) const;
  const Tensor& recurrent_state(size_t layer) const;
  int64_t gdn_cache_bytes() const;  // every GDN layer's conv and recurrent state: constant for a model
  int64_t kv_cache_bytes() const { return kv_.bytes(); }

 private:
  class View;  // the caches as the model's layers see them (DecodeCache)
  struct Layer {
    bool linear = false;
    size_t slot = 0;  // index among the GDN layers (states) or among the attention layers (KV cache)
  };
  ExecContext ctx() const;

  Runtime* rt_;
  Qwen35Model* model_;
  std::vector<Layer> layers_;
  std::vector<Tensor> conv_;       // per GDN layer (W - 1, C) pre-conv rows, oldest first
  std::vector<Tensor> state_;      // per GDN layer (1, H_v, d_k, d_v)
  std::vector<Tensor> new_conv_, new_state_;  // the current call's, committed when every layer succeeded
  KvCache kv_;
  int64_t length_ = 0;
};

}  // namespace lathe
