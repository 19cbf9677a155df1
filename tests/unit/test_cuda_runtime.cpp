// CUDA runtime pieces: the caching allocator (reuse, statistics, release of cached blocks), host/device
// copies through pageable and pinned memory, streams and events. Skipped with the reason without a GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "backend/runtime.h"
#ifdef LATHE_WITH_CUDA
#include "backend/cuda/allocator.h"
#endif
#include "ops/ops.h"

using namespace lathe;

namespace {

Runtime& runtime() {
  static Runtime rt;
  return rt;
}

#define REQUIRE_CUDA()                                                              \
  do {                                                                              \
    std::string why_;                                                               \
    if (!runtime().has_device(Device::cuda(0), &why_)) GTEST_SKIP() << "no CUDA device: " << why_; \
  } while (0)

}  // namespace

TEST(CudaRuntime, ReportsWhyNoDevice) {
  std::string why;
  if (runtime().has_device(Device::cuda(0), &why)) {
    EXPECT_TRUE(why.empty());
    EXPECT_FALSE(runtime().backend(DeviceType::CUDA).info(0).name.empty());
  } else {
    EXPECT_FALSE(why.empty());
    try {
      runtime().context(Device::cuda(0));
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cuda:0 is not available"), std::string::npos) << e.what();
    }
  }
}

TEST(CudaRuntime, CachingAllocatorReusesAndReleases) {
  REQUIRE_CUDA();
  Allocator& alloc = runtime().backend(DeviceType::CUDA).allocator(0);
  alloc.release_cached();
  const AllocatorStats s0 = alloc.stats();
  void* first = nullptr;
  {
    Tensor a = Tensor::empty({1 << 20}, DType::F32, alloc);  // 4 MiB
    first = a.data_ptr();
    EXPECT_EQ(alloc.stats().allocated - s0.allocated, 4 << 20);
  }
  EXPECT_EQ(alloc.stats().allocated, s0.allocated);
  EXPECT_EQ(alloc.stats().reserved - s0.reserved, 4 << 20);  // cached, not returned
  const int64_t system_before = alloc.stats().num_system_allocs;
  {
    Tensor b = Tensor::empty({(1 << 20) - 100}, DType::F32, alloc);  // same rounded size: reused
    EXPECT_EQ(b.data_ptr(), first);
    EXPECT_EQ(alloc.stats().num_system_allocs, system_before);
  }
  EXPECT_GE(alloc.stats().peak_allocated - s0.allocated, 4 << 20);
  alloc.release_cached();
  EXPECT_EQ(alloc.stats().reserved, alloc.stats().allocated);  // only live blocks remain reserved
}

TEST(CudaRuntime, CachingAllocatorKeepsLargeTensorsInBlocksNearTheirSize) {
#ifdef LATHE_WITH_CUDA
  using lathe::cuda::CachingAllocator;
  EXPECT_EQ(CachingAllocator::max_block_for(2560), 5120u);          // small: twice the size
  EXPECT_EQ(CachingAllocator::max_block_for(4u << 20), 6u << 20);    // large: + 2 MiB at least
  EXPECT_EQ(CachingAllocator::max_block_for(64u << 20), 72u << 20);  // + an eighth
#endif
  REQUIRE_CUDA();
  Allocator& alloc = runtime().backend(DeviceType::CUDA).allocator(0);
  alloc.release_cached();
  const AllocatorStats s0 = alloc.stats();
  void* big = nullptr;
  {
    Tensor a = Tensor::empty({64 << 20}, DType::U8, alloc);
    big = a.data_ptr();
  }
  {
    Tensor b = Tensor::empty({40 << 20}, DType::U8, alloc);  // 64 MiB is over 40 + 5: not handed out
    EXPECT_NE(b.data_ptr(), big);
    EXPECT_EQ(alloc.stats().allocated - s0.allocated, 40 << 20);
    EXPECT_EQ(alloc.stats().requested - s0.requested, 40 << 20);
  }
  {
    Tensor c = Tensor::empty({60 << 20}, DType::U8, alloc);  // within 60 + 7.5: the cached 64 MiB block
    EXPECT_EQ(c.data_ptr(), big);
    EXPECT_EQ(alloc.stats().allocated - s0.allocated, 64 << 20) << "the whole block counts as allocated";
    EXPECT_EQ(alloc.stats().requested - s0.requested, 60 << 20);
  }
  void* small = nullptr;
  {
    Tensor d = Tensor::empty({4000}, DType::U8, alloc);  // rounded to 4,096 bytes
    small = d.data_ptr();
  }
  {
    Tensor e = Tensor::empty({2100}, DType::U8, alloc);  // rounded to 2,560: the cached 4,096 is within twice that
    EXPECT_EQ(e.data_ptr(), small);
    EXPECT_EQ(alloc.stats().requested - s0.requested, 2100);
  }
  EXPECT_EQ(alloc.stats().allocated, s0.allocated);
  EXPECT_EQ(alloc.stats().requested, s0.requested);
  alloc.release_cached();
}

