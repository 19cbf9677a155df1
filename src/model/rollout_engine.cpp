// The rollout engine (rollout_engine.h). Shapes: n new tokens of a sequence, L = past + n its cached tokens, Hq/Hkv
// heads of D (group = Hq / Hkv query heads share one kv head), S = blocks x block_size rows of a layer's pool.
#include "model/rollout_engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <span>
#include <tuple>
#include <utility>

#include "backend/dropout_hash.h"
#include "comm/communicator.h"
#include "model/lora.h"
#include "ops/ops.h"

namespace lathe {

namespace {

bool is_gdn_layer(const ModelConfig& c, int64_t layer) {
  return !c.layer_types.empty() && c.layer_types[size_t(layer)] == "linear_attention";
}

void fill_zero(ExecContext& cx, const Tensor& t) {
  if (t.nbytes() > 0) cx.backend.fill_bytes(t.data_ptr(), 0, t.nbytes(), cx.stream);
}

// The tensors' values as doubles on the host through one copy (each cast into its place of one f64 buffer): one wait
// for the device a step instead of one a tensor.
std::vector<std::vector<double>> to_host_f64(Runtime& rt, ExecContext& cx, const std::vector<Tensor>& ts) {
  int64_t total = 0;
  for (const Tensor& t : ts) total += t.numel();
  const Tensor buf = Tensor::empty({std::max<int64_t>(total, 1)}, DType::F64, cx.allocator);
  int64_t at = 0;
  for (const Tensor& t : ts) {
    if (t.numel() > 0) copy_into(cx, contiguous(cx, t).view({t.numel()}), buf.narrow(0, at, t.numel()));
    at += t.numel();
  }
  const Tensor host = rt.copy_to(buf, Device::cpu());
  std::vector<std::vector<double>> out;
  at = 0;
  for (const Tensor& t : ts) {
    out.emplace_back(host.data<double>() + at, host.data<double>() + at + t.numel());
    at += t.numel();
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// The cache memory: KV blocks of the attention layers, state slots of the Gated DeltaNet layers.

namespace {

// Tensor parallelism: the smallest of the group's values (each rank sizes its pool from its own free memory, and the
// ranks of a group must admit, preempt and finish the same sequences, since every step's layers are collectives).
int64_t fewest_over(Runtime& rt, Device device, Communicator* group, int64_t value) {
  if (!group || group->size() <= 1) return value;
  const std::vector<double> all = values_over(rt, device, *group, double(value));
  return int64_t(*std::min_element(all.begin(), all.end()));
}

}  // namespace

int64_t blocks_needed(const EngineOptions& o, int64_t prompt_tokens, int64_t max_new_tokens, int64_t n) {
  return n * ((prompt_tokens + max_new_tokens + o.block_size - 1) / o.block_size);
}

namespace {

struct CacheLayout {
  int64_t attn = 0, gdn = 0;  // the rank's attention and Gated DeltaNet layers
  int64_t block_bytes = 0;    // one KV block over every attention layer of the rank
  int64_t conv_channels = 0;
};

// Whether this rank computes `layer` (pipeline parallelism: its stages' layers; else every one): the layers the cache
// holds.
bool caches_layer(const ModelOptions& mo, int64_t layer) {
  return !mo.pp || mo.pp->size() <= 1 || mo.pipeline.rank_holds_layer(mo.pp->rank(), layer);
}

CacheLayout cache_layout(const ModelConfig& c, const ModelOptions& mo, int64_t block_size) {
  CacheLayout l;
  for (int64_t i = 0; i < c.num_layers; ++i)
    if (caches_layer(mo, i)) ++(is_gdn_layer(c, i) ? l.gdn : l.attn);
  l.block_bytes = l.attn * 2 * block_size * c.num_kv_heads * c.head_dim * int64_t(dtype_size(mo.dtype));
  l.conv_channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim;
  return l;
}

}  // namespace

int64_t cache_bytes(const ModelConfig& c, const ModelOptions& mo, const EngineOptions& o, int64_t blocks) {
  const CacheLayout l = cache_layout(c, mo, o.block_size);
  const int64_t slot_bytes =
      (c.linear_conv_kernel_dim - 1) * l.conv_channels * int64_t(dtype_size(mo.dtype)) +
      c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim *
          int64_t(dtype_size(gdn_state_dtype(mo.dtype)));
  return (blocks + 1) * l.block_bytes + l.gdn * (o.max_running + 1) * slot_bytes;
}

class RolloutEngine::Pool {
 public:
  Pool(Runtime& rt, const ModelConfig& c, const ModelOptions& mo, const EngineOptions& o) : block_size(o.block_size) {
    ExecContext cx = rt.context(mo.device);
    const CacheLayout layout = cache_layout(c, mo, block_size);
    const int64_t attn = layout.attn, gdn = layout.gdn, block_bytes = layout.block_bytes;
    for (int64_t i = 0, a = 0, g = 0; i < c.num_layers; ++i) {  // (another pipeline stage's layers: neither)
      const bool linear = is_gdn_layer(c, i), here = caches_layer(mo, i);
      attn_slot.push_back(linear || !here ? -1 : int(a++));
      gdn_slot.push_back(linear && here ? int(g++) : -1);
    }
    LATHE_CHECK(o.cache_memory_fraction >= 0 && o.cache_memory_fraction < 1,
                "rollout: cache_memory_fraction must be in [0, 1), not {}", o.cache_memory_fraction);
    const int64_t bytes =
        o.cache_memory_fraction > 0
            ? int64_t(o.cache_memory_fraction * double(rt.backend(mo.device.type).free_memory(mo.device.index)))
            : o.cache_bytes;
    // A rank without attention layers (a pipeline stage of Gated DeltaNet layers) bounds nothing.
    constexpr int64_t kUnbounded = int64_t(1) << 50;
    blocks = o.cache_blocks > 0 ? o.cache_blocks : (block_bytes > 0 ? bytes / block_bytes : kUnbounded);
    if (o.cache_blocks == 0 && o.max_cache_blocks > 0) blocks = std::min(blocks, o.max_cache_blocks);
    // Tensor and pipeline parallelism: one pool size, so that every rank of the groups schedules alike.
    blocks = fewest_over(rt, mo.device, mo.pp, fewest_over(rt, mo.device, mo.tp, blocks));
    if (blocks == kUnbounded) blocks = 0;  // no attention layer anywhere
    LATHE_CHECK(attn == 0 || blocks > 0, "rollout: a cache of {} bytes holds no block of {} tokens ({} bytes a block)",
                bytes, block_size, block_bytes);
    // One block and one slot more, for the pad rows of fixed-shape steps: scratch_block, scratch_slot.
    scratch_block = blocks;
    scratch_slot = o.max_running;
    for (int64_t l = 0; l < attn; ++l)
      for (std::vector<Tensor>* t : {&k, &v}) {
        t->push_back(Tensor::empty({(blocks + 1) * block_size, c.num_kv_heads, c.head_dim}, mo.dtype, cx.allocator));
        fill_zero(cx, t->back().narrow(0, scratch_block * block_size, block_size));
      }
    const int64_t channels = layout.conv_channels;
    for (int64_t l = 0; l < gdn; ++l) {
      conv.push_back(
          Tensor::empty({o.max_running + 1, c.linear_conv_kernel_dim - 1, channels}, mo.dtype, cx.allocator));
      state.push_back(Tensor::empty({o.max_running + 1, c.linear_num_value_heads, c.linear_key_head_dim,
                                     c.linear_value_head_dim}, gdn_state_dtype(mo.dtype), cx.allocator));
      for (Tensor* t : {&conv.back(), &state.back()}) fill_zero(cx, t->narrow(0, scratch_slot, 1));
    }
    for (int64_t b = blocks; b-- > 0;) free_blocks.push_back(int32_t(b));
    block_refs.assign(size_t(blocks), 0);
    for (int64_t s = o.max_running; s-- > 0;) free_slots.push_back(int(s));
    // A sequence's context: the model's positions and the cache (which does not bound it without attention layers).
    bool attends = false;  // the model's, not the rank's: every rank of a pipeline bounds a sequence alike
    for (int64_t i = 0; i < c.num_layers; ++i) attends = attends || !is_gdn_layer(c, i);
    context_tokens = attends ? blocks * block_size : std::numeric_limits<int64_t>::max();
    if (c.max_position_embeddings > 0) context_tokens = std::min(context_tokens, c.max_position_embeddings);
  }

  int64_t block_size, blocks = 0, context_tokens = 0;
  int64_t scratch_block = 0, scratch_slot = 0;  // written by pad rows only
  std::vector<int> attn_slot, gdn_slot;  // per model layer: its index among the rank's attention / GDN layers, or -1
  std::vector<Tensor> k, v;              // per attention layer: (S, Hkv, D)
  std::vector<Tensor> conv, state;       // per GDN layer: (slots, W - 1, C), (slots, Hv, dk, dv)
  std::vector<int32_t> free_blocks;      // back: next handed out
  std::vector<int> block_refs;           // per block: the sequences whose table holds it
  std::vector<int> free_slots;
};

struct RolloutEngine::Sequence {
  int64_t request = 0;
  int sample = 0;
  std::shared_ptr<const RolloutRequest> req;
  std::vector<int32_t> tokens;  // the prompt, then the generated ids
  size_t prompt_len = 0;
  int64_t computed = 0;         // tokens whose keys, values and states are in the cache
  std::vector<int32_t> blocks;  // block table
  int slot = -1;                // GDN state slot while running
  std::mt19937_64 rng;
  std::vector<double> logprobs, sampling_logprobs;
  // The request's other samples while this one computes the shared prompt (share_prefixes); they fork from it once
  // the prompt is in the cache.
  std::vector<std::unique_ptr<Sequence>> followers;
};

// ---------------------------------------------------------------------------------------------------------------
// One step's cache as the model's layers see it (PackedBatch::cache): document i of the batch is the next chunk[i]
// tokens of sequence i, after its `computed` ones. The sequences that have a past come first (the running ones; the
// scheduler admits new ones after them): their queries attend the pages through paged_attention, one call for all;
// the first chunks of new sequences attend among their own tokens through the training attention op, one call for
// all. Every new token's key and value is written to its cache row first (scatter_rows), so that both see them.

// A step's cache coordinates on the host.
struct RolloutEngine::StepCoords {
  std::vector<int32_t> rows;   // each new token's cache row (attention layers)
  std::vector<int32_t> table;  // the sequences with a past: their block tables, `width` columns each
  int64_t width = 1;
  std::vector<int32_t> cu_paged = {0}, lens, cu_first = {0};
  std::vector<int32_t> slots;  // each sequence's GDN slot
};

namespace {

// The same on the device.
struct StepTensors {
  int64_t paged_rows = 0, first_rows = 0;
  Tensor rows, table, cu_paged, lens, cu_first, slots;
};

}  // namespace

// Index tables of the layers (DecodeCache::table), kept while their values stay the same. A frozen store (a recorded
// graph's) hands out only what it holds: the layers asking for anything else would make the graph read a table that
// is not kept.
class RolloutEngine::TableStore {
 public:
  Tensor get(Runtime& rt, Device device, const std::string& key, const std::vector<int32_t>& values) {
    auto it = tables_.find(key);
    if (it != tables_.end() && it->second.first == values) return it->second.second;
    LATHE_CHECK(!frozen, "rollout: the layers asked for table '{}' with other values than when the step's graph was "
                         "prepared (a table must depend only on the batch's document lengths)", key);
    Tensor t = rt.upload(values.data(), {int64_t(values.size())}, DType::I32, device);
    tables_[key] = {values, t};
    return t;
  }
  bool frozen = false;

 private:
  std::map<std::string, std::pair<std::vector<int32_t>, Tensor>> tables_;
};

class RolloutEngine::StepView final : public DecodeCache {
 public:
  StepView(Runtime& rt, Device device, Pool& pool, StepTensors tensors, TableStore& tables)
      : rt_(&rt), device_(device), pool_(&pool), t_(std::move(tensors)), tables_(&tables) {}

  Tensor attend(ExecContext& cx, int64_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v) override {
    const int a = pool_->attn_slot.at(size_t(layer));
    LATHE_ASSERT(a >= 0);
    Tensor& kc = pool_->k[size_t(a)];
    Tensor& vc = pool_->v[size_t(a)];
    scatter_rows_into(cx, kr, t_.rows, kc);
    scatter_rows_into(cx, v, t_.rows, vc);
    const int64_t p = t_.paged_rows, f = t_.first_rows;
    Tensor paged, first;
    if (p > 0)
      paged = paged_attention(cx, qr.narrow(0, 0, p), kc, vc, t_.table, t_.cu_paged, t_.lens, {0.0, pool_->block_size});
    if (f > 0) first = attention(cx, qr.narrow(0, p, f), kr.narrow(0, p, f), v.narrow(0, p, f), t_.cu_first, {})[0];
    if (f == 0) return paged;
    if (p == 0) return first;
    Tensor out = Tensor::empty(qr.shape(), qr.dtype(), cx.allocator);
    copy_into(cx, paged, out.narrow(0, 0, p));
    copy_into(cx, first, out.narrow(0, p, f));
    return out;
  }

  Tensor conv_history(int64_t layer) override { return gather(pool_->conv[gdn(layer)]); }
  Tensor gdn_state(int64_t layer) override { return gather(pool_->state[gdn(layer)]); }
  void set_gdn(int64_t layer, Tensor conv_history, Tensor state) override {
    ExecContext cx = rt_->context(device_);
    const size_t g = gdn(layer);
    scatter_rows_into(cx, conv_history, t_.slots, pool_->conv[g]);
    scatter_rows_into(cx, state, t_.slots, pool_->state[g]);
  }
  Tensor table(const std::string& key, const std::vector<int32_t>& values) override {
    return tables_->get(*rt_, device_, key, values);
  }

 private:
  size_t gdn(int64_t layer) const {
    const int g = pool_->gdn_slot.at(size_t(layer));
    LATHE_ASSERT(g >= 0);
    return size_t(g);
  }
  // The batch's sequences' rows of a per-slot tensor (slots, ...), as (B, ...).
  Tensor gather(const Tensor& per_slot) const {
    ExecContext cx = rt_->context(device_);
    Shape shape = per_slot.shape();
    const int64_t slots = shape[0], each = per_slot.numel() / std::max<int64_t>(slots, 1);
    shape[0] = t_.slots.size(0);
    return embedding(cx, per_slot.view({slots, each}), t_.slots).view(shape);
  }

  Runtime* rt_;
  Device device_;
  Pool* pool_;
  StepTensors t_;
  TableStore* tables_;
};

// ---------------------------------------------------------------------------------------------------------------
// Decode steps of fixed shapes: a step whose sequences all decode one token runs padded to a shape (a batch size of
// kDecodeBatches, a power-of-two block-table width) whose inputs sit in one device buffer at fixed places; its layers
// are recorded once per shape as a graph and replayed (EngineOptions::graphs). Pad rows decode token 0 at position 0
// into the pool's scratch block and scratch GDN slot, which no sequence uses; their outputs are dropped. Recording
// runs the step once eagerly first (that run is the step's result and warms lazily made state: GEMM plans, tables),
// then records the same calls with every allocation from an allocator of the graphs' own, so what a graph reads and
// writes stays where it was recorded. The final norm's rows are the graph's output; the LM head runs after it.

namespace {

// The padded batch sizes of decode steps.
constexpr int64_t kDecodeBatches[] = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024};

}  // namespace

class RolloutEngine::FixedSteps {
 public:
  FixedSteps(Runtime& rt, CausalLm& model, Pool& pool, int64_t max_batch, bool record, bool strict)
      : rt_(&rt), model_(&model), pool_(&pool), record_(record), strict_(strict), device_(model.options().device) {
    max_batch_ = padded_batch(max_batch);
    max_width_ = std::max<int64_t>(1, (pool.context_tokens + pool.block_size - 1) / pool.block_size);
    if (pool.k.empty()) max_width_ = 1;
    max_width_ = std::min(max_width_, std::max<int64_t>(1, pool.blocks));
    ExecContext cx = rt.context(device_);
    inputs_ = Tensor::empty({7 * max_batch_ + 1 + max_batch_ * max_width_}, DType::I32, cx.allocator);
    if (record_) private_ = rt.backend(device_.type).private_allocator(device_.index);
    LATHE_CHECK(!record_ || private_, "rollout: {} has no allocator for graphs", device_.str());
  }

  // The final norm's rows (b, H) of a decode step of b sequences, one token each: ids, positions, adapters (the
  // bank's index, -1 for none; empty without a bank) and coordinates (b rows, `width` columns of table) of the real
  // sequences.
  Tensor hidden(const std::vector<int32_t>& ids, const std::vector<int32_t>& positions,
                const std::vector<int32_t>& adapters, const StepCoords& c, EngineStats& stats) {
    const int64_t b = int64_t(ids.size()), batch = padded_batch(b), width = padded_width(c.width);
    ShapeRun& s = shape(batch, width);
    LATHE_CHECK(!s.graph || s.bank == model_->lora(), "rollout: the model's LoRA bank changed after decode steps were "
                "recorded with {} (make a new engine)", s.bank ? "another bank" : "none");
    upload(s, ids, positions, adapters, c);
    if (s.graph) {
      s.graph->replay(rt_->context(device_).stream);
      ++stats.graph_replays;
      return s.out.narrow(0, 0, b);
    }
    ++stats.padded_steps;
    if (!record_) return run(s).narrow(0, 0, b);
    const AllocatorScope scope(*rt_, device_, *private_);
    const Tensor out = run(s);  // this step's rows; then the same calls are recorded
    s.tables.frozen = true;
    ExecContext cx = rt_->context(device_);
    DeviceBackend& backend = cx.backend;
    try {
      backend.begin_capture(cx.stream);
      try {
        s.out = run(s);
      } catch (...) {
        try {
          backend.end_capture(cx.stream);
        } catch (const Error&) {  // the first error is the one to report
        }
        throw;
      }
      s.graph = backend.end_capture(cx.stream);
      s.bank = model_->lora();
    } catch (const Error& e) {
      if (strict_) throw;
      failure_ = e.what();  // this step's rows stand (its cache writes are done); the engine stops recording
      return out.narrow(0, 0, b);
    }
    ++stats.graphs_recorded;
    return out.narrow(0, 0, b);
  }

  // Why recording failed (empty: it did not), for an engine that was not asked for graphs outright (StepGraphs::kAuto).
  const std::string& failure() const { return failure_; }

  int64_t max_batch() const { return max_batch_; }
  bool records() const { return record_; }
  bool strict() const { return strict_; }  // asked for outright (on, padded), not auto

 private:
  struct ShapeRun {
    int64_t batch = 0, width = 0;
    StepTensors tensors;
    PackedBatch batch_inputs;  // views of the input buffer; no cache (run() sets one)
    Tensor adapters;           // each row's adapter (PackedBatch::row_adapters; run() sets it with a bank)
    const LoraBank* bank = nullptr;  // the model's bank when the graph was recorded
    TableStore tables;
    std::unique_ptr<Graph> graph;
    Tensor out;  // the graph's output
  };

  static int64_t padded_batch(int64_t b) {
    for (int64_t p : kDecodeBatches)
      if (p >= b) return p;
    return b;  // past the largest size: the batch itself
  }
  int64_t padded_width(int64_t w) const {
    int64_t p = 1;
    while (p < w) p *= 2;
    return std::min(p, max_width_);
  }

  // Input buffer layout of a shape: ids | positions | rows | lens | slots | adapters (batch each) | cu (batch + 1) |
  // table.
  ShapeRun& shape(int64_t batch, int64_t width) {
    auto& slot = shapes_[{batch, width}];
    if (slot) return *slot;
    LATHE_ASSERT(batch <= max_batch_ && width <= max_width_);
    slot = std::make_unique<ShapeRun>();
    ShapeRun& s = *slot;
    s.batch = batch;
    s.width = width;
    const auto part = [&](int64_t i) { return inputs_.narrow(0, i * batch, batch); };
    const Tensor cu = inputs_.narrow(0, 6 * batch, batch + 1);
    s.tensors.paged_rows = batch;
    s.tensors.rows = part(2);
    s.tensors.lens = part(3);
    s.tensors.slots = part(4);
    s.tensors.cu_paged = cu;
    s.adapters = part(5);
    s.tensors.table = inputs_.narrow(0, 7 * batch + 1, batch * width).view({batch, width});
    PackedBatch& p = s.batch_inputs;
    p.ids = part(0);
    p.positions = part(1);
    p.cu_seqlens = cu;
    p.labels = part(0);  // unread: no loss
    p.host_ids.assign(size_t(batch), 0);  // the real ids were checked when they were made
    p.host_labels.assign(size_t(batch), -100);
    for (int64_t i = 0; i <= batch; ++i) p.host_cu.push_back(int32_t(i));
    return s;
  }

  void upload(const ShapeRun& s, const std::vector<int32_t>& ids, const std::vector<int32_t>& positions,
              const std::vector<int32_t>& adapters, const StepCoords& c) {
    const int64_t b = int64_t(ids.size()), batch = s.batch, width = s.width;
    const int32_t scratch_row = int32_t(pool_->scratch_block * pool_->block_size);
    const int32_t none = model_->lora() ? int32_t(model_->lora()->size()) : 0;  // the masks' zero row
    host_.assign(size_t(7 * batch + 1 + batch * width), 0);
    int32_t* h = host_.data();
    for (int64_t i = 0; i < batch; ++i) {
      const bool real = i < b;
      h[i] = real ? ids[size_t(i)] : 0;
      h[batch + i] = real ? positions[size_t(i)] : 0;
      h[2 * batch + i] = real && !c.rows.empty() ? c.rows[size_t(i)] : scratch_row;
      h[3 * batch + i] = real ? c.lens[size_t(i)] : 1;
      h[4 * batch + i] = real ? c.slots[size_t(i)] : int32_t(pool_->scratch_slot);
      h[5 * batch + i] = real && !adapters.empty() && adapters[size_t(i)] >= 0 ? adapters[size_t(i)] : none;
      for (int64_t j = 0; j < width; ++j)
        h[7 * batch + 1 + i * width + j] =
            real && j < c.width ? c.table[size_t(i * c.width + j)] : int32_t(pool_->scratch_block);
    }
    for (int64_t i = 0; i <= batch; ++i) h[6 * batch + i] = int32_t(i);
    ExecContext cx = rt_->context(device_);
    cx.stream.upload(inputs_.data_ptr(), host_.data(), host_.size() * sizeof(int32_t));
  }

  Tensor run(ShapeRun& s) {
    StepView view(*rt_, device_, *pool_, s.tensors, s.tables);
    PackedBatch b = s.batch_inputs;
    b.cache = &view;
    if (model_->lora()) b.row_adapters = s.adapters;
    return model_->last_hidden(b);
  }

  Runtime* rt_;
  CausalLm* model_;
  Pool* pool_;
  bool record_, strict_;  // strict: a failed recording is an error, else failure() says why
  std::string failure_;
  Device device_;
  int64_t max_batch_ = 1, max_width_ = 1;
  Tensor inputs_;                       // the shapes' inputs (i32)
  std::vector<int32_t> host_;           // their host copy
  std::unique_ptr<Allocator> private_;  // the graphs' memory: destroyed after the shapes that hold it
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<ShapeRun>> shapes_;
};

// ---------------------------------------------------------------------------------------------------------------
// RolloutEngine

RolloutEngine::RolloutEngine(Runtime& rt, CausalLm& model, EngineOptions options)
    : rt_(&rt), model_(&model), options_(options) {
  LATHE_CHECK(options_.block_size >= 1 && options_.max_step_tokens >= 1 && options_.max_running >= 1,
              "rollout: block_size, max_step_tokens and max_running must be at least 1 (got {}, {}, {})",
              options_.block_size, options_.max_step_tokens, options_.max_running);
  pool_ = std::make_unique<Pool>(rt, model.config(), model.options(), options_);
  tables_ = std::make_unique<TableStore>();
  const Device device = model.options().device;
  std::string why;
  if (!rt.backend(device.type).can_capture()) why = fmt::format("{} does not record graphs", device.str());
  else if (model.expert_parallel())  // (a decoding step routes on the device otherwise: CausalLm::routes_on_device)
    why = "expert parallelism's exchange reads the routing back to the host";
  else if (model.options().tp && model.options().tp->size() > 1)
    why = "tensor parallelism's collectives are not recorded in graphs yet";
  else if (model.pp_size() > 1)
    why = "pipeline parallelism's stages exchange through the host's schedule";
  LATHE_CHECK(options_.graphs != StepGraphs::kOn || why.empty(), "rollout: decode graphs asked for, but {}", why);
  LATHE_CHECK(options_.graphs != StepGraphs::kPadded || model.pp_size() == 1,
              "rollout: padded decode steps run whole models; under pipeline parallelism use graphs auto or off");
  // kAuto records whatever can be recorded: faster by median step for the dense, hybrid and mixture-of-experts shapes
  // at every batch measured (docs/rollout.md, "Decode graphs").
  const bool record = why.empty() && (options_.graphs == StepGraphs::kOn || options_.graphs == StepGraphs::kAuto);
  if (options_.graphs == StepGraphs::kPadded || record)
    fixed_ = std::make_unique<FixedSteps>(rt, model, *pool_, options_.max_running, record,
                                          options_.graphs != StepGraphs::kAuto);
}

RolloutEngine::~RolloutEngine() = default;

int64_t RolloutEngine::cache_blocks() const { return pool_->blocks; }

int64_t RolloutEngine::submit(RolloutRequest request) {
  const int64_t vocab = model_->global_config().vocab_size;  // the whole vocabulary (config()'s is a tp rank's rows)
  LATHE_CHECK(!request.prompt.empty(), "rollout: request {} has an empty prompt", next_request_);
  LATHE_CHECK(request.n >= 1, "rollout: request {} asks for {} samples", next_request_, request.n);
  LATHE_CHECK(request.max_new_tokens >= 1, "rollout: request {} asks for {} new tokens", next_request_,
              request.max_new_tokens);
  check_sampling_options(request.sampling);
  const int adapters = model_->lora() ? model_->lora()->size() : 0;
  LATHE_CHECK(request.adapter >= -1 && request.adapter < adapters,
              "rollout: request {} names adapter {}, but the model has {} (attach a LoRA bank to serve adapters)",
              next_request_, request.adapter, adapters);
  for (int32_t id : request.banned_ids)
    LATHE_CHECK(id >= 0 && id < vocab, "rollout: request {}: banned id {} is outside the vocabulary (size {})",
                next_request_, id, vocab);
  for (int32_t id : request.prompt)
    LATHE_CHECK(id >= 0 && id < vocab, "rollout: request {}: token id {} is outside the vocabulary (size {})",
                next_request_, id, vocab);
  const int64_t limit = pool_->context_tokens;
  LATHE_CHECK(int64_t(request.prompt.size()) < limit,
              "rollout: request {}: a prompt of {} tokens leaves no room in a context of {} (the model's positions "
              "and the cache's {} blocks of {})",
              next_request_, request.prompt.size(), limit, pool_->blocks, pool_->block_size);
  auto req = std::make_shared<const RolloutRequest>(std::move(request));
  for (int i = 0; i < req->n; ++i) {
    auto s = std::make_unique<Sequence>();
    s->request = next_request_;
    s->sample = i;
    s->req = req;
    s->tokens = req->prompt;
    s->prompt_len = req->prompt.size();
    std::seed_seq seq{uint32_t(req->seed), uint32_t(req->seed >> 32), uint32_t(i)};
    s->rng.seed(seq);
    if (i > 0 && options_.share_prefixes) waiting_.back()->followers.push_back(std::move(s));
    else waiting_.push_back(std::move(s));
  }
  return next_request_++;
}

// Grows a running sequence's block table to hold `tokens` tokens; false (and nothing taken) when the pool is short.
bool RolloutEngine::reserve_blocks(Sequence& s, int64_t tokens) {
  if (pool_->k.empty()) return true;  // no attention layer: nothing to page
  const size_t need = size_t((tokens + pool_->block_size - 1) / pool_->block_size);
  if (need <= s.blocks.size()) return true;
  if (need - s.blocks.size() > pool_->free_blocks.size()) return false;
  while (s.blocks.size() < need) {
    s.blocks.push_back(pool_->free_blocks.back());
    pool_->block_refs[size_t(s.blocks.back())] = 1;
    pool_->free_blocks.pop_back();
  }
  return true;
}

void RolloutEngine::release(Sequence& s) {
  for (int32_t b : s.blocks)
    if (--pool_->block_refs[size_t(b)] == 0) pool_->free_blocks.push_back(b);
  s.blocks.clear();
  if (s.slot >= 0) pool_->free_slots.push_back(s.slot);
  s.slot = -1;
}

// The sequence leaves the running batch and waits first in line, to be prefilled again from its tokens so far.
void RolloutEngine::preempt(Sequence& s) {
  release(s);
  s.computed = 0;
  auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& p) { return p.get() == &s; });
  LATHE_ASSERT(it != running_.end());
  waiting_.push_front(std::move(*it));
  running_.erase(it);
  ++stats_.preemptions;
}

void RolloutEngine::finish(Sequence& s, FinishReason why) {
  RolloutResult r;
  r.request = s.request;
  r.sample = s.sample;
  r.tokens.assign(s.tokens.begin() + std::ptrdiff_t(s.prompt_len), s.tokens.end());
  r.logprobs = std::move(s.logprobs);
  r.sampling_logprobs = std::move(s.sampling_logprobs);
  r.finish_reason = why;
  finished_.push_back(std::move(r));
  release(s);
}

void RolloutEngine::admit(Sequence& s) {
  s.slot = pool_->free_slots.back();
  pool_->free_slots.pop_back();
}

// `follower` continues from `leader`'s prompt, which is in the cache: its whole blocks shared, its partial block and
// GDN history and state copied. False (nothing taken) when no slot or block is free for it.
bool RolloutEngine::fork(Sequence& leader, Sequence& follower) {
  const int64_t bs = pool_->block_size, whole = int64_t(leader.prompt_len) / bs, part = int64_t(leader.prompt_len) % bs;
  const bool needs_block = !pool_->k.empty() && part > 0;
  if (pool_->free_slots.empty() || int64_t(running_.size()) >= options_.max_running ||
      (needs_block && pool_->free_blocks.empty()))
    return false;
  admit(follower);
  ExecContext cx = rt_->context(model_->options().device);
  if (!pool_->k.empty()) {
    for (int64_t b = 0; b < whole; ++b) {
      follower.blocks.push_back(leader.blocks[size_t(b)]);
      ++pool_->block_refs[size_t(leader.blocks[size_t(b)])];
    }
    if (needs_block) {
      reserve_blocks(follower, int64_t(leader.prompt_len));  // the one new block
      const int64_t from = leader.blocks[size_t(whole)] * bs, to = follower.blocks.back() * bs;
      for (size_t a = 0; a < pool_->k.size(); ++a)
        for (Tensor* t : {&pool_->k[a], &pool_->v[a]}) copy_into(cx, t->narrow(0, from, part), t->narrow(0, to, part));
    }
  }
  for (size_t g = 0; g < pool_->conv.size(); ++g)
    for (Tensor* t : {&pool_->conv[g], &pool_->state[g]})
      copy_into(cx, t->narrow(0, leader.slot, 1), t->narrow(0, follower.slot, 1));
  follower.computed = int64_t(leader.prompt_len);
  stats_.shared_prompt_tokens += int64_t(leader.prompt_len);
  return true;
}

int64_t RolloutEngine::allowed_vocab(const Sequence& s) const {
  const int64_t v = model_->global_config().vocab_size;  // the whole vocabulary (config()'s is a tp rank's rows)
  return s.req->allowed_vocab > 0 ? std::min(s.req->allowed_vocab, v) : v;
}

// Whether the sequence's next token is the argmax over `limit` ids: greedy with nothing that changes the logits.
bool RolloutEngine::plain_greedy(const Sequence& s, int64_t limit) const {
  const SamplingOptions& o = s.req->sampling;
  return o.temperature == 0 && o.repetition_penalty == 1.0 && o.frequency_penalty == 0.0 && s.req->banned_ids.empty() &&
         allowed_vocab(s) == limit;
}

// Whether the sequence's next token is drawn on the device: sampled (temperature, top-k, top-p, min-p), or greedy or
// sampled after penalties or banned ids (penalize_rows); only a request whose allowed vocabulary is not the step's
// limit draws on the host.
bool RolloutEngine::device_drawn(const Sequence& s, int64_t limit) const {
  return allowed_vocab(s) == limit && !plain_greedy(s, limit);
}

// The model's logit of `token` from its penalised one (penalize_rows, op_table.h, undone in double): z = y + f c,
// then z * p above zero and z / p otherwise, for an id the draw saw; other ids are unchanged.
double RolloutEngine::unpenalized(const DeviceDraws::Draw& d, int32_t token, double logit) {
  const auto e = d.entries.find(token);
  if (e == d.entries.end() || e->second < 0) return logit;
  const double z = logit + d.frequency * double(e->second);
  return z > 0 ? z * d.repetition : z / d.repetition;
}

// The next tokens of the ready rows that draw on the device, and of their followers (which draw their first token
// from their leader's row): at most one sample_rows call for the plain draws, and for the penalised ones one
// penalize_rows call and then sample_rows or row_argmax_logsumexp over its rows. Each draw's stream is the sample's (a
// key from the request's seed and the sample's index), its counter the tokens the sample has generated, so nothing
// else in the step changes it.
RolloutEngine::DeviceDraws RolloutEngine::draw_on_device(ExecContext& cx, const Tensor& logits,
                                                         const std::vector<Sequence*>& batch,
                                                         const std::vector<size_t>& ready, int64_t limit) {
  using Group = DeviceDraws::Group;
  DeviceDraws d;
  const DType st = logits.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const auto as_kernel = [&](double x) { return st == DType::F64 ? x : double(float(x)); };
  const int64_t v = logits.size(1);
  struct Draws {  // one sample_rows call's inputs
    std::vector<int32_t> rows, keys;
    std::vector<double> params;
  } plain, penalised;
  std::vector<int32_t> penalised_rows, entries, greedy_rows;  // penalize_rows' inputs; the greedy draws' y rows
  std::vector<double> penalties;
  const auto add = [&](const Sequence& q, size_t row) {
    const SamplingOptions& o = q.req->sampling;
    const bool penalise = o.repetition_penalty != 1.0 || o.frequency_penalty != 0.0 || !q.req->banned_ids.empty();
    DeviceDraws::Draw w;
    w.group = o.temperature == 0 ? Group::kPenalisedGreedy : penalise ? Group::kPenalisedSampled : Group::kSampled;
    w.i = 0;
    if (penalise) {  // the ids the penalties change: generated (their counts), and the prompt's for repetition
      w.repetition = as_kernel(o.repetition_penalty);
      w.frequency = as_kernel(o.frequency_penalty);
      const int32_t y_row = int32_t(penalised_rows.size());
      if (o.repetition_penalty != 1.0)
        for (size_t k = 0; k < q.prompt_len; ++k) w.entries.try_emplace(q.tokens[k], 0);
      for (size_t k = q.prompt_len; k < q.tokens.size(); ++k) ++w.entries[q.tokens[k]];
      for (int32_t id : q.req->banned_ids) w.entries[id] = -1;
      for (const auto& [id, count] : w.entries)
        if (id >= 0 && id < v) entries.insert(entries.end(), {y_row, id, count});
      penalised_rows.push_back(int32_t(row));
      penalties.insert(penalties.end(), {o.repetition_penalty, o.frequency_penalty});
      row = size_t(y_row);
    }
    if (w.group == Group::kPenalisedGreedy) {
      w.i = greedy_rows.size();
      greedy_rows.push_back(int32_t(row));
    } else {
      Draws& to = penalise ? penalised : plain;
      const uint64_t key = splitmix64(splitmix64(q.req->seed) + uint64_t(q.sample));
      w.i = to.rows.size();
      to.rows.push_back(int32_t(row));
      to.keys.insert(to.keys.end(), {int32_t(uint32_t(key)), int32_t(uint32_t(key >> 32)),
                                     int32_t(q.tokens.size() - q.prompt_len)});
      to.params.insert(to.params.end(), {o.temperature, o.min_p, double(o.top_k), o.top_p});
    }
    d.index.emplace(&q, std::move(w));
  };
  for (size_t i : ready) {
    if (!device_drawn(*batch[i], limit ? limit : v)) continue;
    add(*batch[i], i);
    for (const std::unique_ptr<Sequence>& f : batch[i]->followers) add(*f, i);
  }
  const Device device = logits.device();
  const auto sample = [&](Group g, const Tensor& x, const Draws& draws) {
    if (draws.rows.empty()) return;
    const int64_t m = int64_t(draws.rows.size());
    d.first[g] = int(d.out.size());
    for (Tensor& t : sample_rows(cx, x, rt_->upload(draws.rows.data(), {m}, DType::I32, device),
                                 cast(cx, rt_->upload(draws.params.data(), {m, 4}, DType::F64, device), st),
                                 rt_->upload(draws.keys.data(), {m, 3}, DType::I32, device), limit))
      d.out.push_back(std::move(t));
  };
  sample(Group::kSampled, logits, plain);
  if (penalised_rows.empty()) return d;
  const int64_t m = int64_t(penalised_rows.size()), e = int64_t(entries.size()) / 3;
  const Tensor y =
      penalize_rows(cx, logits, rt_->upload(penalised_rows.data(), {m}, DType::I32, device),
                    cast(cx, rt_->upload(penalties.data(), {m, 2}, DType::F64, device), st),
                    e > 0 ? rt_->upload(entries.data(), {e, 3}, DType::I32, device) : Tensor::empty({0, 3}, DType::I32, cx.allocator));
  sample(Group::kPenalisedSampled, y, penalised);
  if (!greedy_rows.empty()) {
    const Tensor rows_of_y = embedding(cx, y, rt_->upload(greedy_rows.data(), {int64_t(greedy_rows.size())}, DType::I32, device));
    std::vector<Tensor> g = row_argmax_logsumexp(cx, rows_of_y, limit);
    d.first[Group::kPenalisedGreedy] = int(d.out.size());
    d.out.push_back(std::move(g[0]));
    d.out.push_back(std::move(g[1]));
  }
  return d;
}

SampledToken RolloutEngine::draw(Sequence& s, std::span<const double> row, std::vector<float>& scratch) {
  std::copy(row.begin(), row.end(), scratch.begin());
  for (int32_t id : s.req->banned_ids) scratch[size_t(id)] = -std::numeric_limits<float>::infinity();
  const std::span<const int32_t> prompt(s.tokens.data(), s.prompt_len);
  const std::span<const int32_t> generated(s.tokens.data() + s.prompt_len, s.tokens.size() - s.prompt_len);
  return sample_next(scratch, allowed_vocab(s), s.req->sampling, prompt, generated, s.rng);
}

bool RolloutEngine::take(Sequence& s, int32_t token, double logprob, double sampling_logprob) {
  s.logprobs.push_back(logprob);
  s.sampling_logprobs.push_back(sampling_logprob);
  s.tokens.push_back(token);
  const bool eos = std::find(s.req->stop_ids.begin(), s.req->stop_ids.end(), token) != s.req->stop_ids.end();
  const bool stop = s.req->on_token && s.req->on_token(s.sample, token);
  const int64_t new_tokens = int64_t(s.tokens.size() - s.prompt_len);
  if (!eos && !stop && new_tokens < s.req->max_new_tokens && int64_t(s.tokens.size()) < pool_->context_tokens)
    return false;
  finish(s, eos ? FinishReason::kEos : stop ? FinishReason::kStop : FinishReason::kLength);
  return true;
}

// The step's sequences and how many of their tokens each computes: the running ones first (in admission order; a
// sequence that cannot get its blocks preempts the latest admitted one), then waiting ones while the step has room.
bool RolloutEngine::schedule(std::vector<Sequence*>& batch, std::vector<int64_t>& chunk) {
  int64_t budget = options_.max_step_tokens;
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& s = *running_[i];
    const int64_t n = std::min(int64_t(s.tokens.size()) - s.computed, budget);
    if (!reserve_blocks(s, s.computed + n)) {
      Sequence& victim = *running_.back();
      LATHE_CHECK(&victim != &s || running_.size() > 1,
                  "rollout: the cache ({} blocks of {} tokens) cannot hold one sequence of {} tokens", pool_->blocks,
                  pool_->block_size, s.computed + n);
      preempt(victim);
      if (&victim == &s) break;
      continue;  // try again with the victim's blocks
    }
    batch.push_back(&s);
    chunk.push_back(n);
    budget -= n;
    ++i;
  }
  while (budget > 0 && !waiting_.empty() && !pool_->free_slots.empty() &&
         int64_t(running_.size()) < options_.max_running) {
    Sequence& s = *waiting_.front();
    const int64_t n = std::min(int64_t(s.tokens.size()), budget);
    if (!reserve_blocks(s, n)) {
      // Nothing running to wait for: the pool is too small for this sequence's first chunk.
      LATHE_CHECK(!running_.empty(),
                  "rollout: the cache ({} blocks of {} tokens) cannot hold {} tokens of one sequence", pool_->blocks,
                  pool_->block_size, n);
      break;
    }
    admit(s);
    ExecContext cx = rt_->context(model_->options().device);
    for (size_t g = 0; g < pool_->conv.size(); ++g) {  // a new sequence starts from zero history and state
      fill_zero(cx, pool_->conv[g].narrow(0, s.slot, 1));
      fill_zero(cx, pool_->state[g].narrow(0, s.slot, 1));
    }
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    batch.push_back(&s);
    chunk.push_back(n);
    budget -= n;
  }
  return !batch.empty();
}

