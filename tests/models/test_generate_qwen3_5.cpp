// Decoding of the Qwen3.5 hybrid model through the rollout engine, and its op gated_delta_rule_state.
// References: the op against gdn_recurrent_forward (the plain recurrence with the same initial states; the op's CPU
// kernel is the chunked form); every greedy step's token and log-probability against Qwen35Model::logits of the full
// sequence at that position (the prompt prefilled in chunks of k tokens, or at once), on a random tiny model with
// several GDN and attention layers (conv widths 4, 2 and 1) and on the committed HF fixtures (whose first generated
// token and its log-probability are also checked against transformers' logits); greedy tokens of Generator against
// the argmax of a full forward recomputed each step; `lathe generate` on a fixture folder (greedy tokens against the
// full forward). The engine's batches, preemption and CUDA rows are in test_rollout.cpp.
// Convention: random models use weights of std 0.3 so that logits are spread and greedy ties do not occur.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>

#include "../e2e/lathe_run.h"
#include "io/safetensors.h"
#include "backend/cpu/gdn_reference.h"
#include "model/generate.h"
#include "model/qwen3_5.h"
#include "model/rollout_engine.h"
#include "ops/ops.h"
#include "support/model_support.h"

using namespace lathe;
using namespace lathe::test_support;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = fs::path(LATHE_TEST_DATA_DIR) / "models" / "fixtures" / "qwen3_5";

template <typename V>
int32_t argmax(const V& v) { return int32_t(std::max_element(v.begin(), v.end()) - v.begin()); }

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& x : ids) x = int32_t(rng() % uint32_t(vocab));
  return ids;
}

// 5 layers: GDN, GDN, attention, GDN, attention; H_v = 2 H_k, d_k != d_v; 4 q / 2 kv heads with partial rotary 0.5.
ModelConfig tiny_config(int64_t conv_width = 4) {
  const std::vector<std::string> types = {"linear_attention", "linear_attention", "full_attention", "linear_attention",
                                          "full_attention"};
  nlohmann::json j = {
      {"model_type", "qwen3_5_text"}, {"vocab_size", 48}, {"hidden_size", 32}, {"intermediate_size", 40},
      {"num_hidden_layers", int64_t(types.size())}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
      {"head_dim", 8}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false}, {"layer_types", types},
      {"linear_num_key_heads", 2}, {"linear_num_value_heads", 4}, {"linear_key_head_dim", 8},
      {"linear_value_head_dim", 6}, {"linear_conv_kernel_dim", conv_width}, {"max_position_embeddings", 64},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}}};
  return parse_model_config(j, "test");
}

Qwen35Model random_model(const ModelConfig& c, DType dt, Device d = Device::cpu()) {
  ModelOptions opt;
  opt.dtype = dt;
  opt.device = d;
  return Qwen35Model::random(runtime(), c, opt, 11, 0.3);
}

// Logits (T, V) of the whole sequence as one document, in f64 on the host: row p is the next-token distribution
// after ids[0..p], the reference for the decoding step that ends at p.
std::vector<std::vector<double>> full_logits(Qwen35Model& m, const std::vector<int32_t>& ids) {
  const int32_t n = int32_t(ids.size());
  const PackedBatch b = make_packed_batch(runtime(), m.options().device, ids, {0, n},
                                          std::vector<int32_t>(ids.size(), -100), m.config().vocab_size);
  const std::vector<double> all = to_f64(m.logits(b));
  const size_t v = size_t(m.config().vocab_size);
  std::vector<std::vector<double>> rows;
  for (size_t p = 0; p < ids.size(); ++p) rows.emplace_back(all.begin() + long(p * v), all.begin() + long((p + 1) * v));
  return rows;
}

// Greedy decoding of `prompt` through the rollout engine, its prompt prefilled in chunks of at most `chunk` tokens:
// every token is the argmax of the full forward over the sequence so far and its log-probability is within `tol` of
// that row's log-softmax. Returns the worst log-probability gap.
double check_decoding(Qwen35Model& m, const std::vector<int32_t>& prompt, int64_t steps, int64_t chunk, double tol) {
  EngineOptions eo;
  eo.block_size = 2;  // many blocks, so the sequence's table grows while decoding
  eo.max_step_tokens = chunk;
  const RolloutResult out = engine_greedy(m, prompt, steps, eo);
  EXPECT_EQ(int64_t(out.tokens.size()), steps);
  std::vector<int32_t> seq = prompt;
  double worst = 0;
  for (size_t s = 0; s < out.tokens.size(); ++s) {
    const std::vector<double> row = full_logits(m, seq).back();
    const int32_t want = argmax(row);
    EXPECT_EQ(out.tokens[s], want) << "step " << s << " (chunk " << chunk << ")";
    const double gap = std::abs(out.logprobs[s] - log_softmax_at(row, want));
    worst = std::max(worst, gap);
    EXPECT_LT(gap, tol) << "step " << s << " (chunk " << chunk << ")";
    seq.push_back(want);
  }
  return worst;
}

}  // namespace

