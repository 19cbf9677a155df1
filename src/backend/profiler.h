// Per-op time profile. While a profiler is set on an ExecContext (Runtime::set_profiler hands it to every context the
// runtime makes), run_op times each kernel it dispatches with a pair of the device's events recorded on the op's
// stream: CUDA events on CUDA (pooled and read once, after the profiled work, so profiling adds two event records
// per op and no synchronisation), a steady clock on the CPU. Without a profiler run_op pays one null test.
// Time goes to the outermost exact kernel: a composite is the ops it is made of (each timed itself), and an op
// nested inside an exact kernel counts in that kernel, so no interval is counted twice. Work not dispatched through
// run_op (copies, fills, host code, waits) is not covered: the step's wall time minus the kernels' total is that.
// Each record also keeps the host time spent inside the kernel's run function (launches, plan building, heuristic
// queries): where it approaches the device interval, the op is host-bound (the device waited for its launches).
// The time between one timed op's end and the next one's start (copies, fills, waits for the host, idle) is summed by
// the pair of kernels around it (Profile::gaps), which says where the untimed part of a step sits.
// Covered by tests/unit/test_profiler.cpp and tests/e2e/test_bench.cpp (`lathe bench --profile`).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "ops/op_table.h"

namespace lathe {

struct OpCall;
struct Resolution;

class OpProfiler {
 public:
  // Times the ops that run on `device`, with events of its backend.
  OpProfiler(DeviceBackend& backend, Device device);
  ~OpProfiler();
  OpProfiler(const OpProfiler&) = delete;
  OpProfiler& operator=(const OpProfiler&) = delete;
  Device device() const { return device_; }

  // run_op's hooks around a kernel's run function (end is called even when the run throws); begin returns the
  // token to pass to end (negative: this call is not timed).
  int begin(const OpCall& call, const Resolution& resolution, Stream& stream);
  void end(int token, Stream& stream);

  struct Total {
    std::string name;  // kernel name (the resolution's), or for matmul_shapes "M x N x K <layout>"
    OpId op = OpId::matmul;
    int64_t calls = 0;
    double ms = 0;
    double host_ms = 0;  // host time inside the run functions (steady clock)
    double flops = 0;  // matmul: 2 M N K per call (batched: times the batch); 0 for other ops
  };
  struct Profile {
    std::vector<Total> kernels;        // by kernel name, largest total first
    std::vector<Total> matmul_shapes;  // the matmul calls by shape and layout, largest total first
    std::vector<std::pair<std::string, int64_t>> composites;  // composites run (their time is in their ops), calls
    // Time between consecutive timed ops, by "previous kernel -> next kernel" (name), largest total first; calls =
    // how many such gaps. Ops of one stream in launch order (the profiled runs use one stream).
    std::vector<Total> gaps;
    double kernels_ms = 0;             // sum of the kernels' times
    double span_ms = 0;                // first kernel's start to the last one's end
    int64_t calls = 0;
  };
  // Waits for the recorded events, sums them and forgets the records (their events are reused).
  Profile collect();

 private:
  struct Record {
    int kernel;  // index into names_
    int shape;   // index into names_ for matmul, else -1
    OpId op;
    double flops;
    Event* start;
    Event* stop;
    std::chrono::steady_clock::time_point host_start;
    double host_ms;
  };
  Event* acquire_event();
  int intern(const std::string& name);

  DeviceBackend& backend_;
  Device device_;
  std::vector<std::unique_ptr<Event>> pool_;
  size_t pool_used_ = 0;
  std::vector<Record> records_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, int> name_index_;
  std::unordered_map<std::string, int64_t> composite_calls_;
  int depth_ = 0;  // exact kernels being timed that enclose the current call
};

}  // namespace lathe
