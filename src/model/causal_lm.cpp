// What the model families share (see causal_lm.h): gradient accumulation, the LoRA projection, the loss head,
// save(), and the factories. Shapes: T tokens, H hidden, V vocabulary, R the slot's total LoRA rank.
#include "model/causal_lm.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <utility>

#include "comm/communicator.h"
#include "core/files.h"
#include "model/lora.h"
#include "model/pipeline_step.h"
#include "model/qwen3.h"
#include "model/qwen3_5.h"
#include "ops/ops.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

bool any_dropout(const SegmentAttrs& s) {
  return std::any_of(s.p.begin(), s.p.end(), [](double p) { return p > 0; });
}

// The transformers class a config.json of this model_type names in `architectures` (a model made from an inline
// config has none; a loaded folder keeps its own).
std::string architecture_of(const std::string& model_type) {
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  if (model_type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  if (model_type == "qwen3_5_text") return "Qwen3_5ForCausalLM";
  if (model_type == "qwen3_5_moe_text") return "Qwen3_5MoeForCausalLM";
  if (model_type == "qwen3_next") return "Qwen3NextForCausalLM";
  if (model_type == "qwen3_5") return "Qwen3_5ForConditionalGeneration";
  if (model_type == "qwen3_5_moe") return "Qwen3_5MoeForConditionalGeneration";
  LATHE_FAIL("model: no transformers class known for model_type '{}'", model_type);
}

}  // namespace

void check_tensor_parallel(const ModelConfig& c, int tp) {
  if (tp <= 1) return;
  LATHE_CHECK(c.model_type == "qwen3" || c.model_type == "qwen3_moe" || c.is_hybrid(),
              "parallel.tp: tensor parallelism is built for the qwen3, qwen3_moe, qwen3_5 and qwen3_next families, not "
              "{} (docs/parallel.md)", c.model_type);
  bool dense = false;  // a layer with a dense MLP, which tp splits
  for (int64_t i = 0; i < c.num_layers; ++i) dense = dense || !c.sparse_layer(i);
  LATHE_CHECK(c.num_heads % tp == 0 && (!dense || c.intermediate_size % tp == 0),
              "parallel.tp: {} ranks must divide the attention heads ({}) and the MLP's intermediate size ({})", tp,
              c.num_heads, c.intermediate_size);
  LATHE_CHECK(c.num_kv_heads % tp == 0 || tp % c.num_kv_heads == 0,
              "parallel.tp: {} ranks and {} key/value heads: one must divide the other", tp, c.num_kv_heads);
  LATHE_CHECK(!c.is_hybrid() || c.linear_num_key_heads % tp == 0,
              "parallel.tp: {} ranks must divide the Gated DeltaNet key heads ({}; each rank keeps its key heads' "
              "groups of {} value heads)", tp, c.linear_num_key_heads,
              c.linear_num_key_heads > 0 ? c.linear_num_value_heads / c.linear_num_key_heads : 0);
}

void check_context_parallel(const ModelConfig& whole, int tp, int cp) {
  if (cp <= 1) return;
  const ModelConfig c = tensor_parallel_config(whole, tp);  // the head all-to-all splits each tp rank's heads
  LATHE_CHECK(c.model_type == "qwen3" || c.model_type == "qwen3_moe" || c.is_hybrid(), "parallel.cp: context "
              "parallelism is built for the qwen3, qwen3_moe, qwen3_5 and qwen3_next families, not {} (docs/parallel.md)",
              c.model_type);
  // Heads fewer than the ranks are shared: a key/value head by the ranks whose query heads read it, a Gated DeltaNet
  // key head by the ranks whose value heads read it. Gated DeltaNet heads too few for that pass the recurrence's state
  // from rank to rank instead (Qwen35Model::gdn_passes_states): no limit there.
  LATHE_CHECK(c.num_heads % cp == 0 && (c.num_kv_heads % cp == 0 || cp % c.num_kv_heads == 0),
              "parallel.cp: {} ranks must divide each tp rank's attention heads ({}), and divide or be divided by its "
              "key/value heads ({})", cp, c.num_heads, c.num_kv_heads);
}

// This rank's slice of the layers: the heads and the MLP's intermediate size divided over the group (above the
// key/value heads, one key/value head a rank, each held by tp / heads ranks), checked first.
ModelConfig tensor_parallel_config(const ModelConfig& c, int tp) {
  if (tp <= 1) return c;
  check_tensor_parallel(c, tp);
  ModelConfig local = c;
  local.num_heads /= tp;
  local.num_kv_heads = std::max<int64_t>(1, c.num_kv_heads / tp);
  local.intermediate_size /= tp;
  local.linear_num_key_heads /= tp;  // Gated DeltaNet: each rank its key heads and their value heads
  local.linear_num_value_heads /= tp;
  // The vocab-parallel embedding and LM head, each rank its rows, where tp divides the vocabulary; otherwise both stay
  // whole on every rank (a tokenizer's own size, e.g. 151,669; Qwen checkpoints pad theirs to 151,936).
  if (c.vocab_size % tp == 0) local.vocab_size /= tp;
  return local;
}

CausalLm::CausalLm(Runtime& rt, ModelConfig config, ModelOptions options)
    : rt_(&rt), global_config_(std::move(config)), options_(options) {
  rt.check_device(options_.device);
  config_ = tensor_parallel_config(global_config_, tp_size());
  check_context_parallel(global_config_, tp_size(), cp_size());
  if (expert_parallel()) {
    LATHE_CHECK(global_config_.num_experts > 0, "parallel.ep: {} has no mixture-of-experts layers to split over {} "
                "ranks", global_config_.model_type, ep_size());
    LATHE_CHECK(global_config_.num_experts % ep_size() == 0, "parallel.ep: {} experts do not split evenly over {} "
                "ranks", global_config_.num_experts, ep_size());
    LATHE_CHECK(ep_size() % cp_size() == 0, "parallel.ep: {} with parallel.cp {}: ep must be a multiple of cp (each "
                "expert group holds whole context-parallel groups)", ep_size(), cp_size());
  }
  if (pp_size() > 1) {
    const PipelineLayout& pl = options_.pipeline;
    LATHE_CHECK(pl.pp() == pp_size() && pl.end_layer(pl.stages() - 1) == global_config_.num_layers,
                "model: the pipeline layout ({}) is not one for {} ranks and {} layers", pl.describe(), pp_size(),
                global_config_.num_layers);
  }
  moe_routes_.resize(size_t(config_.num_layers));
}

int CausalLm::declare(std::string name, Shape shape, bool here) {
  if (here) {
    declared_here_.emplace_back(std::move(name), std::move(shape));
    declared_.push_back(int(declared_here_.size()) - 1);
  } else {
    absent_.push_back({std::move(name), std::move(shape), {}});
    declared_.push_back(-1 - int(absent_.size()));
  }
  return declared_.back();
}

void CausalLm::allocate_declared() {
  ExecContext cx = ctx();
  for (auto& [name, shape] : declared_here_)
    params_.push_back({name, Tensor::empty(shape, options_.dtype, cx.allocator), {}, {}});
  declared_here_.clear();
}

void CausalLm::for_each_declared(const std::function<void(const std::string&, const Shape&, Parameter*)>& f) {
  for (int i : declared_) {
    if (i >= 0) {
      f(params_[size_t(i)].name, params_[size_t(i)].global_shape(), &params_[size_t(i)]);
    } else {
      const AbsentParameter& a = absent_[size_t(-2 - i)];
      f(a.name, a.shard.global_shape.empty() ? a.shape : a.shard.global_shape, nullptr);
    }
  }
}

