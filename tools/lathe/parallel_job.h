// How `lathe train` and `lathe rl` run as several ranks: joining the job's process groups (mpirun, srun or --nproc),
// the parent of a --nproc launch starting its ranks, and one rank's error ending every rank (docs/parallel.md).
// Covered by tests/e2e/test_train_dp.cpp.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/launch.h"
#include "comm/mpi_communicator.h"
#include "model/causal_lm.h"
#include "parallel/process_groups.h"
#include "rl/rl_source.h"
#include "train/config.h"

namespace lathe::cli {

// A parallel launch: the communicators of this rank's groups, checked against the layout before any weight is loaded
// (comm/launch.h join_world: MPI for CPU ranks, NCCL for GPU ranks; `config.device` becomes this rank's GPU); nullptr
// for one process (which parallel.dp > 1 refuses, saying how to launch). `who`: the subcommand, for messages.
std::unique_ptr<ProcessGroups> join_job(Runtime& rt, TrainConfig& config, const LaunchEnv& env,
                                        std::optional<MpiSession>& mpi, const std::string& who);

// rl.mode: async: the launch's ranks split into training ranks (the first world - R) and rollout ranks (the last R =
// rl.rollout_ranks, half by default), with every communicator between them made here, in one order on every rank:
// the training ranks' world (and, for more than one, their process groups: dp x tp x cp x ep x pp), the rollout
// ranks' world (under rl.rollout_tp also each engine's tp group and the groups across the engines), and the sync group
// of the first training rank and the rollout ranks. A layout the launch cannot hold, or one not built for async yet
// (LoRA under tp, ep or rl.rollout_tp), is refused naming it. `config.device` becomes this rank's GPU.
struct AsyncJob {
  std::unique_ptr<Communicator> world, side, sync, rollout_tp, rollout_dp;
  std::unique_ptr<ProcessGroups> groups;  // a training rank's, with more than one training rank
  AsyncRanks ranks;
  int training_ranks = 0, rollout_ranks = 0;
};
AsyncJob join_async_job(Runtime& rt, TrainConfig& config, const LaunchEnv& env, std::optional<MpiSession>& mpi);

// The parent of `lathe WHO ... --nproc N`: starts N ranks of `lathe rank_args...` (WHO and its arguments, without
// --nproc) on this machine's GPUs and returns how they ended (an exit code). GPU ranks only: a CPU `device` is refused,
// pointing to `mpirun -np N lathe WHO USAGE` (CPU ranks talk over MPI).
int start_local_ranks(const std::string& who, const std::vector<std::string>& rank_args, const std::string& device,
                      int nproc, const std::string& usage);
// The same for `lathe WHO CONFIG [--set ...] --nproc N` (lathe train, lathe rl).
int start_local_ranks(const std::string& who, const std::string& config_path, const std::vector<std::string>& overrides,
                      const std::string& device, int nproc);

// The ranks of a parallel `lathe generate` / `lathe logprobs` over input lines: the world, and with `--tp T` its
// ranks in groups of T (ParallelGrid order: tp fastest), each group one model replica. The lines go to the replicas
// (replica d: lines d, d + replicas, ...); every rank of a replica computes them, and its first rank sends them to rank
// 0, which writes them in input order (in_input_order).
struct LineRanks {
  std::unique_ptr<ProcessGroups> groups;  // with tp or cp > 1
  std::unique_ptr<Communicator> alone;    // the world without them
  Communicator* world = nullptr;          // nullptr: one process
  Communicator* tp = nullptr;             // the replica's tensor-parallel group (ModelOptions::tp)
  Communicator* cp = nullptr;             // the replica's context-parallel group (ModelOptions::cp)
  Communicator* ep = nullptr;             // the expert-parallel group (ModelOptions::ep): replicas that split experts
  Communicator* pp = nullptr;             // the replica's pipeline (ModelOptions::pp): its stages
  int replica = 0, replicas = 1;
  // This rank's place in its replica (tp fastest, then cp, then pp; 0: the rank that sends the replica's lines), and
  // the rank distance between two replicas' first ranks (tp x cp).
  int member = 0, members = 1;
  bool writer() const { return !world || world->rank() == 0; }
  // The replica's groups in `o` (tp, cp, ep; with a pipeline, pp and its stages over the layers of the model in
  // `model_dir`, as even as they go).
  void place(ModelOptions& o, const std::string& model_dir) const;
  // Every replica's output lines (`mine`: this rank's, in its own order) on the writer, in input order, `lines` in all;
  // empty on the other ranks. A collective under a parallel launch (gather_lines over the world).
  std::vector<std::string> in_input_order(Runtime& rt, Device device, const std::vector<std::string>& mine,
                                          size_t lines) const;
};
// `world` (nullptr: one process) split for `--tp tp`, `--cp cp` and `--pp pp` (a replica is tp x cp x pp ranks) and
// `--ep ep` (ep replicas share one copy of the experts, each holding ep-th of them); refused when they do not fit the
// launch. `who`: for messages.
LineRanks line_ranks(std::unique_ptr<Communicator> world, int tp, int cp, int ep, int pp, const std::string& who);

// Runs `body` as this rank's work; under a parallel launch an error on this rank ends every rank at once (a rank left
// waiting in a collective would only time out), after printing it with the rank's number.
void run_as_rank(const LaunchEnv& env, const std::function<void()>& body);

}  // namespace lathe::cli
