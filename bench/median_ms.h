// The benchmarks' timer: runs f `warmup` times, then `iters` times between CUDA events on the context's stream, and
// returns the median in milliseconds (device 0).
#pragma once

#include <algorithm>
#include <vector>

#include "backend/registry.h"

namespace lathe {

template <typename F>
double median_ms(ExecContext& ctx, int iters, F f, int warmup = 0) {
  for (int i = 0; i < warmup; ++i) f();
  auto start = ctx.backend.create_event(0), stop = ctx.backend.create_event(0);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    start->record(ctx.stream);
    f();
    stop->record(ctx.stream);
    stop->synchronize();
    ms.push_back(stop->elapsed_ms_since(*start));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace lathe
