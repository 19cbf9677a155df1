#include "train/trainer.h"

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

#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/packing.h"
#include "data/tokenizer.h"
#include "model/lora.h"
#include "model/causal_lm.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/schedule.h"
#include "train/final_eval.h"
#include "train/flops.h"
#include "train/metrics.h"
#include "train/tensorboard.h"

namespace lathe {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                 "generation_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"};

void write_file_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + fmt::format(".tmp-{}", getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f << text;
    f.flush();
    LATHE_CHECK(f.good(), "train: cannot write {}", tmp.string());
  }
  fs::rename(tmp, path);
}

void copy_tokenizer_files(const std::string& from, const fs::path& to) {
  for (const char* name : kTokenizerFiles)
    if (fs::exists(fs::path(from) / name)) fs::copy_file(fs::path(from) / name, to / name, fs::copy_options::overwrite_existing);
}

std::string step_dir_name(int64_t step) { return fmt::format("step-{:08d}", step); }

// LATHE_FAULT_INJECT=<point>:<step> makes the process die at that point (tests of crash safety only).
bool fault_injected(const char* point, int64_t step) {
  const char* f = std::getenv("LATHE_FAULT_INJECT");
  return f && std::string(f) == fmt::format("{}:{}", point, step);
}


std::string human(double x) {
  if (x >= 1e9) return fmt::format("{:.1f}G", x / 1e9);
  if (x >= 1e6) return fmt::format("{:.1f}M", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f}k", x / 1e3);
  return fmt::format("{:.0f}", x);
}

std::string duration(double s) {
  if (!(s >= 0) || s > 1e7) return "?";
  const int64_t t = int64_t(s);
  return t >= 3600 ? fmt::format("{}h{:02d}m", t / 3600, t % 3600 / 60) : fmt::format("{}m{:02d}s", t / 60, t % 60);
}

std::shared_ptr<const data::Corpus> load_corpus(const std::vector<std::string>& files, const data::RowEncoder& enc,
                                                data::DatasetStats* stats) {
  if (files.size() == 1) return data::open_corpus(files[0], enc, stats);
  auto corpus = std::make_shared<data::MemoryCorpus>();
  for (const std::string& f : files) {
    const data::DatasetStats s = data::encode_jsonl(f, enc, [&](data::Sample&& x) { corpus->append(x); });
    stats->samples += s.samples;
    stats->tokens += s.tokens;
    stats->labelled += s.labelled;
    stats->bad_rows += s.bad_rows;
    stats->truncated += s.truncated;
    stats->dropped_too_long += s.dropped_too_long;
    stats->dropped_no_labels += s.dropped_no_labels;
  }
  return corpus;
}


class Progress {
 public:
  explicit Progress(int64_t log_every) : tty_(isatty(STDOUT_FILENO)), log_every_(log_every) {}
  void step(int64_t step, int64_t total, const std::string& line) {
    if (tty_) {
      std::printf("\r\033[K%s", line.c_str());
      std::fflush(stdout);
    } else if (step % log_every_ == 0 || step == total) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
  }
  void message(const std::string& line) {
    std::printf(tty_ ? "\r\033[K%s\n" : "%s\n", line.c_str());
    std::fflush(stdout);
  }
  void finish() {
    if (tty_) std::printf("\n");
  }

 private:
  bool tty_;
  int64_t log_every_;
};

}  // namespace

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

namespace {

// One model being trained: the whole model (full fine-tuning) or one LoRA adapter (a tenant). Everything a job
// owns — data, optimizer, schedule, metrics, checkpoints — is its own; a failing job is stopped alone.
struct Job {
  const TrainConfig* cfg = nullptr;
  fs::path out;
  std::string label;  // "" for a single-job run, else the tenant's name
  int adapter = -1;   // LoRA: index in the bank
  std::vector<Parameter>* params = nullptr;
  std::shared_ptr<const data::Corpus> train, eval;
  data::LoaderOptions loader_options;
  std::unique_ptr<data::PackedLoader> loader;
  std::unique_ptr<AdamW> opt;
  std::unique_ptr<MetricsWriter> metrics;
  std::unique_ptr<TensorBoardWriter> tb;
  ScheduleConfig sched;
  std::string resume_from;
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
  std::string prefix() const { return label.empty() ? "" : label + ": "; }
};

uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^ c * 0x94D049BB133111EBull;
  z = (z ^ (z >> 31)) * 0xD6E8FEB86927D7A9ull;
  return z ^ (z >> 29);
}

