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
  std::string model_type;  // "qwen3", or "qwen3_5_text" for the Qwen3.5 text stack (also when read from a "qwen3_5"
                           // multimodal config: its text_config)
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
  std::vector<std::string> notes;  // fields read but not used (mtp_*, vision tower...), printed by the loaders
  nlohmann::json raw;  // the file as read, written back on save

  bool is_qwen3_5() const { return model_type == "qwen3_5_text"; }
  // Channels of the rotary embedding per head: head_dim x partial_rotary_factor (HF's int()), even.
  int64_t rotary_dim() const;

  // Number of parameters (tied embeddings counted once).
  int64_t parameter_count() const;
};

ModelConfig parse_model_config(const nlohmann::json& j, const std::string& source);
ModelConfig load_model_config(const std::string& model_dir);  // reads DIR/config.json
// model_type "qwen3_5_text" (text-only) or "qwen3_5" (multimodal release: the text_config part); called by
// parse_model_config. Every field that changes the maths and is not implemented is refused by name.
ModelConfig parse_qwen3_5_config(const nlohmann::json& j, const std::string& source);

}  // namespace lathe
