// The rollout engine (model/rollout_engine.h) on the CPU in f64, for every family (qwen3, qwen3_moe, qwen3_5, qwen3_next,
// qwen3_5_moe_text): a batch of prompts of mixed lengths generated at once — with small blocks, a step budget that
// prefills the longest prompt in chunks, fewer running slots than sequences, and a cache so small that sequences are
// preempted — against the reference of each prompt alone without any cache: the argmax of the model's full forward
// (CausalLm::logits) over the prompt and the tokens so far, recomputed at every step, and the log-softmax of that row
// at the token. Seeded sampling is the same whatever else is in the batch. Bad requests are refused with their reason.
// Convention: random models use weights of std 0.3 so that logits are spread and greedy ties do not occur.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "model/config.h"
#include "model/rollout_engine.h"
#include "support/model_support.h"
#include "model/lora.h"
#include "support/lora_support.h"
#include "support/moe_support.h"

using namespace lathe;
using namespace lathe::test_support;

namespace {

nlohmann::json tiny_json(const std::string& type) {
  if (type == "qwen3")
    return {{"model_type", "qwen3"}, {"vocab_size", 40}, {"hidden_size", 24}, {"intermediate_size", 32},
            {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
            {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", true}, {"max_position_embeddings", 128}};
  if (type == "qwen3_5")  // GDN, attention, GDN; H_v = 2 H_k, d_k != d_v
    return {{"model_type", "qwen3_5_text"}, {"vocab_size", 40}, {"hidden_size", 24}, {"intermediate_size", 32},
            {"num_hidden_layers", 3}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
            {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false},
            {"layer_types", {"linear_attention", "full_attention", "linear_attention"}}, {"linear_num_key_heads", 2},
            {"linear_num_value_heads", 4}, {"linear_key_head_dim", 8}, {"linear_value_head_dim", 6},
            {"linear_conv_kernel_dim", 4}, {"max_position_embeddings", 128},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}}};
  nlohmann::json j = tiny_moe_json(type);
  j["max_position_embeddings"] = 128;
  return j;
}

std::unique_ptr<CausalLm> tiny_model(const std::string& type, Device device = Device::cpu(), DType dtype = DType::F64) {
  ModelOptions opt;
  opt.dtype = dtype;
  opt.device = device;
  return random_causal_lm(runtime(), parse_model_config(tiny_json(type), "test"), opt, 5, 0.3);
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& x : ids) x = int32_t(rng() % uint32_t(vocab));
  return ids;
}

// Greedy generation of one prompt without a cache: each token the argmax of the full forward's last row, with its
// log-softmax.
std::pair<std::vector<int32_t>, std::vector<double>> reference_greedy(CausalLm& m, std::vector<int32_t> ids,
                                                                      int64_t new_tokens) {
  const int64_t v = m.config().vocab_size;
  std::vector<int32_t> out;
  std::vector<double> logprobs;
  for (int64_t k = 0; k < new_tokens; ++k) {
    const int32_t n = int32_t(ids.size());
    const PackedBatch b =
        make_packed_batch(runtime(), Device::cpu(), ids, {0, n}, std::vector<int32_t>(ids.size(), -100), v);
    const std::vector<double> all = to_f64(m.logits(b));
    const double* row = all.data() + (ids.size() - 1) * size_t(v);
    const int32_t best = int32_t(std::max_element(row, row + v) - row);
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(row[j] - row[best]);
    out.push_back(best);
    logprobs.push_back(-std::log(sum));
    ids.push_back(best);
  }
  return {out, logprobs};
}

// The log-softmax of the model's full forward (on the model's device, in its dtype) at each generated token of one
// sample: what the trainer computes for the same sequence.
std::vector<double> forward_logprobs(CausalLm& m, Device device, std::vector<int32_t> ids,
                                     const std::vector<int32_t>& generated) {
  const int64_t v = m.config().vocab_size;
  const size_t first = ids.size() - 1;  // the row that predicts the first generated token
  ids.insert(ids.end(), generated.begin(), generated.end());
  const int32_t n = int32_t(ids.size());
  const PackedBatch b = make_packed_batch(runtime(), device, ids, {0, n}, std::vector<int32_t>(ids.size(), -100), v);
  const std::vector<double> all = to_f64(m.logits(b));
  std::vector<double> out;
  for (size_t k = 0; k < generated.size(); ++k) {
    const double* row = all.data() + (first + k) * size_t(v);
    const double top = *std::max_element(row, row + v);
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(row[j] - top);
    out.push_back(row[generated[k]] - top - std::log(sum));
  }
  return out;
}

class RolloutFamilies : public ::testing::TestWithParam<std::string> {};

// Five prompts (1 to 37 tokens) of 9 new tokens each, greedy: every engine configuration gives each prompt's reference
// tokens, and log-probs within 1e-10.
TEST_P(RolloutFamilies, GreedyBatchEqualsEachPromptAloneWithoutACache) {
  const std::unique_ptr<CausalLm> m = tiny_model(GetParam());
  const int64_t v = m->config().vocab_size, new_tokens = 9;
  const std::vector<int64_t> lengths = {5, 37, 1, 12, 20};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::pair<std::vector<int32_t>, std::vector<double>>> want;
  for (size_t i = 0; i < lengths.size(); ++i) {
    prompts.push_back(random_ids(lengths[i], v, 100 + i));
    want.push_back(reference_greedy(*m, prompts.back(), new_tokens));
  }
  struct Config {
    const char* what;
    EngineOptions options;
    bool expect_preemption;
  };
  std::vector<Config> configs = {{"roomy", {}, false},          {"chunks", {}, false},       {"preempted", {}, true},
                                 {"padded", {}, false},         {"padded chunks", {}, false}, {"padded preempted", {}, true}};
  configs[1].options.block_size = 4;
  configs[1].options.max_step_tokens = 16;  // the 37- and 20-token prompts prefill in chunks
  configs[1].options.max_running = 3;       // two prompts wait for a slot
  configs[2].options.block_size = 4;
  configs[2].options.max_step_tokens = 24;
  configs[2].options.cache_blocks = 14;     // 56 tokens: the five sequences (111 tokens at the end) cannot all stay
  // The same with decode steps padded to fixed shapes (batch 1, 2, 4 or 8; table widths 1 to 16): what a graph replays.
  for (size_t k = 3; k < 6; ++k) {
    configs[k].options = configs[k - 3].options;
    configs[k].options.graphs = StepGraphs::kPadded;
  }
  configs[0].options.time_forwards = true;  // timing the decode steps changes nothing
  for (const Config& cfg : configs) {
    RolloutEngine engine(runtime(), *m, cfg.options);
    for (const auto& p : prompts) {
      RolloutRequest r;
      r.prompt = p;
      r.max_new_tokens = new_tokens;
      engine.submit(r);
    }
    const std::vector<RolloutResult> got = engine.run();
    ASSERT_EQ(got.size(), prompts.size()) << cfg.what;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].request, int64_t(i)) << cfg.what;
      EXPECT_EQ(got[i].tokens, want[i].first) << cfg.what << " prompt " << i;
      ASSERT_EQ(got[i].logprobs.size(), want[i].second.size()) << cfg.what;
      for (size_t k = 0; k < got[i].logprobs.size(); ++k)
        EXPECT_NEAR(got[i].logprobs[k], want[i].second[k], 1e-10) << cfg.what << " prompt " << i << " token " << k;
      EXPECT_EQ(got[i].finish_reason, FinishReason::kLength);
    }
    EXPECT_EQ(engine.stats().preemptions > 0, cfg.expect_preemption)
        << cfg.what << ": " << engine.stats().preemptions << " preemptions";
    if (cfg.options.max_running == 3) EXPECT_LE(engine.stats().peak_running, 3);
    EXPECT_EQ(engine.stats().padded_steps > 0, cfg.options.graphs == StepGraphs::kPadded) << cfg.what;
    EXPECT_EQ(engine.stats().eager_decode_steps > 0, cfg.options.time_forwards) << cfg.what;
  }
}

