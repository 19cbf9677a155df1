// `lathe train CONFIG.yaml [--set key.path=value ...]`: supervised fine-tuning (src/train/trainer.h).
// `lathe train --help-config` lists every option with its type, default and meaning.
#include <fmt/format.h>

#include <cstdio>
#include <optional>

#include "commands.h"
#include "comm/launch.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "parallel/process_groups.h"
#include "train/trainer.h"

namespace lathe::cli {

void add_train_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("train", "Supervised fine-tuning (or training from scratch) from a YAML config");
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    bool help_config = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("config", args->config, "YAML config file");
  cmd->add_option("--set", args->overrides, "override an option: key.path=value (repeatable)");
  cmd->add_flag("--help-config", args->help_config, "list every config option");
  cmd->callback([args, &exit_code] {
    if (args->help_config) {
      fmt::print("lathe train options (YAML keys; --set key=value overrides):\n{}", train_config_help());
      exit_code = 0;
      return;
    }
    LATHE_CHECK(!args->config.empty() || !args->overrides.empty(), "train: give a config file (see --help-config)");
    const TrainConfig config = load_train_config(args->config, args->overrides);
    // A parallel launch (mpirun, srun): MPI for the whole run, and the process groups of the layout — checked before
    // any weight is loaded.
    const LaunchEnv env = launch_env();
    const ParallelSizes sizes{int(config.tp), int(config.cp), int(config.ep), int(config.dp), int(config.pp)};
    std::optional<MpiSession> mpi;
    std::unique_ptr<ProcessGroups> groups;
    if (env.world > 1) {
      LATHE_CHECK(mpi_available(), "train: launched as {} ranks by {}, but this lathe was built without MPI (install "
                  "libopenmpi-dev and rebuild)", env.world, env.launcher);
      LATHE_CHECK(config.device == "cpu", "train: a run of {} ranks on {}: multi-GPU data parallelism needs the NCCL data "
                  "plane, which is not built yet; on the CPU, MPI runs it (device: cpu)", env.world, config.device);
      mpi.emplace();
      groups = make_process_groups(mpi_world(config.timeout_s), sizes);
    } else {
      LATHE_CHECK(config.dp <= 1, "train: parallel.dp = {0} needs {0} ranks, but this is one process: launch them with "
                  "`mpirun -np {0} lathe train CONFIG` (docs/parallel.md)", config.dp);
    }
    const bool first = !groups || groups->is_first();
    TrainSummary s;
    try {
      s = run_training(config, groups.get());
    } catch (const std::exception& e) {
      if (!groups) throw;
      // One rank's error ends every rank at once (a rank left waiting in a collective would only time out).
      fmt::print(stderr, "lathe: error: rank {}: {}\n", groups->rank, e.what());
      std::fflush(stderr);
      mpi_abort_job(1);
      throw;
    }
    if (!first) return;  // the first rank reports
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
  });
}

}  // namespace lathe::cli
