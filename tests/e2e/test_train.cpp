// End-to-end training through the lathe binary on a tiny model and the tiny tokenizer fixture: the loss
// falls; a run killed with SIGKILL (or dying inside a checkpoint save) and restarted with resume=auto
// reproduces the uninterrupted run's losses bitwise on the CPU, and metrics.jsonl stays consistent; bad
// configs and missing files fail with messages that name every problem; bf16 optimizer states
// (train.optimizer_states) train, checkpoint bf16 moments without masters, resume bitwise, and refuse the other setting;
// the memory plan changes no loss, evaluation or weight.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "lathe_run.h"
#include "support/text_folder.h"

namespace fs = std::filesystem;
using lathe_e2e::lathe;
using lathe_e2e::LatheRun;
using lathe_e2e::metrics;

namespace {

// A work folder with a tokenizer folder, training text and a config.
fs::path setup(const std::string& name) {
  const fs::path dir = lathe_e2e::tiny_text_folder("lathe_e2e", name, 60);
  std::ofstream cfg(dir / "config.yaml");
  cfg << "model:\n  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,\n"
         "           num_key_value_heads: 2, head_dim: 8, tie_word_embeddings: true}\n"
         "  tokenizer: " << (dir / "tok").string() << "\n"
         "data:\n  train: " << (dir / "train.jsonl").string() << "\n  format: text\n  max_seq_len: 64\n"
         "output_dir: " << (dir / "out").string() << "\n"
         "train:\n  max_steps: 12\n  micro_batch_tokens: 96\n  lr: 0.01\n  warmup_steps: 2\n  save_every: 3\n  keep_last: 3\n"
         "  seed: 5\n";
  return dir;
}

// Losses by step (the last entry of each step wins; the file must have exactly one entry per step).
std::vector<double> losses(const fs::path& out) {
  std::vector<double> l;
  for (const auto& r : metrics(out)) {
    if (!r.contains("loss")) continue;
    EXPECT_EQ(r["step"].get<int64_t>(), int64_t(l.size()) + 1) << "metrics.jsonl out of order or duplicated";
    l.push_back(r["loss"].get<double>());
  }
  return l;
}

// name -> dtype of every tensor of a safetensors file (its JSON header).
std::map<std::string, std::string> safetensors_dtypes(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, ' ');
  f.read(header.data(), std::streamsize(n));
  const nlohmann::json parsed = nlohmann::json::parse(header);
  std::map<std::string, std::string> out;
  for (const auto& [name, entry] : parsed.items())
    if (name != "__metadata__") out[name] = entry["dtype"].get<std::string>();
  return out;
}

}  // namespace

