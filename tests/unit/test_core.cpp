// Core types: dtype conversions against known bit patterns (IEEE 754 / bfloat16 definitions), tensor
// views and strides, host allocator statistics and scopes, device parsing and error messages.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "backend/runtime.h"
#include "core/tensor.h"
#include "ops/ops.h"

using namespace lathe;

TEST(DType, Bf16KnownPatterns) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3F80);
  EXPECT_EQ(float_to_bf16(-2.0f).bits, 0xC000);
  EXPECT_EQ(float_to_bf16(0.1f).bits, 0x3DCD);  // 0x3DCCCCCD rounds up
  // Ties round to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 -> 1.
  EXPECT_EQ(float_to_bf16(1.00390625f).bits, 0x3F80);
  EXPECT_EQ(float_to_bf16(1.01171875f).bits, 0x3F82);  // halfway between 0x3F81 and 0x3F82 -> even 0x3F82
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(bf16_to_float(BF16{0x4049}), 3.140625f);
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(3.4e38f))));  // rounds past the largest finite
}

TEST(DType, F16KnownPatterns) {
  EXPECT_EQ(float_to_f16(1.0f).bits, 0x3C00);
  EXPECT_EQ(float_to_f16(-2.5f).bits, 0xC100);
  EXPECT_EQ(float_to_f16(65504.0f).bits, 0x7BFF);   // largest finite
  EXPECT_EQ(float_to_f16(65520.0f).bits, 0x7C00);   // rounds to infinity
  EXPECT_EQ(float_to_f16(5.9604645e-8f).bits, 0x0001);  // smallest subnormal 2^-24
  EXPECT_EQ(float_to_f16(2.9802322e-8f).bits, 0x0000);  // 2^-25 ties to even (zero)
  EXPECT_EQ(f16_to_float(F16{0x0001}), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(F16{0x3555}), 0.333251953125f);
  EXPECT_TRUE(std::isnan(f16_to_float(F16{0x7E00})));
  // Every f16 pattern survives a round trip through f32.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const F16 h{uint16_t(b)};
    const float f = f16_to_float(h);
    if (!std::isnan(f)) EXPECT_EQ(float_to_f16(f).bits, h.bits) << b;
  }
}

TEST(DType, NamesRoundTrip) {
  for (DType t : kAllDTypes) EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  EXPECT_THROW(dtype_from_name("float8"), Error);
}

TEST(Device, Parse) {
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("cuda"), Device::cuda(0));
  EXPECT_EQ(parse_device("cuda:3"), Device::cuda(3));
  EXPECT_THROW(parse_device("gpu"), Error);
  EXPECT_THROW(parse_device("cuda:x"), Error);
  EXPECT_EQ(Device::cuda(2).str(), "cuda:2");
}

TEST(Tensor, ViewsShareStorageAndComputeStrides) {
  HostAllocator alloc;
  Tensor t = Tensor::empty({2, 3, 4}, DType::F32, alloc);
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  float* p = t.data<float>();
  for (int i = 0; i < 24; ++i) p[i] = float(i);

  Tensor tr = t.transpose(0, 2);  // (4, 3, 2)
  EXPECT_EQ(tr.shape(), (Shape{4, 3, 2}));
  EXPECT_EQ(tr.strides(), (Shape{1, 4, 12}));
  EXPECT_FALSE(tr.is_contiguous());

  Tensor n = t.narrow(1, 1, 2);  // rows 1..2 of each batch
  EXPECT_EQ(n.offset(), 4);
  EXPECT_EQ(n.data<float>()[0], 4.0f);

  Tensor v = t.view({6, -1});
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  EXPECT_EQ(v.storage(), t.storage());
  EXPECT_THROW(tr.view({24}), Error);  // not contiguous
  EXPECT_THROW(t.view({5, -1}), Error);

  Tensor e = Tensor::empty({3}, DType::F32, alloc).unsqueeze(0).expand({4, 3});
  EXPECT_EQ(e.strides(), (Shape{0, 1}));
  EXPECT_THROW(t.expand({2, 5, 4}), Error);
  EXPECT_THROW(t.data<double>(), Error);  // wrong element type
  EXPECT_THROW(t.narrow(0, 1, 2), Error);
}

