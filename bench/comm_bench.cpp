// The collectives of Lathe's NCCL communicator, timed (issue 25: tensor-parallel communication against the bytes moved
// and the link's bandwidth; issue 26: the all-to-all). Each rank, one GPU, times all_gather, reduce_scatter, all_reduce
// and an even all_to_all of bf16 tensors on its default stream (where the model's collectives run) between CUDA events
// — one call on an idle GPU, and ten queued back to back — for full tensors from 1 MiB to 1 GiB: the sizes a
// tensor-parallel layer moves (tokens x hidden x 2 bytes: 32 MiB for 4,096 tokens of the Qwen3-8B shape) and NCCL's own
// bandwidth test size. Rank 0 prints one JSON line per collective and size: the median time a call (queued;
// one_call_ms: alone), the algorithm bandwidth (the full tensor's bytes over the time) and the bus bandwidth (NCCL's
// convention: x (n-1)/n for gather, scatter and all-to-all, x 2(n-1)/n for all-reduce; what one link carries).
// Launched by bench/run_comm.sh.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/runtime.h"
#include "comm/launch.h"
#include "core/device.h"

using namespace lathe;

int main() {
  try {
    Runtime rt;
    const LaunchEnv env = launch_env();
    std::string device = "cuda";
    std::optional<MpiSession> mpi;
    const std::unique_ptr<Communicator> world = join_world(rt, device, env, 120.0, mpi, "comm_bench");
    LATHE_CHECK(world != nullptr, "comm_bench: a world of one rank has nothing to time (bench/run_comm.sh starts two)");
    const Device dev = parse_device(device);
    ExecContext ctx = rt.context(dev);
    const int64_t n = world->size();
    auto start = ctx.backend.create_event(dev.index), stop = ctx.backend.create_event(dev.index);
    for (const int64_t mib : {1, 4, 16, 32, 64, 256, 1024}) {
      const int64_t elems = mib * 1048576 / 2;
      Tensor full = Tensor::empty({elems}, DType::BF16, ctx.allocator), part = Tensor::empty({elems / n}, DType::BF16, ctx.allocator);
      Tensor scratch = Tensor::empty({elems}, DType::BF16, ctx.allocator);
      const std::vector<int64_t> even(size_t(n), elems / n);
      struct Case {
        const char* name;
        double bus_factor;
        std::function<void()> run;
      };
      const std::vector<Case> cases = {
          {"all_gather", double(n - 1) / double(n), [&] { world->all_gather(part, full); }},
          {"reduce_scatter", double(n - 1) / double(n), [&] { world->reduce_scatter(full, part); }},
          {"all_reduce", 2.0 * double(n - 1) / double(n), [&] { world->all_reduce(full); }},
          // An even all-to-all of the full tensor (each rank sends a 1/n block to every rank: expert parallelism's
          // dispatch with balanced experts, context parallelism's head exchange).
          {"all_to_all", double(n - 1) / double(n), [&] { world->all_to_all(full, even, scratch, even); }}};
      for (const Case& c : cases) {
        // One call on an idle GPU (the host's queueing included), and a run of `reps` calls queued back to back (the
        // GPU's time per call, as in a step where the host runs ahead): medians over `iters`.
        const int iters = mib >= 256 ? 5 : 15, reps = 10;
        for (int i = 0; i < 3; ++i) c.run();
        std::vector<double> one, queued;
        for (int i = 0; i < iters; ++i) {
          for (int k : {1, reps}) {
            start->record(ctx.stream);
            for (int r = 0; r < k; ++r) c.run();
            stop->record(ctx.stream);
            stop->synchronize();
            (k == 1 ? one : queued).push_back(stop->elapsed_ms_since(*start) / k);
          }
        }
        std::sort(one.begin(), one.end());
        std::sort(queued.begin(), queued.end());
        const double ms = queued[queued.size() / 2], bytes = double(mib) * 1048576.0;
        if (world->rank() == 0)
          fmt::print("{{\"collective\": \"{}\", \"ranks\": {}, \"mib\": {}, \"ms\": {:.4f}, \"one_call_ms\": {:.4f}, "
                     "\"algbw_gbs\": {:.1f}, \"busbw_gbs\": {:.1f}, \"device\": \"{}\"}}\n",
                     c.name, n, mib, ms, one[one.size() / 2], bytes / (ms * 1e-3) / 1e9,
                     c.bus_factor * bytes / (ms * 1e-3) / 1e9, ctx.backend.info(dev.index).name);
      }
    }
    world->barrier();
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "comm_bench: error: {}\n", e.what());
    return 1;
  }
}
