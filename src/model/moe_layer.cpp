// The MLP of a layer, dense or mixture of experts (model/moe_layer.h, docs/moe.md): for experts, routing on the
// model's device (the moe_route op) from the router logits, grouped GEMMs over the rows sorted by expert (or one
// batched GEMM over blocks padded to the largest expert's rows), a gather and a fixed-order combine, the shared
// expert, the aux loss; and the checkpoint reading both families share (fused or per-expert expert tensors).
// Shapes: T tokens, D hidden, E experts, k experts per token, P = T k routed rows, I the expert FFN size.
// Numerics follow transformers' Qwen MoE blocks: router logits in the model dtype, softmax / top-k / renormalisation
// in fp32 (double in an f64 model) and the combine weights rounded to the model dtype.
#include <cmath>
#include <string_view>

#include "comm/communicator.h"
#include "model/causal_lm.h"
#include "model/lora.h"
#include "ops/ops.h"

namespace lathe {

namespace {

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

// The fused expert tensors and, for the per-expert layout, the parts each one stacks (along dim 1, in order).
bool is_fused_experts(std::string_view name) {
  return ends_with(name, ".mlp.experts.gate_up_proj") || ends_with(name, ".mlp.experts.down_proj");
}

std::vector<std::string> expert_parts(std::string_view fused_name) {
  if (ends_with(fused_name, "gate_up_proj")) return {"gate_proj", "up_proj"};
  return {"down_proj"};
}

// "model.layers.3.mlp.experts.gate_up_proj", expert 5, part "up_proj" -> "model.layers.3.mlp.experts.5.up_proj.weight"
std::string per_expert_name(std::string_view fused_name, int64_t expert, const std::string& part) {
  const std::string_view base = fused_name.substr(0, fused_name.rfind('.') + 1);
  return fmt::format("{}{}.{}.weight", base, expert, part);
}

}  // namespace

namespace {

// The ep group's counts, from the all-gathered summaries of moe_ep_messages: each rank's plan offsets (E + 2), then
// the length of its message to each rank.
struct GroupCounts {
  const int32_t* all;
  int64_t experts, ranks;
  const int32_t* of(int64_t rank) const { return all + rank * (experts + 2 + ranks); }
  int64_t pairs(int64_t rank, int64_t expert) const { return of(rank)[expert + 1] - of(rank)[expert]; }
  int64_t tokens(int64_t from, int64_t to) const { return of(from)[experts + 2 + to]; }
  int64_t bad_token(int64_t rank) const { return of(rank)[experts + 1]; }  // -1: every router logit finite
};

// A slot tensor (E R, n) as (E, R, n), its experts [first, first + count) (count -1: all).
Tensor experts_of(const Tensor& t, const LoraSlot& slot, int64_t n, int64_t first, int64_t count) {
  const Tensor all = t.view({slot.experts, slot.rank_total, n});
  return count < 0 ? all : all.narrow(0, first, count);
}

}  // namespace

Tensor ExpertLora::a() const { return experts_of(slot->a, *slot, slot->in, first, count); }
Tensor ExpertLora::bt() const { return experts_of(slot->bt, *slot, slot->out, first, count); }

void ExpertLora::forward(ExecContext& cx, const Tensor& x, const std::vector<int64_t>& offsets, Tensor& y) {
  u = mul(cx, grouped_matmul(cx, x, a(), {offsets, true}), mask);
  y = add(cx, y, grouped_matmul(cx, u, bt(), {offsets, false}));
}

void ExpertLora::backward(ExecContext& cx, const Tensor& x, const Tensor& dy, const std::vector<int64_t>& offsets,
                          Tensor& dx) const {
  auto accumulate = [&](const Tensor& grad, int64_t n, const Tensor& g) {
    const Tensor view = experts_of(grad, *slot, n, first, count);
    copy_into(cx, add(cx, view, g), view);
  };
  const GroupedMatmulAttrs g{offsets, true};
  accumulate(slot->grad_bt, slot->out, grouped_matmul_weight_grad(cx, u, dy, g));  // dBT_e += u_e^T dy_e
  const Tensor du = mul(cx, grouped_matmul(cx, dy, bt(), {offsets, true}), mask);
  accumulate(slot->grad_a, slot->in, grouped_matmul_weight_grad(cx, du, x, g));  // dA_e += du_e^T x_e
  dx = add(cx, dx, grouped_matmul(cx, du, a(), {offsets, false}));
}

MlpParams CausalLm::declare_mlp(int64_t layer, const std::string& prefix,
                                const std::function<int(std::string, Shape)>& add) {
  const ModelConfig& c = config_;
  if (mlps_.size() < size_t(c.num_layers)) mlps_.resize(size_t(c.num_layers));
  MlpParams& p = mlps_.at(size_t(layer));
  p = MlpParams{};
  p.sparse = c.sparse_layer(layer);
  if (!p.sparse) {
    p.gate = add(prefix + "mlp.gate_proj.weight", {c.intermediate_size, c.hidden_size});
    p.up = add(prefix + "mlp.up_proj.weight", {c.intermediate_size, c.hidden_size});
    p.down = add(prefix + "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size});
    return p;
  }
  const int64_t e = c.num_experts, in = c.moe_intermediate_size, is = c.shared_expert_intermediate_size;
  const int64_t mine = e / ep_size();  // expert parallelism: this rank's experts
  p.moe.router = add(prefix + "mlp.gate.weight", {e, c.hidden_size});
  p.moe.gate_up = add(prefix + "mlp.experts.gate_up_proj", {mine, 2 * in, c.hidden_size});
  p.moe.down = add(prefix + "mlp.experts.down_proj", {mine, c.hidden_size, in});
  if (is > 0) {
    p.moe.shared_gate = add(prefix + "mlp.shared_expert.gate_proj.weight", {is, c.hidden_size});
    p.moe.shared_up = add(prefix + "mlp.shared_expert.up_proj.weight", {is, c.hidden_size});
    p.moe.shared_down = add(prefix + "mlp.shared_expert.down_proj.weight", {c.hidden_size, is});
    p.moe.shared_gate_w = add(prefix + "mlp.shared_expert_gate.weight", {1, c.hidden_size});
  }
  return p;
}

void CausalLm::shard_experts() {
  for (const MlpParams& p : mlps_)
    if (p.sparse) {
      shard_over_ep(p.moe.gate_up);
      shard_over_ep(p.moe.down);
    }
}

void CausalLm::pack_mlp_rows() {
  for (const MlpParams& p : mlps_) {
    if (!p.sparse && p.gate >= 0) pack_rows({p.gate, p.up});
    else if (p.sparse && p.moe.shared_gate >= 0) pack_rows({p.moe.shared_gate, p.moe.shared_up});
  }
}

MlpActs CausalLm::mlp_forward(int64_t layer, const MlpParams& p, const Tensor& hn, const PackedBatch& b,
                              bool training) {
  MlpActs a;
  if (p.sparse) {  // whole on every rank of a tp group: the stream's rows (sp) of its output
    // Under cp the rank's rows of the batch are routed, the padding rows after its end left out (a zero output).
    const int64_t real = context_parallel() ? cp_real_rows(b) : hn.size(0);
    // Under ep every rank takes part in the layer's exchanges with rows of its own: a batch too short to give the
    // last cp rank one is refused on every rank alike (they share the batch).
    LATHE_CHECK(!expert_parallel() || !context_parallel() || b.tokens() > (cp_size() - 1) * block_tokens(b),
                "moe: a batch of {} tokens leaves context-parallel rank {} without rows, which expert parallelism "
                "cannot route: give micro-batches of at least {} tokens", b.tokens(), cp_size() - 1,
                (cp_size() - 1) * block_tokens(b) + 1);
    if (real > 0) a.moe = moe_forward(layer, p.moe, hn.narrow(0, 0, real), b, training);
    a.out = sp_rows(zero_padded_rows(real > 0 ? a.moe.out : hn.narrow(0, 0, 0), hn.size(0)));
    return a;
  }
  ExecContext cx = ctx();
  a.gu = project_rows(layer, {LoraTarget::gate_proj, LoraTarget::up_proj}, {p.gate, p.up}, hn, b, training);
  a.act = swiglu_halves(cx, a.gu);
  // tensor parallelism: every rank's intermediate columns summed (onto the stream's rows under sp)
  a.out = block_output(project(layer, LoraTarget::down_proj, p.down, a.act, b, training));
  return a;
}

Tensor CausalLm::mlp_backward(int64_t layer, const MlpParams& p, const Tensor& hn, const MlpActs& a, const Tensor& dout,
                              const PackedBatch& b) {
  const Tensor d = block_input(dout, hn.size(0));  // sequence parallelism: every rank's rows of the stream
  if (p.sparse) {  // the rows mlp_forward routed (under cp the padding rows after the batch get no gradient)
    const int64_t real = context_parallel() ? cp_real_rows(b) : d.size(0);
    if (real > 0)
      return sp_rows(zero_padded_rows(moe_backward(layer, p.moe, a.moe, d.narrow(0, 0, real), b), d.size(0)));
    // No row of the batch: the layer's gradients are zero here (defined, as on the other ranks, for the group's sum).
    for (int index : {p.moe.router, p.moe.gate_up, p.moe.down, p.moe.shared_gate, p.moe.shared_up, p.moe.shared_down,
                      p.moe.shared_gate_w})
      if (index >= 0) add_grad(index, zeros_like(w(index)));
    return sp_rows(zero_padded_rows(d.narrow(0, 0, 0), d.size(0)));
  }
  ExecContext cx = ctx();
  Tensor dact, dhn;  // out = down(swiglu(gate(hn), up(hn)))
  project_backward(layer, LoraTarget::down_proj, p.down, a.act, d, dact, b);
  project_rows_backward(layer, {LoraTarget::gate_proj, LoraTarget::up_proj}, {p.gate, p.up}, hn,
                        swiglu_halves_backward(cx, a.gu, dact), dhn, b);
  return block_output(dhn);
}

bool CausalLm::routes_on_device(int64_t layer, const PackedBatch& b, bool training) const {
  if (!b.cache || training || expert_parallel()) return false;
  // A decoding step only (one token a sequence): grouped_matmul_routed's kernel is built for few rows per expert, and
  // a prefill chunk's thousands of rows go to the grouped GEMM (tensor cores) after the host wait.
  if (b.tokens() != int64_t(b.host_cu.size()) - 1) return false;
  if (!lora_ || !b.adapted()) return true;
  return !lora_->slot(layer, LoraTarget::experts_gate_up) && !lora_->slot(layer, LoraTarget::experts_down);
}

bool CausalLm::groups_on_device(bool training) const {
  return training && !options_.moe_host_groups && !expert_parallel() && pp_size() == 1;
}

MoeRoute CausalLm::make_route(const MoeParams& p, const Tensor& x, RouteRead read) {
  MoeRoute r;
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = x.size(0), e = c.num_experts, k = c.num_experts_per_tok;
  // The logits in the model dtype (transformers' F.linear), routed in f32 (transformers' fp32 router; f64 in an f64
  // model) where they are: the moe_route op.
  const DType rd = routing_dtype();
  const MoeRouting m = moe_route(cx, cast(cx, linear(cx, x, w(p.router)), rd), {k, c.norm_topk_prob});
  r.token_ids = m.token;
  r.position_ids = m.position;
  r.pair_ids = m.pair;
  r.weights = cast(cx, m.weights, options_.dtype);
  r.probs = m.probs;
  r.picked_ids = m.picked.view({t * k});
  r.picked_w = m.weights;
  r.inv_sum = m.inv_sum;
  if (read != RouteRead::now) {
    // A decoding step does not look for a non-finite router logit (its token's logits are not finite either); a
    // training step's check comes with its aux loss and loads, once the batch's backward is queued.
    r.device_offsets = m.offsets;
    r.decoding = read == RouteRead::never;
    if (read == RouteRead::at_batch_end) r.sums = sum(cx, m.probs, {0});
    r.valid = true;
    return r;
  }
  const Tensor sums = sum(cx, m.probs, {0});  // (E), queued before the wait below
  // The one wait of the layer: the grouped GEMMs take their groups on the host. Under expert parallelism the wait is
  // for every rank's plan offsets and message lengths (moe_ep_messages' summary, all-gathered), so that the exchange is
  // planned from counts alone (plan_expert_exchange).
  MoeEpMessages messages;
  const Tensor host = expert_parallel() ? gather_ep_summaries(m, messages) : rt_->copy_to(m.offsets, Device::cpu());
  const int32_t* off = expert_parallel() ? GroupCounts{host.data<int32_t>(), e, ep_size()}.of(ep_rank())
                                          : host.data<int32_t>();
  LATHE_CHECK(off[e + 1] < 0, "moe: router logit of token {} is not finite (a layer's router produced NaN or Inf)",
              off[e + 1]);
  r.offsets.assign(off, off + e + 1);
  r.totals.tokens = t;
  for (int64_t i = 0; i < e; ++i) r.totals.counts.push_back(r.offsets[size_t(i + 1)] - r.offsets[size_t(i)]);
  const Tensor host_sums = rt_->copy_to(sums, Device::cpu());
  for (int64_t i = 0; i < e; ++i)
    r.totals.prob_sums.push_back(load_as_double(host_sums.data_ptr(), host_sums.dtype(), i));
  // The batched expert GEMMs when padding every expert to the largest count wastes little (ModelOptions).
  int64_t most = 0;
  for (int64_t n : r.totals.counts) most = std::max(most, n);
  const int64_t rows = (most + 7) / 8 * 8, pairs = t * k;
  if (pairs > 0 && !expert_parallel() && double(e * rows) <= options_.moe_padded_max_waste * double(pairs)) {
    const MoePadPlan pad = moe_pad_plan(cx, m.offsets, m.pair, {rows, k});
    r.pad_rows = rows;
    r.pad_token = pad.token;
    r.pad_pair = pad.pair;
    r.pad_position = pad.position;
  }
  if (expert_parallel()) plan_expert_exchange(r, messages, host.data<int32_t>());
  r.valid = true;
  return r;
}

Tensor CausalLm::gather_ep_summaries(const MoeRouting& m, MoeEpMessages& messages) const {
  ExecContext cx = rt_->context(options_.device);
  const int64_t n = ep_size(), e = global_config_.num_experts;
  messages = moe_ep_messages(cx, m.picked, m.offsets, n);
  Tensor all = Tensor::empty({n * messages.summary.numel()}, DType::I32, cx.allocator);
  options_.ep->all_gather(messages.summary, all).wait();
  Tensor host = rt_->copy_to(all, Device::cpu());
  const GroupCounts c{host.data<int32_t>(), e, n};
  for (int64_t j = 0; j < n; ++j)  // every rank refuses a bad batch together: none waits for the others
    LATHE_CHECK(c.bad_token(j) < 0, "moe: router logit of token {} on expert-parallel rank {} is not finite (a layer's "
                "router produced NaN or Inf)", c.bad_token(j), j);
  return host;
}

namespace {

// Row counts as element counts of rows `width` wide.
std::vector<int64_t> elements(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out(rows);
  for (int64_t& n : out) n *= width;
  return out;
}

int64_t total_of(const std::vector<int64_t>& counts) {
  int64_t sum = 0;
  for (int64_t n : counts) sum += n;
  return sum;
}

}  // namespace

// From the ep group's counts alone (O(E n) on the host, after the route's wait): the counts of the all-to-alls, the
// received pairs' groups by local expert, and the bases of the device's tables (moe_ep_slots, moe_ep_regroup); then,
// on the device, the row orders between the received pair layout (by sending rank, each rank's pairs of this rank's
// experts in expert order) and the grouped one (by local expert, then sending rank) the GEMMs take, and each token's
// pairs' grouped rows there and their weights, sent with the token (S + S values a token sent); the experts' rank
// inverts them to each grouped pair's token and weight (moe_ep_sources).
void CausalLm::plan_expert_exchange(MoeRoute& r, const MoeEpMessages& messages, const int32_t* gathered) const {
  ExecContext cx = rt_->context(options_.device);
  const int64_t n = ep_size(), me = ep_rank(), e = global_config_.num_experts, mine = e / n, t = r.totals.tokens;
  const int64_t k = config_.num_experts_per_tok, pairs = r.offsets.back();
  const GroupCounts c{gathered, e, n};
  r.ep_send.assign(size_t(n), 0);
  r.ep_recv.assign(size_t(n), 0);
  r.ep_token_send.assign(size_t(n), 0);
  r.ep_token_recv.assign(size_t(n), 0);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t x = 0; x < mine; ++x) {
      r.ep_send[size_t(j)] += c.pairs(me, j * mine + x);  // my pairs of rank j's experts
      r.ep_recv[size_t(j)] += c.pairs(j, me * mine + x);  // rank j's pairs of mine
    }
    r.ep_token_send[size_t(j)] = c.tokens(me, j);
    r.ep_token_recv[size_t(j)] = c.tokens(j, me);
  }
  // One table, uploaded once: moe_ep_slots' bases (E), then moe_ep_regroup's blocks (2 B + 1, B = n mine).
  // bases[f]: where my pairs of expert f (on rank j, local x) start in rank j's grouped layout, less offsets[f].
  // blocks: where sender j's pairs of local expert x start in the received layout, then in the grouped one.
  const DType xd = options_.dtype == DType::F64 ? DType::F64 : DType::F32;  // the values' transport dtype
  const int64_t b = n * mine;
  std::vector<int32_t> table(size_t(e + 2 * b + 1), 0);
  for (int64_t j = 0; j < n; ++j) {
    int64_t first_row = 0;  // where local expert x's group starts on rank j (its pairs from every rank)
    for (int64_t x = 0; x < mine; ++x) {
      const int64_t f = j * mine + x;
      int64_t row = first_row;
      for (int64_t i = 0; i < me; ++i) row += c.pairs(i, f);
      table[size_t(f)] = int32_t(row - r.offsets[size_t(f)]);
      for (int64_t i = 0; i < n; ++i) first_row += c.pairs(i, f);
    }
    LATHE_CHECK(xd == DType::F64 || first_row <= (int64_t(1) << 24),
                "moe: expert-parallel rank {} would receive more than 2^24 pairs in one layer", j);
  }
  int32_t* blocks = table.data() + e;
  int64_t at = 0;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t x = 0; x < mine; ++x) {
      blocks[j * mine + x] = int32_t(at);
      at += c.pairs(j, me * mine + x);
    }
  blocks[b] = int32_t(at);
  r.ep_offsets = {0};
  int64_t grouped = 0;
  for (int64_t x = 0; x < mine; ++x) {
    for (int64_t j = 0; j < n; ++j) {
      blocks[b + 1 + j * mine + x] = int32_t(grouped);
      grouped += c.pairs(j, me * mine + x);
    }
    r.ep_offsets.push_back(grouped);
  }
  const Tensor tables = rt_->upload(table.data(), {int64_t(table.size())}, DType::I32, options_.device);
  const MoeEpRegroup regroup = moe_ep_regroup(cx, tables.narrow(0, e, 2 * b + 1), at);
  r.ep_grouped = regroup.grouped;
  r.ep_received = regroup.received;
  const int64_t sent = total_of(r.ep_token_send);
  r.ep_tokens = messages.tokens.narrow(0, 0, sent);
  r.ep_back = messages.back;
  r.ep_back_ones = ones(t, n);
  const MoeEpSlots slots = moe_ep_slots(cx, r.picked_ids.view({t, k}), r.position_ids, messages.back,
                                        tables.narrow(0, 0, e));

  // By token sent: its pairs' grouped rows there and their weights, S + S values exact in the transport dtype (f32
  // holds integers to 2^24; f64 in an f64 model).
  const int64_t s = slots.slot_row.size(1);
  const Tensor weights = embedding(cx, r.weights.view({pairs, 1}), r.pair_ids);  // (P, 1), the route's pair order
  Tensor per_token = Tensor::empty({sent, 2 * s}, xd, cx.allocator);
  copy_into(cx, slots.slot_row.narrow(0, 0, sent), per_token.narrow(1, 0, s));
  const Tensor slot_ids = contiguous(cx, slots.slot_pair.narrow(0, 0, sent)).view({sent * s});
  copy_into(cx, embedding(cx, weights, slot_ids).view({sent, s}), per_token.narrow(1, s, s));
  const int64_t got = total_of(r.ep_token_recv);
  Tensor token_values = Tensor::empty({got, 2 * s}, xd, cx.allocator);
  Tensor flat = token_values.view({got * 2 * s});
  options_.ep->all_to_all(per_token.view({per_token.numel()}), elements(r.ep_token_send, 2 * s), flat,
                          elements(r.ep_token_recv, 2 * s));
  r.ep_pairs = cast(cx, token_values.narrow(1, 0, s), DType::I32);
  r.ep_pair_weights = cast(cx, token_values.narrow(1, s, s), options_.dtype);
  r.ep_pair_ones = ones(got, s);
  // Each grouped pair's token among those received and its weight, from the slots that name it.
  const MoeEpSources sources = moe_ep_sources(cx, r.ep_pairs, at);
  r.ep_unique = sources.token;
  r.ep_weights = at > 0 ? embedding(cx, r.ep_pair_weights.view({got * s, 1}), sources.slot)
                        : Tensor::empty({0, 1}, options_.dtype, cx.allocator);
}

