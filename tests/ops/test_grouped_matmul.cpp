// The grouped GEMMs of mixture-of-experts layers beyond what the op check sees, on every device present (CPU always,
// CUDA where a GPU exists): a small case worked by hand (both trans_w values and the weight grad), agreement with one
// linear / matmul per group, weights that are strided views (the gate and up halves of a fused gate_up_proj, narrowed
// on dim 1) read in place, weight grads written with the _into form into such views without touching the rest,
// accumulation into an existing output (empty groups left alone), identical bytes on a second run, and the errors for
// bad offsets, shapes and outputs. Values and gradients against
// the f64 reference in every dtype: the op cases in src/testing/op_cases_moe.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

#include "backend/runtime.h"
#include "ops/ops.h"
#include "support/error_of.h"

using namespace lathe;
using lathe::test_support::error_of;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

Tensor make(const std::vector<double>& values, const Shape& shape, DType dtype, Device device) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) store_from_double(bytes.data(), dtype, int64_t(i), values[i]);
  return runtime().from_host(bytes.data(), shape, dtype, device);
}

// Values of t in logical order (any strides).
std::vector<double> values(const Tensor& t) {
  ExecContext ctx = runtime().context(t.device());
  const Tensor h = runtime().copy_to(contiguous(ctx, t), Device::cpu());
  std::vector<double> v(size_t(h.numel()));
  for (int64_t i = 0; i < h.numel(); ++i) v[size_t(i)] = load_as_double(h.data_ptr(), h.dtype(), i);
  return v;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor h = runtime().copy_to(t, Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.nbytes());
}

std::vector<double> random_values(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = d(rng);
  return v;
}

std::vector<Device> devices() {
  std::vector<Device> d = {Device::cpu()};
  if (runtime().has_device(Device::cuda(0))) d.push_back(Device::cuda(0));
  return d;
}

// The dtypes with a kernel (or the upcast composite) on `device`: CUDA has no f64 grouped GEMM.
std::vector<DType> dtypes(Device device) {
  if (device.is_cpu()) return {DType::F64, DType::F32, DType::BF16};
  return {DType::F32, DType::BF16, DType::F16};
}

// Tolerance of a result in `dtype` relative to the largest reference magnitude.
double tolerance(DType dtype) { return dtype == DType::F64 ? 1e-12 : dtype == DType::F32 ? 1e-5 : 1e-2; }

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, DType dtype,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1e-30;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tolerance(dtype) * scale) << what << " element " << i;
}

std::string where(Device device, DType dtype) { return device.str() + " " + std::string(dtype_name(dtype)); }

}  // namespace

// x (3, 2) in two groups: row 0 (expert 0, the identity) and rows 1-2 (expert 1).
TEST(GroupedMatmul, HandWorked) {
  const std::vector<double> x = {1, 2, 3, 4, 5, 6};
  const std::vector<double> w = {1, 0, 0, 1,    // w[0] = I
                                 1, 1, 2, -1};  // w[1] = [[1, 1], [2, -1]]
  const std::vector<double> dy = {1, 0, 0, 1, 1, 1};
  const GroupedMatmulAttrs trans{{0, 1, 3}, true}, plain{{0, 1, 3}, false};
  for (Device device : devices()) {
    for (DType dt : dtypes(device)) {
      ExecContext ctx = runtime().context(device);
      const Tensor xt = make(x, {3, 2}, dt, device), wt = make(w, {2, 2, 2}, dt, device);
      // trans_w: row 0 -> [1, 2]; rows [3, 4], [5, 6] -> [x . (1, 1), x . (2, -1)] = [7, 2], [11, 4].
      EXPECT_EQ(values(grouped_matmul(ctx, xt, wt, trans)), (std::vector<double>{1, 2, 7, 2, 11, 4})) << where(device, dt);
      // !trans_w: [3, 4] [[1, 1], [2, -1]] = [11, -1]; [5, 6] -> [17, -1].
      EXPECT_EQ(values(grouped_matmul(ctx, xt, wt, plain)), (std::vector<double>{1, 2, 11, -1, 17, -1}))
          << where(device, dt);
      // dw[0] = [1, 0]^T [1, 2]; dw[1] = [0, 1]^T [3, 4] + [1, 1]^T [5, 6] = [[5, 6], [8, 10]].
      EXPECT_EQ(values(grouped_matmul_weight_grad(ctx, make(dy, {3, 2}, dt, device), xt, trans)),
                (std::vector<double>{1, 2, 0, 0, 5, 6, 8, 10}))
          << where(device, dt);
    }
  }
}

