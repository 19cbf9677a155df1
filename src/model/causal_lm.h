// The interface every model family implements (Qwen3Model, Qwen35Model), and what they share: the parameter list,
// gradient accumulation, the linear projection with the LoRA bank (forward and backward), the loss head (labelled-row
// gather, chunked logits and cross-entropy, per-segment weights) and save(). The trainer, final eval and the CLI
// (export, logprobs, convert, bench) work on a CausalLm from load_causal_lm / random_causal_lm, which dispatch on
// config.json's model_type.
// Convention: a family builds params_ with Hugging Face names and implements logits / label_logprobs / loss through
// head_loss() and head_label_logprobs(); every linear module that LoRA may adapt goes through project().
// Covered by tests/models/test_qwen3.cpp, test_qwen3_5.cpp, test_lora.cpp, test_lora_qwen3_5.cpp, tests/e2e.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/parameter.h"
#include "io/safetensors.h"
#include "model/batch.h"
#include "model/config.h"
#include "model/lm_head.h"
#include "model/moe_layer.h"
#include "model/pipeline_schedule.h"

namespace lathe {


// The residual stream between decoder layers as its last two terms, x = h + r (r undefined: x = h), so that the add
// runs inside the next norm (CausalLm::norm_stream: residual_rmsnorm) instead of as a kernel of its own.
struct ResidualStream {
  Tensor h, r;
};

// One layer's attention outputs kept from a training forward for the backward's recompute of the layer: an attention
// layer's o and lse (ModelOptions::recompute_keeps_attention), or a Gated DeltaNet layer's delta rule results, its
// output on the layer's rows, chunk-start states and chunk cache (recompute_keeps_gdn; under cp, a layer that passes
// states along the group keeps its output and the state it received instead). DecoderStack points
// CausalLm::kept_attention_ at the layer's slot.
struct KeptAttention {
  Tensor o, lse;
  Tensor core, states, chunk_cache, state_in;
};

class Communicator;

struct ModelOptions {
  Device device = Device::cpu();
  DType dtype = DType::F32;      // parameter and activation dtype (f32 on CPU, bf16 on CUDA)
  bool recompute = false;        // recompute layer activations in the backward pass
  // Under recompute: only the model's first recompute_layers layers (by their index in the whole model) recompute; the
  // others keep their activations from the forward (Megatron's block method). -1: every layer. The memory a kept layer
  // costs and the time a recomputed one takes: docs/training.md, "Recomputation".
  int64_t recompute_layers = -1;
  // Under recompute: each attention layer's kernel outputs (o and its log-sum-exp) are kept from the forward, so the
  // backward's recompute of the layer runs no attention kernel (KeptAttention; docs/parallel.md, "Long documents").
  bool recompute_keeps_attention = false;
  // Under recompute: each Gated DeltaNet layer's delta rule results (its output, chunk-start states and chunk cache)
  // are kept from the forward, so the backward's recompute runs no delta rule forward (and under cp no all-to-all of
  // its output). Far more memory than the attention outputs: docs/training.md.
  bool recompute_keeps_gdn = false;
  int64_t loss_chunk_rows = 2048;  // rows of logits alive at once in the loss head
  // Whether layer `layer` (its index in the whole model) recomputes its activations in the backward.
  bool recomputes(int64_t layer) const { return recompute && (recompute_layers < 0 || layer < recompute_layers); }
  bool train_base = true;        // false: the base weights are frozen (LoRA): no gradient is computed for them
  // false: kernels whose gradients are equal within rounding but not bitwise run to run may be chosen where they are
  // faster (the attention backward's dQ summed across key tiles in any order: AttentionAttrs::deterministic).
  bool deterministic = true;
  // MoE models: whether the trained loss includes router_aux_loss_coef x the load-balancing loss. Unset: the
  // config's output_router_logits decides, as in transformers (off in released Qwen MoE configs).
  std::optional<bool> router_aux_loss;
  // MoE models, training: each sparse layer's row groups are read on the host as soon as it is routed (one wait per
  // layer), as under ep and pp, which pass counts between ranks on the host; false (the default) leaves them on the
  // device for the grouped GEMMs that read them there, and reads the aux loss, the loads and the non-finite check once
  // the batch's backward is queued (docs/moe.md, "Groups on the device").
  bool moe_host_groups = false;
  // MoE models, where the groups are read on the host: the experts' GEMMs of a batch run as one batched GEMM over
  // (E, M, .) blocks, M = the largest expert's row count rounded up to 8 (padding rows computed and discarded), when
  // E M <= moe_padded_max_waste x the routed rows and no expert adapter applies; else as grouped GEMMs over the exact
  // rows. 0 keeps the grouped GEMMs always.
  double moe_padded_max_waste = 1.5;
  // Tensor parallelism (docs/parallel.md, "Tensor parallelism"): the group whose ranks each hold a slice of every
  // attention and MLP layer (nullptr or a group of one: the whole model). The model then works on its slice: config()
  // has the local head counts, intermediate size and vocabulary (vocab_size / tp); the column-parallel projections
  // (q, k, v, gate, up) hold their rank's rows and the row-parallel ones (o, down) its columns; the embedding and the
  // LM head are vocab-parallel (each rank its vocab_size / tp rows: lm_head.h); the norms are whole.
  Communicator* tp = nullptr;
  // Sequence parallelism (Megatron's, with tp > 1): between the tensor-parallel blocks the residual stream, its norms
  // and their inputs hold this rank's rows of the batch's T tokens (ceil(T / tp) a rank, the last padded with zero
  // rows); each block's input is gathered over the group (all-gather) and its partial output summed onto the rows
  // (reduce-scatter) instead of all-reduced. The same communication volume, 1/tp of the stream's activations.
  bool sequence_parallel = false;
  // Context parallelism (docs/parallel.md, "Context parallelism"): the group whose ranks each hold ceil(T / cp)
  // consecutive rows of every batch for the whole stack; attention goes over whole documents by a head all-to-all
  // (each rank all rows of a cp-th of its heads). Every rank is given the whole batch; each parameter's gradient is
  // the rank's rows' part (to sum over the group). Without sp; a decoding batch runs whole on every rank.
  Communicator* cp = nullptr;
  // Expert parallelism (docs/moe.md, "Expert parallelism"): the group whose ranks each hold num_experts / ep of every
  // sparse layer's experts (ShardLayout "ep", split along the expert dimension) and each give their own batch (the
  // ranks are data-parallel for everything else). Each sparse layer routes its rows on the rank, sends each token's
  // row once to every rank holding one of its experts and gets one summed row back (all-to-alls of uneven sizes, planned
  // on the device from the counts the ranks all-gather first: the layer's one wait); an expert's gradient is then that
  // of every rank's rows, a dense parameter's the rank's own part. The aux loss and the expert loads are the group's
  // (routing totals summed over it). ep must be a multiple of cp.
  Communicator* ep = nullptr;
  // Pipeline parallelism (docs/parallel.md, "Pipeline parallelism"): the group of the pipeline's ranks and how the
  // layers are split over its stages. The model holds only its rank's layers (those of its chunks), the embedding on
  // the first rank (and on the last when the head is tied to it), the final norm and the LM head on the last; it runs
  // one stage of one micro-batch at a time (stage_forward, stage_backward; model/pipeline_step.h drives the schedule).
  Communicator* pp = nullptr;
  PipelineLayout pipeline;
};

// What a backward reports while it is being queued (CausalLm::loss), so that a trainer can start work on the gradients
// that are complete (reduce them over data-parallel ranks) while the rest of the backward still runs.
struct BackwardHooks {
  // Called with the number of layers whose backward is still to come: the number of layers once the LM head and the
  // final norm are done, then i after layer i, then -1 once the embedding and the adapters are (the end).
  std::function<void(int64_t layers_left)> grads_done;
  // Called once the whole backward is queued and before the host waits for the loss values: a trainer queues the
  // gradient norm there, so the device does not idle between the backward and the norm.
  std::function<void()> queued;
};

struct LossResult {
  double loss = 0;         // mean over labelled positions
  double loss_sum = 0;     // sum over labelled positions
  int64_t labelled = 0;
  struct Segment {
    double loss_sum = 0;
    int64_t labelled = 0;
  };
  std::vector<Segment> segments;  // one per batch segment (PackedBatch::segments)
  // MoE models: transformers' load-balancing loss over every sparse layer's routing of the batch (before the
  // coefficient; `loss` never includes it), and each sparse layer's expert load.
  double aux_loss = 0;
  std::vector<ExpertLoadStat> expert_load;
};

// Pipeline parallelism: what the last stage computes of a micro-batch — its loss (Train: and the head's backward, the
// stages' activations kept for theirs), its labels' log-probabilities, or the logits after each document's last token
// (decoding through the stages).
enum class StageHead { Loss, Train, LabelLogprobs, LastLogits };

// Pipeline parallelism: one micro-batch's forward on one virtual stage, kept until its backward.
struct StageWork {
  int stage = 0;
  std::shared_ptr<void> acts;  // the family's layer activations (or their inputs, under recompute)
  Tensor out;                  // (2, rows, H): the residual stream's two terms, for the next stage (not on the last)
  LossResult loss;             // the last stage's (StageHead Loss and Train)
  std::vector<double> logprobs;  // the last stage's (StageHead LabelLogprobs): per position, label_logprobs' layout
  Tensor logits;                 // the last stage's (StageHead LastLogits): (documents, V) in the model's dtype
  std::vector<std::pair<int64_t, MoeRoute>> routes;  // the stage's sparse layers' routing, for their backward
  std::vector<RoutingTotals> totals;                  // and its totals (the aux loss is every layer's)
};

class LoraBank;
struct LoraSlot;
struct SegmentAttrs;
struct MoeEpMessages;
struct MoeRouting;
enum class LoraTarget;

class CausalLm {
 public:
  virtual ~CausalLm() = default;

