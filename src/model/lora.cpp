#include "model/lora.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <regex>
#include <set>

#include <fmt/ranges.h>

#include "comm/communicator.h"
#include "core/files.h"
#include "io/safetensors.h"
#include "ops/ops.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The key PEFT saves for the A or B matrix of (layer, t). An expert parameter's wrapper sits on the experts module;
// peft wraps the targeted parameters in registration order (gate_up_proj, then down_proj), each new wrapper around
// the previous one, so gate_up_proj's matrices carry one ".base_layer" when down_proj is adapted too.
std::string peft_key(const LoraConfig& c, const ModelConfig& model, int64_t layer, LoraTarget t, const char* ab) {
  std::string module = lora_module_name(model, layer, t);
  if (lora_target_is_expert(t)) {
    module = module.substr(0, module.rfind('.'));  // "...mlp.experts"
    if (t == LoraTarget::experts_gate_up && c.targets_module(model, layer, LoraTarget::experts_down))
      module += ".base_layer";
  }
  return fmt::format("base_model.model.{}.lora_{}.weight", module, ab);
}

bool is_gdn(LoraTarget t) { return int(t) >= int(LoraTarget::in_proj_qkv) && int(t) <= int(LoraTarget::in_proj_ba); }
bool is_attention(LoraTarget t) { return int(t) <= int(LoraTarget::o_proj); }

// The model types whose MLP names peft 0.21 re-maps to the fused expert parameters (transformers 5's qwen2_moe
// weight conversion): see lora_config_for_model.
bool peft_fuses_mlp_names(const ModelConfig& m) { return m.model_type == "qwen3_moe" || m.model_type == "qwen3_next"; }

// PEFT's matching of a target name against a module name (or an expert parameter's key): equal, or a dotted tail.
bool name_matches(const std::string& name, const std::string& target) {
  return name == target || ends_with(name, "." + target);
}

// The value of the first pattern (in key order) that `name` matches, PEFT's rule: equal to the name, or a regular
// expression matching the whole name or a dotted tail of it. Two matching patterns with different values are refused.
template <typename V>
const V* pattern_value(const std::map<std::string, V>& patterns, const std::string& name) {
  const V* found = nullptr;
  for (const auto& [pattern, value] : patterns) {
    const bool hit = name == pattern || std::regex_match(name, std::regex("(.*\\.)?(" + pattern + ")"));
    if (!hit) continue;
    LATHE_CHECK(found == nullptr || *found == value, "lora: module '{}' matches two patterns with different values",
                name);
    found = &value;
  }
  return found;
}

// Writes `host` (the view's element count) into a contiguous device view, converting to its dtype.
void write_view(Runtime& rt, Tensor& view, const std::vector<double>& host) {
  LATHE_ASSERT(view.is_contiguous() && int64_t(host.size()) == view.numel());
  ExecContext cx = rt.context(view.device());
  const Tensor src = rt.from_host(host.data(), view.shape(), DType::F64, view.device());
  OpCall call{OpId::cast, {src}, {view}, CastAttrs{view.dtype()}};
  run_op(cx, call);
}

void fill_zero(Runtime& rt, Tensor& t) {
  ExecContext cx = rt.context(t.device());
  cx.backend.fill_bytes(t.data_ptr(), 0, t.nbytes(), cx.stream);
}

// PEFT fields that change the maths and that Lathe does not implement: each must be absent or hold its default.
bool is_default(const nlohmann::json& v) {
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_object() && v.empty()) || (v.is_array() && v.empty()) ||
         (v.is_string() && (v == "none" || v.get<std::string>().empty()));
}

}  // namespace

bool lora_target_is_expert(LoraTarget t) { return t == LoraTarget::experts_gate_up || t == LoraTarget::experts_down; }

const char* lora_target_name(LoraTarget t) {
  switch (t) {
    case LoraTarget::q_proj: return "q_proj";
    case LoraTarget::k_proj: return "k_proj";
    case LoraTarget::v_proj: return "v_proj";
    case LoraTarget::o_proj: return "o_proj";
    case LoraTarget::gate_proj: return "gate_proj";
    case LoraTarget::up_proj: return "up_proj";
    case LoraTarget::down_proj: return "down_proj";
    case LoraTarget::in_proj_qkv: return "in_proj_qkv";
    case LoraTarget::in_proj_z: return "in_proj_z";
    case LoraTarget::in_proj_b: return "in_proj_b";
    case LoraTarget::in_proj_a: return "in_proj_a";
    case LoraTarget::out_proj: return "out_proj";
    case LoraTarget::in_proj_qkvz: return "in_proj_qkvz";
    case LoraTarget::in_proj_ba: return "in_proj_ba";
    case LoraTarget::shared_gate_proj: return "shared_expert.gate_proj";
    case LoraTarget::shared_up_proj: return "shared_expert.up_proj";
    case LoraTarget::shared_down_proj: return "shared_expert.down_proj";
    case LoraTarget::experts_gate_up: return "experts.gate_up_proj";
    case LoraTarget::experts_down: return "experts.down_proj";
  }
  return "?";
}

