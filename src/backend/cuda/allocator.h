// CUDA memory: a caching device allocator and a pinned host allocator.
// The caching allocator keeps freed blocks in size-sorted free lists and hands them out again without a
// cudaMalloc. Sizes round up to 512 bytes (blocks under 1 MiB) or 2 MiB (larger); a cached small block is reused
// for a request of at least half its size, a large one for a request it exceeds by at most an eighth (2 MiB at
// least: max_block_for), or one of up to twice its size when cudaMalloc finds the device full; failing that the whole
// cache is released and the request placed afresh. Blocks are not split. stats() counts whole blocks as allocated and the bytes asked for as
// requested. Reuse is ordered by the device's default stream: a tensor another stream uses is released only after the
// default stream has waited for an event recorded after that use (parallel/grad_reducer.h does so).
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
  // The largest cached block a request of rounded `size` takes: twice the size for small blocks; for large ones the
  // size plus an eighth (at least 2 MiB), so that a long-lived tensor (a parameter, an optimizer state) never sits in
  // a block far larger than itself for the rest of the run. A larger cached block stays cached for a request it fits.
  static size_t max_block_for(size_t size);
  // With the device full, the largest cached block a request of rounded `size` takes before the cache is emptied:
  // twice the size (a larger one would hold more unused memory than the request uses).
  static size_t max_cached_block_when_full(size_t size);

 private:
  void* try_system_alloc(size_t bytes);  // cudaMalloc; nullptr when the device is out of memory
  void* system_alloc(size_t bytes);      // cudaMalloc, retrying once after releasing the cache
  void free_cached_blocks();             // cudaFree of every cached block; under the lock

  int device_;
  mutable std::mutex mutex_;
  std::multimap<size_t, void*> free_;           // block size -> block
  struct LiveBlock {
    size_t block, requested;  // the block's size, the bytes asked for
  };
  std::unordered_map<void*, LiveBlock> live_;
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
