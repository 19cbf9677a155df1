// The Qwen3.5 text model (model_type qwen3_5_text, or the text stack of a qwen3_5 multimodal checkpoint), and the
// same stack with mixture-of-experts MLPs: Qwen3.5-MoE (qwen3_5_moe_text / qwen3_5_moe) and Qwen3-Next (qwen3_next,
// whose GDN input projections are fused: in_proj_qkvz, in_proj_ba). Embedding, N x [zero-centred RMSNorm, mixer,
// residual, zero-centred RMSNorm, SwiGLU MLP or mixture of experts with a shared expert (model/moe_layer.h),
// residual], final zero-centred RMSNorm, tied or untied LM head. The mixer of layer i is config.layer_types[i]:
//  - "linear_attention": Gated DeltaNet (research note gated-deltanet.md §2): in_proj_qkv -> causal depthwise conv
//    + SiLU per section [q | k | v] -> L2-normalised q, k; beta = sigmoid(in_proj_b x), g = -exp(A_log)
//    softplus(in_proj_a x + dt_bias); the gated delta rule (key heads shared by H_v / H_k value heads); gated RMSNorm
//    (plain weight) times SiLU(in_proj_z x); out_proj;
//  - "full_attention": gated attention: q_proj gives, per head, [query (d) | gate (d)]; q/k zero-centred RMSNorm,
//    partial RoPE on the first rotary_dim channels, causal packed attention, output * sigmoid(gate), o_proj.
// Packed documents (cu_seqlens): attention, conv history and delta-rule state all restart at every boundary.
// Every linear projection (GDN in_proj_qkv/z/b/a and out_proj, attention q/k/v/o_proj, MLP) goes through
// CausalLm::project, so LoRA adapters (one or many tenants) apply to all of them exactly as on Qwen3.
// Every layer has an explicit backward; gradients accumulate into Parameter::grad. Parameters keep Hugging Face
// names in the layout they were loaded from (model.* or model.language_model.*); tensors of the checkpoint that the
// text model does not use (vision tower, MTP head) are kept aside, reported, and written back by save().
// Covered by tests/models/test_qwen3_5.cpp (HF fixtures from dev/ref/qwen3_5_fixtures.py, finite differences,
// packing isolation, loader errors) and tests/models/test_lora_qwen3_5.cpp (LoRA).
#pragma once

#include <array>
#include <string>
#include <vector>

#include "model/causal_lm.h"

namespace lathe {

// The dtype of the GDN log-decay g and of beta in a model of dtype `model`: at least f32 (transformers computes g
// from a.float() and A_log.float() in a bf16 model; a bf16 g is off by ~|g| 2^-9, which compounds over the decays of
// a document). The training path and the rollout engine (its DecodeCache) both use it.
DType gdn_gate_dtype(DType model);

class Qwen35Model : public CausalLm {
 public:
  // Loads config.json and the safetensors weights of a Hugging Face folder (text-only or multimodal layout).
  static Qwen35Model load(Runtime& rt, const std::string& dir, const ModelOptions& options);
  // A randomly initialised model: normal(0, std) matrices, zero-centred norms 0, gated norms and dt_bias 1,
  // A_log = log U(0.01, 16) (transformers' initialisation).
  static Qwen35Model random(Runtime& rt, const ModelConfig& config, const ModelOptions& options, uint64_t seed,
                            double std = 0.02);
  // The parameters allocated and not set (allocated_causal_lm).
  static Qwen35Model allocated(Runtime& rt, const ModelConfig& config, const ModelOptions& options) {
    return Qwen35Model(rt, config, options);
  }

  Tensor logits(const PackedBatch& batch) override;                   // (T, V)
  Tensor last_hidden(const PackedBatch& batch) override;
  std::shared_ptr<StageWork> stage_forward(int stage, const PackedBatch& b, const Tensor& in, StageHead head,
                                           double loss_scale) override;
  Tensor stage_backward(StageWork& work, const Tensor& dout, const PackedBatch& b, const Tensor& d_aux) override;
  Tensor lm_head_logits(const Tensor& x) override;
  std::vector<double> label_logprobs(const PackedBatch& batch) override;
  LossResult loss(const PackedBatch& batch, bool backward, double loss_scale = 1.0,
                  const BackwardHooks& hooks = {}) override;
  std::vector<int64_t> grads_complete_after() const override;

 protected:
  // save() writes the weights in the layout they were loaded from, plus the kept-aside tensors; A_log stays f32.
  DType save_dtype(const std::string& name, DType requested) const override;
  std::vector<io::TensorRef> extra_tensors() const override;