TEST(Train, LossFallsAndOutputsAreComplete) {
  const fs::path dir = setup("falls");
  const LatheRun r = lathe("train " + (dir / "config.yaml").string() + " --set train.max_steps=30 --set train.save_every=0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> l = losses(dir / "out");
  ASSERT_EQ(l.size(), 30u);
  EXPECT_LT(l.back(), 0.6 * l.front()) << "loss did not fall: " << l.front() << " -> " << l.back();
  EXPECT_TRUE(fs::exists(dir / "out/final/config.json"));
  EXPECT_TRUE(fs::exists(dir / "out/final/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "out/final/tokenizer.json"));
  EXPECT_TRUE(fs::exists(dir / "out/config.resolved.json"));
  bool tb = false;
  for (const auto& e : fs::directory_iterator(dir / "out/tb")) tb |= e.path().filename().string().rfind("events.out.tfevents", 0) == 0;
  EXPECT_TRUE(tb) << "no TensorBoard event file";
  const std::vector<nlohmann::json> rows = metrics(dir / "out");
  for (const char* key : {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "elapsed_s"})
    EXPECT_TRUE(rows[0].contains(key)) << key;
  for (size_t i = 1; i < rows.size(); ++i)  // the run's clock: at least the step's own time after the previous row
    EXPECT_GE(rows[i]["elapsed_s"].get<double>(), rows[i - 1]["elapsed_s"].get<double>() + rows[i]["step_time_s"].get<double>() * 0.99)
        << "step " << i + 1;
}

// train.profile_step: step N's kernels are timed and printed as `lathe bench --profile` prints them, once, and the run
// is otherwise the same (bitwise, on the CPU).
TEST(Train, ProfileStepPrintsThatStepsKernelsAndChangesNothing) {
  const fs::path dir = setup("profile");
  const std::string base = "train " + (dir / "config.yaml").string() + " --set train.max_steps=4 --set train.save_every=0";
  const LatheRun plain = lathe(base + " --set output_dir=" + (dir / "plain").string());
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_EQ(plain.output.find("profile of one step"), std::string::npos);
  const LatheRun r = lathe(base + " --set output_dir=" + (dir / "profiled").string() + " --set train.profile_step=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const size_t at = r.output.find("profile of one step: wall ");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("profile of one step", at + 1), std::string::npos) << "printed more than once";
  EXPECT_NE(r.output.find("by kind: ", at), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("matmul shapes", at), std::string::npos) << r.output;
  EXPECT_EQ(losses(dir / "profiled"), losses(dir / "plain"));
}

TEST(Train, KilledWithSigkillAndResumedReproducesTheLossesBitwise) {
  const fs::path ref = setup("ref");
  ASSERT_EQ(lathe("train " + (ref / "config.yaml").string()).exit_code, 0);
  const std::vector<double> want = losses(ref / "out");
  ASSERT_EQ(want.size(), 12u);

  const fs::path dir = setup("kill");
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cfg = (dir / "config.yaml").string();
    freopen("/dev/null", "w", stdout);
    execl(LATHE_BINARY, LATHE_BINARY, "train", cfg.c_str(), (char*)nullptr);
    _exit(127);
  }
  // Kill it once it is past its second checkpoint, wherever it is then.
  for (int i = 0; i < 6000 && losses(dir / "out").size() < 7; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the run finished before it could be killed";
  const LatheRun resumed = lathe("train " + (dir / "config.yaml").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  EXPECT_EQ(losses(dir / "out"), want);  // bitwise: the same doubles
}

TEST(Train, CrashDuringSaveLeavesThePreviousCheckpointUsable) {
  const fs::path ref = setup("ref2");
  ASSERT_EQ(lathe("train " + (ref / "config.yaml").string()).exit_code, 0);
  const fs::path dir = setup("crash");
  const LatheRun crashed = lathe("train " + (dir / "config.yaml").string(), "LATHE_FAULT_INJECT=checkpoint_save:6");
  EXPECT_EQ(crashed.exit_code, 3);
  EXPECT_TRUE(fs::exists(dir / "out/checkpoints/step-00000003/trainer_state.json"));
  EXPECT_FALSE(fs::exists(dir / "out/checkpoints/step-00000006"));  // only a .tmp folder, never a complete-looking one
  const LatheRun resumed = lathe("train " + (dir / "config.yaml").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("step-00000003"), std::string::npos) << resumed.output;
  EXPECT_EQ(losses(dir / "out"), losses(ref / "out"));
  for (const auto& e : fs::directory_iterator(dir / "out/checkpoints"))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << "stale temporary checkpoint left behind";
}

TEST(Train, ExportWritesALoadableFolder) {
  const fs::path dir = setup("export");
  ASSERT_EQ(lathe("train " + (dir / "config.yaml").string() + " --set train.max_steps=3").exit_code, 0);
  const LatheRun e = lathe("export --checkpoint " + (dir / "out").string() + " --output " + (dir / "exported").string() +
                           " --dtype f32");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"}) EXPECT_TRUE(fs::exists(dir / "exported" / f)) << f;
  // The exported weights are the checkpoint's: scoring with both gives the same log-probs.
  std::ofstream(dir / "in.jsonl") << "{\"tokens\": [5, 9, 12, 40, 7]}\n";
  ASSERT_EQ(lathe("logprobs --model " + (dir / "exported").string() + " --input " + (dir / "in.jsonl").string() +
                  " --output " + (dir / "a.jsonl").string()).exit_code, 0);
  ASSERT_EQ(lathe("logprobs --model " + (dir / "out/checkpoints/step-00000003/model").string() + " --input " +
                  (dir / "in.jsonl").string() + " --output " + (dir / "b.jsonl").string()).exit_code, 0);
  std::ifstream a(dir / "a.jsonl"), b(dir / "b.jsonl");
  std::string la, lb;
  std::getline(a, la);
  std::getline(b, lb);
  EXPECT_EQ(la, lb);
  EXPECT_EQ(nlohmann::json::parse(la)["logprobs"].size(), 4u);
}

// The same kill-and-resume on a GPU: bf16 compute, so equal within tolerance rather than bitwise.
TEST(Train, ResumeOnCudaMatchesWithinTolerance) {
  if (lathe("kernels").output.find("cuda: unavailable") != std::string::npos) GTEST_SKIP() << "no CUDA device";
  const fs::path ref = setup("cuda_ref");
  ASSERT_EQ(lathe("train " + (ref / "config.yaml").string() + " --set device=cuda").exit_code, 0);
  const fs::path dir = setup("cuda_kill");
  EXPECT_EQ(lathe("train " + (dir / "config.yaml").string() + " --set device=cuda", "LATHE_FAULT_INJECT=after_step:8").exit_code, 9);
  const LatheRun resumed = lathe("train " + (dir / "config.yaml").string() + " --set device=cuda");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const std::vector<double> want = losses(ref / "out"), got = losses(dir / "out");
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / std::abs(want[i]));
  std::printf("[cuda resume] worst relative loss difference over %zu steps: %.3g\n", want.size(), worst);
  EXPECT_LT(worst, 1e-2);
}

// train.memory_plan (default on) against off, through the whole trainer: evaluations and checkpoints between the
// planned steps, the arena handed back before the export. Losses, evaluation losses, gradient norms and the exported
// weights must be bitwise equal (on CUDA too: every kernel of a default run is deterministic), and the log must say
// what was planned.
namespace {

void expect_memory_plan_changes_nothing(const std::string& device) {
  std::vector<fs::path> dirs;
  std::vector<LatheRun> runs;
  for (const char* plan : {"true", "false"}) {
    const fs::path dir = setup(fmt::format("plan_{}_{}", device, plan));
    runs.push_back(lathe(fmt::format("train {} --set device={} --set train.eval_every=4 --set train.save_every=5 "
                                     "--set data.eval=[{}] --set train.memory_plan={}",
                                     (dir / "config.yaml").string(), device, (dir / "train.jsonl").string(), plan)));
    ASSERT_EQ(runs.back().exit_code, 0) << runs.back().output;
    dirs.push_back(dir);
  }
  EXPECT_NE(runs[0].output.find("memory plan: "), std::string::npos) << runs[0].output;
  EXPECT_NE(runs[0].output.find("laid out in one arena"), std::string::npos) << runs[0].output;
  EXPECT_EQ(runs[1].output.find("memory plan"), std::string::npos) << runs[1].output;
  const auto with = metrics(dirs[0] / "out"), without = metrics(dirs[1] / "out");
  ASSERT_EQ(with.size(), without.size());
  int evals = 0;
  for (size_t i = 0; i < with.size(); ++i) {
    for (const char* key : {"loss", "grad_norm", "eval_loss"}) {
      EXPECT_EQ(with[i].contains(key), without[i].contains(key)) << key << " at entry " << i;
      if (with[i].contains(key) && without[i].contains(key))
        EXPECT_EQ(with[i][key].get<double>(), without[i][key].get<double>()) << key << " at entry " << i;
    }
    evals += with[i].contains("eval_loss");
  }
  EXPECT_GE(evals, 3);
  std::ifstream a(dirs[0] / "out/final/model.safetensors", std::ios::binary), b(dirs[1] / "out/final/model.safetensors", std::ios::binary);
  const std::string wa((std::istreambuf_iterator<char>(a)), {}), wb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(wa.empty());
  EXPECT_TRUE(wa == wb) << "the exported weights differ";
}

}  // namespace

TEST(Train, MemoryPlanChangesNothingOnTheCpu) { expect_memory_plan_changes_nothing("cpu"); }

TEST(Train, MemoryPlanChangesNothingOnCuda) {
  if (lathe("kernels").output.find("cuda: unavailable") != std::string::npos) GTEST_SKIP() << "no CUDA device";
  expect_memory_plan_changes_nothing("cuda");
}

TEST(Cli, KernelsAndHelpRun) {
  const LatheRun k = lathe("kernels");
  EXPECT_EQ(k.exit_code, 0) << k.output;
  EXPECT_NE(k.output.find("attention"), std::string::npos) << k.output;
  const LatheRun h = lathe("train --help-config");
  EXPECT_EQ(h.exit_code, 0) << h.output;
  EXPECT_NE(h.output.find("train.micro_batch_tokens"), std::string::npos) << h.output;
  EXPECT_NE(lathe("no-such-command").exit_code, 0);
}

TEST(Train, BadConfigsReportEveryProblem) {
  const fs::path dir = setup("bad");
  const LatheRun r = lathe("train " + (dir / "config.yaml").string() +
                      " --set train.lrr=0.1 --set train.max_steps=abc --set data.overlong=squash --set device=tpu");
  EXPECT_NE(r.exit_code, 0);
  for (const char* needle : {"4 problems", "unknown option 'train.lrr' (did you mean 'train.lr'?)", "train.max_steps: expected int",
                             "data.overlong: 'squash'", "device: 'tpu'"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  const LatheRun experts = lathe("train " + (dir / "config.yaml").string() + " --set lora.target_parameters=gate_up_proj");
  EXPECT_NE(experts.exit_code, 0);
  EXPECT_NE(experts.output.find("lora.target_parameters: needs lora.rank > 0"), std::string::npos) << experts.output;
  const LatheRun missing = lathe("train " + (dir / "config.yaml").string() + " --set data.train=" + (dir / "nope.jsonl").string());
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("nope.jsonl"), std::string::npos) << missing.output;
  const LatheRun deep = lathe("train " + (dir / "config.yaml").string() +
                              " --set train.recompute=true --set train.recompute_layers=99");
  EXPECT_NE(deep.exit_code, 0);
  EXPECT_NE(deep.output.find("train.recompute_layers is 99, but the model has"), std::string::npos) << deep.output;
  const LatheRun no_file = lathe("train " + (dir / "absent.yaml").string());
  EXPECT_NE(no_file.exit_code, 0);
  EXPECT_NE(no_file.output.find("absent.yaml"), std::string::npos) << no_file.output;
}

TEST(Train, Bf16OptimizerStates) {
  const fs::path dir = setup("bf16_states");
  const std::string cfg = (dir / "config.yaml").string();
  // Refused: an unknown value, and bf16 states over f32 parameters (the CPU default), where they would do nothing.
  const LatheRun bad = lathe("train " + cfg + " --set train.optimizer_states=f16");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("train.optimizer_states: 'f16' is not one of f32, bf16"), std::string::npos) << bad.output;
  const LatheRun f32 = lathe("train " + cfg + " --set train.optimizer_states=bf16");
  EXPECT_NE(f32.exit_code, 0);
  EXPECT_NE(f32.output.find("train.optimizer_states: bf16 keeps bf16 parameters without f32 masters, but the parameters "
                            "are f32"), std::string::npos) << f32.output;

  // An uninterrupted run, and one that stops after step 4 and resumes from its step-3 checkpoint: the same losses.
  const std::string bf16 = " --set dtype=bf16 --set train.optimizer_states=bf16";
  const LatheRun full = lathe("train " + cfg + bf16);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  EXPECT_NE(full.output.find("AdamW states in bf16 (no f32 masters)"), std::string::npos) << full.output;
  const std::vector<double> want = losses(dir / "out");
  ASSERT_EQ(want.size(), 12u);
  EXPECT_LT(want.back(), want.front());
  const auto dtypes = safetensors_dtypes(dir / "out/checkpoints/step-00000012/optimizer.safetensors");
  EXPECT_EQ(dtypes.at("model.embed_tokens.weight.exp_avg"), "BF16");
  EXPECT_EQ(dtypes.at("model.norm.weight.exp_avg_sq"), "BF16");
  for (const auto& [name, dtype] : dtypes) EXPECT_EQ(name.find(".master"), std::string::npos) << name;

  const fs::path dir2 = setup("bf16_states_resume");
  const std::string cfg2 = (dir2 / "config.yaml").string();
  EXPECT_EQ(lathe("train " + cfg2 + bf16, "LATHE_FAULT_INJECT=after_step:4").exit_code, 9);
  // Resuming with the other setting is refused, naming a tensor and both dtypes, and changes nothing.
  const LatheRun other = lathe("train " + cfg2 + " --set dtype=bf16");
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.output.find("model.embed_tokens.weight.exp_avg is bf16 in the file, but this optimizer keeps it in "
                              "f32"), std::string::npos) << other.output;
  const LatheRun resumed = lathe("train " + cfg2 + bf16);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  EXPECT_EQ(losses(dir2 / "out"), want);  // bitwise: the same doubles
}

// ---- Bad input and re-runs never damage a run (the robustness issue) -------------------------------------------

namespace {

// Every file under `dir` with its bytes: a run folder's whole state, to show a command left it untouched.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    files[fs::relative(e.path(), dir).string()] = std::string((std::istreambuf_iterator<char>(f)), {});
  }
  return files;
}

// The files that differ between two snapshots (added, removed or changed), for a readable failure.
std::string changed(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  std::string out;
  for (const auto& [name, bytes] : a)
    if (!b.count(name) || b.at(name) != bytes) out += " " + name;
  for (const auto& [name, bytes] : b)
    if (!a.count(name)) out += " +" + name;
  return out;
}

std::vector<std::string> checkpoints(const fs::path& out) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out / "checkpoints")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A finished 6-step run with a final evaluation: the folder the re-run tests start from.
fs::path finished_run(const std::string& name) {
  const fs::path dir = setup(name);
  std::ofstream(dir / "heldout.jsonl") << "{\"prompt\": \"the cat sat\", \"answer\": \"on\"}\n";
  std::ofstream(dir / "config.yaml", std::ios::app) << "final_eval: {file: " << (dir / "heldout.jsonl").string()
                                                     << ", max_new_tokens: 2}\n";
  const LatheRun r = lathe("train " + (dir / "config.yaml").string() + " --set train.max_steps=6");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return dir;
}

}  // namespace