std::vector<LoraTarget> lora_layer_targets(const ModelConfig& model, int64_t layer) {
  const bool gdn = model.is_hybrid() && model.layer_types[size_t(layer)] == "linear_attention";
  std::vector<LoraTarget> out;
  if (gdn && model.fused_gdn_projections) out = {LoraTarget::in_proj_qkvz, LoraTarget::in_proj_ba, LoraTarget::out_proj};
  else if (gdn) out = {LoraTarget::in_proj_qkv, LoraTarget::in_proj_z, LoraTarget::in_proj_b, LoraTarget::in_proj_a,
                       LoraTarget::out_proj};
  else out = {LoraTarget::q_proj, LoraTarget::k_proj, LoraTarget::v_proj, LoraTarget::o_proj};
  // The MLP names of qwen3_moe and qwen3_next designate their experts (peft_fuses_mlp_names): their dense and shared
  // MLPs take no adapter.
  const bool mlp_names_free = !peft_fuses_mlp_names(model);
  if (!model.sparse_layer(layer)) {
    if (mlp_names_free)
      for (LoraTarget t : {LoraTarget::gate_proj, LoraTarget::up_proj, LoraTarget::down_proj}) out.push_back(t);
    return out;
  }
  if (mlp_names_free && model.shared_expert_intermediate_size > 0)
    for (LoraTarget t : {LoraTarget::shared_gate_proj, LoraTarget::shared_up_proj, LoraTarget::shared_down_proj})
      out.push_back(t);
  out.push_back(LoraTarget::experts_gate_up);
  out.push_back(LoraTarget::experts_down);
  return out;
}

std::vector<std::string> lora_target_names(const ModelConfig& model) {
  std::vector<std::string> names;
  for (int i = 0; i < kLoraTargetCount; ++i) {
    if (lora_target_is_expert(LoraTarget(i))) continue;
    bool present = false;
    for (int64_t l = 0; l < model.num_layers && !present; ++l) {
      const std::vector<LoraTarget> ts = lora_layer_targets(model, l);
      present = std::find(ts.begin(), ts.end(), LoraTarget(i)) != ts.end();
    }
    if (present) names.push_back(lora_target_name(LoraTarget(i)));
  }
  return names;
}

std::string lora_module_name(const ModelConfig& model, int64_t layer, LoraTarget t) {
  const char* root = model.multimodal_layout ? "model.language_model" : "model";
  const char* block = is_gdn(t) ? "linear_attn" : is_attention(t) ? "self_attn" : "mlp";
  return fmt::format("{}.layers.{}.{}.{}", root, layer, block, lora_target_name(t));
}

std::pair<int64_t, int64_t> lora_module_dims(const ModelConfig& m, LoraTarget t) {
  // Qwen3.5's gated attention: q_proj gives [query | gate] per head.
  const int64_t q_out = (m.attn_output_gate ? 2 : 1) * m.num_heads * m.head_dim, kv_out = m.num_kv_heads * m.head_dim;
  const int64_t kd = m.linear_num_key_heads * m.linear_key_head_dim, vd = m.linear_num_value_heads * m.linear_value_head_dim;
  switch (t) {
    case LoraTarget::q_proj: return {m.hidden_size, q_out};
    case LoraTarget::k_proj:
    case LoraTarget::v_proj: return {m.hidden_size, kv_out};
    case LoraTarget::o_proj: return {m.num_heads * m.head_dim, m.hidden_size};
    case LoraTarget::gate_proj:
    case LoraTarget::up_proj: return {m.hidden_size, m.intermediate_size};
    case LoraTarget::down_proj: return {m.intermediate_size, m.hidden_size};
    case LoraTarget::in_proj_qkv: return {m.hidden_size, 2 * kd + vd};
    case LoraTarget::in_proj_z: return {m.hidden_size, vd};
    case LoraTarget::in_proj_b:
    case LoraTarget::in_proj_a: return {m.hidden_size, m.linear_num_value_heads};
    case LoraTarget::out_proj: return {vd, m.hidden_size};
    case LoraTarget::in_proj_qkvz: return {m.hidden_size, 2 * kd + 2 * vd};
    case LoraTarget::in_proj_ba: return {m.hidden_size, 2 * m.linear_num_value_heads};
    case LoraTarget::shared_gate_proj:
    case LoraTarget::shared_up_proj: return {m.hidden_size, m.shared_expert_intermediate_size};
    case LoraTarget::shared_down_proj: return {m.shared_expert_intermediate_size, m.hidden_size};
    case LoraTarget::experts_gate_up: return {m.hidden_size, 2 * m.moe_intermediate_size};
    case LoraTarget::experts_down: return {m.moe_intermediate_size, m.hidden_size};
  }
  return {0, 0};
}

double LoraConfig::scaling() const { return rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank); }

int64_t LoraConfig::rank_of(const std::string& name) const {
  const int64_t* r = pattern_value(rank_pattern, name);
  return r ? *r : rank;
}

double LoraConfig::alpha_of(const std::string& name) const {
  const double* a = pattern_value(alpha_pattern, name);
  return a ? *a : alpha;
}

double LoraConfig::scaling_of(const std::string& name) const {
  const double r = double(rank_of(name)), a = alpha_of(name);
  return rslora ? a / std::sqrt(r) : a / r;
}

