#include "train/flops.h"

#include <sys/resource.h>

#include <algorithm>

namespace lathe {

double matmul_parameter_count(const ModelConfig& c) {
  return double(c.parameter_count()) - double(c.vocab_size * c.hidden_size) * (c.tie_word_embeddings ? 0 : 1) -
         double(c.num_layers * (2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size);
}

double attention_flops_per_token(const ModelConfig& c, const std::vector<int32_t>& cu_seqlens) {
  double sq = 0;
  for (size_t i = 0; i + 1 < cu_seqlens.size(); ++i) sq += double(cu_seqlens[i + 1] - cu_seqlens[i]) * (cu_seqlens[i + 1] - cu_seqlens[i]);
  const double tokens = cu_seqlens.empty() ? 0.0 : double(cu_seqlens.back() - cu_seqlens.front());
  return 6.0 * double(c.num_layers * c.num_heads * c.head_dim) * sq / std::max<double>(1, tokens);
}

double flops_per_token(const ModelConfig& c, const std::vector<int32_t>& cu_seqlens) {
  return 6.0 * matmul_parameter_count(c) + attention_flops_per_token(c, cu_seqlens);
}

double lora_flops_per_token(const ModelConfig& c, double adapter_parameters, const std::vector<int32_t>& cu_seqlens) {
  return 4.0 * matmul_parameter_count(c) + 6.0 * adapter_parameters + attention_flops_per_token(c, cu_seqlens);
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
