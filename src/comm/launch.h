// How this process was launched: its rank, the world size and its rank on the node, read from the launcher's
// environment — mpirun (OpenMPI: OMPI_COMM_WORLD_*), srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or PMIx
// (PMIX_RANK) — or a world of one. Covered by tests/parallel/test_train_dp.cpp.
#pragma once

#include <string>

namespace lathe {

struct LaunchEnv {
  int rank = 0, world = 1, local_rank = 0;
  std::string launcher = "none";  // "mpirun", "srun", "pmix" or "none"
};

LaunchEnv launch_env();

}  // namespace lathe
