// CPU reductions: sum over any set of dims (strided input), the sum of squares of a whole tensor (strided, any float
// dtype: the global gradient norm), softmax over the last dim and its backward. Accumulation is in double for every
// dtype. sum_squares sums fixed chunks of the logical order, then the chunk totals in order, so its result does not
// depend on the number of threads. Covered by tests/ops (the CPU rows) and tests/unit/test_optim.cpp.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/strided.h"
#include "backend/registry.h"
#include "ops/ops.h"

namespace lathe {

namespace {

template <typename T>
void sum_kernel(const OpCall& call, ExecContext&) {
  const Tensor& x = call.inputs[0];
  const std::vector<int> dims = normalize_reduce_dims(call.attr<ReduceAttrs>().dims, x.dim());
  // Split x's dims into kept (outer) and reduced (inner) sub-shapes with their strides.
  Shape kept_shape, kept_strides, red_shape, red_strides;
  for (int d = 0; d < x.dim(); ++d) {
    const bool reduced = std::find(dims.begin(), dims.end(), d) != dims.end();
    (reduced ? red_shape : kept_shape).push_back(x.size(d));
    (reduced ? red_strides : kept_strides).push_back(x.strides()[d]);
  }
  const int64_t n_out = shape_numel(kept_shape);
  const int64_t n_red = shape_numel(red_shape);
  const T* px = x.data<T>();
  T* po = call.outputs[0].data<T>();
#pragma omp parallel for if (n_out * n_red > 65536)
  for (int64_t o = 0; o < n_out; ++o) {
    const int64_t base = cpu::strided_offset(o, kept_shape, kept_strides);
    double acc = 0;
    for (int64_t r = 0; r < n_red; ++r) acc += double(px[base + cpu::strided_offset(r, red_shape, red_strides)]);
    po[o] = T(acc);
  }
}

inline double to_double(float x) { return x; }
inline double to_double(double x) { return x; }
inline double to_double(BF16 x) { return bf16_to_float(x); }
inline double to_double(F16 x) { return f16_to_float(x); }

// Output: 0-d, double for a double input and float otherwise (ops/shape.cpp).
template <typename T>
void sum_squares_kernel(const OpCall& call, ExecContext&) {
  constexpr int64_t kChunk = 65536;
  const Tensor& x = call.inputs[0];
  const int64_t n = x.numel();
  const bool plain = x.is_contiguous();
  const T* px = x.data<T>();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(size_t(chunks), 0.0);
#pragma omp parallel for if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    double acc = 0;
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
      const double v = to_double(px[plain ? i : cpu::strided_offset(i, x.shape(), x.strides())]);
      acc += v * v;
    }
    partial[size_t(c)] = acc;
  }
  double total = 0;
  for (double p : partial) total += p;
  if constexpr (std::is_same_v<T, double>) *call.outputs[0].data<double>() = total;
  else *call.outputs[0].data<float>() = float(total);
}

template <typename T>
void softmax_kernel(const OpCall& call, ExecContext&) {
  const Tensor& x = call.inputs[0];
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  const T* px = x.data<T>();
  T* py = call.outputs[0].data<T>();
#pragma omp parallel for if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = px + r * cols;
    T* yr = py + r * cols;
    double mx = -INFINITY;
    for (int64_t j = 0; j < cols; ++j) mx = std::max(mx, double(xr[j]));
    double total = 0;
    for (int64_t j = 0; j < cols; ++j) total += std::exp(double(xr[j]) - mx);
    for (int64_t j = 0; j < cols; ++j) yr[j] = T(std::exp(double(xr[j]) - mx) / total);
  }
}

// dx = y * (dy - sum(dy * y)) per row.
template <typename T>
void softmax_backward_kernel(const OpCall& call, ExecContext&) {
  const Tensor& y = call.inputs[0];
  const int64_t cols = y.size(-1);
  const int64_t rows = cols ? y.numel() / cols : 0;
  const T* py = y.data<T>();
  const T* pdy = call.inputs[1].data<T>();
  T* pdx = call.outputs[0].data<T>();
#pragma omp parallel for if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0;
    for (int64_t j = 0; j < cols; ++j) dot += double(py[r * cols + j]) * double(pdy[r * cols + j]);
    for (int64_t j = 0; j < cols; ++j)
      pdx[r * cols + j] = T(double(py[r * cols + j]) * (double(pdy[r * cols + j]) - dot));
  }
}

template <typename T>
void register_for(KernelRegistry& r) {
  const DType dt = DTypeOf<T>::value;
  r.add(KernelDef{OpId::sum, DeviceType::CPU, dt, "cpu/strided_sum", outputs_contiguous, sum_kernel<T>});
  r.add(KernelDef{OpId::softmax, DeviceType::CPU, dt, "cpu/softmax_rows", all_contiguous, softmax_kernel<T>});
  r.add(KernelDef{OpId::softmax_backward, DeviceType::CPU, dt, "cpu/softmax_backward_rows", all_contiguous,
                  softmax_backward_kernel<T>});
}

}  // namespace

void register_cpu_reduce_kernels(KernelRegistry& r) {
  register_for<float>(r);
  register_for<double>(r);
  // Every float dtype natively: bf16 gradients are squared where they lie, with no f32 copy (no upcast composite).
  r.add(KernelDef{OpId::sum_squares, DeviceType::CPU, DType::F64, "cpu/chunked_sum_squares", outputs_contiguous,
                  sum_squares_kernel<double>});
  r.add(KernelDef{OpId::sum_squares, DeviceType::CPU, DType::F32, "cpu/chunked_sum_squares", outputs_contiguous,
                  sum_squares_kernel<float>});
  r.add(KernelDef{OpId::sum_squares, DeviceType::CPU, DType::BF16, "cpu/chunked_sum_squares", outputs_contiguous,
                  sum_squares_kernel<BF16>});
  r.add(KernelDef{OpId::sum_squares, DeviceType::CPU, DType::F16, "cpu/chunked_sum_squares", outputs_contiguous,
                  sum_squares_kernel<F16>});
}

}  // namespace lathe
