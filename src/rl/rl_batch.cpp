// The RL update's batch (rl_batch.h).
#include "rl/rl_batch.h"

#include "core/error.h"

namespace lathe {

RlBatch make_rl_batch(Runtime& rt, Device device, int64_t vocab, const std::vector<std::vector<int32_t>>& prompts,
                      const std::vector<RolloutResult>& samples, const std::vector<double>& advantages,
                      const std::string& aggregation, double norm_length) {
  LATHE_CHECK(prompts.size() == samples.size() && advantages.size() == samples.size(),
              "rl: {} prompts and {} advantages for {} samples", prompts.size(), advantages.size(), samples.size());
  std::vector<int32_t> ids, cu = {0}, labels;
  RlBatch out;
  for (size_t i = 0; i < samples.size(); ++i) {
    const std::vector<int32_t>& p = prompts[i];
    const RolloutResult& s = samples[i];
    LATHE_CHECK(!p.empty() && s.logprobs.size() == s.tokens.size(), "rl: sample {} has an empty prompt or {} log-probs "
                "for {} tokens", i, s.logprobs.size(), s.tokens.size());
    ids.insert(ids.end(), p.begin(), p.end());
    ids.insert(ids.end(), s.tokens.begin(), s.tokens.end());
    // Position P - 1 + j predicts response token j; the last token predicts nothing.
    for (size_t k = 0; k + 1 < p.size(); ++k) labels.push_back(-100);
    for (size_t j = 0; j < s.tokens.size(); ++j) {
      labels.push_back(s.tokens[j]);
      out.tokens.sequence.push_back(int64_t(i));
      out.tokens.advantage.push_back(advantages[i]);
      out.tokens.old_logprob.push_back(s.logprobs[j]);
    }
    labels.push_back(-100);
    cu.push_back(int32_t(ids.size()));
  }
  out.tokens.weight = aggregation_weights(out.tokens.sequence, aggregation, norm_length);
  out.batch = make_packed_batch(rt, device, std::move(ids), std::move(cu), std::move(labels), vocab);
  return out;
}

}  // namespace lathe
