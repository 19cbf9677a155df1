// Composite fallbacks: ops expressed through other ops, valid on every device.
// - mean: sum, then scale by 1/count.
// - upcast_f32: a bf16/f16 op with no exact kernel on its device runs as cast -> f32 kernel -> cast. The
//   result is rounded once, at the output, which is what a native low-precision kernel with fp32 compute
//   does too; `lathe kernels` shows where it is taken.
// - swiglu_of_halves: swiglu_halves (+ backward) as swiglu (+ backward) on contiguous copies of the halves, the
//   gradients copied into their columns; the CPU reference, and what runs where no device has the fused kernel.
// - norm_then_rope: qk_norm_rope (+ backward) as the rmsnorm and rope ops (+ backwards) on heads copied out of (or
//   into) the fused qkv rows; the CPU reference, and what runs where no device has the fused kernel.
// Covered by tests/ops (the CPU rows for bf16/f16 all go through upcast_f32).
#include "ops/composite.h"

#include "ops/ops.h"

namespace lathe {

namespace {

constexpr OpId kUpcastOps[] = {
    OpId::matmul,  OpId::add,    OpId::mul,     OpId::scale,   OpId::sum,     OpId::mean,
    OpId::softmax, OpId::softmax_backward,  OpId::silu,  OpId::silu_backward, OpId::swiglu,
    OpId::swiglu_backward, OpId::embedding, OpId::embedding_backward, OpId::rmsnorm, OpId::rmsnorm_backward,
    OpId::residual_rmsnorm, OpId::residual_rmsnorm_backward, OpId::gated_rmsnorm, OpId::gated_rmsnorm_backward,
    OpId::rope, OpId::attention, OpId::attention_backward, OpId::cross_entropy, OpId::cross_entropy_slice, OpId::grouped_matmul,
    OpId::grouped_matmul_weight_grad, OpId::gather_sum};  // not the routed grouped GEMMs: their callers fall back to
                                                          // host groups where no kernel of the exact dtype runs

// Tensors of the call's low-precision dtype are widened; index and f32 statistics tensors pass through.
void run_upcast(const OpCall& call, ExecContext& ctx) {
  const DType narrow = call.key_dtype();
  OpCall wide{call.op, {}, {}, call.attrs};
  for (const Tensor& t : call.inputs) wide.inputs.push_back(t.dtype() == narrow ? cast(ctx, t, DType::F32) : t);
  // Ops that read their output's current contents (matmul with beta, embedding_backward accumulating) get it widened.
  const bool reads_output = (call.op == OpId::matmul && call.attr<MatmulAttrs>().beta != 0.0f) ||
                            (call.op == OpId::embedding_backward && call.attr<EmbeddingAttrs>().accumulate);
  for (const Tensor& t : call.outputs) {
    const DType dt = t.dtype() == narrow ? DType::F32 : t.dtype();
    wide.outputs.push_back(reads_output ? cast(ctx, t, dt) : Tensor::empty(t.shape(), dt, ctx.allocator));
  }
  run_op(ctx, wide);
  for (size_t i = 0; i < call.outputs.size(); ++i)
    run_op(ctx, OpCall{OpId::cast, {wide.outputs[i]}, {call.outputs[i]}, CastAttrs{call.outputs[i].dtype()}});
}

// Whether `op` runs: a kernel of its own, or (bf16/f16) an f32 kernel that upcast_f32 can use.
bool op_runs(const KernelRegistry& reg, OpId op, DeviceType dev, DType dt) {
  return reg.has_kernel(op, dev, dt) ||
         ((dt == DType::BF16 || dt == DType::F16) && reg.has_kernel(op, dev, DType::F32));
}

// (T, n, D) heads [first, first + n) of qkv (T, heads D), as a contiguous copy.
Tensor qkv_heads(ExecContext& ctx, const Tensor& qkv, int64_t first, int64_t n, int64_t d) {
  return contiguous(ctx, qkv.narrow(1, first * d, n * d)).view({qkv.size(0), n, d});
}

// The gate (0) or up (1) half of gu (..., 2 I) as a contiguous (rows, I) copy.
Tensor gu_half(ExecContext& ctx, const Tensor& gu, int64_t which) {
  const int64_t i = gu.size(-1) / 2;
  return contiguous(ctx, gu.view({-1, 2 * i}).narrow(1, which * i, i));
}

void run_swiglu_halves(const OpCall& c, ExecContext& ctx) {
  const Tensor& gu = c.inputs[0];
  copy_into(ctx, swiglu(ctx, gu_half(ctx, gu, 0), gu_half(ctx, gu, 1)).view(c.outputs[0].shape()), c.outputs[0]);
}

void run_swiglu_halves_backward(const OpCall& c, ExecContext& ctx) {
  const Tensor& gu = c.inputs[0];
  const Tensor g = gu_half(ctx, gu, 0);
  const std::vector<Tensor> d = swiglu_backward(ctx, g, gu_half(ctx, gu, 1), c.inputs[1].view(g.shape()));
  const Tensor dgu = c.outputs[0].view({g.size(0), 2 * g.size(1)});
  copy_into(ctx, d[0], dgu.narrow(1, 0, g.size(1)));  // each half straight into its columns
  copy_into(ctx, d[1], dgu.narrow(1, g.size(1), g.size(1)));
}

void run_qk_norm_rope(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<QkNormRopeAttrs>();
  const Tensor& qkv = c.inputs[0];
  const Tensor& pos = c.inputs[3];
  const int64_t d = c.inputs[1].size(0);
  copy_into(ctx, rope(ctx, rmsnorm(ctx, qkv_heads(ctx, qkv, 0, a.q_heads, d), c.inputs[1], a.norm), pos, a.rope),
            c.outputs[0]);
  copy_into(ctx,
            rope(ctx, rmsnorm(ctx, qkv_heads(ctx, qkv, a.q_heads, a.kv_heads, d), c.inputs[2], a.norm), pos, a.rope),
            c.outputs[1]);
  copy_into(ctx, qkv_heads(ctx, qkv, a.q_heads + a.kv_heads, a.kv_heads, d), c.outputs[2]);
}

void run_qk_norm_rope_backward(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<QkNormRopeAttrs>();
  const Tensor& qkv = c.inputs[0];
  const Tensor& pos = c.inputs[3];
  const int64_t t = qkv.size(0), d = c.inputs[1].size(0);
  RopeAttrs inverse = a.rope;
  inverse.inverse = true;
  const std::vector<Tensor> gq =
      rmsnorm_backward(ctx, qkv_heads(ctx, qkv, 0, a.q_heads, d), c.inputs[1], rope(ctx, c.inputs[4], pos, inverse),
                       a.norm);
  const std::vector<Tensor> gk = rmsnorm_backward(ctx, qkv_heads(ctx, qkv, a.q_heads, a.kv_heads, d), c.inputs[2],
                                                  rope(ctx, c.inputs[5], pos, inverse), a.norm);
  const Tensor& dqkv = c.outputs[0];  // each part straight into its columns
  copy_into(ctx, gq[0].view({t, -1}), dqkv.narrow(1, 0, a.q_heads * d));
  copy_into(ctx, gk[0].view({t, -1}), dqkv.narrow(1, a.q_heads * d, a.kv_heads * d));
  copy_into(ctx, c.inputs[6].view({t, -1}), dqkv.narrow(1, (a.q_heads + a.kv_heads) * d, a.kv_heads * d));
  copy_into(ctx, gq[1], c.outputs[1]);
  copy_into(ctx, gk[1], c.outputs[2]);
}

}  // namespace

void register_composites(KernelRegistry& r) {
  // Composites of other ops run wherever those run, directly or upcast.
  const auto parts_run = [](std::vector<OpId> parts) {
    return [parts](const OpCall& c, const KernelRegistry& reg) {
      const DeviceType dev = c.device().type;
      const DType dt = c.key_dtype();
      for (OpId op : parts)
        if (!op_runs(reg, op, dev, dt))
          return Support::no(fmt::format("no {} kernel for {} on {}", op_name(op), dtype_name(dt),
                                         device_type_name(dev)));
      return Support::yes();
    };
  };
  r.add(CompositeDef{OpId::mean, "composite/sum_then_scale", parts_run({OpId::sum, OpId::scale}),
                     [](const OpCall& c, ExecContext& ctx) {
                       const Tensor& x = c.inputs[0];
                       int64_t count = 1;
                       for (int d : normalize_reduce_dims(c.attr<ReduceAttrs>().dims, x.dim())) count *= x.size(d);
                       const Tensor s = sum(ctx, x, c.attr<ReduceAttrs>().dims, c.attr<ReduceAttrs>().keepdim);
                       run_op(ctx, OpCall{OpId::scale, {s}, {c.outputs[0]}, ScaleAttrs{1.0 / double(count)}});
                     }});
  // The list ops as one op per tensor (or group of four): what runs where no device fuses them (the CPU reference).
  const auto per_tensor_supports = [](OpId single) {
    return [single](const OpCall& c, const KernelRegistry& reg) {
      if (reg.has_kernel(single, c.device().type, c.key_dtype())) return Support::yes();
      return Support::no(fmt::format("no {} kernel for {} on {}", op_name(single), dtype_name(c.key_dtype()),
                                     device_type_name(c.device().type)));
    };
  };
  r.add(CompositeDef{OpId::sum_squares_list, "composite/per_tensor", per_tensor_supports(OpId::sum_squares),
                     [](const OpCall& c, ExecContext& ctx) {
                       for (size_t i = 0; i < c.inputs.size(); ++i)
                         sum_squares_into(ctx, c.inputs[i], c.outputs[0].narrow(0, int64_t(i), 1).view({}));
                     }});
  r.add(CompositeDef{OpId::adamw_list, "composite/per_tensor", per_tensor_supports(OpId::adamw),
                     [](const OpCall& c, ExecContext& ctx) {
                       const size_t outs = c.outputs.size() / (c.inputs.size() / 4);  // 3, or 4 with rounded_to
                       for (size_t g = 0; g < c.inputs.size() / 4; ++g) {
                         OpCall one{OpId::adamw, {}, {}, c.attrs};
                         one.inputs.assign(c.inputs.begin() + long(4 * g), c.inputs.begin() + long(4 * g + 4));
                         one.outputs.assign(c.outputs.begin() + long(outs * g),
                                            c.outputs.begin() + long(outs * g + outs));
                         run_op(ctx, one);
                       }
                     }});
  r.add(CompositeDef{OpId::swiglu_halves, "composite/swiglu_of_halves", parts_run({OpId::swiglu}),
                     run_swiglu_halves});
  r.add(CompositeDef{OpId::swiglu_halves_backward, "composite/swiglu_of_halves", parts_run({OpId::swiglu_backward}),
                     run_swiglu_halves_backward});
  r.add(CompositeDef{OpId::qk_norm_rope, "composite/norm_then_rope", parts_run({OpId::rmsnorm, OpId::rope}),
                     run_qk_norm_rope});
  r.add(CompositeDef{OpId::qk_norm_rope_backward, "composite/norm_then_rope",
                     parts_run({OpId::rmsnorm_backward, OpId::rope}), run_qk_norm_rope_backward});
  for (OpId op : kUpcastOps) {
    r.add(CompositeDef{op, "composite/upcast_f32",
                       [op](const OpCall& c, const KernelRegistry& reg) {
                         const DType dt = c.key_dtype();
                         if (dt != DType::BF16 && dt != DType::F16) return Support::no("only for bf16/f16 inputs");
                         if (!reg.has_kernel(op, c.device().type, DType::F32))
                           return Support::no(fmt::format("no f32 {} kernel on {}", op_name(op), c.device().str()));
                         return Support::yes();
                       },
                       run_upcast});
  }
}

}  // namespace lathe
