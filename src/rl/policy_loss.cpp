// The RL policy losses (policy_loss.h). Per-token arithmetic in double on the host.
#include "rl/policy_loss.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace lathe {

namespace {

// -min(r A, clip(r) A) and its derivative by log r (the gradient flows only where the unclipped branch is the min).
std::pair<double, double> clipped_term(double ratio, double adv, const PolicyLossConfig& c, bool* clipped) {
  const double lo = 1 - c.clip_low, hi = 1 + c.clip_high;
  const double unclipped = ratio * adv, cut = std::clamp(ratio, lo, hi) * adv;
  *clipped = cut < unclipped;
  return *clipped ? std::pair{-cut, 0.0} : std::pair{-unclipped, -unclipped};
}

// A KL estimate of logp against ref, and its derivative by logp.
std::pair<double, double> kl_term(double logp, double ref, KlEstimator k) {
  const double d = logp - ref;
  switch (k) {
    case KlEstimator::k1: return {d, 1.0};
    case KlEstimator::k2: return {0.5 * d * d, d};
    case KlEstimator::k3: return {std::exp(-d) + d - 1, 1 - std::exp(-d)};
  }
  return {0, 0};
}

}  // namespace

void policy_loss(const PolicyTokens& t, const PolicyLossConfig& c, std::span<const double> logp,
                 std::span<double> loss, std::span<double> dloss_dlogp, PolicyStats* stats) {
  const size_t n = logp.size();
  LATHE_CHECK(t.sequence.size() == n && t.advantage.size() == n && t.old_logprob.size() == n &&
                  t.weight.size() == n && (c.kl_coef == 0 || t.ref_logprob.size() == n) &&
                  loss.size() == n && dloss_dlogp.size() == n,
              "rl: policy_loss got {} log-probs for {} tokens", n, t.sequence.size());
  LATHE_CHECK(c.clip_low >= 0 && c.clip_low < 1 && c.clip_high >= 0, "rl: clip epsilons must be in [0, 1) and >= 0, "
              "not {} and {}", c.clip_low, c.clip_high);
  PolicyStats s;
  int64_t units = 0, clipped_units = 0;
  if (!c.sequence_ratio) {
    for (size_t i = 0; i < n; ++i) {
      bool clipped = false;
      const double ratio = std::exp(logp[i] - t.old_logprob[i]);
      const auto [term, dterm] = clipped_term(ratio, t.advantage[i], c, &clipped);
      loss[i] = t.weight[i] * term;
      dloss_dlogp[i] = t.weight[i] * dterm;  // d(r A)/d logp = r A
      s.ratio_mean += ratio;
      clipped_units += clipped;
      ++units;
    }
  } else {  // GSPO: per sequence, the geometric mean ratio of its tokens
    for (size_t a = 0; a < n;) {
      size_t b = a;
      double log_ratio = 0, weight = 0;
      for (; b < n && t.sequence[b] == t.sequence[a]; ++b) {
        log_ratio += logp[b] - t.old_logprob[b];
        weight += t.weight[b];
      }
      const double len = double(b - a), ratio = std::exp(log_ratio / len);
      bool clipped = false;
      const auto [term, dterm] = clipped_term(ratio, t.advantage[a], c, &clipped);
      for (size_t i = a; i < b; ++i) {
        loss[i] = t.weight[i] * term;
        dloss_dlogp[i] = weight * dterm / len;  // d log s / d logp_t = 1 / len
      }
      s.ratio_mean += ratio;
      clipped_units += clipped;
      ++units;
      a = b;
    }
  }
  if (c.kl_coef != 0)
    for (size_t i = 0; i < n; ++i) {
      const auto [k, dk] = kl_term(logp[i], t.ref_logprob[i], c.kl);
      loss[i] += c.kl_coef * t.weight[i] * k;
      dloss_dlogp[i] += c.kl_coef * t.weight[i] * dk;
      s.kl_mean += k / double(n);
    }
  if (units > 0) s.ratio_mean /= double(units), s.clip_fraction = double(clipped_units) / double(units);
  if (stats) *stats = s;
}

std::vector<double> group_advantages(std::span<const double> rewards, int64_t group, bool scale_by_std, double eps) {
  LATHE_CHECK(group >= 1 && int64_t(rewards.size()) % group == 0, "rl: {} rewards do not form groups of {}",
              rewards.size(), group);
  std::vector<double> a(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += size_t(group)) {
    double mean = 0;
    for (int64_t i = 0; i < group; ++i) mean += rewards[g + size_t(i)] / double(group);
    double var = 0;
    for (int64_t i = 0; i < group; ++i) var += (rewards[g + size_t(i)] - mean) * (rewards[g + size_t(i)] - mean);
    const double sd = group > 1 ? std::sqrt(var / double(group - 1)) : 0.0;
    for (int64_t i = 0; i < group; ++i) {
      const double d = rewards[g + size_t(i)] - mean;
      a[g + size_t(i)] = !scale_by_std ? d : sd > 0 ? d / (sd + eps) : 0.0;
    }
  }
  return a;
}

std::vector<double> aggregation_weights(std::span<const int64_t> sequence, const std::string& mode,
                                        double norm_length) {
  std::vector<int64_t> lengths;  // per sequence, in order
  for (size_t i = 0; i < sequence.size(); ++i)
    if (i == 0 || sequence[i] != sequence[i - 1]) lengths.push_back(1);
    else ++lengths.back();
  const double seqs = double(lengths.size()), tokens = double(sequence.size());
  std::vector<double> w(sequence.size());
  size_t at = 0;
  for (int64_t len : lengths) {
    for (int64_t j = 0; j < len; ++j, ++at) {
      if (mode == "token-mean") w[at] = 1 / tokens;
      else if (mode == "seq-mean-token-mean") w[at] = 1 / (double(len) * seqs);
      else if (mode == "seq-mean-token-sum") w[at] = 1 / seqs;
      else if (mode == "seq-mean-token-sum-norm") {
        LATHE_CHECK(norm_length > 0, "rl: seq-mean-token-sum-norm needs a positive norm length, not {}", norm_length);
        w[at] = 1 / (seqs * norm_length);
      } else {
        LATHE_FAIL("rl: unknown loss aggregation '{}' (token-mean, seq-mean-token-mean, seq-mean-token-sum, "
                   "seq-mean-token-sum-norm)", mode);
      }
    }
  }
  return w;
}

}  // namespace lathe
