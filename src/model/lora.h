// LoRA adapters over a frozen base model, one or many at once (multi-tenant training, docs/lora.md).
// An adapter adds  y += scaling * dropout(x) A^T B^T  to chosen linear modules, A (r, in), B (out, r),
// scaling = alpha / r (alpha / sqrt(r) with rsLoRA). Several adapters may target the same module: a LoraBank
// keeps, for each (layer, module) that any adapter targets, one "slot" holding every adapter's A stacked along
// the rank axis (A_cat (R, in), R = sum of their ranks) and every B transposed and stacked likewise
// (BT_cat (R, out)). A batch whose rows belong to different adapters then needs two GEMMs per module for all of
// them: U = x A_cat^T (T, R), a segment mask that keeps, for each row, only its own adapter's columns (scaled),
// and y += U_masked BT_cat. The base weights are read once for every tenant.
// The routed experts of a mixture-of-experts layer are adapted per expert through their fused parameters
// (mlp.experts.gate_up_proj (E, out, in) and down_proj, PEFT's target_parameters): expert e adds
// scaling * x A_e^T B_e^T; its slot stacks the adapters' ranks inside each expert (A_cat (E R, in), BT_cat (E R, out),
// rows e R + c + j), and the model runs them as grouped GEMMs over the rows sorted by expert (model/moe_layer.cpp).
// Each adapter's parameters are views into its slots' rows, so its optimizer updates them in place.
// Files are PEFT's: adapter_config.json and adapter_model.safetensors with keys
// "base_model.model.<module>.lora_A.weight" (r, in) and "...lora_B.weight" (out, r), <module> the Hugging Face
// module name in the layout the model was loaded from (model.layers.N... or model.language_model.layers.N...).
// An expert parameter's keys are those of peft 0.21's ParamWrapper: "<...>.mlp.experts[.base_layer].lora_A.weight"
// (E r, in), expert-major rows e r + j, and "...lora_B.weight" (out, r E), expert-minor columns j E + e; when both
// expert parameters are adapted their wrappers nest, gate_up_proj inside (".base_layer."), down_proj outside.
// The modules of a layer depend on the family (lora_layer_targets): Qwen3 and Qwen3.5 full-attention layers have
// q/k/v/o_proj (Qwen3.5's q_proj gives query and gate interleaved per head, out = 2 H d), Qwen3.5 Gated DeltaNet
// layers in_proj_qkv/z/b/a and out_proj (Qwen3-Next: in_proj_qkvz/ba); dense MLPs gate/up/down_proj; a sparse layer
// its experts and, in qwen3_5_moe, the shared expert's gate/up/down_proj. For qwen3_moe and qwen3_next, peft 0.21
// (with transformers 5's weight conversion) reads the names gate_proj, up_proj and down_proj as the experts' fused
// parameters (gate_up_proj at twice the rank and alpha); Lathe does the same (lora_config_for_model), so adapters
// mean the same in both, and the dense and shared-expert MLPs of those two families take no adapter (docs/lora.md).
// Covered by tests/models/test_lora.cpp, test_lora_qwen3_5.cpp and test_lora_moe.cpp (finite differences, HF/peft
// fixtures, round trips).
#pragma once

#include <array>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/causal_lm.h"
#include "ops/op_table.h"

namespace lathe {

// The linear modules of a decoder layer that LoRA can adapt (Qwen3 and Qwen3.5: attention, MLP, Gated DeltaNet; the
// mixture-of-experts families: the shared expert and the routed experts' fused parameters).
enum class LoraTarget {
  q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj,    // attention and MLP
  in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj,           // Gated DeltaNet (Qwen3.5 linear_attention)
  in_proj_qkvz, in_proj_ba,                                         // Qwen3-Next's fused GDN input projections
  shared_gate_proj, shared_up_proj, shared_down_proj,               // mlp.shared_expert.{gate,up,down}_proj
  experts_gate_up, experts_down,                                    // mlp.experts.gate_up_proj / down_proj (E, out, in)
};
inline constexpr int kLoraTargetCount = 19;
// Whether t is a routed-expert parameter (matched by target_parameters, one (r, in) x (out, r) pair per expert).
bool lora_target_is_expert(LoraTarget t);
const char* lora_target_name(LoraTarget t);
// The modules of layer `layer` of this model, in a fixed order.
std::vector<LoraTarget> lora_layer_targets(const ModelConfig& model, int64_t layer);
// Every short name a module of this model has (what "all-linear" expands to in adapter_config.json); never the
// expert parameters.
std::vector<std::string> lora_target_names(const ModelConfig& model);
// "model.layers.3.self_attn.q_proj" — the module name PEFT matches target_modules against; for an expert parameter
// "model.layers.3.mlp.experts.gate_up_proj", the key PEFT matches target_parameters against.
std::string lora_module_name(const ModelConfig& model, int64_t layer, LoraTarget t);
// (in, out) of the module's weight (out, in); of each expert's (out, in) block for an expert parameter.
std::pair<int64_t, int64_t> lora_module_dims(const ModelConfig& model, LoraTarget t);

struct LoraConfig {
  int64_t rank = 16;
  double alpha = 32;
  double dropout = 0.0;
  bool rslora = false;
  // Which modules: short names ("q_proj", "self_attn.o_proj" — matched as a name suffix, as PEFT does),
  // "all-linear" (every projection of every layer; never the LM head), or, as a single entry starting with
  // "re:", a regular expression matched against the whole module name (PEFT's string form).
  std::vector<std::string> targets = {"all-linear"};
  // PEFT's target_parameters: the routed experts' fused parameters, "mlp.experts.gate_up_proj" / "experts.down_proj"
  // (matched as a key suffix) or a full key "model.layers.3.mlp.experts.down_proj". No dropout with these (as PEFT).
  std::vector<std::string> target_parameters;
  // PEFT's rank_pattern / alpha_pattern: a module (or expert parameter) name that matches a pattern (equal to it, or a
  // regular expression matching its whole name or a dotted tail of it) takes that rank / alpha instead.
  std::map<std::string, int64_t> rank_pattern;
  std::map<std::string, double> alpha_pattern;

