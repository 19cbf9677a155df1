#include "model/config.h"

#include <algorithm>
#include <fstream>

#include "core/error.h"

namespace lathe {

namespace {

int64_t get_int(const nlohmann::json& j, const char* key, const std::string& src, int64_t fallback = -1) {
  if (!j.contains(key) || j[key].is_null()) {
    LATHE_CHECK(fallback >= 0, "config: {}: missing required field '{}'", src, key);
    return fallback;
  }
  LATHE_CHECK(j[key].is_number_integer() && j[key].get<int64_t>() > 0, "config: {}: field '{}' must be a positive integer, got {}",
              src, key, j[key].dump());
  return j[key].get<int64_t>();
}

double get_number(const nlohmann::json& j, const char* key, const std::string& src, double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  LATHE_CHECK(j[key].is_number(), "config: {}: field '{}' must be a number, got {}", src, key, j[key].dump());
  return j[key].get<double>();
}

bool get_bool(const nlohmann::json& j, const char* key, const std::string& src, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  LATHE_CHECK(j[key].is_boolean(), "config: {}: field '{}' must be true or false, got {}", src, key, j[key].dump());
  return j[key].get<bool>();
}

// rope_theta at top level, or in rope_parameters (transformers 5) or rope_scaling; only the default rope type.
double rope_theta(const nlohmann::json& j, const std::string& src) {
  double theta = get_number(j, "rope_theta", src, -1.0);
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    const nlohmann::json& p = j[key];
    LATHE_CHECK(p.is_object(), "config: {}: field '{}' must be an object", src, key);
    const std::string type = p.value("rope_type", p.value("type", std::string("default")));
    LATHE_CHECK(type == "default", "config: {}: {}.rope_type '{}' is not supported (only 'default' rotary embeddings)", src,
                key, type);
    for (const auto& [k, v] : p.items())
      LATHE_CHECK(k == "rope_type" || k == "type" || k == "rope_theta", "config: {}: {}.{} is not supported", src, key, k);
    if (p.contains("rope_theta")) {
      const double t = get_number(p, "rope_theta", src + " " + key, -1.0);
      LATHE_CHECK(theta < 0 || theta == t, "config: {}: rope_theta {} and {}.rope_theta {} disagree", src, theta, key, t);
      theta = t;
    }
  }
  return theta > 0 ? theta : 10000.0;
}

}  // namespace

bool ModelConfig::sparse_layer(int64_t i) const {
  return num_experts > 0 && std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) == mlp_only_layers.end() &&
         (i + 1) % decoder_sparse_step == 0;
}

void parse_moe_fields(const nlohmann::json& j, const std::string& src, ModelConfig& c, bool default_norm,
                      bool forced_norm, bool shared) {
  const char* experts_key = j.contains("num_local_experts") && !j.contains("num_experts") ? "num_local_experts"
                                                                                          : "num_experts";
  c.num_experts = get_int(j, experts_key, src);
  c.num_experts_per_tok = get_int(j, "num_experts_per_tok", src);
  c.moe_intermediate_size = get_int(j, "moe_intermediate_size", src);
  LATHE_CHECK(c.num_experts_per_tok <= c.num_experts, "config: {}: num_experts_per_tok {} exceeds num_experts {}", src,
              c.num_experts_per_tok, c.num_experts);
  c.decoder_sparse_step = get_int(j, "decoder_sparse_step", src, 1);
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    const nlohmann::json& m = j["mlp_only_layers"];
    LATHE_CHECK(m.is_array(), "config: {}: mlp_only_layers must be a list of layer indices", src);
    for (const auto& v : m) {
      LATHE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < c.num_layers,
                  "config: {}: mlp_only_layers entry {} is not a layer index in [0, {})", src, v.dump(), c.num_layers);
      c.mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  c.norm_topk_prob = get_bool(j, "norm_topk_prob", src, default_norm);
  LATHE_CHECK(!forced_norm || c.norm_topk_prob, "config: {}: norm_topk_prob=false is not what this family computes "
              "(its router always renormalises the top-k weights)", src);
  c.router_aux_loss_coef = get_number(j, "router_aux_loss_coef", src, 0.001);
  c.output_router_logits = get_bool(j, "output_router_logits", src, false);
  if (shared) {
    c.shared_expert_intermediate_size = get_int(j, "shared_expert_intermediate_size", src);
  } else {
    LATHE_CHECK(!j.contains("shared_expert_intermediate_size") || j["shared_expert_intermediate_size"].is_null() ||
                    j["shared_expert_intermediate_size"] == 0,
                "config: {}: shared_expert_intermediate_size is not part of {} models", src, c.model_type);
  }
  for (int64_t i = 0; i < c.num_layers; ++i)
    if (!c.sparse_layer(i)) {
      LATHE_CHECK(c.intermediate_size > 0, "config: {}: layer {} has a dense MLP (mlp_only_layers / "
                  "decoder_sparse_step) but intermediate_size is missing", src, i);
    }
}

int64_t ModelConfig::rotary_dim() const {
  const int64_t r = int64_t(double(head_dim) * partial_rotary_factor);
  return r - r % 2;
}