bool LoraConfig::targets_module(const ModelConfig& model, int64_t layer, LoraTarget t) const {
  const std::string name = lora_module_name(model, layer, t);
  if (lora_target_is_expert(t)) {
    for (const std::string& target : target_parameters)
      if (name_matches(name, target)) return true;
    return false;
  }
  for (const std::string& target : targets) {
    if (target == "all-linear") return true;
    if (target.rfind("re:", 0) == 0) {
      if (std::regex_match(name, std::regex(target.substr(3)))) return true;
    } else if (name_matches(name, target)) {
      return true;
    }
  }
  return false;
}

LoraConfig lora_config_for_model(const LoraConfig& c, const ModelConfig& model, const std::string& where) {
  if (!peft_fuses_mlp_names(model)) return c;
  // peft 0.21's table for these models (transformers' qwen2_moe conversion): old module name -> fused parameter.
  static const std::vector<std::pair<std::string, std::string>> kMapping = {
      {"gate", "gate.weight"}, {"gate_proj", "gate_up_proj"}, {"up_proj", "gate_up_proj"}, {"down_proj", "down_proj"}};
  LoraConfig out = c;
  out.targets.clear();
  std::set<std::string> fused_parts;  // which of gate_proj / up_proj were named
  for (const std::string& target : c.targets) {
    auto hit = std::find_if(kMapping.begin(), kMapping.end(), [&](const auto& m) { return name_matches(target, m.first); });
    if (target.rfind("re:", 0) == 0 || hit == kMapping.end()) {
      out.targets.push_back(target);
      continue;
    }
    if (std::find(out.target_parameters.begin(), out.target_parameters.end(), hit->second) == out.target_parameters.end())
      out.target_parameters.push_back(hit->second);
    if (hit->second == "gate_up_proj") fused_parts.insert(hit->first);
  }
  LATHE_CHECK(fused_parts.size() != 1, "{}: lora target {} of the {} model needs {} as well: both are fused into the "
              "experts' gate_up_proj (peft 0.21 refuses one alone too)", where, *fused_parts.begin(), model.model_type,
              fused_parts.count("gate_proj") ? "up_proj" : "gate_proj");
  if (fused_parts.size() == 2) {  // peft keeps each part's rank and scaling: the fused matrix has twice both
    out.rank_pattern.emplace(".*\\.gate_up_proj", 2 * c.rank);
    out.alpha_pattern.emplace(".*\\.gate_up_proj", 2 * c.alpha);
  }
  return out;
}

void LoraConfig::validate(const std::string& where, const ModelConfig& model) const {
  LATHE_CHECK(rank > 0, "{}: lora rank must be positive, got {}", where, rank);
  LATHE_CHECK(std::isfinite(alpha) && alpha > 0, "{}: lora alpha must be positive, got {}", where, alpha);
  LATHE_CHECK(dropout >= 0 && dropout < 1, "{}: lora dropout must be in [0, 1), got {}", where, dropout);
  const LoraConfig c = lora_config_for_model(*this, model, where);
  LATHE_CHECK(!c.targets.empty() || !c.target_parameters.empty(), "{}: lora targets are empty", where);
  LATHE_CHECK(c.target_parameters.empty() || dropout == 0, "{}: lora dropout {} with target parameters (experts): "
              "dropout cannot be applied to a parameter's input (peft refuses it too)", where, dropout);
  auto check_regex = [&](const std::string& p) {
    try {
      std::regex re(p);
    } catch (const std::regex_error& e) {
      LATHE_FAIL("{}: lora pattern '{}' is not a valid regular expression: {}", where, p, e.what());
    }
  };
  for (const auto& [pattern, r] : c.rank_pattern) {
    check_regex(pattern);
    LATHE_CHECK(r > 0, "{}: lora rank_pattern '{}' gives rank {}", where, pattern, r);
  }
  for (const auto& [pattern, a] : c.alpha_pattern) {
    check_regex(pattern);
    LATHE_CHECK(std::isfinite(a) && a > 0, "{}: lora alpha_pattern '{}' gives alpha {}", where, pattern, a);
  }
  for (const std::string& target : c.target_parameters) {
    LoraConfig one;
    one.targets.clear();
    one.target_parameters = {target};
    bool matched = false;
    for (int64_t l = 0; l < model.num_layers && !matched; ++l)
      for (LoraTarget t : lora_layer_targets(model, l)) matched = matched || one.targets_module(model, l, t);
    LATHE_CHECK(matched, "{}: lora target parameter '{}' matches no expert parameter of the {} model (valid: "
                "mlp.experts.gate_up_proj, mlp.experts.down_proj; routers take no adapter)", where, target,
                model.model_type);
  }
  for (const std::string& target : c.targets) {
    if (target.rfind("re:", 0) == 0) {
      try {
        std::regex re(target.substr(3));
      } catch (const std::regex_error& e) {
        LATHE_FAIL("{}: lora target '{}' is not a valid regular expression: {}", where, target, e.what());
      }
    }
    bool matched = false;
    LoraConfig one;
    one.targets = {target};
    for (int64_t l = 0; l < model.num_layers && !matched; ++l)
      for (LoraTarget t : lora_layer_targets(model, l)) matched = matched || one.targets_module(model, l, t);
    const std::vector<std::string> names = lora_target_names(model);
    LATHE_CHECK(matched, "{}: lora target '{}' matches no linear module of the {} model (valid: {}, all-linear, or "
                "re:<regex> over names like '{}')", where, target, model.model_type, fmt::join(names, ", "),
                lora_module_name(model, 0, lora_layer_targets(model, 0).front()));
  }
}