// Three samples of each of three prompts (6, 13 and 1 tokens), 7 new tokens: with prefix sharing the prompt of each
// request is computed once (the step tokens drop by (n - 1) x its length, which shared_prompt_tokens counts) and every
// sample draws the same tokens as without sharing, also under a cache so small that samples are preempted and forks
// find no room; greedy samples all equal the cache-free reference.
TEST_P(RolloutFamilies, GroupSamplesShareTheirPromptComputedOnce) {
  const std::unique_ptr<CausalLm> m = tiny_model(GetParam());
  const int64_t v = m->config().vocab_size;
  const std::vector<int64_t> lengths = {6, 13, 1};
  const auto run = [&](EngineOptions o, SamplingOptions sampling, EngineStats* stats = nullptr) {
    RolloutEngine e(runtime(), *m, o);
    for (size_t i = 0; i < lengths.size(); ++i) {
      RolloutRequest r;
      r.prompt = random_ids(lengths[i], v, 300 + i);
      r.n = 3;
      r.max_new_tokens = 7;
      r.sampling = sampling;
      r.seed = 77 + i;
      e.submit(r);
    }
    std::vector<RolloutResult> out = e.run();
    if (stats) *stats = e.stats();
    return out;
  };
  EngineOptions unshared, shared, cramped;
  unshared.block_size = shared.block_size = cramped.block_size = 4;
  unshared.share_prefixes = false;
  cramped.cache_blocks = 9;  // 36 tokens for nine sequences of up to 20
  cramped.max_step_tokens = 12;
  cramped.graphs = StepGraphs::kPadded;  // and decode steps padded to fixed shapes
  EngineStats a, b, c;
  // A repetition penalty (penalize_rows, then sample_rows) and top-k, top-p and min-p (sample_rows), followers from
  // their leader's row.
  SamplingOptions penalised, device_drawn, greedy_options;
  penalised.temperature = device_drawn.temperature = 0.9;
  penalised.top_k = 10;
  penalised.repetition_penalty = 1.2;
  device_drawn.min_p = 0.1;
  device_drawn.top_k = 12;
  device_drawn.top_p = 0.9;
  greedy_options.temperature = 0.0;
  for (const SamplingOptions& so : {penalised, device_drawn}) {
    const std::vector<RolloutResult> want = run(unshared, so, &a);
    const std::vector<RolloutResult> got = run(shared, so, &b);
    const std::vector<RolloutResult> tight = run(cramped, so, &c);
    ASSERT_EQ(want.size(), 9u);
    ASSERT_EQ(got.size(), 9u);
    ASSERT_EQ(tight.size(), 9u);
    for (size_t k = 0; k < want.size(); ++k) {
      EXPECT_EQ(got[k].tokens, want[k].tokens) << "request " << got[k].request << " sample " << got[k].sample;
      EXPECT_EQ(tight[k].tokens, want[k].tokens)
          << "cramped: request " << tight[k].request << " sample " << tight[k].sample;
    }
    EXPECT_NE(want[0].tokens, want[1].tokens) << "two samples of one request drew the same tokens";
  }
  EXPECT_EQ(a.shared_prompt_tokens, 0);
  EXPECT_EQ(b.shared_prompt_tokens, 2 * (6 + 13 + 1));
  EXPECT_EQ(b.step_tokens, a.step_tokens - 2 * (6 + 13 + 1));
  EXPECT_GT(c.preemptions, 0);
  EXPECT_GT(c.padded_steps, 0);
  const std::vector<RolloutResult> greedy = run(shared, greedy_options);
  for (const RolloutResult& r : greedy) {
    const std::vector<int32_t> prompt = random_ids(lengths[size_t(r.request)], v, 300 + uint64_t(r.request));
    EXPECT_EQ(r.tokens, reference_greedy(*m, prompt, 7).first)
        << "greedy request " << r.request << " sample " << r.sample;
  }
}

