#include "train/flops.h"

#include <sys/resource.h>

#include <algorithm>

namespace lathe {

double matmul_parameter_count(const ModelConfig& c) {
  if (c.is_qwen3_5()) {  // the matrices only: projections, MLPs and the LM head (once, tied or not)
    const double h = double(c.hidden_size), d = double(c.head_dim);
    const double kd = double(c.linear_num_key_heads * c.linear_key_head_dim);
    const double vd = double(c.linear_num_value_heads * c.linear_value_head_dim);
    const double attn = h * d * double(2 * c.num_heads + 2 * c.num_kv_heads) + double(c.num_heads) * d * h;
    const double gdn = h * (2 * kd + vd + vd + 2.0 * double(c.linear_num_value_heads)) + vd * h;
    double n = double(c.vocab_size) * h;
    for (const std::string& t : c.layer_types) n += (t == "full_attention" ? attn : gdn) + 3 * h * double(c.intermediate_size);
    return n;
  }
  return double(c.parameter_count()) - double(c.vocab_size * c.hidden_size) * (c.tie_word_embeddings ? 0 : 1) -
         double(c.num_layers * (2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size);
}

double attention_flops_per_token(const ModelConfig& c, const std::vector<int32_t>& cu_seqlens) {
  double sq = 0;
  for (size_t i = 0; i + 1 < cu_seqlens.size(); ++i) sq += double(cu_seqlens[i + 1] - cu_seqlens[i]) * (cu_seqlens[i + 1] - cu_seqlens[i]);
  const double tokens = cu_seqlens.empty() ? 0.0 : double(cu_seqlens.back() - cu_seqlens.front());
  int64_t attention_layers = c.num_layers;
  if (c.is_qwen3_5()) attention_layers = std::count(c.layer_types.begin(), c.layer_types.end(), "full_attention");
  return 6.0 * double(attention_layers * c.num_heads * c.head_dim) * sq / std::max<double>(1, tokens);
}

double gdn_core_flops_per_token(const ModelConfig& c) {
  if (!c.is_qwen3_5()) return 0.0;
  const double dk = double(c.linear_key_head_dim), dv = double(c.linear_value_head_dim), ch = 64.0;
  const double fwd = 6 * dk * dv + 6 * ch * dk + 4 * ch * dv;
  const double bwd = 16 * dk * dv + 18 * ch * dk + 10 * ch * dv + 4 * ch * ch;
  const int64_t gdn_layers = std::count(c.layer_types.begin(), c.layer_types.end(), "linear_attention");
  return double(gdn_layers * c.linear_num_value_heads) * (fwd + bwd);
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

}  // namespace lathe
