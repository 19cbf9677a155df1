#include "train/step_profile.h"

#include <fmt/format.h>

#include <map>
#include <string>

#include "train/flops.h"

namespace lathe {

namespace {

const char* kind_of(OpId op) {
  switch (op) {
    case OpId::matmul: return "GEMM";
    case OpId::grouped_matmul:
    case OpId::grouped_matmul_weight_grad: return "grouped GEMM";
    case OpId::attention:
    case OpId::attention_backward: return "attention";
    case OpId::cross_entropy: return "cross-entropy";
    case OpId::adamw: return "AdamW";
    default: return "elementwise/norm/other";
  }
}

}  // namespace

nlohmann::json print_step_profile(const OpProfiler::Profile& p, double step_ms, double tokens, double flops_per_step,
                             double attention_flops, double peak) {
  const double gaps = step_ms - p.kernels_ms;
  fmt::print("\nprofile of one step: wall {:.2f} ms; kernels {:.2f} ms ({:.1f}%) in {} calls, first start to last end "
             "{:.2f} ms; not in any kernel {:.2f} ms ({:.1f}%: host work, copies, fills, waits)\n",
             step_ms, p.kernels_ms, 100.0 * p.kernels_ms / step_ms, p.calls, p.span_ms, gaps, 100.0 * gaps / step_ms);
  fmt::print("  {:<40} {:>7} {:>10} {:>7} {:>9} {:>9}\n", "kernel", "calls", "total ms", "% step", "TFLOP/s",
             "host ms");
  nlohmann::json kernels = nlohmann::json::array();
  std::map<std::string, double> by_kind;
  double gemm_ms = 0, gemm_flops = 0;
  for (const OpProfiler::Total& t : p.kernels) {
    double flops = t.flops;
    if (t.op == OpId::attention) flops = attention_flops * double(t.calls);
    if (t.op == OpId::attention_backward) flops = 2.5 * attention_flops * double(t.calls);
    const double tflops = flops > 0 && t.ms > 0 ? flops / (t.ms * 1e-3) / 1e12 : 0.0;
    fmt::print("  {:<40} {:>7} {:>10.3f} {:>7.2f} {:>9} {:>9.3f}\n", t.name, t.calls, t.ms, 100.0 * t.ms / step_ms,
               tflops >= 1 ? fmt::format("{:.1f}", tflops) : tflops > 0 ? fmt::format("{:.2g}", tflops) : "",
               t.host_ms);
    by_kind[kind_of(t.op)] += t.ms;
    if (t.op == OpId::matmul) gemm_ms += t.ms, gemm_flops += t.flops;
    nlohmann::json k = {{"kernel", t.name}, {"op", op_name(t.op)}, {"calls", t.calls}, {"ms", t.ms},
                        {"host_ms", t.host_ms}};
    if (tflops > 0) k["tflops"] = tflops;
    kernels.push_back(k);
  }
  std::string kinds;
  for (const auto& [kind, ms] : by_kind) kinds += fmt::format("{} {:.1f} ms ({:.1f}%), ", kind, ms, 100.0 * ms / step_ms);
  fmt::print("  by kind: {}not in any kernel {:.1f} ms ({:.1f}%)\n", kinds, gaps, 100.0 * gaps / step_ms);
  if (gemm_ms > 0) {
    // Bounds if everything but the GEMMs (and the attention kernels) took no time; the MFU counts the model's FLOPs,
    // attention included, so only the second bound has one.
    const double attn_ms = by_kind.count("attention") ? by_kind["attention"] : 0.0;
    fmt::print("  bounds: the GEMMs alone take {:.1f} ms at their measured {:.3g} TFLOP/s -> {} tokens/s; GEMMs + attention "
               "kernels {:.1f} ms -> {} tokens/s{}\n",
               gemm_ms, gemm_flops / (gemm_ms * 1e-3) / 1e12, human(tokens / (gemm_ms * 1e-3)), gemm_ms + attn_ms,
               human(tokens / ((gemm_ms + attn_ms) * 1e-3)),
               peak > 0 ? fmt::format(", MFU {:.1f}%", 100.0 * flops_per_step / ((gemm_ms + attn_ms) * 1e-3) / peak) : "");
    fmt::print("  matmul shapes (M x N x K, layout of A and B: n/t), largest first:\n");
    for (size_t i = 0; i < std::min<size_t>(24, p.matmul_shapes.size()); ++i) {
      const OpProfiler::Total& t = p.matmul_shapes[i];
      const double tf = t.ms > 0 ? t.flops / (t.ms * 1e-3) / 1e12 : 0.0;
      fmt::print("    {:<36} {:>7} {:>10.3f} {:>7.2f} {:>9}\n", t.name, t.calls, t.ms, 100.0 * t.ms / step_ms,
                 tf >= 1 ? fmt::format("{:.1f}", tf) : fmt::format("{:.2g}", tf));
    }
  }
  // Where the time outside the kernels sits: between which two timed ops (largest first).
  nlohmann::json between = nlohmann::json::array();
  double between_ms = 0;
  for (const OpProfiler::Total& t : p.gaps) between_ms += t.ms;
  if (!p.gaps.empty())
    fmt::print("  between timed ops {:.2f} ms of the {:.2f} ms outside them; largest, by the kernels around them:\n",
               between_ms, gaps);
  for (size_t i = 0; i < std::min<size_t>(8, p.gaps.size()); ++i) {
    const OpProfiler::Total& t = p.gaps[i];
    fmt::print("    {:<72} {:>5} x {:>8.3f} ms\n", t.name, t.calls, t.ms);
    between.push_back({{"between", t.name}, {"count", t.calls}, {"ms", t.ms}});
  }
  if (!p.composites.empty()) {
    std::string c;
    for (const auto& [name, calls] : p.composites) c += fmt::format("{}{} x{}", c.empty() ? "" : ", ", name, calls);
    fmt::print("  composites run (their time is in the kernels they call): {}\n", c);
  }
  return {{"step_ms", step_ms}, {"kernels_ms", p.kernels_ms}, {"span_ms", p.span_ms}, {"gaps_ms", gaps}, {"calls", p.calls},
          {"gemm_ms", gemm_ms}, {"by_kind", by_kind}, {"kernels", kernels}, {"between_ops", between}};
}


}  // namespace lathe
