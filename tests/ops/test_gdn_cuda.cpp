// Determinism of the CUDA gated_delta_rule backward: the same inputs give bitwise the same dq, dk, dv, dg, dbeta on
// two runs, and a third run from the forward's saved chunk-start states (which skips the backward's own forward scan)
// gives those same bytes, for the chunked tensor-core kernels (bf16, d_k = d_v = 128, GQA group 2, packed documents) and the
// recurrent kernel (f32, small dims), with g and beta in the dtype of q or in f32 (the model's). dq and dk sum the value heads of each key head in a fixed order, without
// atomics. Accuracy is checked by the op cases (tests/ops); skips with the reason when no CUDA device is present.
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

Tensor uniform(ExecContext& ctx, const Shape& s, DType dt, double lo, double hi, std::mt19937& rng) {
  std::vector<float> v(size_t(shape_numel(s)));
  std::uniform_real_distribution<float> d{float(lo), float(hi)};
  for (float& x : v) x = d(rng);
  const Tensor t = runtime().from_host(v.data(), s, DType::F32, Device::cuda(0));
  return cast(ctx, t, dt);
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor h = runtime().copy_to(t, Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.numel() * int64_t(dtype_size(h.dtype())));
}

void check_deterministic(DType dt, DType gate, int64_t hk, int64_t hv, int64_t dk, int64_t dv, std::vector<int32_t> cu) {
  ExecContext ctx = runtime().context(Device::cuda(0));
  std::mt19937 rng(7);
  const int64_t t = cu.back();
  const double kr = dk >= 64 ? 0.15 : 0.35;
  const Tensor q = uniform(ctx, {t, hk, dk}, dt, -kr, kr, rng);
  const Tensor k = uniform(ctx, {t, hk, dk}, dt, -kr, kr, rng);
  const Tensor v = uniform(ctx, {t, hv, dv}, dt, -2, 2, rng);
  const Tensor g = uniform(ctx, {t, hv}, gate, -1.5, -0.001, rng);
  const Tensor beta = uniform(ctx, {t, hv}, gate, 0.001, 1, rng);
  const Tensor d_o = uniform(ctx, {t, hv, dv}, dt, -2, 2, rng);
  const Tensor cu_t = runtime().from_host(cu.data(), {int64_t(cu.size())}, DType::I32, Device::cuda(0));
  GatedDeltaAttrs save;
  save.save_states = true;
  const std::vector<Tensor> fwd = gated_delta_rule(ctx, q, k, v, g, beta, cu_t, save);
  ASSERT_EQ(fwd[1].size(0), t / 64 + int64_t(cu.size()) - 1);
  const bool chunked = dt == DType::BF16 && dk == 128 && dv == 128;
  EXPECT_EQ(fwd[2].size(0), chunked ? t : 0) << "the chunk cache exists exactly where the chunked kernels run";
  std::vector<std::vector<uint8_t>> first;
  for (int run = 0; run < 4; ++run) {  // recomputed, recomputed again, saved states, saved states and chunk cache
    const Tensor states = run >= 2 ? fwd[1] : Tensor();
    const Tensor cache = run == 3 ? fwd[2] : Tensor();
    const std::vector<Tensor> grads = gated_delta_rule_backward(ctx, q, k, v, g, beta, d_o, cu_t, states, {}, cache);
    ASSERT_EQ(grads.size(), 5u);
    for (size_t i = 0; i < grads.size(); ++i) {
      std::vector<uint8_t> b = bytes_of(grads[i]);
      if (run == 0) first.push_back(std::move(b));
      else EXPECT_TRUE(b == first[i]) << "gradient " << i << " of run " << run << " differs from run 0"
                                      << (run == 2 ? " (saved states)" : run == 3 ? " (saved states, chunk cache)" : "");
    }
  }
}

}  // namespace

TEST(GdnCuda, ChunkedBackwardIsDeterministic) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  check_deterministic(DType::BF16, DType::BF16, 2, 4, 128, 128, {0, 1, 64, 128, 193, 393});
  check_deterministic(DType::BF16, DType::F32, 2, 4, 128, 128, {0, 1, 64, 128, 193, 393});  // the model's f32 gates
}

TEST(GdnCuda, RecurrentBackwardIsDeterministic) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  check_deterministic(DType::F32, DType::F32, 1, 3, 8, 6, {0, 5, 5, 80});
  check_deterministic(DType::BF16, DType::F32, 1, 3, 8, 6, {0, 5, 5, 80});
}
