// CPU elementwise kernels: add and mul with numpy broadcasting, scale, cast between any dtypes (also the
// strided-to-contiguous copy), SiLU and sigmoid and their backward ops. Inputs may be strided; outputs are contiguous.
#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/strided.h"
#include "backend/registry.h"

namespace lathe {

namespace {

// out[i] = f(a[i'], b[i'']) over the broadcast shape of out.
template <typename T, typename F>
void binary_map(const OpCall& call, F f) {
  const Tensor& out = call.outputs[0];
  const Tensor& a = call.inputs[0];
  const Tensor& b = call.inputs[1];
  const Shape sa = cpu::broadcast_strides(a, out.shape());
  const Shape sb = cpu::broadcast_strides(b, out.shape());
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  T* po = out.data<T>();
  const int64_t n = out.numel();
  const bool plain = a.is_contiguous() && b.is_contiguous() && a.shape() == out.shape() && b.shape() == out.shape();
#pragma omp parallel for if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ia = plain ? i : cpu::strided_offset(i, out.shape(), sa);
    const int64_t ib = plain ? i : cpu::strided_offset(i, out.shape(), sb);
    po[i] = f(pa[ia], pb[ib]);
  }
}

template <typename T, typename F>
void unary_map(const OpCall& call, F f) {
  const Tensor& out = call.outputs[0];
  const Tensor& x = call.inputs[0];
  const T* px = x.data<T>();
  T* po = out.data<T>();
  const int64_t n = out.numel();
  const bool plain = x.is_contiguous();
#pragma omp parallel for if (n > 65536)
  for (int64_t i = 0; i < n; ++i) po[i] = f(px[plain ? i : cpu::strided_offset(i, x.shape(), x.strides())]);
}

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <typename T>
void register_float_kernels(KernelRegistry& r) {
  const DType dt = DTypeOf<T>::value;
  r.add(KernelDef{OpId::add, DeviceType::CPU, dt, "cpu/broadcast_add", outputs_contiguous,
                  [](const OpCall& c, ExecContext&) { binary_map<T>(c, [](T a, T b) { return a + b; }); }});
  r.add(KernelDef{OpId::mul, DeviceType::CPU, dt, "cpu/broadcast_mul", outputs_contiguous,
                  [](const OpCall& c, ExecContext&) { binary_map<T>(c, [](T a, T b) { return a * b; }); }});
  r.add(KernelDef{OpId::scale, DeviceType::CPU, dt, "cpu/scale", outputs_contiguous, [](const OpCall& c, ExecContext&) {
                    const T alpha = T(c.attr<ScaleAttrs>().alpha);
                    unary_map<T>(c, [alpha](T x) { return alpha * x; });
                  }});
  r.add(KernelDef{OpId::silu, DeviceType::CPU, dt, "cpu/silu", outputs_contiguous, [](const OpCall& c, ExecContext&) {
                    unary_map<T>(c, [](T x) { return x * sigmoid(x); });
                  }});
  // d/dx [x s(x)] = s(x) (1 + x (1 - s(x)))
  r.add(KernelDef{OpId::silu_backward, DeviceType::CPU, dt, "cpu/silu_backward", outputs_contiguous,
                  [](const OpCall& c, ExecContext&) {
                    binary_map<T>(c, [](T x, T dy) {
                      const T s = sigmoid(x);
                      return dy * s * (T(1) + x * (T(1) - s));
                    });
                  }});
  r.add(KernelDef{OpId::sigmoid, DeviceType::CPU, dt, "cpu/sigmoid", outputs_contiguous,
                  [](const OpCall& c, ExecContext&) { unary_map<T>(c, [](T x) { return sigmoid(x); }); }});
  // d/dx s(x) = s (1 - s), from the output y = s(x)
  r.add(KernelDef{OpId::sigmoid_backward, DeviceType::CPU, dt, "cpu/sigmoid_backward", outputs_contiguous,
                  [](const OpCall& c, ExecContext&) {
                    binary_map<T>(c, [](T y, T dy) { return dy * y * (T(1) - y); });
                  }});
}

// Any dtype to any dtype, through double (exact for every supported dtype except i64 beyond 2^53). The output may
// be strided (copy_into a view whose elements are distinct).
void cast_any(const OpCall& call, ExecContext&) {
  const Tensor& x = call.inputs[0];
  const Tensor& out = call.outputs[0];
  const int64_t n = out.numel();
  const void* px = x.data_ptr();
  void* po = out.data_ptr();
  const bool plain = x.is_contiguous(), out_plain = out.is_contiguous();
  if (plain && out_plain && x.dtype() == out.dtype()) {
    std::memcpy(po, px, out.nbytes());
    return;
  }
#pragma omp parallel for if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ix = plain ? i : cpu::strided_offset(i, x.shape(), x.strides());
    const int64_t io = out_plain ? i : cpu::strided_offset(i, out.shape(), out.strides());
    store_from_double(po, out.dtype(), io, load_as_double(px, x.dtype(), ix));
  }
}

}  // namespace

void register_cpu_elementwise_kernels(KernelRegistry& r) {
  register_float_kernels<float>(r);
  register_float_kernels<double>(r);
  for (DType dt : kAllDTypes)
    r.add(KernelDef{OpId::cast, DeviceType::CPU, dt, "cpu/cast", [](const OpCall&) { return Support::yes(); },
                    cast_any});  // strided outputs too
}

}  // namespace lathe
