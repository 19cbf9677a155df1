// `lathe plan` as a user runs it: the demo's layouts over 2, 3 and 4 ranks as a table and as JSON (a context-parallel
// layout the trainer refuses, with its reason; one it runs, against data parallelism), and input it cannot plan (a
// missing config, an N the configured layout cannot fill, an unknown key) as usage errors, exit 2; the demo made a
// mixture-of-experts model, with its expert-parallel layouts.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "e2e/lathe_run.h"

namespace {

namespace fs = std::filesystem;
using lathe_e2e::lathe;
using lathe_e2e::LatheRun;

const std::string kDemo = (fs::path(LATHE_TEST_DATA_DIR) / "../examples/demo.yaml").string();

TEST(Plan, DemoOverTwoRanksNamesItsLayouts) {
  const LatheRun r = lathe("plan " + kDemo + " --nproc 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* row : {"* tp=1 cp=1 dp=2 zero=0", "tp=1 cp=1 dp=2 zero=1", "tp=1 cp=1 dp=2 zero=2",
                          "tp=1 cp=2 dp=1 zero=0", "tp=1 cp=2 dp=1 zero=2", "tp=2 cp=1 dp=1 zero=0"})
    EXPECT_NE(r.output.find(row), std::string::npos) << row << "\n" << r.output;
  EXPECT_NE(r.output.find("fits: tp=1 cp=1 dp=2 zero=0"), std::string::npos) << r.output;

  // 3 ranks: cp 3 does not divide the demo's 4 query heads; the row says so in the trainer's words.
  const LatheRun three = lathe("plan " + kDemo + " --nproc 3");
  ASSERT_EQ(three.exit_code, 0) << three.output;
  const size_t row = three.output.find("tp=1 cp=3 dp=1 zero=0");
  ASSERT_NE(row, std::string::npos) << three.output;
  const std::string line = three.output.substr(row, three.output.find('\n', row) - row);
  EXPECT_NE(line.find("refused: parallel.cp: 3 ranks must divide each tp rank's attention heads (4)"),
            std::string::npos) << line;

  // At Qwen3's padded vocabulary (151,936): the demo's tokenizer's 151,669 ids are not divided by tp 2 or 4. Without
  // the demo's final generation (final_eval.file), which the trainer may refuse under cp.
  const LatheRun j = lathe("plan " + kDemo + " --nproc 4 --memory-gib 1 --json --set model.config.vocab_size=151936 " +
                           "--set final_eval.file=");
  ASSERT_EQ(j.exit_code, 0) << j.output;
  const nlohmann::json plan = nlohmann::json::parse(j.output);
  EXPECT_EQ(plan["nproc"], 4);
  EXPECT_EQ(plan["memory_bytes"], int64_t(1) << 30);
  // tp 1 with cp 1, 2 and 4 and tp 2 with cp 1 and 2, zero 0..2 each; tp 4 with zero 0; with pp 2 tp 1 x cp 1, tp 1
  // x cp 2 (zero 0..2 each) and tp 2; pp 4 (refused: the demo's 2 layers)
  ASSERT_EQ(plan["layouts"].size(), 24u);
  for (const nlohmann::json& l : plan["layouts"]) {
    const int tp = l["tp"].get<int>(), cp = l["cp"].get<int>(), zero = l["zero"].get<int>(), pp = l["pp"].get<int>();
    EXPECT_EQ(tp * cp * pp * l["dp"].get<int>(), 4);
    const bool refused = !l["refused"].is_null();
    EXPECT_EQ(refused, (pp > 1 && zero == 2) || pp == 4) << l.dump();  // (the demo has 2 layers)
    if (pp > 1 && !refused) EXPECT_EQ(l["stage_peak_bytes"].size(), size_t(pp)) << l.dump();
    if (!refused) EXPECT_GT(l["peak_bytes"].get<int64_t>(), l["weights_bytes"].get<int64_t>());
  }

