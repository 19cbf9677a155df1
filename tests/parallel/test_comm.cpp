// src/comm/mpi_communicator.h under mpirun (-np 2 and -np 4 in ctest): every collective against values the test
// computes itself, sums exact and bitwise equal on every rank, uneven all-to-all, sub-groups from the grid; and, as
// separate ctest entries (LATHE_COMM_FAULT), a rank that skips a collective or dies ends the job with a message
// instead of a hang.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "backend/runtime.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "parallel/grid.h"
#include "support/error_of.h"

using namespace lathe;
using lathe::test_support::error_of;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

Tensor cpu_tensor(const std::vector<float>& v) { return runtime().from_host(v.data(), {int64_t(v.size())}, DType::F32, Device::cpu()); }

std::vector<float> values(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

// Rank r's operand: values whose f32 sums depend on the order of addition.
std::vector<float> operand(int r, int n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[size_t(i)] = float(1.0 / (3.0 + r) + 1e-3 * i) * (i % 2 ? 1e4f : 1e-4f);
  return v;
}

struct Comm : ::testing::Test {
  static std::unique_ptr<Communicator> world;
  static void SetUpTestSuite() { world = mpi_world(60); }
  static void TearDownTestSuite() { world.reset(); }
};
std::unique_ptr<Communicator> Comm::world;

}  // namespace

TEST_F(Comm, AllReduceIsTheRankOrderSumInF64AndEqualOnEveryRank) {
  const int n = 37, size = world->size();
  Tensor t = cpu_tensor(operand(world->rank(), n));
  world->all_reduce(t).wait();
  const std::vector<float> got = values(t);
  for (int i = 0; i < n; ++i) {
    double want = 0;
    for (int r = 0; r < size; ++r) want += double(operand(r, n)[size_t(i)]);
    EXPECT_EQ(got[size_t(i)], float(want)) << i;
  }
  Tensor all = Tensor::empty({int64_t(n) * size}, DType::F32, runtime().host_allocator());
  world->all_gather(t, all).wait();
  for (int r = 1; r < size; ++r)
    for (int i = 0; i < n; ++i) EXPECT_EQ(all.data<float>()[r * n + i], got[size_t(i)]) << "rank " << r << " differs";
}

TEST_F(Comm, ReduceScatterIsTheSliceOfTheAllReduce) {
  const int size = world->size(), n = 5 * size;
  Tensor full = cpu_tensor(operand(world->rank(), n));
  Tensor part = Tensor::empty({5}, DType::F32, runtime().host_allocator());
  world->reduce_scatter(full, part).wait();
  world->all_reduce(full).wait();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(part.data<float>()[i], full.data<float>()[world->rank() * 5 + i]);
}

TEST_F(Comm, AllToAllWithUnevenSplits) {
  const int size = world->size(), me = world->rank();
  // Rank i sends j + 1 + i elements to rank j, each 100 i + j.
  std::vector<float> out;
  std::vector<int64_t> send, recv;
  for (int j = 0; j < size; ++j) {
    send.push_back(j + 1 + me);
    for (int k = 0; k < j + 1 + me; ++k) out.push_back(float(100 * me + j));
  }
  int64_t total = 0;
  for (int i = 0; i < size; ++i) recv.push_back(me + 1 + i), total += me + 1 + i;
  Tensor in = cpu_tensor(out);
  Tensor got = Tensor::empty({total}, DType::F32, runtime().host_allocator());
  world->all_to_all(in, send, got, recv).wait();
  int64_t at = 0;
  for (int i = 0; i < size; ++i)
    for (int k = 0; k < me + 1 + i; ++k) EXPECT_EQ(got.data<float>()[at++], float(100 * i + me)) << "from rank " << i;
}

// The shape contract (comm/communicator.h) is checked on each rank before any data moves, naming the group: every
// rank refuses the same bad call, so none waits for the others.
TEST_F(Comm, BadShapesAreRefusedBeforeTheCollective) {
  const int size = world->size();
  Tensor in = cpu_tensor(std::vector<float>(size_t(3 * size), 1.0f));
  Tensor small = Tensor::empty({2}, DType::F32, runtime().host_allocator());
  EXPECT_NE(error_of([&] { world->reduce_scatter(in, small); }).find("reduce_scatter on world: input of"), std::string::npos);
  EXPECT_NE(error_of([&] { world->all_gather(small, in); }).find("all_gather on world: output of"), std::string::npos);
  const std::vector<int64_t> ones(size_t(size), 1);
  EXPECT_NE(error_of([&] { world->all_to_all(in, ones, small, ones); }).find("all_to_all on world: counts"), std::string::npos);
  EXPECT_NE(error_of([&] { world->all_to_all(in, {1}, small, ones); }).find("receive counts for"), std::string::npos)
      << "a count per rank";
  world->barrier();  // and the group still works
}

