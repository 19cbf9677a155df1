#include "train/config.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "core/error.h"

namespace lathe {

namespace {

enum class Kind { Int, Float, Bool, String, StringList, Mapping };

struct Option {
  const char* path;
  Kind kind;
  const char* fallback;  // YAML text of the default; nullptr = required / no default
  const char* help;
  std::function<void(TrainConfig&, const YAML::Node&)> set;
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::Bool: return "bool";
    case Kind::String: return "string";
    case Kind::StringList: return "list of strings";
    case Kind::Mapping: return "mapping";
  }
  return "?";
}

nlohmann::json to_json(const YAML::Node& n) {
  if (n.IsMap()) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& kv : n) j[kv.first.as<std::string>()] = to_json(kv.second);
    return j;
  }
  if (n.IsSequence()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& v : n) j.push_back(to_json(v));
    return j;
  }
  if (n.IsNull()) return nullptr;
  const std::string s = n.as<std::string>();
  if (n.Tag() == "!") return s;  // quoted in the YAML: keep it a string
  try {
    size_t used = 0;
    const long long i = std::stoll(s, &used);
    if (used == s.size()) return i;
  } catch (...) {
  }
  try {
    size_t used = 0;
    const double d = std::stod(s, &used);
    if (used == s.size()) return d;
  } catch (...) {
  }
  if (s == "true" || s == "false") return s == "true";
  return s;
}

#define LATHE_OPT(path, kind, fallback, help, field) \
  Option { path, kind, fallback, help, [](TrainConfig& c, const YAML::Node& n) { assign(c.field, n); } }

void assign(int64_t& f, const YAML::Node& n) { f = n.as<int64_t>(); }
void assign(uint64_t& f, const YAML::Node& n) { f = n.as<uint64_t>(); }
void assign(double& f, const YAML::Node& n) { f = n.as<double>(); }
void assign(bool& f, const YAML::Node& n) { f = n.as<bool>(); }
void assign(std::string& f, const YAML::Node& n) { f = n.as<std::string>(); }
void assign(std::vector<std::string>& f, const YAML::Node& n) {
  f.clear();
  if (n.IsSequence()) {
    for (const auto& v : n) f.push_back(v.as<std::string>());
  } else {
    f.push_back(n.as<std::string>());  // a single file may be given as a plain string
  }
}
void assign(nlohmann::json& f, const YAML::Node& n) { f = to_json(n); }