TEST(GroupedMatmul, EmptyGroupsAndNoRows) {
  for (Device device : devices()) {
    ExecContext ctx = runtime().context(device);
    // P = 0: y is (0, N); every block of the weight grad is zero.
    const Tensor x0 = make({}, {0, 3}, DType::F32, device), dy0 = make({}, {0, 2}, DType::F32, device);
    const Tensor w = make(std::vector<double>(12, 0.5), {2, 2, 3}, DType::F32, device);
    const GroupedMatmulAttrs none{{0, 0, 0}, true};
    EXPECT_EQ(grouped_matmul(ctx, x0, w, none).shape(), (Shape{0, 2}));
    EXPECT_EQ(values(grouped_matmul_weight_grad(ctx, dy0, x0, none)), std::vector<double>(12, 0.0));
    // Expert 1 of 3 empty: its block is zero, the others are the outer products of their one row.
    const Tensor x = make({1, 2, 3, 4, 5, 6}, {2, 3}, DType::F32, device), dy = make({1, -1, 2, 0}, {2, 2}, DType::F32, device);
    EXPECT_EQ(values(grouped_matmul_weight_grad(ctx, dy, x, {{0, 1, 1, 2}, true})),
              (std::vector<double>{1, 2, 3, -1, -2, -3, 0, 0, 0, 0, 0, 0, 8, 10, 12, 0, 0, 0}))
        << device.str();
  }
}

// Against one linear (trans_w), matmul (!trans_w) or transposed matmul (weight grad) per group.
TEST(GroupedMatmul, MatchesOneMatmulPerGroup) {
  const std::vector<int64_t> offsets = {0, 5, 5, 6, 19, 19, 24};  // groups 5, 0, 1, 13, 0, 5
  const int64_t p = 24, e = 6, k = 16, n = 24;
  std::mt19937 rng(11);
  const std::vector<double> xv = random_values(p * k, rng), wv = random_values(e * n * k, rng), dyv = random_values(p * n, rng);
  for (Device device : devices()) {
    for (DType dt : dtypes(device)) {
      ExecContext ctx = runtime().context(device);
      const Tensor x = make(xv, {p, k}, dt, device), dy = make(dyv, {p, n}, dt, device);
      for (bool trans_w : {true, false}) {
        const Tensor w = make(wv, trans_w ? Shape{e, n, k} : Shape{e, k, n}, dt, device);
        const std::vector<double> got = values(grouped_matmul(ctx, x, w, {offsets, trans_w}));
        std::vector<double> want;
        for (int64_t g = 0; g < e; ++g) {
          const int64_t rows = offsets[size_t(g) + 1] - offsets[size_t(g)];
          if (rows == 0) continue;
          const Tensor xe = x.narrow(0, offsets[size_t(g)], rows);
          const Tensor we = w.narrow(0, g, 1).view(trans_w ? Shape{n, k} : Shape{k, n});
          const std::vector<double> ye = values(trans_w ? linear(ctx, xe, we) : matmul(ctx, xe, we));
          want.insert(want.end(), ye.begin(), ye.end());
        }
        expect_near_all(got, want, dt, where(device, dt) + (trans_w ? " trans_w" : " !trans_w"));
      }
      const std::vector<double> dw = values(grouped_matmul_weight_grad(ctx, dy, x, {offsets, true}));
      std::vector<double> want;
      for (int64_t g = 0; g < e; ++g) {
        const int64_t rows = offsets[size_t(g) + 1] - offsets[size_t(g)];
        if (rows == 0) {
          want.insert(want.end(), size_t(n * k), 0.0);
          continue;
        }
        const Tensor dye = dy.narrow(0, offsets[size_t(g)], rows), xe = x.narrow(0, offsets[size_t(g)], rows);
        const std::vector<double> b = values(matmul(ctx, dye, xe, {true, false}));
        want.insert(want.end(), b.begin(), b.end());
      }
      expect_near_all(dw, want, dt, where(device, dt) + " weight grad");
    }
  }
}

