// Pipeline layouts, schedules and the lockstep timeline (pipeline.h).
#include "model/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "core/error.h"

namespace lathe {

PipelineLayout::PipelineLayout(int64_t num_layers, int pp, int vpp, std::vector<int64_t> counts)
    : pp_(pp), vpp_(vpp), layers_(std::move(counts)) {
  LATHE_CHECK(pp >= 1 && vpp >= 1, "parallel: pp and vpp must be at least 1, got pp {} and vpp {}", pp, vpp);
  LATHE_CHECK(vpp == 1 || pp > 1, "parallel.vpp = {}: virtual pipeline stages need pipeline parallelism (parallel.pp "
              "above 1)", vpp);
  const int s = pp * vpp;
  if (layers_.empty()) {
    LATHE_CHECK(num_layers >= s, "parallel: the model's {} layers cannot be split into {} pipeline stages (pp {} x vpp "
                "{}): every stage needs at least one layer", num_layers, s, pp, vpp);
    for (int i = 0; i < s; ++i) layers_.push_back(num_layers / s + (i < num_layers % s ? 1 : 0));
  }
  LATHE_CHECK(int64_t(layers_.size()) == s, "parallel.pp_layers: {} layer counts for {} pipeline stages (pp {} x vpp "
              "{}): give one a stage, in stage order", layers_.size(), s, pp, vpp);
  int64_t sum = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    LATHE_CHECK(layers_[i] >= 1, "parallel.pp_layers: stage {} has {} layers; every stage needs at least one", i,
                layers_[i]);
    starts_.push_back(sum);
    sum += layers_[i];
  }
  LATHE_CHECK(sum == num_layers, "parallel.pp_layers: the counts add up to {} layers; the model has {}", sum,
              num_layers);
}

int PipelineLayout::stage_of_layer(int64_t layer) const {
  if (starts_.empty()) return 0;
  const auto it = std::upper_bound(starts_.begin(), starts_.end(), layer);
  return int(it - starts_.begin()) - 1;
}

std::string PipelineLayout::describe() const {
  std::vector<std::string> parts;
  for (int s = 0; s < stages(); ++s) {
    const int64_t a = first_layer(s), b = end_layer(s) - 1;
    parts.push_back(a == b ? fmt::format("{}", a) : fmt::format("{}-{}", a, b));
  }
  return fmt::format("pp {} x vpp {}: layers {}", pp_, vpp_, fmt::join(parts, " | "));
}