const std::vector<Option>& options() {
  static const std::vector<Option> table = {
      LATHE_OPT("model.path", Kind::String, "", "Hugging Face model folder to fine-tune", model_path),
      LATHE_OPT("model.config", Kind::Mapping, nullptr, "inline HF config.json fields: train a new model from scratch", model_config),
      LATHE_OPT("model.init_std", Kind::Float, "0.02", "std of the random initialisation (with model.config)", init_std),
      LATHE_OPT("model.tokenizer", Kind::String, "", "folder with tokenizer.json (default: model.path)", tokenizer),
      LATHE_OPT("data.train", Kind::StringList, nullptr, "training JSONL file(s)", train_files),
      LATHE_OPT("data.eval", Kind::StringList, "[]", "evaluation JSONL file(s)", eval_files),
      LATHE_OPT("data.format", Kind::String, "auto", "auto | text | chat | prompt_completion", data_format),
      LATHE_OPT("data.max_seq_len", Kind::Int, "2048", "longest sample in tokens", max_seq_len),
      LATHE_OPT("data.skip_bad_rows", Kind::Bool, "false", "skip (and count) malformed rows instead of stopping", skip_bad_rows),
      LATHE_OPT("data.overlong", Kind::String, "truncate", "samples over max_seq_len: truncate | drop (counted)", overlong),
      LATHE_OPT("data.train_on_prompt", Kind::Bool, "false", "also put loss on prompt / user tokens", train_on_prompt),
      LATHE_OPT("output_dir", Kind::String, nullptr, "folder for checkpoints, metrics and the final model", output_dir),
      LATHE_OPT("train.max_steps", Kind::Int, nullptr, "optimizer steps to run", max_steps),
      LATHE_OPT("train.micro_batch_tokens", Kind::Int, "4096", "tokens packed into one forward/backward", micro_batch_tokens),
      LATHE_OPT("train.grad_accum", Kind::Int, "1", "micro-batches per optimizer step", grad_accum),
      LATHE_OPT("train.lr", Kind::Float, "0.0001", "peak learning rate", lr),
      LATHE_OPT("train.schedule", Kind::String, "cosine", "constant | linear | cosine (after warmup)", schedule),
      LATHE_OPT("train.warmup_steps", Kind::Int, "0", "linear warmup from 0", warmup_steps),
      LATHE_OPT("train.min_lr_ratio", Kind::Float, "0.1", "final LR as a fraction of train.lr (linear, cosine)", min_lr_ratio),
      LATHE_OPT("train.weight_decay", Kind::Float, "0.0", "decoupled weight decay (AdamW)", weight_decay),
      LATHE_OPT("train.beta1", Kind::Float, "0.9", "AdamW beta1", beta1),
      LATHE_OPT("train.beta2", Kind::Float, "0.999", "AdamW beta2", beta2),
      LATHE_OPT("train.eps", Kind::Float, "1e-8", "AdamW epsilon", eps),
      LATHE_OPT("train.optimizer_states", Kind::String, "f32",
                "AdamW state dtype: f32 (f32 masters and moments for bf16 parameters) | bf16 (no masters: bf16 "
                "parameters updated in place, bf16 moments; needs dtype bf16; docs/optim.md)", optimizer_states),
      LATHE_OPT("train.router_aux_loss", Kind::String, "auto",
                "mixture-of-experts models: add router_aux_loss_coef x the load-balancing loss to the trained loss: "
                "auto (as config.json's output_router_logits, like transformers) | on | off (docs/moe.md)",
                router_aux_loss),
      LATHE_OPT("train.moe_padded_max_waste", Kind::Float, "1.5",
                "mixture-of-experts models: run the experts as one batched GEMM over blocks padded to the largest "
                "expert's rows while E x those rows <= this x the routed rows (0: grouped GEMMs always; docs/moe.md)",
                moe_padded_max_waste),
      LATHE_OPT("train.max_grad_norm", Kind::Float, "1.0", "global-norm gradient clipping (0 = off)", max_grad_norm),
      LATHE_OPT("train.seed", Kind::Int, "0", "seed of data order and initialisation", seed),
      LATHE_OPT("train.save_every", Kind::Int, "0", "checkpoint every N steps (0 = only at the end)", save_every),
      LATHE_OPT("train.keep_last", Kind::Int, "2", "checkpoints kept", keep_last),
      LATHE_OPT("train.eval_every", Kind::Int, "0", "evaluate every N steps (0 = never)", eval_every),
      LATHE_OPT("train.eval_batches", Kind::Int, "4", "micro-batches per evaluation", eval_batches),
      LATHE_OPT("train.log_every", Kind::Int, "1", "steps between log lines when not on a terminal", log_every),
      LATHE_OPT("train.recompute", Kind::Bool, "false", "recompute activations in the backward pass", recompute),
      LATHE_OPT("train.deterministic", Kind::Bool, "true",
                "bitwise-repeatable gradients; false lets the attention backward sum dQ in any order (faster, equal "
                "within rounding; docs/training.md)", deterministic),
      LATHE_OPT("train.gemm_autotune", Kind::Bool, "false",
                "time cuBLASLt's candidate algorithms on each GEMM shape's first call and keep the fastest (faster; "
                "two runs may then differ in the last bits; docs/training.md)", gemm_autotune),
      LATHE_OPT("train.memory_plan", Kind::Bool, "true",
                "lay out each step's memory (batch, activations, gradients) in one arena planned from the second step, "
                "instead of allocating block by block (docs/training.md)", memory_plan),
      LATHE_OPT("train.max_bad_steps", Kind::Int, "5", "stop after this many non-finite steps in a row", max_bad_steps),
      LATHE_OPT("final_eval.file", Kind::String, "", "JSONL of {messages|prompt, answer}: accuracy printed at the end", final_eval_file),
      LATHE_OPT("final_eval.max_new_tokens", Kind::Int, "16", "tokens generated per final-eval prompt", final_eval_max_new_tokens),
      LATHE_OPT("lora.rank", Kind::Int, "0", "LoRA rank (0 = full fine-tuning; > 0 freezes the base)", lora_rank),
      LATHE_OPT("lora.alpha", Kind::Float, "32", "LoRA alpha: scaling = alpha / rank (alpha / sqrt(rank) with rslora)", lora_alpha),
      LATHE_OPT("lora.dropout", Kind::Float, "0.0", "dropout on the LoRA input during training", lora_dropout),
      LATHE_OPT("lora.rslora", Kind::Bool, "false", "rank-stabilised scaling alpha / sqrt(rank)", lora_rslora),
      LATHE_OPT("lora.targets", Kind::StringList, "all-linear",
                "modules: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (Qwen3.5 also in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj; qwen3_moe/qwen3_next: gate/up/down_proj mean the experts, as in peft) | all-linear | re:<regex>", lora_targets),
      LATHE_OPT("lora.target_parameters", Kind::StringList, "[]",
                "MoE experts' fused parameters (PEFT target_parameters): mlp.experts.gate_up_proj, mlp.experts.down_proj", lora_target_parameters),
      LATHE_OPT("lora.init", Kind::String, "", "PEFT adapter folder to continue from (default: fresh init)", lora_init),
      LATHE_OPT("resume", Kind::String, "auto", "auto (newest complete checkpoint in output_dir) | none | checkpoint path", resume),
      LATHE_OPT("device", Kind::String, "cpu", "cpu | cuda | cuda:N", device),
      LATHE_OPT("dtype", Kind::String, "", "compute dtype (default f32 on cpu, bf16 on cuda)", dtype),
  };
  return table;
}

