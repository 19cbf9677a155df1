// Several ranks of `lathe train` / `lathe rl` (parallel_job.h).
#include "parallel_job.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <cstdlib>

#include "backend/runtime.h"
#include "cli_support.h"
#include "comm/local_launch.h"
#include "core/error.h"
#include "model/config.h"

namespace lathe::cli {

std::unique_ptr<ProcessGroups> join_job(Runtime& rt, TrainConfig& config, const LaunchEnv& env,
                                        std::optional<MpiSession>& mpi, const std::string& who) {
  const ParallelSizes sizes{int(config.tp), int(config.cp), int(config.ep), int(config.dp), int(config.pp)};
  if (env.world == 1) {
    LATHE_CHECK(config.dp <= 1, "{0}: parallel.dp = {1} needs {1} ranks, but this is one process: launch them with "
                "`mpirun -np {1} lathe {0} CONFIG` (CPU or GPU) or `lathe {0} CONFIG --nproc {1}` (GPUs; "
                "docs/parallel.md)", who, config.dp);
    return nullptr;
  }
  const ParallelGrid check(env.world, sizes);  // an impossible layout is refused here, naming the constraint
  (void)check;
  std::unique_ptr<Communicator> world = join_world(rt, config.device, env, config.timeout_s, mpi, who);
  const Device device = parse_device(config.device);  // this rank's
  return make_process_groups(std::move(world), sizes, rt.backend(device.type).create_stream(device.index));
}

AsyncJob join_async_job(Runtime& rt, TrainConfig& config, const LaunchEnv& env, std::optional<MpiSession>& mpi) {
  AsyncJob job;
  job.rollout_ranks = int(config.rl.rollout_ranks > 0 ? config.rl.rollout_ranks : env.world / 2);
  job.training_ranks = env.world - job.rollout_ranks;
  LATHE_CHECK(env.world >= 2, "rl: rl.mode async runs rollout ranks beside training ranks: launch at least two (`mpirun "
              "-np 2 lathe rl CONFIG` on CPUs, or `lathe rl CONFIG --nproc 2` on the GPUs of one machine)");
  LATHE_CHECK(job.rollout_ranks < env.world, "rl: rl.rollout_ranks = {} leaves no training rank in a launch of {} ranks",
              job.rollout_ranks, env.world);
  const int64_t replica = config.tp * config.cp * config.pp;
  LATHE_CHECK(job.training_ranks % replica == 0, "rl: rl.mode async leaves {} training rank(s) of the {} launched ({} "
              "sample: rl.rollout_ranks), which parallel.tp x parallel.cp x parallel.pp = {} does not divide",
              job.training_ranks, env.world, job.rollout_ranks, replica);
  const int64_t dp = job.training_ranks / replica;
  LATHE_CHECK(config.dp == 0 || config.dp == dp, "rl: parallel.dp = {}, but rl.mode async leaves {} training rank(s) "
              "of the {} launched ({} sample: rl.rollout_ranks), which make dp {}: leave parallel.dp unset or make it {}",
              config.dp, job.training_ranks, env.world, job.rollout_ranks, dp, dp);
  config.dp = dp;
  check_rl_layout(config, dp);
  const int rollout_tp = int(config.rl.rollout_tp);
  LATHE_CHECK(job.rollout_ranks % rollout_tp == 0, "rl: rl.rollout_tp = {} does not divide the {} rollout rank(s)",
              rollout_tp, job.rollout_ranks);
  job.world = join_world(rt, config.device, env, config.timeout_s, mpi, "rl");
  const int rank = job.world->rank();
  const bool trains = rank < job.training_ranks;
  job.side = job.world->split(trains ? 0 : 1, rank, trains ? "train" : "rollout", nullptr);
  job.sync = job.world->split(!trains || rank == 0 ? 0 : 1, rank, "sync", nullptr);
  job.ranks.trains = trains;
  job.ranks.world = job.world.get();
  job.ranks.sync = !trains || rank == 0 ? job.sync.get() : nullptr;
  job.ranks.rollout = trains ? nullptr : job.side.get();
  if (!trains && rollout_tp > 1) {
    const int r = job.side->rank();
    job.rollout_tp = job.side->split(r / rollout_tp, r % rollout_tp, "rollout_tp", nullptr);
    job.rollout_dp = job.side->split(r % rollout_tp, r / rollout_tp, "rollout_dp", nullptr);
    job.ranks.rollout_tp = job.rollout_tp.get();
    job.ranks.rollout_dp = job.rollout_dp.get();
  }
  if (trains && job.training_ranks > 1) {
    const Device device = parse_device(config.device);
    const ParallelSizes sizes{int(config.tp), int(config.cp), int(config.ep), int(dp), int(config.pp)};
    job.groups = make_process_groups(std::move(job.side), sizes, rt.backend(device.type).create_stream(device.index));
  }
  return job;
}

int start_local_ranks(const std::string& who, const std::vector<std::string>& rank_args, const std::string& device,
                      int nproc, const std::string& usage) {
  LATHE_CHECK(device != "cpu", "{0}: --nproc starts GPU ranks (NCCL); CPU ranks talk over MPI: launch them with "
              "`mpirun -np {1} lathe {0} {2}`", who, nproc, usage);
  return run_local_ranks("/proc/self/exe", rank_args, nproc);
}

int start_local_ranks(const std::string& who, const std::string& config_path, const std::vector<std::string>& overrides,
                      const std::string& device, int nproc) {
  std::vector<std::string> rank_args = {who};
  if (!config_path.empty()) rank_args.push_back(config_path);
  for (const std::string& o : overrides) rank_args.insert(rank_args.end(), {"--set", o});
  return start_local_ranks(who, rank_args, device, nproc, "CONFIG");
}

void LineRanks::place(ModelOptions& o, const std::string& model_dir) const {
  o.tp = tp;
  o.cp = cp;
  o.ep = ep;
  if (!pp) return;
  o.pp = pp;
  o.pipeline = PipelineLayout(load_model_config(model_dir).num_layers, pp->size(), 1);
}

LineRanks line_ranks(std::unique_ptr<Communicator> world, int tp, int cp, int ep, int pp, const std::string& who) {
  const int n = world ? world->size() : 1, size = tp * cp * ep * pp;
  std::vector<std::string> given;
  for (const auto& [flag, v] : {std::pair{"--tp", tp}, {"--cp", cp}, {"--ep", ep}, {"--pp", pp}})
    if (v > 1) given.push_back(fmt::format("{} {}", flag, v));
  const std::string flags = given.empty() ? "--tp 1" : fmt::format("{}", fmt::join(given, " "));
  LATHE_CHECK(size == 1 || n > 1, "{0}: {1} splits the model over {2} ranks, but this is one process: launch them with "
              "`mpirun -np {2} lathe {0} ... {1}` or --nproc {2}", who, flags, size);
  LineRanks r;
  if (size > 1) {
    const ParallelSizes sizes{tp, cp, ep, 0, pp};
    const ParallelGrid check(n, sizes);  // the world must be a multiple of tp x cp x pp, ep divide cp x dp (named if not)
    (void)check;
    r.groups = make_process_groups(std::move(world), sizes, nullptr);
    r.world = r.groups->world.get();
    r.tp = r.groups->tp.get();
    r.cp = r.groups->cp.get();
    r.ep = r.groups->ep.get();
    r.pp = r.groups->pp.get();
    r.replica = r.groups->dp_rank(), r.replicas = r.groups->dp_size();
    // (a replica's later stages follow all first stages in rank order: pp is the slowest coordinate)
    r.member = r.groups->tp_rank() + tp * (r.groups->cp_rank() + cp * r.groups->pp_rank()), r.members = tp * cp;
    return r;
  }
  r.alone = std::move(world);
  r.world = r.alone.get();
  if (r.world) r.replica = r.world->rank(), r.replicas = r.world->size();
  return r;
}

std::vector<std::string> LineRanks::in_input_order(Runtime& rt, Device device, const std::vector<std::string>& mine,
                                                   size_t lines) const {
  if (!world) return mine;
  const std::vector<std::string> none;  // a replica's other ranks send nothing
  const std::vector<std::vector<std::string>> by_rank = gather_lines(rt, *world, device, member == 0 ? mine : none);
  std::vector<std::string> out;
  for (size_t i = 0; writer() && i < lines; ++i)  // replica d's first rank is world rank d x tp x cp (ParallelGrid order)
    out.push_back(by_rank[(i % size_t(replicas)) * size_t(members)][i / size_t(replicas)]);
  return out;
}

void run_as_rank(const LaunchEnv& env, const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    if (env.world == 1) throw;
    fmt::print(stderr, "lathe: error: rank {}: {}\n", env.rank, e.what());
    std::fflush(stderr);
    mpi_abort_job(1);
    std::_Exit(1);  // under --nproc the parent ends the other ranks
  }
}

}  // namespace lathe::cli
