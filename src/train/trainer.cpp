#include "train/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <regex>

#include <fmt/ranges.h>

#include "core/files.h"
#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/packing.h"
#include "data/tokenizer.h"
#include "data/tokenizer_files.h"
#include "model/causal_lm.h"
#include "model/lora.h"
#include "model/pipeline_step.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/schedule.h"
#include "parallel/grad_reducer.h"
#include "parallel/process_groups.h"
#include "parallel/tp_state.h"
#include "parallel/zero.h"
#include "train/final_eval.h"
#include "train/flops.h"
#include "train/metrics.h"
#include "train/plan.h"
#include "train/run_folder.h"
#include "train/step_profile.h"
#include "train/tensorboard.h"
#include "train/trainer_parts.h"

namespace lathe {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string latest_checkpoint(const std::string& output_dir) {
  const fs::path dir = fs::path(output_dir) / "checkpoints";
  if (!fs::exists(dir)) return "";
  std::string best;
  static const std::regex complete("step-[0-9]{8}");
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, complete) && fs::exists(e.path() / "trainer_state.json") && name > best)
      best = name;
  }
  return best.empty() ? "" : (dir / best).string();
}

using namespace trainer_parts;

// The trainer's state (trainer.h's Trainer forwards to it): one job, or one per tenant.
class Trainer::Impl {
 public:
  Impl(Runtime& rt, const TrainConfig& c, ProcessGroups* groups, StepSource* source);
  bool finished() const;  // every job already trained, exported and evaluated: nothing to do
  void prepare_outputs();
  void build();
  bool step();
  void finish();
  TrainSummary summary(bool already_finished) const;

 private:
  // What a step queues for each job (indexed like jobs_): its gradient norm and prepared AdamW update.
  struct PendingUpdates {
    explicit PendingUpdates(size_t jobs) : norms(jobs), updates(jobs) {}
    std::vector<std::optional<PendingGradNorm>> norms;
    std::vector<std::optional<AdamW::Prepared>> updates;
    bool replicas_summed = false;
  };
  // A step's totals over its active jobs, for the metrics and the progress line.
  struct StepTotals {
    double dt = 0, dp_comm_s = 0, mem_mib = 0;
    int64_t tokens = 0, cache_flushes = 0;
    double flops = 0;
  };
  // step()'s named parts: the gradients and figures cleared; the norms and updates queued (once the gradients are
  // complete); the updates applied (ZeRO's gathers included); the metrics, checkpoints and the progress line.
  void begin_step(const std::vector<Job*>& active);
  void queue_updates(const std::vector<Job*>& active, PendingUpdates& pending);
  std::vector<nlohmann::json> apply_updates(const std::vector<Job*>& active, PendingUpdates& pending,
                                            double& dp_comm_s);
  void record_steps(const std::vector<Job*>& active, std::vector<nlohmann::json> entries, const StepTotals& totals);
  void print_progress(size_t active, const std::vector<nlohmann::json>& entries, const StepTotals& totals,
                      const std::string& tenant_losses);
  void read_inputs(Job& j);
  void choose_model_source();
  PipelineLayout pipeline_layout() const;
  void build_job(Job& j);
  void load_optimizer(Job& j);
  // How the weights are sliced over the ranks of one replica, as the optimizer files are named: the kind ("tp", "pp",
  // "tp-pp", ...: slice_kind_of), the slicing group's ranks (1: none) and the pipeline's stages ("" without pp).
  struct Slicing {
    std::string kind = "tp";
    int ranks = 1;
    std::string stages;
    bool operator==(const Slicing&) const = default;
  };
  Slicing slicing() const;
  // "parallel.tp = 2, ZeRO shards over 2 ranks", "parallel.pp = 2 (stages ...), without ZeRO": a layout in messages.
  static std::string layout_text(const nlohmann::json& zero, const Slicing& slicing);
  void load_zero_optimizer(Job& j, const nlohmann::json& saved, const Slicing& then);
  void recut_zero_in_slot(Job& j, const nlohmann::json& saved, const fs::path& out) const;
  void recut_zero_from_another_slicing(Job& j, const nlohmann::json& saved, const Slicing& then,
                                       const fs::path& out) const;
  void check_zero_slots_agree();
  nlohmann::json zero_slot_layouts(const ZeroShards& zero);
  nlohmann::json saved_zero_layout(const Job& j) const;
  void move_zero_shards(const Job& j, const fs::path& dir) const;
  void check_optimizer_layout(const Job& j) const;
  void run_micro_batches(const std::vector<Job*>& active, const std::function<void()>& queue_optimizer);
  void account_micro_batch(const LossResult& r, const std::vector<Job*>& in_batch);
  BackwardHooks micro_batch_hooks(bool last, const std::function<void()>& queue_optimizer);
  std::vector<LossResult> through_stages(const std::vector<PackedBatch>& micro, double loss_scale,
                                         const std::function<void()>& queue_optimizer);
  void run_source_batch(const std::vector<Job*>& active, PackedBatch& pb, const std::function<void()>& queue_optimizer);
  void start_source();
  nlohmann::json optimizer_step(Job& j, double norm, AdamW::Prepared&& update);
  void record_step(Job& j, nlohmann::json& m, double dt, double mem_mib, int64_t run_tokens);
  void write_final(Job& j);
  FinalEvalResult held_out(Job& j, const std::string& prefix);
  FinalEvalResult held_out_whole(Job& j, const std::string& prefix);
  void final_eval(Job& j);
  void fail(Job& j, const std::string& why);
  void guarded(Job& j, const std::function<void()>& f);
  void write_model_files(const std::string& dir) const;  // tokenizer files and chat_template_kwargs.json
  void agree_on_failures(const std::vector<Job*>& active);
  double reduce_over_replicas(const std::vector<Job*>& active);
  void reduce_adapter_grads(const std::vector<Job*>& active);
  bool sharded() const { return c_.zero > 0 && grad_ranks_ > 1 && !lora_; }  // ZeRO: the state over grad_ranks_
  // The gradient reducers (the dense buckets', and under ZeRO with ep the experts'), in the order they run.
  std::vector<GradReducer*> reducers() const {
    std::vector<GradReducer*> out;
    for (GradReducer* r : {reducer_.get(), expert_reducer_.get()})
      if (r) out.push_back(r);
    return out;
  }
  // ZeRO: the reducers' summed chunks, one bucket after the other (ZeroShards::take_grads).
  std::vector<Tensor> reduced_sums() const {
    std::vector<Tensor> sums;
    for (GradReducer* r : reducers()) sums.insert(sums.end(), r->sums().begin(), r->sums().end());
    return sums;
  }
  // ZeRO under tp or pp: the rank's slot of the slicing group in its shards' names ("tp-R-of-T", "pp-R-of-P", ...:
  // zero_state_name); without slices "".
  std::string zero_slice(int slot) const {
    return slices() ? fmt::format("{}-{}-of-{}", slice_kind(), slot, slices()->size()) : "";
  }
  std::string zero_slice() const { return zero_slice(slices() ? slices()->rank() : 0); }
  // The ranks that take part in writing the model or the adapters: the first weight replica's (the slices are
  // gathered), of its cp ranks, which hold the same weights, the first alone; under ep the whole expert group (its cp
  // ranks hold different experts; ep is a multiple of cp).
  bool joins_save() const { return lead_ && (!groups_ || groups_->ep || groups_->cp_rank() == 0); }
  // The group whose ranks hold different slices of the weights, each saving its slices' optimizer state: tp, ep, or
  // tp x ep.
  Communicator* slices() const { return groups_ ? groups_->slices.get() : nullptr; }
  std::string slice_kind() const {
    return groups_ ? slice_kind_of(groups_->tp_size(), groups_->ep_size(), groups_->pp_size()) : "tp";
  }
  // LoRA under ep: the adapters are whole on every ep rank, so only the first ep rank's (tp group) writes them.
  // Under pp every stage holds the adapters whole: the first stage's write them.
  bool writes_adapters() const {
    return !groups_ || ((!groups_->ep || groups_->ep->rank() == 0) && groups_->pp_rank() == 0);
  }
  std::vector<double> sum_over_dp(const std::vector<double>& values);
  // Pipeline parallelism with a tied head: the last stage's copy of the embedding (the first stage's is counted in
  // the gradient norm); else nullptr.
  const Parameter* tied_head_copy() const {
    if (lora_ || model_->pp_size() == 1 || !model_->holds_head() || !model_->global_config().tie_word_embeddings)
      return nullptr;
    return model_->embedding_parameter();
  }
  // What the job's gradient norm leaves out: the tied head's copy, or under ZeRO this rank's piece of it (if any).
  const Parameter* norm_skip(const Job& j) const {
    const Parameter* copy = tied_head_copy();
    if (!copy || !j.zero) return copy;
    for (const Parameter& p : *j.params)
      if (p.name == copy->name) return &p;
    return nullptr;
  }
  std::vector<double> sum_over(Communicator& group, const std::vector<double>& values);

  Runtime& rt_;
  const TrainConfig& c_;
  ProcessGroups* groups_;  // nullptr: a single process
  StepSource* source_;     // nullptr: the steps train on data.train
  bool first_;             // the rank that prints and writes the run's files (rank 0, or the only one)
  // Tensor parallelism: the ranks of the first rank's tp group, which run its model work with it (evaluation, the
  // held-out check, gathering the model for a save); without tp, the first rank alone. Expert parallelism: the first
  // ep group (each its experts).
  bool lead_;
  Communicator* tp_ = nullptr;  // the tensor-parallel group (tp > 1)
  int dp_;                 // data-parallel ranks: each step's micro-batches are split over them
  // The ranks whose gradients are summed (ProcessGroups::weight_replicas): dp, or dp x cp under context parallelism.
  int grad_ranks_;
  Device device_;
  DType dtype_, save_dtype_;
  bool lora_;
  Progress progress_;
  RunFolder top_;  // output_dir; each job's own folder is in the job (the same folder for a single job)
  StartPlan top_start_;
  std::optional<data::Tokenizer> tokenizer_;
  std::optional<ChatTemplate> chat_;
  nlohmann::ordered_json chat_kwargs_;
  std::vector<Job> jobs_;
  // The model: loaded from model_source_ (a checkpoint's model/, the scratch LoRA base or model.path), or random.
  std::string model_source_;
  ModelConfig model_config_;
  std::vector<LoraConfig> lora_configs_;
  PlannedAllocator* plan_ = nullptr;
  std::unique_ptr<CausalLm> model_;
  std::unique_ptr<LoraBank> bank_;
  std::string base_model_;
  double peak_ = 0;  // bf16 FLOP/s of every GPU of the run (0: not a known card, no MFU)
  // The loop.
  std::optional<ExecContext> ctx_;
  // Data parallelism, full fine-tuning: the model's gradient buckets, summed over dp while the backward runs.
  std::vector<GradBucket> buckets_;
  std::unique_ptr<GradReducer> reducer_;
  std::vector<Parameter*> bucketed_;  // the parameters of buckets_: all but the experts under ep
  // ZeRO under ep: the rank's experts, their buckets and their reducer over edp (without ZeRO they are summed over edp
  // after the backward).
  std::vector<Parameter*> experts_;
  std::vector<GradBucket> expert_buckets_;
  std::unique_ptr<GradReducer> expert_reducer_;
  std::vector<double> rank_mem_mib_;  // each dp rank's peak memory up to the last gradient sum, in rank order
  MemoryReport memory_said_;
  Clock::time_point t_start_;
  int64_t run_steps_ = 0;
};

