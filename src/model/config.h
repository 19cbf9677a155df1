// Model configuration read from a Hugging Face config.json.
// Both spellings seen in released checkpoints are accepted (rope_theta at top level, or inside
// rope_parameters / rope_scaling; num_experts or num_local_experts). Every setting that changes the maths and
// is not implemented (a rope scaling type, attention bias, sliding windows, an unknown model_type) is refused
// with an error naming the field — never ignored.
// Covered by tests/models/test_config.cpp.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lathe {

struct ModelConfig {
  // "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text" or "qwen3_5_moe_text" (the Qwen3.5 text stacks, also when
  // read from a "qwen3_5" / "qwen3_5_moe" multimodal config: its text_config)
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  // Qwen3.5 (model/config_qwen3_5.cpp; empty / defaults for qwen3): per-layer "linear_attention" (Gated DeltaNet)
  // or "full_attention"; the GDN sizes; the rotated fraction of head_dim; gated attention and (1 + w) norms.
  std::vector<std::string> layer_types;
  int64_t linear_num_key_heads = 0, linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0, linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;
  double partial_rotary_factor = 1.0;
  bool attn_output_gate = false;
  bool multimodal_layout = false;  // weights under model.language_model.*, config nested in text_config
  // Mixture of experts (qwen3_moe, qwen3_5_moe_text, qwen3_next; docs/moe.md). num_experts 0 = dense. Layer i is
  // sparse when num_experts > 0, i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (transformers'
  // rule): its MLP is a router over num_experts SwiGLU experts of moe_intermediate_size (top num_experts_per_tok),
  // plus a shared SwiGLU expert with a sigmoid gate when shared_expert_intermediate_size > 0.
  int64_t num_experts = 0, num_experts_per_tok = 0, moe_intermediate_size = 0, shared_expert_intermediate_size = 0;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.0;
  bool output_router_logits = false;   // transformers adds router_aux_loss_coef x the aux loss to the loss only then
  bool fused_gdn_projections = false;  // qwen3_next: in_proj_qkvz / in_proj_ba, interleaved per key head
  std::vector<std::string> notes;  // fields read but not used (mtp_*, vision tower...), printed by the loaders
  nlohmann::json raw;  // the file as read, written back on save

  // The Qwen3.5-style hybrid stack (Qwen35Model): qwen3_5_text, qwen3_5_moe_text, qwen3_next.
  bool is_hybrid() const {
    return model_type == "qwen3_5_text" || model_type == "qwen3_5_moe_text" || model_type == "qwen3_next";
  }
  bool is_moe() const { return num_experts > 0; }
  bool sparse_layer(int64_t i) const;
  // Channels of the rotary embedding per head: head_dim x partial_rotary_factor (HF's int()), even.
  int64_t rotary_dim() const;

  // Number of parameters (tied embeddings counted once).
  int64_t parameter_count() const;
  int64_t layer_parameter_count(int64_t i) const;  // decoder layer i's (its norms, mixer and MLP)
};

ModelConfig parse_model_config(const nlohmann::json& j, const std::string& source);
ModelConfig load_model_config(const std::string& model_dir);  // reads DIR/config.json
// model_type "qwen3_5_text" / "qwen3_5_moe_text" (text-only), "qwen3_5" / "qwen3_5_moe" (multimodal release: the
// text_config part) or "qwen3_next"; called by parse_model_config. Every field that changes the maths and is not
// implemented is refused by name.
ModelConfig parse_qwen3_5_config(const nlohmann::json& j, const std::string& source);
// The mixture-of-experts fields of config `j` into `c` (model/config.cpp): the experts, top-k, the sparse-layer rule,
// norm_topk_prob (`default_norm`; `forced_norm`: the family always renormalises and a false value is refused), the
// aux loss, and the shared expert (`shared`: the family has one, its size is required).
void parse_moe_fields(const nlohmann::json& j, const std::string& source, ModelConfig& c, bool default_norm,
                      bool forced_norm, bool shared);

}  // namespace lathe
