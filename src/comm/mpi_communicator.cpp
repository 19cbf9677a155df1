#include "comm/mpi_communicator.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <thread>

#include "core/error.h"

#if LATHE_HAVE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only: no deprecated C++ bindings to link
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace lathe {

#if LATHE_HAVE_MPI

bool mpi_available() { return true; }

namespace {

int g_sessions = 0;  // MpiSession objects alive (the process's MPI lifetime)

// One rank's record of a group's operations: the flight recorder a timeout report prints.
struct OpRecord {
  int64_t seq;
  std::string op;
  size_t bytes;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, double timeout_s) : comm_(comm), name_(std::move(name)), timeout_s_(timeout_s) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  MPI_Comm comm() const { return comm_; }
  double timeout_s() const { return timeout_s_; }

  CommWork all_reduce(Tensor& t) override {
    check_cpu(t, "all_reduce");
    std::vector<char> all = gather_bytes(t, "all_reduce");
    sum_into(all, t.data_ptr(), t.dtype(), size_t(t.numel()), 0);
    return {};
  }

  CommWork reduce_scatter(const Tensor& in, Tensor& out) override {
    check_cpu(in, "reduce_scatter");
    check_cpu(out, "reduce_scatter");
    check_reduce_scatter(*this, in, out);
    std::vector<char> all = gather_bytes(in, "reduce_scatter");
    sum_into(all, out.data_ptr(), in.dtype(), size_t(out.numel()), size_t(rank_) * size_t(out.numel()));
    return {};
  }

  CommWork all_gather(const Tensor& in, Tensor& out) override {
    check_cpu(in, "all_gather");
    check_cpu(out, "all_gather");
    check_all_gather(*this, in, out);
    MPI_Request req;
    post("all_gather", in.nbytes(), MPI_Iallgather(in.data_ptr(), int(in.nbytes()), MPI_BYTE, out.data_ptr(),
                                                     int(in.nbytes()), MPI_BYTE, comm_, &req));
    wait("all_gather", &req, 1);
    return {};
  }

  CommWork all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                      const std::vector<int64_t>& recv_counts) override {
    check_cpu(in, "all_to_all");
    check_cpu(out, "all_to_all");
    check_all_to_all(*this, in, send_counts, out, recv_counts);
    const size_t item = dtype_size(in.dtype());
    const size_t n = size_t(size_);
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    int64_t s_off = 0, r_off = 0;
    for (int i = 0; i < size_; ++i) {
      sd[size_t(i)] = int(s_off * int64_t(item));
      sc[size_t(i)] = int(send_counts[size_t(i)] * int64_t(item));
      rd[size_t(i)] = int(r_off * int64_t(item));
      rc[size_t(i)] = int(recv_counts[size_t(i)] * int64_t(item));
      s_off += send_counts[size_t(i)];
      r_off += recv_counts[size_t(i)];
    }
    LATHE_CHECK(s_off * int64_t(item) < (int64_t(1) << 31) && r_off * int64_t(item) < (int64_t(1) << 31),
                "comm: all_to_all on {}: {} bytes sent or {} received exceed MPI's 2 GiB", name_,
                s_off * int64_t(item), r_off * int64_t(item));
    MPI_Request req;
    post("all_to_all", in.nbytes(), MPI_Ialltoallv(in.data_ptr(), sc.data(), sd.data(), MPI_BYTE, out.data_ptr(),
                                                     rc.data(), rd.data(), MPI_BYTE, comm_, &req));
    wait("all_to_all", &req, 1);
    return {};
  }

  CommWork broadcast(Tensor& t, int root) override {
    check_cpu(t, "broadcast");
    MPI_Request req;
    post("broadcast", t.nbytes(), MPI_Ibcast(t.data_ptr(), int(t.nbytes()), MPI_BYTE, root, comm_, &req));
    wait("broadcast", &req, 1);
    return {};
  }

  CommWork send(const Tensor& t, int peer) override {
    check_cpu(t, "send");
    MPI_Request req;
    post("send", t.nbytes(), MPI_Isend(t.data_ptr(), int(t.nbytes()), MPI_BYTE, peer, 0, comm_, &req));
    wait("send", &req, 1);
    return {};
  }

  CommWork recv(Tensor& t, int peer) override {
    check_cpu(t, "recv");
    MPI_Request req;
    post("recv", t.nbytes(), MPI_Irecv(t.data_ptr(), int(t.nbytes()), MPI_BYTE, peer, 0, comm_, &req));
    wait("recv", &req, 1);
    return {};
  }

  CommWork exchange(const std::vector<std::pair<Tensor, int>>& sends,
                    const std::vector<std::pair<Tensor, int>>& recvs) override {
    std::vector<MPI_Request> reqs;
    size_t bytes = 0;
    for (const auto& [t, peer] : sends) check_cpu(t, "exchange"), bytes += t.nbytes();
    for (const auto& [t, peer] : recvs) check_cpu(t, "exchange"), bytes += t.nbytes();
    LATHE_CHECK(bytes < (size_t(1) << 31), "comm: exchange on {}: {} bytes exceed MPI's 2 GiB", name_, bytes);
    ++seq_;
    history_.push_back({seq_, "exchange", bytes});
    if (history_.size() > 8) history_.pop_front();
    for (const auto& [t, peer] : sends) {
      reqs.emplace_back();
      const int rc = MPI_Isend(t.data_ptr(), int(t.nbytes()), MPI_BYTE, peer, 0, comm_, &reqs.back());
      if (rc != MPI_SUCCESS) fail("exchange", fmt::format("MPI error {}", error_string(rc)));
    }
    for (const auto& [t, peer] : recvs) {
      reqs.emplace_back();
      const int rc = MPI_Irecv(t.data_ptr(), int(t.nbytes()), MPI_BYTE, peer, 0, comm_, &reqs.back());
      if (rc != MPI_SUCCESS) fail("exchange", fmt::format("MPI error {}", error_string(rc)));
    }
    if (!reqs.empty()) wait("exchange", reqs.data(), int(reqs.size()));
    return {};
  }

  void barrier(double timeout_s = 0, const char* timeout_name = "parallel.timeout_s") override {
    MPI_Request req;
    post("barrier", 0, MPI_Ibarrier(comm_, &req));
    wait("barrier", &req, 1, timeout_s, timeout_name);
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name, Stream*) override {  // CPU: no streams
    MPI_Comm sub;
    LATHE_CHECK(MPI_Comm_split(comm_, color, key, &sub) == MPI_SUCCESS, "comm: splitting {} into {} failed", name_, name);
    return std::make_unique<MpiCommunicator>(sub, name, timeout_s_);
  }

 private:
  void check_cpu(const Tensor& t, const char* op) const {
    LATHE_CHECK(t.device().is_cpu() && t.is_contiguous(), "comm: {} on {} takes contiguous CPU tensors (the MPI data "
                "plane); got a {} tensor{}", op, name_, t.device().str(), t.is_contiguous() ? "" : " that is not contiguous");
    LATHE_CHECK(t.nbytes() < (size_t(1) << 31), "comm: {} on {}: {} bytes exceed MPI's 2 GiB per call", op, name_, t.nbytes());
  }

  // Every rank's bytes of `t`, in rank order.
  std::vector<char> gather_bytes(const Tensor& t, const char* op) {
    std::vector<char> all(t.nbytes() * size_t(size_));
    MPI_Request req;
    post(op, t.nbytes(), MPI_Iallgather(t.data_ptr(), int(t.nbytes()), MPI_BYTE, all.data(), int(t.nbytes()), MPI_BYTE,
                                        comm_, &req));
    wait(op, &req, 1);
    return all;
  }

  // out[i] = sum over ranks r (in order) of rank r's element first + i, added in f64.
  void sum_into(const std::vector<char>& all, void* out, DType dtype, size_t n, size_t first) const {
    const size_t per_rank = all.size() / size_t(size_);
    for (size_t i = 0; i < n; ++i) {
      double s = 0;
      for (int r = 0; r < size_; ++r) s += load_as_double(all.data() + size_t(r) * per_rank, dtype, int64_t(first + i));
      store_from_double(out, dtype, int64_t(i), s);
    }
  }

  void post(const std::string& op, size_t bytes, int rc) {
    ++seq_;
    history_.push_back({seq_, op, bytes});
    if (history_.size() > 8) history_.pop_front();
    if (rc != MPI_SUCCESS) fail(op, fmt::format("MPI error {}", error_string(rc)));
  }

  void wait(const std::string& op, MPI_Request* reqs, int n, double timeout_s = 0,
            const char* timeout_name = "parallel.timeout_s") {
    if (timeout_s <= 0) timeout_s = timeout_s_;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (int spins = 0;; ++spins) {
      int done = 0;
      const int rc = MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) fail(op, fmt::format("MPI error {}", error_string(rc)));
      if (done) return;
      if (std::chrono::steady_clock::now() > deadline)
        fail(op, fmt::format("did not complete within {} = {} s (a rank died, stopped or took another path)",
                             timeout_name, timeout_s), true);
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  static std::string error_string(int rc) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    return std::string(text, size_t(len));
  }

  // Reports the stalled or failed operation with this rank's recent ones, and ends the whole job. After a timeout it
  // waits a moment first (timeout_grace_s): the other ranks waiting in the same collective time out within moments
  // and print their own reports, so the job's output holds every live rank's last collectives.
  [[noreturn]] void fail(const std::string& op, const std::string& why, bool timed_out = false) const {
    std::string recent;
    for (const OpRecord& r : history_) recent += fmt::format("\n  #{} {} ({} bytes)", r.seq, r.op, r.bytes);
    std::fprintf(stderr, "lathe: error: rank %d: %s #%lld on group %s (%d ranks) %s; this rank's last collectives on "
                         "it:%s\n", world_rank_, op.c_str(), static_cast<long long>(seq_), name_.c_str(), size_,
                 why.c_str(), recent.c_str());
    std::fflush(stderr);
    if (timed_out) std::this_thread::sleep_for(std::chrono::duration<double>(timeout_grace_s(timeout_s_)));
    MPI_Abort(MPI_COMM_WORLD, 5);
    std::abort();
  }

  MPI_Comm comm_;
  std::string name_;
  double timeout_s_;
  int rank_ = 0, size_ = 1, world_rank_ = 0;
  int64_t seq_ = 0;
  std::deque<OpRecord> history_;
};

}  // namespace

