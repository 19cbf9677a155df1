// Causal packed attention benchmark: lathe's `attention` and `attention_backward` ops (whatever the registry
// resolves, printed) on one GPU, and in the same run the tiled kernels (cuda/flash_attention*) called by name and,
// with cuDNN in the build, cuDNN's non-deterministic backward (not registered) for what determinism costs. Usage:
//   attention_bench [tokens docs q_heads kv_heads head_dim] [dtype] [iters] [equal|uneven]
// `uneven` gives document b a length proportional to b + 1. Random inputs (never zeros), 3 warm-up rounds, median
// of event-timed iterations; also checks that two backward runs give identical bytes and times the first call of
// each op (plan building included). Prints one JSON line; the cuDNN plan log goes to stderr. FLOP model (causal,
// per document of length L): forward 2 * 2 * L^2 / 2 * Hq * D, backward 2.5 x forward.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>

#include "backend/runtime.h"
#include "ops/ops.h"
#ifdef LATHE_WITH_CUDNN
#include "backend/cuda/cudnn_attention.h"
#endif
#include "median_ms.h"

using namespace lathe;

namespace {


double wall_ms(ExecContext& ctx, const std::function<void()>& f) {
  ctx.stream.synchronize();
  const auto start = std::chrono::steady_clock::now();
  f();
  ctx.stream.synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

std::vector<uint8_t> host_bytes(Runtime& rt, const Tensor& t) {
  const Tensor h = rt.copy_to(t, Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.numel() * int64_t(dtype_size(h.dtype())));
}

// Normalised MSE of `got` against `ref` (same dtype and size), as the op check measures it.
double nmse(const std::vector<uint8_t>& got, const std::vector<uint8_t>& ref, DType t) {
  double err = 0, norm = 0;
  for (int64_t i = 0; i < int64_t(ref.size() / dtype_size(t)); ++i) {
    const double g = load_as_double(got.data(), t, i), r = load_as_double(ref.data(), t, i);
    err += (g - r) * (g - r);
    norm += r * r;
  }
  return norm > 0 ? err / norm : err;
}

// "[dq, dk, dv]" nmse of `got` against `ref`.
std::string grad_nmse(Runtime& rt, const std::vector<Tensor>& got, const std::vector<std::vector<uint8_t>>& ref) {
  std::vector<std::string> v;
  for (size_t i = 0; i < 3; ++i) v.push_back(fmt::format("{:.2g}", nmse(host_bytes(rt, got[i]), ref[i], got[i].dtype())));
  return fmt::format("[{}]", fmt::join(v, ", "));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bool shape_given = argc > 5;
    const int64_t tokens = shape_given ? std::stoll(argv[1]) : 16384;
    const int64_t docs = shape_given ? std::stoll(argv[2]) : 4;
    const int64_t hq = shape_given ? std::stoll(argv[3]) : 16;
    const int64_t hkv = shape_given ? std::stoll(argv[4]) : 8;
    const int64_t d = shape_given ? std::stoll(argv[5]) : 128;
    const DType dtype = argc > 6 ? dtype_from_name(argv[6]) : DType::BF16;
    const int iters = argc > 7 ? std::stoi(argv[7]) : 20;
    const bool uneven = argc > 8 && std::string(argv[8]) == "uneven";
    LATHE_CHECK(docs >= 1 && docs <= tokens && hkv >= 1 && hq % hkv == 0, "attention_bench: bad shape");

    Runtime rt;
    const Device dev = Device::cuda(0);
    ExecContext ctx = rt.context(dev);
    std::vector<std::string> kernels;
    const ResolutionObserver observer = [&](const OpCall&, const Resolution& r) {
      if (std::find(kernels.begin(), kernels.end(), r.name) == kernels.end()) kernels.push_back(r.name);
    };
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    auto random = [&](Shape shape) {
      std::vector<float> v(size_t(shape_numel(shape)));
      for (float& x : v) x = dist(rng);
      return cast(ctx, rt.from_host(v.data(), shape, DType::F32, dev), dtype);
    };
    const Tensor q = random({tokens, hq, d}), k = random({tokens, hkv, d}), v = random({tokens, hkv, d});
    const Tensor dout = random({tokens, hq, d});
    std::vector<int32_t> cu = {0};
    double fwd_flop = 0;
    for (int64_t b = 0; b < docs; ++b) {  // uneven: lengths proportional to b + 1 (the last takes the remainder)
      const int64_t len = uneven ? tokens * 2 * (b + 1) / (docs * (docs + 1)) : tokens / docs;
      cu.push_back(int32_t(b == docs - 1 ? tokens : cu.back() + len));
    }
    for (int64_t b = 0; b < docs; ++b) {
      const double len = double(cu[size_t(b + 1)] - cu[size_t(b)]);
      fwd_flop += 2.0 * 2.0 * len * len / 2.0 * double(hq) * double(d);
    }
    const Tensor cu_t = rt.from_host(cu.data(), {docs + 1}, DType::I32, dev);
    const AttentionAttrs attrs{};

    ctx.observer = &observer;
    std::vector<Tensor> fwd, grads;
    const double first_fwd_ms = wall_ms(ctx, [&] { fwd = attention(ctx, q, k, v, cu_t, attrs); });
    const double first_bwd_ms =
        wall_ms(ctx, [&] { grads = attention_backward(ctx, q, k, v, fwd[0], fwd[1], dout, cu_t, attrs); });
    ctx.observer = nullptr;
    for (int i = 0; i < 2; ++i) {
      fwd = attention(ctx, q, k, v, cu_t, attrs);
      grads = attention_backward(ctx, q, k, v, fwd[0], fwd[1], dout, cu_t, attrs);
    }
    ctx.stream.synchronize();
    bool deterministic = true;
    {
      const std::vector<Tensor> again = attention_backward(ctx, q, k, v, fwd[0], fwd[1], dout, cu_t, attrs);
      for (size_t i = 0; i < 3; ++i) deterministic = deterministic && host_bytes(rt, again[i]) == host_bytes(rt, grads[i]);
    }

    const double fwd_ms = median_ms(ctx, iters, [&] { fwd = attention(ctx, q, k, v, cu_t, attrs); });
    const double bwd_ms =
        median_ms(ctx, iters, [&] { grads = attention_backward(ctx, q, k, v, fwd[0], fwd[1], dout, cu_t, attrs); });
    const double both_ms = median_ms(ctx, iters, [&] {
      fwd = attention(ctx, q, k, v, cu_t, attrs);
      grads = attention_backward(ctx, q, k, v, fwd[0], fwd[1], dout, cu_t, attrs);
    });
    auto tflops = [](double flop, double ms) { return flop / (ms * 1e-3) / 1e12; };

    // Same run, same inputs: the tiled kernels by name (the registry's fallback), when they take this shape, and
    // (with cuDNN) its non-deterministic backward, each compared with the registry's gradients (nmse, as op-check).
    std::string extra;
    std::vector<std::vector<uint8_t>> ref;
    for (size_t i = 0; i < 3; ++i) ref.push_back(host_bytes(rt, grads[i]));
    const std::vector<Tensor> other = {Tensor::empty(grads[0].shape(), dtype, ctx.allocator),
                                       Tensor::empty(grads[1].shape(), dtype, ctx.allocator),
                                       Tensor::empty(grads[2].shape(), dtype, ctx.allocator)};
    const KernelDef* flash_f = rt.registry().find(OpId::attention, DeviceType::CUDA, dtype, "cuda/flash_attention");
    const KernelDef* flash_b =
        rt.registry().find(OpId::attention_backward, DeviceType::CUDA, dtype, "cuda/flash_attention_backward");
    OpCall fcall{OpId::attention, {q, k, v, cu_t}, {fwd[0], fwd[1]}, attrs};
    OpCall bcall{OpId::attention_backward, {q, k, v, fwd[0], fwd[1], dout, cu_t}, other, attrs};
    if (flash_f && flash_b && flash_f->supports(fcall).ok && flash_b->supports(bcall).ok &&
        std::find(kernels.begin(), kernels.end(), flash_f->name) == kernels.end()) {
      for (int i = 0; i < 3; ++i) flash_f->run(fcall, ctx), flash_b->run(bcall, ctx);
      const double f_ms = median_ms(ctx, iters, [&] { flash_f->run(fcall, ctx); });
      const double fb_ms = median_ms(ctx, iters, [&] { flash_f->run(fcall, ctx), flash_b->run(bcall, ctx); });
      extra += fmt::format(", \"flash_fwd_ms\": {:.4f}, \"flash_fwdbwd_ms\": {:.4f}, \"flash_fwdbwd_tflops\": {:.1f}, "
                           "\"flash_grad_nmse\": \"{}\"",
                           f_ms, fb_ms, tflops(3.5 * fwd_flop, fb_ms), grad_nmse(rt, other, ref));
    }
#ifdef LATHE_WITH_CUDNN
    // cuDNN's non-deterministic backward (fp32 dQ accumulation), for what the registered deterministic one costs.
    try {
      for (int i = 0; i < 3; ++i) cuda::run_cudnn_attention_backward_nondeterministic(bcall, ctx);
      const double nd_ms = median_ms(ctx, iters, [&] { cuda::run_cudnn_attention_backward_nondeterministic(bcall, ctx); });
      extra += fmt::format(", \"cudnn_nondeterministic_bwd_ms\": {:.4f}, \"cudnn_nondeterministic_bwd_tflops\": {:.1f}, "
                           "\"cudnn_nondeterministic_grad_nmse\": \"{}\"",
                           nd_ms, tflops(2.5 * fwd_flop, nd_ms), grad_nmse(rt, other, ref));
    } catch (const std::exception& e) {
      fmt::print(stderr, "attention_bench: cuDNN non-deterministic backward: {}\n", e.what());
    }
    for (const std::string& line : cuda::cudnn_attention_plan_log()) fmt::print(stderr, "cudnn plan: {}\n", line);
#endif
    fmt::print(
        "{{\"impl\": \"lathe\", \"tokens\": {}, \"docs\": {}, \"uneven\": {}, \"hq\": {}, \"hkv\": {}, \"d\": {}, "
        "\"dtype\": \"{}\", \"fwd_ms\": {:.4f}, \"fwd_tflops\": {:.1f}, \"bwd_ms\": {:.4f}, \"bwd_tflops\": {:.1f}, "
        "\"fwdbwd_ms\": {:.4f}, \"fwdbwd_tflops\": {:.1f}, \"first_fwd_ms\": {:.1f}, \"first_bwd_ms\": {:.1f}, "
        "\"deterministic\": {}, \"kernels\": \"{}\"{}, \"device\": \"{}\"}}\n",
        tokens, docs, uneven ? "true" : "false", hq, hkv, d, dtype_name(dtype), fwd_ms, tflops(fwd_flop, fwd_ms), bwd_ms,
        tflops(2.5 * fwd_flop, bwd_ms), both_ms, tflops(3.5 * fwd_flop, both_ms), first_fwd_ms, first_bwd_ms,
        deterministic ? "true" : "false", fmt::join(kernels, ", "), extra, ctx.backend.info(0).name);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "attention_bench: error: {}\n", e.what());
    return 1;
  }
}