Tensor CausalLm::to_expert_ranks(const MoeRoute& r, const Tensor& rows) const {
  ExecContext cx = rt_->context(options_.device);
  const int64_t d = rows.size(1), got = r.ep_offsets.back();
  Tensor received = Tensor::empty({got, d}, rows.dtype(), cx.allocator);
  Tensor flat = received.view({got * d});
  options_.ep->all_to_all(contiguous(cx, rows).view({rows.numel()}), elements(r.ep_send, d), flat,
                          elements(r.ep_recv, d));
  return got > 0 ? embedding(cx, received, r.ep_grouped) : received;
}

Tensor CausalLm::from_expert_ranks(const MoeRoute& r, const Tensor& rows) const {
  ExecContext cx = rt_->context(options_.device);
  const int64_t d = rows.size(1), back = total_of(r.ep_send);
  const Tensor received = rows.size(0) > 0 ? embedding(cx, rows, r.ep_received) : rows;
  Tensor out = Tensor::empty({back, d}, rows.dtype(), cx.allocator);
  Tensor flat = out.view({back * d});
  options_.ep->all_to_all(contiguous(cx, received).view({received.numel()}), elements(r.ep_recv, d), flat,
                          elements(r.ep_send, d));
  return out;
}

Tensor CausalLm::ones(int64_t rows, int64_t cols) const {
  const int64_t n = rows * cols;
  const int64_t have = ones_.defined() ? ones_.numel() : 0;
  if (!ones_.defined() || have < n) {
    ExecContext cx = rt_->context(options_.device);
    const std::vector<double> host(static_cast<size_t>(std::max<int64_t>({n, 2 * have, 1})), 1.0);
    ones_ = cast(cx, rt_->upload(host.data(), {int64_t(host.size())}, DType::F64, options_.device), options_.dtype);
  }
  return ones_.narrow(0, 0, n).view({rows, cols});
}

