// CPU grouped GEMM (formulas at GroupedMatmulAttrs in ops/op_table.h): f32 through one OpenBLAS sgemm per non-empty
// group, f64 as plain loops (the reference that f32 and every device kernel are checked against). Row-major; the
// weight (and the weight-grad output) is addressed block by block, block e at its data pointer plus e times its dim-0
// stride, so a narrowed view of a fused (E, 2I, H) tensor is read and written in place. An empty group writes nothing
// in the forward and a zero block in the weight grad. The routed ops read their groups from their offsets tensor (host
// memory here) and run the same kernels. Covered by tests/ops (testing/op_cases_moe.cpp) and
// tests/ops/test_grouped_matmul.cpp.
#include <cblas.h>

#include <algorithm>

#include "backend/cpu/cpu_backend.h"
#include "backend/registry.h"
#include "ops/ops.h"

namespace lathe {

namespace {

// The sizes of one call: P rows in E groups; forward y (P, N) from x (P, K); weight grad dw (E, N, K) from dy (P, N)
// and x (P, K). `block_stride` is the dim-0 stride of the weight (forward) or of dw (weight grad).
struct GroupedShape {
  int64_t experts, n, k, block_stride;
};

GroupedShape grouped_shape(const OpCall& c) {
  const auto& a = c.attr<GroupedMatmulAttrs>();
  const int64_t experts = int64_t(a.offsets.size()) - 1;
  if (c.op == OpId::grouped_matmul) {
    const Tensor& w = c.inputs[1];
    return {experts, c.outputs[0].size(1), c.inputs[0].size(1), w.strides()[0]};
  }
  return {experts, c.inputs[0].size(1), c.inputs[1].size(1), c.outputs[0].strides()[0]};
}

void grouped_matmul_f32(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<GroupedMatmulAttrs>();
  const GroupedShape g = grouped_shape(c);
  const float* x = c.inputs[0].data<float>();
  const float* w = c.inputs[1].data<float>();
  float* y = c.outputs[0].data<float>();
  for (int64_t e = 0; e < g.experts; ++e) {
    const int64_t row0 = a.offsets[size_t(e)], rows = a.offsets[size_t(e) + 1] - row0;
    if (rows == 0) continue;
    // y_e (rows, N) = x_e (rows, K) op(w_e): w_e is (N, K) (trans_w) or (K, N), contiguous rows.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, a.trans_w ? CblasTrans : CblasNoTrans, int(rows), int(g.n), int(g.k), 1.0f,
                x + row0 * g.k, int(g.k), w + e * g.block_stride, int(a.trans_w ? g.k : g.n), 0.0f, y + row0 * g.n,
                int(g.n));
  }
}

void grouped_matmul_weight_grad_f32(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<GroupedMatmulAttrs>();
  const GroupedShape g = grouped_shape(c);
  const float* dy = c.inputs[0].data<float>();
  const float* x = c.inputs[1].data<float>();
  float* dw = c.outputs[0].data<float>();
  for (int64_t e = 0; e < g.experts; ++e) {
    const int64_t row0 = a.offsets[size_t(e)], rows = a.offsets[size_t(e) + 1] - row0;
    float* block = dw + e * g.block_stride;
    if (rows == 0) {
      if (!a.accumulate) std::fill(block, block + g.n * g.k, 0.0f);
      continue;
    }
    // dw_e (N, K) = dy_e^T (N, rows) x_e (rows, K) (+ dw_e when accumulating).
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(g.n), int(g.k), int(rows), 1.0f, dy + row0 * g.n,
                int(g.n), x + row0 * g.k, int(g.k), a.accumulate ? 1.0f : 0.0f, block, int(g.k));
  }
}

void grouped_matmul_f64_reference(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<GroupedMatmulAttrs>();
  const GroupedShape g = grouped_shape(c);
  const double* x = c.inputs[0].data<double>();
  const double* w = c.inputs[1].data<double>();
  double* y = c.outputs[0].data<double>();
  for (int64_t e = 0; e < g.experts; ++e) {
    const int64_t row0 = a.offsets[size_t(e)], row1 = a.offsets[size_t(e) + 1];
    const double* we = w + e * g.block_stride;
#pragma omp parallel for collapse(2)
    for (int64_t i = row0; i < row1; ++i) {
      for (int64_t j = 0; j < g.n; ++j) {
        double acc = 0;
        for (int64_t p = 0; p < g.k; ++p) acc += x[i * g.k + p] * (a.trans_w ? we[j * g.k + p] : we[p * g.n + j]);
        y[i * g.n + j] = acc;
      }
    }
  }
}