  const ModelConfig& config() const { return config_; }  // this rank's slice of the layers under tensor parallelism
  const ModelConfig& global_config() const { return global_config_; }  // the whole model's (config.json)
  int tp_size() const;
  int tp_rank() const;
  // Whether the embedding and the LM head are split by vocabulary rows over the tp group (tp divides vocab_size).
  bool vocab_parallel() const { return config_.vocab_size != global_config_.vocab_size; }
  // Whether the stack runs on this rank's rows of the batch (ModelOptions::cp of more than one rank), for every batch
  // but a decoding one (with a DecodeCache): generation runs the whole batch on each rank of the cp group alike (the
  // weights are the same there), so prefill and decoding need no split; set by each forward's begin_forward.
  bool context_parallel() const;
  int cp_size() const;
  int cp_rank() const;
  // Whether the sparse layers' experts are split over ModelOptions::ep (more than one rank).
  bool expert_parallel() const { return ep_size() > 1; }
  int ep_size() const;
  int ep_rank() const;
  // Pipeline parallelism: this rank's place in the pipeline, and what it holds (ModelOptions::pipeline).
  int pp_size() const;
  int pp_rank() const;
  bool holds_layer(int64_t layer) const {
    return pp_size() == 1 || options_.pipeline.rank_holds_layer(pp_rank(), layer);
  }
  bool holds_embedding() const { return pp_rank() == 0; }
  bool holds_head() const { return pp_rank() == pp_size() - 1; }
  // The embedding this rank holds (under pp the first stage's, and a tied head's copy on the last), or nullptr.
  Parameter* embedding_parameter();
  const Parameter* embedding_parameter() const;
  // Every declared parameter's shape on this rank and layout (ShardLayout), by name, whether this rank holds it or
  // another pipeline stage does: what an adapter bank, which holds every layer's adapters, splits them by.
  std::map<std::string, std::pair<Shape, ShardLayout>> declared_layouts() const;
  // One micro-batch's part of the stack on virtual stage `stage` (one of this rank's): the embedding of b's ids on the
  // first stage, else the stream `in` (2, rows, H) from the previous; the stage's layers; on the last stage the final
  // norm and `head` (Train: the loss, the head's gradient now and d(loss) kept for stage_backward). A MoE model's
  // routing totals of the stage's layers are in the work (pipeline_step.h joins them for the aux loss).
  virtual std::shared_ptr<StageWork> stage_forward(int stage, const PackedBatch& b, const Tensor& in, StageHead head,
                                                   double loss_scale) = 0;
  // The stage's backward: from d(stream) `dout` (rows, H) from the next stage (undefined on the last), the layers'
  // gradients, and the embedding's on the first stage; returns d(stream) for the previous stage (undefined on the
  // first). `d_aux` (the aux loss's derivative, MoeRoute::d_aux) for the stage's sparse layers when the aux loss is on.
  virtual Tensor stage_backward(StageWork& work, const Tensor& dout, const PackedBatch& b, const Tensor& d_aux) = 0;
  // The rows of the residual stream between stages for batch b: the batch's (under cp the rank's) tokens, under sp
  // this tp rank's share of them.
  int64_t stream_rows(const PackedBatch& b) const;
  // Pipeline parallelism, MoE models (model/pipeline_step.h): the aux loss is every sparse layer's, so each stage's
  // routing totals of a micro-batch travel on with its stream. stage_routing_totals: the stage's, flat (per sparse
  // layer in order: tokens, the per-expert counts, the probability sums; the group's under cp or ep);
  // routing_totals_size: the flat size of the sparse layers before `stage` (all of them for stages()); on the last
  // stage aux_from_pipeline puts the aux loss and the loads of every layer's totals into r and returns the aux
  // derivative every stage's sparse layers take (stage_backward's d_aux; undefined when off or without backward).
  std::vector<double> stage_routing_totals(const StageWork& work);
  int64_t routing_totals_size(int stage) const;
  Tensor aux_from_pipeline(LossResult& r, const std::vector<double>& flat, bool backward, double loss_scale);
  // Whether a backward's stages take the aux derivative (the aux loss on, sparse layers), and its dtype.
  bool pipeline_sends_aux(bool backward) const {
    return backward && aux_loss_on() && routing_totals_size(options_.pipeline.stages()) > 0;
  }
  DType aux_dtype() const { return routing_dtype(); }
  // Whether the residual stream between the blocks holds this rank's rows (ModelOptions::sequence_parallel, tp > 1).
  bool sequence_parallel() const { return options_.sequence_parallel && tp_size() > 1; }
  // A parameter's whole tensor: itself, or under tensor parallelism its slices from every rank of the group joined
  // (a collective: every rank of the group calls it for the same parameter; `grad` the gradient's instead).
  Tensor gathered(const Parameter& p, bool grad = false) const;
  // The inverse: p's piece (its boxes under tp or ep) copied out of `whole`, a tensor of p's global shape on p's device.
  void set_from_whole(const Parameter& p, const Tensor& whole) const;
  // Every parameter of the whole model, whole, in declaration order (a one-process model's parameters() order): on
  // the writer — the first rank of the tp, cp and ep groups on the first pipeline stage — fn(name, tensor), each
  // gathered over tp and ep, the other stages' sent to it (a tied head's copy left out: the embedding's). A collective
  // of those groups and the pipeline: every rank of them calls it (save() does).
  void for_each_whole(const std::function<void(const std::string&, const Tensor&)>& fn) const;
  // The whole model's parameters' element counts, in for_each_whole's order (on any rank).
  std::vector<int64_t> whole_sizes() const;
  // Tensor parallelism above the key/value heads: the gradients of the k and v slices that several ranks hold, each
  // rank's part (from its own query heads) summed over those ranks. A collective: every rank of the group calls it once
  // the step's gradients are complete, before their norm (the trainer does); a sum over micro-batches commutes with it.
  void sum_replicated_grads();
  // Sums p's gradient over the tp ranks that hold the same piece (ShardLayout::replicas; nothing when one does).
  void sum_over_replicas(Parameter& p) const;
  const ModelOptions& options() const { return options_; }
  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  Parameter& parameter(const std::string& name);
  // Moves every parameter's storage to `device` (a frozen model waiting in host memory, and back), one copy per
  // storage, so parameters that share one keep sharing it at the same offsets (the joined projections still join).
  // The model's forward then runs on `device`'s side of the move only where its options' device is; returns the bytes.
  size_t move_parameters(Device device);
  Runtime& runtime() const { return *rt_; }
  // Adapters applied to the rows of a batch according to its segments (nullptr: none). The bank must be built for
  // this model's config and outlive its use; its gradients accumulate like the model's.
  void attach_lora(LoraBank* bank);
  LoraBank* lora() const { return lora_; }

