// rl.mode: async (rl_source.h, docs/rl.md "Asynchronous RL"): the training ranks' side — each rollout's groups taken
// from the rollout ranks instead of sampled, the weights sent after each rollout's updates — and the rollout ranks'
// loop, both walking the events of rl/async_schedule.h in one order.
//
// Messages. A rollout rank's groups of one rollout, to every training rank (gathered_values over the world; a
// training rank gives nothing, or {kStop} when it stops early): {kRollout, rollout, version, the rollout rank's seconds
// waiting for the trainer since its last message, then each job's (the policy's, or every tenant's, in order) epoch
// and position after the rollout}, then for each job {its figures (Figures::message), group count, each group
// (encode_group)}. The weights, from the first training rank over the sync group: a header {kWeights or kStop,
// version, bytes of JSON that follow}, at the start the JSON (the model config, dtype, LoRA configs, each job's
// position in its prompts and adapter, the first rollout to sample and the parameters' sizes), then the synced tensors,
// whole, in buckets of up to 256 MiB (sync_buckets): at the start the whole model and the adapters, later the adapters
// alone under LoRA, else the whole model.
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <chrono>
#include <map>
#include <numeric>
#include <optional>
#include <tuple>

#include "backend/runtime.h"
#include "core/error.h"
#include "core/fault_inject.h"
#include "model/causal_lm.h"
#include "model/config.h"
#include "model/lora.h"
#include "ops/ops.h"
#include "rl/async_schedule.h"
#include "rl/rl_source.h"
#include "rl/rl_source_parts.h"

