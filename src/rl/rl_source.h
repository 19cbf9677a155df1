// The RL loop of `lathe rl` as the trainer's step source (train/trainer.h StepSource): each rollout samples
// rl.samples responses to each of rl.prompts_per_step prompts with the rollout engine, on the policy's own weights
// (model/rollout_engine.h: the engine reads the parameters the optimizer updates, and serves the LoRA adapter being
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
// is the one-process run up to the order of the gradient sums. Dynamic sampling works there too: the ranks agree on each round's set-aside candidates and exchange the groups (share_of_groups).
// Tenants (a `tenants:` list, LoRA): each tenant is a job with its own prompts, rewards, algorithm settings, adapter and
// output folder over the one frozen base; a rollout's sampling rounds draw every tenant's requests in one engine (each
// request with its tenant's adapter) and each step trains every tenant's mini-batch in one batch (a segment each).
// rl.mode async (rl_source_async.cpp, docs/rl.md): the same source on separate ranks — rollout ranks run serve(),
// sampling each rollout with weights at most rl.max_staleness versions old, and the training ranks take each rollout's
// groups from them instead of sampling, sending the weights after each rollout's updates.
// Covered by tests/e2e/test_rl.cpp.
#pragma once

#include <cstdint>
#include <functional>
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
#include "comm/communicator.h"
#include "model/rollout_engine.h"
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
  // rl.importance_correction; auto: token_tis where the samples are older than the weights they train (rl.mode async
  // with rl.max_staleness above 0), else none.
  std::string importance_correction = "none";
};
RlSettings resolve_rl_settings(const RlOptions& o);

// Reads and checks data.train's prompt rows (bad JSON, a row without a prompt, a missing "answer" while the answer
// reward is on, a prompt that fills the model's max_position_embeddings: errors naming the file and line).
std::vector<RlPrompt> read_rl_prompts(const TrainConfig& c, const data::Tokenizer& tok, const ChatTemplate* chat);

// rl.mode: async (docs/rl.md): this rank's side and the communicators between the sides, made at the launch
// (tools/lathe/parallel_job.h join_async_job). The last rl.rollout_ranks ranks of the world sample; the others train.
struct AsyncRanks {
  bool trains = true;
  Communicator* world = nullptr;    // every rank: each rollout's groups go to every training rank
  Communicator* sync = nullptr;     // the first training rank (its rank 0) and the rollout ranks: the weights; else null
  Communicator* rollout = nullptr;  // the rollout ranks (on a rollout rank)
  // rl.rollout_tp > 1 (on a rollout rank): the ranks of its engine (consecutive rollout ranks), and the ranks of the
  // same place in every engine, which share each rollout's prompts (else the rollout ranks do).
  Communicator* rollout_tp = nullptr;
  Communicator* rollout_dp = nullptr;
};

class RlSource final : public StepSource {
 public:
  // Reads the tokenizer, chat template and every job's prompts (nothing is written). Jobs: the config's tenants (each
  // its own prompts, rewards, algorithm settings and adapter), or the config itself.
  RlSource(Runtime& rt, const TrainConfig& c);
  ~RlSource() override;

  void start(CausalLm& model, const std::vector<SourceJob>& jobs, const SourceRanks& ranks,
             const SourceHandover& handover) override;
  PackedBatch* batch(const std::vector<size_t>& jobs) override;
  std::string name() const override { return "rl"; }
  void before_save() override;
  // rl.mode async: each trained sample's staleness (rl/staleness).
  std::vector<std::pair<std::string, std::vector<double>>> step_histograms(size_t job) override;

  // rl.mode: async: this rank's side of the job, set before start() (a training rank) or serve() (a rollout rank).
  void set_async(const AsyncRanks& ranks);
  // A rollout rank's work: takes the run's start from the first training rank (the model, its weights and the position
  // in the prompts), then samples each rollout the schedule (rl/async_schedule.h) gives it, sends its groups to the
  // training ranks and takes each new version of the weights where the schedule says; returns at the schedule's end,
  // or when the trainer stopped early (end_async).
  void serve();
  // A training rank at the end of its run: a trainer that stops before the schedule's end (or never started: the run
  // had finished) tells the rollout ranks, so that they return instead of waiting for it. A collective of the training
  // ranks and the rollout ranks; `device`: this rank's (the run's model may not have been built).
  void end_async(Device device);
  nlohmann::json step_metrics(size_t job) override;
  std::string progress(size_t job) const override;
  nlohmann::json state(size_t job) const override;
  void check_state(size_t job, const nlohmann::json& state) const override;

