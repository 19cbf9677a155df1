// CUDA grouped GEMM (formulas at GroupedMatmulAttrs in ops/op_table.h) for bf16, f16 and f32 inputs with fp32
// compute (CUBLAS_COMPUTE_32F on a handle in default math mode: no TF32, so f32 matches the CPU reference).
// Row-major to column-major: a row-major (r, c) matrix with row stride ld is the column-major (c x r) matrix of the
// same ld, its transpose, so each group's product is computed transposed and nothing is ever copied:
//   forward, trans_w:   y_e^T (N x rows, ld N) = [w_e^T stored K x N, ld K]^T  x_e^T (K x rows, ld K)
//   forward, !trans_w:  y_e^T (N x rows, ld N) = [w_e^T stored N x K, ld N]    x_e^T (K x rows, ld K)
//   weight grad:        dw_e^T (K x N, ld K)   = x_e^T (K x rows, ld K) [dy_e^T stored N x rows, ld N]^T
// Expert e's block of w (or dw) starts at the tensor's data plus e times its dim-0 stride: a narrowed fused
// gate_up_proj is read or written in place. Empty groups are left out of the GEMMs (cuBLAS wants m, n, k >= 1); in the
// weight grad their blocks are zeroed with memsets first.
// Kernels, tried in order:
// - cuda/hopper_grouped_gemm (bf16 on sm_90 only): our own TMA + wgmma kernel (hopper_grouped_gemm.cu) for the shapes
//   its 128 x 256 tiles cover: the forward where K is a multiple of 64 and N of 256, the weight grad where N is a
//   multiple of 128 and K of 256 (Qwen3-30B-A3B's experts: H = 2048, I = 768, 2 I = 1536), 16-byte aligned operands.
//   The host builds its tile table (one row a 128-row slice of an expert, or a non-empty expert in the weight grad)
//   and the TMA tensor maps of the operands and the output each call. No Debian package has a grouped GEMM for Hopper
//   (CUTLASS is not packaged), so it is written here (docs/moe.md, "Expert GEMMs"). It also runs the routed ops of a
//   training step (groups on the device, not few_rows), its tile table then built on the device; the weight grad's
//   empty experts get tiles that store zero blocks instead of the memsets.
// - The routed forward of a decoding step (few_rows) runs on routed_gemm.cu's kernels. Where no kernel takes a routed
//   call (a training step's off sm_90, or shapes the Hopper tiles do not cover) the MoE layer reads the groups to the
//   host and calls the ops below.
// - cuda/cublas_grouped_gemm: one cublasGemmGroupedBatchedEx call (cuBLAS >= 12.5), the GEMMs bucketed into cuBLAS
//   groups of equal sizes. Its matrix pointers are read on the device (an array uploaded through the stream's pinned
//   staging into scratch from the context's allocator), so cuBLAS cannot check their alignment: 16-bit types need
//   16-byte aligned pointers and rows for it, and the kernel asks that of every dtype: base pointers aligned to 16
//   bytes, K, N and the block stride multiples of 16 bytes.
// - cuda/cublas_gemm_per_group: one cublasGemmEx per non-empty group, for everything else.
// All are deterministic (no atomics; fixed GEMM order). Covered by tests/ops (testing/op_cases_moe.cpp: both kernels
// in every dtype) and tests/ops/test_grouped_matmul.cpp (strided views); timed by bench/grouped_gemm_bench.
#include <cudaTypedefs.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/hopper_grouped_gemm.h"
#include "backend/cuda/routed_gemm.h"
#include "backend/registry.h"
#include "core/error.h"
#include "ops/ops.h"

#if CUBLAS_VER_MAJOR > 12 || (CUBLAS_VER_MAJOR == 12 && CUBLAS_VER_MINOR >= 5)
#define LATHE_CUBLAS_GROUPED_GEMM 1
#endif

