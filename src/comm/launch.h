// How this process was launched: its rank, the world size and its rank on the node, read from the launcher's
// environment — `lathe train --nproc N` (LATHE_RANK, LATHE_WORLD, LATHE_LOCAL_RANK), mpirun (OpenMPI: OMPI_COMM_WORLD_*), srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or PMIx
// (PMIX_RANK) — or a world of one. Covered by tests/unit/test_launch.cpp and tests/e2e/test_train_dp.cpp.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"

namespace lathe {

struct LaunchEnv {
  int rank = 0, world = 1, local_rank = 0;
  std::string launcher = "none";  // "lathe --nproc", "mpirun", "srun", "pmix" or "none"
  std::string rendezvous;         // LATHE_RENDEZVOUS: where rank 0 leaves the NCCL id (--nproc sets it; with srun, a
                                  // folder every rank sees, when MPI does not hand the id over)
  std::string job;                // srun: "SLURM_JOB_ID.SLURM_STEP_ID", so that one rendezvous folder serves many jobs
};

LaunchEnv launch_env();

class Runtime;

// This rank's world communicator for a parallel launch (nullptr for a world of one). CPU ranks (`device` "cpu") talk
// over MPI and need mpirun/srun; GPU ranks over NCCL, one GPU each: `device` must be "cuda" and becomes
// "cuda:LOCAL_RANK" (more ranks on a machine than GPUs is refused). `mpi` holds MPI's session when one is started
// (MPI also hands NCCL its id under mpirun). `who` starts the error messages.
std::unique_ptr<Communicator> join_world(Runtime& rt, std::string& device, const LaunchEnv& env, double timeout_s,
                                         std::optional<MpiSession>& mpi, const std::string& who);

}  // namespace lathe