// The gate and up halves of a fused gate_up_proj (E, 2I, H), narrowed on dim 1, read in place; a (E, 2K, N) weight
// narrowed the same way for !trans_w; a transposed view (no contiguous blocks) is copied first and gives the same.
TEST(GroupedMatmul, StridedWeightViews) {
  const std::vector<int64_t> offsets = {0, 3, 3, 12, 13};
  const int64_t p = 13, e = 4, h = 16, i = 8;
  std::mt19937 rng(5);
  const std::vector<double> xv = random_values(p * h, rng), fused_v = random_values(e * 2 * i * h, rng);
  for (Device device : devices()) {
    for (DType dt : dtypes(device)) {
      ExecContext ctx = runtime().context(device);
      const Tensor x = make(xv, {p, h}, dt, device);
      const Tensor fused = make(fused_v, {e, 2 * i, h}, dt, device);
      for (int64_t half : {0, 1}) {
        const Tensor view = fused.narrow(1, half * i, i);  // (E, I, H), blocks 2 I H apart
        ASSERT_TRUE(expert_blocks_contiguous(view) && !view.is_contiguous());
        const std::vector<double> want = values(grouped_matmul(ctx, x, contiguous(ctx, view), {offsets, true}));
        expect_near_all(values(grouped_matmul(ctx, x, view, {offsets, true})), want, dt,
                        where(device, dt) + " gate/up half " + std::to_string(half));
      }
      // !trans_w: w (E, K = H, N = I) as a narrow of (E, 2H, I) on dim 1; x here is (P, H) = (P, K).
      const Tensor tall = make(fused_v, {e, 2 * h, i}, dt, device);
      const Tensor lower = tall.narrow(1, h, h);
      expect_near_all(values(grouped_matmul(ctx, x, lower, {offsets, false})),
                      values(grouped_matmul(ctx, x, contiguous(ctx, lower), {offsets, false})), dt,
                      where(device, dt) + " !trans_w view");
      // A transposed (E, I, H) view of an (E, H, I) tensor: not block-contiguous, copied by the op function.
      const Tensor wide = make(fused_v, {e, h, i}, dt, device);
      const Tensor transposed = wide.transpose(1, 2);
      ASSERT_FALSE(expert_blocks_contiguous(transposed));
      expect_near_all(values(grouped_matmul(ctx, x, transposed, {offsets, true})),
                      values(grouped_matmul(ctx, x, wide, {offsets, false})), dt, where(device, dt) + " transposed");
    }
  }
}

