// The CPU backend: host memory, a synchronous stream, and the reference kernels (the executable spec).
// Covered by tests/unit/test_core.cpp and tests/ops.
#pragma once

#include "backend/backend.h"

namespace lathe {

class CpuBackend final : public DeviceBackend {
 public:
  DeviceType type() const override { return DeviceType::CPU; }
  int device_count() const override { return 1; }
  DeviceInfo info(int index) const override;
  int64_t free_memory(int index) override;
  Allocator& allocator(int index) override;
  Stream& default_stream(int index) override;
  std::unique_ptr<Stream> create_stream(int index) override;
  std::unique_ptr<Event> create_event(int index) override;
  void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes,
            Stream& stream) override;
  void fill_bytes(void* dst, uint8_t value, size_t nbytes, Stream& stream) override;
  void register_kernels(KernelRegistry& registry) override;

 private:
  HostAllocator allocator_;
};

// One registration function per kernel family (backend/cpu/<family>.cpp).
void register_cpu_matmul_kernels(KernelRegistry& registry);
void register_cpu_elementwise_kernels(KernelRegistry& registry);
void register_cpu_reduce_kernels(KernelRegistry& registry);
void register_cpu_model_kernels(KernelRegistry& registry);
void register_cpu_optim_kernels(KernelRegistry& registry);
void register_cpu_segment_kernels(KernelRegistry& registry);  // segment_ops.cpp
void register_cpu_gated_delta_kernels(KernelRegistry& registry);  // gated_delta.cpp
void register_cpu_grouped_matmul_kernels(KernelRegistry& registry);  // grouped_matmul.cpp
void register_cpu_moe_route_kernels(KernelRegistry& registry);  // moe_route.cpp
void register_cpu_moe_exchange_kernels(KernelRegistry& registry);  // moe_exchange.cpp

}  // namespace lathe
