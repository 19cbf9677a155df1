// The Qwen3 dense model: embedding, N x [RMSNorm, GQA attention with q/k RMSNorm and RoPE over packed
// documents, residual, RMSNorm, SwiGLU MLP, residual], final RMSNorm, tied or untied LM head.
// Every layer has an explicit backward; layers can recompute their activations in the backward instead of
// keeping them. The loss head, the LoRA projection and save() are CausalLm's (causal_lm.h).
// Parameters keep Hugging Face names. Covered by tests/models/test_qwen3.cpp (HF fixtures) and
// dev/ref/check_logprobs.py.
#pragma once

#include <string>
#include <vector>

#include "model/causal_lm.h"

namespace lathe {

class Qwen3Model : public CausalLm {
 public:
  // Loads config.json and the safetensors weights of a Hugging Face model folder.
  static Qwen3Model load(Runtime& rt, const std::string& dir, const ModelOptions& options);
  // A randomly initialised model (normal(0, std) matrices, unit norms) for from-scratch training.
  static Qwen3Model random(Runtime& rt, const ModelConfig& config, const ModelOptions& options, uint64_t seed,
                           double std = 0.02);

  Tensor logits(const PackedBatch& batch) override;
  std::vector<double> label_logprobs(const PackedBatch& batch) override;
  LossResult loss(const PackedBatch& batch, bool backward, double loss_scale = 1.0) override;

 private:
  struct Layer {
    int64_t index;
    int input_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_norm, gate_proj, up_proj, down_proj;
  };
  struct LayerActs;

  Qwen3Model(Runtime& rt, ModelConfig config, ModelOptions options);
  void build_parameter_list();
  int head() const { return lm_head_ >= 0 ? lm_head_ : embed_; }

  friend struct DecoderStack;  // the shared embedding -> layers -> norm -> head driver (model/decoder_stack.h)
  static constexpr double kFinalNormOffset = 0.0;  // the final RMSNorm's gain: w
  LayerActs layer_forward(const Layer& l, const Tensor& x, const PackedBatch& b, bool training);
  Tensor layer_backward(const Layer& l, const LayerActs& a, const Tensor& dout, const PackedBatch& b);

  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;  // lm_head_ = -1 when tied
  std::vector<Layer> layers_;
};

}  // namespace lathe
