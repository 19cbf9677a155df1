// Training configuration: every option is declared once (path, type, default, help) in config.cpp; a YAML
// file plus `--set a.b=value` overrides are checked against that table, and *every* problem (unknown keys,
// wrong types, bad values, missing or conflicting settings) is reported in one error.
// Covered by tests/unit/test_train_config.cpp.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lathe {

// `lathe rl`'s own options (the rl.* keys; docs/rl.md). Plain values: the RL loop (src/rl/rl_source.h) reads them.
struct RlOptions {
  std::string warm_start;      // a `lathe train` config run first; its final model is the policy's start
  std::string algorithm = "grpo";  // grpo | dr_grpo | dapo | gspo: the defaults of the settings below
  int64_t samples = 8;             // responses per prompt (a group)
  int64_t prompts_per_step = 16;   // groups per rollout
  int64_t minibatches = 1;         // optimizer steps per rollout (the groups split evenly)
  int64_t max_new_tokens = 256;
  double temperature = 1.0, top_p = 1.0;
  int64_t top_k = 0;
  double clip_low = 0.2, clip_high = -1;  // -1: the algorithm's (DAPO 0.28, else clip_low)
  std::string loss_agg;                   // "": the algorithm's (verl's loss_agg_mode names)
  std::string scale_by_std = "auto";      // auto (off for dr_grpo) | true | false
  std::string dynamic_sampling = "auto";  // auto (on for dapo) | true | false: drop groups whose rewards are all equal
  int64_t max_sampling_rounds = 4;        // dynamic sampling: rollouts per step at most
  std::string overlong_filter = "auto";   // auto (on for dapo) | true | false: truncated responses take no part in the loss
  double kl_coef = 0.0;
  std::string kl_estimator = "k3";
  bool reference_offload = false;              // full fine-tuning's frozen KL reference waits in host memory
  std::string importance_correction = "auto";  // auto | none | token_tis | token_mis | seq_tis | seq_mis
  double importance_cap = 2.0;                 // the truncation (tis) or mask bound (mis) of the rollout weight
  double reward_answer = 1.0;             // weight of the answer-match reward (needs "answer" in each prompt row)
  std::string reward_format;              // PCRE2 pattern of the format reward ("" = off)
  double reward_format_weight = 0.0;
  std::string reward_command;             // external reward command ("" = off)
  double reward_command_weight = 1.0, reward_command_timeout_s = 60;
  int64_t overlong_buffer = 0;            // DAPO's overlong shaping over the last N tokens (0 = off)
  int64_t cache_mib = 0;                  // the rollout engine's KV cache (0: 80% of free GPU memory / 256 MiB CPU)
  int64_t max_running = 256;              // the rollout engine's running sequences
  std::string offload_optimizer = "auto";  // auto (a GPU's rollouts short of room) | true | false: the optimizer state on the host during rollouts
  std::string mode = "colocated";         // colocated | async: separate rollout ranks (docs/rl.md)
  int64_t rollout_ranks = 0;              // async: the last N ranks sample (0: half the world)
  int64_t rollout_tp = 1;                 // async: each rollout engine's model split over this many rollout ranks
  int64_t max_staleness = 1;              // async: rollout n is sampled with the weights after rollout n - 1 - k's updates
};

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
  bool moe_host_groups = false;          // MoE: ModelOptions::moe_host_groups
  double moe_padded_max_waste = 1.5;     // MoE: ModelOptions::moe_padded_max_waste (0: grouped expert GEMMs always)
  double max_grad_norm = 1.0;
  uint64_t seed = 0;
  int64_t save_every = 0;  // 0 = only at the end
  int64_t keep_last = 2;
  int64_t eval_every = 0;  // 0 = never
  int64_t eval_batches = 4;
  int64_t log_every = 1;
  bool recompute = false;
  int64_t recompute_layers = -1;  // under recompute: the model's first N layers recompute (-1: all; ModelOptions)
  bool recompute_keeps_attention = false;
  bool recompute_keeps_gdn = false;
  // Whether layer i of the model recomputes its activations in the backward (ModelOptions::recomputes).
  bool recomputes(int64_t i) const { return recompute && (recompute_layers < 0 || i < recompute_layers); }
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
  int64_t vpp = 1;                     // virtual pipeline stages a rank (the interleaved schedule)
  std::vector<std::string> pp_layers;  // layers of each pipeline stage (empty: as even as possible)
  bool sp = false;  // sequence parallelism with tp (ModelOptions::sequence_parallel)
  int64_t zero = 0;
  double bucket_mb = 128;  // gradient buckets summed over dp while the backward runs
  double timeout_s = 600;
  double save_timeout_s = 3600;  // how long the other ranks wait while the first one writes a checkpoint
  // where
  std::string resume = "auto";  // auto | none | path of a checkpoint
  std::string device = "cpu";
  std::string dtype;  // default: f32 on cpu, bf16 on cuda

  RlOptions rl;  // lathe rl only

  nlohmann::json resolved;  // every option with its final value, saved beside the outputs
};

// Which command reads the config: lathe rl also takes the rl.* options (and data.train holds its prompts).
enum class ConfigFor { train, rl };

// Reads `yaml_path` (may be empty: defaults and overrides only) and applies "a.b=value" overrides. Relative paths in
// the file are taken relative to its folder; those in overrides, relative to the current directory. A key given twice
// in one mapping is a problem. "model.config.KEY=value" sets one field of the inline model config.
// A `tenants:` list makes a multi-tenant LoRA run: each entry is a mapping with a `name` and any of the per-tenant
// options (data.*, lora.*, train.* except train.recompute(_keeps_attention), train.deterministic, train.gemm_autotune,
// train.memory_plan and train.log_every, output_dir, final_eval.*); what an entry does not set it inherits from the top level. Model,
// device, dtype and resume are shared by every tenant. Each tenant's output_dir defaults to <output_dir>/<name>.
// With ConfigFor::rl: the rl.* options too, checked together with the rest (one micro-batch a step, checkpoints on
// rollout boundaries; each tenant's checked with its own options), a tenant may set rl.* except rl.minibatches,
// rl.cache_mib, rl.max_running, rl.offload_optimizer and rl.warm_start; rl.warm_start's run output supplies model.path when neither
// model option is set.
TrainConfig load_train_config(const std::string& yaml_path, const std::vector<std::string>& overrides,
                              ConfigFor which = ConfigFor::train);

// One line per option: "train.lr (float, default 0.0001): peak learning rate".
std::string train_config_help(ConfigFor which = ConfigFor::train);

// lathe rl under a parallel launch whose dp (`dp` ranks) the config left to the launch (parallel.dp 0): the checks
// load_train_config makes of an explicit parallel.dp (equal shares of every mini-batch per rank; no dynamic sampling).
void check_rl_layout(const TrainConfig& c, int64_t dp);

}  // namespace lathe
