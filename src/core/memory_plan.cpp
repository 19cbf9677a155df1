#include "core/memory_plan.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "core/error.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

namespace lathe {

namespace {

// Under AddressSanitizer (LATHE_SANITIZE=ON) a host arena keeps every byte that no live block asked for poisoned, so
// a read or write past a tensor's end, or into a freed block, is reported as it would be for a block of its own.
// Device arenas have no host shadow memory and are left alone.
void poison(bool host, const char* p, size_t n) {
#if defined(__SANITIZE_ADDRESS__)
  if (host && n) ASAN_POISON_MEMORY_REGION(p, n);
#else
  (void)host, (void)p, (void)n;
#endif
}

void unpoison(bool host, const char* p, size_t n) {
#if defined(__SANITIZE_ADDRESS__)
  if (host && n) ASAN_UNPOISON_MEMORY_REGION(p, n);
#else
  (void)host, (void)p, (void)n;
#endif
}

size_t planned_size(size_t nbytes) {
  return (std::max<size_t>(nbytes, 1) + kPlanAlignment - 1) / kPlanAlignment * kPlanAlignment;
}

bool lifetimes_overlap(const AllocationRecord& a, const AllocationRecord& b) {
  return a.born < b.died && b.born < a.died;
}

}  // namespace

MemoryPlan plan_memory(const std::vector<AllocationRecord>& records) {
  MemoryPlan plan;
  plan.offsets.assign(records.size(), -1);
  std::vector<size_t> order;  // the records that die inside the window
  std::vector<std::pair<int64_t, int64_t>> changes;  // (event, +bytes at birth / -bytes at death)
  for (size_t i = 0; i < records.size(); ++i) {
    const AllocationRecord& r = records[i];
    if (r.died < 0) continue;
    LATHE_ASSERT(r.died > r.born && r.bytes % kPlanAlignment == 0);
    order.push_back(i);
    changes.push_back({r.born, int64_t(r.bytes)});
    changes.push_back({r.died, -int64_t(r.bytes)});
  }
  std::sort(changes.begin(), changes.end());
  int64_t live = 0;
  for (const auto& [event, delta] : changes) {
    live += delta;
    if (size_t(live) > plan.peak_live_bytes) {
      plan.peak_live_bytes = size_t(live);
      plan.peak_event = event;
    }
  }

  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (records[a].bytes != records[b].bytes) return records[a].bytes > records[b].bytes;
    return records[a].born < records[b].born;
  });
  std::vector<size_t> placed;                     // records placed so far
  std::vector<std::pair<size_t, size_t>> busy;    // [offset, end) of the placed ones alive with the next
  for (size_t i : order) {
    const AllocationRecord& r = records[i];
    busy.clear();
    for (size_t j : placed)
      if (lifetimes_overlap(r, records[j]))
        busy.push_back({size_t(plan.offsets[j]), size_t(plan.offsets[j]) + records[j].bytes});
    std::sort(busy.begin(), busy.end());
    size_t at = 0;  // the lowest offset clear of every busy range seen so far
    for (const auto& [begin, end] : busy) {
      if (begin >= at + r.bytes) break;  // the gap before this range fits
      at = std::max(at, end);
    }
    plan.offsets[i] = int64_t(at);
    plan.arena_bytes = std::max(plan.arena_bytes, at + r.bytes);
    placed.push_back(i);
  }
  return plan;
}

PlannedAllocator::PlannedAllocator(Allocator& backing, int64_t record_window)
    : backing_(backing), record_window_(record_window), host_(backing.device().is_cpu()) {
  LATHE_CHECK(record_window >= 0, "memory plan: the recorded window must be 0 or later, got {}", record_window);
}

PlannedAllocator::~PlannedAllocator() {
  unpoison(host_, arena_, arena_size_);
  if (arena_) backing_.deallocate(arena_, arena_size_);
}

void PlannedAllocator::begin_window() {
  std::lock_guard lock(mutex_);
  LATHE_CHECK(!open_, "memory plan: a window was begun inside another (windows do not nest)");
  open_ = true;
  alloc_index_ = 0;
  event_ = 0;
  window_hits_ = window_misses_ = 0;
  recording_ = !stats_.planned && stats_.not_planned.empty() && window_ >= record_window_;
  if (recording_) {
    records_.clear();
    stats_at_record_begin_ = backing_.stats();
  }
}

void PlannedAllocator::end_window() { close_window(true); }
void PlannedAllocator::abort_window() { close_window(false); }

void PlannedAllocator::close_window(bool planable) {
  std::lock_guard lock(mutex_);
  LATHE_CHECK(open_, "memory plan: a window was closed that was never begun");
  open_ = false;
  if (recording_) {
    recording_ = false;
    recorded_live_.clear();  // blocks still live stay out of the arena (died < 0)
    if (planable) make_plan();
    else records_.clear();  // the next window is recorded instead
  }
  ++window_;
  ++stats_.windows;
  stats_.last_hits = window_hits_;
  stats_.last_misses = window_misses_;
}