namespace {

// The layer of a decoder layer's tensor ("model.layers.N." or "model.language_model.layers.N.", per-expert names
// too); -1 for any other.
int64_t layer_of(const std::string& name) {
  for (const std::string root : {"model.layers.", "model.language_model.layers."}) {
    if (name.rfind(root, 0) != 0) continue;
    int64_t layer = 0;
    size_t end = root.size();
    for (; end < name.size() && std::isdigit(static_cast<unsigned char>(name[end])); ++end)
      layer = layer * 10 + (name[end] - '0');
    return end > root.size() ? layer : -1;
  }
  return -1;
}

}  // namespace

int CausalLm::stage_rank_of(const std::string& name) const {
  const int64_t layer = layer_of(name);
  if (layer >= 0) return options_.pipeline.rank_of(options_.pipeline.stage_of_layer(layer));
  return name.find("embed_tokens") != std::string::npos ? 0 : pp_size() - 1;
}

const Parameter* CausalLm::embedding_parameter() const {
  for (const Parameter& p : params_)
    if (p.name.size() >= 19 && p.name.compare(p.name.size() - 19, 19, "embed_tokens.weight") == 0) return &p;
  return nullptr;
}

Parameter* CausalLm::embedding_parameter() {
  return const_cast<Parameter*>(static_cast<const CausalLm&>(*this).embedding_parameter());
}

std::map<std::string, std::pair<Shape, ShardLayout>> CausalLm::declared_layouts() const {
  std::map<std::string, std::pair<Shape, ShardLayout>> out;
  for (const Parameter& p : params_) out[p.name] = {p.value.shape(), p.shard};
  for (const AbsentParameter& a : absent_) out[a.name] = {a.shape, a.shard};
  return out;
}

bool CausalLm::held_elsewhere(const std::string& name) const {
  if (const int64_t layer = layer_of(name); layer >= 0) return !holds_layer(layer);
  return std::any_of(absent_.begin(), absent_.end(), [&](const AbsentParameter& a) { return a.name == name; });
}

int CausalLm::tp_size() const { return options_.tp ? options_.tp->size() : 1; }
int CausalLm::tp_rank() const { return options_.tp ? options_.tp->rank() : 0; }

void CausalLm::tp_sum(Tensor& t) const {
  if (tp_size() > 1) options_.tp->all_reduce(t);
}

namespace {

// x (T, ...) padded with zero rows to `rows` (itself when it has them).
Tensor padded_rows(ExecContext& cx, const Tensor& x, int64_t rows) {
  if (x.size(0) == rows) return x;
  Shape shape = x.shape();
  shape[0] = rows;
  Tensor out = zeros(cx, shape, x.dtype());
  copy_into(cx, x, out.narrow(0, 0, x.size(0)));
  return out;
}

// Rank `rank` of `n`'s rows of a whole (T, ...): ceil(T / n) of them, the last rank's zero-padded.
Tensor rows_of(ExecContext& cx, const Tensor& whole, int64_t n, int64_t rank) {
  const int64_t mine = (whole.size(0) + n - 1) / n;
  return contiguous(cx, padded_rows(cx, whole, n * mine).narrow(0, rank * mine, mine));
}

// Every rank's rows (rows_of) joined over `group` into the whole's first `tokens` rows.
Tensor joined_rows(ExecContext& cx, Communicator& group, const Tensor& rows, int64_t tokens) {
  const int64_t n = group.size(), size = rows.numel();
  Shape shape = rows.shape();
  shape[0] *= n;
  Tensor all = Tensor::empty(shape, rows.dtype(), cx.allocator);
  Tensor flat = all.view({n * size});
  group.all_gather(contiguous(cx, rows).view({size}), flat);
  return all.narrow(0, 0, tokens);  // the padding rows dropped
}

}  // namespace

Tensor CausalLm::block_input(const Tensor& rows, int64_t tokens) const {
  if (!sequence_parallel()) return rows;
  ExecContext cx = rt_->context(options_.device);
  return joined_rows(cx, *options_.tp, rows, tokens);
}

Tensor CausalLm::block_output(Tensor partial) const {
  if (!sequence_parallel()) {
    tp_sum(partial);
    return partial;
  }
  ExecContext cx = rt_->context(options_.device);
  const int64_t n = tp_size(), mine = (partial.size(0) + n - 1) / n, h = partial.size(1);
  const Tensor in = padded_rows(cx, contiguous(cx, partial), n * mine);
  Tensor out = Tensor::empty({mine, h}, partial.dtype(), cx.allocator);
  Tensor flat = out.view({mine * h});
  options_.tp->reduce_scatter(in.view({n * mine * h}), flat);
  return out;
}

Tensor CausalLm::stream_rows(const Tensor& whole) const { return sp_rows(cp_rows(whole)); }

Tensor CausalLm::sp_rows(const Tensor& block) const {
  if (!sequence_parallel()) return block;
  ExecContext cx = rt_->context(options_.device);
  return rows_of(cx, block, tp_size(), tp_rank());
}

Tensor CausalLm::cp_rows(const Tensor& whole) const {
  if (!context_parallel()) return whole;
  ExecContext cx = rt_->context(options_.device);
  return rows_of(cx, whole, options_.cp->size(), options_.cp->rank());
}

Tensor CausalLm::last_logits(const PackedBatch& batch) {
  if (pp_size() > 1) return pipeline_last_logits(*this, batch);
  return lm_head_logits(last_hidden(batch));
}

Tensor CausalLm::cp_gather(const Tensor& rows, int64_t tokens) const {
  if (!context_parallel()) return rows;
  ExecContext cx = rt_->context(options_.device);
  return joined_rows(cx, *options_.cp, rows, tokens);
}

Tensor CausalLm::heads_to_sequence(const Tensor& heads_rows) const {
  ExecContext cx = rt_->context(options_.device);
  const int64_t c = options_.cp->size(), heads = heads_rows.size(1);
  LATHE_ASSERT(heads % c == 0 || c % heads == 0);
  // Fewer heads than ranks (key/value heads): each head repeated for the c / heads ranks whose query heads read it.
  const Tensor rows = heads >= c ? heads_rows
                                 : contiguous(cx, heads_rows.view({heads_rows.size(0), heads, 1, heads_rows.size(2)})
                                                      .expand({heads_rows.size(0), heads, c / heads, heads_rows.size(2)}))
                                       .view({heads_rows.size(0), c, heads_rows.size(2)});
  const int64_t r = rows.size(0), part = rows.size(1) / c, d = rows.size(2);
  // (c, rows, part d): block j (my rows, rank j's heads) goes to rank j; block j back is rank j's rows, my heads.
  const Tensor send = contiguous(cx, rows.view({r, c, part * d}).transpose(0, 1));
  Tensor recv = Tensor::empty({c * r, part, d}, rows.dtype(), cx.allocator);
  Tensor flat = recv.view({c * r * part * d});
  const std::vector<int64_t> counts(size_t(c), r * part * d);
  options_.cp->all_to_all(send.view({c * r * part * d}), counts, flat, counts);
  return recv;
}

Tensor CausalLm::sequence_to_heads(const Tensor& sequence, int64_t heads) const {
  ExecContext cx = rt_->context(options_.device);
  const int64_t c = options_.cp->size(), r = sequence.size(0) / c, part = sequence.size(1), d = sequence.size(2);
  const Tensor send = contiguous(cx, sequence);  // block j: rank j's rows, my heads
  Tensor recv = Tensor::empty({c, r, part * d}, sequence.dtype(), cx.allocator);  // block j: my rows, rank j's heads
  Tensor flat = recv.view({c * r * part * d});
  const std::vector<int64_t> counts(size_t(c), r * part * d);
  options_.cp->all_to_all(send.view({c * r * part * d}), counts, flat, counts);
  const Tensor rows = contiguous(cx, recv.transpose(0, 1)).view({r, c * part, d});
  if (heads < 0 || heads == c * part) return rows;
  // A head repeated over c / heads ranks (heads_to_sequence): the gradients of its copies summed.
  LATHE_ASSERT(part == 1 && c % heads == 0);
  return sum(cx, rows.view({r, heads, c / heads, d}), {2}, false);
}

