#include "train/config.h"

#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "core/error.h"
#include "core/files.h"
#include "data/dataset.h"

namespace lathe {

namespace {

enum class Kind { Int, Float, Bool, String, StringList, Mapping, TenantList };

// The values a number option accepts: lo..hi, each end open or closed. Every number must also be finite.
struct Range {
  double lo = -INFINITY, hi = INFINITY;
  bool lo_open = false, hi_open = false;
  bool contains(double v) const {
    return std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  }
  std::string text() const {
    if (std::isinf(hi)) return fmt::format("{} {}", lo_open ? ">" : ">=", lo);
    return fmt::format("in {}{}, {}{}", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
  }
};
constexpr double kMaxTokens = 2147483647.0;  // token counts and positions are int32 on the device
Range at_least(double lo) { return {lo, INFINITY, false, false}; }
Range above(double lo) { return {lo, INFINITY, true, false}; }
Range between(double lo, double hi, bool hi_open = false) { return {lo, hi, false, hi_open}; }

// How an option's absence is treated: it has a default, it is required, or it is optional with no default.
enum class Need { Default, Required, Optional };

struct Option {
  const char* path;
  Kind kind;
  const char* fallback;  // YAML text of the default (Need::Default only)
  const char* help;
  std::function<void(TrainConfig&, const YAML::Node&)> set;
  Range range = {};           // Int and Float options
  Need need = Need::Default;
  bool is_path = false;       // a file or folder: relative paths in a config file are relative to its folder
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::Bool: return "bool";
    case Kind::String: return "string";
    case Kind::StringList: return "list of strings";
    case Kind::Mapping: return "mapping";
    case Kind::TenantList: return "list of mappings";
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

// An option with a default (LATHE_OPT), a number with its range (LATHE_NUM), a file or folder (LATHE_PATH), and one
// with no default (LATHE_NEED: Need::Required or Need::Optional).
#define LATHE_SETTER(field) [](TrainConfig& c, const YAML::Node& n) { assign(c.field, n); }
#define LATHE_OPT(path, kind, fallback, help, field) Option{path, kind, fallback, help, LATHE_SETTER(field)}
#define LATHE_NUM(path, kind, fallback, range, help, field) Option{path, kind, fallback, help, LATHE_SETTER(field), range}
#define LATHE_PATH(path, kind, fallback, need, help, field) \
  Option{path, kind, fallback, help, LATHE_SETTER(field), {}, need, true}
#define LATHE_NEED(path, kind, range, need, help, field) Option{path, kind, nullptr, help, LATHE_SETTER(field), range, need}

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
  static const Range any = {};
  static const std::vector<Option> table = {
      LATHE_PATH("model.path", Kind::String, "", Need::Default, "Hugging Face model folder to fine-tune", model_path),
      LATHE_NEED("model.config", Kind::Mapping, any, Need::Optional,
                 "inline HF config.json fields: train a new model from scratch (instead of model.path); "
                 "--set model.config.KEY=VALUE sets one field", model_config),
      LATHE_NUM("model.init_std", Kind::Float, "0.02", above(0), "std of the random initialisation (with model.config)", init_std),
      LATHE_PATH("model.tokenizer", Kind::String, "", Need::Default, "folder with tokenizer.json (default: model.path)", tokenizer),
      LATHE_PATH("data.train", Kind::StringList, nullptr, Need::Required, "training JSONL file(s)", train_files),
      LATHE_PATH("data.eval", Kind::StringList, "[]", Need::Default, "evaluation JSONL file(s)", eval_files),
      LATHE_OPT("data.format", Kind::String, "auto",
                "auto (each row by its keys) | text | messages (alias: chat) | prompt_completion", data_format),
      LATHE_NUM("data.max_seq_len", Kind::Int, "2048", between(1, kMaxTokens), "longest sample in tokens", max_seq_len),
      LATHE_OPT("data.skip_bad_rows", Kind::Bool, "false", "skip (and count) malformed rows instead of stopping", skip_bad_rows),
      LATHE_OPT("data.overlong", Kind::String, "truncate", "samples over max_seq_len: truncate | drop (counted)", overlong),
      LATHE_OPT("data.train_on_prompt", Kind::Bool, "false", "also put loss on prompt / user tokens", train_on_prompt),
      LATHE_OPT("data.chat_template_kwargs", Kind::Mapping, "{enable_thinking: false}",
                "variables the chat template renders 'messages' rows with; saved with the model "
                "(chat_template_kwargs.json) and used by generate, logprobs and the final evaluation; "
                "--set data.chat_template_kwargs.KEY=VALUE sets one", chat_template_kwargs),
      LATHE_PATH("output_dir", Kind::String, nullptr, Need::Required, "folder for checkpoints, metrics and the final model",
                 output_dir),
      LATHE_OPT("overwrite", Kind::Bool, "false",
                "delete the run already in output_dir (checkpoints, metrics, final model) and start again; without it a "
                "folder holding a run is continued (resume: auto) or refused (docs/training.md)", overwrite),
      LATHE_NEED("train.max_steps", Kind::Int, between(1, 1e12), Need::Required, "optimizer steps to run", max_steps),
      LATHE_NUM("train.micro_batch_tokens", Kind::Int, "4096", between(1, kMaxTokens), "tokens packed into one forward/backward",
                micro_batch_tokens),
      LATHE_NUM("train.grad_accum", Kind::Int, "1", between(1, 1e6), "micro-batches per optimizer step", grad_accum),
      LATHE_NUM("train.lr", Kind::Float, "0.0001", above(0), "peak learning rate", lr),
      LATHE_OPT("train.schedule", Kind::String, "cosine", "constant | linear | cosine (after warmup)", schedule),
      LATHE_NUM("train.warmup_steps", Kind::Int, "0", at_least(0), "linear warmup from 0 (at most train.max_steps)", warmup_steps),
      LATHE_NUM("train.min_lr_ratio", Kind::Float, "0.1", between(0, 1),
                "final LR as a fraction of train.lr (linear, cosine)", min_lr_ratio),
      LATHE_NUM("train.weight_decay", Kind::Float, "0.0", at_least(0), "decoupled weight decay (AdamW)", weight_decay),
      LATHE_NUM("train.beta1", Kind::Float, "0.9", between(0, 1, true), "AdamW beta1", beta1),
      LATHE_NUM("train.beta2", Kind::Float, "0.999", between(0, 1, true), "AdamW beta2", beta2),
      LATHE_NUM("train.eps", Kind::Float, "1e-8", above(0), "AdamW epsilon", eps),
      LATHE_OPT("train.optimizer_states", Kind::String, "f32",
                "AdamW state dtype: f32 (f32 masters and moments for bf16 parameters) | bf16 (no masters: bf16 "
                "parameters updated in place, bf16 moments; needs dtype bf16; docs/optim.md)", optimizer_states),
      LATHE_OPT("train.router_aux_loss", Kind::String, "auto",
                "mixture-of-experts models: add router_aux_loss_coef x the load-balancing loss to the trained loss: "
                "auto (as config.json's output_router_logits, like transformers) | on | off (docs/moe.md)",
                router_aux_loss),
      LATHE_OPT("train.moe_host_groups", Kind::Bool, "false",
                "mixture-of-experts models: read each sparse layer's expert groups on the host as it is routed (a wait "
                "per layer) instead of leaving them on the device; ep and pp always do (docs/moe.md)",
                moe_host_groups),
      LATHE_NUM("train.moe_padded_max_waste", Kind::Float, "1.5", at_least(0),
                "mixture-of-experts models, with the groups read on the host: run the experts as one batched GEMM "
                "over blocks padded to the largest expert's rows while E x those rows <= this x the routed rows (0: "
                "grouped GEMMs always; docs/moe.md)",
                moe_padded_max_waste),
      LATHE_NUM("train.max_grad_norm", Kind::Float, "1.0", at_least(0), "global-norm gradient clipping (0 = off)", max_grad_norm),
      LATHE_NUM("train.seed", Kind::Int, "0", at_least(0), "seed of data order and initialisation", seed),
      LATHE_NUM("train.save_every", Kind::Int, "0", at_least(0), "checkpoint every N steps (0 = only at the end)", save_every),
      LATHE_NUM("train.keep_last", Kind::Int, "2", at_least(1), "checkpoints kept", keep_last),
      LATHE_NUM("train.eval_every", Kind::Int, "0", at_least(0), "evaluate every N steps (0 = never)", eval_every),
      LATHE_NUM("train.eval_batches", Kind::Int, "4", at_least(1), "micro-batches per evaluation", eval_batches),
      LATHE_NUM("train.log_every", Kind::Int, "1", at_least(1), "steps between log lines when not on a terminal", log_every),
      LATHE_OPT("train.recompute", Kind::Bool, "false", "recompute activations in the backward pass", recompute),
      LATHE_NUM("train.recompute_layers", Kind::Int, "-1", at_least(-1),
                "under train.recompute, only the model's first N layers recompute and the others keep their "
                "activations (faster where the memory allows; `lathe plan` names the smallest N that fits; -1: all)",
                recompute_layers),
      LATHE_OPT("train.recompute_keeps_attention", Kind::Bool, "false",
                "under train.recompute, keep each attention layer's output and log-sum-exp from the forward (T x q "
                "heads x (head_dim + 2) bf16 a layer) so that the backward does not run attention again: long "
                "documents",
                recompute_keeps_attention),
      LATHE_OPT("train.recompute_keeps_gdn", Kind::Bool, "false",
                "under train.recompute, keep each Gated DeltaNet layer's delta rule output, chunk-start states and "
                "chunk cache from the forward so that the backward does not run the rule again (on CUDA in bf16 "
                "about 1.8 KB a row and value head of 128, a layer: 3.8 GB a layer for Qwen3.5-0.8B at 131,072 "
                "tokens, far more than train.recompute_keeps_attention; docs/training.md)",
                recompute_keeps_gdn),
      LATHE_OPT("train.deterministic", Kind::Bool, "true",
                "bitwise-repeatable gradients; false lets the attention backward sum dQ in any order (faster, equal "
                "within rounding; docs/training.md)", deterministic),
      LATHE_OPT("train.gemm_autotune", Kind::Bool, "false",
                "time cuBLASLt's candidate algorithms on each GEMM shape's first call and keep the fastest (faster; "
                "two runs may then differ in the last bits; docs/training.md)", gemm_autotune),
      LATHE_NUM("train.profile_step", Kind::Int, "0", at_least(0),
                "time every kernel of step N and print the per-kernel table, as lathe bench --profile does (0: off)",
                profile_step),
      LATHE_OPT("train.memory_plan", Kind::Bool, "true",
                "lay out each step's memory (batch, activations, gradients) in one arena planned from the second step, "
                "instead of allocating block by block (docs/training.md)", memory_plan),
      LATHE_NUM("train.max_bad_steps", Kind::Int, "5", at_least(1), "stop after this many non-finite steps in a row", max_bad_steps),
      LATHE_PATH("final_eval.file", Kind::String, "", Need::Default,
                 "JSONL of {messages|prompt, answer}: accuracy printed at the end", final_eval_file),
      LATHE_NUM("final_eval.max_new_tokens", Kind::Int, "16", between(1, kMaxTokens), "tokens generated per final-eval prompt",
                final_eval_max_new_tokens),
      LATHE_NUM("lora.rank", Kind::Int, "0", between(0, 65536), "LoRA rank (0 = full fine-tuning; > 0 freezes the base)", lora_rank),
      LATHE_NUM("lora.alpha", Kind::Float, "32", above(0), "LoRA alpha: scaling = alpha / rank (alpha / sqrt(rank) with rslora)",
                lora_alpha),
      LATHE_NUM("lora.dropout", Kind::Float, "0.0", between(0, 1, true), "dropout on the LoRA input during training", lora_dropout),
      LATHE_OPT("lora.rslora", Kind::Bool, "false", "rank-stabilised scaling alpha / sqrt(rank)", lora_rslora),
      LATHE_OPT("lora.targets", Kind::StringList, "all-linear",
                "modules: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (Qwen3.5 also in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj; qwen3_moe/qwen3_next: gate/up/down_proj mean the experts, as in peft) | all-linear | re:<regex>", lora_targets),
      LATHE_OPT("lora.target_parameters", Kind::StringList, "[]",
                "MoE experts' fused parameters (PEFT target_parameters): mlp.experts.gate_up_proj, mlp.experts.down_proj", lora_target_parameters),
      LATHE_PATH("lora.init", Kind::String, "", Need::Default, "PEFT adapter folder to continue from (default: fresh init)",
                 lora_init),
      LATHE_PATH("resume", Kind::String, "auto", Need::Default,
                 "auto (continue the run in output_dir from its newest complete checkpoint) | none (start afresh: "
                 "output_dir must hold no run) | checkpoint path", resume),
      LATHE_NUM("parallel.dp", Kind::Int, "0", between(0, 65536),
                "data-parallel ranks (0: the world size divided by tp x cp x pp); docs/parallel.md", dp),
      LATHE_NUM("parallel.tp", Kind::Int, "1", between(1, 65536), "tensor-parallel ranks: each holds a slice of every layer (full fine-tuning and LoRA; docs/parallel.md)", tp),
      LATHE_OPT("parallel.sp", Kind::Bool, "false", "sequence parallelism with parallel.tp > 1: the residual stream between the layers' blocks split by tokens over the tp group (1/tp of its activations; docs/parallel.md)", sp),
      LATHE_NUM("parallel.cp", Kind::Int, "1", between(1, 65536), "context-parallel ranks: each holds its rows of every micro-batch, attention and Gated DeltaNet over whole documents by a head all-to-all (docs/parallel.md)", cp),
      LATHE_NUM("parallel.ep", Kind::Int, "1", between(1, 65536), "expert-parallel ranks: each holds num_experts / ep of every mixture-of-experts layer's experts (docs/moe.md)", ep),
      LATHE_NUM("parallel.pp", Kind::Int, "1", between(1, 65536), "pipeline stages: each rank holds the layers of its stages, a step's micro-batches (train.grad_accum) run through them by the 1F1B schedule (full fine-tuning and LoRA; docs/parallel.md)", pp),
      LATHE_NUM("parallel.vpp", Kind::Int, "1", between(1, 65536), "virtual pipeline stages per rank (the interleaved 1F1B schedule: a smaller bubble; train.grad_accum a multiple of parallel.pp)", vpp),
      LATHE_OPT("parallel.pp_layers", Kind::StringList, "[]", "layers of each pipeline stage, pp x vpp counts in stage order, or [balanced]: split by the layers' estimated training FLOPs at data.max_seq_len, the LM head's on the last stage (default: as even as possible, the first stages one more; a hybrid stack balanced)", pp_layers),
      LATHE_NUM("parallel.zero", Kind::Int, "0", between(0, 2),
                "optimizer sharding over dp (dp x cp under context parallelism; each tp slot's slices and each pipeline "
                "stage's tensors over their own; under ep the experts over the ranks holding them): 0 (replicated) | 1 "
                "(ZeRO-1: each rank keeps the f32 masters and AdamW moments of 1/dp of the parameters) | 2 (ZeRO-2: and "
                "between micro-batches only 1/dp of the gradients; not under pp); full fine-tuning; docs/parallel.md",
                zero),
      LATHE_NUM("parallel.bucket_mb", Kind::Float, "128", above(0),
                "gradients are summed over dp in buckets of about this many MiB, each as soon as the backward has "
                "finished it, while the rest of the backward runs", bucket_mb),
      LATHE_NUM("parallel.timeout_s", Kind::Float, "600", above(0),
                "a collective that does not complete in this time ends the job with a report (rank, group, "
                "collective, sequence number)", timeout_s),
      LATHE_NUM("parallel.save_timeout_s", Kind::Float, "3600", above(0),
                "how long the other ranks wait while the first rank writes a checkpoint or the final model (a save "
                "can take far longer than a collective)", save_timeout_s),
      LATHE_OPT("device", Kind::String, "cpu", "cpu | cuda | cuda:N", device),
      LATHE_OPT("dtype", Kind::String, "", "compute dtype: f32 | bf16 (default f32 on cpu, bf16 on cuda)", dtype),
      // lathe rl (docs/rl.md)
      LATHE_PATH("rl.warm_start", Kind::String, "", Need::Default,
                 "a lathe train config run first (continued, or found finished, like any run); its final model is the "
                 "policy's start (model.path)", rl.warm_start),
      LATHE_OPT("rl.algorithm", Kind::String, "grpo",
                "grpo | dr_grpo | dapo | gspo: sets the defaults of rl.clip_high, rl.loss_agg, rl.scale_by_std, "
                "rl.dynamic_sampling and rl.overlong_filter", rl.algorithm),
      LATHE_NUM("rl.samples", Kind::Int, "8", between(1, 4096), "responses sampled per prompt (a group)", rl.samples),
      LATHE_NUM("rl.prompts_per_step", Kind::Int, "16", between(1, 1e6), "prompts (groups) per rollout",
                rl.prompts_per_step),
      LATHE_NUM("rl.minibatches", Kind::Int, "1", between(1, 4096),
                "optimizer steps per rollout: its groups split evenly (train.max_steps counts optimizer steps)",
                rl.minibatches),
      LATHE_NUM("rl.max_new_tokens", Kind::Int, "256", between(1, kMaxTokens), "longest response", rl.max_new_tokens),
      LATHE_NUM("rl.temperature", Kind::Float, "1.0", above(0), "sampling temperature of the rollouts", rl.temperature),
      LATHE_NUM("rl.top_p", Kind::Float, "1.0", between(0, 1), "nucleus sampling (1 = off)", rl.top_p),
      LATHE_NUM("rl.top_k", Kind::Int, "0", at_least(0), "sample from the k most likely tokens (0 = off)", rl.top_k),
      LATHE_NUM("rl.clip_low", Kind::Float, "0.2", between(0, 1, true), "PPO clip: ratio >= 1 - clip_low", rl.clip_low),
      LATHE_NUM("rl.clip_high", Kind::Float, "-1", at_least(-1),
                "PPO clip: ratio <= 1 + clip_high (-1: the algorithm's: 0.28 for dapo, else clip_low)", rl.clip_high),
      LATHE_OPT("rl.loss_agg", Kind::String, "",
                "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (verl's names; empty: "
                "the algorithm's: token-mean for dapo, seq-mean-token-sum-norm for dr_grpo, seq-mean-token-mean else)",
                rl.loss_agg),
      LATHE_OPT("rl.scale_by_std", Kind::String, "auto",
                "divide group advantages by the group's std: auto (all but dr_grpo) | true | false", rl.scale_by_std),
      LATHE_OPT("rl.dynamic_sampling", Kind::String, "auto",
                "drop groups whose rewards are all equal and sample more prompts: auto (dapo) | true | false",
                rl.dynamic_sampling),
      LATHE_NUM("rl.max_sampling_rounds", Kind::Int, "4", between(1, 1000),
                "dynamic sampling: rollouts per step at most (then the step trains on the groups it has)",
                rl.max_sampling_rounds),
      LATHE_OPT("rl.overlong_filter", Kind::String, "auto",
                "responses cut by rl.max_new_tokens take no part in the loss: auto (dapo) | true | false",
                rl.overlong_filter),
      LATHE_NUM("rl.kl_coef", Kind::Float, "0", at_least(0),
                "KL penalty to the reference policy in the loss (LoRA: the base without the adapter; full "
                "fine-tuning: a frozen copy of the starting weights)", rl.kl_coef),
      LATHE_OPT("rl.kl_estimator", Kind::String, "k3", "k1 | k2 | k3 (Schulman's estimators)", rl.kl_estimator),
      LATHE_OPT("rl.reference_offload", Kind::Bool, "false",
                "full fine-tuning with rl.kl_coef: the frozen reference copy waits in host memory and comes to the "
                "device for each update's reference forward (a GPU's memory for one more copy of the weights)",
                rl.reference_offload),
      LATHE_OPT("rl.importance_correction", Kind::String, "auto",
                "weight each token by the trainer's over the rollout engine's probability of it (the train-rollout "
                "mismatch): none | token_tis | seq_tis (truncated at rl.importance_cap) | token_mis | seq_mis (tokens or "
                "sequences whose weight leaves [1/cap, cap] masked out) | auto (token_tis where rl.mode async samples "
                "with older weights, rl.max_staleness above 0; else none)", rl.importance_correction),
      LATHE_NUM("rl.importance_cap", Kind::Float, "2.0", above(1), "the importance weight's bound", rl.importance_cap),
      LATHE_NUM("rl.reward.answer", Kind::Float, "1.0", at_least(0),
                "weight of the answer match (last \\boxed{} or number against the row's \"answer\")", rl.reward_answer),
      LATHE_OPT("rl.reward.format", Kind::String, "", "PCRE2 pattern the whole response must match (\"\" = off)",
                rl.reward_format),
      LATHE_NUM("rl.reward.format_weight", Kind::Float, "0", at_least(0), "weight of the format reward",
                rl.reward_format_weight),
      LATHE_OPT("rl.reward.command", Kind::String, "",
                "external reward: sh -c COMMAND reads one JSON row per response on stdin ({prompt, response, ...the "
                "prompt row's fields}) and prints one number per line (\"\" = off)", rl.reward_command),
      LATHE_NUM("rl.reward.command_weight", Kind::Float, "1.0", at_least(0), "weight of the external reward",
                rl.reward_command_weight),
      LATHE_NUM("rl.reward.command_timeout_s", Kind::Float, "60", above(0),
                "the external command's time per rollout; past it the run stops with an error", rl.reward_command_timeout_s),
      LATHE_NUM("rl.reward.overlong_buffer", Kind::Int, "0", at_least(0),
                "DAPO's overlong shaping: a penalty rising to -1 over the last N tokens before rl.max_new_tokens (0 = off)",
                rl.overlong_buffer),
      LATHE_NUM("rl.max_running", Kind::Int, "256", at_least(1),
                "sequences the rollout engine generates at once (and Gated DeltaNet state slots it keeps)",
                rl.max_running),
      LATHE_NUM("rl.cache_mib", Kind::Int, "0", at_least(0),
                "the rollout engine's KV cache in MiB (0: 80% of the GPU's free memory, 256 MiB on the CPU)", rl.cache_mib),
      LATHE_OPT("rl.offload_optimizer", Kind::String, "auto",
                "auto | true | false: the optimizer state (masters and moments) moves to host memory for each rollout "
                "and back for the updates, so the rollout's cache gets its room (auto: on a GPU, for the rollouts whose cache "
                "would not fit the free memory beside it)", rl.offload_optimizer),
      LATHE_OPT("rl.mode", Kind::String, "colocated",
                "colocated | async: async splits the ranks into training ranks and rollout ranks (rl.rollout_ranks), "
                "which sample while the trainer trains, taking new weights after each rollout's updates (docs/rl.md)",
                rl.mode),
      LATHE_NUM("rl.rollout_ranks", Kind::Int, "0", at_least(0),
                "async: how many of the launch's ranks (the last ones) sample; the rest train (0: half)", rl.rollout_ranks),
      LATHE_NUM("rl.rollout_tp", Kind::Int, "1", at_least(1),
                "async: tensor parallelism of the rollout side: each engine's model split over this many rollout ranks "
                "(rl.rollout_ranks / rl.rollout_tp engines)", rl.rollout_tp),
      LATHE_NUM("rl.max_staleness", Kind::Int, "1", at_least(0),
                "async: how many weight versions a rollout may lag: rollout n is sampled with the weights after the "
                "updates of rollouts up to n - 1 - max_staleness (0: the colocated loop on separate ranks)",
                rl.max_staleness),
      Option{"tenants", Kind::TenantList, nullptr,
             "multi-tenant LoRA: one entry per adapter trained at once over the shared base, each a mapping with a "
             "name and its own data.*, lora.*, train.*, final_eval.* and output_dir (default OUTPUT/NAME), and "
             "under lathe rl its rl.* but rl.minibatches, rl.cache_mib, rl.max_running, rl.offload_optimizer and "
             "rl.warm_start; "
             "the rest is inherited from the top level (docs/lora.md, docs/rl.md)",
             [](TrainConfig&, const YAML::Node&) {}, {}, Need::Optional},
  };
  return table;
}

const Option* find_option(const std::string& path) {
  for (const Option& o : options())
    if (path == o.path) return &o;
  return nullptr;
}

// A mapping option (model.config, data.chat_template_kwargs) is one leaf: its keys are not options.
bool is_mapping_option(const std::string& path) {
  const Option* o = find_option(path);
  return o && o->kind == Kind::Mapping;
}

// Walks `node` and records every leaf path (a mapping option's mapping is one leaf).
void collect(const YAML::Node& node, const std::string& prefix, std::map<std::string, YAML::Node>& out) {
  for (const auto& kv : node) {
    const std::string key = prefix.empty() ? kv.first.as<std::string>() : prefix + "." + kv.first.as<std::string>();
    if (kv.second.IsMap() && !is_mapping_option(key)) collect(kv.second, key, out);
    else out[key] = kv.second;
  }
}

// yaml-cpp keeps both entries of a key given twice in one mapping (and the option code would take the last): every
// such key is a problem, named with its line.
void find_duplicate_keys(const YAML::Node& node, const std::string& file, std::vector<std::string>& problems) {
  if (node.IsSequence()) {
    for (const auto& v : node) find_duplicate_keys(v, file, problems);
    return;
  }
  if (!node.IsMap()) return;
  std::map<std::string, int> first_line;
  for (const auto& kv : node) {
    const std::string key = kv.first.Scalar();
    const int line = kv.first.Mark().line + 1;
    const auto [it, fresh] = first_line.emplace(key, line);
    if (!fresh)
      problems.push_back(fmt::format("{}:{}: key '{}' is given twice in one mapping (first at line {})", file, line, key,
                                     it->second));
    find_duplicate_keys(kv.second, file, problems);
  }
}

// Relative file and folder paths written in a config file are relative to the file's folder, so a config works from
// any current directory; resume's auto and none are words, not paths.
void resolve_paths(std::map<std::string, YAML::Node>& given, const std::filesystem::path& base) {
  if (base.empty()) return;
  auto rebase = [&](const std::string& p) {
    if (p.empty() || std::filesystem::path(p).is_absolute()) return p;
    return (base / p).lexically_normal().string();
  };
  for (auto& [key, node] : given) {
    const Option* o = find_option(key);
    if (!o || !o->is_path || node.IsNull()) continue;
    if (key == "resume" && node.IsScalar() && (node.Scalar() == "auto" || node.Scalar() == "none")) continue;
    YAML::Node rebased;
    if (node.IsSequence()) {
      for (const auto& v : node) rebased.push_back(v.IsScalar() ? YAML::Node(rebase(v.Scalar())) : YAML::Node(v));
    } else if (node.IsScalar()) {
      rebased = YAML::Node(rebase(node.Scalar()));
    } else {
      continue;  // the wrong kind: reported by resolve()
    }
    node = rebased;
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
      case Kind::TenantList: return n.IsSequence();
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
         (starts("rl.") && path != "rl.minibatches" && path != "rl.warm_start" && path != "rl.cache_mib" &&
          path != "rl.offload_optimizer" && path != "rl.max_running" && path != "rl.mode" &&
          path != "rl.rollout_ranks" && path != "rl.rollout_tp" && path != "rl.max_staleness") ||
         (starts("train.") && path != "train.recompute" && path != "train.recompute_layers" &&
          path != "train.recompute_keeps_attention" &&
          path != "train.recompute_keeps_gdn" &&
          path != "train.deterministic" &&
          path != "train.gemm_autotune" && path != "train.memory_plan" && path != "train.log_every" &&
          path != "train.profile_step");
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
    if ((o.kind == Kind::Int || o.kind == Kind::Float) && !o.range.contains(value.as<double>())) {
      problems.push_back(fmt::format("{}: must be {} (got {})", o.path, o.range.text(), value.Scalar()));
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
  if (c.recompute_layers >= 0 && !c.recompute)
    problems.push_back(fmt::format("train.recompute_layers: {} with train.recompute false: it chooses which layers "
                                   "recompute, so it needs train.recompute: true", c.recompute_layers));
  if (c.train_files.empty() && !has_tenants) problems.push_back("data.train: at least one training file is required");
  if (c.output_dir.empty()) problems.push_back("output_dir: required");
  if (!given.count("train.max_steps") && !unparsed.count("train.max_steps") && !has_tenants)
    problems.push_back("train.max_steps: required");
  if (c.max_seq_len > c.micro_batch_tokens)
    problems.push_back(fmt::format("data.max_seq_len: {} exceeds train.micro_batch_tokens ({}): a sample must fit a "
                                   "micro-batch", c.max_seq_len, c.micro_batch_tokens));
  if (c.warmup_steps > c.max_steps && c.max_steps > 0)
    problems.push_back(fmt::format("train.warmup_steps: {} exceed train.max_steps ({})", c.warmup_steps, c.max_steps));
  if (c.schedule != "constant" && c.schedule != "linear" && c.schedule != "cosine")
    problems.push_back(fmt::format("train.schedule: '{}' is not one of constant, linear, cosine", c.schedule));
  if (c.overlong != "truncate" && c.overlong != "drop")
    problems.push_back(fmt::format("data.overlong: '{}' is not one of truncate, drop", c.overlong));
  try {
    data::parse_row_format(c.data_format);
  } catch (const Error&) {
    problems.push_back(fmt::format("data.format: '{}' is not one of auto, text, messages (or chat), prompt_completion",
                                   c.data_format));
  }
  if (c.pp > 1) {  // pipeline parallelism (docs/parallel.md, "Pipeline parallelism"): what the trainer composes it with
    // The stages' gradients are reduced once, after the schedule's last backward (the schedule does not report each
    // micro-batch's), so ZeRO-2 would keep ZeRO-1's memory: refused rather than run as ZeRO-1.
    if (c.zero == 2)
      problems.push_back(fmt::format("parallel.pp: {} with parallel.zero 2: under pipeline parallelism the gradients "
                                     "are reduced once after the schedule, so ZeRO-2 would hold them whole like "
                                     "ZeRO-1: use parallel.zero: 1", c.pp));
    if (c.vpp > 1 && c.grad_accum % c.pp != 0)
      problems.push_back(fmt::format("parallel.vpp: the interleaved schedule runs micro-batches in groups of "
                                     "parallel.pp = {}; train.grad_accum = {} is not a multiple of it", c.pp,
                                     c.grad_accum));
  }
  if (c.vpp > 1 && c.pp <= 1)
    problems.push_back(
        fmt::format("parallel.vpp: {} virtual stages need pipeline parallelism (parallel.pp above 1)", c.vpp));
  const bool balanced = c.pp_layers == std::vector<std::string>{"balanced"};
  for (const std::string& n : c.pp_layers)
    if (!balanced && (n.empty() || n.find_first_not_of("0123456789") != std::string::npos))
      problems.push_back(fmt::format("parallel.pp_layers: '{}' is not a layer count (or give [balanced] alone)", n));
  if (!balanced && !c.pp_layers.empty() && int64_t(c.pp_layers.size()) != c.pp * c.vpp)
    problems.push_back(fmt::format("parallel.pp_layers: {} counts for {} pipeline stages (pp {} x vpp {})",
                                   c.pp_layers.size(), c.pp * c.vpp, c.pp, c.vpp));
  if (c.ep > 1) {  // expert parallelism (docs/moe.md, "Expert parallelism"): what the trainer composes it with
    if (c.cp > 1 && c.ep % c.cp != 0)
      problems.push_back(fmt::format("parallel.ep: {} with parallel.cp {}: ep must be a multiple of cp (each expert "
                                     "group then holds whole context-parallel groups: one aux loss over their batches, "
                                     "one copy of the weights to save)", c.ep, c.cp));
  }
  if (c.sp && c.tp <= 1)
    problems.push_back("parallel.sp: sequence parallelism splits the stream over the tp group: it needs parallel.tp > 1");
  if (c.zero > 0 && (c.lora_rank > 0 || has_tenants))
    problems.push_back(fmt::format("parallel.zero: {} shards a full fine-tuning's optimizer state; LoRA adapters' states "
                                   "are small and stay replicated: use 0", c.zero));
  if (!c.dtype.empty() && c.dtype != "f32" && c.dtype != "bf16" && c.dtype != "f64")
    problems.push_back(fmt::format("dtype: '{}' is not one of f32, bf16 (f64: CPU only)", c.dtype));
  else if (c.dtype == "f64" && c.device != "cpu")
    problems.push_back(fmt::format("dtype: f64 runs on the CPU only (device is {})", c.device));
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
  if (c.device != "cpu" && c.device != "cuda" && c.device.rfind("cuda:", 0) != 0)
    problems.push_back(fmt::format("device: '{}' is not cpu, cuda or cuda:N", c.device));
  if (c.lora_rank > 0) {
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

namespace {

bool is_rl_option(const std::string& path) { return path.rfind("rl.", 0) == 0; }

// lathe rl's limits under `dp` data-parallel ranks (none for dp <= 1).
void rl_layout_problems(const TrainConfig& c, int64_t dp, std::vector<std::string>& problems) {
  const RlOptions& r = c.rl;
  if (dp <= 1) return;
  if (r.prompts_per_step % (r.minibatches * dp) != 0)
    problems.push_back(fmt::format("rl.prompts_per_step: {} groups do not split evenly into rl.minibatches ({}) x "
                                   "parallel.dp ({}): each rank trains an equal share of every mini-batch",
                                   r.prompts_per_step, r.minibatches, dp));
}

// lathe rl's checks of its options against the rest.
void check_rl(const TrainConfig& c, bool has_tenants, std::vector<std::string>& problems) {
  const RlOptions& r = c.rl;
  const auto one_of = [&](const char* key, const std::string& v, std::initializer_list<const char*> allowed) {
    for (const char* a : allowed)
      if (v == a) return;
    problems.push_back(fmt::format("{}: '{}' is not one of {}", key, v, fmt::join(allowed, ", ")));
  };
  one_of("rl.algorithm", r.algorithm, {"grpo", "dr_grpo", "dapo", "gspo"});
  if (!r.loss_agg.empty())
    one_of("rl.loss_agg", r.loss_agg, {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"});
  one_of("rl.scale_by_std", r.scale_by_std, {"auto", "true", "false"});
  one_of("rl.dynamic_sampling", r.dynamic_sampling, {"auto", "true", "false"});
  one_of("rl.overlong_filter", r.overlong_filter, {"auto", "true", "false"});
  one_of("rl.kl_estimator", r.kl_estimator, {"k1", "k2", "k3"});
  one_of("rl.importance_correction", r.importance_correction, {"auto", "none", "token_tis", "token_mis", "seq_tis", "seq_mis"});
  one_of("rl.offload_optimizer", r.offload_optimizer, {"auto", "true", "false"});
  one_of("rl.mode", r.mode, {"colocated", "async"});
  if (has_tenants) return;  // each tenant's policy is checked with its own options (and layout)
  if (c.grad_accum != 1)
    problems.push_back(fmt::format("train.grad_accum: {}: lathe rl takes one mini-batch a step (rl.minibatches splits "
                                   "a rollout)", c.grad_accum));
  if (c.max_steps % r.minibatches != 0)
    problems.push_back(fmt::format("train.max_steps: {} is not a multiple of rl.minibatches ({}): a run ends on a "
                                   "rollout's last update", c.max_steps, r.minibatches));
  if (c.save_every % r.minibatches != 0)
    problems.push_back(fmt::format("train.save_every: {} is not a multiple of rl.minibatches ({}): checkpoints fall "
                                   "between rollouts", c.save_every, r.minibatches));
  if (r.prompts_per_step % r.minibatches != 0)
    problems.push_back(fmt::format("rl.prompts_per_step: {} groups do not split evenly into rl.minibatches ({})",
                                   r.prompts_per_step, r.minibatches));
  if (r.overlong_buffer >= r.max_new_tokens)
    problems.push_back(fmt::format("rl.reward.overlong_buffer: {} must be below rl.max_new_tokens ({})",
                                   r.overlong_buffer, r.max_new_tokens));
  if (r.reward_format.empty() != (r.reward_format_weight == 0))
    problems.push_back("rl.reward.format and rl.reward.format_weight: give both (a pattern and a weight above 0) or "
                       "neither");
  if (r.reward_answer == 0 && r.reward_format_weight == 0 && r.reward_command.empty() && r.overlong_buffer == 0)
    problems.push_back("rl.reward: every reward is off (rl.reward.answer, format_weight, command, overlong_buffer)");
  if (r.reference_offload && (r.kl_coef == 0 || c.lora_rank > 0))
    problems.push_back("rl.reference_offload: only full fine-tuning with rl.kl_coef > 0 keeps a reference copy (under "
                       "LoRA the reference is the base without the adapter)");
  rl_layout_problems(c, c.dp, problems);
}

}  // namespace

void check_rl_layout(const TrainConfig& c, int64_t dp) {
  std::vector<std::string> problems;
  if (c.tenants.empty()) rl_layout_problems(c, dp, problems);
  for (const TrainConfig& t : c.tenants) {
    std::vector<std::string> own;
    rl_layout_problems(t, dp, own);
    for (const std::string& p : own) problems.push_back(fmt::format("tenants ({}): {}", t.name, p));
  }
  LATHE_CHECK(problems.empty(), "config: {}", fmt::join(problems, "; "));
}

TrainConfig load_train_config(const std::string& yaml_path, const std::vector<std::string>& overrides,
                              ConfigFor which) {
  std::vector<std::string> problems;
  YAML::Node root = YAML::Node(YAML::NodeType::Map);
  std::filesystem::path base;  // relative paths in the file are relative to its folder
  if (!yaml_path.empty()) {
    const std::string text = read_text_file(yaml_path, "config");
    try {
      root = YAML::Load(text);
    } catch (const YAML::Exception& e) {
      LATHE_FAIL("config: {}: {}", yaml_path, e.what());
    }
    LATHE_CHECK(root.IsMap() || root.IsNull(), "config: {}: the top level must be a mapping", yaml_path);
    if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
    find_duplicate_keys(root, yaml_path, problems);
    base = std::filesystem::path(yaml_path).parent_path();
    if (base.empty()) base = ".";
  }
  std::map<std::string, YAML::Node> given;
  collect(root, "", given);
  resolve_paths(given, base);
  for (const std::string& o : overrides) {
    const size_t eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      problems.push_back(fmt::format("--set '{}': expected key.path=value", o));
      continue;
    }
    const std::string key = o.substr(0, eq);
    YAML::Node value;
    try {
      value = YAML::Load(o.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      problems.push_back(fmt::format("--set '{}': {}", o, e.what()));
      continue;
    }
    // --set model.config.hidden_size=64: one field of a mapping option, the rest of the mapping kept.
    const size_t dot = key.rfind('.');
    if (dot != std::string::npos && is_mapping_option(key.substr(0, dot))) {
      const std::string mapping = key.substr(0, dot);
      YAML::Node m = given.count(mapping) && given[mapping].IsMap() ? YAML::Clone(given[mapping])
                                                                    : YAML::Node(YAML::NodeType::Map);
      m[key.substr(dot + 1)] = value;
      replace(given, mapping, m);
    } else {
      replace(given, key, value);
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
  for (const auto& [key, node] : given) {
    if (!by_path.count(key)) problems.push_back(unknown_key_problem(key));
    else if (which == ConfigFor::train && is_rl_option(key))
      problems.push_back(fmt::format("'{}' is an option of lathe rl, not lathe train", key));
  }
  // lathe rl with rl.warm_start and no model option: the warm-start run's final model is the policy's start.
  if (which == ConfigFor::rl && given.count("rl.warm_start") && given["rl.warm_start"].IsScalar() &&
      !given.count("model.path") && !given.count("model.config")) {
    const std::string warm = given["rl.warm_start"].Scalar();
    const TrainConfig sft = load_train_config(warm, {});
    replace(given, "model.path", YAML::Node((std::filesystem::path(sft.output_dir) / "final").string()));
    if (!given.count("model.tokenizer")) replace(given, "model.tokenizer", YAML::Node(sft.tokenizer));
  }
  TrainConfig c = resolve(given, "", tenants.IsDefined() && !tenants.IsNull(), problems);
  if (which == ConfigFor::rl) check_rl(c, tenants.IsDefined() && !tenants.IsNull(), problems);
  else
    for (auto it = c.resolved.begin(); it != c.resolved.end();)
      it = is_rl_option(it.key()) ? c.resolved.erase(it) : std::next(it);

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
    resolve_paths(own, base);
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
      else if (which == ConfigFor::train && is_rl_option(key))
        problems.push_back(where + fmt::format("'{}' is an option of lathe rl, not lathe train", key));
      else if (!per_tenant(key)) problems.push_back(where + fmt::format("'{}' is shared by every tenant: set it at the top level", key));
      else replace(merged, key, node);
    }
    const bool own_output = own.count("output_dir") > 0;
    if (!own_output && !c.output_dir.empty()) replace(merged, "output_dir", YAML::Node(c.output_dir + "/" + name));
    TrainConfig t = resolve(merged, where, false, problems);
    t.name = name;
    if (which == ConfigFor::rl) {
      std::vector<std::string> own_problems;
      check_rl(t, false, own_problems);
      for (const std::string& p : own_problems) problems.push_back(where + p);
    }
    if (t.lora_rank <= 0) problems.push_back(where + "lora.rank: tenants share one frozen base model, so each needs lora.rank > 0");
    // rl.mode async walks one schedule of rollouts for every tenant (rl/async_schedule.h): they run in step.
    for (const auto& [key, mine, run] : {std::tuple{"train.max_steps", t.max_steps, c.max_steps},
                                         std::tuple{"train.save_every", t.save_every, c.save_every}})
      if (which == ConfigFor::rl && c.rl.mode == "async" && mine != run)
        problems.push_back(where + fmt::format("{}: {} differs from the run's {}: under rl.mode async the tenants' "
                                               "rollouts run in step (one schedule), so it is shared", key, mine, run));
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

std::string train_config_help(ConfigFor which) {
  std::string out;
  for (const Option& o : options()) {
    if (which == ConfigFor::train && is_rl_option(o.path)) continue;
    const std::string fallback = o.need == Need::Required ? "(required)" : o.need == Need::Optional ? "(none)" : o.fallback;
    std::string help = o.help;
    if ((o.kind == Kind::Int || o.kind == Kind::Float) && (std::isfinite(o.range.lo) || std::isfinite(o.range.hi)))
      help += fmt::format(" (range: {})", o.range.text());
    out += fmt::format("  {:<30} {:<16} {:<10} {}\n", o.path, kind_name(o.kind), fallback, help);
  }
  out += "Relative paths in a config file are relative to the file's folder; in --set, to the current directory.\n";
  return out;
}

}  // namespace lathe
