#include "comm/nccl_communicator.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>

#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "core/files.h"

#if LATHE_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include "backend/cuda/cuda_backend.h"
#endif

namespace lathe {

#if LATHE_WITH_NCCL

bool nccl_available() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_in(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::U8: return ncclUint8;
    default: LATHE_FAIL("comm: NCCL cannot carry {} tensors", dtype_name(t));
  }
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // calls return at once; a stalled job can then be aborted (research note parallelism.md §11)
  return config;
}

// Polls a non-blocking communicator until its pending work has settled; returns the final result. A call may return
// ncclSuccess while the communicator is still being set up in the background, so the state is always asked for. The
// first thousand polls spin (yielding): a collective is taken within microseconds, and a 20 us sleep lasts several
// times that on Linux (suspected of the 0.11 ms floor per queued collective that bench/comm_bench.cpp measured,
// docs/benchmarks.md session 23; not measured again since); then they sleep (a communicator forming, a stalled rank).
ncclResult_t settle(ncclComm_t comm, ncclResult_t r, Clock::time_point deadline) {
  if ((r != ncclSuccess && r != ncclInProgress) || comm == nullptr) return r;
  for (int polls = 0;; ++polls) {
    ncclCommGetAsyncError(comm, &r);
    if (r != ncclInProgress) return r;
    if (Clock::now() > deadline) return ncclInProgress;
    if (polls < 1000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

struct OpRecord {
  int64_t seq;
  std::string op;
  size_t bytes;
};

// An operation queued on the group's stream and not yet seen finished by the watchdog.
struct Pending {
  std::shared_ptr<cudaEvent_t> done;  // recorded behind the operation
  std::string op;
  int64_t seq;
  double timeout_s;
  const char* timeout_name;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, int device, std::string name, double timeout_s, int world_rank)
      : comm_(comm), stream_(stream), device_(device), name_(std::move(name)), timeout_s_(timeout_s), world_rank_(world_rank) {
    ncclCommUserRank(comm_, &rank_);
    ncclCommCount(comm_, &size_);
  }
  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      stopping_ = true;
    }
    pending_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (comm_) ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  int world_rank() const { return world_rank_; }

  CommWork all_reduce(Tensor& t) override {
    check(t, "all_reduce");
    run("all_reduce", t.nbytes(), [&] {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), ncclSum, comm_, stream_);
    });
    return completion("all_reduce");
  }

  CommWork reduce_scatter(const Tensor& in, Tensor& out) override {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    check_reduce_scatter(*this, in, out);
    run("reduce_scatter", in.nbytes(), [&] {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()), nccl_type(in.dtype()), ncclSum, comm_,
                               stream_);
    });
    return completion("reduce_scatter");
  }

  CommWork all_gather(const Tensor& in, Tensor& out) override {
    check(in, "all_gather");
    check(out, "all_gather");
    check_all_gather(*this, in, out);
    run("all_gather", in.nbytes(), [&] {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), size_t(in.numel()), nccl_type(in.dtype()), comm_, stream_);
    });
    return completion("all_gather");
  }

  CommWork all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                      const std::vector<int64_t>& recv_counts) override {
    check(in, "all_to_all");
    check(out, "all_to_all");
    check_all_to_all(*this, in, send_counts, out, recv_counts);
    const size_t item = dtype_size(in.dtype());
    run("all_to_all", in.nbytes(), [&] {
      ncclGroupStart();
      int64_t s = 0, r = 0;
      for (int j = 0; j < size_; ++j) {
        const auto* src = static_cast<const char*>(in.data_ptr()) + size_t(s) * item;
        auto* dst = static_cast<char*>(out.data_ptr()) + size_t(r) * item;
        if (send_counts[size_t(j)] > 0) ncclSend(src, size_t(send_counts[size_t(j)]), nccl_type(in.dtype()), j, comm_, stream_);
        if (recv_counts[size_t(j)] > 0) ncclRecv(dst, size_t(recv_counts[size_t(j)]), nccl_type(in.dtype()), j, comm_, stream_);
        s += send_counts[size_t(j)];
        r += recv_counts[size_t(j)];
      }
      return ncclGroupEnd();
    });
    return completion("all_to_all");
  }

  CommWork broadcast(Tensor& t, int root) override {
    check(t, "broadcast");
    run("broadcast", t.nbytes(), [&] {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), root, comm_, stream_);
    });
    return completion("broadcast");
  }

  CommWork send(const Tensor& t, int peer) override {
    check(t, "send");
    run("send", t.nbytes(), [&] { return ncclSend(t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), peer, comm_, stream_); });
    return completion("send");
  }

  CommWork recv(Tensor& t, int peer) override {
    check(t, "recv");
    run("recv", t.nbytes(), [&] { return ncclRecv(t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), peer, comm_, stream_); });
    return completion("recv");
  }

  CommWork exchange(const std::vector<std::pair<Tensor, int>>& sends,
                    const std::vector<std::pair<Tensor, int>>& recvs) override {
    size_t bytes = 0;
    for (const auto& [t, peer] : sends) check(t, "exchange"), bytes += t.nbytes();
    for (const auto& [t, peer] : recvs) check(t, "exchange"), bytes += t.nbytes();
    if (sends.empty() && recvs.empty()) return {};
    run("exchange", bytes, [&] {
      ncclGroupStart();
      for (const auto& [t, peer] : sends)
        ncclSend(t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), peer, comm_, stream_);
      for (const auto& [t, peer] : recvs)
        ncclRecv(t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), peer, comm_, stream_);
      return ncclGroupEnd();
    });
    return completion("exchange");
  }

  void barrier(double timeout_s = 0, const char* timeout_name = "parallel.timeout_s") override {
    void* one = nullptr;
    cudaSetDevice(device_);
    cudaMallocAsync(&one, sizeof(float), stream_);
    cudaMemsetAsync(one, 0, sizeof(float), stream_);
    run("barrier", sizeof(float), [&] { return ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, comm_, stream_); });
    CommWork w = completion("barrier", timeout_s, timeout_name);
    w.wait();
    cudaFreeAsync(one, stream_);
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name, Stream* stream) override;

  // Reports the stalled or failed operation with this rank's recent ones, aborts the communicator and ends the job.
  // Called from the host's wait() or from the watchdog: the first caller reports, a second waits for the exit.
  [[noreturn]] void fail(const std::string& op, const std::string& why, bool timed_out = false) {
    if (failing_.exchange(true))
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    std::string recent;
    {
      std::lock_guard<std::mutex> lock(history_mu_);
      for (const OpRecord& r : history_) recent += fmt::format("\n  #{} {} ({} bytes)", r.seq, r.op, r.bytes);
    }
    std::fprintf(stderr, "lathe: error: rank %d: %s #%lld on group %s (%d ranks, NCCL) %s; this rank's last collectives "
                         "on it:%s\n", world_rank_, op.c_str(), static_cast<long long>(seq_), name_.c_str(), size_,
                 why.c_str(), recent.c_str());
    std::fflush(stderr);
    if (timed_out) std::this_thread::sleep_for(std::chrono::duration<double>(timeout_grace_s(timeout_s_)));
    ncclCommAbort(comm_);
    comm_ = nullptr;
    mpi_abort_job(5);
    std::_Exit(5);
  }

 private:
  void check(const Tensor& t, const char* op) const {
    LATHE_CHECK(t.device().is_cuda() && t.device().index == device_ && t.is_contiguous(),
                "comm: {} on {} takes contiguous tensors on cuda:{} (the NCCL data plane); got a {} tensor{}", op, name_,
                device_, t.device().str(), t.is_contiguous() ? "" : " that is not contiguous");
  }

  template <typename F>
  void run(const std::string& op, size_t bytes, F&& call) {
    ++seq_;
    {
      std::lock_guard<std::mutex> lock(history_mu_);
      history_.push_back({seq_, op, bytes});
      if (history_.size() > 8) history_.pop_front();
    }
    cudaSetDevice(device_);
    const auto deadline = deadline_in(timeout_s_);
    const ncclResult_t r = settle(comm_, call(), deadline);
    if (r == ncclInProgress) fail(op, fmt::format("was not taken by NCCL within parallel.timeout_s = {} s", timeout_s_), true);
    if (r != ncclSuccess) fail(op, fmt::format("failed: {}", ncclGetErrorString(r)));
  }

  // The operation's completion: an event behind it on the stream, polled by wait() against the timeout, and handed
  // to the watchdog.
  CommWork completion(const std::string& op, double timeout_s = 0, const char* timeout_name = "parallel.timeout_s") {
    if (timeout_s <= 0) timeout_s = timeout_s_;
    auto event = std::shared_ptr<cudaEvent_t>(new cudaEvent_t(nullptr), [](cudaEvent_t* e) {
      if (*e) cudaEventDestroy(*e);
      delete e;
    });
    cudaEventCreateWithFlags(event.get(), cudaEventDisableTiming);
    cudaEventRecord(*event, stream_);
    const int64_t seq = seq_;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      pending_.push_back({event, op, seq, timeout_s, timeout_name});
      if (!watchdog_.joinable()) watchdog_ = std::thread([this] { watch(); });
    }
    pending_cv_.notify_one();
    return CommWork([this, event, op, seq, timeout_s, timeout_name] {
      const auto deadline = deadline_in(timeout_s);
      for (int spins = 0;; ++spins) {
        const cudaError_t e = cudaEventQuery(*event);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) fail(op, fmt::format("#{}: CUDA error {}", seq, cudaGetErrorString(e)));
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm_, &async);
        if (async != ncclSuccess && async != ncclInProgress) fail(op, fmt::format("failed: {}", ncclGetErrorString(async)));
        if (Clock::now() > deadline)
          fail(op, fmt::format("did not complete within {} = {} s (a rank died, stopped or took another path)",
                               timeout_name, timeout_s), true);
        if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    });
  }

  // The watchdog: the oldest pending operation's event, polled every millisecond. An operation the GPU has not
  // finished within its timeout — counted from when the one before it finished, or from its queueing when nothing was
  // pending — ends the job with fail()'s report, also where no host waits for it (the model's tensor- and
  // context-parallel collectives are ordered on the compute stream and never waited for; a host blocked in a copy
  // behind a stalled collective would otherwise hang).
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(pending_mu_);
    Clock::time_point since = Clock::now();
    while (!stopping_) {
      if (pending_.empty()) {
        pending_cv_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
        since = Clock::now();
        continue;
      }
      const Pending front = pending_.front();
      lock.unlock();
      const cudaError_t e = cudaEventQuery(*front.done);
      const double waited = std::chrono::duration<double>(Clock::now() - since).count();
      ncclResult_t async = ncclSuccess;
      if (e == cudaErrorNotReady && waited > 0.1) ncclCommGetAsyncError(comm_, &async);
      if (e != cudaSuccess && e != cudaErrorNotReady)
        fail(front.op, fmt::format("#{}: CUDA error {}", front.seq, cudaGetErrorString(e)));
      if (async != ncclSuccess && async != ncclInProgress) fail(front.op, fmt::format("failed: {}", ncclGetErrorString(async)));
      if (e == cudaErrorNotReady && waited > front.timeout_s)
        fail(front.op, fmt::format("#{} did not complete within {} = {} s (a rank died, stopped or took another path)",
                                   front.seq, front.timeout_name, front.timeout_s), true);
      if (e == cudaErrorNotReady) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lock.lock();
      if (e == cudaSuccess) {
        pending_.pop_front();
        since = Clock::now();
      }
    }
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int device_;
  std::string name_;
  double timeout_s_;
  int world_rank_;
  int rank_ = 0, size_ = 1;
  int64_t seq_ = 0;
  std::mutex history_mu_;  // history_ is read by the watchdog's report
  std::deque<OpRecord> history_;
  std::atomic<bool> failing_{false};
  std::mutex pending_mu_;
  std::condition_variable pending_cv_;
  std::deque<Pending> pending_;
  bool stopping_ = false;
  std::thread watchdog_;  // started with the first operation; stopped and joined by the destructor
};