Tensor CausalLm::tokens_to_experts(const MoeRoute& r, const Tensor& rows) const {
  ExecContext cx = rt_->context(options_.device);
  const int64_t d = rows.size(1), sent = r.ep_tokens.numel(), got = total_of(r.ep_token_recv);
  const Tensor out = sent > 0 ? embedding(cx, rows, r.ep_tokens) : Tensor::empty({0, d}, rows.dtype(), cx.allocator);
  Tensor received = Tensor::empty({got, d}, rows.dtype(), cx.allocator);
  Tensor flat = received.view({got * d});
  options_.ep->all_to_all(out.view({sent * d}), elements(r.ep_token_send, d), flat, elements(r.ep_token_recv, d));
  return received;
}

Tensor CausalLm::expert_pairs(const MoeRoute& r, const Tensor& received) const {
  ExecContext cx = rt_->context(options_.device);
  const int64_t pairs = r.ep_offsets.back();
  return pairs > 0 ? embedding(cx, received, r.ep_unique)
                   : Tensor::empty({0, received.size(1)}, received.dtype(), cx.allocator);
}

Tensor CausalLm::experts_to_tokens(const MoeRoute& r, const Tensor& rows, const Tensor& weights) const {
  ExecContext cx = rt_->context(options_.device);
  const int64_t d = rows.size(1), sent = r.ep_tokens.numel(), got = total_of(r.ep_token_recv);
  const Tensor sums = gather_sum(cx, rows, r.ep_pairs, weights);  // (received tokens, D)
  Tensor back = Tensor::empty({sent, d}, rows.dtype(), cx.allocator);
  Tensor flat = back.view({sent * d});
  options_.ep->all_to_all(sums.view({got * d}), elements(r.ep_token_recv, d), flat, elements(r.ep_token_send, d));
  return gather_sum(cx, back, r.ep_back, r.ep_back_ones);
}

