// Data parallelism over MPI on the CPU (f32), through `mpirun lathe train`: dp = N with grad_accum k is the run of one
// process with grad_accum N x k — per-step losses within 1e-5 relative and final weights within 1e-5 — for the dense
// Qwen3, the Qwen3.5 hybrid and a Qwen3-Next MoE, and for LoRA; a run checkpointed at dp = 2 resumes at dp = 4 on the
// same loss curve; a rank killed with SIGKILL ends the job (never a hang) and the resumed run equals the
// uninterrupted one; a layout that cannot work is refused before any weight is loaded.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "io/safetensors.h"
#include "lathe_run.h"
#include "support/tensor_files.h"

namespace fs = std::filesystem;

using lathe_e2e::LatheRun;
using lathe_e2e::losses;

namespace {

const fs::path kTests = LATHE_TEST_DATA_DIR;
const std::string kMpirun = std::string(LATHE_MPIRUN) + " --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1";

// Buckets of about 1 KiB (parallel.bucket_mb), so that the tiny model's gradients are summed in many buckets as the
// backward completes them (one bucket holds everything at the default size).
const std::string kSmallBuckets = " --set parallel.bucket_mb=0.001";

// vocab_size 320 (the tokenizer's 305 padded): tensor parallelism splits the vocabulary too, so tp 2 and 4 must divide it.
const char* kQwen3 =
    "model:\n  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,\n"
    "           num_key_value_heads: 2, head_dim: 8, tie_word_embeddings: true, vocab_size: 320}\n";
const char* kQwen35 =
    "model:\n  config: {model_type: qwen3_5_text, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,\n"
    "           layer_types: [linear_attention, full_attention], num_attention_heads: 2, num_key_value_heads: 1,\n"
    "           head_dim: 8, partial_rotary_factor: 0.5, rope_theta: 10000, linear_num_key_heads: 1,\n"
    "           linear_num_value_heads: 2, linear_key_head_dim: 8, linear_value_head_dim: 8,\n"
    "           linear_conv_kernel_dim: 4, tie_word_embeddings: true}\n  init_std: 0.2\n";
// The hybrid with two GDN key heads of two value heads each and four attention heads over two kv heads: tp 2 splits
// every layer.
const char* kQwen35Tp =
    "model:\n  config: {model_type: qwen3_5_text, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,\n"
    "           layer_types: [linear_attention, full_attention], num_attention_heads: 4, num_key_value_heads: 2,\n"
    "           head_dim: 8, partial_rotary_factor: 0.5, rope_theta: 10000, linear_num_key_heads: 2,\n"
    "           linear_num_value_heads: 4, linear_key_head_dim: 8, linear_value_head_dim: 8,\n"
    "           linear_conv_kernel_dim: 4, tie_word_embeddings: true, vocab_size: 320}\n  init_std: 0.2\n";
// The hybrid of kQwen35Tp with mixture-of-experts MLPs (a shared expert, the aux loss on): cp 2 divides its heads.
const char* kQwen35MoeCp =
    "model:\n  config: {model_type: qwen3_5_moe_text, hidden_size: 32, num_hidden_layers: 2,\n"
    "           layer_types: [linear_attention, full_attention], num_attention_heads: 4, num_key_value_heads: 2,\n"
    "           head_dim: 8, partial_rotary_factor: 0.5, rope_theta: 10000, linear_num_key_heads: 2,\n"
    "           linear_num_value_heads: 4, linear_key_head_dim: 8, linear_value_head_dim: 8,\n"
    "           linear_conv_kernel_dim: 4, num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 16,\n"
    "           shared_expert_intermediate_size: 16, router_aux_loss_coef: 0.01, output_router_logits: true,\n"
    "           tie_word_embeddings: true, vocab_size: 320}\n  init_std: 0.2\n";
const char* kMoe =
    "model:\n  config: {model_type: qwen3_next, hidden_size: 32, intermediate_size: 48, num_hidden_layers: 2,\n"
    "           layer_types: [linear_attention, full_attention], num_attention_heads: 2, num_key_value_heads: 1,\n"
    "           head_dim: 8, partial_rotary_factor: 0.5, rope_theta: 10000, linear_num_key_heads: 1,\n"
    "           linear_num_value_heads: 2, linear_key_head_dim: 8, linear_value_head_dim: 8,\n"
    "           linear_conv_kernel_dim: 4, num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 16,\n"
    "           shared_expert_intermediate_size: 16, router_aux_loss_coef: 0.01, output_router_logits: true,\n"
    "           tie_word_embeddings: true}\n  init_std: 0.2\n";

// Qwen3-MoE with four experts, the aux loss off (its value is reported, not trained: under ep it is the group's batch's,
// under one process each micro-batch's, so only with it off are the runs the same computation).
const char* kQwen3Moe =
    "model:\n  config: {model_type: qwen3_moe, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4,\n"
    "           num_key_value_heads: 2, head_dim: 8, num_experts: 4, num_experts_per_tok: 2,\n"
    "           moe_intermediate_size: 16, tie_word_embeddings: true, vocab_size: 320}\n  init_std: 0.2\n";

// A work folder with the tiny tokenizer, varied training text and a config of `model` (grad_accum 4, 8 steps).
fs::path setup(const std::string& name, const char* model, const std::string& extra = "") {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_dp_e2e_{}_{}", name, getpid());
  fs::remove_all(dir);
  fs::create_directories(dir / "tok");
  fs::copy_file(kTests / "data/fixtures/tiny_tokenizer.json", dir / "tok/tokenizer.json");
  std::ofstream data(dir / "train.jsonl");
  const char* words[] = {"the cat", "sat on", "a mat", "dogs run", "in parks", "hot sun", "green tea", "we like"};
  for (int i = 0; i < 80; ++i)
    data << nlohmann::json{{"text", fmt::format("{} {} {}", words[i % 8], words[(i * 3 + 1) % 8], std::string(size_t(i % 5), 'x'))}}.dump()
         << "\n";
  std::ofstream(dir / "config.yaml") << model << "  tokenizer: " << (dir / "tok").string() << "\n"
                                     << "data: {train: " << (dir / "train.jsonl").string()
                                     << ", format: text, max_seq_len: 48}\n"
                                     << "train: {max_steps: 8, micro_batch_tokens: 64, grad_accum: 4, lr: 0.01, seed: 7, "
                                        "save_every: 3, keep_last: 5}\n"
                                     << extra;
  return dir;
}

// `lathe train` of the folder's config into OUT, under mpirun with `np` ranks (np 0: one process, no launcher).
LatheRun train(const fs::path& dir, const std::string& out, int np, int grad_accum, const std::string& more = "",
               const std::string& env = "") {
  const std::string args = fmt::format("train {} --set output_dir={} --set train.grad_accum={}{}", (dir / "config.yaml").string(),
                                       (dir / out).string(), grad_accum, more);
  if (np == 0) return lathe_e2e::lathe(args, env);
  return lathe_e2e::lathe(args, env + " " + kMpirun + fmt::format(" -np {}", np));
}

using lathe::test_support::worst_rel_diff;
const auto weights = lathe::test_support::read_f32_tensors;

std::vector<double> grad_norms(const fs::path& out) {
  std::vector<double> g;
  for (const auto& r : lathe_e2e::metrics(out))
    if (r.contains("grad_norm")) g.push_back(r["grad_norm"].get<double>());
  return g;
}

void expect_same_curve(const std::vector<double>& got, const std::vector<double>& want, const std::string& what,
                       double tolerance = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tolerance * std::abs(want[i])) << what << ", step " << i + 1;
}

// `out` run (again: after a stop, at another layout) on `np` ranks: it ends well, its output says `said` ("resumed
// from", a re-cut's report, the layout), and its losses are on the `want` curve.
void expect_continues(const fs::path& dir, const std::string& out, int np, int accum, const std::string& extra,
                      const std::string& said, const std::vector<double>& want, const std::string& what) {
  const LatheRun r = train(dir, out, np, accum, extra);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(said), std::string::npos) << r.output;
  expect_same_curve(losses(dir / out), want, what);
}

// Run `out`'s gradient norms over the first three steps against the reference run's (DIR/ref), within 1e-4 relative:
// they check the scale of the summed gradients while the weights still agree to rounding.
void expect_same_first_grad_norms(const fs::path& dir, const std::string& out) {
  std::vector<double> got = grad_norms(dir / out), want = grad_norms(dir / "ref");
  got.resize(std::min<size_t>(got.size(), 3));
  want.resize(3);
  expect_same_curve(got, want, out + " gradient norm", 1e-4);
}

// The worst ||w - w_ref|| / ||w_ref|| over the tensors of run `out`'s `weights_file` (model.safetensors, or an
// adapter's adapter_model.safetensors) against the reference run's: {in the step-3 checkpoint, in the final folder},
// printed after `tag`.
std::pair<double, double> weight_diffs(const fs::path& dir, const std::string& out, const std::string& weights_file,
                                       const std::string& tag) {
  const fs::path step3 = fs::path("checkpoints/step-00000003") /
                         (weights_file == "model.safetensors" ? "model" : "adapter") / weights_file;
  const fs::path last = fs::path("final") / weights_file;
  const double d3 = worst_rel_diff(weights(dir / out / step3), weights(dir / "ref" / step3));
  const double d = worst_rel_diff(weights(dir / out / last), weights(dir / "ref" / last));
  std::printf("[%s] worst ||w - w_ref|| / ||w_ref|| over tensors: %.3g at step 3, %.3g at step 8\n", tag.c_str(), d3, d);
  return {d3, d};
}

// Run `out` of an adapter (np ranks, grad_accum `accum`, the overrides `sets`): it ends well, its loss curve is the
// reference run's (DIR/ref) and its adapter is within 1e-5 of the reference's at step 3 and at the end.
void expect_adapter_run_equals_reference(const fs::path& dir, const std::string& out, int np, int accum,
                                         const std::string& sets, const std::string& what) {
  const LatheRun r = train(dir, out, np, accum, sets);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_curve(losses(dir / out), losses(dir / "ref"), what);
  const auto [d3, d] = weight_diffs(dir, out, "adapter_model.safetensors", what);
  EXPECT_LT(d3, 1e-5);
  EXPECT_LT(d, 1e-5);
}

// `n` lines {"tokens": [...]} into `path`, line i of `length(i)` ids below 300.
void write_token_lines(const fs::path& path, int n, const std::function<int(int)>& length) {
  std::ofstream in(path);
  for (int i = 0; i < n; ++i) {
    nlohmann::json ids = nlohmann::json::array();
    for (int k = 0; k < length(i); ++k) ids.push_back((37 * i + 11 * k) % 300);
    in << nlohmann::json{{"tokens", ids}}.dump() << "\n";
  }
}

// `out`'s log-probs against `want`, line by line in input order, within f32 rounding of another batch composition.
// The folder's model trained two steps (DIR/model/final), nine token lines of 3 to 19 tokens (DIR/in.jsonl) and one
// process's log-probs of them into `want`, what a parallel `lathe logprobs` is held to; returns the arguments of such
// a run up to its --output (with --batch-tokens 24: several batches a rank).
std::string logprobs_reference(const fs::path& dir, std::vector<std::vector<double>>& want) {
  EXPECT_EQ(train(dir, "model", 0, 1, " --set train.max_steps=2").exit_code, 0);
  write_token_lines(dir / "in.jsonl", 9, [](int i) { return 3 + (7 * i) % 17; });
  const std::string args = fmt::format("logprobs --model {} --input {} --batch-tokens 24 --output ",
                                       (dir / "model/final").string(), (dir / "in.jsonl").string());
  EXPECT_EQ(lathe_e2e::lathe(args + (dir / "one.jsonl").string()).exit_code, 0);
  want = lathe_e2e::read_logprobs(dir / "one.jsonl");
  return args;
}

void expect_same_logprobs(const fs::path& out, const std::vector<std::vector<double>>& want, const std::string& what) {
  const auto got = lathe_e2e::read_logprobs(out);
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << "line " << i << " of " << what << ": out of order";
    for (size_t k = 0; k < want[i].size(); ++k) EXPECT_NEAR(got[i][k], want[i][k], 1e-5 * (1 + std::abs(want[i][k])));
  }
}

// One process with grad_accum 4 against dp = 2 (grad_accum 2) and dp = 4 (grad_accum 1): losses within 1e-5
// relative at every step, the step-3 checkpoint's weights within 1e-5 and the final weights within `final_tolerance`.
// The association of the gradient sums differs (each rank sums its micro-batches, then the ranks are summed), so the
// runs differ by rounding; AdamW's first steps move a weight by about lr whatever the size of its gradient, so where a
// gradient is near zero (an expert that got few tokens) that rounding grows, about 5x a step in the MoE config.
void expect_dp_equals_one_process(const char* model, const std::string& name, const std::string& weights_file,
                                  const std::string& extra = "", double final_tolerance = 1e-5) {
  const fs::path dir = setup(name, model, extra);
  const LatheRun ref = train(dir, "ref", 0, 4);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::vector<double> want = losses(dir / "ref");
  ASSERT_EQ(want.size(), 8u);
  EXPECT_LT(want.back(), want.front()) << "the reference did not learn";
  for (const auto& [np, accum] : {std::pair{2, 2}, std::pair{4, 1}}) {
    const std::string out = fmt::format("dp{}", np);
    const LatheRun r = train(dir, out, np, accum, kSmallBuckets);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_curve(losses(dir / out), want, out);
    for (const auto& row : lathe_e2e::metrics(dir / out))  // every rank's peak memory, in rank order
      if (row.contains("loss")) {
        ASSERT_TRUE(row.contains("memory_mib_ranks")) << row.dump();
        ASSERT_EQ(row["memory_mib_ranks"].size(), size_t(np)) << row.dump();
        for (const auto& mib : row["memory_mib_ranks"]) EXPECT_GT(mib.get<double>(), 0.0) << row.dump();
      }
    // The gradient norm checks the scale of the summed gradients (a missing 1/dp would double it), over the first
    // three steps, while the weights still agree to rounding (checked below). Gradients whose micro-batch parts cancel
    // lose digits to the other association of the sum (3e-5 relative on the hybrid's norm of 61 at step 1), hence 1e-4.
    expect_same_first_grad_norms(dir, out);
    const auto [d3, d] = weight_diffs(dir, out, weights_file, "dp " + name + " " + out);
    EXPECT_LT(d3, 1e-5) << out;
    EXPECT_LT(d, final_tolerance) << out;
  }
}

}  // namespace