Trainer::Impl::Impl(Runtime& rt, const TrainConfig& c, ProcessGroups* groups, StepSource* source)
    : rt_(rt), c_(c), groups_(groups), source_(source), first_(!groups || groups->is_first()),
      lead_(!groups || (groups->ep ? groups->edp_rank() == 0 : groups->dp_rank() == 0)),
      tp_(groups ? groups->tp.get() : nullptr), dp_(groups ? groups->dp_size() : 1),
      grad_ranks_(groups && groups->dp ? groups->weight_replicas().size() : 1),
      device_(parse_device(c.device)), progress_(c.log_every, !first_) {
  rt_.check_device(device_);
  // The gradient sums run on the groups' own stream (make_process_groups' grad_stream), which several ranks need.
  LATHE_CHECK(grad_ranks_ <= 1 || groups->grad_stream, "train: process groups whose gradients sum over {} ranks were "
              "made without a gradient stream (make_process_groups' grad_stream)", grad_ranks_);
  dtype_ = !c.dtype.empty() ? dtype_from_name(c.dtype) : device_.is_cpu() ? DType::F32 : DType::BF16;
  save_dtype_ = dtype_ == DType::F64 ? DType::F32 : dtype_;
  lora_ = c.tenants.empty() ? c.lora_rank > 0 : true;
  LATHE_CHECK(c.tenants.empty() || c.resume == "auto" || c.resume == "none",
              "train: resume: with tenants, only auto or none (each tenant resumes from its own output_dir)");
  if (!c.model_path.empty()) check_folder(c.model_path, "model.path", "train", "config.json");
  check_folder(c.tokenizer, c.model_path == c.tokenizer ? "model.path" : "model.tokenizer", "train", "tokenizer.json");
  tokenizer_.emplace(data::Tokenizer::from_dir(c.tokenizer));
  chat_ = data::load_chat_template(c.tokenizer);
  chat_kwargs_ = nlohmann::ordered_json(c.chat_template_kwargs);

  // The output folders: the run's, and each tenant's.
  top_ = inspect_run_folder(c.output_dir, "train");
  jobs_.resize(c.tenants.empty() ? 1 : c.tenants.size());
  for (size_t i = 0; i < jobs_.size(); ++i) {
    Job& j = jobs_[i];
    j.cfg = c.tenants.empty() ? &c : &c.tenants[i];
    j.label = j.cfg->name;
    j.out = j.cfg->output_dir;
    j.adapter = lora_ ? int(i) : -1;
    j.summary.name = j.label;
  }
  if (!c.tenants.empty()) top_start_ = plan_start(top_, c.resume == "none" ? "none" : "auto", c.overwrite, 0, "train");
  for (Job& j : jobs_) {
    j.folder = c.tenants.empty() ? top_ : inspect_run_folder(j.out, j.who());
    j.start = plan_start(j.folder, j.cfg->resume, c.overwrite, j.cfg->max_steps, j.who());
    if (c.tenants.empty()) top_start_ = j.start;
    if (!j.start.resume_from.empty()) {
      std::ifstream f(fs::path(j.start.resume_from) / "trainer_state.json");
      j.state = nlohmann::json::parse(f, nullptr, false);
      LATHE_CHECK(j.state.is_object(), "train: {}/trainer_state.json is not valid JSON", j.start.resume_from);
      check_optimizer_layout(j);  // before anything is written (the element counts are checked again at load)
      if (source_ && j.state.contains("source")) source_->check_state(size_t(&j - jobs_.data()), j.state["source"]);
    }
    if (j.start.training_done) {
      const bool final_kept = j.folder.has_final && !j.start.clear &&
                              std::find(j.start.remove.begin(), j.start.remove.end(), j.out / "final") == j.start.remove.end();
      j.needs_final = !final_kept;  // re-exported from the same checkpoint: an evaluation already run still holds
      j.needs_final_eval = !j.cfg->final_eval_file.empty() && !(j.folder.has_final_eval && !j.start.clear);
    }
  }
  if (finished()) return;
  for (Job& j : jobs_) guarded(j, [&] { read_inputs(j); });
  choose_model_source();
  if (groups_ && groups_->pp) pipeline_layout();  // refused here (before anything is written) if it cannot be made
}

// The stages' layers (train/plan.h planned_pipeline: what `lathe plan` counts with).
PipelineLayout Trainer::Impl::pipeline_layout() const {
  return planned_pipeline(c_, model_config_, groups_->pp->size());
}

// The job's data, final-evaluation rows and LoRA start, read and checked.
void Trainer::Impl::read_inputs(Job& j) {
  const TrainConfig& jc = *j.cfg;
  if (!jc.lora_init.empty()) check_folder(jc.lora_init, "lora.init", "train", "adapter_config.json");
  if (!jc.final_eval_file.empty()) j.final_eval_rows = read_final_eval(jc.final_eval_file, chat_ ? &*chat_ : nullptr, chat_kwargs_);
  if (j.finished() || j.start.training_done) return;  // no step left to run: its data is not read
  if (source_) return;  // the source read its own inputs
  data::DatasetOptions dopt;
  dopt.format = data::parse_row_format(jc.data_format);
  dopt.max_seq_len = jc.max_seq_len;
  dopt.overlong = data::parse_overlong_policy(jc.overlong);
  dopt.skip_bad_rows = jc.skip_bad_rows;
  dopt.train_on_prompt = jc.train_on_prompt;
  dopt.chat_template_kwargs = nlohmann::ordered_json(jc.chat_template_kwargs);
  const data::RowEncoder encoder(*tokenizer_, chat_ ? &*chat_ : nullptr, dopt);
  data::DatasetStats train_stats, eval_stats;
  j.train = load_corpus(jc.train_files, encoder, &train_stats);
  progress_.message(fmt::format("{}data: {}", j.prefix(), train_stats.summary()));
  if (!jc.eval_files.empty()) j.eval = load_corpus(jc.eval_files, encoder, &eval_stats);
}

// Where the model comes from, and its config, checked against the tokenizer and the adapters' targets.
void Trainer::Impl::choose_model_source() {
  const Job& first = jobs_[0];
  const fs::path scratch_base = fs::path(c_.output_dir) / "base";
  if (!lora_ && !first.start.resume_from.empty()) {
    model_source_ = (fs::path(first.start.resume_from) / "model").string();
  } else if (lora_ && c_.model_path.empty() && fs::exists(scratch_base / "config.json") && !top_start_.clear) {
    model_source_ = scratch_base.string();
  } else {
    model_source_ = c_.model_path;
  }
  if (!model_source_.empty()) {
    model_config_ = load_model_config(model_source_);
    if (!c_.model_config.is_null() && model_source_ != c_.model_path) {
      // A resumed (or scratch-base) run keeps its model: an inline config that now says otherwise is an error, not
      // silently ignored.
      for (const auto& [key, value] : c_.model_config.items())
        LATHE_CHECK(!model_config_.raw.contains(key) || model_config_.raw[key] == value,
                    "train: model.config.{} is {}, but the run being continued was made with {} ({}): a resumed run "
                    "keeps its model; set overwrite: true to start again with the new config", key, value.dump(),
                    model_config_.raw[key].dump(), model_source_);
    }
  } else {
    nlohmann::json cfg = c_.model_config;
    if (!cfg.contains("model_type")) cfg["model_type"] = "qwen3";
    if (!cfg.contains("vocab_size")) cfg["vocab_size"] = tokenizer_->vocab_size();
    model_config_ = parse_model_config(cfg, "model.config");
  }
  LATHE_CHECK(model_config_.vocab_size >= tokenizer_->vocab_size(),
              "train: the model's vocabulary ({}) is smaller than the tokenizer's ({})", model_config_.vocab_size,
              tokenizer_->vocab_size());
  LATHE_CHECK(c_.recompute_layers <= model_config_.num_layers,
              "train: train.recompute_layers is {}, but the model has {} layers", c_.recompute_layers,
              model_config_.num_layers);
  check_tensor_parallel(model_config_, int(c_.tp));  // before any weight is loaded
  if (!lora_) return;
  for (Job& j : jobs_) {
    LoraConfig lc;
    lc.rank = std::max<int64_t>(1, j.cfg->lora_rank);
    lc.alpha = j.cfg->lora_alpha;
    lc.dropout = j.cfg->lora_dropout;
    lc.rslora = j.cfg->lora_rslora;
    lc.targets = j.cfg->lora_targets;
    lc.target_parameters = j.cfg->lora_target_parameters;
    guarded(j, [&] { lc.validate(j.prefix() + "lora", model_config_); });  // a tenant whose targets match nothing fails alone
    if (j.failed) {
      lc.targets = {"all-linear"};
      lc.target_parameters.clear();
    }
    lora_configs_.push_back(lc);
  }
}

bool Trainer::Impl::finished() const {
  return std::all_of(jobs_.begin(), jobs_.end(), [](const Job& j) { return j.finished(); });
}

void Trainer::Impl::prepare_outputs() {
  // Every rank has read the folders (and decided the same start) before the first one changes them.
  if (groups_) groups_->world->barrier();
  if (!first_) return;  // the first rank prepares the folders and writes every file of the run
  if (!c_.tenants.empty()) apply_start(top_, top_start_, "train");
  for (Job& j : jobs_) {
    if (!c_.tenants.empty()) j.folder = inspect_run_folder(j.out, j.who());  // the top folder's overwrite may have cleared it
    apply_start(j.folder, j.start, j.who());
  }
  write_file_atomic((fs::path(c_.output_dir) / "config.resolved.json").string(), c_.resolved.dump(2) + "\n", "train");
  for (Job& j : jobs_) {
    if (!j.label.empty()) write_file_atomic((j.out / "config.resolved.json").string(), j.cfg->resolved.dump(2) + "\n", j.who());
    std::error_code ec;
    fs::remove(j.out / "FAILED", ec);
    if (j.failed) write_file_atomic((j.out / "FAILED").string(), j.error + "\n", j.who());
  }
}