TEST(Rerun, AFinishedRunSaysSoAndChangesNothing) {
  const fs::path dir = finished_run("rerun_done");
  const auto before = snapshot(dir / "out");
  const LatheRun again = lathe("train " + (dir / "config.yaml").string() + " --set train.max_steps=6");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("already finished at step 6"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("steps 7..6"), std::string::npos) << again.output;
  EXPECT_EQ(changed(before, snapshot(dir / "out")), "") << "a re-run of a finished run changed its folder";
}

TEST(Rerun, ResumeNoneIntoARunIsRefusedAndChangesNothing) {
  const fs::path dir = finished_run("rerun_none");
  const auto before = snapshot(dir / "out");
  const LatheRun r = lathe("train " + (dir / "config.yaml").string() + " --set train.max_steps=6 --set resume=none");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("resume: none, but output_dir " + (dir / "out").string() +
                          " already holds a run with checkpoints up to step 6 and a final model"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("overwrite: true"), std::string::npos) << r.output;
  EXPECT_EQ(changed(before, snapshot(dir / "out")), "");
}

TEST(Rerun, OverwriteStartsAgainAndExportSeesOnlyTheNewRun) {
  const fs::path dir = finished_run("rerun_overwrite");
  // The new run is shorter: with the old checkpoints kept, export would pick the old step-6 model.
  const LatheRun r = lathe("train " + (dir / "config.yaml").string() + " --set train.max_steps=2 --set overwrite=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(checkpoints(dir / "out"), std::vector<std::string>{"step-00000002"});
  EXPECT_EQ(losses(dir / "out").size(), 2u);
  int final_evals = 0;
  for (const auto& m : metrics(dir / "out")) final_evals += m.contains("final_eval_accuracy");
  EXPECT_EQ(final_evals, 1);
  // Refused for a folder that holds files of something else.
  fs::create_directories(dir / "mine");
  std::ofstream(dir / "mine/notes.txt") << "keep me";
  const LatheRun other = lathe("train " + (dir / "config.yaml").string() + " --set overwrite=true --set output_dir=" +
                               (dir / "mine").string());
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.output.find("holds files that are not a Lathe run's"), std::string::npos) << other.output;
  EXPECT_TRUE(fs::exists(dir / "mine/notes.txt"));
}

