// Lab for the memory-bound CUDA kernels (elementwise.cu, model_ops.cu: casts, add/mul, scale, SiLU, RMSNorm,
// embedding gather, SwiGLU), through their raw launchers at the sizes of a Qwen3.5-0.8B step. Checks that the
// 16-byte packed path gives the same bits as the single-element path (inputs copied to buffers one element off
// 16 bytes, which the launchers refuse to pack), and RMSNorm against a host f64 reference; then times each
// kernel (CUDA events, mean of 20 after warm-up) and prints GB/s counting bytes read and written once.
// Not part of liblathe and not in bench/CMakeLists.txt: built by hand with the two .cu files, from the repo root:
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Isrc bench/memory_bound_lab.cu \
//        src/backend/cuda/elementwise.cu src/backend/cuda/model_ops.cu -o memory_bound_lab
// (the launchers' signatures are stable, so the same lab built against older copies of those files times them).
// Usage: memory_bound_lab   (exit status 1 if a check failed)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/launchers.h"
#include "backend/cuda/model_launchers.h"
#include <cuda_bf16.h>

namespace lathe {
size_t dtype_size(DType t) { return t == DType::F64 || t == DType::I64 ? 8 : (t == DType::BF16 || t == DType::F16 ? 2 : 4); }
namespace cuda {
void throw_cuda_error(const char* what, cudaError_t err, const char* file, int line) {
  throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err) + " at " + file + ":" + std::to_string(line));
}
}  // namespace cuda
}  // namespace lathe

namespace lab {

using namespace lathe;
using namespace lathe::cuda;
using bf16 = __nv_bfloat16;

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e_)); } while (0)

__global__ void fill_kernel(bf16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    p[i] = __float2bfloat16(float(x % 20001) / 5000.0f - 2.0f);
  }
}

// A buffer of n bytes at offset 0 (16-byte aligned) and a copy of it one bf16 element further (unaligned).
struct Buf {
  char* base = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t n) : bytes(n) { CHECK(cudaMalloc(&base, n + 64)); CHECK(cudaMemset(base, 0, n + 64)); }
  void* at() const { return base; }
  void* off() const { return base + 2; }
  void sync_off() const { CHECK(cudaMemcpy(off(), at(), bytes, cudaMemcpyDeviceToDevice)); }
  std::vector<char> host(bool offset) const {
    std::vector<char> h(bytes);
    CHECK(cudaMemcpy(h.data(), offset ? off() : at(), bytes, cudaMemcpyDeviceToHost));
    return h;
  }
};

Buf random_bf16(int64_t n, uint32_t seed) {
  Buf b(size_t(n) * 2);
  fill_kernel<<<1024, 256>>>(static_cast<bf16*>(b.at()), n, seed);
  CHECK(cudaDeviceSynchronize());
  b.sync_off();
  return b;
}

int failures = 0;
void expect_same(const char* what, const Buf& out) {
  const bool same = out.host(false) == out.host(true);
  std::printf("check %-40s packed == single-element: %s\n", what, same ? "yes" : "NO");
  failures += !same;
}

template <typename F> double time_us(F f) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < 20; ++i) f();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms * 1000.0 / 20;
}
void report(const char* what, double us, double bytes) {
  std::printf("time  %-40s %9.1f us %8.0f GB/s\n", what, us, bytes / us / 1e3);
}

StridedLayout flat(int64_t n) {
  StridedLayout l;
  l.ndim = 1;
  l.shape[0] = n;
  l.stride[0] = 1;
  return l;
}

float bf(const std::vector<char>& h, int64_t i) {
  uint16_t u;
  std::memcpy(&u, h.data() + 2 * i, 2);
  uint32_t v = uint32_t(u) << 16;
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}