LoraConfig lora_config_from_peft(const nlohmann::json& j, const std::string& source) {
  LATHE_CHECK(j.is_object(), "lora: {}: adapter_config.json is not a JSON object", source);
  LATHE_CHECK(j.value("peft_type", std::string("LORA")) == "LORA", "lora: {}: peft_type '{}' is not LORA", source,
              j.value("peft_type", std::string()));
  for (const char* field : {"use_dora", "modules_to_save", "layers_to_transform", "layers_pattern", "fan_in_fan_out",
                            "lora_bias", "exclude_modules", "layer_replication", "use_qalora", "trainable_token_indices",
                            "megatron_config"}) {
    if (j.contains(field))
      LATHE_CHECK(is_default(j[field]), "lora: {}: adapter_config.json sets '{}' = {}, which Lathe does not implement", source,
                  field, j[field].dump());
  }
  LATHE_CHECK(j.value("bias", std::string("none")) == "none", "lora: {}: bias '{}' is not supported (only 'none')", source,
              j.value("bias", std::string()));
  LoraConfig c;
  try {
    c.rank = j.at("r").get<int64_t>();
    c.alpha = j.value("lora_alpha", 8.0);
    c.dropout = j.value("lora_dropout", 0.0);
    c.rslora = j.value("use_rslora", false);
    const nlohmann::json& t = j.at("target_modules");
    c.targets.clear();
    if (t.is_string()) {
      const std::string s = t.get<std::string>();
      c.targets.push_back(s == "all-linear" ? s : "re:" + s);  // PEFT: a string is a full-match regex
    } else if (!t.is_null()) {
      for (const auto& x : t) c.targets.push_back(x.get<std::string>());
    }
    if (j.contains("target_parameters") && !j["target_parameters"].is_null())
      for (const auto& x : j["target_parameters"]) c.target_parameters.push_back(x.get<std::string>());
    if (j.contains("rank_pattern") && !j["rank_pattern"].is_null())
      for (const auto& [k, v] : j["rank_pattern"].items()) c.rank_pattern[k] = v.get<int64_t>();
    if (j.contains("alpha_pattern") && !j["alpha_pattern"].is_null())
      for (const auto& [k, v] : j["alpha_pattern"].items()) c.alpha_pattern[k] = v.get<double>();
  } catch (const nlohmann::json::exception& e) {
    LATHE_FAIL("lora: {}: adapter_config.json: {}", source, e.what());
  }
  return c;
}

nlohmann::json lora_config_to_peft(const LoraConfig& c, const std::string& base_model, const ModelConfig& model) {
  nlohmann::json targets;
  if (c.targets.size() == 1 && c.targets[0].rfind("re:", 0) == 0) {
    targets = c.targets[0].substr(3);
  } else if (std::find(c.targets.begin(), c.targets.end(), "all-linear") != c.targets.end()) {
    targets = lora_target_names(model);
  } else {
    targets = c.targets;
  }
  nlohmann::json params = nullptr, ranks = nlohmann::json::object(), alphas = nlohmann::json::object();
  if (!c.target_parameters.empty()) params = c.target_parameters;
  for (const auto& [k, v] : c.rank_pattern) ranks[k] = v;
  for (const auto& [k, v] : c.alpha_pattern) alphas[k] = v;
  return {{"peft_type", "LORA"},        {"task_type", "CAUSAL_LM"},    {"base_model_name_or_path", base_model},
          {"r", c.rank},                {"lora_alpha", c.alpha},       {"lora_dropout", c.dropout},
          {"use_rslora", c.rslora},     {"target_modules", targets},   {"bias", "none"},
          {"target_parameters", params}, {"fan_in_fan_out", false},    {"modules_to_save", nullptr},
          {"init_lora_weights", true},  {"layers_to_transform", nullptr}, {"layers_pattern", nullptr},
          {"rank_pattern", ranks},      {"alpha_pattern", alphas},     {"use_dora", false}, {"inference_mode", true}};
}

LoraConfig read_lora_config(const std::string& dir) {
  const fs::path path = fs::path(dir) / "adapter_config.json";
  std::ifstream f(path);
  LATHE_CHECK(f.good(), "lora: {} does not exist (not a PEFT adapter folder?)", path.string());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    LATHE_FAIL("lora: {}: {}", path.string(), e.what());
  }
  return lora_config_from_peft(j, path.string());
}

