// The RL loop of `lathe rl` as the trainer's step source (train/trainer.h StepSource): each rollout samples
// rl.samples responses to each of rl.prompts_per_step prompts with the rollout engine, on the policy's own weights
// (rl/rollout_engine.h: the engine reads the parameters the optimizer updates, and serves the LoRA adapter being
// trained); scores them (rl/rewards.h: answer match, format, overlong shaping, an external command, weighted);
// turns the rewards into group advantages; drops groups whose rewards are all equal and samples more prompts where
// dynamic sampling is on (DAPO); and splits the groups into rl.minibatches update batches, each the trainer's step
// with the policy loss (rl/policy_loss.h) as its row loss. The old policy's log-probabilities are the trainer's own
// forward over the rollout before the updates; the engine's give the train-rollout mismatch (reported) and, with
// rl.importance_correction, truncated or masked importance weights per token or sequence.
//
// Prompts: data.train's JSONL rows {"prompt": "..."} (rendered as one user message with the chat template's generation
// prompt, like final_eval) or {"messages": [...]}, plus any fields a reward reads ("answer" for the answer match; the
// external command gets the whole row). Every row is read and checked before anything is written.
// Order: the rows shuffled per epoch by train.seed; the state is the rollouts done and the position in the order, so a
// resumed run continues with the same prompts and, sampling being seeded by (seed, rollout, prompt), the same tokens.
// Data parallelism (parallel.dp = N): every rank walks the same order; of a rollout's groups (prompt k of the rollout's
// list), rank r samples, scores and trains those with k % N == r, so the ranks' rollouts together are the one
// process's rollout, the same tokens included. The loss weights are the whole mini-batch's (its sequence and token
// counts summed over the ranks) and the figures are summed (or their maxima taken) over the ranks, so a run of N ranks
// is the one-process run up to the order of the gradient sums. Dynamic sampling is refused there (config.cpp).
// Covered by tests/e2e/test_rl.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "rl/policy_loss.h"
#include "rl/rewards.h"
#include "rl/rl_batch.h"
#include "rl/rollout_engine.h"
#include "train/config.h"
#include "train/trainer.h"

namespace lathe {

struct RlPrompt {
  std::vector<int32_t> ids;  // the rendered prompt's tokens
  std::string text;          // rendered
  nlohmann::json row;        // the JSONL row (its fields go to the rewards)
};

// The algorithm's settings resolved from rl.* (the "auto" and empty ones by rl.algorithm).
struct RlSettings {
  PolicyLossConfig loss;
  std::string aggregation;
  bool scale_by_std = true, dynamic_sampling = false, overlong_filter = false;
};
RlSettings resolve_rl_settings(const RlOptions& o);

// Reads and checks data.train's prompt rows (bad JSON, a row without a prompt, a missing "answer" while the answer
// reward is on, a prompt that fills the model's max_position_embeddings: errors naming the file and line).
std::vector<RlPrompt> read_rl_prompts(const TrainConfig& c, const data::Tokenizer& tok, const ChatTemplate* chat);

class RlSource final : public StepSource {
 public:
  // Reads the tokenizer, chat template and prompts (nothing is written).
  RlSource(Runtime& rt, const TrainConfig& c);
  ~RlSource() override;

  void start(CausalLm& model, int adapter, const nlohmann::json& state, const SourceRanks& ranks) override;
  std::vector<PackedBatch*> batches(int64_t step) override;
  std::string name() const override { return "rl"; }
  nlohmann::json step_metrics() override;
  std::string progress() const override;
  nlohmann::json state() const override;

 private:
  struct Update;   // one mini-batch: its batch, policy tokens and loss
  struct Group;    // a prompt's samples and rewards
  struct Figures;  // a rollout's figures
  void rollout();
  std::vector<Group> sample_groups(Figures& f);
  void queue_updates(std::vector<Group>& groups, Figures& f);
  std::vector<RolloutResult> sample(const std::vector<size_t>& prompts, int64_t round);
  std::vector<double> rewards(const std::vector<size_t>& prompts, const std::vector<RolloutResult>& samples,
                              std::vector<double>& answers);
  size_t next_prompt();  // the next prompt index in the shuffled order (a new epoch reshuffles)
  // The labelled tokens' log-probabilities under the model as it is (forward only): with the trained adapter, or the
  // base alone (the KL reference).
  std::vector<double> label_logprobs(PackedBatch& b, bool with_adapter);
  void whole_batch_weights(PolicyTokens& t);
  void figures_over_ranks(Figures& f);
  // Folds the importance weights of the trainer's (old) over the rollout's log-probabilities into the token weights.
  void correct_importance(PolicyTokens& t, const std::vector<double>& rollout, double& weight_sum, int64_t& masked);

  Runtime& rt_;
  const TrainConfig& c_;
  RlSettings settings_;
  data::Tokenizer tok_;
  std::optional<ChatTemplate> chat_;
  std::vector<RlPrompt> prompts_;
  std::optional<FormatReward> format_;
  std::vector<int32_t> stop_ids_, banned_;
  CausalLm* model_ = nullptr;
  int adapter_ = -1;
  SourceRanks ranks_;  // data parallelism: this rank samples and trains the groups g with g % ranks == rank
  // The position in the prompt order, and the rollouts done (each seeds its sampling).
  int64_t epoch_ = 0, position_ = 0, rollouts_ = 0;
  std::vector<size_t> order_;
  std::vector<std::unique_ptr<Update>> pending_;  // this rollout's mini-batches not trained yet, next first
  std::unique_ptr<Update> current_;               // the mini-batch of the step running
  nlohmann::json rollout_metrics_;                 // the last rollout's figures, reported with its first update
  double last_reward_ = 0;                         // the last rollout's mean reward (the progress line)
};

}  // namespace lathe
