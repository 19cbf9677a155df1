// Row-major C (M x N) = op(A) op(B) is computed as the column-major product C^T = op(B)^T op(A)^T, so the
// cuBLASLt "A" operand is our B and vice versa, and no data is ever transposed.
#include "backend/cuda/gemm.h"

#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/skinny_linear.h"
#include "backend/cuda/thin_matmul.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/registry.h"
#include "core/error.h"
#include "ops/ops.h"

namespace lathe::cuda {

GemmPlan::~GemmPlan() {
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (op) cublasLtMatmulDescDestroy(op);
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: LATHE_FAIL("cuda: cuBLAS GEMMs do not support dtype {}", dtype_name(t));
  }
}

namespace {

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                                   int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  LATHE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, uint64_t(rows), uint64_t(cols), ld));
  if (batch > 1) {
    int32_t count = int32_t(batch);
    LATHE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                        sizeof(count)));
    LATHE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                        &stride, sizeof(stride)));
  }
  return layout;
}

// The operands of the call a plan is made for (autotuning times the candidates on them).
struct GemmOperands {
  float alpha, beta;
  const void *a, *b;
  void* c;
};

// The fastest of `results` on the call's own operands, each run writing into a scratch copy of C (so the call's
// output is untouched and beta != 0 reads realistic values): one untimed run, then the best of three timed runs.
// A candidate that fails to run is skipped; when scratch memory cannot be had, the heuristic's first choice stands.
cublasLtMatmulAlgo_t fastest_algo(CudaStream& stream, const GemmProblem& p, const GemmPlan& plan,
                                  const std::vector<cublasLtMatmulHeuristicResult_t>& results, const GemmOperands& o) {
  const int64_t c_elems = (p.batch > 1 ? p.stride_c * (p.batch - 1) : 0) + (p.m - 1) * p.ld_c + p.n;
  const size_t c_bytes = size_t(c_elems) * dtype_size(p.dtype);
  void* scratch = nullptr;
  if (cudaMalloc(&scratch, c_bytes) != cudaSuccess) {
    cudaGetLastError();
    return results[0].algo;
  }
  LATHE_CUDA_CHECK(cudaMemcpyAsync(scratch, o.c, c_bytes, cudaMemcpyDeviceToDevice, stream.handle()));
  cudaEvent_t start = nullptr, stop = nullptr;
  LATHE_CUDA_CHECK(cudaEventCreate(&start));
  LATHE_CUDA_CHECK(cudaEventCreate(&stop));
  float best_ms = -1;
  cublasLtMatmulAlgo_t best = results[0].algo;
  for (const cublasLtMatmulHeuristicResult_t& r : results) {
    auto run = [&] {
      return cublasLtMatmul(stream.cublaslt(), plan.op, &o.alpha, o.b, plan.a, o.a, plan.b, &o.beta, scratch, plan.c,
                            scratch, plan.c, &r.algo, stream.gemm_workspace(), stream.gemm_workspace_bytes(),
                            stream.handle());
    };
    if (run() != CUBLAS_STATUS_SUCCESS) continue;
    float ms = -1;
    for (int i = 0; i < 3; ++i) {
      LATHE_CUDA_CHECK(cudaEventRecord(start, stream.handle()));
      const cublasStatus_t st = run();
      LATHE_CUDA_CHECK(cudaEventRecord(stop, stream.handle()));
      LATHE_CUDA_CHECK(cudaEventSynchronize(stop));
      float t = 0;
      LATHE_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      if (st == CUBLAS_STATUS_SUCCESS && (ms < 0 || t < ms)) ms = t;
    }
    if (ms >= 0 && (best_ms < 0 || ms < best_ms)) {
      best_ms = ms;
      best = r.algo;
    }
  }
  LATHE_CUDA_CHECK(cudaEventDestroy(start));
  LATHE_CUDA_CHECK(cudaEventDestroy(stop));
  LATHE_CUDA_CHECK(cudaStreamSynchronize(stream.handle()));
  LATHE_CUDA_CHECK(cudaFree(scratch));
  return best;
}

