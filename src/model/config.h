// Model configuration read from a Hugging Face config.json.
// Both spellings seen in released checkpoints are accepted (rope_theta at top level, or inside
// rope_parameters / rope_scaling; num_experts or num_local_experts). Every setting that changes the maths and
// is not implemented (a rope scaling type, attention bias, sliding windows, an unknown model_type) is refused
// with an error naming the field — never ignored.
// Covered by tests/models/test_config.cpp.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace lathe {

struct ModelConfig {
  std::string model_type;  // "qwen3"
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
  nlohmann::json raw;  // the file as read, written back on save

  // Number of parameters (tied embeddings counted once).
  int64_t parameter_count() const;
};

ModelConfig parse_model_config(const nlohmann::json& j, const std::string& source);
ModelConfig load_model_config(const std::string& model_dir);  // reads DIR/config.json

}  // namespace lathe
