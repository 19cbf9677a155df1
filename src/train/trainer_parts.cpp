// The trainer's parts besides its loop (trainer_parts.h).
#include "train/trainer_parts.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <regex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/communicator.h"
#include "core/files.h"
#include "model/pipeline_step.h"
#include "optim/clip.h"

namespace lathe::trainer_parts {

std::string step_dir_name(int64_t step) { return fmt::format("step-{:08d}", step); }

// Whether a job checkpoints after `step`: every train.save_every steps, and at the last. One predicate for the save
// itself and for the ranks' barriers around it, which must agree on every rank.
bool saves_at(const TrainConfig& c, int64_t step) { return (c.save_every > 0 && step % c.save_every == 0) || step == c.max_steps; }

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

uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^ c * 0x94D049BB133111EBull;
  z = (z ^ (z >> 31)) * 0xD6E8FEB86927D7A9ull;
  return z ^ (z >> 29);
}

// The folder a ZeRO run's ranks write their optimizer shards into before the first rank gathers them into the
// checkpoint (its name holds ".tmp-", so a start after a crash removes it with the other temporaries).
fs::path zero_shard_dir(const Job& job) { return job.out / "checkpoints" / (step_dir_name(job.step) + ".tmp-shards"); }

// `write_files` writes the weights and the optimizer state into the checkpoint's folder before it appears.
nlohmann::json gathered_json(Runtime& rt, Device device, Communicator& group, const nlohmann::json& mine) {
  const int n = group.size(), me = group.rank();
  const std::string text = mine.dump();
  std::vector<double> lengths(size_t(n), 0.0);
  lengths[size_t(me)] = double(text.size());
  lengths = summed_over(rt, device, group, lengths);
  std::vector<size_t> at(size_t(n) + 1, 0);
  for (int t = 0; t < n; ++t) at[size_t(t) + 1] = at[size_t(t)] + size_t(lengths[size_t(t)]);
  std::vector<double> chars(at.back(), 0.0);
  for (size_t i = 0; i < text.size(); ++i) chars[at[size_t(me)] + i] = double(uint8_t(text[i]));
  chars = summed_over(rt, device, group, chars);
  nlohmann::json all = nlohmann::json::array();
  for (int t = 0; t < n; ++t) {
    std::string one;
    for (size_t i = at[size_t(t)]; i < at[size_t(t) + 1]; ++i) one.push_back(char(uint8_t(chars[i])));
    all.push_back(nlohmann::json::parse(one));
  }
  return all;
}

void save_checkpoint(const Job& job, const std::function<void(const fs::path&)>& write_files, const nlohmann::json& state) {
  const fs::path dir = job.out / "checkpoints";
  OutputDir out((dir / step_dir_name(job.step)).string(), job.who());  // replaces one of the same step
  write_files(out.tmp());
  // Test hooks (tests/e2e): die in the middle of the save of step N, as a crash or kill -9 would; or take 6 s longer.
  if (fault_injected("checkpoint_save", job.step)) _exit(3);
  if (fault_injected("slow_save", job.step)) std::this_thread::sleep_for(std::chrono::seconds(6));
  write_file_atomic((out.tmp() / "trainer_state.json").string(), state.dump(2), job.who());
  out.commit();
  // Keep the newest `keep_last` complete checkpoints.
  std::vector<fs::path> all;
  for (const auto& e : fs::directory_iterator(dir))
    if (std::regex_match(e.path().filename().string(), std::regex("step-[0-9]{8}"))) all.push_back(e.path());
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + size_t(job.cfg->keep_last) < all.size(); ++i) fs::remove_all(all[i]);
}

// The name of the layout whose ranks hold different slices of the weights, in the optimizer state files' names: the
// kinds above 1 joined ("tp", "ep", "tp-ep", "pp", "tp-pp", ...).
std::string slice_kind_of(int tp, int ep, int pp) {
  std::vector<std::string> kinds;
  if (tp > 1) kinds.push_back("tp");
  if (ep > 1) kinds.push_back("ep");
  if (pp > 1) kinds.push_back("pp");
  return kinds.empty() ? "tp" : fmt::format("{}", fmt::join(kinds, "-"));
}

