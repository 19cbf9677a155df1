// `lathe train CONFIG.yaml [--set key.path=value ...]`: supervised fine-tuning (src/train/trainer.h).
// `lathe train --help-config` lists every option with its type, default and meaning. Parallel runs: `mpirun -np N lathe
// train ...` (CPU or GPU), `srun lathe train ...`, or `lathe train ... --nproc N` (GPUs on one machine; docs/parallel.md).
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <optional>

#include "backend/runtime.h"
#include "cli_support.h"
#include "commands.h"
#include "comm/launch.h"
#include "comm/local_launch.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "parallel/process_groups.h"
#include "train/trainer.h"

namespace lathe::cli {

namespace {

struct Args {
  std::string config;
  std::vector<std::string> overrides;
  bool help_config = false;
  int nproc = 0;
};

// A parallel launch: the communicators of this rank's groups, checked against the layout before any weight is loaded
// (comm/launch.h join_world: MPI for CPU ranks, NCCL for GPU ranks; `config.device` becomes this rank's GPU).
std::unique_ptr<ProcessGroups> join_job(Runtime& rt, TrainConfig& config, const LaunchEnv& env, std::optional<MpiSession>& mpi) {
  const ParallelSizes sizes{int(config.tp), int(config.cp), int(config.ep), int(config.dp), int(config.pp)};
  if (env.world == 1) {
    LATHE_CHECK(config.dp <= 1, "train: parallel.dp = {0} needs {0} ranks, but this is one process: launch them with "
                "`mpirun -np {0} lathe train CONFIG` (CPU or GPU) or `lathe train CONFIG --nproc {0}` (GPUs; "
                "docs/parallel.md)", config.dp);
    return nullptr;
  }
  const ParallelGrid check(env.world, sizes);  // an impossible layout is refused here, naming the constraint
  (void)check;
  std::unique_ptr<Communicator> world = join_world(rt, config.device, env, config.timeout_s, mpi, "train");
  const Device device = parse_device(config.device);  // this rank's
  return make_process_groups(std::move(world), sizes, rt.backend(device.type).create_stream(device.index));
}

void print_summary(const TrainSummary& s, int& exit_code) {
  if (s.already_finished) {  // a re-run of a finished run: say so, with what it recorded
    for (const JobSummary& j : s.jobs)
      fmt::print("{}: {} already finished at step {} (loss {:.4f} -> {:.4f}{}); nothing to do. Raise train.max_steps to "
                 "train on, or set overwrite: true to start again.\n",
                 j.name.empty() ? "train" : "tenant " + j.name, j.output_dir, j.final_step, j.first_loss, j.last_loss,
                 j.final_eval_accuracy >= 0 ? fmt::format(", final-eval accuracy {:.1f}%", 100 * j.final_eval_accuracy)
                                            : "");
    exit_code = 0;
    return;
  }
  int failed = 0;
  for (const JobSummary& j : s.jobs) {
    failed += j.failed;
    const std::string who = j.name.empty() ? "train" : "tenant " + j.name;
    if (j.failed) fmt::print("{}: FAILED at step {}: {}\n", who, j.final_step, j.error);
    else if (j.steps_run == 0)  // trained already: this run wrote what the earlier one had not
      fmt::print("{}: trained to step {} already; its final outputs are complete{}\n", who, j.final_step,
                 j.final_eval_accuracy >= 0 ? fmt::format(", final-eval accuracy {:.1f}%", 100 * j.final_eval_accuracy) : "");
    else
      fmt::print("{}: {} steps, loss {:.4f} -> {:.4f}{}\n", who, j.steps_run, j.first_loss, j.last_loss,
                 j.final_eval_accuracy >= 0 ? fmt::format(", final-eval accuracy {:.1f}%", 100 * j.final_eval_accuracy) : "");
  }
  // Some tenants failing is a failed run (exit 4) even though the others finished and wrote their outputs.
  exit_code = failed ? 4 : 0;
}

}  // namespace

void add_train_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("train", "Supervised fine-tuning (or training from scratch) from a YAML config");
  auto args = std::make_shared<Args>();
  cmd->add_option("config", args->config, "YAML config file");
  cmd->add_option("--set", args->overrides, "override an option: key.path=value (repeatable)");
  cmd->add_flag("--help-config", args->help_config, "list every config option");
  cmd->add_option("--nproc", args->nproc, "start N ranks on this machine, one per GPU (NCCL; no MPI needed)")
      ->check(number_in(1, 1024));
  cmd->callback([args, &exit_code] {
    if (args->help_config) {
      fmt::print("lathe train options (YAML keys; --set key=value overrides):\n{}", train_config_help());
      exit_code = 0;
      return;
    }
    LATHE_CHECK(!args->config.empty() || !args->overrides.empty(), "train: give a config file (see --help-config)");
    TrainConfig config = load_train_config(args->config, args->overrides);
    const LaunchEnv env = launch_env();
    if (args->nproc > 1 && env.world == 1) {  // the parent of a --nproc job: start the ranks, report how they ended
      LATHE_CHECK(config.device != "cpu", "train: --nproc starts GPU ranks (NCCL); CPU ranks talk over MPI: launch them "
                  "with `mpirun -np {} lathe train CONFIG`", args->nproc);
      std::vector<std::string> rank_args = {"train"};
      if (!args->config.empty()) rank_args.push_back(args->config);
      for (const std::string& o : args->overrides) rank_args.insert(rank_args.end(), {"--set", o});
      exit_code = run_local_ranks("/proc/self/exe", rank_args, args->nproc);
      return;
    }
    Runtime rt;
    std::optional<MpiSession> mpi;
    std::unique_ptr<ProcessGroups> groups;
    try {
      groups = join_job(rt, config, env, mpi);
      const TrainSummary s = run_training(rt, config, groups.get());
      if (!groups || groups->is_first()) print_summary(s, exit_code);  // the first rank reports
    } catch (const std::exception& e) {
      if (env.world == 1) throw;
      // One rank's error ends every rank at once (a rank left waiting in a collective would only time out).
      fmt::print(stderr, "lathe: error: rank {}: {}\n", env.rank, e.what());
      std::fflush(stderr);
      mpi_abort_job(1);
      std::_Exit(1);  // under --nproc the parent ends the other ranks
    }
  });
}

}  // namespace lathe::cli
