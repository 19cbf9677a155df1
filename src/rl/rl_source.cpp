// The RL loop's rollouts and update batches (rl_source.h).
#include "rl/rl_source.h"
#include "rl/rl_source_parts.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "core/files.h"
#include "data/dataset.h"
#include "model/causal_lm.h"
#include "model/config.h"
#include "model/pipeline_step.h"

namespace lathe {

namespace {

uint64_t mix(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x7F4A7C159E3779B9ull) * 0xBF58476D1CE4E5B9ull ^ c * 0x94D049BB133111EBull;
  z = (z ^ (z >> 31)) * 0xD6E8FEB86927D7A9ull;
  return z ^ (z >> 29);
}

bool flag(const std::string& option, bool automatic) { return option == "auto" ? automatic : option == "true"; }

}  // namespace

RlSettings resolve_rl_settings(const RlOptions& o) {
  RlSettings s;
  const bool dapo = o.algorithm == "dapo", dr = o.algorithm == "dr_grpo";
  s.loss.clip_low = o.clip_low;
  s.loss.clip_high = o.clip_high >= 0 ? o.clip_high : dapo ? 0.28 : o.clip_low;
  s.loss.sequence_ratio = o.algorithm == "gspo";
  s.loss.kl_coef = o.kl_coef;
  s.loss.kl = o.kl_estimator == "k1" ? KlEstimator::k1 : o.kl_estimator == "k2" ? KlEstimator::k2 : KlEstimator::k3;
  s.aggregation = !o.loss_agg.empty() ? o.loss_agg
                  : dapo             ? "token-mean"
                  : dr               ? "seq-mean-token-sum-norm"
                                     : "seq-mean-token-mean";
  s.scale_by_std = flag(o.scale_by_std, !dr);
  s.dynamic_sampling = flag(o.dynamic_sampling, dapo);
  s.overlong_filter = flag(o.overlong_filter, dapo);
  s.importance_correction = o.importance_correction != "auto"                   ? o.importance_correction
                            : o.mode == "async" && o.max_staleness > 0 ? "token_tis"
                                                                       : "none";
  return s;
}

std::vector<RlPrompt> read_rl_prompts(const TrainConfig& c, const data::Tokenizer& tok, const ChatTemplate* chat) {
  const nlohmann::ordered_json kwargs(c.chat_template_kwargs);
  // The model's positions (0: not bounded by its config), so that a prompt the model cannot hold with one response
  // token is refused here, before anything is written.
  int64_t context = 0;
  if (!c.model_path.empty()) context = load_model_config(c.model_path).max_position_embeddings;
  else if (c.model_config.is_object()) context = c.model_config.value("max_position_embeddings", int64_t(0));
  std::vector<RlPrompt> out;
  for (const std::string& path : c.train_files) {
    std::istringstream in(read_text_file(path, "rl: data.train"));
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      RlPrompt p;
      try {
        p.row = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        LATHE_FAIL("rl: {}:{}: invalid JSON: {}", path, n, e.what());
      }
      const bool text = p.row.is_object() && p.row.contains("prompt") && p.row["prompt"].is_string();
      const bool messages = p.row.is_object() && p.row.contains("messages") && p.row["messages"].is_array() &&
                            !p.row["messages"].empty();
      LATHE_CHECK(text || messages, "rl: {}:{}: expected {{\"prompt\": \"...\"}} or {{\"messages\": [...]}}", path, n);
      if (c.rl.reward_answer > 0) {
        LATHE_CHECK(p.row.contains("answer") && (p.row["answer"].is_string() || p.row["answer"].is_number()),
                    "rl: {}:{}: no \"answer\" (a string or number) for the answer reward (rl.reward.answer {}; set it "
                    "to 0 to train without it)", path, n, c.rl.reward_answer);
        if (p.row["answer"].is_number()) p.row["answer"] = p.row["answer"].dump();
      }
      const nlohmann::ordered_json conv =
          messages ? nlohmann::ordered_json(p.row["messages"])
                   : nlohmann::ordered_json::array({{{"role", "user"}, {"content", p.row["prompt"].get<std::string>()}}});
      if (chat) {
        try {
          p.text = chat->render(conv, true, kwargs);
        } catch (const Error& e) {
          LATHE_FAIL("rl: {}:{}: {}", path, n, e.what());
        }
      } else {
        LATHE_CHECK(text, "rl: {}:{}: 'messages' need a chat template in the tokenizer folder", path, n);
        p.text = p.row["prompt"].get<std::string>();
      }
      p.ids = tok.encode(p.text);
      LATHE_CHECK(!p.ids.empty(), "rl: {}:{}: the prompt has no tokens", path, n);
      LATHE_CHECK(context == 0 || int64_t(p.ids.size()) < context,
                  "rl: {}:{}: the prompt has {} tokens, leaving no room for a response in the model's {} positions "
                  "(max_position_embeddings)", path, n, p.ids.size(), context);
      out.push_back(std::move(p));
    }
  }
  LATHE_CHECK(!out.empty(), "rl: data.train has no prompt rows");
  return out;
}

RlSource::RlSource(Runtime& rt, const TrainConfig& c)
    : rt_(rt), tok_(data::Tokenizer::from_dir(c.tokenizer)), chat_(data::load_chat_template(c.tokenizer)) {
  banned_ = tok_.ids_without_token(tok_.vocab_size());  // a tokenizer's holes are never drawn
  stop_ids_ = tok_.end_of_turn_ids();
  std::vector<const TrainConfig*> configs;
  for (const TrainConfig& t : c.tenants) configs.push_back(&t);
  if (configs.empty()) configs.push_back(&c);
  for (const TrainConfig* tc : configs) {
    auto j = std::make_unique<Job>();
    j->c = tc;
    j->settings = resolve_rl_settings(tc->rl);
    j->prompts = read_rl_prompts(*tc, tok_, chat_ ? &*chat_ : nullptr);
    if (!tc->rl.reward_format.empty() && tc->rl.reward_format_weight > 0) j->format.emplace(tc->rl.reward_format);
    jobs_.push_back(std::move(j));
  }
}