// The weight grad written into the middle third of an (E, 3N, K) buffer: every block (an empty group's zeros too)
// lands in place, and the other two thirds keep their sentinel values.
TEST(GroupedMatmul, WeightGradIntoStridedView) {
  const std::vector<int64_t> offsets = {0, 4, 4, 9, 10};
  const int64_t p = 10, e = 4, n = 8, k = 16;
  std::mt19937 rng(3);
  const std::vector<double> dyv = random_values(p * n, rng), xv = random_values(p * k, rng);
  for (Device device : devices()) {
    for (DType dt : dtypes(device)) {
      ExecContext ctx = runtime().context(device);
      const Tensor dy = make(dyv, {p, n}, dt, device), x = make(xv, {p, k}, dt, device);
      const Tensor buffer = make(std::vector<double>(size_t(e * 3 * n * k), 7.0), {e, 3 * n, k}, dt, device);
      const Tensor middle = buffer.narrow(1, n, n);
      grouped_matmul_weight_grad_into(ctx, dy, x, middle, {offsets, true});
      const std::vector<double> dense = values(grouped_matmul_weight_grad(ctx, dy, x, {offsets, true}));
      expect_near_all(values(middle), dense, dt, where(device, dt) + " middle third");
      for (int64_t third : {0, 2})
        EXPECT_EQ(values(buffer.narrow(1, third * n, n)), std::vector<double>(size_t(e * n * k), 7.0))
            << where(device, dt) << " third " << third << " was written";
      // Expert 1 is empty: its block is zero.
      EXPECT_EQ(values(middle.narrow(0, 1, 1)), std::vector<double>(size_t(n * k), 0.0)) << where(device, dt);
      // A contiguous output through the same function.
      const Tensor out = make(std::vector<double>(size_t(e * n * k), 7.0), {e, n, k}, dt, device);
      grouped_matmul_weight_grad_into(ctx, dy, x, out, {offsets, true});
      expect_near_all(values(out), dense, dt, where(device, dt) + " contiguous output");
    }
  }
}

// Accumulating (GroupedMatmulAttrs::accumulate, what a model's expert gradients do over micro-batches): the output's
// values plus the fresh weight grad, an empty group's block left as it was, into a contiguous output and into the
// middle third of a fused buffer (CPU bf16 through the composite's fresh copy and an add).
TEST(GroupedMatmul, WeightGradIntoAccumulates) {
  const std::vector<int64_t> offsets = {0, 4, 4, 9, 10};
  const int64_t p = 10, e = 4, n = 8, k = 16;
  std::mt19937 rng(5);
  const std::vector<double> dyv = random_values(p * n, rng), xv = random_values(p * k, rng);
  const std::vector<double> before = random_values(e * n * k, rng);
  for (Device device : devices()) {
    for (DType dt : dtypes(device)) {
      ExecContext ctx = runtime().context(device);
      const Tensor dy = make(dyv, {p, n}, dt, device), x = make(xv, {p, k}, dt, device);
      const std::vector<double> start = values(make(before, {e, n, k}, dt, device));  // (rounded to dt)
      const std::vector<double> fresh = values(grouped_matmul_weight_grad(ctx, dy, x, {offsets, true}));
      std::vector<double> want(start.size());
      for (size_t i = 0; i < want.size(); ++i) want[i] = start[i] + fresh[i];
      GroupedMatmulAttrs add{offsets, true};
      add.accumulate = true;
      const Tensor out = make(before, {e, n, k}, dt, device);
      grouped_matmul_weight_grad_into(ctx, dy, x, out, add);
      expect_near_all(values(out), want, dt, where(device, dt) + " contiguous");
      const std::vector<double> empty(start.begin() + n * k, start.begin() + 2 * n * k);
      EXPECT_EQ(values(out.narrow(0, 1, 1)), empty) << where(device, dt) << ": the empty group's block changed";
      std::vector<double> fused(size_t(e * 3 * n * k), 7.0);
      for (int64_t b = 0; b < e; ++b)
        std::copy_n(before.begin() + b * n * k, n * k, fused.begin() + b * 3 * n * k + n * k);
      const Tensor buffer = make(fused, {e, 3 * n, k}, dt, device);
      grouped_matmul_weight_grad_into(ctx, dy, x, buffer.narrow(1, n, n), add);
      expect_near_all(values(buffer.narrow(1, n, n)), want, dt, where(device, dt) + " middle third");
      EXPECT_EQ(values(buffer.narrow(1, 0, n)), std::vector<double>(size_t(e * n * k), 7.0)) << where(device, dt);
    }
  }
  EXPECT_NE(error_of([] {
              ExecContext ctx = runtime().context(Device::cpu());
              GroupedMatmulAttrs add{{0, 1}, true};
              add.accumulate = true;
              grouped_matmul_weight_grad(ctx, make({1}, {1, 1}, DType::F32, Device::cpu()),
                                         make({1}, {1, 1}, DType::F32, Device::cpu()), add);
            }).find("accumulates only into an output"),
            std::string::npos);
}

