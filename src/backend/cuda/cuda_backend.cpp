#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cstring>

#include "backend/cuda/check.h"
#ifdef LATHE_WITH_CUDNN
#include "backend/cuda/cudnn_attention.h"
#endif
#include "backend/cuda/device_guard.h"
#include "backend/cuda/gemm.h"
#include "backend/registry.h"
#include "core/error.h"

namespace lathe {

std::unique_ptr<DeviceBackend> create_cuda_backend() { return std::make_unique<cuda::CudaBackend>(); }

namespace cuda {

void throw_cuda_error(const char* what, cudaError_t err, const char* file, int line) {
  int device = -1;
  cudaGetDevice(&device);
  throw_error(file, line, fmt::format("cuda: {} failed on cuda:{}: {} ({})", what, device, cudaGetErrorString(err),
                                      cudaGetErrorName(err)));
}

void throw_cublas_error(const char* what, int status, const char* file, int line) {
  int device = -1;
  cudaGetDevice(&device);
  throw_error(file, line, fmt::format("cublas: {} failed on cuda:{}: status {} ({})", what, device, status,
                                      cublasLtGetStatusString(cublasStatus_t(status))));
}

namespace {

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) : device_(device) {
    DeviceGuard g(device_);
    LATHE_CUDA_CHECK(cudaEventCreate(&event_));
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  void record(Stream& stream) override { LATHE_CUDA_CHECK(cudaEventRecord(event_, as_cuda(stream).handle())); }
  void wait(Stream& stream) override { LATHE_CUDA_CHECK(cudaStreamWaitEvent(as_cuda(stream).handle(), event_, 0)); }
  void synchronize() override { LATHE_CUDA_CHECK(cudaEventSynchronize(event_)); }
  double elapsed_ms_since(const Event& start) override {
    float ms = 0;
    LATHE_CUDA_CHECK(cudaEventElapsedTime(&ms, dynamic_cast<const CudaEvent&>(start).event_, event_));
    return ms;
  }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace

CudaStream::CudaStream(int device, bool) : device_(device), gemm_cache_(std::make_unique<GemmPlanCache>()) {
  DeviceGuard g(device_);
  LATHE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

CudaStream::~CudaStream() {
  gemm_cache_.reset();
  if (stream_) cudaStreamSynchronize(stream_);  // pending staged copies read their pinned buffers
  for (Staging& s : staging_) {
    if (s.copied) cudaEventDestroy(s.copied);
    if (s.host) cudaFreeHost(s.host);
  }
  if (blas_) cublasDestroy(blas_);
  if (lt_) cublasLtDestroy(lt_);
  if (workspace_) cudaFree(workspace_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaStream::synchronize() { LATHE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

cublasLtHandle_t CudaStream::cublaslt() {
  if (!lt_) {
    DeviceGuard g(device_);
    LATHE_CUBLAS_CHECK(cublasLtCreate(&lt_));
  }
  return lt_;
}

cublasHandle_t CudaStream::cublas() {
  if (!blas_) {
    DeviceGuard g(device_);
    LATHE_CUBLAS_CHECK(cublasCreate(&blas_));
    LATHE_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
    LATHE_CUBLAS_CHECK(cublasSetPointerMode(blas_, CUBLAS_POINTER_MODE_HOST));
    LATHE_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));  // f32 stays f32: no TF32
    LATHE_CUBLAS_CHECK(cublasSetWorkspace(blas_, gemm_workspace(), kGemmWorkspaceBytes));
  }
  return blas_;
}

void CudaStream::upload_async(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard g(device_);
  // The smallest free buffer that fits (a large one taken by a small upload would make the next large upload allocate:
  // cudaMallocHost is slow and may synchronise the device); sizes are powers of two so that buffers get reused.
  Staging* slot = nullptr;
  for (Staging& s : staging_) {
    if (s.bytes < bytes || (slot && slot->bytes <= s.bytes)) continue;
    const cudaError_t done = cudaEventQuery(s.copied);  // an event never recorded counts as complete
    if (done == cudaSuccess) {
      slot = &s;
      continue;
    }
    if (done != cudaErrorNotReady) LATHE_CUDA_CHECK(done);
    cudaGetLastError();  // not-ready is no error: keep it from surfacing at the next launch check
  }
  if (!slot) {
    Staging s;
    s.bytes = size_t(16) << 10;
    while (s.bytes < bytes) s.bytes *= 2;
    LATHE_CUDA_CHECK(cudaMallocHost(&s.host, s.bytes));
    LATHE_CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
    staging_.push_back(s);
    slot = &staging_.back();
  }
  std::memcpy(slot->host, src, bytes);
  LATHE_CUDA_CHECK(cudaMemcpyAsync(dst, slot->host, bytes, cudaMemcpyHostToDevice, stream_));
  LATHE_CUDA_CHECK(cudaEventRecord(slot->copied, stream_));
}

void* CudaStream::gemm_workspace() {
  if (!workspace_) {
    DeviceGuard g(device_);
    LATHE_CUDA_CHECK(cudaMalloc(&workspace_, kGemmWorkspaceBytes));
  }
  return workspace_;
}

GemmPlanCache& CudaStream::gemm_cache() { return *gemm_cache_; }

cudaStream_t stream_of(ExecContext& ctx) { return as_cuda(ctx.stream).handle(); }

CudaStream& as_cuda(Stream& stream) {
  auto* s = dynamic_cast<CudaStream*>(&stream);
  LATHE_CHECK(s != nullptr, "cuda: a CUDA kernel was given a {} stream", stream.device().str());
  return *s;
}

namespace {

// For `lathe kernels`: the cuDNN in use, or why its kernels are not in this build.
std::string cudnn_summary() {
#if defined(LATHE_WITH_CUDNN)
  return cudnn_runtime_summary();
#elif defined(LATHE_CUDNN_MISSING)
  return std::string("cuDNN kernels not built: ") + LATHE_CUDNN_MISSING;  // cmake/cudnn.cmake's reason
#else
  return "cuDNN kernels not built";
#endif
}

}  // namespace

CudaBackend::CudaBackend() {
  const cudaError_t err = cudaGetDeviceCount(&device_count_);
  if (err != cudaSuccess) {
    cudaGetLastError();
    device_count_ = 0;
    unavailable_reason_ = fmt::format("CUDA runtime reports {} ({})", cudaGetErrorString(err), cudaGetErrorName(err));
  } else if (device_count_ == 0) {
    unavailable_reason_ = "no CUDA device found";
  }
  for (int i = 0; i < device_count_; ++i) allocators_.push_back(std::make_unique<CachingAllocator>(i));
  default_streams_.resize(device_count_);
}

CudaBackend::~CudaBackend() = default;

void CudaBackend::check_index(int index) const {
  LATHE_CHECK(index >= 0 && index < device_count_, "cuda: device cuda:{} does not exist ({} devices{}{})", index,
              device_count_, unavailable_reason_.empty() ? "" : ": ", unavailable_reason_);
}

int64_t CudaBackend::free_memory(int index) {
  check_index(index);
  DeviceGuard guard(index);
  size_t free_bytes = 0, total_bytes = 0;
  LATHE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const AllocatorStats st = allocator(index).stats();
  return int64_t(free_bytes) + std::max<int64_t>(st.reserved - st.allocated, 0);
}

DeviceInfo CudaBackend::info(int index) const {
  check_index(index);
  cudaDeviceProp p{};
  LATHE_CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  return {p.name, int64_t(p.totalGlobalMem),
          fmt::format("sm_{}{}, {} SMs, driver API {}.{}, runtime {}.{}, cuBLASLt {}, {}", p.major, p.minor,
                      p.multiProcessorCount, driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10,
                      cublasLtGetVersion(), cudnn_summary())};
}

Allocator& CudaBackend::allocator(int index) {
  check_index(index);
  return *allocators_[index];
}

Stream& CudaBackend::default_stream(int index) {
  check_index(index);
  if (!default_streams_[index]) default_streams_[index] = std::make_unique<CudaStream>(index, true);
  return *default_streams_[index];
}

std::unique_ptr<Stream> CudaBackend::create_stream(int index) {
  check_index(index);
  return std::make_unique<CudaStream>(index, false);
}

std::unique_ptr<Event> CudaBackend::create_event(int index) {
  check_index(index);
  return std::make_unique<CudaEvent>(index);
}

void CudaBackend::copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes,
                       Stream& stream) {
  if (nbytes == 0) return;
  const cudaMemcpyKind kind = dst_device.is_cpu() ? (src_device.is_cpu() ? cudaMemcpyHostToHost : cudaMemcpyDeviceToHost)
                                                  : (src_device.is_cpu() ? cudaMemcpyHostToDevice
                                                                         : cudaMemcpyDeviceToDevice);
  LATHE_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kind, as_cuda(stream).handle()));
}

void CudaBackend::fill_bytes(void* dst, uint8_t value, size_t nbytes, Stream& stream) {
  if (nbytes) LATHE_CUDA_CHECK(cudaMemsetAsync(dst, value, nbytes, as_cuda(stream).handle()));
}

namespace {

class CudaGraph final : public Graph {
 public:
  CudaGraph(cudaGraph_t graph, int device) : graph_(graph), device_(device) {
    DeviceGuard g(device_);
    LATHE_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CudaGraph() override {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  void replay(Stream& stream) override {
    DeviceGuard g(device_);
    LATHE_CUDA_CHECK(cudaGraphLaunch(exec_, as_cuda(stream).handle()));
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  int device_;
};

}  // namespace

void CudaBackend::begin_capture(Stream& stream) {
  DeviceGuard g(as_cuda(stream).index());
  LATHE_CUDA_CHECK(cudaStreamBeginCapture(as_cuda(stream).handle(), cudaStreamCaptureModeRelaxed));
}

std::unique_ptr<Graph> CudaBackend::end_capture(Stream& stream) {
  DeviceGuard g(as_cuda(stream).index());
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(as_cuda(stream).handle(), &graph);
  if (err != cudaSuccess || graph == nullptr) {
    cudaGetLastError();  // the capture's error is reported here, not left for the next call
    if (graph) cudaGraphDestroy(graph);
    throw Error(fmt::format("graphs: recording on {} failed: {} (something in the recorded work waited for the device "
                            "or copied from host memory)", stream.device().str(), cudaGetErrorString(err)));
  }
  return std::make_unique<CudaGraph>(graph, as_cuda(stream).index());
}

std::unique_ptr<Allocator> CudaBackend::private_allocator(int index) {
  check_index(index);
  return std::make_unique<CachingAllocator>(index);
}

void CudaBackend::register_kernels(KernelRegistry& registry) {
  register_cuda_gemm_kernels(registry);
  register_cuda_elementwise_kernels(registry);
  register_cuda_reduce_kernels(registry);
  register_cuda_model_kernels(registry);
  register_cuda_optim_kernels(registry);
  register_cuda_segment_kernels(registry);
  register_cuda_gated_delta_kernels(registry);
  register_cuda_gdn_state_kernels(registry);
  register_cuda_grouped_gemm_kernels(registry);
  register_cuda_paged_kernels(registry);
}

}  // namespace cuda
}  // namespace lathe