bool CausalLm::context_parallel() const { return cp_size() > 1 && !decoding_; }
int CausalLm::cp_size() const { return options_.cp ? options_.cp->size() : 1; }
int CausalLm::cp_rank() const { return options_.cp ? options_.cp->rank() : 0; }
int CausalLm::pp_size() const { return options_.pp ? options_.pp->size() : 1; }
int CausalLm::pp_rank() const { return options_.pp ? options_.pp->rank() : 0; }
int CausalLm::ep_size() const { return options_.ep ? options_.ep->size() : 1; }
int CausalLm::ep_rank() const { return options_.ep ? options_.ep->rank() : 0; }

int64_t CausalLm::stream_rows(const PackedBatch& b) const {
  const int64_t t = block_tokens(b);
  return sequence_parallel() ? (t + tp_size() - 1) / tp_size() : t;
}

int64_t CausalLm::block_tokens(const PackedBatch& b) const {
  if (!context_parallel()) return b.tokens();
  const int64_t c = options_.cp->size();
  return (b.tokens() + c - 1) / c;
}

int64_t CausalLm::cp_real_rows(const PackedBatch& b) const {
  if (!context_parallel()) return b.tokens();
  const int64_t mine = block_tokens(b);
  return std::clamp<int64_t>(b.tokens() - cp_rank() * mine, 0, mine);
}

Tensor CausalLm::zero_padded_rows(const Tensor& x, int64_t rows) const {
  ExecContext cx = rt_->context(options_.device);
  return padded_rows(cx, x, rows);
}

SegmentAttrs CausalLm::stack_segments(const LoraSlot& slot, const PackedBatch& b, bool training, int64_t rows) const {
  SegmentAttrs s = lora_segments(*lora_, slot, b, training);
  s.col_offset = slot.in_offset;  // tensor parallelism: a row-parallel module's columns of its input
  s.row_width = slot.in_whole;
  if (!context_parallel()) return s;
  // Context parallelism: the batch's segments as the rank's rows see them, from its first row, cut at `rows`; a
  // segment that began on an earlier rank keeps counting its rows from its own first row (its dropout mask).
  const int64_t first = cp_rank() * block_tokens(b);
  for (size_t i = 0; i + 1 < s.rows.size(); ++i) s.row_shift.push_back(std::max<int64_t>(0, first - s.rows[i]));
  for (int64_t& r : s.rows) r = std::clamp<int64_t>(r - first, 0, rows);
  return s;
}

Tensor CausalLm::head_input(const Tensor& xf, const PackedBatch& b) const {
  return cp_gather(block_input(xf, block_tokens(b)), b.tokens());
}

void CausalLm::make_cp_tables(const PackedBatch& b) {
  if (cp_tables_tokens_ == b.tokens()) return;
  const int64_t c = options_.cp->size(), padded = (b.tokens() + c - 1) / c * c;
  std::vector<int32_t> cu = b.host_cu;
  if (padded > b.tokens()) cu.push_back(int32_t(padded));  // the padding rows: a document of their own
  cp_cu_ = rt_->upload(cu.data(), {int64_t(cu.size())}, DType::I32, options_.device);
  cp_positions_ = cp_rows(b.positions);
  cp_tables_tokens_ = b.tokens();
}

const Tensor& CausalLm::cp_cu_seqlens(const PackedBatch& b) {
  make_cp_tables(b);
  return cp_cu_;
}

const Tensor& CausalLm::stack_positions(const PackedBatch& b) {
  if (!context_parallel()) return b.positions;
  make_cp_tables(b);
  return cp_positions_;
}

void CausalLm::add_norm_grad(int index, Tensor g) {
  if (sequence_parallel()) tp_sum(g);
  add_grad(index, g);
}

void CausalLm::shard_over_tp(int index, int dim, int replicas, std::vector<int64_t> sections) {
  if (tp_size() <= 1) return;
  ShardLayout& shard = index >= 0 ? params_[size_t(index)].shard : absent_[size_t(-2 - index)].shard;
  const Shape& shape = index >= 0 ? params_[size_t(index)].value.shape() : absent_[size_t(-2 - index)].shape;
  shard = split_layout(shape, dim, tp_size() / replicas, tp_rank() / replicas, "tp", replicas, std::move(sections));
}

void CausalLm::shard_over_ep(int index) {
  if (!expert_parallel()) return;
  ShardLayout& shard = index >= 0 ? params_[size_t(index)].shard : absent_[size_t(-2 - index)].shard;
  const Shape& shape = index >= 0 ? params_[size_t(index)].value.shape() : absent_[size_t(-2 - index)].shape;
  shard = split_layout(shape, 0, ep_size(), ep_rank(), "ep");
}

void CausalLm::sum_replicated_grads() {
  for (Parameter& p : params_)
    if (p.grad.defined()) sum_over_replicas(p);
}

void CausalLm::sum_over_replicas(Parameter& p) const {
  const int r = p.shard.replicas;
  if (r <= 1 || tp_size() <= 1) return;
  ExecContext cx = rt_->context(options_.device);
  const int64_t n = p.grad.numel();
  Tensor all = Tensor::empty({int64_t(tp_size()) * n}, p.grad.dtype(), cx.allocator);
  options_.tp->all_gather(contiguous(cx, p.grad).view({n}), all);
  const int first = tp_rank() / r * r;  // the replica set's ranks, summed in rank order (the same bits on each)
  Tensor sum = contiguous(cx, all.narrow(0, first * n, n));
  for (int k = 1; k < r; ++k) sum = add(cx, sum, all.narrow(0, (first + k) * n, n));
  copy_into(cx, sum.view(p.grad.shape()), p.grad);
}

Tensor CausalLm::gathered(const Parameter& p, bool grad) const {
  const Tensor& mine = grad ? p.grad : p.value;
  if (p.whole() || (p.shard.group != "tp" && p.shard.group != "ep")) return mine;
  Communicator& group = p.shard.group == "tp" ? *options_.tp : *options_.ep;
  const int n = group.size();
  if (p.shard.global_shape == mine.shape()) return mine;  // held whole by every rank (one kv head for all)
  ExecContext cx = rt_->context(options_.device);
  const int64_t size = mine.numel(), local_cols = size / mine.size(0);
  Tensor all = Tensor::empty({int64_t(n) * size}, mine.dtype(), cx.allocator);  // the pieces in rank order
  Tensor in = contiguous(cx, mine);
  group.all_gather(in.view({size}), all);
  // Each part (one of a replica set's ranks) copied box by box into the whole viewed as 2-D.
  const Shape& global = p.shard.global_shape;
  Tensor whole = Tensor::empty(global, mine.dtype(), cx.allocator);
  Tensor whole2d = whole.view({global[0], whole.numel() / global[0]});
  for (int r = 0; r < n; r += p.shard.replicas) {
    const Tensor piece = all.narrow(0, r * size, size).view({mine.size(0), local_cols});
    for (const PieceBox& box : piece_boxes(part_layout(p.shard, mine.shape(), r / p.shard.replicas), mine.shape()))
      copy_into(cx, piece.narrow(0, box.local_row, box.rows).narrow(1, box.local_col, box.cols),
                whole2d.narrow(0, box.row, box.rows).narrow(1, box.col, box.cols));
  }
  return whole;
}

