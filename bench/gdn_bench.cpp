// Gated DeltaNet core benchmark: lathe's `gated_delta_rule` op forward and forward+backward (whatever the registry
// resolves, printed) on one GPU, timed with CUDA events (3 warm-up rounds, median of the iterations), as training
// runs it: the forward saves the chunk-start states and the backward reads them (no forward scan of its own); the
// forward is also timed saving nothing (`fwd_nosave_ms`: an inference forward, as fla's forward kernel runs). Usage:
//   gdn_bench [tokens docs k_heads v_heads dim] [dtype] [iters] [gate dtype (g, beta): f32 by default]
// Defaults: 16384 tokens in 4 packed documents of 4096, H_k = 16, H_v = 32, d_k = d_v = 128, bf16 (issue 8).
// Inputs as in the model: q, k L2-normalised per head, g = log-decay in [-1.5, 0), beta in (0, 1), g and beta in f32
// beside bf16/f16 q, k, v.
// FLOP model (research note gated-deltanet.md §3.6, dense-GEMM counting per token and value head, chunk C = 64):
//   forward  = 6 d_k d_v + 6 C d_k + 4 C d_v + C^2 / 3 (the triangular solve),
//   backward = 16 d_k d_v + 18 C d_k + 10 C d_v + 4 C^2 (recomputation included; the model is kept unchanged
//   although the saved states now spare the backward part of that recomputation).
// At d = 128, C = 64 that is ~180 K (fwd) and ~508 K (bwd) FLOP per token and value head, the note's table.
// Also checks that two backward runs give identical bytes. Prints one JSON line per row.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <random>

#include "backend/runtime.h"
#include "ops/ops.h"
#include "median_ms.h"

using namespace lathe;

namespace {


std::vector<uint8_t> host_bytes(Runtime& rt, const Tensor& t) {
  const Tensor h = rt.copy_to(t, Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.numel() * int64_t(dtype_size(h.dtype())));
}

// Per token and value head (see the header).
double fwd_flop(double dk, double dv, double c) { return 6 * dk * dv + 6 * c * dk + 4 * c * dv + c * c / 3; }
double bwd_flop(double dk, double dv, double c) { return 16 * dk * dv + 18 * c * dk + 10 * c * dv + 4 * c * c; }

}  // namespace

