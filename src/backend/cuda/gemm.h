// cuBLASLt GEMM for row-major tensors: C = alpha op(A) op(B) + beta C, bf16/f16/f32 inputs, fp32 compute
// (no TF32 for f32, so f32 results match the CPU reference), strided batches, and leading dimensions (an unbatched
// product's operands may be column slices of wider matrices). A plan (descriptors and the
// heuristic's first algorithm) is cached per stream and shape, so steady-state calls skip the heuristic. With
// autotuning (GemmProblem::autotune, from ExecContext::gemm_autotune) the plan instead holds the fastest of the
// heuristic's first kAutotuneCandidates algorithms, timed on the first call's own operands into a scratch output.
// Covered by tests/ops (matmul rows on cuda) and bench/gemm_bench.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "core/dtype.h"

namespace lathe::cuda {

class CudaStream;

struct GemmProblem {
  DType dtype;
  bool trans_a, trans_b;
  int64_t batch, m, n, k;
  int64_t stride_a, stride_b, stride_c;  // elements between batches (0 = shared)
  int64_t ld_a, ld_b, ld_c;              // elements between rows of the stored A, B and C (column slices: wider)
  bool accumulate;                       // beta != 0
  int align_a, align_b, align_c;         // pointer alignment in bytes (min 16, max 256)
  bool autotune = false;                 // time the heuristic's candidates on the first call, keep the fastest
  auto key() const {
    return std::tuple(int(dtype), trans_a, trans_b, batch, m, n, k, stride_a, stride_b, stride_c, ld_a, ld_b, ld_c,
                      accumulate, align_a, align_b, align_c, autotune);
  }
};

struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan();
};

constexpr int kAutotuneCandidates = 8;

struct GemmPlanCache {
  std::map<decltype(GemmProblem{}.key()), std::unique_ptr<GemmPlan>> plans;
};

// The cuBLAS data type of an f32 / bf16 / f16 tensor (throws for any other dtype).
cudaDataType_t cuda_type(DType t);

// Runs one GEMM on `stream`. Pointers are device pointers in row-major layout.
void gemm(CudaStream& stream, const GemmProblem& p, float alpha, const void* a, const void* b, float beta, void* c);

}  // namespace lathe::cuda