void CausalLm::for_each_whole(const std::function<void(const std::string&, const Tensor&)>& fn) const {
  ExecContext cx = rt_->context(options_.device);
  const bool writer = tp_rank() == 0 && (!options_.cp || options_.cp->rank() == 0) && ep_rank() == 0;
  if (pp_size() == 1) {
    for (const Parameter& p : params_) {
      const Tensor whole = gathered(p);
      if (writer) fn(p.name, whole);
    }
    return;
  }
  const Parameter* tied_copy = pp_rank() > 0 ? embedding_parameter() : nullptr;  // a tied head: the first stage's
  for (int i : declared_) {
    if (i >= 0) {
      const Parameter& p = params_[size_t(i)];
      if (&p == tied_copy) continue;
      const Tensor whole = gathered(p);
      if (!writer) continue;
      if (pp_rank() == 0) fn(p.name, whole);
      else options_.pp->send(contiguous(cx, whole), 0).wait();
    } else if (writer && pp_rank() == 0) {  // another stage's, sent in the same order
      const AbsentParameter& a = absent_[size_t(-2 - i)];
      Tensor whole = Tensor::empty(a.shard.global_shape.empty() ? a.shape : a.shard.global_shape, options_.dtype,
                                   cx.allocator);
      options_.pp->recv(whole, stage_rank_of(a.name)).wait();
      fn(a.name, whole);
    }
  }
}

std::vector<int64_t> CausalLm::whole_sizes() const {
  std::vector<int64_t> out;
  if (pp_size() == 1) {
    for (const Parameter& p : params_) out.push_back(shape_numel(p.global_shape()));
    return out;
  }
  for (int i : declared_) {
    if (i >= 0) {
      out.push_back(shape_numel(params_[size_t(i)].global_shape()));
    } else {
      const AbsentParameter& a = absent_[size_t(-2 - i)];
      out.push_back(shape_numel(a.shard.global_shape.empty() ? a.shape : a.shard.global_shape));
    }
  }
  return out;
}

void CausalLm::set_from_whole(const Parameter& p, const Tensor& whole) const {
  ExecContext cx = rt_->context(options_.device);
  if (p.whole() || p.shard.global_shape == p.value.shape()) return copy_into(cx, whole, p.value);
  LATHE_CHECK(p.value.is_contiguous() && p.shard.flat_begin < 0, "model: {} is not a tp / ep piece", p.name);
  const Shape& global = p.shard.global_shape;
  const Tensor whole2d = whole.view({global[0], whole.numel() / global[0]});
  const Tensor local2d = p.value.view({p.value.size(0), p.value.numel() / p.value.size(0)});
  for (const PieceBox& box : piece_boxes(p.shard, p.value.shape()))
    copy_into(cx, whole2d.narrow(0, box.row, box.rows).narrow(1, box.col, box.cols),
              local2d.narrow(0, box.local_row, box.rows).narrow(1, box.local_col, box.cols));
}

ExecContext CausalLm::ctx() { return rt_->context(options_.device); }

Parameter& CausalLm::parameter(const std::string& name) {
  for (Parameter& p : params_)
    if (p.name == name) return p;
  LATHE_FAIL("model: no parameter named '{}'", name);
}

void CausalLm::attach_lora(LoraBank* bank) {
  LATHE_CHECK(!bank || tp_size() == 1 || bank->split(), "lora: under tensor parallelism the adapter bank must be split "
              "like the model first (LoraBank::split_like)");
  if (bank) {
    const ModelConfig& m = bank->model();
    LATHE_CHECK(m.model_type == config_.model_type && m.num_layers == config_.num_layers &&
                    m.hidden_size == config_.hidden_size && m.layer_types == config_.layer_types &&
                    m.multimodal_layout == config_.multimodal_layout,
                "lora: the adapter bank was built for another model ({}, {} layers, hidden {}) than this {} model "
                "({} layers, hidden {})", m.model_type, m.num_layers, m.hidden_size, config_.model_type,
                config_.num_layers, config_.hidden_size);
  }
  lora_ = bank;
}

size_t CausalLm::move_parameters(Device device) {
  std::map<const Storage*, std::shared_ptr<Storage>> moved;
  size_t bytes = 0;
  for (Parameter& p : params_) {
    const std::shared_ptr<Storage>& from = p.value.storage();
    if (!from || from->device() == device) continue;
    std::shared_ptr<Storage>& to = moved[from.get()];
    if (!to) {
      ExecContext cx = rt_->context(device.is_cpu() ? from->device() : device);
      to = std::make_shared<Storage>(rt_->context(device).allocator, from->nbytes());
      cx.backend.copy(to->data(), device, from->data(), from->device(), from->nbytes(), cx.stream);
      cx.stream.synchronize();
      bytes += from->nbytes();
    }
    p.value = Tensor(to, p.value.shape(), p.value.strides(), p.value.offset(), p.value.dtype());
  }
  return bytes;
}

void CausalLm::zero_grads() {
  for (Parameter& p : params_) p.grad = Tensor();
}

void CausalLm::begin_forward(const PackedBatch& b) {
  LATHE_CHECK(b.ids.device() == options_.device, "model: batch is on {} but the model is on {}", b.ids.device().str(),
              options_.device.str());
  for (int32_t id : b.host_ids)
    LATHE_CHECK(id >= 0 && id < global_config_.vocab_size, "model: token id {} is outside the vocabulary (size {})", id,
                global_config_.vocab_size);
  if (lora_ && b.adapted()) lora_->refresh();  // the adapters' current values into the slots
  for (MoeRoute& r : moe_routes_) r.valid = false;     // this batch routes afresh
  moe_reads_ = {};                                      // and a pass that threw before its read leaves none
  batch_tokens_ = b.tokens();
  cp_tables_tokens_ = -1;                               // context parallelism: this batch's tables
  decoding_ = b.cache != nullptr;                       // decoding runs every row on every rank (no cp)
}

std::pair<Tensor, Tensor> CausalLm::attend(int64_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v,
                                           const PackedBatch& b) {
  ExecContext cx = ctx();
  if (b.cache) return {b.cache->attend(cx, layer, qr, kr, v), Tensor()};
  if (kept_attention_ && kept_attention_->o.defined())  // the backward's recompute: what the forward kept
    return {std::exchange(kept_attention_->o, Tensor()), std::exchange(kept_attention_->lse, Tensor())};
  std::vector<Tensor> att = attention(cx, qr, kr, v, context_parallel() ? cp_cu_seqlens(b) : b.cu_seqlens, {});
  if (kept_attention_ && options_.recompute_keeps_attention) kept_attention_->o = att[0], kept_attention_->lse = att[1];
  return {att[0], att[1]};
}

bool CausalLm::take_kept_rule(Tensor& core, Tensor& states, Tensor& chunk_cache, Tensor& state_in) {
  if (!kept_attention_ || !kept_attention_->core.defined()) return false;
  core = std::exchange(kept_attention_->core, Tensor());
  states = std::exchange(kept_attention_->states, Tensor());
  chunk_cache = std::exchange(kept_attention_->chunk_cache, Tensor());
  state_in = std::exchange(kept_attention_->state_in, Tensor());
  return true;
}

void CausalLm::keep_rule(const Tensor& core, const Tensor& states, const Tensor& chunk_cache, const Tensor& state_in) {
  if (!kept_attention_ || !options_.recompute_keeps_gdn) return;
  kept_attention_->core = core;
  kept_attention_->states = states;
  kept_attention_->chunk_cache = chunk_cache;
  kept_attention_->state_in = state_in;
}