// Rank 0's NCCL id, on every rank: over MPI when it runs, else through a file in `dir`.
std::string id_file(const std::string& dir, const std::string& job) {
  return (std::filesystem::path(dir) / (job.empty() ? std::string("nccl-world.id") : "nccl-world." + job + ".id")).string();
}

ncclUniqueId share_id(int rank, int world, const std::string& dir, const std::string& job, double timeout_s) {
  ncclUniqueId id{};
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    LATHE_CHECK(r == ncclSuccess, "comm: ncclGetUniqueId failed: {}", ncclGetErrorString(r));
  }
  if (mpi_broadcast_bytes(&id, sizeof(id), 0)) return id;
  LATHE_CHECK(!dir.empty(), "comm: {} ranks need a rendezvous for NCCL: run under mpirun (with MPI built in), with "
              "`lathe train --nproc N` (which sets LATHE_RENDEZVOUS), or set LATHE_RENDEZVOUS to a folder every rank "
              "sees (srun without an MPI that srun starts)", world);
  const std::string path = id_file(dir, job);
  if (rank == 0) {
    make_dirs(dir, "comm");
    write_file_atomic(path, std::string_view(id.internal, sizeof(id.internal)), "comm");
    return id;
  }
  const auto deadline = deadline_in(timeout_s);
  while (!std::filesystem::exists(path)) {
    LATHE_CHECK(Clock::now() < deadline, "comm: rank {}: rank 0's NCCL id did not appear in {} within {} s", rank, path,
                timeout_s);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const std::string bytes = read_text_file(path, "comm");
  LATHE_CHECK(bytes.size() == sizeof(id.internal), "comm: {} holds {} bytes, not an NCCL id", path, bytes.size());
  std::copy(bytes.begin(), bytes.end(), id.internal);
  return id;
}

}  // namespace

