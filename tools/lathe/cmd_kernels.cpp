// `lathe kernels`: for this machine, which implementation every op resolves to per device and dtype, and
// why a fallback was taken.
#include <fmt/format.h>

#include "backend/runtime.h"
#include "commands.h"
#include "ops/ops.h"
#include "testing/op_check.h"

namespace lathe::cli {

namespace {

void print_device(Runtime& rt, Device device) {
  ExecContext ctx = rt.context(device);
  const DeviceInfo info = ctx.backend.info(device.index);
  fmt::print("\n{} — {}{}\n", device.str(), info.name, info.details.empty() ? "" : " (" + info.details + ")");
  const std::vector<OpCase> cases = all_op_cases();
  for (int op = 0; op < kOpCount; ++op) {
    const auto it = std::find_if(cases.begin(), cases.end(), [&](const OpCase& c) { return int(c.op) == op; });
    if (it == cases.end()) continue;
    for (DType dtype : kAllDTypes) {
      if (std::find(it->dtypes.begin(), it->dtypes.end(), dtype) == it->dtypes.end()) continue;
      OpCall call{it->op, {}, {}, it->attrs};
      for (size_t i = 0; i < it->inputs.size(); ++i) {
        const bool index = i < it->index_values.size() && !it->index_values[i].empty();
        if (index) {  // the case's own values: predicates may read them (cu_seqlens for cuDNN attention)
          const std::vector<int32_t> v(it->index_values[i].begin(), it->index_values[i].end());
          call.inputs.push_back(rt.from_host(v.data(), it->inputs[i], DType::I32, device));
        } else {
          call.inputs.push_back(Tensor::empty(it->inputs[i], op_case_input_dtype(*it, i, dtype), ctx.allocator));
        }
      }
      for (const TensorSpec& spec : infer_outputs(it->op, call.inputs, call.attrs))
        call.outputs.push_back(Tensor::empty(spec.shape, spec.dtype, ctx.allocator));
      Resolution r;
      std::string why;
      if (!rt.registry().try_resolve(call, &r, &why)) {
        fmt::print("  {:<18} {:<5} unsupported: {}\n", op_name(it->op), dtype_name(dtype), why);
      } else if (r.is_composite) {
        fmt::print("  {:<18} {:<5} {} (fallback: {})\n", op_name(it->op), dtype_name(dtype), r.name, r.fallback_reason);
      } else {
        fmt::print("  {:<18} {:<5} {}\n", op_name(it->op), dtype_name(dtype), r.name);
      }
    }
  }
}

}  // namespace

void add_kernels_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("kernels", "Show which kernel each op resolves to on this machine");
  cmd->callback([&exit_code] {
    Runtime rt;
    fmt::print("lathe kernels: {} registered kernels, {} composites\n", rt.registry().kernels().size(),
               rt.registry().composites().size());
    print_device(rt, Device::cpu());
    std::string why;
    if (!rt.has_device(Device::cuda(0), &why)) {
      fmt::print("\ncuda: unavailable: {}\n", why);
    } else {
      for (int i = 0; i < rt.backend(DeviceType::CUDA).device_count(); ++i) print_device(rt, Device::cuda(i));
    }
    exit_code = 0;
  });
}

}  // namespace lathe::cli
