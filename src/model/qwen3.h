// The Qwen3 model (model_type qwen3) and Qwen3-MoE (qwen3_moe): embedding, N x [RMSNorm, GQA attention with q/k
// RMSNorm and RoPE over packed documents, residual, RMSNorm, SwiGLU MLP or, in a sparse layer, the mixture of experts
// (model/moe_layer.h), residual], final RMSNorm, tied or untied LM head.
// Every layer has an explicit backward; layers can recompute their activations in the backward instead of
// keeping them. The loss head, the LoRA projection and save() are CausalLm's (causal_lm.h).
// Parameters keep Hugging Face names (experts as the fused gate_up_proj / down_proj; CausalLm::read_parameters also
// reads the per-expert layout and save() writes back the one read). Covered by tests/models/test_qwen3.cpp (HF
// fixtures), tests/models/test_moe.cpp and dev/ref/check_logprobs.py.
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
  // The parameters allocated and not set (allocated_causal_lm).
  static Qwen3Model allocated(Runtime& rt, const ModelConfig& config, const ModelOptions& options) {
    return Qwen3Model(rt, config, options);
  }

  Tensor logits(const PackedBatch& batch) override;
  std::vector<double> label_logprobs(const PackedBatch& batch) override;
  LossResult loss(const PackedBatch& batch, bool backward, double loss_scale = 1.0,
                  const BackwardHooks& hooks = {}) override;
  std::vector<int64_t> grads_complete_after() const override;
  Tensor last_hidden(const PackedBatch& batch) override;
  std::shared_ptr<StageWork> stage_forward(int stage, const PackedBatch& b, const Tensor& in, StageHead head,
                                           double loss_scale) override;
  Tensor stage_backward(StageWork& work, const Tensor& dout, const PackedBatch& b, const Tensor& d_aux) override;
  Tensor lm_head_logits(const Tensor& x) override;

 private:
  struct Layer {
    int64_t index = 0;
    int input_norm = -1, q_proj = -1, k_proj = -1, v_proj = -1, o_proj = -1, q_norm = -1, k_norm = -1, post_norm = -1;
    MlpParams mlp;  // a SwiGLU, or the mixture of experts of a qwen3_moe sparse layer
  };
  struct LayerActs;

  Qwen3Model(Runtime& rt, ModelConfig config, ModelOptions options);
  void build_parameter_list();
  int head() const { return lm_head_ >= 0 ? lm_head_ : embed_; }

  friend struct DecoderStack;  // the shared embedding -> layers -> norm -> head driver (model/decoder_stack.h)
  static constexpr double kFinalNormOffset = 0.0;  // the final RMSNorm's gain: w
  LayerActs layer_forward(const Layer& l, const ResidualStream& x, const PackedBatch& b, bool training);
  Tensor layer_backward(const Layer& l, const LayerActs& a, const Tensor& dout, const PackedBatch& b);

  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;  // lm_head_ = -1 when tied
  std::vector<Layer> layers_;
};

}  // namespace lathe
