// The activation memory plan (core/memory_plan.h): the planner's offsets against a brute-force check of every pair of
// blocks alive together, the allocator on host memory (hits, misses, and that no handed-out block ever overlaps a
// live one, whatever order a window takes), and training with a plan bitwise equal to training without one, on the
// CPU and on CUDA.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>

#include "backend/runtime.h"
#include "model/causal_lm.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "train/trainer_parts.h"

using namespace lathe;

namespace {

// A random window: `n` allocations of random sizes interleaved with frees of random live blocks; about one block in
// six is still live at the end.
std::vector<AllocationRecord> random_records(std::mt19937& rng, int n) {
  std::vector<AllocationRecord> records;
  std::vector<size_t> live;
  int64_t event = 0;
  while (int(records.size()) < n || live.size() > size_t(n / 6)) {
    const bool alloc = int(records.size()) < n && (live.empty() || rng() % 3 != 0);
    if (alloc) {
      live.push_back(records.size());
      records.push_back({(1 + rng() % 64) * kPlanAlignment, event++, -1});
    } else {
      const size_t k = rng() % live.size();
      records[live[k]].died = event++;
      live.erase(live.begin() + long(k));
    }
  }
  return records;
}

bool overlap(size_t a0, size_t a1, size_t b0, size_t b1) { return a0 < b1 && b0 < a1; }

}  // namespace

TEST(MemoryPlan, BlocksAliveTogetherNeverShareBytes) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<AllocationRecord> r = random_records(rng, 300);
    const MemoryPlan plan = plan_memory(r);
    ASSERT_EQ(plan.offsets.size(), r.size());
    size_t sum = 0;
    for (size_t i = 0; i < r.size(); ++i) {
      if (r[i].died < 0) {
        EXPECT_EQ(plan.offsets[i], -1) << "a block live at the window's end stays out of the arena";
        continue;
      }
      ASSERT_GE(plan.offsets[i], 0);
      EXPECT_EQ(size_t(plan.offsets[i]) % kPlanAlignment, 0u);
      EXPECT_LE(size_t(plan.offsets[i]) + r[i].bytes, plan.arena_bytes);
      sum += r[i].bytes;
      for (size_t j = 0; j < i; ++j) {
        if (r[j].died < 0 || !(r[i].born < r[j].died && r[j].born < r[i].died)) continue;
        EXPECT_FALSE(overlap(size_t(plan.offsets[i]), size_t(plan.offsets[i]) + r[i].bytes, size_t(plan.offsets[j]),
                             size_t(plan.offsets[j]) + r[j].bytes))
            << "blocks " << i << " and " << j << " are alive together and overlap";
      }
    }
    // The lower bound, by brute force over every event.
    size_t peak = 0;
    int64_t first_peak = -1;
    for (int64_t e = 0; e < int64_t(2 * r.size()); ++e) {
      size_t live = 0;
      for (const AllocationRecord& a : r)
        if (a.died >= 0 && a.born <= e && e < a.died) live += a.bytes;
      if (live > peak) peak = live, first_peak = e;
    }
    EXPECT_EQ(plan.peak_live_bytes, peak);
    EXPECT_EQ(plan.peak_event, first_peak);
    EXPECT_GE(plan.arena_bytes, peak);
    EXPECT_LT(plan.arena_bytes, sum) << "blocks that never live together share memory";
  }
}

TEST(MemoryPlan, NestedLifetimesPackToTheirPeak) {
  // A forward then backward: a1..a4 allocated in turn, freed in reverse, then two more that reuse the space.
  const size_t k = kPlanAlignment;
  const std::vector<AllocationRecord> r = {{4 * k, 0, 7}, {2 * k, 1, 6}, {8 * k, 2, 5}, {k, 3, 4}, {8 * k, 8, 10},
                                           {6 * k, 9, 11}, {k, 12, -1}};
  const MemoryPlan plan = plan_memory(r);
  EXPECT_EQ(plan.peak_live_bytes, 15 * k);
  EXPECT_EQ(plan.arena_bytes, 15 * k);
  EXPECT_EQ(plan.offsets[6], -1);
}