PipelineLayout balanced_pipeline_layout(const std::vector<double>& layer_costs, int pp, int vpp) {
  const int64_t n = int64_t(layer_costs.size());
  const int s = pp * vpp;
  if (n < s) return PipelineLayout(n, pp, vpp);  // refused there, naming the counts
  std::vector<double> prefix(size_t(n) + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[size_t(i) + 1] = prefix[size_t(i)] + layer_costs[size_t(i)];
  // best[k][i]: the least largest stage cost of the first i layers in k stages; cut[k][i]: where the k-th starts.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(s) + 1, std::vector<double>(size_t(n) + 1, inf));
  std::vector<std::vector<int64_t>> cut(size_t(s) + 1, std::vector<int64_t>(size_t(n) + 1, 0));
  best[0][0] = 0.0;
  for (int k = 1; k <= s; ++k)
    for (int64_t i = k; i <= n - (s - k); ++i)
      for (int64_t j = i - 1; j >= k - 1; --j) {  // the k-th stage is layers [j, i): from the largest first
        const double cost = std::max(best[size_t(k) - 1][size_t(j)], prefix[size_t(i)] - prefix[size_t(j)]);
        if (cost < best[size_t(k)][size_t(i)] * (1 - 1e-12)) {
          best[size_t(k)][size_t(i)] = cost;
          cut[size_t(k)][size_t(i)] = j;
        }
      }
  std::vector<int64_t> counts(static_cast<size_t>(s));
  for (int64_t k = s, i = n; k >= 1; --k) {
    counts[size_t(k) - 1] = i - cut[size_t(k)][size_t(i)];
    i = cut[size_t(k)][size_t(i)];
  }
  return PipelineLayout(n, pp, vpp, counts);
}

std::vector<PipeAction> pipeline_order(const PipelineLayout& layout, int rank, int64_t micro_batches,
                                       bool forward_only) {
  const int pp = layout.pp(), vpp = layout.vpp();
  LATHE_CHECK(micro_batches >= 1, "pipeline: a step needs at least one micro-batch, got {}", micro_batches);
  if (forward_only) {  // each forward as early as its input can be there: micro-batch m reaches stage v at tick m + v
    std::vector<PipeAction> order;
    for (int c = 0; c < vpp; ++c)
      for (int64_t m = 0; m < micro_batches; ++m) order.push_back({PipeOp::Forward, c, int(m)});
    std::stable_sort(order.begin(), order.end(), [&](const PipeAction& a, const PipeAction& b) {
      return a.micro + layout.stage(rank, a.chunk) < b.micro + layout.stage(rank, b.chunk);
    });
    return order;
  }
  LATHE_CHECK(vpp == 1 || micro_batches % pp == 0, "parallel.vpp = {}: the interleaved pipeline schedule runs "
              "micro-batches in groups of pp = {}; a step's {} micro-batches (train.grad_accum) are not a multiple of "
              "it", vpp, pp, micro_batches);
  const int64_t total = micro_batches * vpp;
  // The k-th forward (backward) of the rank: chunks in turn for each group of pp micro-batches (backwards from the
  // last chunk); with vpp 1 simply micro-batch k.
  auto micro = [&](int64_t k) { return int((k / (int64_t(pp) * vpp)) * pp + k % pp); };
  auto forward = [&](int64_t k) { return PipeAction{PipeOp::Forward, int((k / pp) % vpp), micro(k)}; };
  auto backward = [&](int64_t k) { return PipeAction{PipeOp::Backward, vpp - 1 - int((k / pp) % vpp), micro(k)}; };
  const int64_t warmup = std::min<int64_t>(
      total, vpp == 1 ? pp - rank - 1 : int64_t(pp - rank - 1) * 2 + int64_t(vpp - 1) * pp);
  std::vector<PipeAction> order;
  for (int64_t k = 0; k < warmup; ++k) order.push_back(forward(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    order.push_back(forward(warmup + k));
    order.push_back(backward(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) order.push_back(backward(k));
  return order;
}

double PipelineTimeline::idle_fraction() const {
  if (ticks.empty()) return 0.0;
  size_t busy = 0;
  for (const PipeTick& t : ticks)
    busy += size_t(std::count_if(t.action.begin(), t.action.end(), [](int a) { return a >= 0; }));
  const double slots = double(ticks.size()) * double(ticks[0].action.size());
  return (slots - double(busy)) / slots;
}

PipelineTimeline pipeline_timeline(const PipelineLayout& layout, int64_t micro_batches, bool forward_only) {
  PipelineTimeline tl;
  const int pp = layout.pp(), stages = layout.stages();
  size_t remaining = 0;
  for (int r = 0; r < pp; ++r) {
    tl.orders.push_back(pipeline_order(layout, r, micro_batches, forward_only));
    remaining += tl.orders.back().size();
  }
  // The tick at which each (stage, micro-batch)'s forward and backward ran (-1: not yet).
  std::vector<std::vector<int64_t>> fwd(size_t(stages), std::vector<int64_t>(size_t(micro_batches), -1)), bwd = fwd;
  auto before = [](int64_t done, int64_t tick) { return done >= 0 && done < tick; };
  std::vector<size_t> next(size_t(pp), 0);
  for (int64_t t = 0; remaining > 0; ++t) {
    PipeTick tick;
    tick.action.assign(size_t(pp), -1);
    for (int r = 0; r < pp; ++r) {
      if (next[size_t(r)] == tl.orders[size_t(r)].size()) continue;
      const PipeAction a = tl.orders[size_t(r)][next[size_t(r)]];
      const int v = layout.stage(r, a.chunk);
      const size_t m = size_t(a.micro);
      const bool ready = a.op == PipeOp::Forward
                             ? v == 0 || before(fwd[size_t(v - 1)][m], t)
                             : before(fwd[size_t(v)][m], t) && (v == stages - 1 || before(bwd[size_t(v + 1)][m], t));
      if (!ready) continue;
      tick.action[size_t(r)] = int(next[size_t(r)]++);
      --remaining;
      if (a.op == PipeOp::Forward) {
        fwd[size_t(v)][m] = t;
        if (v + 1 < stages) tick.messages.push_back({PipeOp::Forward, v + 1, a.micro, r, layout.rank_of(v + 1)});
      } else {
        bwd[size_t(v)][m] = t;
        if (v > 0) tick.messages.push_back({PipeOp::Backward, v - 1, a.micro, r, layout.rank_of(v - 1)});
      }
    }
    LATHE_CHECK(std::any_of(tick.action.begin(), tick.action.end(), [](int a) { return a >= 0; }),
                "pipeline: the schedule for {} and {} micro-batches stalls at tick {} (a Lathe bug)", layout.describe(),
                micro_batches, t);
    tl.ticks.push_back(std::move(tick));
  }
  return tl;
}

}  // namespace lathe
