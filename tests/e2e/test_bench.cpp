// `lathe bench` end to end on the CPU with a tiny config.json: the JSON line has the throughput fields, --profile
// prints a per-kernel table whose totals are positive and together within the step's wall time, LoRA counts its
// FLOPs as 4N + 6N_adapter + attention, --optimizer-states says and records what AdamW keeps (a third of the state
// bytes with bf16 states), --memory-report lists the blocks that make the planned peak, the steady figures leave out
// the memory plan's recording step, and a bad shape fails with a message naming it.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lathe_run.h"

namespace fs = std::filesystem;
using lathe_e2e::lathe;
using lathe_e2e::LatheRun;

namespace {

fs::path tiny_config() {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_e2e_bench_{}", getpid());
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << nlohmann::json{{"model_type", "qwen3"},       {"vocab_size", 512},
                                                       {"hidden_size", 32},           {"intermediate_size", 64},
                                                       {"num_hidden_layers", 2},      {"num_attention_heads", 4},
                                                       {"num_key_value_heads", 2},    {"head_dim", 8},
                                                       {"rms_norm_eps", 1e-6},        {"rope_theta", 10000.0},
                                                       {"tie_word_embeddings", true}, {"max_position_embeddings", 256}}
                                            .dump();
  return dir / "config.json";
}

// The JSON line of a bench run (the last line that starts with '{').
nlohmann::json result_line(const std::string& out) {
  std::istringstream in(out);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') last = line;
  EXPECT_FALSE(last.empty()) << out;
  return last.empty() ? nlohmann::json::object() : nlohmann::json::parse(last);
}

}  // namespace

TEST(Bench, ProfileOfOneStepIsPositiveAndWithinTheStep) {
  const fs::path cfg = tiny_config();
  const LatheRun r = lathe(fmt::format("bench --device cpu --shape {} --seq 32 --micro-batch 2 --steps 2 --warmup 0 --profile",
                                       cfg.string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("profile of one step"), std::string::npos) << r.output;
  const nlohmann::json j = result_line(r.output);
  EXPECT_EQ(j["tokens_per_step"], 64);
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0.0);
  EXPECT_GT(j["step_ms"].get<double>(), 0.0);
  EXPECT_TRUE(j["mfu"].is_null()) << "no peak is known for a CPU";
  EXPECT_TRUE(std::isfinite(j["loss_first"].get<double>()));
  ASSERT_TRUE(j.contains("profile")) << r.output;
  const nlohmann::json& p = j["profile"];
  const double step_ms = p["step_ms"].get<double>();
  double sum = 0;
  bool matmul = false, attention = false, adamw = false;
  for (const auto& k : p["kernels"]) {
    EXPECT_GT(k["ms"].get<double>(), 0.0) << k.dump();
    EXPECT_GT(k["calls"].get<int64_t>(), 0) << k.dump();
    EXPECT_NE(r.output.find(k["kernel"].get<std::string>()), std::string::npos) << "not in the printed table: " << k.dump();
    sum += k["ms"].get<double>();
    matmul |= k["op"] == "matmul";
    attention |= k["op"] == "attention_backward";
    adamw |= k["op"] == "adamw";
  }
  EXPECT_TRUE(matmul && attention && adamw) << p.dump();
  EXPECT_NEAR(sum, p["kernels_ms"].get<double>(), 1e-6 * step_ms + 1e-9);
  EXPECT_GT(sum, 0.0);
  EXPECT_LE(sum, 1.02 * step_ms + 0.05) << "the kernels of one step take longer than the step";
}