  // cp 2 against dp 2: whole weights on each rank, half the rows of activations, the same gradient sum, and cp's
  // all-to-alls besides.
  const LatheRun k = lathe("plan " + kDemo + " --nproc 2 --memory-gib 1 --json --set final_eval.file=");
  ASSERT_EQ(k.exit_code, 0) << k.output;
  const nlohmann::json cp_plan = nlohmann::json::parse(k.output);
  ASSERT_EQ(cp_plan["layouts"].size(), 8u);  // dp 2 (zero 0..2), pp 2, cp 2 (zero 0..2), tp 2
  const nlohmann::json& dp2 = cp_plan["layouts"][0];
  const nlohmann::json& cp2 = cp_plan["layouts"][4];
  ASSERT_EQ(cp2["cp"], 2);
  ASSERT_EQ(cp2["zero"], 0);
  EXPECT_TRUE(cp2["refused"].is_null()) << cp2.dump();
  EXPECT_EQ(cp2["weights_bytes"], dp2["weights_bytes"]);
  EXPECT_EQ(cp2["optimizer_bytes"], dp2["optimizer_bytes"]);
  EXPECT_LT(cp2["activations_bytes"].get<int64_t>(), dp2["activations_bytes"].get<int64_t>());
  const nlohmann::json& parts = cp2["comm_bytes_per_step_by_group"];
  EXPECT_EQ(parts["grads"], dp2["comm_bytes_per_step_by_group"]["grads"]);
  EXPECT_GT(parts["cp"].get<int64_t>(), 0);
  EXPECT_EQ(parts["tp"], 0);
  EXPECT_EQ(cp2["comm_bytes_per_step"].get<int64_t>(), parts["grads"].get<int64_t>() + parts["cp"].get<int64_t>());
}

TEST(Plan, InputItCannotPlanIsAUsageError) {
  const LatheRun missing = lathe("plan /no/such/config.yaml --nproc 2");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("does not exist"), std::string::npos) << missing.output;
  const LatheRun odd = lathe("plan " + kDemo + " --nproc 3 --set parallel.tp=2");
  EXPECT_EQ(odd.exit_code, 2) << odd.output;
  EXPECT_NE(odd.output.find("lathe: error:"), std::string::npos) << odd.output;
  const LatheRun odd_cp = lathe("plan " + kDemo + " --nproc 3 --set parallel.cp=2 --set final_eval.file=");
  EXPECT_EQ(odd_cp.exit_code, 2) << odd_cp.output;
  EXPECT_NE(odd_cp.output.find("tp x cp x pp = 1 x 2 x 1 = 2 does not divide the 3 ranks"), std::string::npos)
      << odd_cp.output;
  const LatheRun unknown = lathe("plan " + kDemo + " --nproc 2 --set train.no_such_key=1");
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("no_such_key"), std::string::npos) << unknown.output;
  EXPECT_EQ(lathe("plan " + kDemo + " --nproc 0").exit_code, 2);
#ifndef LATHE_WITH_CUDA
  const LatheRun gpu = lathe("plan " + kDemo + " --nproc 2 --set device=cuda");  // no GPU to ask its memory
  EXPECT_EQ(gpu.exit_code, 2) << gpu.output;
  EXPECT_NE(gpu.output.find("give --memory-gib"), std::string::npos) << gpu.output;
  EXPECT_EQ(lathe("plan " + kDemo + " --nproc 2 --set device=cuda --memory-gib 80").exit_code, 0);
#endif
}

// The demo made a mixture-of-experts model (4 experts, top 2): the ep rows appear among the layouts of 2 ranks, the two
// ep runs with (over dp 2 or cp 2, ZeRO 0) planned, ZeRO at ep = dp planned too, and the JSON names ep and its traffic.
TEST(Plan, MoeLayoutsIncludeExpertParallelism) {
  const std::string moe = " --set model.config.model_type=qwen3_moe --set model.config.num_experts=4 "
                          "--set model.config.num_experts_per_tok=2 --set model.config.moe_intermediate_size=32 "
                          "--set final_eval.file=";
  const LatheRun r = lathe("plan " + kDemo + " --nproc 2 --memory-gib 4" + moe);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tp=1 cp=1 ep=2 dp=2 zero=0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tp=1 cp=2 ep=2 dp=1 zero=0"), std::string::npos) << r.output;  // the experts over cp ranks
  const size_t row = r.output.find("tp=1 cp=1 ep=2 dp=2 zero=1");
  ASSERT_NE(row, std::string::npos) << r.output;
  // ZeRO with ep = dp x cp: the dense state cut over the two ranks, each rank's experts its own (planned).
  EXPECT_EQ(r.output.substr(row, r.output.find('\n', row) - row).find("refused"), std::string::npos) << r.output;
  const LatheRun j = lathe("plan " + kDemo + " --nproc 2 --memory-gib 4 --json" + moe);
  ASSERT_EQ(j.exit_code, 0) << j.output;
  const nlohmann::json plan = nlohmann::json::parse(j.output);
  int ep_rows = 0;
  for (const nlohmann::json& l : plan["layouts"])
    if (l["ep"] == 2) {
      ++ep_rows;
      EXPECT_GT(l["comm_bytes_per_step_by_group"]["ep"].get<int64_t>(), 0) << l.dump();
    } else {
      EXPECT_EQ(l["comm_bytes_per_step_by_group"]["ep"].get<int64_t>(), 0) << l.dump();
    }
  EXPECT_EQ(ep_rows, 6);  // ep 2 over dp 2, and over cp 2, each at ZeRO 0, 1 and 2
}

}  // namespace
