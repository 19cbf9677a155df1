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

#include "io/safetensors.h"
#include "ops/ops.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string peft_key(const ModelConfig& model, int64_t layer, LoraTarget t, const char* ab) {
  return fmt::format("base_model.model.{}.lora_{}.weight", lora_module_name(model, layer, t), ab);
}

bool is_gdn(LoraTarget t) { return int(t) >= int(LoraTarget::in_proj_qkv); }
bool is_attention(LoraTarget t) { return int(t) <= int(LoraTarget::o_proj); }

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
  // A sparse (mixture-of-experts) layer has no dense MLP; its experts take no adapter yet (docs/moe.md).
  if (!model.sparse_layer(layer))
    for (LoraTarget t : {LoraTarget::gate_proj, LoraTarget::up_proj, LoraTarget::down_proj}) out.push_back(t);
  return out;
}

std::vector<std::string> lora_target_names(const ModelConfig& model) {
  std::vector<std::string> names;
  for (int i = 0; i < kLoraTargetCount; ++i) {
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
  }
  return {0, 0};
}

double LoraConfig::scaling() const { return rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank); }

bool LoraConfig::targets_module(const ModelConfig& model, int64_t layer, LoraTarget t) const {
  const std::string name = lora_module_name(model, layer, t);
  for (const std::string& target : targets) {
    if (target == "all-linear") return true;
    if (target.rfind("re:", 0) == 0) {
      if (std::regex_match(name, std::regex(target.substr(3)))) return true;
    } else if (name == target || ends_with(name, "." + target)) {
      return true;
    }
  }
  return false;
}