RolloutEngine::StepCoords RolloutEngine::step_coords(const std::vector<Sequence*>& seqs,
                                                     const std::vector<int64_t>& chunk) const {
  StepCoords co;
  const Pool& pool = *pool_;
  for (const Sequence* s : seqs) co.width = std::max(co.width, int64_t(s->blocks.size()));
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Sequence& s = *seqs[i];
    for (int64_t p = s.computed; p < s.computed + chunk[i] && !pool.k.empty(); ++p)
      co.rows.push_back(int32_t(s.blocks[size_t(p / pool.block_size)] * pool.block_size + p % pool.block_size));
    if (s.computed > 0) {
      LATHE_ASSERT(co.cu_first.size() == 1);  // no sequence with a past after a first chunk
      std::vector<int32_t> t(s.blocks.begin(), s.blocks.end());
      t.resize(size_t(co.width), 0);
      co.table.insert(co.table.end(), t.begin(), t.end());
      co.cu_paged.push_back(co.cu_paged.back() + int32_t(chunk[i]));
      co.lens.push_back(int32_t(s.computed + chunk[i]));
    } else {
      co.cu_first.push_back(co.cu_first.back() + int32_t(chunk[i]));
    }
    co.slots.push_back(int32_t(s.slot));
  }
  return co;
}

