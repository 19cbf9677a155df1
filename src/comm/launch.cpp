#include "comm/launch.h"

#include <cstdlib>

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

}  // namespace

LaunchEnv launch_env() {
  LaunchEnv e;
  if (read_int("LATHE_WORLD", e.world)) {  // lathe train --nproc N (comm/local_launch.h)
    e.launcher = "lathe --nproc";
    read_int("LATHE_RANK", e.rank);
    read_int("LATHE_LOCAL_RANK", e.local_rank);
    if (const char* r = std::getenv("LATHE_RENDEZVOUS")) e.rendezvous = r;
  } else if (read_int("OMPI_COMM_WORLD_SIZE", e.world)) {
    e.launcher = "mpirun";
    read_int("OMPI_COMM_WORLD_RANK", e.rank);
    read_int("OMPI_COMM_WORLD_LOCAL_RANK", e.local_rank);
  } else if (read_int("SLURM_NTASKS", e.world) && std::getenv("SLURM_PROCID")) {
    e.launcher = "srun";
    read_int("SLURM_PROCID", e.rank);
    read_int("SLURM_LOCALID", e.local_rank);
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

}  // namespace lathe