TEST(DataParallel, Qwen3EqualsOneProcess) { expect_dp_equals_one_process(kQwen3, "qwen3", "model.safetensors"); }
TEST(DataParallel, Qwen35EqualsOneProcess) { expect_dp_equals_one_process(kQwen35, "qwen35", "model.safetensors"); }
TEST(DataParallel, MoeEqualsOneProcess) { expect_dp_equals_one_process(kMoe, "moe", "model.safetensors", "", 1e-4); }
TEST(DataParallel, LoraEqualsOneProcess) {
  expect_dp_equals_one_process(kQwen3, "lora", "adapter_model.safetensors", "lora: {rank: 4, alpha: 8}\n");
}

// Tensor parallelism of the dense Qwen3 (parallel.tp = 2: each rank holds two of the four heads, one of the two
// key/value heads and half the MLP): one process with grad_accum 4 against tp = 2 (grad_accum 4), tp = 2 x dp = 2
// (grad_accum 2) and tp = 4 (one query head a rank, each key/value head held by two ranks whose k/v gradients are
// summed; fails without that sum): losses within 1e-5 relative at every step, the first three gradient norms within
// 1e-4 (the slices' sums of squares summed over the group, a shared slice counted once), the step-3 checkpoint's and
// the final weights within 1e-5 (2e-5 at tp 4; gathered from the slices); tp 4's step-3 checkpoint resumes at tp 2. Then tp = 2 dies after step 4 and its step-3 checkpoint (each tp rank's optimizer state in its own file)
// resumes at tp = 2 x dp = 2 and at tp = 1 (the state re-cut), and a one-process checkpoint resumes at tp = 2, all on
// the same curve.
TEST(TensorParallel, Qwen3EqualsOneProcessAndResumes) {
  const fs::path dir = setup("tp", kQwen3);
  const LatheRun ref = train(dir, "ref", 0, 4);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::vector<double> want = losses(dir / "ref");
  for (const auto& [np, accum, tp] : {std::tuple{2, 4, 2}, std::tuple{4, 2, 2}, std::tuple{4, 4, 4}}) {
    const std::string out = fmt::format("tp{}_np{}", tp, np);
    const LatheRun r = train(dir, out, np, accum, fmt::format(" --set parallel.tp={}", tp) + kSmallBuckets);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("parallel: tp={} cp=1 ep=1 dp={} pp=1 (world {}); each rank {} of the 4 attention "
                                        "heads", tp, np / tp, np, 4 / tp)), std::string::npos) << r.output;
    expect_same_curve(losses(dir / out), want, out);
    expect_same_first_grad_norms(dir, out);
    const auto [d3, d] = weight_diffs(dir, out, "model.safetensors", "tp " + out);
    // tp 4 sums each key/value head's gradient from two ranks' parts: another f32 association (7.6e-6 measured at
    // step 3), hence 2e-5 there.
    EXPECT_LT(d3, tp == 4 ? 2e-5 : 1e-5) << out;
    EXPECT_LT(d, tp == 4 ? 2e-5 : 1e-5) << out;
    for (int rank = 0; rank < tp; ++rank)
      EXPECT_TRUE(fs::exists(dir / out / fmt::format("checkpoints/step-00000003/optimizer.tp-{}-of-{}.safetensors", rank, tp)));
  }
  // tp 4 over the two key/value heads (each held by two ranks, their k/v gradients summed) resumed at tp 2.
  fs::copy(dir / "tp4_np4", dir / "tp4_to_2", fs::copy_options::recursive);
  for (const auto& e : fs::directory_iterator(dir / "tp4_to_2/checkpoints"))
    if (e.path().filename() != "step-00000003") fs::remove_all(e.path());
  fs::remove_all(dir / "tp4_to_2/final");
  expect_continues(dir, "tp4_to_2", 2, 4, " --set parallel.tp=2", "was saved at tp 4; re-cut for tp 2",
                   want, "tp 4 -> tp 2");
  // Killed after step 4 at tp 2; its step-3 checkpoint resumed at tp 2 x dp 2 and, re-cut, at tp 1.
  const LatheRun killed = train(dir, "run", 2, 4, " --set parallel.tp=2", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(killed.exit_code, 0);
  fs::copy(dir / "run", dir / "run_tp1", fs::copy_options::recursive);
  expect_continues(dir, "run", 4, 2, " --set parallel.tp=2", "resumed from", want, "tp 2 -> tp 2 x dp 2");
  expect_continues(dir, "run_tp1", 0, 4, "", "was saved at tp 2; re-cut for tp 1", want, "tp 2 -> tp 1");
  // The other way: one process killed after step 4, resumed at tp 2 (its whole optimizer state cut into slices).
  const LatheRun one = train(dir, "one", 0, 4, "", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(one.exit_code, 0);
  expect_continues(dir, "one", 2, 4, " --set parallel.tp=2", "was saved at tp 1; re-cut for tp 2",
                   want, "tp 1 -> tp 2");
}

// The Qwen3.5 hybrid at tp 2 (Gated DeltaNet split by key heads with their value heads; in_proj_qkv and the conv in
// three sections) equals one process; killed after step 4, its step-3 checkpoint re-cut for tp 1 continues on the
// same curve (the optimizer state's sectioned slices put back together). At lr 0.002: at 0.01 (with the tokenizer's
// 305-row vocabulary) the gradient norm jumped to 17 at step 2 and runs drifted apart from rounding alone, dp 2 as
// much as tp 2 (AdamW's first steps move a weight by about lr whatever its gradient, so in_proj_a's near-zero
// gradients turned f32 rounding into 3e-4 relative moves). Measured here: 6.8e-6 at step 3, 8.7e-6 at step 8.
TEST(TensorParallel, Qwen35EqualsOneProcessAndResumesAtAnotherTp) {
  const fs::path dir = setup("tp35", kQwen35Tp);
  const std::string lr = " --set train.lr=0.002";
  const LatheRun ref = train(dir, "ref", 0, 4, lr);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::vector<double> want = losses(dir / "ref");
  const LatheRun r = train(dir, "tp2", 2, 4, lr + " --set parallel.tp=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_curve(losses(dir / "tp2"), want, "tp 2");
  expect_same_first_grad_norms(dir, "tp2");
  const auto [d3, d] = weight_diffs(dir, "tp2", "model.safetensors", "tp qwen3.5 tp2");
  EXPECT_LT(d3, 2e-5);
  EXPECT_LT(d, 2e-5);
  const LatheRun killed = train(dir, "run", 2, 4, lr + " --set parallel.tp=2", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(killed.exit_code, 0);
  expect_continues(dir, "run", 0, 4, lr, "was saved at tp 2; re-cut for tp 1", want, "qwen3.5 tp 2 -> tp 1");
}

// Sequence parallelism at tp 2 (the stream between the blocks split by tokens; micro-batches of 64 tokens at most,
// odd lengths padded) equals one process, full fine-tuning and LoRA.
TEST(TensorParallel, SequenceParallelEqualsOneProcess) {
  for (const std::string extra : {"", "lora: {rank: 4, alpha: 8}\n"}) {
    const fs::path dir = setup(extra.empty() ? "sp" : "splora", kQwen3, extra);
    const LatheRun ref = train(dir, "ref", 0, 4);
    ASSERT_EQ(ref.exit_code, 0) << ref.output;
    const LatheRun r = train(dir, "sp", 2, 4, " --set parallel.tp=2 --set parallel.sp=true");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("; sequence parallel"), std::string::npos) << r.output;
    expect_same_curve(losses(dir / "sp"), losses(dir / "ref"), "tp 2 with sp " + extra);
  }
}

// Context parallelism (each rank its rows of every micro-batch, attention by a head all-to-all, the gradients summed
// over the cp group) at cp 2 and cp 2 x dp 2 equals one process: losses within 1e-5 relative, weights at steps 3
// and 8 within 1e-5; tp 2 x cp 2 with sp on the same curve; killed after step 4 at cp 2, resumed on the same curve;
// the Qwen3.5 hybrid at cp 2 (Gated DeltaNet too) on one process's loss curve.
TEST(ContextParallel, Qwen3EqualsOneProcessAndResumes) {
  const fs::path dir = setup("cp", kQwen3);
  const LatheRun ref = train(dir, "ref", 0, 4);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::vector<double> want = losses(dir / "ref");
  for (const auto& [np, accum] : {std::pair{2, 4}, std::pair{4, 2}}) {
    const std::string out = fmt::format("cp2_np{}", np);
    const LatheRun r = train(dir, out, np, accum, " --set parallel.cp=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("parallel: tp=1 cp=2 ep=1 dp={}", np / 2)), std::string::npos) << r.output;
    expect_same_curve(losses(dir / out), want, out);
    const auto [d3, d] = weight_diffs(dir, out, "model.safetensors", "cp " + out);
    EXPECT_LT(d3, 1e-5) << out;
    EXPECT_LT(d, 1e-5) << out;
  }
  // tp 2 x cp 2 with sequence parallelism: each cp rank's rows split again over its tp group between the blocks.
  expect_continues(dir, "tp2cp2sp", 4, 4, " --set parallel.tp=2 --set parallel.cp=2 --set parallel.sp=true",
                   "parallel: tp=2 cp=2 ep=1 dp=1", want, "tp 2 x cp 2 with sp");
  const LatheRun killed = train(dir, "run", 2, 4, " --set parallel.cp=2", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(killed.exit_code, 0);
  expect_continues(dir, "run", 2, 4, " --set parallel.cp=2", "resumed from", want, "cp 2 resumed");
  // The Qwen3.5 hybrid at cp 2: Gated DeltaNet over whole documents by the head all-to-all (lr 0.002, as the tp test).
  const fs::path hybrid = setup("cp35", kQwen35Tp);
  const std::string lr = " --set train.lr=0.002";
  ASSERT_EQ(train(hybrid, "ref", 0, 4, lr).exit_code, 0);
  const LatheRun r35 = train(hybrid, "cp2", 2, 4, lr + " --set parallel.cp=2");
  ASSERT_EQ(r35.exit_code, 0) << r35.output;
  expect_same_curve(losses(hybrid / "cp2"), losses(hybrid / "ref"), "qwen3.5 cp 2");
}

// Context parallelism with mixture-of-experts layers (each rank routes its rows; the aux loss from the routing totals
// summed over the group) and with LoRA (each rank's rows see the segments from its first row; the adapters' gradients
// summed over the group): `lathe train` at cp 2 on one process's loss curve, and the adapters at steps 3 and 8 within
// 1e-5.
TEST(ContextParallel, MoeAndLoraEqualOneProcess) {
  const fs::path moe = setup("cpmoe", kQwen35MoeCp);
  const std::string lr = " --set train.lr=0.002";
  const LatheRun moe_ref = train(moe, "ref", 0, 4, lr);
  ASSERT_EQ(moe_ref.exit_code, 0) << moe_ref.output;
  const LatheRun moe_cp = train(moe, "cp2", 2, 4, lr + " --set parallel.cp=2");
  ASSERT_EQ(moe_cp.exit_code, 0) << moe_cp.output;
  expect_same_curve(losses(moe / "cp2"), losses(moe / "ref"), "moe cp 2");
  ASSERT_EQ(losses(moe / "ref", "aux_loss").size(), 8u);
  expect_same_curve(losses(moe / "cp2", "aux_loss"), losses(moe / "ref", "aux_loss"), "moe cp 2, aux loss");
  expect_same_first_grad_norms(moe, "cp2");  // the aux term's gradient at the batch's scale (fails at half of it)
  const fs::path lora = setup("cplora", kQwen3, "lora: {rank: 4, alpha: 8}\n");
  ASSERT_EQ(train(lora, "ref", 0, 4).exit_code, 0);
  expect_adapter_run_equals_reference(lora, "cp2", 2, 4, " --set parallel.cp=2", "cp lora");
}

// ZeRO under context parallelism: the optimizer state cut over the dp x cp ranks of one tp slot (the ranks that hold
// the same weights; the gradients reduced and scattered over them, Megatron's dp_cp group) at cp 2 (ZeRO-1 and
// ZeRO-2) and cp 2 x dp 2 (ZeRO-1, four shards) on the one-process loss curve with the weights at steps 3 and 8 within
// 1e-5; killed after step 4 at cp 2 x dp 2 and resumed at cp 2 (the four shards re-cut into two) on the same curve.
TEST(ContextParallel, ZeroCutsTheStateOverDpAndCp) {
  const fs::path dir = setup("cpzero", kQwen3);
  ASSERT_EQ(train(dir, "ref", 0, 4).exit_code, 0);
  const std::vector<double> want = losses(dir / "ref");
  for (const auto& [np, accum, zero] : {std::tuple{2, 4, 1}, {2, 4, 2}, {4, 2, 1}}) {
    const std::string out = fmt::format("cp2_np{}_zero{}", np, zero);
    const std::string layout = fmt::format(" --set parallel.cp=2 --set parallel.zero={}", zero);
    const LatheRun r = train(dir, out, np, accum, layout + kSmallBuckets);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_curve(losses(dir / out), want, out);
    const auto [d3, d] = weight_diffs(dir, out, "model.safetensors", "cp zero " + out);
    EXPECT_LT(d3, 1e-5) << out;
    EXPECT_LT(d, 1e-5) << out;
    EXPECT_TRUE(fs::exists(dir / out / fmt::format("checkpoints/step-00000003/optimizer.rank-0-of-{}.safetensors", np)))
        << out;
  }
  EXPECT_NE(train(dir, "run", 4, 2, " --set parallel.cp=2 --set parallel.zero=1", "LATHE_FAULT_INJECT=after_step:4").exit_code, 0);
  expect_continues(dir, "run", 2, 4, " --set parallel.cp=2 --set parallel.zero=1", "resumed from",
                   want, "cp 2 x dp 2 ZeRO-1 resumed at cp 2");
}

namespace {

// Into ZeRO at `layout` (`np` ranks, grad_accum `accum`): one process's run and a dp 2 ZeRO-1 run, each killed after
// step 4, resume there (the whole state, or the shards assembled whole, cut into the layout's tensors and then into
// pieces) on the `want` curve.
void expect_whole_and_zero_states_resume_at(const fs::path& dir, int np, int accum, const std::string& layout,
                                            const std::vector<double>& want, const std::string& what) {
  EXPECT_NE(train(dir, "one", 0, 4, "", "LATHE_FAULT_INJECT=after_step:4").exit_code, 0);
  expect_continues(dir, "one", np, accum, layout, "was saved whole; re-cut for this run's layout", want,
                   "one process -> " + what);
  EXPECT_NE(train(dir, "dp2", 2, 2, " --set parallel.zero=1", "LATHE_FAULT_INJECT=after_step:4").exit_code, 0);
  expect_continues(dir, "dp2", np, accum, layout, "was saved in ZeRO shards over dp = 2; re-cut for this run's layout",
                   want, "dp 2 ZeRO-1 -> " + what);
}

// Run `out` against the reference run (DIR/ref): its loss curve within 1e-5, its first gradient norms within 1e-4 and
// its weights at steps 3 and 8 within `tolerance` (printed after `tag`).
void expect_equals_reference(const fs::path& dir, const std::string& out, const std::string& tag,
                             double tolerance = 1e-5) {
  expect_same_curve(losses(dir / out), losses(dir / "ref"), out);
  expect_same_first_grad_norms(dir, out);
  const auto [d3, d] = weight_diffs(dir, out, "model.safetensors", tag);
  EXPECT_LT(d3, tolerance) << out;
  EXPECT_LT(d, tolerance) << out;
}

// Each step's expert loads (metrics.jsonl's expert_load) of run folder `out`.
std::vector<nlohmann::json> expert_loads(const fs::path& out) {
  std::vector<nlohmann::json> l;
  for (const auto& row : lathe_e2e::metrics(out))
    if (row.contains("expert_load")) l.push_back(row["expert_load"]);
  return l;
}

// Qwen3 with one key/value head for its four query heads: at tp 2 both ranks hold the whole k/v slice (replicas 2),
// each rank's gradient of it the part from its own query heads, summed over the two.
const char* kQwen3Mqa =
    "model:\n  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,\n"
    "           num_key_value_heads: 1, head_dim: 8, tie_word_embeddings: true, vocab_size: 320}\n";

// The ZeRO shards of a tp x (dp x cp) run: for each of the `tp` slots, `ranks` files.
void expect_tp_zero_shards(const fs::path& ckpt, int tp, int ranks) {
  for (int t = 0; t < tp; ++t)
    for (int r = 0; r < ranks; ++r)
      EXPECT_TRUE(fs::exists(ckpt / fmt::format("optimizer.tp-{}-of-{}.rank-{}-of-{}.safetensors", t, tp, r, ranks)))
          << ckpt << " tp " << t << " rank " << r;
  EXPECT_FALSE(fs::exists(ckpt / fmt::format("optimizer.tp-0-of-{}.safetensors", tp))) << ckpt;
}

}  // namespace

// ZeRO under tensor parallelism: each tp slot's slices (and whole tensors) cut over the dp (x cp) ranks that hold
// them, the gradient norm summed over the pieces and the slots, a shared k/v slice's pieces summed over its replicas.
// tp 2 x dp 2 with ZeRO-1, ZeRO-2 and ZeRO-1 under sp against the same layout without ZeRO (the same tolerances as
// DataParallel.ZeroEqualsPlainDataParallelAndShardsTheOptimizerState: the gradients are the same sums, only the
// norm's is associated otherwise, and ZeRO-2 sums the micro-batches after the ranks), and against one process (losses
// 1e-5, first gradient norms 1e-4, weights 1e-5 at steps 3 and 8); tp 2 x cp 2 with sp and ZeRO-2 against one
// process; the MQA model (its one k/v head held by both tp ranks) likewise at tp 2 x dp 2 with ZeRO-1 (fails without
// the replicas' sum of the pieces).
TEST(TensorParallel, ZeroCutsEachSliceOverItsReplicas) {
  for (const auto& [name, model] : {std::pair{"gqa", kQwen3}, std::pair{"mqa", kQwen3Mqa}}) {
    const fs::path dir = setup(std::string("tpzero_") + name, model);
    ASSERT_EQ(train(dir, "ref", 0, 4).exit_code, 0);
    const std::string tp2 = " --set parallel.tp=2" + kSmallBuckets;
    ASSERT_EQ(train(dir, "plain", 4, 2, tp2).exit_code, 0);
    weight_diffs(dir, "plain", "model.safetensors", std::string("tp 2 x dp 2 without ZeRO ") + name);
    struct Layout { std::string out, sets; int accum, zero; bool over_dp; };
    std::vector<Layout> layouts = {{"zero1", " --set parallel.zero=1", 2, 1, true}};
    if (std::string(name) == "gqa")
      layouts.insert(layouts.end(), {{"zero2", " --set parallel.zero=2", 2, 2, true},
                                     {"zero1_sp", " --set parallel.zero=1 --set parallel.sp=true", 2, 1, true},
                                     {"cp2_zero2_sp",
                                      " --set parallel.zero=2 --set parallel.sp=true --set parallel.cp=2", 4, 2,
                                      false}});
    for (const Layout& l : layouts) {
      const std::string out = l.out;
      const LatheRun r = train(dir, out, 4, l.accum, tp2 + l.sets);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      // The shared k/v head's gradient is summed from two ranks' parts: another f32 association than one process's,
      // as at tp 4 in TensorParallel.Qwen3EqualsOneProcessAndResumes (the same 2e-5; plain tp 2 x dp 2 is as far).
      expect_equals_reference(dir, out, std::string("tp zero ") + name + " " + out,
                              std::string(name) == "mqa" ? 2e-5 : 1e-5);
      expect_tp_zero_shards(dir / out / "checkpoints/step-00000003", 2, 2);
      if (!l.over_dp) continue;
      const double tol = l.zero == 1 ? 1e-7 : 1e-6;  // ZeRO-2 at grad_accum 2: the micro-batches summed after the ranks
      expect_same_curve(losses(dir / out), losses(dir / "plain"), std::string(name) + " " + out + " vs plain", tol);
      expect_same_curve(grad_norms(dir / out), grad_norms(dir / "plain"), out + " gradient norm vs plain", tol);
      const double dp = worst_rel_diff(weights(dir / out / "final/model.safetensors"),
                                       weights(dir / "plain/final/model.safetensors"));
      std::printf("[tp zero] %s %s: worst ||w - w_plain|| / ||w_plain|| %.3g\n", name, out.c_str(), dp);
      EXPECT_LT(dp, l.zero == 1 ? 1e-6 : 1e-5) << out;
    }
  }
}

// A ZeRO checkpoint of tp 2 x dp 2 (killed after step 4, checkpoint at 3) resumes at its layout (read as it is), at
// tp 2 without ZeRO and at tp 2 x cp 2 with ZeRO-2 and other buckets (each tp slot's shards re-cut), and at tp 1 and
// tp 4 (each slot's shards assembled into its whole slices, then cut), all on one process's curve. Into ZeRO under
// tp: one process's whole state and a ZeRO checkpoint of dp 2 (tp 1) each resume at tp 2 x dp 2 with ZeRO-1 (cut into
// slices, then into pieces).
TEST(TensorParallel, ZeroCheckpointsResumeAtTheirTpAndIntoIt) {
  const fs::path dir = setup("tpzero_resume", kQwen3);
  ASSERT_EQ(train(dir, "ref", 0, 4).exit_code, 0);
  const std::vector<double> want = losses(dir / "ref");
  const std::string tp2_zero1 = " --set parallel.tp=2 --set parallel.zero=1";
  EXPECT_NE(train(dir, "run", 4, 2, tp2_zero1, "LATHE_FAULT_INJECT=after_step:4").exit_code, 0);
  for (const char* copy : {"tp2", "cp2", "tp1", "tp4"}) fs::copy(dir / "run", dir / copy, fs::copy_options::recursive);
  const LatheRun same = train(dir, "run", 4, 2, tp2_zero1);
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NE(same.output.find("resumed from"), std::string::npos) << same.output;
  EXPECT_EQ(same.output.find("re-cut"), std::string::npos) << "the same layout is read as it is";
  expect_same_curve(losses(dir / "run"), want, "tp 2 x dp 2 ZeRO-1 resumed at its layout");
  expect_continues(dir, "tp2", 2, 4, " --set parallel.tp=2",
                   "re-cut for this run's layout (parallel.tp = 2, without ZeRO)", want, "tp 2 x dp 2 ZeRO-1 -> tp 2");
  expect_continues(dir, "cp2", 4, 4, " --set parallel.tp=2 --set parallel.cp=2 --set parallel.zero=2" + kSmallBuckets,
                   "re-cut for this run's layout (parallel.tp = 2, ZeRO shards over 2 ranks)", want,
                   "tp 2 x dp 2 ZeRO-1 -> tp 2 x cp 2 ZeRO-2");
  // Another tp: each old tp slot's shards assembled into its whole slices, then cut for this run.
  expect_continues(dir, "tp1", 0, 4, "", "re-cut for this run's layout (parallel.tp = 1, without ZeRO)", want,
                   "tp 2 x dp 2 ZeRO-1 -> one process");
  expect_continues(dir, "tp4", 4, 4, " --set parallel.tp=4", "re-cut for this run's layout (parallel.tp = 4, without ZeRO)",
                   want, "tp 2 x dp 2 ZeRO-1 -> tp 4");
  expect_whole_and_zero_states_resume_at(dir, 4, 2, tp2_zero1, want, "tp 2 x dp 2 ZeRO-1");
}

// LoRA at tp 2 and tp 2 x dp 2 (each adapter matrix split as its base weight; the whole matrices' gradient parts
// summed over the group) equals one process: losses within 1e-5 relative, the adapters' weights at steps 3 and 8;
// killed after step 4 at tp 2, resumed at tp 2 x dp 2 on the same curve; `lathe logprobs --adapter --tp 2` scores
// as one process.
// Expert parallelism in `lathe train` (docs/moe.md, "Expert parallelism"): ep 2 on 2 ranks (grad_accum 2), ep 4 on 4
// (grad_accum 1), ep 2 x edp 2 on 4 (each expert's gradient summed over its two holders) and tp 2 x ep 2 on 4
// (grad_accum 2) against one process with grad_accum 4: losses within 1e-5 and the expert loads equal at every step,
// weights within 1e-5; each rank of the ep (or tp x ep) group writes its slices' optimizer state. Killed after step 4 at
// ep 2, the run continues on the same curve at ep 2, and its state re-cut at ep 4, at tp 2 x ep 2 and for one process.
TEST(ExpertParallel, EqualsOneProcessAndResumesAtAnotherEp) {
  const fs::path dir = setup("ep", kQwen3Moe);
  const LatheRun ref = train(dir, "ref", 0, 4);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::vector<double> want = losses(dir / "ref");
  const auto loads = expert_loads;
  for (const auto& [np, accum, ep, tp] :
       {std::tuple{2, 2, 2, 1}, std::tuple{4, 1, 4, 1}, std::tuple{4, 1, 2, 1}, std::tuple{4, 2, 2, 2}}) {
    const std::string out = fmt::format("ep{}_tp{}_np{}", ep, tp, np);
    const LatheRun r = train(dir, out, np, accum, fmt::format(" --set parallel.ep={} --set parallel.tp={}", ep, tp) +
                                                      kSmallBuckets);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("parallel: tp={} cp=1 ep={} dp={} pp=1 (world {})", tp, ep, np / tp, np)),
              std::string::npos) << r.output;
    expect_same_curve(losses(dir / out), want, out);
    EXPECT_EQ(loads(dir / out), loads(dir / "ref")) << out;
    expect_same_first_grad_norms(dir, out);
    const auto [d3, d] = weight_diffs(dir, out, "model.safetensors", "ep " + out);
    EXPECT_LT(d3, 1e-5) << out;
    EXPECT_LT(d, 1e-5) << out;
    const std::string kind = tp > 1 ? "tp-ep" : "ep";  // each rank of the tp x ep group its slices' state
    for (int rank = 0; rank < tp * ep; ++rank)
      EXPECT_TRUE(fs::exists(dir / out / fmt::format("checkpoints/step-00000003/optimizer.{}-{}-of-{}.safetensors", kind,
                                                     rank, tp * ep)));
  }
  const LatheRun killed = train(dir, "run", 2, 2, " --set parallel.ep=2", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(killed.exit_code, 0);
  fs::copy(dir / "run", dir / "run_ep4", fs::copy_options::recursive);
  fs::copy(dir / "run", dir / "run_one", fs::copy_options::recursive);
  fs::copy(dir / "run", dir / "run_tp2", fs::copy_options::recursive);
  expect_continues(dir, "run", 2, 2, " --set parallel.ep=2", "resumed from", want, "ep 2 -> ep 2");
  expect_continues(dir, "run_ep4", 4, 1, " --set parallel.ep=4", "was saved at ep 2; re-cut for ep 4", want, "ep 2 -> ep 4");
  expect_continues(dir, "run_one", 0, 4, "", "was saved at ep 2; re-cut for ep 1", want, "ep 2 -> one process");
  expect_continues(dir, "run_tp2", 4, 2, " --set parallel.ep=2 --set parallel.tp=2", "was saved at ep 2; re-cut for tp-ep 4",
                   want, "ep 2 -> tp 2 x ep 2");
}

// LoRA with the experts' fused parameters among its targets, at ep 2: the adapters' loss curve and weights equal one
// process's (each rank's expert adapters used at its experts, their gradients summed over the ranks).
TEST(ExpertParallel, LoraOnTheExpertsEqualsOneProcess) {
  const fs::path dir = setup("ep_lora", kQwen3Moe);
  const std::string lora = " --set lora.rank=4 --set lora.alpha=8 "
                           "--set lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]";
  ASSERT_EQ(train(dir, "ref", 0, 4, lora).exit_code, 0);
  expect_adapter_run_equals_reference(dir, "ep2", 2, 2, " --set parallel.ep=2 --set parallel.timeout_s=60" + lora,
                                      "ep lora");
}

// `lathe logprobs --ep 2` (-np 2, -np 4 as two ep groups, and -np 4 as tp 2 x ep 2) scores as one process: each ep
// rank its lines, the experts split; with --batch-tokens 24 the ranks pack different numbers of batches, so the ones
// with fewer run fillers.
TEST(ExpertParallel, LogprobsEqualOneProcess) {
  const fs::path dir = setup("ep_logprobs", kQwen3Moe);
  std::vector<std::vector<double>> want;
  const std::string args = logprobs_reference(dir, want);
  ASSERT_EQ(want.size(), 9u);
  for (const auto& [np, tp] : {std::pair{2, 1}, std::pair{4, 1}, std::pair{4, 2}}) {
    const fs::path out = dir / fmt::format("ep2_tp{}_np{}.jsonl", tp, np);
    const LatheRun r = lathe_e2e::lathe(args + out.string() + fmt::format(" --ep 2 --tp {}", tp),
                                        kMpirun + fmt::format(" -np {}", np));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("9 lines scored with {} on cpu (f32), {} ranks{}, ep 2",
                                        (dir / "model/final").string(), np, tp > 1 ? ", tp 2" : "")),
              std::string::npos) << r.output;
    expect_same_logprobs(out, want, fmt::format("{} ranks at ep 2, tp {}", np, tp));
  }
}

// A rank that fails while the others wait for it in a collective ends the job at once with its error (run_as_rank's
// MPI_Abort while MPI is still up), not at the 600 s collective timeout nor in an MPI_Finalize that waits for ranks
// that wait for it: rank 1 of `lathe logprobs --ep 2` fails after loading, rank 0 goes on to its first exchange.
TEST(ExpertParallel, AFailingRankEndsTheJobWithItsError) {
  const fs::path dir = setup("ep_fail", kQwen3Moe);
  std::vector<std::vector<double>> want;
  const std::string args = logprobs_reference(dir, want);
  const auto t0 = std::chrono::steady_clock::now();
  const LatheRun r = lathe_e2e::lathe(args + (dir / "ep2.jsonl").string() + " --ep 2",
                                      "LATHE_FAULT_INJECT=logprobs_rank_error:1 " + kMpirun + " -np 2");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("lathe: error: rank 1: logprobs: rank 1 failed (LATHE_FAULT_INJECT)"), std::string::npos)
      << r.output;
  EXPECT_LT(seconds, 120) << r.output;
  EXPECT_FALSE(fs::exists(dir / "ep2.jsonl"));
}