// Every sequence of the step decodes one token after its past.
bool RolloutEngine::decode_step(const std::vector<Sequence*>& batch, const std::vector<int64_t>& chunk) {
  for (size_t i = 0; i < batch.size(); ++i)
    if (chunk[i] != 1 || batch[i]->computed == 0) return false;
  return true;
}

// A decode step; not recorded while a profiler times ops. With adapters only where graphs were asked for outright (on,
// padded: the row-adapter path, correct on a GPU but not yet timed against eager segments, docs/rollout.md), and not
// for adapters on the experts (their GEMMs take host segments).
bool RolloutEngine::fixed_shape_step(const std::vector<Sequence*>& batch, const std::vector<int64_t>& chunk) const {
  if (!fixed_ || int64_t(batch.size()) > fixed_->max_batch()) return false;
  if (model_->lora() && (model_->lora()->adapts_experts() || !fixed_->strict())) return false;
  if (fixed_->records() && rt_->profiler()) return false;
  return decode_step(batch, chunk);
}

Tensor RolloutEngine::step_logits(const std::vector<Sequence*>& batch, const std::vector<int64_t>& chunk) {
  const Device device = model_->options().device;
  if (!options_.time_forwards || !decode_step(batch, chunk)) return step_logits_untimed(batch, chunk);
  DeviceBackend& backend = rt_->backend(device.type);
  Stream& stream = rt_->context(device).stream;
  if (!forward_start_) forward_start_ = backend.create_event(device.index), forward_end_ = backend.create_event(device.index);
  const int64_t replays = stats_.graph_replays, recorded = stats_.graphs_recorded;
  forward_start_->record(stream);
  Tensor logits = step_logits_untimed(batch, chunk);
  forward_end_->record(stream);
  forward_end_->synchronize();
  const double ms = forward_end_->elapsed_ms_since(*forward_start_);
  if (stats_.graph_replays > replays) {
    stats_.replay_forward_ms += ms;
  } else if (stats_.graphs_recorded == recorded) {  // (a recording step is neither)
    stats_.eager_forward_ms += ms;
    ++stats_.eager_decode_steps;
  }
  return logits;
}

