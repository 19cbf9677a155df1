// The training batch of one RL update, built from the rollout engine's samples: each sample a document (its prompt,
// then its response), the response tokens labelled (each predicted from the token before it), and the PolicyTokens of
// the labelled rows in row order: the sample's advantage, the rollout's log-probability of each token (the policy that
// sampled it: the importance ratio's denominator), the aggregation weights. Covered by tests/unit/test_policy_loss.cpp
// (a GRPO run on a tiny model raises its reward).
#pragma once

#include <string>
#include <vector>

#include "model/batch.h"
#include "rl/policy_loss.h"
#include "model/rollout_engine.h"

namespace lathe {

struct RlBatch {
  PackedBatch batch;
  PolicyTokens tokens;
};

// `prompts[i]` and `advantages[i]` belong to samples[i] (a sample with no response contributes no labelled row).
RlBatch make_rl_batch(Runtime& rt, Device device, int64_t vocab, const std::vector<std::vector<int32_t>>& prompts,
                      const std::vector<RolloutResult>& samples, const std::vector<double>& advantages,
                      const std::string& aggregation, double norm_length = 0);

}  // namespace lathe
