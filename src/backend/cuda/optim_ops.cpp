// Registration of the CUDA optimizer kernels: the AdamW step for f32 masters (key dtype f32) with f32, bf16 or f16
// gradients, optionally writing the bf16/f16 parameter too (attrs.rounded_to), and for bf16 states (key dtype bf16:
// the bf16 parameter is its own master, m and v bf16) with the same gradients. The bias corrections are computed here
// in double and handed to the kernel as floats. adamw_list (the same step over many tensors, one launch) uploads a
// table of the tensors' pointers through the stream's pinned staging (no wait) into a scratch buffer.
// Covered by the adamw and adamw_list op-check cases and tests/unit/test_optim.cpp.
#include <cmath>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/optim_launchers.h"
#include "backend/registry.h"

namespace lathe::cuda {

namespace {

Support adamw_supports(const OpCall& c) {
  const DType g = c.inputs[1].dtype();
  if (g != DType::F32 && g != DType::BF16 && g != DType::F16)
    return Support::no("cuda adamw takes f32, bf16 or f16 gradients");
  for (const Tensor& t : c.inputs)
    if (!t.is_contiguous()) return Support::no("inputs must be contiguous");
  for (const Tensor& t : c.outputs)
    if (!t.is_contiguous()) return Support::no("outputs must be contiguous");
  return Support::yes();
}

AdamWScalars scalars_of(const AdamWAttrs& a) {
  AdamWScalars s;
  s.beta1 = float(a.beta1);
  s.beta2 = float(a.beta2);
  s.one_minus_beta1 = float(1.0 - a.beta1);
  s.one_minus_beta2 = float(1.0 - a.beta2);
  s.step_size = float(a.lr / (1.0 - std::pow(a.beta1, double(a.step))));
  s.sqrt_bc2 = float(std::sqrt(1.0 - std::pow(a.beta2, double(a.step))));
  s.eps = float(a.eps);
  s.lr_wd = float(a.lr * a.weight_decay);
  s.grad_scale = float(a.grad_scale);
  return s;
}

void adamw_run(const OpCall& c, ExecContext& ctx) {
  const AdamWAttrs& a = c.attr<AdamWAttrs>();
  const AdamWScalars s = scalars_of(a);
  const bool with_param = a.rounded_to.has_value();
  launch_adamw(c.inputs[0].dtype(), c.inputs[1].dtype(), c.inputs[0].numel(), c.inputs[0].data_ptr(),
               c.inputs[1].data_ptr(), c.inputs[2].data_ptr(), c.inputs[3].data_ptr(), c.outputs[0].data_ptr(),
               c.outputs[1].data_ptr(), c.outputs[2].data_ptr(), a.rounded_to.value_or(DType::F32),
               with_param ? c.outputs[3].data_ptr() : nullptr, s, as_cuda(ctx.stream).handle());
}

void adamw_list_run(const OpCall& c, ExecContext& ctx) {
  const AdamWAttrs& a = c.attr<AdamWAttrs>();
  const bool with_param = a.rounded_to.has_value();
  const size_t groups = c.inputs.size() / 4, outs = with_param ? 4 : 3;
  std::vector<AdamWListEntry> table(groups);
  int64_t chunks = 0;
  for (size_t g = 0; g < groups; ++g) {
    const Tensor* in = &c.inputs[4 * g];
    const Tensor* out = &c.outputs[outs * g];
    AdamWListEntry& e = table[g];
    e = {in[0].data_ptr(), in[1].data_ptr(), in[2].data_ptr(), in[3].data_ptr(), out[0].data_ptr(),
         out[1].data_ptr(), out[2].data_ptr(), with_param ? out[3].data_ptr() : nullptr, in[0].numel(), chunks, 1};
    for (const void* p : {e.w, e.grad, e.m, e.v, static_cast<const void*>(e.w_out), static_cast<const void*>(e.m_out),
                          static_cast<const void*>(e.v_out), static_cast<const void*>(e.param)})
      if (p && reinterpret_cast<uintptr_t>(p) % 16 != 0) e.packed = 0;
    chunks += (e.n + kAdamWListChunk - 1) / kAdamWListChunk;
  }
  const int64_t bytes = int64_t(table.size() * sizeof(AdamWListEntry));
  const Tensor scratch = Tensor::empty({bytes}, DType::U8, ctx.allocator);  // released in stream order
  CudaStream& stream = as_cuda(ctx.stream);
  stream.upload_async(scratch.data_ptr(), table.data(), size_t(bytes));
  launch_adamw_list(c.inputs[0].dtype(), c.inputs[1].dtype(), a.rounded_to.value_or(DType::F32), with_param,
                    static_cast<const AdamWListEntry*>(scratch.data_ptr()), int(groups), chunks, scalars_of(a),
                    stream.handle());
}

}  // namespace

void register_cuda_optim_kernels(KernelRegistry& r) {
  r.add(KernelDef{OpId::adamw, DeviceType::CUDA, DType::F32, "cuda/adamw", adamw_supports, adamw_run});
  r.add(KernelDef{OpId::adamw, DeviceType::CUDA, DType::BF16, "cuda/adamw", adamw_supports, adamw_run});
  for (DType dt : {DType::F32, DType::BF16})
    r.add(KernelDef{OpId::adamw_list, DeviceType::CUDA, dt, "cuda/adamw_list", adamw_supports, adamw_list_run});
}

}  // namespace lathe::cuda