namespace lathe::cuda {

namespace {

// One GEMM of a non-empty group in cuBLAS's column-major terms: C (m x n) = op(A) (m x k) op(B) (k x n).
struct Gemm {
  int m, n, k;
  const void* a;
  const void* b;
  void* c;
};

// Every GEMM of one call: the operations and leading dimensions are shared, only the group's row count differs.
struct GroupedPlan {
  cudaDataType_t type;
  cublasOperation_t trans_a, trans_b;
  int lda, ldb, ldc;
  std::vector<Gemm> gemms;  // the non-empty groups, in expert order
};

// The address `elements` elements past t's first one.
char* element_at(const Tensor& t, int64_t elements) {
  return static_cast<char*>(t.data_ptr()) + elements * int64_t(t.itemsize());
}

GroupedPlan plan_of(const OpCall& c) {
  const auto& attrs = c.attr<GroupedMatmulAttrs>();
  const std::vector<int64_t>& off = attrs.offsets;
  const int64_t experts = int64_t(off.size()) - 1;
  GroupedPlan p;
  p.type = cuda_type(c.key_dtype());
  if (c.op == OpId::grouped_matmul) {
    const Tensor& x = c.inputs[0];   // (P, K)
    const Tensor& w = c.inputs[1];   // (E, N, K) or (E, K, N), contiguous blocks
    const Tensor& y = c.outputs[0];  // (P, N)
    const int64_t k = x.size(1), n = y.size(1);
    p.trans_a = attrs.trans_w ? CUBLAS_OP_T : CUBLAS_OP_N;
    p.trans_b = CUBLAS_OP_N;
    p.lda = int(attrs.trans_w ? k : n);
    p.ldb = int(k);
    p.ldc = int(n);
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t row0 = off[size_t(e)], rows = off[size_t(e) + 1] - row0;
      if (rows == 0) continue;
      p.gemms.push_back({int(n), int(rows), int(k), element_at(w, e * w.strides()[0]), element_at(x, row0 * k),
                         element_at(y, row0 * n)});
    }
    return p;
  }
  const Tensor& dy = c.inputs[0];   // (P, N)
  const Tensor& x = c.inputs[1];    // (P, K)
  const Tensor& dw = c.outputs[0];  // (E, N, K), contiguous blocks
  const int64_t n = dy.size(1), k = x.size(1);
  p.trans_a = CUBLAS_OP_N;
  p.trans_b = CUBLAS_OP_T;
  p.lda = int(k);
  p.ldb = int(n);
  p.ldc = int(k);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t row0 = off[size_t(e)], rows = off[size_t(e) + 1] - row0;
    if (rows > 0)
      p.gemms.push_back({int(k), int(n), int(rows), element_at(x, row0 * k), element_at(dy, row0 * n),
                         element_at(dw, e * dw.strides()[0])});
  }
  return p;
}

// The weight grad written fresh (not accumulating): zeroes the blocks of the empty groups, which no GEMM writes;
// adjacent blocks take one memset. Nothing for the forward.
void zero_empty_blocks(const OpCall& c, CudaStream& s) {
  const auto& attrs = c.attr<GroupedMatmulAttrs>();
  if (c.op != OpId::grouped_matmul_weight_grad || attrs.accumulate) return;
  const Tensor& dw = c.outputs[0];  // (E, N, K), contiguous blocks
  const size_t block_bytes = size_t(dw.size(1) * dw.size(2)) * dw.itemsize();
  std::vector<std::pair<char*, size_t>> ranges;
  for (size_t e = 0; e + 1 < attrs.offsets.size(); ++e) {
    if (attrs.offsets[e + 1] > attrs.offsets[e]) continue;
    char* block = element_at(dw, int64_t(e) * dw.strides()[0]);
    if (!ranges.empty() && ranges.back().first + ranges.back().second == block)
      ranges.back().second += block_bytes;
    else
      ranges.push_back({block, block_bytes});
  }
  for (const auto& [ptr, bytes] : ranges) LATHE_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, s.handle()));
}