void Trainer::Impl::build() {
  rt_.set_gemm_autotune(c_.gemm_autotune);
  plan_ = c_.memory_plan ? &rt_.enable_memory_plan(device_) : nullptr;
  ModelOptions mopt;
  mopt.device = device_;
  mopt.dtype = dtype_;
  mopt.recompute = c_.recompute;
  mopt.recompute_layers = c_.recompute_layers;
  mopt.recompute_keeps_attention = c_.recompute_keeps_attention;
  mopt.recompute_keeps_gdn = c_.recompute_keeps_gdn;
  mopt.deterministic = c_.deterministic;
  mopt.train_base = !lora_;
  if (c_.router_aux_loss != "auto") mopt.router_aux_loss = c_.router_aux_loss == "on";  // MoE (config.cpp checks)
  mopt.moe_padded_max_waste = c_.moe_padded_max_waste;
  mopt.moe_host_groups = c_.moe_host_groups;
  mopt.tp = tp_;
  mopt.sequence_parallel = c_.sp;
  mopt.cp = groups_ ? groups_->cp.get() : nullptr;
  mopt.ep = groups_ ? groups_->ep.get() : nullptr;
  if (groups_ && groups_->pp) {
    mopt.pp = groups_->pp.get();
    mopt.pipeline = pipeline_layout();
    const PipelineTimeline tl = pipeline_timeline(mopt.pipeline, c_.grad_accum);
    progress_.message(fmt::format("pipeline: {}; {} micro-batches a step: {:.1f}% of the schedule's ticks idle",
                                  mopt.pipeline.describe(), c_.grad_accum, 100.0 * tl.idle_fraction()));
  }
  model_ = model_source_.empty() ? random_causal_lm(rt_, model_config_, mopt, c_.seed, c_.init_std)
                                 : load_causal_lm(rt_, model_source_, mopt);
  const ModelConfig& mc = model_->global_config();
  base_model_ = c_.model_path.empty() ? "" : fs::absolute(c_.model_path).string();
  // LoRA over a from-scratch base: the base is written once to OUTPUT/base (and read back on resume), so the
  // adapters have a base folder to load onto in transformers/peft, `lathe logprobs --adapter` and export --merge.
  if (lora_ && c_.model_path.empty()) {
    const fs::path scratch_base = fs::path(c_.output_dir) / "base";
    if (model_source_.empty() && joins_save())  // every rank made the same random base; under tp the first group gathers it
      model_->save(scratch_base.string(), save_dtype_, 5ull << 30, [&](const std::string& d) { write_model_files(d); });
    base_model_ = fs::absolute(scratch_base).string();
  }
  if (lora_) {
    bank_ = std::make_unique<LoraBank>(rt_, model_->config(), device_, dtype_, lora_configs_);  // this rank's layers
    bank_->split_like(*model_);  // tensor parallelism: each matrix split as its base weight
    model_->attach_lora(bank_.get());
  }
  // Summed over the weight replicas; the experts under ep over edp (below, or in buckets of their own under ZeRO).
  std::vector<int64_t> complete_after, expert_after;
  const std::vector<int64_t> after = model_->grads_complete_after();
  for (size_t i = 0; i < model_->parameters().size(); ++i) {
    Parameter& p = model_->parameters()[i];
    (p.shard.group != "ep" ? bucketed_ : experts_).push_back(&p);
    (p.shard.group != "ep" ? complete_after : expert_after).push_back(after[i]);
  }
  const int64_t bucket_bytes = int64_t(c_.bucket_mb * 1048576.0);
  if (grad_ranks_ > 1 && !lora_) buckets_ = plan_buckets(bucketed_, complete_after, bucket_bytes);
  if (sharded() && !experts_.empty()) expert_buckets_ = plan_buckets(experts_, expert_after, bucket_bytes);
  for (Job& j : jobs_) guarded(j, [&] { build_job(j); });
  if (lora_)
    for (Job& j : jobs_)
      if (j.failed) bank_->clear(j.adapter);

  const std::string device_name = rt_.backend(device_.type).info(device_.index).name;
  // MFU divides the step's model FLOPs (every replica's batches, counted once per batch) by the peak of every GPU that
  // ran them: one card's peak times the world (every rank of every group).
  peak_ = device_.is_cuda() ? peak_flops(device_name) * double(groups_ ? groups_->world->size() : 1) : 0.0;
  const size_t bf16_jobs = size_t(
      std::count_if(jobs_.begin(), jobs_.end(), [](const Job& j) { return j.cfg->optimizer_states == "bf16"; }));
  std::string states;
  if (bf16_jobs > 0) states = ", AdamW states in bf16 (no f32 masters)";
  if (bf16_jobs > 0 && bf16_jobs < jobs_.size()) states += fmt::format(" for {} of {} tenants", bf16_jobs, jobs_.size());
  progress_.message(fmt::format("train: {} parameters, {} on {} ({}){}{}", human(double(mc.parameter_count())),
                                dtype_name(dtype_), device_.str(), device_name,
                                lora_ ? fmt::format(", LoRA with {} adapter(s)", jobs_.size()) : "", states));
  if (groups_)  // the layout, and under tp what one rank holds
    progress_.message(fmt::format("parallel: {}{}", groups_->grid.describe(),
                                  tp_ ? fmt::format("; each rank {} of the {} attention heads, {} of the {} key/value heads{}",
                                                    model_->config().num_heads, mc.num_heads,
                                                    model_->config().num_kv_heads, mc.num_kv_heads,
                                                    model_->sequence_parallel() ? "; sequence parallel" : "")
                                      : ""));
  auto resumed = [](const Job& j) { return j.start.resume_from.empty() ? "" : ", resumed from " + j.start.resume_from; };
  if (lora_) {
    int64_t trainable = 0;
    for (const Job& j : jobs_) {
      trainable += bank_->parameter_count(j.adapter);
      if (!j.failed)
        progress_.message(fmt::format("{}lora r={} alpha={} targets={}: {} trainable parameters, {}{}", j.prefix(),
                                      j.cfg->lora_rank, j.cfg->lora_alpha, fmt::join(j.cfg->lora_targets, ","),
                                      human(double(bank_->parameter_count(j.adapter))),
                                      j.active() ? fmt::format("steps {}..{}", j.step + 1, j.cfg->max_steps)
                                                 : fmt::format("trained to step {}", j.step),
                                      resumed(j)));
    }
    // Frozen base: no gradient buffers and no optimizer state (master, m, v) for its weights.
    const double base = double(mc.parameter_count());
    const double grad_bytes = base * double(dtype_size(dtype_));
    const double opt_bytes =
        base * double(adamw_state_bytes_per_element(dtype_, dtype_from_name(jobs_[0].cfg->optimizer_states)));
    progress_.message(fmt::format("lora: {} trainable of {} base parameters ({:.3f}%); the frozen base needs no gradients "
                                  "({:.2f} GiB) and no optimizer state ({:.2f} GiB)",
                                  human(double(trainable)), human(base), 100.0 * double(trainable) / base,
                                  grad_bytes / 1073741824.0, opt_bytes / 1073741824.0));
  } else {
    const Job& j = jobs_[0];
    progress_.message(j.active() ? fmt::format("train: steps {}..{}{}", j.step + 1, c_.max_steps, resumed(j))
                                 : fmt::format("train: trained to step {} already{}; completing its outputs", j.step,
                                               resumed(j)));
  }
  ctx_.emplace(rt_.context(device_));
  if (source_ && std::any_of(jobs_.begin(), jobs_.end(), [](const Job& j) { return j.active(); })) start_source();
  if (!buckets_.empty())
    reducer_ = std::make_unique<GradReducer>(bucketed_, buckets_, groups_->weight_sums(), *ctx_, *groups_->grad_stream,
                                             sharded() ? GradReducer::Mode::ReduceScatter : GradReducer::Mode::AllReduce);
  if (!expert_buckets_.empty())
    expert_reducer_ = std::make_unique<GradReducer>(experts_, expert_buckets_, *groups_->edp_grads, *ctx_,
                                                    *groups_->grad_stream, GradReducer::Mode::ReduceScatter);
  t_start_ = Clock::now();
}

// The job's adapter start, optimizer (with the resumed state), loader, schedule and writers.
void Trainer::Impl::build_job(Job& j) {
  const TrainConfig& jc = *j.cfg;
  if (lora_) {
    if (!j.start.resume_from.empty()) bank_->load_peft(j.adapter, (fs::path(j.start.resume_from) / "adapter").string());
    else if (!jc.lora_init.empty()) bank_->load_peft(j.adapter, jc.lora_init);
    else bank_->init(j.adapter, mix_seed(jc.seed, 0x10a, 0));
  }
  if (sharded()) {  // ZeRO: this rank updates (and keeps the state of) 1/dp (1/(dp cp)) of the model
    if (tp_) check_zero_slots_agree();
    // Under ep the experts are a second group, cut over the edp ranks that hold the same ones.
    std::vector<ZeroGroup> cut = {{bucketed_, buckets_, &groups_->weight_replicas(), &groups_->weight_sums()}};
    if (!expert_buckets_.empty())
      cut.push_back({experts_, expert_buckets_, groups_->edp.get(), groups_->edp_grads.get()});
    j.zero = std::make_unique<ZeroShards>(std::move(cut));
    j.params = &j.zero->owned();
  } else {
    // LoRA under tp: the matrices one by one (each with its slice's layout), not the flat parameter.
    j.params = !lora_ ? &model_->parameters() : tp_ ? &bank_->parameters(j.adapter) : &bank_->flat_parameter(j.adapter);
  }
  AdamWConfig acfg;
  acfg.beta1 = jc.beta1;
  acfg.beta2 = jc.beta2;
  acfg.eps = jc.eps;
  acfg.weight_decay = jc.weight_decay;
  acfg.state_dtype = dtype_from_name(jc.optimizer_states);  // f32 | bf16 (config.cpp checks)
  j.opt = std::make_unique<AdamW>(rt_, *j.params, acfg);
  if (!j.start.resume_from.empty()) load_optimizer(j);
  j.step = j.state.value("step", int64_t(0));
  j.tokens_seen = j.state.value("tokens_seen", int64_t(0));
  j.bad_in_row = j.state.value("bad_steps_in_a_row", int64_t(0));
  if (j.train) {
    j.loader_options.capacity = jc.micro_batch_tokens;
    j.loader_options.seed = jc.seed;
    j.loader_options.rank = groups_ ? groups_->dp_rank() : 0;  // rank r takes global batches r, r + dp, ...
    j.loader_options.world = dp_;
    j.loader = std::make_unique<data::PackedLoader>(j.train, j.loader_options,
                                                    j.state.contains("loader") ? j.state["loader"] : nlohmann::json(nullptr));
  }
  j.sched.kind = schedule_kind_from_name(jc.schedule);
  j.sched.lr = jc.lr;
  j.sched.warmup_steps = jc.warmup_steps;
  j.sched.total_steps = jc.max_steps;
  j.sched.min_lr_ratio = jc.min_lr_ratio;
  if (first_) {
    j.metrics = std::make_unique<MetricsWriter>((j.out / "metrics.jsonl").string());
    j.metrics->truncate_after(j.step);  // entries past the checkpoint belong to the interrupted run
    j.tb = std::make_unique<TensorBoardWriter>((j.out / "tb").string(), j.step + 1);
  }
  j.summary.final_step = j.step;
}

