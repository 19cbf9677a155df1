// GEMM micro-benchmark: C = A @ B through lathe's matmul op (cuBLASLt path) on one GPU.
// Usage: gemm_bench [M N K] [dtype] [iters] [layout]; layout nn (default), nt or tn: whether A and B are stored
// transposed (A (K, M) for tn, B (N, K) for nt), as the model's backward GEMMs read them. Random inputs (never
// zeros), warm-up, median of event-timed iterations. Prints one JSON line: {"impl":"lathe", "tflops":..., "ms":...}.
#include <fmt/format.h>

#include <algorithm>
#include <random>
#include <string>

#include "backend/runtime.h"
#include "ops/ops.h"

using namespace lathe;

int main(int argc, char** argv) {
  try {
    const int64_t m = argc > 3 ? std::stoll(argv[1]) : 8192;
    const int64_t n = argc > 3 ? std::stoll(argv[2]) : 8192;
    const int64_t k = argc > 3 ? std::stoll(argv[3]) : 8192;
    const DType dtype = argc > 4 ? dtype_from_name(argv[4]) : DType::BF16;
    const int iters = argc > 5 ? std::stoi(argv[5]) : 50;
    const std::string layout = argc > 6 ? argv[6] : "nn";
    LATHE_CHECK(layout == "nn" || layout == "nt" || layout == "tn", "gemm_bench: layout must be nn, nt or tn, got '{}'",
                layout);
    const MatmulAttrs attrs{layout == "tn", layout == "nt"};
    Runtime rt;
    const Device dev = Device::cuda(0);
    ExecContext ctx = rt.context(dev);
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    auto random = [&](int64_t rows, int64_t cols) {
      std::vector<float> v(size_t(rows * cols));
      for (float& x : v) x = dist(rng);
      return cast(ctx, rt.from_host(v.data(), {rows, cols}, DType::F32, dev), dtype);
    };
    const Tensor a = attrs.trans_a ? random(k, m) : random(m, k), b = attrs.trans_b ? random(n, k) : random(k, n);
    Tensor c = Tensor::empty({m, n}, dtype, ctx.allocator);
    for (int i = 0; i < 5; ++i) matmul_into(ctx, a, b, c, attrs);
    auto start = ctx.backend.create_event(0), stop = ctx.backend.create_event(0);
    std::vector<double> ms;
    for (int i = 0; i < iters; ++i) {
      start->record(ctx.stream);
      matmul_into(ctx, a, b, c, attrs);
      stop->record(ctx.stream);
      stop->synchronize();
      ms.push_back(stop->elapsed_ms_since(*start));
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const double tflops = 2.0 * double(m) * double(n) * double(k) / (med * 1e-3) / 1e12;
    fmt::print("{{\"impl\": \"lathe\", \"m\": {}, \"n\": {}, \"k\": {}, \"layout\": \"{}\", \"dtype\": \"{}\", "
               "\"ms\": {:.4f}, \"tflops\": {:.1f}, \"device\": \"{}\"}}\n",
               m, n, k, layout, dtype_name(dtype), med, tflops, ctx.backend.info(0).name);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "gemm_bench: error: {}\n", e.what());
    return 1;
  }
}
