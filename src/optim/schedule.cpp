// Learning-rate schedules (conventions in schedule.h). Covered by tests/unit/test_optim.cpp.
#include "optim/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace lathe {

std::string_view schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::Constant: return "constant";
    case ScheduleKind::Linear: return "linear";
    case ScheduleKind::Cosine: return "cosine";
  }
  return "?";
}

ScheduleKind schedule_kind_from_name(std::string_view name) {
  for (ScheduleKind k : {ScheduleKind::Constant, ScheduleKind::Linear, ScheduleKind::Cosine})
    if (schedule_kind_name(k) == name) return k;
  LATHE_FAIL("schedule: unknown schedule '{}' (choose constant, linear or cosine)", name);
}

std::vector<std::string> validate_schedule(const ScheduleConfig& c) {
  std::vector<std::string> p;
  if (!(std::isfinite(c.lr) && c.lr > 0))
    p.push_back(fmt::format("schedule: lr must be a positive number, got {}", c.lr));
  if (c.warmup_steps < 0) p.push_back(fmt::format("schedule: warmup_steps must be >= 0, got {}", c.warmup_steps));
  if (c.min_lr && c.min_lr_ratio) p.push_back("schedule: set min_lr or min_lr_ratio, not both");
  if (c.min_lr && !(*c.min_lr >= 0 && *c.min_lr <= c.lr))
    p.push_back(fmt::format("schedule: min_lr must lie in [0, lr = {}], got {}", c.lr, *c.min_lr));
  if (c.min_lr_ratio && !(*c.min_lr_ratio >= 0 && *c.min_lr_ratio <= 1))
    p.push_back(fmt::format("schedule: min_lr_ratio must lie in [0, 1], got {}", *c.min_lr_ratio));
  if (c.kind != ScheduleKind::Constant) {
    if (c.total_steps <= 0)
      p.push_back(fmt::format("schedule: a {} schedule needs total_steps > 0 (the step where the decay ends)",
                              schedule_kind_name(c.kind)));
    else if (c.total_steps < c.warmup_steps)
      p.push_back(fmt::format("schedule: warmup_steps ({}) exceed total_steps ({})", c.warmup_steps, c.total_steps));
  }
  return p;
}

double learning_rate(const ScheduleConfig& c, int64_t step) {
  if (const std::vector<std::string> p = validate_schedule(c); !p.empty())
    LATHE_FAIL("{}", fmt::join(p, "; "));
  LATHE_CHECK(step >= 0, "schedule: step must be >= 0, got {}", step);
  if (step <= c.warmup_steps && c.warmup_steps > 0) return c.lr * double(step) / double(c.warmup_steps);
  if (c.kind == ScheduleKind::Constant) return c.lr;
  const double floor = c.min_lr ? *c.min_lr : c.min_lr_ratio ? *c.min_lr_ratio * c.lr : 0.0;
  const int64_t span = c.total_steps - c.warmup_steps;
  const double progress = span <= 0 ? 1.0 : std::min(1.0, double(step - c.warmup_steps) / double(span));
  const double shape = c.kind == ScheduleKind::Linear ? 1.0 - progress
                                                      : 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return floor + (c.lr - floor) * shape;
}

}  // namespace lathe
