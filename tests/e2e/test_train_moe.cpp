// End-to-end mixture-of-experts runs through the lathe binary (CPU): full fine-tuning of a tiny qwen3_next lowers the
// loss and logs the aux loss and each sparse layer's expert load; LoRA on a tiny qwen3_moe lowers the loss and exports
// a PEFT adapter and a merged model that score alike and decodes with `lathe generate`; a per-expert checkpoint converts
// and keeps its layout; `lathe logprobs` on the MoE fixture folders matches transformers' logits stored with them
// (dev/ref/moe_fixtures.py).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "fixture_logprobs.h"
#include "lathe_run.h"

namespace fs = std::filesystem;
using lathe_e2e::LatheRun;
using lathe_e2e::losses;
using lathe_e2e::metrics;
using lathe_e2e::read_logprobs;

namespace {

const fs::path kTests = LATHE_TEST_DATA_DIR;

const char* kNext =
    "model:\n"
    "  config: {model_type: qwen3_next, hidden_size: 32, intermediate_size: 48, num_hidden_layers: 2,\n"
    "           layer_types: [linear_attention, full_attention], num_attention_heads: 2, num_key_value_heads: 1,\n"
    "           head_dim: 8, partial_rotary_factor: 0.5, rope_theta: 10000, linear_num_key_heads: 1,\n"
    "           linear_num_value_heads: 2, linear_key_head_dim: 8, linear_value_head_dim: 8,\n"
    "           linear_conv_kernel_dim: 4, num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 16,\n"
    "           shared_expert_intermediate_size: 16, router_aux_loss_coef: 0.01, output_router_logits: true,\n"
    "           tie_word_embeddings: true}\n"
    "  init_std: 0.2\n";

const char* kQwen3Moe =
    "model:\n"
    "  config: {model_type: qwen3_moe, hidden_size: 32, intermediate_size: 48, num_hidden_layers: 2,\n"
    "           num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, rope_theta: 10000, num_experts: 4,\n"
    "           num_experts_per_tok: 2, moe_intermediate_size: 16, norm_topk_prob: true, mlp_only_layers: [1],\n"
    "           tie_word_embeddings: true}\n"
    "  init_std: 0.2\n";

fs::path setup(const std::string& name, const char* model, const std::string& extra = "") {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_moe_e2e_{}_{}", name, getpid());
  fs::remove_all(dir);
  fs::create_directories(dir / "tok");
  fs::copy_file(kTests / "data/fixtures/tiny_tokenizer.json", dir / "tok/tokenizer.json");
  const std::vector<std::string> texts = {"the cat sat on the mat", "a dog ran in the park", "the sun is hot",
                                          "we like green tea"};
  {
    std::ofstream f(dir / "a.jsonl");
    for (int i = 0; i < 60; ++i) f << nlohmann::json{{"text", texts[size_t(i) % texts.size()]}}.dump() << "\n";
  }
  std::ofstream cfg(dir / "config.yaml");
  cfg << model << "  tokenizer: " << (dir / "tok").string() << "\n"
      << "data: {train: " << (dir / "a.jsonl").string() << ", format: text, max_seq_len: 64}\n"
      << "output_dir: " << (dir / "out").string() << "\n"
      << "train: {max_steps: 30, micro_batch_tokens: 96, lr: 0.01, warmup_steps: 2, save_every: 0, seed: 5}\n"
      << extra;
  return dir;
}

// The losses of 3 `lathe train` steps of dir's config with train.`key` = `value`, written to dir/value.
std::vector<double> three_steps(const fs::path& dir, const std::string& key, const std::string& value,
                                const std::string& more = "") {
  const std::string sets = " --set train.max_steps=3 --set train." + key + "=" + value + more + " --set output_dir=";
  const LatheRun r = lathe_e2e::lathe("train " + (dir / "config.yaml").string() + sets + (dir / value).string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return losses(dir / value);
}

}  // namespace

TEST(MoeTrain, FullFineTuningLossFallsAndLogsTheExpertLoad) {
  const fs::path dir = setup("full", kNext);
  const LatheRun r = lathe_e2e::lathe("train " + (dir / "config.yaml").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> l = losses(dir / "out");
  ASSERT_EQ(l.size(), 30u);
  std::printf("[qwen3_next full fine-tuning] loss %.3f -> %.3f in 30 steps\n", l.front(), l.back());
  EXPECT_LT(l.back(), 0.7 * l.front()) << "loss did not fall: " << l.front() << " -> " << l.back();
  for (const nlohmann::json& m : metrics(dir / "out")) {
    if (!m.contains("loss")) continue;
    ASSERT_TRUE(m.contains("aux_loss")) << m.dump();
    EXPECT_GT(m["aux_loss"].get<double>(), 0.0);
    ASSERT_TRUE(m.contains("expert_load")) << m.dump();
    ASSERT_EQ(m["expert_load"].size(), 2u);  // both layers are sparse
    for (const auto& [layer, load] : m["expert_load"].items()) {
      int64_t routed = 0;
      for (int64_t c : load["tokens_per_expert"].get<std::vector<int64_t>>()) routed += c;
      EXPECT_EQ(routed, 2 * m["tokens"].get<int64_t>()) << "layer " << layer << ": top-2 of every token";
      EXPECT_GE(load["max_over_mean"].get<double>(), 1.0);
    }
  }
  const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir / "out/final/config.json"));
  EXPECT_EQ(cfg["model_type"], "qwen3_next");
  const lathe::io::SafetensorsModel saved = lathe::io::SafetensorsModel::open((dir / "out/final").string());
  EXPECT_NE(saved.find("model.layers.0.linear_attn.in_proj_qkvz.weight"), nullptr);
  EXPECT_NE(saved.find("model.layers.1.mlp.experts.gate_up_proj"), nullptr);
  EXPECT_NE(saved.find("model.layers.1.mlp.shared_expert_gate.weight"), nullptr);
}

