// The grouped GEMM ops of mixture-of-experts layers (grouped_matmul, grouped_matmul_weight_grad, and the two with
// their groups on the device, grouped_matmul_routed and grouped_matmul_weight_grad_routed): the op functions, their
// shape inference, the layout rule of their kernels and the backward compositions, kept out of the generic op files.
// Formulas at GroupedMatmulAttrs in ops/op_table.h. Convention: the row groups come as host offsets in the attrs,
// checked here in full, so the kernels trust them; the routed ops' come as moe_route's offsets tensor, which their
// kernels clamp. Weights (and weight-grad outputs) may be views whose expert blocks are contiguous but further apart
// than a block: the gate and up halves of a fused gate_up_proj.
// Covered by tests/ops (op cases in testing/op_cases_moe.cpp) and tests/ops/test_grouped_matmul.cpp.
#include "ops/ops.h"

namespace lathe {

namespace {

// offsets: E + 1 entries, offsets[0] = 0, non-decreasing, offsets[E] = rows. `experts` < 0: E is not known
// otherwise (the weight grad takes it from the offsets).
void check_offsets(OpId op, const std::vector<int64_t>& offsets, int64_t rows, int64_t experts, const Tensor& x) {
  const std::string_view name = op_name(op);
  LATHE_CHECK(!offsets.empty(), "ops: {} needs E + 1 group offsets (offsets is empty)", name);
  const int64_t e_count = int64_t(offsets.size()) - 1;
  if (experts >= 0)
    LATHE_CHECK(e_count == experts, "ops: {} has {} group offsets for a weight of {} experts (needs E + 1 = {})", name,
                offsets.size(), experts, experts + 1);
  LATHE_CHECK(offsets[0] == 0, "ops: {} group offsets must start at 0, got offsets[0] = {}", name, offsets[0]);
  for (int64_t e = 0; e < e_count; ++e)
    LATHE_CHECK(offsets[size_t(e)] <= offsets[size_t(e) + 1],
                "ops: {} group offsets must be non-decreasing: offsets[{}] = {} > offsets[{}] = {}", name, e,
                offsets[size_t(e)], e + 1, offsets[size_t(e) + 1]);
  LATHE_CHECK(offsets.back() == rows, "ops: {} group offsets end at {}, but {} has {} rows (offsets[E] must be P)",
              name, offsets.back(), x.describe(), rows);
}

void check_float_pair(OpId op, const Tensor& a, const Tensor& b) {
  LATHE_CHECK(is_floating(a.dtype()), "ops: {} needs floating-point inputs, got {}", op_name(op), a.describe());
  LATHE_CHECK(a.dtype() == b.dtype(), "ops: {} needs inputs of one dtype, got {} and {}", op_name(op), a.describe(),
              b.describe());
}

// A weight as the kernels take it: itself when its expert blocks are contiguous, else a contiguous copy.
Tensor expert_blocks(ExecContext& ctx, const Tensor& w) { return expert_blocks_contiguous(w) ? w : contiguous(ctx, w); }

GroupedMatmulAttrs with_trans(const GroupedMatmulAttrs& a, bool trans_w) {
  GroupedMatmulAttrs out = a;
  out.trans_w = trans_w;
  out.accumulate = false;
  return out;
}

}  // namespace

bool expert_blocks_contiguous(const Tensor& t) {
  if (t.dim() != 3) return false;
  const Shape& s = t.strides();
  const bool elements = t.size(2) <= 1 || s[2] == 1;        // element stride 1 within a row
  const bool rows = t.size(1) <= 1 || s[1] == t.size(2);     // row stride = the row length
  const bool apart = t.size(0) <= 1 || s[0] >= t.size(1) * t.size(2);  // blocks do not overlap
  return elements && rows && apart;
}

Support grouped_matmul_layout(const OpCall& call) {
  const bool forward = call.op == OpId::grouped_matmul || call.op == OpId::grouped_matmul_routed;
  if (!call.inputs[0].is_contiguous()) return Support::no(forward ? "x must be contiguous" : "dy must be contiguous");
  if (forward && !expert_blocks_contiguous(call.inputs[1]))
    return Support::no("w's expert blocks must be contiguous and at least a block apart");
  if (!forward && !call.inputs[1].is_contiguous()) return Support::no("x must be contiguous");
  if (forward && !call.outputs[0].is_contiguous()) return Support::no("y must be contiguous");
  if (!forward && !expert_blocks_contiguous(call.outputs[0]))
    return Support::no("dw's expert blocks must be contiguous and at least a block apart");
  return Support::yes();
}

std::vector<TensorSpec> infer_grouped_matmul_outputs(OpId op, const std::vector<Tensor>& in, const OpAttrs& attrs) {
  const std::string_view name = op_name(op);
  if (op == OpId::grouped_matmul_routed || op == OpId::grouped_matmul_weight_grad_routed) {  // groups: a tensor
    const auto& a = std::get<GroupedMatmulAttrs>(attrs);
    LATHE_CHECK(a.offsets.empty(), "ops: {} reads its groups from its offsets tensor, not from attrs.offsets", name);
    check_float_pair(op, in[0], in[1]);
    const Tensor& off = in[2];
    const bool forward = op == OpId::grouped_matmul_routed;
    const int64_t experts = forward ? in[1].size(0) : off.size(0) - 2;
    LATHE_CHECK(off.dim() == 1 && off.dtype() == DType::I32 && off.size(0) >= 2 &&
                    (!forward || off.size(0) == in[1].size(0) + 2) && off.device() == in[0].device(),
                "ops: {} needs moe_route's offsets (E + 2{}) i32 on {}, got {}", name,
                forward && in[1].dim() == 3 ? fmt::format(" = {}", in[1].size(0) + 2) : "", in[0].device().str(),
                off.describe());
    if (forward) {
      const Tensor& x = in[0];
      const Tensor& w = in[1];
      LATHE_CHECK(x.dim() == 2 && w.dim() == 3 && (a.trans_w ? w.size(2) : w.size(1)) == x.size(1),
                  "ops: {} needs x (P, K) and w {}, got {} and {}", name, a.trans_w ? "(E, N, K)" : "(E, K, N)",
                  x.describe(), w.describe());
      return {{{x.size(0), a.trans_w ? w.size(1) : w.size(2)}, x.dtype()}};
    }
    LATHE_CHECK(in[0].dim() == 2 && in[1].dim() == 2 && in[0].size(0) == in[1].size(0),
                "ops: {} needs dy (P, N) and x (P, K) with the same rows, got {} and {}", name, in[0].describe(),
                in[1].describe());
    return {{{experts, in[0].size(1), in[1].size(1)}, in[0].dtype()}};
  }
  const auto& a = std::get<GroupedMatmulAttrs>(attrs);
  check_float_pair(op, in[0], in[1]);
  if (op == OpId::grouped_matmul) {
    const Tensor& x = in[0];
    const Tensor& w = in[1];
    LATHE_CHECK(x.dim() == 2, "ops: grouped_matmul needs x (P, K), got {}", x.describe());
    LATHE_CHECK(w.dim() == 3, "ops: grouped_matmul needs w {} (3-D), got {}", a.trans_w ? "(E, N, K)" : "(E, K, N)",
                w.describe());
    const int64_t k = a.trans_w ? w.size(2) : w.size(1);
    const int64_t n = a.trans_w ? w.size(1) : w.size(2);
    LATHE_CHECK(k == x.size(1), "ops: grouped_matmul inner dimensions differ: x {} and w {} ({}: K is w's dim {})",
                x.describe(), w.describe(), a.trans_w ? "trans_w" : "!trans_w", a.trans_w ? 2 : 1);
    LATHE_CHECK(k >= 1 && n >= 1, "ops: grouped_matmul needs K >= 1 and N >= 1, got x {} and w {}", x.describe(),
                w.describe());
    check_offsets(op, a.offsets, x.size(0), w.size(0), x);
    return {{{x.size(0), n}, x.dtype()}};
  }
  const Tensor& dy = in[0];
  const Tensor& x = in[1];
  LATHE_CHECK(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0),
              "ops: {} needs dy (P, N) and x (P, K) with the same rows, got {} and {}", name, dy.describe(),
              x.describe());
  LATHE_CHECK(dy.size(1) >= 1 && x.size(1) >= 1, "ops: {} needs N >= 1 and K >= 1, got dy {} and x {}", name,
              dy.describe(), x.describe());
  check_offsets(op, a.offsets, x.size(0), -1, x);
  return {{{int64_t(a.offsets.size()) - 1, dy.size(1), x.size(1)}, dy.dtype()}};
}

