// The order of rl.mode: async's events (async_schedule.h).
#include "rl/async_schedule.h"

#include <fmt/format.h>

#include "core/error.h"

namespace lathe {

std::vector<AsyncEvent> async_events(int64_t held, int64_t first, int64_t total, int64_t max_staleness) {
  std::vector<AsyncEvent> out;
  for (int64_t n = first; n < total; ++n) {
    const int64_t v = async_version(n, max_staleness);
    LATHE_ASSERT(v <= held + 1);  // a version a rollout: the weights come one version at a time
    if (v > held) out.push_back({AsyncEvent::Kind::kWeights, held = v});
    out.push_back({AsyncEvent::Kind::kSamples, n});
  }
  return out;
}

size_t async_events_before_training(const std::vector<AsyncEvent>& events, size_t next, int64_t m) {
  size_t end = next;
  for (size_t i = next; i < events.size(); ++i) {
    const AsyncEvent& e = events[i];
    if (e.index == m) end = i + 1;  // rollout m's samples, the weights of version m
    if (e.kind == AsyncEvent::Kind::kWeights) LATHE_ASSERT(e.index >= m);  // an older version would be gone already
  }
  return end;
}

size_t async_events_before_checkpoint(const std::vector<AsyncEvent>& events, size_t next, int64_t m,
                                      int64_t max_staleness) {
  size_t end = next;
  for (size_t i = next; i < events.size(); ++i)
    if (events[i].kind == AsyncEvent::Kind::kSamples && async_version(events[i].index, max_staleness) < m) end = i + 1;
  for (size_t i = next; i < end; ++i) LATHE_ASSERT(events[i].kind == AsyncEvent::Kind::kSamples);
  return end;
}

std::string describe(const AsyncEvent& e) {
  return e.kind == AsyncEvent::Kind::kWeights ? fmt::format("weights v{}", e.index)
                                              : fmt::format("samples of rollout {}", e.index);
}

}  // namespace lathe
