// Allocator interface and the host allocator.
// Allocators are owned by their backend (which outlives every tensor) and passed explicitly; storage
// remembers which allocator made it. Statistics count bytes handed out (allocated), bytes held from the
// system (reserved, >= allocated for caching allocators) and the peak of allocated.
// Covered by tests/unit/test_core.cpp (host) and tests/unit/test_cuda_runtime.cpp (CUDA caching allocator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "core/device.h"

namespace lathe {

struct AllocatorStats {
  int64_t allocated = 0;       // bytes in live allocations (a caching allocator counts each one's whole block)
  int64_t requested = 0;       // bytes those allocations asked for (allocated - requested: blocks' slack)
  int64_t reserved = 0;        // bytes obtained from the system (live + cached)
  int64_t peak_allocated = 0;  // high-water mark of `allocated` since the last reset_peak()
  int64_t num_allocs = 0;      // allocate() calls served
  int64_t num_system_allocs = 0;  // times the system allocator was called
  int64_t num_cache_flushes = 0;  // times a full device made a caching allocator free every cached block (each a
                                  // device-wide wait, and the blocks allocated afresh after it)
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;
  virtual AllocatorStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns every cached (not live) block to the system. Live allocations are untouched.
  virtual void release_cached() {}
};

// Host memory, 64-byte aligned (enough for any SIMD load), no caching.
class HostAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;
  Device device() const override { return Device::cpu(); }
  std::string name() const override { return "host"; }
  AllocatorStats stats() const override;
  void reset_peak() override;

 private:
  mutable std::mutex mutex_;
  AllocatorStats stats_;
};

}  // namespace lathe
