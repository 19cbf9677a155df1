// The kernel registry (resolution order, fallbacks, error messages) and the op-check harness itself:
// kernels planted with known faults must be caught, or the harness proves nothing.
#include <gtest/gtest.h>

#include "backend/runtime.h"
#include "ops/ops.h"
#include "testing/op_check.h"

using namespace lathe;

namespace {

bool any_failed(const std::vector<OpCheckResult>& rs, const std::string& needle) {
  for (const OpCheckResult& r : rs)
    if (r.status == OpCheckResult::Status::Fail && r.detail.find(needle) != std::string::npos) return true;
  return false;
}

OpCheckOptions only(const std::string& op, DType dt) {
  OpCheckOptions o;
  o.op = op;
  o.devices = {Device::cpu()};
  o.dtypes = {dt};
  return o;
}

}  // namespace

TEST(Registry, ResolvesExactKernelThenComposite) {
  Runtime rt;
  ExecContext cpu = rt.context(Device::cpu());
  OpCall call{OpId::silu, {Tensor::empty({4}, DType::F32, cpu.allocator)}, {Tensor::empty({4}, DType::F32, cpu.allocator)}, {}};
  Resolution r = rt.registry().resolve(call);
  EXPECT_EQ(r.name, "cpu/silu");
  EXPECT_FALSE(r.is_composite);

  OpCall half{OpId::silu, {Tensor::empty({4}, DType::BF16, cpu.allocator)}, {Tensor::empty({4}, DType::BF16, cpu.allocator)}, {}};
  r = rt.registry().resolve(half);
  EXPECT_EQ(r.name, "composite/upcast_f32");
  EXPECT_TRUE(r.is_composite);
  EXPECT_NE(r.fallback_reason.find("no cpu kernel for bf16"), std::string::npos);
}

TEST(Registry, PredicateFailureFallsThroughAndIsReported) {
  Runtime rt;
  ExecContext cpu = rt.context(Device::cpu());
  Tensor x = Tensor::empty({3, 4}, DType::F32, cpu.allocator).transpose(0, 1);  // non-contiguous
  OpCall call{OpId::softmax, {x}, {Tensor::empty({4, 3}, DType::F32, cpu.allocator)}, {}};
  try {
    rt.registry().resolve(call);
    FAIL() << "expected no kernel";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("op 'softmax'"), std::string::npos) << m;
    EXPECT_NE(m.find("on cpu"), std::string::npos) << m;
    EXPECT_NE(m.find("dtype f32"), std::string::npos) << m;
    EXPECT_NE(m.find("cpu/softmax_rows: inputs must be contiguous"), std::string::npos) << m;
  }
  // The op function makes the input contiguous first, so the same call through softmax() works.
  EXPECT_NO_THROW(softmax(cpu, x));
}

TEST(Registry, FirstRegisteredKernelWins) {
  Runtime rt([](KernelRegistry& r) {
    r.add(KernelDef{OpId::scale, DeviceType::CPU, DType::F32, "test/first", [](const OpCall&) { return Support::yes(); },
                    [](const OpCall&, ExecContext&) {}});
  });
  ExecContext cpu = rt.context(Device::cpu());
  OpCall call{OpId::scale, {Tensor::empty({2}, DType::F32, cpu.allocator)}, {Tensor::empty({2}, DType::F32, cpu.allocator)}, ScaleAttrs{2.0}};
  EXPECT_EQ(rt.registry().resolve(call).name, "test/first");
}

// find: the kernel of that name for exactly (op, device, dtype), whatever its place in the order.
TEST(Registry, FindsAKernelByNameForItsOpDeviceAndDtype) {
  Runtime rt([](KernelRegistry& r) {
    r.add(KernelDef{OpId::scale, DeviceType::CPU, DType::F32, "test/first",
                    [](const OpCall&) { return Support::yes(); }, [](const OpCall&, ExecContext&) {}});
  });
  const KernelDef* planted = rt.registry().find(OpId::scale, DeviceType::CPU, DType::F32, "test/first");
  ASSERT_NE(planted, nullptr);
  EXPECT_EQ(planted->name, "test/first");
  const KernelDef* silu = rt.registry().find(OpId::silu, DeviceType::CPU, DType::F32, "cpu/silu");
  ASSERT_NE(silu, nullptr);
  EXPECT_EQ(silu->op, OpId::silu);
  EXPECT_EQ(rt.registry().find(OpId::silu, DeviceType::CPU, DType::F64, "test/first"), nullptr);  // another op's name
  EXPECT_EQ(rt.registry().find(OpId::scale, DeviceType::CUDA, DType::F32, "test/first"), nullptr);
  EXPECT_EQ(rt.registry().find(OpId::scale, DeviceType::CPU, DType::F64, "test/first"), nullptr);
}