RlSource::~RlSource() = default;

void RlSource::start(CausalLm& model, const std::vector<SourceJob>& jobs, const SourceRanks& ranks,
                     const SourceHandover& handover) {
  LATHE_CHECK(jobs.size() == jobs_.size(), "rl: the trainer has {} jobs, the RL loop {}", jobs.size(), jobs_.size());
  model_ = &model;
  ranks_ = ranks;
  handover_ = handover;
  const std::string& offload = jobs_[0]->c->rl.offload_optimizer;  // shared by the tenants
  offload_ = offload == "true"                                          ? Offload::kAlways
             : offload == "auto" && !model.options().device.is_cpu() ? Offload::kWhenShort
                                                                       : Offload::kNever;
  for (auto& j : jobs_) j->longest_prompt = longest_prompt(*j);
  // Full fine-tuning's KL reference: a frozen copy of the starting weights (tenants are LoRA: their base is it).
  const bool kl = std::any_of(jobs_.begin(), jobs_.end(), [](const auto& j) { return j->c->rl.kl_coef > 0; });
  if (kl && jobs[0].adapter < 0) {
    LATHE_CHECK(bool(handover.starting_model), "rl: the trainer gave no starting model for the KL reference");
    reference_ = handover.starting_model();
    reference_offloaded_ = jobs_[0]->c->rl.reference_offload;  // on the CPU the copy stays where it is
    if (reference_offloaded_) reference_->move_parameters(Device::cpu());
  }
  const auto yes = [](bool b) { return b ? "on" : "off"; };
  for (size_t k = 0; k < jobs_.size(); ++k) {
    Job& j = *jobs_[k];
    j.adapter = jobs[k].adapter;
    j.active = jobs[k].active;
    const RlOptions& o = j.c->rl;
    const RlSettings& s = j.settings;
    if (ranks_.rank == 0)
      fmt::print("rl: {}{}: {} samples x {} prompts a rollout ({} in data.train), {} update(s) each; clip [{}, {}]{}, "
                 "loss_agg {}, advantages / std {}, dynamic sampling {}, overlong filter {}, kl {}{}, importance "
                 "correction {}{}\n",
                 j.c->name.empty() ? "" : "tenant " + j.c->name + ": ", o.algorithm, o.samples, o.prompts_per_step,
                 j.prompts.size(), o.minibatches, s.loss.clip_low, s.loss.clip_high,
                 s.loss.sequence_ratio ? " (sequence ratio)" : "", s.aggregation, yes(s.scale_by_std),
                 yes(s.dynamic_sampling), yes(s.overlong_filter), s.loss.kl_coef,
                 s.loss.kl_coef > 0 ? " (" + o.kl_estimator + ")" : "", s.importance_correction,
                 ranks_.ranks > 1 ? fmt::format("; {} data-parallel ranks", ranks_.ranks) : "");
    set_position(j, jobs[k].state);
  }
  if (async_) {  // the tenants walk one schedule: every active one resumes at the same rollout
    size_t lead = 0;
    while (lead + 1 < jobs.size() && !jobs[lead].active) ++lead;
    const auto rollouts = [&](size_t k) { return jobs_[k]->rollouts; };
    for (size_t k = 0; k < jobs.size(); ++k)
      LATHE_CHECK(!jobs[k].active || !jobs[lead].active || rollouts(k) == rollouts(lead), "rl: async: tenant {} resumes "
                  "after rollout {} and tenant {} after rollout {}: under rl.mode async the tenants run in step, so "
                  "their checkpoints must be of one step", jobs_[k]->c->name, rollouts(k), jobs_[lead]->c->name,
                  rollouts(lead));
    start_async(jobs[lead].state, lead);
  }
  std::fflush(stdout);
}

// The job's place in its prompts (a checkpoint's state, else the start): the epoch's order, the position in it, the
// rollouts sampled.
void RlSource::set_position(Job& j, const nlohmann::json& state) {
  if (state.is_object()) {
    j.epoch = state.value("epoch", int64_t(0));
    j.position = state.value("position", int64_t(0));
    j.rollouts = state.value("rollouts", int64_t(0));
  }
  j.order.resize(j.prompts.size());
  std::iota(j.order.begin(), j.order.end(), size_t(0));
  std::shuffle(j.order.begin(), j.order.end(), std::mt19937_64(mix(j.c->seed, uint64_t(j.epoch), 0x5eed)));
}

int64_t RlSource::longest_prompt(const Job& j) {
  int64_t n = 0;
  for (const RlPrompt& p : j.prompts) n = std::max(n, int64_t(p.ids.size()));
  return n;
}

// A checkpoint's state written in the other rl.mode: an async one holding rollouts not trained yet cannot resume
// colocated (they would be lost), a colocated one past its first rollout cannot resume async (no rollouts kept, no
// version schedule).
void RlSource::check_state(size_t, const nlohmann::json& state) const {
  if (!state.is_object()) return;
  const bool written_async = state.contains("async");
  if (!async_ && written_async) {
    const size_t kept = state["async"].value("buffer", nlohmann::json::object()).size();
    LATHE_CHECK(kept == 0, "rl: the checkpoint being resumed holds {} rollout(s) that an rl.mode async run sampled and "
                "had not trained yet: resume it with rl.mode async (colocated, they would be lost)", kept);
  }
  LATHE_CHECK(!async_ || written_async || state.value("rollouts", int64_t(0)) == 0,
              "rl: the checkpoint being resumed was written by a colocated run (rl.mode colocated): resume it "
              "colocated, or start the async run again (overwrite: true)");
}

nlohmann::json RlSource::state(size_t job) const {
  const Job& j = *jobs_.at(job);
  LATHE_ASSERT(pending_.empty());  // checkpoints fall on rollout boundaries (config.cpp checks)
  nlohmann::json s = {{"epoch", j.epoch}, {"position", j.position}, {"rollouts", j.rollouts}};
  if (async_) s["async"] = async_state();
  return s;
}