namespace lathe {

namespace {

constexpr double kRollout = 1, kStop = 2, kWeights = 3;
// A rollout message's numbers before the jobs' (epoch, position) pairs, and where job k's pair is.
constexpr size_t kMessageHeader = 4;
size_t place_of_job(size_t k) { return kMessageHeader + 2 * k; }
constexpr int64_t kBucketBytes = int64_t(256) << 20;

// The sync's broadcasts: runs of consecutive tensors of one dtype, each run at most kBucketBytes (a larger tensor
// alone), each run one broadcast. Whether a tensor of `bytes` in `dtype` opens a new run after one of `held_bytes` in
// `held`: the one rule both sides cut by (sync_buckets on the rollout ranks, BucketSender on the first trainer).
bool opens_bucket(DType held, int64_t held_bytes, DType dtype, int64_t bytes) {
  return held != dtype || held_bytes + bytes > kBucketBytes;
}

// A rollout rank's parameters (global shapes, dtype) in the sync's runs.
std::vector<std::vector<const Parameter*>> sync_buckets(const std::vector<const Parameter*>& params) {
  std::vector<std::vector<const Parameter*>> out;
  int64_t bytes = 0;
  for (const Parameter* p : params) {
    const int64_t n = shape_numel(p->global_shape()) * int64_t(dtype_size(p->value.dtype()));
    if (out.empty() || opens_bucket(out.back().front()->value.dtype(), bytes, p->value.dtype(), n)) {
      out.emplace_back();
      bytes = 0;
    }
    out.back().push_back(p);
    bytes += n;
  }
  return out;
}

int64_t bucket_elements(const std::vector<const Parameter*>& bucket) {
  int64_t n = 0;
  for (const Parameter* p : bucket) n += shape_numel(p->global_shape());
  return n;
}

}  // namespace

void RlSource::set_async(const AsyncRanks& ranks) {
  async_ = std::make_unique<Async>();
  async_->ranks = ranks;
  const RlOptions& o = jobs_[0]->c->rl;
  async_->max_staleness = o.max_staleness;
  async_->minibatches = o.minibatches;
  async_->total = jobs_[0]->c->max_steps / o.minibatches;  // tenants: the same for each (the config check)
}

// A rollout rank's message for the training ranks, read: the callback gets each job's section (its place in the prompts
// after the rollout, its figures, its groups). The header's first fields are read by the caller.
void RlSource::read_message(const std::vector<double>& m, const std::function<void(size_t, MessageSection&)>& fn) const {
  LATHE_CHECK(m.size() >= place_of_job(jobs_.size()) && m[0] == kRollout, "rl: async: a malformed rollout message");
  const double* v = m.data() + place_of_job(jobs_.size());
  for (size_t k = 0; k < jobs_.size(); ++k) {
    MessageSection s;
    s.epoch = int64_t(m[place_of_job(k)]);
    s.position = int64_t(m[place_of_job(k) + 1]);
    s.figures = v;
    v += Figures::kMessageSize;
    const int64_t count = int64_t(*v++);
    for (int64_t g = 0; g < count; ++g) s.groups.push_back(decode_group(v, size_t(jobs_[k]->c->rl.samples)));
    fn(k, s);
  }
  LATHE_CHECK(v == m.data() + m.size(), "rl: async: a rollout message of {} numbers holds {} more than its jobs' "
              "sections", m.size(), m.data() + m.size() - v);
}

// A rollout rank's parameters in the order the sync sends them (send_weights): every model parameter (`with_base`, or
// full fine-tuning), then each adapter's matrices (whole: either side may split them over its tp group).
std::vector<const Parameter*> RlSource::synced_parameters(bool with_base) const {
  std::vector<const Parameter*> out;
  LoraBank* bank = model_->lora();
  if (with_base || !bank)
    for (const Parameter& p : model_->parameters()) out.push_back(&p);
  for (int a = 0; bank && a < bank->size(); ++a)
    for (const Parameter& p : bank->parameters(a)) out.push_back(&p);
  return out;
}

// Whether this training rank takes part in a weights event: the first training rank, which sends, and under tensor,
// expert or pipeline parallelism every training rank, each gathering its slices with its groups (and sending its
// stage's tensors to its first stage) as a save does; the other replicas do the same among themselves, so that every
// group's collectives are whole.
bool RlSource::joins_weights() const {
  const ModelOptions& o = model_->options();
  return async_->ranks.sync || o.tp || o.ep || o.pp;
}

namespace {

// The sender's side of sync_buckets: whole tensors added in the sync's order, each bucket broadcast from rank 0 of
// `sync` once the next tensor opens another (opens_bucket, so both sides cut the same buckets).
class BucketSender {
 public:
  BucketSender(Communicator& sync, ExecContext cx) : sync_(sync), cx_(cx) {}
  void add(const Tensor& whole) {
    const int64_t n = whole.numel() * int64_t(dtype_size(whole.dtype()));
    if (!held_.empty() && opens_bucket(held_[0].dtype(), bytes_, whole.dtype(), n)) flush();
    held_.push_back(whole);
    bytes_ += n;
    sent_ += double(n);
  }
  void flush() {
    if (held_.size() == 1) {
      sync_.broadcast(held_[0], 0).wait();
    } else if (!held_.empty()) {
      int64_t elements = 0;
      for (const Tensor& t : held_) elements += t.numel();
      Tensor flat = Tensor::empty({elements}, held_[0].dtype(), cx_.allocator);
      int64_t at = 0;
      for (const Tensor& t : held_) {
        copy_into(cx_, t, flat.narrow(0, at, t.numel()).view(t.shape()));
        at += t.numel();
      }
      sync_.broadcast(flat, 0).wait();
    }
    held_.clear();
    bytes_ = 0;
  }
  double sent() const { return sent_; }