  // Full logits (T, V) of a batch: for tests and scoring of short inputs. Under tensor parallelism the ranks' pieces
  // of each row are gathered (here, in last_logits and lm_head_logits: decoding's rows); the training loss and
  // label_logprobs never gather (LmHead).
  virtual Tensor logits(const PackedBatch& batch) = 0;
  // The logits (B, V) after each document's last token, through the same layers (a decoder's batch carries its
  // DecodeCache, each document continuing one sequence): lm_head_logits(last_hidden(batch)). Under pipeline
  // parallelism through the stages, on every rank of the pipeline (pipeline_last_logits).
  Tensor last_logits(const PackedBatch& batch);
  // The final norm's output (B, H) at each document's last token; with one token a document, nothing is uploaded
  // (a rollout engine records it as a graph).
  virtual Tensor last_hidden(const PackedBatch& batch) = 0;
  // The LM head over rows of the final norm's output: (N, H) -> (N, V).
  virtual Tensor lm_head_logits(const Tensor& x) = 0;
  // Per-position log p(label) (T entries; 0 where the label is -100), chunked like the loss.
  virtual std::vector<double> label_logprobs(const PackedBatch& batch) = 0;
  // Mean cross-entropy over labelled positions; with `backward`, adds every parameter's gradient into
  // Parameter::grad (so micro-batches accumulate), and the attached adapters' gradients into the bank.
  // `loss_scale` multiplies the gradients. A batch with segments differentiates the sum over segments of
  // segment.loss_scale x (the segment's mean loss); LoRA dropout is active only with `backward`.
  // `hooks` report the backward's progress (BackwardHooks).
  virtual LossResult loss(const PackedBatch& batch, bool backward, double loss_scale = 1.0,
                          const BackwardHooks& hooks = {}) = 0;
  void zero_grads();
  // For each parameter, the `layers_left` value of BackwardHooks::grads_done after which the backward adds nothing
  // more to its gradient: its layer's index, the number of layers for the LM head and the final norm, -1 (the end)
  // for the embedding (also a tied head's) and anything else.
  virtual std::vector<int64_t> grads_complete_after() const = 0;