// `lathe generate --ep 2` (greedy, one sequence at a time) equals one process: rank 0 has three lines and rank 1 two,
// so rank 1 runs out of work first and keeps stepping with filler forwards while rank 0 still routes rows to its
// experts (without them the ranks' collectives part ways and the job fails).
TEST(ExpertParallel, GenerateEqualsOneProcess) {
  const fs::path dir = setup("ep_generate", kQwen3Moe);
  ASSERT_EQ(train(dir, "model", 0, 1, " --set train.max_steps=2").exit_code, 0);
  write_token_lines(dir / "in.jsonl", 5, [](int i) { return 3 + 4 * i; });
  const std::string args = fmt::format("generate --model {} --input {} --max-new-tokens 8 --ignore-eos --max-running 1 "
                                       "--output ", (dir / "model/final").string(), (dir / "in.jsonl").string());
  ASSERT_EQ(lathe_e2e::lathe(args + (dir / "one.jsonl").string()).exit_code, 0);
  const LatheRun r = lathe_e2e::lathe(args + (dir / "ep2.jsonl").string() + " --ep 2", kMpirun + " -np 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto rows = [](const fs::path& file) {
    std::vector<nlohmann::json> out;
    std::ifstream f(file);
    for (std::string line; std::getline(f, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  };
  const std::vector<nlohmann::json> want = rows(dir / "one.jsonl"), got = rows(dir / "ep2.jsonl");
  ASSERT_EQ(got.size(), 5u);
  ASSERT_EQ(want.size(), 5u);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i]["tokens"], want[i]["tokens"]) << "line " << i;
    const auto a = got[i]["logprobs"].get<std::vector<double>>(), b = want[i]["logprobs"].get<std::vector<double>>();
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) EXPECT_NEAR(a[k], b[k], 1e-5 * (1 + std::abs(b[k]))) << "line " << i;
  }
}