TEST(PlannedAllocator, RepeatedWindowsComeFromTheArenaAndDifferentOnesNeverOverlapALiveBlock) {
  HostAllocator host;
  PlannedAllocator plan(host, 1);
  std::mt19937 rng(5);
  const std::vector<AllocationRecord> script = random_records(rng, 200);
  // Plays a window: `script`'s allocations and frees, but with probability `swap` a free is postponed to the end, and
  // sizes grow by a block with probability `grow`. Every block is filled with its own byte, checked when freed;
  // every allocation is checked against the live ranges.
  auto play = [&](double swap, double grow) {
    std::mt19937 r2{unsigned(rng())};
    std::uniform_real_distribution<double> u(0, 1);
    struct Live {
      char* p;
      size_t n;
      char fill;
    };
    std::map<size_t, Live> live;  // record -> block
    std::vector<size_t> postponed, kept;
    auto free_block = [&](size_t i) {
      const Live b = live.at(i);
      for (size_t x = 0; x < b.n; ++x) ASSERT_EQ(b.p[x], b.fill) << "block " << i << " was overwritten";
      plan.deallocate(b.p, b.n);
      live.erase(i);
    };
    {
      const MemoryPlanWindow window(&plan);
      std::vector<std::pair<int64_t, size_t>> events;  // (event, record), births and deaths
      for (size_t i = 0; i < script.size(); ++i) {
        events.push_back({script[i].born, i});
        if (script[i].died >= 0) events.push_back({script[i].died, i});
      }
      std::sort(events.begin(), events.end());
      for (const auto& [e, i] : events) {
        if (e == script[i].born) {
          const size_t n = script[i].bytes - 100 + (u(r2) < grow ? kPlanAlignment : 0);
          char* p = static_cast<char*>(plan.allocate(n));
          for (const auto& [j, b] : live)
            ASSERT_FALSE(overlap(size_t(p), size_t(p) + n, size_t(b.p), size_t(b.p) + b.n)) << i << " overlaps " << j;
          const char fill = char(1 + i % 250);
          std::memset(p, fill, n);
          live[i] = {p, n, fill};
        } else if (u(r2) < swap) {
          postponed.push_back(i);
        } else {
          free_block(i);
        }
      }
      for (size_t i : postponed) free_block(i);
      for (const auto& [i, b] : live) kept.push_back(i);
    }
    for (size_t i : kept) free_block(i);  // blocks that outlived the window
  };
  play(0, 0);  // window 0: before the recorded one
  EXPECT_FALSE(plan.plan_stats().planned);
  play(0, 0);  // window 1: recorded
  const PlanStats planned = plan.plan_stats();
  ASSERT_TRUE(planned.planned) << planned.not_planned;
  EXPECT_EQ(planned.recorded_blocks, 200);
  EXPECT_LT(planned.planned_blocks, 200);  // the ones still live at the window's end stay out
  EXPECT_GE(planned.arena_bytes, planned.peak_live_bytes);
  const PeakReport peak = plan.peak_report();  // what --memory-report prints: the blocks that make the peak
  ASSERT_GE(peak.event, 0);
  EXPECT_LT(peak.event, peak.events);
  const auto frees = std::count_if(script.begin(), script.end(), [](const AllocationRecord& a) { return a.died >= 0; });
  EXPECT_EQ(peak.events, 200 + frees) << "the window's allocations and the frees inside it";
  EXPECT_EQ(peak.at_begin.allocated, 0) << "window 0 freed all it kept";
  size_t at_peak = 0;
  for (size_t i = 0; i < peak.blocks.size(); ++i) {
    at_peak += peak.blocks[i].bytes;
    EXPECT_TRUE(peak.blocks[i].born <= peak.event && peak.event < peak.blocks[i].died);
    if (i) EXPECT_GE(peak.blocks[i - 1].bytes, peak.blocks[i].bytes) << "largest first";
  }
  EXPECT_EQ(at_peak, planned.peak_live_bytes);
  play(0, 0);  // the same sequence: every planned block a hit
  EXPECT_EQ(plan.plan_stats().last_hits, planned.planned_blocks);
  EXPECT_EQ(plan.plan_stats().last_misses, 0) << "blocks planned to outlive the window are no misses";
  for (int w = 0; w < 4; ++w) play(0.3, 0.2);  // frees postponed, blocks larger than planned
  const PlanStats after = plan.plan_stats();
  EXPECT_GT(after.last_misses, 0) << "a changed window must miss where it departs";
  EXPECT_GT(after.last_hits, 0);
  EXPECT_EQ(after.windows, 7);
  EXPECT_EQ(host.stats().allocated, int64_t(planned.arena_bytes)) << "only the arena is left";
}