Tensor RolloutEngine::step_logits_untimed(const std::vector<Sequence*>& batch, const std::vector<int64_t>& chunk) {
  const int64_t vocab = model_->global_config().vocab_size;
  const Device device = model_->options().device;
  const StepCoords co = step_coords(batch, chunk);
  if (fixed_shape_step(batch, chunk)) {
    std::vector<int32_t> ids, positions, adapters;
    for (const Sequence* s : batch) {
      ids.push_back(s->tokens[size_t(s->computed)]);
      positions.push_back(int32_t(s->computed));
      adapters.push_back(int32_t(s->req->adapter));
    }
    const Tensor logits = model_->lm_head_logits(fixed_->hidden(ids, positions, adapters, co, stats_));
    if (!fixed_->failure().empty()) {  // kAuto: the rest runs eagerly (the rows above were freed before this)
      fmt::print(stderr, "rollout: note: decode graphs are off for this engine: {}\n", fixed_->failure());
      fixed_.reset();
    }
    return logits;
  }
  std::vector<std::vector<int32_t>> tokens;
  std::vector<int64_t> past;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Sequence& s = *batch[i];
    tokens.emplace_back(s.tokens.begin() + std::ptrdiff_t(s.computed),
                        s.tokens.begin() + std::ptrdiff_t(s.computed + chunk[i]));
    past.push_back(s.computed);
  }
  PackedBatch b = continuation_batch(*rt_, device, tokens, past, vocab);
  if (model_->lora()) {  // each sequence a segment with its request's adapter (-1: the base alone)
    std::vector<BatchSegment> segments;
    for (size_t i = 0; i < batch.size(); ++i) segments.push_back({b.host_cu[i + 1], batch[i]->req->adapter});
    set_segments(b, std::move(segments));
  }
  const auto upload = [&](const std::vector<int32_t>& v) {
    return rt_->upload(v.data(), {int64_t(v.size())}, DType::I32, device);
  };
  StepTensors t;
  t.paged_rows = co.cu_paged.back();
  t.first_rows = co.cu_first.back();
  if (!co.rows.empty()) t.rows = upload(co.rows);
  if (t.paged_rows > 0) {
    t.table = upload(co.table).view({int64_t(co.lens.size()), co.width});
    t.cu_paged = upload(co.cu_paged);
    t.lens = upload(co.lens);
  }
  if (t.first_rows > 0) t.cu_first = upload(co.cu_first);
  t.slots = upload(co.slots);
  StepView view(*rt_, device, *pool_, std::move(t), *tables_);
  b.cache = &view;
  return model_->last_logits(b);  // (B, V)
}

