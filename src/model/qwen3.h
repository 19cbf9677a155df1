// The Qwen3 dense model: embedding, N x [RMSNorm, GQA attention with q/k RMSNorm and RoPE over packed
// documents, residual, RMSNorm, SwiGLU MLP, residual], final RMSNorm, tied or untied LM head.
// Every layer has an explicit backward; layers can recompute their activations in the backward instead of
// keeping them. The loss head never materialises logits for the whole batch: it runs in row chunks, each
// chunk's logits turned into loss and dlogits, then freed.
// Parameters keep Hugging Face names. Covered by tests/models/test_qwen3.cpp (HF fixtures) and
// dev/ref/check_logprobs.py.
#pragma once

#include <string>
#include <vector>

#include "model/batch.h"
#include "model/config.h"

namespace lathe {

struct Parameter {
  std::string name;  // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Tensor value;
  Tensor grad;       // undefined until a backward pass writes it
};

struct ModelOptions {
  Device device = Device::cpu();
  DType dtype = DType::F32;      // parameter and activation dtype (f32 on CPU, bf16 on CUDA)
  bool recompute = false;        // recompute layer activations in the backward pass
  int64_t loss_chunk_rows = 1024;  // rows of logits alive at once in the loss head
  bool train_base = true;        // false: the base weights are frozen (LoRA): no gradient is computed for them
};

struct LossResult {
  double loss = 0;         // mean over labelled positions
  double loss_sum = 0;     // sum over labelled positions
  int64_t labelled = 0;
  struct Segment {
    double loss_sum = 0;
    int64_t labelled = 0;
  };
  std::vector<Segment> segments;  // one per batch segment (PackedBatch::segments)
};

class LoraBank;
enum class LoraTarget;

class Qwen3Model {
 public:
  // Loads config.json and the safetensors weights of a Hugging Face model folder.
  static Qwen3Model load(Runtime& rt, const std::string& dir, const ModelOptions& options);
  // A randomly initialised model (normal(0, std) matrices, unit norms) for from-scratch training.
  static Qwen3Model random(Runtime& rt, const ModelConfig& config, const ModelOptions& options, uint64_t seed,
                           double std = 0.02);

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  Parameter& parameter(const std::string& name);
  Runtime& runtime() const { return *rt_; }
  // Adapters applied to the rows of a batch according to its segments (nullptr: none). The bank must
  // outlive its use; its gradients accumulate like the model's.
  void attach_lora(LoraBank* bank) { lora_ = bank; }

  // Full logits (T, V) of a batch: for tests, scoring of short inputs and generation.
  Tensor logits(const PackedBatch& batch);
  // Per-position log p(label) (f32, T entries; 0 where the label is -100), chunked like the loss.
  std::vector<double> label_logprobs(const PackedBatch& batch);
  // Mean cross-entropy over labelled positions; with `backward`, adds every parameter's gradient into
  // Parameter::grad (so micro-batches accumulate), and the attached adapters' gradients into the bank.
  // `loss_scale` multiplies the gradients. A batch with segments differentiates the sum over segments of
  // segment.loss_scale x (the segment's mean loss); LoRA dropout is active only with `backward`.
  LossResult loss(const PackedBatch& batch, bool backward, double loss_scale = 1.0);
  void zero_grads();

  // Writes config.json and model.safetensors (sharded above max_shard_bytes) into `dir`, atomically.
  void save(const std::string& dir, DType dtype = DType::F32, uint64_t max_shard_bytes = 5ull << 30) const;

 private:
  struct Layer {
    int64_t index;
    int input_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_norm, gate_proj, up_proj, down_proj;
  };
  struct LayerActs;

  Qwen3Model(Runtime& rt, ModelConfig config, ModelOptions options);
  void build_parameter_list();
  ExecContext ctx();
  const Tensor& w(int index) const { return params_[size_t(index)].value; }
  const Tensor& lm_head() const;

  Tensor forward_hidden(const PackedBatch& batch, std::vector<LayerActs>* acts, std::vector<Tensor>* layer_inputs,
                        bool training);
  LayerActs layer_forward(const Layer& l, const Tensor& x, const PackedBatch& b, bool training);
  Tensor layer_backward(const Layer& l, const LayerActs& a, const Tensor& dout, const PackedBatch& b);
  // y = x W^T plus the adapters' terms for the batch's segments.
  Tensor project(const Layer& l, LoraTarget t, int weight, const Tensor& x, const PackedBatch& b, bool training);
  // The backward of project(): dx (allocated when undefined, else accumulated) += dy W (+ adapter terms);
  // the weight's gradient (unless frozen) and the adapters' gradients accumulate.
  void project_backward(const Layer& l, LoraTarget t, int weight, const Tensor& x, const Tensor& dy, Tensor& dx,
                        const PackedBatch& b);
  void add_grad(int index, const Tensor& g);
  void add_linear_grad(int index, const Tensor& dy, const Tensor& x);  // grad += dy^T x

  Runtime* rt_;
  ModelConfig config_;
  ModelOptions options_;
  std::vector<Parameter> params_;
  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;  // lm_head_ = -1 when tied
  std::vector<Layer> layers_;
  LoraBank* lora_ = nullptr;
};

}  // namespace lathe