std::unique_ptr<Communicator> nccl_world(int rank, int world, Stream& stream, double timeout_s,
                                         const std::string& rendezvous_dir, const std::string& job) {
  cuda::CudaStream& s = cuda::as_cuda(stream);
  cudaSetDevice(s.index());
  const ncclUniqueId id = share_id(rank, world, rendezvous_dir, job, timeout_s);
  ncclComm_t comm = nullptr;
  ncclConfig_t config = nonblocking_config();
  const auto deadline = deadline_in(timeout_s);
  ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  r = settle(comm, r, deadline);
  LATHE_CHECK(r == ncclSuccess, "comm: rank {}: NCCL world of {} ranks on cuda:{}: {}", rank, world, s.index(),
              r == ncclInProgress ? fmt::format("not formed within {} s (a rank did not start?)", timeout_s)
                                  : std::string(ncclGetErrorString(r)));
  auto c = std::make_unique<NcclCommunicator>(comm, s.handle(), s.index(), "world", timeout_s, rank);
  // Warm the communicator up with one tiny collective (a lazily formed one can stall outside any timeout).
  c->barrier();
  if (rank == 0 && !rendezvous_dir.empty()) {  // every rank has read the id: a later job must not find it
    std::error_code ec;
    std::filesystem::remove(id_file(rendezvous_dir, job), ec);
  }
  return c;
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key, const std::string& name, Stream* stream) {
  cudaSetDevice(device_);
  ncclComm_t sub = nullptr;
  ncclConfig_t config = nonblocking_config();
  const auto deadline = deadline_in(timeout_s_);
  ncclResult_t r = ncclCommSplit(comm_, color, key, &sub, &config);
  r = settle(comm_, r, deadline);  // the parent carries the split until the child exists
  if (r == ncclSuccess) r = sub ? settle(sub, ncclInProgress, deadline) : ncclInvalidUsage;
  if (r != ncclSuccess)
    fail("split", fmt::format("into {} failed: {}", name, r == ncclInProgress ? "not done within parallel.timeout_s"
                                                                               : ncclGetErrorString(r)));
  int count = 0;
  LATHE_CHECK(ncclCommCount(sub, &count) == ncclSuccess && count >= 1, "comm: the {} communicator split from {} is not "
              "usable", name, name_);
  auto c = std::make_unique<NcclCommunicator>(sub, stream ? cuda::as_cuda(*stream).handle() : stream_, device_, name,
                                              timeout_s_, world_rank_);
  c->barrier();
  return c;
}

#else  // no NCCL in this build

bool nccl_available() { return false; }
std::unique_ptr<Communicator> nccl_world(int, int, Stream&, double, const std::string&, const std::string&) {
  LATHE_FAIL("comm: this lathe was built without NCCL (a CUDA toolkit with NCCL is needed for GPU ranks)");
}

#endif

}  // namespace lathe