TEST(Bench, LoraCountsTheFrozenBaseAtFourN) {
  const LatheRun r = lathe(fmt::format("bench --device cpu --shape {} --seq 16 --micro-batch 2 --steps 1 --warmup 1 --lora-rank 4",
                                       tiny_config().string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = result_line(r.output);
  EXPECT_EQ(j["lora_rank"], 4);
  EXPECT_NE(j["flop_model"].get<std::string>().find("4N"), std::string::npos) << j.dump();
  EXPECT_NE(r.output.find("LoRA r4"), std::string::npos) << r.output;
}

TEST(Bench, Qwen35ShapeRunsAndCountsTheGdnCore) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_e2e_bench_q35_{}", getpid());
  fs::create_directories(dir);
  const nlohmann::json cfg = {{"model_type", "qwen3_5_text"}, {"vocab_size", 256},  {"hidden_size", 32},
                              {"intermediate_size", 48},      {"num_hidden_layers", 2}, {"num_attention_heads", 2},
                              {"num_key_value_heads", 1},     {"head_dim", 16},     {"rms_norm_eps", 1e-6},
                              {"linear_num_key_heads", 1},    {"linear_num_value_heads", 2},
                              {"linear_key_head_dim", 8},     {"linear_value_head_dim", 8},
                              {"linear_conv_kernel_dim", 4},  {"layer_types", {"linear_attention", "full_attention"}},
                              {"tie_word_embeddings", true},  {"max_position_embeddings", 256},
                              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e4},
                                                   {"partial_rotary_factor", 0.5}}}};
  std::ofstream(dir / "config.json") << cfg.dump();
  const LatheRun r = lathe(fmt::format("bench --device cpu --shape {} --seq 16 --micro-batch 2 --steps 1 --warmup 1",
                                       (dir / "config.json").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = result_line(r.output);
  EXPECT_TRUE(std::isfinite(j["loss_first"].get<double>())) << j.dump();
  // Written out from the shapes: matrices (GDN in_proj_qkv 32x32, z 32x16, b and a 32x2, out 16x32; attention q 32x64,
  // k and v 32x16, o 32x32; MLP 3 x 32x48; tied head 256x32), the one attention layer 6 Hq D S = 6*2*16*16, the one
  // GDN layer's core 2 value heads x (22*64 + 24*64*8 + 14*64*8 + 4*4096).
  const double n = (32.0 * 32 + 32 * 16 + 2 * 32 * 2 + 16 * 32) + (32.0 * 64 + 2 * 32 * 16 + 32 * 32) +
                   2 * 3 * 32.0 * 48 + 256.0 * 32;
  const double expected = 6 * n + 6.0 * 2 * 16 * 16 + 2.0 * (22 * 64 + 24 * 64 * 8 + 14 * 64 * 8 + 4 * 4096);
  EXPECT_NEAR(j["flops_per_token"].get<double>(), expected, 1e-9 * expected) << j.dump();
  EXPECT_NE(j["flop_model"].get<std::string>().find("GDN"), std::string::npos) << j.dump();
  fs::remove_all(dir);
}

TEST(Bench, OptimizerStatesAreStatedAndRecorded) {
  const std::string base = fmt::format("bench --device cpu --shape {} --seq 16 --micro-batch 2 --steps 1 --warmup 0",
                                       tiny_config().string());
  const LatheRun masters = lathe(base + " --dtype bf16");
  ASSERT_EQ(masters.exit_code, 0) << masters.output;
  EXPECT_NE(masters.output.find("bf16 with fp32 AdamW masters"), std::string::npos) << masters.output;
  const LatheRun states = lathe(base + " --dtype bf16 --optimizer-states bf16");
  ASSERT_EQ(states.exit_code, 0) << states.output;
  EXPECT_NE(states.output.find("bf16 with bf16 AdamW states (no fp32 masters)"), std::string::npos) << states.output;
  const nlohmann::json a = result_line(masters.output), b = result_line(states.output);
  EXPECT_EQ(a["optimizer_states"], "f32");
  EXPECT_EQ(b["optimizer_states"], "bf16");
  // Every parameter is bf16 here: 12 bytes (f32 master, m, v) against 4 (bf16 m, v).
  EXPECT_DOUBLE_EQ(3 * b["optimizer_state_mib"].get<double>(), a["optimizer_state_mib"].get<double>());
  const LatheRun f32 = lathe(base + " --optimizer-states bf16");
  EXPECT_NE(f32.exit_code, 0);
  EXPECT_NE(f32.output.find("--optimizer-states bf16 keeps bf16 parameters without masters, but the parameters are f32"),
            std::string::npos) << f32.output;
}

// The memory plan records the second step, which is slower (block by block, then the arena's layout): with one warm-up
// step it is the first timed one, and the steady figures are the other timed steps' mean; with two or more warm-up
// steps no timed step records it and the steady figures are all of them.
TEST(Bench, SteadyFiguresLeaveOutTheMemoryPlansRecordingStep) {
  const std::string base = fmt::format("bench --device cpu --shape {} --seq 16 --micro-batch 2 --steps 3",
                                       tiny_config().string());
  const LatheRun one = lathe(base + " --warmup 1");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const nlohmann::json a = result_line(one.output);
  ASSERT_TRUE(a["memory_plan"]["planned"].get<bool>()) << one.output;
  EXPECT_EQ(a["recording_step"], 0);
  const std::vector<double> each = a["step_ms_each"];
  ASSERT_EQ(each.size(), 3u);
  EXPECT_NEAR(a["steady_step_ms"].get<double>(), (each[1] + each[2]) / 2, 1e-9);
  EXPECT_NE(one.output.find("without timed step 1 (it recorded the memory plan)"), std::string::npos) << one.output;
  const LatheRun two = lathe(base + " --warmup 2");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const nlohmann::json b = result_line(two.output);
  EXPECT_EQ(b["recording_step"], -1);
  EXPECT_DOUBLE_EQ(b["steady_step_ms"].get<double>(), b["step_ms"].get<double>());
  EXPECT_EQ(two.output.find("recorded the memory plan"), std::string::npos) << two.output;
}

TEST(Bench, MemoryReportListsTheBlocksThatMakeThePlannedPeak) {
  const std::string base = fmt::format("bench --device cpu --shape {} --seq 16 --micro-batch 2 --steps 1 --warmup 2",
                                       tiny_config().string());
  const LatheRun r = lathe(base + " --memory-report");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = result_line(r.output);
  ASSERT_TRUE(j["memory_plan"]["planned"].get<bool>()) << r.output;
  // "... peaks at event E of N with X MiB alive in B blocks ...", then one row per block size: "  S bytes x C = ...".
  const size_t at = r.output.find("the step peaks at event ");
  ASSERT_NE(at, std::string::npos) << r.output;
  long long event = -1, events = 0, blocks = 0;
  double mib = 0;
  ASSERT_EQ(std::sscanf(r.output.c_str() + at, "the step peaks at event %lld of %lld with %lf MiB alive in %lld blocks",
                        &event, &events, &mib, &blocks), 4) << r.output.substr(at, 200);
  EXPECT_GE(event, 0);
  EXPECT_LT(event, events);
  EXPECT_NEAR(mib, j["memory_plan"]["peak_live_mib"].get<double>(), 0.05) << "the report's blocks are the planner's peak";
  std::istringstream rows(r.output.substr(at));
  std::string line;
  std::getline(rows, line);
  long long listed_blocks = 0, listed_bytes = 0, n_rows = 0;
  while (std::getline(rows, line)) {
    long long size = 0, count = 0;
    if (std::sscanf(line.c_str(), " %lld bytes x %lld =", &size, &count) != 2) break;
    listed_blocks += count, listed_bytes += size * count, ++n_rows;
  }
  ASSERT_GT(n_rows, 0) << r.output;
  if (n_rows < 24) {  // every size listed: the rows add up to the peak
    EXPECT_EQ(listed_blocks, blocks);
    EXPECT_NEAR(double(listed_bytes) / 1048576.0, j["memory_plan"]["peak_live_mib"].get<double>(), 1e-6);
  }
  EXPECT_NE(r.output.find("and 0.0 in blocks larger than their tensors asked for"), std::string::npos)
      << "the host allocator does not cache: no slack";
  const LatheRun none = lathe(base + " --memory-report --no-memory-plan");
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_NE(none.output.find("memory report: none without the memory plan"), std::string::npos) << none.output;
}

TEST(Bench, UnknownShapeFailsWithItsName) {
  const LatheRun r = lathe("bench --device cpu --shape 9b --steps 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--shape 9b"), std::string::npos) << r.output;
}

TEST(Bench, RecomputeLayersWithoutRecomputeIsAnError) {
  const LatheRun r = lathe("bench --device cpu --shape 0.6b --steps 1 --recompute-layers 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--recompute-layers 2 needs --recompute"), std::string::npos) << r.output;
}
