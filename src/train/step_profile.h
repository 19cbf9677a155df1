// One training step's per-kernel table from an OpProfiler (backend/profiler.h): each kernel's calls, time, share of
// the step, TFLOP/s and host time; the time by kind; the bounds the GEMMs set; the matmul shapes; and where the time
// outside the kernels sits. Printed by `lathe bench --profile` and by `lathe train` at train.profile_step.
// Covered by tests/e2e/test_bench.cpp and tests/e2e/test_train.cpp (the table's lines).
#pragma once

#include <nlohmann/json.hpp>

#include "backend/profiler.h"

namespace lathe {

// Prints the table of one step of `step_ms` wall time and returns its JSON form. `attention_flops`: the forward FLOPs
// of one attention call (all documents of one layer); its backward is counted at 2.5x. `peak`: the card's bf16 peak
// (0: no MFU bound).
nlohmann::json print_step_profile(const OpProfiler::Profile& p, double step_ms, double tokens, double flops_per_step,
                                  double attention_flops, double peak);

}  // namespace lathe