size_t RlSource::next_prompt(Job& j) {
  if (j.position == int64_t(j.order.size())) {
    ++j.epoch;
    j.position = 0;
    std::iota(j.order.begin(), j.order.end(), size_t(0));
    std::shuffle(j.order.begin(), j.order.end(), std::mt19937_64(mix(j.c->seed, uint64_t(j.epoch), 0x5eed)));
  }
  return j.order[size_t(j.position++)];
}

// Each ask's prompts, rl.samples responses each, in prompt order, then sample order: one engine for every ask (the
// tenants' requests in one batch, each with its job's adapter). The engine lives for the round: its KV cache is freed
// before the updates (on a GPU the memory goes back to the training step).
std::vector<std::vector<RolloutResult>> RlSource::sample(const std::vector<Ask>& asks) {
  int64_t requests = 0;
  for (const Ask& a : asks) requests += int64_t(a.prompts.size()) * a.job->c->rl.samples;
  if (requests == 0) return std::vector<std::vector<RolloutResult>>(asks.size());  // a rank's empty share of a refill
  int64_t blocks = 0;
  for (const Ask& a : asks)
    for (size_t p : a.prompts)
      blocks += blocks_needed(EngineOptions{}, int64_t(a.job->prompts[p].ids.size()), a.job->c->rl.max_new_tokens,
                              a.job->c->rl.samples);
  const Device device = model_->options().device;
  // What the updates left cached goes back to the driver: the pool is sized from the free memory, and small requests
  // in large cached blocks would hold room nobody uses.
  rt_.backend(device.type).allocator(device.index).release_cached();
  RolloutEngine engine(rt_, *model_, engine_options(requests, blocks));
  for (const Ask& a : asks) {
    const RlOptions& o = a.job->c->rl;
    for (size_t p : a.prompts) {
      RolloutRequest r;
      r.prompt = a.job->prompts[p].ids;
      r.n = int(o.samples);
      r.max_new_tokens = o.max_new_tokens;
      r.sampling.temperature = o.temperature;
      r.sampling.top_p = o.top_p;
      r.sampling.top_k = o.top_k;
      r.seed = mix(a.job->c->seed, uint64_t(a.job->rollouts) * 1024 + uint64_t(a.round), p);
      r.stop_ids = stop_ids_;
      r.allowed_vocab = tok_.vocab_size();
      r.banned_ids = banned_;
      r.adapter = a.job->adapter;
      engine.submit(std::move(r));
    }
  }
  std::vector<RolloutResult> all = engine.run();  // by request, then sample
  std::vector<std::vector<RolloutResult>> out;
  size_t at = 0;
  int64_t first_request = 0;
  for (const Ask& a : asks) {
    const size_t n = a.prompts.size() * size_t(a.job->c->rl.samples);
    std::vector<RolloutResult> mine(std::make_move_iterator(all.begin() + std::ptrdiff_t(at)),
                                    std::make_move_iterator(all.begin() + std::ptrdiff_t(at + n)));
    for (RolloutResult& r : mine) r.request -= first_request;  // the job's own request numbers (its prompt index)
    first_request += int64_t(a.prompts.size());
    out.push_back(std::move(mine));
    at += n;
  }
  return out;
}

// Each sample's weighted reward; `parts` gets each sample's unweighted components (0 where a component is off).
std::vector<double> RlSource::rewards(const Job& j, const std::vector<size_t>& prompts,
                                      const std::vector<RolloutResult>& samples, RewardParts& parts) {
  const RlOptions& o = j.c->rl;
  std::vector<double> out(samples.size(), 0.0);
  std::vector<std::string> rows;
  for (std::vector<double>* v : {&parts.answer, &parts.format, &parts.overlong, &parts.command})
    v->assign(samples.size(), 0.0);
  for (size_t k = 0; k < samples.size(); ++k) {
    const RolloutResult& s = samples[k];
    const RlPrompt& p = j.prompts[prompts[size_t(s.request)]];
    std::span<const int32_t> ids(s.tokens);
    if (s.finish_reason == FinishReason::kEos && !ids.empty()) ids = ids.first(ids.size() - 1);  // the stop token
    const std::string text = tok_.decode(ids, true);
    if (o.reward_answer > 0) {
      parts.answer[k] = answer_reward(text, p.row["answer"].get<std::string>());
      out[k] += o.reward_answer * parts.answer[k];
    }
    if (j.format) out[k] += o.reward_format_weight * (parts.format[k] = (*j.format)(text));
    if (o.overlong_buffer > 0)
      out[k] += parts.overlong[k] = overlong_penalty(int64_t(s.tokens.size()), o.max_new_tokens, o.overlong_buffer);
    if (!o.reward_command.empty()) {
      nlohmann::json row = p.row;
      row["prompt"] = p.text;
      row["response"] = text;
      rows.push_back(row.dump());
    }
  }
  if (!o.reward_command.empty() && !rows.empty()) {  // (a rank's share of a refill round may be empty)
    parts.command = external_rewards(o.reward_command, rows, o.reward_command_timeout_s);
    for (size_t k = 0; k < out.size(); ++k) out[k] += o.reward_command_weight * parts.command[k];
  }
  return out;
}