TEST(MoeTrain, LoraTrainsAndExportsAsAdapterAndMergedModel) {
  // gate/up/down_proj name the experts' fused parameters for qwen3_moe (as in peft 0.21): they train per expert.
  const fs::path dir = setup("lora", kQwen3Moe, "lora: {rank: 4, alpha: 8, targets: [q_proj, v_proj, gate_proj, up_proj, down_proj]}\n");
  const LatheRun r = lathe_e2e::lathe("train " + (dir / "config.yaml").string() + " --set train.lr=0.02");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> l = losses(dir / "out");
  ASSERT_EQ(l.size(), 30u);
  std::printf("[qwen3_moe lora] loss %.3f -> %.3f in 30 steps\n", l.front(), l.back());
  EXPECT_LT(l.back(), 0.8 * l.front()) << "LoRA loss did not fall: " << l.front() << " -> " << l.back();
  const std::string ckpt = (dir / "out").string();
  LatheRun e = lathe_e2e::lathe("export --checkpoint " + ckpt + " --adapter --dtype f32 --output " + (dir / "peft").string());
  ASSERT_EQ(e.exit_code, 0) << e.output;
  e = lathe_e2e::lathe("export --checkpoint " + ckpt + " --merge --dtype f32 --output " + (dir / "merged").string());
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const nlohmann::json peft = nlohmann::json::parse(std::ifstream(dir / "peft/adapter_config.json"));
  EXPECT_EQ(peft["target_modules"], nlohmann::json({"q_proj", "v_proj"}));
  EXPECT_EQ(peft["target_parameters"], nlohmann::json({"gate_up_proj", "down_proj"}));
  EXPECT_EQ(peft["rank_pattern"], nlohmann::json({{".*\\.gate_up_proj", 8}}));
  const lathe::io::SafetensorsFile adapter =
      lathe::io::SafetensorsFile::open((dir / "peft/adapter_model.safetensors").string());
  EXPECT_NE(adapter.find("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"), nullptr);
  std::ofstream(dir / "in.jsonl") << "{\"tokens\": [5, 9, 12, 40, 7, 3, 8]}\n{\"tokens\": [1, 2, 3, 4]}\n";
  const std::string in = " --input " + (dir / "in.jsonl").string();
  LatheRun s = lathe_e2e::lathe("logprobs --model " + (dir / "out/base").string() + " --adapter " +
                                (dir / "peft").string() + in + " --output " + (dir / "adapted.jsonl").string());
  ASSERT_EQ(s.exit_code, 0) << s.output;
  s = lathe_e2e::lathe("logprobs --model " + (dir / "merged").string() + in + " --output " + (dir / "merged.jsonl").string());
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const auto adapted = read_logprobs(dir / "adapted.jsonl"), merged = read_logprobs(dir / "merged.jsonl");
  ASSERT_EQ(adapted.size(), merged.size());
  double worst = 0;
  for (size_t i = 0; i < adapted.size(); ++i)
    for (size_t j = 0; j < adapted[i].size(); ++j) worst = std::max(worst, std::abs(adapted[i][j] - merged[i][j]));
  std::printf("[qwen3_moe lora] merged vs base+adapter log-probs: max abs diff %.3g\n", worst);
  EXPECT_LT(worst, 1e-4);
  // `lathe generate` decodes the MoE model (greedy, cached) to the requested length.
  const LatheRun g = lathe_e2e::lathe("generate --model " + (dir / "merged").string() + " --prompt-tokens 5,9,12 "
                                      "--max-new-tokens 4 --print-tokens --ignore-eos");
  ASSERT_EQ(g.exit_code, 0) << g.output;
  const size_t at = g.output.find("{\"completion\"");
  ASSERT_NE(at, std::string::npos) << g.output;
  EXPECT_EQ(nlohmann::json::parse(g.output.substr(at, g.output.find('\n', at) - at))["tokens"].size(), 4u) << g.output;
}

