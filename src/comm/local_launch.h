// `--nproc N`: Lathe starts the ranks of a one-machine job itself, without MPI. The parent runs the same binary N
// times with LATHE_RANK, LATHE_WORLD, LATHE_LOCAL_RANK and LATHE_RENDEZVOUS (a fresh folder through which rank 0
// hands NCCL its id) in the environment, and NCCL_NVLS_ENABLE=0 unless set (NVLink multicast stays off). When a rank
// fails, the parent ends the others (SIGTERM, then SIGKILL after 10 s), says which rank failed and how, and exits
// with its status; it never waits on a rank that cannot finish. Covered by tests/e2e/test_train_dp.cpp (argument
// checks on the CPU) and dev/gpu_session.sh dp24 (two GPUs).
#pragma once

#include <string>
#include <vector>

namespace lathe {

// Runs `binary args...` as ranks 0..n-1 and returns the job's exit status.
int run_local_ranks(const std::string& binary, const std::vector<std::string>& args, int n);

}  // namespace lathe