// Adapters per request: two LoRA adapters (different targets and ranks) in a bank attached to the base model, and
// requests for adapter 0, adapter 1 and the base alone, mixed in one engine (two samples each, small blocks and step
// budget): each request's greedy tokens equal the cache-free reference of a model with that adapter merged into its
// weights (merge_lora), and its log-probs that model's within 1e-9. Twice: decode steps as eager batches with host
// segments, and at the graphs' fixed shapes (StepGraphs::kPadded, run eagerly here), where each row's adapter is
// gathered on the device (PackedBatch::row_adapters) — except where an adapter targets experts (host segments).
TEST_P(RolloutFamilies, RequestsChooseTheirAdapterInOneBatch) {
  const std::unique_ptr<CausalLm> base = tiny_model(GetParam());
  const int64_t v = base->config().vocab_size;
  LoraBank bank(runtime(), base->config(), Device::cpu(), DType::F64,
                {lora(4, 8, {"all-linear"}), lora(2, 2, {"q_proj", "v_proj", "down_proj"})});
  randomise(bank, 0, 1, 0.2);
  randomise(bank, 1, 2, 0.2);
  base->attach_lora(&bank);
  std::vector<std::unique_ptr<CausalLm>> merged;
  for (int a = 0; a < 2; ++a) {
    merged.push_back(tiny_model(GetParam()));
    merge_lora(*merged.back(), bank, a);
  }
  const std::vector<int> adapters = {0, 1, -1, 1, 0};
  for (StepGraphs graphs : {StepGraphs::kOff, StepGraphs::kPadded}) {
    SCOPED_TRACE(graphs == StepGraphs::kOff ? "eager" : "padded");
    EngineOptions o;
    o.block_size = 4;
    o.max_step_tokens = 10;
    o.graphs = graphs;
    RolloutEngine e(runtime(), *base, o);
    for (size_t i = 0; i < adapters.size(); ++i) {
      RolloutRequest r;
      r.prompt = random_ids(3 + int64_t(i) * 4, v, 400 + i);
      r.max_new_tokens = 6;
      r.n = 2;
      r.adapter = adapters[i];
      e.submit(r);
    }
    const std::vector<RolloutResult> got = e.run();
    ASSERT_EQ(got.size(), 2 * adapters.size());
    for (const RolloutResult& r : got) {
      const int a = adapters[size_t(r.request)];
      base->attach_lora(nullptr);  // the reference of the base runs without the bank
      CausalLm& ref = a < 0 ? *base : *merged[size_t(a)];
      const auto want = reference_greedy(ref, random_ids(3 + r.request * 4, v, 400 + uint64_t(r.request)), 6);
      base->attach_lora(&bank);
      EXPECT_EQ(r.tokens, want.first) << "request " << r.request << " (adapter " << a << ") sample " << r.sample;
      for (size_t k = 0; k < r.logprobs.size() && k < want.second.size(); ++k)
        EXPECT_NEAR(r.logprobs[k], want.second[k], 1e-9) << "request " << r.request << " token " << k;
    }
    if (graphs == StepGraphs::kPadded && !bank.adapts_experts()) EXPECT_GT(e.stats().padded_steps, 0);
    RolloutRequest bad;
    bad.prompt = {1};
    bad.adapter = 2;
    EXPECT_THROW(e.submit(bad), Error);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, RolloutFamilies,
                         ::testing::Values("qwen3", "qwen3_moe", "qwen3_5", "qwen3_next", "qwen3_5_moe_text"));

// The engine on CUDA (f32 and bf16 models of the same weights; every family) against the CPU f32 engine: a batch of
// prompts, chunked prefill and a shared group prompt; greedy tokens equal in f32 (logits spread by std 0.3 weights, so
// no near-ties), and the log-probs within 1e-4. In bf16 the engine's log-probs of its own tokens are checked against
// the bf16 full forward of the same sequences on the GPU (the train-rollout gap, printed; within 0.1), and the first
// token of each sample must equal the CPU's for the dense families. For the MoE families a bf16 router may pick
// another expert than f32 does (seen on the H200: one prompt in each MoE family), so their first token may differ
// from the f32 CPU's. Skips without a GPU.
TEST_P(RolloutFamilies, CudaMatchesTheCpu) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  const auto prompt = [&](CausalLm& m, uint64_t i) {
    return random_ids(3 + int64_t(i) * 9, m.config().vocab_size, 500 + i);
  };
  const auto generate = [&](CausalLm& m) {
    EngineOptions o;
    o.block_size = 4;
    o.max_step_tokens = 16;
    RolloutEngine e(runtime(), m, o);
    for (uint64_t i = 0; i < 4; ++i) {
      RolloutRequest r;
      r.prompt = prompt(m, i);
      r.max_new_tokens = 8;
      r.n = i == 1 ? 3 : 1;
      e.submit(r);
    }
    return e.run();
  };
  const std::unique_ptr<CausalLm> cpu = tiny_model(GetParam(), Device::cpu(), DType::F32);
  const std::vector<RolloutResult> want = generate(*cpu);
  const bool moe = cpu->config().num_experts > 0;
  for (DType dt : {DType::F32, DType::BF16}) {
    const std::unique_ptr<CausalLm> gpu = tiny_model(GetParam(), Device::cuda(0), dt);
    const std::vector<RolloutResult> got = generate(*gpu);
    ASSERT_EQ(got.size(), want.size());
    double gap_sum = 0, gap_max = 0;
    size_t gaps = 0;
    for (size_t k = 0; k < want.size(); ++k) {
      const std::string what = fmt::format("{} request {} sample {}", dtype_name(dt), got[k].request, got[k].sample);
      ASSERT_FALSE(got[k].tokens.empty()) << what;
      if (dt == DType::F32) {
        EXPECT_EQ(got[k].tokens, want[k].tokens) << what;
        for (size_t t = 0; t < want[k].logprobs.size() && t < got[k].logprobs.size(); ++t)
          EXPECT_NEAR(got[k].logprobs[t], want[k].logprobs[t], 1e-4) << what << " token " << t;
        continue;
      }
      if (!moe) EXPECT_EQ(got[k].tokens[0], want[k].tokens[0]) << what;
      const std::vector<double> trainer =
          forward_logprobs(*gpu, Device::cuda(0), prompt(*gpu, uint64_t(got[k].request)), got[k].tokens);
      for (size_t t = 0; t < trainer.size(); ++t) {
        const double gap = std::abs(got[k].logprobs[t] - trainer[t]);
        gap_sum += gap;
        gap_max = std::max(gap_max, gap);
        ++gaps;
        EXPECT_LT(gap, 0.1) << what << " token " << t;
      }
    }
    if (gaps > 0)
      std::printf("%s bf16: engine against the full forward over %zu tokens: mean |gap| %.4f, max %.4f\n",
                  GetParam().c_str(), gaps, gap_sum / double(gaps), gap_max);
  }
}