void elementwise() {
  for (int64_t n : {int64_t(1000003), int64_t(32) << 20}) {
    const bool timed = n > 2000000;
    Buf a = random_bf16(n, 1), b = random_bf16(n, 2), o(size_t(n) * 2), o32(size_t(n) * 4), o2(size_t(n) * 2);
    const StridedLayout l = flat(n);
    const char* ops[] = {"mul", "add", "silu_backward"};
    const BinaryOp bops[] = {BinaryOp::mul, BinaryOp::add, BinaryOp::silu_backward};
    for (int k = 0; k < 3; ++k) {
      auto run = [&](bool off) {
        launch_binary(bops[k], DType::BF16, n, off ? a.off() : a.at(), l, off ? b.off() : b.at(), l, true,
                      off ? o.off() : o.at(), 0);
      };
      run(false); run(true);
      CHECK(cudaDeviceSynchronize());
      if (!timed) expect_same(ops[k], o);
      else report((std::string("bf16 ") + ops[k] + " n=32M").c_str(), time_us([&] { run(false); }), 6.0 * n);
    }
    for (UnaryOp u : {UnaryOp::scale, UnaryOp::silu}) {
      auto run = [&](bool off) { launch_unary(u, DType::BF16, n, off ? a.off() : a.at(), l, true, 0.37, off ? o.off() : o.at(), 0); };
      run(false); run(true);
      CHECK(cudaDeviceSynchronize());
      const char* name = u == UnaryOp::scale ? "bf16 scale" : "bf16 silu";
      if (!timed) expect_same(name, o);
      else report(name, time_us([&] { run(false); }), 4.0 * n);
    }
    auto up = [&](bool off) { launch_cast(DType::BF16, DType::F32, n, off ? a.off() : a.at(), l, true, off ? o32.off() : o32.at(), 0); };
    up(false); up(true);
    CHECK(cudaDeviceSynchronize());
    if (!timed) expect_same("cast bf16->f32", o32);
    else report("cast bf16->f32", time_us([&] { up(false); }), 6.0 * n);
    // f32 -> bf16 from the f32 result (aligned and unaligned copies of it hold the same values).
    auto down = [&](bool off) { launch_cast(DType::F32, DType::BF16, n, off ? o32.off() : o32.at(), l, true, off ? o2.off() : o2.at(), 0); };
    down(false); down(true);
    CHECK(cudaDeviceSynchronize());
    if (!timed) expect_same("cast f32->bf16", o2);
    else report("cast f32->bf16", time_us([&] { down(false); }), 6.0 * n);
  }
}

void swiglu() {
  for (int64_t n : {int64_t(1000003), int64_t(8192) * 3584}) {
    const bool timed = n > 2000000;
    Buf g = random_bf16(n, 3), u = random_bf16(n, 4), dy = random_bf16(n, 5), y(size_t(n) * 2), dg(size_t(n) * 2),
        du(size_t(n) * 2);
    auto fwd = [&](bool off) { launch_swiglu(DType::BF16, n, off ? g.off() : g.at(), off ? u.off() : u.at(), off ? y.off() : y.at(), 0); };
    auto bwd = [&](bool off) {
      launch_swiglu_backward(DType::BF16, n, off ? g.off() : g.at(), off ? u.off() : u.at(), off ? dy.off() : dy.at(),
                             off ? dg.off() : dg.at(), off ? du.off() : du.at(), 0);
    };
    fwd(false); fwd(true); bwd(false); bwd(true);
    CHECK(cudaDeviceSynchronize());
    if (!timed) {
      expect_same("swiglu", y);
      expect_same("swiglu_backward dg", dg);
      expect_same("swiglu_backward du", du);
    } else {
      report("swiglu n=29M", time_us([&] { fwd(false); }), 6.0 * n);
      report("swiglu_backward n=29M", time_us([&] { bwd(false); }), 10.0 * n);
    }
  }
}

void embedding() {
  const int64_t vocab = 4096, tokens = 8192;
  std::vector<int32_t> ids(tokens);
  for (int64_t t = 0; t < tokens; ++t) ids[size_t(t)] = int32_t((t * 7919) % vocab);
  int32_t* dids;
  CHECK(cudaMalloc(&dids, tokens * 4));
  CHECK(cudaMemcpy(dids, ids.data(), tokens * 4, cudaMemcpyHostToDevice));
  for (int64_t h : {int64_t(256), int64_t(2048)}) {
    Buf w = random_bf16(vocab * h, 6), out(size_t(tokens * h) * 2);
    auto run = [&](bool off) { launch_embedding(DType::BF16, tokens, h, vocab, off ? w.off() : w.at(), dids, off ? out.off() : out.at(), 0); };
    run(false); run(true);
    CHECK(cudaDeviceSynchronize());
    const std::string name = "embedding h=" + std::to_string(h);
    expect_same(name.c_str(), out);
    report(name.c_str(), time_us([&] { run(false); }), 4.0 * tokens * h);
  }
  CHECK(cudaFree(dids));
}