// One sampling round: every job in `ids` still short of groups (rl.prompts_per_step, or dynamic sampling's rounds
// left) asks for the rest of its groups (this rank's share), all asks are sampled by one engine, scored, and their
// groups kept (informative) or set aside (every reward equal, under dynamic sampling). False when no job asked.
bool RlSource::sampling_round(const std::vector<size_t>& ids, std::vector<Drawn>& d) {
  std::vector<Ask> asks;
  std::vector<size_t> of;  // each ask's index into ids
  for (size_t k = 0; k < ids.size(); ++k) {
    Job& j = *jobs_[ids[k]];
    const RlOptions& o = j.c->rl;
    const int64_t want = o.prompts_per_step;  // under data parallelism, over all ranks
    const int64_t rounds = j.settings.dynamic_sampling ? o.max_sampling_rounds : 1;
    if (d[k].informative_total >= want || d[k].f.rounds >= rounds) continue;
    Ask a{&j, {}, {}, d[k].f.rounds};
    for (int64_t c = 0; c < want - d[k].informative_total; ++c) {  // every rank walks them; samples its share
      const size_t p = next_prompt(j);
      if (c % ranks_.ranks == ranks_.rank) {
        a.prompts.push_back(p);
        a.candidates.push_back(c);
      }
    }
    d[k].uniform_at.emplace_back(size_t(want - d[k].informative_total), false);
    asks.push_back(std::move(a));
    of.push_back(k);
  }
  if (asks.empty()) return false;
  auto t = Clock::now();
  std::vector<std::vector<RolloutResult>> samples = sample(asks);
  const double rollout_s = seconds_since(t);
  for (size_t a = 0; a < asks.size(); ++a) {
    const Job& j = *asks[a].job;
    Figures& f = d[of[a]].f;
    f.rollout_s += rollout_s;  // the round's, shared by its jobs
    t = Clock::now();
    RewardParts parts;
    const std::vector<size_t>& prompts = asks[a].prompts;
    const std::vector<double> r = rewards(j, prompts, samples[a], parts);
    f.reward_s += seconds_since(t);
    for (size_t k = 0; k < samples[a].size(); ++k) {
      f.reward_sum += r[k];
      f.reward_sq_sum += r[k] * r[k];
      f.answer_sum += parts.answer[k];
      f.format_sum += parts.format[k];
      f.overlong_sum += parts.overlong[k];
      f.command_sum += parts.command[k];
      f.length_sum += double(samples[a][k].tokens.size());
      f.length_max = std::max(f.length_max, int64_t(samples[a][k].tokens.size()));
      f.truncated += samples[a][k].finish_reason == FinishReason::kLength;
    }
    f.sampled += int64_t(samples[a].size());
    const size_t n = size_t(j.c->rl.samples);
    Drawn& dk = d[of[a]];
    std::vector<double> aside(dk.uniform_at.back().size(), 0.0);  // this round's set-aside candidates
    for (size_t g = 0; g < prompts.size(); ++g) {
      Group group;
      group.prompt = prompts[g];
      group.round = f.rounds;
      group.candidate = asks[a].candidates[g];
      for (size_t i = 0; i < n; ++i) {
        group.samples.push_back(std::move(samples[a][g * n + i]));
        group.rewards.push_back(r[g * n + i]);
      }
      group.uniform =
          std::all_of(group.rewards.begin(), group.rewards.end(), [&](double x) { return x == group.rewards[0]; });
      const bool set_aside = j.settings.dynamic_sampling && group.uniform;
      if (set_aside) aside[size_t(group.candidate)] = 1;
      (set_aside ? dk.uniform : dk.informative).push_back(std::move(group));
    }
    // Every rank learns which of the round's candidates were set aside (the next round's size, the final order).
    if (ranks_.ranks > 1) aside = ranks_.sum(aside);
    for (size_t c = 0; c < aside.size(); ++c) {
      dk.uniform_at.back()[c] = aside[c] != 0;
      dk.informative_total += aside[c] == 0;
    }
    ++f.rounds;
  }
  return true;
}

// A group as numbers (exact in f64): prompt, round, candidate, set aside, then per sample: request, sample, finish
// reason, reward, length, ids, log-probs, sampling log-probs.
void RlSource::encode_group(const Group& g, std::vector<double>& v) {
  v.insert(v.end(), {double(g.prompt), double(g.round), double(g.candidate), double(g.uniform)});
  for (size_t i = 0; i < g.samples.size(); ++i) {
    const RolloutResult& s = g.samples[i];
    v.insert(v.end(), {double(s.request), double(s.sample), double(int(s.finish_reason)), g.rewards[i],
                       double(s.tokens.size())});
    for (int32_t t : s.tokens) v.push_back(double(t));
    v.insert(v.end(), s.logprobs.begin(), s.logprobs.end());
    v.insert(v.end(), s.sampling_logprobs.begin(), s.sampling_logprobs.end());
  }
}

// The group of `samples` samples at v (encode_group's numbers); v moves past it.
RlSource::Group RlSource::decode_group(const double*& v, size_t samples) {
  Group g;
  g.prompt = size_t(*v++);
  g.round = int64_t(*v++);
  g.candidate = int64_t(*v++);
  g.uniform = *v++ != 0;
  for (size_t i = 0; i < samples; ++i) {
    RolloutResult s;
    s.request = int64_t(*v++);
    s.sample = int(*v++);
    s.finish_reason = FinishReason(int(*v++));
    g.rewards.push_back(*v++);
    const size_t len = size_t(*v++);
    for (size_t t = 0; t < len; ++t) s.tokens.push_back(int32_t(*v++));
    s.logprobs.assign(v, v + len);
    s.sampling_logprobs.assign(v + len, v + 2 * len);
    v += 2 * len;
    g.samples.push_back(std::move(s));
  }
  return g;
}

