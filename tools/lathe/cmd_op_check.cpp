// `lathe op-check`: runs the op test harness (src/testing/op_check.h) on this machine's devices, so an
// installed build can check every CUDA kernel against the CPU reference.
#include <fmt/format.h>

#include "backend/runtime.h"
#include "commands.h"
#include "testing/op_check.h"

namespace lathe::cli {

void add_op_check_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("op-check", "Check every kernel against the CPU reference (and finite differences)");
  struct Args {
    std::string op, params, device = "all";
    std::vector<std::string> dtypes;
    bool verbose = false, no_fd = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--op", args->op, "Only this op (e.g. matmul)");
  cmd->add_option("--params", args->params, "Only cases whose parameters contain this text (e.g. ta=1)");
  cmd->add_option("--device", args->device, "cpu, cuda, cuda:N or all")->capture_default_str();
  cmd->add_option("--dtype", args->dtypes, "Only these dtypes (f32, bf16, ...)");
  cmd->add_flag("--no-fd", args->no_fd, "Skip the finite-difference checks");
  cmd->add_flag("-v,--verbose", args->verbose, "Print every check, not only failures");
  cmd->callback([args, &exit_code] {
    Runtime rt;
    OpCheckOptions o;
    o.op = args->op;
    o.params = args->params;
    o.finite_differences = !args->no_fd;
    for (const std::string& d : args->dtypes) o.dtypes.push_back(dtype_from_name(d));
    if (args->device == "cuda") {
      rt.check_device(Device::cuda(0));
      for (int i = 0; i < rt.backend(DeviceType::CUDA).device_count(); ++i) o.devices.push_back(Device::cuda(i));
    } else if (args->device != "all") {
      o.devices.push_back(parse_device(args->device));
      rt.check_device(o.devices.back());
    }
    if (!o.op.empty()) op_from_name(o.op);  // reject unknown op names up front
    std::string why;
    if (args->device == "all" && !rt.has_device(Device::cuda(0), &why)) fmt::print("op-check: cuda skipped: {}\n", why);
    int passed = 0, failed = 0, skipped = 0;
    const auto report = [&](const OpCheckResult& r) {
      const char* tag = r.status == OpCheckResult::Status::Pass ? "PASS" : r.status == OpCheckResult::Status::Fail ? "FAIL" : "SKIP";
      (r.status == OpCheckResult::Status::Pass ? passed : r.status == OpCheckResult::Status::Fail ? failed : skipped)++;
      if (args->verbose || r.status == OpCheckResult::Status::Fail)
        fmt::print("[{}] {:<7} {:<5} {:<17} {:<40} {:<26} {}\n", tag, r.device, r.dtype, r.op, r.params, r.kernel, r.detail);
    };
    run_op_check(rt, o, report);
    fmt::print("op-check: {} passed, {} failed, {} skipped\n", passed, failed, skipped);
    exit_code = failed ? 1 : 0;
  });
}

}  // namespace lathe::cli
