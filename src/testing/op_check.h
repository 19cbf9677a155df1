// The op check harness (after ggml's test-backend-ops): every op case x device x dtype is run through the
// kernel registry and compared with the CPU f64 reference kernels; backward passes are compared the same
// way and, on the CPU in f64, against central finite differences. Outputs are surrounded by guard bytes
// and poisoned with NaN before each run, so out-of-bounds and missing writes fail. Inputs are seeded random
// values (never zeros). Used by tests/ops and by `lathe op-check` on an installed build.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/runtime.h"

namespace lathe {

struct OpCase {
  OpId op;
  std::string params;             // human-readable, used by filters, e.g. "m=33,n=17,k=65,ta=1"
  std::vector<Shape> inputs;      // shapes of the (contiguous) inputs
  OpAttrs attrs;
  std::vector<DType> dtypes;      // dtypes to test (the key dtype of the call)
  bool transpose_first = false;   // pass input 0 as a transposed (non-contiguous) view of its last two dims
  bool differentiable = true;
  // Where non-empty, input i is an i32 index tensor (ids, positions, labels, cu_seqlens) with these values.
  std::vector<std::vector<double>> index_values = {};
  // Where non-empty, floating input i is drawn from [lo, hi] instead of [-2, 2] (a log-decay must be <= 0; the
  // gated delta rule is stable only for small enough keys).
  std::vector<std::pair<double, double>> value_ranges = {};
  // Floating inputs listed here are in the accumulation dtype (f32; f64 in an f64 row) instead of the row's dtype:
  // ops that take some inputs wider than the key dtype (the gated delta rule's g and beta beside bf16/f16 q, k, v;
  // the recurrent state of gated_delta_rule_state).
  std::vector<size_t> accumulation_inputs = {};
  // Where non-empty, floating input i holds these values (exact in its dtype: settings such as sample_rows' params).
  std::vector<std::vector<double>> fixed_values = {};
};

std::vector<OpCase> all_op_cases();
// The dtype of floating input i of case `c` in a row of dtype `row` (see OpCase::accumulation_inputs).
DType op_case_input_dtype(const OpCase& c, size_t i, DType row);
void add_gated_delta_op_cases(std::vector<OpCase>& cases);  // testing/op_cases_gated_delta.cpp
void add_gdn_state_op_cases(std::vector<OpCase>& cases);    // testing/op_cases_gdn_state.cpp
void add_moe_op_cases(std::vector<OpCase>& cases);          // testing/op_cases_moe.cpp
void add_paged_op_cases(std::vector<OpCase>& cases);        // testing/op_cases_paged.cpp

struct OpCheckOptions {
  std::string op;                   // exact op name, empty = all
  std::string params;               // substring of the case params, empty = all
  std::vector<Device> devices;      // empty = cpu and every CUDA device present
  std::vector<DType> dtypes;        // empty = each case's own list
  bool backward = true;
  bool finite_differences = true;
  uint64_t seed = 20261125;
};

struct OpCheckResult {
  enum class Status { Pass, Fail, Skip };
  Status status;
  std::string op, params, device, dtype, kernel;
  std::string detail;  // errors, or the measured figures
};

// Maximum normalised mean squared error accepted for outputs of dtype `t`.
double nmse_threshold(DType t);

// Runs the selected checks; calls `report` after each one. A final set of "coverage" results fails for every
// registered kernel on a checked device type that no case exercised.
std::vector<OpCheckResult> run_op_check(Runtime& rt, const OpCheckOptions& options,
                                        const std::function<void(const OpCheckResult&)>& report = {});

}  // namespace lathe
