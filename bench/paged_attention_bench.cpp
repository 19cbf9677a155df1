// Decode-step paged attention benchmark (the rollout engine's `paged_attention` op at one query a sequence): the op as
// the registry resolves it (printed), then each registered CUDA kernel by name and each pipeline of
// cuda/paged_attention_pipelined (backend/cuda/paged_launchers.h), against a device-to-device copy timed in the same
// run. Usage:
//   paged_attention_bench [batch mean_context spread q_heads kv_heads head_dim block_size] [dtype] [iters]
// Sequence b's context is mean + ((b x 7919) mod (2 spread + 1)) - spread positions; its pages are scattered over the
// cache (a shuffled table). Bytes read: each sequence's keys and values (context x kv heads x head dim x 2) plus the
// queries; reported against the copy's rate (bytes read + written a second), the ceiling of a kernel that streams
// the cache once. Each variant's output is checked against the registry's reference kernel (nmse). Prints one JSON
// line per variant.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/paged_launchers.h"
#include "backend/runtime.h"
#include "median_ms.h"
#include "ops/ops.h"

using namespace lathe;

namespace {

// A (rows, heads, d) tensor of `dtype` on `dev` with values uniform in [-1, 1], filled a chunk at a time.
Tensor random_tensor(Runtime& rt, ExecContext& ctx, Shape shape, DType dtype, Device dev, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype, ctx.allocator);
  const int64_t n = shape_numel(shape), chunk = int64_t(1) << 24;
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> host(size_t(std::min(n, chunk)));
  for (int64_t at = 0; at < n; at += chunk) {
    const int64_t m = std::min(chunk, n - at);
    for (int64_t k = 0; k < m; ++k) host[size_t(k)] = dist(rng);
    const Tensor part = cast(ctx, rt.from_host(host.data(), {m}, DType::F32, dev), dtype);
    ctx.backend.copy(static_cast<char*>(t.data_ptr()) + at * int64_t(dtype_size(dtype)), dev, part.data_ptr(), dev,
                     size_t(m) * dtype_size(dtype), ctx.stream);
    ctx.stream.synchronize();
  }
  return t;
}

std::vector<float> host_floats(Runtime& rt, ExecContext& ctx, const Tensor& t) {
  const Tensor h = rt.copy_to(cast(ctx, t, DType::F32), Device::cpu());
  const float* p = h.data<float>();
  return std::vector<float>(p, p + h.numel());
}