void CausalLm::prepare_moe_backward(MoeRoute& r) {
  if (r.ones.defined()) return;  // once per batch and layer (a recomputing backward reuses it)
  r.ones = ones(r.weights.size(0), r.weights.size(1)).view({r.weights.size(0), 1, r.weights.size(1)});
}

ExpertLora CausalLm::expert_lora(int64_t layer, LoraTarget t, const PackedBatch* b, const MoeRoute& r) {
  ExpertLora e;
  if (!lora_ || !b || !b->adapted()) return e;
  e.slot = lora_->slot(layer, t);
  if (!e.slot) return e;
  LATHE_CHECK(!b->segments.empty(), "model: adapters on the experts of layer {} need the batch's segments (its rows "
              "by adapter on the host), not row_adapters", layer);
  // Each token's scaled adapter columns (the segment mask of a (T, R) of ones), gathered to the routed rows.
  ExecContext cx = ctx();
  const int64_t tokens = int64_t(r.weights.size(0)), rank = e.slot->rank_total;  // the routed rows
  e.mask = embedding(cx, segment_mask(cx, ones(tokens, rank), stack_segments(*e.slot, *b, false, tokens)), r.token_ids);
  if (expert_parallel()) {  // the mask goes with the rows to their experts' ranks; the slot's local experts are used
    e.mask = to_expert_ranks(r, e.mask);
    e.count = global_config_.num_experts / ep_size();
    e.first = ep_rank() * e.count;
  }
  return e;
}

MoeActs CausalLm::moe_forward(int64_t layer, const MoeParams& p, const Tensor& x, const PackedBatch& b,
                              bool training) {
  LATHE_CHECK(x.size(0) > 0, "model: a mixture-of-experts layer needs at least one token");
  // A decoding step's route is not kept: no backward reads it, and a recorded step's tensors come from the graphs'
  // allocator, which the model's cache would outlive (rollout_engine.cpp, FixedSteps).
  if (routes_on_device(layer, b, training)) {
    MoeRoute route = make_route(p, x, RouteRead::never);
    return moe_apply(layer, route, p, x, &b, training);
  }
  MoeRoute& r = moe_routes_.at(size_t(layer));
  if (!r.valid) r = make_route(p, x, groups_on_device(training) ? RouteRead::at_batch_end : RouteRead::now);
  return moe_apply(layer, r, p, x, &b, training);
}

