// CPU matmul: f32 through OpenBLAS sgemm, f64 as plain loops (the reference that f32 and every device
// kernel are checked against). Row-major; a batched A with 2-D B folds its batch into M; an unbatched product's
// operands may be column slices (matmul_layout), read and written through their leading dimensions.
#include <cblas.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/registry.h"
#include "ops/ops.h"

namespace lathe {

namespace {

struct GemmShape {
  int64_t batch, m, n, k;
  int64_t lda, ldb, ldc;  // leading dimensions of the stored A, B and C
};

GemmShape gemm_shape(const OpCall& call) {
  const Tensor& a = call.inputs[0];
  const Tensor& b = call.inputs[1];
  const auto& at = call.attr<MatmulAttrs>();
  const int64_t k = at.trans_b ? b.size(-1) : b.size(-2);
  const int64_t n = at.trans_b ? b.size(-2) : b.size(-1);
  if (a.dim() == 2 && b.dim() == 2) {
    const int64_t m = at.trans_a ? a.size(1) : a.size(0);
    return {1, m, n, k, leading_dim(a), leading_dim(b), leading_dim(call.outputs[0])};
  }
  const int64_t ldb = at.trans_b ? k : n;
  if (b.dim() == 2) return {1, a.numel() / k, n, k, k, ldb, n};  // batch folded into M (trans_a is false here)
  const int64_t m = at.trans_a ? a.size(-1) : a.size(-2);
  return {a.numel() / (m * k), m, n, k, at.trans_a ? m : k, ldb, n};
}

void matmul_f32(const OpCall& call, ExecContext&) {
  const auto& at = call.attr<MatmulAttrs>();
  const GemmShape g = gemm_shape(call);
  const float* a = call.inputs[0].data<float>();
  const float* b = call.inputs[1].data<float>();
  float* c = call.outputs[0].data<float>();
  const int64_t b_batch_stride = call.inputs[1].dim() == 2 ? 0 : g.k * g.n;
  for (int64_t i = 0; i < g.batch; ++i) {
    cblas_sgemm(CblasRowMajor, at.trans_a ? CblasTrans : CblasNoTrans, at.trans_b ? CblasTrans : CblasNoTrans,
                int(g.m), int(g.n), int(g.k), at.alpha, a + i * g.m * g.k, int(g.lda), b + i * b_batch_stride,
                int(g.ldb), at.beta, c + i * g.m * g.n, int(g.ldc));
  }
}

void matmul_f64_reference(const OpCall& call, ExecContext&) {
  const auto& at = call.attr<MatmulAttrs>();
  const GemmShape g = gemm_shape(call);
  const double* a = call.inputs[0].data<double>();
  const double* b = call.inputs[1].data<double>();
  double* c = call.outputs[0].data<double>();
  const int64_t b_batch_stride = call.inputs[1].dim() == 2 ? 0 : g.k * g.n;
#pragma omp parallel for collapse(2)
  for (int64_t bi = 0; bi < g.batch; ++bi) {
    for (int64_t i = 0; i < g.m; ++i) {
      const double* ab = a + bi * g.m * g.k;
      const double* bb = b + bi * b_batch_stride;
      double* cb = c + bi * g.m * g.n;
      for (int64_t j = 0; j < g.n; ++j) {
        double acc = 0;
        for (int64_t p = 0; p < g.k; ++p) {
          const double av = at.trans_a ? ab[p * g.lda + i] : ab[i * g.lda + p];
          const double bv = at.trans_b ? bb[j * g.ldb + p] : bb[p * g.ldb + j];
          acc += av * bv;
        }
        const double prev = at.beta != 0.0f ? double(at.beta) * cb[i * g.ldc + j] : 0.0;
        cb[i * g.ldc + j] = double(at.alpha) * acc + prev;
      }
    }
  }
}

}  // namespace

void register_cpu_matmul_kernels(KernelRegistry& r) {
  r.add(KernelDef{OpId::matmul, DeviceType::CPU, DType::F32, "cpu/openblas_sgemm", matmul_layout, matmul_f32});
  r.add(KernelDef{OpId::matmul, DeviceType::CPU, DType::F64, "cpu/reference_loops", matmul_layout,
                  matmul_f64_reference});
}

}  // namespace lathe
