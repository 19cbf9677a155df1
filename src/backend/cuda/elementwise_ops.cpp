// Registration of the CUDA elementwise kernels: tensor checks, layouts, launch on the context's stream.
#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/launchers.h"
#include "backend/registry.h"
#include "ops/ops.h"

namespace lathe::cuda {

namespace {

// `t` seen through an output of shape `out` (numpy broadcasting).
StridedLayout layout_for(const Tensor& t, const Shape& out) {
  LATHE_CHECK(out.size() <= size_t(kMaxDims), "cuda: tensors of more than {} dims are not supported", kMaxDims);
  StridedLayout l;
  l.ndim = int(out.size());
  const size_t lead = out.size() - size_t(t.dim());
  for (size_t d = 0; d < out.size(); ++d) {
    l.shape[d] = out[d];
    l.stride[d] = (d < lead || t.size(int(d - lead)) == 1) ? 0 : t.strides()[d - lead];
  }
  return l;
}

bool plain(const Tensor& t, const Shape& out) { return t.is_contiguous() && t.shape() == out; }

Support elementwise_supports(const OpCall& call) {
  if (!call.outputs[0].is_contiguous()) return Support::no("output must be contiguous");
  if (call.outputs[0].dim() > kMaxDims) return Support::no("more than 8 dims");
  return Support::yes();
}

void run_binary(BinaryOp op, const OpCall& c, ExecContext& ctx) {
  const Tensor& out = c.outputs[0];
  const Tensor& a = c.inputs[0];
  const Tensor& b = c.inputs[1];
  launch_binary(op, a.dtype(), out.numel(), a.data_ptr(), layout_for(a, out.shape()), b.data_ptr(),
                layout_for(b, out.shape()), plain(a, out.shape()) && plain(b, out.shape()), out.data_ptr(),
                as_cuda(ctx.stream).handle());
}

void run_unary(UnaryOp op, double alpha, const OpCall& c, ExecContext& ctx) {
  const Tensor& out = c.outputs[0];
  const Tensor& x = c.inputs[0];
  launch_unary(op, x.dtype(), out.numel(), x.data_ptr(), layout_for(x, out.shape()), plain(x, out.shape()), alpha,
               out.data_ptr(), as_cuda(ctx.stream).handle());
}

void run_cast(const OpCall& c, ExecContext& ctx) {
  const Tensor& out = c.outputs[0];
  const Tensor& x = c.inputs[0];
  // Same dtype, rows to rows (a column slice in or out, concat_columns): a 2-D copy, whole rows at a time.
  if (x.dtype() == out.dtype() && rows_contiguous(x) && rows_contiguous(out) &&
      !(x.is_contiguous() && out.is_contiguous())) {
    if (out.numel() == 0) return;
    const size_t e = x.itemsize();
    LATHE_CUDA_CHECK(cudaMemcpy2DAsync(out.data_ptr(), size_t(leading_dim(out)) * e, x.data_ptr(),
                                       size_t(leading_dim(x)) * e, size_t(out.size(1)) * e, size_t(out.size(0)),
                                       cudaMemcpyDeviceToDevice, as_cuda(ctx.stream).handle()));
    return;
  }
  launch_cast(x.dtype(), out.dtype(), out.numel(), x.data_ptr(), layout_for(x, out.shape()), plain(x, out.shape()),
              out.data_ptr(), layout_for(out, out.shape()), out.is_contiguous(), as_cuda(ctx.stream).handle());
}

}  // namespace

void register_cuda_elementwise_kernels(KernelRegistry& r) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    r.add(KernelDef{OpId::add, DeviceType::CUDA, dt, "cuda/broadcast_add", elementwise_supports,
                    [](const OpCall& c, ExecContext& ctx) { run_binary(BinaryOp::add, c, ctx); }});
    r.add(KernelDef{OpId::mul, DeviceType::CUDA, dt, "cuda/broadcast_mul", elementwise_supports,
                    [](const OpCall& c, ExecContext& ctx) { run_binary(BinaryOp::mul, c, ctx); }});
    r.add(KernelDef{OpId::silu_backward, DeviceType::CUDA, dt, "cuda/silu_backward", elementwise_supports,
                    [](const OpCall& c, ExecContext& ctx) { run_binary(BinaryOp::silu_backward, c, ctx); }});
    r.add(KernelDef{OpId::scale, DeviceType::CUDA, dt, "cuda/scale", elementwise_supports,
                    [](const OpCall& c, ExecContext& ctx) { run_unary(UnaryOp::scale, c.attr<ScaleAttrs>().alpha, c, ctx); }});
    r.add(KernelDef{OpId::silu, DeviceType::CUDA, dt, "cuda/silu", elementwise_supports,
                    [](const OpCall& c, ExecContext& ctx) { run_unary(UnaryOp::silu, 0.0, c, ctx); }});
  }
  for (DType dt : kAllDTypes) {
    if (!cast_supported(dt)) continue;
    r.add(KernelDef{OpId::cast, DeviceType::CUDA, dt, "cuda/cast",
                    [](const OpCall& c) {
                      if (!cast_supported(c.outputs[0].dtype()))
                        return Support::no("cuda cast covers f32, f64, bf16, f16, i32, i64");
                      if (c.outputs[0].dim() > kMaxDims) return Support::no("more than 8 dims");
                      return Support::yes();  // strided outputs too (copy_into)
                    },
                    run_cast});
  }
}

}  // namespace lathe::cuda