// Layouts expert parallelism does not compose with yet are refused before any weight is loaded, by name.
// Expert parallelism over context-parallel ranks (ep a multiple of cp: each expert group holds whole cp groups), on
// the Qwen3.5-MoE hybrid with the aux loss on: cp 2 x ep 2 (the two cp ranks of one batch split the experts) and
// cp 2 x ep 2 x dp 2 against one process — losses and aux losses within 1e-5 (the group's totals are the batch's), loads
// equal, first gradient norms 1e-4, weights 2e-5 at steps 3 and 8 (each token's expert outputs are summed per rank
// and then over the ranks, a different f32 order than one process's: 1.0e-5 measured); killed at cp 2 x ep 2 and
// resumed for one process
// on the same curve; LoRA on the experts at cp 2 x ep 2 likewise. cp 2 x ep 4 (an expert group over two batches) on
// the curve of one process with the aux loss off.
TEST(ExpertParallel, OverContextParallelRanksEqualsOneProcess) {
  const fs::path dir = setup("ep_cp", kQwen35MoeCp);
  const std::string lr = " --set train.lr=0.002 --set parallel.timeout_s=60";
  ASSERT_EQ(train(dir, "ref", 0, 4, lr).exit_code, 0);
  const std::vector<double> want = losses(dir / "ref"), want_aux = losses(dir / "ref", "aux_loss");
  ASSERT_EQ(want_aux.size(), 8u);
  const auto loads = expert_loads;
  for (const auto& [np, accum] : {std::pair{2, 4}, std::pair{4, 2}}) {
    const std::string out = fmt::format("cp2_ep2_np{}", np);
    const LatheRun r = train(dir, out, np, accum, lr + " --set parallel.cp=2 --set parallel.ep=2" + kSmallBuckets);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("parallel: tp=1 cp=2 ep=2 dp={} pp=1 (world {})", np / 2, np)),
              std::string::npos) << r.output;
    expect_same_curve(losses(dir / out), want, out);
    expect_same_curve(losses(dir / out, "aux_loss"), want_aux, out + " aux loss");
    EXPECT_EQ(loads(dir / out), loads(dir / "ref")) << out;
    expect_same_first_grad_norms(dir, out);
    const auto [d3, d] = weight_diffs(dir, out, "model.safetensors", "cp ep " + out);
    EXPECT_LT(d3, 2e-5) << out;
    EXPECT_LT(d, 2e-5) << out;
  }
  EXPECT_NE(train(dir, "run", 2, 4, lr + " --set parallel.cp=2 --set parallel.ep=2", "LATHE_FAULT_INJECT=after_step:4")
                .exit_code, 0);
  expect_continues(dir, "run", 0, 4, lr, "was saved at ep 2; re-cut for ep 1", want, "cp 2 x ep 2 -> one process");
  const std::string off = lr + " --set train.router_aux_loss=off";
  ASSERT_EQ(train(dir, "ref_off", 0, 4, off).exit_code, 0);
  const LatheRun wide = train(dir, "cp2_ep4", 4, 2, off + " --set parallel.cp=2 --set parallel.ep=4");
  ASSERT_EQ(wide.exit_code, 0) << wide.output;
  expect_same_curve(losses(dir / "cp2_ep4"), losses(dir / "ref_off"), "cp 2 x ep 4, aux off");
  const fs::path lora = setup("ep_cp_lora", kQwen35MoeCp);
  const std::string adapter = lr + " --set lora.rank=4 --set lora.alpha=8 "
                              "--set lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]";
  ASSERT_EQ(train(lora, "ref", 0, 4, adapter).exit_code, 0);
  const LatheRun tuned = train(lora, "cp2_ep2", 2, 4, adapter + " --set parallel.cp=2 --set parallel.ep=2");
  ASSERT_EQ(tuned.exit_code, 0) << tuned.output;
  expect_same_curve(losses(lora / "cp2_ep2"), losses(lora / "ref"), "cp ep lora");
  expect_same_first_grad_norms(lora, "cp2_ep2");
  // (The adapters' B matrices start at zero and some get gradients near zero, whose rounding AdamW's first steps
  // amplify, as for the MoE weights of DataParallel.MoeEqualsOneProcess: measured 3.6e-5 and 7.2e-5.)
  const auto [d3, d] = weight_diffs(lora, "cp2_ep2", "adapter_model.safetensors", "cp ep lora");
  EXPECT_LT(d3, 2e-4);
  EXPECT_LT(d, 2e-4);
}