void CausalLm::add_grad(int index, const Tensor& g) {
  if (!options_.train_base) return;
  Parameter& p = params_[size_t(index)];
  ExecContext cx = ctx();
  const Tensor gv = contiguous(cx, g).view(p.value.shape());  // e.g. a conv weight's (C, W) gradient as (C, 1, W)
  p.grad = p.grad.defined() ? add(cx, p.grad, gv) : gv;
}

void CausalLm::add_linear_grad(int index, const Tensor& dy, const Tensor& x) {
  if (!options_.train_base) return;
  Tensor& grad = params_[size_t(index)].grad;
  ExecContext cx = ctx();
  if (grad.defined()) matmul_into(cx, dy, x, grad, {true, false, 1.0f, 1.0f});
  else grad = matmul(cx, dy, x, {true, false});
}

void CausalLm::add_lora(int64_t layer, LoraTarget t, const Tensor& x, const Tensor& y, const PackedBatch& b,
                        bool training) {
  const LoraBank::Slot* slot = lora_ && b.adapted() ? lora_->slot(layer, t) : nullptr;
  if (!slot) return;
  // y += mask(dropout(x) A_cat^T) BT_cat: every adapter in two GEMMs, each row keeping its own adapter's columns.
  ExecContext cx = ctx();
  Tensor out = y;
  if (b.row_adapters.defined()) {  // decoding: each row's columns gathered on the device (no dropout)
    const Tensor u = mul(cx, matmul(cx, x, slot->a, {false, true}), embedding(cx, slot->column_masks, b.row_adapters));
    matmul_into(cx, u, slot->bt, out, {false, false, 1.0f, 1.0f});
    return;
  }
  const SegmentAttrs seg = stack_segments(*slot, b, training, x.size(0));
  const Tensor xd = any_dropout(seg) ? dropout(cx, x, seg) : x;
  const Tensor u = segment_mask(cx, matmul(cx, xd, slot->a, {false, true}), seg);
  matmul_into(cx, u, slot->bt, out, {false, false, 1.0f, 1.0f});
}

void CausalLm::lora_backward(int64_t layer, LoraTarget t, const Tensor& x, const Tensor& dy, Tensor& dx,
                             const PackedBatch& b) {
  LoraBank::Slot* slot = lora_ && !b.segments.empty() ? lora_->slot(layer, t) : nullptr;
  if (!slot) return;
  ExecContext cx = ctx();
  const SegmentAttrs seg = stack_segments(*slot, b, true, x.size(0));
  const bool drop = any_dropout(seg);
  const Tensor xd = drop ? dropout(cx, x, seg) : x;  // the same masks as the forward (same seeds)
  const Tensor u = segment_mask(cx, matmul(cx, xd, slot->a, {false, true}), seg);
  matmul_into(cx, u, dy, slot->grad_bt, {true, false, 1.0f, 1.0f});  // dBT += U^T dy
  const Tensor du = segment_mask(cx, matmul(cx, dy, slot->bt, {false, true}), seg);
  matmul_into(cx, du, xd, slot->grad_a, {true, false, 1.0f, 1.0f});  // dA += dU^T x
  if (drop) dx = add(cx, dx, dropout(cx, matmul(cx, du, slot->a), seg));
  else matmul_into(cx, du, slot->a, dx, {false, false, 1.0f, 1.0f});
}

Tensor CausalLm::project(int64_t layer, LoraTarget t, int weight, const Tensor& x, const PackedBatch& b,
                         bool training) {
  ExecContext cx = ctx();
  const Tensor y = matmul(cx, x, w(weight), {false, true});
  add_lora(layer, t, x, y, b, training);
  return y;
}

void CausalLm::project_backward(int64_t layer, LoraTarget t, int weight, const Tensor& x, const Tensor& dy, Tensor& dx,
                                const PackedBatch& b) {
  ExecContext cx = ctx();
  if (dx.defined()) matmul_into(cx, dy, w(weight), dx, {false, false, 1.0f, 1.0f});
  else dx = matmul(cx, dy, w(weight));
  add_linear_grad(weight, dy, x);
  lora_backward(layer, t, x, dy, dx, b);
}

namespace {

// The (rows, cols) view over `parts` when they are contiguous 2-D tensors of one dtype and column count that follow
// each other in one storage, in order; undefined otherwise.
Tensor stacked_rows(const std::vector<const Tensor*>& parts) {
  const Tensor& first = *parts.front();
  int64_t rows = 0, next = first.defined() ? first.offset() : 0;
  for (const Tensor* p : parts) {
    if (!p->defined() || p->storage() != first.storage() || p->dim() != 2 || !p->is_contiguous() ||
        p->dtype() != first.dtype() || p->size(1) != first.size(1) || p->offset() != next)
      return {};
    next += p->numel();
    rows += p->size(0);
  }
  const Shape shape{rows, first.size(1)};
  return Tensor(first.storage(), shape, contiguous_strides(shape), first.offset(), first.dtype());
}

}  // namespace

std::pair<Tensor, Tensor> CausalLm::norm_stream(const ResidualStream& s, const Tensor& w, NormAttrs attrs) {
  ExecContext cx = ctx();
  if (!s.r.defined()) return {rmsnorm(cx, s.h, w, attrs), s.h};
  const std::vector<Tensor> y = residual_rmsnorm(cx, s.h, s.r, w, attrs);
  return {y[0], y[1]};
}

void CausalLm::pack_rows(const std::vector<int>& weights) {
  ExecContext cx = ctx();
  const Tensor& first = w(weights.front());
  int64_t rows = 0;
  for (int i : weights) {
    LATHE_CHECK(w(i).dim() == 2 && w(i).size(1) == first.size(1) && w(i).dtype() == first.dtype(),
                "model: pack_rows needs 2-D weights of one dtype and column count, got {} beside {}",
                w(i).describe(), first.describe());
    rows += w(i).size(0);
  }
  const Tensor buffer = Tensor::empty({rows, first.size(1)}, first.dtype(), cx.allocator);
  int64_t at = 0;
  for (int i : weights) {
    Parameter& p = params_[size_t(i)];
    const Tensor block = buffer.narrow(0, at, p.value.size(0));
    copy_into(cx, p.value, block);
    p.value = block;
    at += block.size(0);
  }
}

Tensor CausalLm::project_rows(int64_t layer, const std::vector<LoraTarget>& targets, const std::vector<int>& weights,
                              const Tensor& x, const PackedBatch& b, bool training) {
  ExecContext cx = ctx();
  std::vector<const Tensor*> values;
  for (int i : weights) values.push_back(&w(i));
  const Tensor stacked = stacked_rows(values);
  if (!stacked.defined()) {
    std::vector<Tensor> parts;
    for (size_t i = 0; i < weights.size(); ++i) parts.push_back(project(layer, targets[i], weights[i], x, b, training));
    return concat_columns(cx, parts);
  }
  const Tensor y = matmul(cx, x, stacked, {false, true});
  int64_t at = 0;  // each adapter's term adds into its weight's columns of y (a column slice: no copy)
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t n = w(weights[i]).size(0);
    add_lora(layer, targets[i], x, y.narrow(1, at, n), b, training);
    at += n;
  }
  return y;
}

