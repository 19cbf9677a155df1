// The layout planner (train/plan.h) against what the code really allocates: the weights, gradients and AdamW states
// of a built model after a real backward and update, byte for byte; the planned peak against the host allocator's
// peak of a real training run (the figure metrics.jsonl's memory_mib reports on a GPU), within 15%; and the layouts
// that are refused, with their reasons.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/runtime.h"
#include "core/error.h"
#include "model/causal_lm.h"
#include "optim/adamw.h"
#include "support/error_of.h"
#include "support/model_support.h"
#include "support/text_folder.h"
#include "train/plan.h"
#include "train/trainer.h"

namespace {

namespace fs = std::filesystem;
using namespace lathe;
using namespace lathe::test_support;

// A run folder: the tiny test tokenizer, `rows` short text rows and a config.yaml training an inline Qwen3 `model`
// (a flow mapping of config.json fields) with `train` (a flow mapping of train.* options).
fs::path run_folder(const std::string& name, const std::string& model, const std::string& train, int rows = 60) {
  const fs::path dir = lathe_e2e::tiny_text_folder("lathe_plan", name, rows);
  std::ofstream(dir / "config.yaml") << "model:\n  config: " << model << "\n  tokenizer: " << (dir / "tok").string()
                                     << "\ndata:\n  train: " << (dir / "train.jsonl").string()
                                     << "\n  format: text\n  max_seq_len: 64\noutput_dir: " << (dir / "out").string()
                                     << "\ntrain: " << train << "\n";
  return dir;
}

const char* kSmallModel =
    "{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
    "head_dim: 8, tie_word_embeddings: false, vocab_size: 320}";

size_t value_bytes(const std::vector<Parameter>& params) {
  size_t n = 0;
  for (const Parameter& p : params) n += p.value.nbytes();
  return n;
}

size_t grad_bytes(const std::vector<Parameter>& params) {
  size_t n = 0;
  for (const Parameter& p : params) n += p.grad.defined() ? p.grad.nbytes() : 0;
  return n;
}

// One process (tp 1): the model's parameters, their gradients after a backward, and AdamW's masters and moments after
// an update are exactly the planned bytes, for f32, bf16 with f32 masters and bf16 with bf16 states.
TEST(Plan, WeightsGradientsAndStatesAreTheBuiltModelsTensors) {
  const fs::path dir = run_folder("parts", kSmallModel, "{max_steps: 1, micro_batch_tokens: 64}");
  for (const auto& [dtype, states] : {std::pair{"f32", "f32"}, {"bf16", "f32"}, {"bf16", "bf16"}}) {
    SCOPED_TRACE(fmt::format("dtype {} states {}", dtype, states));
    const TrainConfig c = load_train_config((dir / "config.yaml").string(),
                                            {fmt::format("dtype={}", dtype), fmt::format("train.optimizer_states={}", states)});
    const ModelConfig mc = planned_model_config(c);
    const LayoutPlan plan = plan_layout(c, mc, {1, 1, 0});
    ModelOptions opts;
    opts.dtype = dtype_from_name(dtype);
    std::unique_ptr<CausalLm> model = random_causal_lm(runtime(), mc, opts, 1);
    model->loss(random_batch(mc.vocab_size, {0, 20, 48}, 2), true);
    AdamWConfig acfg;
    acfg.state_dtype = dtype_from_name(states);
    AdamW opt(runtime(), model->parameters(), acfg);
    opt.step(1e-3);
    EXPECT_EQ(int64_t(value_bytes(model->parameters())), plan.memory.weights);
    EXPECT_EQ(int64_t(grad_bytes(model->parameters())), plan.memory.gradients);
    EXPECT_EQ(int64_t(opt.state_bytes()), plan.memory.optimizer);
  }
  // LoRA: the frozen base has no gradients and no state.
  const TrainConfig lora = load_train_config((dir / "config.yaml").string(), {"lora.rank=4"});
  const LayoutPlan plan = plan_layout(lora, planned_model_config(lora), {1, 1, 0});
  EXPECT_EQ(plan.memory.gradients, 0);
  EXPECT_EQ(plan.memory.optimizer, 0);
}

// The planned peak of one rank against the host allocator's peak over a real run of `lathe train`'s trainer (3
// steps): with every layer's activations kept and with recomputation (the memory plan on, as by default: its arena is
// the step's live peak), and with two micro-batches a step. The latter without the memory plan: their batches differ
// in shape from step to step, and a step that departs from the recorded plan allocates its misses beside the idle
// arena, up to twice the live peak (docs/plan.md); the planner predicts the live peak. The model is sized so that
// activations, the loss head and the parameters all matter.
TEST(Plan, PeakIsWithinFifteenPercentOfARealRun) {
  const char* model =
      "{hidden_size: 128, intermediate_size: 512, num_hidden_layers: 6, num_attention_heads: 8, num_key_value_heads: 4, "
      "head_dim: 16, tie_word_embeddings: true, vocab_size: 4096}";
  const fs::path dir = run_folder("peak", model, "{max_steps: 3, micro_batch_tokens: 2048, seed: 3}", 3000);
  for (const std::vector<std::string>& overrides :
       {std::vector<std::string>{}, {"train.recompute=true"}, {"train.grad_accum=2", "train.memory_plan=false"}}) {
    const std::string what = overrides.empty() ? "plain" : overrides[0];
    SCOPED_TRACE(what);
    std::vector<std::string> all = overrides;
    all.push_back("overwrite=true");
    const TrainConfig c = load_train_config((dir / "config.yaml").string(), all);
    const LayoutPlan plan = plan_layout(c, planned_model_config(c), {1, 1, 0});
    Runtime rt;  // a fresh host allocator: its peak is this run's
    run_training(rt, c);
    const double measured = double(rt.host_allocator().stats().peak_allocated);
    const double planned = double(plan.memory.peak);
    std::printf("plan %-22s planned %.1f MiB, measured %.1f MiB (%+.1f%%)\n", what.c_str(), planned / 1048576.0,
                measured / 1048576.0, 100.0 * (planned - measured) / measured);
    EXPECT_LT(std::abs(planned - measured) / measured, 0.15) << "planned " << planned << " measured " << measured;
  }
}

// Refused layouts carry the trainer's reason; an N that the configured layout cannot fill is an error.
TEST(Plan, RefusedLayoutsSayWhy) {
  const fs::path dir = run_folder("refused", kSmallModel, "{max_steps: 1, micro_batch_tokens: 64}");
  const std::string yaml = (dir / "config.yaml").string();
  const auto config_at = [&](const PlanLayout& l) { return load_train_config(yaml, layout_overrides(l)); };
  const TrainConfig c = load_train_config(yaml, {});
  const TrainingPlan four = plan_layouts(c, 4, int64_t(1) << 30, config_at);
  // tp 1, 2, 4 (zero 0..2 where dp > 1): 3 + 3 + 1 layouts
  ASSERT_EQ(four.layouts.size(), 7u);
  for (const LayoutPlan& l : four.layouts) {
    SCOPED_TRACE(fmt::format("tp {} dp {} zero {}", l.layout.tp, l.layout.dp, l.layout.zero));
    EXPECT_EQ(l.layout.tp * l.layout.dp, 4);
    EXPECT_EQ(l.configured, l.layout.tp == 1 && l.layout.zero == 0);
    if (l.layout.tp > 1 && l.layout.zero > 0) {
      EXPECT_NE(l.refused.find("ZeRO over tensor-parallel slices is not built"), std::string::npos) << l.refused;
      EXPECT_FALSE(l.fits);
    } else {
      EXPECT_EQ(l.refused, "");
      EXPECT_TRUE(l.fits);
    }
  }
  // tp 3 does not divide the 4 query heads (check_tensor_parallel's reason).
  const TrainingPlan three = plan_layouts(c, 3, int64_t(1) << 30, config_at);
  ASSERT_EQ(three.layouts.size(), 4u);
  EXPECT_NE(three.layouts.back().refused, "");
  EXPECT_EQ(three.layouts.back().layout.tp, 3);
  // A configured tp 2 cannot fill 3 ranks; nor can an explicit dp 2 with tp 1.
  const TrainConfig tp2 = load_train_config(yaml, {"parallel.tp=2"});
  EXPECT_NE(error_of([&] { plan_layouts(tp2, 3, int64_t(1) << 30, config_at); }), "(no error)");
  const TrainConfig dp2 = load_train_config(yaml, {"parallel.dp=2"});
  EXPECT_NE(error_of([&] { plan_layouts(dp2, 3, int64_t(1) << 30, config_at); }), "(no error)");
  // A layout whose peak exceeds the memory does not fit.
  const TrainingPlan small = plan_layouts(c, 1, 1024, config_at);
  ASSERT_EQ(small.layouts.size(), 1u);
  EXPECT_FALSE(small.layouts[0].fits);
}

// tp and ZeRO divide what one rank holds as the trainer divides it: tp 2 halves the split matrices (k/v too, with 2
// kv heads; the embedding and LM head by vocabulary rows), ZeRO-1 divides the states, ZeRO-2 the gradients too; tp adds per-layer activation sums to the traffic.
TEST(Plan, LayoutsDivideTheirParts) {
  const fs::path dir = run_folder("divide", kSmallModel, "{max_steps: 1, micro_batch_tokens: 64}");
  const TrainConfig c = load_train_config((dir / "config.yaml").string(), {});
  const ModelConfig mc = planned_model_config(c);
  const LayoutPlan one = plan_layout(c, mc, {1, 1, 0}), tp2 = plan_layout(c, mc, {2, 1, 0});
  // Whole on every rank: the final norm and the layers' norms (the embedding and LM head are vocab-parallel).
  const int64_t b = 4, outside = mc.hidden_size * b;
  const int64_t norms = mc.num_layers * (2 * mc.hidden_size + 2 * mc.head_dim) * b;
  EXPECT_EQ(tp2.memory.weights - outside - norms, (one.memory.weights - outside - norms) / 2);
  EXPECT_GT(tp2.comm_bytes, 0);
  EXPECT_EQ(one.comm_bytes, 0);
  const LayoutPlan z1 = plan_layout(c, mc, {1, 2, 1}), z2 = plan_layout(c, mc, {1, 2, 2});
  EXPECT_EQ(z1.memory.optimizer, one.memory.optimizer / 2);
  EXPECT_EQ(z1.memory.gradients, one.memory.gradients);
  EXPECT_EQ(z2.memory.gradients, one.memory.gradients / 2);
}

}  // namespace