 private:
  Communicator& sync_;
  ExecContext cx_;
  std::vector<Tensor> held_;
  int64_t bytes_ = 0;
  double sent_ = 0;
};

}  // namespace

// The first training rank (with the others under tp, ep or pp): the header, at the start the run's description, and
// the weights, whole, over the sync group in buckets (sync_buckets): the model's parameters (for_each_whole's order:
// a one-process model's), then under LoRA each adapter's values (later syncs send the adapters alone).
void RlSource::send_weights(bool start) {
  Async& as = *async_;
  Communicator* sync = as.ranks.sync;  // null on the other training ranks: they gather and send to their stage 0 only
  const Device device = model_->options().device;
  const auto t = Clock::now();
  LoraBank* bank = model_->lora();
  if (start && sync) {
    nlohmann::json jobs = nlohmann::json::array();  // each job's place in its prompts, and its adapter
    for (const auto& j : jobs_)
      jobs.push_back({{"epoch", j->epoch}, {"position", j->position}, {"rollouts", j->rollouts}, {"adapter", j->adapter}});
    nlohmann::json s = {{"model_config", model_->global_config().raw},
                        {"dtype", std::string(dtype_name(model_->options().dtype))}, {"jobs", jobs},
                        {"rollouts", as.first_rollout}, {"held", as.trained}, {"sizes", model_->whole_sizes()}};
    nlohmann::json lora = nlohmann::json::array();
    for (int a = 0; bank && a < bank->size(); ++a) {
      lora.push_back(lora_config_to_peft(bank->config(a), "", model_->global_config()));
      for (const Parameter& p : bank->parameters(a)) s["sizes"].push_back(shape_numel(p.global_shape()));
    }
    s["lora"] = lora;
    const std::string json = s.dump();
    std::vector<double> header = {kWeights, double(as.trained), double(json.size())};
    Tensor h = rt_.from_host(header.data(), {3}, DType::F64, device);
    sync->broadcast(h, 0).wait();
    Tensor bytes = rt_.from_host(json.data(), {int64_t(json.size())}, DType::U8, device);
    sync->broadcast(bytes, 0).wait();
  } else if (sync) {
    std::vector<double> header = {kWeights, double(as.trained), 0.0};
    Tensor h = rt_.from_host(header.data(), {3}, DType::F64, device);
    sync->broadcast(h, 0).wait();
  }
  std::optional<BucketSender> sender;
  if (sync) sender.emplace(*sync, rt_.context(device));
  if (start || !bank)
    model_->for_each_whole([&](const std::string&, const Tensor& whole) {
      if (sender) sender->add(whole);
    });
  for (int a = 0; bank && a < bank->size(); ++a)
    for (const Parameter& p : bank->parameters(a)) {
      const Tensor whole = model_->gathered(p);  // under tp a collective of the group (the bank split like the model)
      if (sender) sender->add(whole);
    }
  if (sender) sender->flush();
  rt_.synchronize(device);
  as.sync_s = seconds_since(t);
  as.sync_bytes = sender ? sender->sent() : 0.0;
}

// A rollout rank: the next weights (at the first call the run's start: the model is built from its description).
bool RlSource::receive_weights() {
  Async& as = *async_;
  Communicator& sync = *as.ranks.sync;
  const Device device = as.model ? as.model->options().device : parse_device(jobs_[0]->c->device);
  std::vector<double> header(3, 0.0);
  Tensor h = rt_.from_host(header.data(), {3}, DType::F64, device);
  sync.broadcast(h, 0).wait();
  const Tensor hh = device.is_cpu() ? h : rt_.copy_to(h, Device::cpu());
  std::copy(hh.data<double>(), hh.data<double>() + 3, header.begin());
  if (header[0] == kStop) return false;
  LATHE_CHECK(header[0] == kWeights, "rl: async: a malformed weights header from the first training rank");
  const bool start = header[2] > 0;
  if (start) {
    std::string json(size_t(header[2]), '\0');
    Tensor bytes = rt_.from_host(json.data(), {int64_t(json.size())}, DType::U8, device);
    sync.broadcast(bytes, 0).wait();
    const Tensor hb = device.is_cpu() ? bytes : rt_.copy_to(bytes, Device::cpu());
    json.assign(static_cast<const char*>(hb.data_ptr()), json.size());
    const nlohmann::json s = nlohmann::json::parse(json);
    ModelOptions mopt;
    mopt.device = device;
    mopt.dtype = dtype_from_name(s["dtype"].get<std::string>());
    mopt.train_base = false;
    mopt.tp = as.ranks.rollout_tp;  // rl.rollout_tp: this engine's slice of every layer
    const ModelConfig mc = parse_model_config(s["model_config"], "rl: async: the trainer's model");
    if (mopt.tp) check_tensor_parallel(mc, mopt.tp->size());
    as.model = allocated_causal_lm(rt_, mc, mopt);  // its values come next
    std::vector<LoraConfig> adapters;
    for (const nlohmann::json& a : s["lora"]) adapters.push_back(lora_config_from_peft(a, "rl: async"));
    if (!adapters.empty()) {
      as.bank = std::make_unique<LoraBank>(rt_, as.model->config(), device, mopt.dtype, adapters);
      as.bank->split_like(*as.model);  // rl.rollout_tp: each matrix split as its base weight
      as.model->attach_lora(as.bank.get());
    }
    model_ = as.model.get();
    LATHE_CHECK(s["jobs"].size() == jobs_.size(), "rl: async: the trainer serves {} policies, this rollout rank's "
                "config {}", s["jobs"].size(), jobs_.size());
    for (size_t k = 0; k < jobs_.size(); ++k) {
      Job& j = *jobs_[k];
      set_position(j, s["jobs"][k]);
      j.adapter = s["jobs"][k]["adapter"].get<int>();
      j.longest_prompt = longest_prompt(j);
    }
    const std::vector<const Parameter*> mine = synced_parameters(true);
    const std::vector<int64_t> sizes = s["sizes"].get<std::vector<int64_t>>();
    LATHE_CHECK(sizes.size() == mine.size(), "rl: async: the trainer sends {} tensors, this rollout rank's model has {} "
                "(with its adapters)", sizes.size(), mine.size());
    for (size_t i = 0; i < sizes.size(); ++i)
      LATHE_CHECK(sizes[i] == shape_numel(mine[i]->global_shape()), "rl: async: {} has {} elements on the trainer "
                  "and {} here", mine[i]->name, sizes[i], shape_numel(mine[i]->global_shape()));
    // The schedule from the trainer's position: it holds rollouts [held, rollouts) already.
    as.events = async_events(s["held"].get<int64_t>(), s["rollouts"].get<int64_t>(), as.total, as.max_staleness);
    as.next = 0;
  }
  ExecContext cx = rt_.context(device);
  for (const std::vector<const Parameter*>& bucket : sync_buckets(synced_parameters(start))) {
    const Parameter& first = *bucket[0];
    if (bucket.size() == 1 && (first.whole() || first.global_shape() == first.value.shape())) {
      Tensor v = first.value;  // in place
      sync.broadcast(v, 0).wait();
      continue;
    }
    // The bucket's whole tensors arrive back to back; each parameter takes its own (rl.rollout_tp: its piece).
    Tensor flat = Tensor::empty({bucket_elements(bucket)}, first.value.dtype(), cx.allocator);
    sync.broadcast(flat, 0).wait();
    int64_t at = 0;
    for (const Parameter* p : bucket) {
      const int64_t n = shape_numel(p->global_shape());
      model_->set_from_whole(*p, flat.narrow(0, at, n).view(p->global_shape()));
      at += n;
    }
  }
  return true;
}

// A training rank at the start of the run: the rollouts a checkpoint kept (taken but not trained), the schedule from
// there, and the run's start sent to the rollout ranks (the first training rank).
void RlSource::start_async(const nlohmann::json& state, size_t lead) {
  Async& as = *async_;
  LATHE_CHECK(as.ranks.trains, "rl: start() is a training rank's; a rollout rank runs serve()");
  const Job& j = *jobs_[lead];
  as.first_rollout = j.rollouts;
  const nlohmann::json none = nlohmann::json::object();
  const nlohmann::json& saved = state.is_object() && state.contains("async") ? state["async"] : none;
  as.trained = saved.value("trained", j.rollouts);
  as.updates = as.trained * as.minibatches;
  if (saved.contains("buffer"))
    for (const auto& [rollout, messages] : saved["buffer"].items())
      as.buffer[std::stoll(rollout)] = messages.get<std::vector<std::vector<double>>>();
  as.events = async_events(as.trained, j.rollouts, as.total, as.max_staleness);
  as.next = 0;
  if (ranks_.rank == 0)
    fmt::print("rl: async: {} rollout(s) taken and not trained{}; the rollout ranks sample from rollout {} with "
               "max_staleness {}\n", as.buffer.size(), as.buffer.empty() ? "" : " (kept by the checkpoint)",
               j.rollouts, as.max_staleness);
  if (joins_weights()) send_weights(true);
  as.started = true;
}

nlohmann::json RlSource::async_state() const {
  nlohmann::json buffer = nlohmann::json::object();
  for (const auto& [rollout, messages] : async_->buffer) buffer[std::to_string(rollout)] = messages;
  return {{"trained", async_->trained}, {"buffer", buffer}};
}

// Where the update of this step stands against the weights its samples came from (in updates: colocated runs
// count 0 .. rl.minibatches - 1 within a rollout).
int64_t RlSource::next_update_staleness() {
  Async& as = *async_;
  return as.updates++ - as.version * as.minibatches;
}

// A rollout rank: one rollout sampled (its share of the prompts, dynamic sampling's rounds agreed over the rollout
// ranks), as the message to the training ranks.
std::vector<double> RlSource::sample_for_trainer(int64_t rollout) {
  std::vector<size_t> ids(jobs_.size());  // every job (tenants in step: one schedule), in one engine
  std::iota(ids.begin(), ids.end(), size_t(0));
  for (auto& j : jobs_) j->rollouts = rollout;
  std::vector<Drawn> d(ids.size());
  while (sampling_round(ids, d)) {
  }
  for (auto& j : jobs_) j->rollouts = rollout + 1;
  if (async_->ranks.rollout_tp && async_->ranks.rollout_tp->rank() > 0) return {};  // the engine's first rank sends
  std::vector<double> m = {kRollout, double(rollout), double(async_version(rollout, async_->max_staleness)),
                           async_->rollout_idle_s};
  LATHE_ASSERT(m.size() == kMessageHeader);
  for (const auto& j : jobs_) m.insert(m.end(), {double(j->epoch), double(j->position)});
  for (size_t k = 0; k < ids.size(); ++k) {
    Figures& f = d[k].f;
    f.dropped = int64_t(d[k].uniform.size());
    const std::vector<double> figures = f.message();
    LATHE_ASSERT(figures.size() == Figures::kMessageSize);
    m.insert(m.end(), figures.begin(), figures.end());
    m.push_back(double(d[k].informative.size() + d[k].uniform.size()));
    for (const std::vector<Group>* kept : {&d[k].informative, &d[k].uniform})
      for (const Group& g : *kept) encode_group(g, m);
  }
  return m;
}

void RlSource::serve() {
  LATHE_CHECK(async_ && !async_->ranks.trains, "rl: serve() is a rollout rank's (rl.mode async)");
  Async& as = *async_;
  // The ranks that share each rollout's prompts: the rollout ranks, or under rl.rollout_tp one rank of each engine.
  Communicator& rollout = as.ranks.rollout_dp ? *as.ranks.rollout_dp : *as.ranks.rollout;
  ranks_.rank = rollout.rank();
  ranks_.ranks = rollout.size();
  if (!receive_weights()) return;
  const Device device = model_->options().device;
  ranks_.sum = [this, &rollout, device](const std::vector<double>& v) { return summed_over(rt_, device, rollout, v); };
  if (as.ranks.rollout->rank() == 0)
    fmt::print("rl: async: {} rollout rank(s), {} engine(s), from rollout {} of {}, max_staleness {}\n",
               as.ranks.rollout->size(), ranks_.ranks, jobs_[0]->rollouts, as.total, as.max_staleness);
  for (; as.next < as.events.size(); ++as.next) {
    const AsyncEvent e = as.events[as.next];
    if (e.kind == AsyncEvent::Kind::kWeights) {
      const auto t = Clock::now();
      if (!receive_weights()) return;
      as.rollout_idle_s += seconds_since(t);
      continue;
    }
    const std::vector<double> mine = sample_for_trainer(e.index);
    // Test hooks (tests/e2e/test_rl.cpp): the first rollout rank dies (kill -9) or stalls after sampling rollout N.
    if (as.ranks.rollout->rank() == 0 && fault_injected("rollout_sigkill", e.index)) raise(SIGKILL);
    if (as.ranks.rollout->rank() == 0 && fault_injected("rollout_sigstop", e.index)) raise(SIGSTOP);
    const auto t = Clock::now();
    const std::vector<std::vector<double>> all = gathered_values(rt_, device, *as.ranks.world, mine);
    as.rollout_idle_s = seconds_since(t);  // reported with the next rollout
    for (const std::vector<double>& m : all)
      if (!m.empty() && m[0] == kStop) return;
  }
}

// A training rank: the schedule's events [next, end).
void RlSource::take_events(size_t end) {
  Async& as = *async_;
  const Device device = model_->options().device;
  for (; as.next < end; ++as.next) {
    const AsyncEvent e = as.events[as.next];
    if (e.kind == AsyncEvent::Kind::kWeights) {
      LATHE_ASSERT(e.index == as.trained);  // the weights of this version are the trainer's now
      if (joins_weights()) send_weights(false);
      continue;
    }
    const auto t = Clock::now();
    std::vector<std::vector<double>> all = gathered_values(rt_, device, *as.ranks.world, {});
    as.trainer_idle_s += seconds_since(t);
    std::vector<std::vector<double>>& kept = as.buffer[e.index];
    for (std::vector<double>& m : all)
      if (!m.empty()) {
        LATHE_CHECK(m[0] == kRollout && int64_t(m[1]) == e.index, "rl: async: expected rollout {} from the rollout "
                    "ranks, got a message for {}", e.index, m.size() > 1 ? int64_t(m[1]) : -1);
        kept.push_back(std::move(m));
      }
    LATHE_CHECK(!kept.empty(), "rl: async: no rollout rank sent rollout {}", e.index);
    const std::vector<double>& last = kept.back();  // each job's position after this rollout (the groups stay coded)
    LATHE_CHECK(last.size() >= place_of_job(jobs_.size()), "rl: async: a malformed rollout message");
    for (size_t k = 0; k < jobs_.size(); ++k) {
      jobs_[k]->epoch = int64_t(last[place_of_job(k)]);
      jobs_[k]->position = int64_t(last[place_of_job(k) + 1]);
      jobs_[k]->rollouts = e.index + 1;
    }
  }
}

// A training rank: rollout m (its weights are version m) from the rollout ranks' messages — the groups ordered as one
// process orders them (the informative by sampling round and candidate, then the set-aside ones that fill the rest),
// this rank's share of them, and the rollout ranks' figures (on the first training rank alone: the ranks' figures are
// summed).
void RlSource::rollout_from_ranks(const std::vector<size_t>& ids) {
  Async& as = *async_;
  const int64_t m = as.trained;
  as.trainer_idle_s = 0;
  take_events(async_events_before_training(as.events, as.next, m));
  const auto it = as.buffer.find(m);
  LATHE_CHECK(it != as.buffer.end(), "rl: async: rollout {} never arrived from the rollout ranks", m);
  const std::vector<std::vector<double>> messages = std::move(it->second);
  as.buffer.erase(it);
  std::vector<std::vector<Group>> all(jobs_.size());
  std::vector<Figures> sampled(jobs_.size());
  double rollout_idle = 0;
  for (const std::vector<double>& msg : messages) {
    as.version = int64_t(msg[2]);
    rollout_idle = std::max(rollout_idle, msg[3]);
    read_message(msg, [&](size_t k, MessageSection& s) {
      sampled[k].add_message(s.figures);
      for (Group& g : s.groups) all[k].push_back(std::move(g));
    });
  }
  // The jobs training this step (a failed tenant's groups are left: the rollout ranks sampled it with the base).
  std::vector<std::vector<Group>> groups(ids.size());
  std::vector<Figures> figures(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const Job& j = *jobs_[ids[i]];
    std::vector<Group>& mine = all[ids[i]];
    const bool dynamic = j.settings.dynamic_sampling;
    std::stable_sort(mine.begin(), mine.end(), [&](const Group& a, const Group& b) {
      return std::tuple(dynamic && a.uniform, a.round, a.candidate) < std::tuple(dynamic && b.uniform, b.round, b.candidate);
    });
    const int64_t want = j.c->rl.prompts_per_step;
    LATHE_CHECK(int64_t(mine.size()) >= want, "rl: async: rollout {} has {} groups{}, {} wanted", m, mine.size(),
                j.c->name.empty() ? "" : " of tenant " + j.c->name, want);
    for (int64_t k = ranks_.rank; k < want; k += ranks_.ranks) groups[i].push_back(std::move(mine[size_t(k)]));
    if (ranks_.rank == 0) figures[i] = sampled[ids[i]];  // summed over the training ranks in train_on
  }
  train_on(ids, groups, figures);
  for (size_t id : ids) {
    nlohmann::json& metrics = jobs_[id]->rollout_metrics;
    metrics["weights_version"] = as.version;
    metrics["trainer_idle_s"] = as.trainer_idle_s;
    metrics["rollout_idle_s"] = rollout_idle;
    if (as.ranks.sync) {
      metrics["sync_s"] = as.sync_s;
      metrics["sync_mib"] = as.sync_bytes / 1048576.0;
      metrics["sync_gb_per_s"] = as.sync_s > 0 ? as.sync_bytes / as.sync_s / 1e9 : 0.0;
    }
  }
  ++as.trained;
}

std::vector<std::pair<std::string, std::vector<double>>> RlSource::step_histograms(size_t job) {
  if (!async_ || !current_) return {};
  double samples = 0;  // this rank's sequences of the update (the first rank's: it writes TensorBoard)
  for (const Part& p : current_->parts)
    if (p.job == job) samples += sequences_in(p.tokens);
  return {{"staleness", std::vector<double>(size_t(samples), double(staleness_))}};
}

void RlSource::before_save() {
  if (!async_ || !async_->ranks.trains) return;
  Async& as = *async_;
  take_events(async_events_before_checkpoint(as.events, as.next, as.trained, as.max_staleness));
}

void RlSource::end_async(Device device) {
  if (!async_ || !async_->ranks.trains) return;
  Async& as = *async_;
  const auto stop_header = [&] {
    if (!as.ranks.sync) return;
    std::vector<double> header = {kStop, 0, 0};
    Tensor h = rt_.from_host(header.data(), {3}, DType::F64, device);
    as.ranks.sync->broadcast(h, 0).wait();
  };
  if (!as.started) {  // nothing to train (the run had finished): the rollout ranks wait for the start
    stop_header();
    as.started = true;
    return;
  }
  if (as.next >= as.events.size()) return;
  if (as.events[as.next].kind == AsyncEvent::Kind::kSamples) gathered_values(rt_, device, *as.ranks.world, {kStop});
  else stop_header();
  as.next = as.events.size();
}

}  // namespace lathe