// ZeRO under tp: every tp slot cuts its own slices' flat space, and the pieces of one dp rank of every slot are summed
// over tp (the norm, the shared k/v slices), so the slots' slices must have the same sizes, in the same order (the
// families' splits give that; checked, since a difference would pair other pieces): the sums over tp of each size and
// of its square are tp times this rank's only if every rank's are the same.
void Trainer::Impl::check_zero_slots_agree() {
  const std::vector<Parameter>& params = model_->parameters();
  std::vector<double> sizes(2 * params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    sizes[i] = double(params[i].value.numel());
    sizes[params.size() + i] = sizes[i] * sizes[i];
  }
  const std::vector<double> sums = sum_over(*tp_, sizes);
  const double tp = double(tp_->size());
  for (size_t i = 0; i < params.size(); ++i)
    LATHE_CHECK(sums[i] == tp * sizes[i] && sums[params.size() + i] == tp * sizes[params.size() + i],
                "train: parallel.zero under parallel.tp needs every tp rank's slices of one size; {} has {} elements "
                "here and another size on another tp rank", params[i].name, params[i].value.numel());
}

// The resumed checkpoint's optimizer state, kept as this run keeps it: whole, this rank's tp (ep, pp) slices, or its
// ZeRO pieces. A checkpoint saved the same way is read as it is (the whole state, a slice's file, or this rank's shard
// at the same layout); any other is assembled into a temporary file of this rank's tensors first (reslice_tp_state
// for slices, assemble_optimizer_state for ZeRO pieces: load_zero_optimizer).
void Trainer::Impl::load_optimizer(Job& j) {
  const fs::path from = j.start.resume_from;
  check_optimizer_layout(j);
  const nlohmann::json saved = saved_zero_layout(j);
  // Tensor or expert parallelism, now or then: the checkpoint's slices, one file per rank of the slicing group.
  const int saved_tp = j.state.value("tp", 1), saved_ep = j.state.value("ep", 1), saved_pp = j.state.value("pp", 1);
  const int n = slices() ? slices()->size() : 1;
  const std::string saved_kind = slice_kind_of(saved_tp, saved_ep, saved_pp);
  const int saved_n = saved_tp * saved_ep * saved_pp;
  if (j.zero || !saved.is_null()) {
    load_zero_optimizer(j, saved, {saved_kind, saved_n, j.state.value("pipeline", std::string())});
    return;
  }
  if (saved_n > 1 || slices()) {  // this rank's slices (and whole tensors)
    const bool same_stages = j.state.value("pipeline", std::string()) ==
                             (model_->pp_size() > 1 ? model_->options().pipeline.describe() : std::string());
    if (saved_n == n && saved_kind == slice_kind() && same_stages) {
      j.opt->load((from / slice_state_name(saved_kind, slices()->rank(), n)).string());
      return;
    }
    const int tp = tp_ ? tp_->size() : 1;
    LATHE_CHECK(!lora_ || (saved_tp > 1) == (tp > 1), "train: {}: a LoRA checkpoint saved at parallel.tp = {} cannot "
                "resume at tp {}: between tp 1 and tp > 1 the adapters' optimizer state is laid out differently (one "
                "flat tensor, or matrix by matrix); resume it at {}", from.string(), saved_tp, tp,
                saved_tp > 1 ? "any tp above 1" : "tp 1");
    const fs::path tmp = fs::temp_directory_path() /
                         fmt::format("lathe-optimizer-{}-{}.safetensors", getpid(), groups_ ? groups_->rank : 0);
    std::vector<std::string> files;  // the old group's files, or the whole state
    for (int r = 0; r < saved_n; ++r) files.push_back((from / slice_state_name(saved_kind, r, saved_n)).string());
    if (saved_n == 1) files = {(from / "optimizer.safetensors").string()};
    reslice_tp_state(files, *j.params, tmp.string());
    j.opt->load(tmp.string());
    fs::remove(tmp);
    progress_.message(fmt::format("train: the optimizer state of {} was saved at {} {}; re-cut for {} {}", from.string(),
                                  saved_kind, saved_n, slices() ? slice_kind() : saved_kind, n));
    return;
  }
  j.opt->load((from / "optimizer.safetensors").string());
}

Trainer::Impl::Slicing Trainer::Impl::slicing() const {
  return {slice_kind(), slices() ? slices()->size() : 1,
          model_->pp_size() > 1 ? model_->options().pipeline.describe() : std::string()};
}

std::string Trainer::Impl::layout_text(const nlohmann::json& zero, const Slicing& slicing) {
  return fmt::format("parallel.{} = {}{}{}", slicing.kind, slicing.ranks,
                     slicing.stages.empty() ? "" : fmt::format(" (stages {})", slicing.stages),
                     zero.is_null() ? std::string(", without ZeRO")
                                    : fmt::format(", ZeRO shards over {} ranks", zero.value("dp", 0)));
}

// ZeRO now or in the checkpoint (full fine-tuning): this rank's pieces (or its whole tensors) from the checkpoint's
// shards (or whole state). At the checkpoint's slicing (tp, ep, stages) each slot of the slicing group reads its own
// slot's files, as one slot does without tp or pp; at another, the old state is made this rank's whole slices first (a
// ZeRO checkpoint assembled whole, or slot by slot into its slices' whole state, then cut). A ZeRO checkpoint under ep
// resumes at its own layout only (refused otherwise, naming both layouts).
void Trainer::Impl::load_zero_optimizer(Job& j, const nlohmann::json& saved, const Slicing& then_slicing) {
  const fs::path from = j.start.resume_from;
  const Slicing now_slicing = slicing();
  const std::string then = layout_text(saved, then_slicing);
  const std::string now = layout_text(j.zero ? j.zero->layout() : nlohmann::json(nullptr), now_slicing);
  if (then_slicing == now_slicing && j.zero && saved == j.zero->layout()) {
    j.opt->load((from / zero_state_name(zero_slice(), groups_->weight_replicas().rank(), grad_ranks_)).string());
    return;
  }
  // Under ep each rank's shard holds its pieces of its experts (cut over edp) beside those of the rest ("experts").
  LATHE_CHECK(saved.is_null() || !saved.contains("experts"), "train: {} was saved at {} under parallel.ep (the experts' "
              "state cut over the ranks holding each); this run is at {}: re-cutting it is not built. Resume it at its "
              "layout, with the same parallel.ep, dp and zero", from.string(), then, now);
  // Another slicing: a checkpoint without tp, ep or pp is assembled whole (every tensor of this run's model named); one
  // of slices from each slot's shards, as its tensors were listed when it was saved ("zero_slots").
  LATHE_CHECK(saved.is_null() || then_slicing == now_slicing || (then_slicing.ranks == 1 && model_->pp_size() == 1) ||
                  (then_slicing.ranks > 1 && j.state.contains("zero_slots")),
              "train: {} was saved at {}; this run is at {}: re-cutting these ZeRO shards for another tp or stage "
              "layout is not built. Resume it at parallel.{} = {}{} (any dp or cp, with or without ZeRO); a checkpoint "
              "saved there with parallel.zero: 0 resumes at any layout", from.string(), then, now, then_slicing.kind,
              then_slicing.ranks, then_slicing.stages.empty() ? "" : " with the same stages");
  const fs::path tmp = fs::temp_directory_path() /
                       fmt::format("lathe-optimizer-{}-{}.safetensors", getpid(), groups_ ? groups_->rank : 0);
  if (then_slicing == now_slicing) recut_zero_in_slot(j, saved, tmp);
  else recut_zero_from_another_slicing(j, saved, then_slicing, tmp);
  progress_.message(fmt::format("train: the optimizer state of {} was saved {}; re-cut for this run's layout ({})",
                                from.string(), saved.is_null() ? "whole" : fmt::format("in ZeRO shards over dp = {}",
                                saved.value("dp", 0)), now));
  j.opt->load(tmp.string());
  std::error_code ec;
  fs::remove(tmp, ec);
}

// At the checkpoint's slicing (or without tp and pp): this rank's pieces, or its whole tensors, from its slot's old
// files (another dp or cp, other buckets, ZeRO from a whole state or the reverse).
void Trainer::Impl::recut_zero_in_slot(Job& j, const nlohmann::json& saved, const fs::path& out) const {
  const std::string from = j.start.resume_from;
  if (j.zero) {
    j.zero->reshard_state(from, saved, out.string(), zero_slice());
    return;
  }
  const std::vector<StatePiece> pieces = whole_state_pieces(*j.params, false);
  const int64_t elements = pieces.empty() ? 0 : pieces.back().param_end;
  assemble_optimizer_state(from, saved, pieces, elements, out.string(), zero_slice());
}

// From another slicing: the old state as whole files (a slicing group's, one process's, each old slot's ZeRO shards
// assembled into its whole state, or the shards of a ZeRO checkpoint without tp or pp assembled whole), cut into this
// rank's slices (reslice_tp_state), then under ZeRO into its pieces.
void Trainer::Impl::recut_zero_from_another_slicing(Job& j, const nlohmann::json& saved, const Slicing& then,
                                                    const fs::path& out) const {
  const fs::path from = j.start.resume_from;
  const fs::path scratch = out.string() + ".d";
  fs::create_directories(scratch);
  std::vector<std::string> files;
  if (!saved.is_null() && then.ranks > 1) {  // each old slot's shards: its whole state first
    files = assemble_slot_states(from.string(), j.state["zero_slots"], then.kind, scratch.string());
  } else if (!saved.is_null()) {  // the shards of one slot holding every tensor whole: the whole state first
    const std::vector<StatePiece> pieces = whole_state_pieces(model_->parameters(), true);
    files = {(scratch / "whole.safetensors").string()};
    assemble_optimizer_state(from.string(), saved, pieces, pieces.back().param_end, files[0]);
  } else {
    for (int r = 0; r < then.ranks; ++r) files.push_back((from / slice_state_name(then.kind, r, then.ranks)).string());
    if (then.ranks == 1) files = {(from / "optimizer.safetensors").string()};
  }
  const fs::path slices = j.zero ? scratch / zero_state_name("", 0, 0) : out;  // this rank's slices, whole
  reslice_tp_state(files, model_->parameters(), slices.string());
  if (j.zero) j.zero->reshard_state(scratch.string(), nullptr, out.string());
  std::error_code ec;
  fs::remove_all(scratch, ec);
}