std::vector<Tensor> grouped_matmul_op_backward(ExecContext& ctx, OpId op, const std::vector<Tensor>& in,
                                               const OpAttrs& attrs, const Tensor& dy) {
  const auto& a = std::get<GroupedMatmulAttrs>(attrs);
  if (op == OpId::grouped_matmul) {
    // y_e = x_e w_e^T (trans_w): dx_e = dy_e w_e, dw_e = dy_e^T x_e. y_e = x_e w_e: dx_e = dy_e w_e^T, dw_e = x_e^T dy_e.
    const Tensor& x = in[0];
    const Tensor& w = in[1];
    const Tensor dx = grouped_matmul(ctx, dy, w, with_trans(a, !a.trans_w));
    const Tensor dw = a.trans_w ? grouped_matmul_weight_grad(ctx, dy, x, a) : grouped_matmul_weight_grad(ctx, x, dy, a);
    return {dx, dw};
  }
  // dw_e = p_e^T q_e for p = in[0] (P, N), q = in[1] (P, K), with the gradient g_e (N, K) of dw_e:
  // dp_e = q_e g_e^T (grouped_matmul of q with g as an (E, N, K) weight), dq_e = p_e g_e (g as an (E, K_in = N, K) one).
  return {grouped_matmul(ctx, in[1], dy, with_trans(a, true)), grouped_matmul(ctx, in[0], dy, with_trans(a, false))};
}

