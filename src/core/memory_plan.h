// Activation memory plan: the memory a repeating window of work allocates and frees (a training step: its batch,
// activations, gradients and the optimizer's temporaries) laid out once in a single arena, every block at an offset
// fixed ahead from a recorded window, instead of being taken from and returned to a general allocator block by block.
//
// PlannedAllocator wraps a device's allocator (the backing one). Until there is a plan, calls outside windows pass
// through. The window numbered `record_window` (counting from 0; by default the second, after the first has created
// the gradients and the libraries' workspaces) is recorded: each allocation's rounded size and its lifetime in the
// window's events.
// When it closes, plan_memory gives every block that died inside it an offset such that blocks alive at the same
// time never overlap, the backing allocator's cache is released and the arena is taken from it in one piece. In every
// later window the i-th allocation gets the i-th planned block when it is no larger than the recorded one and no live
// arena block overlaps it; any other allocation (a block that outlived the recorded window, a window whose sequence
// differs) comes from the backing allocator, so a window that does not repeat costs its hits, never correctness.
// Between windows (an evaluation, a checkpoint) allocations take the highest gap of the idle arena that fits, so the
// arena does not sit beside the memory they need; one still live when a window begins (an input made before it) makes
// the planned blocks it overlaps miss, so inputs belong inside the window, as the trainer makes its batches.
// Reuse follows host order, as in the caching allocator: correct for work queued on one stream; work on another stream
// releases its blocks only after the default stream has waited for it (parallel/grad_reducer.h). Under AddressSanitizer
// a host arena stays poisoned wherever no live block asked for bytes, so overflows and use-after-free inside it are
// reported as for blocks of their own.
// plan_stats() reports hits and misses; a plan is made once per allocator (no re-planning: docs/training.md).
// Covered by tests/unit/test_memory_plan.cpp (planner properties, the allocator on host memory, training with and
// without a plan bitwise equal on the CPU and on CUDA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/allocator.h"

namespace lathe {

constexpr size_t kPlanAlignment = 512;  // arena offsets and planned sizes are multiples of this

// One allocation of a recorded window: its size (rounded to kPlanAlignment) and its lifetime [born, died) in the
// window's events (each allocation and each free is one event). died < 0: still live when the window closed (a
// gradient, a result the caller keeps); such a block stays out of the arena.
struct AllocationRecord {
  size_t bytes = 0;
  int64_t born = 0;
  int64_t died = -1;
};

struct MemoryPlan {
  std::vector<int64_t> offsets;  // per record: byte offset in the arena, or -1 (not in the arena)
  size_t arena_bytes = 0;        // the arena's size
  size_t peak_live_bytes = 0;    // the largest total size of arena blocks alive at one event: no plan can do better
  int64_t peak_event = -1;       // the first event at which that many bytes are alive
};

// Offsets for the records that die inside the window, such that two blocks whose lifetimes overlap never overlap in
// the arena. Greedy: the largest block first (earlier birth breaks ties), each at the lowest offset that leaves it
// clear of the blocks already placed whose lifetimes overlap its own. Deterministic.
MemoryPlan plan_memory(const std::vector<AllocationRecord>& records);

// What the recorded window held at its peak, for finding where a step's memory goes (`lathe bench --memory-report`).
struct PeakReport {
  int64_t event = -1, events = 0;          // the peak's event, of the recorded window's events
  std::vector<AllocationRecord> blocks;    // the arena blocks alive then: largest first, by birth within a size
  AllocatorStats at_begin;                 // the backing allocator's as the recorded window began
};

struct PlanStats {
  int64_t windows = 0;          // windows closed
  bool planned = false;         // a plan is in use
  std::string not_planned;      // why there is none after the recorded window (empty while none was tried)
  size_t arena_bytes = 0;
  size_t peak_live_bytes = 0;
  int64_t planned_blocks = 0;   // allocations of the recorded window placed in the arena
  int64_t recorded_blocks = 0;  // allocations of the recorded window
  int64_t hits = 0;             // allocations served from the arena, all windows
  int64_t misses = 0;           // allocations of planned windows that departed from the plan (backing allocator)
  int64_t between_hits = 0;     // allocations between windows served from the idle arena
  int64_t last_hits = 0, last_misses = 0;  // the same, for the last window closed
};

class PlannedAllocator final : public Allocator {
 public:
  explicit PlannedAllocator(Allocator& backing, int64_t record_window = 1);
  ~PlannedAllocator() override;
  PlannedAllocator(const PlannedAllocator&) = delete;
  PlannedAllocator& operator=(const PlannedAllocator&) = delete;

  // A window is the work that repeats. Windows do not nest. abort_window() closes one that an error cut short: it
  // is never planned from (the next window is recorded instead).
  void begin_window();
  void end_window();
  void abort_window();

  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;
  Device device() const override { return backing_.device(); }
  std::string name() const override { return "planned(" + backing_.name() + ")"; }
  // The backing allocator's statistics: the arena counts as one live allocation of arena_bytes.
  AllocatorStats stats() const override { return backing_.stats(); }
  void reset_peak() override { backing_.reset_peak(); }
  void release_cached() override { backing_.release_cached(); }

  PlanStats plan_stats() const;
  PeakReport peak_report() const;  // empty (event -1) until a window has been recorded

  // Ends the plan: the arena goes back to the backing allocator, which serves every later allocation (a trainer
  // calls it after its last step, before generation). False, and nothing changes, while a window is open or a block
  // of the arena is still live.
  bool release_arena();

 private:
  void close_window(bool planable);
  void make_plan();  // from records_; under the lock

  Allocator& backing_;
  const int64_t record_window_;
  const bool host_;           // host memory: poisoned for AddressSanitizer where no live block is
  mutable std::mutex mutex_;
  bool open_ = false;
  int64_t window_ = 0;        // windows closed so far (the open one's number while open)
  int64_t alloc_index_ = 0;   // allocations in the open window
  int64_t event_ = 0;         // events in the recorded window
  bool recording_ = false;    // the open window is being recorded
  std::vector<AllocationRecord> records_;
  int64_t recorded_events_ = 0;
  AllocatorStats stats_at_record_begin_;
  std::unordered_map<void*, size_t> recorded_live_;  // block -> its record, while recording
  MemoryPlan plan_;
  char* arena_ = nullptr;
  size_t arena_size_ = 0;     // bytes taken from the backing allocator (plan_.arena_bytes, at least 1)
  std::map<size_t, size_t> live_;  // live arena blocks: offset -> end
  PlanStats stats_;
  int64_t window_hits_ = 0, window_misses_ = 0;
};

// Opens a window on `plan` (nothing when null) until close() or its end; closed as aborted when an exception leaves
// it. Closing the recorded window makes the plan, whose errors (a CUDA error releasing the cache) propagate from
// close(), or from the destructor when no exception is in flight.
class MemoryPlanWindow {
 public:
  explicit MemoryPlanWindow(PlannedAllocator* plan);
  ~MemoryPlanWindow() noexcept(false);
  MemoryPlanWindow(const MemoryPlanWindow&) = delete;
  MemoryPlanWindow& operator=(const MemoryPlanWindow&) = delete;
  void close();

 private:
  PlannedAllocator* plan_;  // null once closed
  int exceptions_;
};

}  // namespace lathe
