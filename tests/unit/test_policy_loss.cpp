// The RL policy losses (rl/policy_loss.h): group advantages and aggregation weights by hand; the PPO clip's four
// cases by hand (ratio above and below the range, positive and negative advantage); the KL estimators by known values;
// every term's derivative (token-level with clip-higher and KL, GSPO's sequence ratio) against central finite
// differences of the summed loss; and the model's row-loss head (PackedBatch::row_loss) on a tiny f64 Qwen3: the
// gradients of a GRPO loss against finite differences of the loss, and the on-policy case (old = current log-probs:
// every ratio exactly 1, the loss -sum(w A)); the head's per-row entropy against the full forward's logits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <algorithm>
#include <numeric>
#include <random>

#include "model/config.h"
#include "optim/adamw.h"
#include "rl/policy_loss.h"
#include "rl/rl_batch.h"
#include "support/model_support.h"

using namespace lathe;
using namespace lathe::test_support;

namespace {

double objective(const PolicyTokens& t, const PolicyLossConfig& c, const std::vector<double>& logp) {
  std::vector<double> l(logp.size()), d(logp.size());
  policy_loss(t, c, logp, l, d);
  double sum = 0;
  for (double x : l) sum += x;
  return sum;
}

// A tiny random f64 Qwen3 (2 layers, hidden 16, 2 / 1 heads of 8) of `vocab` ids, weights of std `std`.
std::unique_ptr<CausalLm> tiny_qwen3(int64_t vocab, bool tied, double std) {
  const nlohmann::json j = {{"model_type", "qwen3"}, {"vocab_size", vocab}, {"hidden_size", 16},
                            {"intermediate_size", 24}, {"num_hidden_layers", 2}, {"num_attention_heads", 2},
                            {"num_key_value_heads", 1}, {"head_dim", 8}, {"rms_norm_eps", 1e-6},
                            {"tie_word_embeddings", tied}};
  ModelOptions opt;
  opt.dtype = DType::F64;
  return random_causal_lm(runtime(), parse_model_config(j, "test"), opt, 3, std);
}

}  // namespace

TEST(GroupAdvantages, GrpoAndDrGrpoByHand) {
  const std::vector<double> r = {1, 0, 0, 1, 2, 2, 2, 2};
  const std::vector<double> grpo = group_advantages(r, 4, true, 0.0);
  const double a = 0.5 / std::sqrt(1.0 / 3.0);  // mean 0.5, unbiased std sqrt(1/3)
  EXPECT_NEAR(grpo[0], a, 1e-12);
  EXPECT_NEAR(grpo[1], -a, 1e-12);
  for (size_t i = 4; i < 8; ++i) EXPECT_EQ(grpo[i], 0.0);  // all equal: no signal
  const std::vector<double> dr = group_advantages(r, 4, false);
  EXPECT_EQ(dr[0], 0.5);
  EXPECT_EQ(dr[2], -0.5);
  EXPECT_THROW(group_advantages(r, 3, true), Error);
}

TEST(AggregationWeights, VerlModesByHand) {
  const std::vector<int64_t> seq = {0, 0, 0, 1};  // lengths 3 and 1
  EXPECT_EQ(aggregation_weights(seq, "token-mean"), (std::vector<double>{0.25, 0.25, 0.25, 0.25}));
  const std::vector<double> smtm = aggregation_weights(seq, "seq-mean-token-mean");
  EXPECT_NEAR(smtm[0], 1.0 / 6, 1e-15);
  EXPECT_EQ(smtm[3], 0.5);
  EXPECT_EQ(aggregation_weights(seq, "seq-mean-token-sum"), (std::vector<double>{0.5, 0.5, 0.5, 0.5}));
  EXPECT_EQ(aggregation_weights(seq, "seq-mean-token-sum-norm", 8)[0], 1.0 / 16);
  EXPECT_THROW(aggregation_weights(seq, "mean"), Error);
}

// The clip's four cases with eps_low 0.2, eps_high 0.28 (DAPO's): A = 1, r = 1.5 -> -1.28, no gradient; A = 1,
// r = 0.5 -> -0.5, gradient -0.5; A = -1, r = 1.5 -> 1.5, gradient 1.5; A = -1, r = 0.5 -> 0.8, no gradient.
TEST(PolicyLoss, PpoClipCasesByHand) {
  PolicyTokens t;
  t.sequence = {0, 1, 2, 3};
  t.advantage = {1, 1, -1, -1};
  t.old_logprob = {0, 0, 0, 0};
  t.weight = {1, 1, 1, 1};
  const std::vector<double> logp = {std::log(1.5), std::log(0.5), std::log(1.5), std::log(0.5)};
  PolicyLossConfig c;
  c.clip_low = 0.2;
  c.clip_high = 0.28;
  std::vector<double> l(4), d(4);
  PolicyStats st;
  policy_loss(t, c, logp, l, d, &st);
  const std::vector<double> want_l = {-1.28, -0.5, 1.5, 0.8}, want_d = {0, -0.5, 1.5, 0};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(l[i], want_l[i], 1e-12) << i;
    EXPECT_NEAR(d[i], want_d[i], 1e-12) << i;
  }
  EXPECT_EQ(st.clip_fraction, 0.5);
  EXPECT_NEAR(st.ratio_mean, 1.0, 1e-12);
}