// Walks `node` and records every leaf path (mappings under model.config are one leaf).
void collect(const YAML::Node& node, const std::string& prefix, std::map<std::string, YAML::Node>& out) {
  for (const auto& kv : node) {
    const std::string key = prefix.empty() ? kv.first.as<std::string>() : prefix + "." + kv.first.as<std::string>();
    if (kv.second.IsMap() && key != "model.config") collect(kv.second, key, out);
    else out[key] = kv.second;
  }
}

bool kind_matches(Kind k, const YAML::Node& n) {
  try {
    switch (k) {
      case Kind::Int: return n.IsScalar() && (n.as<int64_t>(), true);
      case Kind::Float: return n.IsScalar() && (n.as<double>(), true);
      case Kind::Bool: return n.IsScalar() && (n.as<bool>(), true);
      case Kind::String: return n.IsScalar();
      case Kind::StringList: return n.IsScalar() || n.IsSequence();
      case Kind::Mapping: return n.IsMap();
    }
  } catch (const YAML::Exception&) {
  }
  return false;
}

// The closest option path, to suggest a fix for a typo.
std::string closest(const std::string& key) {
  std::string best;
  size_t best_d = 4;
  for (const Option& o : options()) {
    const std::string p = o.path;
    std::vector<size_t> prev(p.size() + 1), cur(p.size() + 1);
    for (size_t j = 0; j <= p.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= key.size(); ++i) {
      cur[0] = i;
      for (size_t j = 1; j <= p.size(); ++j)
        cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (key[i - 1] != p[j - 1])});
      std::swap(prev, cur);
    }
    if (prev[p.size()] < best_d) best_d = prev[p.size()], best = p;
  }
  return best;
}

}  // namespace