TEST(PlannedAllocator, MisuseIsAnErrorAbortedWindowsAreNotPlannedFromAndTheArenaGoesBackWhenFree) {
  HostAllocator host;
  PlannedAllocator plan(host, 0);
  plan.begin_window();
  EXPECT_THROW(plan.begin_window(), Error);
  void* a = plan.allocate(1000);
  plan.deallocate(a, 1000);
  plan.abort_window();
  EXPECT_FALSE(plan.plan_stats().planned);
  EXPECT_THROW(plan.end_window(), Error);
  {
    const MemoryPlanWindow window(&plan);  // recorded instead of the aborted one
    void* b = plan.allocate(3000);
    plan.deallocate(b, 3000);
  }
  const PlanStats s = plan.plan_stats();
  EXPECT_TRUE(s.planned);
  EXPECT_EQ(s.arena_bytes, 3072u);
  EXPECT_THROW(PlannedAllocator(host, -1), Error);
  // The arena goes back only when none of it is live.
  void* c = nullptr;
  {
    const MemoryPlanWindow window(&plan);
    c = plan.allocate(3000);
    EXPECT_FALSE(plan.release_arena()) << "a window is open";
  }
  EXPECT_EQ(plan.plan_stats().last_hits, 1);
  EXPECT_FALSE(plan.release_arena()) << "a block of the arena outlived its window";
  plan.deallocate(c, 3000);
  EXPECT_TRUE(plan.release_arena());
  EXPECT_EQ(host.stats().allocated, 0);
  {
    const MemoryPlanWindow window(&plan);  // from now on everything passes through
    void* d = plan.allocate(3000);
    EXPECT_EQ(host.stats().allocated, 3000);
    plan.deallocate(d, 3000);
  }
  EXPECT_FALSE(plan.plan_stats().planned);
  EXPECT_EQ(plan.plan_stats().not_planned, "released");
}

TEST(PlannedAllocator, AWindowThatFreesNothingLeavesNoPlanAndSaysWhy) {
  HostAllocator host;
  PlannedAllocator plan(host, 0);
  void* kept = nullptr;
  {
    const MemoryPlanWindow window(&plan);
    kept = plan.allocate(100);
  }
  EXPECT_FALSE(plan.plan_stats().planned);
  EXPECT_NE(plan.plan_stats().not_planned.find("freed none"), std::string::npos);
  plan.deallocate(kept, 100);
  MemoryPlanWindow w(&plan);
  w.close();
  w.close();  // once closed, closing again (and the destructor) does nothing
  EXPECT_EQ(plan.plan_stats().windows, 2);
  plan.begin_window();  // no window is open
  plan.end_window();
}

