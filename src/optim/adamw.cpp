// AdamW: per-parameter state, the update through the adamw_list op (which also rounds the new master into a
// low-precision parameter, in the same kernel; one op, one launch on CUDA, per group of parameters that share their
// attributes and dtypes: usually one or two a step), and the state file. Loading validates the whole file first and
// reports every problem at once; nothing is changed unless the file is valid (a loaded master is cast into its
// parameter, as no update runs). Covered by tests/unit/test_optim.cpp.
#include "optim/adamw.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "io/safetensors.h"
#include "ops/ops.h"

namespace lathe {

namespace {


constexpr const char* kFormat = "lathe.adamw";

bool contains_any(const std::string& name, const std::vector<std::string>& parts) {
  for (const std::string& p : parts)
    if (!p.empty() && name.find(p) != std::string::npos) return true;
  return false;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Copies `t`'s values to a host buffer of its own dtype.
std::vector<uint8_t> to_host(Runtime& rt, const Tensor& t) {
  const Tensor h = rt.copy_to(t, Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.nbytes());
}

// Overwrites the contiguous tensor `t` with `bytes` (of t's dtype) from the host.
void upload(ExecContext& ctx, const Tensor& t, const std::vector<uint8_t>& bytes) {
  ctx.stream.synchronize();
  ctx.backend.copy(t.data_ptr(), ctx.device, bytes.data(), Device::cpu(), bytes.size(), ctx.stream);
  ctx.stream.synchronize();
}

int64_t parse_int(const std::map<std::string, std::string>& meta, const std::string& key, const std::string& path) {
  const auto it = meta.find(key);
  LATHE_CHECK(it != meta.end(), "optim: {}: metadata has no \"{}\"", path, key);
  int64_t v = 0;
  const char* end = it->second.data() + it->second.size();
  const auto r = std::from_chars(it->second.data(), end, v);
  LATHE_CHECK(r.ec == std::errc() && r.ptr == end && v >= 0, "optim: {}: metadata \"{}\" = \"{}\" is not a count",
              path, key, it->second);
  return v;
}

}  // namespace

size_t adamw_state_bytes_per_element(DType param, DType state_dtype) {
  if (param == DType::F32 || param == DType::F64) return 2 * dtype_size(param);
  if (param == DType::BF16 && state_dtype == DType::BF16) return 2 * dtype_size(DType::BF16);
  return 3 * dtype_size(DType::F32);  // f32 master, m and v
}

bool weight_decay_applies(const AdamWConfig& c, const std::string& name, const Shape& shape) {
  if (c.weight_decay == 0.0) return false;
  if (contains_any(name, c.no_decay)) return false;
  const bool bias = ends_with(name, "bias");
  if (bias) return c.decay_biases;
  if (shape.size() < 2) return c.decay_norms;
  if (name.find("embed_tokens") != std::string::npos) return c.decay_embeddings;
  return true;
}

AdamW::AdamW(Runtime& rt, std::vector<Parameter>& params, AdamWConfig config)
    : AdamW(rt,
            [&] {
              std::vector<Parameter*> p;
              for (Parameter& x : params) p.push_back(&x);
              return p;
            }(),
            std::move(config)) {}

AdamW::AdamW(Runtime& rt, std::vector<Parameter*> params, AdamWConfig config)
    : rt_(&rt), config_(std::move(config)) {
  LATHE_CHECK(config_.beta1 >= 0 && config_.beta1 < 1 && config_.beta2 >= 0 && config_.beta2 < 1,
              "optim: AdamW betas must lie in [0, 1), got {} and {}", config_.beta1, config_.beta2);
  LATHE_CHECK(config_.eps >= 0 && config_.weight_decay >= 0, "optim: AdamW needs eps >= 0 and weight_decay >= 0");
  LATHE_CHECK(!params.empty(), "optim: AdamW got no parameters");
  LATHE_CHECK(config_.state_dtype == DType::F32 || config_.state_dtype == DType::BF16,
              "optim: AdamW state_dtype must be f32 or bf16, got {}", dtype_name(config_.state_dtype));
  const bool bf16_states = config_.state_dtype == DType::BF16;
  device_ = params[0]->value.device();
  ExecContext ctx = rt.context(device_);
  std::set<std::string> names;
  for (Parameter* p : params) {
    const Tensor& w = p->value;
    LATHE_CHECK(w.defined() && is_floating(w.dtype()) && w.is_contiguous(),
                "optim: parameter {} must be a contiguous floating-point tensor, got {}", p->name,
                w.defined() ? w.describe() : "an undefined tensor");
    LATHE_CHECK(w.device() == device_, "optim: parameter {} is on {}, the others on {}", p->name, w.device().str(),
                device_.str());
    LATHE_CHECK(names.insert(p->name).second, "optim: parameter {} is listed twice", p->name);
    LATHE_CHECK(!bf16_states || w.dtype() != DType::F16,
                "optim: parameter {} is f16; bf16 optimizer states are for bf16 parameters (use f32 states)", p->name);
    Slot s{p, {}, {}, {}, 0, weight_decay_applies(config_, p->name, p->global_shape())};
    const bool own_master =
        w.dtype() == DType::F32 || w.dtype() == DType::F64 || (bf16_states && w.dtype() == DType::BF16);
    if (!own_master) s.master = cast(ctx, w, DType::F32);
    const DType state = own_master ? w.dtype() : DType::F32;
    s.m = zeros(ctx, w.shape(), state);
    s.v = zeros(ctx, w.shape(), state);
    slots_.push_back(std::move(s));
  }
}

const Tensor& AdamW::master(size_t i) const {
  return slots_[i].master.defined() ? slots_[i].master : slots_[i].param->value;
}

size_t AdamW::state_bytes() const {
  size_t n = 0;
  for (const Slot& s : slots_) n += s.m.nbytes() + s.v.nbytes() + (s.master.defined() ? s.master.nbytes() : 0);
  return n;
}

// The host copies are made once and kept (host_), in pinned memory where the device's backend has it, so the copies
// of a move are queued without waiting and the move waits once.
size_t AdamW::offload() {
  if (offloaded_) return 0;
  const size_t bytes = state_bytes();
  ExecContext cx = rt_->context(device_);
  Allocator* pinned = device_.is_cpu() ? nullptr : cx.backend.pinned_host_allocator();
  Allocator& host = pinned ? *pinned : rt_->host_allocator();
  host_.resize(slots_.size() * 3);
  size_t i = 0;
  for (Slot& s : slots_)
    for (Tensor* t : {&s.master, &s.m, &s.v}) {
      Tensor& h = host_[i++];
      if (!t->defined()) continue;
      if (!h.defined() || h.shape() != t->shape() || h.dtype() != t->dtype()) h = Tensor::empty(t->shape(), t->dtype(), host);
      cx.backend.copy(h.data_ptr(), Device::cpu(), t->data_ptr(), device_, t->nbytes(), cx.stream);
    }
  cx.stream.synchronize();
  i = 0;
  for (Slot& s : slots_)
    for (Tensor* t : {&s.master, &s.m, &s.v}) {
      const Tensor& h = host_[i++];
      if (t->defined()) *t = h;  // the device tensor goes back to its allocator
    }
  offloaded_ = true;
  return bytes;
}

size_t AdamW::restore() {
  if (!offloaded_) return 0;
  ExecContext cx = rt_->context(device_);
  for (Slot& s : slots_)
    for (Tensor* t : {&s.master, &s.m, &s.v}) {
      if (!t->defined()) continue;
      Tensor d = Tensor::empty(t->shape(), t->dtype(), cx.allocator);
      cx.backend.copy(d.data_ptr(), device_, t->data_ptr(), Device::cpu(), t->nbytes(), cx.stream);
      *t = std::move(d);
    }
  cx.stream.synchronize();  // the host copies are written again at the next offload
  offloaded_ = false;
  return state_bytes();
}

void AdamW::step(double lr, double grad_scale) { step(prepare(), lr, grad_scale); }

AdamW::Prepared AdamW::prepare(const std::vector<size_t>& segment_of) const {
  LATHE_CHECK(!offloaded_, "adamw: the state is offloaded to the host (restore() it before an update)");
  ExecContext ctx = rt_->context(device_);
  const bool segments_ok =
      segment_of.empty() || (segment_of.size() == slots_.size() && std::is_sorted(segment_of.begin(), segment_of.end()));
  LATHE_CHECK(segments_ok, "optim: {} segment numbers for {} parameters, or not in order", segment_of.size(),
              slots_.size());
  // Parameters whose update shares every attribute (segment, decay, step count) and dtype (master, gradient,
  // parameter) go through one adamw_list op, in parameter order; the groups in order of their first parameter (so in
  // segment order).
  struct Batch {
    std::tuple<size_t, bool, int64_t, bool, DType, DType, DType> key;  // segment, decay, step, has master, dtypes
    std::vector<AdamWGroup> groups;
  };
  std::vector<Batch> batches;
  Prepared prepared;
  prepared.for_step = step_count_;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    Parameter& p = *s.param;
    if (!p.grad.defined()) continue;
    LATHE_CHECK(p.grad.shape() == p.value.shape(), "optim: gradient {} of {} does not match the parameter {}",
                p.grad.describe(), p.name, p.value.describe());
    const bool master = s.master.defined();
    const Tensor grad = p.grad.is_contiguous() ? p.grad : contiguous(ctx, p.grad);
    const auto key = std::make_tuple(segment_of.empty() ? size_t(0) : segment_of[i], s.decay, s.steps + 1, master,
                                     master ? s.master.dtype() : p.value.dtype(), grad.dtype(), p.value.dtype());
    auto it = std::find_if(batches.begin(), batches.end(), [&](const Batch& b) { return b.key == key; });
    if (it == batches.end()) it = batches.insert(batches.end(), Batch{key, {}});
    // With a master, the op rounds the new master into the parameter as well.
    it->groups.push_back(master ? AdamWGroup{s.master, grad, s.m, s.v, p.value}
                                : AdamWGroup{p.value, grad, s.m, s.v, {}});
    prepared.slots.push_back(i);
  }
  for (const Batch& b : batches) {
    const AdamWAttrs a{0.0, config_.beta1, config_.beta2, config_.eps, std::get<1>(b.key) ? config_.weight_decay : 0.0,
                       std::get<2>(b.key), 1.0, std::nullopt};
    prepared.calls.push_back(adamw_update_list_call(b.groups, a));
    prepared.segment.push_back(std::get<0>(b.key));
  }
  return prepared;
}

void AdamW::step(Prepared prepared, double lr, double grad_scale, const std::function<void(size_t)>& segment_done) {
  LATHE_CHECK(std::isfinite(lr) && lr >= 0 && std::isfinite(grad_scale),
              "optim: AdamW step needs a finite lr >= 0 and a finite grad_scale, got {} and {}", lr, grad_scale);
  LATHE_CHECK(prepared.for_step == step_count_, "optim: AdamW update prepared at step {} run at step {}",
              prepared.for_step, step_count_);
  ExecContext ctx = rt_->context(device_);
  for (size_t c = 0; c < prepared.calls.size(); ++c) {
    auto& a = std::get<AdamWAttrs>(prepared.calls[c].attrs);
    a.lr = lr;
    a.grad_scale = grad_scale;
    run_op(ctx, prepared.calls[c]);
    const bool segment_ends = c + 1 == prepared.calls.size() || prepared.segment[c + 1] != prepared.segment[c];
    if (segment_done && segment_ends) segment_done(prepared.segment[c]);
  }
  for (size_t i : prepared.slots) slots_[i].steps += 1;
  ++step_count_;
}

void AdamW::save(const std::string& path) const {
  LATHE_CHECK(!offloaded_, "adamw: the state is offloaded to the host (restore() it before saving)");
  std::vector<std::vector<uint8_t>> buffers;  // keeps the host copies alive until written
  std::vector<io::TensorRef> refs;
  auto add = [&](const std::string& name, const Tensor& t) {
    buffers.push_back(to_host(*rt_, t));
    refs.push_back({name, t.dtype(), t.shape(), buffers.back().data(), buffers.back().size()});
  };
  buffers.reserve(slots_.size() * 3);
  std::map<std::string, std::string> meta = {{"format", kFormat},
                                             {"step", std::to_string(step_count_)},
                                             {"beta1", fmt::format("{}", config_.beta1)},
                                             {"beta2", fmt::format("{}", config_.beta2)},
                                             {"eps", fmt::format("{}", config_.eps)},
                                             {"weight_decay", fmt::format("{}", config_.weight_decay)},
                                             {"state_dtype", std::string(dtype_name(config_.state_dtype))}};
  for (const Slot& s : slots_) {
    const std::string& n = s.param->name;
    add(n + ".exp_avg", s.m);
    add(n + ".exp_avg_sq", s.v);
    if (s.master.defined()) add(n + ".master", s.master);
    // A parameter that skipped steps (no gradient) has its own count; the common case stores nothing.
    if (s.steps != step_count_) meta["step." + n] = std::to_string(s.steps);
    // A piece of a sharded tensor (ZeRO): where it sits in the whole, so that a shard file describes itself.
    if (!s.param->whole()) meta["shard." + n] = shard_metadata(s.param->shard);
  }
  io::write_safetensors(path, std::move(refs), meta);
}

void AdamW::load(const std::string& path) {
  LATHE_CHECK(!offloaded_, "adamw: the state is offloaded to the host (restore() it before loading)");
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  const auto& meta = file.metadata();
  const auto fmt_it = meta.find("format");
  LATHE_CHECK(fmt_it != meta.end() && fmt_it->second == kFormat,
              "optim: {} is not an AdamW state file (metadata format is \"{}\", expected \"{}\")", path,
              fmt_it == meta.end() ? "" : fmt_it->second, kFormat);
  const int64_t step_count = parse_int(meta, "step", path);

  // Validate everything before changing anything.
  std::vector<std::string> problems;
  std::set<std::string> known;
  // `moment`: the dtype this optimizer keeps the tensor in; a file's f32/f64 moments are read into either of those,
  // but bf16 ones only into bf16 ones (and the reverse): that is the state_dtype setting.
  const auto is_full = [](DType d) { return d == DType::F32 || d == DType::F64; };
  bool state_dtype_differs = false;
  auto check = [&](const std::string& name, const Shape& shape, bool required, std::optional<DType> moment) {
    known.insert(name);
    const io::SafetensorsTensor* t = file.find(name);
    if (!t) {
      if (required) problems.push_back(fmt::format("{} is missing", name));
      return;
    }
    if (!is_floating(t->dtype))
      problems.push_back(fmt::format("{} is {}, not floating point", name, dtype_name(t->dtype)));
    else if (moment && t->dtype != *moment && (!is_full(t->dtype) || !is_full(*moment))) {
      problems.push_back(fmt::format("{} is {} in the file, but this optimizer keeps it in {}", name,
                                     dtype_name(t->dtype), dtype_name(*moment)));
      state_dtype_differs = true;
    }
    if (Shape(t->shape.begin(), t->shape.end()) != shape)
      problems.push_back(fmt::format("{} has shape {}, the parameter {}", name, shape_str(Shape(t->shape.begin(),
                                     t->shape.end())), shape_str(shape)));
  };
  std::vector<int64_t> steps(slots_.size(), step_count);
  for (size_t i = 0; i < slots_.size(); ++i) {
    const std::string& n = slots_[i].param->name;
    const Shape& shape = slots_[i].param->value.shape();
    check(n + ".exp_avg", shape, true, slots_[i].m.dtype());
    check(n + ".exp_avg_sq", shape, true, slots_[i].v.dtype());
    check(n + ".master", shape, false, std::nullopt);
    if (meta.count("step." + n)) steps[i] = parse_int(meta, "step." + n, path);
    const auto shard = meta.find("shard." + n);  // a piece must be loaded into the same piece
    const std::string want = slots_[i].param->whole() ? "" : shard_metadata(slots_[i].param->shard);
    if ((shard == meta.end() ? "" : shard->second) != want)
      problems.push_back(fmt::format("{} was saved as {}, but this optimizer holds {}", n,
                                     shard == meta.end() ? "the whole tensor" : "the piece " + shard->second,
                                     want.empty() ? "the whole tensor" : "the piece " + want));
  }
  for (const io::SafetensorsTensor& t : file.tensors())
    if (!known.count(t.name)) problems.push_back(fmt::format("{} belongs to no parameter of this model", t.name));
  if (!problems.empty()) {
    const size_t shown = std::min<size_t>(problems.size(), 12);
    const std::string hint = state_dtype_differs
        ? fmt::format("; this optimizer keeps {} states (AdamWConfig::state_dtype, train.optimizer_states): resume "
                      "with the state dtype the file was saved with", dtype_name(config_.state_dtype))
        : "";
    LATHE_FAIL("optim: {} does not match this optimizer ({} problems{}): {}{}", path, problems.size(), hint,
               fmt::join(problems.begin(), problems.begin() + long(shown), "; "), shown < problems.size() ? "; ..." : "");
  }

  ExecContext ctx = rt_->context(device_);
  auto read = [&](const std::string& name, const Tensor& into) {
    std::vector<uint8_t> bytes(into.nbytes());
    file.read_into(name, into.dtype(), bytes.data(), bytes.size());
    upload(ctx, into, bytes);
  };
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    const std::string& n = s.param->name;
    read(n + ".exp_avg", s.m);
    read(n + ".exp_avg_sq", s.v);
    const bool saved_master = file.find(n + ".master") != nullptr;
    if (s.master.defined()) {
      if (saved_master) {
        read(n + ".master", s.master);
        OpCall call{OpId::cast, {s.master}, {s.param->value}, CastAttrs{s.param->value.dtype()}};
        run_op(ctx, call);  // the parameter is the rounded master, whatever the model file held
      } else {
        s.master = cast(ctx, s.param->value, DType::F32);  // state saved from f32 parameters
      }
    } else if (saved_master) {
      read(n + ".master", s.param->value);  // the exact master onto an f32/f64 parameter
    }
    s.steps = steps[i];
  }
  step_count_ = step_count;
}

}  // namespace lathe