// Decode steps as recorded CUDA graphs (StepGraphs::kOn) against the same engine without them (kOff), f32 on the GPU:
// nine sequences of mixed prompt lengths that finish at different lengths (so the batch shrinks through several padded
// sizes), a shared group prompt, a cache small enough to preempt, greedy and device-sampled requests: the same tokens,
// log-probs within 1e-5; graphs were recorded and replayed, for every family (the mixture-of-experts ones since session
// 27: a decoding step routes on the device, grouped_matmul_routed). Skips without a GPU.
TEST_P(RolloutFamilies, CudaGraphsEqualEagerSteps) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  const std::unique_ptr<CausalLm> m = tiny_model(GetParam(), Device::cuda(0), DType::F32);
  const auto generate = [&](StepGraphs graphs, EngineStats* stats) {
    EngineOptions o;
    o.block_size = 4;
    o.max_step_tokens = 20;
    o.cache_blocks = 40;
    o.graphs = graphs;
    RolloutEngine e(runtime(), *m, o);
    for (uint64_t i = 0; i < 6; ++i) {
      RolloutRequest r;
      r.prompt = random_ids(1 + int64_t(i) * 5, m->config().vocab_size, 700 + i);
      r.max_new_tokens = 6 + int64_t(i) * 3;
      r.n = i == 2 ? 4 : 1;
      if (i % 2 == 1) {
        r.sampling.temperature = 0.8;
        r.sampling.min_p = 0.05;
        r.seed = 90 + i;
      }
      e.submit(r);
    }
    std::vector<RolloutResult> out = e.run();
    *stats = e.stats();
    return out;
  };
  EngineStats eager_stats, graph_stats;
  const std::vector<RolloutResult> want = generate(StepGraphs::kOff, &eager_stats);
  EngineStats auto_stats;  // kAuto records every family (mixture-of-experts models route on the device when decoding)
  generate(StepGraphs::kAuto, &auto_stats);
  EXPECT_GT(auto_stats.graph_replays, 0) << "kAuto";
  const std::vector<RolloutResult> got = generate(StepGraphs::kOn, &graph_stats);
  EXPECT_EQ(eager_stats.graph_replays, 0);
  EXPECT_GT(graph_stats.graphs_recorded, 1);
  EXPECT_GT(graph_stats.graph_replays, graph_stats.graphs_recorded);
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_EQ(got[k].tokens, want[k].tokens) << "request " << got[k].request << " sample " << got[k].sample;
    for (size_t t = 0; t < want[k].logprobs.size() && t < got[k].logprobs.size(); ++t)
      EXPECT_NEAR(got[k].logprobs[t], want[k].logprobs[t], 1e-5) << "request " << got[k].request << " token " << t;
  }
  std::printf("%s: %lld graphs recorded, %lld replays, %lld steps\n", GetParam().c_str(),
              (long long)graph_stats.graphs_recorded, (long long)graph_stats.graph_replays,
              (long long)graph_stats.steps);
}