 private:
  struct Job;      // one policy: its options, prompts and position in them
  struct Part;     // one job's share of an update: its policy tokens and loss settings
  struct Update;   // one step's mini-batch of every job that rolled out together: one batch, a part per job
  struct Group;    // a prompt's samples and rewards
  struct Figures;  // a rollout's figures
  struct Ask;      // one job's prompts of a sampling round
  struct MessageSection;  // rl.mode async: one job's part of a rollout rank's message
  struct RewardParts {  // each sample's reward components, unweighted (0 where one is off)
    std::vector<double> answer, format, overlong, command;
  };
  // One rollout of each job in `jobs` (indices), their samples drawn by one engine in each sampling round (the
  // tenants' requests batched, each with its adapter).
  void rollout(const std::vector<size_t>& jobs);
  struct Drawn;  // a job's groups so far in a rollout, and its figures
  bool sampling_round(const std::vector<size_t>& jobs, std::vector<Drawn>& drawn);
  std::vector<Group> share_of_groups(const Job& j, Drawn& drawn);  // data parallelism with dynamic sampling
  nlohmann::json rollout_figures(const Job& j, const Figures& f) const;
  std::vector<std::vector<RolloutResult>> sample(const std::vector<Ask>& asks);
  EngineOptions engine_options(int64_t sequences, int64_t blocks) const;
  bool cache_fits_beside_optimizer(const std::vector<size_t>& jobs) const;
  std::vector<double> rewards(const Job& j, const std::vector<size_t>& prompts,
                              const std::vector<RolloutResult>& samples, RewardParts& parts);
  void queue_updates(const std::vector<size_t>& jobs, std::vector<std::vector<Group>>& groups,
                     std::vector<Figures>& figures);
  void train_on(const std::vector<size_t>& jobs, std::vector<std::vector<Group>>& groups, std::vector<Figures>& figures);
  static void encode_group(const Group& g, std::vector<double>& v);
  static Group decode_group(const double*& v, size_t samples);
  // rl.mode: async (rl_source_async.cpp).
  struct Async;
  void rollout_from_ranks(const std::vector<size_t>& jobs);  // a training rank: the rollout the rollout ranks sampled
  void take_events(size_t end);                             // a training rank: the schedule's events up to `end`
  void send_weights(bool start);                            // the first training rank (and its tp group)
  bool receive_weights();                                   // a rollout rank; false: the trainer stopped
  std::vector<double> sample_for_trainer(int64_t rollout);  // a rollout rank: one rollout, as its message
  std::vector<const Parameter*> synced_parameters(bool with_base) const;
  void read_message(const std::vector<double>& m, const std::function<void(size_t, MessageSection&)>& fn) const;
  bool joins_weights() const;
  // A training rank: the buffer resumed from the state of job `lead` (the first active: the tenants run in step), the
  // rollout ranks started.
  void start_async(const nlohmann::json& state, size_t lead);
  nlohmann::json async_state() const;             // a training rank: what a checkpoint keeps of the async loop
  int64_t next_update_staleness();                // a training rank: the update's lag behind its samples' weights
  void set_position(Job& j, const nlohmann::json& state);
  static int64_t longest_prompt(const Job& j);
  size_t next_prompt(Job& j);  // the next prompt index in the job's shuffled order (a new epoch reshuffles)
  // The labelled tokens' log-probabilities under the model as it is (forward only): with the batch's segments (each
  // job's adapter), or the base alone (the KL reference); `entropy`, where given, gets each row's entropy.
  std::vector<double> label_logprobs(PackedBatch& b, bool with_adapters, std::vector<double>* entropy = nullptr,
                                     CausalLm* model = nullptr);  // nullptr: the policy
  std::vector<double> reference_logprobs(PackedBatch& b);
  // Folds the importance weights of the trainer's (old) over the rollout's log-probabilities into the token weights.
  void correct_importance(const Job& j, PolicyTokens& t, const std::vector<double>& rollout, double& weight_sum,
                          int64_t& masked);
  void whole_batch_weights(const Job& j, PolicyTokens& t);
  void figures_over_ranks(Figures& f);

  Runtime& rt_;
  data::Tokenizer tok_;  // shared by the jobs (one base model)
  std::optional<ChatTemplate> chat_;
  std::vector<int32_t> stop_ids_, banned_;
  std::vector<std::unique_ptr<Job>> jobs_;
  std::vector<std::unique_ptr<Update>> pending_;  // the last rollout's updates not trained yet, next first
  std::unique_ptr<Update> current_;               // the update of the step running
  int64_t staleness_ = 0;                         // rl.mode async: the update's (next_update_staleness)
  CausalLm* model_ = nullptr;
  SourceRanks ranks_;  // data parallelism: this rank samples and trains the groups g with g % ranks == rank
  SourceHandover handover_;
  enum class Offload { kNever, kAlways, kWhenShort };  // rl.offload_optimizer false, true, auto (on a GPU)
  Offload offload_ = Offload::kNever;
  std::unique_ptr<CausalLm> reference_;  // full fine-tuning's KL reference (the starting weights, frozen)
  bool reference_offloaded_ = false;     // rl.reference_offload: it waits in host memory
  std::unique_ptr<Async> async_;         // rl.mode: async
};

}  // namespace lathe