LoraBank::LoraBank(Runtime& rt, const ModelConfig& model, Device device, DType dtype, std::vector<LoraConfig> adapters)
    : rt_(&rt), model_(model), device_(device), dtype_(dtype) {
  for (size_t i = 0; i < adapters.size(); ++i) {
    const std::string where = fmt::format("lora adapter {}", i);
    adapters[i].validate(where, model);
    adapters_.push_back({lora_config_for_model(adapters[i], model, where), {}, {}, {}});
  }
  chunk_ = 0;  // gcd of every row length; 1 when nothing is targeted
  slot_index_.assign(size_t(model.num_layers * kLoraTargetCount), -1);
  for (int64_t l = 0; l < model.num_layers; ++l) {
    for (LoraTarget t : lora_layer_targets(model, l)) {
      Slot s;
      s.layer = l;
      s.target = t;
      s.experts = lora_target_is_expert(t) ? model.num_experts : 0;
      std::tie(s.in, s.out) = lora_module_dims(model, t);
      const std::string name = lora_module_name(model, l, t);
      for (const Adapter& a : adapters_) {
        const bool on = a.config.targets_module(model, l, t);
        s.col_begin.push_back(s.rank_total);
        s.rank_total += on ? a.config.rank_of(name) : 0;
        s.col_end.push_back(s.rank_total);
        s.scaling.push_back(on ? a.config.scaling_of(name) : 0.0);
      }
      if (s.rank_total == 0) continue;
      chunk_ = std::gcd(chunk_, std::gcd(s.in, s.out));
      slot_index_[size_t(l * kLoraTargetCount + int(t))] = int(slots_.size());
      slots_.push_back(std::move(s));
    }
  }
  if (chunk_ == 0) chunk_ = 1;
  for (Slot& s : slots_) {
    if (s.experts > 0) continue;
    const int64_t n = int64_t(adapters_.size());
    std::vector<double> masks(size_t((n + 1) * s.rank_total), 0.0);
    for (int64_t a = 0; a < n; ++a)
      for (int64_t j = s.col_begin[size_t(a)]; j < s.col_end[size_t(a)]; ++j)
        masks[size_t(a * s.rank_total + j)] = s.scaling[size_t(a)];
    ExecContext cx = rt.context(device);
    s.column_masks = cast(cx, rt.upload(masks.data(), {n + 1, s.rank_total}, DType::F64, device), dtype);
  }
  // Each slot holds A_cat then BT_cat, of max(E, 1) R rows each (in slot order); each adapter holds its matrices slot
  // by slot, A then BT. Row q of an adapter's matrix of rank r at columns [c, c + r) lands in slot row
  //   c + q                      (a module: A (r, in), BT (r, out))
  //   e R + c + j, q = e r + j   (an expert parameter's A (E r, in), expert-major as PEFT's lora_A)
  //   e R + c + j, q = j E + e   (an expert parameter's BT (r E, out), expert-minor as PEFT's lora_B columns)
  // Both orders hold the same chunks of chunk_ elements: to_slot_ / to_adapter_ map one onto the other.
  struct Matrix {
    size_t adapter, slot;
    bool is_a;
    int64_t slot_base;  // the slot matrix's first chunk
  };
  std::vector<Matrix> matrices;
  int64_t total_chunks = 0;
  for (size_t si = 0; si < slots_.size(); ++si) {
    const Slot& s = slots_[si];
    for (bool is_a : {true, false}) {
      for (size_t ai = 0; ai < adapters_.size(); ++ai)
        if (s.col_end[ai] > s.col_begin[ai]) matrices.push_back({ai, si, is_a, total_chunks});
      total_chunks += std::max<int64_t>(s.experts, 1) * s.rank_total * (is_a ? s.in : s.out) / chunk_;
    }
  }
  std::stable_sort(matrices.begin(), matrices.end(), [](const Matrix& x, const Matrix& y) { return x.adapter < y.adapter; });
  LATHE_CHECK(total_chunks < (int64_t(1) << 31), "lora: {} chunks of {} elements exceed the index range", total_chunks,
              chunk_);
  std::vector<int32_t> to_slot(static_cast<size_t>(total_chunks)), to_adapter(static_cast<size_t>(total_chunks));
  ExecContext cx = rt.context(device);
  values_ = Tensor::empty({total_chunks, chunk_}, dtype, cx.allocator);
  grads_ = Tensor::empty({total_chunks, chunk_}, dtype, cx.allocator);
  slot_values_ = Tensor::empty({total_chunks, chunk_}, dtype, cx.allocator);
  slot_grads_ = Tensor::empty({total_chunks, chunk_}, dtype, cx.allocator);
  for (Tensor* x : {&values_, &grads_, &slot_values_, &slot_grads_}) fill_zero(rt, *x);
  int64_t adapter_chunk = 0;
  std::vector<int64_t> adapter_begin(adapters_.size() + 1, 0);
  for (const Matrix& m : matrices) {
    const Slot& s = slots_[m.slot];
    const int64_t c = s.col_begin[m.adapter], r = s.col_end[m.adapter] - c, e_count = std::max<int64_t>(s.experts, 1);
    const int64_t width = m.is_a ? s.in : s.out, row_chunks = width / chunk_, rows = e_count * r;
    for (int64_t q = 0; q < rows; ++q) {
      int64_t slot_row = c + q;
      if (s.experts > 0) {
        const int64_t e = m.is_a ? q / r : q % s.experts, j = m.is_a ? q % r : q / s.experts;
        slot_row = e * s.rank_total + c + j;
      }
      for (int64_t k = 0; k < row_chunks; ++k) {
        const int64_t from = adapter_chunk + q * row_chunks + k, to = m.slot_base + slot_row * row_chunks + k;
        to_slot[size_t(to)] = int32_t(from);
        to_adapter[size_t(from)] = int32_t(to);
      }
    }
    const int64_t n = rows * row_chunks;
    const Tensor v = values_.narrow(0, adapter_chunk, n).view({rows, width});
    const Tensor g = grads_.narrow(0, adapter_chunk, n).view({rows, width});
    const LoraConfig& cfg = adapters_[m.adapter].config;
    adapters_[m.adapter].params.push_back({peft_key(cfg, model, s.layer, s.target, m.is_a ? "A" : "B"), v, g, {}});
    adapter_chunk += n;
    adapter_begin[m.adapter + 1] = adapter_chunk;
  }
  for (size_t ai = 0; ai < adapters_.size(); ++ai) {
    const int64_t begin = adapter_begin[ai], n = std::max(begin, adapter_begin[ai + 1]) - begin;
    adapters_[ai].flat.push_back({"lora_adapter", values_.narrow(0, begin, n), grads_.narrow(0, begin, n), {}});
  }
  to_slot_ = rt.from_host(to_slot.data(), {total_chunks}, DType::I32, device);
  to_adapter_ = rt.from_host(to_adapter.data(), {total_chunks}, DType::I32, device);
  // The slots' matrices: views of the slot-order buffers.
  int64_t offset = 0;
  for (Slot& s : slots_) {
    for (bool is_a : {true, false}) {
      const int64_t width = is_a ? s.in : s.out, rows = std::max<int64_t>(s.experts, 1) * s.rank_total;
      const int64_t n = rows * width / chunk_;
      (is_a ? s.a : s.bt) = slot_values_.narrow(0, offset, n).view({rows, width});
      (is_a ? s.grad_a : s.grad_bt) = slot_grads_.narrow(0, offset, n).view({rows, width});
      offset += n;
    }
  }
}