void CausalLm::project_rows_backward(int64_t layer, const std::vector<LoraTarget>& targets,
                                     const std::vector<int>& weights, const Tensor& x, const Tensor& dy, Tensor& dx,
                                     const PackedBatch& b) {
  ExecContext cx = ctx();
  std::vector<const Tensor*> values, grads;
  for (int i : weights) {
    values.push_back(&w(i));
    grads.push_back(&params_[size_t(i)].grad);
  }
  const Tensor stacked = stacked_rows(values);
  bool none_yet = true;
  for (const Tensor* g : grads) none_yet = none_yet && !g->defined();
  const Tensor stacked_grad = none_yet ? Tensor() : stacked_rows(grads);
  if (!stacked.defined() || (options_.train_base && !none_yet && !stacked_grad.defined())) {
    int64_t at = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t n = w(weights[i]).size(0);
      project_backward(layer, targets[i], weights[i], x, dy.narrow(1, at, n), dx, b);
      at += n;
    }
    return;
  }
  if (dx.defined()) matmul_into(cx, dy, stacked, dx, {false, false, 1.0f, 1.0f});
  else dx = matmul(cx, dy, stacked);
  if (options_.train_base && stacked_grad.defined()) {
    Tensor g = stacked_grad;
    matmul_into(cx, dy, x, g, {true, false, 1.0f, 1.0f});
  } else if (options_.train_base) {
    const Tensor g = matmul(cx, dy, x, {true, false});  // (out_0 + out_1 + ..., in): the gradients' one buffer
    int64_t at = 0;
    for (int i : weights) {
      Parameter& p = params_[size_t(i)];
      p.grad = g.narrow(0, at, p.value.size(0));
      at += p.value.size(0);
    }
  }
  int64_t at = 0;  // the adapters read their weight's columns of dy (a column slice: no copy)
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t n = w(weights[i]).size(0);
    lora_backward(layer, targets[i], x, dy.narrow(1, at, n), dx, b);
    at += n;
  }
}

LmHead CausalLm::lm_head(int head) const {
  const Parameter& p = params_[size_t(head)];
  const bool sliced = !p.whole() && p.shard.group == "tp";
  return LmHead(*rt_, p.value, options_.tp, sliced ? p.shard.offset[0] : -1);
}

Tensor CausalLm::embed(int index, const Tensor& ids) {
  ExecContext cx = ctx();
  const Parameter& p = params_[size_t(index)];
  if (p.whole() || p.shard.group != "tp") return stream_rows(embedding(cx, p.value, ids));
  // (T, H): this rank's ids' rows, zeros elsewhere; the rows the stack runs on (cp) summed over the group (onto the
  // rank's rows under sp)
  return block_output(cp_rows(embedding(cx, p.value, ids, p.shard.offset[0])));
}

namespace {

// The batch's labelled positions (label != -100) and their targets, in row order: the only rows the LM head computes.
void labelled_rows(const PackedBatch& b, std::vector<int32_t>& rows, std::vector<int32_t>& targets) {
  for (int64_t i = 0; i < b.tokens(); ++i) {
    if (b.host_labels[size_t(i)] == -100) continue;
    rows.push_back(int32_t(i));
    targets.push_back(b.host_labels[size_t(i)]);
  }
}

}  // namespace

size_t CausalLm::head_rows(const PackedBatch& b, int64_t rows_here, std::vector<int32_t>& rows,
                           std::vector<int32_t>& targets) const {
  if (!context_parallel()) return 0;
  const int64_t first = cp_rank() * block_tokens(b);
  size_t kept = 0, at = rows.size();
  for (size_t r = 0; r < rows.size(); ++r)
    if (rows[r] >= first && rows[r] < first + rows_here) {
      at = std::min(at, r);
      rows[kept] = int32_t(rows[r] - first);
      targets[kept++] = targets[r];
    }
  rows.resize(kept);
  targets.resize(kept);
  return kept > 0 ? at : 0;
}

std::vector<double> CausalLm::joined_values(const std::vector<double>& mine, size_t at, size_t total) const {
  if (!context_parallel() || total == 0) return mine;  // (every rank of the group has the same total)
  std::vector<double> all(total, 0.0);  // each rank's values at its place, zero elsewhere, summed over the group
  std::copy(mine.begin(), mine.end(), all.begin() + std::ptrdiff_t(at));
  Tensor t = rt_->from_host(all.data(), {int64_t(total)}, DType::F64, options_.device);
  options_.cp->all_reduce(t).wait();
  const Tensor host = options_.device.is_cpu() ? t : rt_->copy_to(t, Device::cpu());
  return std::vector<double>(host.data<double>(), host.data<double>() + total);
}

Tensor CausalLm::zeros_like(const Tensor& x) const {
  ExecContext cx = rt_->context(options_.device);
  return zeros(cx, x.shape(), x.dtype());
}

std::vector<double> CausalLm::head_label_logprobs(const Tensor& xf, int head, const PackedBatch& b) {
  ExecContext cx = ctx();
  const LmHead lm = lm_head(head);
  // Under cp xf holds the rank's rows of the batch: their log-probs, joined over the group into the batch's.
  const int64_t first = context_parallel() ? cp_rank() * block_tokens(b) : 0;
  const int64_t rows = std::min(xf.size(0), b.tokens() - std::min(first, b.tokens()));
  std::vector<double> out;
  for (int64_t r0 = 0; r0 < rows; r0 += options_.loss_chunk_rows) {
    const int64_t n = std::min(options_.loss_chunk_rows, rows - r0);
    const Tensor logits = lm.logits(cx, xf.narrow(0, r0, n));
    const Tensor loss =
        rt_->copy_to(lm.cross_entropy(cx, logits, b.labels.narrow(0, first + r0, n), {})[0], Device::cpu());
    for (int64_t i = 0; i < n; ++i) out.push_back(-load_as_double(loss.data_ptr(), loss.dtype(), i));
  }
  return joined_values(out, size_t(first), size_t(b.tokens()));
}

