#include "backend/cpu/cpu_backend.h"

#include <unistd.h>

#include <omp.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "backend/registry.h"

namespace lathe {

namespace {

class CpuStream final : public Stream {
 public:
  Device device() const override { return Device::cpu(); }
  void synchronize() override {}
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
};

class CpuEvent final : public Event {
 public:
  void record(Stream&) override { time_ = std::chrono::steady_clock::now(); }
  void wait(Stream&) override {}
  void synchronize() override {}
  double elapsed_ms_since(const Event& start) override {
    const auto& s = dynamic_cast<const CpuEvent&>(start);
    return std::chrono::duration<double, std::milli>(time_ - s.time_).count();
  }

 private:
  std::chrono::steady_clock::time_point time_;
};

CpuStream g_cpu_stream;  // stateless: one shared instance is enough

}  // namespace

DeviceInfo CpuBackend::info(int) const {
  return {"cpu", 0, fmt::format("{} hardware threads, {} OpenMP threads", std::thread::hardware_concurrency(),
                                omp_get_max_threads())};
}

int64_t CpuBackend::free_memory(int) { return int64_t(sysconf(_SC_AVPHYS_PAGES)) * int64_t(sysconf(_SC_PAGESIZE)); }

Allocator& CpuBackend::allocator(int index) {
  LATHE_CHECK(index == 0, "cpu: there is one cpu device, not {}", index);
  return allocator_;
}

Stream& CpuBackend::default_stream(int) { return g_cpu_stream; }
std::unique_ptr<Stream> CpuBackend::create_stream(int) { return std::make_unique<CpuStream>(); }
std::unique_ptr<Event> CpuBackend::create_event(int) { return std::make_unique<CpuEvent>(); }

void CpuBackend::copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes, Stream&) {
  LATHE_ASSERT(dst_device.is_cpu() && src_device.is_cpu());
  if (nbytes) std::memcpy(dst, src, nbytes);
}

void CpuBackend::fill_bytes(void* dst, uint8_t value, size_t nbytes, Stream&) {
  if (nbytes) std::memset(dst, value, nbytes);
}

void CpuBackend::register_kernels(KernelRegistry& registry) {
  register_cpu_matmul_kernels(registry);
  register_cpu_elementwise_kernels(registry);
  register_cpu_reduce_kernels(registry);
  register_cpu_model_kernels(registry);
  register_cpu_optim_kernels(registry);
  register_cpu_segment_kernels(registry);
  register_cpu_gated_delta_kernels(registry);
  register_cpu_grouped_matmul_kernels(registry);
  register_cpu_moe_route_kernels(registry);
  register_cpu_moe_exchange_kernels(registry);
}

}  // namespace lathe