double nmse(const std::vector<float>& got, const std::vector<float>& ref) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return norm > 0 ? err / norm : err;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bool shape_given = argc > 7;
    const auto arg = [&](int i, int64_t fallback) { return shape_given ? std::stoll(argv[i]) : fallback; };
    const int64_t batch = arg(1, 256), mean = arg(2, 810), spread = arg(3, 300), hq = arg(4, 16), hkv = arg(5, 8),
                  d = arg(6, 128), bs = arg(7, 16);
    const DType dtype = argc > 8 ? dtype_from_name(argv[8]) : DType::BF16;
    const int iters = argc > 9 ? std::stoi(argv[9]) : 50;
    LATHE_CHECK(batch >= 1 && mean > spread && hkv >= 1 && hq % hkv == 0, "paged_attention_bench: bad shape");

    Runtime rt;
    const Device dev = Device::cuda(0);
    ExecContext ctx = rt.context(dev);
    std::mt19937 rng(1);
    std::vector<int32_t> lens(static_cast<size_t>(batch)), cu(static_cast<size_t>(batch + 1));
    for (int64_t b = 0; b < batch; ++b) lens[size_t(b)] = int32_t(mean + (b * 7919) % (2 * spread + 1) - spread);
    std::iota(cu.begin(), cu.end(), 0);
    const int64_t width = (mean + spread + bs - 1) / bs, blocks = batch * width;
    std::vector<int32_t> pages(static_cast<size_t>(blocks));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    const Tensor table = rt.from_host(pages.data(), {batch, width}, DType::I32, dev);
    const Tensor cu_t = rt.from_host(cu.data(), {batch + 1}, DType::I32, dev);
    const Tensor lens_t = rt.from_host(lens.data(), {batch}, DType::I32, dev);
    const Tensor q = random_tensor(rt, ctx, {batch, hq, d}, dtype, dev, rng);
    const Tensor kc = random_tensor(rt, ctx, {blocks * bs, hkv, d}, dtype, dev, rng);
    const Tensor vc = random_tensor(rt, ctx, {blocks * bs, hkv, d}, dtype, dev, rng);
    const PagedAttentionAttrs attrs{0.0, bs};
    const double positions = std::accumulate(lens.begin(), lens.end(), 0.0);
    const double bytes = (2.0 * positions * double(hkv) + 2.0 * double(batch * hq)) * double(d) * dtype_size(dtype);

    // The copy's rate over the keys' bytes (read + written).
    Tensor copy_dst = Tensor::empty(kc.shape(), dtype, ctx.allocator);
    const double copy_ms = median_ms(ctx, iters, [&] {
      ctx.backend.copy(copy_dst.data_ptr(), dev, kc.data_ptr(), dev, kc.nbytes(), ctx.stream);
    }, 3);
    const double copy_gbs = 2.0 * double(kc.nbytes()) / copy_ms / 1e6;
    fmt::print("{{\"what\": \"copy\", \"gb\": {:.3f}, \"ms\": {:.4f}, \"gb_s\": {:.1f}}}\n", 2.0 * kc.nbytes() / 1e9,
               copy_ms, copy_gbs);

    std::string resolved;
    const ResolutionObserver observer = [&](const OpCall&, const Resolution& r) { resolved = r.name; };
    ctx.observer = &observer;
    Tensor out = paged_attention(ctx, q, kc, vc, table, cu_t, lens_t, attrs);
    ctx.observer = nullptr;
    const auto report = [&](const std::string& what, double ms, const Tensor& o, const std::vector<float>& ref) {
      const double gbs = bytes / ms / 1e6;
      fmt::print("{{\"what\": \"{}\", \"batch\": {}, \"mean_context\": {}, \"hq\": {}, \"hkv\": {}, \"d\": {}, "
                 "\"block\": {}, \"dtype\": \"{}\", \"ms\": {:.4f}, \"gb_read\": {:.3f}, \"gb_s\": {:.1f}, "
                 "\"of_copy_rate\": {:.3f}, \"nmse_vs_reference\": {:.3g}}}\n",
                 what, batch, mean, hq, hkv, d, bs, dtype_name(dtype), ms, bytes / 1e9, gbs, gbs / copy_gbs,
                 ref.empty() ? 0.0 : nmse(host_floats(rt, ctx, o), ref));
    };
    const double op_ms =
        median_ms(ctx, iters, [&] { out = paged_attention(ctx, q, kc, vc, table, cu_t, lens_t, attrs); }, 3);
    report("op:" + resolved, op_ms, out, {});

    std::vector<float> reference;
    for (const char* name : {"cuda/paged_attention", "cuda/paged_attention_pipelined"}) {
      const KernelDef* k = rt.registry().find(OpId::paged_attention, DeviceType::CUDA, dtype, name);
      OpCall call{OpId::paged_attention, {q, kc, vc, table, cu_t, lens_t},
                  {Tensor::empty(q.shape(), dtype, ctx.allocator)}, attrs};
      if (!k || !k->supports(call).ok) {
        fmt::print("{{\"what\": \"{}\", \"skipped\": \"not registered or does not support the shape\"}}\n", name);
        continue;
      }
      const double ms = median_ms(ctx, iters, [&] { k->run(call, ctx); }, 3);
      if (reference.empty()) reference = host_floats(rt, ctx, call.outputs[0]);
      report(name, ms, call.outputs[0], reference);
    }

    // The pipelines the launcher builds for 128-value bf16 rows.
    if (dtype == DType::BF16 && d == 128 && cuda::paged_attention_pipelined_applies(dtype, d, bs)) {
      const int64_t splits = cuda::paged_attention_splits(batch, hq, hkv, width * bs);
      const Tensor workspace = Tensor::empty({std::max<int64_t>(1, batch * hq * splits * (d + 2))}, DType::F32,
                                             ctx.allocator);
      for (const cuda::PagedPipeline pipe : {cuda::PagedPipeline{4, 3}, cuda::PagedPipeline{4, 2},
                                             cuda::PagedPipeline{2, 4}, cuda::PagedPipeline{2, 6}}) {
        Tensor o = Tensor::empty(q.shape(), dtype, ctx.allocator);
        const auto launch = [&] {
          cuda::launch_paged_attention_pipelined(dtype, batch, hq, hkv, d, bs, batch, width, splits,
                                                 float(1.0 / std::sqrt(double(d))), q.data_ptr(), kc.data_ptr(),
                                                 vc.data_ptr(), table.data<int32_t>(), cu_t.data<int32_t>(),
                                                 lens_t.data<int32_t>(), o.data_ptr(), workspace.data<float>(),
                                                 pipe, cuda::stream_of(ctx));
        };
        const double ms = median_ms(ctx, iters, launch, 3);
        report(fmt::format("pipelined positions={} stages={} splits={}", pipe.positions, pipe.stages, splits), ms, o,
               reference);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "paged_attention_bench: {}\n", e.what());
    return 1;
  }
}