  // Writes config.json (with `architectures`, as transformers writes it) and model.safetensors (sharded above
  // max_shard_bytes) into `dir`, atomically: the folder appears whole or not at all (core/files.h OutputDir). Under
  // tensor parallelism every rank of the group calls it (the slices are gathered) and the group's first rank writes.
  // `add_files`, when given, writes more files (tokenizer, generation config) into the folder before it appears.
  void save(const std::string& dir, DType dtype = DType::F32, uint64_t max_shard_bytes = 5ull << 30,
            const std::function<void(const std::string&)>& add_files = {}) const;

 protected:
  CausalLm(Runtime& rt, ModelConfig config, ModelOptions options);
  CausalLm(const CausalLm&) = default;
  CausalLm(CausalLm&&) = default;
  CausalLm& operator=(const CausalLm&) = default;
  CausalLm& operator=(CausalLm&&) = default;

  // Hooks of save(): the dtype a tensor is written in, and checkpoint tensors the model keeps aside.
  virtual DType save_dtype(const std::string& name, DType requested) const;
  virtual std::vector<io::TensorRef> extra_tensors() const { return {}; }

  ExecContext ctx();
  const Tensor& w(int index) const { return params_[size_t(index)].value; }
  // Checks the batch (device, token ids) and refreshes the attached adapters' slots: the start of every forward.
  void begin_forward(const PackedBatch& b);
  // After a forward's layers: a family drops what it kept from a decoding batch's cache (whose tables may live in
  // memory that goes when the cache's engine goes).
  virtual void end_forward() {}
  void add_grad(int index, const Tensor& g);                                         // unless frozen
  void add_linear_grad(int index, const Tensor& dy, const Tensor& x);  // grad += dy^T x, unless frozen
  // An expert weight's gradient (E, N, K) += each expert's dy_e^T x_e, unless frozen: rows grouped by route r (the
  // grouped GEMM, expert_matmul's choice of groups), or with nullptr the padded form's (E, M, N) and (E, M, K) blocks;
  // added in place where the gradient exists (the later micro-batches: no (E, N, K) temporary and add each time).
  void add_expert_grad(int index, const Tensor& dy, const Tensor& x, MoeRoute* r);
  // The grouped GEMM of rows x grouped by route r (trans_w: w (E, N, K), else (E, K, N)): with the groups on the
  // device where a kernel reads them there, else with expert_groups(r).
  Tensor expert_matmul(MoeRoute& r, const Tensor& x, const Tensor& w, bool trans_w);
  // Route r's groups on the host: under ep the received pairs' (ep_offsets), else the plan's offsets, read back first
  // (one wait) when they were left on the device.
  const std::vector<int64_t>& expert_groups(MoeRoute& r);
  // y = x W^T plus the adapters' terms of (layer, target) for the batch's segments (the LoRA path, docs/lora.md).
  Tensor project(int64_t layer, LoraTarget t, int weight, const Tensor& x, const PackedBatch& b, bool training);
  // The backward of project(): dx (allocated when undefined, else accumulated) += dy W (+ adapter terms); the
  // weight's gradient (unless frozen) and the adapters' slot gradients accumulate.
  void project_backward(int64_t layer, LoraTarget t, int weight, const Tensor& x, const Tensor& dy, Tensor& dx,
                        const PackedBatch& b);
  // y += the adapters' terms of (layer, target) for x, where the batch has any: y is the projection's output or its
  // columns in a wider output (a column slice, written in place).
  void add_lora(int64_t layer, LoraTarget t, const Tensor& x, const Tensor& y, const PackedBatch& b, bool training);
  // The adapters' part of project_backward for dy (a tensor or a column slice): their slot gradients accumulate and
  // dx (defined) += their input gradient.
  void lora_backward(int64_t layer, LoraTarget t, const Tensor& x, const Tensor& dy, Tensor& dx, const PackedBatch& b);
  // {rmsnorm(x; w), x} of the stream x = h + r, the add fused into the norm (residual_rmsnorm; rmsnorm when r is
  // undefined).
  std::pair<Tensor, Tensor> norm_stream(const ResidualStream& s, const Tensor& w, NormAttrs attrs);
  // project() of several weights over the same x, side by side: y (T, out_0 + out_1 + ...). One GEMM over the
  // weights' stacked rows when they are consecutive row blocks of one buffer (pack_rows), each adapter's term added
  // into its weight's columns; else project() per weight, then concat_columns.
  Tensor project_rows(int64_t layer, const std::vector<LoraTarget>& targets, const std::vector<int>& weights,
                      const Tensor& x, const PackedBatch& b, bool training);
  // The backward of project_rows() for dy (T, out_0 + out_1 + ...): one GEMM for dx and one for the stacked
  // gradients (kept as row blocks of one buffer, so that later micro-batches accumulate into it), the adapters
  // reading their columns of dy; or project_backward() per weight.
  void project_rows_backward(int64_t layer, const std::vector<LoraTarget>& targets, const std::vector<int>& weights,
                             const Tensor& x, const Tensor& dy, Tensor& dx, const PackedBatch& b);
  // Makes the values of `weights` (2-D, equal column counts) consecutive row blocks of one new buffer, in order,
  // keeping their values: what project_rows fuses. Loading writes into these views (read_parameters), so they stay.
  void pack_rows(const std::vector<int>& weights);
  // The LM head params_[head] as a component (vocab-parallel under tensor parallelism).
  LmHead lm_head(int head) const;
  // The embedding params_[embed] of token ids (T) -> (T, H): under tensor parallelism each rank looks up the ids of its
  // rows (zero rows for the others') and the rows are summed over the group.
  Tensor embed(int embed, const Tensor& ids);
  // The loss head over xf (T, H), the final norm's output, with the LM head params_[head]: only labelled rows get
  // logits, in chunks of options_.loss_chunk_rows; segments weight their mean losses. With `backward`, the head's
  // gradient accumulates and *dxf receives d(loss)/d(xf) (T, H). The losses stay on the device in `pending` (each
  // chunk's per-row losses and its segment piece) until add_head_losses reads them into the result, so that a caller
  // can queue the backward first and wait once, at the end.
  LossResult head_loss(const Tensor& xf, int head, const PackedBatch& b, bool backward, double loss_scale, Tensor* dxf,
                       std::vector<std::pair<size_t, Tensor>>& pending);
  void add_head_losses(LossResult& result, const PackedBatch& b, const std::vector<std::pair<size_t, Tensor>>& pending);
  // head_loss for a batch with a RowLoss: the labelled rows' log-probabilities (one pass of chunked logits), the
  // loss's terms and derivatives, then a second pass whose cross-entropy gradients are scaled row by row.
  LossResult head_row_loss(const Tensor& xf, int head, const PackedBatch& b, bool backward, double loss_scale,
                           Tensor* dxf);
  std::vector<double> head_label_logprobs(const Tensor& xf, int head, const PackedBatch& b);
  // A layer's attention of its rotated queries, keys and values: within the batch's documents ({o, lse}; under cp the
  // rows of every rank for the rank's heads, cp_cu_seqlens), or for a decoding batch over its DecodeCache ({o,
  // undefined}: no backward). With kept_attention_ set (recompute_keeps_attention), a forward keeps {o, lse} there and
  // the backward's recompute of the layer takes them back instead of running the kernel.
  std::pair<Tensor, Tensor> attend(int64_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v,
                                   const PackedBatch& b);
  // Gated DeltaNet under recompute_keeps_gdn: take_kept_rule gives the backward's recompute of the layer what the
  // forward kept ({core, states, chunk_cache, state_in}, moved out of the slot; true) or returns false (nothing kept:
  // run the rule); keep_rule keeps a training forward's results where the slot and the option ask for it.
  bool take_kept_rule(Tensor& core, Tensor& states, Tensor& chunk_cache, Tensor& state_in);
  void keep_rule(const Tensor& core, const Tensor& states, const Tensor& chunk_cache, const Tensor& state_in);
  // The end of every backward: the embedding's gradient (unless frozen) and the adapters' gradients.
  void end_backward(int embed, const Tensor& dx, const PackedBatch& b);