MoeActs CausalLm::moe_apply(int64_t layer, MoeRoute& r, const MoeParams& p, const Tensor& x,
                            const PackedBatch* b, bool training) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  const int64_t t = x.size(0), d = x.size(1), k = c.num_experts_per_tok;
  MoeActs a;
  a.x = x;
  a.lora_gate_up = expert_lora(layer, LoraTarget::experts_gate_up, b, r);
  a.lora_down = expert_lora(layer, LoraTarget::experts_down, b, r);
  a.padded = r.pad_rows > 0 && !a.lora_gate_up.slot && !a.lora_down.slot;
  if (a.padded) {  // (E, M, .) blocks, one batched GEMM each (padding rows hold token 0's row; never read back)
    const int64_t e = c.num_experts, m = r.pad_rows, in = c.moe_intermediate_size;
    a.xs = embedding(cx, x, r.pad_token);  // (E M, D)
    a.gu = matmul(cx, a.xs.view({e, m, d}), w(p.gate_up), {false, true}).view({e * m, 2 * in});
    a.act = swiglu_halves(cx, a.gu);
    const Tensor yd = matmul(cx, a.act.view({e, m, in}), w(p.down), {false, true}).view({e * m, d});
    a.picked = embedding(cx, yd, r.pad_position).view({t, k, d});
  } else {
    // Expert parallelism: each token goes once to every rank holding one of its experts, becomes that rank's pairs
    // there (grouped by local expert: the GEMMs run over this rank's experts' pairs from every rank), and comes back
    // as the weighted sum of those pairs' outputs.
    a.xs = expert_parallel() ? expert_pairs(r, tokens_to_experts(r, x)) : embedding(cx, x, r.token_ids);
    a.gu = expert_matmul(r, a.xs, w(p.gate_up), true);  // (P, 2I): [gate | up] per row, one grouped GEMM
    if (a.lora_gate_up.slot) a.lora_gate_up.forward(cx, a.xs, expert_groups(r), a.gu);
    a.act = swiglu_halves(cx, a.gu);
    Tensor yd = expert_matmul(r, a.act, w(p.down), true);  // (P, D)
    if (a.lora_down.slot) a.lora_down.forward(cx, a.act, expert_groups(r), yd);
    if (expert_parallel()) {
      a.yd = yd;
      a.out = experts_to_tokens(r, yd, r.ep_pair_weights);
    } else {
      a.picked = embedding(cx, yd, r.position_ids).view({t, k, d});
    }
  }
  if (a.picked.defined())
    a.out = matmul(cx, r.weights.view({t, 1, k}), a.picked).view({t, d});  // sum_j weights[t, j] picked[t, j]
  if (p.shared_gate >= 0) {  // + sigmoid(x Wg^T) * shared_expert(x), its projections adapted as modules when batched
    const PackedBatch none;  // decoding: no adapters (merged)
    a.sh_gu = project_rows(layer, {LoraTarget::shared_gate_proj, LoraTarget::shared_up_proj},
                           {p.shared_gate, p.shared_up}, x, b ? *b : none, training);
    a.sh_act = swiglu_halves(cx, a.sh_gu);
    a.sh_y = b ? project(layer, LoraTarget::shared_down_proj, p.shared_down, a.sh_act, *b, training)
               : linear(cx, a.sh_act, w(p.shared_down));
    a.sh_sig = sigmoid(cx, linear(cx, x, w(p.shared_gate_w)));
    a.out = add(cx, a.out, mul(cx, a.sh_y, a.sh_sig));
  }
  return a;
}

Tensor CausalLm::moe_backward(int64_t layer, const MoeParams& p, const MoeActs& a, const Tensor& dout,
                              const PackedBatch& b) {
  ExecContext cx = ctx();
  const ModelConfig& c = config_;
  MoeRoute& r = moe_routes_.at(size_t(layer));
  LATHE_ASSERT(r.valid);
  prepare_moe_backward(r);
  const int64_t t = dout.size(0), d = dout.size(1), k = c.num_experts_per_tok;
  const bool train = options_.train_base;
  // Combine: out[t] = weights[t] (1, k) picked[t] (k, D), a batched product (under ep: on the experts' ranks).
  Tensor dweights;
  if (!expert_parallel()) dweights = matmul(cx, a.picked, dout.view({t, d, 1})).view({t, k});
  // Each (P, .) temporary below is dropped after its last use, not at the end of the scope: at the step's peak (the
  // first layer's backward, every other gradient alive) that keeps about 300 MiB fewer of them alive at the
  // 30B-A3B shape (docs/benchmarks.md, session 13).
  Tensor dx;
  if (a.padded) {  // the batched GEMMs of (E, M, .) blocks; padding rows take the zero row after the T k pairs
    const int64_t e = c.num_experts, m = r.pad_rows, in = c.moe_intermediate_size;
    Tensor dpicked = Tensor::empty({t * k + 1, d}, dout.dtype(), cx.allocator);
    cx.backend.fill_bytes(dpicked.narrow(0, t * k, 1).data_ptr(), 0, size_t(d) * dtype_size(dout.dtype()), cx.stream);
    Tensor dpicked_pairs = dpicked.narrow(0, 0, t * k).view({t, k, d});
    matmul_into(cx, r.weights.view({t, k, 1}), dout.view({t, 1, d}), dpicked_pairs, {});
    dpicked_pairs = Tensor();
    Tensor dyd = embedding(cx, dpicked, r.pad_pair).view({e, m, d});  // (E, M, D), zero padding rows
    dpicked = Tensor();
    Tensor dact = matmul(cx, dyd, w(p.down)).view({e * m, in});
    if (train) add_expert_grad(p.down, dyd, a.act.view({e, m, in}), nullptr);  // dyd_e^T act_e
    dyd = Tensor();
    Tensor dgate_up = swiglu_halves_backward(cx, a.gu, dact).view({e, m, 2 * in});
    dact = Tensor();
    if (train) add_expert_grad(p.gate_up, dgate_up, a.xs.view({e, m, d}), nullptr);
    const Tensor dxs = matmul(cx, dgate_up, w(p.gate_up)).view({e * m, d});
    dgate_up = Tensor();
    dx = matmul(cx, r.ones, embedding(cx, dxs, r.pad_position).view({t, k, d})).view({t, d});
  } else {
    Tensor dyd;  // (P, D), expert order
    if (expert_parallel()) {  // dout to the experts' ranks as the tokens went; each pair's weight is there
      const Tensor received = tokens_to_experts(r, dout);
      const Tensor dpair = expert_pairs(r, received);  // (R, D)
      const int64_t rows = dpair.size(0);
      const Tensor dw_pairs = matmul(cx, a.yd.view({rows, 1, d}), dpair.view({rows, d, 1})).view({rows, 1});
      dweights = embedding(cx, from_expert_ranks(r, dw_pairs), r.position_ids).view({t, k});
      dyd = gather_sum(cx, received, r.ep_unique.view({rows, 1}), r.ep_weights);  // weight x the token's gradient
    } else {
      Tensor dpicked = matmul(cx, r.weights.view({t, k, 1}), dout.view({t, 1, d}));  // (T, k, D)
      dyd = embedding(cx, dpicked.view({t * k, d}), r.pair_ids);
    }
    // Experts: yd = grouped(act, down), act = swiglu(gate, up), [gate | up] = grouped(xs, gate_up).
    Tensor dact = expert_matmul(r, dyd, w(p.down), false);  // (P, I)
    if (train) add_expert_grad(p.down, dyd, a.act, &r);
    if (a.lora_down.slot) a.lora_down.backward(cx, a.act, dyd, expert_groups(r), dact);
    dyd = Tensor();
    Tensor dgate_up = swiglu_halves_backward(cx, a.gu, dact);  // (P, 2I), [gate | up] per row
    dact = Tensor();
    if (train) add_expert_grad(p.gate_up, dgate_up, a.xs, &r);
    Tensor dxs = expert_matmul(r, dgate_up, w(p.gate_up), false);  // (P, D)
    if (a.lora_gate_up.slot) a.lora_gate_up.backward(cx, a.xs, dgate_up, expert_groups(r), dxs);
    dgate_up = Tensor();
    // Each token's k rows summed in a fixed order (a batched product with ones; under ep per rank, then over them).
    if (expert_parallel()) dx = experts_to_tokens(r, dxs, r.ep_pair_ones);
    else dx = matmul(cx, r.ones, embedding(cx, dxs, r.position_ids).view({t, k, d})).view({t, d});
  }
  // Router, on the device in the routing dtype (route_tokens_backward's formulas): d(probs) at the picked experts,
  // through the renormalisation when norm_topk_prob (dp_j = (dw_j - sum_i dw_i w_i) / S), scattered into (T, E) (the k
  // experts of a token are distinct: no two writes meet), plus the aux term, then through the softmax.
  Tensor dpk = cast(cx, dweights, routing_dtype());  // (T, k)
  if (c.norm_topk_prob) {
    const Tensor dot = sum(cx, mul(cx, dpk, r.picked_w), {1}, true);  // (T, 1)
    dpk = mul(cx, add(cx, dpk, scale(cx, dot, -1.0)), r.inv_sum);
  }
  Tensor dp = embedding_backward(cx, dpk.view({t * k, 1}), r.picked_ids, t * c.num_experts).view({t, c.num_experts});
  if (r.d_aux.defined()) dp = add(cx, dp, r.d_aux);
  const Tensor dl = cast(cx, softmax_backward(cx, r.probs, dp), options_.dtype);
  matmul_into(cx, dl, w(p.router), dx, {false, false, 1.0f, 1.0f});
  add_linear_grad(p.router, dl, a.x);
  if (p.shared_gate >= 0) {  // out += sh_y * sigmoid(x Wg^T)
    const Tensor dsh_y = mul(cx, dout, a.sh_sig);
    const Tensor dgate_logit = sigmoid_backward(cx, a.sh_sig, sum(cx, mul(cx, dout, a.sh_y), {1}, true));  // (T, 1)
    matmul_into(cx, dgate_logit, w(p.shared_gate_w), dx, {false, false, 1.0f, 1.0f});
    add_linear_grad(p.shared_gate_w, dgate_logit, a.x);
    Tensor dsh_act;
    project_backward(layer, LoraTarget::shared_down_proj, p.shared_down, a.sh_act, dsh_y, dsh_act, b);
    project_rows_backward(layer, {LoraTarget::shared_gate_proj, LoraTarget::shared_up_proj},
                          {p.shared_gate, p.shared_up}, a.x, swiglu_halves_backward(cx, a.sh_gu, dsh_act), dx, b);
  }
  return dx;
}

