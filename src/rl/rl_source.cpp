// The RL loop's rollouts and update batches (rl_source.h).
#include "rl/rl_source.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>
#include <sstream>

#include "core/error.h"
#include "core/files.h"
#include "data/dataset.h"
#include "model/causal_lm.h"
#include "model/config.h"

namespace lathe {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

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

// One update's batch: the groups' samples as documents, the policy loss as its row loss.
struct RlSource::Update {
  RlBatch rb;
  RowLoss loss;
  PolicyStats stats;
};

RlSource::RlSource(Runtime& rt, const TrainConfig& c)
    : rt_(rt), c_(c), settings_(resolve_rl_settings(c.rl)), tok_(data::Tokenizer::from_dir(c.tokenizer)),
      chat_(data::load_chat_template(c.tokenizer)) {
  prompts_ = read_rl_prompts(c, tok_, chat_ ? &*chat_ : nullptr);
  if (!c.rl.reward_format.empty() && c.rl.reward_format_weight > 0) format_.emplace(c.rl.reward_format);
  banned_ = tok_.ids_without_token(tok_.vocab_size());  // a tokenizer's holes are never drawn
  stop_ids_ = tok_.end_of_turn_ids();
}

RlSource::~RlSource() = default;

void RlSource::start(CausalLm& model, int adapter, const nlohmann::json& state, const SourceRanks& ranks) {
  model_ = &model;
  adapter_ = adapter;
  ranks_ = ranks;
  const RlOptions& o = c_.rl;
  const auto yes = [](bool b) { return b ? "on" : "off"; };
  if (ranks_.rank == 0)
    fmt::print("rl: {}: {} samples x {} prompts a rollout ({} in data.train), {} update(s) each; clip [{}, {}]{}, "
             "loss_agg {}, advantages / std {}, dynamic sampling {}, overlong filter {}, kl {}{}, importance "
             "correction {}{}\n",
             o.algorithm, o.samples, o.prompts_per_step, prompts_.size(), o.minibatches, settings_.loss.clip_low,
             settings_.loss.clip_high, settings_.loss.sequence_ratio ? " (sequence ratio)" : "", settings_.aggregation,
             yes(settings_.scale_by_std), yes(settings_.dynamic_sampling), yes(settings_.overlong_filter),
             settings_.loss.kl_coef, settings_.loss.kl_coef > 0 ? " (" + o.kl_estimator + ")" : "",
             o.importance_correction, ranks_.ranks > 1 ? fmt::format("; {} data-parallel ranks", ranks_.ranks) : "");
  std::fflush(stdout);
  if (state.is_object()) {
    epoch_ = state.value("epoch", int64_t(0));
    position_ = state.value("position", int64_t(0));
    rollouts_ = state.value("rollouts", int64_t(0));
  }
  order_.resize(prompts_.size());
  std::iota(order_.begin(), order_.end(), size_t(0));
  std::shuffle(order_.begin(), order_.end(), std::mt19937_64(mix(c_.seed, uint64_t(epoch_), 0x5eed)));
}

nlohmann::json RlSource::state() const {
  LATHE_ASSERT(pending_.empty());  // checkpoints fall on rollout boundaries (config.cpp checks)
  return {{"epoch", epoch_}, {"position", position_}, {"rollouts", rollouts_}};
}

size_t RlSource::next_prompt() {
  if (position_ == int64_t(order_.size())) {
    ++epoch_;
    position_ = 0;
    std::iota(order_.begin(), order_.end(), size_t(0));
    std::shuffle(order_.begin(), order_.end(), std::mt19937_64(mix(c_.seed, uint64_t(epoch_), 0x5eed)));
  }
  return order_[size_t(position_++)];
}

// rl.samples responses to each prompt, in prompt order, then sample order. The engine lives for the rollout: its KV
// cache is freed before the updates (on a GPU the memory goes back to the training step).
std::vector<RolloutResult> RlSource::sample(const std::vector<size_t>& prompts, int64_t round) {
  const RlOptions& o = c_.rl;
  EngineOptions eo;
  eo.max_running = std::min<int64_t>(256, int64_t(prompts.size()) * o.samples);
  if (o.cache_mib > 0) eo.cache_bytes = o.cache_mib * 1048576;
  else if (model_->options().device.is_cpu()) eo.cache_bytes = int64_t(256) << 20;
  else eo.cache_memory_fraction = 0.8;
  RolloutEngine engine(rt_, *model_, eo);
  for (size_t i = 0; i < prompts.size(); ++i) {
    RolloutRequest r;
    r.prompt = prompts_[prompts[i]].ids;
    r.n = int(o.samples);
    r.max_new_tokens = o.max_new_tokens;
    r.sampling.temperature = o.temperature;
    r.sampling.top_p = o.top_p;
    r.sampling.top_k = o.top_k;
    r.seed = mix(c_.seed, uint64_t(rollouts_) * 1024 + uint64_t(round), prompts[i]);
    r.stop_ids = stop_ids_;
    r.allowed_vocab = tok_.vocab_size();
    r.banned_ids = banned_;
    r.adapter = adapter_;
    engine.submit(std::move(r));  // request i
  }
  return engine.run();
}

// Each sample's weighted reward; `answers` gets each one's answer match (1 or 0; 0 without the answer reward).
std::vector<double> RlSource::rewards(const std::vector<size_t>& prompts, const std::vector<RolloutResult>& samples,
                                      std::vector<double>& answers) {
  const RlOptions& o = c_.rl;
  std::vector<double> out(samples.size(), 0.0);
  std::vector<std::string> rows;
  answers.assign(samples.size(), 0.0);
  for (size_t k = 0; k < samples.size(); ++k) {
    const RolloutResult& s = samples[k];
    const RlPrompt& p = prompts_[prompts[size_t(s.request)]];
    std::span<const int32_t> ids(s.tokens);
    if (s.finish_reason == FinishReason::kEos && !ids.empty()) ids = ids.first(ids.size() - 1);  // the stop token
    const std::string text = tok_.decode(ids, true);
    if (o.reward_answer > 0) {
      answers[k] = answer_reward(text, p.row["answer"].get<std::string>());
      out[k] += o.reward_answer * answers[k];
    }
    if (format_) out[k] += o.reward_format_weight * (*format_)(text);
    if (o.overlong_buffer > 0) out[k] += overlong_penalty(int64_t(s.tokens.size()), o.max_new_tokens, o.overlong_buffer);
    if (!o.reward_command.empty()) {
      nlohmann::json row = p.row;
      row["prompt"] = p.text;
      row["response"] = text;
      rows.push_back(row.dump());
    }
  }
  if (!o.reward_command.empty()) {
    const std::vector<double> ext = external_rewards(o.reward_command, rows, o.reward_command_timeout_s);
    for (size_t k = 0; k < out.size(); ++k) out[k] += o.reward_command_weight * ext[k];
  }
  return out;
}

// A prompt's samples with their rewards.
struct RlSource::Group {
  size_t prompt = 0;
  std::vector<RolloutResult> samples;
  std::vector<double> rewards;
  bool uniform = false;  // every reward equal: zero advantages
};

// The rollout's figures, summed over its sampling rounds and updates.
struct RlSource::Figures {
  double rollout_s = 0, reward_s = 0, logprob_s = 0, reward_sum = 0, answer_sum = 0, length_sum = 0;
  int64_t sampled = 0, truncated = 0, rounds = 0, dropped = 0;
  double gap_sum = 0, gap_max = 0, weight_sum = 0;  // train-rollout log-prob gaps, importance weights
  int64_t gap_tokens = 0, masked = 0;
};

// One rollout: the groups sampled and scored, then split into rl.minibatches updates.
void RlSource::rollout() {
  Figures f;
  std::vector<Group> groups = sample_groups(f);
  ++rollouts_;
  queue_updates(groups, f);
  if (ranks_.ranks > 1) figures_over_ranks(f);
  const RlOptions& o = c_.rl;
  const double count = double(std::max<int64_t>(f.sampled, 1));
  last_reward_ = f.reward_sum / count;
  rollout_metrics_ = {{"reward_mean", f.reward_sum / count}, {"response_length_mean", f.length_sum / count},
                      {"truncated_fraction", double(f.truncated) / count}, {"samples", f.sampled},
                      {"sampling_rounds", f.rounds}, {"groups_dropped", f.dropped}, {"rollout_s", f.rollout_s},
                      {"reward_s", f.reward_s}, {"logprob_s", f.logprob_s}};
  if (o.reward_answer > 0) rollout_metrics_["answer_accuracy"] = f.answer_sum / count;
  rollout_metrics_["logprob_gap_mean"] = f.gap_tokens ? f.gap_sum / double(f.gap_tokens) : 0.0;
  rollout_metrics_["logprob_gap_max"] = f.gap_max;
  if (o.importance_correction != "none") {
    rollout_metrics_["importance_weight_mean"] = f.gap_tokens ? f.weight_sum / double(f.gap_tokens) : 1.0;
    rollout_metrics_["importance_masked_fraction"] = f.gap_tokens ? double(f.masked) / double(f.gap_tokens) : 0.0;
  }
}

// rl.prompts_per_step groups, sampled and scored; under dynamic sampling, groups whose rewards are all equal are set
// aside and more prompts sampled (up to rl.max_sampling_rounds rounds); groups still missing are filled with set-aside
// ones (zero advantages: no policy gradient, but the step keeps its size).
std::vector<RlSource::Group> RlSource::sample_groups(Figures& f) {
  const RlOptions& o = c_.rl;
  const int64_t want = o.prompts_per_step, n = o.samples;  // under data parallelism, over all ranks
  std::vector<Group> informative, uniform;
  while (int64_t(informative.size()) * ranks_.ranks < want && f.rounds < (settings_.dynamic_sampling ? o.max_sampling_rounds : 1)) {
    std::vector<size_t> prompts;  // this rank's share of the round's prompts
    for (int64_t i = int64_t(informative.size()); i < want; ++i) {
      const size_t p = next_prompt();
      if (i % ranks_.ranks == ranks_.rank) prompts.push_back(p);
    }
    auto t = Clock::now();
    std::vector<RolloutResult> samples = sample(prompts, f.rounds);
    f.rollout_s += seconds_since(t);
    t = Clock::now();
    std::vector<double> answers;
    const std::vector<double> r = rewards(prompts, samples, answers);
    f.reward_s += seconds_since(t);
    for (size_t k = 0; k < samples.size(); ++k) {
      f.reward_sum += r[k];
      f.answer_sum += answers[k];
      f.length_sum += double(samples[k].tokens.size());
      f.truncated += samples[k].finish_reason == FinishReason::kLength;
    }
    f.sampled += int64_t(samples.size());
    for (size_t g = 0; g < prompts.size(); ++g) {
      Group group;
      group.prompt = prompts[g];
      for (int64_t i = 0; i < n; ++i) {
        group.samples.push_back(std::move(samples[g * size_t(n) + size_t(i)]));
        group.rewards.push_back(r[g * size_t(n) + size_t(i)]);
      }
      group.uniform = std::all_of(group.rewards.begin(), group.rewards.end(), [&](double x) { return x == group.rewards[0]; });
      (settings_.dynamic_sampling && group.uniform ? uniform : informative).push_back(std::move(group));
    }
    ++f.rounds;
  }
  f.dropped = int64_t(uniform.size());
  for (size_t i = 0; int64_t(informative.size()) * ranks_.ranks < want && i < uniform.size(); ++i)
    informative.push_back(std::move(uniform[i]));
  return informative;
}

// The groups split evenly into rl.minibatches updates, in order: each an RL batch with its advantages, the old
// policy's log-probabilities, the importance weights and the KL reference where asked, and its policy loss.
void RlSource::queue_updates(std::vector<Group>& groups, Figures& f) {
  const RlOptions& o = c_.rl;
  const int64_t per = o.prompts_per_step / o.minibatches / ranks_.ranks, n = o.samples;  // this rank's groups
  for (int64_t m = 0; m < o.minibatches; ++m) {
    std::vector<std::vector<int32_t>> prompts;
    std::vector<RolloutResult> samples;
    std::vector<double> advantages;
    for (int64_t g = m * per; g < (m + 1) * per; ++g) {
      Group& group = groups[size_t(g)];
      const std::vector<double> adv = group_advantages(group.rewards, n, settings_.scale_by_std);
      for (int64_t i = 0; i < n; ++i) {
        RolloutResult& s = group.samples[size_t(i)];
        if (settings_.overlong_filter && s.finish_reason == FinishReason::kLength) continue;  // DAPO: out of the loss
        prompts.push_back(prompts_[group.prompt].ids);
        samples.push_back(std::move(s));
        advantages.push_back(adv[size_t(i)]);
      }
    }
    if (samples.empty()) {  // every response cut by the length limit: keep one with zero advantage (no gradient)
      prompts.push_back(prompts_[groups[size_t(m * per)].prompt].ids);
      samples.push_back(groups[size_t(m * per)].samples[0]);
      advantages.push_back(0.0);
    }
    auto u = std::make_unique<Update>();
    u->rb = make_rl_batch(rt_, model_->options().device, model_->config().vocab_size, prompts, samples, advantages,
                          settings_.aggregation, double(o.max_new_tokens));
    if (ranks_.ranks > 1) whole_batch_weights(u->rb.tokens);
    // The old policy's log-probabilities: the trainer's own forward over the rollout (as verl recomputes them), so an
    // update on policy has ratios of exactly 1 wherever the forward is deterministic. The engine's log-probabilities
    // measure the train-rollout mismatch and, with rl.importance_correction, weight the tokens.
    const auto t = Clock::now();
    const std::vector<double> rollout_lp = std::exchange(u->rb.tokens.old_logprob, {});
    u->rb.tokens.old_logprob = label_logprobs(u->rb.batch, true);
    for (size_t t = 0; t < rollout_lp.size(); ++t) {
      const double gap = std::abs(u->rb.tokens.old_logprob[t] - rollout_lp[t]);
      f.gap_sum += gap;
      f.gap_max = std::max(f.gap_max, gap);
    }
    f.gap_tokens += int64_t(rollout_lp.size());
    if (o.importance_correction != "none") correct_importance(u->rb.tokens, rollout_lp, f.weight_sum, f.masked);
    if (settings_.loss.kl_coef > 0) u->rb.tokens.ref_logprob = label_logprobs(u->rb.batch, false);
    f.logprob_s += seconds_since(t);
    Update* raw = u.get();
    const PolicyLossConfig config = settings_.loss;
    u->loss = [raw, config](std::span<const double> logp, std::span<double> loss, std::span<double> d) {
      policy_loss(raw->rb.tokens, config, logp, loss, d, &raw->stats);
    };
    u->rb.batch.row_loss = &u->loss;
    pending_.push_back(std::move(u));
  }
}

// Data parallelism: the aggregation weights of this rank's share rescaled to the whole mini-batch's (their
// denominators, the sequences or the tokens, summed over the ranks).
void RlSource::whole_batch_weights(PolicyTokens& t) {
  double seqs = 0;
  for (size_t i = 0; i < t.sequence.size(); ++i) seqs += i == 0 || t.sequence[i] != t.sequence[i - 1];
  const double tokens = double(t.sequence.size());
  const std::vector<double> all = ranks_.sum({seqs, tokens});
  const double scale = settings_.aggregation == "token-mean" ? tokens / all[1] : seqs / all[0];
  for (double& w : t.weight) w *= scale;
}

// Data parallelism: the rollout's figures over every rank — the counts and sums added, the largest gap and the
// slowest rank's seconds taken.
void RlSource::figures_over_ranks(Figures& f) {
  std::vector<double> v = {f.reward_sum, f.answer_sum, f.length_sum, double(f.sampled), double(f.truncated),
                           double(f.dropped), f.gap_sum, double(f.gap_tokens), f.weight_sum, double(f.masked)};
  const size_t slots = v.size(), per_rank = 4;  // then each rank's gap_max and seconds in its own slots
  v.resize(slots + per_rank * size_t(ranks_.ranks), 0.0);
  double* mine = v.data() + slots + per_rank * size_t(ranks_.rank);
  mine[0] = f.gap_max, mine[1] = f.rollout_s, mine[2] = f.reward_s, mine[3] = f.logprob_s;
  const std::vector<double> s = ranks_.sum(v);
  f.reward_sum = s[0], f.answer_sum = s[1], f.length_sum = s[2];
  f.sampled = int64_t(s[3]), f.truncated = int64_t(s[4]), f.dropped = int64_t(s[5]);
  f.gap_sum = s[6], f.gap_tokens = int64_t(s[7]), f.weight_sum = s[8], f.masked = int64_t(s[9]);
  f.gap_max = f.rollout_s = f.reward_s = f.logprob_s = 0;
  for (int r = 0; r < ranks_.ranks; ++r) {
    const double* x = s.data() + slots + per_rank * size_t(r);
    f.gap_max = std::max(f.gap_max, x[0]);
    f.rollout_s = std::max(f.rollout_s, x[1]);
    f.reward_s = std::max(f.reward_s, x[2]);
    f.logprob_s = std::max(f.logprob_s, x[3]);
  }
}

std::vector<double> RlSource::label_logprobs(PackedBatch& b, bool with_adapter) {
  std::vector<double> out;
  const RowLoss capture = [&](std::span<const double> logp, std::span<double> loss, std::span<double> d) {
    out.assign(logp.begin(), logp.end());
    std::fill(loss.begin(), loss.end(), 0.0);
    std::fill(d.begin(), d.end(), 0.0);
  };
  b.row_loss = &capture;
  if (with_adapter && adapter_ >= 0) set_segments(b, {{b.tokens(), adapter_, 1.0, 0}});
  model_->loss(b, false);
  b.row_loss = nullptr;
  b.segments.clear();
  return out;
}

// w = exp(old - rollout) per token (token_*) or exp(the sum over the sequence) per sequence (seq_*); *_tis: min(w,
// cap); *_mis: 1 inside [1 / cap, cap], else 0. The weight multiplies the token's aggregation weight (the policy loss
// and the KL term alike).
void RlSource::correct_importance(PolicyTokens& t, const std::vector<double>& rollout, double& weight_sum,
                                  int64_t& masked) {
  const std::string& mode = c_.rl.importance_correction;
  const double cap = c_.rl.importance_cap;
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

std::vector<PackedBatch*> RlSource::batches(int64_t) {
  if (pending_.empty()) rollout();
  current_ = std::move(pending_.front());
  pending_.erase(pending_.begin());
  return {&current_->rb.batch};
}

nlohmann::json RlSource::step_metrics() {
  if (ranks_.ranks > 1) {  // the update's statistics over every rank's share, weighted by its tokens (or sequences)
    const PolicyTokens& t = current_->rb.tokens;
    double seqs = 0;
    for (size_t i = 0; i < t.sequence.size(); ++i) seqs += i == 0 || t.sequence[i] != t.sequence[i - 1];
    const double tokens = double(t.sequence.size()), n = settings_.loss.sequence_ratio ? seqs : tokens;
    PolicyStats& st = current_->stats;
    const std::vector<double> s = ranks_.sum({st.clip_fraction * n, st.ratio_mean * n, st.kl_mean * tokens, n, tokens});
    st.clip_fraction = s[0] / s[3];
    st.ratio_mean = s[1] / s[3];
    st.kl_mean = s[2] / s[4];
  }
  nlohmann::json m = {{"clip_fraction", current_->stats.clip_fraction}, {"ratio_mean", current_->stats.ratio_mean}};
  if (settings_.loss.kl_coef > 0) m["kl_mean"] = current_->stats.kl_mean;
  if (!rollout_metrics_.is_null()) m.update(std::exchange(rollout_metrics_, nullptr));
  return m;
}

std::string RlSource::progress() const {
  return fmt::format("reward {:.3f} | ratio {:.3f} | clip {:.3f}", last_reward_,
                     current_ ? current_->stats.ratio_mean : 1.0, current_ ? current_->stats.clip_fraction : 0.0);
}

}  // namespace lathe
