// The conv's fused SiLU (ConvAttrs::silu) against the unfused composition it replaces in the Qwen3.5 layer:
// causal_conv1d(silu) = silu(causal_conv1d) and causal_conv1d_backward(silu; dy) =
// causal_conv1d_backward(silu_backward(conv(x), dy)), over packed documents (one shorter than the width, one of a single
// token). The composition is built from independent ops (the linear conv, silu, silu_backward). CPU in f64 and f32
// (rounding-level agreement); CUDA, where present, in f32 (rounding level) and bf16 (where the composition rounds the
// pre-activation to bf16 and the fused kernels do not: a bf16-level bound), and the fused backward twice, bitwise equal.
// The op cases (testing/op_cases_gated_delta.cpp) check the fused kernels against the f64 CPU kernels and finite
// differences.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/runtime.h"
#include "ops/ops.h"

using namespace lathe;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

std::vector<double> values_of(const Tensor& t) {
  ExecContext cpu = runtime().context(Device::cpu());
  const Tensor h = runtime().copy_to(t, Device::cpu());
  const Tensor d = h.dtype() == DType::F64 ? h : cast(cpu, h, DType::F64);
  const double* p = d.data<double>();
  return std::vector<double>(p, p + d.numel());
}

// Normalised squared error of `got` against `want`.
double nmse(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = values_of(got), w = values_of(want);
  EXPECT_EQ(g.size(), w.size());
  double err = 0, norm = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    err += (g[i] - w[i]) * (g[i] - w[i]);
    norm += w[i] * w[i];
  }
  EXPECT_GT(norm, 0.0);
  return err / norm;
}

// Fused against unfused on `device` in `dt`; every nmse must be <= `bound`.
void check_fused(Device device, DType dt, int64_t channels, int64_t width, std::vector<int32_t> cu, double bound) {
  ExecContext ctx = runtime().context(device);
  ExecContext cpu = runtime().context(Device::cpu());
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  const int64_t t = cu.back();
  const auto random = [&](const Shape& s) {  // drawn in f64, rounded to dt on the CPU, then moved to the device
    std::vector<double> v(size_t(shape_numel(s)));
    for (double& x : v) x = u(rng);
    return runtime().copy_to(cast(cpu, runtime().from_host(v.data(), s, DType::F64, Device::cpu()), dt), device);
  };
  const Tensor x = random({t, channels});
  const Tensor w = random({channels, width});
  const Tensor dy = random({t, channels});
  const Tensor cu_t = runtime().from_host(cu.data(), {int64_t(cu.size())}, DType::I32, device);

  const Tensor z = causal_conv1d(ctx, x, w, cu_t);
  const Tensor y_ref = silu(ctx, z);
  const std::vector<Tensor> g_ref = causal_conv1d_backward(ctx, x, w, silu_backward(ctx, z, dy), cu_t);
  const Tensor y = causal_conv1d(ctx, x, w, cu_t, ConvAttrs{true});
  const std::vector<Tensor> g = causal_conv1d_backward(ctx, x, w, dy, cu_t, ConvAttrs{true});
  ASSERT_EQ(g.size(), 2u);
  EXPECT_LE(nmse(y, y_ref), bound) << "y";
  EXPECT_LE(nmse(g[0], g_ref[0]), bound) << "dx";
  EXPECT_LE(nmse(g[1], g_ref[1]), bound) << "dw";
  // The fused activation is not the linear conv: a check that the attribute reached the kernels.
  EXPECT_GT(nmse(y, z), 1e-3);
  if (device.is_cpu()) return;
  const std::vector<Tensor> again = causal_conv1d_backward(ctx, x, w, dy, cu_t, ConvAttrs{true});
  EXPECT_EQ(values_of(again[0]), values_of(g[0])) << "dx differs between two runs";
  EXPECT_EQ(values_of(again[1]), values_of(g[1])) << "dw differs between two runs";
}

}  // namespace

TEST(ConvSilu, CpuMatchesComposition) {
  for (DType dt : {DType::F64, DType::F32}) {
    SCOPED_TRACE(dtype_name(dt));
    const double bound = dt == DType::F64 ? 1e-26 : 1e-12;
    check_fused(Device::cpu(), dt, 6, 4, {0, 2, 9, 10, 23}, bound);
    check_fused(Device::cpu(), dt, 3, 1, {0, 5, 12}, bound);
  }
}

TEST(ConvSilu, CudaMatchesComposition) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  // Compile-time widths 4 and 3, the run-time width 5; a partial channel block; several dw slabs (T > 256) with
  // documents across the slab and dx-slab edges.
  const std::vector<int32_t> cu = {0, 1, 63, 64, 129, 130, 400, 700};
  for (int64_t width : {4, 3, 5}) {
    SCOPED_TRACE(width);
    check_fused(Device::cuda(0), DType::F32, 130, width, cu, 1e-10);
    // bf16: the composition rounds z to bf16 before silu and silu_backward; the fused kernels keep it in fp32.
    check_fused(Device::cuda(0), DType::BF16, 130, width, cu, 1e-4);
  }
}