// k1, k2, k3 at logp - ref = 0.3: 0.3, 0.045, exp(-0.3) + 0.3 - 1 (with advantage 0 the term is the KL alone).
TEST(PolicyLoss, KlEstimatorsByKnownValues) {
  PolicyTokens t;
  t.sequence = {0};
  t.advantage = {0};
  t.old_logprob = {-1.0};
  t.ref_logprob = {-1.3};
  t.weight = {1};
  const std::vector<std::pair<KlEstimator, double>> cases = {
      {KlEstimator::k1, 0.3}, {KlEstimator::k2, 0.045}, {KlEstimator::k3, std::exp(-0.3) + 0.3 - 1}};
  for (const auto& [k, want] : cases) {
    PolicyLossConfig c;
    c.kl_coef = 1.0;
    c.kl = k;
    EXPECT_NEAR(objective(t, c, {-1.0}), want, 1e-12);
  }
}

// Every derivative against central differences of the summed loss (h = 1e-6): token level with clip-higher and a k3
// KL (some tokens clipped, some not), and GSPO over three sequences.
TEST(PolicyLoss, DerivativesMatchFiniteDifferences) {
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  PolicyTokens t;
  t.sequence = {0, 0, 0, 1, 1, 2, 2, 2, 2};
  for (size_t i = 0; i < t.sequence.size(); ++i) {
    t.advantage.push_back(t.sequence[i] == 1 ? -0.7 : 0.9);
    t.old_logprob.push_back(-1.0 + 0.3 * u(rng));
    t.ref_logprob.push_back(-1.0 + 0.3 * u(rng));
  }
  t.weight = aggregation_weights(t.sequence, "seq-mean-token-mean");
  std::vector<double> logp;
  for (size_t i = 0; i < t.sequence.size(); ++i) logp.push_back(t.old_logprob[i] + 0.4 * u(rng));
  for (bool gspo : {false, true}) {
    PolicyLossConfig c;
    c.clip_high = 0.28;
    c.sequence_ratio = gspo;
    c.kl_coef = gspo ? 0.0 : 0.1;
    std::vector<double> l(logp.size()), d(logp.size());
    policy_loss(t, c, logp, l, d);
    for (size_t i = 0; i < logp.size(); ++i) {
      std::vector<double> p = logp, m = logp;
      p[i] += 1e-6;
      m[i] -= 1e-6;
      EXPECT_NEAR(d[i], (objective(t, c, p) - objective(t, c, m)) / 2e-6, 1e-7) << (gspo ? "gspo " : "token ") << i;
    }
  }
}

// The model's row-loss head: a tiny f64 Qwen3, two documents whose second halves are the "responses" (labelled), a GRPO
// loss with clip-higher and a k3 KL, old and reference log-probs off the current ones: gradients against finite
// differences of the loss; then old = current log-probs: every ratio is exactly 1 and the loss is -sum(w A).
TEST(PolicyLoss, TheModelsRowLossHeadHasTheLossesGradient) {
  std::unique_ptr<CausalLm> m = tiny_qwen3(40, false, 0.3);
  std::vector<int32_t> ids, labels;
  std::mt19937 rng(9);
  const std::vector<int32_t> cu = {0, 7, 16};
  for (int32_t i = 0; i < 16; ++i) ids.push_back(int32_t(rng() % 40));
  std::vector<int64_t> sequence;
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t i = cu[d]; i < cu[d + 1]; ++i) {
      const bool response = i >= cu[d] + 3 && i + 1 < cu[d + 1];  // predicts the next token of the response
      labels.push_back(response ? ids[size_t(i + 1)] : -100);
      if (response) sequence.push_back(int64_t(d));
    }
  PackedBatch b = make_packed_batch(runtime(), Device::cpu(), ids, cu, labels, 40);
  std::vector<double> current;  // the labelled rows' log-probabilities, in row order (label_logprobs gives every row's)
  const std::vector<double> all = m->label_logprobs(b);
  for (size_t i = 0; i < labels.size(); ++i)
    if (labels[i] != -100) current.push_back(all[i]);
  ASSERT_EQ(current.size(), sequence.size());
  PolicyTokens t;
  t.sequence = sequence;
  for (size_t i = 0; i < sequence.size(); ++i) {
    t.advantage.push_back(sequence[i] == 0 ? 1.1 : -0.6);
    t.old_logprob.push_back(current[i] + (i % 3 == 0 ? 0.3 : -0.05));  // some ratios clipped
    t.ref_logprob.push_back(current[i] - 0.2);
  }
  t.weight = aggregation_weights(sequence, "token-mean");
  PolicyLossConfig c;
  c.clip_high = 0.28;
  c.kl_coef = 0.05;
  const RowLoss loss = [&](std::span<const double> logp, std::span<double> l, std::span<double> d) {
    policy_loss(t, c, logp, l, d);
  };
  b.row_loss = &loss;
  m->zero_grads();
  m->loss(b, true);
  EXPECT_GT(expect_gradients_match_finite_differences(*m, b, 3), 0);
  // On policy: old = current.
  t.old_logprob = current;
  c.kl_coef = 0;
  PolicyStats st;
  const RowLoss on_policy = [&](std::span<const double> logp, std::span<double> l, std::span<double> d) {
    policy_loss(t, c, logp, l, d, &st);
  };
  b.row_loss = &on_policy;
  const LossResult r = m->loss(b, false);
  double want = 0;
  for (size_t i = 0; i < sequence.size(); ++i) want -= t.weight[i] * t.advantage[i];
  EXPECT_EQ(st.ratio_mean, 1.0);
  EXPECT_EQ(st.clip_fraction, 0.0);
  EXPECT_NEAR(r.loss, want, 1e-12);
  // The head's entropy of each labelled row (PackedBatch::row_entropy, the RL loop's `entropy`) against -sum p log p of
  // the full forward's logits at that row, on the host.
  std::vector<double> entropy;
  b.row_entropy = &entropy;
  m->loss(b, false);
  b.row_entropy = nullptr;
  ASSERT_EQ(entropy.size(), sequence.size());
  ExecContext cx = runtime().context(Device::cpu());
  const Tensor logits = runtime().copy_to(cast(cx, m->logits(b), DType::F64), Device::cpu());
  size_t k = 0;
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] == -100) continue;
    const double* row = logits.data<double>() + i * 40;
    double mx = -INFINITY, z = 0, h = 0;
    for (int v = 0; v < 40; ++v) mx = std::max(mx, row[v]);
    for (int v = 0; v < 40; ++v) z += std::exp(row[v] - mx);
    for (int v = 0; v < 40; ++v) {
      const double p = std::exp(row[v] - mx) / z;
      h -= p * std::log(p);
    }
    EXPECT_NEAR(entropy[k++], h, 1e-12) << "row " << i;
  }
}

