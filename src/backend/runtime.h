// Runtime: the backends present in this build and machine, and the one kernel registry filled from them.
// Made once by the program (the CLI, a test) and passed explicitly; there is no global runtime.
// Covered by tests/unit/test_core.cpp and tests/unit/test_cuda_runtime.cpp.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/registry.h"
#include "core/memory_plan.h"

namespace lathe {

class Runtime;

// While it lives, every context made for `device` allocates from `allocator` (before any memory plan): what a graph
// is recorded with stays in memory of its own (model/rollout_engine.cpp). Scopes nest.
class AllocatorScope {
 public:
  AllocatorScope(Runtime& rt, Device device, Allocator& allocator);
  ~AllocatorScope();
  AllocatorScope(const AllocatorScope&) = delete;
  AllocatorScope& operator=(const AllocatorScope&) = delete;

 private:
  Runtime* rt_;
  Device device_;
  Allocator* previous_ = nullptr;
};

class Runtime {
 public:
  Runtime();
  // Registers `first` before the built-in kernels, so its kernels win resolution (used by tests that plant
  // deliberately broken kernels to prove the op checks catch them).
  explicit Runtime(const std::function<void(KernelRegistry&)>& first);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const KernelRegistry& registry() const { return registry_; }
  // The backend for a device type; throws with the reason when the type is absent from this build.
  DeviceBackend& backend(DeviceType type);
  bool cuda_built() const { return cuda_ != nullptr; }
  // Whether `device` exists here; fills `why` when it does not.
  bool has_device(Device device, std::string* why = nullptr) const;
  void check_device(Device device) const;  // throws with the reason when absent

  ExecContext context(Device device);  // the device's default stream and allocator (or an AllocatorScope's)
  // Every context made from now on for the profiler's device times its ops with `profiler` (nullptr: none;
  // backend/profiler.h). The profiler must outlive the contexts that hold it.
  void set_profiler(OpProfiler* profiler) { profiler_ = profiler; }
  OpProfiler* profiler() const { return profiler_; }
  // Every context made from now on lets GEMM kernels time their candidate algorithms on a shape's first call and
  // keep the fastest (ExecContext::gemm_autotune; cuda/cublaslt_gemm). Results stay bitwise repeatable within the
  // process, but two processes may pick different algorithms, so runs are no longer bitwise reproducible.
  void set_gemm_autotune(bool on) { gemm_autotune_ = on; }
  bool gemm_autotune() const { return gemm_autotune_; }
  Allocator& host_allocator() { return cpu_->allocator(0); }
  // Every context made from now on for `device` allocates through an activation memory plan over the device's
  // allocator (core/memory_plan.h), recorded in window `record_window`. The caller marks the windows
  // (MemoryPlanWindow around each training step). Once per device; returns the plan.
  PlannedAllocator& enable_memory_plan(Device device, int64_t record_window = 1);
  PlannedAllocator* memory_plan(Device device);  // null when not enabled
  void synchronize(Device device);

  // A new contiguous copy of `t` on `device` (synchronous).
  Tensor copy_to(const Tensor& t, Device device);
  // t's elements (contiguous) into host memory the caller keeps, after the work queued before (a wait).
  void download(const Tensor& t, void* dst);
  // The downloads so far (copy_to the host included): each waited for the device's queued work. Tests count them to
  // show where a pass waits (docs/moe.md, "Groups on the device").
  int64_t downloads() const { return downloads_; }
  // A new tensor on `device` holding `nbytes(shape, dtype)` bytes from host memory (waits for the copy).
  Tensor from_host(const void* data, const Shape& shape, DType dtype, Device device);
  // The same without waiting for the device (Stream::upload): `data` may be reused at once, and the device keeps
  // running the work queued before. What the model uploads mid-pass (routing plans, masks) uses this.
  Tensor upload(const void* data, const Shape& shape, DType dtype, Device device);

 private:
  friend class AllocatorScope;
  std::unique_ptr<DeviceBackend> cpu_;
  std::unique_ptr<DeviceBackend> cuda_;  // null when built without CUDA
  KernelRegistry registry_;
  OpProfiler* profiler_ = nullptr;
  bool gemm_autotune_ = false;
  std::atomic<int64_t> downloads_ = 0;  // downloads may come from several threads
  std::map<std::pair<DeviceType, int>, std::unique_ptr<PlannedAllocator>> plans_;  // destroyed before the backends
  std::map<std::pair<DeviceType, int>, Allocator*> allocators_;  // AllocatorScope's
};

}  // namespace lathe
