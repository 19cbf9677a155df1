// Learning-rate schedules: constant, linear and cosine decay, each after a linear warmup from 0, with a floor
// (min_lr, or min_lr_ratio times the peak). Pure functions of (config, step).
// Convention: `step` is the 1-based number of the optimizer update being taken, as AdamW's bias correction counts
// it: update s of the warmup gets lr * s / warmup_steps (so the first update is not wasted at lr 0, unlike Hugging
// Face's schedulers, which evaluate their lambda at s - 1), update warmup_steps gets the peak, and the decay reaches
// the floor exactly at update total_steps and stays there. step 0 (before any update) gives 0 with a warmup.
// Covered by tests/unit/test_optim.cpp (hand-computed values).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lathe {

enum class ScheduleKind { Constant, Linear, Cosine };

std::string_view schedule_kind_name(ScheduleKind kind);
ScheduleKind schedule_kind_from_name(std::string_view name);  // "constant", "linear", "cosine"; throws otherwise

struct ScheduleConfig {
  ScheduleKind kind = ScheduleKind::Cosine;
  double lr = 1e-4;            // peak, reached at the end of the warmup
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;     // the decay ends here (train.max_steps); unused by constant
  std::optional<double> min_lr;        // floor of linear and cosine; at most one of these two
  std::optional<double> min_lr_ratio;  // floor as a fraction of lr
};

// Every problem with `config`, as messages starting with "schedule:" (empty when valid), so a config loader can
// report them all at once.
std::vector<std::string> validate_schedule(const ScheduleConfig& config);

// The learning rate of update `step` (1-based, see above). Throws if the config is invalid or step < 0.
double learning_rate(const ScheduleConfig& config, int64_t step);

}  // namespace lathe
