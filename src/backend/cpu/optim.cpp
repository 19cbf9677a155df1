// CPU optimizer kernels: the AdamW step (op `adamw`, formula in ops/op_table.h), per master dtype (f32, f64, and bf16:
// optimizer states in bf16, the parameter its own master) for gradients of any float dtype. Computes in double
// whatever the storage dtype, so it is the reference the CUDA kernel is judged against. Each element is read before
// it is written: outputs may alias the inputs. The optional rounded parameter (attrs.rounded_to) is converted from
// the stored master' as the cast op does (store_from_double of the T value), which is what makes it bitwise equal to
// adamw followed by cast. A bf16 key stores each output as f32 first, then rounds that to nearest even into bf16
// (the cast op's conversion), so it is bitwise the f32 key on the widened inputs followed by a cast.
// Covered by the adamw op-check cases (src/testing/op_cases.cpp) and tests/unit/test_optim.cpp.
#include <cmath>

#include "backend/cpu/cpu_backend.h"
#include "backend/registry.h"

namespace lathe {

namespace {

inline double to_double(float x) { return x; }
inline double to_double(double x) { return x; }
inline double to_double(BF16 x) { return bf16_to_float(x); }
inline double to_double(F16 x) { return f16_to_float(x); }

// The stored form of a result computed in double: rounded once for f32 and f64 keys; for bf16, through f32 (as a
// float kernel or the f32 key followed by a cast would store it).
template <typename T> T store_as(double x) { return T(x); }
template <> BF16 store_as<BF16>(double x) { return float_to_bf16(float(x)); }

Support adamw_supports(const OpCall& c) {
  for (const Tensor& t : c.inputs)
    if (!t.is_contiguous()) return Support::no("inputs must be contiguous");
  for (const Tensor& t : c.outputs)
    if (!t.is_contiguous()) return Support::no("outputs must be contiguous");
  return Support::yes();
}

template <typename T, typename G>
void adamw_step(const OpCall& c) {
  const AdamWAttrs& a = c.attr<AdamWAttrs>();
  const T* w = c.inputs[0].data<T>();
  const G* g = c.inputs[1].data<G>();
  const T* m = c.inputs[2].data<T>();
  const T* v = c.inputs[3].data<T>();
  T* w_out = c.outputs[0].data<T>();
  T* m_out = c.outputs[1].data<T>();
  T* v_out = c.outputs[2].data<T>();
  void* rounded = a.rounded_to ? c.outputs[3].data_ptr() : nullptr;  // bf16/f16 (ops/shape.cpp checks)
  const DType rounded_dtype = a.rounded_to.value_or(DType::F32);
  const double b1 = a.beta1, b2 = a.beta2;
  const double step_size = a.lr / (1.0 - std::pow(b1, double(a.step)));
  const double sqrt_bc2 = std::sqrt(1.0 - std::pow(b2, double(a.step)));
  const double lr_wd = a.lr * a.weight_decay;
  const int64_t n = c.inputs[0].numel();
#pragma omp parallel for if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const double gi = a.grad_scale * to_double(g[i]);
    const double w_old = to_double(w[i]);
    const double mi = b1 * to_double(m[i]) + (1.0 - b1) * gi;
    const double vi = b2 * std::abs(to_double(v[i])) + (1.0 - b2) * gi * gi;
    const double wi = w_old - lr_wd * w_old - step_size * mi / (std::sqrt(vi) / sqrt_bc2 + a.eps);
    const T w_stored = store_as<T>(wi);
    w_out[i] = w_stored;
    m_out[i] = store_as<T>(mi);
    v_out[i] = store_as<T>(vi);
    if (rounded) store_from_double(rounded, rounded_dtype, i, to_double(w_stored));
  }
}

template <typename T>
void adamw_run(const OpCall& c, ExecContext&) {
  switch (c.inputs[1].dtype()) {
    case DType::F32: adamw_step<T, float>(c); return;
    case DType::F64: adamw_step<T, double>(c); return;
    case DType::BF16: adamw_step<T, BF16>(c); return;
    case DType::F16: adamw_step<T, F16>(c); return;
    default: LATHE_FAIL("cpu: adamw gradient dtype {} is not a float dtype", dtype_name(c.inputs[1].dtype()));
  }
}

}  // namespace

void register_cpu_optim_kernels(KernelRegistry& r) {
  r.add(KernelDef{OpId::adamw, DeviceType::CPU, DType::F32, "cpu/adamw", adamw_supports, adamw_run<float>});
  r.add(KernelDef{OpId::adamw, DeviceType::CPU, DType::F64, "cpu/adamw", adamw_supports, adamw_run<double>});
  r.add(KernelDef{OpId::adamw, DeviceType::CPU, DType::BF16, "cpu/adamw", adamw_supports, adamw_run<BF16>});
}

}  // namespace lathe