// Data parallelism with dynamic sampling: the groups a rank sampled are not its share of the rollout. Every rank
// orders the rollout's groups as one process does — the informative ones by (round, candidate), then the set-aside
// ones that fill the rest — and takes those at k % ranks == rank, sent by the ranks that sampled them (one sum over
// the ranks of every such group's numbers, each written by its sampler: ids and log-probabilities are exact in f64).
std::vector<RlSource::Group> RlSource::share_of_groups(const Job& j, Drawn& d) {
  const int64_t want = j.c->rl.prompts_per_step;
  std::vector<std::pair<int64_t, int64_t>> order;  // (round, candidate) of the rollout's groups, in order
  for (bool aside : {false, true})
    for (size_t r = 0; r < d.uniform_at.size(); ++r)
      for (size_t c = 0; c < d.uniform_at[r].size() && int64_t(order.size()) < want; ++c)
        if (d.uniform_at[r][c] == aside) order.push_back({int64_t(r), int64_t(c)});
  std::map<std::pair<int64_t, int64_t>, size_t> place;  // -> k
  for (size_t k = 0; k < order.size(); ++k) place[order[k]] = k;
  // The groups' numbers (encode_group); their sizes go first, so that every rank knows where each group's go.
  std::vector<std::vector<double>> mine(order.size());
  for (std::vector<Group>* kept : {&d.informative, &d.uniform})
    for (const Group& g : *kept)
      if (const auto it = place.find({g.round, g.candidate}); it != place.end()) encode_group(g, mine[it->second]);
  std::vector<double> sizes(order.size());
  for (size_t k = 0; k < order.size(); ++k) sizes[k] = double(mine[k].size());
  sizes = ranks_.sum(sizes);
  std::vector<size_t> at(order.size() + 1, 0);
  for (size_t k = 0; k < order.size(); ++k) at[k + 1] = at[k] + size_t(sizes[k]);
  std::vector<double> all(at.back(), 0.0);
  for (size_t k = 0; k < order.size(); ++k) std::copy(mine[k].begin(), mine[k].end(), all.begin() + std::ptrdiff_t(at[k]));
  all = ranks_.sum(all);
  std::vector<Group> share;
  const size_t n = size_t(j.c->rl.samples);
  for (size_t k = size_t(ranks_.rank); k < order.size(); k += size_t(ranks_.ranks)) {
    const double* v = all.data() + at[k];
    share.push_back(decode_group(v, n));
  }
  return share;
}

// The engine of a sampling round of `sequences` samples whose requests can use `blocks` KV blocks: rl.max_running
// sequences at once (at most the round's), a cache of rl.cache_mib, else 80% of a GPU's free memory (256 MiB on the
// CPU), never more than the blocks.
EngineOptions RlSource::engine_options(int64_t sequences, int64_t blocks) const {
  const RlOptions& o = jobs_[0]->c->rl;  // shared by the tenants
  EngineOptions eo;
  eo.max_running = std::max<int64_t>(1, std::min<int64_t>(o.max_running, sequences));
  if (o.cache_mib > 0) eo.cache_bytes = o.cache_mib * 1048576;
  else if (model_->options().device.is_cpu()) eo.cache_bytes = int64_t(256) << 20;
  else eo.cache_memory_fraction = 0.8;
  eo.max_cache_blocks = blocks;
  return eo;
}

// rl.offload_optimizer: auto: whether the first sampling round's cache (this rank's share of the jobs' prompts, each
// sample as long as the longest prompt and rl.max_new_tokens) fits the device's free memory as the engine takes it
// (80%, or rl.cache_mib) with the optimizer state where it is.
bool RlSource::cache_fits_beside_optimizer(const std::vector<size_t>& ids) const {
  int64_t sequences = 0, blocks = 0;
  for (size_t id : ids) {
    const Job& j = *jobs_[id];
    const RlOptions& o = j.c->rl;
    const int64_t prompts = (o.prompts_per_step + ranks_.ranks - 1) / ranks_.ranks;
    sequences += prompts * o.samples;
    blocks += prompts * blocks_needed(EngineOptions{}, j.longest_prompt, o.max_new_tokens, o.samples);
  }
  const EngineOptions eo = engine_options(sequences, blocks);
  const Device device = model_->options().device;
  rt_.backend(device.type).allocator(device.index).release_cached();
  const int64_t free = rt_.backend(device.type).free_memory(device.index);
  const int64_t need = cache_bytes(model_->config(), model_->options(), eo, blocks);
  const int64_t room = eo.cache_memory_fraction > 0 ? int64_t(eo.cache_memory_fraction * double(free))
                                                     : std::min<int64_t>(eo.cache_bytes, free);
  return need <= room;
}

// One rollout of each listed job: sampling rounds until every job has rl.prompts_per_step groups (or no rounds left:
// set-aside groups fill the rest, with zero advantages), then each job's groups split into its updates. The optimizer
// state leaves the device while the engine samples (rl.offload_optimizer: its cache gets the room) and comes back
// before the updates.
void RlSource::rollout(const std::vector<size_t>& ids) {
  if (async_) return rollout_from_ranks(ids);
  std::vector<Drawn> d(ids.size());
  auto t = Clock::now();
  const bool offload =
      offload_ == Offload::kAlways || (offload_ == Offload::kWhenShort && !cache_fits_beside_optimizer(ids));
  const size_t handover_bytes = offload ? handover_.offload() : 0;
  double handover_s = seconds_since(t);
  while (sampling_round(ids, d)) {
  }
  t = Clock::now();
  if (offload) handover_.restore();
  handover_s += seconds_since(t);
  std::vector<std::vector<Group>> groups(ids.size());
  std::vector<Figures> figures(ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    Job& j = *jobs_[ids[k]];
    figures[k] = d[k].f;
    figures[k].dropped = int64_t(d[k].uniform.size());
    if (ranks_.ranks > 1 && j.settings.dynamic_sampling) {
      groups[k] = share_of_groups(j, d[k]);
    } else {  // one process, or one round whose candidate c is sampled (and trained) by rank c % ranks
      groups[k] = std::move(d[k].informative);
      for (size_t i = 0; int64_t(groups[k].size()) * ranks_.ranks < j.c->rl.prompts_per_step && i < d[k].uniform.size();
           ++i)
        groups[k].push_back(std::move(d[k].uniform[i]));
    }
    ++j.rollouts;
  }
  train_on(ids, groups, figures);
  if (offload_ != Offload::kNever)  // the whole run's optimizer state, every tenant's (0: it stayed)
    for (size_t id : ids) {
      jobs_[id]->rollout_metrics["handover_s"] = handover_s;
      jobs_[id]->rollout_metrics["handover_mib"] = double(handover_bytes) / 1048576.0;
    }
}