// Decode graphs serving adapters (session 27): a bank of two adapters on the attention projections attached to the
// CUDA model (f32; the values drawn in an f64 host bank and copied over), requests for adapter 0, adapter 1 and the
// base mixed in one engine, recorded graphs against eager
// steps: the same tokens, log-probs within 1e-5, graphs recorded and replayed (each row's adapter columns gathered on
// the device from a fixed input buffer). Skips without a GPU.
TEST_P(RolloutFamilies, CudaGraphsServeAdapters) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  const std::unique_ptr<CausalLm> m = tiny_model(GetParam(), Device::cuda(0), DType::F32);
  const std::vector<LoraConfig> configs = {lora(4, 8, {"q_proj", "k_proj", "v_proj", "o_proj"}),
                                           lora(2, 2, {"q_proj", "v_proj"})};
  LoraBank bank(runtime(), m->config(), Device::cuda(0), DType::F32, configs);
  LoraBank host(runtime(), m->config(), Device::cpu(), DType::F64, configs);
  ExecContext cpu = runtime().context(Device::cpu()), gpu = runtime().context(Device::cuda(0));
  for (int a = 0; a < 2; ++a) {
    randomise(host, a, 1 + uint64_t(a), 0.2);
    for (size_t i = 0; i < bank.parameters(a).size(); ++i)
      copy_into(gpu, runtime().copy_to(cast(cpu, host.parameters(a)[i].value, DType::F32), Device::cuda(0)),
                bank.parameters(a)[i].value);
  }
  m->attach_lora(&bank);
  const std::vector<int> adapters = {0, 1, -1, 1, 0, -1};
  const auto generate = [&](StepGraphs graphs, EngineStats* stats) {
    EngineOptions o;
    o.block_size = 4;
    o.max_step_tokens = 20;
    o.graphs = graphs;
    RolloutEngine e(runtime(), *m, o);
    for (size_t i = 0; i < adapters.size(); ++i) {
      RolloutRequest r;
      r.prompt = random_ids(1 + int64_t(i) * 5, m->config().vocab_size, 800 + i);
      r.max_new_tokens = 5 + int64_t(i) * 2;
      r.adapter = adapters[i];
      e.submit(r);
    }
    std::vector<RolloutResult> out = e.run();
    *stats = e.stats();
    return out;
  };
  EngineStats eager, replayed;
  const std::vector<RolloutResult> want = generate(StepGraphs::kOff, &eager), got = generate(StepGraphs::kOn, &replayed);
  EXPECT_GT(replayed.graphs_recorded, 0);
  EXPECT_GT(replayed.graph_replays, replayed.graphs_recorded);
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_EQ(got[k].tokens, want[k].tokens) << "request " << got[k].request;
    for (size_t t = 0; t < want[k].logprobs.size() && t < got[k].logprobs.size(); ++t)
      EXPECT_NEAR(got[k].logprobs[t], want[k].logprobs[t], 1e-5) << "request " << got[k].request << " token " << t;
  }
  m->attach_lora(nullptr);
}

