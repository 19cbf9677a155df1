// The supervised fine-tuning loop behind `lathe train` — full fine-tuning, LoRA, or many LoRA tenants over one
// frozen base (docs/lora.md): model (loaded or from scratch), packed data,
// AdamW (fp32 masters, or bf16 states: train.optimizer_states), LR schedule, clipping, NaN/Inf guard, periodic
// evaluation, atomic checkpoints with automatic resume, metrics.jsonl + TensorBoard, a progress line, and a final HF export.
// Checkpoint layout: OUTPUT/checkpoints/step-NNNNNNNN/{model/ or adapter/, optimizer.safetensors, trainer_state.json},
// per tenant in the tenant's output_dir; a tenant that fails writes OUTPUT/FAILED and stops alone.
// A checkpoint is written under a temporary name and renamed when complete, so any step-* folder is whole.
// Data-parallel ranks (docs/parallel.md) split each step's micro-batches; the first rank writes the run's files.
// Covered by tests/e2e/test_train.cpp (loss falls, kill -9 and resume reproduce the losses bitwise on CPU, crash during
// save, bad configs, re-runs into a run folder, validation before any write) and tests/e2e/test_train_dp.cpp.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "train/config.h"

namespace lathe {

struct ProcessGroups;
struct PackedBatch;
class CausalLm;
class Runtime;

// A step source's view of the data-parallel ranks: its rank among `ranks`, and a sum of numbers over them (every rank
// calls it with vectors of one length, in the same order; a single process's sum is the identity).
struct SourceRanks {
  int rank = 0, ranks = 1;
  std::function<std::vector<double>(const std::vector<double>&)> sum = [](const std::vector<double>& v) { return v; };
};

// What a step trains on in place of the SFT data (lathe rl: src/rl/rl_source.h), for every job of the run (one, or
// each LoRA tenant; job k is the config's tenant k). Under data parallelism every rank has its own source, which builds
// that rank's share of each step (the gradients of the ranks' batches are summed, so each row loss's weights are the
// whole step's).
// The trainer calls start() once the model (and adapters) are built and resumed, then batches() at the start of every
// step, outside the step's memory plan (a source may generate there), and step_metrics() after the update (on every
// rank); state() goes into every checkpoint's trainer_state.json ("source") and comes back to start() on resume.
struct SourceJob {
  int adapter = -1;         // the LoRA adapter the job trains (-1: full fine-tuning)
  nlohmann::json state;     // the resumed checkpoint's state(), else null
  bool active = true;       // false: the job has finished training (it never asks for batches)
};

// The trainer's side of the colocated handover: offload() moves every job's optimizer state (masters and moments) to
// host memory and restore() brings it back; each returns the bytes moved. starting_model() makes a new, frozen model
// of the run's starting weights (the model folder, or the seed's random initialisation; not a checkpoint's) on the
// run's device: full fine-tuning's KL reference.
struct SourceHandover {
  std::function<size_t()> offload = [] { return size_t(0); };
  std::function<size_t()> restore = [] { return size_t(0); };
  std::function<std::unique_ptr<CausalLm>()> starting_model;
};

class StepSource {
 public:
  virtual ~StepSource() = default;
  virtual void start(CausalLm& model, const std::vector<SourceJob>& jobs, const SourceRanks& ranks,
                     const SourceHandover& handover) = 0;
  // The step's batch for the jobs in `jobs` (indices, ascending): one batch, its row loss (PackedBatch::row_loss)
  // covering every labelled row with terms that carry their own weights; under LoRA each job's rows are a segment
  // with its adapter (the trainer sets their dropout seeds; a segment with adapter -1 is rows kept without a loss).
  // Valid until the next call.
  virtual PackedBatch* batch(const std::vector<size_t>& jobs) = 0;
  // The key of the step's figures in metrics.jsonl and their TensorBoard prefix ("rl": "rl" and "rl/NAME").
  virtual std::string name() const = 0;
  // Job `job`'s figures of the step (numbers) for metrics.jsonl and TensorBoard, and a few words for the progress line.
  virtual nlohmann::json step_metrics(size_t job) = 0;
  virtual std::string progress(size_t job) const = 0;
  // Distributions of the step's figures for TensorBoard (tag under name(), the values), after step_metrics().
  virtual std::vector<std::pair<std::string, std::vector<double>>> step_histograms(size_t /*job*/) { return {}; }
  virtual nlohmann::json state(size_t job) const = 0;
  // A resumed checkpoint's state() for job `job`, checked before anything is written (throws naming the problem).
  virtual void check_state(size_t /*job*/, const nlohmann::json& /*state*/) const {}
  // Called on every rank, in step, before a step's checkpoint is written (a source may gather what its state needs).
  virtual void before_save() {}
};

struct JobSummary {
  std::string name;           // the tenant's name ("" for a single-job run)
  int64_t steps_run = 0;      // steps run by this invocation
  int64_t final_step = 0;
  double first_loss = 0, last_loss = 0;
  double final_eval_accuracy = -1;  // -1 when no final_eval.file
  double start_eval_accuracy = -1;  // a step source's run: the held-out accuracy before its first step (-1: not run)
  bool failed = false;
  std::string error;
  std::string output_dir;  // set when the run had already finished
};

struct TrainSummary {
  // Every job had already trained, written its final model and run its final evaluation: nothing was done, and the
  // jobs' figures are those the run recorded.
  bool already_finished = false;
  // The first (or only) job's figures.
  int64_t steps_run = 0;
  int64_t final_step = 0;
  double first_loss = 0, last_loss = 0;
  double final_eval_accuracy = -1;
  std::vector<JobSummary> jobs;  // one per tenant (one for a single-job run)
};

// A run of `lathe train` as a training state that a loop drives — run_training's below, or another one (RL): the
// constructor reads and checks every input (files, options, the model config, the output folders) and writes
// nothing; prepare_outputs() then continues, rewinds, replaces or creates the output folders (train/run_folder.h);
// build() makes the model, adapters, optimizers, loaders and writers; step() runs one optimizer step of every active
// job and returns false when none is left; finish() writes what a resumed run still lacks and runs the final
// evaluations. The Runtime and the process groups are the caller's (groups nullptr: a single process).
class Trainer {
 public:
  // `source`: the steps' batches come from it (kept by the caller), not from data.train.
  Trainer(Runtime& rt, const TrainConfig& config, ProcessGroups* groups = nullptr, StepSource* source = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  bool finished() const;  // every job already trained, exported and evaluated: nothing to do
  void prepare_outputs();
  void build();
  bool step();
  void finish();
  TrainSummary summary(bool already_finished) const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Every input (files, options, the model config) is read and checked before anything is written; the output folder
// is then continued, rewound, replaced or refused as train/run_folder.h says.
// With `groups` (a parallel launch), the data-parallel ranks split each step's micro-batches: dp = N with grad_accum k
// is the computation of one process with grad_accum N x k; the first rank prints and writes the run's files.
TrainSummary run_training(Runtime& rt, const TrainConfig& config, ProcessGroups* groups = nullptr,
                          StepSource* source = nullptr);
TrainSummary run_training(const TrainConfig& config);  // a single process with a Runtime of its own

// Newest complete checkpoint folder in `output_dir`, or "" when there is none.
std::string latest_checkpoint(const std::string& output_dir);

}  // namespace lathe