  double scaling() const;
  // Rank, alpha and scaling of the module (or expert parameter) `name` (lora_module_name), with the patterns.
  int64_t rank_of(const std::string& name) const;
  double alpha_of(const std::string& name) const;
  double scaling_of(const std::string& name) const;
  // Whether the module (layer, t) of `model` — one of lora_layer_targets(model, layer) — is adapted.
  bool targets_module(const ModelConfig& model, int64_t layer, LoraTarget t) const;
  // Throws with `where` in the message on a bad rank, alpha, dropout, pattern or target list (unknown names are
  // refused: a target that matches nothing would silently train nothing).
  void validate(const std::string& where, const ModelConfig& model) const;
};

// The config as peft 0.21 applies it to `model`: for qwen3_moe and qwen3_next (transformers 5 fuses their experts),
// the target names gate_proj / up_proj / down_proj become the target parameters gate_up_proj / down_proj, gate_up_proj
// at twice the rank and alpha (rank_pattern / alpha_pattern) when both gate_proj and up_proj are named; one of the two
// alone is refused, as peft does. Other models: unchanged. Idempotent (a file peft wrote is already converted).
LoraConfig lora_config_for_model(const LoraConfig& c, const ModelConfig& model, const std::string& where);

// adapter_config.json <-> LoraConfig. Reading refuses every PEFT feature Lathe does not implement (DoRA, biases,
// modules_to_save, layers_to_transform, ...) by field name.
LoraConfig lora_config_from_peft(const nlohmann::json& j, const std::string& source);
nlohmann::json lora_config_to_peft(const LoraConfig& c, const std::string& base_model, const ModelConfig& model);
LoraConfig read_lora_config(const std::string& adapter_dir);  // DIR/adapter_config.json

// The matrices of one (layer, module) that at least one adapter targets, as the model uses them. Views into the
// bank's slot-layout buffers; refresh() fills a and bt from the adapters, collect_grads() reads grad_a/grad_bt.
struct LoraSlot {
  int64_t layer = 0;
  LoraTarget target = LoraTarget::q_proj;
  int64_t in = 0, out = 0, rank_total = 0;
  int64_t experts = 0;     // E for a routed-expert parameter (a, bt are then (E R, in), (E R, out)), else 0
  Tensor a, bt;            // (R, in), (R, out)
  Tensor grad_a, grad_bt;  // same shapes; zeroed by zero_grads(), accumulated by the model's backward
  std::vector<int64_t> col_begin, col_end;  // per adapter: its rows of a/bt ([c, c) when it does not target this)
  std::vector<double> scaling;              // per adapter: its scaling here (rank_pattern / alpha_pattern apply)
  // (adapters + 1, R) in the bank's dtype: row a holds adapter a's scaling on its columns and zeros elsewhere, the
  // last row (no adapter) zeros; a decoding batch's rows gather theirs (PackedBatch::row_adapters). Modules only.
  Tensor column_masks;
  // Tensor parallelism (LoraBank::split_like), a row-parallel module: its input here (and A's columns) is columns
  // [in_offset, in_offset + in) of in_whole (0: the input is whole); the dropout mask is drawn by those columns.
  int64_t in_offset = 0, in_whole = 0;
};

class LoraBank {
 public:
  using Slot = LoraSlot;

  // Allocates (zero-filled) every adapter and slot on `device` in `dtype`.
  LoraBank(Runtime& rt, const ModelConfig& model, Device device, DType dtype, std::vector<LoraConfig> adapters);
  LoraBank(const LoraBank&) = delete;
  LoraBank& operator=(const LoraBank&) = delete;

  int size() const { return int(adapters_.size()); }
  const LoraConfig& config(int adapter) const { return adapters_[size_t(adapter)].config; }
  // The adapter's matrices, one Parameter per matrix: for each targeted module lora_A (r, in) and lora_B stored
  // transposed, (r, out), named by their PEFT keys. Views into the adapter's flat storage (below); their grads are
  // views into its flat gradient, valid after collect_grads().
  std::vector<Parameter>& parameters(int adapter) { return adapters_[size_t(adapter)].params; }
  // All of the adapter's matrices as one (n, chunk) parameter over the same storage: what its optimizer, gradient
  // norm and clipping work on (two kernel launches per step instead of two per matrix).
  std::vector<Parameter>& flat_parameter(int adapter) { return adapters_[size_t(adapter)].flat; }
  int64_t parameter_count(int adapter) const;