// CausalLm::move_parameters (full fine-tuning's KL reference waiting in host memory, rl.reference_offload): a CUDA
// model's parameters go to the host, where they are, and back; its logits are then bit for bit what they were, and
// the parameters that shared a storage (the joined projections) share one again. Skips without a GPU.
TEST(Rollout, CudaParametersMoveToTheHostAndBack) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  const std::unique_ptr<CausalLm> m = tiny_model("qwen3", Device::cuda(0), DType::F32);
  const std::vector<int32_t> ids = random_ids(9, m->config().vocab_size, 3);
  const auto logits = [&] {
    return to_f64(m->logits(make_packed_batch(runtime(), Device::cuda(0), ids, {0, 9}, std::vector<int32_t>(9, -100),
                                              m->config().vocab_size)));
  };
  const auto storages = [&] {
    std::set<const Storage*> s;
    for (const Parameter& p : m->parameters()) s.insert(p.value.storage().get());
    return s.size();
  };
  const std::vector<double> before = logits();
  const size_t shared = storages();
  EXPECT_GT(m->move_parameters(Device::cpu()), 0u);
  for (const Parameter& p : m->parameters()) EXPECT_TRUE(p.value.device().is_cpu()) << p.name;
  EXPECT_EQ(storages(), shared);
  EXPECT_GT(m->move_parameters(Device::cuda(0)), 0u);
  EXPECT_EQ(logits(), before);
  EXPECT_EQ(storages(), shared);
}

// Penalties on the device (penalize_rows): greedy requests with a repetition penalty (1.5), a frequency penalty (0.7)
// and banned ids (including the first token plain greedy picks), in one batch with a sampled request with the same
// penalties: the greedy tokens are those of the rule applied here to the cache-free forward's logits (transformers'
// repetition penalty over the prompt and the response, vLLM's frequency penalty over the response counts, bans at
// -inf, then the argmax), and every token's log-probability is the model's own (the forward's log-softmax, the
// penalty undone) within 1e-9 in f64.
TEST(Rollout, PenaltiesAndBansOnTheDeviceFollowTheRules) {
  const std::unique_ptr<CausalLm> m = tiny_model("qwen3");
  const int64_t v = m->config().vocab_size;
  const double rep = 1.5, freq = 0.7;
  std::vector<int32_t> prompt = random_ids(9, v, 77);
  prompt.insert(prompt.end(), {prompt[0], prompt[0], prompt[3]});  // repeats in the prompt
  const int32_t plain_first = reference_greedy(*m, prompt, 1).first[0];
  const std::vector<int32_t> banned = {plain_first, int32_t(v - 1), 5};
  // The rule, step by step on the full forward.
  std::vector<int32_t> ids = prompt, want;
  for (int k = 0; k < 8; ++k) {
    const int32_t n = int32_t(ids.size());
    const PackedBatch b = make_packed_batch(runtime(), Device::cpu(), ids, {0, n}, std::vector<int32_t>(ids.size(), -100), v);
    const std::vector<double> all = to_f64(m->logits(b));
    std::vector<double> row(all.end() - v, all.end());
    std::set<int32_t> seen(ids.begin(), ids.end());
    for (int32_t id : seen) row[size_t(id)] = row[size_t(id)] > 0 ? row[size_t(id)] / rep : row[size_t(id)] * rep;
    for (size_t i = prompt.size(); i < ids.size(); ++i) row[size_t(ids[i])] -= freq;
    for (int32_t id : banned) row[size_t(id)] = -std::numeric_limits<double>::infinity();
    const int32_t best = int32_t(std::max_element(row.begin(), row.end()) - row.begin());
    want.push_back(best);
    ids.push_back(best);
  }
  RolloutEngine e(runtime(), *m);
  RolloutRequest greedy;
  greedy.prompt = prompt;
  greedy.n = 2;
  greedy.max_new_tokens = 8;
  greedy.sampling.temperature = 0;
  greedy.sampling.repetition_penalty = rep;
  greedy.sampling.frequency_penalty = freq;
  greedy.banned_ids = banned;
  RolloutRequest sampled = greedy;
  sampled.n = 1;
  sampled.sampling.temperature = 0.9;
  sampled.seed = 3;
  e.submit(greedy);
  e.submit(sampled);
  const std::vector<RolloutResult> got = e.run();
  ASSERT_EQ(got.size(), 3u);
  for (const RolloutResult& r : got) {
    if (r.request == 0) EXPECT_EQ(r.tokens, want) << "greedy sample " << r.sample;
    for (int32_t id : r.tokens) EXPECT_TRUE(std::find(banned.begin(), banned.end(), id) == banned.end()) << id;
    const std::vector<double> model = forward_logprobs(*m, Device::cpu(), prompt, r.tokens);
    ASSERT_EQ(r.logprobs.size(), model.size());
    for (size_t k = 0; k < model.size(); ++k) EXPECT_NEAR(r.logprobs[k], model[k], 1e-9) << "request " << r.request;
  }
}