// Expert parallelism: whether any rank of the ep group still has work (a sum over the group, read on the host).
bool RolloutEngine::any_rank_busy(bool busy) {
  const std::vector<double> all = values_over(*rt_, model_->options().device, *model_->options().ep, busy ? 1.0 : 0.0);
  return std::any_of(all.begin(), all.end(), [](double b) { return b > 0; });
}

// A forward of two tokens whose output is dropped: a rank of an ep group with nothing left to decode keeps serving its
// experts to the ranks that have.
void RolloutEngine::filler_forward() {
  const int64_t vocab = model_->global_config().vocab_size;
  std::vector<int32_t> ids = {0, 0}, cu = {0, 2};
  std::vector<int32_t> labels = next_token_labels(ids, cu);
  model_->logits(
      make_packed_batch(*rt_, model_->options().device, std::move(ids), std::move(cu), std::move(labels), vocab));
}

bool RolloutEngine::step() {
  std::vector<Sequence*> batch;
  std::vector<int64_t> chunk;
  const bool busy = schedule(batch, chunk);
  // Expert parallelism: each forward is the ep group's collective (its ranks serve each other's routed rows), so every
  // rank steps while any has work; one without runs a filler.
  if (model_->expert_parallel()) {
    if (!any_rank_busy(busy)) return false;
    if (!busy) {
      filler_forward();
      return true;
    }
  } else if (!busy) {
    return false;
  }
  const int64_t vocab = model_->global_config().vocab_size;
  const Device device = model_->options().device;
  ExecContext cx = rt_->context(device);
  const Tensor logits = step_logits(batch, chunk);
  // Every row's log-sum-exp, and the argmax over `limit` ids, on the device: a plain greedy sequence takes its token
  // and log-probability from there; only the rows that sample (or whose logits change first) come to the host.
  std::vector<size_t> ready;  // rows whose sequence has all its tokens in the cache after this step
  for (size_t i = 0; i < batch.size(); ++i)
    if (batch[i]->computed + chunk[i] == int64_t(batch[i]->tokens.size())) ready.push_back(i);
  const int64_t limit = ready.empty() ? vocab : allowed_vocab(*batch[ready[0]]);
  std::vector<Tensor> figures = row_argmax_logsumexp(cx, logits, limit == vocab ? 0 : limit);
  std::vector<int32_t> host_rows;  // in f64 on the host: an f64 model's log-probabilities keep their precision
  std::vector<int64_t> host_row_of(batch.size(), -1);
  for (size_t i : ready)
    if (!plain_greedy(*batch[i], limit) && !device_drawn(*batch[i], limit)) {
      host_row_of[i] = int64_t(host_rows.size());
      host_rows.push_back(int32_t(i));
    }
  Tensor host;
  if (!host_rows.empty()) {
    const Tensor rows = rt_->from_host(host_rows.data(), {int64_t(host_rows.size())}, DType::I32, device);
    host = rt_->copy_to(cast(cx, embedding(cx, logits, rows), DType::F64), Device::cpu());
  }
  const DeviceDraws drawn = draw_on_device(cx, logits, batch, ready, limit == vocab ? 0 : limit);
  // Every row's argmax, its value and log-sum-exp, then the device draws' tokens, logits and log-probabilities: one
  // copy to the host.
  figures.insert(figures.end(), drawn.out.begin(), drawn.out.end());
  const std::vector<std::vector<double>> host_figures = to_host_f64(*rt_, cx, figures);
  const std::vector<double>&arg = host_figures[0], &best = host_figures[1], &lse = host_figures[2];
  std::vector<float> scratch(static_cast<size_t>(vocab));
  ++stats_.steps;
  for (size_t i = 0; i < batch.size(); ++i) stats_.step_tokens += chunk[i];
  stats_.peak_blocks_used = std::max(stats_.peak_blocks_used, pool_->blocks - int64_t(pool_->free_blocks.size()));
  std::vector<Sequence*> done;
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence& s = *batch[i];
    s.computed += chunk[i];
    if (s.computed < int64_t(s.tokens.size())) continue;  // a prompt chunk: its last logits are not the next token's
    const double row_lse = lse[i];
    LATHE_CHECK(std::isfinite(row_lse),
                "rollout: the model produced a non-finite logit for request {} (log-sum-exp {})", s.request, row_lse);
    // Sequence s's next token (and the request's other samples' first, from the same logits).
    const auto next = [&](Sequence& q) {
      if (const auto d = drawn.index.find(&q); d != drawn.index.end()) {
        const DeviceDraws::Draw& w = d->second;
        const size_t at = 3 + size_t(drawn.first[w.group]);  // the group's outputs among host_figures
        const int32_t id = int32_t(host_figures[at][w.i]);
        const double logit = host_figures[at + 1][w.i];
        const bool greedy = w.group == DeviceDraws::kPenalisedGreedy;
        LATHE_CHECK(id >= 0 && std::isfinite(logit), "rollout: every token id of request {} is masked", q.request);
        return take(q, id, unpenalized(w, id, logit) - row_lse, greedy ? 0.0 : host_figures[at + 2][w.i]);
      }
      if (host_row_of[i] < 0) return take(q, int32_t(arg[i]), best[i] - row_lse, 0.0);
      const std::span<const double> row(host.data<double>() + host_row_of[i] * vocab, size_t(vocab));
      const SampledToken t = draw(q, row, scratch);
      return take(q, t.id, row[size_t(t.id)] - row_lse, t.logprob);
    };
    // The prompt is in the cache: the request's other samples fork from it and draw from the same logits.
    for (std::unique_ptr<Sequence>& f : std::exchange(s.followers, {})) {
      if (!fork(s, *f)) {  // no room now: it will compute its prompt itself
        waiting_.push_back(std::move(f));
        continue;
      }
      if (next(*f)) done.push_back(f.get());
      running_.push_back(std::move(f));
    }
    if (next(s)) done.push_back(&s);
  }
  stats_.peak_running = std::max(stats_.peak_running, int64_t(running_.size()));
  std::erase_if(running_, [&](const auto& p) { return std::find(done.begin(), done.end(), p.get()) != done.end(); });
  return true;
}

std::vector<RolloutResult> RolloutEngine::take_finished() { return std::exchange(finished_, {}); }

std::vector<RolloutResult> RolloutEngine::run() {
  std::vector<RolloutResult> all;
  while (step()) {
    std::vector<RolloutResult> f = take_finished();
    all.insert(all.end(), std::make_move_iterator(f.begin()), std::make_move_iterator(f.end()));
  }
  std::vector<RolloutResult> f = take_finished();
  all.insert(all.end(), std::make_move_iterator(f.begin()), std::make_move_iterator(f.end()));
  std::sort(all.begin(), all.end(), [](const RolloutResult& a, const RolloutResult& b) {
    return std::tie(a.request, a.sample) < std::tie(b.request, b.sample);
  });
  return all;
}

void RolloutEngine::abort(int64_t request) {
  std::erase_if(waiting_, [&](const auto& s) { return s->request == request; });
  for (auto& s : running_)
    if (s->request == request) release(*s);
  std::erase_if(running_, [&](const auto& s) { return s->request == request; });
}

}  // namespace lathe