TEST(MoeConvert, PerExpertCheckpointKeepsItsLayout) {
  const fs::path src = kTests / "models/fixtures/moe/qwen3_next/model";
  const fs::path out = fs::temp_directory_path() / fmt::format("lathe_moe_convert_{}", getpid());
  fs::remove_all(out);
  const LatheRun r = lathe_e2e::lathe("convert --model " + src.string() + " --dtype bf16 --output " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const lathe::io::SafetensorsModel saved = lathe::io::SafetensorsModel::open(out.string());
  EXPECT_EQ(saved.find("model.layers.0.mlp.experts.gate_up_proj"), nullptr);
  EXPECT_NE(saved.find("model.layers.0.mlp.experts.7.down_proj.weight"), nullptr);
  EXPECT_EQ(saved.get("model.layers.0.mlp.experts.7.down_proj.weight").dtype, lathe::DType::BF16);
  fs::remove_all(out);
}

TEST(MoeLogprobs, MatchTransformersLogitsOnTheFixtures) {
  EXPECT_GE(lathe_e2e::expect_logprobs_match_fixture_logits(kTests / "models/fixtures/moe", "moe"), 4);
}

TEST(MoeTrain, RouterAuxLossSettingChangesTheUpdatesOnly) {
  const fs::path dir = setup("aux", kNext);
  const std::string cfg = (dir / "config.yaml").string();
  const LatheRun bad = lathe_e2e::lathe("train " + cfg + " --set train.router_aux_loss=maybe");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("train.router_aux_loss: 'maybe' is not one of auto, on, off"), std::string::npos)
      << bad.output;
  const std::vector<std::vector<double>> runs = {three_steps(dir, "router_aux_loss", "on"),
                                                  three_steps(dir, "router_aux_loss", "off")};
  ASSERT_EQ(runs[0].size(), 3u);
  ASSERT_EQ(runs[1].size(), 3u);
  // The first step's loss is the cross-entropy of the same weights either way; the aux term changes the updates.
  EXPECT_EQ(runs[0][0], runs[1][0]);
  EXPECT_NE(runs[0][2], runs[1][2]);
}

TEST(MoeTrain, PaddedExpertsTrainAsTheGroupedOnes) {
  const fs::path dir = setup("padded", kNext);
  const std::string cfg = (dir / "config.yaml").string();
  const LatheRun bad = lathe_e2e::lathe("train " + cfg + " --set train.moe_padded_max_waste=-1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("train.moe_padded_max_waste: must be >= 0 (got -1)"), std::string::npos)
      << bad.output;
  // 0: grouped GEMMs with the groups on the device (the default); 1e9 with the groups read on the host: every layer's
  // experts as one batched GEMM over padded blocks. Same losses within f32 rounding (the CPU runs f32 here; the f64
  // equalities are tests/models/test_moe.cpp's MoePadded and MoeGroupsOnDevice).
  const std::vector<std::vector<double>> runs = {
      three_steps(dir, "moe_padded_max_waste", "0"),
      three_steps(dir, "moe_padded_max_waste", "1e9", " --set train.moe_host_groups=true")};
  ASSERT_EQ(runs[0].size(), 3u);
  ASSERT_EQ(runs[1].size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(runs[1][i], runs[0][i], 1e-4 * std::abs(runs[0][i])) << "step " << i;
}
