// Qwen3.5 text configs: model_type "qwen3_5_text" (Qwen3_5ForCausalLM, weights under model.*) and "qwen3_5" (the
// multimodal release, Qwen3_5ForConditionalGeneration: the text stack is its "text_config", weights under
// model.language_model.*, the vision tower is skipped). Defaults are those of transformers' Qwen3_5TextConfig
// (head_dim 256, partial_rotary_factor 0.25, layer_types from full_attention_interval 4, ...).
// Convention: a field that changes the maths and is not implemented is refused by name; a field that is read but
// not used (MTP heads, the vision tower, cache dtypes, unknown keys) is added to ModelConfig::notes, which the
// loaders print — never dropped silently.
// Covered by tests/models/test_qwen3_5.cpp.
#include <algorithm>
#include <set>

#include "core/error.h"
#include "model/config.h"

namespace lathe {

namespace {

int64_t int_field(const nlohmann::json& j, const char* key, const std::string& src, int64_t fallback) {
  if (!j.contains(key) || j[key].is_null()) {
    LATHE_CHECK(fallback >= 0, "config: {}: missing required field '{}'", src, key);
    return fallback;
  }
  LATHE_CHECK(j[key].is_number_integer() && j[key].get<int64_t>() > 0,
              "config: {}: field '{}' must be a positive integer, got {}", src, key, j[key].dump());
  return j[key].get<int64_t>();
}

double number_field(const nlohmann::json& j, const char* key, const std::string& src, double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  LATHE_CHECK(j[key].is_number(), "config: {}: field '{}' must be a number, got {}", src, key, j[key].dump());
  return j[key].get<double>();
}

bool has(const nlohmann::json& j, const char* key) { return j.contains(key) && !j[key].is_null(); }

// Keys that carry no maths for training or scoring (metadata, token ids, inference-only switches).
const std::set<std::string> kInert = {
    "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
    "transformers_version", "use_cache", "initializer_range", "max_position_embeddings", "_name_or_path",
    "model_type", "output_attentions", "output_hidden_states", "return_dict", "tie_word_embeddings",
    "keys_to_ignore_at_inference", "is_encoder_decoder", "chunk_size_feed_forward", "problem_type", "id2label",
    "label2id", "base_config_key", "_attn_implementation_autoset"};

// Keys this parser reads (the others fall to a note).
const std::set<std::string> kRead = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
    "partial_rotary_factor", "attention_bias", "attention_dropout", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "layer_types",
    "full_attention_interval", "attn_output_gate", "output_gate_type", "mamba_ssm_dtype", "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings", "mlp_only_layers", "use_sliding_window", "sliding_window", "max_window_layers",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "decoder_sparse_step", "norm_topk_prob", "router_aux_loss_coef", "output_router_logits"};

// theta and partial_rotary_factor from rope_parameters / rope_scaling and the legacy top-level keys.
void parse_rope(const nlohmann::json& j, const std::string& src, ModelConfig& c) {
  double theta = number_field(j, "rope_theta", src, -1.0);
  double factor = number_field(j, "partial_rotary_factor", src, -1.0);
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!has(j, key)) continue;
    const nlohmann::json& p = j[key];
    LATHE_CHECK(p.is_object(), "config: {}: field '{}' must be an object", src, key);
    const std::string type = p.value("rope_type", p.value("type", std::string("default")));
    LATHE_CHECK(type == "default", "config: {}: {}.rope_type '{}' is not supported (only 'default' rotary embeddings)",
                src, key, type);
    for (const auto& [k, v] : p.items()) {
      if (k == "rope_type" || k == "type") continue;
      if (k == "rope_theta") {
        const double t = number_field(p, "rope_theta", src + " " + key, -1.0);
        LATHE_CHECK(theta < 0 || theta == t, "config: {}: rope_theta {} and {}.rope_theta {} disagree", src, theta, key, t);
        theta = t;
      } else if (k == "partial_rotary_factor") {
        const double f = number_field(p, "partial_rotary_factor", src + " " + key, -1.0);
        LATHE_CHECK(factor < 0 || factor == f, "config: {}: partial_rotary_factor {} and {}.partial_rotary_factor {} disagree",
                    src, factor, key, f);
        factor = f;
      } else if (k == "mrope_section" || k == "mrope_interleaved") {
        c.notes.push_back(fmt::format("{}.{} (multimodal RoPE) does not change text-only positions: all three "
                                      "position streams are equal", key, k));
      } else {
        LATHE_FAIL("config: {}: {}.{} is not supported", src, key, k);
      }
    }
  }
  if (theta <= 0) {
    theta = 10000.0;
    c.notes.push_back("no rope_theta given: 10000");
  }
  c.rope_theta = theta;
  c.partial_rotary_factor = factor < 0 ? 0.25 : factor;  // transformers' default for qwen3_5
  LATHE_CHECK(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1,
              "config: {}: partial_rotary_factor {} must lie in (0, 1]", src, c.partial_rotary_factor);
}

