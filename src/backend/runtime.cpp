#include "backend/runtime.h"

#include "backend/cpu/cpu_backend.h"
#include "backend/profiler.h"
#include "ops/composite.h"
#include "ops/ops.h"

namespace lathe {

#ifdef LATHE_WITH_CUDA
std::unique_ptr<DeviceBackend> create_cuda_backend();  // backend/cuda/cuda_backend.cpp
#endif

void DeviceBackend::begin_capture(Stream& stream) {
  throw Error(fmt::format("graphs: the {} backend does not record them", stream.device().str()));
}

std::unique_ptr<Graph> DeviceBackend::end_capture(Stream& stream) {
  throw Error(fmt::format("graphs: the {} backend does not record them", stream.device().str()));
}

Runtime::Runtime() : Runtime(std::function<void(KernelRegistry&)>{}) {}

Runtime::Runtime(const std::function<void(KernelRegistry&)>& first) : cpu_(std::make_unique<CpuBackend>()) {
#ifdef LATHE_WITH_CUDA
  cuda_ = create_cuda_backend();
#endif
  if (first) first(registry_);
  cpu_->register_kernels(registry_);
  if (cuda_) cuda_->register_kernels(registry_);
  register_composites(registry_);
}

Runtime::~Runtime() = default;

DeviceBackend& Runtime::backend(DeviceType type) {
  if (type == DeviceType::CPU) return *cpu_;
  LATHE_CHECK(cuda_ != nullptr, "device: this build of lathe has no CUDA backend (built with LATHE_CUDA=OFF or "
                                "without a CUDA toolkit)");
  return *cuda_;
}

bool Runtime::has_device(Device device, std::string* why) const {
  if (device.is_cpu()) return device.index == 0;
  if (!cuda_) {
    if (why) *why = "this build has no CUDA backend";
    return false;
  }
  if (device.index >= 0 && device.index < cuda_->device_count()) return true;
  if (why) {
    *why = cuda_->device_count() == 0
               ? cuda_->unavailable_reason()
               : fmt::format("{} is out of range ({} CUDA devices)", device.str(), cuda_->device_count());
  }
  return false;
}

void Runtime::check_device(Device device) const {
  std::string why;
  LATHE_CHECK(has_device(device, &why), "device: {} is not available: {}", device.str(), why);
}

ExecContext Runtime::context(Device device) {
  check_device(device);
  DeviceBackend& b = backend(device.type);
  PlannedAllocator* plan = memory_plan(device);
  const auto routed = allocators_.find({device.type, device.index});
  Allocator& allocator = routed != allocators_.end() ? *routed->second
                         : plan                      ? static_cast<Allocator&>(*plan)
                                                     : b.allocator(device.index);
  return ExecContext{registry_, b, device, allocator, b.default_stream(device.index), nullptr,
                     profiler_ && profiler_->device() == device ? profiler_ : nullptr, gemm_autotune_};
}

AllocatorScope::AllocatorScope(Runtime& rt, Device device, Allocator& allocator) : rt_(&rt), device_(device) {
  auto& slot = rt.allocators_[{device.type, device.index}];
  previous_ = slot;
  slot = &allocator;
}

AllocatorScope::~AllocatorScope() {
  const std::pair<DeviceType, int> key{device_.type, device_.index};
  if (previous_) rt_->allocators_[key] = previous_;
  else rt_->allocators_.erase(key);
}

PlannedAllocator& Runtime::enable_memory_plan(Device device, int64_t record_window) {
  check_device(device);
  auto& plan = plans_[{device.type, device.index}];
  LATHE_CHECK(!plan, "memory plan: {} already has one", device.str());
  plan = std::make_unique<PlannedAllocator>(backend(device.type).allocator(device.index), record_window);
  return *plan;
}

PlannedAllocator* Runtime::memory_plan(Device device) {
  const auto it = plans_.find({device.type, device.index});
  return it == plans_.end() ? nullptr : it->second.get();
}

void Runtime::synchronize(Device device) { backend(device.type).default_stream(device.index).synchronize(); }

Tensor Runtime::copy_to(const Tensor& t, Device device) {
  ExecContext src_ctx = context(t.device());
  const Tensor src = contiguous(src_ctx, t);
  ExecContext dst_ctx = context(device);
  Tensor out = Tensor::empty(t.shape(), t.dtype(), dst_ctx.allocator);
  if (device.is_cpu()) {
    download(src, out.data_ptr());
    return out;
  }
  src_ctx.stream.synchronize();
  dst_ctx.backend.copy(out.data_ptr(), device, src.data_ptr(), t.device(), out.nbytes(), dst_ctx.stream);
  dst_ctx.stream.synchronize();
  return out;
}

void Runtime::download(const Tensor& t, void* dst) {
  LATHE_CHECK(t.is_contiguous(), "runtime: download takes a contiguous tensor");
  ++downloads_;
  ExecContext ctx = context(t.device());
  ctx.stream.synchronize();
  ctx.backend.copy(dst, Device::cpu(), t.data_ptr(), t.device(), t.nbytes(), ctx.stream);
  ctx.stream.synchronize();
}

Tensor Runtime::upload(const void* data, const Shape& shape, DType dtype, Device device) {
  ExecContext ctx = context(device);
  Tensor out = Tensor::empty(shape, dtype, ctx.allocator);
  ctx.stream.upload(out.data_ptr(), data, out.nbytes());
  return out;
}

Tensor Runtime::from_host(const void* data, const Shape& shape, DType dtype, Device device) {
  ExecContext ctx = context(device);
  Tensor out = Tensor::empty(shape, dtype, ctx.allocator);
  ctx.backend.copy(out.data_ptr(), device, data, Device::cpu(), out.nbytes(), ctx.stream);
  ctx.stream.synchronize();
  return out;
}

}  // namespace lathe
