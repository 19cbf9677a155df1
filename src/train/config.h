// Training configuration: every option is declared once (path, type, default, help) in config.cpp; a YAML
// file plus `--set a.b=value` overrides are checked against that table, and *every* problem (unknown keys,
// wrong types, bad values, missing or conflicting settings) is reported in one error.
// Covered by tests/unit/test_train_config.cpp.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lathe {

struct TrainConfig {
  // model: an HF folder, or an inline HF config for training from scratch.
  std::string model_path;
  nlohmann::json model_config;  // empty unless model.config is given
  double init_std = 0.02;
  std::string tokenizer;  // folder with tokenizer.json (default: model.path)
  // data
  std::vector<std::string> train_files, eval_files;
  std::string data_format = "auto";
  int64_t max_seq_len = 2048;
  bool skip_bad_rows = false;
  std::string overlong = "truncate";
  bool train_on_prompt = false;
  nlohmann::json chat_template_kwargs = nlohmann::json::object();  // rendering variables of 'messages' rows
  // output
  std::string output_dir;
  bool overwrite = false;  // delete the run already in output_dir before starting
  // train
  int64_t max_steps = 0;
  int64_t micro_batch_tokens = 4096;
  int64_t grad_accum = 1;
  double lr = 1e-4;
  std::string schedule = "cosine";
  int64_t warmup_steps = 0;
  double min_lr_ratio = 0.1;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  std::string optimizer_states = "f32";  // f32 (f32 masters + moments) | bf16 (bf16 parameters updated in place)
  std::string router_aux_loss = "auto";  // MoE: auto (config.json's output_router_logits) | on | off
  double moe_padded_max_waste = 1.5;     // MoE: ModelOptions::moe_padded_max_waste (0: grouped expert GEMMs always)
  double max_grad_norm = 1.0;
  uint64_t seed = 0;
  int64_t save_every = 0;  // 0 = only at the end
  int64_t keep_last = 2;
  int64_t eval_every = 0;  // 0 = never
  int64_t eval_batches = 4;
  int64_t log_every = 1;
  bool recompute = false;
  bool deterministic = true;  // false: the attention backward may sum dQ in any order (ModelOptions::deterministic)
  int64_t profile_step = 0;  // 0: off; else the step whose kernels are timed and printed (train.profile_step)
  bool gemm_autotune = false;  // time cuBLASLt's candidate algorithms per GEMM shape (Runtime::set_gemm_autotune)
  bool memory_plan = true;  // each step's memory in one planned arena (Runtime::enable_memory_plan)
  int64_t max_bad_steps = 5;
  // final check: generate answers for held-out prompts and print the accuracy
  std::string final_eval_file;
  int64_t final_eval_max_new_tokens = 16;
  // LoRA (lora.rank > 0): the base is frozen and one adapter per tenant is trained
  int64_t lora_rank = 0;
  double lora_alpha = 32;
  double lora_dropout = 0.0;
  bool lora_rslora = false;
  std::vector<std::string> lora_targets = {"all-linear"};
  std::vector<std::string> lora_target_parameters;
  std::string lora_init;  // PEFT adapter folder to start from (default: fresh PEFT initialisation)
  // multi-tenant runs: one entry per tenant, each a whole config (shared options inherited from the top level)
  std::string name;  // the tenant's name ("" for a single-job run)
  std::vector<TrainConfig> tenants;
  // parallel layout (docs/parallel.md): sizes whose product is the world size (dp 0: inferred), ZeRO stage, the
  // collectives' timeout
  int64_t tp = 1, cp = 1, ep = 1, pp = 1, dp = 0;
  int64_t zero = 0;
  double bucket_mb = 128;  // gradient buckets summed over dp while the backward runs
  double timeout_s = 600;
  double save_timeout_s = 3600;  // how long the other ranks wait while the first one writes a checkpoint
  // where
  std::string resume = "auto";  // auto | none | path of a checkpoint
  std::string device = "cpu";
  std::string dtype;  // default: f32 on cpu, bf16 on cuda

  nlohmann::json resolved;  // every option with its final value, saved beside the outputs
};

// Reads `yaml_path` (may be empty: defaults and overrides only) and applies "a.b=value" overrides. Relative paths in
// the file are taken relative to its folder; those in overrides, relative to the current directory. A key given twice
// in one mapping is a problem. "model.config.KEY=value" sets one field of the inline model config.
// A `tenants:` list makes a multi-tenant LoRA run: each entry is a mapping with a `name` and any of the per-tenant
// options (data.*, lora.*, train.* except train.recompute, train.deterministic, train.gemm_autotune,
// train.memory_plan and train.log_every, output_dir, final_eval.*); what an entry does not set it inherits from the top level. Model,
// device, dtype and resume are shared by every tenant. Each tenant's output_dir defaults to <output_dir>/<name>.
TrainConfig load_train_config(const std::string& yaml_path, const std::vector<std::string>& overrides);

// One line per option: "train.lr (float, default 0.0001): peak learning rate".
std::string train_config_help();

}  // namespace lathe