namespace {

// YAML::Node is a handle: assigning to a map entry would write into the node it refers to (shared with other
// maps), so entries are replaced, never assigned.
void replace(std::map<std::string, YAML::Node>& m, const std::string& key, const YAML::Node& value) {
  m.erase(key);
  m.emplace(key, value);
}

// Options a tenant may set for itself; every other option is shared by the whole run.
bool per_tenant(const std::string& path) {
  auto starts = [&](const char* p) { return path.rfind(p, 0) == 0; };
  return starts("data.") || starts("lora.") || starts("final_eval.") || path == "output_dir" ||
         (starts("train.") && path != "train.recompute" && path != "train.deterministic" &&
          path != "train.gemm_autotune" && path != "train.memory_plan" && path != "train.log_every");
}

std::string unknown_key_problem(const std::string& key) {
  const std::string hint = closest(key);
  return fmt::format("unknown option '{}'{}", key, hint.empty() ? "" : fmt::format(" (did you mean '{}'?)", hint));
}

// Fills a config from `given` (leaf path -> value) and the defaults, appending every problem, each prefixed by `where`.
TrainConfig resolve(const std::map<std::string, YAML::Node>& given, const std::string& where, bool has_tenants,
                    std::vector<std::string>& problems) {
  const size_t first_problem = problems.size();
  TrainConfig c;
  std::set<std::string> unparsed;  // options already reported: no second complaint about their value
  for (const Option& o : options()) {
    auto it = given.find(o.path);
    YAML::Node value;
    if (it != given.end() && !it->second.IsNull()) {
      value = it->second;
    } else if (o.fallback) {
      value = *o.fallback ? YAML::Load(o.fallback) : YAML::Node(std::string());
    } else {
      continue;  // optional without default, or required (checked below)
    }
    if (!kind_matches(o.kind, value)) {
      problems.push_back(fmt::format("{}: expected {}, got '{}'", o.path, kind_name(o.kind), YAML::Dump(value)));
      unparsed.insert(o.path);
      continue;
    }
    o.set(c, value);
    c.resolved[o.path] = to_json(value);
  }
  // Cross-field checks.
  if (c.model_path.empty() == c.model_config.is_null())
    problems.push_back("model: give exactly one of model.path (fine-tune) or model.config (train from scratch)");
  if (c.tokenizer.empty()) c.tokenizer = c.model_path;
  if (c.tokenizer.empty()) problems.push_back("model.tokenizer: required when training from model.config");
  if (c.train_files.empty() && !has_tenants) problems.push_back("data.train: at least one training file is required");
  if (c.output_dir.empty()) problems.push_back("output_dir: required");
  if (c.max_steps <= 0 && !unparsed.count("train.max_steps") && !has_tenants)
    problems.push_back("train.max_steps: must be a positive integer");
  if (c.micro_batch_tokens <= 0) problems.push_back("train.micro_batch_tokens: must be positive");
  if (c.grad_accum <= 0) problems.push_back("train.grad_accum: must be positive");
  if (c.max_seq_len <= 0 || c.max_seq_len > c.micro_batch_tokens)
    problems.push_back(fmt::format("data.max_seq_len: must be in 1..train.micro_batch_tokens ({})", c.micro_batch_tokens));
  if (!(c.lr > 0)) problems.push_back("train.lr: must be positive");
  if (c.schedule != "constant" && c.schedule != "linear" && c.schedule != "cosine")
    problems.push_back(fmt::format("train.schedule: '{}' is not one of constant, linear, cosine", c.schedule));
  if (c.overlong != "truncate" && c.overlong != "drop")
    problems.push_back(fmt::format("data.overlong: '{}' is not one of truncate, drop", c.overlong));
  if (c.data_format != "auto" && c.data_format != "text" && c.data_format != "chat" && c.data_format != "prompt_completion")
    problems.push_back(fmt::format("data.format: '{}' is not one of auto, text, chat, prompt_completion", c.data_format));
  if (c.min_lr_ratio < 0 || c.min_lr_ratio > 1) problems.push_back("train.min_lr_ratio: must be in [0, 1]");
  if (c.beta1 < 0 || c.beta1 >= 1 || c.beta2 < 0 || c.beta2 >= 1) problems.push_back("train.beta1/beta2: must be in [0, 1)");
  if (!(c.moe_padded_max_waste >= 0) || !std::isfinite(c.moe_padded_max_waste))
    problems.push_back(
        fmt::format("train.moe_padded_max_waste: {} must be a finite number >= 0", c.moe_padded_max_waste));
  if (c.router_aux_loss != "auto" && c.router_aux_loss != "on" && c.router_aux_loss != "off")
    problems.push_back(fmt::format("train.router_aux_loss: '{}' is not one of auto, on, off", c.router_aux_loss));
  if (c.optimizer_states != "f32" && c.optimizer_states != "bf16") {
    problems.push_back(fmt::format("train.optimizer_states: '{}' is not one of f32, bf16", c.optimizer_states));
  } else if (c.optimizer_states == "bf16") {
    // bf16 states apply to bf16 parameters only; with any other dtype the setting would silently do nothing.
    const std::string dtype = !c.dtype.empty() ? c.dtype : c.device == "cpu" ? "f32" : "bf16";
    if (dtype != "bf16")
      problems.push_back(fmt::format("train.optimizer_states: bf16 keeps bf16 parameters without f32 masters, but the "
                                     "parameters are {} (set dtype: bf16, the default on cuda)", dtype));
  }
  if (c.keep_last < 1) problems.push_back("train.keep_last: must be at least 1");
  if (c.device != "cpu" && c.device != "cuda" && c.device.rfind("cuda:", 0) != 0)
    problems.push_back(fmt::format("device: '{}' is not cpu, cuda or cuda:N", c.device));
  if (c.lora_rank < 0) problems.push_back("lora.rank: must be 0 (full fine-tuning) or positive");
  if (c.lora_rank > 0) {
    if (!(c.lora_alpha > 0)) problems.push_back("lora.alpha: must be positive");
    if (c.lora_dropout < 0 || c.lora_dropout >= 1) problems.push_back("lora.dropout: must be in [0, 1)");
    auto split = [](const std::vector<std::string>& list) {  // "q_proj,v_proj" is a list too
      std::vector<std::string> out;
      for (const std::string& t : list) {
        size_t p = 0;
        for (size_t q; (q = t.find(',', p)) != std::string::npos && t.rfind("re:", 0) != 0; p = q + 1) out.push_back(t.substr(p, q - p));
        out.push_back(t.substr(p));
      }
      std::erase_if(out, [](const std::string& t) { return t.empty(); });
      return out;
    };
    c.lora_targets = split(c.lora_targets);
    c.lora_target_parameters = split(c.lora_target_parameters);
    if (c.lora_targets.empty() && c.lora_target_parameters.empty())
      problems.push_back("lora.targets and lora.target_parameters: both empty");
  } else if (!c.lora_init.empty()) {
    problems.push_back("lora.init: needs lora.rank > 0 (and equal to the adapter's r)");
  } else if (!c.lora_target_parameters.empty()) {
    problems.push_back("lora.target_parameters: needs lora.rank > 0 (full fine-tuning trains every parameter)");
  }
  for (size_t i = first_problem; i < problems.size(); ++i) problems[i] = where + problems[i];
  return c;
}

}  // namespace