  // The MLP of layer `layer` (model/moe_layer.h): declare_mlp adds its parameters through `add` (Hugging Face name,
  // shape) -> index, under `prefix` ("model.layers.N."), and remembers them (pack_mlp_rows); mlp_backward returns d(hn)
  // and accumulates the gradients. Under sequence parallelism hn is the block's whole input (T, H) and the output,
  // dout and d(hn) are the stream's rows.
  MlpParams declare_mlp(int64_t layer, const std::string& prefix, const std::function<int(std::string, Shape)>& add);
  // pack_rows for every MLP's gate and up projections (dense, or a sparse layer's shared expert): one GEMM for both.
  void pack_mlp_rows();
  void shard_experts();  // after the parameters exist: the sparse layers' experts over ep (shard_over_ep)
  MlpActs mlp_forward(int64_t layer, const MlpParams& p, const Tensor& hn, const PackedBatch& b, bool training);
  Tensor mlp_backward(int64_t layer, const MlpParams& p, const Tensor& hn, const MlpActs& a, const Tensor& dout,
                      const PackedBatch& b);
  // The mixture-of-experts MLP of sparse layer `layer` (model/moe_layer.h, docs/moe.md); moe_backward returns dx and
  // accumulates the parameters' gradients (the router's includes the aux-loss term when it is on).
  // The batch's adapters apply to the shared expert (through project) and to the experts (grouped GEMMs).
  MoeActs moe_forward(int64_t layer, const MoeParams& p, const Tensor& x, const PackedBatch& b, bool training);
  Tensor moe_backward(int64_t layer, const MoeParams& p, const MoeActs& a, const Tensor& dout, const PackedBatch& b);
  // After a forward of the loss: the aux loss and expert loads into `r`; with `backward` and the aux loss on, each
  // sparse layer's aux gradient (times coef x loss_scale) for moe_backward.
  // Under cp the rows' aux loss and loads are the whole batch's only once summed: each sparse layer's routing totals
  // (tokens, pairs and probability sums per expert) summed over the group (a rank without rows adds zeros).
  void moe_after_forward(LossResult& r, bool backward, double loss_scale);
  // Once the batch's backward is queued (or its forward, without one): what moe_after_forward left on the device for
  // routes whose groups stayed there (the aux loss, the loads) into `r`, in one read; refuses the batch if a router
  // logit was not finite. Nothing for routes read at once.
  void moe_read_routing(LossResult& r);
  // The routing totals summed over `group` (cp: the rows' parts of one batch; ep: the ranks' batches).
  void sum_totals_over(Communicator& group, std::vector<RoutingTotals>& totals) const;
  // The aux loss and the loads of sparse layers `layers` from their (summed) totals into `r`; returns the aux loss's
  // derivative for moe_backward (MoeRoute::d_aux; undefined when the aux loss is off or without backward).
  Tensor aux_from_totals(LossResult& r, const std::vector<int64_t>& layers, const std::vector<RoutingTotals>& totals,
                         bool backward, double loss_scale);
  // Expert parallelism: the plan of a route's all-to-alls (MoeRoute::ep_*, from this rank's moe_ep_messages and every
  // rank's summary of them, all-gathered: `gathered`), the rows sent to their experts' ranks and the outputs (or
  // gradients) sent back.
  void plan_expert_exchange(MoeRoute& r, const MoeEpMessages& messages, const int32_t* gathered) const;
  // The route's one wait under expert parallelism: this rank's moe_ep_messages (into `messages`), and every rank's
  // summary of them (plan offsets, then message lengths), all-gathered and read back; a non-finite router logit on any
  // rank is refused on every rank.
  Tensor gather_ep_summaries(const MoeRouting& m, MoeEpMessages& messages) const;
  Tensor to_expert_ranks(const MoeRoute& r, const Tensor& rows) const;    // (P, w) -> (R, w) by local expert
  Tensor from_expert_ranks(const MoeRoute& r, const Tensor& rows) const;  // (R, w) -> (P, w) in the route's order
  // A (rows, cols) view of ones in the model dtype, kept by the model (the MoE layers take them every layer and batch);
  // training and expert parallelism only: a recorded decoding step must not make the kept buffer grow.
  Tensor ones(int64_t rows, int64_t cols) const;
  // Token rows (T, D) -> the tokens this rank receives (U, D): each token sent once to each rank holding its experts.
  Tensor tokens_to_experts(const MoeRoute& r, const Tensor& rows) const;
  // The received tokens (U, D) -> one row a grouped pair (R, D).
  Tensor expert_pairs(const MoeRoute& r, const Tensor& received) const;
  // Grouped pair rows (R, D) -> (T, D): each received token's pairs summed here times `weights` (U, S), one row back
  // to its rank, and the ranks' rows summed there (MoeRoute::ep_pairs, ep_back).
  Tensor experts_to_tokens(const MoeRoute& r, const Tensor& rows, const Tensor& weights) const;
  bool aux_loss_on() const { return options_.router_aux_loss.value_or(config_.output_router_logits); }
  // The dtype of the router's softmax backward on the device: f32 (transformers' router dtype), f64 in an f64 model.
  DType routing_dtype() const { return options_.dtype == DType::F64 ? DType::F64 : DType::F32; }
  // Checkpoint reading shared by the families: every parameter of params_ from `st` (staged on the host in f32, f64 for
  // an f64 model, so f32/f64 checkpoints stay exact), the experts from either layout (fused gate_up_proj / down_proj, or per-expert
  // experts.N.{gate,up,down}_proj.weight, remembered for save()). Returns the checkpoint names it consumed.
  std::set<std::string> read_parameters(const io::SafetensorsModel& st);
  // The checkpoint tensors of parameter `p` whose host copy in `dtype` is `host`: itself, or its per-expert slices
  // when the checkpoint used that layout.
  std::vector<io::TensorRef> checkpoint_refs(const Parameter& p, DType dtype, const Tensor& host) const;

