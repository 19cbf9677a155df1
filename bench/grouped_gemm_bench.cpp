// Grouped GEMM benchmark: lathe's grouped_matmul ops at a Qwen3-MoE layer's shapes on one GPU (whatever the registry
// resolves, printed), against the baseline of one dense matmul of the same FLOPs, (P, K) x (K, N), and against a loop
// of one matmul per expert, all timed with CUDA events in the same run (3 warm-up rounds, median of the iterations).
// Usage: grouped_gemm_bench [dtype] [iters] [tokens top_k experts hidden intermediate]
// Defaults: bf16, 20 iterations, 4096 tokens x top-8 = P = 32768 rows over E = 128 experts, hidden H = 2048,
// expert intermediate I = 768 (Qwen3-30B-A3B). Two projections: gate/up-like (K = H, N = I) and down (K = I, N = H).
// Four spreads of the rows: even (P / E each), uneven (seeded log-normal sizes, every 8th expert empty), hot (every
// token to the same k experts: P / k rows each, the rest empty) and model (what a random-init router does in lathe
// bench's 30b-a3b layers: 10 experts of 4,060 down to 2,080 rows, the other 118 sharing the rest, about 17 each).
// Three GEMMs per row, each 2 P N K FLOPs (active experts only: the dense baseline does the same work):
//   fwd  y = grouped_matmul(x, w)                      (w (E, N, K), trans_w; dense: x W^T)
//   dx   dx = grouped_matmul(dy, w, trans_w = false)   (dense: dy W)
//   dw   dw = grouped_matmul_weight_grad(dy, x)        (dense: dy^T x)
// Also the MoE layer's padded form (ModelOptions::moe_padded_max_waste): one batched matmul over (E, M, .) blocks,
// M the largest group rounded up to 8, its TFLOP/s counting the P rows' work only (padding is waste).
// Also cuBLAS's grouped call (cuda/cublas_grouped_gemm) run directly, beside whatever the registry resolves.
// Prints the device's description, then one JSON line per (projection, spread, GEMM) with the TFLOP/s of each and the
// ratios grouped / dense, grouped / loop and grouped / cuBLAS grouped of TFLOP/s (above 1: the grouped call is
// faster); bench/run_grouped_gemm.sh adds the card, driver, CUDA version and commit.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backend/runtime.h"
#include "ops/ops.h"
#include "median_ms.h"

using namespace lathe;

namespace {


enum class Spread { even, uneven, hot, model };

// Group sizes summing to `rows` over `experts`: even, log-normal with every 8th expert empty (seeded), all in the
// first `top_k` experts, or the model spread (scaled to `rows`; even where there are 10 experts or fewer).
std::vector<int64_t> group_sizes(int64_t rows, int64_t experts, int64_t top_k, Spread spread) {
  std::vector<int64_t> sizes(size_t(experts), 0);
  if (spread == Spread::hot) {
    for (int64_t e = 0; e < top_k; ++e) sizes[size_t(e)] = rows / top_k + (e < rows % top_k ? 1 : 0);
    return sizes;
  }
  if (spread == Spread::model && experts > 10) {
    int64_t given = 0;
    for (int64_t e = 0; e < 10; ++e) given += sizes[size_t(e)] = rows * (4060 - 220 * e) / 32768;
    for (int64_t e = 10; e < experts; ++e)
      given += sizes[size_t(e)] = (rows - given) / (experts - e);
    sizes[0] += rows - given;
    return sizes;
  }
  if (spread == Spread::even || spread == Spread::model) {
    for (int64_t e = 0; e < experts; ++e) sizes[size_t(e)] = rows / experts + (e < rows % experts ? 1 : 0);
    return sizes;
  }
  std::mt19937 rng(17);
  std::lognormal_distribution<double> dist(0.0, 0.8);
  std::vector<double> weight(size_t(experts), 0.0);
  double total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    weight[size_t(e)] = e % 8 == 5 ? 0.0 : dist(rng);
    total += weight[size_t(e)];
  }
  int64_t given = 0, largest = 0;
  for (int64_t e = 0; e < experts; ++e) {
    sizes[size_t(e)] = int64_t(std::floor(double(rows) * weight[size_t(e)] / total));
    given += sizes[size_t(e)];
    if (sizes[size_t(e)] > sizes[size_t(largest)]) largest = e;
  }
  sizes[size_t(largest)] += rows - given;  // the rounding remainder
  return sizes;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> o = {0};
  for (int64_t s : sizes) o.push_back(o.back() + s);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const DType dtype = argc > 1 ? dtype_from_name(argv[1]) : DType::BF16;
    const int iters = argc > 2 ? std::stoi(argv[2]) : 20;
    const bool shape_given = argc > 7;
    const int64_t tokens = shape_given ? std::stoll(argv[3]) : 4096;
    const int64_t top_k = shape_given ? std::stoll(argv[4]) : 8;
    const int64_t experts = shape_given ? std::stoll(argv[5]) : 128;
    const int64_t hidden = shape_given ? std::stoll(argv[6]) : 2048;
    const int64_t inter = shape_given ? std::stoll(argv[7]) : 768;
    LATHE_CHECK(tokens >= 1 && top_k >= 1 && experts >= 1 && hidden >= 1 && inter >= 1 && iters >= 1,
                "grouped_gemm_bench: bad configuration");
    const int64_t p = tokens * top_k;