TrainConfig load_train_config(const std::string& yaml_path, const std::vector<std::string>& overrides) {
  std::vector<std::string> problems;
  YAML::Node root = YAML::Node(YAML::NodeType::Map);
  if (!yaml_path.empty()) {
    try {
      root = YAML::LoadFile(yaml_path);
    } catch (const YAML::Exception& e) {
      LATHE_FAIL("config: {}: {}", yaml_path, e.what());
    }
    LATHE_CHECK(root.IsMap() || root.IsNull(), "config: {}: the top level must be a mapping", yaml_path);
    if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  }
  std::map<std::string, YAML::Node> given;
  collect(root, "", given);
  for (const std::string& o : overrides) {
    const size_t eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      problems.push_back(fmt::format("--set '{}': expected key.path=value", o));
      continue;
    }
    try {
      replace(given, o.substr(0, eq), YAML::Load(o.substr(eq + 1)));
    } catch (const YAML::Exception& e) {
      problems.push_back(fmt::format("--set '{}': {}", o, e.what()));
    }
  }
  YAML::Node tenants;
  if (given.count("tenants")) {
    tenants = given["tenants"];
    given.erase("tenants");
    if (!tenants.IsSequence() || tenants.size() == 0) {
      problems.push_back("tenants: expected a non-empty list of mappings");
      tenants = YAML::Node();
    }
  }
  std::map<std::string, const Option*> by_path;
  for (const Option& o : options()) by_path[o.path] = &o;
  for (const auto& [key, node] : given)
    if (!by_path.count(key)) problems.push_back(unknown_key_problem(key));
  TrainConfig c = resolve(given, "", tenants.IsDefined() && !tenants.IsNull(), problems);

  std::set<std::string> names, outputs;
  for (size_t i = 0; tenants.IsDefined() && !tenants.IsNull() && i < tenants.size(); ++i) {
    const YAML::Node entry = tenants[i];
    std::string where = fmt::format("tenants[{}]: ", i);
    if (!entry.IsMap()) {
      problems.push_back(where + "expected a mapping with a name and the tenant's options");
      continue;
    }
    std::map<std::string, YAML::Node> own;
    collect(entry, "", own);
    std::string name = own.count("name") && own["name"].IsScalar() ? own["name"].as<std::string>() : "";
    own.erase("name");
    if (name.empty() || name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") != std::string::npos ||
        name[0] == '.') {
      problems.push_back(where + fmt::format("name: required, letters, digits, '_', '-' and '.' only (got '{}')", name));
    } else {
      where = fmt::format("tenants[{}] ({}): ", i, name);
      if (!names.insert(name).second) problems.push_back(where + "a second tenant has this name");
    }
    std::map<std::string, YAML::Node> merged = given;
    for (const auto& [key, node] : own) {
      if (!by_path.count(key)) problems.push_back(where + unknown_key_problem(key));
      else if (!per_tenant(key)) problems.push_back(where + fmt::format("'{}' is shared by every tenant: set it at the top level", key));
      else replace(merged, key, node);
    }
    const bool own_output = own.count("output_dir") > 0;
    if (!own_output && !c.output_dir.empty()) replace(merged, "output_dir", YAML::Node(c.output_dir + "/" + name));
    TrainConfig t = resolve(merged, where, false, problems);
    t.name = name;
    if (t.lora_rank <= 0) problems.push_back(where + "lora.rank: tenants share one frozen base model, so each needs lora.rank > 0");
    if (!t.output_dir.empty() && !outputs.insert(t.output_dir).second)
      problems.push_back(where + fmt::format("output_dir '{}' is used by another tenant", t.output_dir));
    c.tenants.push_back(std::move(t));
  }
  if (!c.tenants.empty()) {
    nlohmann::json list = nlohmann::json::array();
    for (const TrainConfig& t : c.tenants) {
      nlohmann::json r = t.resolved;
      r["name"] = t.name;
      list.push_back(r);
    }
    c.resolved["tenants"] = list;
  }
  if (!problems.empty()) {
    std::string msg = fmt::format("config: {} problem{} in {}:", problems.size(), problems.size() > 1 ? "s" : "",
                                  yaml_path.empty() ? "the options" : yaml_path);
    for (const std::string& p : problems) msg += "\n  - " + p;
    throw Error(msg);
  }
  return c;
}

std::string train_config_help() {
  std::string out;
  for (const Option& o : options())
    out += fmt::format("  {:<30} {:<16} {:<10} {}\n", o.path, kind_name(o.kind), o.fallback ? o.fallback : "(required)", o.help);
  return out;
}

}  // namespace lathe