// ZeRO under tp, pp or ep: every slot's layout (ZeroShards::layout, with its tensors for a re-cut at other slices:
// assemble_slot_states), over the slicing group, in slot order.
nlohmann::json Trainer::Impl::zero_slot_layouts(const ZeroShards& zero) {
  nlohmann::json layout = zero.layout();
  layout["tensors"] = zero.tensors();
  return gathered_json(rt_, device_, *slices(), layout);
}

// The checkpoint's ZeRO layout of this rank's slot: its entry of "zero_slots" where the checkpoint has one for each
// slot of this run's slicing group, else "zero" (null: no ZeRO).
nlohmann::json Trainer::Impl::saved_zero_layout(const Job& j) const {
  if (!j.state.contains("zero")) return nullptr;
  const nlohmann::json& slots = j.state.contains("zero_slots") ? j.state["zero_slots"] : nlohmann::json(nullptr);
  if (!slices() || !slots.is_array() || int(slots.size()) != slices()->size()) return j.state["zero"];
  nlohmann::json mine = slots[size_t(slices()->rank())];
  mine.erase("tensors");
  return mine;
}

// A checkpoint's ZeRO layout must be one this Lathe cuts shards by (the counts are checked against the model at load).
void Trainer::Impl::check_optimizer_layout(const Job& j) const {
  if (!j.state.contains("zero")) return;
  const nlohmann::json& z = j.state["zero"];
  LATHE_CHECK(z.is_object() && z.contains("dp") && z.contains("elements") && z.contains("buckets") && !lora_,
              "train: {}/trainer_state.json: its \"zero\" layout ({}) is not one this Lathe reads (dp, elements, "
              "buckets; full fine-tuning)", j.start.resume_from, z.dump());
}

// A tenant's error stops that tenant only: recorded in its folder and the summary, the others go on.
void Trainer::Impl::fail(Job& j, const std::string& why) {
  if (c_.tenants.empty()) throw Error(why);
  j.failed = true;
  j.error = why;
  if (j.metrics) {  // the folder is prepared (before that, prepare_outputs writes FAILED)
    write_file_atomic((j.out / "FAILED").string(), why + "\n", j.who());
    j.metrics->write({{"step", j.step}, {"failed", why}});
  }
  progress_.message(fmt::format("train: tenant {} failed at step {} and is stopped (the others continue): {}", j.label,
                                j.step, why));
}

void Trainer::Impl::guarded(Job& j, const std::function<void()>& f) {
  if (j.failed) return;
  try {
    f();
  } catch (const Error& e) {
    fail(j, e.what());
  }
}

void Trainer::Impl::write_model_files(const std::string& dir) const {
  data::copy_tokenizer_files(c_.tokenizer, dir);
  if (!fs::exists(fs::path(dir) / "generation_config.json"))
    write_file_atomic((fs::path(dir) / "generation_config.json").string(),
                      generation_config(model_->config(), *tokenizer_).dump(2) + "\n", "train");
  data::write_chat_template_kwargs(dir, chat_kwargs_);
}

// Micro-batches: each active job adds its own micro-batch; together they make one packed batch over the shared base,
// the rows of each job a segment of its adapter.
void Trainer::Impl::run_micro_batches(const std::vector<Job*>& active, const std::function<void()>& queue_optimizer) {
  const ModelConfig& mc = model_->global_config();  // the whole vocabulary (config()'s is a tp rank's rows)
  std::vector<PackedBatch> pipeline_batches;
  std::vector<std::vector<Job*>> pipeline_jobs;
  int64_t max_accum = 0;
  for (Job* j : active) max_accum = std::max(max_accum, j->cfg->grad_accum);
  for (int64_t micro = 0; micro < max_accum; ++micro) {
    std::vector<int32_t> ids, labels, cu = {0};
    std::vector<BatchSegment> segments;
    std::vector<Job*> in_batch;
    for (Job* j : active) {
      if (micro >= j->cfg->grad_accum || j->failed) continue;
      guarded(*j, [&] {
        const data::Batch b = j->loader->next();
        check_batch_fits(b, mc.vocab_size);
        const int32_t base_row = int32_t(ids.size());
        ids.insert(ids.end(), b.ids.begin(), b.ids.end());
        labels.insert(labels.end(), b.labels.begin(), b.labels.end());
        for (size_t k = 1; k < b.cu_seqlens.size(); ++k) cu.push_back(base_row + b.cu_seqlens[k]);
        segments.push_back({int64_t(ids.size()), j->adapter, 1.0 / double(j->cfg->grad_accum * dp_),
                            mix_seed(j->cfg->seed, uint64_t(j->step + 1), uint64_t(micro))});
        j->tokens += b.tokens();
        j->flops += flops_per_token(mc, b.cu_seqlens) * double(b.tokens());
        in_batch.push_back(j);
      });
    }
    if (in_batch.empty()) continue;
    PackedBatch pb = make_packed_batch(rt_, device_, std::move(ids), std::move(cu), std::move(labels), mc.vocab_size);
    if (lora_) set_segments(pb, segments);
    if (model_->pp_size() > 1) {  // the step's micro-batches go through the pipeline together, below
      pipeline_batches.push_back(std::move(pb));
      pipeline_jobs.push_back(std::move(in_batch));
      continue;
    }
    const bool last = micro + 1 == max_accum;
    const BackwardHooks hooks = micro_batch_hooks(last, queue_optimizer);
    account_micro_batch(model_->loss(pb, true, lora_ ? 1.0 : 1.0 / double(jobs_[0].cfg->grad_accum * dp_), hooks),
                        in_batch);
  }
  if (pipeline_batches.empty()) return;
  const std::vector<LossResult> results = through_stages(
      pipeline_batches, lora_ ? 1.0 : 1.0 / double(jobs_[0].cfg->grad_accum * dp_), queue_optimizer);
  for (size_t i = 0; i < results.size(); ++i) account_micro_batch(results[i], pipeline_jobs[i]);
}

// Pipeline parallelism: a step's micro-batches through the stages (each batch's row loss, if any, on the last), the
// last stage's losses shared with the others, a tied embedding's two halves summed (LoRA: the adapters' gradients
// over the stages); the gradients are then complete, as after a backward.
std::vector<LossResult> Trainer::Impl::through_stages(const std::vector<PackedBatch>& micro, double loss_scale,
                                                      const std::function<void()>& queue_optimizer) {
  std::vector<LossResult> results = run_pipeline(*model_, micro, true, loss_scale);
  broadcast_losses(*model_, results);
  if (lora_) bank_->sum_grads_over(*groups_->pp);  // every stage holds the adapters, each its layers' gradients
  else sum_tied_embedding_grads(*model_);
  const BackwardHooks hooks = micro_batch_hooks(true, queue_optimizer);
  if (hooks.grads_done) hooks.grads_done(-1);
  if (hooks.queued) hooks.queued();
  return results;
}

// A micro-batch's losses, aux loss and expert loads into the figures of the jobs whose rows it holds.
void Trainer::Impl::account_micro_batch(const LossResult& r, const std::vector<Job*>& in_batch) {
  for (size_t k = 0; k < in_batch.size(); ++k) {
    const LossResult::Segment seg = lora_ ? r.segments[k] : LossResult::Segment{r.loss_sum, r.labelled};
    in_batch[k]->loss_sum += seg.labelled ? seg.loss_sum / double(seg.labelled) : 0.0;
    in_batch[k]->labelled += seg.labelled;
    // The routing is the whole batch's (the tenants of one batch share the base model's experts).
    in_batch[k]->aux_sum += r.aux_loss;
    // Under ep every rank of an ep group has the group's loads: its first rank's count once in the sum over dp.
    const bool counts = !groups_ || !groups_->ep || groups_->ep->rank() == 0;
    for (const ExpertLoadStat& s : r.expert_load) {
      std::vector<int64_t>& acc = in_batch[k]->expert_tokens[s.layer];
      acc.resize(s.tokens_per_expert.size(), 0);
      for (size_t e = 0; e < acc.size(); ++e) acc[e] += counts ? s.tokens_per_expert[e] : 0;
    }
  }
}

// The backward hooks of a step's micro-batch (`last`: the step's last on this rank). Data parallelism with full
// fine-tuning: the reducer sums the gradient buckets as the backward completes them, and after the last micro-batch
// the optimizer is queued; one process: the last queues it; LoRA under data parallelism: step() queues it, once the
// adapters' sums are in.
BackwardHooks Trainer::Impl::micro_batch_hooks(bool last, const std::function<void()>& queue_optimizer) {
  BackwardHooks hooks;
  if (reducer_) {
    for (GradReducer* r : reducers()) r->begin_micro_batch(last || c_.zero == 2);
    hooks.grads_done = [this](int64_t layers_left) {
      for (GradReducer* r : reducers()) r->grads_done(layers_left);
    };
    hooks.queued = [this, last, queue_optimizer] {
      for (GradReducer* r : reducers()) r->end_micro_batch();
      if (!last) return;
      if (jobs_[0].zero) jobs_[0].zero->take_grads(reduced_sums());
      queue_optimizer();
    };
  } else if (last && grad_ranks_ == 1) {
    hooks.queued = queue_optimizer;
  }
  return hooks;
}

// A step source's batch for the active jobs (this rank's share under data parallelism): its terms carry their weights
// (so no scaling by a micro-batch count). Under LoRA each active job's rows are the segment with its adapter, whose
// loss is the job's (a segment without an adapter: rows of a job that failed, which the source keeps with no loss).
void Trainer::Impl::run_source_batch(const std::vector<Job*>& active, PackedBatch& pb,
                                     const std::function<void()>& queue_optimizer) {
  LATHE_CHECK(pb.row_loss, "train: a step source's batch has no row loss");
  LATHE_CHECK(lora_ || (pb.segments.empty() && active.size() == 1),
              "train: a step source's batch for full fine-tuning has {} segments for {} jobs", pb.segments.size(),
              active.size());
  std::vector<size_t> segment_of;  // active job k's segment
  for (Job* j : active) {
    size_t s = 0;
    while (s < pb.segments.size() && pb.segments[s].adapter != j->adapter) ++s;
    LATHE_CHECK(!lora_ || s < pb.segments.size(), "train: a step source's batch has no rows for {}", j->who());
    segment_of.push_back(s);
    if (lora_) pb.segments[s].dropout_seed = mix_seed(j->cfg->seed, uint64_t(j->step + 1), 0);
  }
  const double flops = flops_per_token(model_->config(), pb.host_cu) * double(pb.tokens());
  const LossResult r = model_->pp_size() > 1  // under pp the batch is one micro-batch through the stages
                           ? through_stages({pb}, 1.0, queue_optimizer)[0]
                           : model_->loss(pb, true, 1.0, micro_batch_hooks(true, queue_optimizer));
  for (size_t k = 0; k < active.size(); ++k) {
    Job& j = *active[k];
    const size_t s = segment_of[k];
    const int64_t rows = lora_ ? pb.segments[s].rows_end - (s ? pb.segments[s - 1].rows_end : 0) : pb.tokens();
    j.loss_sum += lora_ ? r.segments[s].loss_sum : r.loss_sum;
    j.labelled += lora_ ? r.segments[s].labelled : r.labelled;
    j.tokens += rows;
    j.flops += flops * double(rows) / double(std::max<int64_t>(pb.tokens(), 1));  // the job's share of the batch's
  }
}

