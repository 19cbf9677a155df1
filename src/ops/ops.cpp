// Op functions: validate, allocate outputs on the context's device, resolve and run.
#include "ops/ops.h"

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

Tensor matmul(ExecContext& ctx, const Tensor& a, const Tensor& b, MatmulAttrs attrs) {
  return call_op(ctx, OpId::matmul, {contiguous(ctx, a), contiguous(ctx, b)}, attrs)[0];
}

void matmul_into(ExecContext& ctx, const Tensor& a, const Tensor& b, Tensor& out, MatmulAttrs attrs) {
  OpCall call{OpId::matmul, {contiguous(ctx, a), contiguous(ctx, b)}, {out}, attrs};
  const TensorSpec spec = infer_outputs(OpId::matmul, call.inputs, call.attrs)[0];
  LATHE_CHECK(out.shape() == spec.shape && out.dtype() == spec.dtype && out.is_contiguous(),
              "ops: matmul_into output {} should be a contiguous {}{}", out.describe(), dtype_name(spec.dtype),
              shape_str(spec.shape));
  run_op(ctx, call);
}

Tensor add(ExecContext& ctx, const Tensor& a, const Tensor& b) { return call_op(ctx, OpId::add, {a, b})[0]; }
Tensor mul(ExecContext& ctx, const Tensor& a, const Tensor& b) { return call_op(ctx, OpId::mul, {a, b})[0]; }

Tensor scale(ExecContext& ctx, const Tensor& x, double alpha) {
  return call_op(ctx, OpId::scale, {x}, ScaleAttrs{alpha})[0];
}

Tensor cast(ExecContext& ctx, const Tensor& x, DType to) { return call_op(ctx, OpId::cast, {x}, CastAttrs{to})[0]; }

Tensor contiguous(ExecContext& ctx, const Tensor& x) {
  return x.is_contiguous() ? x : cast(ctx, x, x.dtype());
}

Tensor sum(ExecContext& ctx, const Tensor& x, std::vector<int> dims, bool keepdim) {
  return call_op(ctx, OpId::sum, {x}, ReduceAttrs{std::move(dims), keepdim})[0];
}

Tensor mean(ExecContext& ctx, const Tensor& x, std::vector<int> dims, bool keepdim) {
  return call_op(ctx, OpId::mean, {x}, ReduceAttrs{std::move(dims), keepdim})[0];
}

Tensor softmax(ExecContext& ctx, const Tensor& x) { return call_op(ctx, OpId::softmax, {contiguous(ctx, x)})[0]; }

Tensor softmax_backward(ExecContext& ctx, const Tensor& y, const Tensor& dy) {
  return call_op(ctx, OpId::softmax_backward, {contiguous(ctx, y), contiguous(ctx, dy)})[0];
}

Tensor silu(ExecContext& ctx, const Tensor& x) { return call_op(ctx, OpId::silu, {x})[0]; }

Tensor silu_backward(ExecContext& ctx, const Tensor& x, const Tensor& dy) {
  return call_op(ctx, OpId::silu_backward, {x, dy})[0];
}

}  // namespace lathe