int64_t LoraBank::parameter_count(int adapter) const {
  int64_t n = 0;
  for (const Parameter& p : adapters_[size_t(adapter)].params) n += p.value.numel();
  return n;
}

bool LoraBank::adapts_experts() const {
  return std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.experts > 0; });
}

const LoraBank::Slot* LoraBank::slot(int64_t layer, LoraTarget t) const {
  const int i = slot_index_[size_t(layer * kLoraTargetCount + int(t))];
  return i < 0 ? nullptr : &slots_[size_t(i)];
}

LoraBank::Slot* LoraBank::slot(int64_t layer, LoraTarget t) {
  return const_cast<Slot*>(static_cast<const LoraBank*>(this)->slot(layer, t));
}

void LoraBank::refresh() {
  if (slot_values_.numel() == 0) return;
  ExecContext cx = rt_->context(device_);
  OpCall call{OpId::embedding, {values_, to_slot_}, {slot_values_}, {}};  // a row gather
  run_op(cx, call);
}

void LoraBank::collect_grads() {
  if (slot_grads_.numel() == 0) return;
  ExecContext cx = rt_->context(device_);
  OpCall call{OpId::embedding, {slot_grads_, to_adapter_}, {grads_}, {}};
  run_op(cx, call);
}

void LoraBank::zero_grads() {
  fill_zero(*rt_, slot_grads_);
  fill_zero(*rt_, grads_);
}

void LoraBank::split_like(CausalLm& model) {
  if (model.tp_size() <= 1) return;
  tp_model_ = &model;
  const int tp = model.tp_size(), rank = model.tp_rank();
  // Every layer's base weight (pipeline parallelism: also those of the other stages, whose adapters this bank holds).
  const std::map<std::string, std::pair<Shape, ShardLayout>> base = model.declared_layouts();
  const bool dropout = std::any_of(adapters_.begin(), adapters_.end(), [](const Adapter& a) {
    return a.config.dropout > 0;
  });
  for (Slot& s : slots_) {  // a row-parallel module's input columns, by which its dropout mask is drawn
    const auto it = base.find(lora_module_name(model_, s.layer, s.target) + ".weight");
    if (it == base.end() || it->second.second.global_shape.size() != 2) continue;
    const ShardLayout& w = it->second.second;
    if (w.global_shape[1] == it->second.first[1]) continue;  // whole input columns: column-parallel or whole
    LATHE_CHECK(!dropout || w.sections.empty(), "lora: dropout under tensor parallelism on {} (its input columns are "
                "cut in sections) is not built yet; set lora.dropout: 0", it->first);
    s.in_offset = w.offset[1];
    s.in_whole = w.global_shape[1];
  }
  for (Adapter& a : adapters_) {
    a.partial.clear();
    for (size_t i = 0; i < a.params.size(); ++i) {
      Parameter& p = a.params[i];
      const auto it = base.find(lora_key_module(p.name) + ".weight");
      const ShardLayout& w = it == base.end() ? ShardLayout{} : it->second.second;
      if (w.global_shape.empty()) continue;  // experts and MoE blocks: whole on every rank
      const bool is_a = ends_with(p.name, "lora_A.weight");
      const bool column = w.offset[0] != 0 || w.global_shape[0] != it->second.first[0] || w.replicas > 1;
      if (column == is_a) {  // A of a column-parallel module, B^T of a row-parallel one: whole, its gradient a part
        a.partial.push_back(i);
        continue;
      }
      // The split side: B^T (r, out) by the base's rows, A (r, in) by its columns; B^T of a shared kv head is held by
      // the base's replicas (their gradient parts summed over them).
      p.shard = split_layout(p.value.shape(), 1, tp / w.replicas, rank / w.replicas, "tp", w.replicas, w.sections);
    }
  }
}