// The source's start, after the model, adapters and optimizers are built (and resumed). On a fresh run with a
// final_eval.file, each job's held-out accuracy before its first step is printed and recorded, to set beside the final
// one.
void Trainer::Impl::start_source() {
  SourceRanks ranks;
  if (dp_ > 1) {
    ranks.rank = groups_->dp_rank();
    ranks.ranks = int(dp_);
    ranks.sum = [this](const std::vector<double>& v) { return sum_over_dp(v); };
  }
  std::vector<SourceJob> jobs;
  for (const Job& j : jobs_)
    jobs.push_back({lora_ ? j.adapter : -1, j.state.contains("source") ? j.state["source"] : nlohmann::json(nullptr),
                    j.active()});
  SourceHandover handover;
  handover.offload = [this] {
    size_t bytes = 0;
    for (Job& j : jobs_)
      if (j.opt) bytes += j.opt->offload();
    return bytes;
  };
  handover.restore = [this] {
    size_t bytes = 0;
    for (Job& j : jobs_)
      if (j.opt) bytes += j.opt->restore();
    return bytes;
  };
  handover.starting_model = [this] {
    ModelOptions mopt = model_->options();
    mopt.train_base = false;
    mopt.recompute = false;
    // model.path (or the warm start's final model), else the seed's initialisation; a resumed run's model_source_
    // is its checkpoint, which is not where the run started.
    return c_.model_path.empty() ? random_causal_lm(rt_, model_config_, mopt, c_.seed, c_.init_std)
                                 : load_causal_lm(rt_, c_.model_path, mopt);
  };
  source_->start(*model_, jobs, ranks, handover);
  for (Job& j : jobs_) {
    if (j.step > 0 || !j.active() || j.cfg->final_eval_file.empty() || !lead_) continue;
    const FinalEvalResult r = held_out(j, j.prefix() + "before training: ");
    if (!first_) continue;
    j.metrics->write({{"step", 0}, {"start_eval_accuracy", r.accuracy}, {"start_eval_correct", r.correct},
                      {"start_eval_total", r.total}});
    j.summary.start_eval_accuracy = r.accuracy;
  }
}

// The job's optimizer step on its own gradient norm, schedule and clipping; returns its metrics entry (null when the
// job failed).
nlohmann::json Trainer::Impl::optimizer_step(Job& j, double norm, AdamW::Prepared&& update) {
  const TrainConfig& jc = *j.cfg;
  const int64_t step = j.step + 1;
  // A source's terms carry the whole step's weights (summed over the ranks: the step's loss); the SFT micro-batches
  // add their means.
  const double loss = source_ ? j.loss_sum : j.loss_sum / double(jc.grad_accum * dp_);
  const double lr = learning_rate(j.sched, step);
  nlohmann::json m = {{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm}, {"tokens", j.tokens}, {"labelled", j.labelled}};
  if (!j.expert_tokens.empty()) {  // MoE: the aux loss (mean over micro-batches) and each sparse layer's load
    m["aux_loss"] = j.aux_sum / double(jc.grad_accum * dp_);
    nlohmann::json load = nlohmann::json::object();
    for (const auto& [layer, counts] : j.expert_tokens) {
      const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
      const int64_t mx = *std::max_element(counts.begin(), counts.end());
      const double mean = double(total) / double(counts.size());
      load[std::to_string(layer)] = {{"tokens_per_expert", counts}, {"max_over_mean", mean > 0 ? double(mx) / mean : 0.0}};
    }
    m["expert_load"] = std::move(load);
  }
  if (!std::isfinite(norm) || !std::isfinite(loss)) {
    ++j.bad_in_row;
    m["skipped"] = true;
    progress_.message(fmt::format("{}train: step {}: non-finite loss or gradient (loss {}, grad norm {}); step skipped ({} in a row)",
                                  j.prefix(), step, loss, norm, j.bad_in_row));
    if (j.bad_in_row >= jc.max_bad_steps) {
      fail(j, fmt::format("train: {} non-finite steps in a row (last at step {}); stopping. Lower train.lr or check the data; "
                          "the last checkpoint is {}", j.bad_in_row, step, latest_checkpoint(j.out.string())));
      if (lora_) bank_->clear(j.adapter);
      return nullptr;
    }
  } else {
    j.bad_in_row = 0;
    j.opt->step(std::move(update), lr, clip_factor(norm, jc.max_grad_norm), [&j](size_t bucket) {
      if (j.zero) j.zero->gather_through(bucket);
    });
    if (lora_ && !values_finite(*ctx_, *j.params)) {
      fail(j, fmt::format("train: the adapter's weights overflowed at step {} (lr {}); stopping", step, lr));
      bank_->clear(j.adapter);
      return nullptr;
    }
  }
  j.step = step;
  return m;
}

// The step's metrics, evaluation, TensorBoard scalars, checkpoint and (at the last step) final model of one job.
void Trainer::Impl::record_step(Job& j, nlohmann::json& m, double dt, double mem_mib, int64_t run_tokens) {
  const TrainConfig& jc = *j.cfg;
  const int64_t step = j.step;
  j.tokens_seen += j.tokens;
  m["tokens_per_s"] = double(j.tokens) / dt;
  m["step_time_s"] = dt;
  m["elapsed_s"] = std::chrono::duration<double>(Clock::now() - t_start_).count();  // since the first step began
  if (jobs_.size() > 1) m["run_tokens_per_s"] = double(run_tokens) / dt;
  if (peak_ > 0) m["mfu"] = j.flops / dt / peak_;
  m["memory_mib"] = mem_mib;
  const double loss = m["loss"].get<double>();
  if (!m.contains("skipped")) {
    if (j.summary.steps_run == 0) j.summary.first_loss = loss;
    j.summary.last_loss = loss;
  }
  j.summary.steps_run++;
  j.summary.final_step = step;
  const bool save = saves_at(jc, step);
  nlohmann::json zero_slots;  // ZeRO under tp or pp: every slot's layout (the stages' differ), for the first rank
  if (save && j.zero) {  // every rank's optimizer shard (its slot's), before the first rank makes the checkpoint
    make_dirs(zero_shard_dir(j), j.who());
    const std::string name = zero_state_name(zero_slice(), groups_->weight_replicas().rank(), grad_ranks_);
    j.opt->save((zero_shard_dir(j) / name).string());
    if (slices()) zero_slots = zero_slot_layouts(*j.zero);
    groups_->world->barrier();
  } else if (save && slices() && joins_save()) {  // the first replica's slices group: each its slices' state
    if (first_) make_dirs(zero_shard_dir(j), j.who());
    slices()->barrier();
    j.opt->save((zero_shard_dir(j) / slice_state_name(slice_kind(), slices()->rank(), slices()->size())).string());
    slices()->barrier();
  }
  const bool evaluates = j.eval && jc.eval_every > 0 && (step % jc.eval_every == 0 || step == jc.max_steps);
  if (!first_) {  // the other ranks hold the same state; the first rank's tp group joins its model work
    if (!lead_) return;
    if (evaluates) evaluate(rt_, *model_, j);
    if (save && joins_save() && lora_ && writes_adapters())  // gathers
      bank_->save_peft(j.adapter, std::string(), save_dtype_, base_model_);
    else if (save && joins_save() && !lora_) model_->save(std::string(), save_dtype_);  // gathers; the first rank writes
    if (step == jc.max_steps) write_final(j);
    return;
  }
  if (evaluates) {
    const double eval_loss = evaluate(rt_, *model_, j);
    m["eval_loss"] = eval_loss;
    progress_.message(fmt::format("{}eval: step {} loss {:.4f}", j.prefix(), step, eval_loss));
  }
  j.metrics->write(m);
  if (fault_injected("after_step", step)) _exit(9);
  std::vector<std::pair<std::string, double>> scalars = {{"train/loss", m["loss"].get<double>()}, {"train/lr", m["lr"].get<double>()},
                                                         {"train/grad_norm", m["grad_norm"].get<double>()},
                                                         {"train/tokens_per_s", double(j.tokens) / dt}};
  if (m.contains("eval_loss")) scalars.push_back({"eval/loss", m["eval_loss"].get<double>()});
  if (m.contains("mfu")) scalars.push_back({"train/mfu", m["mfu"].get<double>()});
  if (m.contains("aux_loss")) scalars.push_back({"train/aux_loss", m["aux_loss"].get<double>()});
  if (m.contains("expert_load"))
    for (const auto& [layer, v] : m["expert_load"].items())
      scalars.push_back({"moe/layer_" + layer + "_max_over_mean", v["max_over_mean"].get<double>()});
  if (source_ && m.contains(source_->name()))
    for (const auto& [name, v] : m[source_->name()].items())
      if (v.is_number()) scalars.push_back({source_->name() + "/" + name, v.get<double>()});
  j.tb->add_scalars(step, scalars);
  if (source_)
    for (const auto& [tag, values] : source_->step_histograms(size_t(&j - jobs_.data())))
      j.tb->add_histogram(step, source_->name() + "/" + tag, values);
  if (save) {
    nlohmann::json st = {{"step", step}, {"loader", j.loader ? j.loader->state() : nlohmann::json(nullptr)},
                         {"tokens_seen", j.tokens_seen}, {"bad_steps_in_a_row", j.bad_in_row}, {"tokenizer", fs::absolute(c_.tokenizer).string()},
                         {"base_model", base_model_}, {"lora", lora_}, {"config", jc.resolved}};
    if (j.zero) st["zero"] = j.zero->layout();
    if (!zero_slots.is_null()) st["zero_slots"] = zero_slots;
    if (tp_) st["tp"] = tp_->size();
    if (groups_ && groups_->ep) st["ep"] = groups_->ep->size();
    if (groups_ && groups_->pp) {
      st["pp"] = groups_->pp->size();
      st["pipeline"] = model_->options().pipeline.describe();  // another split of the layers re-cuts the state
    }
    if (source_) st["source"] = source_->state(size_t(&j - jobs_.data()));
    save_checkpoint(j, [&](const fs::path& dir) {
      const auto add = [&](const std::string& d) { data::write_chat_template_kwargs(d, chat_kwargs_); };
      if (lora_) bank_->save_peft(j.adapter, (dir / "adapter").string(), save_dtype_, base_model_, add);
      else model_->save((dir / "model").string(), save_dtype_, 5ull << 30, add);
      if (j.zero) {
        move_zero_shards(j, dir);
        return;
      }
      if (slices()) {
        for (int r = 0; r < slices()->size(); ++r) {
          const std::string name = slice_state_name(slice_kind(), r, slices()->size());
          fs::rename(zero_shard_dir(j) / name, dir / name);
        }
        fs::remove_all(zero_shard_dir(j));
        return;
      }
      j.opt->save((dir / "optimizer.safetensors").string());
    }, st);
  }
  if (step == jc.max_steps) write_final(j);
}