TEST(OpCheckHarness, CatchesWrongValues) {
  Runtime rt([](KernelRegistry& r) {
    r.add(KernelDef{OpId::silu, DeviceType::CPU, DType::F32, "test/wrong_silu", [](const OpCall&) { return Support::yes(); },
                    [](const OpCall& c, ExecContext&) {
                      const float* x = c.inputs[0].data<float>();
                      float* y = c.outputs[0].data<float>();
                      for (int64_t i = 0; i < c.outputs[0].numel(); ++i) y[i] = x[i] / (1.0f + std::exp(-1.01f * x[i]));
                    }});
  });
  EXPECT_TRUE(any_failed(run_op_check(rt, only("silu", DType::F32)), "output 0: nmse"));
}

TEST(OpCheckHarness, CatchesWritePastTheEnd) {
  Runtime rt([](KernelRegistry& r) {
    r.add(KernelDef{OpId::scale, DeviceType::CPU, DType::F32, "test/overflowing_scale", [](const OpCall&) { return Support::yes(); },
                    [](const OpCall& c, ExecContext&) {
                      const float* x = c.inputs[0].data<float>();
                      float* y = c.outputs[0].data<float>();
                      const double a = c.attr<ScaleAttrs>().alpha;
                      for (int64_t i = 0; i < c.outputs[0].numel(); ++i) y[i] = float(a * x[i]);
                      y[c.outputs[0].numel()] = 0.0f;  // one element too far
                    }});
  });
  EXPECT_TRUE(any_failed(run_op_check(rt, only("scale", DType::F32)), "write past the output"));
}

TEST(OpCheckHarness, CatchesMissingWrite) {
  Runtime rt([](KernelRegistry& r) {
    r.add(KernelDef{OpId::add, DeviceType::CPU, DType::F32, "test/short_add", [](const OpCall&) { return Support::yes(); },
                    [](const OpCall& c, ExecContext& ctx) {
                      // Correct except the last element, which is never written.
                      const int64_t n = c.outputs[0].numel();
                      const Tensor a = contiguous(ctx, c.inputs[0].expand(c.outputs[0].shape()));
                      const Tensor b = contiguous(ctx, c.inputs[1].expand(c.outputs[0].shape()));
                      for (int64_t i = 0; i + 1 < n; ++i)
                        c.outputs[0].data<float>()[i] = a.data<float>()[i] + b.data<float>()[i];
                    }});
  });
  EXPECT_TRUE(any_failed(run_op_check(rt, only("add", DType::F32)), "non-finite values"));
}

TEST(OpCheckHarness, CatchesWrongGradientByFiniteDifferences) {
  // A silu_backward that is off by 1%: the f64 CPU reference path uses it, so only finite differences
  // can notice.
  Runtime rt([](KernelRegistry& r) {
    r.add(KernelDef{OpId::silu_backward, DeviceType::CPU, DType::F64, "test/wrong_silu_backward",
                    [](const OpCall&) { return Support::yes(); },
                    [](const OpCall& c, ExecContext&) {
                      const double* x = c.inputs[0].data<double>();
                      const double* dy = c.inputs[1].data<double>();
                      double* dx = c.outputs[0].data<double>();
                      for (int64_t i = 0; i < c.outputs[0].numel(); ++i) {
                        const double s = 1.0 / (1.0 + std::exp(-x[i]));
                        dx[i] = 1.01 * dy[i] * s * (1.0 + x[i] * (1.0 - s));
                      }
                    }});
  });
  EXPECT_TRUE(any_failed(run_op_check(rt, only("silu", DType::F64)), "finite differences"));
}

TEST(OpCheckHarness, CoverageFailsForAKernelWithoutACase) {
  Runtime rt([](KernelRegistry& r) {
    r.add(KernelDef{OpId::silu, DeviceType::CPU, DType::I64, "test/unreachable", [](const OpCall&) { return Support::yes(); },
                    [](const OpCall&, ExecContext&) {}});
  });
  OpCheckOptions o;
  o.devices = {Device::cpu()};
  o.finite_differences = false;
  bool found = false;
  for (const OpCheckResult& r : run_op_check(rt, o))
    found |= r.status == OpCheckResult::Status::Fail && r.kernel == "test/unreachable";
  EXPECT_TRUE(found);
}
