// Backend interfaces: a DeviceBackend owns devices of one type, with their allocators and streams, moves
// bytes, and lists its kernels through register_kernels() (explicit, no static-initialiser magic).
// Adding an accelerator means implementing these interfaces in src/backend/<dev>/.
// Covered by tests/unit/test_core.cpp (CPU) and tests/unit/test_cuda_runtime.cpp (CUDA).
#pragma once

#include <memory>
#include <string>

#include "core/allocator.h"
#include "core/device.h"

namespace lathe {

class KernelRegistry;

// An ordered queue of work on one device. The CPU stream runs everything synchronously.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual Device device() const = 0;
  virtual void synchronize() = 0;
  // Copies `bytes` host bytes to this stream's device memory `dst` in stream order, without waiting for the device:
  // `src` may be reused as soon as this returns (CUDA: through pinned staging, CudaStream::upload_async).
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
};

class Event {
 public:
  virtual ~Event() = default;
  virtual void record(Stream& stream) = 0;
  virtual void wait(Stream& stream) = 0;  // later work on `stream` waits for this event
  virtual void synchronize() = 0;
  virtual double elapsed_ms_since(const Event& start) = 0;
};

// Work recorded from a stream once and replayed as one launch (CUDA graphs): the same kernels with the same
// arguments and pointers, so what a replay reads and writes must sit at the addresses it had when recorded.
class Graph {
 public:
  virtual ~Graph() = default;
  virtual void replay(Stream& stream) = 0;
};

struct DeviceInfo {
  std::string name;
  int64_t total_memory = 0;
  std::string details;  // e.g. "sm_90, 132 SMs, driver 13.0, runtime 13.0"
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual DeviceType type() const = 0;
  virtual int device_count() const = 0;
  // Why no device is usable (empty when device_count() > 0).
  virtual std::string unavailable_reason() const { return {}; }
  virtual DeviceInfo info(int index) const = 0;
  // Bytes the device could still hand out now (CUDA: cudaMemGetInfo's free memory plus what this process's caching
  // allocator holds unused; the CPU: available physical memory).
  virtual int64_t free_memory(int index) = 0;
  virtual Allocator& allocator(int index) = 0;
  // Page-locked host memory for asynchronous copies (nullptr when the backend has none).
  virtual Allocator* pinned_host_allocator() { return nullptr; }
  virtual Stream& default_stream(int index) = 0;
  virtual std::unique_ptr<Stream> create_stream(int index) = 0;
  virtual std::unique_ptr<Event> create_event(int index) = 0;
  // Copies bytes between host and this backend's devices (or within a device), ordered on `stream`.
  // Host memory that is not pinned makes the copy synchronous.
  virtual void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes,
                    Stream& stream) = 0;
  virtual void fill_bytes(void* dst, uint8_t value, size_t nbytes, Stream& stream) = 0;
  // Graphs: whether this backend records them; between begin_capture and end_capture the work queued on `stream` is
  // recorded, not run, and nothing may wait for the device or copy from host memory (end_capture throws then).
  virtual bool can_capture() const { return false; }
  virtual void begin_capture(Stream& stream);
  virtual std::unique_ptr<Graph> end_capture(Stream& stream);
  // A caching allocator of the device's memory with blocks of its own (what graphs use stays theirs); nullptr when the
  // backend has none.
  virtual std::unique_ptr<Allocator> private_allocator(int /*index*/) { return nullptr; }
  virtual void register_kernels(KernelRegistry& registry) = 0;
};

}  // namespace lathe
