#include "backend/profiler.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "backend/registry.h"

namespace lathe {

namespace {

constexpr int kComposite = -2;  // begin's token for a composite (not timed, no depth); -1: nested in a timed kernel

// 2 M N K of a matmul call (its output is (..., M, N); K is A's contracted dimension).
double matmul_flops(const OpCall& call, std::string* shape) {
  const Tensor& a = call.inputs.at(0);
  const Tensor& out = call.outputs.at(0);
  const MatmulAttrs& at = call.attr<MatmulAttrs>();
  const int64_t k = at.trans_a ? a.size(-2) : a.size(-1);
  const int64_t n = out.size(-1);
  const int64_t m = n > 0 ? out.numel() / n : 0;
  *shape = fmt::format("{} x {} x {} {}{}", m, n, k, at.trans_a ? 't' : 'n', at.trans_b ? 't' : 'n');
  return 2.0 * double(m) * double(n) * double(k);
}

// 2 P N K of a grouped GEMM call: every routed row of x (P, K) meets one (N, K) expert block (grouped_matmul), or
// every row of dy (P, N) and x (P, K) adds to one expert's (N, K) gradient (grouped_matmul_weight_grad); the same for
// the routed ops.
double grouped_flops(const OpCall& call) {
  const Tensor& a = call.inputs.at(0);
  const Tensor& b = call.inputs.at(1);
  const double rows = double(a.size(0));
  if (call.op == OpId::grouped_matmul || call.op == OpId::grouped_matmul_routed)
    return 2.0 * rows * double(call.outputs.at(0).size(1)) * double(a.size(1));
  return 2.0 * rows * double(a.size(1)) * double(b.size(1));
}

std::vector<OpProfiler::Total> sorted(std::unordered_map<int, OpProfiler::Total>& by_key) {
  std::vector<OpProfiler::Total> v;
  for (auto& [key, t] : by_key) v.push_back(std::move(t));
  std::sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return x.ms != y.ms ? x.ms > y.ms : x.name < y.name; });
  return v;
}

}  // namespace

OpProfiler::OpProfiler(DeviceBackend& backend, Device device) : backend_(backend), device_(device) {
  LATHE_CHECK(backend.type() == device.type, "profiler: {} is not a device of this backend", device.str());
}

OpProfiler::~OpProfiler() = default;

Event* OpProfiler::acquire_event() {
  if (pool_used_ == pool_.size()) pool_.push_back(backend_.create_event(device_.index));
  return pool_[pool_used_++].get();
}

int OpProfiler::intern(const std::string& name) {
  const auto [it, added] = name_index_.try_emplace(name, int(names_.size()));
  if (added) names_.push_back(name);
  return it->second;
}

int OpProfiler::begin(const OpCall& call, const Resolution& resolution, Stream& stream) {
  if (resolution.is_composite) {
    ++composite_calls_[resolution.name];
    return kComposite;
  }
  if (depth_++ > 0) return -1;
  Record r{intern(resolution.name), -1, call.op, 0.0, acquire_event(), acquire_event(), {}, 0.0};
  if (call.op == OpId::matmul) {
    std::string shape;
    r.flops = matmul_flops(call, &shape);
    r.shape = intern(shape);
  } else if (call.op == OpId::grouped_matmul || call.op == OpId::grouped_matmul_weight_grad ||
             call.op == OpId::grouped_matmul_routed || call.op == OpId::grouped_matmul_weight_grad_routed) {
    r.flops = grouped_flops(call);
  }
  r.start->record(stream);
  r.host_start = std::chrono::steady_clock::now();
  records_.push_back(r);
  return int(records_.size()) - 1;
}

void OpProfiler::end(int token, Stream& stream) {
  if (token == kComposite) return;
  --depth_;
  if (token < 0) return;
  Record& r = records_[size_t(token)];
  r.host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - r.host_start).count();
  r.stop->record(stream);
}

OpProfiler::Profile OpProfiler::collect() {
  Profile p;
  std::unordered_map<int, Total> kernels, shapes;
  for (const Record& r : records_) {
    r.stop->synchronize();
    const double ms = r.stop->elapsed_ms_since(*r.start);
    for (auto [key, map] : {std::pair{r.kernel, &kernels}, std::pair{r.shape, &shapes}}) {
      if (key < 0) continue;
      Total& t = (*map)[key];
      t.name = names_[size_t(key)];
      t.op = r.op;
      t.calls += 1;
      t.ms += ms;
      t.host_ms += r.host_ms;
      t.flops += r.flops;
    }
    p.kernels_ms += ms;
    ++p.calls;
  }
  if (!records_.empty()) p.span_ms = records_.back().stop->elapsed_ms_since(*records_.front().start);
  std::map<std::pair<int, int>, Total> gaps;
  for (size_t i = 1; i < records_.size(); ++i) {
    const double ms = records_[i].start->elapsed_ms_since(*records_[i - 1].stop);
    if (ms <= 0) continue;
    Total& t = gaps[{records_[i - 1].kernel, records_[i].kernel}];
    t.name = names_[size_t(records_[i - 1].kernel)] + " -> " + names_[size_t(records_[i].kernel)];
    t.op = records_[i].op;
    t.calls += 1;
    t.ms += ms;
  }
  for (auto& [key, t] : gaps) p.gaps.push_back(std::move(t));
  std::stable_sort(p.gaps.begin(), p.gaps.end(), [](const Total& a, const Total& b) { return a.ms > b.ms; });
  p.kernels = sorted(kernels);
  p.matmul_shapes = sorted(shapes);
  for (const auto& [name, calls] : composite_calls_) p.composites.push_back({name, calls});
  std::sort(p.composites.begin(), p.composites.end());
  records_.clear();
  composite_calls_.clear();
  pool_used_ = 0;
  return p;
}

}  // namespace lathe