std::unique_ptr<GemmPlan> make_plan(CudaStream& stream, const GemmProblem& p, const GemmOperands& operands) {
  auto plan = std::make_unique<GemmPlan>();
  const cudaDataType_t type = cuda_type(p.dtype);
  LATHE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major view: first operand is our B (N x K after op), second is our A (K x M after op).
  const cublasOperation_t op_first = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  LATHE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  LATHE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  // Stored column-major shapes: B is (N x K) or, transposed, (K x N); A is (K x M) or (M x K); C is (N x M); the
  // leading dimensions are the row strides of the row-major tensors.
  plan->a = p.trans_b ? make_layout(type, p.k, p.n, p.ld_b, p.batch, p.stride_b)
                      : make_layout(type, p.n, p.k, p.ld_b, p.batch, p.stride_b);
  plan->b = p.trans_a ? make_layout(type, p.m, p.k, p.ld_a, p.batch, p.stride_a)
                      : make_layout(type, p.k, p.m, p.ld_a, p.batch, p.stride_a);
  plan->c = make_layout(type, p.n, p.m, p.ld_c, p.batch, p.stride_c);

  cublasLtMatmulPreference_t pref = nullptr;
  LATHE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = stream.gemm_workspace_bytes();
  const uint32_t align_first = uint32_t(p.align_b), align_second = uint32_t(p.align_a), align_c = uint32_t(p.align_c);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_first, 4);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_second, 4);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, 4);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, 4);
  std::vector<cublasLtMatmulHeuristicResult_t> results(p.autotune ? kAutotuneCandidates : 1);
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(stream.cublaslt(), plan->op, plan->a, plan->b, plan->c,
                                                           plan->c, pref, int(results.size()), results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  LATHE_CUBLAS_CHECK(st);
  LATHE_CHECK(found > 0, "cublas: no cuBLASLt algorithm for {} gemm m={} n={} k={} batch={}", dtype_name(p.dtype),
              p.m, p.n, p.k, p.batch);
  results.resize(size_t(found));
  plan->algo = found > 1 ? fastest_algo(stream, p, *plan, results, operands) : results[0].algo;
  return plan;
}

int pointer_alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 2 && v % uintptr_t(align) != 0) align /= 2;
  return align;
}

void run_matmul(const OpCall& call, ExecContext& ctx) {
  const Tensor& a = call.inputs[0];
  const Tensor& b = call.inputs[1];
  const Tensor& c = call.outputs[0];
  const auto& at = call.attr<MatmulAttrs>();
  GemmProblem p{};
  p.dtype = a.dtype();
  p.trans_a = at.trans_a;
  p.trans_b = at.trans_b;
  p.k = at.trans_b ? b.size(-1) : b.size(-2);
  p.n = at.trans_b ? b.size(-2) : b.size(-1);
  if (b.dim() == 2) {
    p.batch = 1;
    p.m = a.numel() / p.k;
  } else {
    p.m = at.trans_a ? a.size(-1) : a.size(-2);
    p.batch = a.numel() / (p.m * p.k);
  }
  p.stride_a = p.m * p.k;
  p.stride_b = p.k * p.n;
  p.stride_c = p.m * p.n;
  const bool flat = a.dim() == 2 && b.dim() == 2;  // else contiguous (matmul_layout)
  p.ld_a = flat ? leading_dim(a) : (at.trans_a ? p.m : p.k);
  p.ld_b = flat ? leading_dim(b) : (at.trans_b ? p.k : p.n);
  p.ld_c = flat ? leading_dim(c) : p.n;
  p.accumulate = at.beta != 0.0f;
  p.align_a = pointer_alignment(a.data_ptr());
  p.align_b = pointer_alignment(b.data_ptr());
  p.align_c = pointer_alignment(c.data_ptr());
  p.autotune = ctx.gemm_autotune;
  if (c.numel() == 0) return;
  gemm(as_cuda(ctx.stream), p, at.alpha, a.data_ptr(), b.data_ptr(), at.beta, c.data_ptr());
}

// Batched, untransposed products with K <= kMaxThinK or n = 1 (thin_matmul.h): memory-bound shapes cuBLAS runs far
// below the memory bound. Batched only (a 3-D B), so that 2-D products such as LoRA's rank-r ones stay on cuBLAS.
ThinMatmul thin_problem(const OpCall& call) {
  const Tensor& a = call.inputs[0];
  const Tensor& b = call.inputs[1];
  const auto& at = call.attr<MatmulAttrs>();
  ThinMatmul p{};
  p.k = b.size(-2);
  p.n = b.size(-1);
  p.m = a.size(-2);
  p.batch = p.m * p.k > 0 ? a.numel() / (p.m * p.k) : 0;
  p.stride_a = p.m * p.k;
  p.stride_b = p.k * p.n;
  p.stride_c = p.m * p.n;
  p.alpha = at.alpha;
  p.beta = at.beta;
  return p;
}

