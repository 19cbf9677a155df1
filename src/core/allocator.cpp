#include "core/allocator.h"

#include <cstdlib>
#include <new>

#include "core/error.h"

namespace lathe {

std::string Device::str() const {
  return type == DeviceType::CPU ? std::string("cpu") : fmt::format("cuda:{}", index);
}

const char* device_type_name(DeviceType t) { return t == DeviceType::CPU ? "cpu" : "cuda"; }

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0 && text.size() > 5) {
    int index = 0;
    for (size_t i = 5; i < text.size(); ++i) {
      LATHE_CHECK(text[i] >= '0' && text[i] <= '9' && index < 1000,
                  "device: invalid device '{}' (expected cpu, cuda or cuda:N)", text);
      index = index * 10 + (text[i] - '0');
    }
    return Device::cuda(index);
  }
  LATHE_FAIL("device: invalid device '{}' (expected cpu, cuda or cuda:N)", text);
}

void* HostAllocator::allocate(size_t nbytes) {
  const size_t rounded = (nbytes + 63) / 64 * 64;
  void* p = rounded == 0 ? nullptr : std::aligned_alloc(64, rounded);
  LATHE_CHECK(rounded == 0 || p != nullptr, "memory: host allocation of {} bytes failed", nbytes);
  std::lock_guard lock(mutex_);
  stats_.allocated += int64_t(nbytes);
  stats_.requested += int64_t(nbytes);
  stats_.reserved += int64_t(nbytes);
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  stats_.num_allocs++;
  stats_.num_system_allocs++;
  return p;
}

void HostAllocator::deallocate(void* ptr, size_t nbytes) {
  std::free(ptr);
  std::lock_guard lock(mutex_);
  stats_.allocated -= int64_t(nbytes);
  stats_.requested -= int64_t(nbytes);
  stats_.reserved -= int64_t(nbytes);
}

AllocatorStats HostAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void HostAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak_allocated = stats_.allocated;
}

}  // namespace lathe