// Fills the device, so it runs only when asked (LATHE_DEVICE_FILL_TESTS=1) and alone: other tests beside it would run
// out of memory.
TEST(CudaRuntime, CachingAllocatorOnAFullDeviceTakesACachedBlockOfAtMostTwiceTheSize) {
  REQUIRE_CUDA();
  const char* fill = std::getenv("LATHE_DEVICE_FILL_TESTS");
  if (!fill || std::string(fill) != "1") GTEST_SKIP() << "fills the device: set LATHE_DEVICE_FILL_TESTS=1 and run alone";
  Allocator& alloc = runtime().backend(DeviceType::CUDA).allocator(0);
  alloc.release_cached();
  const AllocatorStats s0 = alloc.stats();
  const int64_t chunk = int64_t(512) << 20;
  void* one = nullptr;
  {
    Tensor a = Tensor::empty({int64_t(1) << 30}, DType::U8, alloc);  // 1 GiB and 4 GiB, then cached
    Tensor b = Tensor::empty({int64_t(4) << 30}, DType::U8, alloc);
    one = a.data_ptr();
  }
  // 512 MiB chunks until the device is full. Both cached blocks are far over 512 MiB + an eighth, so no chunk takes
  // them while cudaMalloc succeeds; the first chunk cudaMalloc cannot place takes the 1 GiB block (twice its size);
  // the next must not take the 4 GiB one: the cache is emptied and the chunks fill its room.
  std::vector<Tensor> chunks;
  bool took_one = false, out_of_memory = false;
  for (int i = 0; i < 4096 && !out_of_memory; ++i) {
    try {
      chunks.push_back(Tensor::empty({chunk}, DType::U8, alloc));
      took_one = took_one || chunks.back().data_ptr() == one;
    } catch (const Error& e) {
      out_of_memory = true;
      EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(out_of_memory);
  EXPECT_TRUE(took_one) << "the full device emptied the cache instead of using the cached 1 GiB block";
  const AllocatorStats full = alloc.stats();
  EXPECT_EQ((full.allocated - s0.allocated) - (full.requested - s0.requested), chunk)
      << "only the chunk in the 1 GiB block holds unused memory (a chunk in the 4 GiB block would hold 3.5 GiB)";
  EXPECT_EQ(full.reserved - s0.reserved, full.allocated - s0.allocated) << "the cache was emptied";
  chunks.clear();
  alloc.release_cached();
  EXPECT_EQ(alloc.stats().allocated, s0.allocated);
}

TEST(CudaRuntime, OutOfMemoryIsAClearError) {
  REQUIRE_CUDA();
  Allocator& alloc = runtime().backend(DeviceType::CUDA).allocator(0);
  try {
    Tensor huge = Tensor::empty({int64_t(1) << 50}, DType::F32, alloc);
    FAIL() << "expected out of memory";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
  Tensor ok = Tensor::empty({1024}, DType::F32, alloc);  // the allocator still works afterwards
  EXPECT_NE(ok.data_ptr(), nullptr);
}

TEST(CudaRuntime, CopiesRoundTripPageableAndPinned) {
  REQUIRE_CUDA();
  Runtime& rt = runtime();
  std::vector<float> src(10007);
  std::iota(src.begin(), src.end(), 1.0f);
  const Tensor dev = rt.from_host(src.data(), {int64_t(src.size())}, DType::F32, Device::cuda(0));
  const Tensor back = rt.copy_to(dev, Device::cpu());
  EXPECT_EQ(std::vector<float>(back.data<float>(), back.data<float>() + src.size()), src);

  DeviceBackend& cuda = rt.backend(DeviceType::CUDA);
  Allocator* pinned = cuda.pinned_host_allocator();
  ASSERT_NE(pinned, nullptr);
  Tensor host = Tensor::empty({int64_t(src.size())}, DType::F32, *pinned);
  auto stream = cuda.create_stream(0);
  auto start = cuda.create_event(0), stop = cuda.create_event(0);
  start->record(*stream);
  cuda.copy(host.data_ptr(), Device::cpu(), dev.data_ptr(), Device::cuda(0), host.nbytes(), *stream);
  stop->record(*stream);
  stop->synchronize();
  EXPECT_GE(stop->elapsed_ms_since(*start), 0.0);
  EXPECT_EQ(std::vector<float>(host.data<float>(), host.data<float>() + src.size()), src);
}

// Runtime::upload does not wait for the device: its source may be overwritten at once (the bytes are staged), many
// uploads in flight land in order behind a long kernel queue, and each tensor holds its own bytes.
TEST(CudaRuntime, UploadsWithoutWaitingKeepTheirBytes) {
  REQUIRE_CUDA();
  Runtime& rt = runtime();
  ExecContext ctx = rt.context(Device::cuda(0));
  const Tensor big = rt.from_host(std::vector<float>(1 << 22, 1.0f).data(), {1 << 22}, DType::F32, Device::cuda(0));
  for (int i = 0; i < 20; ++i) (void)matmul(ctx, big.view({2048, 2048}), big.view({2048, 2048}));  // a queue to wait behind
  std::vector<Tensor> uploaded;
  std::vector<int32_t> src(3001);
  for (int round = 0; round < 40; ++round) {
    std::iota(src.begin(), src.end(), round * 10000);
    uploaded.push_back(rt.upload(src.data(), {int64_t(src.size())}, DType::I32, Device::cuda(0)));
    std::fill(src.begin(), src.end(), -1);  // the upload has its own copy
  }
  for (int round = 0; round < 40; ++round) {
    const Tensor back = rt.copy_to(uploaded[size_t(round)], Device::cpu());
    std::vector<int32_t> want(src.size());
    std::iota(want.begin(), want.end(), round * 10000);
    EXPECT_EQ(std::vector<int32_t>(back.data<int32_t>(), back.data<int32_t>() + want.size()), want) << "round " << round;
  }
}

TEST(CudaRuntime, StridedViewCopiesToHost) {
  REQUIRE_CUDA();
  Runtime& rt = runtime();
  std::vector<float> src = {1, 2, 3, 4, 5, 6};
  const Tensor dev = rt.from_host(src.data(), {2, 3}, DType::F32, Device::cuda(0)).transpose(0, 1);
  const Tensor back = rt.copy_to(dev, Device::cpu());
  EXPECT_EQ(std::vector<float>(back.data<float>(), back.data<float>() + 6), (std::vector<float>{1, 4, 2, 5, 3, 6}));
}

// GEMM autotuning (Runtime::set_gemm_autotune) times cuBLASLt's candidates on a shape's first call into a scratch
// output: the call's own result must still be C = A B^T + C exactly once (checked in f64 on the host), for a fresh
// output and for an accumulating one, and a second call of the same shape (the cached choice) must agree bitwise.
TEST(CudaRuntime, GemmAutotuneKeepsTheCallsResult) {
  REQUIRE_CUDA();
  Runtime& rt = runtime();
  rt.set_gemm_autotune(true);
  ExecContext ctx = rt.context(Device::cuda(0));
  const int64_t m = 384, n = 320, k = 192;
  std::vector<float> a(size_t(m * k)), b(size_t(n * k)), c0(size_t(m * n));
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(int64_t(i * 37 % 101) - 50) / 64.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(int64_t(i * 53 % 97) - 48) / 64.0f;
  for (size_t i = 0; i < c0.size(); ++i) c0[i] = float(int64_t(i * 29 % 89) - 44) / 8.0f;
  const Device dev = Device::cuda(0);
  const Tensor da = cast(ctx, rt.from_host(a.data(), {m, k}, DType::F32, dev), DType::BF16);
  const Tensor db = cast(ctx, rt.from_host(b.data(), {n, k}, DType::F32, dev), DType::BF16);
  for (const float beta : {0.0f, 1.0f}) {
    std::vector<Tensor> outs;
    for (int call = 0; call < 2; ++call) {
      Tensor dc = cast(ctx, rt.from_host(c0.data(), {m, n}, DType::F32, dev), DType::BF16);
      matmul_into(ctx, da, db, dc, {false, true, 1.0f, beta});
      outs.push_back(cast(ctx, dc, DType::F32));
    }
    const Tensor first = rt.copy_to(outs[0], Device::cpu()), second = rt.copy_to(outs[1], Device::cpu());
    const float* got = first.data<float>();
    double err = 0, ref2 = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double want = beta * double(c0[size_t(i * n + j)]);  // the inputs are exact in bf16 (multiples of 1/64, 1/8)
        for (int64_t p = 0; p < k; ++p) want += double(a[size_t(i * k + p)]) * double(b[size_t(j * k + p)]);
        err += (got[i * n + j] - want) * (got[i * n + j] - want);
        ref2 += want * want;
      }
    EXPECT_LT(err / ref2, 1e-5) << "beta " << beta;  // bf16 output rounding is about 1e-6 in nmse
    EXPECT_EQ(std::vector<float>(got, got + m * n),
              std::vector<float>(second.data<float>(), second.data<float>() + m * n))
        << "beta " << beta;
  }
  rt.set_gemm_autotune(false);
}

// The embedding's backward sums each id's rows in token order after a stable sort (no atomics): with many repeated
// ids, three runs give the same bits, and each row equals the f64 sum of its tokens' rows (rounded to bf16).
TEST(CudaRuntime, EmbeddingBackwardIsDeterministic) {
  REQUIRE_CUDA();
  Runtime& rt = runtime();
  ExecContext ctx = rt.context(Device::cuda(0));
  const int64_t vocab = 50, hidden = 96, tokens = 4000;
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  std::vector<float> dy(static_cast<size_t>(tokens * hidden));
  for (int64_t t = 0; t < tokens; ++t) ids[size_t(t)] = int32_t((t * t + 7 * t) % 37);  // ids 37..49 never occur
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = float(int64_t(i * 7919 % 255) - 127) / 64.0f;  // exact in bf16
  const Tensor d_ids = rt.from_host(ids.data(), {tokens}, DType::I32, Device::cuda(0));
  const Tensor d_dy = cast(ctx, rt.from_host(dy.data(), {tokens, hidden}, DType::F32, Device::cuda(0)), DType::BF16);
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    const Tensor dw = rt.copy_to(cast(ctx, embedding_backward(ctx, d_dy, d_ids, vocab), DType::F32), Device::cpu());
    const std::vector<float> got(dw.data<float>(), dw.data<float>() + vocab * hidden);
    if (run == 0) first = got;
    else ASSERT_EQ(got, first) << "run " << run;
  }
  double err = 0, ref = 0;
  for (int64_t v = 0; v < vocab; ++v)
    for (int64_t c = 0; c < hidden; ++c) {
      double want = 0;  // exact in fp32 too: sums of about 110 multiples of 1/64 below 2
      for (int64_t t = 0; t < tokens; ++t)
        if (ids[size_t(t)] == v) want += double(dy[size_t(t * hidden + c)]);
      const double got = first[size_t(v * hidden + c)];
      if (v >= 37) ASSERT_EQ(got, 0.0) << "row " << v << " has no token";
      err += (got - want) * (got - want);
      ref += want * want;
    }
  EXPECT_LT(err / ref, 1e-5);  // the one bf16 rounding of each sum: about 1e-6
}