int64_t ModelConfig::layer_parameter_count(int64_t i) const {
  // The MLP: a dense SwiGLU, or the router, the experts and the shared expert with its gate; two norms.
  int64_t n = 2 * hidden_size;
  if (!sparse_layer(i)) {
    n += 3 * hidden_size * intermediate_size;
  } else {
    n += num_experts * hidden_size + 3 * num_experts * hidden_size * moe_intermediate_size;
    if (shared_expert_intermediate_size > 0) n += 3 * hidden_size * shared_expert_intermediate_size + hidden_size;
  }
  if (is_hybrid() && layer_types[size_t(i)] != "full_attention") {  // Gated DeltaNet
    const int64_t kd = linear_num_key_heads * linear_key_head_dim, vd = linear_num_value_heads * linear_value_head_dim;
    const int64_t conv = 2 * kd + vd;
    return n + hidden_size * (conv + vd + 2 * linear_num_value_heads) + conv * linear_conv_kernel_dim +
           2 * linear_num_value_heads + linear_value_head_dim + vd * hidden_size;
  }
  const int64_t q_rows = (is_hybrid() ? 2 : 1) * num_heads;  // the hybrids' q_proj holds query and gate
  return n + hidden_size * head_dim * (q_rows + 2 * num_kv_heads) + num_heads * head_dim * hidden_size + 2 * head_dim;
}

int64_t ModelConfig::parameter_count() const {
  int64_t n = vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2) + hidden_size;  // embedding, head, final norm
  for (int64_t i = 0; i < num_layers; ++i) n += layer_parameter_count(i);
  return n;
}

ModelConfig parse_model_config(const nlohmann::json& j, const std::string& src) {
  LATHE_CHECK(j.is_object(), "config: {}: expected a JSON object", src);
  ModelConfig c;
  c.raw = j;
  LATHE_CHECK(j.contains("model_type") && j["model_type"].is_string(), "config: {}: missing 'model_type'", src);
  c.model_type = j["model_type"].get<std::string>();
  for (const char* hybrid : {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"})
    if (c.model_type == hybrid) return parse_qwen3_5_config(j, src);
  LATHE_CHECK(c.model_type == "qwen3" || c.model_type == "qwen3_moe",
              "config: {}: model_type '{}' is not supported (supported: qwen3, qwen3_moe, qwen3_5, qwen3_5_text, "
              "qwen3_5_moe, qwen3_5_moe_text, qwen3_next)", src, c.model_type);
  const bool moe = c.model_type == "qwen3_moe";
  c.vocab_size = get_int(j, "vocab_size", src);
  c.hidden_size = get_int(j, "hidden_size", src);
  c.intermediate_size = get_int(j, "intermediate_size", src, moe ? 0 : -1);
  c.num_layers = get_int(j, "num_hidden_layers", src);
  c.num_heads = get_int(j, "num_attention_heads", src);
  c.num_kv_heads = get_int(j, "num_key_value_heads", src, c.num_heads);
  LATHE_CHECK(c.hidden_size % c.num_heads == 0 || j.contains("head_dim"),
              "config: {}: hidden_size {} is not a multiple of num_attention_heads {} and no head_dim is given", src,
              c.hidden_size, c.num_heads);
  c.head_dim = get_int(j, "head_dim", src, c.hidden_size / c.num_heads);
  LATHE_CHECK(c.num_heads % c.num_kv_heads == 0, "config: {}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
              src, c.num_heads, c.num_kv_heads);
  LATHE_CHECK(c.head_dim % 2 == 0, "config: {}: head_dim {} must be even for rotary embeddings", src, c.head_dim);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", src, 32768);
  c.rms_norm_eps = get_number(j, "rms_norm_eps", src, 1e-6);
  c.rope_theta = rope_theta(j, src);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", src, false);
  LATHE_CHECK(!get_bool(j, "attention_bias", src, false), "config: {}: attention_bias=true is not supported for qwen3", src);
  LATHE_CHECK(!get_bool(j, "use_sliding_window", src, false), "config: {}: use_sliding_window=true is not supported", src);
  const std::string act = j.value("hidden_act", std::string("silu"));
  LATHE_CHECK(act == "silu", "config: {}: hidden_act '{}' is not supported (only silu)", src, act);
  if (moe) {
    parse_moe_fields(j, src, c, /*default_norm=*/false, /*forced_norm=*/false, /*shared=*/false);
  } else {
    for (const char* key : {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size"})
      LATHE_CHECK(!j.contains(key) || j[key].is_null() || j[key] == 0, "config: {}: {} = {} in a dense qwen3 config "
                  "(mixture-of-experts checkpoints have model_type qwen3_moe)", src, key, j[key].dump());
  }
  return c;
}

ModelConfig load_model_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream f(path);
  LATHE_CHECK(f.good(), "config: cannot open {}", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    LATHE_FAIL("config: {} is not valid JSON: {}", path, e.what());
  }
  return parse_model_config(j, path);
}

}  // namespace lathe