// ZeRO under expert parallelism: the dense parameters cut over the dp (x cp) ranks as without ep, each rank's experts
// cut over the edp ranks that hold the same ones (a second group of buckets, reduce-scattered and gathered over edp),
// the gradient norm every piece's squares summed once over the dp x cp ranks (= ep x edp). ep 2 (2 ranks, edp 1) with
// ZeRO-1 and ZeRO-2, tp 2 x ep 2 and ep 4 (4 ranks, edp 1), ep 2 over cp 2 (2 ranks) and ep 2 over dp 4 (edp 2) with
// ZeRO-1 and ZeRO-2, against the same layouts without ZeRO (the tolerances of
// DataParallel.ZeroEqualsPlainDataParallelAndShardsTheOptimizerState) and one process (losses 1e-5, expert loads
// equal, first gradient norms 1e-4, weights 1e-5 at steps 3 and 8). Killed after step 4 at ep 2 with ZeRO-1, it
// resumes at its layout (read as it is); at ep 2 without ZeRO it is refused naming both layouts; one process's
// checkpoint and a dp 2 ZeRO-1 one (no ep) each resume at ep 2 with ZeRO-1, on one process's curve.
TEST(ExpertParallel, ZeroCutsTheDenseStateOverDpAndTheExpertsOverTheirHolders) {
  const fs::path dir = setup("epzero", kQwen3Moe);
  ASSERT_EQ(train(dir, "ref", 0, 4).exit_code, 0);
  const std::vector<double> want = losses(dir / "ref");
  const auto loads = expert_loads;
  for (const auto& [np, accum, ep, tp, cp, zero] :
       {std::tuple{2, 2, 2, 1, 1, 1}, std::tuple{2, 2, 2, 1, 1, 2}, std::tuple{4, 2, 2, 2, 1, 1},
        std::tuple{4, 1, 4, 1, 1, 1}, std::tuple{2, 4, 2, 1, 2, 1}, std::tuple{4, 1, 2, 1, 1, 1},
        std::tuple{4, 1, 2, 1, 1, 2}}) {
    const std::string layout =
        fmt::format(" --set parallel.ep={} --set parallel.tp={} --set parallel.cp={}", ep, tp, cp) + kSmallBuckets;
    const std::string plain = fmt::format("plain_np{}_ep{}_tp{}_cp{}", np, ep, tp, cp);
    const std::string out = fmt::format("zero{}_np{}_ep{}_tp{}_cp{}", zero, np, ep, tp, cp);
    if (!fs::exists(dir / plain)) ASSERT_EQ(train(dir, plain, np, accum, layout).exit_code, 0);
    const LatheRun r = train(dir, out, np, accum, layout + fmt::format(" --set parallel.zero={}", zero));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_equals_reference(dir, out, "ep zero " + out);
    EXPECT_EQ(loads(dir / out), loads(dir / "ref")) << out;
    const double tol = zero == 1 || accum == 1 ? 1e-7 : 1e-6;
    expect_same_curve(losses(dir / out), losses(dir / plain), out + " vs plain", tol);
    expect_same_curve(grad_norms(dir / out), grad_norms(dir / plain), out + " gradient norm vs plain", tol);
    const double dp = worst_rel_diff(weights(dir / out / "final/model.safetensors"),
                                     weights(dir / plain / "final/model.safetensors"));
    std::printf("[ep zero] %s: worst ||w - w_plain|| / ||w_plain|| %.3g\n", out.c_str(), dp);
    EXPECT_LT(dp, zero == 1 ? 1e-6 : 1e-5) << out;
    int shards = 0;  // one a rank: its pieces of the dense parameters and its experts whole
    for (const auto& e : fs::directory_iterator(dir / out / "checkpoints/step-00000003"))
      shards += e.path().filename().string().find(".rank-") != std::string::npos;
    EXPECT_EQ(shards, np) << out;
  }
  const std::string ep2_zero1 = " --set parallel.ep=2 --set parallel.zero=1";
  EXPECT_NE(train(dir, "run", 2, 2, ep2_zero1, "LATHE_FAULT_INJECT=after_step:4").exit_code, 0);
  fs::copy(dir / "run", dir / "plain", fs::copy_options::recursive);
  const LatheRun same = train(dir, "run", 2, 2, ep2_zero1);
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NE(same.output.find("resumed from"), std::string::npos) << same.output;
  EXPECT_EQ(same.output.find("re-cut"), std::string::npos) << "the same layout is read as it is";
  expect_same_curve(losses(dir / "run"), want, "ep 2 ZeRO-1 resumed at its layout");
  const LatheRun plain = train(dir, "plain", 2, 2, " --set parallel.ep=2");
  EXPECT_NE(plain.exit_code, 0);
  EXPECT_NE(plain.output.find("was saved at parallel.ep = 2, ZeRO shards over 2 ranks under parallel.ep (the experts' "
                              "state cut over the ranks holding each); this run is at parallel.ep = 2, without ZeRO: "
                              "re-cutting it is not built"), std::string::npos) << plain.output;
  expect_whole_and_zero_states_resume_at(dir, 2, 2, ep2_zero1, want, "ep 2 ZeRO-1");
}

TEST(ExpertParallel, LayoutsNotBuiltAreRefusedByName) {
  const fs::path dir = setup("ep_refused", kQwen3Moe);
  for (const auto& [np, sets, needle] :
       {std::tuple{4, " --set parallel.ep=2 --set parallel.cp=4", "parallel.ep: 2 with parallel.cp 4: ep must be a "
                                                                  "multiple of cp"}}) {
    const LatheRun r = train(dir, "out", np, 2, sets);
    EXPECT_NE(r.exit_code, 0) << sets;
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
  }
  const fs::path dense = setup("ep_dense", kQwen3);
  const LatheRun r = train(dense, "out", 2, 2, " --set parallel.ep=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("has no mixture-of-experts layers to split over 2 ranks"), std::string::npos) << r.output;
}

// Qwen3 with four layers (tied head): pp 2 x vpp 2 splits them into four stages, pp 4 into one a stage.
const char* kQwen3Deep =
    "model:\n  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 4, num_attention_heads: 4,\n"
    "           num_key_value_heads: 2, head_dim: 8, tie_word_embeddings: true, vocab_size: 320}\n";

// The Qwen3.5 hybrid with four layers: three Gated DeltaNet and one full attention.
const char* kQwen35Deep =
    "model:\n  config: {model_type: qwen3_5_text, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 4,\n"
    "           layer_types: [linear_attention, linear_attention, linear_attention, full_attention],\n"
    "           num_attention_heads: 2, num_key_value_heads: 1, head_dim: 8, partial_rotary_factor: 0.5,\n"
    "           rope_theta: 10000, linear_num_key_heads: 1, linear_num_value_heads: 2, linear_key_head_dim: 8,\n"
    "           linear_value_head_dim: 8, linear_conv_kernel_dim: 4, tie_word_embeddings: true}\n  init_std: 0.2\n";

// Pipeline parallelism: the step's micro-batches (grad_accum) through the stages by the 1F1B schedule (interleaved
// with vpp 2) equal one process's grad_accum x dp micro-batches: losses within 1e-5, the first gradient norms within
// 1e-4 (the norm's squares are summed stage by stage, the tied embedding's counted once), weights within 1e-5 at step
// 3 and at the end; each stage writes its optimizer state (optimizer.pp-R-of-N), and the model is one HF folder.
// Qwen3 (tied head) at pp 2, pp 2 x vpp 2, pp 4 and pp 2 x dp 2; the Qwen3.5 hybrid at pp 2; Qwen3-MoE at pp 2 x ep 2,
// twice: bitwise the same. A run killed at pp 2
// resumes at pp 2 and, re-cut, at one process and at pp 4; one process's checkpoint resumes at pp 2.
TEST(PipelineParallel, EqualsOneProcessAndResumesAtAnotherLayout) {
  const fs::path dir = setup("pp", kQwen3Deep);
  // Held-out loss every 4 steps (streamed through the stages under pp).
  const std::string eval = " --set data.eval=[" + (dir / "train.jsonl").string() + "] --set train.eval_every=4";
  const LatheRun ref = train(dir, "ref", 0, 4, eval);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::vector<double> want = losses(dir / "ref");
  const auto eval_losses = [](const fs::path& out) {
    std::vector<double> e;
    for (const auto& row : lathe_e2e::metrics(out))
      if (row.contains("eval_loss")) e.push_back(row["eval_loss"].get<double>());
    return e;
  };
  ASSERT_EQ(eval_losses(dir / "ref").size(), 2u);
  for (const auto& [np, accum, pp, vpp] :
       {std::tuple{2, 4, 2, 1}, std::tuple{2, 4, 2, 2}, std::tuple{4, 4, 4, 1}, std::tuple{4, 2, 2, 1}}) {
    const std::string out = fmt::format("pp{}_vpp{}_np{}", pp, vpp, np);
    const LatheRun r = train(dir, out, np, accum, fmt::format(" --set parallel.pp={} --set parallel.vpp={}", pp, vpp) +
                                                      kSmallBuckets + eval);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("parallel: tp=1 cp=1 ep=1 dp={} pp={} (world {})", np / pp, pp, np)),
              std::string::npos) << r.output;
    expect_same_curve(losses(dir / out), want, out);
    expect_same_curve(eval_losses(dir / out), eval_losses(dir / "ref"), out + " held-out loss");
    expect_same_first_grad_norms(dir, out);
    const auto [d3, d] = weight_diffs(dir, out, "model.safetensors", "pp " + out);
    EXPECT_LT(d3, 1e-5) << out;
    EXPECT_LT(d, 1e-5) << out;
    for (int rank = 0; rank < pp; ++rank)
      EXPECT_TRUE(fs::exists(dir / out / fmt::format("checkpoints/step-00000003/optimizer.pp-{}-of-{}.safetensors", rank, pp)));
  }
  const LatheRun killed = train(dir, "run", 2, 4, " --set parallel.pp=2", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(killed.exit_code, 0);
  fs::copy(dir / "run", dir / "run_one", fs::copy_options::recursive);
  fs::copy(dir / "run", dir / "run_pp4", fs::copy_options::recursive);
  expect_continues(dir, "run", 2, 4, " --set parallel.pp=2", "resumed from", want, "pp 2 -> pp 2");
  expect_continues(dir, "run_one", 0, 4, "", "was saved at pp 2; re-cut for pp 1", want, "pp 2 -> one process");
  expect_continues(dir, "run_pp4", 4, 4, " --set parallel.pp=4", "was saved at pp 2; re-cut for pp 4", want,
                   "pp 2 -> pp 4");
  const LatheRun one = train(dir, "one", 0, 4, "", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(one.exit_code, 0);
  expect_continues(dir, "one", 2, 4, " --set parallel.pp=2", "was saved at tp 1; re-cut for pp 2", want,
                   "one process -> pp 2");

  // The Qwen3.5 hybrid (three GDN layers and one full attention; its stages by their layers' estimated cost), in f64:
  // in f32 its gradient norm jumps to 63 at step 4 and f32 rounding alone (here the tied embedding's two halves added
  // in another order) grows to 3e-5 in the weights by step 8; in f64 the runs agree to 2e-14.
  const fs::path hybrid = setup("pp_hybrid", kQwen35Deep, "dtype: f64\n");
  ASSERT_EQ(train(hybrid, "ref", 0, 4).exit_code, 0);
  const LatheRun h = train(hybrid, "pp2", 2, 4, " --set parallel.pp=2");
  ASSERT_EQ(h.exit_code, 0) << h.output;
  EXPECT_NE(h.output.find("pipeline: pp 2 x vpp 1: layers "), std::string::npos) << h.output;
  expect_same_curve(losses(hybrid / "pp2"), losses(hybrid / "ref"), "Qwen3.5 at pp 2", 1e-12);
  const auto [hd3, hd] = weight_diffs(hybrid, "pp2", "model.safetensors", "Qwen3.5 at pp 2");  // saved in f32
  EXPECT_LT(hd3, 1e-7);
  EXPECT_LT(hd, 1e-7);

  const fs::path moe = setup("pp_ep", kQwen3Moe);  // pp 2 x ep 2: the ep group is the dp pair of each stage
  const LatheRun moe_ref = train(moe, "ref", 0, 4);
  ASSERT_EQ(moe_ref.exit_code, 0) << moe_ref.output;
  const LatheRun r = train(moe, "pp2_ep2", 4, 2, " --set parallel.pp=2 --set parallel.ep=2" + std::string(kSmallBuckets));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_curve(losses(moe / "pp2_ep2"), losses(moe / "ref"), "pp 2 x ep 2");
  const auto [d3, d] = weight_diffs(moe, "pp2_ep2", "model.safetensors", "pp 2 x ep 2");
  EXPECT_LT(d3, 1e-5);
  EXPECT_LT(d, 1e-5);
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_TRUE(fs::exists(moe / fmt::format("pp2_ep2/checkpoints/step-00000003/optimizer.ep-pp-{}-of-4.safetensors", rank)));
  // The same run again: bitwise the same (every loss and gradient norm, and the final weights).
  const LatheRun again = train(moe, "pp2_ep2_again", 4, 2, " --set parallel.pp=2 --set parallel.ep=2" +
                                                               std::string(kSmallBuckets));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(losses(moe / "pp2_ep2_again"), losses(moe / "pp2_ep2"));
  EXPECT_EQ(grad_norms(moe / "pp2_ep2_again"), grad_norms(moe / "pp2_ep2"));
  EXPECT_EQ(weights(moe / "pp2_ep2_again/final/model.safetensors"), weights(moe / "pp2_ep2/final/model.safetensors"));
}

// ZeRO under pipeline parallelism: each stage's parameters cut over the dp ranks of that stage (four layers, tied
// head: the last stage's copy of the embedding has its own pieces, left out of the norm as without ZeRO). pp 2 x dp 2
// and pp 2 x vpp 2 x dp 2 with ZeRO-1 against the same layouts without ZeRO (losses and gradient norms within 1e-7,
// final weights 1e-6, as DataParallel.ZeroEqualsPlainDataParallelAndShardsTheOptimizerState) and against one process
// (losses 1e-5, first gradient norms 1e-4, weights 1e-5 at steps 3 and 8). Killed after step 4, the checkpoint (each
// stage's dp shards, optimizer.pp-S-of-2.rank-R-of-2) resumes at its layout (read as it is), at pp 2 without ZeRO, at
// pp 4 and at one process (each stage's shards assembled into its whole tensors, then cut), on one process's curve;
// one process's checkpoint resumes at pp 2 x dp 2 with ZeRO-1 (cut into the stage's tensors, then into pieces).
TEST(PipelineParallel, ZeroCutsEachStageOverItsDataParallelRanks) {
  const fs::path dir = setup("ppzero", kQwen3Deep);
  ASSERT_EQ(train(dir, "ref", 0, 4).exit_code, 0);
  const std::vector<double> want = losses(dir / "ref");
  for (const std::string vpp : {"1", "2"}) {
    const std::string layout = " --set parallel.pp=2 --set parallel.vpp=" + vpp + kSmallBuckets;
    const std::string plain = "plain_vpp" + vpp, zero = "zero1_vpp" + vpp;
    ASSERT_EQ(train(dir, plain, 4, 2, layout).exit_code, 0);
    const LatheRun r = train(dir, zero, 4, 2, layout + " --set parallel.zero=1");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_equals_reference(dir, zero, "pp zero " + zero);
    expect_same_curve(losses(dir / zero), losses(dir / plain), zero + " vs plain", 1e-7);
    expect_same_curve(grad_norms(dir / zero), grad_norms(dir / plain), zero + " gradient norm vs plain", 1e-7);
    const double dp = worst_rel_diff(weights(dir / zero / "final/model.safetensors"),
                                     weights(dir / plain / "final/model.safetensors"));
    std::printf("[pp zero] %s: worst ||w - w_plain|| / ||w_plain|| %.3g\n", zero.c_str(), dp);
    EXPECT_LT(dp, 1e-6) << zero;
    for (int stage = 0; stage < 2; ++stage)
      for (int rank = 0; rank < 2; ++rank)
        EXPECT_TRUE(fs::exists(dir / zero / fmt::format("checkpoints/step-00000003/optimizer.pp-{}-of-2.rank-{}-of-2"
                                                        ".safetensors", stage, rank))) << zero;
  }
  const std::string pp2_zero1 = " --set parallel.pp=2 --set parallel.zero=1";
  EXPECT_NE(train(dir, "run", 4, 2, pp2_zero1, "LATHE_FAULT_INJECT=after_step:4").exit_code, 0);
  for (const char* copy : {"pp2", "pp4", "one_of_pp"}) fs::copy(dir / "run", dir / copy, fs::copy_options::recursive);
  const LatheRun same = train(dir, "run", 4, 2, pp2_zero1);
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NE(same.output.find("resumed from"), std::string::npos) << same.output;
  EXPECT_EQ(same.output.find("re-cut"), std::string::npos) << "the same layout is read as it is";
  expect_same_curve(losses(dir / "run"), want, "pp 2 x dp 2 ZeRO-1 resumed at its layout");
  expect_continues(dir, "pp2", 2, 4, " --set parallel.pp=2", "re-cut for this run's layout (parallel.pp = 2", want,
                   "pp 2 x dp 2 ZeRO-1 -> pp 2");
  // Other stages: each old stage's shards assembled into its whole tensors, then cut for this run.
  expect_continues(dir, "pp4", 4, 4, " --set parallel.pp=4", "re-cut for this run's layout (parallel.pp = 4", want,
                   "pp 2 x dp 2 ZeRO-1 -> pp 4");
  expect_continues(dir, "one_of_pp", 0, 4, "", "re-cut for this run's layout (parallel.tp = 1, without ZeRO)", want,
                   "pp 2 x dp 2 ZeRO-1 -> one process");
  EXPECT_NE(train(dir, "one", 0, 4, "", "LATHE_FAULT_INJECT=after_step:4").exit_code, 0);
  expect_continues(dir, "one", 4, 2, pp2_zero1, "was saved whole; re-cut for this run's layout", want,
                   "one process -> pp 2 x dp 2 ZeRO-1");
}

// A stage that stops (SIGSTOP, the last rank after step 4) leaves the first stage waiting in the pipeline's exchange
// of the next step: the job ends at parallel.timeout_s with the report naming the pp group.
TEST(PipelineParallel, AStoppedStageEndsTheJobWithTheTimeoutReport) {
  const fs::path dir = setup("pp_stopped", kQwen3Deep, "parallel: {timeout_s: 4}\n");
  const auto t0 = std::chrono::steady_clock::now();
  const LatheRun r = train(dir, "run", 2, 2, " --set parallel.pp=2", "LATHE_FAULT_INJECT=rank_sigstop:4");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(seconds, 30) << "not ended at the timeout";
  EXPECT_NE(r.output.find("lathe: error: rank 0: exchange #"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("on group pp[0] (2 ranks) did not complete within parallel.timeout_s = 4 s"),
            std::string::npos) << r.output;
}

// The lines a run printed for its final evaluation (each prompt's generation and the summary), in order, without the
// progress line's erase codes and indent.
std::vector<std::string> final_eval_lines(const std::string& output) {
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.find(" -> \"") == std::string::npos && line.find("final eval: ") == std::string::npos) continue;
    for (const std::string erase : {"\r", "\x1B[K"})
      for (size_t at; (at = line.find(erase)) != std::string::npos;) line.erase(at, erase.size());
    lines.push_back(line.substr(line.find_first_not_of(' ')));
  }
  return lines;
}