// The two row-major (P, *) operands besides the weight-shaped one: x and y (forward), dy and x (weight grad).
const Tensor& first_rows(const OpCall& c) { return c.inputs[0]; }
const Tensor& second_rows(const OpCall& c) { return c.op == OpId::grouped_matmul ? c.outputs[0] : c.inputs[1]; }

// The layout rule (ops/grouped_matmul.cpp) and int-sized dimensions (cuBLAS's m, n, k and leading dimensions).
Support per_group_supports(const OpCall& c) {
  if (Support s = grouped_matmul_layout(c); !s.ok) return s;
  for (int64_t size : {first_rows(c).size(0), first_rows(c).size(1), second_rows(c).size(1)})
    if (size > INT_MAX) return Support::no("a dimension above INT_MAX (cuBLAS's int sizes)");
  return Support::yes();
}

// cuda/hopper_grouped_gemm: hopper_grouped_gemm.h. The forward's rows of tiles: each expert's rows in 128-row slices,
// in expert order; the weight grad's: each non-empty expert, the most rows first (the persistent CTAs take tiles in
// turn, so the long reductions spread over them before the short ones fill in).
std::vector<HopperTile> hopper_tiles(const std::vector<int64_t>& off, bool weight_grad) {
  std::vector<HopperTile> tiles;
  for (size_t e = 0; e + 1 < off.size(); ++e) {
    if (off[e + 1] == off[e]) continue;
    if (weight_grad) {
      tiles.push_back({int32_t(e), int32_t(off[e]), int32_t(off[e + 1]), 0});
      continue;
    }
    for (int64_t row = off[e]; row < off[e + 1]; row += kHopperTileM)
      tiles.push_back({int32_t(e), int32_t(row), int32_t(off[e + 1]), 0});
  }
  if (weight_grad)
    std::stable_sort(tiles.begin(), tiles.end(), [](const HopperTile& a, const HopperTile& b) {
      return a.row_end - a.row0 > b.row_end - b.row0;
    });
  return tiles;
}

// Registered only where device 0 is sm_90 (the kernel is compiled for sm_90a alone): the op check's coverage pass
// wants every registered kernel reachable.
bool device_is_sm90() {
  int devices = 0;
  cudaDeviceProp prop{};
  const bool yes = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 &&
                   cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0;
  cudaGetLastError();  // a failed query (no device) leaves nothing behind
  return yes;
}

bool is_weight_grad(OpId op) {
  return op == OpId::grouped_matmul_weight_grad || op == OpId::grouped_matmul_weight_grad_routed;
}
bool is_routed(OpId op) { return op == OpId::grouped_matmul_routed || op == OpId::grouped_matmul_weight_grad_routed; }