TEST(Rerun, ResumingFromAnOlderCheckpointRewindsTheRun) {
  const fs::path dir = setup("rewind");
  const std::string cfg = (dir / "config.yaml").string();
  ASSERT_EQ(lathe("train " + cfg + " --set train.keep_last=5").exit_code, 0);  // checkpoints 3, 6, 9, 12
  const std::vector<double> full = losses(dir / "out");
  const LatheRun r = lathe("train " + cfg + " --set train.keep_last=5 --set resume=" +
                           (dir / "out/checkpoints/step-00000006").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(checkpoints(dir / "out"),
            (std::vector<std::string>{"step-00000003", "step-00000006", "step-00000009", "step-00000012"}));
  EXPECT_EQ(losses(dir / "out"), full);  // the same run again from step 7: bitwise on the CPU, one entry a step
  // A shorter run from step 6: the checkpoints after it belong to the abandoned run and go.
  ASSERT_EQ(lathe("train " + cfg + " --set train.max_steps=8 --set train.keep_last=5 --set resume=" +
                  (dir / "out/checkpoints/step-00000006").string()).exit_code, 0);
  EXPECT_EQ(checkpoints(dir / "out"), (std::vector<std::string>{"step-00000003", "step-00000006", "step-00000008"}));
  EXPECT_EQ(losses(dir / "out").size(), 8u);
}

TEST(Rerun, AMissingFinalModelIsWrittenOnTheNextRun) {
  const fs::path dir = finished_run("final_missing");
  const std::vector<double> before = losses(dir / "out");
  fs::remove_all(dir / "out/final");  // as if the process died between the last checkpoint and the export
  const LatheRun r = lathe("train " + (dir / "config.yaml").string() + " --set train.max_steps=6");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "out/final/model.safetensors"));
  EXPECT_EQ(losses(dir / "out"), before);
  int final_evals = 0;
  for (const auto& m : metrics(dir / "out")) final_evals += m.contains("final_eval_accuracy");
  EXPECT_EQ(final_evals, 1) << "the final evaluation ran again";
}