Tensor grouped_matmul(ExecContext& ctx, const Tensor& x, const Tensor& w, const GroupedMatmulAttrs& attrs) {
  return call_op(ctx, OpId::grouped_matmul, {contiguous(ctx, x), expert_blocks(ctx, w)}, attrs)[0];
}

Tensor grouped_matmul_weight_grad(ExecContext& ctx, const Tensor& dy, const Tensor& x, const GroupedMatmulAttrs& attrs) {
  LATHE_CHECK(!attrs.accumulate, "ops: grouped_matmul_weight_grad accumulates only into an output "
              "(grouped_matmul_weight_grad_into)");
  return call_op(ctx, OpId::grouped_matmul_weight_grad, {contiguous(ctx, dy), contiguous(ctx, x)}, attrs)[0];
}

namespace {

// A weight grad (either op) written into `out`, its spec checked: a kernel of the exact dtype writes (or adds into) the
// output directly, and so does any kernel into a contiguous output when nothing is added. Otherwise (a bf16 call on
// the CPU runs as upcast_f32, whose final cast needs a contiguous output, and reads nothing of it) it is computed into
// a fresh tensor whose expert blocks, each contiguous, are then copied (or added) into place.
void weight_grad_into(ExecContext& ctx, OpCall call, bool accumulate) {
  const Tensor out = call.outputs.at(0);
  LATHE_CHECK(out.defined(), "ops: {}_into got an undefined output", op_name(call.op));
  const TensorSpec spec = infer_outputs(call.op, call.inputs, call.attrs)[0];
  LATHE_CHECK(out.shape() == spec.shape && out.dtype() == spec.dtype && out.device() == ctx.device &&
                  expert_blocks_contiguous(out),
              "ops: {}_into needs a {}{} output on {} whose expert blocks are contiguous and at least a block apart, "
              "got {}",
              op_name(call.op), dtype_name(spec.dtype), shape_str(spec.shape), ctx.device.str(), out.describe());
  if (ctx.registry.has_exact(call) || (out.is_contiguous() && !accumulate)) {
    run_op(ctx, call);
    return;
  }
  std::get<GroupedMatmulAttrs>(call.attrs).accumulate = false;
  const Tensor dense = call_op(ctx, call.op, call.inputs, call.attrs)[0];
  for (int64_t e = 0; e < spec.shape[0]; ++e) {
    const Tensor block = out.narrow(0, e, 1);
    copy_into(ctx, accumulate ? add(ctx, block, dense.narrow(0, e, 1)) : dense.narrow(0, e, 1), block);
  }
}

GroupedMatmulAttrs routed_attrs(bool trans_w, bool accumulate) {
  GroupedMatmulAttrs a;
  a.trans_w = trans_w;
  a.accumulate = accumulate;
  return a;
}

}  // namespace

void grouped_matmul_weight_grad_into(ExecContext& ctx, const Tensor& dy, const Tensor& x, const Tensor& out,
                                     const GroupedMatmulAttrs& attrs) {
  weight_grad_into(ctx, {OpId::grouped_matmul_weight_grad, {contiguous(ctx, dy), contiguous(ctx, x)}, {out}, attrs},
                   attrs.accumulate);
}

bool try_grouped_matmul_routed(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w,
                               bool few_rows, Tensor& y) {
  GroupedMatmulAttrs attrs = routed_attrs(trans_w, false);
  attrs.few_rows = few_rows;
  OpCall call{OpId::grouped_matmul_routed, {contiguous(ctx, x), expert_blocks(ctx, w), contiguous(ctx, offsets)}, {},
              attrs};
  const TensorSpec spec = infer_outputs(call.op, call.inputs, call.attrs)[0];
  call.outputs.push_back(Tensor::empty(spec.shape, spec.dtype, ctx.allocator));
  if (!ctx.registry.has_exact(call)) return false;
  run_op(ctx, call);
  y = call.outputs[0];
  return true;
}

bool try_grouped_matmul_weight_grad_routed_into(ExecContext& ctx, const Tensor& dy, const Tensor& x,
                                                const Tensor& offsets, const Tensor& out, bool accumulate) {
  const OpCall call{OpId::grouped_matmul_weight_grad_routed,
                    {contiguous(ctx, dy), contiguous(ctx, x), contiguous(ctx, offsets)}, {out},
                    routed_attrs(true, accumulate)};
  if (!ctx.registry.has_exact(call)) return false;
  weight_grad_into(ctx, call, accumulate);
  return true;
}

}  // namespace lathe