void LoraConfig::validate(const std::string& where, const ModelConfig& model) const {
  LATHE_CHECK(rank > 0, "{}: lora rank must be positive, got {}", where, rank);
  LATHE_CHECK(std::isfinite(alpha) && alpha > 0, "{}: lora alpha must be positive, got {}", where, alpha);
  LATHE_CHECK(dropout >= 0 && dropout < 1, "{}: lora dropout must be in [0, 1), got {}", where, dropout);
  LATHE_CHECK(!targets.empty(), "{}: lora targets are empty", where);
  for (const std::string& target : targets) {
    if (target.rfind("re:", 0) == 0) {
      try {
        std::regex re(target.substr(3));
      } catch (const std::regex_error& e) {
        LATHE_FAIL("{}: lora target '{}' is not a valid regular expression: {}", where, target, e.what());
      }
    }
    bool matched = false;
    const LoraConfig one{rank, alpha, dropout, rslora, {target}};
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
  for (const char* field : {"use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform",
                            "layers_pattern", "fan_in_fan_out", "lora_bias", "exclude_modules", "target_parameters",
                            "layer_replication", "use_qalora", "trainable_token_indices", "megatron_config"}) {
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
    } else {
      for (const auto& x : t) c.targets.push_back(x.get<std::string>());
    }
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
  return {{"peft_type", "LORA"},        {"task_type", "CAUSAL_LM"},    {"base_model_name_or_path", base_model},
          {"r", c.rank},                {"lora_alpha", c.alpha},       {"lora_dropout", c.dropout},
          {"use_rslora", c.rslora},     {"target_modules", targets},   {"bias", "none"},
          {"fan_in_fan_out", false},    {"modules_to_save", nullptr},  {"init_lora_weights", true},
          {"layers_to_transform", nullptr}, {"layers_pattern", nullptr}, {"rank_pattern", nlohmann::json::object()},
          {"alpha_pattern", nlohmann::json::object()}, {"use_dora", false}, {"inference_mode", true}};
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
  for (size_t i = 0; i < adapters.size(); ++i) adapters[i].validate(fmt::format("lora adapter {}", i), model);
  for (LoraConfig& c : adapters) adapters_.push_back({std::move(c), {}, {}});
  chunk_ = 0;  // gcd of every row length; 1 when nothing is targeted
  slot_index_.assign(size_t(model.num_layers * kLoraTargetCount), -1);
  for (int64_t l = 0; l < model.num_layers; ++l) {
    for (LoraTarget t : lora_layer_targets(model, l)) {
      Slot s;
      s.layer = l;
      s.target = t;
      std::tie(s.in, s.out) = lora_module_dims(model, t);
      for (const Adapter& a : adapters_) {
        s.col_begin.push_back(s.rank_total);
        s.rank_total += a.config.targets_module(model, l, t) ? a.config.rank : 0;
        s.col_end.push_back(s.rank_total);
      }
      if (s.rank_total == 0) continue;
      chunk_ = std::gcd(chunk_, std::gcd(s.in, s.out));
      slot_index_[size_t(l * kLoraTargetCount + int(t))] = int(slots_.size());
      slots_.push_back(std::move(s));
    }
  }
  // Chunk offsets: slot order (each slot's A_cat then BT_cat, adapters in order inside each) and adapter order
  // (each adapter's matrices slot by slot, A then BT). Both hold the same chunks: to_slot_ maps one onto the other.
  struct Matrix {
    size_t adapter, slot;
    bool is_a;
    int64_t slot_chunk, chunks;
  };
  std::vector<Matrix> matrices;
  int64_t slot_chunks = 0;
  for (size_t si = 0; si < slots_.size(); ++si) {
    const Slot& s = slots_[si];
    for (bool is_a : {true, false}) {
      const int64_t width = (is_a ? s.in : s.out) / chunk_;
      for (size_t ai = 0; ai < adapters_.size(); ++ai) {
        const int64_t r = s.col_end[ai] - s.col_begin[ai];
        if (r) matrices.push_back({ai, si, is_a, slot_chunks + s.col_begin[ai] * width, r * width});
      }
      slot_chunks += s.rank_total * width;
    }
  }
  if (chunk_ == 0) chunk_ = 1;
  std::stable_sort(matrices.begin(), matrices.end(), [](const Matrix& x, const Matrix& y) { return x.adapter < y.adapter; });
  std::vector<int32_t> to_slot(static_cast<size_t>(slot_chunks)), to_adapter(static_cast<size_t>(slot_chunks));
  LATHE_CHECK(slot_chunks < (int64_t(1) << 31), "lora: {} chunks of {} elements exceed the index range", slot_chunks, chunk_);
  ExecContext cx = rt.context(device);
  values_ = Tensor::empty({slot_chunks, chunk_}, dtype, cx.allocator);
  grads_ = Tensor::empty({slot_chunks, chunk_}, dtype, cx.allocator);
  slot_values_ = Tensor::empty({slot_chunks, chunk_}, dtype, cx.allocator);
  slot_grads_ = Tensor::empty({slot_chunks, chunk_}, dtype, cx.allocator);
  for (Tensor* x : {&values_, &grads_, &slot_values_, &slot_grads_}) fill_zero(rt, *x);
  int64_t adapter_chunk = 0;
  std::vector<int64_t> adapter_begin(adapters_.size() + 1, 0);
  for (const Matrix& m : matrices) {
    const Slot& s = slots_[m.slot];
    const int64_t r = s.col_end[m.adapter] - s.col_begin[m.adapter], width = m.is_a ? s.in : s.out;
    for (int64_t k = 0; k < m.chunks; ++k) {
      to_slot[size_t(m.slot_chunk + k)] = int32_t(adapter_chunk + k);
      to_adapter[size_t(adapter_chunk + k)] = int32_t(m.slot_chunk + k);
    }
    const Tensor v = values_.narrow(0, adapter_chunk, m.chunks).view({r, width});
    const Tensor g = grads_.narrow(0, adapter_chunk, m.chunks).view({r, width});
    adapters_[m.adapter].params.push_back({peft_key(model, s.layer, s.target, m.is_a ? "A" : "B"), v, g});
    adapter_chunk += m.chunks;
    adapter_begin[m.adapter + 1] = adapter_chunk;
  }
  for (size_t ai = 0; ai < adapters_.size(); ++ai) {
    const int64_t begin = adapter_begin[ai], n = std::max(begin, adapter_begin[ai + 1]) - begin;
    adapters_[ai].flat.push_back({"lora_adapter", values_.narrow(0, begin, n), grads_.narrow(0, begin, n)});
  }
  to_slot_ = rt.from_host(to_slot.data(), {slot_chunks}, DType::I32, device);
  to_adapter_ = rt.from_host(to_adapter.data(), {slot_chunks}, DType::I32, device);
  // The slots' matrices: views of the slot-order buffers.
  int64_t offset = 0;
  for (Slot& s : slots_) {
    for (bool is_a : {true, false}) {
      const int64_t width = is_a ? s.in : s.out, n = s.rank_total * width / chunk_;
      (is_a ? s.a : s.bt) = slot_values_.narrow(0, offset, n).view({s.rank_total, width});
      (is_a ? s.grad_a : s.grad_bt) = slot_grads_.narrow(0, offset, n).view({s.rank_total, width});
      offset += n;
    }
  }
}

int64_t LoraBank::parameter_count(int adapter) const {
  int64_t n = 0;
  for (const Parameter& p : adapters_[size_t(adapter)].params) n += p.value.numel();
  return n;
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

void LoraBank::init(int adapter, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (Parameter& p : parameters(adapter)) {
    std::vector<double> host(size_t(p.value.numel()), 0.0);
    if (ends_with(p.name, "lora_A.weight")) {  // kaiming_uniform_(a = sqrt(5)): bound = 1 / sqrt(fan_in)
      std::uniform_real_distribution<double> u(-1.0, 1.0);
      const double bound = 1.0 / std::sqrt(double(p.value.size(1)));
      for (double& x : host) x = bound * u(rng);
    }
    write_view(*rt_, p.value, host);
  }
}

void LoraBank::clear(int adapter) {
  for (Parameter& p : parameters(adapter)) write_view(*rt_, p.value, std::vector<double>(size_t(p.value.numel()), 0.0));
}

void LoraBank::load_peft(int adapter, const std::string& dir) {
  const LoraConfig file_cfg = read_lora_config(dir);
  const LoraConfig& mine = config(adapter);
  LATHE_CHECK(file_cfg.rank == mine.rank && file_cfg.alpha == mine.alpha && file_cfg.rslora == mine.rslora,
              "lora: {}: adapter has r={} alpha={} rslora={} but the run asks for r={} alpha={} rslora={}", dir, file_cfg.rank,
              file_cfg.alpha, file_cfg.rslora, mine.rank, mine.alpha, mine.rslora);
  const fs::path file = fs::path(dir) / "adapter_model.safetensors";
  LATHE_CHECK(fs::exists(file), "lora: {} does not exist", file.string());
  const io::SafetensorsFile st = io::SafetensorsFile::open(file.string());
  std::set<std::string> used;
  for (Parameter& p : parameters(adapter)) {
    const bool is_b = ends_with(p.name, "lora_B.weight");
    const io::SafetensorsTensor* t = st.find(p.name);
    LATHE_CHECK(t != nullptr, "lora: {}: tensor '{}' is missing (the adapter's target_modules imply it)", file.string(), p.name);
    const Shape want = is_b ? Shape{p.value.size(1), p.value.size(0)} : p.value.shape();
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
    write_view(*rt_, p.value, host);
    used.insert(p.name);
  }
  std::vector<std::string> extra;
  for (const io::SafetensorsTensor& t : st.tensors())
    if (!used.count(t.name)) extra.push_back(t.name);
  LATHE_CHECK(extra.empty(), "lora: {}: {} tensors do not belong to the adapter's target modules, e.g. '{}'", file.string(),
              extra.size(), extra.empty() ? "" : extra.front());
}

void LoraBank::save_peft(int adapter, const std::string& dir, DType dtype, const std::string& base_model) const {
  ExecContext cx = rt_->context(device_);
  std::vector<Tensor> host;
  std::vector<io::TensorRef> refs;
  for (const Parameter& p : adapters_[size_t(adapter)].params) {
    const bool is_b = ends_with(p.name, "lora_B.weight");
    const Tensor v = is_b ? contiguous(cx, p.value.transpose(0, 1)) : p.value;
    host.push_back(rt_->copy_to(cast(cx, v, dtype), Device::cpu()));
    refs.push_back({p.name, dtype, host.back().shape(), host.back().data_ptr(), host.back().nbytes()});
  }
  const fs::path target = fs::absolute(dir);
  const fs::path tmp = target.string() + fmt::format(".tmp-{}", getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  io::write_safetensors((tmp / "adapter_model.safetensors").string(), refs, {{"format", "pt"}});
  {
    std::ofstream f(tmp / "adapter_config.json");
    f << lora_config_to_peft(config(adapter), base_model, model_).dump(2) << "\n";
    LATHE_CHECK(f.good(), "lora: cannot write {}", (tmp / "adapter_config.json").string());
  }
  const fs::path old = target.string() + fmt::format(".old-{}", getpid());
  if (fs::exists(target)) fs::rename(target, old);
  fs::rename(tmp, target);
  fs::remove_all(old);
}

std::string lora_key_module(const std::string& key) {
  const std::string prefix = "base_model.model.";
  const size_t end = key.find(".lora_");
  LATHE_CHECK(key.rfind(prefix, 0) == 0 && end != std::string::npos, "lora: '{}' is not a PEFT LoRA key", key);
  return key.substr(prefix.size(), end - prefix.size());
}

void merge_lora(CausalLm& model, LoraBank& bank, int adapter) {
  ExecContext cx = model.runtime().context(model.options().device);
  const double s = bank.config(adapter).scaling();
  const std::vector<Parameter>& params = bank.parameters(adapter);
  for (size_t i = 0; i + 1 < params.size(); i += 2) {  // lora_A (r, in), then lora_B stored as (r, out)
    LATHE_ASSERT(ends_with(params[i].name, "lora_A.weight") && ends_with(params[i + 1].name, "lora_B.weight"));
    Tensor& w = model.parameter(lora_key_module(params[i].name) + ".weight").value;  // (out, in) += s * BT^T A
    matmul_into(cx, params[i + 1].value, params[i].value, w, {true, false, float(s), 1.0f});
  }
}

}  // namespace lathe