// A rollout's groups (this rank's share) become its updates, and its figures (this rank's) the metrics of its first.
void RlSource::train_on(const std::vector<size_t>& ids, std::vector<std::vector<Group>>& groups,
                        std::vector<Figures>& figures) {
  queue_updates(ids, groups, figures);
  for (size_t k = 0; k < ids.size(); ++k) {
    Job& j = *jobs_[ids[k]];
    if (ranks_.ranks > 1) figures_over_ranks(figures[k]);
    j.last_reward = figures[k].reward_sum / double(std::max<int64_t>(figures[k].sampled, 1));
    j.rollout_metrics = rollout_figures(j, figures[k]);
  }
}

// A rollout's figures as metrics.jsonl reports them (docs/rl.md, "What a run reports").
nlohmann::json RlSource::rollout_figures(const Job& j, const Figures& f) const {
  const double count = double(std::max<int64_t>(f.sampled, 1)), mean = f.reward_sum / count;
  const RlOptions& o = j.c->rl;
  nlohmann::json m = {{"reward_mean", mean},
                      {"reward_std", std::sqrt(std::max(0.0, f.reward_sq_sum / count - mean * mean))},
                      {"response_length_mean", f.length_sum / count}, {"response_length_max", f.length_max},
                      {"truncated_fraction", double(f.truncated) / count}, {"samples", f.sampled},
                      {"sampling_rounds", f.rounds}, {"groups_dropped", f.dropped}, {"rollout_s", f.rollout_s},
                      {"rollout_tokens_per_s", f.rollout_s > 0 ? f.length_sum / f.rollout_s : 0.0},
                      {"reward_s", f.reward_s}, {"logprob_s", f.logprob_s}};
  // Each reward that is on, unweighted: the answer match is the accuracy.
  if (o.reward_answer > 0) m["accuracy"] = f.answer_sum / count;
  if (j.format) m["reward_format"] = f.format_sum / count;
  if (o.overlong_buffer > 0) m["reward_overlong"] = f.overlong_sum / count;
  if (!o.reward_command.empty()) m["reward_command"] = f.command_sum / count;
  m["entropy"] = f.gap_tokens ? f.entropy_sum / double(f.gap_tokens) : 0.0;
  m["rollout_train_logprob_gap"] = f.gap_tokens ? f.gap_sum / double(f.gap_tokens) : 0.0;
  m["rollout_train_logprob_gap_max"] = f.gap_max;
  if (j.settings.importance_correction != "none") {
    m["importance_weight_mean"] = f.gap_tokens ? f.weight_sum / double(f.gap_tokens) : 1.0;
    m["importance_masked_fraction"] = f.gap_tokens ? double(f.masked) / double(f.gap_tokens) : 0.0;
  }
  return m;
}

// Each job's groups split evenly into rl.minibatches updates, in order (the jobs share rl.minibatches): update m holds
// every job's m-th share, each job's samples with their advantages, the old policy's log-probabilities, the importance
// weights and the KL reference where asked, and the jobs' policy losses on their rows.
void RlSource::queue_updates(const std::vector<size_t>& ids, std::vector<std::vector<Group>>& groups,
                             std::vector<Figures>& figures) {
  const int64_t minibatches = jobs_[ids[0]]->c->rl.minibatches;
  const Device device = model_->options().device;
  const int64_t vocab = model_->global_config().vocab_size;
  for (int64_t m = 0; m < minibatches; ++m) {
    auto u = std::make_unique<Update>();
    u->jobs = ids;
    std::vector<int32_t> all_ids, cu = {0}, labels;
    std::vector<BatchSegment> segments;
    std::vector<std::vector<double>> rollout_lp;
    for (size_t k = 0; k < ids.size(); ++k) {
      const Job& j = *jobs_[ids[k]];
      const RlOptions& o = j.c->rl;
      const RlSettings& settings = j.settings;
      const int64_t per = o.prompts_per_step / o.minibatches / ranks_.ranks, n = o.samples;  // this rank's groups
      std::vector<std::vector<int32_t>> prompts;
      std::vector<RolloutResult> samples;
      std::vector<double> advantages;
      for (int64_t g = m * per; g < (m + 1) * per; ++g) {
        Group& group = groups[k][size_t(g)];
        const std::vector<double> adv = group_advantages(group.rewards, n, settings.scale_by_std);
        for (int64_t i = 0; i < n; ++i) {
          RolloutResult& s = group.samples[size_t(i)];
          if (settings.overlong_filter && s.finish_reason == FinishReason::kLength) continue;  // DAPO: out of the loss
          prompts.push_back(j.prompts[group.prompt].ids);
          samples.push_back(std::move(s));
          advantages.push_back(adv[size_t(i)]);
        }
      }
      if (samples.empty()) {  // every response cut by the length limit: keep one with zero advantage (no gradient)
        prompts.push_back(j.prompts[groups[k][size_t(m * per)].prompt].ids);
        samples.push_back(groups[k][size_t(m * per)].samples[0]);
        advantages.push_back(0.0);
      }
      // The job's documents on the host, appended to the update's batch.
      RlBatch rb = make_rl_batch(rt_, Device::cpu(), vocab, prompts, samples, advantages, settings.aggregation,
                                 double(o.max_new_tokens));
      if (ranks_.ranks > 1) whole_batch_weights(j, rb.tokens);
      for (size_t d = 1; d < rb.batch.host_cu.size(); ++d) cu.push_back(int32_t(all_ids.size()) + rb.batch.host_cu[d]);
      all_ids.insert(all_ids.end(), rb.batch.host_ids.begin(), rb.batch.host_ids.end());
      labels.insert(labels.end(), rb.batch.host_labels.begin(), rb.batch.host_labels.end());
      segments.push_back({int64_t(all_ids.size()), j.adapter, 1.0, 0});
      rollout_lp.push_back(std::exchange(rb.tokens.old_logprob, {}));
      u->parts.push_back({ids[k], std::move(rb.tokens), settings.loss, {}});
    }
    u->batch = make_packed_batch(rt_, device, std::move(all_ids), std::move(cu), std::move(labels), vocab);
    if (jobs_[ids[0]]->adapter >= 0) set_segments(u->batch, std::move(segments));  // LoRA: a segment a job
    // The old policy's log-probabilities: the trainer's own forward over this very batch (as verl recomputes them), so
    // an update on policy has ratios of exactly 1 wherever the forward is deterministic. The engine's log-probabilities
    // measure the train-rollout mismatch and, with rl.importance_correction, weight the tokens.
    const auto t = Clock::now();
    std::vector<double> entropy;
    const std::vector<double> old = label_logprobs(u->batch, true, &entropy);
    const bool kl = std::any_of(u->parts.begin(), u->parts.end(), [](const Part& p) { return p.config.kl_coef > 0; });
    const std::vector<double> ref = kl ? reference_logprobs(u->batch) : std::vector<double>{};
    size_t at = 0;
    for (size_t k = 0; k < u->parts.size(); ++k) {
      Part& part = u->parts[k];
      const Job& j = *jobs_[part.job];
      Figures& f = figures[k];
      const size_t n = part.tokens.sequence.size();
      part.tokens.old_logprob.assign(old.begin() + std::ptrdiff_t(at), old.begin() + std::ptrdiff_t(at + n));
      for (size_t i = 0; i < n; ++i) {
        const double gap = std::abs(part.tokens.old_logprob[i] - rollout_lp[k][i]);
        f.gap_sum += gap;
        f.gap_max = std::max(f.gap_max, gap);
      }
      f.gap_tokens += int64_t(n);
      for (size_t i = 0; i < n; ++i) f.entropy_sum += entropy[at + i];
      if (j.settings.importance_correction != "none")
        correct_importance(j, part.tokens, rollout_lp[k], f.weight_sum, f.masked);
      if (part.config.kl_coef > 0)
        part.tokens.ref_logprob.assign(ref.begin() + std::ptrdiff_t(at), ref.begin() + std::ptrdiff_t(at + n));
      at += n;
    }
    const double logprob_s = seconds_since(t);
    for (Figures& f : figures) f.logprob_s += logprob_s;  // the update's forwards, shared by its jobs
    Update* raw = u.get();
    u->loss = [raw](std::span<const double> logp, std::span<double> loss, std::span<double> d) {
      size_t at = 0;
      for (Part& part : raw->parts) {
        const size_t n = part.tokens.sequence.size();
        if (part.dropped) {
          std::fill_n(loss.begin() + std::ptrdiff_t(at), n, 0.0);
          std::fill_n(d.begin() + std::ptrdiff_t(at), n, 0.0);
        } else {
          policy_loss(part.tokens, part.config, logp.subspan(at, n), loss.subspan(at, n), d.subspan(at, n),
                      &part.stats);
        }
        at += n;
      }
    };
    u->batch.row_loss = &u->loss;
    pending_.push_back(std::move(u));
  }
}