// The final evaluation under pp (generation runs on whole models: the first rank evaluates the exported final folder
// alone): the same generations and accuracy as one process's, full fine-tuning and LoRA.
TEST(PipelineParallel, FinalEvalGeneratesWhatOneProcessGenerates) {
  const fs::path dir = setup("pp_final_eval", kQwen3Deep);
  std::ofstream(dir / "heldout.jsonl") << "{\"prompt\": \"the cat sat\", \"answer\": \"on\"}\n"
                                       << "{\"prompt\": \"dogs run\", \"answer\": \"in\"}\n";
  const std::string eval = " --set final_eval.file=" + (dir / "heldout.jsonl").string() +
                           " --set final_eval.max_new_tokens=4 --set train.max_steps=4";
  for (const std::string& lora : {std::string(), std::string(" --set lora.rank=4")}) {
    const LatheRun one = train(dir, "one" + std::to_string(lora.size()), 0, 4, eval + lora);
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const LatheRun pp = train(dir, "pp" + std::to_string(lora.size()), 2, 4, " --set parallel.pp=2" + eval + lora);
    ASSERT_EQ(pp.exit_code, 0) << pp.output;
    const std::vector<std::string> want = final_eval_lines(one.output);
    ASSERT_EQ(want.size(), 3u) << one.output;
    EXPECT_EQ(final_eval_lines(pp.output), want) << (lora.empty() ? "full" : "LoRA") << "\n" << pp.output;
  }
}

// LoRA through pipeline stages: every stage holds the adapters, the gradients of each stage's layers summed over the
// stages; the loss curve and the adapter (PEFT files, written by the first stage) equal one process's at pp 2, pp 2 x
// dp 2 and pp 2 x tp 2; killed at pp 2, the run resumes at one process and at pp 4 on the same curve.
TEST(PipelineParallel, LoraEqualsOneProcessAndResumes) {
  const fs::path dir = setup("pp_lora", kQwen3Deep, "lora: {rank: 4, alpha: 8}\n");
  const LatheRun ref = train(dir, "ref", 0, 4);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  expect_adapter_run_equals_reference(dir, "pp2", 2, 4, " --set parallel.pp=2", "LoRA at pp 2");
  expect_adapter_run_equals_reference(dir, "pp2_dp2", 4, 2, " --set parallel.pp=2" + std::string(kSmallBuckets),
                                      "LoRA at pp 2 x dp 2");
  expect_adapter_run_equals_reference(dir, "pp2_tp2", 4, 4, " --set parallel.pp=2 --set parallel.tp=2",
                                      "LoRA at pp 2 x tp 2");
  const LatheRun killed = train(dir, "run", 2, 4, " --set parallel.pp=2", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(killed.exit_code, 0);
  fs::copy(dir / "run", dir / "run_pp4", fs::copy_options::recursive);
  const std::vector<double> want = losses(dir / "ref");
  expect_continues(dir, "run", 0, 4, "", "was saved at pp 2; re-cut for pp 1", want, "LoRA pp 2 -> one process");
  expect_continues(dir, "run_pp4", 4, 4, " --set parallel.pp=4", "was saved at pp 2; re-cut for pp 4", want,
                   "LoRA pp 2 -> pp 4");
}

// `lathe logprobs --pp N`: each replica's batches stream through its stages; the lines equal one process's at pp 2
// (two replicas at four ranks), pp 4, and pp 2 x tp 2.
TEST(PipelineParallel, LogprobsEqualOneProcess) {
  const fs::path dir = setup("pp_logprobs", kQwen3Deep);
  std::vector<std::vector<double>> want;
  const std::string args = logprobs_reference(dir, want);
  ASSERT_EQ(want.size(), 9u);
  for (const auto& [np, pp, tp] : {std::tuple{2, 2, 1}, std::tuple{4, 2, 1}, std::tuple{4, 4, 1}, std::tuple{4, 2, 2}}) {
    const fs::path out = dir / fmt::format("pp{}_tp{}_np{}.jsonl", pp, tp, np);
    const LatheRun r = lathe_e2e::lathe(args + out.string() + fmt::format(" --pp {} --tp {}", pp, tp),
                                        kMpirun + fmt::format(" -np {}", np));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("9 lines scored with {} on cpu (f32), {} ranks{}, pp {}",
                                        (dir / "model/final").string(), np, tp > 1 ? ", tp 2" : "", pp)),
              std::string::npos) << r.output;
    expect_same_logprobs(out, want, fmt::format("{} ranks at pp {}, tp {}", np, pp, tp));
  }
}

// LoRA dropout under tp 2 (with and without sp) and cp 2 (session 27; refused before): each rank draws its part of
// every segment's mask (a row-parallel module's input columns by their place in the whole row, a cp rank's rows by
// their place in their segment), so the runs equal one process: the hybrid (GDN out_proj, o_proj and down_proj
// row-parallel; every linear adapted but in_proj_a and in_proj_b, whose adapters' near-zero first gradients AdamW
// turns into lr-sized moves of either sign, so that f32 rounding alone moved them 6e-4 apart at tp 2, with or without
// dropout) at tp 2 and at tp 2 x cp 2 on four ranks, and Qwen3 at cp 2 (segments cut by the ranks' rows). Fails
// with the column offset or the row shift left out.
TEST(TensorParallel, LoraDropoutEqualsOneProcessAtTpAndCp) {
  const fs::path hybrid = setup("tplora_dropout", kQwen35Tp,
                                "lora: {rank: 4, alpha: 8, dropout: 0.2, targets: [q_proj, k_proj, v_proj, o_proj, "
                                "gate_proj, up_proj, down_proj, in_proj_qkv, in_proj_z, out_proj]}\n");
  const std::string lr = " --set train.lr=0.002";
  ASSERT_EQ(train(hybrid, "ref", 0, 4, lr).exit_code, 0);
  expect_adapter_run_equals_reference(hybrid, "tp2", 2, 4, lr + " --set parallel.tp=2", "lora dropout tp 2");
  expect_adapter_run_equals_reference(hybrid, "tp2_sp", 2, 4, lr + " --set parallel.tp=2 --set parallel.sp=true",
                                      "lora dropout tp 2 sp");
  expect_adapter_run_equals_reference(hybrid, "tp2_cp2", 4, 4, lr + " --set parallel.tp=2 --set parallel.cp=2",
                                      "lora dropout tp 2 x cp 2");
  const fs::path dense = setup("cplora_dropout", kQwen3, "lora: {rank: 4, alpha: 8, dropout: 0.2}\n");
  ASSERT_EQ(train(dense, "ref", 0, 4).exit_code, 0);
  expect_adapter_run_equals_reference(dense, "cp2", 2, 4, " --set parallel.cp=2", "lora dropout cp 2");
}

