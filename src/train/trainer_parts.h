// The trainer's parts besides its loop (train/trainer.cpp): a job (one model or adapter being trained, with
// everything it owns), the progress line, checkpoint folders and their writing, evaluation on held-out rows, and the
// small checks and names the loop uses. Private to train/: only trainer.cpp and trainer_parts.cpp include it.
// Covered through the trainer's tests (tests/e2e/test_train.cpp, test_train_dp.cpp, test_tenants.cpp).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/runtime.h"
#include "core/fault_inject.h"
#include "core/memory_plan.h"
#include "data/dataset.h"
#include "data/packing.h"
#include "data/tokenizer.h"
#include "model/causal_lm.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "parallel/zero.h"
#include "train/config.h"
#include "train/final_eval.h"
#include "train/metrics.h"
#include "train/run_folder.h"
#include "train/tensorboard.h"
#include "train/trainer.h"

namespace lathe::trainer_parts {

namespace fs = std::filesystem;

class Progress {
 public:
  // Only the first rank of a parallel run prints (`silent` on the others).
  Progress(int64_t log_every, bool silent) : tty_(isatty(STDOUT_FILENO)), silent_(silent), log_every_(log_every) {}
  void step(int64_t step, int64_t total, const std::string& line) {
    if (silent_) return;
    if (tty_) {
      std::printf("\r\033[K%s", line.c_str());
      std::fflush(stdout);
    } else if (step % log_every_ == 0 || step == total) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
  }
  void message(const std::string& line) {
    if (silent_) return;
    std::printf(tty_ ? "\r\033[K%s\n" : "%s\n", line.c_str());
    std::fflush(stdout);
  }
  void finish() {
    if (tty_ && !silent_) std::printf("\n");
  }

 private:
  bool tty_, silent_;
  int64_t log_every_;
};

// One model being trained: the whole model (full fine-tuning) or one LoRA adapter (a tenant). Everything a job
// owns — data, optimizer, schedule, metrics, checkpoints — is its own; a failing job is stopped alone.
struct Job {
  const TrainConfig* cfg = nullptr;
  fs::path out;
  std::string label;  // "" for a single-job run, else the tenant's name
  int adapter = -1;   // LoRA: index in the bank
  // Read and checked before anything is written.
  RunFolder folder;
  StartPlan start;
  nlohmann::json state = nlohmann::json::object();  // the resumed checkpoint's trainer_state.json
  std::shared_ptr<const data::Corpus> train, eval;
  std::vector<FinalEvalRow> final_eval_rows;
  bool needs_final = false, needs_final_eval = false;  // resumed at max_steps with these still to do
  // Built once the folder is prepared.
  std::vector<Parameter>* params = nullptr;  // what the optimizer updates (under ZeRO: this rank's pieces)
  std::unique_ptr<ZeroShards> zero;          // parallel.zero: 1 or 2 with dp > 1 (full fine-tuning)
  data::LoaderOptions loader_options;
  std::unique_ptr<data::PackedLoader> loader;
  std::unique_ptr<AdamW> opt;
  std::unique_ptr<MetricsWriter> metrics;
  std::unique_ptr<TensorBoardWriter> tb;
  ScheduleConfig sched;
  int64_t step = 0, tokens_seen = 0, bad_in_row = 0;
  bool failed = false;
  std::string error;
  JobSummary summary;
  // this step
  double loss_sum = 0, flops = 0;
  int64_t labelled = 0, tokens = 0;
  // MoE models, this step: the aux loss summed over micro-batches, and each sparse layer's tokens per expert.
  double aux_sum = 0;
  std::map<int64_t, std::vector<int64_t>> expert_tokens;

  bool active() const { return !failed && step < cfg->max_steps; }
  bool finished() const {  // nothing left to do: trained, exported and evaluated
    return start.training_done && !needs_final && !needs_final_eval;
  }
  std::string prefix() const { return label.empty() ? "" : label + ": "; }
  std::string who() const { return label.empty() ? "train" : "train: tenant " + label; }
};

// What the log has said about memory (the plan, a full device), so that each thing is said once.
struct MemoryReport {
  bool outcome = false;  // planned, or why not
  bool misses = false;   // a step left the planned sequence
  bool full = false;     // a step found the device full (report_full_device)
};

std::string step_dir_name(int64_t step);  // "step-00000042"
// Whether a job checkpoints after `step`: every train.save_every steps, and at the last. One predicate for the save
// itself and for the ranks' barriers around it, which must agree on every rank.
bool saves_at(const TrainConfig& c, int64_t step);
std::string duration(double s);  // "3m05s", "1h02m" (the ETA)
// The rows of data files, one corpus (a file's own, memory-mapped where it can be; several joined in memory).
std::shared_ptr<const data::Corpus> load_corpus(const std::vector<std::string>& files, const data::RowEncoder& enc,
                                                data::DatasetStats* stats);
uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c);  // one seed of three (dropout, sampling streams)
// The folder a ZeRO run's ranks write their optimizer shards into before the first rank gathers them into the
// checkpoint (its name holds ".tmp-", so a start after a crash removes it with the other temporaries); the shards'
// names: zero_state_name (parallel/zero.h).
fs::path zero_shard_dir(const Job& job);
// Every rank's `mine` of `group`, in rank order, on every rank (a collective): two sums over the group (summed_over),
// the texts' lengths, then every rank's characters in its own range.
nlohmann::json gathered_json(Runtime& rt, Device device, Communicator& group, const nlohmann::json& mine);
// Writes the job's checkpoint of its current step atomically: `write_files` writes the weights and the optimizer state
// into the folder before it appears, then trainer_state.json; keeps the newest train.keep_last.
void save_checkpoint(const Job& job, const std::function<void(const fs::path&)>& write_files, const nlohmann::json& state);
// The name of the layout whose ranks hold different slices of the weights, in the optimizer state files' names: the
// kinds above 1 joined ("tp", "ep", "tp-ep", "pp", "tp-pp", ...).
std::string slice_kind_of(int tp, int ep, int pp);
// A device batch of one job's host batch, its rows served by `adapter` (-1: no adapter).
PackedBatch single_job_batch(Runtime& rt, const CausalLm& model, const data::Batch& b, int adapter);
// The job's mean loss over its held-out rows (train.eval_batches of them; through the stages under pp).
double evaluate(Runtime& rt, CausalLm& model, const Job& job);
// The sum of squares of the parameters' values is finite (an update that overflowed would poison other tenants).
bool values_finite(ExecContext& ctx, std::vector<Parameter>& params);
void check_batch_fits(const data::Batch& b, int64_t vocab);  // token ids and labels inside the vocabulary
// Says once how the memory plan went (planned, or why not), and once that a step departed from it.
void report_memory_plan(const PlanStats& s, MemoryReport& said, Progress& progress);
// Once a run: a step during which the device allocator found the device full `flushes` > 0 times (each time it freed
// its whole cache and waited for the device; such steps run slowly), with what makes room.
void report_full_device(int64_t flushes, int64_t step, MemoryReport& said, Progress& progress);
// generation_config.json for a model made from scratch, as transformers derives it from a model config: the
// config's bos/eos ids, else the tokenizer's end-of-sequence tokens (<|im_end|> too, as chat generation stops there).
nlohmann::json generation_config(const ModelConfig& mc, const data::Tokenizer& tok);

}  // namespace lathe::trainer_parts
