// `lathe rl CONFIG.yaml [--set key.path=value ...]`: reinforcement learning (GRPO, Dr. GRPO, DAPO, GSPO) on the
// trainer's own weights, colocated: each rollout comes from the rollout engine over the policy being trained, its
// updates are the trainer's steps (src/rl/rl_source.h, src/train/trainer.h StepSource). The config is lathe train's
// with data.train holding prompts and the rl.* options; `lathe rl --help-config` lists them all. rl.warm_start names a
// `lathe train` config run first (resumed or found finished like any run) whose final model the policy starts from.
// Checkpoints, resume (resume: auto), metrics, TensorBoard and the final HF / PEFT export are the trainer's.
// Data parallelism (parallel.dp = N): `mpirun -np N lathe rl ...` (CPU or GPU), srun, or `lathe rl ... --nproc N` (GPUs
// of one machine); each rank samples and trains its share of every rollout's groups (rl_source.h). A warm start under
// several ranks must have finished already (run it first in one process), so that no two ranks train it.
#include <fmt/format.h>

#include <filesystem>

#include "backend/runtime.h"
#include "cli_support.h"
#include "commands.h"
#include "core/error.h"
#include "parallel_job.h"
#include "rl/rl_source.h"
#include "train/trainer.h"

namespace lathe::cli {

namespace {

struct Args {
  std::string config;
  std::vector<std::string> overrides;
  bool help_config = false;
  int nproc = 0;
};

std::string accuracy(double a) { return a >= 0 ? fmt::format("{:.1f}%", 100 * a) : "-"; }

// The warm start's SFT run, on the RL run's device: trained (or continued, or found finished) before the RL run reads
// its final model.
void warm_start(const std::string& path, const std::string& device, const LaunchEnv& env) {
  const TrainConfig sft = load_train_config(path, {"device=" + device});
  if (env.world > 1) {  // several ranks: the warm start must be done already (a Trainer reads and checks, writes nothing)
    Runtime rt;
    LATHE_CHECK(Trainer(rt, sft).finished(), "rl: the warm start {} has not finished (output {}): under {} ranks run it "
                "first in one process (`lathe train {}`, or `lathe rl` without the parallel launch), then launch the "
                "ranks", path, sft.output_dir, env.world, path);
    if (env.rank == 0) fmt::print("rl: warm start {} already trained; starting RL from {}/final\n", path, sft.output_dir);
    return;
  }
  fmt::print("rl: warm start: lathe train {} (output {})\n", path, sft.output_dir);
  std::fflush(stdout);
  const TrainSummary s = run_training(sft);
  const JobSummary& j = s.jobs[0];
  LATHE_CHECK(!j.failed, "rl: the warm start {} failed: {}", path, j.error);
  if (s.already_finished)
    fmt::print("rl: warm start already trained ({} steps{}); starting RL from {}/final\n", j.final_step,
               j.final_eval_accuracy >= 0 ? ", held-out accuracy " + accuracy(j.final_eval_accuracy) : "",
               sft.output_dir);
  else
    fmt::print("rl: warm start trained {} steps, loss {:.4f} -> {:.4f}{}\n", j.steps_run, j.first_loss, j.last_loss,
               j.final_eval_accuracy >= 0 ? ", held-out accuracy " + accuracy(j.final_eval_accuracy) : "");
}

// The run's last lines (the first rank's): one per tenant; returns the exit code (4 when a tenant failed, as lathe
// train's).
int report(const TrainSummary& s) {
  int failed = 0;
  for (const JobSummary& j : s.jobs) {
    const std::string who = j.name.empty() ? "rl" : "rl: tenant " + j.name;
    if (s.already_finished) {
      fmt::print("{}: {} already finished at step {}{}; nothing to do. Raise train.max_steps to train on, or set "
                 "overwrite: true to start again.\n",
                 who, j.output_dir, j.final_step,
                 j.final_eval_accuracy >= 0 ? ", held-out accuracy " + accuracy(j.final_eval_accuracy) : "");
    } else if (j.failed) {
      ++failed;
      fmt::print("{}: FAILED at step {}: {}\n", who, j.final_step, j.error);
    } else if (j.steps_run == 0) {
      fmt::print("{}: trained to step {} already; its final outputs are complete\n", who, j.final_step);
    } else {
      fmt::print("{}: {} steps{}\n", who, j.steps_run,
                 j.final_eval_accuracy >= 0
                     ? fmt::format(", held-out accuracy {} -> {}", accuracy(j.start_eval_accuracy),
                                   accuracy(j.final_eval_accuracy))
                     : "");
    }
  }
  return failed ? 4 : 0;
}

// rl.mode: async: the training ranks run the trainer on the groups the rollout ranks sample (parallel_job.h
// join_async_job, rl_source.h); returns the exit code.
int run_async(Runtime& rt, TrainConfig& config, const LaunchEnv& env, std::optional<MpiSession>& mpi) {
  AsyncJob job = join_async_job(rt, config, env, mpi);
  RlSource source(rt, config);  // reads and checks the prompts; writes nothing
  source.set_async(job.ranks);
  if (!job.ranks.trains) {
    source.serve();
    return 0;
  }
  if (job.world->rank() == 0)
    fmt::print("rl: async: {} training rank(s), {} rollout rank(s), max_staleness {}\n", job.training_ranks,
               job.rollout_ranks, config.rl.max_staleness);
  const TrainSummary s = run_training(rt, config, job.groups.get(), &source);
  source.end_async(parse_device(config.device));
  return job.world->rank() == 0 ? report(s) : 0;
}

}  // namespace

void add_rl_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("rl", "Reinforcement learning (GRPO, Dr. GRPO, DAPO, GSPO) from a YAML config");
  auto args = std::make_shared<Args>();
  cmd->add_option("config", args->config, "YAML config file");
  cmd->add_option("--set", args->overrides, "override an option: key.path=value (repeatable)");
  cmd->add_flag("--help-config", args->help_config, "list every config option");
  cmd->add_option("--nproc", args->nproc, "start N ranks on this machine, one per GPU (NCCL; no MPI needed)")
      ->check(number_in(1, 1024));
  cmd->callback([args, &exit_code] {
    if (args->help_config) {
      fmt::print("lathe rl options (YAML keys; --set key=value overrides; data.train holds the prompts):\n{}",
                 train_config_help(ConfigFor::rl));
      exit_code = 0;
      return;
    }
    LATHE_CHECK(!args->config.empty() || !args->overrides.empty(), "rl: give a config file (see --help-config)");
    TrainConfig config = load_train_config(args->config, args->overrides, ConfigFor::rl);
    const LaunchEnv env = launch_env();
    if (args->nproc > 1 && env.world == 1) {  // the parent of a --nproc job: start the ranks, report how they ended
      exit_code = start_local_ranks("rl", args->config, args->overrides, config.device, args->nproc);
      return;
    }
    if (!config.rl.warm_start.empty()) warm_start(config.rl.warm_start, config.device, env);
    // Each step's batch differs in shape (responses of any length): no step-wise memory plan.
    config.memory_plan = false;
    Runtime rt;
    std::optional<MpiSession> mpi;
    run_as_rank(env, [&] {
      if (config.rl.mode == "async") {
        exit_code = run_async(rt, config, env, mpi);
        return;
      }
      const std::unique_ptr<ProcessGroups> groups = join_job(rt, config, env, mpi, "rl");
      if (groups) check_rl_layout(config, groups->dp_size());
      RlSource source(rt, config);  // reads and checks the prompts; writes nothing
      const TrainSummary s = run_training(rt, config, groups.get(), &source);
      exit_code = !groups || groups->is_first() ? report(s) : 0;  // the first rank reports
    });
  });
}

}  // namespace lathe::cli
