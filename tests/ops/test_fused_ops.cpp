// The fused residual norm against the ops it fuses: residual_rmsnorm(x, r, w) is, bitwise, add(x, r) followed by
// rmsnorm, on the CPU (f32, f64) and on CUDA (f32, bf16, f16) where a GPU exists. The CPU's bf16/f16 rows go through
// upcast_f32, which keeps h in f32 between the two steps, so they are the op check's business (tolerance), not this
// test's. Values against the f64 reference and the backward: the residual_rmsnorm op-check cases.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "backend/runtime.h"
#include "ops/ops.h"

using namespace lathe;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

Tensor random_tensor(std::mt19937_64& rng, const Shape& shape, DType dtype, Device device) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (float& x : v) x = dist(rng);
  ExecContext ctx = runtime().context(device);
  return cast(ctx, runtime().from_host(v.data(), shape, DType::F32, device), dtype);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ha = runtime().copy_to(a, Device::cpu()), hb = runtime().copy_to(b, Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) == 0;
}

}  // namespace

TEST(ResidualRmsnorm, IsTheAddThenTheNormBitwise) {
  std::vector<std::pair<Device, DType>> rows = {{Device::cpu(), DType::F32}, {Device::cpu(), DType::F64}};
  if (runtime().has_device(Device::cuda(0)))
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) rows.push_back({Device::cuda(0), dt});
  // Row widths of the CUDA kernel's shapes: lane groups of 16 (128 in bf16), one warp with a second pass over the row
  // (1030: single elements), two and four warps (2048, 2560 in bf16).
  for (const auto& [device, dtype] : rows)
    for (int64_t h : {int64_t(128), int64_t(1030), int64_t(2048), int64_t(2560)}) {
      std::mt19937_64 rng{uint64_t(h)};
      ExecContext ctx = runtime().context(device);
      const Tensor x = random_tensor(rng, {37, h}, dtype, device), r = random_tensor(rng, {37, h}, dtype, device);
      const Tensor w = random_tensor(rng, {h}, dtype, device);
      const NormAttrs attrs{1e-6, 1.0};
      const std::vector<Tensor> fused = residual_rmsnorm(ctx, x, r, w, attrs);
      const Tensor h_sum = add(ctx, x, r);
      const std::string where = device.str() + " " + std::string(dtype_name(dtype)) + " h=" + std::to_string(h);
      EXPECT_TRUE(same_bits(fused[1], h_sum)) << where << ": h";
      EXPECT_TRUE(same_bits(fused[0], rmsnorm(ctx, h_sum, w, attrs))) << where << ": y";
    }
}