// The Hopper kernel (cuda/hopper_grouped_gemm, sm_90 only) against plain loops in f64 over the same bf16 inputs:
// groups at and around its 128-row tile and 64-row stage edges (1, 63, 64, 65, 127, 128, 129 rows), a 700-row group,
// an empty one; w read in place as one half of a fused (E, 2N, K) weight (trans_w) and as (E, K, N); the weight grad
// into the middle third of a fused buffer, fresh and accumulated; a second forward and weight grad give the same bytes.
// Each call must resolve to the Hopper kernel.
TEST(GroupedMatmul, HopperKernelMatchesPlainLoops) {
  if (!runtime().has_device(Device::cuda(0))) GTEST_SKIP() << "no CUDA device";
  const Device gpu = Device::cuda(0);
  ExecContext ctx = runtime().context(gpu);
  if (!ctx.registry.find(OpId::grouped_matmul, DeviceType::CUDA, DType::BF16, "cuda/hopper_grouped_gemm"))
    GTEST_SKIP() << "cuda/hopper_grouped_gemm is registered on sm_90 only";
  const std::vector<int64_t> counts = {700, 0, 1, 63, 64, 65, 127, 128, 129, 323};
  std::vector<int64_t> offsets = {0};
  for (int64_t n : counts) offsets.push_back(offsets.back() + n);
  const int64_t p = offsets.back(), e = int64_t(counts.size()), k = 256, n = 512;
  std::mt19937 rng(11);
  // The inputs as bf16 holds them (the loops start from the same values).
  const auto rounded = [&](int64_t count) {
    return values(make(random_values(count, rng), {count}, DType::BF16, gpu));
  };
  const std::vector<double> xv = rounded(p * k), fused = rounded(e * 2 * n * k), dyv = rounded(p * n);
  const std::vector<double> before = rounded(e * 3 * n * k);
  const auto w_at = [&](int64_t ex, int64_t row, int64_t col) {  // the upper half's (row, col) of expert ex
    return fused[size_t((ex * 2 * n + n + row) * k + col)];
  };
  std::vector<std::string> kernels;
  const ResolutionObserver observer = [&](const OpCall&, const Resolution& r) { kernels.push_back(r.name); };
  ctx.observer = &observer;

  // y = x w_e^T with w the upper half of (E, 2N, K): blocks 2 N K apart.
  const Tensor w_fused = make(fused, {e, 2 * n, k}, DType::BF16, gpu);
  const Tensor x = make(xv, {p, k}, DType::BF16, gpu), dy = make(dyv, {p, n}, DType::BF16, gpu);
  // out[r][o] = sum_i in[r][i] weight(expert of r, o, i): the forward's products as plain loops.
  const auto loops = [&](const std::vector<double>& in, int64_t in_width, int64_t out_width, const auto& weight) {
    std::vector<double> out(size_t(p * out_width), 0.0);
    for (int64_t ex = 0; ex < e; ++ex)
      for (int64_t r = offsets[size_t(ex)]; r < offsets[size_t(ex) + 1]; ++r)
        for (int64_t o = 0; o < out_width; ++o) {
          double acc = 0;
          for (int64_t i = 0; i < in_width; ++i) acc += in[size_t(r * in_width + i)] * weight(ex, o, i);
          out[size_t(r * out_width + o)] = acc;
        }
    return out;
  };
  const std::vector<double> want = loops(xv, k, n, w_at);
  const Tensor y = grouped_matmul(ctx, x, w_fused.narrow(1, n, n), {offsets, true});
  expect_near_all(values(y), want, DType::BF16, "forward, trans_w");
  EXPECT_EQ(bytes_of(grouped_matmul(ctx, x, w_fused.narrow(1, n, n), {offsets, true})), bytes_of(y))
      << "a second forward differs";

  // dx = dy w_e with w (E, K', N') = the same half viewed as (E, N, K): here the product's K' = N, N' = K.
  const std::vector<double> want_dx =
      loops(dyv, n, k, [&](int64_t ex, int64_t i, int64_t j) { return w_at(ex, j, i); });
  expect_near_all(values(grouped_matmul(ctx, dy, w_fused.narrow(1, n, n), {offsets, false})), want_dx, DType::BF16,
                  "forward, !trans_w");

  // dw_e = dy_e^T x_e into the middle third of (E, 3N, K), fresh (the empty group's block zeroed), then accumulated.
  std::vector<double> grad(size_t(e * n * k), 0.0);
  for (int64_t ex = 0; ex < e; ++ex)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < k; ++i) {
        double acc = 0;
        for (int64_t r = offsets[size_t(ex)]; r < offsets[size_t(ex) + 1]; ++r)
          acc += dyv[size_t(r * n + j)] * xv[size_t(r * k + i)];
        grad[size_t((ex * n + j) * k + i)] = acc;
      }
  const Tensor buffer = make(before, {e, 3 * n, k}, DType::BF16, gpu);
  const Tensor middle = buffer.narrow(1, n, n);
  grouped_matmul_weight_grad_into(ctx, dy, x, middle, {offsets, true});
  expect_near_all(values(middle), grad, DType::BF16, "weight grad");
  const std::vector<double> fresh = values(middle);
  const std::vector<uint8_t> fresh_bytes = bytes_of(buffer);
  grouped_matmul_weight_grad_into(ctx, dy, x, middle, {offsets, true});
  EXPECT_EQ(bytes_of(buffer), fresh_bytes) << "a second weight grad differs";
  GroupedMatmulAttrs add{offsets, true};
  add.accumulate = true;
  grouped_matmul_weight_grad_into(ctx, dy, x, middle, add);
  std::vector<double> twice(grad.size());
  for (size_t i = 0; i < grad.size(); ++i) twice[i] = fresh[i] + grad[i];
  expect_near_all(values(middle), twice, DType::BF16, "weight grad, accumulated");
  for (int64_t third : {0, 2}) {
    std::vector<double> kept;
    for (int64_t ex = 0; ex < e; ++ex)
      kept.insert(kept.end(), before.begin() + (ex * 3 + third) * n * k, before.begin() + (ex * 3 + third + 1) * n * k);
    EXPECT_EQ(values(buffer.narrow(1, third * n, n)), kept) << "third " << third << " was written";
  }
  ctx.observer = nullptr;
  for (const std::string& name : kernels)
    if (name.find("grouped") != std::string::npos) EXPECT_EQ(name, "cuda/hopper_grouped_gemm");
  EXPECT_EQ(std::count(kernels.begin(), kernels.end(), std::string("cuda/hopper_grouped_gemm")), 6);
}