MpiSession::MpiSession() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  ++g_sessions;
}

MpiSession::~MpiSession() {
  if (--g_sessions > 0) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

int MpiSession::rank() const {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int MpiSession::size() const {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

std::unique_ptr<Communicator> mpi_world(double timeout_s) {
  LATHE_CHECK(g_sessions > 0, "comm: MPI is not initialised (make an MpiSession first)");
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "world", timeout_s);
}

void mpi_abort_job(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > 1) MPI_Abort(MPI_COMM_WORLD, code);
  }
}

bool mpi_broadcast_bytes(void* data, size_t bytes, int root) {
  int initialized = 0, finalized = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return false;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size < 2) return false;
  LATHE_CHECK(MPI_Bcast(data, int(bytes), MPI_BYTE, root, MPI_COMM_WORLD) == MPI_SUCCESS, "comm: MPI_Bcast failed");
  return true;
}

#else  // no MPI in this build

bool mpi_available() { return false; }
MpiSession::MpiSession() { LATHE_FAIL("comm: this lathe was built without MPI (install libopenmpi-dev and rebuild)"); }
MpiSession::~MpiSession() = default;
int MpiSession::rank() const { return 0; }
int MpiSession::size() const { return 1; }
std::unique_ptr<Communicator> mpi_world(double) { LATHE_FAIL("comm: this lathe was built without MPI"); }
void mpi_abort_job(int) {}
bool mpi_broadcast_bytes(void*, size_t, int) { return false; }

#endif

}  // namespace lathe