 private:
  struct Layer {
    int64_t index = 0;
    bool linear = false;  // Gated DeltaNet, else gated full attention
    int input_norm = -1, post_norm = -1;
    int q_proj = -1, k_proj = -1, v_proj = -1, o_proj = -1, q_norm = -1, k_norm = -1;
    int in_qkv = -1, in_z = -1, in_b = -1, in_a = -1, conv = -1, dt_bias = -1, a_log = -1, gnorm = -1, out_proj = -1;
    int in_qkvz = -1, in_ba = -1;  // qwen3_next's fused GDN projections (instead of in_qkv, in_z, in_b, in_a)
    MlpParams mlp;                 // a SwiGLU, or the mixture of experts of a sparse layer (qwen3_5_moe, qwen3_next)
  };
  struct LayerActs;
  struct Passthrough {  // a checkpoint tensor the text model does not use, written back unchanged
    std::string name;
    DType dtype;
    Shape shape;
    std::vector<uint8_t> bytes;
  };
  // Column blocks of a projection's output (T, N), as row indices of it viewed as (T N / width, width): gathered
  // by the embedding op. q_proj's query / gate, in_proj_qkv's q / k / v. The blocks of a split partition the
  // columns, so the backward puts the parts' gradients back with one gather too: `merge` indexes, for each row of
  // the whole, its row in the parts stacked one after another (no zero fill, no scatter-add).
  struct Columns {
    int64_t width = 0, n = 0;  // chunk width, columns of the whole output
    Tensor ids;                 // (T x the block's columns / width) i32
  };
  struct SplitIndex {
    int64_t tokens = -1;
    const DecodeCache* cache = nullptr;  // the decoding batch's cache whose tables these are (this forward's)
    Columns query, gate, qkv[3];
    Tensor merge_query_gate, merge_qkv;  // (T N / width) i32 into [query; gate] and [q; k; v] rows
    // qwen3_next: in_proj_qkvz's output is, per key head, [q (d_k) | k (d_k) | v (r d_v) | z (r d_v)] with r = H_v /
    // H_k, and in_proj_ba's [b (r) | a (r)]: the conv input [q | k | v] (heads in order), z, b and a are gathers.
    Columns next_qkv, next_z, next_b, next_a;
    Tensor merge_qkvz, merge_ba;
  };

  Qwen35Model(Runtime& rt, ModelConfig config, ModelOptions options);
  void shard_layers(const std::vector<Layer>& layers);
  void build_parameter_list();
  int head() const { return lm_head_ >= 0 ? lm_head_ : embed_; }
  const SplitIndex& split_index(int64_t tokens, DecodeCache* cache);
  void end_forward() override;
  Tensor gather_columns(const Tensor& y, const Columns& c);
  // The gradient (T, N) of the whole from those of its parts (dparts[i] is (T, block i's columns)).
  Tensor merge_columns(const std::vector<Tensor>& dparts, const std::vector<const Columns*>& blocks,
                       const Tensor& merge);

  friend struct DecoderStack;  // the shared embedding -> layers -> norm -> head driver (model/decoder_stack.h)
  static constexpr double kFinalNormOffset = 1.0;  // the final RMSNorm's gain: 1 + w, zero-centred
  LayerActs layer_forward(const Layer& l, const ResidualStream& x, const PackedBatch& b, bool training);
  void attention_forward(const Layer& l, LayerActs& a, const PackedBatch& b, bool training);
  void gdn_forward(const Layer& l, LayerActs& a, const PackedBatch& b, bool training);
  // The Gated DeltaNet core from its projections (a.qkv, a.bproj, a.aproj) to a.core: on one rank's rows, or (context
  // parallelism) over every row for the rank's cp-th of the heads.
  void gdn_core(const Layer& l, LayerActs& a, const PackedBatch& b, bool training);
  void gdn_core_over_ranks(const Layer& l, LayerActs& a, const PackedBatch& b, bool training);
  // Or, where the heads are too few for the all-to-all, over the rank's rows with the conv's history and the rule's
  // state passed along the cp group (model/gdn_context.h).
  bool gdn_passes_states() const;
  void gdn_core_over_chain(const Layer& l, LayerActs& a, const PackedBatch& b);
  void rule_inputs(const Layer& l, LayerActs& a, const SplitIndex& split);
  Tensor rank_conv_weight(const Layer& l);
  Tensor conv_weight(const Layer& l) const;  // the conv weight (2K + V, 1, W) as the (2K + V, W) the conv ops take
  void gdn_core_backward(const Layer& l, const LayerActs& a, const Tensor& dcore, const PackedBatch& b, Tensor& dqkv,
                         Tensor& db, Tensor& da);
  void gdn_core_over_ranks_backward(const Layer& l, const LayerActs& a, const Tensor& dcore, const PackedBatch& b,
                                    Tensor& dqkv, Tensor& db, Tensor& da);
  void gdn_core_over_chain_backward(const Layer& l, const LayerActs& a, const Tensor& dcore, const PackedBatch& b,
                                    Tensor& dqkv, Tensor& db, Tensor& da);
  Tensor rule_inputs_backward(const Layer& l, const LayerActs& a, const std::vector<Tensor>& dr,
                              const SplitIndex& split, Tensor& db, Tensor& da);
  Tensor layer_backward(const Layer& l, const LayerActs& a, const Tensor& dout, const PackedBatch& b);
  Tensor attention_backward_part(const Layer& l, const LayerActs& a, const Tensor& dh, const PackedBatch& b);
  Tensor gdn_backward_part(const Layer& l, const LayerActs& a, const Tensor& dh, const PackedBatch& b);
  Tensor l2norm(const Tensor& x);
  Tensor l2norm_backward(const Tensor& x, const Tensor& dy);

  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  std::vector<Layer> layers_;
  std::vector<Passthrough> passthrough_;
  Tensor l2_weight_;  // (d_k) d_k^-1/2: the weight of the RMSNorm that computes the L2 norm
  SplitIndex split_;  // for the last batch size seen
};

}  // namespace lathe