  // PEFT's default initialisation: A kaiming-uniform (bound 1/sqrt(in)), B zero; seeded.
  void init(int adapter, uint64_t seed);
  // Sets the adapter's A and B to zero (it then adds nothing: a failed tenant's weights are taken out).
  void clear(int adapter);
  // Reads DIR/adapter_model.safetensors into the adapter; its config must equal the adapter's (checked).
  void load_peft(int adapter, const std::string& dir);
  // Writes adapter_config.json and adapter_model.safetensors (B transposed back to (out, r)) atomically; `add_files`,
  // when given, writes more files into the folder before it appears.
  void save_peft(int adapter, const std::string& dir, DType dtype, const std::string& base_model,
                 const std::function<void(const std::string&)>& add_files = {}) const;

  // Copies every adapter's current values into the slots (one gather for the whole bank). The model calls it
  // before each forward, so optimizer updates and loads are always seen.
  void refresh();
  // Zeroes the slots' gradients and the adapters' gradients.
  void zero_grads();
  // Copies the slots' accumulated gradients into the adapters' gradients (one gather). The model calls it at the
  // end of each backward.
  void collect_grads();
  // Tensor parallelism: `model` (its layers split over ModelOptions::tp, the bank built from its local config()) is
  // the bank's base. Each matrix is then split as its base weight is: a column-parallel module's B^T holds the rank's
  // output columns (in the base's sections and replicas) and its A is whole, a row-parallel module's A holds the rank's
  // input columns and its B^T is whole; the whole matrix of each pair gets a part of its gradient on every rank
  // (sum_tp_grads). init, load_peft and save_peft then draw, read and write the whole matrices (save_peft: every rank
  // of the group calls it; the first writes). Dropout is refused here (its mask would need the global columns). The
  // adapters' optimizer then works on parameters() (each matrix with its layout), not flat_parameter(). Nothing
  // without tp.
  void split_like(CausalLm& model);
  bool split() const { return tp_model_ != nullptr; }
  // Sums the parts of the adapters' gradients over the tp group: the whole matrices' over every rank, a shared kv
  // head's B^T over the ranks that hold it. A collective, once a step's gradients are complete; nothing without tp.
  void sum_tp_grads();
  // Pipeline parallelism: every adapter's gradient summed over `group` (each stage holds every adapter, and gives the
  // gradients of its own layers' matrices; zero elsewhere). A collective of the group.
  void sum_grads_over(Communicator& group);
  // Whether an adapter targets a routed-expert parameter (such batches need host segments: PackedBatch::row_adapters).
  bool adapts_experts() const;
  // The slot of (layer, target), or nullptr when no adapter targets it.
  const Slot* slot(int64_t layer, LoraTarget t) const;
  Slot* slot(int64_t layer, LoraTarget t);
  Device device() const { return device_; }
  const ModelConfig& model() const { return model_; }  // the config the bank was built for

 private:
  struct Adapter {
    LoraConfig config;
    std::vector<Parameter> params;
    std::vector<Parameter> flat;  // one entry
    std::vector<size_t> partial;  // tp: the params whose gradient is this rank's part of the whole matrix's
  };
  CausalLm* tp_model_ = nullptr;  // split_like's model (its tp group gathers and sums)
  Runtime* rt_;
  ModelConfig model_;
  Device device_;
  DType dtype_;
  std::vector<Adapter> adapters_;
  std::vector<Slot> slots_;
  std::vector<int> slot_index_;  // layer * kLoraTargetCount + target -> index into slots_, -1 = none
  // Storage, in chunks of `chunk_` elements (the gcd of every matrix row length): the adapters' matrices back to
  // back, adapter by adapter (values_, grads_), and the same chunks in slot order (slot_values_, slot_grads_);
  // slot chunk i is adapter chunk to_slot_[i], adapter chunk j is slot chunk to_adapter_[j] (i32 index tensors).
  int64_t chunk_ = 1;
  Tensor values_, grads_, slot_values_, slot_grads_, to_slot_, to_adapter_;
};

// The segment table of one slot for batch b: each segment keeps its adapter's columns of the slot, times the adapter's
// scaling there; dropout probabilities and seeds (per segment, per slot) only when training.
SegmentAttrs lora_segments(const LoraBank& bank, const LoraBank::Slot& slot, const PackedBatch& b, bool training);

// Adds scaling * B A of `adapter` into the base weights of `model` (for generation and merged export); per expert
// for an expert parameter.
void merge_lora(CausalLm& model, LoraBank& bank, int adapter);
// The names of the base parameters merge_lora(..., adapter) changes.
std::vector<std::string> lora_merge_targets(const LoraBank& bank, int adapter);
// "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" -> "model.layers.0.self_attn.q_proj".
std::string lora_key_module(const std::string& key);

}  // namespace lathe