TEST(Rerun, ARunThatFailsValidationLeavesTheFolderAsItWas) {
  const fs::path dir = finished_run("invalid");
  const auto before = snapshot(dir / "out");
  const std::string cfg = (dir / "config.yaml").string() + " --set train.max_steps=12";  // would continue the run
  struct Case {
    std::string set, needle;
  };
  const std::vector<Case> cases = {
      {"train.warmup_steps=20", "train.warmup_steps: 20 exceed train.max_steps (12)"},
      {"model.tokenizer=" + (dir / "nowhere").string(), "model.tokenizer " + (dir / "nowhere").string() + " does not exist"},
      {"data.train=" + (dir / "nowhere.jsonl").string(), "nowhere.jsonl"},
      {"final_eval.file=" + (dir / "nowhere.jsonl").string(), (dir / "nowhere.jsonl").string() + " does not exist"},
      {"dtype=f16", "dtype: 'f16' is not one of f32, bf16"},
      {"model.config.num_attention_heads=3", "model.config"},
      {"train.log_every=0", "train.log_every: must be >= 1 (got 0)"},
      {"train.save_every=-1", "train.save_every: must be >= 0 (got -1)"},
      {"train.eval_batches=0", "train.eval_batches: must be >= 1"},
      {"train.max_bad_steps=0", "train.max_bad_steps: must be >= 1"},
  };
  for (const Case& c : cases) {
    const LatheRun r = lathe("train " + cfg + " --set " + c.set);
    EXPECT_NE(r.exit_code, 0) << c.set;
    EXPECT_LT(r.exit_code, 3) << c.set << ": not a clear error\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.set << "\n" << r.output;
    EXPECT_EQ(changed(before, snapshot(dir / "out")), "") << c.set << " changed the run folder";
  }
}