void LoraBank::sum_tp_grads() {
  if (!tp_model_) return;
  Communicator& group = *tp_model_->options().tp;
  for (Adapter& a : adapters_) {
    for (size_t i : a.partial) group.all_reduce(a.params[i].grad);
    for (Parameter& p : a.params) tp_model_->sum_over_replicas(p);
  }
}

void LoraBank::sum_grads_over(Communicator& group) {
  if (grads_.numel() > 0) group.all_reduce(grads_);
}

void LoraBank::init(int adapter, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (Parameter& p : parameters(adapter)) {  // the whole matrix's draws (the same at any tp), then this rank's piece
    std::vector<double> host(size_t(shape_numel(p.global_shape())), 0.0);
    if (ends_with(p.name, "lora_A.weight")) {  // kaiming_uniform_(a = sqrt(5)): bound = 1 / sqrt(fan_in)
      std::uniform_real_distribution<double> u(-1.0, 1.0);
      const double bound = 1.0 / std::sqrt(double(p.global_shape()[1]));
      for (double& x : host) x = bound * u(rng);
    }
    if (!p.whole()) host = slice_of(host, p);
    write_view(*rt_, p.value, host);
  }
}

void LoraBank::clear(int adapter) {
  for (Parameter& p : parameters(adapter)) write_view(*rt_, p.value, std::vector<double>(size_t(p.value.numel()), 0.0));
}

void LoraBank::load_peft(int adapter, const std::string& dir) {
  const LoraConfig file_cfg = lora_config_for_model(read_lora_config(dir), model_, dir);
  const LoraConfig& mine = config(adapter);
  LATHE_CHECK(file_cfg.rank == mine.rank && file_cfg.alpha == mine.alpha && file_cfg.rslora == mine.rslora,
              "lora: {}: adapter has r={} alpha={} rslora={} but the run asks for r={} alpha={} rslora={}", dir, file_cfg.rank,
              file_cfg.alpha, file_cfg.rslora, mine.rank, mine.alpha, mine.rslora);
  LATHE_CHECK(file_cfg.rank_pattern == mine.rank_pattern && file_cfg.alpha_pattern == mine.alpha_pattern,
              "lora: {}: adapter has rank_pattern {} alpha_pattern {} but the run has {} and {}", dir,
              file_cfg.rank_pattern, file_cfg.alpha_pattern, mine.rank_pattern, mine.alpha_pattern);
  const fs::path file = fs::path(dir) / "adapter_model.safetensors";
  LATHE_CHECK(fs::exists(file), "lora: {} does not exist", file.string());
  const io::SafetensorsFile st = io::SafetensorsFile::open(file.string());
  std::set<std::string> used;
  for (Parameter& p : parameters(adapter)) {
    const bool is_b = ends_with(p.name, "lora_B.weight");
    const io::SafetensorsTensor* t = st.find(p.name);
    LATHE_CHECK(t != nullptr, "lora: {}: tensor '{}' is missing (the adapter's target_modules imply it)", file.string(), p.name);
    const Shape& whole = p.global_shape();
    const Shape want = is_b ? Shape{whole[1], whole[0]} : whole;
    LATHE_CHECK(t->shape == want, "lora: {}: tensor '{}' has shape {}, expected {}", file.string(), p.name,
                shape_str(t->shape), shape_str(want));
    std::vector<double> host(size_t(t->numel));
    st.read_into(p.name, DType::F64, host.data(), host.size() * sizeof(double));
    if (is_b) {  // (out, r) -> (r, out)
      std::vector<double> tr(host.size());
      const int64_t out = want[0], r = want[1];
      for (int64_t o = 0; o < out; ++o)
        for (int64_t k = 0; k < r; ++k) tr[size_t(k * out + o)] = host[size_t(o * r + k)];
      host.swap(tr);
    }
    if (!p.whole()) host = slice_of(host, p);  // tensor parallelism: this rank's columns
    write_view(*rt_, p.value, host);
    used.insert(p.name);
  }
  std::vector<std::string> extra;
  for (const io::SafetensorsTensor& t : st.tensors())
    if (!used.count(t.name)) extra.push_back(t.name);
  LATHE_CHECK(extra.empty(), "lora: {}: {} tensors do not belong to the adapter's target modules, e.g. '{}'", file.string(),
              extra.size(), extra.empty() ? "" : extra.front());
}