// ZeRO: every rank's shard (every slot's under tp or pp), written into the job's shard folder (record_step), moved into
// the checkpoint's folder `dir` before it appears.
void Trainer::Impl::move_zero_shards(const Job& j, const fs::path& dir) const {
  const fs::path shards = zero_shard_dir(j);
  for (const auto& e : fs::directory_iterator(shards))  // every slot's (under ep the slots are not dp x cp apart)
    fs::rename(e.path(), dir / e.path().filename());
  fs::remove_all(shards);
}

// `values` summed over the dp group, through a tensor on the training device (the group's data plane), back on the
// host. Waiting for it waits for every collective queued before it in the stream, bounded by parallel.timeout_s.
std::vector<double> Trainer::Impl::sum_over_dp(const std::vector<double>& values) {
  return sum_over(*groups_->dp, values);
}

std::vector<double> Trainer::Impl::sum_over(Communicator& group, const std::vector<double>& values) {
  return summed_over(rt_, device_, group, values);
}

// A tenant that failed on any rank is failed on every rank, so that all ranks run the same collectives from here on.
void Trainer::Impl::agree_on_failures(const std::vector<Job*>& active) {
  std::vector<double> failed;
  for (Job* j : active) failed.push_back(j->failed ? 1.0 : 0.0);
  const std::vector<double> any = sum_over_dp(failed);
  for (size_t k = 0; k < active.size(); ++k)
    if (any[k] > 0 && !active[k]->failed) {
      fail(*active[k], fmt::format("train: failed on another data-parallel rank at step {}", active[k]->step + 1));
      if (lora_) bank_->clear(active[k]->adapter);
    }
}