// The routed ops (groups read on the device, moe_route's offsets with the non-finite flag last) against the ops with
// host groups, a training step's (not few_rows), wherever a kernel of the exact dtype takes them (try_* returns false,
// computing nothing, elsewhere): the same bytes, as the same kernel computes both (the CPU's f32 and f64; on sm_90 in
// bf16 the Hopper kernel, its tile schedule built on the device). The forward from a narrowed fused weight and
// !trans_w, the weight grad into a narrowed view fresh (an empty group's block zeroed) and accumulated.
TEST(GroupedMatmul, GroupsOnTheDeviceGiveTheBytesOfHostGroups) {
  const std::vector<int64_t> counts = {700, 0, 1, 63, 64, 65, 127, 128, 129, 323};
  std::vector<int64_t> offsets = {0};
  for (int64_t n : counts) offsets.push_back(offsets.back() + n);
  std::vector<double> flagged(offsets.begin(), offsets.end());
  flagged.push_back(-1.0);
  const int64_t p = offsets.back(), e = int64_t(counts.size()), k = 256, n = 256;
  std::mt19937 rng(12);
  const std::vector<double> xv = random_values(p * k, rng), fused = random_values(e * 2 * n * k, rng),
                            dyv = random_values(p * n, rng), before = random_values(e * 3 * n * k, rng);
  int64_t compared = 0;
  for (Device device : devices()) {
    for (DType dt : dtypes(device)) {
      ExecContext ctx = runtime().context(device);
      std::vector<std::string> kernels;
      const ResolutionObserver observer = [&](const OpCall& c, const Resolution& r) {
        if (c.op == OpId::grouped_matmul_routed || c.op == OpId::grouped_matmul_weight_grad_routed)
          kernels.push_back(r.name);
      };
      ctx.observer = &observer;
      const Tensor off = make(flagged, {e + 2}, DType::I32, device);
      const Tensor x = make(xv, {p, k}, dt, device), dy = make(dyv, {p, n}, dt, device);
      const Tensor w = make(fused, {e, 2 * n, k}, dt, device).narrow(1, n, n);
      for (bool trans_w : {true, false}) {
        Tensor y;
        if (!try_grouped_matmul_routed(ctx, x, w, off, trans_w, false, y)) continue;
        EXPECT_EQ(bytes_of(y), bytes_of(grouped_matmul(ctx, x, w, {offsets, trans_w})))
            << where(device, dt) << ", trans_w " << trans_w;
        ++compared;
      }
      const Tensor host = make(before, {e, 3 * n, k}, dt, device), routed = make(before, {e, 3 * n, k}, dt, device);
      for (bool accumulate : {false, true}) {
        if (!try_grouped_matmul_weight_grad_routed_into(ctx, dy, x, off, routed.narrow(1, n, n), accumulate)) continue;
        GroupedMatmulAttrs g{offsets, true};
        g.accumulate = accumulate;
        grouped_matmul_weight_grad_into(ctx, dy, x, host.narrow(1, n, n), g);
        EXPECT_EQ(bytes_of(routed), bytes_of(host)) << where(device, dt) << ", accumulate " << accumulate;
        ++compared;
      }
      ctx.observer = nullptr;
      if (device.is_cpu() && dt != DType::BF16) EXPECT_EQ(kernels.size(), 4u) << where(device, dt);
      const bool hopper = ctx.registry.find(OpId::grouped_matmul_routed, DeviceType::CUDA, DType::BF16,
                                            "cuda/hopper_grouped_gemm") != nullptr;
      if (device.is_cuda() && dt == DType::BF16 && hopper) {
        EXPECT_EQ(kernels, std::vector<std::string>(4, "cuda/hopper_grouped_gemm"));
        std::printf("[hopper, groups on the device] forward, !trans_w, weight grad fresh and accumulated: the bytes "
                    "of host groups\n");
      }
    }
  }
  EXPECT_GE(compared, 8) << "the CPU's f64 and f32 rows, at least";
}