Support thin_supports(const OpCall& call) {
  const auto& at = call.attr<MatmulAttrs>();
  if (at.trans_a || at.trans_b) return Support::no("transposed operands (cuBLASLt takes them)");
  if (call.inputs[1].dim() < 3) return Support::no("an unbatched B (cuBLASLt takes it)");
  if (!thin_matmul_shape(thin_problem(call))) return Support::no("K above 16 with n above 1 (cuBLASLt takes it)");
  return matmul_layout(call);  // batched: contiguous operands
}

void run_thin(const OpCall& call, ExecContext& ctx) {
  launch_thin_matmul(call.inputs[0].dtype(), thin_problem(call), call.inputs[0].data_ptr(), call.inputs[1].data_ptr(),
                     call.outputs[0].data_ptr(), as_cuda(ctx.stream).handle());
}

// A few rows of x against a 2-D weight, x W^T (skinny_linear.h): the decoding step's projections at small batch sizes.
Support skinny_supports(const OpCall& call) {
  const Tensor& a = call.inputs[0];
  const Tensor& b = call.inputs[1];
  const auto& at = call.attr<MatmulAttrs>();
  if (at.trans_a || !at.trans_b || b.dim() != 2) return Support::no("not x W^T with a 2-D W (cuBLASLt takes it)");
  if (at.beta != 0.0f) return Support::no("accumulates into the output (cuBLASLt takes it)");
  const int64_t k = b.size(1), m = k > 0 ? a.numel() / k : 0;
  if (m < 1 || m > kMaxSkinnyRows) return Support::no(fmt::format("{} rows (1 to {} take it)", m, kMaxSkinnyRows));
  if (!a.is_contiguous() || !b.is_contiguous() || !call.outputs[0].is_contiguous())
    return Support::no("strided operands (cuBLASLt takes them)");
  const int64_t bytes = int64_t(dtype_size(a.dtype()));
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if ((k * bytes) % 16 != 0 || !aligned(a.data_ptr()) || !aligned(b.data_ptr()))
    return Support::no("rows that are not whole 16-byte packs, or unaligned operands");
  if (m * k * bytes > kMaxSkinnyXBytes) return Support::no("x larger than the 48 KiB a block stages");
  return Support::yes();
}

void run_skinny(const OpCall& call, ExecContext& ctx) {
  const Tensor& b = call.inputs[1];
  const int64_t k = b.size(1);
  launch_skinny_linear(b.dtype(), call.inputs[0].numel() / k, b.size(0), k, call.attr<MatmulAttrs>().alpha,
                       call.inputs[0].data_ptr(), b.data_ptr(), call.outputs[0].data_ptr(), as_cuda(ctx.stream).handle());
}

}  // namespace

void gemm(CudaStream& stream, const GemmProblem& p, float alpha, const void* a, const void* b, float beta, void* c) {
  auto& cache = stream.gemm_cache().plans;
  auto it = cache.find(p.key());
  if (it == cache.end()) it = cache.emplace(p.key(), make_plan(stream, p, {alpha, beta, a, b, c})).first;
  const GemmPlan& plan = *it->second;
  LATHE_CUBLAS_CHECK(cublasLtMatmul(stream.cublaslt(), plan.op, &alpha, b, plan.a, a, plan.b, &beta, c, plan.c, c,
                                    plan.c, &plan.algo, stream.gemm_workspace(), stream.gemm_workspace_bytes(),
                                    stream.handle()));
}

void register_cuda_gemm_kernels(KernelRegistry& r) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    r.add(KernelDef{OpId::matmul, DeviceType::CUDA, dt, "cuda/skinny_linear", skinny_supports, run_skinny});
    r.add(KernelDef{OpId::matmul, DeviceType::CUDA, dt, "cuda/thin_batched_matmul", thin_supports, run_thin});
    r.add(KernelDef{OpId::matmul, DeviceType::CUDA, dt, "cuda/cublaslt_gemm", matmul_layout, run_matmul});
  }
}

}  // namespace lathe::cuda
