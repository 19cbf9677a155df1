#include "backend/cuda/allocator.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/device_guard.h"
#include "core/error.h"

namespace lathe::cuda {

namespace {
constexpr size_t kSmallLimit = 1u << 20;
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = 2u << 20;
}  // namespace

size_t CachingAllocator::round_size(size_t nbytes) {
  if (nbytes == 0) nbytes = 1;
  const size_t r = nbytes < kSmallLimit ? kSmallRound : kLargeRound;
  return (nbytes + r - 1) / r * r;
}

CachingAllocator::~CachingAllocator() {
  // Live blocks at exit belong to tensors that outlive the backend; the driver reclaims them.
  for (auto& [size, ptr] : free_) cudaFree(ptr);
}

void* CachingAllocator::try_system_alloc(size_t bytes) {
  DeviceGuard guard(device_);
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear the error state of the failed call
    return nullptr;
  }
  LATHE_CUDA_CHECK(err);
  stats_.reserved += int64_t(bytes);
  stats_.num_system_allocs++;
  return p;
}

void CachingAllocator::free_cached_blocks() {
  DeviceGuard guard(device_);
  for (auto& [size, ptr] : free_) {
    LATHE_CUDA_CHECK(cudaFree(ptr));
    stats_.reserved -= int64_t(size);
  }
  free_.clear();
}

void* CachingAllocator::system_alloc(size_t bytes) {
  if (void* p = try_system_alloc(bytes)) return p;
  stats_.num_cache_flushes++;
  free_cached_blocks();
  if (void* p = try_system_alloc(bytes)) return p;
  DeviceGuard guard(device_);
  size_t free_bytes = 0, total_bytes = 0;
  cudaMemGetInfo(&free_bytes, &total_bytes);
  LATHE_FAIL("cuda: out of memory allocating {} MiB on cuda:{} (lathe holds {} MiB live, {} MiB reserved; "
             "device has {} MiB free of {} MiB)",
             bytes >> 20, device_, stats_.allocated >> 20, stats_.reserved >> 20, free_bytes >> 20, total_bytes >> 20);
}

size_t CachingAllocator::max_cached_block_when_full(size_t size) { return 2 * size; }

size_t CachingAllocator::max_block_for(size_t size) {
  return size < kSmallLimit ? 2 * size : size + std::max(kLargeRound, size / 8);
}

void* CachingAllocator::allocate(size_t nbytes) {
  const size_t size = round_size(nbytes);
  std::lock_guard lock(mutex_);
  void* p = nullptr;
  size_t block = size;
  auto it = free_.lower_bound(size);
  // A cached block near the size; else a new one; else, with the device full, a cached block of at most twice the
  // size; else the cache is emptied (system_alloc: a device-wide synchronisation) and the request placed afresh. A
  // larger block would count whole against the device: small requests in the large blocks a training step left
  // cached once filled a GPU with memory nobody used (docs/memory.md, "The caching allocator").
  const bool fits = it != free_.end() && it->first <= max_block_for(size);
  if (!fits) p = try_system_alloc(size);
  if (!p && it != free_.end() && it->first <= max_cached_block_when_full(size)) {
    p = it->second;
    block = it->first;
    free_.erase(it);
  } else if (!p) {
    p = system_alloc(size);
  }
  live_[p] = {block, nbytes};
  stats_.allocated += int64_t(block);
  stats_.requested += int64_t(nbytes);
  stats_.num_allocs++;
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  return p;
}

void CachingAllocator::deallocate(void* ptr, size_t) {
  std::lock_guard lock(mutex_);
  auto it = live_.find(ptr);
  LATHE_ASSERT(it != live_.end());
  stats_.allocated -= int64_t(it->second.block);
  stats_.requested -= int64_t(it->second.requested);
  free_.emplace(it->second.block, ptr);
  live_.erase(it);
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak_allocated = stats_.allocated;
}

void CachingAllocator::release_cached() {
  std::lock_guard lock(mutex_);
  DeviceGuard guard(device_);
  LATHE_CUDA_CHECK(cudaDeviceSynchronize());  // a cached block may still be read by queued work
  free_cached_blocks();
}

void* PinnedHostAllocator::allocate(size_t nbytes) {
  void* p = nullptr;
  if (nbytes) LATHE_CUDA_CHECK(cudaHostAlloc(&p, nbytes, cudaHostAllocDefault));
  std::lock_guard lock(mutex_);
  stats_.allocated += int64_t(nbytes);
  stats_.requested += int64_t(nbytes);
  stats_.reserved += int64_t(nbytes);
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  stats_.num_allocs++;
  stats_.num_system_allocs++;
  return p;
}

void PinnedHostAllocator::deallocate(void* ptr, size_t nbytes) {
  if (ptr) cudaFreeHost(ptr);
  std::lock_guard lock(mutex_);
  stats_.allocated -= int64_t(nbytes);
  stats_.requested -= int64_t(nbytes);
  stats_.reserved -= int64_t(nbytes);
}

AllocatorStats PinnedHostAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void PinnedHostAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak_allocated = stats_.allocated;
}

}  // namespace lathe::cuda
