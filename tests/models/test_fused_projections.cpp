// Fused projections (CausalLm::pack_rows / project_rows): q, k and v, and every MLP's gate and up (dense, or a
// sparse layer's shared expert), are row blocks of one buffer after construction, so each group is one GEMM whose
// gradients land in one buffer. The same model with those weights as separate tensors takes the per-weight path;
// both must give the same loss and gradients (f64, so only the summation order of the fused GEMMs differs).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "model/causal_lm.h"
#include "ops/ops.h"
#include "support/model_support.h"
#include "support/moe_support.h"

using namespace lathe;
using namespace lathe::test_support;

namespace {

nlohmann::json dense_json() {
  return {{"model_type", "qwen3"}, {"vocab_size", 50}, {"hidden_size", 24}, {"intermediate_size", 40},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
          {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false}};
}

std::unique_ptr<CausalLm> model(const nlohmann::json& j, uint64_t seed) {
  ModelOptions opt;
  opt.dtype = DType::F64;
  return random_causal_lm(runtime(), parse_model_config(j, "tiny"), opt, seed, 0.3);
}

bool same_storage(const CausalLm& m, const std::string& a, const std::string& b, bool grads) {
  const auto find = [&](const std::string& name) -> const Parameter& {
    for (const Parameter& p : m.parameters())
      if (p.name == name) return p;
    ADD_FAILURE() << "no parameter " << name;
    return m.parameters().front();
  };
  const Tensor& x = grads ? find(a).grad : find(a).value;
  const Tensor& y = grads ? find(b).grad : find(b).value;
  return x.defined() && y.defined() && x.storage() == y.storage();
}

}  // namespace

TEST(FusedProjections, AgreeWithSeparateWeightsAndKeepOneGradientBuffer) {
  struct Family {
    const char* name;
    nlohmann::json config;
    std::vector<std::pair<std::string, std::string>> groups;  // first and last member of a fused group
  };
  const std::vector<Family> families = {
      {"qwen3", dense_json(),
       {{"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"},
        {"model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"}}},
      {"qwen3_moe", tiny_moe_json("qwen3_moe"),
       {{"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"},
        {"model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"}}},  // mlp_only_layers: dense
      {"qwen3_next", tiny_moe_json("qwen3_next"),
       {{"model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.0.mlp.shared_expert.up_proj.weight"}}},
  };
  for (const Family& f : families) {
    SCOPED_TRACE(f.name);
    std::unique_ptr<CausalLm> fused = model(f.config, 3), split = model(f.config, 3);
    ExecContext cx = runtime().context(Device::cpu());
    for (Parameter& p : split->parameters()) p.value = cast(cx, p.value, p.value.dtype());  // storage of its own
    for (const auto& [a, b] : f.groups) {
      EXPECT_TRUE(same_storage(*fused, a, b, false)) << a;
      EXPECT_FALSE(same_storage(*split, a, b, false)) << a;
    }
    const PackedBatch batch = random_batch(f.config["vocab_size"].get<int64_t>(), {0, 7, 19}, 5);
    const LossResult lf = fused->loss(batch, true), ls = split->loss(batch, true);
    EXPECT_NEAR(lf.loss, ls.loss, 1e-12 * std::abs(ls.loss));
    for (const auto& [a, b] : f.groups) EXPECT_TRUE(same_storage(*fused, a, b, true)) << a;
    // A second micro-batch accumulates into the fused gradients' one buffer.
    const PackedBatch batch2 = random_batch(f.config["vocab_size"].get<int64_t>(), {0, 12, 19}, 6);
    fused->loss(batch2, true);
    split->loss(batch2, true);
    for (const auto& [a, b] : f.groups) EXPECT_TRUE(same_storage(*fused, a, b, true)) << a;
    std::map<std::string, std::vector<double>> want;
    for (const Parameter& p : split->parameters()) want[p.name] = to_f64(p.grad);
    for (const Parameter& p : fused->parameters()) EXPECT_LT(rel_l2(to_f64(p.grad), want[p.name]), 1e-12) << p.name;
  }
}