TEST(GroupedMatmul, SecondRunGivesIdenticalBytes) {
  const std::vector<int64_t> offsets = {0, 40, 41, 41, 100};
  std::mt19937 rng(9);
  const std::vector<double> xv = random_values(100 * 32, rng), wv = random_values(4 * 24 * 32, rng),
                            dyv = random_values(100 * 24, rng);
  for (Device device : devices()) {
    for (DType dt : dtypes(device)) {
      ExecContext ctx = runtime().context(device);
      const Tensor x = make(xv, {100, 32}, dt, device), w = make(wv, {4, 24, 32}, dt, device);
      const Tensor dy = make(dyv, {100, 24}, dt, device);
      EXPECT_EQ(bytes_of(grouped_matmul(ctx, x, w, {offsets, true})), bytes_of(grouped_matmul(ctx, x, w, {offsets, true})))
          << where(device, dt);
      EXPECT_EQ(bytes_of(grouped_matmul_weight_grad(ctx, dy, x, {offsets, true})),
                bytes_of(grouped_matmul_weight_grad(ctx, dy, x, {offsets, true})))
          << where(device, dt);
    }
  }
}

TEST(GroupedMatmul, ErrorsNameTheOpAndTheProblem) {
  ExecContext ctx = runtime().context(Device::cpu());
  const Device cpu = Device::cpu();
  const Tensor x = make(std::vector<double>(15, 1.0), {5, 3}, DType::F32, cpu);
  const Tensor w = make(std::vector<double>(12, 1.0), {2, 2, 3}, DType::F32, cpu);  // (E = 2, N = 2, K = 3)
  const Tensor dy = make(std::vector<double>(10, 1.0), {5, 2}, DType::F32, cpu);
  const auto forward = [&](std::vector<int64_t> offsets) {
    return error_of([&] { grouped_matmul(ctx, x, w, {std::move(offsets), true}); });
  };
  EXPECT_NE(forward({}).find("grouped_matmul needs E + 1 group offsets (offsets is empty)"), std::string::npos);
  EXPECT_NE(forward({1, 3, 5}).find("grouped_matmul group offsets must start at 0, got offsets[0] = 1"), std::string::npos);
  EXPECT_NE(forward({0, 4, 3}).find("must be non-decreasing: offsets[1] = 4 > offsets[2] = 3"), std::string::npos);
  EXPECT_NE(forward({0, 2, 4}).find("group offsets end at 4, but f32[5, 3]"), std::string::npos) << forward({0, 2, 4});
  EXPECT_NE(forward({0, 5}).find("grouped_matmul has 2 group offsets for a weight of 2 experts (needs E + 1 = 3)"),
            std::string::npos);
  // Shapes and dtypes.
  EXPECT_NE(error_of([&] { grouped_matmul(ctx, x, w, {{0, 2, 5}, false}); }).find("grouped_matmul inner dimensions differ"),
            std::string::npos);
  EXPECT_NE(error_of([&] { grouped_matmul(ctx, x, cast(ctx, w, DType::F64), {{0, 2, 5}, true}); })
                .find("grouped_matmul needs inputs of one dtype"),
            std::string::npos);
  EXPECT_NE(error_of([&] { grouped_matmul(ctx, x, w.narrow(0, 0, 1).view({2, 3}), {{0, 5}, true}); })
                .find("grouped_matmul needs w (E, N, K) (3-D)"),
            std::string::npos);
  // The weight grad: rows, offsets, the _into output.
  EXPECT_NE(error_of([&] { grouped_matmul_weight_grad(ctx, dy.narrow(0, 0, 4), x, {{0, 5}, true}); })
                .find("grouped_matmul_weight_grad needs dy (P, N) and x (P, K) with the same rows"),
            std::string::npos);
  EXPECT_NE(error_of([&] { grouped_matmul_weight_grad(ctx, dy, x, {{0, 6}, true}); })
                .find("grouped_matmul_weight_grad group offsets end at 6"),
            std::string::npos);
  const Tensor wrong = make(std::vector<double>(18, 0.0), {3, 2, 3}, DType::F32, cpu);
  EXPECT_NE(error_of([&] { grouped_matmul_weight_grad_into(ctx, dy, x, wrong, {{0, 2, 5}, true}); })
                .find("grouped_matmul_weight_grad_into needs a f32[2, 2, 3] output on cpu"),
            std::string::npos);
  const Tensor holder = make(std::vector<double>(12, 0.0), {2, 3, 2}, DType::F32, cpu);
  EXPECT_NE(error_of([&] { grouped_matmul_weight_grad_into(ctx, dy, x, holder.transpose(1, 2), {{0, 2, 5}, true}); })
                .find("whose expert blocks are contiguous"),
            std::string::npos);
}
