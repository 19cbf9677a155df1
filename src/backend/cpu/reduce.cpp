// CPU reductions: sum over any set of dims (strided input), softmax over the last dim and its backward.
// Accumulation is in double for every dtype.
#include <algorithm>
#include <cmath>

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
}

}  // namespace lathe