  // Tensor parallelism: t summed in place over the group (a row-parallel projection's partial output, or a
  // column-parallel one's partial input gradient); nothing without it.
  void tp_sum(Tensor& t) const;
  // The residual stream's side of a tensor-parallel block (ModelOptions::sequence_parallel; without it the stream is
  // whole and these are plain): block_input gathers the rank's rows (rows, H) into the block's input (T, H);
  // block_output sums a block's partial output (T, H) over the group onto the rank's rows (else all-reduced, whole);
  // stream_rows takes the rank's rows of a whole (T, H) that every rank holds (a mixture-of-experts block's output, a
  // whole embedding's); add_norm_grad adds the gradient of the stream norm `index`'s gain, summed over the group
  // under sp (each rank's from its rows).
  Tensor block_input(const Tensor& rows, int64_t tokens) const;
  Tensor block_output(Tensor partial) const;
  Tensor stream_rows(const Tensor& whole) const;
  // Under sp the rank's rows of a block's whole rows (the batch's, or under cp the rank's cp rows); else itself.
  Tensor sp_rows(const Tensor& block) const;
  void add_norm_grad(int index, Tensor g);
  // Context parallelism: the rank's rows of a whole (T, ...) (ceil(T / cp), zero-padded), every rank's rows joined
  // back into the whole (T, ...), and the head all-to-all: (rows, heads, d) -> (cp x rows, heads / cp, d) (every row,
  // the rank's heads) and back. Plain without cp. Fewer heads than ranks (key/value heads) go out repeated, each to
  // the cp / heads ranks that read it, (cp x rows, 1, d); back, sequence_to_heads(x, heads) sums the copies.
  Tensor cp_rows(const Tensor& whole) const;
  Tensor cp_gather(const Tensor& rows, int64_t tokens) const;
  Tensor heads_to_sequence(const Tensor& rows) const;
  Tensor sequence_to_heads(const Tensor& sequence, int64_t heads = -1) const;
  // The rows a block works on: the batch's T tokens, or under cp the rank's ceil(T / cp); cp_real_rows: those of them
  // that are the batch's (the last ranks' rows past T are zero padding; a rank may have none).
  int64_t block_tokens(const PackedBatch& b) const;
  int64_t cp_real_rows(const PackedBatch& b) const;
  Communicator* routing_group() const;  // the ranks one aux loss's routing totals are summed over (moe_layer.cpp)
  // x (n, ...) with zero rows after it up to `rows` (x itself when it has them); a zero tensor of x's shape and dtype
  // (a gradient that is zero on this rank, defined for a sum over the group).
  Tensor zero_padded_rows(const Tensor& x, int64_t rows) const;
  Tensor zeros_like(const Tensor& x) const;
  // The adapters' segments (lora_segments) of the first `rows` of the rows the stack runs on: the batch's, or under cp
  // the rank's, from its first row.
  SegmentAttrs stack_segments(const LoraSlot& slot, const PackedBatch& b, bool training, int64_t rows) const;
  // The final norm's output as the LM head takes it: every row of the batch (gathered under sp or cp).
  Tensor head_input(const Tensor& xf, const PackedBatch& b) const;
  // The loss head under cp runs on the rank's rows of the batch (its final norm's output gathered over tp under sp):
  // head_rows keeps those of the batch's labelled `rows` (and their targets) that fall in the rank's `rows_here`
  // rows, made relative to them, and returns the index of the first kept one among the batch's (0 without cp: all
  // kept); joined_values puts each rank's values (`mine`, from index `at` of `total`) together over the group.
  // head_loss sums the losses over the group (add_head_losses); head_row_loss joins the rows' log-probabilities, so
  // that a RowLoss sees whole sequences, then differentiates the rank's rows; head_label_logprobs joins its rows'.
  size_t head_rows(const PackedBatch& b, int64_t rows_here, std::vector<int32_t>& rows,
                   std::vector<int32_t>& targets) const;
  std::vector<double> joined_values(const std::vector<double>& mine, size_t at, size_t total) const;
  // The batch's cu_seqlens for the all-to-all's cp x rows (a padding document after the last one when cp does not
  // divide T), and the positions of the rows the stack runs on (under cp the rank's), made once a forward.
  const Tensor& cp_cu_seqlens(const PackedBatch& b);
  const Tensor& stack_positions(const PackedBatch& b);
  void make_cp_tables(const PackedBatch& b);
  // The parameter list as a family declares it, in order: `here` false for another pipeline stage's parameter, which
  // is only remembered (absent_, with the index declare returns: -2, -3, ...; the sharding calls take those too) so
  // that random initialisation draws the same values at any layout; allocate_declared makes params_ from the rest.
  int declare(std::string name, Shape shape, bool here);
  void allocate_declared();
  // Every declared parameter in order: its name, whole shape and this rank's Parameter (nullptr: another stage's).
  void for_each_declared(const std::function<void(const std::string&, const Shape&, Parameter*)>& f);
  // Whether a checkpoint tensor belongs to another pipeline stage (loading skips it); the pp rank that holds tensor
  // `name` (a layer's: its stage's; the embedding: 0; the final norm and the head: the last).
  bool held_elsewhere(const std::string& name) const;
  int stage_rank_of(const std::string& name) const;
  // Marks parameter `index` as this rank's slice of a tensor split along `dim` (0: rows, 1: columns) over the group
  // (ShardLayout "tp"), each slice held by `replicas` consecutive ranks; with `sections` (the whole's dim-0 sizes of
  // its parts, e.g. [q | k | v]) the slice is the rank's part of each section, stacked; what loading, random
  // initialisation and gathered() read.
  void shard_over_tp(int index, int dim, int replicas = 1, std::vector<int64_t> sections = {});
  // Marks parameter `index` (experts along dim 0) as this rank's num_experts / ep of them (ShardLayout "ep").
  void shard_over_ep(int index);

