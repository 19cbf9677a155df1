// Op functions: validate, allocate outputs on the context's device, resolve and run.
#include "ops/ops.h"

#include <algorithm>

namespace lathe {

namespace {

// Every op's attrs alternative; a call with std::monostate gets the default of the right type.
OpAttrs normalize_attrs(OpId op, OpAttrs attrs) {
  auto expect = [&](auto def) -> OpAttrs {
    using A = decltype(def);
    if (std::holds_alternative<std::monostate>(attrs)) return def;
    LATHE_CHECK(std::holds_alternative<A>(attrs), "ops: {} got attributes of the wrong kind", op_name(op));
    return attrs;
  };
  switch (op) {
    case OpId::matmul: return expect(MatmulAttrs{});
    case OpId::scale: return expect(ScaleAttrs{});
    case OpId::cast: return expect(CastAttrs{});
    case OpId::sum:
    case OpId::mean: return expect(ReduceAttrs{});
    case OpId::embedding:
    case OpId::embedding_backward: return expect(EmbeddingAttrs{});
    case OpId::rmsnorm:
    case OpId::rmsnorm_backward:
    case OpId::residual_rmsnorm:
    case OpId::residual_rmsnorm_backward:
    case OpId::gated_rmsnorm:
    case OpId::gated_rmsnorm_backward: return expect(NormAttrs{});
    case OpId::rope: return expect(RopeAttrs{});
    case OpId::qk_norm_rope:
    case OpId::qk_norm_rope_backward: return expect(QkNormRopeAttrs{});
    case OpId::attention:
    case OpId::attention_backward: return expect(AttentionAttrs{});
    case OpId::cross_entropy:
    case OpId::cross_entropy_slice: return expect(CrossEntropyAttrs{});
    case OpId::paged_attention: return expect(PagedAttentionAttrs{});
    case OpId::row_argmax_logsumexp:
    case OpId::sample_rows: return expect(ArgmaxAttrs{});
    case OpId::adamw:
    case OpId::adamw_list: return expect(AdamWAttrs{});
    case OpId::segment_mask:
    case OpId::dropout: return expect(SegmentAttrs{});
    case OpId::gated_delta_rule:
    case OpId::gated_delta_rule_backward:
    case OpId::gated_delta_rule_state: return expect(GatedDeltaAttrs{});
    case OpId::grouped_matmul:
    case OpId::grouped_matmul_weight_grad:
    case OpId::grouped_matmul_routed:
    case OpId::grouped_matmul_weight_grad_routed: return expect(GroupedMatmulAttrs{});
    case OpId::moe_route: return expect(MoeRouteAttrs{});
    case OpId::moe_pad_plan: return expect(MoePadAttrs{});
    case OpId::moe_ep_messages:
    case OpId::moe_ep_slots:
    case OpId::moe_ep_regroup:
    case OpId::moe_ep_sources: return expect(MoeExchangeAttrs{});
    default:
      LATHE_CHECK(std::holds_alternative<std::monostate>(attrs), "ops: {} takes no attributes", op_name(op));
      return attrs;
  }
}

}  // namespace

std::vector<Tensor> call_op(ExecContext& ctx, OpId op, std::vector<Tensor> inputs, OpAttrs attrs) {
  attrs = normalize_attrs(op, std::move(attrs));
  if (const auto* mm = std::get_if<MatmulAttrs>(&attrs))
    LATHE_CHECK(mm->beta == 0.0f, "ops: matmul with beta != 0 reads its output: use matmul_into");
  OpCall call{op, std::move(inputs), {}, std::move(attrs)};
  for (const TensorSpec& spec : infer_outputs(op, call.inputs, call.attrs))
    call.outputs.push_back(Tensor::empty(spec.shape, spec.dtype, ctx.allocator));
  run_op(ctx, call);
  return call.outputs;
}

Support matmul_layout(const OpCall& call) {
  const bool flat = call.inputs[0].dim() == 2 && call.inputs[1].dim() == 2;
  for (const Tensor* t : {&call.inputs[0], &call.inputs[1], &call.outputs[0]})
    if (!t->is_contiguous() && !(flat && rows_contiguous(*t)))
      return Support::no("operands must be contiguous, or 2-D with contiguous rows in an unbatched product");
  return Support::yes();
}

namespace {

// Runs a matmul call whose outputs are set. Its operands are contiguous or 2-D with contiguous rows (column slices),
// which the kernels of matmul_layout read and write in place; where the resolved kernel would not (a bf16 product on
// the CPU runs as upcast_f32), the operands are copied and a strided output is written back.
void run_matmul(ExecContext& ctx, OpCall call) {
  bool strided = false;
  for (const Tensor* t : {&call.inputs[0], &call.inputs[1], &call.outputs[0]}) strided = strided || !t->is_contiguous();
  if (!strided || ctx.registry.has_exact(call)) {
    run_op(ctx, call);
    return;
  }
  for (Tensor& t : call.inputs) t = contiguous(ctx, t);
  const Tensor dst = call.outputs[0];
  call.outputs[0] = contiguous(ctx, dst);  // beta != 0 reads it
  run_op(ctx, call);
  if (!dst.is_contiguous()) copy_into(ctx, call.outputs[0], dst);
}

// Runs `call`, whose one output the caller gave: it must be defined, contiguous and of the shape and dtype the op
// infers (`what` names the function in the error; run_op checks the devices).
void run_into(ExecContext& ctx, const OpCall& call, const char* what) {
  const Tensor& out = call.outputs[0];
  const TensorSpec spec = infer_outputs(call.op, call.inputs, call.attrs)[0];
  LATHE_CHECK(out.defined() && out.shape() == spec.shape && out.dtype() == spec.dtype && out.is_contiguous(),
              "ops: {} needs a contiguous {}{} output, got {}", what, dtype_name(spec.dtype), shape_str(spec.shape),
              out.defined() ? out.describe() : "an undefined tensor");
  run_op(ctx, call);
}

// An operand as a matmul takes it: as it is when contiguous or, in an unbatched product, 2-D with contiguous rows.
Tensor matmul_operand(ExecContext& ctx, const Tensor& t, bool flat) {
  return flat && rows_contiguous(t) ? t : contiguous(ctx, t);
}

}  // namespace

Tensor matmul(ExecContext& ctx, const Tensor& a, const Tensor& b, MatmulAttrs attrs) {
  LATHE_CHECK(attrs.beta == 0.0f, "ops: matmul with beta != 0 reads its output: use matmul_into");
  const bool flat = a.dim() == 2 && b.dim() == 2;
  OpCall call{OpId::matmul, {matmul_operand(ctx, a, flat), matmul_operand(ctx, b, flat)}, {}, attrs};
  const TensorSpec spec = infer_outputs(OpId::matmul, call.inputs, call.attrs)[0];
  call.outputs.push_back(Tensor::empty(spec.shape, spec.dtype, ctx.allocator));
  run_matmul(ctx, call);
  return call.outputs[0];
}

void matmul_into(ExecContext& ctx, const Tensor& a, const Tensor& b, Tensor& out, MatmulAttrs attrs) {
  const bool flat = a.dim() == 2 && b.dim() == 2;
  OpCall call{OpId::matmul, {matmul_operand(ctx, a, flat), matmul_operand(ctx, b, flat)}, {out}, attrs};
  const TensorSpec spec = infer_outputs(OpId::matmul, call.inputs, call.attrs)[0];
  const bool layout_ok = out.is_contiguous() || (flat && rows_contiguous(out));
  LATHE_CHECK(out.shape() == spec.shape && out.dtype() == spec.dtype && layout_ok,
              "ops: matmul_into output {} should be a {}{}, contiguous or (2-D operands) with contiguous rows",
              out.describe(), dtype_name(spec.dtype), shape_str(spec.shape));
  run_matmul(ctx, call);
}

Tensor add(ExecContext& ctx, const Tensor& a, const Tensor& b) { return call_op(ctx, OpId::add, {a, b})[0]; }
Tensor mul(ExecContext& ctx, const Tensor& a, const Tensor& b) { return call_op(ctx, OpId::mul, {a, b})[0]; }

Tensor scale(ExecContext& ctx, const Tensor& x, double alpha) {
  return call_op(ctx, OpId::scale, {x}, ScaleAttrs{alpha})[0];
}

Tensor cast(ExecContext& ctx, const Tensor& x, DType to) { return call_op(ctx, OpId::cast, {x}, CastAttrs{to})[0]; }

namespace {

// Whether no two elements of t share memory: its dims by increasing stride, each stride at least the extent of the
// dims inside it (a contiguous tensor or a narrow or transpose of one; not a broadcast).
bool distinct_elements(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims of size above 1
  for (int d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.strides()[size_t(d)], t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;  // elements spanned by the dims so far
  for (const auto& [stride, size] : dims) {
    if (stride < extent) return false;
    extent = stride * (size - 1) + extent;
  }
  return true;
}

}  // namespace

void copy_into(ExecContext& ctx, const Tensor& src, const Tensor& dst) {
  LATHE_CHECK(src.shape() == dst.shape() && distinct_elements(dst), "ops: copy_into needs a destination of the "
              "source's shape whose elements are distinct, got {} into {}", src.describe(), dst.describe());
  run_op(ctx, OpCall{OpId::cast, {src}, {dst}, CastAttrs{dst.dtype()}});
}

Tensor linear(ExecContext& ctx, const Tensor& x, const Tensor& w) { return matmul(ctx, x, w, {false, true}); }

Tensor contiguous(ExecContext& ctx, const Tensor& x) {
  return x.is_contiguous() ? x : cast(ctx, x, x.dtype());
}

Tensor zeros(ExecContext& ctx, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, ctx.allocator);
  if (t.nbytes() > 0) ctx.backend.fill_bytes(t.data_ptr(), 0, t.nbytes(), ctx.stream);
  return t;
}

Tensor sum(ExecContext& ctx, const Tensor& x, std::vector<int> dims, bool keepdim) {
  return call_op(ctx, OpId::sum, {x}, ReduceAttrs{std::move(dims), keepdim})[0];
}

Tensor mean(ExecContext& ctx, const Tensor& x, std::vector<int> dims, bool keepdim) {
  return call_op(ctx, OpId::mean, {x}, ReduceAttrs{std::move(dims), keepdim})[0];
}

Tensor sum_squares(ExecContext& ctx, const Tensor& x) { return call_op(ctx, OpId::sum_squares, {x})[0]; }

void sum_squares_into(ExecContext& ctx, const Tensor& x, const Tensor& out) {
  run_into(ctx, OpCall{OpId::sum_squares, {x}, {out}, {}}, "sum_squares_into");
}

Tensor softmax(ExecContext& ctx, const Tensor& x) { return call_op(ctx, OpId::softmax, {contiguous(ctx, x)})[0]; }

Tensor softmax_backward(ExecContext& ctx, const Tensor& y, const Tensor& dy) {
  return call_op(ctx, OpId::softmax_backward, {contiguous(ctx, y), contiguous(ctx, dy)})[0];
}

Tensor silu(ExecContext& ctx, const Tensor& x) { return call_op(ctx, OpId::silu, {x})[0]; }

Tensor silu_backward(ExecContext& ctx, const Tensor& x, const Tensor& dy) {
  return call_op(ctx, OpId::silu_backward, {x, dy})[0];
}

Tensor swiglu(ExecContext& ctx, const Tensor& gate, const Tensor& up) {
  return call_op(ctx, OpId::swiglu, {contiguous(ctx, gate), contiguous(ctx, up)})[0];
}

Tensor swiglu_halves(ExecContext& ctx, const Tensor& gu) {
  return call_op(ctx, OpId::swiglu_halves, {contiguous(ctx, gu)})[0];
}

Tensor swiglu_halves_backward(ExecContext& ctx, const Tensor& gu, const Tensor& dy) {
  return call_op(ctx, OpId::swiglu_halves_backward, {contiguous(ctx, gu), contiguous(ctx, dy)})[0];
}

std::vector<Tensor> swiglu_backward(ExecContext& ctx, const Tensor& gate, const Tensor& up, const Tensor& dy) {
  return call_op(ctx, OpId::swiglu_backward, {contiguous(ctx, gate), contiguous(ctx, up), contiguous(ctx, dy)});
}

Tensor embedding(ExecContext& ctx, const Tensor& weight, const Tensor& ids, int64_t first) {
  return call_op(ctx, OpId::embedding, {contiguous(ctx, weight), contiguous(ctx, ids)},
                 EmbeddingAttrs{0, false, first})[0];
}

Tensor embedding_backward(ExecContext& ctx, const Tensor& dy, const Tensor& ids, int64_t vocab, int64_t first) {
  return call_op(ctx, OpId::embedding_backward, {contiguous(ctx, dy), contiguous(ctx, ids)},
                 EmbeddingAttrs{vocab, false, first})[0];
}

void embedding_backward_into(ExecContext& ctx, const Tensor& dy, const Tensor& ids, Tensor& dweight, int64_t first) {
  LATHE_CHECK(dweight.dim() == 2, "ops: embedding_backward_into needs a (vocab, hidden) output, got {}",
              dweight.describe());
  run_into(ctx, OpCall{OpId::embedding_backward, {contiguous(ctx, dy), contiguous(ctx, ids)}, {dweight},
                       EmbeddingAttrs{dweight.size(0), true, first}},
           "embedding_backward_into");
}

Tensor rmsnorm(ExecContext& ctx, const Tensor& x, const Tensor& w, NormAttrs attrs) {
  return call_op(ctx, OpId::rmsnorm, {contiguous(ctx, x), contiguous(ctx, w)}, attrs)[0];
}

std::vector<Tensor> residual_rmsnorm(ExecContext& ctx, const Tensor& x, const Tensor& r, const Tensor& w,
                                     NormAttrs attrs) {
  return call_op(ctx, OpId::residual_rmsnorm, {contiguous(ctx, x), contiguous(ctx, r), contiguous(ctx, w)}, attrs);
}

std::vector<Tensor> residual_rmsnorm_backward(ExecContext& ctx, const Tensor& h, const Tensor& w, const Tensor& dy,
                                              const Tensor& dres, NormAttrs attrs) {
  return call_op(ctx, OpId::residual_rmsnorm_backward,
                 {contiguous(ctx, h), contiguous(ctx, w), contiguous(ctx, dy), contiguous(ctx, dres)}, attrs);
}

std::vector<Tensor> rmsnorm_backward(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy,
                                     NormAttrs attrs) {
  return call_op(ctx, OpId::rmsnorm_backward, {contiguous(ctx, x), contiguous(ctx, w), contiguous(ctx, dy)}, attrs);
}

Tensor gated_rmsnorm(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& z, NormAttrs attrs) {
  return call_op(ctx, OpId::gated_rmsnorm, {contiguous(ctx, x), contiguous(ctx, w), contiguous(ctx, z)}, attrs)[0];
}

std::vector<Tensor> gated_rmsnorm_backward(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& z,
                                           const Tensor& dy, NormAttrs attrs) {
  return call_op(ctx, OpId::gated_rmsnorm_backward,
                 {contiguous(ctx, x), contiguous(ctx, w), contiguous(ctx, z), contiguous(ctx, dy)}, attrs);
}

Tensor rope(ExecContext& ctx, const Tensor& x, const Tensor& positions, RopeAttrs attrs) {
  return call_op(ctx, OpId::rope, {contiguous(ctx, x), contiguous(ctx, positions)}, attrs)[0];
}

std::vector<Tensor> qk_norm_rope(ExecContext& ctx, const Tensor& qkv, const Tensor& wq, const Tensor& wk,
                                 const Tensor& positions, QkNormRopeAttrs attrs) {
  return call_op(ctx, OpId::qk_norm_rope,
                 {contiguous(ctx, qkv), contiguous(ctx, wq), contiguous(ctx, wk), contiguous(ctx, positions)}, attrs);
}

std::vector<Tensor> qk_norm_rope_backward(ExecContext& ctx, const Tensor& qkv, const Tensor& wq, const Tensor& wk,
                                          const Tensor& positions, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                          QkNormRopeAttrs attrs) {
  return call_op(ctx, OpId::qk_norm_rope_backward,
                 {contiguous(ctx, qkv), contiguous(ctx, wq), contiguous(ctx, wk), contiguous(ctx, positions),
                  contiguous(ctx, dq), contiguous(ctx, dk), contiguous(ctx, dv)},
                 attrs);
}

// Each part copied into its columns of the output (a strided destination of the cast op).
Tensor concat_columns(ExecContext& ctx, const std::vector<Tensor>& parts) {
  LATHE_CHECK(!parts.empty(), "ops: concat_columns needs at least one part");
  int64_t cols = 0;
  for (const Tensor& p : parts) {
    LATHE_CHECK(p.dim() == 2 && p.size(0) == parts[0].size(0) && p.dtype() == parts[0].dtype(),
                "ops: concat_columns needs (T, n) parts of one dtype, got {} beside {}", p.describe(),
                parts[0].describe());
    cols += p.size(1);
  }
  const Tensor out = Tensor::empty({parts[0].size(0), cols}, parts[0].dtype(), ctx.allocator);
  int64_t at = 0;
  for (const Tensor& p : parts) {
    copy_into(ctx, p, out.narrow(1, at, p.size(1)));  // a strided destination: each part's rows into its columns
    at += p.size(1);
  }
  return out;
}

std::vector<Tensor> attention(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& cu_seqlens, AttentionAttrs attrs) {
  return call_op(ctx, OpId::attention,
                 {contiguous(ctx, q), contiguous(ctx, k), contiguous(ctx, v), contiguous(ctx, cu_seqlens)}, attrs);
}

std::vector<Tensor> attention_backward(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& o, const Tensor& lse, const Tensor& d_o,
                                       const Tensor& cu_seqlens, AttentionAttrs attrs) {
  return call_op(ctx, OpId::attention_backward,
                 {contiguous(ctx, q), contiguous(ctx, k), contiguous(ctx, v), contiguous(ctx, o), contiguous(ctx, lse),
                  contiguous(ctx, d_o), contiguous(ctx, cu_seqlens)},
                 attrs);
}

Tensor paged_attention(ExecContext& ctx, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& block_table, const Tensor& cu_q, const Tensor& context_lens, PagedAttentionAttrs attrs) {
  return call_op(ctx, OpId::paged_attention,
                 {contiguous(ctx, q), k_cache, v_cache, contiguous(ctx, block_table), contiguous(ctx, cu_q),
                  contiguous(ctx, context_lens)},
                 attrs)[0];
}

std::vector<Tensor> row_argmax_logsumexp(ExecContext& ctx, const Tensor& x, int64_t limit) {
  return call_op(ctx, OpId::row_argmax_logsumexp, {contiguous(ctx, x)}, ArgmaxAttrs{limit});
}

std::vector<Tensor> sample_rows(ExecContext& ctx, const Tensor& x, const Tensor& rows, const Tensor& params,
                                const Tensor& keys, int64_t limit) {
  return call_op(ctx, OpId::sample_rows,
                 {contiguous(ctx, x), contiguous(ctx, rows), contiguous(ctx, params), contiguous(ctx, keys)},
                 ArgmaxAttrs{limit});
}

Tensor penalize_rows(ExecContext& ctx, const Tensor& x, const Tensor& rows, const Tensor& params,
                     const Tensor& entries) {
  return call_op(ctx, OpId::penalize_rows,
                 {contiguous(ctx, x), contiguous(ctx, rows), contiguous(ctx, params), contiguous(ctx, entries)})[0];
}

Tensor gather_sum(ExecContext& ctx, const Tensor& rows, const Tensor& index, const Tensor& weights) {
  return call_op(ctx, OpId::gather_sum, {contiguous(ctx, rows), contiguous(ctx, index), contiguous(ctx, weights)})[0];
}

void scatter_rows_into(ExecContext& ctx, const Tensor& src, const Tensor& index, Tensor& dst) {
  LATHE_CHECK(dst.is_contiguous(), "ops: scatter_rows_into needs a contiguous destination, got {}", dst.describe());
  run_into(ctx, OpCall{OpId::scatter_rows, {contiguous(ctx, src), contiguous(ctx, index), dst}, {dst}, {}},
           "scatter_rows_into");
}

std::vector<Tensor> cross_entropy(ExecContext& ctx, const Tensor& logits, const Tensor& labels,
                                  CrossEntropyAttrs attrs) {
  if (logits.is_contiguous() || !rows_contiguous(logits))
    return call_op(ctx, OpId::cross_entropy, {contiguous(ctx, logits), contiguous(ctx, labels)}, attrs);
  // Padded rows (empty_padded_rows): dlogits gets padded rows too, for the GEMMs that read it; a kernel that takes
  // only contiguous operands gets copies.
  OpCall call{OpId::cross_entropy, {logits, contiguous(ctx, labels)}, {}, normalize_attrs(OpId::cross_entropy, attrs)};
  const std::vector<TensorSpec> specs = infer_outputs(call.op, call.inputs, call.attrs);
  call.outputs.push_back(Tensor::empty(specs[0].shape, specs[0].dtype, ctx.allocator));
  if (attrs.with_grad)
    call.outputs.push_back(empty_padded_rows(logits.size(0), logits.size(1), logits.dtype(), ctx.allocator));
  if (!ctx.registry.has_exact(call))
    return call_op(ctx, OpId::cross_entropy, {contiguous(ctx, logits), call.inputs[1]}, attrs);
  run_op(ctx, call);
  return call.outputs;
}

std::vector<Tensor> cross_entropy_slice(ExecContext& ctx, const Tensor& logits, const Tensor& labels, const Tensor& lse,
                                        CrossEntropyAttrs attrs) {
  const std::vector<Tensor> in = {contiguous(ctx, logits), contiguous(ctx, labels), contiguous(ctx, lse)};
  if (logits.is_contiguous() || !rows_contiguous(logits)) return call_op(ctx, OpId::cross_entropy_slice, in, attrs);
  // Padded rows (empty_padded_rows), as cross_entropy: dlogits gets padded rows too.
  OpCall call{OpId::cross_entropy_slice, {logits, in[1], in[2]}, {}, normalize_attrs(OpId::cross_entropy_slice, attrs)};
  const std::vector<TensorSpec> specs = infer_outputs(call.op, call.inputs, call.attrs);
  call.outputs.push_back(Tensor::empty(specs[0].shape, specs[0].dtype, ctx.allocator));
  if (attrs.with_grad)
    call.outputs.push_back(empty_padded_rows(logits.size(0), logits.size(1), logits.dtype(), ctx.allocator));
  if (!ctx.registry.has_exact(call)) return call_op(ctx, OpId::cross_entropy_slice, in, attrs);
  run_op(ctx, call);
  return call.outputs;
}

void sum_squares_list_into(ExecContext& ctx, const std::vector<Tensor>& xs, const Tensor& out) {
  run_into(ctx, OpCall{OpId::sum_squares_list, xs, {out}, {}}, "sum_squares_list_into");
}

void adamw_update_list(ExecContext& ctx, const std::vector<AdamWGroup>& groups, const AdamWAttrs& attrs) {
  run_op(ctx, adamw_update_list_call(groups, attrs));
}

OpCall adamw_update_list_call(const std::vector<AdamWGroup>& groups, const AdamWAttrs& attrs) {
  LATHE_CHECK(!groups.empty(), "ops: adamw_update_list got no groups");
  const bool with_param = groups[0].param.defined();
  OpCall call{OpId::adamw_list, {}, {}, attrs};
  if (with_param) {
    AdamWAttrs a = attrs;
    a.rounded_to = groups[0].param.dtype();
    call.attrs = a;
  }
  for (const AdamWGroup& g : groups) {
    LATHE_CHECK(g.param.defined() == with_param, "ops: adamw_update_list needs a parameter in every group or in none");
    for (const Tensor* t : {&g.master, &g.grad, &g.m, &g.v})
      LATHE_CHECK(t->is_contiguous(), "ops: adamw_update_list needs contiguous tensors, got {}", t->describe());
    if (with_param)
      LATHE_CHECK(g.param.is_contiguous() && g.param.shape() == g.master.shape() &&
                      g.param.dtype() == groups[0].param.dtype() && g.param.device() == g.master.device(),
                  "ops: adamw_update_list needs contiguous parameters of one dtype and of their master's shape, got "
                  "{} for {}", g.param.describe(), g.master.describe());
    call.inputs.insert(call.inputs.end(), {g.master, g.grad, g.m, g.v});
    call.outputs.insert(call.outputs.end(), {g.master, g.m, g.v});
    if (with_param) call.outputs.push_back(g.param);
  }
  (void)infer_outputs(OpId::adamw_list, call.inputs, call.attrs);  // names the first bad group
  return call;
}

void adamw_update(ExecContext& ctx, Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWAttrs& attrs,
                  const Tensor& param) {
  OpCall call{OpId::adamw, {master, contiguous(ctx, grad), m, v}, {master, m, v}, attrs};
  if (param.defined()) {
    call.attrs = [&] {
      AdamWAttrs a = attrs;
      a.rounded_to = param.dtype();
      return a;
    }();
    call.outputs.push_back(param);
  }
  const std::vector<TensorSpec> specs = infer_outputs(OpId::adamw, call.inputs, call.attrs);
  LATHE_CHECK(specs.size() == call.outputs.size(), "ops: adamw_update got attrs.rounded_to ({}) without a parameter "
              "to write", dtype_name(*attrs.rounded_to));
  for (const Tensor* t : {&master, &m, &v})
    LATHE_CHECK(t->is_contiguous(), "ops: adamw_update needs contiguous state, got {}", t->describe());
  if (param.defined())
    LATHE_CHECK(param.is_contiguous() && param.shape() == master.shape() && param.device() == master.device(),
                "ops: adamw_update needs a contiguous parameter of the master's shape and device, got {} for the "
                "master {}", param.describe(), master.describe());
  run_op(ctx, call);
}

Tensor segment_mask(ExecContext& ctx, const Tensor& x, const SegmentAttrs& attrs) {
  return call_op(ctx, OpId::segment_mask, {contiguous(ctx, x)}, attrs)[0];
}

Tensor dropout(ExecContext& ctx, const Tensor& x, const SegmentAttrs& attrs) {
  return call_op(ctx, OpId::dropout, {contiguous(ctx, x)}, attrs)[0];
}

MoeRouting moe_route(ExecContext& ctx, const Tensor& logits, MoeRouteAttrs attrs) {
  std::vector<Tensor> o = call_op(ctx, OpId::moe_route, {contiguous(ctx, logits)}, attrs);
  return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]};
}