void save_checkpoint(const Job& job, const std::function<void(const fs::path&)>& write_weights, const nlohmann::json& state) {
  const fs::path dir = job.out / "checkpoints";
  fs::create_directories(dir);
  const fs::path final_dir = dir / step_dir_name(job.step);
  const fs::path tmp = final_dir.string() + fmt::format(".tmp-{}", getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  write_weights(tmp);
  job.opt->save((tmp / "optimizer.safetensors").string());
  // Test hook (tests/e2e): die in the middle of the save of step N, as a crash or kill -9 would.
  if (fault_injected("checkpoint_save", job.step)) _exit(3);
  write_file_atomic(tmp / "trainer_state.json", state.dump(2));
  fs::remove_all(final_dir);  // a checkpoint of the same step from an earlier, replaced run
  fs::rename(tmp, final_dir);
  // Keep the newest `keep_last` complete checkpoints.
  std::vector<fs::path> all;
  for (const auto& e : fs::directory_iterator(dir))
    if (std::regex_match(e.path().filename().string(), std::regex("step-[0-9]{8}"))) all.push_back(e.path());
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + size_t(job.cfg->keep_last) < all.size(); ++i) fs::remove_all(all[i]);
}

// A device batch of one job's host batch, its rows served by `adapter` (-1: no adapter).
PackedBatch single_job_batch(Runtime& rt, const CausalLm& model, const data::Batch& b, int adapter) {
  PackedBatch pb = make_packed_batch(rt, model.options().device, b.ids, b.cu_seqlens, b.labels, model.config().vocab_size);
  if (adapter >= 0) set_segments(pb, {{pb.tokens(), adapter, 1.0, 0}});
  return pb;
}

double evaluate(Runtime& rt, CausalLm& model, const Job& job) {
  data::LoaderOptions o = job.loader_options;
  o.shuffle = false;
  o.rank = 0;
  o.world = 1;
  o.prefetch = 0;
  data::PackedLoader loader(job.eval, o);
  const int64_t n = std::min<int64_t>(job.cfg->eval_batches, loader.batches_in_first_epoch());
  double sum = 0;
  int64_t labelled = 0;
  for (int64_t i = 0; i < n; ++i) {
    const LossResult r = model.loss(single_job_batch(rt, model, loader.next(), job.adapter), false);
    sum += r.loss_sum;
    labelled += r.labelled;
  }
  return labelled ? sum / double(labelled) : NAN;
}

// The sum of squares of the parameters' values is finite (an update that overflowed would poison other tenants).
bool values_finite(ExecContext& ctx, std::vector<Parameter>& params) {
  std::vector<Parameter> as_grads;
  for (const Parameter& p : params) as_grads.push_back({p.name, p.value, p.value});
  return std::isfinite(global_grad_norm(ctx, as_grads));
}

void check_batch_fits(const data::Batch& b, int64_t vocab) {
  for (size_t i = 0; i < b.ids.size(); ++i) {
    LATHE_CHECK(b.ids[i] >= 0 && b.ids[i] < vocab, "data: token id {} is outside the model's vocabulary ({})", b.ids[i], vocab);
    LATHE_CHECK(b.labels[i] == -100 || (b.labels[i] >= 0 && b.labels[i] < vocab),
                "data: label {} is outside the model's vocabulary ({})", b.labels[i], vocab);
  }
}

// What the log has said about the memory plan, so that each thing is said once.
struct MemoryPlanReport {
  bool outcome = false;  // planned, or why not
  bool misses = false;   // a step left the planned sequence
};

void report_memory_plan(const PlanStats& s, MemoryPlanReport& said, Progress& progress) {
  if (!said.outcome && (s.planned || !s.not_planned.empty())) {
    said.outcome = true;
    progress.message(s.planned ? fmt::format("memory plan: {} of a step's {} allocations laid out in one arena of "
                                             "{:.0f} MiB (their peak live {:.0f} MiB)",
                                             s.planned_blocks, s.recorded_blocks, double(s.arena_bytes) / 1048576.0,
                                             double(s.peak_live_bytes) / 1048576.0)
                               : fmt::format("memory plan: none ({}); allocations stay block by block", s.not_planned));
  }
  if (s.planned && !said.misses && s.misses > 0) {
    said.misses = true;
    progress.message(fmt::format("memory plan: a step departed from the planned sequence ({} allocations so far outside "
                                 "the arena, {} in it): steps whose batches differ in shape share the plan only in part "
                                 "(docs/training.md)", s.misses, s.hits));
  }
}

}  // namespace

