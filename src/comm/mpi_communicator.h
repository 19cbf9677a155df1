// The MPI backend of Communicator (CPU tensors), over Debian's OpenMPI.
// - MpiSession initialises MPI once for the process (MPI_THREAD_FUNNELED: only the main thread communicates) and
//   finalises it at exit; mpi_world() is MPI_COMM_WORLD as a Communicator, whose split() makes sub-groups.
// - Every operation is posted non-blocking and polled against the group's timeout: one that does not complete in time
//   prints which rank, group, collective and sequence number stalled, with this rank's last eight collectives, and
//   aborts the whole job (MPI_Abort), so a dead or stopped rank never hangs the others.
// - Sums gather the operands and add them in rank order in f64: exact and the same on every rank.
// Built when CMake finds MPI (LATHE_HAVE_MPI); without it, mpi_available() is false and a parallel launch is refused.
// Covered by tests/parallel/test_comm.cpp.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace lathe {

bool mpi_available();

// MPI for this process: initialised by the first session (if the process was started by mpirun/srun or a parallel run
// needs it) and finalised when the last one ends.
class MpiSession {
 public:
  MpiSession();
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const;
  int size() const;
};

// MPI_COMM_WORLD; `timeout_s` bounds every operation of it and of the groups split from it.
std::unique_ptr<Communicator> mpi_world(double timeout_s);

// Ends every rank of the job at once (MPI_Abort) when MPI is running; returns when it is not.
void mpi_abort_job(int code);

// Broadcasts `bytes` bytes from `root` over MPI_COMM_WORLD when MPI is running with more than one rank (and returns
// true); returns false, touching nothing, when it is not.
bool mpi_broadcast_bytes(void* data, size_t bytes, int root);

}  // namespace lathe
