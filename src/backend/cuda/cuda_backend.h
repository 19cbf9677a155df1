// The CUDA backend: devices, streams (each with its cuBLASLt and cuBLAS handles, GEMM workspace and plan cache, and
// pinned staging for small host tables), events, copies, and the registration of every CUDA kernel family.
// Covered by tests/unit/test_cuda_runtime.cpp and tests/ops (skipped with a reason where no GPU exists).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/allocator.h"

namespace lathe {

class KernelRegistry;
struct ExecContext;

namespace cuda {

struct GemmPlanCache;  // gemm.cpp

class CudaStream final : public Stream {
 public:
  CudaStream(int device, bool is_default);
  ~CudaStream() override;

  Device device() const override { return Device::cuda(device_); }
  void synchronize() override;
  void upload(void* dst, const void* src, size_t bytes) override { upload_async(dst, src, bytes); }
  cudaStream_t handle() const { return stream_; }
  int index() const { return device_; }

  cublasLtHandle_t cublaslt();
  // A cuBLAS handle bound to this stream (host pointer mode, default math: no TF32), sharing the GEMM workspace with
  // cuBLASLt (both run in this stream's order). Created on first use.
  cublasHandle_t cublas();
  void* gemm_workspace();  // allocated on first use
  size_t gemm_workspace_bytes() const { return kGemmWorkspaceBytes; }
  GemmPlanCache& gemm_cache();
  // Enqueues a copy of `bytes` host bytes to device memory `dst` on this stream, through pinned staging: the bytes
  // are copied into a pinned buffer at once (so `src` may die on return) and that buffer is reused only after an
  // event behind its copy has completed. The copy is asynchronous, unlike one from pageable memory. For small host
  // tables a kernel or library call reads from device memory (the pointer arrays of grouped GEMMs).
  void upload_async(void* dst, const void* src, size_t bytes);

  static constexpr size_t kGemmWorkspaceBytes = 32u << 20;

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* workspace_ = nullptr;
  std::unique_ptr<GemmPlanCache> gemm_cache_;
  struct Staging {  // a pinned buffer and the event behind its last copy
    void* host = nullptr;
    size_t bytes = 0;
    cudaEvent_t copied = nullptr;
  };
  std::vector<Staging> staging_;
};

CudaStream& as_cuda(Stream& stream);  // checked downcast
cudaStream_t stream_of(ExecContext& ctx);  // the context's stream, as the kernels' launchers take it

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend();
  ~CudaBackend() override;

  DeviceType type() const override { return DeviceType::CUDA; }
  int device_count() const override { return device_count_; }
  std::string unavailable_reason() const override { return unavailable_reason_; }
  DeviceInfo info(int index) const override;
  int64_t free_memory(int index) override;
  Allocator& allocator(int index) override;
  Allocator* pinned_host_allocator() override { return &pinned_; }
  Stream& default_stream(int index) override;
  std::unique_ptr<Stream> create_stream(int index) override;
  std::unique_ptr<Event> create_event(int index) override;
  void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes,
            Stream& stream) override;
  void fill_bytes(void* dst, uint8_t value, size_t nbytes, Stream& stream) override;
  bool can_capture() const override { return true; }
  void begin_capture(Stream& stream) override;  // relaxed mode: other threads may call the runtime meanwhile
  std::unique_ptr<Graph> end_capture(Stream& stream) override;
  std::unique_ptr<Allocator> private_allocator(int index) override;
  void register_kernels(KernelRegistry& registry) override;

 private:
  void check_index(int index) const;

  int device_count_ = 0;
  std::string unavailable_reason_;
  std::vector<std::unique_ptr<CachingAllocator>> allocators_;
  std::vector<std::unique_ptr<CudaStream>> default_streams_;  // created on first use
  PinnedHostAllocator pinned_;
};

// One registration function per kernel family (backend/cuda/<family>).
void register_cuda_gemm_kernels(KernelRegistry& registry);
void register_cuda_elementwise_kernels(KernelRegistry& registry);
void register_cuda_reduce_kernels(KernelRegistry& registry);
void register_cuda_model_kernels(KernelRegistry& registry);  // model_ops_register.cpp
void register_cuda_optim_kernels(KernelRegistry& registry);  // optim_ops.cpp
void register_cuda_segment_kernels(KernelRegistry& registry);  // segment_ops_register.cpp
void register_cuda_gated_delta_kernels(KernelRegistry& registry);  // gated_delta_ops.cpp
void register_cuda_gdn_state_kernels(KernelRegistry& registry);  // gdn_state_register.cpp
void register_cuda_grouped_gemm_kernels(KernelRegistry& registry);  // grouped_gemm.cpp
void register_cuda_paged_kernels(KernelRegistry& registry);  // paged_ops_register.cpp

}  // namespace cuda
}  // namespace lathe