// Data (and context) parallelism: every rank's gradients summed over the ranks that hold the same weights (dp, or
// dp x cp) and the step figures over the dp group (in rank order, so every rank ends with the same values and takes
// the same optimizer step). Returns the communication the backward did not hide (seconds): the device's wait for the
// last buckets, and the figures' sum.
double Trainer::Impl::reduce_over_replicas(const std::vector<Job*>& active) {
  double exposed_s = 0;
  if (reducer_) {
    for (GradReducer* r : reducers())  // the buckets were summed during the backward; the host waits for the last
      exposed_s = std::max(exposed_s, r->wait() / 1e3);
  } else {
    agree_on_failures(active);
    const auto t0 = Clock::now();
    reduce_adapter_grads(active);
    exposed_s = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  const auto t0 = Clock::now();
  std::vector<double> stats;  // the step's figures of every job, summed after the gradients
  for (Job* j : active) {
    if (j->failed) continue;
    stats.insert(stats.end(), {j->loss_sum, double(j->labelled), double(j->tokens), j->flops, j->aux_sum});
    for (auto& [layer, counts] : j->expert_tokens)
      for (int64_t n : counts) stats.push_back(double(n));
  }
  if (stats.empty()) return exposed_s;
  // Each rank's peak memory so far (its slot; the others' zero), summed into every rank's list.
  const size_t mem_at = stats.size();
  stats.resize(stats.size() + size_t(dp_), 0.0);
  stats[mem_at + size_t(groups_->dp_rank())] = peak_memory_mib(rt_, device_);
  const std::vector<double> summed = sum_over_dp(stats);
  rank_mem_mib_.assign(summed.begin() + std::ptrdiff_t(mem_at), summed.end());
  const double* v = summed.data();
  for (Job* j : active) {
    if (j->failed) continue;
    j->loss_sum = *v++;
    j->labelled = int64_t(*v++);
    j->tokens = int64_t(*v++);
    j->flops = *v++;
    j->aux_sum = *v++;
    for (auto& [layer, counts] : j->expert_tokens)
      for (int64_t& n : counts) n = int64_t(*v++);
  }
  return exposed_s + std::chrono::duration<double>(Clock::now() - t0).count();
}

// LoRA: the adapters' gradients are complete only at the end of the backward (LoraBank collects them there), and the
// set of tenants can change from step to step, so they are summed after the backward, in buckets over this step's
// adapters.
void Trainer::Impl::reduce_adapter_grads(const std::vector<Job*>& active) {
  std::vector<Parameter*> params;
  for (Job* j : active)
    if (!j->failed)
      for (Parameter& p : *j->params) params.push_back(&p);
  if (params.empty()) return;
  rt_.synchronize(device_);  // the backward's end: what follows is the exposed communication
  GradReducer reducer(params, plan_buckets(params, std::vector<int64_t>(params.size(), -1), int64_t(c_.bucket_mb * 1048576.0)),
                      groups_->weight_sums(), *ctx_, *groups_->grad_stream, GradReducer::Mode::AllReduceInPlace);
  reducer.begin_micro_batch(true);
  reducer.end_micro_batch();
  reducer.wait();
}

bool Trainer::Impl::step() {
  std::vector<Job*> active;
  for (Job& j : jobs_)
    if (j.active()) active.push_back(&j);
  if (active.empty()) return false;
  const auto t0 = Clock::now();
  const int64_t flushes_before = cache_flushes(rt_, device_);
  // A step source's batches (a rollout, for RL) come before the step's memory plan opens.
  PackedBatch* source_batch = nullptr;
  if (source_) {
    std::vector<size_t> ids;
    for (Job* j : active) ids.push_back(size_t(j - jobs_.data()));
    source_batch = source_->batch(ids);
  }
  // The step is the memory plan's window: its batches, activations, gradients and the optimizer's temporaries are
  // born and die inside it (full fine-tuning drops the gradients at its end), so a step that repeats is laid out
  // whole. Closed as aborted if an error leaves the step.
  MemoryPlanWindow window(plan_);
  // train.profile_step: this step's kernels timed (contexts made from here on carry the profiler).
  std::optional<OpProfiler> profiler;
  if (c_.profile_step > 0 && jobs_[0].step + 1 == c_.profile_step) {
    profiler.emplace(rt_.backend(device_.type), device_);
    rt_.set_profiler(&*profiler);
    ctx_.emplace(rt_.context(device_));
  }
  begin_step(active);
  // Each job's gradient norm and prepared AdamW update: queued from the last micro-batch's backward, before the host
  // waits for its loss (BackwardHooks::queued), or at the optimizer step for a job not queued by then.
  PendingUpdates pending(jobs_.size());
  const std::function<void()> queue_optimizer = [&] { queue_updates(active, pending); };
  if (source_) run_source_batch(active, *source_batch, queue_optimizer);
  else run_micro_batches(active, queue_optimizer);
  double dp_comm_s = grad_ranks_ > 1 ? reduce_over_replicas(active) : 0.0;
  queue_optimizer();
  const std::vector<nlohmann::json> entries = apply_updates(active, pending, dp_comm_s);
  // Test hooks (tests/e2e/test_train_dp.cpp, dev/gpu_dp.sh): after step N's update the last rank dies with SIGKILL, as
  // kill -9 would leave it, or stops with SIGSTOP, as a hung rank would.
  if (groups_ && groups_->rank == groups_->grid.world() - 1) {
    if (fault_injected("rank_sigkill", jobs_[0].step)) raise(SIGKILL);
    if (fault_injected("rank_sigstop", jobs_[0].step)) raise(SIGSTOP);
  }
  if (!lora_) model_->zero_grads();
  window.close();
  rt_.synchronize(device_);
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  if (profiler) {
    rt_.set_profiler(nullptr);
    ctx_.emplace(rt_.context(device_));
  }
  if (plan_) report_memory_plan(plan_->plan_stats(), memory_said_, progress_);
  ++run_steps_;
  StepTotals totals{dt, dp_comm_s, peak_memory_mib(rt_, device_)};
  totals.cache_flushes = cache_flushes(rt_, device_) - flushes_before;
  report_full_device(totals.cache_flushes, jobs_[0].step, memory_said_, progress_);
  for (Job* j : active) totals.tokens += j->tokens, totals.flops += j->flops;
  if (profiler && first_)
    print_step_profile(profiler->collect(), 1e3 * dt, double(totals.tokens), totals.flops, 0.0, peak_);
  record_steps(active, entries, totals);
  return true;
}

void Trainer::Impl::begin_step(const std::vector<Job*>& active) {
  if (lora_) bank_->zero_grads();
  else model_->zero_grads();
  for (Job* j : active) {
    j->loss_sum = j->flops = j->aux_sum = 0;
    j->labelled = j->tokens = 0;
    j->expert_tokens.clear();
  }
}

void Trainer::Impl::queue_updates(const std::vector<Job*>& active, PendingUpdates& pending) {
  if (!pending.replicas_summed) {  // tensor parallelism: the parts of gradients that several ranks make (else nothing)
    if (lora_) bank_->sum_tp_grads();
    else if (jobs_[0].zero)  // ZeRO under tp: each piece of a shared k/v slice over the slice's replicas
      for (Parameter& p : jobs_[0].zero->owned()) model_->sum_over_replicas(p);
    else model_->sum_replicated_grads();
  }
  if (!pending.replicas_summed && groups_ && groups_->edp && groups_->edp->size() > 1 && !lora_ && !expert_reducer_)
    for (Parameter& p : model_->parameters())  // expert parallelism: each expert's gradient over its replicas
      if (p.shard.group == "ep" && p.grad.defined()) groups_->edp->all_reduce(p.grad);
  pending.replicas_summed = true;
  for (Job* j : active) {
    const size_t k = size_t(j - jobs_.data());
    if (j->failed || pending.norms[k]) continue;
    // Under ZeRO the squares are summed over the weight replicas afterwards (apply_updates), which under ep are the ep
    // ranks too (each expert on one of them): the experts are then counted locally, not over ep first.
    pending.norms[k].emplace(
        launch_grad_norm(*ctx_, *j->params, tp_, groups_ && !j->zero ? groups_->ep.get() : nullptr, norm_skip(*j)));
    // Host work while the device sums the squares; under ZeRO the update reports each bucket (its all-gather).
    pending.updates[k].emplace(j->zero ? j->opt->prepare(j->zero->owned_buckets()) : j->opt->prepare());
  }
}

std::vector<nlohmann::json> Trainer::Impl::apply_updates(const std::vector<Job*>& active, PendingUpdates& pending,
                                                         double& dp_comm_s) {
  std::vector<nlohmann::json> entries(jobs_.size());
  for (Job* j : active) {
    if (j->failed) continue;
    const size_t k = size_t(j - jobs_.data());
    double norm = pending.norms[k]->read();
    if (j->zero) norm = std::sqrt(sum_over(groups_->weight_replicas(), {norm * norm})[0]);  // each its range's
    if (groups_ && groups_->pp && !lora_) norm = std::sqrt(sum_over(*groups_->pp, {norm * norm})[0]);  // its stages'
    // ZeRO: every rank's updated range into every rank's parameters, a bucket's all-gather launched as soon as its
    // update is queued (optimizer_step), the rest after it.
    if (j->zero) j->zero->begin_gather(*ctx_, *groups_->grad_stream);
    entries[k] = optimizer_step(*j, norm, std::move(*pending.updates[k]));
    if (j->zero) {
      dp_comm_s += j->zero->finish_gather() / 1e3;
      j->zero->drop_grads();
    }
  }
  for (GradReducer* r : reducers()) r->clear();
  return entries;
}

void Trainer::Impl::record_steps(const std::vector<Job*>& active, std::vector<nlohmann::json> entries,
                                 const StepTotals& totals) {
  std::string tenant_losses;
  bool saved = false;
  for (Job* j : active)
    if (!j->failed && !entries[size_t(j - jobs_.data())].is_null())
      saved |= saves_at(*j->cfg, j->step);
  // Every rank is alive before the first one starts a save (a rank lost here is reported under the collectives'
  // timeout, not the save's).
  if (source_ && saved) source_->before_save();
  if (groups_ && saved) groups_->world->barrier();
  for (Job* j : active) {
    nlohmann::json& m = entries[size_t(j - jobs_.data())];
    if (j->failed || m.is_null()) continue;
    if (grad_ranks_ > 1) m["dp_comm_s"] = totals.dp_comm_s;
    if (dp_ > 1) m["memory_mib_ranks"] = rank_mem_mib_;
    if (totals.cache_flushes > 0) m["cache_flushes"] = totals.cache_flushes;
    if (source_) m[source_->name()] = source_->step_metrics(size_t(j - jobs_.data()));
    guarded(*j, [&] { record_step(*j, m, totals.dt, totals.mem_mib, totals.tokens); });
    tenant_losses += fmt::format("{}{} {}", tenant_losses.empty() ? "" : ", ", j->label,
                                 source_ ? source_->progress(size_t(j - jobs_.data()))
                                         : fmt::format("{:.4f}", m["loss"].get<double>()));
  }
  // While the first rank writes the step's checkpoints, the others wait here under the save timeout, rather than in
  // the next step's first collective under the collectives' one.
  if (groups_ && saved) groups_->world->barrier(c_.save_timeout_s, "parallel.save_timeout_s");
  print_progress(active.size(), entries, totals, tenant_losses);
}

void Trainer::Impl::print_progress(size_t active, const std::vector<nlohmann::json>& entries,
                                   const StepTotals& totals, const std::string& tenant_losses) {
  const double elapsed = std::chrono::duration<double>(Clock::now() - t_start_).count();
  int64_t remaining = 0;
  for (const Job& j : jobs_)
    if (j.active()) remaining = std::max(remaining, j.cfg->max_steps - j.step);
  const double eta = elapsed / double(run_steps_) * double(remaining), dt = totals.dt, mem = totals.mem_mib;
  const std::string rate =
      fmt::format("{} tok/s{}", human(double(totals.tokens) / dt),
                  peak_ > 0 ? fmt::format(" | MFU {:.1f}%", 100.0 * totals.flops / dt / peak_) : "");
  if (jobs_.size() == 1 && !jobs_[0].failed) {
    const Job& j = jobs_[0];
    const nlohmann::json& m = entries[0];
    if (!m.is_null())
      progress_.step(j.step, j.cfg->max_steps,
                     fmt::format("step {}/{} | loss {:.4f} | lr {:.2e} | grad-norm {:.3f}{} | {} | mem {:.0f} MiB | ETA {}",
                                 j.step, j.cfg->max_steps, m["loss"].get<double>(), m["lr"].get<double>(),
                                 m["grad_norm"].get<double>(), source_ ? " | " + source_->progress(0) : "", rate, mem,
                                 duration(eta)));
  } else if (jobs_.size() > 1) {
    progress_.step(run_steps_, run_steps_ + remaining,
                   fmt::format("step {} | {} tenants | {}{} | {} | mem {:.0f} MiB | ETA {}", run_steps_, active,
                               source_ ? "" : "loss ", tenant_losses, rate, mem, duration(eta)));
  }
}

// The final export: an HF folder (with the tokenizer's files, generation_config.json and the chat-template settings),
// or a PEFT adapter folder with the same files; it appears whole.
void Trainer::Impl::write_final(Job& j) {
  if (!joins_save()) return;  // (under tp the group gathers the model; its first rank writes)
  const fs::path final_dir = j.out / "final";
  const auto add = [&](const std::string& d) { write_model_files(d); };
  if (lora_ && writes_adapters()) bank_->save_peft(j.adapter, final_dir.string(), save_dtype_, base_model_, add);
  else if (!lora_) model_->save(final_dir.string(), save_dtype_, 5ull << 30, add);
  j.needs_final = false;
  progress_.message(fmt::format("{}train: done at step {}; {} written to {}", j.prefix(), j.step, lora_ ? "adapter" : "model",
                                final_dir.string()));
}

// The job's held-out accuracy now (LoRA: with its adapter merged into the base, then restored); each log line is
// printed after `prefix`.
FinalEvalResult Trainer::Impl::held_out(Job& j, const std::string& prefix) {
  if (model_->pp_size() > 1) return held_out_whole(j, prefix);
  std::vector<std::pair<Parameter*, Tensor>> saved;  // the weights the merge changes, restored afterwards
  if (lora_) {
    for (const std::string& name : lora_merge_targets(*bank_, j.adapter)) {
      Parameter& p = model_->parameter(name);
      saved.push_back({&p, rt_.copy_to(p.value, device_)});
    }
    merge_lora(*model_, *bank_, j.adapter);
  }
  const FinalEvalResult r = run_final_eval(rt_, *model_, *tokenizer_, j.final_eval_rows, j.cfg->final_eval_file,
                                           j.cfg->final_eval_max_new_tokens,
                                           [&](const std::string& l) { progress_.message(prefix + l); });
  for (auto& [p, v] : saved) p->value = v;
  return r;
}

// Pipeline parallelism: the rollout engine decodes through whole models, not stages, so the first rank evaluates the
// job's exported final folder (the model, or the base with the adapter merged) as one model on its device, which it
// must fit beside the rank's stage; the other ranks do not take part.
FinalEvalResult Trainer::Impl::held_out_whole(Job& j, const std::string& prefix) {
  ModelOptions mopt;
  mopt.device = device_;
  mopt.dtype = dtype_;
  mopt.train_base = false;
  const std::string final_dir = (j.out / "final").string();
  std::unique_ptr<CausalLm> whole = load_causal_lm(rt_, lora_ ? base_model_ : final_dir, mopt);
  if (lora_) {
    LoraBank bank(rt_, whole->config(), device_, dtype_, {read_lora_config(final_dir)});
    bank.load_peft(0, final_dir);
    merge_lora(*whole, bank, 0);
  }
  return run_final_eval(rt_, *whole, *tokenizer_, j.final_eval_rows, j.cfg->final_eval_file,
                        j.cfg->final_eval_max_new_tokens, [&](const std::string& l) { progress_.message(prefix + l); });
}

void Trainer::Impl::final_eval(Job& j) {
  if (!lead_ || (model_->pp_size() > 1 && !first_)) return;  // (under pp the first rank alone: held_out_whole)
  const FinalEvalResult r = held_out(j, j.prefix());
  j.needs_final_eval = false;
  if (!first_) return;
  j.summary.final_eval_accuracy = r.accuracy;
  j.metrics->write({{"step", j.step}, {"final_eval_accuracy", r.accuracy}, {"final_eval_correct", r.correct},
                    {"final_eval_total", r.total}});
}

void Trainer::Impl::finish() {
  progress_.finish();
  if (plan_ && !plan_->release_arena())  // generation and export allocate as they need
    progress_.message("memory plan: a block of the arena outlived the last step; the arena stays held");
  for (Job& j : jobs_) {
    if (j.failed || j.step < j.cfg->max_steps) continue;
    guarded(j, [&] {
      if (j.needs_final) write_final(j);  // resumed at max_steps from a run that died before writing it
      if (!j.cfg->final_eval_file.empty() && (j.summary.steps_run > 0 || j.needs_final_eval)) final_eval(j);
    });
  }
}

TrainSummary Trainer::Impl::summary(bool already_finished) const {
  TrainSummary summary;
  summary.already_finished = already_finished;
  for (const Job& j : jobs_) {
    JobSummary s = j.summary;
    if (already_finished) {  // what the finished run recorded
      s.final_step = j.folder.latest_step;
      s.first_loss = j.folder.first_loss;
      s.last_loss = j.folder.last_loss;
      s.final_eval_accuracy = j.folder.final_eval_accuracy;
      s.output_dir = j.out.string();
    }
    s.failed = j.failed;
    s.error = j.error;
    summary.jobs.push_back(s);
  }
  const JobSummary& first = summary.jobs[0];
  summary.steps_run = first.steps_run;
  summary.final_step = first.final_step;
  summary.first_loss = first.first_loss;
  summary.last_loss = first.last_loss;
  summary.final_eval_accuracy = first.final_eval_accuracy;
  return summary;
}

Trainer::Trainer(Runtime& rt, const TrainConfig& config, ProcessGroups* groups, StepSource* source)
    : impl_(std::make_unique<Impl>(rt, config, groups, source)) {}
Trainer::~Trainer() = default;
bool Trainer::finished() const { return impl_->finished(); }
void Trainer::prepare_outputs() { impl_->prepare_outputs(); }
void Trainer::build() { impl_->build(); }
bool Trainer::step() { return impl_->step(); }
void Trainer::finish() { impl_->finish(); }
TrainSummary Trainer::summary(bool already_finished) const { return impl_->summary(already_finished); }

TrainSummary run_training(const TrainConfig& c) {
  Runtime rt;
  return run_training(rt, c, nullptr);
}

TrainSummary run_training(Runtime& rt, const TrainConfig& c, ProcessGroups* groups, StepSource* source) {
  Trainer trainer(rt, c, groups, source);  // reads and checks every input; writes nothing
  if (trainer.finished()) return trainer.summary(true);
  trainer.prepare_outputs();
  trainer.build();
  while (trainer.step()) {
  }
  trainer.finish();
  return trainer.summary(false);
}

}  // namespace lathe