TEST(TensorParallel, LoraEqualsOneProcessAndResumes) {
  const fs::path dir = setup("tplora", kQwen3, "lora: {rank: 4, alpha: 8}\n");
  const LatheRun ref = train(dir, "ref", 0, 4);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::vector<double> want = losses(dir / "ref");
  for (const auto& [np, accum] : {std::pair{2, 4}, std::pair{4, 2}}) {
    const std::string out = fmt::format("tp2_np{}", np);
    const LatheRun r = train(dir, out, np, accum, " --set parallel.tp=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_curve(losses(dir / out), want, out);
    const auto [d3, d] = weight_diffs(dir, out, "adapter_model.safetensors", "tp lora " + out);
    EXPECT_LT(d3, 1e-5) << out;
    EXPECT_LT(d, 1e-5) << out;
  }
  const LatheRun killed = train(dir, "run", 2, 4, " --set parallel.tp=2", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(killed.exit_code, 0);
  expect_continues(dir, "run", 4, 2, " --set parallel.tp=2", "resumed from", want, "lora tp 2 -> tp 2 x dp 2");
  // The adapter scored over its base at tp 2 (each matrix sliced as its base weight) as by one process.
  {
    std::ofstream in(dir / "in.jsonl");
    for (int i = 0; i < 5; ++i) {
      nlohmann::json ids = nlohmann::json::array();
      for (int k = 0; k < 4 + 3 * i; ++k) ids.push_back((37 * i + 11 * k) % 300);
      in << nlohmann::json{{"tokens", ids}}.dump() << "\n";
    }
  }
  const std::string args = fmt::format("logprobs --model {} --adapter {} --input {} --output ", (dir / "ref/base").string(),
                                       (dir / "ref/final").string(), (dir / "in.jsonl").string());
  ASSERT_EQ(lathe_e2e::lathe(args + (dir / "one.jsonl").string()).exit_code, 0);
  const LatheRun scored = lathe_e2e::lathe(args + (dir / "tp2.jsonl").string() + " --tp 2", kMpirun + " -np 2");
  ASSERT_EQ(scored.exit_code, 0) << scored.output;
  const auto a = lathe_e2e::read_logprobs(dir / "one.jsonl"), c = lathe_e2e::read_logprobs(dir / "tp2.jsonl");
  ASSERT_EQ(c.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t k = 0; k < a[i].size(); ++k) EXPECT_NEAR(c[i][k], a[i][k], 1e-5 * (1 + std::abs(a[i][k])));
}

// A trained adapter applied by `lathe logprobs --adapter` and `lathe generate --adapter` (merged into the weights) /
// `--adapters NAME=DIR` (unmerged, per line) under every layout each command runs, against one process: logprobs at
// tp 2, cp 2 and pp 2 (and ep 2 on Qwen3-MoE with adapters on the experts; tp, cp and ep on the Qwen3.5-MoE hybrid),
// generate at tp 2 and pp 2 (each decoding step through the stages; and ep 2): tokens equal,
// log-probs within f32 rounding; and the adapter moves the log-probs away from the base's (it was applied).
void expect_adapter_commands_equal_one_process(const fs::path& dir, const std::vector<std::string>& layouts_logprobs,
                                               const std::vector<std::string>& layouts_generate) {
  const std::string base = (dir / "ref/base").string(), adapter = (dir / "ref/final").string();
  write_token_lines(dir / "in.jsonl", 5, [](int i) { return 3 + 4 * i; });
  {
    std::ofstream named(dir / "named.jsonl");  // lines 0, 2, 4 with the adapter, 1 and 3 on the base
    for (int i = 0; i < 5; ++i) {
      nlohmann::json ids = nlohmann::json::array();
      for (int k = 0; k < 3 + 4 * i; ++k) ids.push_back((37 * i + 11 * k) % 300);
      nlohmann::json row = {{"tokens", ids}};
      if (i % 2 == 0) row["adapter"] = "a";
      named << row.dump() << "\n";
    }
  }
  const auto run = [&](const std::string& args, const std::string& out, const std::string& layout, int np) {
    const LatheRun r = lathe_e2e::lathe(args + " --output " + (dir / out).string() + layout,
                                        np > 1 ? kMpirun + fmt::format(" -np {}", np) : "");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return lathe_e2e::read_logprobs(dir / out);
  };
  const std::string score = fmt::format("logprobs --model {} --input {}", base, (dir / "in.jsonl").string());
  int out_index = 0;
  const auto plain = run(score, "plain.jsonl", "", 0), want = run(score + " --adapter " + adapter, "one.jsonl", "", 0);
  ASSERT_EQ(want.size(), 5u);
  double moved = 0;
  for (size_t i = 0; i < want.size(); ++i)
    for (size_t k = 0; k < want[i].size(); ++k) moved = std::max(moved, std::abs(want[i][k] - plain[i][k]));
  EXPECT_GT(moved, 1e-4) << "the adapter changes nothing: the test would not see it dropped";
  for (const std::string& layout : layouts_logprobs) {  // each on two ranks
    const std::string out = fmt::format("lp{}.jsonl", out_index++);
    run(score + " --adapter " + adapter, out, " " + layout, 2);
    expect_same_logprobs(dir / out, want, "logprobs --adapter " + layout);  // against one process's
  }
  for (const auto& [what, args] :
       {std::pair{"merged", fmt::format("generate --model {} --adapter {} --input {}", base, adapter,
                                        (dir / "in.jsonl").string())},
        std::pair{"named", fmt::format("generate --model {} --adapters a={} --input {}", base, adapter,
                                       (dir / "named.jsonl").string())}}) {
    const std::string gen = args + " --max-new-tokens 6 --ignore-eos --temperature 0";
    const std::string one = fmt::format("gen_{}_one.jsonl", what);
    run(gen, one, "", 0);
    for (const std::string& flag : layouts_generate) {
      const std::string out = fmt::format("gen_{}{}.jsonl", what, out_index++);
      run(gen, out, " " + flag, 2);
      std::ifstream a(dir / one), b(dir / out);
      int lines = 0;
      for (std::string wa, wb; std::getline(a, wa) && std::getline(b, wb); ++lines) {
        const nlohmann::json x = nlohmann::json::parse(wa), y = nlohmann::json::parse(wb);
        EXPECT_EQ(y["tokens"], x["tokens"]) << what << " " << flag << " line " << lines;
        const auto lx = x["logprobs"].get<std::vector<double>>(), ly = y["logprobs"].get<std::vector<double>>();
        ASSERT_EQ(ly.size(), lx.size());
        for (size_t k = 0; k < lx.size(); ++k) EXPECT_NEAR(ly[k], lx[k], 1e-5 * (1 + std::abs(lx[k]))) << what << flag;
      }
      EXPECT_EQ(lines, 5) << what << " " << flag;
    }
  }
}

TEST(Adapters, ScoredAndDecodedUnderParallelLayoutsAsByOneProcess) {
  const fs::path dense = setup("adapters_dense", kQwen3Deep, "lora: {rank: 4, alpha: 16}\n");
  ASSERT_EQ(train(dense, "ref", 0, 1, " --set train.max_steps=4 --set train.lr=0.05").exit_code, 0);
  expect_adapter_commands_equal_one_process(dense, {"--tp 2", "--cp 2", "--pp 2"}, {"--tp 2", "--pp 2"});
  const fs::path moe = setup("adapters_moe", kQwen3Moe);
  ASSERT_EQ(train(moe, "ref", 0, 1, " --set train.max_steps=4 --set train.lr=0.05 --set lora.rank=4 --set lora.alpha=16 "
                  "--set lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]").exit_code, 0);
  expect_adapter_commands_equal_one_process(moe, {"--ep 2"}, {"--ep 2"});
  // The Qwen3.5-MoE hybrid (Gated DeltaNet, gated attention, experts with a shared one): every layout at once.
  const fs::path hybrid = setup("adapters_hybrid", kQwen35MoeCp, "lora: {rank: 4, alpha: 16}\n");
  ASSERT_EQ(train(hybrid, "ref", 0, 1, " --set train.max_steps=4 --set train.lr=0.05").exit_code, 0);
  expect_adapter_commands_equal_one_process(hybrid, {"--tp 2", "--cp 2", "--ep 2", "--cp 2 --ep 2"}, {"--tp 2", "--ep 2"});
}

TEST(DataParallel, ACheckpointOfDp2ResumesAtDp4OnTheSameCurve) {
  const fs::path dir = setup("reshard", kQwen3);
  ASSERT_EQ(train(dir, "ref", 0, 4).exit_code, 0);
  // dp = 2 dies after step 4 (checkpoint at 3); dp = 4 continues it.
  const LatheRun killed = train(dir, "run", 2, 2, "", "LATHE_FAULT_INJECT=after_step:4");
  EXPECT_NE(killed.exit_code, 0);
  expect_continues(dir, "run", 4, 1, "", "resumed from", losses(dir / "ref"), "dp 2 -> 4");
}

TEST(DataParallel, ARankKilledWithSigkillEndsTheJobAndTheResumedRunEqualsTheUninterruptedOne) {
  const fs::path dir = setup("kill", kQwen3, "parallel: {timeout_s: 30}\n");
  ASSERT_EQ(train(dir, "ref", 0, 4).exit_code, 0);
  // The last rank dies with SIGKILL after step 5 (LATHE_FAULT_INJECT=rank_sigkill:5), as kill -9 would leave it.
  const auto t0 = std::chrono::steady_clock::now();
  const LatheRun killed = train(dir, "run", 2, 2, "", "LATHE_FAULT_INJECT=rank_sigkill:5");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(killed.exit_code, 0) << killed.output;
  EXPECT_LT(seconds, 30) << "the other rank was not ended within the timeout";
  EXPECT_TRUE(killed.output.find("signal 9") != std::string::npos || killed.output.find("Killed") != std::string::npos)
      << killed.output;
  EXPECT_TRUE(fs::exists(dir / "run/checkpoints/step-00000003/trainer_state.json"));
  EXPECT_LT(losses(dir / "run").size(), 8u);
  // Resumed (at another dp size), the run equals the uninterrupted one.
  expect_continues(dir, "run", 4, 1, "", "resumed from", losses(dir / "ref"), "killed and resumed");
}

TEST(DataParallel, AStoppedRankEndsTheJobWithTheTimeoutReport) {
  const fs::path dir = setup("stopped", kQwen3, "parallel: {timeout_s: 4}\n");
  // The last rank stops (SIGSTOP) after step 4 (no checkpoint there): rank 0 waits in the next step's gradient
  // all-reduce (on the dp group's gradient communicator) until the timeout.
  const auto t0 = std::chrono::steady_clock::now();
  const LatheRun r = train(dir, "run", 2, 2, "", "LATHE_FAULT_INJECT=rank_sigstop:4");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(seconds, 30) << "not ended at the timeout";
  EXPECT_NE(r.output.find("lathe: error: rank 0: all_reduce #"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("on group dp[0].grads (2 ranks) did not complete within parallel.timeout_s = 4 s"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("this rank's last collectives on it:"), std::string::npos) << r.output;
  // Stopped just before a checkpoint (step 3): caught by the barrier before the save, under the same timeout (not
  // parallel.save_timeout_s, which bounds only the wait while the first rank writes).
  const LatheRun before_save = train(dir, "run2", 2, 2, "", "LATHE_FAULT_INJECT=rank_sigstop:3");
  EXPECT_NE(before_save.exit_code, 0);
  EXPECT_NE(before_save.output.find("on group world (2 ranks) did not complete within parallel.timeout_s = 4 s"),
            std::string::npos) << before_save.output;
}

// Four ranks, the last stopped: each of the three others reports its own last collectives before the job ends.
TEST(DataParallel, EveryLiveRankReportsItsLastCollectives) {
  const fs::path dir = setup("stopped4", kQwen3, "parallel: {timeout_s: 4}\n");
  const LatheRun r = train(dir, "run", 4, 1, "", "LATHE_FAULT_INJECT=rank_sigstop:4");
  EXPECT_NE(r.exit_code, 0);
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_NE(r.output.find(fmt::format("lathe: error: rank {}: all_reduce #", rank)), std::string::npos)
        << "rank " << rank << " did not report\n" << r.output;
  EXPECT_EQ(r.output.find("lathe: error: rank 3:"), std::string::npos) << "the stopped rank cannot report";
}

TEST(DataParallel, TheOtherRanksWaitForACheckpointUnderTheSaveTimeout) {
  // Rank 0's save of step 3 takes 6 s, twice the collectives' timeout: the others wait for it at the save barrier.
  const fs::path dir = setup("slow_save", kQwen3, "parallel: {timeout_s: 3}\n");
  const LatheRun ok = train(dir, "run", 2, 2, " --set train.max_steps=4", "LATHE_FAULT_INJECT=slow_save:3");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_EQ(losses(dir / "run").size(), 4u);
  // A save timeout shorter than the save ends the job with the report naming it.
  const LatheRun late = train(dir, "late", 2, 2, " --set train.max_steps=4 --set parallel.save_timeout_s=1",
                              "LATHE_FAULT_INJECT=slow_save:3");
  EXPECT_NE(late.exit_code, 0);
  EXPECT_NE(late.output.find("barrier #"), std::string::npos) << late.output;
  EXPECT_NE(late.output.find("did not complete within parallel.save_timeout_s = 1 s"), std::string::npos) << late.output;
}

TEST(DataParallel, LayoutsThatCannotWorkAreRefusedBeforeAnyWeightIsLoaded) {
  const fs::path dir = setup("refused", kQwen3);
  const LatheRun one = train(dir, "x", 0, 1, " --set parallel.dp=2");
  EXPECT_EQ(one.exit_code, 1);
  EXPECT_NE(one.output.find("parallel.dp = 2 needs 2 ranks, but this is one process: launch them with `mpirun -np 2"),
            std::string::npos) << one.output;
  const LatheRun mismatch = train(dir, "x", 2, 1, " --set parallel.dp=3");
  EXPECT_NE(mismatch.exit_code, 0);
  EXPECT_NE(mismatch.output.find("= 3, but the job has 2 ranks"), std::string::npos) << mismatch.output;
  const LatheRun pp = train(dir, "x", 2, 1, " --set parallel.pp=2 --set parallel.zero=2");
  EXPECT_NE(pp.exit_code, 0);
  EXPECT_NE(pp.output.find("parallel.pp: 2 with parallel.zero 2: under pipeline parallelism the gradients are reduced "
                           "once after the schedule, so ZeRO-2 would hold them whole like ZeRO-1: use parallel.zero: 1"),
            std::string::npos) << pp.output;
  const LatheRun vpp = train(dir, "x", 2, 3, " --set parallel.pp=2 --set parallel.vpp=2");
  EXPECT_NE(vpp.exit_code, 0);
  EXPECT_NE(vpp.output.find("train.grad_accum = 3 is not a multiple of it"), std::string::npos) << vpp.output;
  const LatheRun stages = train(dir, "x", 2, 2, " --set parallel.pp=2 --set parallel.pp_layers=[2,1]");
  EXPECT_NE(stages.exit_code, 0);
  EXPECT_NE(stages.output.find("parallel.pp_layers: the counts add up to 3 layers; the model has 2"), std::string::npos)
      << stages.output;
  const LatheRun tp = train(dir, "x", 3, 1, " --set parallel.tp=3");  // 4 heads
  EXPECT_NE(tp.exit_code, 0);
  EXPECT_NE(tp.output.find("parallel.tp: 3 ranks must divide the attention heads (4) and the MLP's intermediate size"),
            std::string::npos) << tp.output;
  const LatheRun nproc = train(dir, "x", 0, 1, " --nproc 2");
  EXPECT_EQ(nproc.exit_code, 1);
  EXPECT_NE(nproc.output.find("--nproc starts GPU ranks (NCCL); CPU ranks talk over MPI"), std::string::npos) << nproc.output;
  EXPECT_FALSE(fs::exists(dir / "x"));
}

// A task of srun whose MPI was not started by srun (no PMI) sees a world of one: refused, naming both worlds, before
// anything is written (otherwise every task would train alone into the same folder).
TEST(DataParallel, ARankWhoseMpiWorldIsNotTheLaunchersIsRefused) {
  const fs::path dir = setup("srun", kQwen3);
  const LatheRun r = lathe_e2e::lathe(fmt::format("train {} --set output_dir={}", (dir / "config.yaml").string(),
                                                  (dir / "out").string()),
                                      "SLURM_NTASKS=2 SLURM_PROCID=1 SLURM_LOCALID=1 SLURM_JOB_ID=7 SLURM_STEP_ID=0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("srun started 2 ranks (this is rank 1), but MPI sees a world of 1 (rank 0)"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir / "out"));
}

// `lathe logprobs` under mpirun -np 2 and 3, with --tp 2 under -np 2 and 4, with --cp 2 under -np 2 and 4: the same
// log-probabilities as one process (within f32 rounding), in input order.
TEST(DataParallel, LogprobsSplitsTheLinesOverTheRanksAndKeepsTheirOrder) {
  const fs::path dir = setup("logprobs", kQwen3);
  ASSERT_EQ(train(dir, "model", 0, 1, " --set train.max_steps=2").exit_code, 0);
  write_token_lines(dir / "in.jsonl", 7, [](int i) { return 3 + 5 * i % 11; });
  const std::string args = fmt::format("logprobs --model {} --input {} --output ", (dir / "model/final").string(),
                                       (dir / "in.jsonl").string());
  ASSERT_EQ(lathe_e2e::lathe(args + (dir / "one.jsonl").string()).exit_code, 0);
  const auto want = lathe_e2e::read_logprobs(dir / "one.jsonl");
  ASSERT_EQ(want.size(), 7u);
  // --tp 2: the model split over two ranks, the lines over the np / 2 groups; --cp 2: each batch's rows split over two
  // ranks (two such replicas at -np 4)
  for (const auto& [np, tp, cp] : {std::tuple{2, 1, 1}, std::tuple{3, 1, 1}, std::tuple{2, 2, 1}, std::tuple{4, 2, 1},
                                   std::tuple{2, 1, 2}, std::tuple{4, 1, 2}}) {
    const fs::path out = dir / fmt::format("np{}_tp{}_cp{}.jsonl", np, tp, cp);
    const LatheRun r = lathe_e2e::lathe(args + out.string() + fmt::format(" --tp {} --cp {}", tp, cp),
                                        kMpirun + fmt::format(" -np {}", np));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("7 lines scored with {} on cpu (f32), {} ranks{}{}", (dir / "model/final").string(),
                                        np, tp > 1 ? fmt::format(", tp {}", tp) : "",
                                        cp > 1 ? fmt::format(", cp {}", cp) : "")),
              std::string::npos) << r.output;
    expect_same_logprobs(out, want, fmt::format("{} ranks", np));
  }
}

// `lathe generate --input` under mpirun -np 2 and 4: rank r generates lines r, r + N, ... (each line's draws seeded by
// its index) and rank 0 writes them all in input order: the same lines as one process (tokens equal, log-probs within
// f32 rounding of another batch composition), sampled at temperature 1 with two samples a line; likewise with --tp 2
// (the model split over two ranks, the lines over the np / 2 groups).
TEST(DataParallel, GenerateSplitsTheLinesOverTheRanksAndKeepsTheirOrder) {
  const fs::path dir = setup("generate", kQwen3);
  ASSERT_EQ(train(dir, "model", 0, 1, " --set train.max_steps=2").exit_code, 0);
  {
    std::ofstream in(dir / "in.jsonl");
    for (int i = 0; i < 5; ++i) {
      nlohmann::json ids = nlohmann::json::array();
      for (int k = 0; k < 2 + 3 * i; ++k) ids.push_back((29 * i + 7 * k) % 300);
      in << nlohmann::json{{"tokens", ids}}.dump() << "\n";
    }
  }
  const std::string args = fmt::format("generate --model {} --input {} --n 2 --temperature 1 --max-new-tokens 5 "
                                       "--ignore-eos --seed 9 --output ", (dir / "model/final").string(),
                                       (dir / "in.jsonl").string());
  ASSERT_EQ(lathe_e2e::lathe(args + (dir / "one.jsonl").string()).exit_code, 0);
  const auto read = [](const fs::path& p) {
    std::vector<nlohmann::json> rows;
    std::ifstream f(p);
    for (std::string line; std::getline(f, line);) rows.push_back(nlohmann::json::parse(line));
    return rows;
  };
  const std::vector<nlohmann::json> want = read(dir / "one.jsonl");
  ASSERT_EQ(want.size(), 10u);
  // 4 ranks: one of them gets a single line; --tp 2: two ranks decode each line with the model split between them;
  // --tp 4: four ranks over the model's two key/value heads (each held by two)
  for (const auto& [np, tp] : {std::pair{2, 1}, std::pair{4, 1}, std::pair{2, 2}, std::pair{4, 2}, std::pair{4, 4}}) {
    const fs::path out = dir / fmt::format("np{}_tp{}.jsonl", np, tp);
    const LatheRun r = lathe_e2e::lathe(args + out.string() + fmt::format(" --tp {}", tp), kMpirun + fmt::format(" -np {}", np));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(tp > 1 ? fmt::format("(rank 0 of {}, tp {})", np, tp) : fmt::format("(rank 0 of {})", np)),
              std::string::npos) << r.output;
    const std::vector<nlohmann::json> got = read(out);
    ASSERT_EQ(got.size(), want.size()) << np;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i]["tokens"], want[i]["tokens"]) << "line " << i << " of " << np << " ranks";
      const auto g = got[i]["logprobs"].get<std::vector<double>>(), w = want[i]["logprobs"].get<std::vector<double>>();
      ASSERT_EQ(g.size(), w.size()) << "line " << i;
      for (size_t k = 0; k < w.size(); ++k) EXPECT_NEAR(g[k], w[k], 1e-5 * (1 + std::abs(w[k]))) << "line " << i;
    }
  }
  EXPECT_NE(want[0]["tokens"], want[1]["tokens"]) << "a line's two samples should differ at temperature 1";
  const LatheRun alone = lathe_e2e::lathe(args + (dir / "x.jsonl").string() + " --tp 2");
  EXPECT_NE(alone.exit_code, 0);
  EXPECT_NE(alone.output.find("--tp 2 splits the model over 2 ranks, but this is one process"), std::string::npos)
      << alone.output;
  // One --prompt is not split: refused under a parallel launch, and --nproc (GPU ranks) refuses the CPU.
  const std::string model = " --model " + (dir / "model/final").string();
  const LatheRun prompt = lathe_e2e::lathe("generate" + model + " --prompt-tokens 1,2", kMpirun + " -np 2");
  EXPECT_NE(prompt.exit_code, 0);
  EXPECT_NE(prompt.output.find("--prompt runs on one"), std::string::npos) << prompt.output;
  const LatheRun cpu = lathe_e2e::lathe("generate" + model + " --input " + (dir / "in.jsonl").string() + " --nproc 2");
  EXPECT_NE(cpu.exit_code, 0);
  EXPECT_NE(cpu.output.find("launch them with `mpirun -np 2 lathe generate"), std::string::npos) << cpu.output;
}