MoePadPlan moe_pad_plan(ExecContext& ctx, const Tensor& offsets, const Tensor& pair, MoePadAttrs attrs) {
  std::vector<Tensor> o = call_op(ctx, OpId::moe_pad_plan, {contiguous(ctx, offsets), contiguous(ctx, pair)}, attrs);
  return {o[0], o[1], o[2]};
}

MoeEpMessages moe_ep_messages(ExecContext& ctx, const Tensor& picked, const Tensor& offsets, int64_t ranks) {
  std::vector<Tensor> o = call_op(ctx, OpId::moe_ep_messages, {contiguous(ctx, picked), contiguous(ctx, offsets)},
                                  MoeExchangeAttrs{ranks, 0});
  return {o[0], o[1], o[2]};
}

MoeEpSlots moe_ep_slots(ExecContext& ctx, const Tensor& picked, const Tensor& position, const Tensor& back,
                        const Tensor& bases) {
  std::vector<Tensor> o = call_op(ctx, OpId::moe_ep_slots,
                                  {contiguous(ctx, picked), contiguous(ctx, position), contiguous(ctx, back),
                                   contiguous(ctx, bases)},
                                  MoeExchangeAttrs{back.size(1), 0});
  return {o[0], o[1]};
}

MoeEpRegroup moe_ep_regroup(ExecContext& ctx, const Tensor& blocks, int64_t rows) {
  std::vector<Tensor> o = call_op(ctx, OpId::moe_ep_regroup, {contiguous(ctx, blocks)}, MoeExchangeAttrs{1, rows});
  return {o[0], o[1]};
}

MoeEpSources moe_ep_sources(ExecContext& ctx, const Tensor& pairs, int64_t rows) {
  std::vector<Tensor> o = call_op(ctx, OpId::moe_ep_sources, {contiguous(ctx, pairs)}, MoeExchangeAttrs{1, rows});
  return {o[0], o[1]};
}

}  // namespace lathe