TEST(GdnStateOp, MatchesRecurrentReferenceWithInitialStates) {
  const GdnDims dims{2, 4, 8, 6, 0.0};
  const std::vector<int32_t> cu = {0, 5, 6, 6, 19};  // documents of 5, 1, 0 and 13 tokens
  const int64_t t = cu.back(), n = int64_t(cu.size()) - 1;
  std::mt19937_64 rng(3);
  auto draw = [&](int64_t count, double lo, double hi) {
    std::uniform_real_distribution<double> u(lo, hi);
    std::vector<double> out(static_cast<size_t>(count));
    for (double& x : out) x = u(rng);
    return out;
  };
  const std::vector<double> q = draw(t * 2 * 8, -0.35, 0.35), k = draw(t * 2 * 8, -0.35, 0.35);
  const std::vector<double> v = draw(t * 4 * 6, -2, 2), g = draw(t * 4, -1.5, -0.001), beta = draw(t * 4, 0.001, 1);
  const std::vector<double> s0 = draw(n * 4 * 8 * 6, -1, 1);
  const GdnOutputs<double> ref = gdn_recurrent_forward<double>(dims, {q, k, v, g, beta, cu, s0});

  Runtime& rt = runtime();
  ExecContext cx = rt.context(Device::cpu());
  auto host = [&](const std::vector<double>& x, Shape s) { return rt.from_host(x.data(), s, DType::F64, Device::cpu()); };
  const Tensor cu_t = rt.from_host(cu.data(), {n + 1}, DType::I32, Device::cpu());
  for (int64_t chunk : {int64_t(4), int64_t(64)}) {
    SCOPED_TRACE(chunk);
    const std::vector<Tensor> out =
        gated_delta_rule_state(cx, host(q, {t, 2, 8}), host(k, {t, 2, 8}), host(v, {t, 4, 6}), host(g, {t, 4}),
                               host(beta, {t, 4}), cu_t, host(s0, {n, 4, 8, 6}), GatedDeltaAttrs{0.0, chunk});
    EXPECT_LT(rel_l2(to_f64(out[0]), ref.o), 1e-12);
    EXPECT_LT(rel_l2(to_f64(out[1]), ref.final_state), 1e-12);
    // The empty document's final state is its initial state, exactly.
    const std::vector<double> fin = to_f64(out[1]);
    const size_t doc = 4 * 8 * 6;
    EXPECT_TRUE(std::equal(fin.begin() + 2 * doc, fin.begin() + 3 * doc, s0.begin() + 2 * doc));
  }
  // Bad states are refused by name.
  const size_t per = 4 * 8 * 6;
  auto expect_error = [&](const Tensor& state, const std::string& needle) {
    try {
      gated_delta_rule_state(cx, host(q, {t, 2, 8}), host(k, {t, 2, 8}), host(v, {t, 4, 6}), host(g, {t, 4}),
                             host(beta, {t, 4}), cu_t, state);
      ADD_FAILURE() << "accepted a state " << state.describe();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(host(s0, {n, 4, 6, 8}), "state (N, H_v, d_k, d_v)");
  expect_error(host(std::vector<double>(3 * per, 0.0), {3, 4, 8, 6}), "for 4 documents");
  expect_error(cast(cx, host(s0, {n, 4, 8, 6}), DType::F32), "needs the state in f64");
}

TEST(Qwen35Decode, EveryStepMatchesTheFullForward) {
  const ModelConfig c = tiny_config();
  const std::vector<int32_t> prompt = random_ids(8, c.vocab_size, 1);
  for (const auto& [dtype, tol] : {std::pair{DType::F64, 1e-9}, std::pair{DType::F32, 1e-4}}) {
    SCOPED_TRACE(dtype_name(dtype));
    Qwen35Model m = random_model(c, dtype);
    double worst = 0;
    for (int64_t chunk : {int64_t(3), int64_t(1), int64_t(64)}) {  // prefill in chunks; a token a step; all at once
      SCOPED_TRACE(chunk);
      worst = std::max(worst, check_decoding(m, prompt, 12, chunk, tol));
    }
    std::printf("[ %s ] worst log-probability gap of decoding against the full forward: %.2e\n",
                std::string(dtype_name(dtype)).c_str(), worst);
  }
}

// A conv of width 1 has no history to keep; width 2 keeps one row.
TEST(Qwen35Decode, ConvWidthsOneAndTwo) {
  for (int64_t width : {1, 2}) {
    SCOPED_TRACE(width);
    const ModelConfig c = tiny_config(width);
    Qwen35Model m = random_model(c, DType::F64);
    check_decoding(m, random_ids(5, c.vocab_size, 4), 6, 3, 1e-9);
  }
}

TEST(Qwen35Decode, GreedyGeneratorMatchesRecompute) {
  const ModelConfig c = tiny_config();
  Qwen35Model m = random_model(c, DType::F32);
  Generator gen(runtime(), m, nullptr);
  const std::vector<int32_t> prompt = random_ids(6, c.vocab_size, 5);
  GenerateOptions o;
  o.max_new_tokens = 16;
  const GenerateResult r = gen.generate(prompt, o);
  ASSERT_EQ(r.tokens.size(), 16u);
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  std::vector<int32_t> seq = prompt;
  for (int32_t t : r.tokens) {
    EXPECT_EQ(t, argmax(full_logits(m, seq).back())) << "after " << seq.size() << " tokens";
    seq.push_back(t);
  }
  // Generating again gives the same tokens; sampling is seeded.
  EXPECT_EQ(gen.generate(prompt, o).tokens, r.tokens);
  o.sampling = {1.0, 0, 1.0};
  o.seed = 3;
  EXPECT_EQ(gen.generate(prompt, o).tokens, gen.generate(prompt, o).tokens);
}

// The committed HF fixtures: the first token generated after document 1 is the argmax of transformers' logits there,
// with transformers' log-probability, and decoding further matches the full forward.
TEST(Qwen35Decode, MatchesOnHfFixtures) {
  ASSERT_TRUE(fs::exists(kFixtures)) << "fixtures missing: " << kFixtures << " (made by dev/ref/qwen3_5_fixtures.py)";
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    if (!entry.is_directory()) continue;
    SCOPED_TRACE(entry.path().filename().string());
    const io::SafetensorsFile ref = io::SafetensorsFile::open((entry.path() / "reference.safetensors").string());
    std::vector<int32_t> ids(size_t(ref.get("input_ids").numel)), cu(size_t(ref.get("cu_seqlens").numel));
    ref.read_into("input_ids", DType::I32, ids.data(), ids.size() * 4);
    ref.read_into("cu_seqlens", DType::I32, cu.data(), cu.size() * 4);
    const std::vector<float> golden = ref.read_as_f32("logits");  // (T, V)
    for (const auto& [dtype, tol] : {std::pair{DType::F64, 1e-9}, std::pair{DType::F32, 1e-4}}) {
      SCOPED_TRACE(dtype_name(dtype));
      ModelOptions opt;
      opt.dtype = dtype;
      Qwen35Model m = Qwen35Model::load(runtime(), (entry.path() / "model").string(), opt);
      const int64_t vocab = m.config().vocab_size;
      const std::vector<int32_t> doc(ids.begin() + cu[1], ids.begin() + cu[2]);
      const std::vector<float> want(golden.begin() + (cu[2] - 1) * vocab, golden.begin() + cu[2] * vocab);
      const RolloutResult out = engine_greedy(m, doc, 1);
      ASSERT_EQ(out.tokens.size(), 1u);
      const double vs_hf = std::abs(out.logprobs[0] - log_softmax_at(want, argmax(want)));
      EXPECT_EQ(out.tokens[0], argmax(want));
      EXPECT_LT(vs_hf, dtype == DType::F64 ? 1e-6 : 1e-5);
      const double worst =
          std::max(check_decoding(m, doc, 12, int64_t(doc.size()), tol), check_decoding(m, doc, 12, 1, tol));
      std::printf("[ %s %s ] first token's log-probability vs transformers %.2e, worst step vs full forward %.2e\n",
                  entry.path().filename().string().c_str(), std::string(dtype_name(dtype)).c_str(), vs_hf, worst);
    }
    ++checked;
  }
  EXPECT_GE(checked, 4);
}

// `lathe generate` reads a qwen3_5 folder: its greedy tokens equal the argmax of the full forward at each step.
TEST(Qwen35GenerateCli, GreedyTokensMatchTheFullForward) {
  const fs::path dir = kFixtures / "hv_gt_hk_untied" / "model";
  const lathe_e2e::LatheRun run = lathe_e2e::lathe("generate --model " + dir.string() +
                                                   " --prompt-tokens 3,1,4,1,5 --max-new-tokens 8 --print-tokens "
                                                   "--ignore-eos --dtype f64");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const size_t at = run.output.find("{\"completion\"");
  ASSERT_NE(at, std::string::npos) << run.output;
  const nlohmann::json result = nlohmann::json::parse(run.output.substr(at, run.output.find('\n', at) - at));
  const std::vector<int32_t> tokens = result["tokens"].get<std::vector<int32_t>>();
  ASSERT_EQ(tokens.size(), 8u);
  ModelOptions opt;
  opt.dtype = DType::F64;
  Qwen35Model m = Qwen35Model::load(runtime(), dir.string(), opt);
  std::vector<int32_t> seq = {3, 1, 4, 1, 5};
  for (int32_t t : tokens) {
    EXPECT_EQ(t, argmax(full_logits(m, seq).back())) << "after " << seq.size() << " tokens";
    seq.push_back(t);
  }
  // A folder without a PEFT adapter is refused by name (the adapter path itself: tests/e2e/test_train_qwen3_5.cpp).
  const lathe_e2e::LatheRun refused = lathe_e2e::lathe("generate --model " + dir.string() +
                                                       " --prompt-tokens 3 --adapter " + dir.string());
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("adapter_config.json"), std::string::npos) << refused.output;
}