TEST_F(Comm, BroadcastAndARingOfSendsAndReceives) {
  const int size = world->size(), me = world->rank();
  Tensor b = cpu_tensor({float(me), float(me * 2)});
  world->broadcast(b, size - 1).wait();
  EXPECT_EQ(values(b), (std::vector<float>{float(size - 1), float(2 * (size - 1))}));
  Tensor mine = cpu_tensor({float(me) + 0.5f});
  Tensor from_left = cpu_tensor({-1.0f});
  if (me % 2 == 0) {
    world->send(mine, (me + 1) % size).wait();
    world->recv(from_left, (me + size - 1) % size).wait();
  } else {
    world->recv(from_left, (me + size - 1) % size).wait();
    world->send(mine, (me + 1) % size).wait();
  }
  EXPECT_EQ(values(from_left)[0], float((me + size - 1) % size) + 0.5f);
  world->barrier();
}

// Every rank sends 4 MiB to both neighbours and receives from both at once (what two pipeline stages do when one's
// activations and the other's gradients cross): blocking sends would wait for each other past MPI's eager limit.
TEST_F(Comm, ExchangeSendsBothWaysAtOnce) {
  const int size = world->size(), me = world->rank(), n = 1 << 20;
  const int left = (me + size - 1) % size, right = (me + 1) % size;
  Tensor to_right = cpu_tensor(std::vector<float>(n, float(me) + 0.25f));
  Tensor to_left = cpu_tensor(std::vector<float>(n, float(me) + 0.75f));
  Tensor from_left = cpu_tensor(std::vector<float>(n, -1.0f)), from_right = cpu_tensor(std::vector<float>(n, -1.0f));
  world->exchange({{to_right, right}, {to_left, left}}, {{from_left, left}, {from_right, right}}).wait();
  EXPECT_EQ(values(from_left)[n - 1], float(left) + 0.25f);
  EXPECT_EQ(values(from_right)[0], float(right) + 0.75f);
  world->barrier();
}

TEST_F(Comm, GridGroupsSplitTheWorld) {
  const int size = world->size();
  if (size % 2) GTEST_SKIP() << "needs an even world";
  const ParallelGrid grid(size, {.tp = 2});
  auto tp = world->split(grid.group_index(GroupKind::Tp, world->rank()), world->rank(), "tp", nullptr);
  auto dp = world->split(grid.group_index(GroupKind::Dp, world->rank()), world->rank(), "dp", nullptr);
  EXPECT_EQ(tp->size(), 2);
  EXPECT_EQ(dp->size(), size / 2);
  Tensor t = cpu_tensor({float(world->rank())});
  tp->all_reduce(t).wait();
  const int base = world->rank() - world->rank() % 2;
  EXPECT_EQ(values(t)[0], float(base + base + 1));  // the two ranks of a tp pair: r and r + 1
  Tensor d = cpu_tensor({float(world->rank())});
  dp->all_reduce(d).wait();
  double want = 0;
  for (int r = world->rank() % 2; r < size; r += 2) want += r;
  EXPECT_EQ(values(d)[0], float(want));
}

// LATHE_COMM_FAULT=skip: rank 1 never joins the all-reduce; the others must abort with the report, not hang.
// LATHE_COMM_FAULT=kill: rank 1 dies with SIGKILL; mpirun must end the others.
TEST(CommFault, ARankThatIsMissingEndsTheJob) {
  const char* fault = std::getenv("LATHE_COMM_FAULT");
  if (!fault) GTEST_SKIP() << "run by the comm_fault_* ctest entries";
  auto world = mpi_world(3);
  Tensor t = cpu_tensor({1.0f});
  world->all_reduce(t).wait();  // #1: everyone
  if (world->rank() == 1) {
    if (std::string(fault) == "kill") raise(SIGKILL);
    std::this_thread::sleep_for(std::chrono::seconds(30));  // stopped: never reaches #2
  }
  world->all_reduce(t).wait();  // #2
  FAIL() << "the collective completed without rank 1";
}