// Sampled (temperature 0.8 with top-k 12 and a repetition penalty, penalised on the device; or with top-k 12, top-p
// 0.9 and min-p 0.05): each request's tokens are the same alone and in a batch with others in another order, and two
// samples of one request differ; a stop id ends a sample with "eos" and is kept.
class SeededSampling : public ::testing::TestWithParam<bool> {};  // true: top-k, top-p and min-p, drawn on the device

TEST_P(SeededSampling, DoesNotDependOnTheBatch) {
  const std::unique_ptr<CausalLm> m = tiny_model("qwen3_5");
  const int64_t v = m->config().vocab_size;
  auto request = [&](uint64_t i) {
    RolloutRequest r;
    r.prompt = random_ids(3 + int64_t(i) * 5, v, 200 + i);
    r.max_new_tokens = 12;
    r.sampling.temperature = 0.8;
    r.sampling.top_k = 12;
    if (GetParam()) r.sampling.min_p = 0.05, r.sampling.top_p = 0.9;
    else r.sampling.repetition_penalty = 1.3;  // penalize_rows first
    r.seed = 1000 + i;
    r.n = 2;
    return r;
  };
  std::vector<std::vector<RolloutResult>> alone;
  for (uint64_t i = 0; i < 3; ++i) {
    RolloutEngine e(runtime(), *m);
    e.submit(request(i));
    alone.push_back(e.run());
  }
  EngineOptions small;
  small.block_size = 4;
  small.max_step_tokens = 7;
  RolloutEngine together(runtime(), *m, small);
  for (uint64_t i : {2u, 0u, 1u}) together.submit(request(i));
  const std::vector<RolloutResult> got = together.run();
  ASSERT_EQ(got.size(), 6u);
  const uint64_t order[] = {2, 0, 1};
  for (size_t k = 0; k < got.size(); ++k) {
    const RolloutResult& want = alone[order[got[k].request]][size_t(got[k].sample)];
    EXPECT_EQ(got[k].tokens, want.tokens) << "request " << got[k].request << " sample " << got[k].sample;
  }
  EXPECT_NE(alone[0][0].tokens, alone[0][1].tokens);
  // At temperature 1 without truncation the sampling distribution is the model's: both log-probs agree (the sampler
  // reads the logits in f32); greedy's is 0, a point mass.
  RolloutRequest plain = request(1);
  plain.sampling = {};
  plain.sampling.temperature = 1.0;
  RolloutEngine p(runtime(), *m);
  p.submit(plain);
  for (const RolloutResult& r : p.run())
    for (size_t k = 0; k < r.tokens.size(); ++k) EXPECT_NEAR(r.sampling_logprobs[k], r.logprobs[k], 1e-5);
  for (double lp : alone[0][0].sampling_logprobs) EXPECT_LE(lp, 0.0);
  // A stop id: the first token sample 0 of request 0 drew, so it stops right there.
  RolloutRequest r = request(0);
  r.stop_ids = {alone[0][0].tokens[0]};
  r.n = 1;
  RolloutEngine e(runtime(), *m);
  e.submit(r);
  const std::vector<RolloutResult> stopped = e.run();
  ASSERT_EQ(stopped.size(), 1u);
  EXPECT_EQ(stopped[0].tokens, std::vector<int32_t>{alone[0][0].tokens[0]});
  EXPECT_EQ(stopped[0].finish_reason, FinishReason::kEos);
}

INSTANTIATE_TEST_SUITE_P(HostAndDevice, SeededSampling, ::testing::Bool(), [](const ::testing::TestParamInfo<bool>& i) {
  return i.param ? "top_k_top_p_min_p" : "repetition_penalty";
});

