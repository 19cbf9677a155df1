#include "comm/launch.h"

#include <cstdlib>

#include <fmt/format.h>

#include "backend/runtime.h"
#include "comm/nccl_communicator.h"
#include "core/error.h"

namespace lathe {

namespace {

bool read_int(const char* name, int& out) {
  const char* v = std::getenv(name);
  if (!v || !*v) return false;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  LATHE_CHECK(*end == '\0' && x >= 0 && x < (1 << 24), "launch: {}={} is not a rank or size", name, v);
  out = int(x);
  return true;
}

// MPI's world must be the launcher's: a launcher that did not start MPI (srun without PMI support for this MPI) leaves
// each rank a world of one, and the ranks would train alone into the same folder.
void check_mpi_world(const Communicator& world, const LaunchEnv& env, const std::string& who) {
  LATHE_CHECK(world.size() == env.world && world.rank() == env.rank,
              "{}: {} started {} ranks (this is rank {}), but MPI sees a world of {} (rank {}): this MPI was not "
              "started by the launcher (with srun: `srun --mpi=pmix` and an MPI built with PMIx, or mpirun)", who,
              env.launcher, env.world, env.rank, world.size(), world.rank());
}

}  // namespace

LaunchEnv launch_env() {
  LaunchEnv e;
  if (const char* r = std::getenv("LATHE_RENDEZVOUS")) e.rendezvous = r;
  if (read_int("LATHE_WORLD", e.world)) {  // lathe train --nproc N (comm/local_launch.h)
    e.launcher = "lathe --nproc";
    read_int("LATHE_RANK", e.rank);
    read_int("LATHE_LOCAL_RANK", e.local_rank);
  } else if (read_int("OMPI_COMM_WORLD_SIZE", e.world)) {
    e.launcher = "mpirun";
    read_int("OMPI_COMM_WORLD_RANK", e.rank);
    read_int("OMPI_COMM_WORLD_LOCAL_RANK", e.local_rank);
  } else if (read_int("SLURM_NTASKS", e.world) && std::getenv("SLURM_PROCID")) {
    e.launcher = "srun";
    read_int("SLURM_PROCID", e.rank);
    read_int("SLURM_LOCALID", e.local_rank);
    const char* job = std::getenv("SLURM_JOB_ID");
    const char* step = std::getenv("SLURM_STEP_ID");
    e.job = fmt::format("{}.{}", job ? job : "0", step ? step : "0");
  } else if (read_int("PMIX_SIZE", e.world) || (std::getenv("PMIX_RANK") && read_int("PMI_SIZE", e.world))) {
    e.launcher = "pmix";
    read_int("PMIX_RANK", e.rank);
    read_int("PMIX_LOCAL_RANK", e.local_rank);
  } else {
    e.world = 1;
  }
  LATHE_CHECK(e.world >= 1 && e.rank < e.world, "launch: rank {} is not in a world of {} ({})", e.rank, e.world, e.launcher);
  return e;
}

std::unique_ptr<Communicator> join_world(Runtime& rt, std::string& device, const LaunchEnv& env, double timeout_s,
                                         std::optional<MpiSession>& mpi, const std::string& who) {
  if (env.world == 1) return nullptr;
  const bool under_mpi = env.launcher != "lathe --nproc";
  if (device == "cpu") {
    LATHE_CHECK(under_mpi, "{}: --nproc starts GPU ranks (NCCL); CPU ranks talk over MPI: launch them with `mpirun -np "
                "{} lathe ...`", who, env.world);
    LATHE_CHECK(mpi_available(), "{}: launched as {} ranks by {}, but this lathe was built without MPI (install "
                "libopenmpi-dev and rebuild)", who, env.world, env.launcher);
    mpi.emplace();
    std::unique_ptr<Communicator> world = mpi_world(timeout_s);
    check_mpi_world(*world, env, who);
    return world;
  }
  LATHE_CHECK(device == "cuda", "{}: device {} names one GPU for every rank; with {} ranks give device cuda, and rank r "
              "takes cuda:LOCAL_RANK", who, device, env.world);
  const int gpus = rt.cuda_built() ? rt.backend(DeviceType::CUDA).device_count() : 0;
  LATHE_CHECK(env.local_rank < gpus, "{}: rank {} is rank {} on its machine, which has {} GPU(s): start at most one "
              "rank per GPU", who, env.rank, env.local_rank, gpus);
  device = fmt::format("cuda:{}", env.local_rank);
  if (under_mpi && mpi_available()) mpi.emplace();  // hands NCCL its id (when MPI's world is the launcher's)
  return nccl_world(env.rank, env.world, rt.context(parse_device(device)).stream, timeout_s, env.rendezvous, env.job);
}

}  // namespace lathe