Support hopper_supports(const OpCall& c) {
  if (Support s = grouped_matmul_layout(c); !s.ok) return s;
  const bool grad = is_weight_grad(c.op), routed = is_routed(c.op);
  const int64_t p = c.inputs[0].size(0);
  const int64_t k = grad ? c.inputs[1].size(1) : c.inputs[0].size(1);  // x's row length
  const int64_t n = grad ? c.inputs[0].size(1) : c.outputs[0].size(1);  // dy's / y's row length
  if (grad ? n % kHopperTileM != 0 || k % kHopperTileN != 0 : k % kHopperTileK != 0 || n % kHopperTileN != 0)
    return Support::no(grad ? "the weight grad's tiles need N a multiple of 128 and K of 256"
                            : "the forward's tiles need K a multiple of 64 and N of 256");
  if (p >= INT_MAX) return Support::no("P above INT_MAX (the tile table's int rows)");
  // TMA boxes of up to 128 rows: only tensors at least that long were checked on the card.
  if (p < kHopperTileM) return Support::no("fewer than 128 rows (the TMA boxes' length)");
  const Tensor& blocks = grad ? c.outputs[0] : c.inputs[1];  // w or dw
  bool aligned = blocks.size(0) <= 1 || blocks.strides()[0] % 8 == 0;  // 16-byte block starts in bf16
  for (const Tensor* t : {&c.inputs[0], &c.inputs[1], &c.outputs[0]})
    aligned &= reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0;
  if (!aligned) return Support::no("TMA needs 16-byte aligned operands and expert blocks");
  const int64_t experts = blocks.size(0);
  int64_t tiles = 0;  // the persistent schedule's tile indices are ints
  if (routed) {  // the most the groups on the device can make
    if (experts > kHopperScheduleMaxExperts)
      return Support::no(fmt::format("more than {} experts (the device schedule's)", kHopperScheduleMaxExperts));
    if (c.attr<GroupedMatmulAttrs>().few_rows) return Support::no("a decoding step's few rows (cuda/routed_skinny's)");
    tiles = grad ? experts * (n / kHopperTileM) * (k / kHopperTileN)
                 : ((p + kHopperTileM - 1) / kHopperTileM + experts) * (n / kHopperTileN);
  } else {
    const std::vector<int64_t>& off = c.attr<GroupedMatmulAttrs>().offsets;
    for (size_t e = 0; e + 1 < off.size(); ++e)
      tiles += grad ? int64_t(off[e + 1] > off[e]) * (n / kHopperTileM) * (k / kHopperTileN)
                    : (off[e + 1] - off[e] + kHopperTileM - 1) / kHopperTileM * (n / kHopperTileN);
  }
  if (tiles > INT_MAX) return Support::no("more than INT_MAX output tiles");
  return Support::yes();
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  // The driver's entry point, looked up once: an immutable function pointer, not state.
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    LATHE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    LATHE_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "cuda/hopper_grouped_gemm: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A bf16 TMA map with 128-byte swizzle: dims innermost first, the byte strides of dims 1.., the box in elements.
CUtensorMap bf16_tensor_map(const void* base, std::vector<cuuint64_t> dims, std::vector<cuuint64_t> strides,
                            std::vector<cuuint32_t> box) {
  CUtensorMap map{};
  const std::vector<cuuint32_t> unit(dims.size(), 1);
  const CUresult r = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, cuuint32_t(dims.size()), const_cast<void*>(base), dims.data(),
      strides.data(), box.data(), unit.data(), CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  LATHE_CHECK(r == CUDA_SUCCESS, "cuda/hopper_grouped_gemm: cuTensorMapEncodeTiled failed (CUresult {}) for dims {}, "
              "byte strides {}, box {}", int(r), fmt::join(dims, "x"), fmt::join(strides, ","), fmt::join(box, "x"));
  return map;
}

// The tile table: built here from host groups (and the empty blocks of a fresh weight grad zeroed), or on the device
// from the routed ops' offsets (with zero tiles for those blocks), its length then read there by the kernel.
void schedule_hopper(const OpCall& c, ExecContext& ctx, HopperGemmLaunch& l, Tensor& table) {
  CudaStream& s = as_cuda(ctx.stream);
  const bool grad = is_weight_grad(c.op);
  const auto& attrs = c.attr<GroupedMatmulAttrs>();
  if (!is_routed(c.op)) {
    zero_empty_blocks(c, s);
    const std::vector<HopperTile> tiles = hopper_tiles(attrs.offsets, grad);
    if (tiles.empty()) return;
    table = Tensor::empty({int64_t(tiles.size() * sizeof(HopperTile) / 8)}, DType::I64, ctx.allocator);
    s.upload_async(table.data_ptr(), tiles.data(), tiles.size() * sizeof(HopperTile));
    l.tiles = static_cast<const HopperTile*>(table.data_ptr());
    l.tile_rows = int(tiles.size());
    return;
  }
  const Tensor& offsets = c.inputs[2];
  const int64_t experts = offsets.size(0) - 2, p = c.inputs[0].size(0);
  const int64_t room = grad ? experts : (p + kHopperTileM - 1) / kHopperTileM + experts;
  if (room == 0) return;
  // The table's entries, then its length (one more 16-byte entry's room).
  table = Tensor::empty({(room + 1) * int64_t(sizeof(HopperTile) / 8)}, DType::I64, ctx.allocator);
  auto* tiles = static_cast<HopperTile*>(table.data_ptr());
  int* count = reinterpret_cast<int*>(tiles + room);
  launch_hopper_schedule(offsets.data<int32_t>(), int(experts), int(p), grad, grad && !attrs.accumulate, tiles, count,
                         s.handle());
  l.tiles = tiles;
  l.tile_rows = int(room);
  l.tile_count = count;
}

void run_hopper(const OpCall& c, ExecContext& ctx) {
  CudaStream& s = as_cuda(ctx.stream);
  const auto& attrs = c.attr<GroupedMatmulAttrs>();
  const bool grad = is_weight_grad(c.op);
  HopperGemmLaunch l{};
  Tensor table;  // scratch for the kernel's tile table, reused in the stream's order once released
  schedule_hopper(c, ctx, l, table);
  if (l.tile_rows == 0) return;
  const auto u = [](int64_t v) { return cuuint64_t(v); };
  CUtensorMap a, b, out;
  if (grad) {
    const Tensor& dy = c.inputs[0];   // (P, N)
    const Tensor& x = c.inputs[1];    // (P, K)
    const Tensor& dw = c.outputs[0];  // (E, N, K)
    const int64_t p = dy.size(0), n = dy.size(1), k = x.size(1);
    a = bf16_tensor_map(dy.data_ptr(), {u(n), u(p)}, {u(n * 2)}, {64, 64});
    b = bf16_tensor_map(x.data_ptr(), {u(k), u(p)}, {u(k * 2)}, {64, 64});
    const int64_t e = dw.size(0), stride = e > 1 ? dw.strides()[0] : n * k;
    out = bf16_tensor_map(dw.data_ptr(), {u(k), u(n), u(e)}, {u(k * 2), u(stride * 2)}, {64, 64, 1});
    l.kind = HopperGemm::weight_grad;
    l.n_tiles = int(k / kHopperTileN);
    l.m_tiles = int(n / kHopperTileM);
    l.accumulate = attrs.accumulate;
  } else {
    const Tensor& x = c.inputs[0];   // (P, K)
    const Tensor& w = c.inputs[1];   // (E, N, K) or (E, K, N)
    const Tensor& y = c.outputs[0];  // (P, N)
    const int64_t p = x.size(0), k = x.size(1), n = y.size(1), e = w.size(0);
    const int64_t stride = e > 1 ? w.strides()[0] : n * k;
    a = bf16_tensor_map(x.data_ptr(), {u(k), u(p)}, {u(k * 2)}, {64, 128});
    b = attrs.trans_w ? bf16_tensor_map(w.data_ptr(), {u(k), u(n), u(e)}, {u(k * 2), u(stride * 2)}, {64, 256, 1})
                      : bf16_tensor_map(w.data_ptr(), {u(n), u(k), u(e)}, {u(n * 2), u(stride * 2)}, {64, 64, 1});
    out = bf16_tensor_map(y.data_ptr(), {u(n), u(p)}, {u(n * 2)}, {64, 64});
    l.kind = attrs.trans_w ? HopperGemm::forward_trans_w : HopperGemm::forward;
    l.n_tiles = int(n / kHopperTileN);
    l.k_tiles = int(k / kHopperTileK);
    l.out = y.data_ptr();
    l.ld = n;
  }
  launch_hopper_grouped_gemm(l, a, b, out, s.handle());
}

#ifdef LATHE_CUBLAS_GROUPED_GEMM
bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The pointer array is read on the device, where cuBLAS cannot see misaligned rows: ask 16-byte alignment of every
// base pointer, row length and block stride, so every matrix of every group starts on a 16-byte boundary.
Support grouped_supports(const OpCall& c) {
  if (Support s = per_group_supports(c); !s.ok) return s;
  const Tensor& blocks = c.op == OpId::grouped_matmul ? c.inputs[1] : c.outputs[0];  // w or dw
  const int64_t item = int64_t(c.inputs[0].itemsize());
  // K and N: the row lengths of the (P, *) operands, and so of the blocks too.
  const bool rows = (first_rows(c).size(1) * item) % 16 == 0 && (second_rows(c).size(1) * item) % 16 == 0;
  const bool stride = blocks.size(0) <= 1 || (blocks.strides()[0] * item) % 16 == 0;
  bool pointers = true;
  for (const Tensor* t : {&c.inputs[0], &c.inputs[1], &c.outputs[0]}) pointers &= aligned16(t->data_ptr());
  if (!rows || !stride || !pointers)
    return Support::no("needs 16-byte aligned pointers, rows and expert blocks (K and N multiples of 8 in bf16/f16, "
                       "4 in f32): the device-side pointer array hides misalignment from cuBLAS");
  return Support::yes();
}

void run_grouped(const OpCall& c, ExecContext& ctx) {
  CudaStream& s = as_cuda(ctx.stream);
  const GroupedPlan p = plan_of(c);
  zero_empty_blocks(c, s);
  if (p.gemms.empty()) return;
  // cuBLAS groups are uniform (one m, n, k each): bucket the GEMMs by size, in a fixed order.
  std::map<std::tuple<int, int, int>, std::vector<size_t>> buckets;
  for (size_t i = 0; i < p.gemms.size(); ++i) buckets[{p.gemms[i].m, p.gemms[i].n, p.gemms[i].k}].push_back(i);
  const size_t count = p.gemms.size();
  const int groups = int(buckets.size());
  std::vector<cublasOperation_t> trans_a(size_t(groups), p.trans_a), trans_b(size_t(groups), p.trans_b);
  std::vector<int> m, n, k, group_size, lda(size_t(groups), p.lda), ldb(size_t(groups), p.ldb),
      ldc(size_t(groups), p.ldc);
  const float added = c.op == OpId::grouped_matmul_weight_grad && c.attr<GroupedMatmulAttrs>().accumulate ? 1.0f : 0.0f;
  std::vector<float> alpha(size_t(groups), 1.0f), beta(size_t(groups), added);
  std::vector<const void*> table(3 * count);  // [A pointers | B pointers | C pointers], one per GEMM in group order
  size_t idx = 0;
  for (const auto& [dims, members] : buckets) {
    m.push_back(std::get<0>(dims));
    n.push_back(std::get<1>(dims));
    k.push_back(std::get<2>(dims));
    group_size.push_back(int(members.size()));
    for (size_t i : members) {
      table[idx] = p.gemms[i].a;
      table[count + idx] = p.gemms[i].b;
      table[2 * count + idx] = p.gemms[i].c;
      ++idx;
    }
  }
  // Scratch for the pointer array: released on return, reused in the stream's order (model_ops_register.cpp).
  const Tensor device_table = Tensor::empty({int64_t(table.size())}, DType::I64, ctx.allocator);
  s.upload_async(device_table.data_ptr(), table.data(), table.size() * sizeof(void*));
  void** d = static_cast<void**>(device_table.data_ptr());
  LATHE_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(s.cublas(), trans_a.data(), trans_b.data(), m.data(), n.data(),
                                                k.data(), alpha.data(), d, p.type, lda.data(), d + count, p.type,
                                                ldb.data(), beta.data(), d + 2 * count, p.type, ldc.data(), groups,
                                                group_size.data(), CUBLAS_COMPUTE_32F));
}
#endif