// GRPO end to end on a tiny f64 Qwen3: the rollout engine samples 8 responses of 3 tokens for each of 2 prompts
// (temperature 1), the reward is the fraction of response tokens equal to id 5, group-normalised advantages, the
// batch of prompts + responses (make_rl_batch) trained with the clipped loss (token-mean, the rollout's log-probs as
// the old policy) and AdamW, 12 rounds: the mean reward of the last rounds is well above the first's; and the first
// round is on policy (every ratio 1, nothing clipped).
TEST(PolicyLoss, GrpoRoundsRaiseTheReward) {
  std::unique_ptr<CausalLm> m = tiny_qwen3(16, true, 0.1);
  AdamWConfig ac;
  ac.weight_decay = 0;
  AdamW adam(runtime(), m->parameters(), ac);
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3}, {4, 7}};
  std::vector<double> mean_reward;
  for (int round = 0; round < 12; ++round) {
    RolloutEngine engine(runtime(), *m);
    for (size_t p = 0; p < prompts.size(); ++p) {
      RolloutRequest r;
      r.prompt = prompts[p];
      r.n = 8;
      r.max_new_tokens = 3;
      r.sampling.temperature = 1.0;
      r.seed = uint64_t(round * 10 + int(p));
      engine.submit(r);
    }
    const std::vector<RolloutResult> samples = engine.run();
    std::vector<double> rewards;
    std::vector<std::vector<int32_t>> sample_prompts;
    for (const RolloutResult& s : samples) {
      rewards.push_back(double(std::count(s.tokens.begin(), s.tokens.end(), 5)) / double(s.tokens.size()));
      sample_prompts.push_back(prompts[size_t(s.request)]);
    }
    mean_reward.push_back(std::accumulate(rewards.begin(), rewards.end(), 0.0) / double(rewards.size()));
    const std::vector<double> adv = group_advantages(rewards, 8, true);
    RlBatch rb = make_rl_batch(runtime(), Device::cpu(), 16, sample_prompts, samples, adv, "token-mean");
    PolicyLossConfig c;
    c.clip_high = 0.28;
    PolicyStats st;
    const RowLoss loss = [&](std::span<const double> logp, std::span<double> l, std::span<double> d) {
      policy_loss(rb.tokens, c, logp, l, d, &st);
    };
    rb.batch.row_loss = &loss;
    m->zero_grads();
    m->loss(rb.batch, true);
    if (round == 0) {  // on policy: the engine's log-probs are the model's
      EXPECT_NEAR(st.ratio_mean, 1.0, 1e-12);
      EXPECT_EQ(st.clip_fraction, 0.0);
    }
    adam.step(0.05);
  }
  std::printf("[grpo] mean reward per round:");
  for (double r : mean_reward) std::printf(" %.3f", r);
  std::printf("\n");
  const double first = (mean_reward[0] + mean_reward[1]) / 2, last = (mean_reward[10] + mean_reward[11]) / 2;
  EXPECT_GT(last, first + 0.3) << "reward " << first << " -> " << last;
}
