// RlSource's private parts (rl_source.h), shared by its two files: rl_source.cpp (the colocated loop, and what both
// modes share) and rl_source_async.cpp (rl.mode: async). Included by those two alone.
#pragma once

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "model/lora.h"
#include "rl/async_schedule.h"
#include "rl/rl_source.h"

namespace lathe {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The sequences of a mini-batch's labelled tokens (consecutive runs of one sequence index).
inline double sequences_in(const PolicyTokens& t) {
  double n = 0;
  for (size_t i = 0; i < t.sequence.size(); ++i) n += i == 0 || t.sequence[i] != t.sequence[i - 1];
  return n;
}

// One job's share of an update: its labelled tokens (in the batch's row order, after the earlier jobs'), their policy
// loss settings and the statistics the loss reports.
struct RlSource::Part {
  size_t job = 0;
  PolicyTokens tokens;
  PolicyLossConfig config;
  PolicyStats stats;
  bool dropped = false;  // the job failed after the rollout: its rows stay in the batch, without adapter or loss
};

// One step's update of the jobs that rolled out together: each job's samples of the mini-batch as documents (a segment
// each under LoRA), one row loss calling each job's policy loss on its rows.
struct RlSource::Update {
  std::vector<size_t> jobs;
  PackedBatch batch;
  std::vector<Part> parts;
  RowLoss loss;
};

// One policy being trained: a tenant, or the run's single job.
struct RlSource::Job {
  const TrainConfig* c = nullptr;
  RlSettings settings;
  std::vector<RlPrompt> prompts;
  std::optional<FormatReward> format;
  int adapter = -1;
  bool active = true;
  // The position in the prompt order, and the rollouts done (each seeds its sampling).
  int64_t epoch = 0, position = 0, rollouts = 0;
  std::vector<size_t> order;
  int64_t longest_prompt = 0;                    // tokens (the rollout cache's need)
  nlohmann::json rollout_metrics;                // the last rollout's figures, reported with its first update
  double last_reward = 0;                        // the last rollout's mean reward (the progress line)
  double last_ratio = 1, last_clip = 0;          // the last update's (the progress line)
};

// A prompt's samples with their rewards.
struct RlSource::Group {
  size_t prompt = 0;
  std::vector<RolloutResult> samples;
  std::vector<double> rewards;
  bool uniform = false;  // every reward equal: zero advantages
  int64_t round = 0, candidate = 0;  // its place among the rollout's groups: sampling round, index in the round
};

// The rollout's figures, summed over its sampling rounds and updates.
struct RlSource::Figures {
  double rollout_s = 0, reward_s = 0, logprob_s = 0, reward_sum = 0, reward_sq_sum = 0, length_sum = 0;
  double answer_sum = 0, format_sum = 0, overlong_sum = 0, command_sum = 0;  // the reward components, unweighted
  int64_t sampled = 0, truncated = 0, rounds = 0, dropped = 0, length_max = 0;
  double gap_sum = 0, gap_max = 0, weight_sum = 0;  // train-rollout log-prob gaps, importance weights
  double entropy_sum = 0;                            // the policy's entropy at each response token
  int64_t gap_tokens = 0, masked = 0;

  // rl.mode async: a rollout rank's sampling figures as numbers of its message (kMessageSize), and a training rank
  // adding one rank's message into the rollout's (sums added, maxima and the slowest rank's seconds taken).
  static constexpr size_t kMessageSize = 14;
  std::vector<double> message() const {
    return {rollout_s, reward_s, reward_sum, reward_sq_sum, answer_sum, format_sum, overlong_sum, command_sum,
            length_sum, double(sampled), double(truncated), double(rounds), double(dropped), double(length_max)};
  }
  void add_message(const double* x) {
    rollout_s = std::max(rollout_s, x[0]);
    reward_s = std::max(reward_s, x[1]);
    reward_sum += x[2], reward_sq_sum += x[3], answer_sum += x[4], format_sum += x[5];
    overlong_sum += x[6], command_sum += x[7], length_sum += x[8];
    sampled += int64_t(x[9]), truncated += int64_t(x[10]);
    rounds = std::max(rounds, int64_t(x[11]));
    dropped += int64_t(x[12]);
    length_max = std::max(length_max, int64_t(x[13]));
  }
};

// A job's groups so far in a rollout (kept, and set aside by dynamic sampling), and its figures.
struct RlSource::Drawn {
  std::vector<Group> informative, uniform;  // this rank's
  Figures f;
  int64_t informative_total = 0;            // over every rank
  std::vector<std::vector<bool>> uniform_at;  // per round, per candidate (over every rank): set aside
};

// One job's prompts in a sampling round (this rank's share), and the round's number for the job (its seeds).
struct RlSource::Ask {
  Job* job = nullptr;
  std::vector<size_t> prompts;
  std::vector<int64_t> candidates;  // each prompt's index among the round's candidates (over every rank)
  int64_t round = 0;
};

// rl.mode async: one job's section of a rollout rank's message (read_message): its place in the prompts after the
// rollout, its figures (Figures::message's numbers, inside the message) and its groups.
struct RlSource::MessageSection {
  int64_t epoch = 0, position = 0;
  const double* figures = nullptr;
  std::vector<Group> groups;
};

// rl.mode: async: the schedule's walk and what each side keeps between its events (rl_source_async.cpp).
struct RlSource::Async {
  AsyncRanks ranks;
  int64_t max_staleness = 1, total = 0;  // the run's rollouts: train.max_steps / rl.minibatches
  std::vector<AsyncEvent> events;
  size_t next = 0;        // the first event not taken
  bool started = false;   // a training rank: the run's start sent (start_async)
  int64_t trained = 0;    // a training rank: rollouts trained (its weights' version)
  int64_t first_rollout = 0;  // a training rank: the first rollout the rollout ranks sample (at the start or resume)
  int64_t updates = 0;    // a training rank: updates done
  int64_t minibatches = 1;
  // A training rank: the rollouts taken and not trained yet, each as the rollout ranks' messages.
  std::map<int64_t, std::vector<std::vector<double>>> buffer;
  int64_t version = 0;        // the rollout being trained: the weights version it was sampled with
  double trainer_idle_s = 0;  // a training rank: waiting for samples since the last rollout began training
  double sync_s = 0, sync_bytes = 0;  // the first training rank: the last weights sent
  // A rollout rank's own model (and adapters), into which the weights arrive.
  std::unique_ptr<CausalLm> model;
  std::unique_ptr<LoraBank> bank;
  double rollout_idle_s = 0;  // a rollout rank: waiting for the trainer since its last message
};

}  // namespace lathe