void run_per_group(const OpCall& c, ExecContext& ctx) {
  CudaStream& s = as_cuda(ctx.stream);
  const GroupedPlan p = plan_of(c);
  zero_empty_blocks(c, s);
  const float alpha = 1.0f;
  const float beta = c.op == OpId::grouped_matmul_weight_grad && c.attr<GroupedMatmulAttrs>().accumulate ? 1.0f : 0.0f;
  for (const Gemm& g : p.gemms)
    LATHE_CUBLAS_CHECK(cublasGemmEx(s.cublas(), p.trans_a, p.trans_b, g.m, g.n, g.k, &alpha, g.a, p.type, p.lda, g.b,
                                    p.type, p.ldb, &beta, g.c, p.type, p.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// grouped_matmul_routed's decoding kernels (routed_gemm.cu; few_rows, trans_w): the skinny kernel where the operands
// are whole aligned packs, else the element kernel.
Support routed_layout(const OpCall& c) {
  const auto& attrs = c.attr<GroupedMatmulAttrs>();
  if (!attrs.few_rows) return Support::no("not few_rows: built for a decoding step's few rows an expert");
  if (!attrs.trans_w) return Support::no("w (E, K, N) (!trans_w): decoding's kernels take (E, N, K)");
  return grouped_matmul_layout(c);
}

Support routed_skinny_supports(const OpCall& c) {
  if (Support s = routed_layout(c); !s.ok) return s;
  const Tensor& w = c.inputs[1];
  if (!routed_skinny_applies(w.dtype(), w.size(2), w.strides()[0], c.inputs[0].data_ptr(), w.data_ptr(),
                             c.outputs[0].data_ptr()))
    return Support::no("K, w's block stride or an operand's address is not a whole 16-byte pack");
  return Support::yes();
}

template <bool kSkinny>
void run_routed(const OpCall& c, ExecContext& ctx) {
  const Tensor& x = c.inputs[0];
  const Tensor& w = c.inputs[1];
  launch_routed_gemm(x.dtype(), kSkinny, x.size(0), w.size(1), w.size(2), w.size(0), w.strides()[0], x.data_ptr(),
                     w.data_ptr(), c.inputs[2].data<int32_t>(), c.outputs[0].data_ptr(), stream_of(ctx));
}

}  // namespace

void register_cuda_grouped_gemm_kernels(KernelRegistry& r) {
  const bool sm90 = device_is_sm90();
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const bool hopper = sm90 && dt == DType::BF16;
    if (hopper) {  // the routed ops' training steps (few_rows false); the weight grad has no other kernel here
      r.add(KernelDef{OpId::grouped_matmul_routed, DeviceType::CUDA, dt, "cuda/hopper_grouped_gemm", hopper_supports,
                      run_hopper});
      r.add(KernelDef{OpId::grouped_matmul_weight_grad_routed, DeviceType::CUDA, dt, "cuda/hopper_grouped_gemm",
                      hopper_supports, run_hopper});
    }
    r.add(KernelDef{OpId::grouped_matmul_routed, DeviceType::CUDA, dt, "cuda/routed_skinny", routed_skinny_supports,
                    run_routed<true>});
    r.add(KernelDef{OpId::grouped_matmul_routed, DeviceType::CUDA, dt, "cuda/routed_rows", routed_layout,
                    run_routed<false>});
    for (OpId op : {OpId::grouped_matmul, OpId::grouped_matmul_weight_grad}) {
      if (hopper) r.add(KernelDef{op, DeviceType::CUDA, dt, "cuda/hopper_grouped_gemm", hopper_supports, run_hopper});
#ifdef LATHE_CUBLAS_GROUPED_GEMM
      r.add(KernelDef{op, DeviceType::CUDA, dt, "cuda/cublas_grouped_gemm", grouped_supports, run_grouped});
#endif
      r.add(KernelDef{op, DeviceType::CUDA, dt, "cuda/cublas_gemm_per_group", per_group_supports, run_per_group});
    }
  }
}

}  // namespace lathe::cuda