  Runtime* rt_;
  ModelConfig global_config_;
  Tensor cp_cu_, cp_positions_;   // make_cp_tables' tensors, for a batch of cp_tables_tokens_ tokens
  int64_t cp_tables_tokens_ = -1;
  int64_t batch_tokens_ = 0;  // the current batch's (begin_forward): every sparse layer routes each once (under cp,
                              // once over the group)
  bool decoding_ = false;  // the current forward's batch is a decoding one (context_parallel())
  KeptAttention* kept_attention_ = nullptr;  // the slot of the layer being run (DecoderStack), or none
  ModelConfig config_;
  ModelOptions options_;
  std::vector<Parameter> params_;
  LoraBank* lora_ = nullptr;
  std::vector<MoeRoute> moe_routes_;  // per layer (empty routes for dense layers)
  mutable Tensor ones_;  // ones() of the model dtype, grown as needed
  bool per_expert_layout_ = false;    // the checkpoint stored experts as experts.N.*_proj.weight: save() does too
  // Pipeline parallelism: the other stages' parameters (declare), and the declaration order (index >= 0: params_,
  // <= -2: absent_[-2 - index]).
  struct AbsentParameter {
    std::string name;
    Shape shape;
    ShardLayout shard;
  };
  std::vector<AbsentParameter> absent_;
  std::vector<std::pair<std::string, Shape>> declared_here_;
  std::vector<int> declared_;