// The engine reads the model's parameters at every step: after a weight update between batches (every matrix scaled
// in place, as an optimizer step would change them), a new request's greedy tokens are the updated model's cache-free
// reference, not the old one's.
TEST(Rollout, AWeightUpdateBetweenBatchesIsUsed) {
  const std::unique_ptr<CausalLm> m = tiny_model("qwen3_5");
  const int64_t v = m->config().vocab_size;
  RolloutEngine e(runtime(), *m);
  RolloutRequest r;
  r.prompt = random_ids(9, v, 600);
  r.max_new_tokens = 8;
  e.submit(r);
  const std::vector<RolloutResult> before = e.run();
  for (Parameter& p : m->parameters())
    if (p.value.dim() == 2) {
      double* w = p.value.data<double>();
      for (int64_t i = 0; i < p.value.numel(); ++i) w[i] *= (i % 7 == 0) ? -1.3 : 1.1;
    }
  const auto want = reference_greedy(*m, r.prompt, 8);
  e.submit(r);
  const std::vector<RolloutResult> after = e.run();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].tokens, want.first);
  EXPECT_NE(after[0].tokens, before[0].tokens) << "the update should change the greedy tokens of this prompt";
}

// cache_bytes (what RL's handover weighs against the free memory) is what an engine's cache takes: the host
// allocator's bytes while an engine of N blocks lives, for a dense and a hybrid model.
TEST(Rollout, CacheBytesIsWhatTheCacheTakes) {
  for (const std::string type : {"qwen3", "qwen3_5"}) {
    const std::unique_ptr<CausalLm> m = tiny_model(type);
    EngineOptions o;
    o.cache_blocks = 11;
    o.max_running = 5;
    o.graphs = StepGraphs::kOff;
    Allocator& host = runtime().host_allocator();
    const int64_t before = host.stats().allocated;
    const RolloutEngine e(runtime(), *m, o);
    EXPECT_EQ(host.stats().allocated - before, cache_bytes(m->config(), m->options(), o, 11)) << type;
  }
}

// A sequence reaching the model's context ends with "length"; bad requests and impossible caches are refused.
TEST(Rollout, LimitsAndBadRequests) {
  const std::unique_ptr<CausalLm> m = tiny_model("qwen3");
  const int64_t v = m->config().vocab_size;
  RolloutEngine e(runtime(), *m);
  RolloutRequest r;
  r.prompt = random_ids(126, v, 7);
  r.max_new_tokens = 10;
  e.submit(r);
  const std::vector<RolloutResult> got = e.run();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].tokens.size(), 2u);  // 126 + 2 = max_position_embeddings
  EXPECT_EQ(got[0].finish_reason, FinishReason::kLength);
  const auto refused = [&](RolloutEngine& engine, RolloutRequest bad, const std::string& needle) {
    try {
      engine.submit(std::move(bad));
      ADD_FAILURE() << "accepted; expected: " << needle;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
  };
  RolloutRequest empty;
  refused(e, empty, "empty prompt");
  RolloutRequest outside;
  outside.prompt = {1, int32_t(v)};
  refused(e, outside, "outside the vocabulary");
  RolloutRequest too_long;
  too_long.prompt = random_ids(128, v, 8);
  refused(e, too_long, "leaves no room");
  // A cache sized by a fraction of the free memory holds blocks (the machine has some); a fraction of 1 is refused.
  EngineOptions fraction;
  fraction.cache_memory_fraction = 0.001;
  EXPECT_GT(RolloutEngine(runtime(), *m, fraction).cache_blocks(), 0);
  // With what the requests can use given (max_cache_blocks), the fraction takes no more: 3 samples of a 20-token
  // prompt with 13 new tokens each use 3 x ceil(33 / 16) blocks.
  fraction.cache_memory_fraction = 0.5;
  fraction.max_cache_blocks = blocks_needed(fraction, 20, 13, 3);
  EXPECT_EQ(fraction.max_cache_blocks, 9);
  EXPECT_EQ(RolloutEngine(runtime(), *m, fraction).cache_blocks(), 9);
  fraction.max_cache_blocks = 0;
  fraction.cache_memory_fraction = 1.0;
  EXPECT_THROW(RolloutEngine(runtime(), *m, fraction), Error);
  EngineOptions tiny;
  tiny.block_size = 4;
  tiny.cache_blocks = 2;  // 8 tokens
  RolloutEngine small(runtime(), *m, tiny);
  RolloutRequest nine;
  nine.prompt = random_ids(9, v, 9);
  refused(small, nine, "leaves no room");
  RolloutRequest six;
  six.prompt = random_ids(6, v, 10);
  six.max_new_tokens = 5;
  small.submit(six);
  const std::vector<RolloutResult> cut = small.run();
  ASSERT_EQ(cut.size(), 1u);
  EXPECT_EQ(cut[0].tokens.size(), 2u);  // the cache's 8 tokens bound the context
}

}  // namespace
