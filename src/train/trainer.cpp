#include "train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>

#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/packing.h"
#include "data/tokenizer.h"
#include "model/qwen3.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/schedule.h"
#include "train/final_eval.h"
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

// Peak of the process's resident memory (CPU runs) in MiB.
double host_peak_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;
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

// Model FLOPs per token of a batch: 6 x matmul weights (the LM head once) plus causal attention,
// 6 L Hq D S averaged over the batch's documents (DESIGN.md, "Measuring").
double flops_per_token(const ModelConfig& c, const data::Batch& b) {
  const double n_matmul = double(c.parameter_count()) - double(c.vocab_size * c.hidden_size) * (c.tie_word_embeddings ? 0 : 1) -
                          double(c.num_layers * (2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size);
  double sq = 0;
  for (size_t i = 0; i + 1 < b.cu_seqlens.size(); ++i) sq += double(b.cu_seqlens[i + 1] - b.cu_seqlens[i]) * (b.cu_seqlens[i + 1] - b.cu_seqlens[i]);
  return 6.0 * n_matmul + 6.0 * double(c.num_layers * c.num_heads * c.head_dim) * sq / std::max<double>(1, double(b.tokens()));
}

double peak_flops(const std::string& device_name) {
  // bf16 dense peak of the card (H100/H200 SXM: 989 TFLOP/s); 0 = unknown, no MFU printed.
  if (device_name.find("H100") != std::string::npos || device_name.find("H200") != std::string::npos) return 989e12;
  return 0;
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

PackedBatch to_device(Runtime& rt, Device d, const data::Batch& b, int64_t vocab) {
  return make_packed_batch(rt, d, b.ids, b.cu_seqlens, b.labels, vocab);
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

void save_checkpoint(const fs::path& out, int64_t step, const Qwen3Model& model, const AdamW& opt,
                     const nlohmann::json& state, int64_t keep_last) {
  const fs::path dir = out / "checkpoints";
  fs::create_directories(dir);
  const fs::path final_dir = dir / step_dir_name(step);
  const fs::path tmp = final_dir.string() + fmt::format(".tmp-{}", getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  model.save((tmp / "model").string(), model.options().dtype == DType::F64 ? DType::F32 : model.options().dtype);
  opt.save((tmp / "optimizer.safetensors").string());
  // Test hook (tests/e2e): die in the middle of the save of step N, as a crash or kill -9 would.
  if (fault_injected("checkpoint_save", step)) _exit(3);
  write_file_atomic(tmp / "trainer_state.json", state.dump(2));
  fs::remove_all(final_dir);  // a checkpoint of the same step from an earlier, replaced run
  fs::rename(tmp, final_dir);
  // Keep the newest `keep_last` complete checkpoints.
  std::vector<fs::path> all;
  for (const auto& e : fs::directory_iterator(dir))
    if (std::regex_match(e.path().filename().string(), std::regex("step-[0-9]{8}"))) all.push_back(e.path());
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + size_t(keep_last) < all.size(); ++i) fs::remove_all(all[i]);
}

double evaluate(Runtime& rt, Qwen3Model& model, const std::shared_ptr<const data::Corpus>& corpus,
                const data::LoaderOptions& base, int64_t batches) {
  data::LoaderOptions o = base;
  o.shuffle = false;
  o.rank = 0;
  o.world = 1;
  o.prefetch = 0;
  data::PackedLoader loader(corpus, o);
  const int64_t n = std::min<int64_t>(batches, loader.batches_in_first_epoch());
  double sum = 0;
  int64_t labelled = 0;
  for (int64_t i = 0; i < n; ++i) {
    const LossResult r = model.loss(to_device(rt, model.options().device, loader.next(), model.config().vocab_size), false);
    sum += r.loss_sum;
    labelled += r.labelled;
  }
  return labelled ? sum / double(labelled) : NAN;
}

}  // namespace

TrainSummary run_training(const TrainConfig& c) {
  Runtime rt;
  const Device device = parse_device(c.device);
  rt.check_device(device);
  const DType dtype = !c.dtype.empty() ? dtype_from_name(c.dtype) : device.is_cpu() ? DType::F32 : DType::BF16;
  const fs::path out = c.output_dir;
  fs::create_directories(out);
  for (const auto& e : fs::directory_iterator(fs::exists(out / "checkpoints") ? out / "checkpoints" : out))
    if (e.path().filename().string().find(".tmp-") != std::string::npos) fs::remove_all(e.path());  // interrupted saves
  write_file_atomic(out / "config.resolved.json", c.resolved.dump(2) + "\n");
  Progress progress(c.log_every);

  // Data.
  const data::Tokenizer tokenizer = data::Tokenizer::from_dir(c.tokenizer);
  const std::optional<ChatTemplate> chat = data::load_chat_template(c.tokenizer);
  data::DatasetOptions dopt;
  dopt.format = data::parse_row_format(c.data_format);
  dopt.max_seq_len = c.max_seq_len;
  dopt.overlong = data::parse_overlong_policy(c.overlong);
  dopt.skip_bad_rows = c.skip_bad_rows;
  dopt.train_on_prompt = c.train_on_prompt;
  dopt.chat_template_kwargs = {{"enable_thinking", false}};
  const data::RowEncoder encoder(tokenizer, chat ? &*chat : nullptr, dopt);
  data::DatasetStats train_stats, eval_stats;
  const auto train_corpus = load_corpus(c.train_files, encoder, &train_stats);
  progress.message(fmt::format("data: {}", train_stats.summary()));
  std::shared_ptr<const data::Corpus> eval_corpus;
  if (!c.eval_files.empty()) eval_corpus = load_corpus(c.eval_files, encoder, &eval_stats);

  // Model: a checkpoint to resume, the HF folder, or a new one.
  ModelOptions mopt;
  mopt.device = device;
  mopt.dtype = dtype;
  mopt.recompute = c.recompute;
  const std::string resume_from = c.resume == "none" ? "" : c.resume == "auto" ? latest_checkpoint(c.output_dir) : c.resume;
  LATHE_CHECK(resume_from.empty() || fs::exists(fs::path(resume_from) / "trainer_state.json"),
              "train: resume: {} is not a complete checkpoint (no trainer_state.json)", resume_from);
  std::optional<Qwen3Model> model;
  if (!resume_from.empty()) {
    model.emplace(Qwen3Model::load(rt, (fs::path(resume_from) / "model").string(), mopt));
  } else if (!c.model_path.empty()) {
    model.emplace(Qwen3Model::load(rt, c.model_path, mopt));
  } else {
    nlohmann::json cfg = c.model_config;
    if (!cfg.contains("model_type")) cfg["model_type"] = "qwen3";
    if (!cfg.contains("vocab_size")) cfg["vocab_size"] = tokenizer.vocab_size();
    model.emplace(Qwen3Model::random(rt, parse_model_config(cfg, "model.config"), mopt, c.seed, c.init_std));
  }
  LATHE_CHECK(model->config().vocab_size >= tokenizer.vocab_size(),
              "train: the model's vocabulary ({}) is smaller than the tokenizer's ({})", model->config().vocab_size,
              tokenizer.vocab_size());

  AdamWConfig acfg;
  acfg.beta1 = c.beta1;
  acfg.beta2 = c.beta2;
  acfg.eps = c.eps;
  acfg.weight_decay = c.weight_decay;
  AdamW opt(rt, model->parameters(), acfg);
  nlohmann::json state = nlohmann::json::object();
  if (!resume_from.empty()) {
    opt.load((fs::path(resume_from) / "optimizer.safetensors").string());
    std::ifstream f(fs::path(resume_from) / "trainer_state.json");
    state = nlohmann::json::parse(f);
  }
  const int64_t start_step = state.value("step", int64_t(0));
  int64_t tokens_seen = state.value("tokens_seen", int64_t(0));
  int64_t bad_in_row = state.value("bad_steps_in_a_row", int64_t(0));

  data::LoaderOptions lopt;
  lopt.capacity = c.micro_batch_tokens;
  lopt.seed = c.seed;
  data::PackedLoader loader(train_corpus, lopt, state.contains("loader") ? state["loader"] : nlohmann::json(nullptr));

  ScheduleConfig sched;
  sched.kind = schedule_kind_from_name(c.schedule);
  sched.lr = c.lr;
  sched.warmup_steps = c.warmup_steps;
  sched.total_steps = c.max_steps;
  sched.min_lr_ratio = c.min_lr_ratio;

  MetricsWriter metrics((out / "metrics.jsonl").string());
  metrics.truncate_after(start_step);  // entries past the checkpoint belong to the interrupted run
  TensorBoardWriter tb((out / "tb").string(), start_step + 1);
  const std::string device_name = rt.backend(device.type).info(device.index).name;
  const double peak = device.is_cuda() ? peak_flops(device_name) : 0.0;
  progress.message(fmt::format("train: {} parameters, {} on {} ({}), steps {}..{}{}", human(double(model->config().parameter_count())),
                               dtype_name(dtype), device.str(), device_name, start_step + 1, c.max_steps,
                               resume_from.empty() ? "" : ", resumed from " + resume_from));

  TrainSummary summary;
  summary.final_step = start_step;
  const auto t_start = Clock::now();
  for (int64_t step = start_step + 1; step <= c.max_steps; ++step) {
    const auto t0 = Clock::now();
    model->zero_grads();
    double loss_sum = 0, flops = 0;
    int64_t labelled = 0, tokens = 0;
    for (int64_t micro = 0; micro < c.grad_accum; ++micro) {
      const data::Batch b = loader.next();
      const PackedBatch pb = to_device(rt, device, b, model->config().vocab_size);
      const LossResult r = model->loss(pb, true, 1.0 / double(c.grad_accum));
      loss_sum += r.loss;
      labelled += r.labelled;
      tokens += b.tokens();
      flops += flops_per_token(model->config(), b) * double(b.tokens());
    }
    const double loss = loss_sum / double(c.grad_accum);
    ExecContext ctx = rt.context(device);
    const double norm = global_grad_norm(ctx, model->parameters());
    const double lr = learning_rate(sched, step);
    nlohmann::json m = {{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm}, {"tokens", tokens}, {"labelled", labelled}};
    if (!std::isfinite(norm) || !std::isfinite(loss)) {
      ++bad_in_row;
      m["skipped"] = true;
      progress.message(fmt::format("train: step {}: non-finite loss or gradient (loss {}, grad norm {}); step skipped ({} in a row)",
                                   step, loss, norm, bad_in_row));
      LATHE_CHECK(bad_in_row < c.max_bad_steps, "train: {} non-finite steps in a row (last at step {}); stopping. "
                  "Lower train.lr or check the data; the last checkpoint is {}", bad_in_row, step, latest_checkpoint(c.output_dir));
    } else {
      bad_in_row = 0;
      opt.step(lr, clip_factor(norm, c.max_grad_norm));
    }
    rt.synchronize(device);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    tokens_seen += tokens;
    m["tokens_per_s"] = double(tokens) / dt;
    m["step_time_s"] = dt;
    if (peak > 0) m["mfu"] = flops / dt / peak;
    const double mem_mib = device.is_cuda() ? double(rt.backend(device.type).allocator(device.index).stats().peak_allocated) / 1048576.0
                                            : host_peak_mib();
    m["memory_mib"] = mem_mib;
    if (eval_corpus && c.eval_every > 0 && (step % c.eval_every == 0 || step == c.max_steps)) {
      const double eval_loss = evaluate(rt, *model, eval_corpus, lopt, c.eval_batches);
      m["eval_loss"] = eval_loss;
      progress.message(fmt::format("eval: step {} loss {:.4f}", step, eval_loss));
    }
    metrics.write(m);
    if (fault_injected("after_step", step)) _exit(9);
    std::vector<std::pair<std::string, double>> scalars = {{"train/loss", loss}, {"train/lr", lr}, {"train/grad_norm", norm},
                                                           {"train/tokens_per_s", double(tokens) / dt}};
    if (m.contains("eval_loss")) scalars.push_back({"eval/loss", m["eval_loss"].get<double>()});
    if (m.contains("mfu")) scalars.push_back({"train/mfu", m["mfu"].get<double>()});
    tb.add_scalars(step, scalars);

    const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
    const double eta = elapsed / double(step - start_step) * double(c.max_steps - step);
    progress.step(step, c.max_steps,
                  fmt::format("step {}/{} | loss {:.4f} | lr {:.2e} | grad-norm {:.3f} | {} tok/s{} | mem {:.0f} MiB | ETA {}", step,
                              c.max_steps, loss, lr, norm, human(double(tokens) / dt),
                              peak > 0 ? fmt::format(" | MFU {:.1f}%", 100.0 * flops / dt / peak) : "", mem_mib, duration(eta)));
    if (summary.steps_run == 0) summary.first_loss = loss;
    summary.last_loss = loss;
    summary.steps_run++;
    summary.final_step = step;

    if ((c.save_every > 0 && step % c.save_every == 0) || step == c.max_steps) {
      const nlohmann::json st = {{"step", step}, {"loader", loader.state()}, {"tokens_seen", tokens_seen},
                                 {"bad_steps_in_a_row", bad_in_row}, {"tokenizer", fs::absolute(c.tokenizer).string()},
                                 {"config", c.resolved}};
      save_checkpoint(out, step, *model, opt, st, c.keep_last);
    }
  }
  progress.finish();

  // Final export: a Hugging Face folder with the tokenizer files.
  const fs::path final_dir = out / "final";
  model->save(final_dir.string(), dtype == DType::F64 ? DType::F32 : dtype);
  copy_tokenizer_files(c.tokenizer, final_dir);
  progress.message(fmt::format("train: done at step {}; model written to {}", summary.final_step, final_dir.string()));
  if (!c.final_eval_file.empty()) {
    const FinalEvalResult r = run_final_eval(rt, *model, tokenizer, chat ? &*chat : nullptr, c.final_eval_file,
                                             c.final_eval_max_new_tokens, [&](const std::string& l) { progress.message(l); });
    summary.final_eval_accuracy = r.accuracy;
    metrics.write({{"step", summary.final_step}, {"final_eval_accuracy", r.accuracy}, {"final_eval_correct", r.correct},
                   {"final_eval_total", r.total}});
  }
  return summary;
}

}  // namespace lathe