// A device batch of one job's host batch, its rows served by `adapter` (-1: no adapter).
PackedBatch single_job_batch(Runtime& rt, const CausalLm& model, const data::Batch& b, int adapter) {
  PackedBatch pb = make_packed_batch(rt, model.options().device, b.ids, b.cu_seqlens, b.labels,
                                     model.global_config().vocab_size);
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
  std::vector<PackedBatch> batches;
  for (int64_t i = 0; i < n; ++i) batches.push_back(single_job_batch(rt, model, loader.next(), job.adapter));
  std::vector<LossResult> results;
  if (model.pp_size() > 1) {  // pipeline parallelism: the batches stream through the stages, forward only
    results = run_pipeline(model, batches, false, 1.0);
    broadcast_losses(model, results);
  } else {
    for (const PackedBatch& b : batches) results.push_back(model.loss(b, false));
  }
  double sum = 0;
  int64_t labelled = 0;
  for (const LossResult& r : results) {
    sum += r.loss_sum;
    labelled += r.labelled;
  }
  return labelled ? sum / double(labelled) : NAN;
}

// The sum of squares of the parameters' values is finite (an update that overflowed would poison other tenants).
bool values_finite(ExecContext& ctx, std::vector<Parameter>& params) {
  std::vector<Parameter> as_grads;
  for (const Parameter& p : params) as_grads.push_back({p.name, p.value, p.value, {}});
  return std::isfinite(global_grad_norm(ctx, as_grads));
}

void check_batch_fits(const data::Batch& b, int64_t vocab) {
  for (size_t i = 0; i < b.ids.size(); ++i) {
    LATHE_CHECK(b.ids[i] >= 0 && b.ids[i] < vocab, "data: token id {} is outside the model's vocabulary ({})", b.ids[i], vocab);
    LATHE_CHECK(b.labels[i] == -100 || (b.labels[i] >= 0 && b.labels[i] < vocab),
                "data: label {} is outside the model's vocabulary ({})", b.labels[i], vocab);
  }
}

void report_memory_plan(const PlanStats& s, MemoryReport& said, Progress& progress) {
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

void report_full_device(int64_t flushes, int64_t step, MemoryReport& said, Progress& progress) {
  if (said.full || flushes <= 0) return;
  said.full = true;
  progress.message(fmt::format("memory: the device was full {} time{} in step {}: each time the allocator freed its "
                               "whole cache and waited for the device, and what came after was allocated afresh; a step "
                               "that does so often runs slowly (metrics.jsonl: cache_flushes). A smaller "
                               "train.micro_batch_tokens, train.recompute: true or a ZeRO stage makes room (`lathe plan` "
                               "shows each layout's peak)",
                               flushes, flushes == 1 ? "" : "s", step));
}

// generation_config.json for a model made from scratch, as transformers derives it from a model config: the
// config's bos/eos ids, else the tokenizer's end-of-sequence tokens (<|im_end|> too, as chat generation stops there).
nlohmann::json generation_config(const ModelConfig& mc, const data::Tokenizer& tok) {
  nlohmann::json g = {{"_from_model_config", true}};
  if (mc.raw.contains("bos_token_id")) g["bos_token_id"] = mc.raw["bos_token_id"];
  else if (tok.bos_id()) g["bos_token_id"] = *tok.bos_id();
  if (mc.raw.contains("eos_token_id")) {
    g["eos_token_id"] = mc.raw["eos_token_id"];
  } else {
    const std::vector<int32_t> eos = tok.end_of_turn_ids();
    if (eos.size() == 1) g["eos_token_id"] = eos[0];
    else if (!eos.empty()) g["eos_token_id"] = eos;
  }
  if (tok.pad_id()) g["pad_token_id"] = *tok.pad_id();
  return g;
}

}  // namespace lathe::trainer_parts
