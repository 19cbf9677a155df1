// The policy-gradient losses of RL post-training, as per-token terms of the labelled tokens' log-probabilities, for
// the model's row-loss head (PackedBatch::row_loss, model/batch.h): the model computes each response token's
// log-probability, policy_loss turns them into loss terms and their derivatives, and the head's backward scales each
// token's cross-entropy gradient by its derivative. Formulas (docs/rl.md cites the papers):
//   GRPO (Shao et al. 2024): advantages normalised within each group of samples of one prompt (group_advantages with
//     scale_by_std); the token-level PPO clip (Schulman et al. 2017) of the ratio r_t = exp(logp_t - old_t):
//     term_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t);
//   Dr. GRPO (Liu et al. 2025): no division by the group's std, token weights without the length normalisation;
//   DAPO (Yu et al. 2025): eps_high > eps_low (clip-higher) and token-level aggregation ("token-mean");
//   GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean over its tokens of logp_t - old_t), clipped as
//     above: term_i = -min(s_i A_i, clip(s_i) A_i), each of its tokens carrying its weight's share;
//   KL to a reference policy (ref_t): k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1
//     (Schulman's estimators), added as kl_coef x weight x k per token.
// Aggregation (verl's loss_agg_mode names): each token's weight, from aggregation_weights.
// Covered by tests/unit/test_policy_loss.cpp (hand-computed cases, finite differences, a model's gradients).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace lathe {

enum class KlEstimator { k1, k2, k3 };

struct PolicyLossConfig {
  double clip_low = 0.2, clip_high = 0.2;  // eps_low, eps_high (DAPO: 0.2 and 0.28)
  bool sequence_ratio = false;             // GSPO: one ratio per sequence
  double kl_coef = 0.0;                    // 0: no KL term
  KlEstimator kl = KlEstimator::k3;
};

// Per labelled token, in row order: its sequence (tokens of a sequence are consecutive), advantage (the sequence's),
// the log-probability under the policy that sampled it (old) and under the reference, and its aggregation weight.
struct PolicyTokens {
  std::vector<int64_t> sequence;
  std::vector<double> advantage, old_logprob, ref_logprob, weight;
};

struct PolicyStats {
  double clip_fraction = 0;  // of the tokens (or sequences, GSPO) whose ratio is clipped with the gradient cut
  double ratio_mean = 0;     // mean token ratio (sequence ratio under GSPO)
  double kl_mean = 0;        // mean per-token KL estimate (0 without a reference)
};

// The loss terms (summing to the objective) and their derivatives by each token's log-probability.
void policy_loss(const PolicyTokens& tokens, const PolicyLossConfig& config, std::span<const double> logp,
                 std::span<double> loss, std::span<double> dloss_dlogp, PolicyStats* stats = nullptr);

// Advantages of `rewards`, consecutive groups of `group` samples of one prompt: r - mean of the group, divided by the
// group's standard deviation (the unbiased one, as torch.std) plus eps when scale_by_std (GRPO), not otherwise (Dr.
// GRPO). A group whose rewards are all equal gets zeros.
std::vector<double> group_advantages(std::span<const double> rewards, int64_t group, bool scale_by_std,
                                     double eps = 1e-6);

// Each token's weight under verl's loss_agg_mode: "token-mean" (1 / all tokens), "seq-mean-token-mean" (1 / (its
// sequence's tokens x sequences)), "seq-mean-token-sum" (1 / sequences), "seq-mean-token-sum-norm" (1 / (sequences x
// norm_length): Dr. GRPO's constant). `sequence`: each token's sequence, consecutive.
std::vector<double> aggregation_weights(std::span<const int64_t> sequence, const std::string& mode,
                                        double norm_length = 0);

}  // namespace lathe