void grouped_matmul_weight_grad_f64_reference(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<GroupedMatmulAttrs>();
  const GroupedShape g = grouped_shape(c);
  const double* dy = c.inputs[0].data<double>();
  const double* x = c.inputs[1].data<double>();
  double* dw = c.outputs[0].data<double>();
  for (int64_t e = 0; e < g.experts; ++e) {
    const int64_t row0 = a.offsets[size_t(e)], row1 = a.offsets[size_t(e) + 1];
    double* block = dw + e * g.block_stride;
#pragma omp parallel for collapse(2)
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t p = 0; p < g.k; ++p) {
        double acc = 0;  // 0 for an empty group
        for (int64_t i = row0; i < row1; ++i) acc += dy[i * g.n + j] * x[i * g.k + p];
        block[j * g.k + p] = a.accumulate ? block[j * g.k + p] + acc : acc;
      }
    }
  }
}

}  // namespace

// The routed ops: the groups read from the offsets tensor (host memory here), clamped (each range within [0, P] and
// after the one before), then the kernel of the op with host groups.
template <void (*kernel)(const OpCall&, ExecContext&)>
void routed(const OpCall& c, ExecContext& ctx) {
  const bool forward = c.op == OpId::grouped_matmul_routed;
  const int32_t* off = c.inputs[2].data<int32_t>();
  const int64_t experts = c.inputs[2].size(0) - 2, rows = c.inputs[0].size(0);
  GroupedMatmulAttrs a = c.attr<GroupedMatmulAttrs>();
  for (int64_t e = 0; e <= experts; ++e)
    a.offsets.push_back(e == experts ? rows : std::clamp<int64_t>(off[e], e ? a.offsets.back() : 0, rows));
  kernel(OpCall{forward ? OpId::grouped_matmul : OpId::grouped_matmul_weight_grad, {c.inputs[0], c.inputs[1]},
                c.outputs, a},
         ctx);
}

void register_cpu_grouped_matmul_kernels(KernelRegistry& r) {
  r.add(KernelDef{OpId::grouped_matmul_routed, DeviceType::CPU, DType::F32, "cpu/openblas_sgemm_per_group",
                  grouped_matmul_layout, routed<grouped_matmul_f32>});
  r.add(KernelDef{OpId::grouped_matmul_routed, DeviceType::CPU, DType::F64, "cpu/reference_loops",
                  grouped_matmul_layout, routed<grouped_matmul_f64_reference>});
  r.add(KernelDef{OpId::grouped_matmul_weight_grad_routed, DeviceType::CPU, DType::F32, "cpu/openblas_sgemm_per_group",
                  grouped_matmul_layout, routed<grouped_matmul_weight_grad_f32>});
  r.add(KernelDef{OpId::grouped_matmul_weight_grad_routed, DeviceType::CPU, DType::F64, "cpu/reference_loops",
                  grouped_matmul_layout, routed<grouped_matmul_weight_grad_f64_reference>});
  r.add(KernelDef{OpId::grouped_matmul, DeviceType::CPU, DType::F32, "cpu/openblas_sgemm_per_group",
                  grouped_matmul_layout, grouped_matmul_f32});
  r.add(KernelDef{OpId::grouped_matmul, DeviceType::CPU, DType::F64, "cpu/reference_loops", grouped_matmul_layout,
                  grouped_matmul_f64_reference});
  r.add(KernelDef{OpId::grouped_matmul_weight_grad, DeviceType::CPU, DType::F32, "cpu/openblas_sgemm_per_group",
                  grouped_matmul_layout, grouped_matmul_weight_grad_f32});
  r.add(KernelDef{OpId::grouped_matmul_weight_grad, DeviceType::CPU, DType::F64, "cpu/reference_loops",
                  grouped_matmul_layout, grouped_matmul_weight_grad_f64_reference});
}

}  // namespace lathe