 private:
  // When a route's groups reach the host (MoeRoute): at once with its totals (pairs per expert and the probabilities'
  // column sums), never (a decoding step: routes_on_device), or at the batch's end (training: groups_on_device).
  enum class RouteRead { now, never, at_batch_end };
  // The routing of rows x (the moe_route op).
  MoeRoute make_route(const MoeParams& p, const Tensor& x, RouteRead read);
  // Whether a forward of batch b routes `layer` without a host wait: a decoding step (a cache, no training, one token
  // a sequence: not a prefill chunk) without expert parallelism (its exchange sizes come from the host) or adapters on
  // the experts (their GEMMs take host groups). A decoding step of such layers only can be recorded as a graph.
  bool routes_on_device(int64_t layer, const PackedBatch& b, bool training) const;
  // Whether a training forward leaves its groups on the device (RouteRead::at_batch_end): unless the host path is
  // asked for (ModelOptions::moe_host_groups), under ep (it plans its exchange from the counts on the host) or pp (the
  // stages pass their routing totals on the host). Under cp the totals are summed over the group on the device.
  bool groups_on_device(bool training) const;
  // The layer's output for rows x routed by r; with a batch b, its adapters apply (decoding passes none: merged).
  MoeActs moe_apply(int64_t layer, MoeRoute& r, const MoeParams& p, const Tensor& x, const PackedBatch* b,
                    bool training);
  // moe_after_forward for routes whose groups stayed on the device: the aux loss's gradient computed there, and what
  // moe_read_routing reads (moe_reads_).
  void aux_on_device(const std::vector<int64_t>& layers, const std::vector<MoeRoute*>& routes, bool backward,
                     double loss_scale);
  // What moe_read_routing reads (aux_on_device has the layout): `values`, summed over the `ranks` of the cp group,
  // and, for an error's token only, this rank's moe_route offsets of each of `layers`.
  struct PendingRoutingReads {
    Tensor values, offsets;
    std::vector<int64_t> layers;
    int ranks = 1;
  };
  PendingRoutingReads moe_reads_;
  // The adapters of expert parameter t of `layer` for batch b (ExpertLora::slot nullptr when none, or no batch).
  ExpertLora expert_lora(int64_t layer, LoraTarget t, const PackedBatch* b, const MoeRoute& r);
  // The route's tensor only the backward reads (ones), uploaded on first use.
  void prepare_moe_backward(MoeRoute& r);
  std::vector<MlpParams> mlps_;  // per layer, from declare_mlp
};

// Refuses a tensor-parallel layout of `tp` ranks the model cannot take (a family not built yet, heads or the MLP's
// intermediate size that tp does not divide, key/value heads that neither divide nor are divided by tp), naming the
// problem.
void check_tensor_parallel(const ModelConfig& c, int tp);
// Refuses context parallelism over `cp` ranks (with tp) that the model cannot take (mixture-of-experts layers, heads
// of a tp rank that cp does not divide), naming the problem.
void check_context_parallel(const ModelConfig& whole, int tp, int cp);
// The config of one rank's layers under tensor parallelism over `tp` ranks (checked first): the query heads, the MLP's
// intermediate size, the Gated DeltaNet key and value heads and, where tp divides it, the vocabulary (the embedding's
// and the LM head's rows) divided by tp; above the key/value heads, one a rank. The whole vocabulary (token ids,
// logits' width) is the global config's.
ModelConfig tensor_parallel_config(const ModelConfig& c, int tp);

// A model of config.json's model_type: qwen3 / qwen3_moe -> Qwen3Model; qwen3_5 / qwen3_5_text / qwen3_5_moe /
// qwen3_5_moe_text / qwen3_next -> Qwen35Model.
std::unique_ptr<CausalLm> load_causal_lm(Runtime& rt, const std::string& dir, const ModelOptions& options);
// A randomly initialised model of config.model_type (each family's initialisation).
std::unique_ptr<CausalLm> random_causal_lm(Runtime& rt, const ModelConfig& config, const ModelOptions& options,
                                           uint64_t seed, double std = 0.02);
// Random initialisation: the families draw a tensor's values from one sequential stream (std::mt19937_64), except a
// tensor of at least kCounterDrawnElements values (only large shapes have one: benchmarks' starts), whose values take
// one draw of the stream as a key and are then counter_normal's, on every host thread (the sequential stream took
// minutes for a 10G-parameter shape). Either way a value does not depend on the parallel layout.
constexpr size_t kCounterDrawnElements = size_t(1) << 25;
// out[j] = a normal(0, std) draw that is a function of (key, j) only (splitmix64 and Box-Muller), filled by OpenMP's
// threads.
void counter_normal(std::vector<float>& out, uint64_t key, double std);
void counter_normal(std::vector<double>& out, uint64_t key, double std);

// A model of config.model_type with its parameters allocated and their values not set: for a model whose every value
// arrives from elsewhere before it is used (an async rollout rank's, from the trainer's sync), without the host draws
// of a random one (about 20 s a billion parameters).
std::unique_ptr<CausalLm> allocated_causal_lm(Runtime& rt, const ModelConfig& config, const ModelOptions& options);

}  // namespace lathe
