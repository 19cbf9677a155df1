// What the tensor-parallel tests share (tests/parallel/test_tensor_parallel.cpp, test_vocab_parallel.cpp): the tiny
// configs — a Qwen3 of `heads` query and `kv_heads` key/value heads, the hybrid stack (Gated DeltaNet, full attention,
// Gated DeltaNet) with H_v = 2 H_k, mixture-of-experts layers for either — and the check of a split model against
// the whole one.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "model/causal_lm.h"
#include "support/model_support.h"

namespace lathe::test_support {

inline nlohmann::json tiny_qwen3(int heads, int kv_heads, int intermediate) {
  return {{"model_type", "qwen3"}, {"vocab_size", 40}, {"hidden_size", 16}, {"intermediate_size", intermediate},
          {"num_hidden_layers", 2}, {"num_attention_heads", heads}, {"num_key_value_heads", kv_heads},
          {"head_dim", 8}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false}, {"max_position_embeddings", 128}};
}

// Mixture-of-experts layers: 4 experts, top 2, a shared expert on the hybrids.
inline void add_experts(nlohmann::json& j) {
  j["num_experts"] = 4;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 12;
  j["norm_topk_prob"] = true;
  if (j["model_type"] != "qwen3_moe") j["shared_expert_intermediate_size"] = 10;
}

// The hybrid stack (Gated DeltaNet, full attention, Gated DeltaNet) with H_v = 2 H_k: `keys` GDN key heads; Qwen3-Next
// with its fused, per-key-head interleaved projections (every MLP dense through mlp_only_layers, or with `moe` the
// first and last layers sparse).
inline nlohmann::json tiny_hybrid(const std::string& type, int heads, int kv_heads, int keys, int intermediate,
                                  bool moe = false) {
  nlohmann::json j = tiny_qwen3(heads, kv_heads, intermediate);
  j["model_type"] = type;
  j["num_hidden_layers"] = 3;
  j["head_dim"] = 16;
  j["layer_types"] = {"linear_attention", "full_attention", "linear_attention"};
  j["linear_num_key_heads"] = keys;
  j["linear_num_value_heads"] = 2 * keys;
  j["linear_key_head_dim"] = 8;
  j["linear_value_head_dim"] = 6;
  j["linear_conv_kernel_dim"] = 4;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.25}};
  if (type == "qwen3_next" || type == "qwen3_5_moe_text") add_experts(j);
  if (type == "qwen3_next") j["mlp_only_layers"] = moe ? nlohmann::json{1} : nlohmann::json{0, 1, 2};
  return j;
}

// A split model against the whole one on batch `b` (f64): logits within 1e-12 relative, the loss within 1e-12 and,
// after both backwards, every gradient (the split model's joined, gathered) within 1e-10.
inline void expect_equals_whole(CausalLm& split, CausalLm& whole, const PackedBatch& b) {
  EXPECT_LT(rel_l2(to_f64(split.logits(b)), to_f64(whole.logits(b))), 1e-12);
  const LossResult want = whole.loss(b, true), got = split.loss(b, true);
  EXPECT_NEAR(got.loss, want.loss, 1e-12 * std::abs(want.loss));
  for (size_t i = 0; i < whole.parameters().size(); ++i) {
    const Parameter& p = split.parameters()[i];
    ASSERT_TRUE(p.grad.defined()) << p.name;
    EXPECT_LT(rel_l2(to_f64(split.gathered(p, true)), to_f64(whole.parameters()[i].grad)), 1e-10) << p.name;
  }
}

}  // namespace lathe::test_support
