// CPU row-segment kernels for multi-tenant LoRA: segment_mask and dropout (formulas at SegmentAttrs in
// ops/op_table.h), for every float dtype natively (compute in float, double for f64; bf16/f16 round once at the
// store, as the CUDA kernels do). segment_mask never reads x outside the kept blocks, so Inf/NaN there give 0.
// The dropout mask comes from backend/dropout_hash.h, shared with the CUDA kernel, and the kept values are
// x / (1 - p) in the compute type on both devices.
// Covered by the segment_mask / dropout op-check cases (src/testing/op_cases.cpp) and tests/ops/test_segment_ops.cpp.
#include <algorithm>
#include <type_traits>

#include "backend/cpu/cpu_backend.h"
#include "backend/dropout_hash.h"
#include "backend/registry.h"

namespace lathe {

namespace {

template <typename T> struct Compute { using type = float; };
template <> struct Compute<double> { using type = double; };

inline float widen(float v) { return v; }
inline double widen(double v) { return v; }
inline float widen(BF16 v) { return bf16_to_float(v); }
inline float widen(F16 v) { return f16_to_float(v); }

template <typename T> T narrow(typename Compute<T>::type v) {
  if constexpr (std::is_same_v<T, BF16>) return float_to_bf16(v);
  else if constexpr (std::is_same_v<T, F16>) return float_to_f16(v);
  else return v;
}

template <typename T>
void segment_mask_run(const OpCall& c, ExecContext&) {
  using A = typename Compute<T>::type;
  const SegmentAttrs& a = c.attr<SegmentAttrs>();
  const Tensor& x = c.inputs[0];  // (T, C)
  const int64_t cols = x.size(1);
  const T* px = x.data<T>();
  T* py = c.outputs[0].data<T>();  // (T, C)
  // Zero everywhere, then the kept blocks: what lies outside them is never read.
  std::fill(py, py + x.numel(), narrow<T>(A(0)));
  for (size_t s = 0; s + 1 < a.rows.size(); ++s) {
    const A scale = A(a.scale[s]);
    const int64_t cb = a.col_begin[s], ce = a.col_end[s];
#pragma omp parallel for if ((a.rows[s + 1] - a.rows[s]) * (ce - cb) > 65536)
    for (int64_t i = a.rows[s]; i < a.rows[s + 1]; ++i)
      for (int64_t j = cb; j < ce; ++j) py[i * cols + j] = narrow<T>(scale * widen(px[i * cols + j]));
  }
}

template <typename T>
void dropout_run(const OpCall& c, ExecContext&) {
  using A = typename Compute<T>::type;
  const SegmentAttrs& a = c.attr<SegmentAttrs>();
  const Tensor& x = c.inputs[0];  // (T, C)
  const int64_t cols = x.size(1);
  const T* px = x.data<T>();
  T* py = c.outputs[0].data<T>();  // (T, C)
  const size_t n_seg = a.rows.size() - 1;
  const int64_t width = a.row_width > 0 ? a.row_width : cols;
  for (size_t s = 0; s < n_seg; ++s) {
    const uint32_t k_min = dropout_threshold(a.p[s]);
    const uint64_t seed = a.seed[s];
    const A keep_prob = A(1.0 - a.p[s]);
    const int64_t r0 = a.rows[s] - (a.row_shift.empty() ? 0 : a.row_shift[s]);  // the segment's first row
#pragma omp parallel for if ((a.rows[s + 1] - a.rows[s]) * cols > 65536)
    for (int64_t i = a.rows[s]; i < a.rows[s + 1]; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const uint64_t n = uint64_t(i - r0) * uint64_t(width) + uint64_t(a.col_offset + j);  // its index in the segment
        py[i * cols + j] = dropout_keep(seed, n, k_min) ? narrow<T>(widen(px[i * cols + j]) / keep_prob)
                                                        : narrow<T>(A(0));
      }
  }
  // Rows beyond the last segment pass through.
  std::copy(px + a.rows[n_seg] * cols, px + x.numel(), py + a.rows[n_seg] * cols);
}

template <typename T>
void register_typed(KernelRegistry& r) {
  const DType dt = DTypeOf<T>::value;
  r.add(KernelDef{OpId::segment_mask, DeviceType::CPU, dt, "cpu/segment_mask", all_contiguous, segment_mask_run<T>});
  r.add(KernelDef{OpId::dropout, DeviceType::CPU, dt, "cpu/segment_dropout", all_contiguous, dropout_run<T>});
}

}  // namespace

void register_cpu_segment_kernels(KernelRegistry& r) {
  register_typed<float>(r);
  register_typed<double>(r);
  register_typed<BF16>(r);
  register_typed<F16>(r);
}

}  // namespace lathe
