// `lathe plan CONFIG.yaml --nproc N [--set key=value ...] [--memory-gib G] [--json]`: before launch, each layout of N
// ranks (tp x cp x dp x ZeRO stage) with the memory one rank needs for it, whether that fits, and its communication per
// step (src/train/plan.h, docs/plan.md). Every problem with the input (the config, N, the memory) is a usage error:
// exit 2. Covered by tests/e2e/test_plan_cli.cpp.
#include <fmt/format.h>
#include <unistd.h>

#include "backend/runtime.h"
#include "cli_support.h"
#include "commands.h"
#include "core/error.h"
#include "train/plan.h"

namespace lathe::cli {

namespace {

struct Args {
  std::string config;
  std::vector<std::string> overrides;
  int64_t nproc = 1;
  double memory_gib = 0;  // 0: the device's
  bool json = false;
};

// One device's memory: the host's for a CPU run; a GPU's own size where this machine has that GPU.
int64_t device_memory_bytes(const TrainConfig& c) {
  const Device device = parse_device(c.device);
  if (device.is_cpu()) return int64_t(sysconf(_SC_PHYS_PAGES)) * int64_t(sysconf(_SC_PAGE_SIZE));
  Runtime rt;
  std::string why;
  LATHE_CHECK(rt.has_device(device, &why),
              "plan: the config trains on {}, whose memory this machine cannot tell ({}): give --memory-gib", c.device,
              why);
  return rt.backend(device.type).info(device.index).total_memory;
}

void run_plan(const Args& a) {
  const TrainConfig config = load_train_config(a.config, a.overrides);
  const int64_t memory = a.memory_gib > 0 ? int64_t(a.memory_gib * 1073741824.0) : device_memory_bytes(config);
  const auto config_at = [&](const PlanLayout& layout) {
    std::vector<std::string> overrides = a.overrides;
    for (std::string& o : layout_overrides(layout)) overrides.push_back(std::move(o));
    return load_train_config(a.config, overrides);
  };
  const TrainingPlan plan = plan_layouts(config, a.nproc, memory, config_at);
  if (a.json) fmt::print("{}\n", plan_to_json(plan).dump(2));
  else fmt::print("{}", format_plan(plan));
}

}  // namespace

void add_plan_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("plan", "Per-rank memory and communication of each parallel layout, before launch");
  auto args = std::make_shared<Args>();
  cmd->add_option("config", args->config, "YAML config file (the one lathe train reads)")->required();
  cmd->add_option("--set", args->overrides, "override an option: key.path=value (repeatable)");
  cmd->add_option("--nproc", args->nproc, "the number of ranks to lay out")->check(number_in(1, 65536));
  cmd->add_option("--memory-gib", args->memory_gib,
                  "one device's memory in GiB (default: the host's on cpu, the GPU's on cuda where present)")
      ->check(number_in(1.0 / 1024));
  cmd->add_flag("--json", args->json, "print the plan as JSON");
  cmd->callback([args, &exit_code] {
    try {
      run_plan(*args);
      exit_code = 0;
    } catch (const Error& e) {  // the input cannot be planned: a usage error
      std::fprintf(stderr, "lathe: error: %s\n", e.what());
      exit_code = 2;
    }
  });
}

}  // namespace lathe::cli
