// Every op case x device x dtype through the op-check harness (src/testing/op_check.h): CPU kernels and
// composites against the f64 reference and finite differences here; CUDA kernels too where a GPU exists
// (skipped with the reason otherwise). The last test checks that every registered kernel was exercised.
#include <gtest/gtest.h>

#include <algorithm>

#include "backend/runtime.h"
#include "testing/op_check.h"

using namespace lathe;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

void expect_all_pass(const std::vector<OpCheckResult>& results) {
  int checked = 0;
  for (const OpCheckResult& r : results) {
    EXPECT_NE(r.status, OpCheckResult::Status::Fail)
        << r.device << " " << r.dtype << " " << r.op << " " << r.params << " [" << r.kernel << "]: " << r.detail;
    checked += r.status == OpCheckResult::Status::Pass;
  }
  EXPECT_GT(checked, 0) << "no check ran";
}

class OpCheck : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(OpCheck, Cpu) {
  OpCheckOptions o;
  o.op = GetParam();
  o.devices = {Device::cpu()};
  expect_all_pass(run_op_check(runtime(), o));
}

TEST_P(OpCheck, Cuda) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  OpCheckOptions o;
  o.op = GetParam();
  o.devices = {Device::cuda(0)};
  const std::vector<OpCheckResult> results = run_op_check(runtime(), o);
  // An op with no CUDA kernel yet (every row skipped) is reported as skipped, with the harness's reason.
  if (std::all_of(results.begin(), results.end(), [](const OpCheckResult& r) { return r.status == OpCheckResult::Status::Skip; }))
    GTEST_SKIP() << GetParam() << " has no CUDA kernel: " << (results.empty() ? "no cases" : results.front().detail);
  expect_all_pass(results);
}

INSTANTIATE_TEST_SUITE_P(AllOps, OpCheck, ::testing::ValuesIn([] {
                           std::vector<std::string> names;
                           for (int i = 0; i < kOpCount; ++i) {
                             const OpId op = OpId(i);
                             const auto cases = all_op_cases();
                             if (std::any_of(cases.begin(), cases.end(), [&](const OpCase& c) { return c.op == op; }))
                               names.emplace_back(op_name(op));
                           }
                           return names;
                         }()),
                         [](const auto& info) { return info.param; });

TEST(OpCheckCoverage, EveryRegisteredKernelIsExercised) {
  OpCheckOptions o;
  o.finite_differences = false;
  for (const OpCheckResult& r : run_op_check(runtime(), o))
    if (r.params == "coverage") ADD_FAILURE() << r.device << " " << r.dtype << " " << r.op << " " << r.kernel << ": " << r.detail;
}
