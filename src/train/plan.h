// The layout planner behind `lathe plan` (docs/plan.md): before launch, for a training config and N processes, the
// bytes one rank holds for each layout tp x cp x dp (x ZeRO stage) — weights, gradients, optimizer state, the
// activations one micro-batch keeps for its backward, the loss head's chunk — the step's peak, and the bytes each
// rank sends through collectives per optimizer step.
// Convention: everything is counted per rank, in bytes, from the model's config alone (nothing is allocated); the
// peak is a walk over the step's phases (forward, loss head, backward layer by layer, optimizer), each phase's live
// memory summed. A layout the trainer would refuse is listed with the trainer's own reason.
// Covered by tests/unit/test_plan.cpp (weights, gradients and states against a built model and optimizer; the peak
// against a real run's allocator peak; cp's activations and traffic against a hand count; refusals),
// tests/e2e/test_plan_cli.cpp (`lathe plan`) and tests/e2e/test_plan_gpu.cpp (the peak against a GPU run's).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/pipeline_schedule.h"
#include "train/config.h"

namespace lathe {

// One layout of the grid's dense view (tp x cp x dp ranks), the ZeRO stage and, for mixture-of-experts models, the
// expert-parallel ranks among the dp ones (each holding num_experts / ep of every sparse layer's experts).
struct PlanLayout {
  int64_t tp = 1, cp = 1, dp = 1, zero = 0, ep = 1, pp = 1;
};

// One rank's memory, in bytes. `peak` is the most that is live at once during a step (plan.cpp walks its phases): not
// the parts' sum, since activations die as the gradients are made, and a phase's temporaries add to it.
struct RankMemory {
  int64_t weights = 0;      // the model's parameters this rank holds (its tp slice; the frozen base under LoRA)
  int64_t gradients = 0;    // kept across the step's micro-batches (ZeRO-2: this rank's 1/(dp x cp) share)
  int64_t optimizer = 0;    // AdamW moments and f32 masters (ZeRO: this rank's 1/(dp x cp) share)
  int64_t activations = 0;  // what one micro-batch's forward keeps for its backward, every layer
  int64_t loss_head = 0;    // the loss head's rows, one chunk's logits and their gradient
  int64_t peak = 0;
};

// The share of a device's memory a layout should leave free (LayoutPlan::tight).
inline constexpr double kTightShare = 0.10;

struct LayoutPlan {
  PlanLayout layout;
  bool configured = false;  // the layout the config asks for
  std::string refused;      // why the trainer would refuse this layout ("" when it runs)
  RankMemory memory;
  int64_t comm_bytes = 0;   // bytes each rank sends per optimizer step (ring all-reduce 2 (n-1)/n S, etc.), the sum of:
  int64_t comm_grads_bytes = 0;  // the gradient sum (and ZeRO's gathers) over the ranks with the same weights, dp x cp
  int64_t comm_tp_bytes = 0;     // tp's activation sums (and its shared k/v and norm gains' gradient sums)
  int64_t comm_cp_bytes = 0;     // cp's head all-to-alls and the final norm's gather
  int64_t comm_ep_bytes = 0;     // ep's all-to-alls of the routed rows and their gradients, each sparse layer
  int64_t comm_pp_bytes = 0;     // pp's streams to the next stage and gradients to the previous, each micro-batch
  bool fits = false;        // peak <= the device memory
  // Fits with less than kTightShare of the memory to spare: the caching allocator may have to free its cache and
  // wait for the device to place a step's blocks (slow steps; session 32's 16,384-token ep run planned at 91% of an
  // H200 made no third step in 200 s).
  bool tight = false;
  // Pipeline parallelism: each pipeline rank's memory (`memory` is the one with the highest peak, heaviest_stage; the
  // comm figures are that rank's but comm_bytes, the most any rank sends).
  std::vector<RankMemory> stages;
  int heaviest_stage = 0;
};

struct TrainingPlan {
  int64_t nproc = 1;
  int64_t memory_bytes = 0;  // one device's (one rank's) memory
  ModelConfig model;         // the whole model's config
  std::vector<LayoutPlan> layouts;
  // Settings that would make the configured run faster, with why (long documents on CUDA: the attention backward's
  // kernel, attention recomputed under train.recompute); empty when there are none.
  std::vector<std::string> notes;
};

// The stages' layers `lathe train` takes for `model` at parallel.pp = `pp`: parallel.pp_layers; else a hybrid stack's
// by its layers' estimated cost at data.max_seq_len (Gated DeltaNet and full attention differ), a uniform one's as
// evenly as possible. Refuses (lathe::Error) a split that cannot be made.
PipelineLayout planned_pipeline(const TrainConfig& c, const ModelConfig& model, int pp);

// The model config `lathe train` would build from `c`: model.path's config.json, or the inline model.config (model
// type qwen3 and the tokenizer's vocabulary size unless given).
ModelConfig planned_model_config(const TrainConfig& c);

// One layout's memory and communication, from the rank's own layer config (tensor_parallel_config: a tp the model
// cannot take throws; plan_layouts lists such layouts as refused). `device_bytes`: one device's memory, which decides
// the CUDA attention backward (cuDNN's, or above 1/16 of it the tiled kernel's smaller scratch); 0: cuDNN's.
LayoutPlan plan_layout(const TrainConfig& c, const ModelConfig& model, const PlanLayout& layout, int64_t device_bytes = 0);

// Every layout of `nproc` ranks: each tp dividing nproc, each cp dividing nproc / tp (dp = nproc / (tp cp)), each ZeRO
// stage 0, 1, 2 (only 0 at dp x cp = 1), and for a mixture-of-experts model each ep dividing dp and the experts. `config_at` returns the config at a layout (the YAML with the layout's parallel.*
// overrides) and throws lathe::Error with the trainer's reason where the config checks refuse it;
// check_tensor_parallel and check_context_parallel refuse the rest. The configured layout (c's tp, cp and dp, and c's
// zero) is marked; an nproc that the configured tp x cp x dp cannot fill is an error.
TrainingPlan plan_layouts(const TrainConfig& c, int64_t nproc, int64_t memory_bytes,
                          const std::function<TrainConfig(const PlanLayout&)>& config_at);

// The `--set` overrides that put a config at `layout`.
std::vector<std::string> layout_overrides(const PlanLayout& layout);

// The plan as a table (one row a layout, memory in MiB/GiB) followed by which layouts fit.
std::string format_plan(const TrainingPlan& plan);
nlohmann::json plan_to_json(const TrainingPlan& plan);

}  // namespace lathe
