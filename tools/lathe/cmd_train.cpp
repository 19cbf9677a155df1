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
#include "core/error.h"
#include "parallel_job.h"
#include "train/trainer.h"

namespace lathe::cli {

namespace {

struct Args {
  std::string config;
  std::vector<std::string> overrides;
  bool help_config = false;
  int nproc = 0;
};

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
      exit_code = start_local_ranks("train", args->config, args->overrides, config.device, args->nproc);
      return;
    }
    Runtime rt;
    std::optional<MpiSession> mpi;
    run_as_rank(env, [&] {
      const std::unique_ptr<ProcessGroups> groups = join_job(rt, config, env, mpi, "train");
      const TrainSummary s = run_training(rt, config, groups.get());
      if (!groups || groups->is_first()) print_summary(s, exit_code);  // the first rank reports
    });
  });
}

}  // namespace lathe::cli
