// The tiny mixture-of-experts configs the MoE tests share (tests/models/test_moe.cpp, test_lora_moe.cpp).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace lathe::test_support {

// 3 layers; 4 experts, top 2; layer 1 dense (mlp_only_layers) for qwen3_moe and qwen3_next.
inline nlohmann::json tiny_moe_json(const std::string& type, bool norm = true) {
  nlohmann::json j = {{"model_type", type}, {"vocab_size", 40}, {"hidden_size", 16}, {"intermediate_size", 20},
                      {"num_hidden_layers", 3}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                      {"head_dim", 8}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false},
                      {"num_experts", 4}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 12},
                      {"router_aux_loss_coef", 0.1}, {"output_router_logits", true}};
  if (type == "qwen3_moe") {
    j["norm_topk_prob"] = norm;
    j["mlp_only_layers"] = {1};
    return j;
  }
  j["head_dim"] = 16;
  j["layer_types"] = {"linear_attention", "full_attention", "linear_attention"};
  j["linear_num_key_heads"] = 1;
  j["linear_num_value_heads"] = 2;
  j["linear_key_head_dim"] = 8;
  j["linear_value_head_dim"] = 6;
  j["linear_conv_kernel_dim"] = 4;
  j["shared_expert_intermediate_size"] = 10;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.25}};
  if (type == "qwen3_next") j["mlp_only_layers"] = {1};
  return j;
}

}  // namespace lathe::test_support