void PlannedAllocator::make_plan() {
  recorded_events_ = event_;
  plan_ = plan_memory(records_);
  stats_.recorded_blocks = int64_t(records_.size());
  stats_.planned_blocks = int64_t(std::count_if(plan_.offsets.begin(), plan_.offsets.end(),
                                                [](int64_t o) { return o >= 0; }));
  stats_.arena_bytes = plan_.arena_bytes;
  stats_.peak_live_bytes = plan_.peak_live_bytes;
  if (stats_.planned_blocks == 0) {
    stats_.not_planned = "the recorded window freed none of its allocations";
    return;
  }
  backing_.release_cached();  // the recorded window's blocks, cached now, would otherwise sit beside the arena
  try {
    arena_ = static_cast<char*>(backing_.allocate(plan_.arena_bytes));
  } catch (const Error& e) {
    stats_.not_planned = fmt::format("no arena of {} MiB: {}", plan_.arena_bytes >> 20, e.what());
    return;
  }
  arena_size_ = plan_.arena_bytes;
  poison(host_, arena_, arena_size_);
  stats_.planned = true;
}

void* PlannedAllocator::allocate(size_t nbytes) {
  std::lock_guard lock(mutex_);
  if (nbytes == 0) return backing_.allocate(nbytes);  // empty blocks take no index: no address to track
  const size_t size = planned_size(nbytes);
  if (!open_) {
    // Between windows (evaluation, checkpoints) the arena is mostly idle: its highest gap that fits, else the backing
    // allocator. Such a block still live in a later window (the next step's inputs, made before it begins) makes the
    // planned blocks it overlaps miss; the planner fills the arena from offset 0 up, largest blocks first, so the top
    // is where that costs least.
    if (stats_.planned) {
      size_t top = arena_size_;  // the gap under consideration ends here
      for (auto it = live_.rbegin(); it != live_.rend() && it->second + size > top; ++it) top = it->first;
      if (size <= top) {
        const size_t at = top - size;
        live_.emplace(at, top);
        ++stats_.between_hits;
        unpoison(host_, arena_ + at, nbytes);
        return arena_ + at;
      }
    }
    return backing_.allocate(nbytes);
  }
  const int64_t i = alloc_index_++;
  if (recording_) {
    void* p = backing_.allocate(nbytes);
    recorded_live_[p] = records_.size();
    records_.push_back({size, event_++, -1});
    return p;
  }
  if (!stats_.planned) return backing_.allocate(nbytes);
  const bool known = size_t(i) < records_.size();
  if (known && plan_.offsets[size_t(i)] < 0 && size == records_[size_t(i)].bytes)
    return backing_.allocate(nbytes);  // planned to outlive the window: not a miss
  if (known && plan_.offsets[size_t(i)] >= 0 && size <= records_[size_t(i)].bytes) {
    const size_t off = size_t(plan_.offsets[size_t(i)]);
    // Live blocks never overlap, so the one starting last before this block's end reaches furthest.
    auto next = live_.lower_bound(off + size);
    const bool clear = next == live_.begin() || std::prev(next)->second <= off;
    if (clear) {
      live_.emplace(off, off + size);
      ++stats_.hits;
      ++window_hits_;
      unpoison(host_, arena_ + off, nbytes);
      return arena_ + off;
    }
  }
  ++stats_.misses;
  ++window_misses_;
  return backing_.allocate(nbytes);
}

void PlannedAllocator::deallocate(void* ptr, size_t nbytes) {
  std::lock_guard lock(mutex_);
  char* const c = static_cast<char*>(ptr);
  const bool in_arena = arena_ && c >= arena_ && c < arena_ + arena_size_;
  if (recording_ && ptr) {  // events are counted only while a window is recorded
    const auto it = recorded_live_.find(ptr);
    if (it != recorded_live_.end()) {
      records_[it->second].died = event_;
      recorded_live_.erase(it);
    }
    ++event_;
  }
  if (in_arena) {
    const auto it = live_.find(size_t(c - arena_));
    LATHE_ASSERT(it != live_.end());
    poison(host_, c, it->second - it->first);
    live_.erase(it);
    return;
  }
  backing_.deallocate(ptr, nbytes);
}

bool PlannedAllocator::release_arena() {
  std::lock_guard lock(mutex_);
  if (open_ || !live_.empty()) return false;
  unpoison(host_, arena_, arena_size_);
  if (arena_) backing_.deallocate(arena_, arena_size_);
  arena_ = nullptr;
  arena_size_ = 0;
  stats_.planned = false;
  stats_.not_planned = "released";
  return true;
}

PlanStats PlannedAllocator::plan_stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

PeakReport PlannedAllocator::peak_report() const {
  std::lock_guard lock(mutex_);
  PeakReport r;
  if (plan_.peak_event < 0) return r;
  r.event = plan_.peak_event;
  r.events = recorded_events_;
  r.at_begin = stats_at_record_begin_;
  for (const AllocationRecord& b : records_)
    if (b.died >= 0 && b.born <= r.event && r.event < b.died) r.blocks.push_back(b);
  std::stable_sort(r.blocks.begin(), r.blocks.end(), [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
  return r;
}

MemoryPlanWindow::MemoryPlanWindow(PlannedAllocator* plan) : plan_(plan), exceptions_(std::uncaught_exceptions()) {
  if (plan_) plan_->begin_window();
}

MemoryPlanWindow::~MemoryPlanWindow() noexcept(false) {
  if (plan_ && std::uncaught_exceptions() > exceptions_) plan_->abort_window();
  else close();
}

void MemoryPlanWindow::close() {
  PlannedAllocator* const plan = std::exchange(plan_, nullptr);
  if (plan) plan->end_window();
}

}  // namespace lathe