// Max |packed - reference| over max |reference| for y (forward) and dx, dw (backward), f64 reference on the host.
void rmsnorm() {
  struct Shape { int64_t rows, h; };
  for (Shape s : {Shape{131072, 128}, Shape{65536, 256}, Shape{8192, 1024}, Shape{3000, 42}}) {
    const int64_t n = s.rows * s.h;
    Buf x = random_bf16(n, 7), w = random_bf16(s.h, 8), dy = random_bf16(n, 9), y(size_t(n) * 2), dx(size_t(n) * 2),
        dw(size_t(s.h) * 2), dw2(size_t(s.h) * 2);
    const int64_t scratch_floats = rmsnorm_backward_scratch_floats(s.rows, s.h);
    float* scratch;
    CHECK(cudaMalloc(&scratch, scratch_floats * 4));
    auto fwd = [&] { launch_rmsnorm(DType::BF16, s.rows, s.h, 1e-6, 1.0, x.at(), w.at(), y.at(), 0); };
    auto bwd = [&](void* dwp) {
      launch_rmsnorm_backward(DType::BF16, s.rows, s.h, 1e-6, 1.0, x.at(), w.at(), dy.at(), dx.at(), dwp, scratch, 0);
    };
    fwd();
    bwd(dw.at());
    bwd(dw2.at());
    CHECK(cudaDeviceSynchronize());
    const bool deterministic = dw.host(false) == dw2.host(false);
    failures += !deterministic;
    // Host reference in f64 over every row.
    const auto hx = x.host(false), hw = w.host(false), hdy = dy.host(false), hy = y.host(false), hdx = dx.host(false),
               hdw = dw.host(false);
    std::vector<double> rdw(size_t(s.h), 0.0);
    double ey = 0, my = 0, edx = 0, mdx = 0;
    for (int64_t r = 0; r < s.rows; ++r) {
      double ss = 0, dot = 0;
      for (int64_t j = 0; j < s.h; ++j) {
        const double xv = bf(hx, r * s.h + j), g = bf(hdy, r * s.h + j) * (1.0 + bf(hw, j));
        ss += xv * xv;
        dot += g * xv;
      }
      const double inv = 1.0 / std::sqrt(ss / double(s.h) + 1e-6);
      for (int64_t j = 0; j < s.h; ++j) {
        const int64_t i = r * s.h + j;
        const double xv = bf(hx, i), dyv = bf(hdy, i);
        const double yr = xv * inv * (1.0 + bf(hw, j));
        const double dxr = inv * dyv * (1.0 + bf(hw, j)) - xv * inv * inv * inv * dot / double(s.h);
        rdw[size_t(j)] += dyv * xv * inv;
        ey = std::max(ey, std::abs(bf(hy, i) - yr));
        my = std::max(my, std::abs(yr));
        edx = std::max(edx, std::abs(bf(hdx, i) - dxr));
        mdx = std::max(mdx, std::abs(dxr));
      }
    }
    double edw = 0, mdw = 0;
    for (int64_t j = 0; j < s.h; ++j) {
      edw = std::max(edw, std::abs(bf(hdw, j) - rdw[size_t(j)]));
      mdw = std::max(mdw, std::abs(rdw[size_t(j)]));
    }
    const bool ok = ey / my < 1e-2 && edx / mdx < 1e-2 && edw / mdw < 1e-2;
    failures += !ok;
    std::printf("check rmsnorm rows=%-7ld h=%-5ld rel err y %.2e dx %.2e dw %.2e, dw deterministic: %s %s\n",
                long(s.rows), long(s.h), ey / my, edx / mdx, edw / mdw, deterministic ? "yes" : "NO", ok ? "" : "FAIL");
    const std::string name = "rmsnorm rows=" + std::to_string(s.rows) + " h=" + std::to_string(s.h);
    report(name.c_str(), time_us(fwd), 4.0 * n);
    report((name + " bwd").c_str(), time_us([&] { bwd(dw.at()); }), 6.0 * n);
    CHECK(cudaFree(scratch));
  }
}

}  // namespace lab

int main() {
  try {
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0));
    std::printf("device %s, %d SMs\n", p.name, p.multiProcessorCount);
    lab::elementwise();
    lab::swiglu();
    lab::embedding();
    lab::rmsnorm();
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 2;
  }
  std::printf("%d check(s) failed\n", lab::failures);
  return lab::failures ? 1 : 0;
}
