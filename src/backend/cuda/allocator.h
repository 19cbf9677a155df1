// CUDA memory: a caching device allocator and a pinned host allocator.
// The caching allocator keeps freed blocks in size-sorted free lists and hands them out again without a
// cudaMalloc. Sizes round up to 512 bytes (blocks under 1 MiB) or 2 MiB (larger); a cached block is reused
// for a request of at least half its size. Blocks are not split. Reuse is ordered by the device's default
// stream: a tensor freed while another stream still uses it must be kept alive by that stream's owner.
// release_cached() returns every free block to the driver (e.g. before handing memory to a rollout engine).
// Covered by tests/unit/test_cuda_runtime.cpp.
#pragma once

#include <map>
#include <mutex>
#include <unordered_map>

#include "core/allocator.h"

namespace lathe::cuda {

class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(int device) : device_(device) {}
  ~CachingAllocator() override;

  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;
  Device device() const override { return Device::cuda(device_); }
  std::string name() const override { return "cuda_caching"; }
  AllocatorStats stats() const override;
  void reset_peak() override;
  void release_cached() override;

  static size_t round_size(size_t nbytes);

 private:
  void* system_alloc(size_t bytes);  // cudaMalloc, retrying once after releasing the cache

  int device_;
  mutable std::mutex mutex_;
  std::multimap<size_t, void*> free_;           // block size -> block
  std::unordered_map<void*, size_t> live_;      // block -> block size
  AllocatorStats stats_;
};

class PinnedHostAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;
  Device device() const override { return Device::cpu(); }
  std::string name() const override { return "cuda_pinned_host"; }
  AllocatorStats stats() const override;
  void reset_peak() override;

 private:
  mutable std::mutex mutex_;
  AllocatorStats stats_;
};

}  // namespace lathe::cuda