int main(int argc, char** argv) {
  try {
    const bool shape_given = argc > 5;
    const int64_t tokens = shape_given ? std::stoll(argv[1]) : 16384;
    const int64_t docs = shape_given ? std::stoll(argv[2]) : 4;
    const int64_t hk = shape_given ? std::stoll(argv[3]) : 16;
    const int64_t hv = shape_given ? std::stoll(argv[4]) : 32;
    const int64_t d = shape_given ? std::stoll(argv[5]) : 128;
    const DType dtype = argc > 6 ? dtype_from_name(argv[6]) : DType::BF16;
    const int iters = argc > 7 ? std::stoi(argv[7]) : 20;
    LATHE_CHECK(docs >= 1 && docs <= tokens && hk >= 1 && hv % hk == 0, "gdn_bench: bad shape");

    Runtime rt;
    const Device dev = Device::cuda(0);
    ExecContext ctx = rt.context(dev);
    std::vector<std::string> kernels;
    const ResolutionObserver observer = [&](const OpCall&, const Resolution& r) {
      if (std::find(kernels.begin(), kernels.end(), r.name) == kernels.end()) kernels.push_back(r.name);
    };
    std::mt19937 rng(1);
    auto upload = [&](std::vector<float>& v, Shape shape, DType to) {
      return cast(ctx, rt.from_host(v.data(), shape, DType::F32, dev), to);
    };
    // g and beta in f32 beside 16-bit q, k, v, as the model feeds them (or in the dtype given last).
    const DType gate = argc > 8                                        ? dtype_from_name(argv[8])
                       : dtype == DType::BF16 || dtype == DType::F16 ? DType::F32
                                                                     : dtype;
    auto uniform = [&](Shape shape, float lo, float hi, bool l2 = false, std::optional<DType> to = {}) {
      std::uniform_real_distribution<float> dist(lo, hi);
      std::vector<float> v(size_t(shape_numel(shape)));
      for (float& x : v) x = dist(rng);
      if (l2)
        for (size_t r = 0; r < v.size(); r += size_t(d)) {
          double n = 0;
          for (int64_t i = 0; i < d; ++i) n += double(v[r + size_t(i)]) * v[r + size_t(i)];
          for (int64_t i = 0; i < d; ++i) v[r + size_t(i)] = float(v[r + size_t(i)] / std::sqrt(n + 1e-6));
        }
      return upload(v, shape, to.value_or(dtype));
    };
    const Tensor q = uniform({tokens, hk, d}, -1, 1, true), k = uniform({tokens, hk, d}, -1, 1, true);
    const Tensor v = uniform({tokens, hv, d}, -1, 1), g = uniform({tokens, hv}, -1.5f, -0.001f, false, gate);
    const Tensor beta = uniform({tokens, hv}, 0.001f, 1.0f, false, gate), dout = uniform({tokens, hv, d}, -1, 1);
    std::vector<int32_t> cu = {0};
    for (int64_t b = 0; b < docs; ++b) cu.push_back(int32_t(b == docs - 1 ? tokens : cu.back() + tokens / docs));
    const Tensor cu_t = rt.from_host(cu.data(), {int64_t(cu.size())}, DType::I32, dev);
    GatedDeltaAttrs attrs{};
    attrs.save_states = true;  // as in training: the forward saves the chunk-start states and chunk cache, the
                               // backward reads them (LATHE_GDN_NO_CACHE=1: the backward runs its own prep pass)
    const bool use_cache = std::getenv("LATHE_GDN_NO_CACHE") == nullptr;

    ctx.observer = &observer;
    Tensor states, cache;
    auto fwd = [&] {
      const std::vector<Tensor> r = gated_delta_rule(ctx, q, k, v, g, beta, cu_t, attrs);
      states = r[1];
      if (use_cache) cache = r[2];
    };
    auto bwd = [&] { return gated_delta_rule_backward(ctx, q, k, v, g, beta, dout, cu_t, states, attrs, cache); };
    for (int i = 0; i < 3; ++i) {
      fwd();
      bwd();
    }
    ctx.stream.synchronize();
    ctx.observer = nullptr;
    const double f_ms = median_ms(ctx, iters, [&] { fwd(); });
    const double f_nosave_ms = median_ms(ctx, iters, [&] { gated_delta_rule(ctx, q, k, v, g, beta, cu_t, {}); });
    const double b_ms = median_ms(ctx, iters, [&] { bwd(); });
    const double fb_ms = median_ms(ctx, iters, [&] {
      fwd();
      bwd();
    });
    const std::vector<Tensor> g1 = bwd(), g2 = bwd();
    bool deterministic = true;
    for (size_t i = 0; i < g1.size(); ++i) deterministic &= host_bytes(rt, g1[i]) == host_bytes(rt, g2[i]);

    const double th = double(tokens) * double(hv), c = 64;
    const double f_flop = th * fwd_flop(double(d), double(d), c);
    const double b_flop = th * bwd_flop(double(d), double(d), c);
    auto tflops = [](double flop, double ms) { return flop / (ms * 1e-3) / 1e12; };
    fmt::print(
        "{{\"impl\": \"lathe\", \"tokens\": {}, \"docs\": {}, \"hk\": {}, \"hv\": {}, \"d\": {}, \"dtype\": \"{}\", \"gate_dtype\": \"{}\", "
        "\"fwd_ms\": {:.4f}, \"fwd_tokens_per_s\": {:.4g}, \"fwd_tflops\": {:.1f}, \"fwd_nosave_ms\": {:.4f}, "
        "\"bwd_ms\": {:.4f}, "
        "\"fwdbwd_ms\": {:.4f}, \"fwdbwd_tokens_per_s\": {:.4g}, \"fwdbwd_tflops\": {:.1f}, "
        "\"flop_model\": \"per token x value head, C=64: fwd 6dkdv+6Cdk+4Cdv+C^2/3, bwd 16dkdv+18Cdk+10Cdv+4C^2\", "
        "\"deterministic\": {}, \"kernels\": \"{}\", \"device\": \"{}\"}}\n",
        tokens, docs, hk, hv, d, dtype_name(dtype), dtype_name(gate), f_ms, double(tokens) / (f_ms * 1e-3),
        tflops(f_flop, f_ms), f_nosave_ms, b_ms, fb_ms, double(tokens) / (fb_ms * 1e-3), tflops(f_flop + b_flop, fb_ms),
        deterministic ? "true" : "false",
        fmt::join(kernels, ", "), ctx.backend.info(0).name);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "gdn_bench: error: {}\n", e.what());
    return 1;
  }
}
