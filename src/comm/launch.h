// How this process was launched: its rank, the world size and its rank on the node, read from the launcher's
// environment — `lathe train --nproc N` (LATHE_RANK, LATHE_WORLD, LATHE_LOCAL_RANK), mpirun (OpenMPI: OMPI_COMM_WORLD_*), srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or PMIx
// (PMIX_RANK) — or a world of one. Covered by tests/parallel/test_train_dp.cpp.
#pragma once

#include <string>

namespace lathe {

struct LaunchEnv {
  int rank = 0, world = 1, local_rank = 0;
  std::string launcher = "none";  // "lathe --nproc", "mpirun", "srun", "pmix" or "none"
  std::string rendezvous;         // LATHE_RENDEZVOUS: where rank 0 leaves the NCCL id (--nproc)
};

LaunchEnv launch_env();

}  // namespace lathe