LossResult CausalLm::head_loss(const Tensor& xf, int head, const PackedBatch& b, bool backward, double loss_scale,
                               Tensor* dxf, std::vector<std::pair<size_t, Tensor>>& pending) {
  if (b.row_loss) return head_row_loss(xf, head, b, backward, loss_scale, dxf);
  ExecContext cx = ctx();
  LossResult result;
  result.labelled = b.num_labelled;
  // Only labelled positions need logits: gather their rows (the embedding op is a row gather, its backward a
  // scatter-add), so prompt tokens of SFT data cost nothing in the LM head.
  std::vector<int32_t> rows, targets;
  labelled_rows(b, rows, targets);
  // Each segment's labelled rows in the whole batch (one segment without adapters): its mean's divisor.
  std::vector<int64_t> seg_end, seg_rows;
  for (const BatchSegment& seg : b.segments) seg_end.push_back(seg.rows_end);
  if (seg_end.empty()) seg_end.push_back(b.tokens());
  seg_rows.assign(seg_end.size(), 0);
  for (size_t r = 0, s = 0; r < rows.size(); ++r) {
    while (rows[r] >= seg_end[s]) ++s;
    ++seg_rows[s];
  }
  // Context parallelism: xf holds this rank's rows of the batch, from `first`; only its labelled rows are this
  // rank's, and add_head_losses sums the losses over the group.
  const int64_t first = context_parallel() ? cp_rank() * block_tokens(b) : 0;
  head_rows(b, xf.size(0), rows, targets);
  const int64_t n_rows = int64_t(rows.size());
  // The gathered rows of each segment are contiguous; each segment's mean loss has its own gradient scale.
  struct Piece {
    int64_t begin, end;
    double grad_scale;
  };
  std::vector<Piece> pieces;
  for (size_t s = 0, r = 0; s < seg_end.size(); ++s) {
    const size_t begin = r;
    while (r < rows.size() && rows[r] + first < seg_end[s]) ++r;
    const double scale = b.segments.empty() ? 1.0 : b.segments[s].loss_scale;
    pieces.push_back({int64_t(begin), int64_t(r), seg_rows[s] ? loss_scale * scale / double(seg_rows[s]) : 0.0});
    if (!b.segments.empty()) result.segments.push_back({0.0, seg_rows[s]});
  }
  // The rows are padded to a multiple of 8 with ignored ones (token 0's row, label -100: zero loss, zero gradient
  // rows), so the LM head's GEMMs never take an odd row count: cuBLAS ran the weight gradient of a 2,046-row chunk
  // at 670 TFLOP/s against 750 for 2,048 rows (docs/benchmarks.md, session 9). The last piece takes the padding (only
  // where it ends the rows: every padded row must fall in a chunk, which writes its zero gradient row).
  const int64_t n_padded = !pieces.empty() && pieces.back().end == n_rows ? (n_rows + 7) / 8 * 8 : n_rows;
  rows.resize(size_t(n_padded), 0);
  targets.resize(size_t(n_padded), -100);
  if (!pieces.empty()) pieces.back().end += n_padded - n_rows;
  Tensor xs, dxs, row_index, target_t;
  if (n_rows > 0) {
    row_index = rt_->upload(rows.data(), {n_padded}, DType::I32, options_.device);  // no wait: the queue keeps running
    target_t = rt_->upload(targets.data(), {n_padded}, DType::I32, options_.device);
    xs = embedding(cx, xf, row_index);  // (n_padded, H)
    if (backward) dxs = Tensor::empty(xs.shape(), xs.dtype(), cx.allocator);
  }
  const LmHead lm = lm_head(head);
  const Tensor& wh = lm.weight();
  pending.clear();
  for (size_t pi = 0; pi < pieces.size(); ++pi) {
    const Piece& piece = pieces[pi];
    for (int64_t r0 = piece.begin; r0 < piece.end; r0 += options_.loss_chunk_rows) {
      const int64_t n = std::min(options_.loss_chunk_rows, piece.end - r0);
      const Tensor xc = xs.narrow(0, r0, n);
      const Tensor logits = lm.logits(cx, xc);  // (n, V) (under tp this rank's columns), freed after this chunk
      const std::vector<Tensor> ce =
          lm.cross_entropy(cx, logits, target_t.narrow(0, r0, n), {-100, backward, piece.grad_scale});
      pending.emplace_back(pi, ce[0]);
      if (backward) {
        Tensor dxc = dxs.narrow(0, r0, n);
        matmul_into(cx, ce[1], wh, dxc, {});
        add_linear_grad(head, ce[1], xc);
      }
    }
  }
  if (!backward) return result;
  if (n_rows > 0 && !sequence_parallel()) lm.sum_input_grad(dxs);  // under tp each rank's columns gave a part (sp:
                                                                     // the stack reduce-scatters it, DecoderStack)
  // The labelled rows' gradients scattered back (zero elsewhere).
  *dxf = n_rows > 0 ? embedding_backward(cx, dxs, row_index, xf.size(0)) : zeros_like(xf);
  // A cp rank without labelled rows: the head's gradient is zero here (defined, as on the others, for the group's sum).
  if (n_rows == 0) add_grad(head, zeros_like(w(head)));
  return result;
}

LossResult CausalLm::head_row_loss(const Tensor& xf, int head, const PackedBatch& b, bool backward, double loss_scale,
                                   Tensor* dxf) {
  ExecContext cx = ctx();
  std::vector<int32_t> rows, targets;
  labelled_rows(b, rows, targets);
  // Segments (an adapter's rows) scale their rows' gradients by their loss_scale; the terms carry their own weights.
  const size_t n_all = rows.size();
  std::vector<double> row_scale(n_all, loss_scale);
  LossResult result;
  size_t r = 0;
  for (const BatchSegment& seg : b.segments) {
    const size_t begin = r;
    for (; r < n_all && rows[r] < seg.rows_end; ++r) row_scale[r] = loss_scale * seg.loss_scale;
    result.segments.push_back({0.0, int64_t(r - begin)});
  }
  result.labelled = int64_t(n_all);
  // Context parallelism: xf holds this rank's rows; its labelled rows are [at, at + n_rows) of the batch's, whose
  // log-probabilities (and entropies) are joined over the group, so that every rank evaluates the loss's terms on
  // whole sequences (a sequence ratio, a sequence mean) and differentiates its own rows.
  const size_t at = head_rows(b, xf.size(0), rows, targets);
  const int64_t n_rows = int64_t(rows.size()), n_padded = (n_rows + 7) / 8 * 8;  // as head_loss: GEMMs of 8k rows
  rows.resize(size_t(n_padded), 0);
  targets.resize(size_t(n_padded), -100);
  const LmHead lm = lm_head(head);
  const Tensor& wh = lm.weight();
  Tensor row_index, target_t, xs;
  if (n_rows > 0) {
    row_index = rt_->upload(rows.data(), {n_padded}, DType::I32, options_.device);
    target_t = rt_->upload(targets.data(), {n_padded}, DType::I32, options_.device);
    xs = embedding(cx, xf, row_index);  // (n_padded, H)
  }
  // Pass 1: every labelled row's log-probability (minus its cross-entropy), and where asked its entropy
  // lse(x) - sum softmax(x) x.
  std::vector<double> logp, entropy;
  for (int64_t r0 = 0; r0 < n_padded; r0 += options_.loss_chunk_rows) {
    const int64_t n = std::min(options_.loss_chunk_rows, n_padded - r0);
    const Tensor logits = lm.logits(cx, xs.narrow(0, r0, n));
    const Tensor ce = lm.cross_entropy(cx, logits, target_t.narrow(0, r0, n), {})[0];
    const Tensor host = rt_->copy_to(ce, Device::cpu());
    for (int64_t i = 0; i < n && r0 + i < n_rows; ++i)
      logp.push_back(-load_as_double(host.data_ptr(), host.dtype(), i));
    if (!b.row_entropy) continue;
    const std::vector<double> h = lm.entropy(cx, logits);
    for (int64_t i = 0; i < n && r0 + i < n_rows; ++i) entropy.push_back(h[size_t(i)]);
  }
  logp = joined_values(logp, at, n_all);
  if (b.row_entropy) *b.row_entropy = joined_values(entropy, at, n_all);
  std::vector<double> terms(n_all), dlogp(n_all);
  if (n_all > 0) (*b.row_loss)(logp, terms, dlogp);
  for (double t : terms) result.loss_sum += t;
  result.loss = result.loss_sum;
  for (size_t s = 0, t = 0; s < result.segments.size(); ++s)
    for (int64_t k = 0; k < result.segments[s].labelled; ++k) result.segments[s].loss_sum += terms[t++];
  if (!backward) return result;
  if (n_rows == 0) {  // nothing labelled here: zero gradients (the head's defined, as on the others, for a cp sum)
    *dxf = zeros_like(xf);
    if (context_parallel()) add_grad(head, zeros_like(w(head)));
    return result;
  }
  // Pass 2: d loss / d logits of row t is dloss_dlogp[t] (onehot - softmax): the cross-entropy's gradient scaled by
  // -dloss_dlogp[t] (and loss_scale); padded rows by 0.
  std::vector<double> scale(static_cast<size_t>(n_padded), 0.0);
  for (int64_t t = 0; t < n_rows; ++t) scale[size_t(t)] = -dlogp[at + size_t(t)] * row_scale[at + size_t(t)];
  const Tensor scale_t =
      cast(cx, rt_->from_host(scale.data(), {n_padded, 1}, DType::F64, options_.device), xs.dtype());
  Tensor dxs = Tensor::empty(xs.shape(), xs.dtype(), cx.allocator);
  for (int64_t r0 = 0; r0 < n_padded; r0 += options_.loss_chunk_rows) {
    const int64_t n = std::min(options_.loss_chunk_rows, n_padded - r0);
    const Tensor xc = xs.narrow(0, r0, n);
    const Tensor unit = lm.cross_entropy(cx, lm.logits(cx, xc), target_t.narrow(0, r0, n), {-100, true, 1.0})[1];
    const Tensor dlogits = mul(cx, unit, scale_t.narrow(0, r0, n));
    Tensor dxc = dxs.narrow(0, r0, n);
    matmul_into(cx, dlogits, wh, dxc, {});
    add_linear_grad(head, dlogits, xc);
  }
  if (!sequence_parallel()) lm.sum_input_grad(dxs);  // under tp each rank's columns gave a part (sp: DecoderStack)
  *dxf = embedding_backward(cx, dxs, row_index, xf.size(0));
  return result;
}

