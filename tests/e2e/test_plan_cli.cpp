// `lathe plan` as a user runs it: the demo's layouts over 2 ranks as a table and as JSON, and input it cannot plan
// (a missing config, an N the configured layout cannot fill, an unknown key) as usage errors, exit 2.
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
  for (const char* row : {"* tp=1 dp=2 zero=0", "tp=1 dp=2 zero=1", "tp=1 dp=2 zero=2", "tp=2 dp=1 zero=0"})
    EXPECT_NE(r.output.find(row), std::string::npos) << row << "\n" << r.output;
  EXPECT_NE(r.output.find("fits: tp=1 dp=2 zero=0"), std::string::npos) << r.output;

  // At Qwen3's padded vocabulary (151,936): the demo's tokenizer's 151,669 ids are not divided by tp 2 or 4.
  const LatheRun j = lathe("plan " + kDemo + " --nproc 4 --memory-gib 1 --json --set model.config.vocab_size=151936");
  ASSERT_EQ(j.exit_code, 0) << j.output;
  const nlohmann::json plan = nlohmann::json::parse(j.output);
  EXPECT_EQ(plan["nproc"], 4);
  EXPECT_EQ(plan["memory_bytes"], int64_t(1) << 30);
  ASSERT_EQ(plan["layouts"].size(), 7u);  // tp 1 and 2 with zero 0..2, tp 4 with zero 0
  for (const nlohmann::json& l : plan["layouts"]) {
    EXPECT_EQ(l["tp"].get<int>() * l["dp"].get<int>(), 4);
    const bool refused = !l["refused"].is_null();
    EXPECT_EQ(refused, l["tp"].get<int>() > 1 && l["zero"].get<int>() > 0) << l.dump();
    if (!refused) EXPECT_GT(l["peak_bytes"].get<int64_t>(), l["weights_bytes"].get<int64_t>());
  }
}

TEST(Plan, InputItCannotPlanIsAUsageError) {
  const LatheRun missing = lathe("plan /no/such/config.yaml --nproc 2");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("does not exist"), std::string::npos) << missing.output;
  const LatheRun odd = lathe("plan " + kDemo + " --nproc 3 --set parallel.tp=2");
  EXPECT_EQ(odd.exit_code, 2) << odd.output;
  EXPECT_NE(odd.output.find("lathe: error:"), std::string::npos) << odd.output;
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

}  // namespace