Tensor CausalLm::expert_matmul(MoeRoute& r, const Tensor& x, const Tensor& w, bool trans_w) {
  ExecContext cx = ctx();
  Tensor y;
  if (r.device_offsets.defined() && try_grouped_matmul_routed(cx, x, w, r.device_offsets, trans_w, r.decoding, y))
    return y;
  return grouped_matmul(cx, x, w, {expert_groups(r), trans_w});
}

const std::vector<int64_t>& CausalLm::expert_groups(MoeRoute& r) {
  if (expert_parallel()) return r.ep_offsets;
  if (r.offsets.empty()) {  // left on the device: read once, for the GEMMs no kernel takes with device groups
    LATHE_ASSERT(r.device_offsets.defined());
    const Tensor host = rt_->copy_to(r.device_offsets, Device::cpu());
    r.offsets.assign(host.data<int32_t>(), host.data<int32_t>() + config_.num_experts + 1);
  }
  return r.offsets;
}

void CausalLm::add_expert_grad(int index, const Tensor& dy, const Tensor& x, MoeRoute* r) {
  if (!options_.train_base) return;
  ExecContext cx = ctx();
  Tensor& grad = params_[size_t(index)].grad;
  const bool in_place = grad.defined() && grad.is_contiguous() && grad.dtype() == dy.dtype();
  if (!r) {  // the padded form: (E, M, N) and (E, M, K) blocks, one batched GEMM
    if (in_place) matmul_into(cx, dy, x, grad, {true, false, 1.0f, 1.0f});
    else add_grad(index, matmul(cx, dy, x, {true, false}));
    return;
  }
  if (r->device_offsets.defined()) {  // the groups on the device, where a kernel reads them there
    if (in_place && try_grouped_matmul_weight_grad_routed_into(cx, dy, x, r->device_offsets, grad, true)) return;
    if (!in_place) {
      const Tensor fresh =
          Tensor::empty({params_[size_t(index)].value.size(0), dy.size(1), x.size(1)}, dy.dtype(), cx.allocator);
      if (try_grouped_matmul_weight_grad_routed_into(cx, dy, x, r->device_offsets, fresh, false)) {
        add_grad(index, fresh);
        return;
      }
    }
  }
  GroupedMatmulAttrs groups{expert_groups(*r), true};
  if (!in_place) {
    add_grad(index, grouped_matmul_weight_grad(cx, dy, x, groups));
    return;
  }
  groups.accumulate = true;
  grouped_matmul_weight_grad_into(cx, dy, x, grad, groups);
}

void CausalLm::moe_after_forward(LossResult& res, bool backward, double loss_scale) {
  std::vector<RoutingTotals> totals;
  std::vector<int64_t> layers;
  std::vector<MoeRoute*> routes, by_layer;  // by_layer: each of `layers`' route, nullptr for an unrouted part
  for (size_t l = 0; l < moe_routes_.size(); ++l) {
    MoeRoute& r = moe_routes_[l];
    // Under cp every sparse layer takes part in the sum below, also on a rank whose rows are all padding (no route).
    const bool unrouted_part = context_parallel() && mlps_[l].sparse && !r.valid;
    if (!r.valid && !unrouted_part) continue;
    const size_t e = size_t(config_.num_experts);
    totals.push_back(r.valid ? r.totals : RoutingTotals{0, std::vector<int64_t>(e, 0), std::vector<double>(e, 0.0)});
    layers.push_back(int64_t(l));
    if (r.valid) routes.push_back(&r);
    by_layer.push_back(r.valid ? &r : nullptr);
  }
  if (totals.empty()) return;
  // Groups on the device: every route alike, on every rank of a cp group alike (groups_on_device; a backward's
  // forward is a training one).
  if (groups_on_device(backward)) {
    aux_on_device(layers, by_layer, backward, loss_scale);
    return;
  }
  // The aux loss and the loads are the whole batch's, not the rows' (cp), or the group's batches' (ep).
  if (Communicator* g = routing_group()) sum_totals_over(*g, totals);
  const Tensor d_aux = aux_from_totals(res, layers, totals, backward, loss_scale);
  if (d_aux.defined())
    for (MoeRoute* r : routes) r->d_aux = d_aux;
}