TEST(HostAllocator, Statistics) {
  HostAllocator alloc;
  {
    Tensor a = Tensor::empty({1000}, DType::F32, alloc);
    Tensor b = Tensor::empty({500}, DType::F64, alloc);
    EXPECT_EQ(alloc.stats().allocated, 8000);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data_ptr()) % 64, 0u);
  }
  EXPECT_EQ(alloc.stats().allocated, 0);
  EXPECT_EQ(alloc.stats().peak_allocated, 8000);
  EXPECT_EQ(alloc.stats().num_allocs, 2);
}

// AllocatorScope: while it lives, contexts made for its device allocate from its allocator (nested scopes too); the
// runtime's own allocator again once it ends. (What the rollout engine's graphs are recorded with.)
TEST(AllocatorScope, RoutesContextsWhileItLives) {
  Runtime rt;
  HostAllocator outer, inner;
  const auto allocate = [&] { return Tensor::empty({10}, DType::F32, rt.context(Device::cpu()).allocator); };
  {
    const AllocatorScope a(rt, Device::cpu(), outer);
    const Tensor x = allocate();
    {
      const AllocatorScope b(rt, Device::cpu(), inner);
      const Tensor y = allocate();
      EXPECT_EQ(inner.stats().allocated, 40);
    }
    const Tensor z = allocate();
    EXPECT_EQ(outer.stats().num_allocs, 2);
    EXPECT_EQ(inner.stats().num_allocs, 1);
  }
  EXPECT_EQ(&rt.context(Device::cpu()).allocator, &rt.backend(DeviceType::CPU).allocator(0));
  EXPECT_EQ(outer.stats().num_allocs, 2);
}

TEST(Errors, MessagesNameTheProblem) {
  Runtime rt;
  ExecContext cpu = rt.context(Device::cpu());
  Tensor a = Tensor::empty({2, 3}, DType::F32, cpu.allocator);
  Tensor b = Tensor::empty({4, 5}, DType::F32, cpu.allocator);
  try {
    matmul(cpu, a, b);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("matmul inner dimensions differ"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("shape.cpp:"), std::string::npos) << e.what();
  }
  Tensor i = Tensor::empty({2, 3}, DType::I32, cpu.allocator);
  EXPECT_THROW(softmax(cpu, i), Error);
  EXPECT_THROW(add(cpu, a, Tensor::empty({2, 3}, DType::F64, cpu.allocator)), Error);
  EXPECT_THROW(rt.context(Device::cuda(7)), Error);
}

TEST(Errors, GatedRmsnormNamesTheMismatchedInput) {
  Runtime rt;
  ExecContext cpu = rt.context(Device::cpu());
  const auto f32 = [&](Shape s) { return Tensor::empty(std::move(s), DType::F32, cpu.allocator); };
  const auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  const Tensor x = f32({4, 8}), w = f32({8});
  EXPECT_NE(message([&] { gated_rmsnorm(cpu, x, w, f32({4, 7}), {}); }).find("gated_rmsnorm gate z"), std::string::npos);
  EXPECT_NE(message([&] { gated_rmsnorm(cpu, x, f32({7}), f32({4, 8}), {}); }).find("gated_rmsnorm weight"),
            std::string::npos);
  EXPECT_NE(message([&] { gated_rmsnorm(cpu, x, w, Tensor::empty({4, 8}, DType::F64, cpu.allocator), {}); })
                .find("gated_rmsnorm needs inputs of one dtype"),
            std::string::npos);
  EXPECT_NE(message([&] { gated_rmsnorm_backward(cpu, x, w, f32({4, 8}), f32({8, 4}), {}); })
                .find("gated_rmsnorm_backward dy"),
            std::string::npos);
}