// Data parallelism: the aggregation weights of this rank's share rescaled to the whole mini-batch's (their
// denominators, the sequences or the tokens, summed over the ranks).
void RlSource::whole_batch_weights(const Job& j, PolicyTokens& t) {
  const double seqs = sequences_in(t), tokens = double(t.sequence.size());
  const std::vector<double> all = ranks_.sum({seqs, tokens});
  const double scale = j.settings.aggregation == "token-mean" ? tokens / all[1] : seqs / all[0];
  for (double& w : t.weight) w *= scale;
}

// Data parallelism: the rollout's figures over every rank — the counts and sums added, the largest gap and the
// slowest rank's seconds taken.
void RlSource::figures_over_ranks(Figures& f) {
  std::vector<double> v = {f.reward_sum, f.reward_sq_sum, f.answer_sum, f.format_sum, f.overlong_sum, f.command_sum,
                           f.length_sum, double(f.sampled), double(f.truncated), double(f.dropped), f.gap_sum,
                           double(f.gap_tokens), f.weight_sum, double(f.masked), f.entropy_sum};
  const size_t slots = v.size(), per_rank = 5;  // then each rank's maxima and seconds in its own slots
  v.resize(slots + per_rank * size_t(ranks_.ranks), 0.0);
  double* mine = v.data() + slots + per_rank * size_t(ranks_.rank);
  mine[0] = f.gap_max, mine[1] = f.rollout_s, mine[2] = f.reward_s, mine[3] = f.logprob_s, mine[4] = double(f.length_max);
  const std::vector<double> s = ranks_.sum(v);
  f.reward_sum = s[0], f.reward_sq_sum = s[1], f.answer_sum = s[2], f.format_sum = s[3], f.overlong_sum = s[4];
  f.command_sum = s[5], f.length_sum = s[6];
  f.sampled = int64_t(s[7]), f.truncated = int64_t(s[8]), f.dropped = int64_t(s[9]);
  f.gap_sum = s[10], f.gap_tokens = int64_t(s[11]), f.weight_sum = s[12], f.masked = int64_t(s[13]);
  f.entropy_sum = s[14];
  f.gap_max = f.rollout_s = f.reward_s = f.logprob_s = 0;
  f.length_max = 0;
  for (int r = 0; r < ranks_.ranks; ++r) {
    const double* x = s.data() + slots + per_rank * size_t(r);
    f.gap_max = std::max(f.gap_max, x[0]);
    f.rollout_s = std::max(f.rollout_s, x[1]);
    f.reward_s = std::max(f.reward_s, x[2]);
    f.logprob_s = std::max(f.logprob_s, x[3]);
    f.length_max = std::max(f.length_max, int64_t(x[4]));
  }
}

// The KL reference's log-probabilities: the frozen copy of the starting weights (full fine-tuning; brought from host
// memory for the forward with rl.reference_offload), or the base without the adapters (LoRA).
std::vector<double> RlSource::reference_logprobs(PackedBatch& b) {
  if (!reference_) return label_logprobs(b, false);
  if (reference_offloaded_) reference_->move_parameters(model_->options().device);
  const std::vector<double> out = label_logprobs(b, false, nullptr, reference_.get());
  if (reference_offloaded_) reference_->move_parameters(Device::cpu());
  return out;
}