TEST(PlannedAllocator, BetweenWindowsTheIdleArenaServesAndABlockKeptIntoAWindowOnlyMakesItMiss) {
  HostAllocator host;
  PlannedAllocator plan(host, 0);
  auto window = [&](std::vector<char*>* got) {  // three blocks of 4, 2 and 4 KiB; the first two die before the third
    const MemoryPlanWindow w(&plan);
    char* a = static_cast<char*>(plan.allocate(4096));
    char* b = static_cast<char*>(plan.allocate(2048));
    plan.deallocate(a, 4096);
    plan.deallocate(b, 2048);
    char* c = static_cast<char*>(plan.allocate(4096));
    plan.deallocate(c, 4096);
    if (got) *got = {a, b, c};
  };
  window(nullptr);
  ASSERT_TRUE(plan.plan_stats().planned);
  EXPECT_EQ(plan.plan_stats().arena_bytes, 6144u);
  // Between windows: two blocks from the idle arena's top down, a third that no longer fits from the host.
  void* x = plan.allocate(4096);
  void* y = plan.allocate(1000);
  void* z = plan.allocate(4096);
  EXPECT_EQ(plan.plan_stats().between_hits, 2);
  EXPECT_EQ(host.stats().allocated, 6144 + 4096) << "x and y lie in the arena";
  EXPECT_EQ(static_cast<char*>(y) + 1024, static_cast<char*>(x)) << "y just under x, x at the top";
  plan.deallocate(x, 4096);
  plan.deallocate(z, 4096);
  // y (bytes 1024-2047 of the arena) is still live: the window's blocks that overlap it (a and c at 0-4095) miss,
  // b (4096-6143) hits.
  std::vector<char*> got;
  window(&got);
  EXPECT_EQ(plan.plan_stats().last_misses, 2);
  EXPECT_EQ(plan.plan_stats().last_hits, 1);
  for (char* p : got) EXPECT_FALSE(p <= static_cast<char*>(y) && static_cast<char*>(y) < p + 2048) << "overlaps y";
  plan.deallocate(y, 1000);
  window(&got);
  EXPECT_EQ(plan.plan_stats().last_hits, 3);
  EXPECT_EQ(host.stats().allocated, 6144);
}

// Under AddressSanitizer (-DLATHE_SANITIZE=ON) the host arena is poisoned wherever no live block asked for bytes, so a
// step's tensors keep the overflow and use-after-free reports they would have as allocations of their own.
TEST(PlannedAllocator, UnderAddressSanitizerArenaBlocksAreGuardedLikeTheirOwnAllocations) {
#if !defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "not an AddressSanitizer build (configure with -DLATHE_SANITIZE=ON)";
#else
  HostAllocator host;
  PlannedAllocator plan(host, 0);
  {
    const MemoryPlanWindow w(&plan);
    plan.deallocate(plan.allocate(1000), 1000);
  }
  ASSERT_TRUE(plan.plan_stats().planned);
  const MemoryPlanWindow w(&plan);
  volatile char* p = static_cast<char*>(plan.allocate(1000));
  EXPECT_EQ(plan.plan_stats().hits, 1);
  p[0] = 1;
  p[999] = 1;
  EXPECT_DEATH(p[1000] = 1, "AddressSanitizer");  // past the end, inside the block's rounded 1,024 bytes
  plan.deallocate(const_cast<char*>(p), 1000);
  EXPECT_DEATH(p[0] = 1, "AddressSanitizer");  // freed
#endif
}

namespace {

ModelConfig small_qwen3() {
  nlohmann::json j = {{"model_type", "qwen3"}, {"vocab_size", 96}, {"hidden_size", 32}, {"intermediate_size", 64},
                      {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"head_dim", 8}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0}, {"tie_word_embeddings", true}};
  return parse_model_config(j, "test");
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<std::vector<uint8_t>> params;  // the final parameters' bytes
  PlanStats plan;
};