void CausalLm::aux_on_device(const std::vector<int64_t>& layers, const std::vector<MoeRoute*>& routes, bool backward,
                             double loss_scale) {
  ExecContext cx = ctx();
  const int64_t e = config_.num_experts, n_layers = int64_t(layers.size());
  const DType rd = routing_dtype();  // f32 (f64 in an f64 model): CUDA's arithmetic has no f64
  LATHE_ASSERT(routes.size() == layers.size());
  // One tensor in the routing dtype, summed over the cp group (each rank routes its rows of the batch): each layer's
  // pair counts per expert (L, E), its non-finite flag (L: moe_route's last offset, -1 when every logit is finite, else
  // a token index, so the group's sum exceeds -(ranks) exactly when some rank has a bad token), the probability sums
  // over the layers (E), then the aux loss (1), written after the sum. Counts and flags are exact in f32 below 2^24.
  const int64_t flags_at = n_layers * e, probs_at = flags_at + n_layers, aux_at = probs_at + e;
  Tensor values = zeros(cx, {aux_at + 1}, rd);
  // Each layer's offsets, this rank's (an error names its token): a cp rank without rows in a layer has all -1 there
  // (no pairs, every logit finite).
  Tensor offsets = Tensor::empty({n_layers, e + 2}, DType::I32, cx.allocator);
  for (int64_t i = 0; i < n_layers; ++i) {
    const Tensor row = offsets.narrow(0, i, 1).view({e + 2});
    if (const MoeRoute* r = routes[size_t(i)]) {
      copy_into(cx, r->device_offsets, row);
      const Tensor probs = values.narrow(0, probs_at, e);
      copy_into(cx, add(cx, probs, r->sums), probs);
    } else {
      cx.backend.fill_bytes(row.data_ptr(), 0xff, size_t(e + 2) * sizeof(int32_t), cx.stream);
    }
  }
  const Tensor off = cast(cx, offsets, rd);
  for (int64_t i = 0; i < n_layers; ++i) {
    const Tensor row = off.narrow(0, i, 1).view({e + 2});
    copy_into(cx, add(cx, row.narrow(0, 1, e), scale(cx, row.narrow(0, 0, e), -1.0)), values.narrow(0, i * e, e));
  }
  copy_into(cx, off.narrow(1, e + 1, 1), values.narrow(0, flags_at, n_layers).view({n_layers, 1}));
  if (Communicator* g = routing_group()) g->all_reduce(values).wait();  // ordered on the stream: no host wait
  // load_balancing_loss_totals' formulas over every layer's rows n, routed_e pairs and prob_e probability mass:
  // aux = E sum_e routed_e prob_e / n^2 and d aux / d probs[r, e] = E routed_e / n^2. Each layer routes each of the
  // batch's tokens once (under cp, once over the group).
  const Tensor routed = sum(cx, values.narrow(0, 0, flags_at).view({n_layers, e}), {0});
  const double n = double(n_layers) * double(batch_tokens_);
  const double unit = n > 0 ? double(e) / (n * n) : 0.0;
  copy_into(cx, scale(cx, sum(cx, mul(cx, routed, values.narrow(0, probs_at, e)), {0}, true), unit),
            values.narrow(0, aux_at, 1));
  moe_reads_ = {values, offsets, layers, routing_group() ? routing_group()->size() : 1};
  if (!backward || !aux_loss_on()) return;
  const Tensor d_aux = scale(cx, routed, unit * config_.router_aux_loss_coef * loss_scale).view({1, e});
  for (MoeRoute* r : routes)
    if (r) r->d_aux = d_aux;
}

void CausalLm::moe_read_routing(LossResult& res) {
  if (!moe_reads_.values.defined()) return;
  const PendingRoutingReads reads = std::move(moe_reads_);
  moe_reads_ = {};
  const Tensor host = rt_->copy_to(reads.values, Device::cpu());
  const auto value = [&](int64_t i) { return load_as_double(host.data_ptr(), host.dtype(), i); };
  const int64_t e = config_.num_experts, n_layers = int64_t(reads.layers.size());
  for (int64_t i = 0; i < n_layers; ++i) {
    if (value(n_layers * e + i) > -double(reads.ranks)) {  // a bad token here or (cp) on another rank: all refuse
      const Tensor mine = rt_->copy_to(reads.offsets, Device::cpu());
      const int32_t token = mine.data<int32_t>()[i * (e + 2) + e + 1];
      LATHE_CHECK(token < 0, "moe: router logit of token {} is not finite (layer {}'s router produced NaN or Inf)",
                  token, reads.layers[size_t(i)]);
      LATHE_FAIL("moe: a router logit on another context-parallel rank is not finite (layer {}'s router produced NaN "
                 "or Inf)", reads.layers[size_t(i)]);
    }
    std::vector<int64_t> counts;
    for (int64_t j = 0; j < e; ++j) counts.push_back(std::llround(value(i * e + j)));
    const ExpertLoad load = expert_load(counts);
    res.expert_load.push_back({reads.layers[size_t(i)], load.tokens_per_expert, load.max_over_mean});
  }
  res.aux_loss = value(n_layers * e + n_layers + e);
}

Tensor CausalLm::aux_from_totals(LossResult& res, const std::vector<int64_t>& layers,
                                 const std::vector<RoutingTotals>& totals, bool backward, double loss_scale) {
  for (size_t i = 0; i < totals.size(); ++i) {
    const ExpertLoad load = expert_load(totals[i].counts);
    res.expert_load.push_back({layers[i], load.tokens_per_expert, load.max_over_mean});
  }
  const bool grad = backward && aux_loss_on();
  std::vector<double> dp;
  res.aux_loss = load_balancing_loss_totals(totals, grad ? &dp : nullptr);
  if (!grad) return Tensor();
  // Under ep each rank differentiates the group's aux loss at its own rows; a rank's loss_scale is its share of a
  // mean over the group's batches (1 / ep of it for equal shares; cp ranks share a batch, so ep / cp batches under cp),
  // so the aux term takes that many times loss_scale, and the group's gradients sum to the aux loss's over all their
  // rows at the group's scale.
  const double batches = expert_parallel() ? double(ep_size()) / double(cp_size()) : 1.0;
  for (double& v : dp) v *= config_.router_aux_loss_coef * loss_scale * batches;
  ExecContext cx = ctx();
  return cast(cx, rt_->upload(dp.data(), {1, int64_t(dp.size())}, DType::F64, options_.device), routing_dtype());
}

namespace {

// Routing totals as flat f64 values, per layer: tokens, the counts, the probability sums (exact: the counts are whole
// numbers far below 2^53).
std::vector<double> flatten_totals(const std::vector<RoutingTotals>& totals) {
  std::vector<double> flat;
  for (const RoutingTotals& t : totals) {
    LATHE_ASSERT(t.prob_sums.size() == t.counts.size());
    flat.push_back(double(t.tokens));
    flat.insert(flat.end(), t.counts.begin(), t.counts.end());
    flat.insert(flat.end(), t.prob_sums.begin(), t.prob_sums.end());
  }
  return flat;
}

std::vector<RoutingTotals> unflatten_totals(const double* v, size_t layers, size_t experts) {
  std::vector<RoutingTotals> totals(layers,
                                    RoutingTotals{0, std::vector<int64_t>(experts), std::vector<double>(experts)});
  for (RoutingTotals& t : totals) {
    t.tokens = int64_t(std::llround(*v++));
    for (int64_t& n : t.counts) n = int64_t(std::llround(*v++));
    for (double& s : t.prob_sums) s = *v++;
  }
  return totals;
}

}  // namespace

