// The Qwen3.5 text model (model_type qwen3_5_text, or the text stack of a qwen3_5 multimodal checkpoint): embedding,
// N x [zero-centred RMSNorm, mixer, residual, zero-centred RMSNorm, SwiGLU MLP, residual], final zero-centred
// RMSNorm, tied or untied LM head. The mixer of layer i is config.layer_types[i]:
//  - "linear_attention": Gated DeltaNet (research note gated-deltanet.md §2): in_proj_qkv -> causal depthwise conv
//    + SiLU per section [q | k | v] -> L2-normalised q, k; beta = sigmoid(in_proj_b x), g = -exp(A_log)
//    softplus(in_proj_a x + dt_bias); the gated delta rule (key heads shared by H_v / H_k value heads); gated RMSNorm
//    (plain weight) times SiLU(in_proj_z x); out_proj;
//  - "full_attention": gated attention: q_proj gives, per head, [query (d) | gate (d)]; q/k zero-centred RMSNorm,
//    partial RoPE on the first rotary_dim channels, causal packed attention, output * sigmoid(gate), o_proj.
// Packed documents (cu_seqlens): attention, conv history and delta-rule state all restart at every boundary.
// Every layer has an explicit backward; gradients accumulate into Parameter::grad. Parameters keep Hugging Face
// names in the layout they were loaded from (model.* or model.language_model.*); tensors of the checkpoint that the
// text model does not use (vision tower, MTP head) are kept aside, reported, and written back by save().
// Covered by tests/models/test_qwen3_5.cpp (HF fixtures from dev/ref/qwen3_5_fixtures.py, finite differences,
// packing isolation, loader errors).
#pragma once

#include <string>
#include <vector>

#include "model/qwen3.h"

namespace lathe {

class Qwen35Model {
 public:
  // Loads config.json and the safetensors weights of a Hugging Face folder (text-only or multimodal layout).
  static Qwen35Model load(Runtime& rt, const std::string& dir, const ModelOptions& options);
  // A randomly initialised model: normal(0, std) matrices, zero-centred norms 0, gated norms and dt_bias 1,
  // A_log = log U(0.01, 16) (transformers' initialisation).
  static Qwen35Model random(Runtime& rt, const ModelConfig& config, const ModelOptions& options, uint64_t seed,
                            double std = 0.02);

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  Parameter& parameter(const std::string& name);
  Runtime& runtime() const { return *rt_; }

  Tensor logits(const PackedBatch& batch);                   // (T, V)
  std::vector<double> label_logprobs(const PackedBatch& batch);
  // Mean cross-entropy over labelled positions; with `backward`, adds every parameter's gradient (times
  // loss_scale) into Parameter::grad. Segments weight their mean losses as in Qwen3Model::loss (no adapters).
  LossResult loss(const PackedBatch& batch, bool backward, double loss_scale = 1.0);
  void zero_grads();

  // Writes config.json (as loaded) and the weights in the layout they were loaded from, plus the kept-aside tensors.
  void save(const std::string& dir, DType dtype = DType::F32, uint64_t max_shard_bytes = 5ull << 30) const;

 private:
  struct Layer {
    int64_t index = 0;
    bool linear = false;  // Gated DeltaNet, else gated full attention
    int input_norm = -1, post_norm = -1, gate_proj = -1, up_proj = -1, down_proj = -1;
    int q_proj = -1, k_proj = -1, v_proj = -1, o_proj = -1, q_norm = -1, k_norm = -1;
    int in_qkv = -1, in_z = -1, in_b = -1, in_a = -1, conv = -1, dt_bias = -1, a_log = -1, gnorm = -1, out_proj = -1;
  };
  struct LayerActs;
  struct Passthrough {  // a checkpoint tensor the text model does not use, written back unchanged
    std::string name;
    DType dtype;
    Shape shape;
    std::vector<uint8_t> bytes;
  };

  Qwen35Model(Runtime& rt, ModelConfig config, ModelOptions options);
  void build_parameter_list();
  ExecContext ctx();
  const Tensor& w(int index) const { return params_[size_t(index)].value; }
  const Tensor& lm_head() const;

  Tensor forward_hidden(const PackedBatch& batch, std::vector<LayerActs>* acts, std::vector<Tensor>* inputs);
  LayerActs layer_forward(const Layer& l, const Tensor& x, const PackedBatch& b);
  void attention_forward(const Layer& l, LayerActs& a, const PackedBatch& b);
  void gdn_forward(const Layer& l, LayerActs& a, const PackedBatch& b);
  Tensor layer_backward(const Layer& l, const LayerActs& a, const Tensor& dout, const PackedBatch& b);
  Tensor attention_backward_part(const Layer& l, const LayerActs& a, const Tensor& dh, const PackedBatch& b);
  Tensor gdn_backward_part(const Layer& l, const LayerActs& a, const Tensor& dh, const PackedBatch& b);
  Tensor l2norm(const Tensor& x);
  Tensor l2norm_backward(const Tensor& x, const Tensor& dy);

  void add_grad(int index, const Tensor& g);
  Tensor& grad_buffer(int index);  // the parameter's gradient, zero-filled when still undefined
  void add_linear_grad(int index, const Tensor& dy, const Tensor& x, int64_t row0 = 0);  // rows [row0, ...) += dy^T x
  // dx (allocated when undefined, else accumulated) += dy W
  void linear_backward_input(const Tensor& w, const Tensor& dy, Tensor& dx);

  Runtime* rt_;
  ModelConfig config_;
  ModelOptions options_;
  std::vector<Parameter> params_;
  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  std::vector<Layer> layers_;
  std::vector<Passthrough> passthrough_;
  Tensor ones_dk_;              // (d_k) weight of the RMSNorm that computes the L2 norm
  Tensor even_rows_, odd_rows_;  // (H) i32: rows 2h (query) and 2h + 1 (gate) of q_proj viewed as (2H, d D)
};

}  // namespace lathe
