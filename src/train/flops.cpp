#include "train/flops.h"

#include <fmt/format.h>

#include <sys/resource.h>

#include <algorithm>

namespace lathe {

namespace {

// The matrix parameters one token goes through in the MLP of layer i: a dense SwiGLU, or the router, k of the experts
// and the shared expert with its gate.
double active_mlp_parameters(const ModelConfig& c, int64_t i) {
  const double h = double(c.hidden_size);
  if (!c.sparse_layer(i)) return 3 * h * double(c.intermediate_size);
  return h * double(c.num_experts) + 3 * h * double(c.num_experts_per_tok * c.moe_intermediate_size) +
         (c.shared_expert_intermediate_size > 0 ? 3 * h * double(c.shared_expert_intermediate_size) + h : 0.0);
}

bool gdn_layer(const ModelConfig& c, int64_t i) {
  return c.is_hybrid() && c.layer_types[size_t(i)] == "linear_attention";
}

// The matrix parameters one token goes through in layer i: its projections and its MLP's active ones.
double layer_matmul_parameters(const ModelConfig& c, int64_t i) {
  const double h = double(c.hidden_size), d = double(c.head_dim);
  double n = active_mlp_parameters(c, i);
  if (gdn_layer(c, i)) {
    const double kd = double(c.linear_num_key_heads * c.linear_key_head_dim);
    const double vd = double(c.linear_num_value_heads * c.linear_value_head_dim);
    n += h * (2 * kd + vd + vd + 2.0 * double(c.linear_num_value_heads)) + vd * h;
  } else {
    const double q_out = double((c.is_hybrid() ? 2 : 1) * c.num_heads) * d;  // hybrids gate: query + gate
    n += h * q_out + h * d * double(2 * c.num_kv_heads) + double(c.num_heads) * d * h;
  }
  return n;
}

// One Gated DeltaNet layer's chunked core, forward + backward, per token.
double gdn_layer_core_flops(const ModelConfig& c) {
  const double dk = double(c.linear_key_head_dim), dv = double(c.linear_value_head_dim), ch = 64.0;
  const double fwd = 6 * dk * dv + 6 * ch * dk + 4 * ch * dv;
  const double bwd = 16 * dk * dv + 18 * ch * dk + 10 * ch * dv + 4 * ch * ch;
  return double(c.linear_num_value_heads) * (fwd + bwd);
}

}  // namespace

double matmul_parameter_count(const ModelConfig& c) {
  // The matrices a token goes through: projections, MLPs (the active experts only) and the LM head (once, tied or not).
  double n = double(c.vocab_size) * double(c.hidden_size);
  for (int64_t i = 0; i < c.num_layers; ++i) n += layer_matmul_parameters(c, i);
  return n;
}

std::vector<double> layer_flops_per_token(const ModelConfig& c, int64_t document_tokens) {
  std::vector<double> f;
  for (int64_t i = 0; i < c.num_layers; ++i)
    f.push_back(6.0 * layer_matmul_parameters(c, i) +
                (gdn_layer(c, i) ? gdn_layer_core_flops(c)
                                 : 6.0 * double(c.num_heads * c.head_dim) * double(document_tokens)));
  if (!f.empty()) f.back() += 6.0 * double(c.vocab_size) * double(c.hidden_size);  // the LM head, on the last stage
  return f;
}

double attention_flops_per_token(const ModelConfig& c, const std::vector<int32_t>& cu_seqlens) {
  double sq = 0;
  for (size_t i = 0; i + 1 < cu_seqlens.size(); ++i) sq += double(cu_seqlens[i + 1] - cu_seqlens[i]) * (cu_seqlens[i + 1] - cu_seqlens[i]);
  const double tokens = cu_seqlens.empty() ? 0.0 : double(cu_seqlens.back() - cu_seqlens.front());
  int64_t attention_layers = c.num_layers;
  if (c.is_hybrid()) attention_layers = std::count(c.layer_types.begin(), c.layer_types.end(), "full_attention");
  return 6.0 * double(attention_layers * c.num_heads * c.head_dim) * sq / std::max<double>(1, tokens);
}

double gdn_core_flops_per_token(const ModelConfig& c) {
  if (!c.is_hybrid()) return 0.0;
  const int64_t gdn_layers = std::count(c.layer_types.begin(), c.layer_types.end(), "linear_attention");
  return double(gdn_layers) * gdn_layer_core_flops(c);
}

double flops_per_token(const ModelConfig& c, const std::vector<int32_t>& cu_seqlens) {
  return 6.0 * matmul_parameter_count(c) + attention_flops_per_token(c, cu_seqlens) + gdn_core_flops_per_token(c);
}

double lora_flops_per_token(const ModelConfig& c, double adapter_parameters, const std::vector<int32_t>& cu_seqlens) {
  return 4.0 * matmul_parameter_count(c) + 6.0 * adapter_parameters + attention_flops_per_token(c, cu_seqlens) +
         gdn_core_flops_per_token(c);
}

double peak_flops(const std::string& device_name) {
  if (device_name.find("H100") != std::string::npos || device_name.find("H200") != std::string::npos) return 989e12;
  return 0;
}

double peak_memory_mib(Runtime& rt, Device device) {
  if (device.is_cuda()) return double(rt.backend(device.type).allocator(device.index).stats().peak_allocated) / 1048576.0;
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;
}

int64_t cache_flushes(Runtime& rt, Device device) {
  return device.is_cuda() ? rt.backend(device.type).allocator(device.index).stats().num_cache_flushes : 0;
}

std::string human(double x) {
  if (x >= 1e9) return fmt::format("{:.2f}G", x / 1e9);
  if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f}k", x / 1e3);
  return fmt::format("{:.0f}", x);
}

}  // namespace lathe