    Runtime rt;
    const Device dev = Device::cuda(0);
    ExecContext ctx = rt.context(dev);
    const DeviceInfo info = ctx.backend.info(0);
    fmt::print("device: {} ({})\n", info.name, info.details);
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    auto random = [&](Shape shape) {
      std::vector<float> v(size_t(shape_numel(shape)));
      for (float& x : v) x = dist(rng);
      return cast(ctx, rt.from_host(v.data(), shape, DType::F32, dev), dtype);
    };

    for (const bool down : {false, true}) {
      const int64_t k = down ? inter : hidden, n = down ? hidden : inter;
      const Tensor x = random({p, k}), dy = random({p, n}), w = random({experts, n, k});
      const Tensor w_dense = random({n, k});  // the dense baseline's weight: (N, K), as one expert's
      Tensor y = Tensor::empty({p, n}, dtype, ctx.allocator), dx = Tensor::empty({p, k}, dtype, ctx.allocator);
      Tensor dw = Tensor::empty({experts, n, k}, dtype, ctx.allocator), dw_dense = Tensor::empty({n, k}, dtype, ctx.allocator);
      for (const Spread spread : {Spread::even, Spread::uneven, Spread::hot, Spread::model}) {
        const std::vector<int64_t> sizes = group_sizes(p, experts, top_k, spread);
        const GroupedMatmulAttrs attrs{offsets_of(sizes), true};
        const GroupedMatmulAttrs back{attrs.offsets, false};
        const int64_t empty = std::count(sizes.begin(), sizes.end(), int64_t(0));
        const int64_t most = *std::max_element(sizes.begin(), sizes.end());
        const int64_t m = (most + 7) / 8 * 8;  // the padded form's rows per expert
        const Tensor xp = random({experts, m, k}), dyp = random({experts, m, n});
        Tensor yp = Tensor::empty({experts, m, n}, dtype, ctx.allocator);
        Tensor dxp = Tensor::empty({experts, m, k}, dtype, ctx.allocator);
        Tensor dwp = Tensor::empty({experts, n, k}, dtype, ctx.allocator);

        std::vector<std::string> kernels;
        const ResolutionObserver observer = [&](const OpCall&, const Resolution& r) {
          if (std::find(kernels.begin(), kernels.end(), r.name) == kernels.end()) kernels.push_back(r.name);
        };
        // One matmul per non-empty expert on row slices (cuBLASLt each): what a grouped call saves.
        auto loop = [&](int which) {
          for (int64_t e = 0; e < experts; ++e) {
            const int64_t r0 = attrs.offsets[size_t(e)], rows = sizes[size_t(e)];
            if (rows == 0) continue;
            const Tensor we = w.narrow(0, e, 1).view({n, k});
            if (which == 0) {
              Tensor ye = y.narrow(0, r0, rows);
              matmul_into(ctx, x.narrow(0, r0, rows), we, ye, {false, true});
            } else if (which == 1) {
              Tensor dxe = dx.narrow(0, r0, rows);
              matmul_into(ctx, dy.narrow(0, r0, rows), we, dxe, {});
            } else {
              Tensor dwe = dw.narrow(0, e, 1).view({n, k});
              matmul_into(ctx, dy.narrow(0, r0, rows), x.narrow(0, r0, rows), dwe, {true, false});
            }
          }
        };
        const char* names[] = {"fwd", "dx", "dw"};
        const char* spread_names[] = {"even", "uneven", "hot", "model"};
        // cuBLAS's grouped call, run directly (the baseline the registry's first choice is measured against).
        auto cublas_grouped = [&](int which) {
          const KernelDef* def = ctx.registry.find(which == 2 ? OpId::grouped_matmul_weight_grad : OpId::grouped_matmul,
                                                   DeviceType::CUDA, dtype, "cuda/cublas_grouped_gemm");
          if (def == nullptr) return;
          OpCall call = which == 0   ? OpCall{OpId::grouped_matmul, {x, w}, {y}, attrs}
                        : which == 1 ? OpCall{OpId::grouped_matmul, {dy, w}, {dx}, back}
                                     : OpCall{OpId::grouped_matmul_weight_grad, {dy, x}, {dw}, attrs};
          def->run(call, ctx);
        };
        for (int which = 0; which < 3; ++which) {
          ctx.observer = &observer;
          const double grouped_ms = median_ms(ctx, iters, [&] {
            if (which == 0) y = grouped_matmul(ctx, x, w, attrs);
            if (which == 1) dx = grouped_matmul(ctx, dy, w, back);
            if (which == 2) grouped_matmul_weight_grad_into(ctx, dy, x, dw, attrs);
          }, 3);
          ctx.observer = nullptr;
          const double dense_ms = median_ms(ctx, iters, [&] {
            if (which == 0) matmul_into(ctx, x, w_dense, y, {false, true});
            if (which == 1) matmul_into(ctx, dy, w_dense, dx, {});
            if (which == 2) matmul_into(ctx, dy, x, dw_dense, {true, false});
          }, 3);
          const double loop_ms = median_ms(ctx, iters, [&] { loop(which); }, 3);
          const double cublas_ms = median_ms(ctx, iters, [&] { cublas_grouped(which); }, 3);
          const double padded_ms = median_ms(ctx, iters, [&] {
            if (which == 0) matmul_into(ctx, xp, w, yp, {false, true});
            if (which == 1) matmul_into(ctx, dyp, w, dxp, {});
            if (which == 2) matmul_into(ctx, dyp, xp, dwp, {true, false});
          }, 3);
          const double flop = 2.0 * double(p) * double(n) * double(k);
          auto tflops = [&](double ms) { return flop / (ms * 1e-3) / 1e12; };
          fmt::print("{{\"impl\": \"lathe\", \"proj\": \"{}\", \"spread\": \"{}\", \"gemm\": \"{}\", \"p\": {}, \"e\": {}, "
                     "\"k\": {}, \"n\": {}, \"dtype\": \"{}\", \"empty_experts\": {}, \"largest_group\": {}, "
                     "\"grouped_ms\": {:.4f}, \"grouped_tflops\": {:.1f}, \"dense_ms\": {:.4f}, \"dense_tflops\": {:.1f}, "
                     "\"loop_ms\": {:.4f}, \"loop_tflops\": {:.1f}, \"padded_rows\": {}, \"padded_ms\": {:.4f}, "
                     "\"padded_tflops\": {:.1f}, \"cublas_grouped_ms\": {:.4f}, \"cublas_grouped_tflops\": {:.1f}, "
                     "\"tflops_ratio_vs_dense\": {:.3f}, \"tflops_ratio_vs_loop\": {:.3f}, "
                     "\"tflops_ratio_vs_cublas_grouped\": {:.3f}, \"kernels\": \"{}\", \"device\": \"{}\"}}\n",
                     down ? "down" : "gate_up", spread_names[int(spread)], names[which], p, experts, k, n,
                     dtype_name(dtype), empty, most, grouped_ms, tflops(grouped_ms), dense_ms, tflops(dense_ms), loop_ms,
                     tflops(loop_ms), m, padded_ms, tflops(padded_ms), cublas_ms, tflops(cublas_ms), dense_ms / grouped_ms,
                     loop_ms / grouped_ms, cublas_ms / grouped_ms,
                     fmt::join(kernels, ", "), info.name);
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "grouped_gemm_bench: error: {}\n", e.what());
    return 1;
  }
}
