// Backward formulas for ops whose backward is a composition of other ops.
// matmul: for C = alpha op(A) op(B), dA and dB are matmuls of dC with the other operand, with transposes
// chosen so that no transposed copy is ever made.
#include "ops/ops.h"

namespace lathe {

Tensor reduce_to_shape(ExecContext& ctx, const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  const int lead = grad.dim() - int(shape.size());
  LATHE_ASSERT(lead >= 0);
  std::vector<int> dims;
  for (int i = 0; i < grad.dim(); ++i)
    if (i < lead || (shape[i - lead] == 1 && grad.size(i) != 1)) dims.push_back(i);
  Tensor reduced = dims.empty() ? grad : sum(ctx, grad, dims, /*keepdim=*/true);
  return contiguous(ctx, reduced).view(shape);
}

namespace {

std::vector<Tensor> matmul_backward(ExecContext& ctx, const Tensor& a, const Tensor& b, const MatmulAttrs& at,
                                    const Tensor& dc) {
  // Batched A with 2-D B: fold the batch into M so that dB sums over it.
  if (b.dim() == 2 && a.dim() > 2) {
    const Tensor a2 = contiguous(ctx, a).view({-1, a.size(-1)});
    const Tensor dc2 = contiguous(ctx, dc).view({-1, dc.size(-1)});
    std::vector<Tensor> g = matmul_backward(ctx, a2, b, at, dc2);
    return {g[0].view(a.shape()), g[1]};
  }
  Tensor da, db;
  if (!at.trans_a) da = matmul(ctx, dc, b, {false, !at.trans_b, at.alpha});
  else da = matmul(ctx, b, dc, {at.trans_b, true, at.alpha});
  if (!at.trans_b) db = matmul(ctx, a, dc, {!at.trans_a, false, at.alpha});
  else db = matmul(ctx, dc, a, {true, at.trans_a, at.alpha});
  return {da, db};
}

int64_t reduced_count(const Tensor& x, const ReduceAttrs& r) {
  int64_t n = 1;
  for (int d : normalize_reduce_dims(r.dims, x.dim())) n *= x.size(d);
  return n;
}

// Broadcasts the gradient of a reduction back to the input's shape.
Tensor expand_reduced(ExecContext& ctx, const Tensor& dy, const Tensor& x, const ReduceAttrs& r) {
  Shape kept = x.shape();
  for (int d : normalize_reduce_dims(r.dims, x.dim())) kept[d] = 1;
  return contiguous(ctx, contiguous(ctx, dy).view(kept).expand(x.shape()));
}

}  // namespace

std::vector<Tensor> op_backward(ExecContext& ctx, OpId op, const std::vector<Tensor>& in, const OpAttrs& attrs,
                                const std::vector<Tensor>& outputs, const Tensor& dy) {
  const Tensor& out = outputs.at(0);
  switch (op) {
    case OpId::matmul:
      return matmul_backward(ctx, in[0], in[1], std::get<MatmulAttrs>(attrs), dy);
    case OpId::add:
      return {reduce_to_shape(ctx, dy, in[0].shape()), reduce_to_shape(ctx, dy, in[1].shape())};
    case OpId::mul:
      return {reduce_to_shape(ctx, mul(ctx, dy, in[1]), in[0].shape()),
              reduce_to_shape(ctx, mul(ctx, dy, in[0]), in[1].shape())};
    case OpId::scale:
      return {scale(ctx, dy, std::get<ScaleAttrs>(attrs).alpha)};
    case OpId::cast:
      return {is_floating(in[0].dtype()) ? cast(ctx, dy, in[0].dtype()) : Tensor()};
    case OpId::sum:
      return {expand_reduced(ctx, dy, in[0], std::get<ReduceAttrs>(attrs))};
    case OpId::mean: {
      const auto& r = std::get<ReduceAttrs>(attrs);
      return {scale(ctx, expand_reduced(ctx, dy, in[0], r), 1.0 / double(reduced_count(in[0], r)))};
    }
    case OpId::softmax:
      return {softmax_backward(ctx, out, dy)};
    case OpId::silu:
      return {silu_backward(ctx, in[0], dy)};
    case OpId::swiglu:
      return swiglu_backward(ctx, in[0], in[1], dy);
    case OpId::swiglu_halves:
      return {swiglu_halves_backward(ctx, in[0], dy)};
    case OpId::embedding: {
      const int64_t first = std::holds_alternative<EmbeddingAttrs>(attrs) ? std::get<EmbeddingAttrs>(attrs).first : -1;
      return {embedding_backward(ctx, dy, in[1], in[0].size(0), first), Tensor()};
    }
    case OpId::rmsnorm:
      return rmsnorm_backward(ctx, in[0], in[1], dy, std::get<NormAttrs>(attrs));
    case OpId::residual_rmsnorm: {  // through y; h = outputs[1] is what was normalised
      std::vector<Tensor> g = rmsnorm_backward(ctx, outputs.at(1), in[2], dy, std::get<NormAttrs>(attrs));
      return {g[0], g[0], g[1]};
    }
    case OpId::gated_rmsnorm:
      return gated_rmsnorm_backward(ctx, in[0], in[1], in[2], dy, std::get<NormAttrs>(attrs));
    case OpId::rope: {
      RopeAttrs inv = std::get<RopeAttrs>(attrs);
      inv.inverse = !inv.inverse;
      return {rope(ctx, dy, in[1], inv), Tensor()};
    }
    case OpId::qk_norm_rope: {  // through q; k and v get no gradient (zeros: the finite outputs times 0)
      const Tensor zk = scale(ctx, outputs.at(1), 0.0), zv = scale(ctx, outputs.at(2), 0.0);
      std::vector<Tensor> g = qk_norm_rope_backward(ctx, in[0], in[1], in[2], in[3], dy, zk, zv,
                                                    std::get<QkNormRopeAttrs>(attrs));
      g.push_back(Tensor());
      return g;
    }
    case OpId::attention: {
      // Only o is differentiated; lse (outputs[1]) is saved statistics.
      std::vector<Tensor> g = attention_backward(ctx, in[0], in[1], in[2], out, outputs.at(1), dy, in[3],
                                                 std::get<AttentionAttrs>(attrs));
      g.push_back(Tensor());
      return g;
    }
    case OpId::segment_mask:  // linear and self-adjoint (a selection times per-segment scalars)
      return {segment_mask(ctx, dy, std::get<SegmentAttrs>(attrs))};
    case OpId::dropout:  // the same mask and 1 / (1 - p): linear and self-adjoint for fixed attrs
      return {dropout(ctx, dy, std::get<SegmentAttrs>(attrs))};
    case OpId::sigmoid:
    case OpId::causal_conv1d:
    case OpId::gdn_decay:
    case OpId::gated_delta_rule:
      return gated_delta_op_backward(ctx, op, in, attrs, outputs, dy);  // ops/gated_delta.cpp
    case OpId::grouped_matmul:
    case OpId::grouped_matmul_weight_grad:  // bilinear: both have compositions
      return grouped_matmul_op_backward(ctx, op, in, attrs, dy);  // ops/grouped_matmul.cpp
    case OpId::sigmoid_backward:
    case OpId::causal_conv1d_backward:
    case OpId::gdn_decay_backward:
    case OpId::gated_delta_rule_backward:
    case OpId::gated_delta_rule_state:  // forward only (decoding)
    case OpId::softmax_backward:
    case OpId::silu_backward:
    case OpId::swiglu_backward:
    case OpId::swiglu_halves_backward:
    case OpId::embedding_backward:
    case OpId::rmsnorm_backward:
    case OpId::residual_rmsnorm_backward:
    case OpId::gated_rmsnorm_backward:
    case OpId::qk_norm_rope_backward:
    case OpId::attention_backward:
    case OpId::cross_entropy:
    case OpId::cross_entropy_slice:
    case OpId::sum_squares:  // the global gradient norm: never part of a differentiated graph
    case OpId::sum_squares_list:
    case OpId::adamw:
    case OpId::adamw_list:
    case OpId::moe_route:  // piecewise constant choices; the router's backward is composed by the MoE layer
    case OpId::moe_pad_plan:
    case OpId::moe_ep_messages:  // expert parallelism's exchange plan: integer tables
    case OpId::moe_ep_slots:
    case OpId::moe_ep_regroup:
    case OpId::moe_ep_sources:
    case OpId::grouped_matmul_routed:  // the MoE layer composes their backward
    case OpId::grouped_matmul_weight_grad_routed:
    case OpId::paged_attention:        // the rollout engine's: decoding only
    case OpId::scatter_rows:
    case OpId::row_argmax_logsumexp:
    case OpId::sample_rows:
    case OpId::penalize_rows:
    case OpId::gather_sum:  // expert parallelism's sums: moe_layer.cpp composes their backward
    case OpId::kCount:
      break;
  }
  LATHE_FAIL("ops: {} has no backward", op_name(op));
}

}  // namespace lathe