// `type`: qwen3_5_text, qwen3_5_moe_text or qwen3_next (the text stack's model_type).
ModelConfig parse_text(const nlohmann::json& j, const std::string& src, const std::string& type) {
  LATHE_CHECK(j.is_object(), "config: {}: expected a JSON object", src);
  ModelConfig c;
  c.model_type = type;
  const bool dense = type == "qwen3_5_text";
  c.vocab_size = int_field(j, "vocab_size", src, -1);
  c.hidden_size = int_field(j, "hidden_size", src, -1);
  c.intermediate_size = int_field(j, "intermediate_size", src, dense ? -1 : 0);
  c.num_layers = int_field(j, "num_hidden_layers", src, -1);
  c.num_heads = int_field(j, "num_attention_heads", src, -1);
  c.num_kv_heads = int_field(j, "num_key_value_heads", src, 4);
  c.head_dim = int_field(j, "head_dim", src, 256);
  c.max_position_embeddings = int_field(j, "max_position_embeddings", src, 32768);
  c.rms_norm_eps = number_field(j, "rms_norm_eps", src, 1e-6);
  c.linear_conv_kernel_dim = int_field(j, "linear_conv_kernel_dim", src, 4);
  c.linear_key_head_dim = int_field(j, "linear_key_head_dim", src, 128);
  c.linear_value_head_dim = int_field(j, "linear_value_head_dim", src, 128);
  c.linear_num_key_heads = int_field(j, "linear_num_key_heads", src, 16);
  c.linear_num_value_heads = int_field(j, "linear_num_value_heads", src, 32);
  c.attn_output_gate = true;
  parse_rope(j, src, c);

  LATHE_CHECK(c.num_heads % c.num_kv_heads == 0, "config: {}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
              src, c.num_heads, c.num_kv_heads);
  LATHE_CHECK(c.linear_num_value_heads % c.linear_num_key_heads == 0,
              "config: {}: linear_num_value_heads {} is not a multiple of linear_num_key_heads {}", src,
              c.linear_num_value_heads, c.linear_num_key_heads);
  const int64_t rot = c.rotary_dim();
  LATHE_CHECK(int64_t(double(c.head_dim) * c.partial_rotary_factor) % 2 == 0 && rot >= 2,
              "config: {}: head_dim {} x partial_rotary_factor {} must give an even number >= 2 of rotary channels", src,
              c.head_dim, c.partial_rotary_factor);

  // layer_types, or derived from full_attention_interval as transformers does.
  const int64_t interval = has(j, "full_attention_interval") ? int_field(j, "full_attention_interval", src, 4) : 4;
  if (has(j, "layer_types")) {
    LATHE_CHECK(j["layer_types"].is_array() && int64_t(j["layer_types"].size()) == c.num_layers,
                "config: {}: layer_types must be a list of num_hidden_layers = {} entries", src, c.num_layers);
    for (const auto& t : j["layer_types"]) {
      LATHE_CHECK(t.is_string() && (t == "linear_attention" || t == "full_attention"),
                  "config: {}: layer_types entry {} is not supported (linear_attention or full_attention)", src, t.dump());
      c.layer_types.push_back(t.get<std::string>());
    }
    if (has(j, "full_attention_interval"))
      for (int64_t i = 0; i < c.num_layers; ++i)
        if ((c.layer_types[size_t(i)] == "full_attention") != ((i + 1) % interval == 0)) {
          c.notes.push_back(fmt::format("layer_types disagrees with full_attention_interval {} (layer {}); layer_types "
                                        "is used, as transformers does", interval, i));
          break;
        }
  } else {
    for (int64_t i = 0; i < c.num_layers; ++i)
      c.layer_types.push_back((i + 1) % interval == 0 ? "full_attention" : "linear_attention");
  }

  // Refused: what the qwen3_5 text model does not compute.
  const std::string act = j.value("hidden_act", std::string("silu"));
  LATHE_CHECK(act == "silu", "config: {}: hidden_act '{}' is not supported (only silu)", src, act);
  LATHE_CHECK(!(has(j, "attention_bias") && j["attention_bias"] != false),
              "config: {}: attention_bias={} is not supported for qwen3_5", src, j.value("attention_bias", nlohmann::json()).dump());
  LATHE_CHECK(number_field(j, "attention_dropout", src, 0.0) == 0.0, "config: {}: attention_dropout != 0 is not supported",
              src);
  LATHE_CHECK(!(has(j, "attn_output_gate") && j["attn_output_gate"] != true),
              "config: {}: attn_output_gate={} is not supported (the qwen3_5 attention always gates its output)", src,
              j.value("attn_output_gate", nlohmann::json()).dump());
  if (has(j, "output_gate_type")) {
    const nlohmann::json& t = j["output_gate_type"];
    LATHE_CHECK(t == "swish" || t == "silu", "config: {}: output_gate_type {} is not supported (only swish)", src, t.dump());
  }
  LATHE_CHECK(!(has(j, "use_sliding_window") && j["use_sliding_window"] != false),
              "config: {}: use_sliding_window is not supported", src);
  if (dense) {
    for (const char* moe : {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"})
      LATHE_CHECK(!has(j, moe) || (j[moe].is_number() && j[moe].get<double>() == 0),
                  "config: {}: {} = {} in a dense qwen3_5 config (mixture-of-experts checkpoints have model_type "
                  "qwen3_5_moe)", src, moe, j[moe].dump());
  } else if (type == "qwen3_next") {
    parse_moe_fields(j, src, c, /*default_norm=*/true, /*forced_norm=*/false, /*shared=*/true);
    c.fused_gdn_projections = true;
  } else {
    // Qwen3.5-MoE: every layer is sparse and the router always renormalises (transformers reads neither
    // decoder_sparse_step nor mlp_only_layers nor norm_topk_prob for this family).
    nlohmann::json moe = j;
    for (const char* k : {"decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"})
      if (has(moe, k)) {
        c.notes.push_back(fmt::format("{} = {}: not read for qwen3_5_moe (every layer is sparse, the top-k weights are "
                                      "always renormalised, as in transformers)", k, moe[k].dump()));
        moe.erase(k);
      }
    parse_moe_fields(moe, src, c, /*default_norm=*/true, /*forced_norm=*/true, /*shared=*/true);
  }

  // Reported: read, not used.
  if (has(j, "mtp_num_hidden_layers") && j["mtp_num_hidden_layers"] != 0)
    c.notes.push_back(fmt::format("mtp_num_hidden_layers = {}: the multi-token-prediction head (mtp.* tensors) is not "
                                  "trained or used; its tensors are skipped", j["mtp_num_hidden_layers"].dump()));
  if (has(j, "mtp_use_dedicated_embeddings"))
    c.notes.push_back(fmt::format("mtp_use_dedicated_embeddings = {}: concerns the unused MTP head",
                                  j["mtp_use_dedicated_embeddings"].dump()));
  if (has(j, "mamba_ssm_dtype"))
    c.notes.push_back(fmt::format("mamba_ssm_dtype = {}: a generation-cache dtype; training keeps the GDN state in the "
                                  "activation dtype's accumulator (f32/f64)", j["mamba_ssm_dtype"].dump()));
  if (dense && has(j, "mlp_only_layers") && !(j["mlp_only_layers"].is_array() && j["mlp_only_layers"].empty()))
    c.notes.push_back("mlp_only_layers: every layer of the dense qwen3_5 model has a dense MLP already");
  for (const char* k : {"decoder_sparse_step", "norm_topk_prob", "router_aux_loss_coef", "output_router_logits"})
    if (dense && has(j, k)) c.notes.push_back(fmt::format("{} = {}: has no effect without MoE", k, j[k].dump()));
  for (const char* k : {"sliding_window", "max_window_layers"})
    if (has(j, k)) c.notes.push_back(fmt::format("{} = {}: has no effect without sliding windows", k, j[k].dump()));
  for (const auto& [k, v] : j.items())
    if (!kInert.count(k) && !kRead.count(k) && !v.is_null())
      c.notes.push_back(fmt::format("unknown field '{}' = {} is ignored", k, v.dump().substr(0, 60)));
  return c;
}

}  // namespace

ModelConfig parse_qwen3_5_config(const nlohmann::json& j, const std::string& src) {
  const std::string type = j.value("model_type", std::string());
  ModelConfig c;
  if (type == "qwen3_5" || type == "qwen3_5_moe") {
    LATHE_CHECK(j.contains("text_config") && j["text_config"].is_object(),
                "config: {}: a {} (multimodal) config needs a 'text_config' object", src, type);
    const nlohmann::json& t = j["text_config"];
    const std::string want = type + "_text";
    const std::string inner = t.value("model_type", want);
    LATHE_CHECK(inner == want, "config: {}: text_config.model_type '{}' is not supported (expected {})", src, inner,
                want);
    c = parse_text(t, src + " text_config", want);
    const bool top = has(j, "tie_word_embeddings"), inside = has(t, "tie_word_embeddings");
    LATHE_CHECK(!(top && inside && j["tie_word_embeddings"] != t["tie_word_embeddings"]),
                "config: {}: tie_word_embeddings {} and text_config.tie_word_embeddings {} disagree", src,
                j["tie_word_embeddings"].dump(), t.value("tie_word_embeddings", nlohmann::json()).dump());
    const nlohmann::json& tie = top ? j["tie_word_embeddings"] : inside ? t["tie_word_embeddings"] : nlohmann::json(false);
    LATHE_CHECK(tie.is_boolean(), "config: {}: tie_word_embeddings must be true or false, got {}", src, tie.dump());
    c.tie_word_embeddings = tie.get<bool>();
    c.multimodal_layout = true;
    c.notes.push_back("multimodal checkpoint: the text model is used (model.language_model.*); the vision tower "
                      "(vision_config, model.visual.* tensors) is skipped");
    for (const auto& [k, v] : j.items())
      if (k != "text_config" && k != "vision_config" && !kInert.count(k) && k.find("token_id") == std::string::npos &&
          !v.is_null())
        c.notes.push_back(fmt::format("unknown top-level field '{}' is ignored", k));
  } else {
    LATHE_CHECK(type == "qwen3_5_text" || type == "qwen3_5_moe_text" || type == "qwen3_next",
                "config: {}: model_type '{}' is not a qwen3_5 type", src, type);
    c = parse_text(j, src, type);
    const nlohmann::json tie = j.value("tie_word_embeddings", nlohmann::json(false));
    LATHE_CHECK(tie.is_boolean(), "config: {}: tie_word_embeddings must be true or false, got {}", src, tie.dump());
    c.tie_word_embeddings = tie.get<bool>();
  }
  c.raw = j;
  return c;
}

}  // namespace lathe
