// Communicator: the collectives of one process group, behind one interface with a backend per data plane — MPI
// (Debian's OpenMPI) for CPU tensors, so every parallel feature runs in CI with mpirun, and NCCL for CUDA tensors.
// Conventions:
// - Every rank of a group calls the same collectives in the same order (the sequence number of each call is the
//   group's, and a fault report names it).
// - Sums are exact and repeatable on the CPU: the MPI backend gathers the operands and adds them in rank order
//   0..n-1 in f64 (MPI_Allreduce's order is unspecified), so reduce-scatter is all-reduce then a slice and a sharded
//   run can equal the unsharded one (research note parallelism.md §13).
// - Each call returns a CommWork; wait() returns once the result is in place. On the CPU the work is done when the
//   call returns; on CUDA it is ordered on the tensors' stream.
// - A call that does not complete within the group's timeout aborts the whole job with a message naming the rank, the
//   group, the collective, its sequence number and this rank's last collectives (never a hang); every other rank
//   waiting in it prints its own (timeout_grace_s).
// Covered by tests/parallel/test_comm.cpp (run under mpirun -np 2 and -np 4).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace lathe {

class Runtime;
class Stream;

// How long a rank that reports a timed-out collective waits before it ends the job, so that the other ranks waiting in
// the same collective (they time out within moments of each other) print their own reports too: 2 s, or half the
// timeout when that is shorter.
inline double timeout_grace_s(double timeout_s) { return timeout_s / 2 < 2.0 ? timeout_s / 2 : 2.0; }

class CommWork {
 public:
  CommWork() = default;  // already complete
  explicit CommWork(std::function<void()> wait) : wait_(std::move(wait)) {}
  void wait() {
    if (wait_) std::exchange(wait_, nullptr)();
  }

 private:
  std::function<void()> wait_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;  // the group's kind and index, e.g. "dp[1]"

  // In place: every rank's `t` becomes the element-wise sum over the group.
  virtual CommWork all_reduce(Tensor& t) = 0;
  // `in` (size x N elements) summed over the group; rank i keeps elements [i*N, (i+1)*N) in `out` (N elements).
  virtual CommWork reduce_scatter(const Tensor& in, Tensor& out) = 0;
  // `out` (size x N elements) holds every rank's `in` (N elements), in rank order.
  virtual CommWork all_gather(const Tensor& in, Tensor& out) = 0;
  // Rank i sends in[send_offsets...] slices: send_counts[j] elements to rank j, in rank order; receives
  // recv_counts[j] elements from rank j into `out`, in rank order. Counts may differ between ranks (uneven splits).
  virtual CommWork all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                              const std::vector<int64_t>& recv_counts) = 0;
  virtual CommWork broadcast(Tensor& t, int root) = 0;
  virtual CommWork send(const Tensor& t, int peer) = 0;
  virtual CommWork recv(Tensor& t, int peer) = 0;
  // Point-to-point sends and receives posted together and completed together (MPI: every Isend and Irecv, then one
  // wait; NCCL: one group), so that two ranks sending to each other at once cannot deadlock: each peer posts the
  // matching ones in its own exchange, in the same order per pair of ranks. A received tensor is filled in place.
  virtual CommWork exchange(const std::vector<std::pair<Tensor, int>>& sends,
                            const std::vector<std::pair<Tensor, int>>& recvs) = 0;
  // Waits for every rank of the group. `timeout_s` (0: the group's) bounds this wait alone, for phases that take
  // longer than a collective should, such as one rank writing a checkpoint; `timeout_name` is what a report calls it.
  virtual void barrier(double timeout_s = 0, const char* timeout_name = "parallel.timeout_s") = 0;
  // The group of the ranks that pass the same `color`, ordered by `key`: every rank of this group calls it, in the
  // same order (the backend's own split: MPI_Comm_split, ncclCommSplit). `stream`: where the new group's operations
  // are ordered (nullptr: this group's stream), e.g. a side stream for gradients reduced while the backward runs.
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name, Stream* stream) = 0;
};

// Every rank's `mine` (one number a rank: a count, a flag) on the host, in rank order: an all-gather on `device` (the
// group's data plane), waited for. A collective of the group.
std::vector<double> values_over(Runtime& rt, Device device, Communicator& group, double mine);
// `values` (the same length on every rank) summed over the group, on the host of every rank: an all-reduce on `device`,
// waited for. A collective of the group.
std::vector<double> summed_over(Runtime& rt, Device device, Communicator& group, const std::vector<double>& values);
// Every rank's `mine` (any length; exact in f64) on every rank, in rank order: two all-gathers on `device`, the
// lengths and then the numbers padded to the longest. A collective of the group.
std::vector<std::vector<double>> gathered_values(Runtime& rt, Device device, Communicator& group,
                                                 const std::vector<double>& mine);

// The collectives' shape contract, which every backend checks before it starts one (the message names the group):
// reduce-scatter's input holds size x the output's elements, all-gather's output size x the input's, all-to-all has a
// count per rank that add up to the tensors' elements; one dtype.
void check_reduce_scatter(const Communicator& c, const Tensor& in, const Tensor& out);
void check_all_gather(const Communicator& c, const Tensor& in, const Tensor& out);
void check_all_to_all(const Communicator& c, const Tensor& in, const std::vector<int64_t>& send_counts, const Tensor& out,
                      const std::vector<int64_t>& recv_counts);

}  // namespace lathe