std::vector<double> RlSource::label_logprobs(PackedBatch& b, bool with_adapters, std::vector<double>* entropy,
                                             CausalLm* model) {
  std::vector<double> out;
  const RowLoss capture = [&](std::span<const double> logp, std::span<double> loss, std::span<double> d) {
    out.assign(logp.begin(), logp.end());
    std::fill(loss.begin(), loss.end(), 0.0);
    std::fill(d.begin(), d.end(), 0.0);
  };
  b.row_loss = &capture;
  b.row_entropy = entropy;
  std::vector<BatchSegment> segments;
  if (!with_adapters) segments = std::exchange(b.segments, {});  // the base alone
  CausalLm& m = model ? *model : *model_;
  if (m.pp_size() > 1) {  // through the stages: the last one's figures, on every stage
    run_pipeline(m, {b}, false, 1.0);
    int64_t labelled = 0;
    for (int32_t l : b.host_labels) labelled += l != -100;
    from_last_stage(m, out, size_t(labelled));
    if (entropy) from_last_stage(m, *entropy, size_t(labelled));
  } else {
    m.loss(b, false);
  }
  if (!with_adapters) b.segments = std::move(segments);
  b.row_loss = nullptr;
  b.row_entropy = nullptr;
  return out;
}

// w = exp(old - rollout) per token (token_*) or exp(the sum over the sequence) per sequence (seq_*); *_tis: min(w,
// cap); *_mis: 1 inside [1 / cap, cap], else 0. The weight multiplies the token's aggregation weight (the policy loss
// and the KL term alike).
void RlSource::correct_importance(const Job& j, PolicyTokens& t, const std::vector<double>& rollout,
                                  double& weight_sum, int64_t& masked) {
  const std::string& mode = j.settings.importance_correction;
  const double cap = j.c->rl.importance_cap;
  const bool sequence = mode.rfind("seq_", 0) == 0, truncate = mode.ends_with("_tis");
  std::vector<double> log_w(t.old_logprob.size());
  for (size_t i = 0; i < log_w.size(); ++i) log_w[i] = t.old_logprob[i] - rollout[i];
  if (sequence)
    for (size_t a = 0; a < log_w.size();) {  // tokens of a sequence are consecutive
      size_t b = a;
      double sum = 0;
      for (; b < log_w.size() && t.sequence[b] == t.sequence[a]; ++b) sum += log_w[b];
      std::fill(log_w.begin() + std::ptrdiff_t(a), log_w.begin() + std::ptrdiff_t(b), sum);
      a = b;
    }
  for (size_t i = 0; i < log_w.size(); ++i) {
    const double w = std::exp(log_w[i]);
    const double applied = truncate ? std::min(w, cap) : (w >= 1.0 / cap && w <= cap ? 1.0 : 0.0);
    masked += applied == 0.0;
    weight_sum += applied;
    t.weight[i] *= applied;
  }
}

PackedBatch* RlSource::batch(const std::vector<size_t>& ids) {
  if (pending_.empty()) rollout(ids);  // every job asking rolls out, together
  current_ = std::move(pending_.front());
  pending_.erase(pending_.begin());
  if (async_) staleness_ = next_update_staleness();
  for (size_t k : ids)
    LATHE_CHECK(std::find(current_->jobs.begin(), current_->jobs.end(), k) != current_->jobs.end(),
                "rl: the tenants are out of step: the update prepared is for jobs [{}], the step trains jobs [{}]",
                fmt::join(current_->jobs, ", "), fmt::join(ids, ", "));
  // A job that failed since the rollout (a tenant stops alone): its rows stay, served by the base, with no loss.
  for (size_t k = 0; k < current_->parts.size(); ++k)
    if (std::find(ids.begin(), ids.end(), current_->parts[k].job) == ids.end()) {
      current_->parts[k].dropped = true;
      if (!current_->batch.segments.empty()) current_->batch.segments[k].adapter = -1;
    }
  return &current_->batch;
}

// Job `job`'s part of the update of the step.
nlohmann::json RlSource::step_metrics(size_t job) {
  Job& j = *jobs_.at(job);
  LATHE_ASSERT(current_);
  Part* part = nullptr;
  for (Part& p : current_->parts)
    if (p.job == job) part = &p;
  LATHE_ASSERT(part);
  PolicyStats& st = part->stats;
  if (model_->pp_size() > 1) {  // the row loss ran on the last stage
    std::vector<double> v = {st.clip_fraction, st.ratio_mean, st.kl_mean};
    from_last_stage(*model_, v, v.size());
    st.clip_fraction = v[0], st.ratio_mean = v[1], st.kl_mean = v[2];
  }
  if (ranks_.ranks > 1) {  // the update's statistics over every rank's share, weighted by its tokens (or sequences)
    const PolicyTokens& t = part->tokens;
    const double tokens = double(t.sequence.size()), n = part->config.sequence_ratio ? sequences_in(t) : tokens;
    const std::vector<double> s = ranks_.sum({st.clip_fraction * n, st.ratio_mean * n, st.kl_mean * tokens, n, tokens});
    st.clip_fraction = s[0] / s[3];
    st.ratio_mean = s[1] / s[3];
    st.kl_mean = s[2] / s[4];
  }
  j.last_ratio = st.ratio_mean;
  j.last_clip = st.clip_fraction;
  nlohmann::json m = {{"clip_fraction", st.clip_fraction}, {"ratio_mean", st.ratio_mean}};
  if (part->config.kl_coef > 0) m["kl_mean"] = st.kl_mean;
  if (async_) m["staleness"] = staleness_;
  if (!j.rollout_metrics.is_null()) m.update(std::exchange(j.rollout_metrics, nullptr));
  return m;
}

std::string RlSource::progress(size_t job) const {
  const Job& j = *jobs_.at(job);
  return fmt::format("reward {:.3f} | ratio {:.3f} | clip {:.3f}", j.last_reward, j.last_ratio, j.last_clip);
}

}  // namespace lathe