TEST(DataParallel, ZeroEqualsPlainDataParallelAndShardsTheOptimizerState) {
  const fs::path dir = setup("zero", kQwen3);
  for (int np : {2, 4}) {
    const int accum = 4 / np;
    const std::string plain = fmt::format("plain{}", np);
    ASSERT_EQ(train(dir, plain, np, accum).exit_code, 0);
    // Many buckets reduced during the backward against one after it: MPI's sums are exact, so bitwise the same.
    const std::string buckets = fmt::format("buckets{}", np);
    ASSERT_EQ(train(dir, buckets, np, accum, kSmallBuckets).exit_code, 0);
    EXPECT_EQ(losses(dir / buckets), losses(dir / plain));
    EXPECT_EQ(grad_norms(dir / buckets), grad_norms(dir / plain));
    for (int zero_level : {1, 2}) {
      const std::string zero = fmt::format("zero{}_{}", zero_level, np);
      const LatheRun z = train(dir, zero, np, accum, fmt::format(" --set parallel.zero={}", zero_level) + kSmallBuckets);
      ASSERT_EQ(z.exit_code, 0) << z.output;
      // ZeRO-1: the same gradients (reduce-scatter is the all-reduce's slice, exactly); only the norm's sum is
      // associated otherwise (each rank's ranges, then the ranks). ZeRO-2 sums each micro-batch over the ranks and
      // then the micro-batches (plain: the other way round), so it differs by rounding where grad_accum > 1.
      const double tol = zero_level == 1 || accum == 1 ? 1e-7 : 1e-6;
      expect_same_curve(losses(dir / zero), losses(dir / plain), zero, tol);
      expect_same_curve(grad_norms(dir / zero), grad_norms(dir / plain), zero + " gradient norm", tol);
      const double d = worst_rel_diff(weights(dir / zero / "final/model.safetensors"), weights(dir / plain / "final/model.safetensors"));
      std::printf("[zero] ZeRO-%d dp %d: worst ||w - w_plain|| / ||w_plain|| %.3g\n", zero_level, np, d);
      EXPECT_LT(d, zero_level == 1 ? 1e-6 : 1e-5);
      // Each rank kept 1/np of the moments, and each shard file says where its pieces sit: for every parameter the
      // pieces' [flat_begin, flat_begin + n) over the ranks tile [0, numel) exactly.
      const fs::path ckpt = dir / zero / "checkpoints/step-00000008";
      std::map<std::string, size_t> numel;
      for (const auto& [name, v] : weights(ckpt / "model/model.safetensors")) numel[name] = v.size();
      std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> pieces;
      for (int r = 0; r < np; ++r) {
        const auto file = lathe::io::SafetensorsFile::open((ckpt / fmt::format("optimizer.rank-{}-of-{}.safetensors", r, np)).string());
        for (const auto& t : file.tensors()) {
          if (!t.name.ends_with(".exp_avg")) continue;
          const std::string param = t.name.substr(0, t.name.size() - 8);
          const auto meta = file.metadata().find("shard." + param);
          ASSERT_NE(meta, file.metadata().end()) << "rank " << r << ": no place recorded for " << param;
          const nlohmann::json where = nlohmann::json::parse(meta->second);
          EXPECT_EQ(where["group"], "dp");
          pieces[param].push_back({where["flat_begin"].get<int64_t>(), t.numel});
        }
      }
      ASSERT_EQ(pieces.size(), numel.size());
      for (auto& [param, list] : pieces) {
        std::sort(list.begin(), list.end());
        int64_t at = 0;
        for (const auto& [begin, n] : list) {
          EXPECT_EQ(begin, at) << param << ": a gap or an overlap between the ranks' pieces";
          at = begin + n;
        }
        EXPECT_EQ(at, int64_t(numel[param])) << param;
      }
      EXPECT_FALSE(fs::exists(ckpt / "optimizer.safetensors"));
    }
  }
}

TEST(DataParallel, ZeroResumesAtItsLayoutAndReshardsToAnother) {
  const fs::path dir = setup("zero_resume", kQwen3);
  ASSERT_EQ(train(dir, "ref", 2, 2, " --set parallel.zero=1").exit_code, 0);
  // Killed after step 4 (checkpoint at 3): the same layout resumes bitwise; dp = 4 with ZeRO-2 and other buckets,
  // one process without ZeRO (the shards assembled into the whole state) and dp = 2 without ZeRO all continue the
  // same curve.
  EXPECT_NE(train(dir, "run", 2, 2, " --set parallel.zero=1", "LATHE_FAULT_INJECT=after_step:4").exit_code, 0);
  for (const char* copy : {"run4", "one", "plain"}) fs::copy(dir / "run", dir / copy, fs::copy_options::recursive);
  const LatheRun resumed = train(dir, "run", 2, 2, " --set parallel.zero=1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("re-cut"), std::string::npos) << "the same layout is read as it is";
  EXPECT_EQ(losses(dir / "run"), losses(dir / "ref"));  // the whole state came back: bitwise
  expect_continues(dir, "run4", 4, 1, " --set parallel.zero=2" + kSmallBuckets, "re-cut for this run's layout",
                   losses(dir / "ref"), "ZeRO-1 dp 2 -> ZeRO-2 dp 4, other buckets");
  const LatheRun one = train(dir, "one", 0, 4);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  expect_same_curve(losses(dir / "one"), losses(dir / "ref"), "ZeRO-1 dp 2 -> one process");
  const LatheRun plain = train(dir, "plain", 2, 2);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  expect_same_curve(losses(dir / "plain"), losses(dir / "ref"), "ZeRO-1 dp 2 -> dp 2 without ZeRO");
  // And back: a whole state (zero 0, killed after step 4, checkpoint at 3) into ZeRO-1 at dp = 4, against the
  // uninterrupted zero-0 run.
  ASSERT_EQ(train(dir, "whole_ref", 2, 2).exit_code, 0);
  EXPECT_NE(train(dir, "whole", 2, 2, "", "LATHE_FAULT_INJECT=after_step:4").exit_code, 0);
  const LatheRun into = train(dir, "whole", 4, 1, " --set parallel.zero=1");
  ASSERT_EQ(into.exit_code, 0) << into.output;
  expect_same_curve(losses(dir / "whole"), losses(dir / "whole_ref"), "whole state -> ZeRO-1 dp 4");
  const LatheRun lora = train(dir, "x", 2, 2, " --set parallel.zero=1 --set lora.rank=4");
  EXPECT_NE(lora.exit_code, 0);
  EXPECT_NE(lora.output.find("LoRA adapters' states are small and stay replicated"), std::string::npos) << lora.output;
}