// `lathe generate --input` runs the rollout engine: three token lines of different lengths, two samples each, at most
// two sequences at once; greedy, so every sample's tokens are the argmax chain of the full forward from its prompt and
// its log-probs that forward's log-softmax; two lines per input line, in input order (no tokenizer here: no "text").
TEST(Qwen35GenerateCli, InputLinesGenerateTogetherAsEachAlone) {
  const fs::path dir = kFixtures / "hv_gt_hk_untied" / "model";
  const fs::path work = fs::temp_directory_path() / "lathe_test_generate_input";
  fs::remove_all(work);
  fs::create_directories(work);
  const std::vector<std::vector<int32_t>> prompts = {{3, 1, 4, 1, 5}, {2}, {7, 7, 0, 9, 2, 6, 5, 3, 1}};
  {
    std::ofstream f(work / "in.jsonl");
    for (const auto& p : prompts) f << nlohmann::json{{"tokens", p}}.dump() << "\n";
  }
  const lathe_e2e::LatheRun run = lathe_e2e::lathe(
      "generate --model " + dir.string() + " --input " + (work / "in.jsonl").string() + " --output " +
      (work / "out.jsonl").string() + " --n 2 --max-new-tokens 6 --ignore-eos --dtype f64 --max-running 2");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ModelOptions opt;
  opt.dtype = DType::F64;
  Qwen35Model m = Qwen35Model::load(runtime(), dir.string(), opt);
  std::ifstream in(work / "out.jsonl");
  std::string line;
  for (const auto& prompt : prompts)
    for (int sample = 0; sample < 2; ++sample) {
      ASSERT_TRUE(std::getline(in, line)) << "fewer lines than prompts x 2";
      const nlohmann::json j = nlohmann::json::parse(line);
      EXPECT_FALSE(j.contains("text"));
      EXPECT_EQ(j["finish_reason"], "length");
      const std::vector<int32_t> tokens = j["tokens"].get<std::vector<int32_t>>();
      const std::vector<double> logprobs = j["logprobs"].get<std::vector<double>>();
      ASSERT_EQ(tokens.size(), 6u);
      ASSERT_EQ(logprobs.size(), 6u);
      std::vector<int32_t> seq = prompt;
      for (size_t k = 0; k < tokens.size(); ++k) {
        const std::vector<double> row = full_logits(m, seq).back();
        EXPECT_EQ(tokens[k], argmax(row)) << "prompt of " << prompt.size() << ", token " << k;
        const double mx = *std::max_element(row.begin(), row.end());
        double sum = 0;
        for (double x : row) sum += std::exp(x - mx);
        EXPECT_NEAR(logprobs[k], row[size_t(tokens[k])] - mx - std::log(sum), 1e-9);
        seq.push_back(tokens[k]);
      }
    }
  EXPECT_FALSE(std::getline(in, line)) << "more lines than prompts x 2: " << line;
  EXPECT_NE(run.output.find("prompt tokens shared"), std::string::npos) << run.output;
  fs::remove_all(work);
}