TrainSummary run_training(const TrainConfig& c) {
  Runtime rt;
  rt.set_gemm_autotune(c.gemm_autotune);
  const Device device = parse_device(c.device);
  rt.check_device(device);
  PlannedAllocator* const plan = c.memory_plan ? &rt.enable_memory_plan(device) : nullptr;
  const DType dtype = !c.dtype.empty() ? dtype_from_name(c.dtype) : device.is_cpu() ? DType::F32 : DType::BF16;
  const DType save_dtype = dtype == DType::F64 ? DType::F32 : dtype;
  const bool lora = c.tenants.empty() ? c.lora_rank > 0 : true;
  LATHE_CHECK(c.tenants.empty() || c.resume == "auto" || c.resume == "none",
              "train: resume: with tenants, only auto or none (each tenant resumes from its own output_dir)");
  fs::create_directories(c.output_dir);
  write_file_atomic(fs::path(c.output_dir) / "config.resolved.json", c.resolved.dump(2) + "\n");
  Progress progress(c.log_every);

  // Jobs: the run itself, or one per tenant.
  std::vector<Job> jobs(c.tenants.empty() ? 1 : c.tenants.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    Job& j = jobs[i];
    j.cfg = c.tenants.empty() ? &c : &c.tenants[i];
    j.label = j.cfg->name;
    j.out = j.cfg->output_dir;
    j.adapter = lora ? int(i) : -1;
    j.summary.name = j.label;
    fs::create_directories(j.out);
    for (const auto& e : fs::directory_iterator(fs::exists(j.out / "checkpoints") ? j.out / "checkpoints" : j.out))
      if (e.path().filename().string().find(".tmp-") != std::string::npos) fs::remove_all(e.path());  // interrupted saves
    if (!j.label.empty()) write_file_atomic(j.out / "config.resolved.json", j.cfg->resolved.dump(2) + "\n");
    fs::remove(j.out / "FAILED");
  }
  // A tenant's error stops that tenant only: recorded in its folder and the summary, the others go on.
  auto fail = [&](Job& j, const std::string& why) {
    if (c.tenants.empty()) throw Error(why);
    j.failed = true;
    j.error = why;
    write_file_atomic(j.out / "FAILED", why + "\n");
    if (j.metrics) j.metrics->write({{"step", j.step}, {"failed", why}});
    progress.message(fmt::format("train: tenant {} failed at step {} and is stopped (the others continue): {}", j.label, j.step, why));
  };
  auto guarded = [&](Job& j, const std::function<void()>& f) {
    if (j.failed) return;
    try {
      f();
    } catch (const Error& e) {
      fail(j, e.what());
    }
  };

  // Data (one tokenizer: the shared model's).
  const data::Tokenizer tokenizer = data::Tokenizer::from_dir(c.tokenizer);
  const std::optional<ChatTemplate> chat = data::load_chat_template(c.tokenizer);
  for (Job& j : jobs) {
    guarded(j, [&] {
      const TrainConfig& jc = *j.cfg;
      data::DatasetOptions dopt;
      dopt.format = data::parse_row_format(jc.data_format);
      dopt.max_seq_len = jc.max_seq_len;
      dopt.overlong = data::parse_overlong_policy(jc.overlong);
      dopt.skip_bad_rows = jc.skip_bad_rows;
      dopt.train_on_prompt = jc.train_on_prompt;
      dopt.chat_template_kwargs = {{"enable_thinking", false}};
      const data::RowEncoder encoder(tokenizer, chat ? &*chat : nullptr, dopt);
      data::DatasetStats train_stats, eval_stats;
      j.train = load_corpus(jc.train_files, encoder, &train_stats);
      progress.message(fmt::format("{}data: {}", j.prefix(), train_stats.summary()));
      if (!jc.eval_files.empty()) j.eval = load_corpus(jc.eval_files, encoder, &eval_stats);
      j.resume_from = jc.resume == "none" ? "" : jc.resume == "auto" ? latest_checkpoint(j.out.string()) : jc.resume;
      LATHE_CHECK(j.resume_from.empty() || fs::exists(fs::path(j.resume_from) / "trainer_state.json"),
                  "train: resume: {} is not a complete checkpoint (no trainer_state.json)", j.resume_from);
    });
  }

  // Model: for full fine-tuning a checkpoint to resume, the HF folder, or a new one; for LoRA the base always.
  ModelOptions mopt;
  mopt.device = device;
  mopt.dtype = dtype;
  mopt.recompute = c.recompute;
  mopt.deterministic = c.deterministic;
  mopt.train_base = !lora;
  if (c.router_aux_loss != "auto") mopt.router_aux_loss = c.router_aux_loss == "on";  // MoE (config.cpp checks)
  mopt.moe_padded_max_waste = c.moe_padded_max_waste;
  // LoRA over a from-scratch base: the base is written once to OUTPUT/base (and read back on resume), so the
  // adapters have a base folder to load onto in transformers/peft, `lathe logprobs --adapter` and export --merge.
  const fs::path scratch_base = fs::path(c.output_dir) / "base";
  std::unique_ptr<CausalLm> model;
  if (!lora && !jobs[0].resume_from.empty()) {
    model = load_causal_lm(rt, (fs::path(jobs[0].resume_from) / "model").string(), mopt);
  } else if (lora && c.model_path.empty() && fs::exists(scratch_base / "config.json")) {
    model = load_causal_lm(rt, scratch_base.string(), mopt);
  } else if (!c.model_path.empty()) {
    model = load_causal_lm(rt, c.model_path, mopt);
  } else {
    nlohmann::json cfg = c.model_config;
    if (!cfg.contains("model_type")) cfg["model_type"] = "qwen3";
    if (!cfg.contains("vocab_size")) cfg["vocab_size"] = tokenizer.vocab_size();
    model = random_causal_lm(rt, parse_model_config(cfg, "model.config"), mopt, c.seed, c.init_std);
  }
  const ModelConfig& mc = model->config();
  LATHE_CHECK(mc.vocab_size >= tokenizer.vocab_size(), "train: the model's vocabulary ({}) is smaller than the tokenizer's ({})",
              mc.vocab_size, tokenizer.vocab_size());
  std::string base_model = c.model_path.empty() ? "" : fs::absolute(c.model_path).string();
  if (lora && c.model_path.empty()) {
    if (!fs::exists(scratch_base / "config.json")) {
      model->save(scratch_base.string(), save_dtype);
      copy_tokenizer_files(c.tokenizer, scratch_base);
    }
    base_model = fs::absolute(scratch_base).string();
  }

  // LoRA: one bank holds every tenant's adapter.
  std::unique_ptr<LoraBank> bank;
  if (lora) {
    std::vector<LoraConfig> configs;
    for (const Job& j : jobs) {
      LoraConfig lc;
      lc.rank = std::max<int64_t>(1, j.cfg->lora_rank);
      lc.alpha = j.cfg->lora_alpha;
      lc.dropout = j.cfg->lora_dropout;
      lc.rslora = j.cfg->lora_rslora;
      lc.targets = j.cfg->lora_targets;
      lc.target_parameters = j.cfg->lora_target_parameters;
      configs.push_back(lc);
    }
    for (size_t i = 0; i < jobs.size(); ++i) {  // a tenant whose targets match nothing fails alone
      guarded(jobs[i], [&] { configs[i].validate(jobs[i].prefix() + "lora", mc); });
      if (jobs[i].failed) {
        configs[i].targets = {"all-linear"};
        configs[i].target_parameters.clear();
      }
    }
    bank = std::make_unique<LoraBank>(rt, mc, device, dtype, configs);
    model->attach_lora(bank.get());
  }

  for (Job& j : jobs) {
    guarded(j, [&] {
      const TrainConfig& jc = *j.cfg;
      if (lora) {
        if (!j.resume_from.empty()) bank->load_peft(j.adapter, (fs::path(j.resume_from) / "adapter").string());
        else if (!jc.lora_init.empty()) bank->load_peft(j.adapter, jc.lora_init);
        else bank->init(j.adapter, mix_seed(jc.seed, 0x10a, 0));
      }
      j.params = lora ? &bank->flat_parameter(j.adapter) : &model->parameters();
      AdamWConfig acfg;
      acfg.beta1 = jc.beta1;
      acfg.beta2 = jc.beta2;
      acfg.eps = jc.eps;
      acfg.weight_decay = jc.weight_decay;
      acfg.state_dtype = dtype_from_name(jc.optimizer_states);  // f32 | bf16 (config.cpp checks)
      j.opt = std::make_unique<AdamW>(rt, *j.params, acfg);
      nlohmann::json state = nlohmann::json::object();
      if (!j.resume_from.empty()) {
        j.opt->load((fs::path(j.resume_from) / "optimizer.safetensors").string());
        std::ifstream f(fs::path(j.resume_from) / "trainer_state.json");
        state = nlohmann::json::parse(f);
      }
      j.step = state.value("step", int64_t(0));
      j.tokens_seen = state.value("tokens_seen", int64_t(0));
      j.bad_in_row = state.value("bad_steps_in_a_row", int64_t(0));
      j.loader_options.capacity = jc.micro_batch_tokens;
      j.loader_options.seed = jc.seed;
      j.loader = std::make_unique<data::PackedLoader>(j.train, j.loader_options,
                                                      state.contains("loader") ? state["loader"] : nlohmann::json(nullptr));
      j.sched.kind = schedule_kind_from_name(jc.schedule);
      j.sched.lr = jc.lr;
      j.sched.warmup_steps = jc.warmup_steps;
      j.sched.total_steps = jc.max_steps;
      j.sched.min_lr_ratio = jc.min_lr_ratio;
      j.metrics = std::make_unique<MetricsWriter>((j.out / "metrics.jsonl").string());
      j.metrics->truncate_after(j.step);  // entries past the checkpoint belong to the interrupted run
      j.tb = std::make_unique<TensorBoardWriter>((j.out / "tb").string(), j.step + 1);
      j.summary.final_step = j.step;
    });
  }
  if (lora)
    for (Job& j : jobs)
      if (j.failed) bank->clear(j.adapter);

  const std::string device_name = rt.backend(device.type).info(device.index).name;
  const double peak = device.is_cuda() ? peak_flops(device_name) : 0.0;
  const size_t bf16_jobs = size_t(
      std::count_if(jobs.begin(), jobs.end(), [](const Job& j) { return j.cfg->optimizer_states == "bf16"; }));
  std::string states;
  if (bf16_jobs > 0) states = ", AdamW states in bf16 (no f32 masters)";
  if (bf16_jobs > 0 && bf16_jobs < jobs.size()) states += fmt::format(" for {} of {} tenants", bf16_jobs, jobs.size());
  progress.message(fmt::format("train: {} parameters, {} on {} ({}){}{}", human(double(mc.parameter_count())),
                               dtype_name(dtype), device.str(), device_name,
                               lora ? fmt::format(", LoRA with {} adapter(s)", jobs.size()) : "", states));
  if (lora) {
    int64_t trainable = 0;
    for (const Job& j : jobs) {
      trainable += bank->parameter_count(j.adapter);
      if (!j.failed)
        progress.message(fmt::format("{}lora r={} alpha={} targets={}: {} trainable parameters, steps {}..{}{}", j.prefix(),
                                     j.cfg->lora_rank, j.cfg->lora_alpha, fmt::join(j.cfg->lora_targets, ","),
                                     human(double(bank->parameter_count(j.adapter))), j.step + 1, j.cfg->max_steps,
                                     j.resume_from.empty() ? "" : ", resumed from " + j.resume_from));
    }
    // Frozen base: no gradient buffers and no optimizer state (master, m, v) for its weights.
    const double base = double(mc.parameter_count());
    const double grad_bytes = base * double(dtype_size(dtype));
    const double opt_bytes =
        base * double(adamw_state_bytes_per_element(dtype, dtype_from_name(jobs[0].cfg->optimizer_states)));
    progress.message(fmt::format("lora: {} trainable of {} base parameters ({:.3f}%); the frozen base needs no gradients "
                                 "({:.2f} GiB) and no optimizer state ({:.2f} GiB)",
                                 human(double(trainable)), human(base), 100.0 * double(trainable) / base,
                                 grad_bytes / 1073741824.0, opt_bytes / 1073741824.0));
  } else {
    progress.message(fmt::format("train: steps {}..{}{}", jobs[0].step + 1, c.max_steps,
                                 jobs[0].resume_from.empty() ? "" : ", resumed from " + jobs[0].resume_from));
  }

  auto write_weights = [&](const Job& j, const fs::path& dir) {
    if (lora) bank->save_peft(j.adapter, (dir / "adapter").string(), save_dtype, base_model);
    else model->save((dir / "model").string(), save_dtype);
  };
  auto finish = [&](Job& j) {  // final export: an HF folder, or a PEFT adapter folder, with the tokenizer files
    const fs::path final_dir = j.out / "final";
    if (lora) bank->save_peft(j.adapter, final_dir.string(), save_dtype, base_model);
    else model->save(final_dir.string(), save_dtype);
    copy_tokenizer_files(c.tokenizer, final_dir);
    progress.message(fmt::format("{}train: done at step {}; {} written to {}", j.prefix(), j.step, lora ? "adapter" : "model",
                                 final_dir.string()));
  };

  ExecContext ctx = rt.context(device);
  MemoryPlanReport plan_report;
  const auto t_start = Clock::now();
  int64_t run_steps = 0;
  for (;;) {
    std::vector<Job*> active;
    for (Job& j : jobs)
      if (j.active()) active.push_back(&j);
    if (active.empty()) break;
    const auto t0 = Clock::now();
    // The step is the memory plan's window: its batches, activations, gradients and the optimizer's temporaries are
    // born and die inside it (full fine-tuning drops the gradients at its end), so a step that repeats is laid out
    // whole. Closed as aborted if an error leaves the step.
    MemoryPlanWindow window(plan);
    if (lora) bank->zero_grads();
    else model->zero_grads();
    int64_t max_accum = 0;
    for (Job* j : active) {
      j->loss_sum = j->flops = j->aux_sum = 0;
      j->labelled = j->tokens = 0;
      j->expert_tokens.clear();
      max_accum = std::max(max_accum, j->cfg->grad_accum);
    }
    // Each job's gradient norm and prepared AdamW update: queued from the last micro-batch's backward, before the host
    // waits for its loss (CausalLm::loss's backward_queued), or at the optimizer step for a job not queued by then.
    std::vector<std::optional<PendingGradNorm>> norms(jobs.size());
    std::vector<std::optional<AdamW::Prepared>> updates(jobs.size());
    const std::function<void()> queue_optimizer = [&] {
      for (Job* j : active) {
        const size_t k = size_t(j - jobs.data());
        if (j->failed || norms[k]) continue;
        norms[k].emplace(launch_grad_norm(ctx, *j->params));
        updates[k].emplace(j->opt->prepare());  // host work while the device sums the squares
      }
    };
    // Micro-batches: each active job adds its own micro-batch; together they make one packed batch over the
    // shared base, the rows of each job a segment of its adapter.
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
          segments.push_back({int64_t(ids.size()), j->adapter, 1.0 / double(j->cfg->grad_accum),
                              mix_seed(j->cfg->seed, uint64_t(j->step + 1), uint64_t(micro))});
          j->tokens += b.tokens();
          j->flops += flops_per_token(mc, b.cu_seqlens) * double(b.tokens());
          in_batch.push_back(j);
        });
      }
      if (in_batch.empty()) continue;
      PackedBatch pb = make_packed_batch(rt, device, std::move(ids), std::move(cu), std::move(labels), mc.vocab_size);
      if (lora) set_segments(pb, segments);
      const LossResult r = model->loss(pb, true, lora ? 1.0 : 1.0 / double(jobs[0].cfg->grad_accum),
                                       micro + 1 == max_accum ? queue_optimizer : std::function<void()>());
      for (size_t k = 0; k < in_batch.size(); ++k) {
        const LossResult::Segment seg = lora ? r.segments[k] : LossResult::Segment{r.loss_sum, r.labelled};
        in_batch[k]->loss_sum += seg.labelled ? seg.loss_sum / double(seg.labelled) : 0.0;
        in_batch[k]->labelled += seg.labelled;
        // The routing is the whole batch's (the tenants of one batch share the base model's experts).
        in_batch[k]->aux_sum += r.aux_loss;
        for (const ExpertLoadStat& s : r.expert_load) {
          std::vector<int64_t>& acc = in_batch[k]->expert_tokens[s.layer];
          acc.resize(s.tokens_per_expert.size(), 0);
          for (size_t e = 0; e < acc.size(); ++e) acc[e] += s.tokens_per_expert[e];
        }
      }
    }
    // Each job's optimizer step, on its own gradient norm, schedule and clipping.
    std::vector<nlohmann::json> entries(jobs.size());
    queue_optimizer();
    for (Job* j : active) {
      if (j->failed) continue;
      const size_t k = size_t(j - jobs.data());
      const TrainConfig& jc = *j->cfg;
      const int64_t step = j->step + 1;
      const double loss = j->loss_sum / double(jc.grad_accum);
      const double norm = norms[k]->read();
      const double lr = learning_rate(j->sched, step);
      nlohmann::json m = {{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm}, {"tokens", j->tokens}, {"labelled", j->labelled}};
      if (!j->expert_tokens.empty()) {  // MoE: the aux loss (mean over micro-batches) and each sparse layer's load
        m["aux_loss"] = j->aux_sum / double(jc.grad_accum);
        nlohmann::json load = nlohmann::json::object();
        for (const auto& [layer, counts] : j->expert_tokens) {
          const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
          const int64_t mx = *std::max_element(counts.begin(), counts.end());
          const double mean = double(total) / double(counts.size());
          load[std::to_string(layer)] = {{"tokens_per_expert", counts}, {"max_over_mean", mean > 0 ? double(mx) / mean : 0.0}};
        }
        m["expert_load"] = std::move(load);
      }
      if (!std::isfinite(norm) || !std::isfinite(loss)) {
        ++j->bad_in_row;
        m["skipped"] = true;
        progress.message(fmt::format("{}train: step {}: non-finite loss or gradient (loss {}, grad norm {}); step skipped ({} in a row)",
                                     j->prefix(), step, loss, norm, j->bad_in_row));
        if (j->bad_in_row >= jc.max_bad_steps) {
          fail(*j, fmt::format("train: {} non-finite steps in a row (last at step {}); stopping. Lower train.lr or check the data; "
                               "the last checkpoint is {}", j->bad_in_row, step, latest_checkpoint(j->out.string())));
          if (lora) bank->clear(j->adapter);
          continue;
        }
      } else {
        j->bad_in_row = 0;
        j->opt->step(std::move(*updates[k]), lr, clip_factor(norm, jc.max_grad_norm));
        if (lora && !values_finite(ctx, *j->params)) {
          fail(*j, fmt::format("train: the adapter's weights overflowed at step {} (lr {}); stopping", step, lr));
          bank->clear(j->adapter);
          continue;
        }
      }
      j->step = step;
      entries[k] = std::move(m);
    }
    if (!lora) model->zero_grads();
    window.close();
    rt.synchronize(device);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (plan) report_memory_plan(plan->plan_stats(), plan_report, progress);
    ++run_steps;
    int64_t run_tokens = 0;
    double run_flops = 0;
    for (Job* j : active) run_tokens += j->tokens, run_flops += j->flops;
    const double mem_mib = peak_memory_mib(rt, device);
    std::string tenant_losses;
    for (Job* j : active) {
      nlohmann::json& m = entries[size_t(j - jobs.data())];
      if (j->failed || m.is_null()) continue;
      const TrainConfig& jc = *j->cfg;
      const int64_t step = j->step;
      j->tokens_seen += j->tokens;
      m["tokens_per_s"] = double(j->tokens) / dt;
      m["step_time_s"] = dt;
      if (jobs.size() > 1) m["run_tokens_per_s"] = double(run_tokens) / dt;
      if (peak > 0) m["mfu"] = j->flops / dt / peak;
      m["memory_mib"] = mem_mib;
      guarded(*j, [&] {
        if (j->eval && jc.eval_every > 0 && (step % jc.eval_every == 0 || step == jc.max_steps)) {
          const double eval_loss = evaluate(rt, *model, *j);
          m["eval_loss"] = eval_loss;
          progress.message(fmt::format("{}eval: step {} loss {:.4f}", j->prefix(), step, eval_loss));
        }
        j->metrics->write(m);
        if (fault_injected("after_step", step)) _exit(9);
        std::vector<std::pair<std::string, double>> scalars = {{"train/loss", m["loss"].get<double>()}, {"train/lr", m["lr"].get<double>()},
                                                               {"train/grad_norm", m["grad_norm"].get<double>()},
                                                               {"train/tokens_per_s", double(j->tokens) / dt}};
        if (m.contains("eval_loss")) scalars.push_back({"eval/loss", m["eval_loss"].get<double>()});
        if (m.contains("mfu")) scalars.push_back({"train/mfu", m["mfu"].get<double>()});
        if (m.contains("aux_loss")) scalars.push_back({"train/aux_loss", m["aux_loss"].get<double>()});
        if (m.contains("expert_load"))
          for (const auto& [layer, v] : m["expert_load"].items())
            scalars.push_back({"moe/layer_" + layer + "_max_over_mean", v["max_over_mean"].get<double>()});
        j->tb->add_scalars(step, scalars);
        const double loss = m["loss"].get<double>();
        if (!m.contains("skipped")) {
          if (j->summary.steps_run == 0) j->summary.first_loss = loss;
          j->summary.last_loss = loss;
        }
        j->summary.steps_run++;
        j->summary.final_step = step;
        tenant_losses += fmt::format("{}{} {:.4f}", tenant_losses.empty() ? "" : ", ", j->label, loss);
        if ((jc.save_every > 0 && step % jc.save_every == 0) || step == jc.max_steps) {
          const nlohmann::json st = {{"step", step}, {"loader", j->loader->state()}, {"tokens_seen", j->tokens_seen},
                                     {"bad_steps_in_a_row", j->bad_in_row}, {"tokenizer", fs::absolute(c.tokenizer).string()},
                                     {"base_model", base_model}, {"lora", lora}, {"config", jc.resolved}};
          save_checkpoint(*j, [&](const fs::path& dir) { write_weights(*j, dir); }, st);
        }
        if (step == jc.max_steps) finish(*j);
      });
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
    int64_t remaining = 0;
    for (const Job& j : jobs)
      if (j.active()) remaining = std::max(remaining, j.cfg->max_steps - j.step);
    const double eta = elapsed / double(run_steps) * double(remaining);
    const std::string rate = fmt::format("{} tok/s{}", human(double(run_tokens) / dt),
                                         peak > 0 ? fmt::format(" | MFU {:.1f}%", 100.0 * run_flops / dt / peak) : "");
    if (jobs.size() == 1 && !jobs[0].failed) {
      const Job& j = jobs[0];
      const nlohmann::json& m = entries[0];
      if (!m.is_null())
        progress.step(j.step, j.cfg->max_steps,
                      fmt::format("step {}/{} | loss {:.4f} | lr {:.2e} | grad-norm {:.3f} | {} | mem {:.0f} MiB | ETA {}", j.step,
                                  j.cfg->max_steps, m["loss"].get<double>(), m["lr"].get<double>(), m["grad_norm"].get<double>(),
                                  rate, mem_mib, duration(eta)));
    } else if (jobs.size() > 1) {
      progress.step(run_steps, run_steps + remaining,
                    fmt::format("step {} | {} tenants | loss {} | {} | mem {:.0f} MiB | ETA {}", run_steps, active.size(),
                                tenant_losses, rate, mem_mib, duration(eta)));
    }
  }
  progress.finish();
  if (plan && !plan->release_arena())  // generation and export allocate as they need
    progress.message("memory plan: a block of the arena outlived the last step; the arena stays held");

  // Final checks: each job's held-out accuracy (LoRA: with its adapter merged into the base, then restored).
  for (Job& j : jobs) {
    if (j.failed || j.cfg->final_eval_file.empty()) continue;
    guarded(j, [&] {
      std::vector<std::pair<Parameter*, Tensor>> saved;  // the weights the merge changes, restored afterwards
      if (lora) {
        for (const std::string& name : lora_merge_targets(*bank, j.adapter)) {
          Parameter& p = model->parameter(name);
          saved.push_back({&p, rt.copy_to(p.value, device)});
        }
        merge_lora(*model, *bank, j.adapter);
      }
      const FinalEvalResult r = run_final_eval(rt, *model, tokenizer, chat ? &*chat : nullptr, j.cfg->final_eval_file,
                                               j.cfg->final_eval_max_new_tokens,
                                               [&](const std::string& l) { progress.message(j.prefix() + l); });
      for (auto& [p, v] : saved) p->value = v;
      j.summary.final_eval_accuracy = r.accuracy;
      j.metrics->write({{"step", j.summary.final_step}, {"final_eval_accuracy", r.accuracy}, {"final_eval_correct", r.correct},
                        {"final_eval_total", r.total}});
    });
  }

  TrainSummary summary;
  for (Job& j : jobs) {
    j.summary.failed = j.failed;
    j.summary.error = j.error;
    summary.jobs.push_back(j.summary);
  }
  const JobSummary& first = summary.jobs[0];
  summary.steps_run = first.steps_run;
  summary.final_step = first.final_step;
  summary.first_loss = first.first_loss;
  summary.last_loss = first.last_loss;
  summary.final_eval_accuracy = first.final_eval_accuracy;
  return summary;
}

}  // namespace lathe