TEST(Rerun, LogEveryIsSafeWhenStdoutIsNotATerminal) {
  const fs::path dir = setup("log_every");
  const LatheRun r = lathe("train " + (dir / "config.yaml").string() + " --set train.max_steps=4 --set train.log_every=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step 3/4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 4/4"), std::string::npos) << r.output;  // the last step always
  EXPECT_EQ(r.output.find("step 2/4"), std::string::npos) << r.output;
}

TEST(Inputs, ConfigPathsAreRelativeToTheConfigFile) {
  const fs::path dir = setup("relative");
  fs::create_directories(dir / "conf");
  // The same run with every path relative to conf/, started from another directory.
  std::ofstream(dir / "conf/run.yaml")
      << "model:\n  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,\n"
         "           num_key_value_heads: 2, head_dim: 8, tie_word_embeddings: true}\n"
         "  tokenizer: ../tok\ndata:\n  train: [../train.jsonl]\n  format: text\n  max_seq_len: 64\n"
         "output_dir: ../rel_out\ntrain: {max_steps: 2, micro_batch_tokens: 96}\n";
  const LatheRun r = lathe("train conf/run.yaml", "cd " + dir.string() + " &&");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "rel_out/final/model.safetensors"));
  const LatheRun elsewhere = lathe("train " + (dir / "conf/run.yaml").string(), "cd / &&");
  ASSERT_EQ(elsewhere.exit_code, 0) << elsewhere.output;
  EXPECT_NE(elsewhere.output.find("already finished"), std::string::npos) << elsewhere.output;
  // --set paths stay relative to the current directory.
  const LatheRun set = lathe("train conf/run.yaml --set output_dir=cwd_out", "cd " + dir.string() + " &&");
  ASSERT_EQ(set.exit_code, 0) << set.output;
  EXPECT_TRUE(fs::exists(dir / "cwd_out/final/model.safetensors"));
}

