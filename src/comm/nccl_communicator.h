// The NCCL backend of Communicator (CUDA tensors), one communicator per group.
// - The world communicator is made from an ncclUniqueId that rank 0 creates and hands to the others: over MPI when
//   the job runs under mpirun with MPI built in, else through a file in a rendezvous folder (LATHE_RENDEZVOUS, which
//   `lathe train --nproc N` sets). Sub-groups come from ncclCommSplit, eagerly and in the same order on every rank.
// - Communicators are non-blocking (config.blocking = 0), so that a stalled job can be aborted: every call is polled
//   until NCCL has taken it, and wait() polls the operation's CUDA event and ncclCommGetAsyncError against the group's
//   timeout; a timeout or an NCCL error prints the rank, group, collective, sequence number and this rank's last
//   collectives, aborts the communicator and ends the job.
// - Operations are ordered on the tensors' stream (the device's default stream, where the compute runs), so a later
//   kernel sees the result without a wait; wait() is for the host. The model's tensor- and context-parallel
//   collectives are never waited for (a wait after each let the GPU's queue run dry at every collective: the 8B shape
//   at tp 2 + sp ran at 40% MFU so): a watchdog thread per communicator polls every queued operation's event against
//   its timeout, so a stalled one still ends the job with the report, even while the host is blocked in a copy
//   behind it.
// Built when the CUDA toolkit has NCCL (LATHE_WITH_NCCL). Covered on two GPUs by tests/e2e/test_parallel_gpu.cpp and
// dev/gpu_parallel.sh's `stall` stage (a stopped rank under tp ends the job with the timeout report).
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "comm/communicator.h"

namespace lathe {

bool nccl_available();

// The world of `world` ranks on `stream`'s device. `rendezvous_dir`: where rank 0 leaves the id when MPI is not used.
// `job` names this job's id file in the folder ("" for a folder of its own, as --nproc makes); rank 0 removes the file
// once the world has formed.
std::unique_ptr<Communicator> nccl_world(int rank, int world, Stream& stream, double timeout_s,
                                         const std::string& rendezvous_dir, const std::string& job);

}  // namespace lathe