// The ranks whose rows one aux loss covers: the cp group (one batch's rows), or the ep group (its ranks' batches; under
// cp too, ep being a multiple of cp, each of its batches whole); null without either.
Communicator* CausalLm::routing_group() const {
  if (expert_parallel()) return options_.ep;
  return context_parallel() ? options_.cp : nullptr;
}

void CausalLm::sum_totals_over(Communicator& group, std::vector<RoutingTotals>& totals) const {
  const std::vector<double> flat = flatten_totals(totals);  // per layer: tokens, counts, probability sums
  Tensor sums = rt_->from_host(flat.data(), {int64_t(flat.size())}, DType::F64, options_.device);
  group.all_reduce(sums).wait();
  const Tensor host = options_.device.is_cpu() ? sums : rt_->copy_to(sums, Device::cpu());
  if (!totals.empty()) totals = unflatten_totals(host.data<double>(), totals.size(), totals[0].counts.size());
}

std::vector<double> CausalLm::stage_routing_totals(const StageWork& work) {
  std::vector<RoutingTotals> totals = work.totals;
  if (totals.empty()) return {};
  if (Communicator* g = routing_group()) sum_totals_over(*g, totals);
  return flatten_totals(totals);
}

int64_t CausalLm::routing_totals_size(int stage) const {
  const PipelineLayout& pl = options_.pipeline;
  int64_t n = 0;
  for (int64_t l = 0; l < (stage < pl.stages() ? pl.first_layer(stage) : global_config_.num_layers); ++l)
    if (global_config_.sparse_layer(l)) n += 1 + 2 * global_config_.num_experts;
  return n;
}

Tensor CausalLm::aux_from_pipeline(LossResult& r, const std::vector<double>& flat, bool backward, double loss_scale) {
  std::vector<int64_t> layers;
  for (int64_t l = 0; l < global_config_.num_layers; ++l)
    if (global_config_.sparse_layer(l)) layers.push_back(l);
  if (layers.empty()) return Tensor();
  LATHE_ASSERT(int64_t(flat.size()) == routing_totals_size(options_.pipeline.stages()));
  return aux_from_totals(r, layers, unflatten_totals(flat.data(), layers.size(), size_t(global_config_.num_experts)),
                         backward, loss_scale);
}

std::set<std::string> CausalLm::read_parameters(const io::SafetensorsModel& st) {
  std::set<std::string> used;
  ExecContext cx = ctx();
  int64_t fused = 0, split = 0;
  // Staged on the host in f32 (exact for f32, bf16 and f16 checkpoints), in f64 for an f64 model.
  const DType host_dtype = options_.dtype == DType::F64 ? DType::F64 : DType::F32;
  const size_t elem = dtype_size(host_dtype);
  for (Parameter& p : params_) {
    std::vector<uint8_t> host(size_t(p.value.numel()) * elem);
    const io::SafetensorsTensor* t = st.find(p.name);
    if (t != nullptr || !is_fused_experts(p.name)) {
      LATHE_CHECK(t != nullptr, "model: {}: tensor '{}' is missing from the checkpoint", st.dir(), p.name);
      LATHE_CHECK(t->shape == p.global_shape(), "model: {}: tensor '{}' has shape {} but the config implies {}",
                  st.dir(), p.name, shape_str(t->shape), shape_str(p.global_shape()));
      if (p.whole()) st.read_into(p.name, host_dtype, host.data(), host.size());
      else  // a tp piece: only its boxes' bytes are read
        for (const PieceBox& box : piece_boxes(p.shard, p.value.shape())) {
          LATHE_CHECK(box.local_col == 0, "model: {}: a piece in column sections is not read here", p.name);
          const size_t at = size_t(box.local_row * (p.value.numel() / p.value.size(0))) * elem;
          st.read_box_into(p.name, {box.row, box.col}, {box.rows, box.cols}, host_dtype, host.data() + at,
                           size_t(box.rows * box.cols) * elem);
        }
      used.insert(p.name);
      fused += is_fused_experts(p.name);
    } else {  // the per-expert layout: experts.N.<part>.weight stacked along dim 1 of the fused (E, rows, cols)
      const std::vector<std::string> parts = expert_parts(p.name);
      const int64_t rows = p.value.size(1), cols = p.value.size(2), part_rows = rows / int64_t(parts.size());
      const int64_t first = p.whole() ? 0 : p.shard.offset[0];  // expert parallelism: this rank's experts
      for (int64_t e = 0; e < p.value.size(0); ++e)
        for (size_t i = 0; i < parts.size(); ++i) {
          const std::string name = per_expert_name(p.name, first + e, parts[i]);
          const io::SafetensorsTensor* pt = st.find(name);
          LATHE_CHECK(pt != nullptr, "model: {}: the checkpoint has neither '{}' (fused experts) nor '{}' (per-expert "
                      "layout)", st.dir(), p.name, name);
          LATHE_CHECK(pt->shape == Shape({part_rows, cols}), "model: {}: tensor '{}' has shape {} but the config "
                      "implies {}", st.dir(), name, shape_str(pt->shape), shape_str(Shape({part_rows, cols})));
          const int64_t at = (e * rows + int64_t(i) * part_rows) * cols;
          st.read_into(name, host_dtype, host.data() + size_t(at) * elem, size_t(part_rows * cols) * elem);
          used.insert(name);
        }
      ++split;
    }
    copy_into(cx, rt_->from_host(host.data(), p.value.shape(), host_dtype, options_.device), p.value);  // in place
  }
  LATHE_CHECK(fused == 0 || split == 0, "model: {}: the checkpoint mixes fused ({} tensors) and per-expert ({}) expert "
              "layouts", st.dir(), fused, split);
  per_expert_layout_ = split > 0;
  return used;
}

std::vector<io::TensorRef> CausalLm::checkpoint_refs(const Parameter& p, DType dtype, const Tensor& host) const {
  if (!per_expert_layout_ || !is_fused_experts(p.name))
    return {{p.name, dtype, host.shape(), host.data_ptr(), host.nbytes()}};
  std::vector<io::TensorRef> refs;
  const std::vector<std::string> parts = expert_parts(p.name);
  const int64_t rows = host.size(1), cols = host.size(2), part_rows = rows / int64_t(parts.size());  // the whole's
  const size_t elem = dtype_size(dtype);
  const auto* base = static_cast<const uint8_t*>(host.data_ptr());
  for (int64_t e = 0; e < host.size(0); ++e)
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t at = (e * rows + int64_t(i) * part_rows) * cols;
      refs.push_back({per_expert_name(p.name, e, parts[i]), dtype, {part_rows, cols}, base + size_t(at) * elem,
                      size_t(part_rows * cols) * elem});
    }
  return refs;
}

}  // namespace lathe