// Six AdamW steps of a small Qwen3 on `device`, each on a fresh random batch; the fifth has other document lengths
// (a window that departs from the plan). With `planned`, through a memory plan.
TrainRun train(Device device, DType dtype, bool planned) {
  Runtime rt;
  PlannedAllocator* plan = planned ? &rt.enable_memory_plan(device) : nullptr;
  ModelOptions mo;
  mo.device = device;
  mo.dtype = dtype;
  std::unique_ptr<CausalLm> model = random_causal_lm(rt, small_qwen3(), mo, 3, 0.1);
  AdamW opt(rt, model->parameters(), AdamWConfig{});
  TrainRun out;
  std::mt19937 rng(9);
  for (int step = 0; step < 6; ++step) {
    const std::vector<int32_t> cu = step == 4 ? std::vector<int32_t>{0, 9, 40} : std::vector<int32_t>{0, 20, 33};
    std::vector<int32_t> ids(size_t(cu.back()));
    for (int32_t& x : ids) x = int32_t(rng() % 96);
    const MemoryPlanWindow window(plan);  // the step, as the trainer's: the batch is made and the gradients die inside
    const PackedBatch b = make_packed_batch(rt, device, ids, cu, next_token_labels(ids, cu), 96);
    out.losses.push_back(model->loss(b, true).loss);
    opt.step(1e-2);
    model->zero_grads();
  }
  for (const Parameter& p : model->parameters()) {
    const Tensor h = rt.copy_to(p.value, Device::cpu());
    const auto* d = static_cast<const uint8_t*>(h.data_ptr());
    out.params.emplace_back(d, d + h.nbytes());
  }
  if (plan) out.plan = plan->plan_stats();
  return out;
}

void expect_same_training(Device device, DType dtype) {
  const TrainRun plain = train(device, dtype, false);
  const TrainRun planned = train(device, dtype, true);
  ASSERT_TRUE(planned.plan.planned) << planned.plan.not_planned;
  EXPECT_GT(planned.plan.hits, 0);
  EXPECT_GT(planned.plan.misses, 0) << "the fifth step's documents differ: some of its blocks must miss";
  std::printf("[memory plan %s] arena %zu bytes (peak live %zu), %lld of %lld blocks planned, %lld hits, %lld misses\n",
              device.str().c_str(), planned.plan.arena_bytes, planned.plan.peak_live_bytes,
              (long long)planned.plan.planned_blocks, (long long)planned.plan.recorded_blocks,
              (long long)planned.plan.hits, (long long)planned.plan.misses);
  ASSERT_EQ(plain.losses.size(), planned.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i) EXPECT_EQ(plain.losses[i], planned.losses[i]) << "step " << i;
  ASSERT_EQ(plain.params.size(), planned.params.size());
  for (size_t i = 0; i < plain.params.size(); ++i) EXPECT_TRUE(plain.params[i] == planned.params[i]) << "parameter " << i;
}

}  // namespace

TEST(MemoryPlanTraining, CpuStepsAreBitwiseThoseWithoutAPlan) { expect_same_training(Device::cpu(), DType::F32); }

TEST(MemoryPlanTraining, CudaStepsAreBitwiseThoseWithoutAPlan) {
  Runtime probe;
  std::string why;
  if (!probe.has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  expect_same_training(Device::cuda(0), DType::BF16);
}

// A step during which the device allocator found the device full (it freed its whole cache and waited) is said once a
// run, with the count, the step and what makes room; steps without one say nothing.
TEST(MemoryReport, AFullDeviceIsSaidOnceWithWhatMakesRoom) {
  using namespace trainer_parts;
  MemoryReport said;
  Progress progress(1, false);
  testing::internal::CaptureStdout();
  report_full_device(0, 3, said, progress);
  report_full_device(5, 4, said, progress);
  report_full_device(2, 5, said, progress);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("memory: the device was full 5 times in step 4"), std::string::npos) << out;
  EXPECT_NE(out.find("train.micro_batch_tokens"), std::string::npos) << out;
  EXPECT_EQ(out.find("step 3"), std::string::npos) << out;
  EXPECT_EQ(out.find("step 5"), std::string::npos) << out;
}
