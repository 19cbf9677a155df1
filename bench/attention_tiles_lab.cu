// Tile-shape lab for the tiled attention kernels (src/backend/cuda/flash_attention.cu, included here so its
// kernel templates can be instantiated with shapes other than FlashConfig's). Times each kernel of the forward
// and the backward per tile shape on one problem and checks every variant against the first of its kind (max
// |difference| over max |value|). Not part of liblathe; links cudart only.
// Usage: attention_tiles_lab [tokens docs q_heads kv_heads] [iters]   (bf16, head dim LAB_D: 128, or 256 for the
// attention_tiles_lab_256 build)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/flash_attention.cu"

namespace lathe::cuda {
void throw_cuda_error(const char* what, cudaError_t err, const char* file, int line) {
  throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err) + " at " + file + ":" + std::to_string(line));
}
}  // namespace lathe::cuda

namespace lab {  // named: an anonymous one here would clash with flash_attention.cu's in nvcc's stub

using namespace lathe::cuda;
using T = __nv_bfloat16;
#ifndef LAB_D
#define LAB_D 128
#endif
constexpr int kD = LAB_D;

__global__ void fill_random(T* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = __float2bfloat16(float(x & 0xffffff) / float(0x800000) - 1.0f);
  }
}

template <typename F> double median_ms(int iters, F f) {
  cudaEvent_t a, b;
  LATHE_CUDA_CHECK(cudaEventCreate(&a));
  LATHE_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) f();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    LATHE_CUDA_CHECK(cudaEventRecord(a));
    f();
    LATHE_CUDA_CHECK(cudaEventRecord(b));
    LATHE_CUDA_CHECK(cudaEventSynchronize(b));
    float x = 0;
    LATHE_CUDA_CHECK(cudaEventElapsedTime(&x, a, b));
    ms.push_back(x);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::vector<float> host(const T* p, int64_t n) {
  std::vector<T> h(static_cast<size_t>(n));
  LATHE_CUDA_CHECK(cudaMemcpy(h.data(), p, size_t(n) * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> f(static_cast<size_t>(n));
  for (size_t i = 0; i < f.size(); ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

// max |a - ref| / max |ref|
double rel_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  double e = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    e = std::max(e, double(std::fabs(a[i] - ref[i])));
    m = std::max(m, double(std::fabs(ref[i])));
    if (!std::isfinite(a[i])) return INFINITY;
  }
  return e / m;
}

T* alloc(int64_t n) {
  T* p = nullptr;
  LATHE_CUDA_CHECK(cudaMalloc(&p, size_t(n) * sizeof(T)));
  return p;
}

}  // namespace lab

int main(int argc, char** argv) {
  using namespace lab;
  try {
    const int64_t tokens = argc > 4 ? std::atoll(argv[1]) : 16384, docs = argc > 4 ? std::atoll(argv[2]) : 4;
    const int hq = argc > 4 ? std::atoi(argv[3]) : 16, hkv = argc > 4 ? std::atoi(argv[4]) : 8;
    const int iters = argc > 5 ? std::atoi(argv[5]) : 10;
    AttentionDims dims;
    dims.tokens = tokens;
    dims.q_heads = hq;
    dims.kv_heads = hkv;
    dims.head_dim = kD;
    dims.n_cu = docs + 1;
    dims.scale = float(1.0 / std::sqrt(double(kD)));
    std::vector<int32_t> cu;
    double fwd_flop = 0;
    for (int64_t b = 0; b <= docs; ++b) cu.push_back(int32_t(b == docs ? tokens : b * (tokens / docs)));
    for (int64_t b = 0; b < docs; ++b) fwd_flop += 2.0 * double(cu[b + 1] - cu[b]) * double(cu[b + 1] - cu[b]) * hq * kD;
    int32_t* dcu = nullptr;
    LATHE_CUDA_CHECK(cudaMalloc(&dcu, cu.size() * sizeof(int32_t)));
    LATHE_CUDA_CHECK(cudaMemcpy(dcu, cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    const int64_t nq = tokens * hq * kD, nk = tokens * hkv * kD;
    T *q = alloc(nq), *k = alloc(nk), *v = alloc(nk), *o = alloc(nq), *dout = alloc(nq), *dq = alloc(nq), *dk = alloc(nk),
      *dv = alloc(nk);
    float *lse = nullptr, *stats = nullptr;
    LATHE_CUDA_CHECK(cudaMalloc(&lse, size_t(tokens * hq) * sizeof(float)));
    LATHE_CUDA_CHECK(cudaMalloc(&stats, size_t(2 * tokens * hq) * sizeof(float)));
    fill_random<<<1024, 256>>>(q, nq, 1);
    fill_random<<<1024, 256>>>(k, nk, 2);
    fill_random<<<1024, 256>>>(v, nk, 3);
    fill_random<<<1024, 256>>>(dout, nq, 4);
    LATHE_CUDA_CHECK(cudaDeviceSynchronize());
    cudaDeviceProp prop{};
    LATHE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("lab: %s, tokens %lld, docs %lld, hq %d, hkv %d, D %d, bf16; TFLOP/s count the FLOPs each kernel does "
                "(forward 2 GEMMs, dK/dV 4, dQ 3)\n",
                prop.name, (long long)tokens, (long long)docs, hq, hkv, kD);

    const ForwardArgs<T> fa{q, k, v, dcu, o, lse, tokens, hq, hkv, int(docs), dims.scale};
    std::vector<float> ref;
    auto fwd = [&](const char* name, auto launch) {
      const double ms = median_ms(iters, [&] { launch(); });
      LATHE_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> out = host(o, nq);
      if (ref.empty()) ref = out;
      std::printf("forward %-28s %8.3f ms %7.1f TFLOP/s  diff %.2e\n", name, ms, fwd_flop / ms / 1e9, rel_diff(out, ref));
    };
#if LAB_D == 128
    fwd("W8 M1 BN64", [&] { launch_forward_tiles<T, kD, 8, 1, 64, 1>(dims, fa, 0); });
    fwd("W4 M2 BN32 (config)", [&] { launch_forward_tiles<T, kD, 4, 2, 32, 1>(dims, fa, 0); });
    fwd("W4 M2 BN64", [&] { launch_forward_tiles<T, kD, 4, 2, 64, 1>(dims, fa, 0); });
    fwd("W8 M1 BN128", [&] { launch_forward_tiles<T, kD, 8, 1, 128, 1>(dims, fa, 0); });
    fwd("W4 M1 BN64 2/SM", [&] { launch_forward_tiles<T, kD, 4, 1, 64, 2>(dims, fa, 0); });
#else
    fwd("W4 M1 BN32 (config)", [&] { launch_forward_tiles<T, kD, 4, 1, 32, 1>(dims, fa, 0); });
#endif
    launch_forward_tiles<T, kD, FlashConfig<kD>::kFwdWarps, FlashConfig<kD>::kFwdRows, FlashConfig<kD>::kFwdKeys, 1>(
        dims, fa, 0);  // o and lse for the backward

    float* lse2 = stats;
    float* delta = stats + tokens * hq;
    const double st_ms = median_ms(iters, [&] { launch_row_stats<T, kD>(dims, o, dout, lse, lse2, delta, 0); });
    std::printf("row stats %8.3f ms (%.0f GB/s)\n", st_ms, double(2 * nq * 2 + tokens * hq * 12) / st_ms / 1e6);
    const BackwardArgs<T> ba{q, k, v, dout, dcu, lse2, delta, dq, dk, dv, tokens, hq, hkv, int(docs), dims.scale};
    std::vector<float> ref_k, ref_v;
    auto dkdv = [&](const char* name, auto launch) {
      const double ms = median_ms(iters, [&] { launch(); });
      LATHE_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> gk = host(dk, nk), gv = host(dv, nk);
      if (ref_k.empty()) ref_k = gk, ref_v = gv;
      std::printf("dK/dV   %-28s %8.3f ms %7.1f TFLOP/s  diff %.2e %.2e\n", name, ms, 2 * fwd_flop / ms / 1e9,
                  rel_diff(gk, ref_k), rel_diff(gv, ref_v));
    };
#if LAB_D == 128
    dkdv("W8 BM32", [&] { launch_dkdv_tiles<T, kD, 8, 32, 1>(dims, ba, 0); });
    dkdv("W8 BM64", [&] { launch_dkdv_tiles<T, kD, 8, 64, 1>(dims, ba, 0); });
    dkdv("W4 BM32", [&] { launch_dkdv_tiles<T, kD, 4, 32, 1>(dims, ba, 0); });
    dkdv("W4 BM64 (config)", [&] { launch_dkdv_tiles<T, kD, 4, 64, 1>(dims, ba, 0); });
#else
    dkdv("W8 BM64 split2 (config)", [&] { launch_dkdv_tiles<T, kD, 8, 64, 2>(dims, ba, 0); });
    dkdv("W8 BM32 split2", [&] { launch_dkdv_tiles<T, kD, 8, 32, 2>(dims, ba, 0); });
    dkdv("W4 BM32 split2", [&] { launch_dkdv_tiles<T, kD, 4, 32, 2>(dims, ba, 0); });
    dkdv("W4 BM64 split2", [&] { launch_dkdv_tiles<T, kD, 4, 64, 2>(dims, ba, 0); });
    dkdv("W16 BM32 split2", [&] { launch_dkdv_tiles<T, kD, 16, 32, 2>(dims, ba, 0); });
#endif
    std::vector<float> ref_q;
    auto dqk = [&](const char* name, auto launch) {
      const double ms = median_ms(iters, [&] { launch(); });
      LATHE_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> gq = host(dq, nq);
      if (ref_q.empty()) ref_q = gq;
      std::printf("dQ      %-28s %8.3f ms %7.1f TFLOP/s  diff %.2e\n", name, ms, 1.5 * fwd_flop / ms / 1e9,
                  rel_diff(gq, ref_q));
    };
#if LAB_D == 128
    dqk("W8 M1 BN64 (config)", [&] { launch_dq_tiles<T, kD, 8, 1, 64>(dims, ba, 0); });
    dqk("W8 M1 BN32", [&] { launch_dq_tiles<T, kD, 8, 1, 32>(dims, ba, 0); });
    dqk("W4 M2 BN32", [&] { launch_dq_tiles<T, kD, 4, 2, 32>(dims, ba, 0); });
    dqk("W4 M1 BN64", [&] { launch_dq_tiles<T, kD, 4, 1, 64>(dims, ba, 0); });
#else
    dqk("W8 M1 BN32 (config)", [&] { launch_dq_tiles<T, kD, 8, 1, 32>(dims, ba, 0); });
    dqk("W4 M1 BN32", [&] { launch_dq_tiles<T, kD, 4, 1, 32>(dims, ba, 0); });
    dqk("W4 M1 BN64", [&] { launch_dq_tiles<T, kD, 4, 1, 64>(dims, ba, 0); });
    dqk("W8 M1 BN16", [&] { launch_dq_tiles<T, kD, 8, 1, 16>(dims, ba, 0); });
#endif
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_tiles_lab: error: %s\n", e.what());
    return 1;
  }
}
