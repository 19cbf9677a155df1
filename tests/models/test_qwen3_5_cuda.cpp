// Qwen3.5 on CUDA: logits, loss and every parameter gradient of the CUDA model in f32 and bf16 against the
// Hugging Face fixtures of tests/models/fixtures/qwen3_5 (f64 goldens, which the CPU f64 model matches within 1e-6,
// see test_qwen3_5.cpp). Exercises the CUDA Gated DeltaNet kernels (conv1d, decay, sigmoid, the gated delta rule)
// inside the model. bf16 bounds are relative to transformers' own bf16 error on the same fixtures (kHfBf16).
// Skips with the reason when no CUDA device is present.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "io/safetensors.h"
#include "model/qwen3_5.h"
#include "ops/ops.h"
#include "support/model_support.h"

using namespace lathe;
using namespace lathe::test_support;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = fs::path(LATHE_TEST_DATA_DIR) / "models" / "fixtures" / "qwen3_5";

// transformers' own bf16 error on each fixture (stock Qwen3_5ForCausalLM in bfloat16 against the same f64 goldens,
// same rel-L2; dev/ref/hf_bf16_error.py, transformers 5.17.0, torch 2.11.0+cu130, torch fallbacks for the
// GDN core (fp32) and the conv, NVIDIA H100 80GB HBM3). These tiny random models amplify bf16 rounding: HF's own
// gradients are off by up to 0.74. multimodal_layout holds hv_gt_hk_untied's weights.
struct HfBf16Error {
  const char* fixture;
  double logits, grad_mean, grad_worst;
};
constexpr HfBf16Error kHfBf16[] = {
    {"hv_gt_hk_untied", 0.0412, 0.180, 0.369},
    {"multimodal_layout", 0.0412, 0.180, 0.369},
    {"interval_legacy_rope", 0.0959, 0.315, 0.738},
    {"tied_hd64", 0.0219, 0.0486, 0.0902},
};

}  // namespace

TEST(Qwen35Cuda, F32AndBf16MatchTransformersFixtures) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  ASSERT_TRUE(fs::exists(kFixtures)) << kFixtures;
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    if (!entry.is_directory()) continue;
    SCOPED_TRACE(entry.path().filename().string());
    const io::SafetensorsFile ref = io::SafetensorsFile::open((entry.path() / "reference.safetensors").string());
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(dtype_name(dtype));
      ModelOptions opt;
      opt.device = Device::cuda(0);
      opt.dtype = dtype;
      Qwen35Model m = Qwen35Model::load(runtime(), (entry.path() / "model").string(), opt);
      const PackedBatch b = make_packed_batch(runtime(), opt.device, read_i32(ref, "input_ids"),
                                              read_i32(ref, "cu_seqlens"), read_i32(ref, "labels"),
                                              m.config().vocab_size);
      const double logit_err = rel_l2(to_f64(m.logits(b)), ref.read_as_f32("logits"));
      const LossResult r = m.loss(b, /*backward=*/true);
      const double want = ref.read_as_f32("loss")[0];
      const auto [mean, worst, worst_name] = grad_errors(m, ref, "grad.");
      std::printf("[qwen3.5 cuda %s vs HF f64] %s: logits rel-l2 %.3g, loss %.6f vs %.6f, grad rel-l2 mean %.3g, worst "
                  "%.3g (%s)\n",
                  std::string(dtype_name(dtype)).c_str(), entry.path().filename().c_str(), logit_err, r.loss, want,
                  mean, worst, worst_name.c_str());
      if (dtype == DType::F32) {
        // fp32 everywhere (the CPU f32 model is within 1e-5 / 5e-5 of the goldens); GPU reductions run in other
        // orders, and cuBLAS may pick other algorithms: 10x the CPU f32 bounds.
        EXPECT_LT(logit_err, 1e-4);
        EXPECT_NEAR(r.loss, want, 1e-4 * std::abs(want));
        EXPECT_LT(worst, 5e-4) << worst_name;
      } else {
        // bf16 weights and activations, g and beta in fp32 (as HF). Bounds relative to HF's own bf16 error on the
        // same fixture (kHfBf16): logits 2x, gradient mean 3x, worst gradient 3.5x; loss within 1% (HF: 0.04% to
        // 0.83%). Measured on an H100 (this commit): logits 0.029 to 0.075 (0.78x to 1.32x HF), loss within 0.63%,
        // gradient mean 0.092 to 0.27 (0.51x to 2.6x), worst 0.16 to 0.66 (0.44x to 3.0x; tied_hd64 is the
        // furthest from HF: mean 0.127 vs 0.049, worst 0.274 vs 0.090).
        const std::string name = entry.path().filename().string();
        const HfBf16Error* hf = nullptr;
        for (const HfBf16Error& e : kHfBf16)
          if (name == e.fixture) hf = &e;
        ASSERT_NE(hf, nullptr) << "no measured HF bf16 error for fixture " << name;
        EXPECT_LT(logit_err, 2.0 * hf->logits);
        EXPECT_NEAR(r.loss, want, 1e-2 * std::abs(want));
        EXPECT_LT(mean, 3.0 * hf->grad_mean);
        EXPECT_LT(worst, 3.5 * hf->grad_worst) << worst_name;
      }
    }
    ++checked;
  }
  EXPECT_GE(checked, 4);
}
