#include "backend/registry.h"

#include "backend/profiler.h"

namespace lathe {

void KernelRegistry::add(KernelDef kernel) {
  LATHE_ASSERT(kernel.supports && kernel.run && !kernel.name.empty());
  kernels_.push_back(std::move(kernel));
}

void KernelRegistry::add(CompositeDef composite) {
  LATHE_ASSERT(composite.supports && composite.run && !composite.name.empty());
  composites_.push_back(std::move(composite));
}

bool KernelRegistry::has_exact(const OpCall& call) const {
  const DeviceType dev = call.device().type;
  for (const KernelDef& k : kernels_)
    if (k.op == call.op && k.device == dev && k.dtype == call.key_dtype() && k.supports(call).ok) return true;
  return false;
}

bool KernelRegistry::has_kernel(OpId op, DeviceType device, DType dtype) const {
  for (const KernelDef& k : kernels_)
    if (k.op == op && k.device == device && k.dtype == dtype) return true;
  return false;
}

const KernelDef* KernelRegistry::find(OpId op, DeviceType device, DType dtype, const std::string& name) const {
  for (const KernelDef& k : kernels_)
    if (k.op == op && k.device == device && k.dtype == dtype && k.name == name) return &k;
  return nullptr;
}

bool KernelRegistry::try_resolve(const OpCall& call, Resolution* out, std::string* why) const {
  const DeviceType dev = call.device().type;
  std::vector<std::string> rejected;
  for (const KernelDef& k : kernels_) {
    if (k.op != call.op || k.device != dev || k.dtype != call.key_dtype()) continue;
    Support s = k.supports(call);
    if (s.ok) {
      *out = Resolution{k.name, false, {}, &k.run};
      return true;
    }
    rejected.push_back(fmt::format("{}: {}", k.name, s.reason));
  }
  // Exact kernels that exist but declined come first; with none at all, say so.
  if (rejected.empty())
    rejected.push_back(fmt::format("no {} kernel for {}", device_type_name(dev), dtype_name(call.key_dtype())));
  const std::string no_exact = fmt::format("{}", fmt::join(rejected, "; "));
  for (const CompositeDef& c : composites_) {
    if (c.op != call.op) continue;
    Support s = c.supports(call, *this);
    if (s.ok) {
      *out = Resolution{c.name, true, no_exact, &c.run};
      return true;
    }
    rejected.push_back(fmt::format("{}: {}", c.name, s.reason));
  }
  *why = fmt::format("{}", fmt::join(rejected, "; "));
  return false;
}

Resolution KernelRegistry::resolve(const OpCall& call) const {
  Resolution r;
  std::string why;
  LATHE_CHECK(try_resolve(call, &r, &why), "kernels: no kernel for op '{}' on {} with dtype {}: {}",
              op_name(call.op), call.device().str(), dtype_name(call.key_dtype()), why);
  return r;
}

Support outputs_contiguous(const OpCall& call) {
  for (const Tensor& t : call.outputs)
    if (!t.is_contiguous()) return Support::no("output must be contiguous");
  return Support::yes();
}

Support all_contiguous(const OpCall& call) {
  for (const Tensor& t : call.inputs)
    if (!t.is_contiguous()) return Support::no("inputs must be contiguous");
  return outputs_contiguous(call);
}

Support rows_layout(const OpCall& call) {
  for (const auto* list : {&call.inputs, &call.outputs})
    for (const Tensor& t : *list)
      if (!t.is_contiguous() && !rows_contiguous(t))
        return Support::no("operands must be contiguous or 2-D with contiguous rows");
  return Support::yes();
}

void run_op(ExecContext& ctx, const OpCall& call) {
  for (const Tensor& t : call.inputs)
    LATHE_CHECK(t.device() == ctx.device, "ops: {} input {} is not on {}", op_name(call.op), t.describe(),
                ctx.device.str());
  for (const Tensor& t : call.outputs)
    LATHE_CHECK(t.device() == ctx.device, "ops: {} output {} is not on {}", op_name(call.op), t.describe(),
                ctx.device.str());
  const Resolution r = ctx.registry.resolve(call);
  if (ctx.observer) (*ctx.observer)(call, r);
  if (!ctx.profiler) {
    (*r.run)(call, ctx);
    return;
  }
  struct Timed {  // ends the interval even when the kernel throws
    ExecContext& ctx;
    int token;
    ~Timed() { ctx.profiler->end(token, ctx.stream); }
  } timed{ctx, ctx.profiler->begin(call, r, ctx.stream)};
  (*r.run)(call, ctx);
}

}  // namespace lathe