void CausalLm::add_head_losses(LossResult& result, const PackedBatch& b,
                               const std::vector<std::pair<size_t, Tensor>>& pending) {
  if (b.row_loss) return;  // head_row_loss set the result
  for (const auto& [pi, losses] : pending) {
    const Tensor loss_rows = rt_->copy_to(losses, Device::cpu());  // the first copy waits for the queued work
    double chunk_sum = 0;
    for (int64_t i = 0; i < loss_rows.numel(); ++i)
      chunk_sum += load_as_double(loss_rows.data_ptr(), loss_rows.dtype(), i);
    result.loss_sum += chunk_sum;
    if (!result.segments.empty()) result.segments[pi].loss_sum += chunk_sum;
  }
  if (context_parallel()) {  // each rank's rows' losses, summed over the cp group
    std::vector<double> sums = {result.loss_sum};
    for (const LossResult::Segment& s : result.segments) sums.push_back(s.loss_sum);
    Tensor t = rt_->from_host(sums.data(), {int64_t(sums.size())}, DType::F64, options_.device);
    options_.cp->all_reduce(t).wait();
    const Tensor host = options_.device.is_cpu() ? t : rt_->copy_to(t, Device::cpu());
    result.loss_sum = host.data<double>()[0];
    for (size_t i = 0; i < result.segments.size(); ++i) result.segments[i].loss_sum = host.data<double>()[i + 1];
  }
  result.loss = b.num_labelled ? result.loss_sum / double(b.num_labelled) : 0.0;
}

void CausalLm::end_backward(int embed, const Tensor& dx, const PackedBatch& b) {
  ExecContext cx = ctx();
  const Parameter& p = params_[size_t(embed)];
  Tensor& grad = params_[size_t(embed)].grad;
  // Vocab-parallel (tensor parallelism): dx is the same on every rank, each adds the rows of its own ids.
  const int64_t first = !p.whole() && p.shard.group == "tp" ? p.shard.offset[0] : -1;
  // A tied LM head already holds its gradient: the batch's rows are added into it in place (no full-size zero fill and
  // add; a full-vocabulary pass each at 151,936 rows).
  if (options_.train_base) {
    // sequence parallelism: every rank's rows of the stream; context parallelism: the rank's rows and their ids
    const Tensor d = block_input(dx, block_tokens(b));
    const Tensor ids = cp_rows(b.ids);
    if (grad.defined() && grad.is_contiguous() && grad.dtype() == d.dtype())
      embedding_backward_into(cx, d, ids, grad, first);
    else
      add_grad(embed, embedding_backward(cx, d, ids, p.value.size(0), first));
  }
  if (lora_ && !b.segments.empty()) lora_->collect_grads();
}

DType CausalLm::save_dtype(const std::string&, DType requested) const { return requested; }

void CausalLm::save(const std::string& dir, DType dtype, uint64_t max_shard_bytes,
                    const std::function<void(const std::string&)>& add_files) const {
  LATHE_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16, "model: cannot save weights as {}",
              dtype_name(dtype));
  ExecContext cx = rt_->context(options_.device);
  // tensor parallelism: every rank joins its slices, the first writes (under cp, the first of its cp group too)
  // (and under ep the first of its ep group: each has gathered the experts)
  // (pipeline parallelism: the first stage writes; every other stage's first rank sends it its tensors, in order)
  const bool writer = tp_rank() == 0 && (!options_.cp || options_.cp->rank() == 0) && ep_rank() == 0;
  std::vector<Tensor> host;
  std::vector<io::TensorRef> refs;
  const auto keep = [&](const Parameter& p, const Tensor& whole) {
    const DType dt = save_dtype(p.name, dtype);
    host.push_back(rt_->copy_to(cast(cx, whole, dt), Device::cpu()));
    for (io::TensorRef& r : checkpoint_refs(p, dt, host.back())) refs.push_back(std::move(r));
  };
  for_each_whole([&](const std::string& name, const Tensor& whole) { keep(Parameter{name, whole, {}, {}}, whole); });
  if (!writer || pp_rank() > 0) return;
  for (io::TensorRef& r : extra_tensors()) refs.push_back(std::move(r));
  OutputDir out(dir, "model");
  io::write_sharded_safetensors(out.tmp().string(), refs, max_shard_bytes, {{"format", "pt"}});
  nlohmann::json cfg = global_config_.raw;
  cfg["torch_dtype"] = cfg["dtype"] = dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16";
  if (!cfg.contains("architectures")) cfg["architectures"] = {architecture_of(config_.model_type)};
  write_file_atomic((out.tmp() / "config.json").string(), cfg.dump(2) + "\n", "model");
  if (add_files) add_files(out.tmp().string());
  out.commit();
}

std::unique_ptr<CausalLm> load_causal_lm(Runtime& rt, const std::string& dir, const ModelOptions& options) {
  const ModelConfig config = load_model_config(dir);
  if (config.is_hybrid()) return std::make_unique<Qwen35Model>(Qwen35Model::load(rt, dir, options));
  LATHE_CHECK(config.model_type == "qwen3" || config.model_type == "qwen3_moe", "model: {}: model_type '{}' has no "
              "model class", dir, config.model_type);
  return std::make_unique<Qwen3Model>(Qwen3Model::load(rt, dir, options));
}

namespace {

uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <typename T>
void counter_normal_into(std::vector<T>& out, uint64_t key, double std) {
  const int64_t n = int64_t(out.size());
  constexpr double kTwoPi = 6.283185307179586;
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t a = splitmix64(key ^ splitmix64(2 * uint64_t(j)));
    const uint64_t b = splitmix64(key ^ splitmix64(2 * uint64_t(j) + 1));
    const double u1 = (double(a >> 11) + 0.5) * 0x1p-53, u2 = double(b >> 11) * 0x1p-53;  // u1 in (0, 1)
    out[size_t(j)] = T(std * std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2));
  }
}

}  // namespace

void counter_normal(std::vector<float>& out, uint64_t key, double std) { counter_normal_into(out, key, std); }
void counter_normal(std::vector<double>& out, uint64_t key, double std) { counter_normal_into(out, key, std); }

std::unique_ptr<CausalLm> random_causal_lm(Runtime& rt, const ModelConfig& config, const ModelOptions& options,
                                           uint64_t seed, double std) {
  if (config.is_hybrid()) return std::make_unique<Qwen35Model>(Qwen35Model::random(rt, config, options, seed, std));
  LATHE_CHECK(config.model_type == "qwen3" || config.model_type == "qwen3_moe", "model: model_type '{}' has no model "
              "class", config.model_type);
  return std::make_unique<Qwen3Model>(Qwen3Model::random(rt, config, options, seed, std));
}

std::unique_ptr<CausalLm> allocated_causal_lm(Runtime& rt, const ModelConfig& config, const ModelOptions& options) {
  if (config.is_hybrid()) return std::make_unique<Qwen35Model>(Qwen35Model::allocated(rt, config, options));
  LATHE_CHECK(config.model_type == "qwen3" || config.model_type == "qwen3_moe", "model: model_type '{}' has no model "
              "class", config.model_type);
  return std::make_unique<Qwen3Model>(Qwen3Model::allocated(rt, config, options));
}

}  // namespace lathe
