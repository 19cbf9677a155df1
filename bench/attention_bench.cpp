// Causal packed attention benchmark: lathe's `attention` and `attention_backward` ops (whatever the registry
// resolves, printed) on one GPU, for equal documents. Usage:
//   attention_bench [tokens docs q_heads kv_heads head_dim] [dtype] [iters]
// Random inputs (never zeros), 3 warm-up rounds, median of event-timed iterations; also checks that two
// backward runs give identical bytes. Prints one JSON line. FLOP model (causal, per document of length L):
// forward 2 * 2 * L^2 / 2 * Hq * D, backward 2.5 x forward.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "backend/runtime.h"
#include "ops/ops.h"

using namespace lathe;

namespace {

template <typename F> double median_ms(ExecContext& ctx, int iters, F f) {
  auto start = ctx.backend.create_event(0), stop = ctx.backend.create_event(0);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    start->record(ctx.stream);
    f();
    stop->record(ctx.stream);
    stop->synchronize();
    ms.push_back(stop->elapsed_ms_since(*start));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::vector<uint8_t> host_bytes(Runtime& rt, const Tensor& t) {
  const Tensor h = rt.copy_to(t, Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.numel() * int64_t(dtype_size(h.dtype())));
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
    std::vector<int32_t> cu;
    double fwd_flop = 0;
    for (int64_t b = 0; b <= docs; ++b) cu.push_back(int32_t(b == docs ? tokens : b * (tokens / docs)));
    for (int64_t b = 0; b < docs; ++b) {
      const double len = double(cu[size_t(b + 1)] - cu[size_t(b)]);
      fwd_flop += 2.0 * 2.0 * len * len / 2.0 * double(hq) * double(d);
    }
    const Tensor cu_t = rt.from_host(cu.data(), {docs + 1}, DType::I32, dev);
    const AttentionAttrs attrs{};

    ctx.observer = &observer;
    std::vector<Tensor> fwd = attention(ctx, q, k, v, cu_t, attrs);
    std::vector<Tensor> grads = attention_backward(ctx, q, k, v, fwd[0], fwd[1], dout, cu_t, attrs);
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
    fmt::print(
        "{{\"impl\": \"lathe\", \"tokens\": {}, \"docs\": {}, \"hq\": {}, \"hkv\": {}, \"d\": {}, \"dtype\": \"{}\", "
        "\"fwd_ms\": {:.4f}, \"fwd_tflops\": {:.1f}, \"bwd_ms\": {:.4f}, \"bwd_tflops\": {:.1f}, \"fwdbwd_ms\": {:.4f}, "
        "\"fwdbwd_tflops\": {:.1f}, \"deterministic\": {}, \"kernels\": \"{}\", \"device\": \"{}\"}}\n",
        tokens, docs, hq, hkv, d, dtype_name(dtype), fwd_ms, tflops(fwd_flop, fwd_ms), bwd_ms,
        tflops(2.5 * fwd_flop, bwd_ms), both_ms, tflops(3.5 * fwd_flop, both_ms), deterministic ? "true" : "false",
        fmt::join(kernels, ", "), ctx.backend.info(0).name);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "attention_bench: error: {}\n", e.what());
    return 1;
  }
}