void LoraBank::save_peft(int adapter, const std::string& dir, DType dtype, const std::string& base_model,
                         const std::function<void(const std::string&)>& add_files) const {
  ExecContext cx = rt_->context(device_);
  std::vector<Tensor> host;
  std::vector<io::TensorRef> refs;
  for (const Parameter& p : adapters_[size_t(adapter)].params) {
    const bool is_b = ends_with(p.name, "lora_B.weight");
    const Tensor whole = tp_model_ ? tp_model_->gathered(p) : p.value;  // tensor parallelism: the pieces joined
    const Tensor v = is_b ? contiguous(cx, whole.transpose(0, 1)) : whole;
    host.push_back(rt_->copy_to(cast(cx, v, dtype), Device::cpu()));
    refs.push_back({p.name, dtype, host.back().shape(), host.back().data_ptr(), host.back().nbytes()});
  }
  if (tp_model_ && tp_model_->tp_rank() != 0) return;  // the group's first rank writes
  OutputDir out(dir, "lora");
  io::write_safetensors((out.tmp() / "adapter_model.safetensors").string(), refs, {{"format", "pt"}});
  write_file_atomic((out.tmp() / "adapter_config.json").string(),
                    lora_config_to_peft(config(adapter), base_model, model_).dump(2) + "\n", "lora");
  if (add_files) add_files(out.tmp().string());
  out.commit();
}

std::string lora_key_module(const std::string& key) {
  const std::string prefix = "base_model.model.";
  const size_t end = key.find(".lora_");
  LATHE_CHECK(key.rfind(prefix, 0) == 0 && end != std::string::npos, "lora: '{}' is not a PEFT LoRA key", key);
  return key.substr(prefix.size(), end - prefix.size());
}

SegmentAttrs lora_segments(const LoraBank& bank, const LoraBank::Slot& slot, const PackedBatch& b, bool training) {
  SegmentAttrs s;
  s.rows.push_back(0);
  for (const BatchSegment& seg : b.segments) {
    s.rows.push_back(seg.rows_end);
    const bool on = seg.adapter >= 0;
    s.col_begin.push_back(on ? slot.col_begin[size_t(seg.adapter)] : 0);
    s.col_end.push_back(on ? slot.col_end[size_t(seg.adapter)] : 0);
    s.scale.push_back(on ? slot.scaling[size_t(seg.adapter)] : 0.0);
    s.p.push_back(on && training ? bank.config(seg.adapter).dropout : 0.0);
    // splitmix-style mixing of the segment's seed with the slot's place in the model
    uint64_t z = seg.dropout_seed + 0x9E3779B97F4A7C15ull * uint64_t(1 + slot.layer * kLoraTargetCount + int(slot.target));
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    s.seed.push_back(z ^ (z >> 31));
  }
  return s;
}

namespace {

// Calls fn(slot, base parameter name) for every slot where `adapter` has columns.
template <typename Fn>
void for_each_adapted(const LoraBank& bank, int adapter, Fn fn) {
  const ModelConfig& m = bank.model();
  for (int64_t l = 0; l < m.num_layers; ++l)
    for (LoraTarget t : lora_layer_targets(m, l)) {
      const LoraBank::Slot* slot = bank.slot(l, t);
      if (!slot || slot->col_end[size_t(adapter)] == slot->col_begin[size_t(adapter)]) continue;
      const std::string name = lora_module_name(m, l, t);
      fn(*slot, lora_target_is_expert(t) ? name : name + ".weight", l);
    }
}

}  // namespace

std::vector<std::string> lora_merge_targets(const LoraBank& bank, int adapter) {
  std::vector<std::string> names;
  for_each_adapted(bank, adapter, [&](const LoraBank::Slot&, const std::string& name, int64_t) {
    names.push_back(name);
  });
  return names;
}

void merge_lora(CausalLm& model, LoraBank& bank, int adapter) {
  ExecContext cx = model.runtime().context(model.options().device);
  bank.refresh();  // the slots hold every adapter's current values
  for_each_adapted(bank, adapter, [&](const LoraBank::Slot& slot, const std::string& name, int64_t layer) {
    if (!model.holds_layer(layer)) return;  // pipeline parallelism: another stage's layer
    const int64_t c = slot.col_begin[size_t(adapter)], r = slot.col_end[size_t(adapter)] - c;
    const double s = slot.scaling[size_t(adapter)];  // applied in the model dtype (a GEMM's alpha is only a float)
    Tensor& w = model.parameter(name).value;
    if (slot.experts == 0) {  // W (out, in) += s BT^T A
      matmul_into(cx, scale(cx, slot.bt.narrow(0, c, r), s), slot.a.narrow(0, c, r), w, {true, false, 1.0f, 1.0f});
      return;
    }
    // W[e] (out, in) += s BT_e^T A_e for every expert: one batched product over the slot's (E, R, .) views (under
    // expert parallelism the bank holds every expert's matrices and W this rank's experts: their rows of the slot)
    const int64_t e = slot.experts, rank_total = slot.rank_total, here = w.size(0), first = model.ep_rank() * here;
    const Tensor a = contiguous(cx, slot.a.view({e, rank_total, slot.in}).narrow(0, first, here).narrow(1, c, r));
    const Tensor bt =
        scale(cx, contiguous(cx, slot.bt.view({e, rank_total, slot.out}).narrow(0, first, here).narrow(1, c, r)), s);
    matmul_into(cx, bt, a, w, {true, false, 1.0f, 1.0f});
  });
}

}  // namespace lathe