TEST(Inputs, DuplicateKeysAndMisplacedPathsAreClearErrors) {
  const fs::path dir = setup("dups");
  std::ofstream(dir / "dup.yaml") << "output_dir: a\ntrain: {max_steps: 2}\noutput_dir: b\n";
  const LatheRun dup = lathe("train " + (dir / "dup.yaml").string());
  EXPECT_EQ(dup.exit_code, 1);
  EXPECT_NE(dup.output.find("dup.yaml:3: key 'output_dir' is given twice in one mapping (first at line 1)"),
            std::string::npos) << dup.output;
  std::ofstream(dir / "a_file") << "x";
  const LatheRun under = lathe("train " + (dir / "config.yaml").string() + " --set output_dir=" + (dir / "a_file/out").string());
  EXPECT_EQ(under.exit_code, 1);
  EXPECT_NE(under.output.find((dir / "a_file").string() + " is a file, not a folder"), std::string::npos) << under.output;
  const LatheRun folder = lathe("train " + dir.string());
  EXPECT_EQ(folder.exit_code, 1);
  EXPECT_NE(folder.output.find(dir.string() + " is a folder, not a file"), std::string::npos) << folder.output;
  const LatheRun missing = lathe("train " + (dir / "absent.yaml").string());
  EXPECT_NE(missing.output.find((dir / "absent.yaml").string() + " does not exist"), std::string::npos) << missing.output;
  const LatheRun model = lathe("train " + (dir / "config.yaml").string() + " --set model.path=" + (dir / "no_model").string() +
                               " --set model.config=null --set model.tokenizer=" + (dir / "tok").string());
  EXPECT_NE(model.output.find("model.path " + (dir / "no_model").string() + " does not exist"), std::string::npos)
      << model.output;
  const LatheRun none = lathe("");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.output.find("Usage: lathe"), std::string::npos) << none.output;
  EXPECT_EQ(lathe("train --no-such-flag").exit_code, 2);
}

TEST(Inputs, TheFinalFolderCarriesWhatTransformersWritesAndTheChatSettings) {
  const fs::path dir = setup("final_files");
  const LatheRun r = lathe("train " + (dir / "config.yaml").string() +
                           " --set train.max_steps=2 --set model.config.hidden_size=48 --set model.config.head_dim=12"
                           " --set data.chat_template_kwargs.enable_thinking=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream cf(dir / "out/final/config.json");
  const nlohmann::json config = nlohmann::json::parse(cf);
  EXPECT_EQ(config["architectures"], nlohmann::json::array({"Qwen3ForCausalLM"}));
  EXPECT_EQ(config["hidden_size"], 48);  // --set model.config.KEY kept the rest of the inline config
  EXPECT_EQ(config["num_hidden_layers"], 2);
  EXPECT_TRUE(fs::exists(dir / "out/final/generation_config.json"));
  std::ifstream kf(dir / "out/final/chat_template_kwargs.json");
  EXPECT_EQ(nlohmann::json::parse(kf), (nlohmann::json{{"enable_thinking", true}}));
  std::ifstream ck(dir / "out/checkpoints/step-00000002/model/chat_template_kwargs.json");
  EXPECT_EQ(nlohmann::json::parse(ck), (nlohmann::json{{"enable_thinking", true}}));
}

TEST(Inputs, AFullDiskIsAClearErrorAndLeavesNoTemporaries) {
  const fs::path dir = setup("full_disk");
  // A full disk as the process sees it: writes past RLIMIT_FSIZE fail with EFBIG (SIGXFSZ ignored). The first
  // checkpoint's weights (about 110 KiB) do not fit under 40 blocks.
  const LatheRun r = lathe("train " + (dir / "config.yaml").string(), "trap '' XFSZ; ulimit -f 40;");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("lathe: error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("too large"), std::string::npos) << r.output;  // the system's reason (EFBIG)
  for (const auto& e : fs::recursive_directory_iterator(dir / "out"))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << "left behind: " << e.path();
  EXPECT_FALSE(fs::exists(dir / "out/checkpoints/step-00000003"));
}
