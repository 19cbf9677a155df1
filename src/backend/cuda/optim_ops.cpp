// Registration of the CUDA optimizer kernels: the AdamW step for f32 masters (key dtype f32) with f32, bf16 or f16
// gradients, optionally writing the bf16/f16 parameter too (attrs.rounded_to), and for bf16 states (key dtype bf16:
// the bf16 parameter is its own master, m and v bf16) with the same gradients. The bias corrections are computed here
// in double and handed to the kernel as floats.
// Covered by the adamw op-check cases and tests/unit/test_optim.cpp.
#include <cmath>

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

void adamw_run(const OpCall& c, ExecContext& ctx) {
  const AdamWAttrs& a = c.attr<AdamWAttrs>();
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
  const bool with_param = a.rounded_to.has_value();
  launch_adamw(c.inputs[0].dtype(), c.inputs[1].dtype(), c.inputs[0].numel(), c.inputs[0].data_ptr(),
               c.inputs[1].data_ptr(), c.inputs[2].data_ptr(), c.inputs[3].data_ptr(), c.outputs[0].data_ptr(),
               c.outputs[1].data_ptr(), c.outputs[2].data_ptr(), a.rounded_to.value_or(DType::F32),
               with_param ? c.outputs[3].data_ptr() : nullptr, s, as_cuda(ctx.stream).handle());
}

}  // namespace

void register_cuda_optim_kernels(KernelRegistry& r) {
  r.add(KernelDef{OpId::adamw, DeviceType::CUDA, DType::F32, "cuda/adamw", adamw_supports, adamw_run});
  r.add(KernelDef{OpId::adamw, DeviceType::CUDA, DType::BF16, "cuda/adamw", adamw_supports, adamw_run});
}

}  // namespace lathe::cuda
