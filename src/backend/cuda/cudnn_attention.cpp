// cuDNN fused attention through the cuDNN backend API (what and why: cudnn_attention.h).
//
// The graphs are cudnn-frontend's CompositeSDPANode / CompositeSDPABackwardNode lowerings for cuDNN < 9.21,
// re-expressed with raw descriptors. A fused engine accepts a graph by matching its pattern, so the op order,
// data types and virtual-tensor strides follow the frontend's:
//   forward:  S = Q.K^T (K^T a stride-swapped view of K) -> *scale -> padding mask (GEN_INDEX rows/cols, < seq_len,
//             AND, BINARY_SELECT -inf) -> causal mask (row >= col, BINARY_SELECT -inf) -> max, S - max, exp, sum,
//             stats = max + log(sum), P = exp / sum (in the I/O type) -> O = P.V.
//   backward: softmax_sum = rowsum(dO * O) (an fp32 buffer we own); P = exp(masked(scale * Q.K^T) - stats);
//             dV = P^T.dO; dS = (dO.V^T - softmax_sum) * P * scale; dK = dS^T.Q; dQ = dS.K. With GQA, dK and dV come
//             per q head and a reduction sums each group. dQ straight from its matmul is cuDNN's deterministic
//             variant (the engine stages dS in its workspace, about B * Hq * S^2 * 2 bytes); the other variant
//             accumulates dQ in fp32 across key tiles (not bitwise repeatable).
// Layout (ragged, THD): Q/O/dO/dQ are (B, Hq, S, D) with strides (-, D, Hq * D, 1), K/V/dK/dV (B, Hkv, S, D)
// likewise, B = documents, S = the longest document rounded up to 128. Document b starts at its ragged offset
// cu[b] * row elements (the batch stride is unused) and has seq_len[b] = cu[b+1] - cu[b] rows (padding mask and the
// matmuls' M/N/K overrides). Stats are (B, Hq, S, 1) with strides (-, 1, Hq, 1) and offsets cu[b] * Hq: the op's lse
// (T, Hq) itself. lse: cuDNN's stats are max_j s_ij + ln sum_j exp(s_ij - max), s = scale * q.k over the unmasked
// keys, i.e. the natural-log log-sum-exp of the scaled scores, which is the op's definition: no conversion either
// way. cuDNN 9.14 on sm_90 takes these ragged graphs for every shape of the op cases, so documents of unequal length
// need no fallback.
// Layout (dense): when every document has one length L, a multiple of 128 (or any L above head dim 128), the batch is a
// plain (B, heads, L, D) one (batch strides L * heads * D, Stats' L * Hq) with no ragged offsets; where L is no
// multiple of 128 it keeps the lengths, padding mask and overrides (cudnn-frontend's own workaround for such a batch
// up to cuDNN 9.15), otherwise it has none.
// D > 128 backward: on cuDNN 9.14 (sm_90) the ragged backward graphs are wrong at D = 256: the deterministic one gets
// dQ right but dK and dV off (op-check nmse about 0.5 against the CPU reference, or unwritten values), the
// non-deterministic one all three (nmse 0.02-0.03 against the tiled kernel), with and without GQA, while the same
// graphs at D <= 128 pass. The dense graphs at D = 256 are right (session 35: the tiled kernel's gradients to nmse
// 1e-6 / 8e-6 / 7e-6 at 8,192 to 131,072 tokens, and the op cases, lengths of 128 and others, against the CPU
// reference), as is torch's cuDNN backend there (dev/attn256_probe.py). So the backward above D = 128 never runs the
// ragged graph: documents of unequal lengths are copied into a padded (B, longest) batch, padding rows repeating a
// document's last row (finite, and hidden by the padding mask), the dense graph with lengths runs on it, and the
// gradients are copied back; it is refused (the tiled kernel runs) where padding would more than double the rows. The
// forward is right at D = 256 either way and stays ragged. The non-deterministic backward is registered for calls that
// allow it (AttentionAttrs::deterministic false), ahead of the deterministic one.
// Covered by tests/ops (op_cases.cpp attention cases on a CUDA device with cuDNN).
#include "backend/cuda/cudnn_attention.h"

#include <cudnn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device_guard.h"
#include "core/error.h"

namespace lathe::cuda {

// cudnn_attention_meta.cu
void launch_cudnn_ragged_meta(const int32_t* cu, int64_t batch, int32_t q_row, int32_t kv_row, int32_t stats_row,
                              int32_t* seq_len, int32_t* q_offsets, int32_t* kv_offsets, int32_t* stats_offsets,
                              cudaStream_t stream);
// Rows of each document between the packed (T, ...) layout and a padded (batch, s, ...) one, row_bytes a multiple of
// 4: to_padded fills every padded row (a document's rows past its end repeat its last row); otherwise only the
// documents' rows are copied back.
void launch_cudnn_padded_rows(const void* src, void* dst, const int32_t* cu, int64_t batch, int64_t s,
                              int64_t row_bytes, bool to_padded, cudaStream_t stream);

namespace {

// Runtime versions these graphs are for: ragged offsets with GQA in the backward need 9.6 (cudnn-frontend's support
// surface); from 9.21 the frontend lowers softmax and masks to unified operations instead, unverified here.
constexpr size_t kMinVersion = 90600;
constexpr size_t kEndVersion = 92100;
constexpr int64_t kRowTile = 128;                   // S is the longest document rounded up to this
constexpr int64_t kRaggedBatchStride = 2147483647;  // ignored with ragged offsets (cudnn-frontend users pass INT_MAX)
constexpr size_t kMaxPlans = 128;                   // least recently used plans beyond this are dropped
constexpr size_t kMaxHostCu = 16;                   // cu_seqlens host copies kept

// clang-format off
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kScale, kOne, kSeqQ, kSeqKV, kRagQ, kRagKV, kRagStats,
  kSoftmaxSum, kDQAccum,
  kNegInf0 = 40,  // one by-value -inf tensor per mask (the frontend makes each its own tensor)
  kVirtual0 = 100,
};
// clang-format on

struct PlanKey {
  bool backward = false;
  bool deterministic = true;
  DType dtype = DType::BF16;
  int64_t b = 0, s = 0, hq = 0, hkv = 0, d = 0;
  // Documents as a plain (B, heads, s, D) batch: no ragged offsets; lengths and the padding mask only where s is no
  // multiple of kRowTile (as cudnn-frontend does for such a batch before cuDNN 9.16) or the batch is `padded` (the
  // documents of unequal lengths copied into a batch of the longest, for the backward above head dim 128).
  bool dense = false, padded = false;
  bool lengths() const { return !dense || padded || s % kRowTile != 0; }
  // The elements between batch entries of a (B, heads, s, D) tensor: a dense batch's, or unused (ragged offsets).
  int64_t batch_stride(int64_t heads) const { return dense ? s * heads * d : kRaggedBatchStride; }
  auto operator<=>(const PlanKey&) const = default;
};

std::string describe(const PlanKey& k) {
  return fmt::format("{} {}{} B={} S={} Hq={} Hkv={} D={} {}", k.backward ? "backward" : "forward",
                     k.backward ? (k.deterministic ? "deterministic " : "nondeterministic ") : "", dtype_name(k.dtype),
                     k.b, k.s, k.hq, k.hkv, k.d, k.padded ? "padded" : k.dense ? "dense" : "ragged");
}

std::string version_string(size_t v) { return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100); }

std::string status_text(cudnnStatus_t st) {
  char last[1024] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  return fmt::format("{} ({}){}{}", cudnnGetErrorString(st), int(st), last[0] ? ": " : "", last);
}

// --- plan log ---------------------------------------------------------------------------------------------------

std::mutex& log_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::string>& log_lines() {
  static auto* lines = new std::vector<std::string>();  // leaked: read from anywhere until exit
  return *lines;
}
void log_line(std::string line) {
  if (std::getenv("LATHE_CUDNN_ATTENTION_LOG")) std::fprintf(stderr, "cudnn_attention: %s\n", line.c_str());
  std::lock_guard<std::mutex> lock(log_mutex());
  log_lines().push_back(std::move(line));
}

// --- graph construction -----------------------------------------------------------------------------------------

using Dims = std::array<int64_t, 4>;

struct TensorDesc {
  cudnnBackendDescriptor_t desc = nullptr;
  int64_t uid = 0;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  Dims dims{}, strides{};
};

// Creates descriptors into `owned` (destroyed by the plan) and records the first failing call; after a failure
// every further call is skipped, so a graph is built in straight-line code and checked once at the end.
class GraphBuilder {
 public:
  explicit GraphBuilder(std::vector<cudnnBackendDescriptor_t>* owned) : owned_(owned) {}
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  std::vector<cudnnBackendDescriptor_t>& ops() { return ops_; }

  cudnnBackendDescriptor_t create(cudnnBackendDescriptorType_t type, const char* what) {
    cudnnBackendDescriptor_t d = nullptr;
    if (!ok()) return nullptr;
    check(cudnnBackendCreateDescriptor(type, &d), what, "create");
    if (d) owned_->push_back(d);
    return d;
  }
  void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           int64_t count, const void* values, const char* what) {
    if (ok())
      check(cudnnBackendSetAttribute(d, name, type, count, values), what, fmt::format("attribute {}", int(name)));
  }
  void link(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value,
            const char* what) {
    set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what);
  }
  void finalize(cudnnBackendDescriptor_t d, const char* what) {
    if (ok()) check(cudnnBackendFinalize(d), what, "finalize");
  }
  void fail(std::string message) {
    if (ok()) error_ = std::move(message);
  }

  TensorDesc tensor(int64_t uid, cudnnDataType_t type, Dims dims, Dims strides, bool is_virtual, bool by_value,
                    const TensorDesc* ragged, const char* what) {
    TensorDesc t{create(CUDNN_BACKEND_TENSOR_DESCRIPTOR, what), uid, type, dims, strides};
    const int64_t alignment = 16;
    set(t.desc, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, what);
    set(t.desc, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, what);
    set(t.desc, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), what);
    set(t.desc, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), what);
    set(t.desc, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, what);
    set(t.desc, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, what);
    set(t.desc, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, what);
    if (ragged) link(t.desc, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, ragged->desc, what);
    finalize(t.desc, what);
    return t;
  }
  // A tensor passed by value from host memory (a 1x1x1x1 scalar).
  TensorDesc scalar(int64_t uid, cudnnDataType_t type, const char* what) {
    return tensor(uid, type, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true, nullptr, what);
  }
  TensorDesc virt(cudnnDataType_t type, Dims dims, Dims strides, const char* what, const TensorDesc* ragged = nullptr) {
    return tensor(next_virtual_++, type, dims, strides, true, false, ragged, what);
  }
  // A virtual tensor with x's dims and strides, as the frontend infers pointwise outputs.
  TensorDesc like(const TensorDesc& x, cudnnDataType_t type, const char* what) {
    return virt(type, x.dims, x.strides, what);
  }

  // y = mode(x [, b] [, t]); GEN_INDEX takes `axis`.
  void pointwise(const char* what, cudnnPointwiseMode_t mode, cudnnDataType_t math, const TensorDesc& x,
                 const TensorDesc* b, const TensorDesc* t, const TensorDesc& y, int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what);
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what);
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math, what);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what);
    finalize(pw, what);
    cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, what);
    link(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, what);
    link(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x.desc, what);
    if (b) link(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b->desc, what);
    if (t) link(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t->desc, what);
    link(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y.desc, what);
    const float one = 1.0f;
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, what);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, what);
    finalize(op, what);
    if (ok()) ops_.push_back(op);
  }
  // c = a.b over the last two dims, fp32 compute; the overrides (where given and made) bound M, N, K per batch entry.
  void matmul(const char* what, const TensorDesc& a, const TensorDesc& b, const TensorDesc& c, const TensorDesc* m,
              const TensorDesc* n, const TensorDesc* k) {
    cudnnBackendDescriptor_t mm = create(CUDNN_BACKEND_MATMUL_DESCRIPTOR, what);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    const double padding = 0.0;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, what);
    set(mm, CUDNN_ATTR_MATMUL_PADDING_VALUE, CUDNN_TYPE_DOUBLE, 1, &padding, what);
    finalize(mm, what);
    cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, what);
    link(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a.desc, what);
    link(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b.desc, what);
    link(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c.desc, what);
    link(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm, what);
    if (m && m->desc) link(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m->desc, what);
    if (n && n->desc) link(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n->desc, what);
    if (k && k->desc) link(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k->desc, what);
    finalize(op, what);
    if (ok()) ops_.push_back(op);
  }
  void reduction(const char* what, cudnnReduceTensorOp_t mode, const TensorDesc& x, const TensorDesc& y) {
    cudnnBackendDescriptor_t rd = create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what);
    set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, what);
    finalize(rd, what);
    cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, what);
    link(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x.desc, what);
    link(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y.desc, what);
    link(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd, what);
    finalize(op, what);
    if (ok()) ops_.push_back(op);
  }
  void reshape(const char* what, const TensorDesc& x, const TensorDesc& y) {
    cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, what);
    link(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x.desc, what);
    link(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y.desc, what);
    finalize(op, what);
    if (ok()) ops_.push_back(op);
  }

 private:
  void check(cudnnStatus_t st, const char* what, const std::string& step) {
    if (st != CUDNN_STATUS_SUCCESS && ok()) error_ = fmt::format("{} ({}): {}", what, step, status_text(st));
  }

  std::vector<cudnnBackendDescriptor_t>* owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  std::string error_;
  int64_t next_virtual_ = kVirtual0;
};

// The tensors both graphs share: lengths and ragged offsets (PlanKey says which a graph has) and the by-value scale.
struct Common {
  TensorDesc seq_q, seq_kv, rag_q, rag_kv, rag_stats, scale;
  Dims scores, scores_strides, rows, rows_strides;  // (B, Hq, S, S) and (B, Hq, S, 1), packed
  int neg_infs = 0;                                 // -inf tensors made so far
};

Common common_tensors(GraphBuilder& g, const PlanKey& k) {
  Common c;
  const int64_t b = k.b, s = k.s, hq = k.hq;
  const Dims off{b + 1, 1, 1, 1}, unit{1, 1, 1, 1};
  c.scale = g.scalar(kScale, CUDNN_DATA_FLOAT, "attn scale");
  c.scores = {b, hq, s, s};
  c.scores_strides = {hq * s * s, s * s, s, 1};
  c.rows = {b, hq, s, 1};
  c.rows_strides = {hq * s, s, 1, 1};
  if (!k.lengths()) return c;
  c.seq_q = g.tensor(kSeqQ, CUDNN_DATA_INT32, {b, 1, 1, 1}, unit, false, false, nullptr, "seq_len_q");
  c.seq_kv = g.tensor(kSeqKV, CUDNN_DATA_INT32, {b, 1, 1, 1}, unit, false, false, nullptr, "seq_len_kv");
  if (k.dense) return c;
  c.rag_q = g.tensor(kRagQ, CUDNN_DATA_INT32, off, unit, false, false, nullptr, "ragged offsets q/o");
  c.rag_kv = g.tensor(kRagKV, CUDNN_DATA_INT32, off, unit, false, false, nullptr, "ragged offsets k/v");
  c.rag_stats = g.tensor(kRagStats, CUDNN_DATA_INT32, off, unit, false, false, nullptr, "ragged offsets stats");
  return c;
}

// (B, heads, S, D) over the packed (T, heads, D) buffer of `uid`; `transposed` swaps the last two dims (K^T, V^T).
TensorDesc packed(GraphBuilder& g, const Common& c, const PlanKey& k, int64_t uid, cudnnDataType_t io, bool transposed,
                  const char* what) {
  const bool q_side = uid == kQ || uid == kO || uid == kDO || uid == kDQ;
  const int64_t heads = q_side ? k.hq : k.hkv;
  const int64_t batch = k.batch_stride(heads);
  const Dims dims = transposed ? Dims{k.b, heads, k.d, k.s} : Dims{k.b, heads, k.s, k.d};
  const Dims strides = transposed ? Dims{batch, k.d, 1, heads * k.d} : Dims{batch, k.d, heads * k.d, 1};
  return g.tensor(uid, io, dims, strides, false, false, k.dense ? nullptr : q_side ? &c.rag_q : &c.rag_kv, what);
}

// Stats (B, Hq, S, 1) over the lse buffer (T, Hq).
TensorDesc stats_tensor(GraphBuilder& g, const Common& c, const PlanKey& k) {
  return g.tensor(kStats, CUDNN_DATA_FLOAT, c.rows, {k.hq * k.s, 1, k.hq, 1}, false, false,
                  k.dense ? nullptr : &c.rag_stats, "stats");
}

TensorDesc neg_inf(GraphBuilder& g, Common& c) { return g.scalar(kNegInf0 + c.neg_infs++, CUDNN_DATA_FLOAT, "-inf"); }

// cudnn-frontend's padding_mask: scores outside seq_len_q x seq_len_kv become -inf. None in a graph without lengths.
TensorDesc padding_mask(GraphBuilder& g, Common& c, const TensorDesc& x) {
  if (!c.seq_q.desc) return x;
  const TensorDesc row = g.like(x, CUDNN_DATA_INT32, "padding row index");
  g.pointwise("padding row index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, x, nullptr, nullptr, row, 2);
  const TensorDesc col = g.like(x, CUDNN_DATA_INT32, "padding col index");
  g.pointwise("padding col index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, x, nullptr, nullptr, col, 3);
  const TensorDesc row_ok = g.like(row, CUDNN_DATA_BOOLEAN, "row < seq_len_q");
  g.pointwise("row < seq_len_q", CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, &c.seq_q, nullptr, row_ok);
  const TensorDesc col_ok = g.like(col, CUDNN_DATA_BOOLEAN, "col < seq_len_kv");
  g.pointwise("col < seq_len_kv", CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, col, &c.seq_kv, nullptr, col_ok);
  const TensorDesc keep = g.like(row_ok, CUDNN_DATA_BOOLEAN, "padding mask");
  g.pointwise("padding mask", CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_ok, &col_ok, nullptr, keep);
  const TensorDesc inf = neg_inf(g, c);
  const TensorDesc y = g.like(x, CUDNN_DATA_FLOAT, "padding select");
  g.pointwise("padding select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, &inf, &keep, y);
  return y;
}

// cudnn-frontend's composite diagonal band (right bound 0, top-left): keep row >= col.
TensorDesc causal_mask(GraphBuilder& g, Common& c, const TensorDesc& x) {
  const TensorDesc row = g.like(x, CUDNN_DATA_INT32, "causal row index");
  g.pointwise("causal row index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, x, nullptr, nullptr, row, 2);
  const TensorDesc col = g.like(x, CUDNN_DATA_INT32, "causal col index");
  g.pointwise("causal col index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, x, nullptr, nullptr, col, 3);
  const TensorDesc keep = g.like(row, CUDNN_DATA_BOOLEAN, "row >= col");
  g.pointwise("row >= col", CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, &col, nullptr, keep);
  const TensorDesc inf = neg_inf(g, c);
  const TensorDesc y = g.like(x, CUDNN_DATA_FLOAT, "causal select");
  g.pointwise("causal select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, &inf, &keep, y);
  return y;
}

struct GraphInfo {
  int neg_infs = 0;
  int64_t softmax_sum_bytes = 0, dq_accum_bytes = 0;  // fp32 buffers the backward graph reads and writes
};

GraphInfo forward_graph(GraphBuilder& g, const PlanKey& k, cudnnDataType_t io) {
  Common c = common_tensors(g, k);
  const TensorDesc q = packed(g, c, k, kQ, io, false, "q");
  const TensorDesc kt = packed(g, c, k, kK, io, true, "k^T");
  const TensorDesc v = packed(g, c, k, kV, io, false, "v");
  const TensorDesc o = packed(g, c, k, kO, io, false, "o");
  const TensorDesc stats = stats_tensor(g, c, k);

  const TensorDesc s1 = g.virt(CUDNN_DATA_FLOAT, c.scores, c.scores_strides, "q.k^T");
  g.matmul("bmm1 q.k^T", q, kt, s1, &c.seq_q, &c.seq_kv, nullptr);
  const TensorDesc s2 = g.like(s1, CUDNN_DATA_FLOAT, "scaled scores");
  g.pointwise("attn scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s1, &c.scale, nullptr, s2);
  const TensorDesc s3 = padding_mask(g, c, s2);
  const TensorDesc s4 = causal_mask(g, c, s3);

  const TensorDesc max = g.virt(CUDNN_DATA_FLOAT, c.rows, c.rows_strides, "row max");
  g.reduction("softmax max", CUDNN_REDUCE_TENSOR_MAX, s4, max);
  const TensorDesc centred = g.like(s4, CUDNN_DATA_FLOAT, "scores - max");
  g.pointwise("softmax sub", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, s4, &max, nullptr, centred);
  const TensorDesc e = g.like(centred, CUDNN_DATA_FLOAT, "exp");
  g.pointwise("softmax exp", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centred, nullptr, nullptr, e);
  const TensorDesc sum = g.virt(CUDNN_DATA_FLOAT, c.rows, c.rows_strides, "row sum");
  g.reduction("softmax sum", CUDNN_REDUCE_TENSOR_ADD, e, sum);
  const TensorDesc log_sum = g.virt(CUDNN_DATA_FLOAT, c.rows, c.rows_strides, "log sum");
  g.pointwise("softmax log", CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, sum, nullptr, nullptr, log_sum);
  g.pointwise("softmax stats", CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, max, &log_sum, nullptr, stats);
  const TensorDesc p = g.like(e, io, "probabilities");  // bmm2's A operand in the I/O type, as the engine wants
  g.pointwise("softmax div", CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, &sum, nullptr, p);
  g.matmul("bmm2 p.v", p, v, o, &c.seq_q, nullptr, &c.seq_kv);
  return GraphInfo{c.neg_infs, 0, 0};
}

GraphInfo backward_graph(GraphBuilder& g, const PlanKey& k, cudnnDataType_t io) {
  Common c = common_tensors(g, k);
  const int64_t b = k.b, s = k.s, hq = k.hq, hkv = k.hkv, d = k.d;
  const TensorDesc q = packed(g, c, k, kQ, io, false, "q");
  const TensorDesc kt = packed(g, c, k, kK, io, true, "k^T");
  const TensorDesc vt = packed(g, c, k, kV, io, true, "v^T");
  const TensorDesc o = packed(g, c, k, kO, io, false, "o");
  const TensorDesc dout = packed(g, c, k, kDO, io, false, "do");
  const TensorDesc stats = stats_tensor(g, c, k);
  const TensorDesc dq = packed(g, c, k, kDQ, io, false, "dq");
  const TensorDesc dk = packed(g, c, k, kDK, io, false, "dk");
  const TensorDesc dv = packed(g, c, k, kDV, io, false, "dv");
  const TensorDesc one = g.scalar(kOne, CUDNN_DATA_FLOAT, "one");
  const Dims full{b, hq, s, d}, full_strides{hq * s * d, s * d, d, 1};
  const Dims transposed_strides{hq * s * s, s * s, 1, s};

  // softmax_sum = rowsum(dO * O), a buffer of ours (the frontend's workspace tensor)
  const TensorDesc doo = g.virt(CUDNN_DATA_FLOAT, full, {hq * s * d, s * d, hq * d, 1}, "do*o");
  g.pointwise("do*o", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dout, &o, nullptr, doo);
  const TensorDesc row_sum = g.virt(CUDNN_DATA_FLOAT, c.rows, c.rows_strides, "rowsum(do*o)");
  g.reduction("rowsum(do*o)", CUDNN_REDUCE_TENSOR_ADD, doo, row_sum);
  const TensorDesc softmax_sum =
      g.tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, c.rows, c.rows_strides, false, false, nullptr, "softmax_sum");
  g.pointwise("softmax_sum", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, row_sum, &one, nullptr, softmax_sum);

  // P = exp(masked(scale * Q.K^T) - stats)
  const TensorDesc s1 = g.virt(CUDNN_DATA_FLOAT, c.scores, c.scores_strides, "q.k^T");
  g.matmul("q.k^T", q, kt, s1, &c.seq_q, &c.seq_kv, nullptr);
  const TensorDesc s2 = g.like(s1, CUDNN_DATA_FLOAT, "scaled scores");
  g.pointwise("attn scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s1, &c.scale, nullptr, s2);
  const TensorDesc s3 = g.like(s2, CUDNN_DATA_FLOAT, "scores - stats");
  g.pointwise("scores - stats", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, s2, &stats, nullptr, s3);
  const TensorDesc s4 = padding_mask(g, c, s3);
  const TensorDesc s5 = causal_mask(g, c, s4);
  const TensorDesc p = g.like(s5, CUDNN_DATA_FLOAT, "p");
  g.pointwise("exp", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, s5, nullptr, nullptr, p);

  // dV = P^T.dO (per q head, then summed per GQA group)
  const TensorDesc pt = g.virt(io, c.scores, transposed_strides, "p^T");
  g.reshape("p^T", p, pt);
  if (hq == hkv) {
    g.matmul("p^T.do", pt, dout, dv, &c.seq_kv, nullptr, &c.seq_q);
  } else {
    const TensorDesc dv_heads = g.virt(io, full, full_strides, "dv per q head");
    g.matmul("p^T.do", pt, dout, dv_heads, &c.seq_kv, nullptr, &c.seq_q);
    g.reduction("dv group sum", CUDNN_REDUCE_TENSOR_ADD, dv_heads, dv);
  }

  // dS = (dO.V^T - softmax_sum) * P * scale
  const TensorDesc dp = g.virt(CUDNN_DATA_FLOAT, c.scores, c.scores_strides, "do.v^T");
  g.matmul("do.v^T", dout, vt, dp, &c.seq_q, &c.seq_kv, nullptr);
  const TensorDesc dp2 = g.like(dp, CUDNN_DATA_FLOAT, "dp - softmax_sum");
  g.pointwise("dp - softmax_sum", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp, &softmax_sum, nullptr, dp2);
  const TensorDesc ds1 = g.like(dp2, CUDNN_DATA_FLOAT, "dp * p");
  g.pointwise("dp * p", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp2, &p, nullptr, ds1);
  const TensorDesc ds = g.like(ds1, CUDNN_DATA_FLOAT, "ds");
  g.pointwise("ds scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, ds1, &c.scale, nullptr, ds);

  // dK = dS^T.Q (per q head, then summed per GQA group)
  const TensorDesc dst = g.virt(io, c.scores, transposed_strides, "ds^T");
  g.reshape("ds^T", ds, dst);
  if (hq == hkv) {
    g.matmul("ds^T.q", dst, q, dk, &c.seq_kv, nullptr, &c.seq_q);
  } else {
    const TensorDesc dk_heads = g.virt(io, full, full_strides, "dk per q head");
    g.matmul("ds^T.q", dst, q, dk_heads, &c.seq_kv, nullptr, &c.seq_q);
    g.reduction("dk group sum", CUDNN_REDUCE_TENSOR_ADD, dk_heads, dk);
  }

  // dQ = dS.K, K being K^T transposed back (a virtual view with K's ragged offsets)
  const TensorDesc k_again = g.virt(CUDNN_DATA_FLOAT, {b, hkv, s, d}, {k.batch_stride(hkv), d, hkv * d, 1}, "k",
                                    k.dense ? nullptr : &c.rag_kv);
  g.reshape("k", kt, k_again);
  GraphInfo info{0, b * hq * s * 4, 0};
  if (k.deterministic) {
    g.matmul("ds.k", ds, k_again, dq, &c.seq_q, nullptr, &c.seq_kv);
  } else {
    const TensorDesc acc = g.tensor(kDQAccum, CUDNN_DATA_FLOAT, full, full_strides, false, false, nullptr, "dq accum");
    g.matmul("ds.k", ds, k_again, acc, &c.seq_q, nullptr, &c.seq_kv);
    g.pointwise("dq convert", CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, acc, nullptr, nullptr, dq);
    info.dq_accum_bytes = b * hq * s * d * 4;
  }
  info.neg_infs = c.neg_infs;
  return info;
}

// --- plans ------------------------------------------------------------------------------------------------------

struct Plan {
  std::vector<cudnnBackendDescriptor_t> owned;  // every descriptor of the graph and plan, destroyed in reverse
  cudnnBackendDescriptor_t plan = nullptr;
  std::string error;  // the graph or every engine config failed; why
  int64_t workspace_bytes = 0;
  GraphInfo info;
  bool nondeterministic_note = false;  // the engine says CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC
  std::string engine;
  uint64_t last_used = 0;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    for (auto it = owned.rbegin(); it != owned.rend(); ++it) cudnnBackendDestroyDescriptor(*it);
  }
  bool ok() const { return plan != nullptr; }
};

// The engine behind a finalized plan's config: its global index and whether it calls itself nondeterministic.
void describe_engine(cudnnBackendDescriptor_t config, Plan* plan) {
  cudnnBackendDescriptor_t engine = nullptr;
  if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine) != CUDNN_STATUS_SUCCESS) return;
  plan->owned.push_back(engine);
  int64_t n = 0, index = -1;
  if (cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine) !=
      CUDNN_STATUS_SUCCESS)
    return;
  cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index);
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
  int64_t n_notes = 0;
  cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE, int64_t(notes.size()),
                           &n_notes, notes.data());
  std::array<cudnnBackendBehaviorNote_t, CUDNN_BEHAVIOR_NOTE_TYPE_COUNT> behaviour{};
  int64_t n_behaviour = 0;
  cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE, int64_t(behaviour.size()),
                           &n_behaviour, behaviour.data());
  std::vector<std::string> names;
  for (int64_t i = 0; i < std::min<int64_t>(n_notes, int64_t(notes.size())); ++i) {
    if (notes[size_t(i)] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) plan->nondeterministic_note = true;
    names.push_back(fmt::format("numerical note {}", int(notes[size_t(i)])));
  }
  for (int64_t i = 0; i < std::min<int64_t>(n_behaviour, int64_t(behaviour.size())); ++i)
    names.push_back(behaviour[size_t(i)] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION
                        ? std::string("runtime-compiled")
                        : fmt::format("behaviour note {}", int(behaviour[size_t(i)])));
  plan->engine = fmt::format("engine {} [{}]", index, fmt::join(names, ", "));
}

// Heuristics (mode A, then the fallback list) and the first engine config that finalizes; for a deterministic
// backward, a config whose engine says nondeterministic is taken only when no other finalizes.
void make_execution_plan(GraphBuilder& g, cudnnHandle_t handle, const PlanKey& key, Plan* plan) {
  cudnnBackendDescriptor_t graph = g.create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
  g.set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(g.ops().size()), g.ops().data(),
        "operation graph");
  g.set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph");
  g.finalize(graph, "operation graph");
  std::string last_failure;
  int64_t tried = 0;
  cudnnBackendDescriptor_t fallback = nullptr, fallback_config = nullptr;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    if (!g.ok() || plan->plan) break;
    cudnnBackendDescriptor_t heur = g.create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    g.link(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "engine heuristics");
    g.set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "engine heuristics");
    g.finalize(heur, "engine heuristics");
    if (!g.ok()) break;
    int64_t count = 0;
    if (cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                 nullptr) != CUDNN_STATUS_SUCCESS)
      count = 0;
    std::vector<cudnnBackendDescriptor_t> configs;
    for (int64_t i = 0; i < count && g.ok(); ++i)
      configs.push_back(g.create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
    if (!g.ok()) break;
    int64_t got = 0;
    if (count > 0 && cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                              &got, configs.data()) != CUDNN_STATUS_SUCCESS)
      got = 0;
    for (int64_t i = 0; i < got && !plan->plan; ++i) {
      ++tried;
      cudnnBackendDescriptor_t candidate = g.create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
      if (!g.ok()) break;
      cudnnBackendSetAttribute(candidate, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      g.link(candidate, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, configs[size_t(i)], "execution plan");
      const cudnnStatus_t st = cudnnBackendFinalize(candidate);
      if (st != CUDNN_STATUS_SUCCESS) {
        last_failure = status_text(st);
        continue;
      }
      Plan probe;
      describe_engine(configs[size_t(i)], &probe);
      if (key.backward && key.deterministic && probe.nondeterministic_note) {
        if (!fallback) fallback = candidate, fallback_config = configs[size_t(i)];
        continue;
      }
      plan->plan = candidate;
      describe_engine(configs[size_t(i)], plan);
    }
  }
  if (!plan->plan && fallback) {
    plan->plan = fallback;
    describe_engine(fallback_config, plan);
  }
  if (!g.ok() || plan->plan) return;
  g.fail(fmt::format("no engine config finalized ({} tried{}{})", tried,
                     last_failure.empty() ? "" : "; last: ", last_failure));
}

std::shared_ptr<Plan> build_plan(cudnnHandle_t handle, const PlanKey& key) {
  auto plan = std::make_shared<Plan>();
  const auto start = std::chrono::steady_clock::now();
  const cudnnDataType_t io = key.dtype == DType::BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  GraphBuilder g(&plan->owned);
  plan->info = key.backward ? backward_graph(g, key, io) : forward_graph(g, key, io);
  if (g.ok()) make_execution_plan(g, handle, key, plan.get());
  if (g.ok() && plan->plan) {
    const cudnnStatus_t st = cudnnBackendGetAttribute(plan->plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                      CUDNN_TYPE_INT64, 1, nullptr, &plan->workspace_bytes);
    if (st != CUDNN_STATUS_SUCCESS) g.fail("workspace size: " + status_text(st));
  }
  if (!g.ok()) {
    plan->plan = nullptr;
    plan->error = g.error();
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (plan->ok()) {
    log_line(fmt::format("{}: {}, workspace {:.1f} MiB, built in {:.0f} ms{}", describe(key), plan->engine,
                         double(plan->workspace_bytes) / (1 << 20), ms,
                         plan->nondeterministic_note ? " (engine notes: nondeterministic)" : ""));
  } else {
    log_line(fmt::format("{}: refused after {:.0f} ms: {}", describe(key), ms, plan->error));
  }
  return plan;
}

// --- per-device state -------------------------------------------------------------------------------------------

struct HostCu {
  std::weak_ptr<Storage> storage;
  const void* data = nullptr;
  int64_t n = 0;
  std::vector<int32_t> values;
};

struct DeviceState {
  std::mutex mutex;
  bool initialised = false;
  std::string refusal;  // why this device cannot run the kernels; empty when it can
  cudnnHandle_t handle = nullptr;
  int64_t total_memory = 0;
  std::map<PlanKey, std::shared_ptr<Plan>> plans;
  uint64_t clock = 0;
  std::vector<HostCu> host_cu;
};

std::string runtime_refusal() {
  const size_t v = cudnnGetVersion();
  if (v < kMinVersion)
    return fmt::format("cuDNN {} is older than 9.6.0 (ragged offsets with GQA in the backward)", version_string(v));
  if (v == 91000 || v == 91001)
    return fmt::format("cuDNN {} has known bf16/f16 attention forward bugs", version_string(v));
  if (v >= kEndVersion)
    return fmt::format(
        "cuDNN {}: from 9.21 cudnn-frontend lowers softmax and masks to unified operations; the "
        "composite graphs here are unverified there",
        version_string(v));
  return {};
}

// One state per device, made on first use with its cuDNN handle. Deliberately never destroyed: the handle and
// plans must not be torn down after the CUDA runtime during static destruction.
DeviceState& device_state(int device) {
  static std::mutex mutex;
  static auto* states = new std::map<int, std::unique_ptr<DeviceState>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<DeviceState>& st = (*states)[device];
  if (!st) st = std::make_unique<DeviceState>();
  return *st;
}

// Under st.mutex, with `device` current.
void initialise(DeviceState& st, int device) {
  if (st.initialised) return;
  st.initialised = true;
  st.refusal = runtime_refusal();
  if (!st.refusal.empty()) return;
  cudaDeviceProp prop{};
  LATHE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  st.total_memory = int64_t(prop.totalGlobalMem);
  if (prop.major != 9) {
    st.refusal = fmt::format("only sm_90 (Hopper) is verified, this is sm_{}{}", prop.major, prop.minor);
    return;
  }
  const cudnnStatus_t status = cudnnCreate(&st.handle);
  if (status != CUDNN_STATUS_SUCCESS) {
    st.handle = nullptr;
    st.refusal = "cudnnCreate failed: " + status_text(status);
  }
}

// Under st.mutex: cu_seqlens on the host, read once per live storage (a device-wide sync on a miss, so work
// queued on any stream that wrote it has finished).
std::vector<int32_t> host_cu_seqlens(DeviceState& st, const Tensor& cu) {
  std::erase_if(st.host_cu, [](const HostCu& e) { return e.storage.expired(); });
  for (const HostCu& e : st.host_cu)
    if (e.storage.lock() == cu.storage() && e.data == cu.data_ptr() && e.n == cu.numel()) return e.values;
  HostCu e{cu.storage(), cu.data_ptr(), cu.numel(), std::vector<int32_t>(size_t(cu.numel()))};
  LATHE_CUDA_CHECK(cudaDeviceSynchronize());
  LATHE_CUDA_CHECK(cudaMemcpy(e.values.data(), cu.data_ptr(), size_t(cu.numel()) * 4, cudaMemcpyDeviceToHost));
  if (st.host_cu.size() >= kMaxHostCu) st.host_cu.erase(st.host_cu.begin());
  st.host_cu.push_back(e);
  return e.values;
}

// Under st.mutex.
std::shared_ptr<Plan> get_plan(DeviceState& st, const PlanKey& key) {
  auto it = st.plans.find(key);
  if (it == st.plans.end()) {
    if (st.plans.size() >= kMaxPlans) {
      auto oldest = std::min_element(st.plans.begin(), st.plans.end(), [](const auto& a, const auto& b) {
        return a.second->last_used < b.second->last_used;
      });
      st.plans.erase(oldest);
    }
    it = st.plans.emplace(key, build_plan(st.handle, key)).first;
  }
  it->second->last_used = ++st.clock;
  return it->second;
}

// --- the op kernels ---------------------------------------------------------------------------------------------

struct Prepared {
  PlanKey key;
  std::shared_ptr<Plan> plan;
  DeviceState* state = nullptr;
  int64_t tokens = 0;
};

// Everything supports() checks; fills `out` for run(). Plans are built (or their failure recorded) here, so a
// shape an engine refuses resolves to the next kernel with cuDNN's reason.
Support prepare(const OpCall& c, bool backward, bool deterministic, Prepared* out) {
  try {
    const Tensor& q = c.inputs[0];  // (T, Hq, D)
    const Tensor& k = c.inputs[1];  // (T, Hkv, D)
    const Tensor& cu = c.inputs[backward ? 6 : 3];
    if (q.dtype() != DType::BF16 && q.dtype() != DType::F16) return Support::no("dtype must be bf16 or f16");
    for (const std::vector<Tensor>* list : {&c.inputs, &c.outputs})
      for (const Tensor& t : *list) {
        if (!t.is_contiguous()) return Support::no("tensors must be contiguous");
        if (t.dtype() != DType::I32 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0)
          return Support::no("tensors must be 16-byte aligned");
      }
    const int64_t tokens = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
    if (tokens == 0) return Support::no("no tokens");
    if (d % 8 != 0 || d > 256) return Support::no("head dim must be a multiple of 8 up to 256");
    if (tokens * hq * d >= (int64_t(1) << 31)) return Support::no("T * Hq * D must fit the 32-bit ragged offsets");
    const int device = c.device().index;
    DeviceGuard guard(device);
    DeviceState& st = device_state(device);
    std::lock_guard<std::mutex> lock(st.mutex);
    initialise(st, device);
    if (!st.refusal.empty()) return Support::no(st.refusal);

    const std::vector<int32_t> cuv = host_cu_seqlens(st, cu);
    const int64_t batch = int64_t(cuv.size()) - 1;
    if (batch < 1 || cuv.front() != 0 || cuv.back() != tokens)
      return Support::no("cu_seqlens must run from 0 to the token count");
    int64_t longest = 0;
    bool uniform = true;  // every document of one length
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = int64_t(cuv[size_t(b + 1)]) - cuv[size_t(b)];
      if (len <= 0) return Support::no("empty or decreasing documents in cu_seqlens");
      longest = std::max(longest, len);
      uniform = uniform && len == cuv[1];
    }
    // The dense graph: documents of one length, a multiple of kRowTile (the plain batch), or any one length above
    // head dim 128 (with lengths and the padding mask), where the ragged backward is wrong. Other batches at D <= 128
    // stay ragged, as before session 35. The backward above head dim 128 of documents of unequal lengths: a padded
    // copy (see the file comment).
    const bool dense = uniform && (longest % kRowTile == 0 || d > 128);
    const bool padded = backward && d > 128 && !uniform;
    if (padded && batch > 65535) return Support::no("a padded backward takes at most 65,535 documents");
    if (padded && batch * longest > 2 * tokens)
      return Support::no(fmt::format(
          "above head dim 128 cuDNN's backward takes documents of unequal lengths as a padded batch, and {} documents "
          "of up to {} rows would more than double the {} rows",
          batch, longest, tokens));

    // A ragged batch's S is the longest document rounded up to kRowTile; a dense or padded one's the longest.
    const int64_t s = dense || padded ? longest : (longest + kRowTile - 1) / kRowTile * kRowTile;
    const PlanKey key{backward, deterministic, q.dtype(), batch, s, hq, hkv, d, dense || padded, padded};
    std::shared_ptr<Plan> plan = get_plan(st, key);
    if (!plan->ok()) return Support::no("cuDNN refused the graph: " + plan->error);
    if (backward) {
      const int64_t bytes = plan->workspace_bytes + plan->info.softmax_sum_bytes + plan->info.dq_accum_bytes;
      if (bytes > st.total_memory / 16)
        return Support::no(
            fmt::format("the backward needs {:.1f} GiB of workspace (dP staging grows with B * Hq * S^2), "
                        "above 1/16 of device memory",
                        double(bytes) / double(1 << 30)));
    }
    *out = Prepared{key, plan, &st, tokens};
    return Support::yes();
  } catch (const std::exception& e) {
    return Support::no(e.what());
  }
}

int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// Scratch for one call, each piece 256-byte aligned: the per-document int32 tensors, the backward's fp32 buffers and
// the engine workspace. Released when the run returns (stream-ordered reuse, see model_ops_register.cpp).
struct Scratch {
  Tensor storage;
  int32_t *seq_len = nullptr, *off_q = nullptr, *off_kv = nullptr, *off_stats = nullptr;
  float *softmax_sum = nullptr, *dq_accum = nullptr;
  void* workspace = nullptr;
};

Scratch make_scratch(ExecContext& ctx, const Prepared& p, const Tensor& cu) {
  const PlanKey& k = p.key;
  const int64_t ints = align_up(k.b + 1, 64);  // 256 bytes per array
  const int64_t sum_bytes = align_up(p.plan->info.softmax_sum_bytes, 256);
  const int64_t acc_bytes = align_up(p.plan->info.dq_accum_bytes, 256);
  const int64_t total = 4 * ints * 4 + sum_bytes + acc_bytes + align_up(p.plan->workspace_bytes, 256);
  Scratch s;
  s.storage = Tensor::empty({total}, DType::U8, ctx.allocator);
  auto* base = static_cast<uint8_t*>(s.storage.data_ptr());
  LATHE_ASSERT(reinterpret_cast<uintptr_t>(base) % 256 == 0);
  auto* ints_base = reinterpret_cast<int32_t*>(base);
  s.seq_len = ints_base;
  s.off_q = ints_base + ints;
  s.off_kv = ints_base + 2 * ints;
  s.off_stats = ints_base + 3 * ints;
  uint8_t* next = base + 4 * ints * 4;
  if (sum_bytes) s.softmax_sum = reinterpret_cast<float*>(next), next += sum_bytes;
  if (acc_bytes) s.dq_accum = reinterpret_cast<float*>(next), next += acc_bytes;
  if (p.plan->workspace_bytes) s.workspace = next;
  if (k.lengths())
    launch_cudnn_ragged_meta(cu.data<int32_t>(), k.b, int32_t(k.hq * k.d), int32_t(k.hkv * k.d), int32_t(k.hq),
                             s.seq_len, s.off_q, s.off_kv, s.off_stats, as_cuda(ctx.stream).handle());
  return s;
}

float scale_of(const OpCall& c) {
  const double scale = c.attr<AttentionAttrs>().scale;
  return float(scale != 0.0 ? scale : 1.0 / std::sqrt(double(c.inputs[0].size(2))));
}

// Runs the plan with these tensor pointers (UID -> address) on the context's stream.
void execute(const Prepared& p, ExecContext& ctx, std::vector<std::pair<int64_t, void*>> bindings, void* workspace) {
  // The masked-score value: -inf, or the lowest float before 9.10 (cudnn-frontend's get_negative_inf_value()).
  const float neg_inf =
      cudnnGetVersion() < 91000 ? std::numeric_limits<float>::lowest() : -std::numeric_limits<float>::infinity();
  for (int i = 0; i < p.plan->info.neg_infs; ++i) bindings.push_back({kNegInf0 + i, const_cast<float*>(&neg_inf)});
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  for (const auto& [uid, ptr] : bindings) {
    const bool ragged = uid == kRagQ || uid == kRagKV || uid == kRagStats, length = uid == kSeqQ || uid == kSeqKV;
    if ((ragged && p.key.dense) || (length && !p.key.lengths())) continue;  // not in this graph
    uids.push_back(uid), ptrs.push_back(ptr);
  }
  DeviceState& st = *p.state;
  std::lock_guard<std::mutex> lock(st.mutex);
  LATHE_CHECK(cudnnSetStream(st.handle, as_cuda(ctx.stream).handle()) == CUDNN_STATUS_SUCCESS,
              "cudnn: cudnnSetStream failed");
  cudnnBackendDescriptor_t pack = nullptr;
  cudnnStatus_t status = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
  if (status == CUDNN_STATUS_SUCCESS)
    status = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()),
                                      uids.data());
  if (status == CUDNN_STATUS_SUCCESS)
    status = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                                      int64_t(ptrs.size()), ptrs.data());
  if (status == CUDNN_STATUS_SUCCESS)
    status = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  if (status == CUDNN_STATUS_SUCCESS) status = cudnnBackendFinalize(pack);
  if (status == CUDNN_STATUS_SUCCESS) status = cudnnBackendExecute(st.handle, p.plan->plan, pack);
  const std::string why = status == CUDNN_STATUS_SUCCESS ? std::string() : status_text(status);
  if (pack) cudnnBackendDestroyDescriptor(pack);
  LATHE_CHECK(why.empty(), "cudnn: executing the {} plan failed: {}", describe(p.key), why);
}

void* ptr(const Tensor& t) { return t.data_ptr(); }

void run_forward(const OpCall& c, ExecContext& ctx) {
  Prepared p;
  const Support s = prepare(c, false, true, &p);
  LATHE_CHECK(s.ok, "cudnn: attention: {}", s.reason);
  DeviceGuard guard(c.device().index);
  Scratch scratch = make_scratch(ctx, p, c.inputs[3]);
  float scale = scale_of(c);
  execute(p, ctx,
          {{kQ, ptr(c.inputs[0])},
           {kK, ptr(c.inputs[1])},
           {kV, ptr(c.inputs[2])},
           {kO, ptr(c.outputs[0])},
           {kStats, ptr(c.outputs[1])},
           {kScale, &scale},
           {kSeqQ, scratch.seq_len},
           {kSeqKV, scratch.seq_len},
           {kRagQ, scratch.off_q},
           {kRagKV, scratch.off_kv},
           {kRagStats, scratch.off_stats}},
          scratch.workspace);
}

// A padded backward's copies of its tensors: (B, S, heads, D) for q, k, v, o, dO and the gradients, (B, S, Hq) for
// the stats; the inputs copied in from the packed rows (padding rows repeat a document's last row), the gradients
// copied out after the run.
struct PaddedTensors {
  Tensor storage;
  std::array<void*, 9> at{};           // inputs 0-5 (q, k, v, o, lse, dO), outputs 0-2 (dq, dk, dv)
  std::array<int64_t, 9> row_bytes{};  // a row of each
};

PaddedTensors pad_inputs(const OpCall& c, ExecContext& ctx, const PlanKey& k) {
  const int64_t rows = k.b * k.s, q = k.hq * k.d * int64_t(dtype_size(k.dtype)), kv = q / k.hq * k.hkv;
  PaddedTensors p;
  p.row_bytes = {q, kv, kv, q, k.hq * 4, q, q, kv, kv};
  int64_t total = 0;
  for (int64_t r : p.row_bytes) total += align_up(rows * r, 256);
  p.storage = Tensor::empty({total}, DType::U8, ctx.allocator);
  auto* next = static_cast<uint8_t*>(p.storage.data_ptr());
  for (size_t i = 0; i < p.at.size(); ++i) p.at[i] = next, next += align_up(rows * p.row_bytes[i], 256);
  for (size_t i = 0; i < 6; ++i)
    launch_cudnn_padded_rows(c.inputs[i].data_ptr(), p.at[i], c.inputs[6].data<int32_t>(), k.b, k.s, p.row_bytes[i],
                             true, as_cuda(ctx.stream).handle());
  return p;
}

void unpad_gradients(const OpCall& c, ExecContext& ctx, const PlanKey& k, const PaddedTensors& p) {
  for (size_t i = 0; i < 3; ++i)
    launch_cudnn_padded_rows(p.at[6 + i], c.outputs[i].data_ptr(), c.inputs[6].data<int32_t>(), k.b, k.s,
                             p.row_bytes[6 + i], false, as_cuda(ctx.stream).handle());
}

void run_backward(const OpCall& c, ExecContext& ctx, bool deterministic) {
  Prepared p;
  const Support s = prepare(c, true, deterministic, &p);
  LATHE_CHECK(s.ok, "cudnn: attention_backward: {}", s.reason);
  DeviceGuard guard(c.device().index);
  Scratch scratch = make_scratch(ctx, p, c.inputs[6]);
  PaddedTensors pad;
  std::array<void*, 9> at = {ptr(c.inputs[0]), ptr(c.inputs[1]),  ptr(c.inputs[2]),  ptr(c.inputs[3]), ptr(c.inputs[4]),
                             ptr(c.inputs[5]), ptr(c.outputs[0]), ptr(c.outputs[1]), ptr(c.outputs[2])};
  if (p.key.padded) pad = pad_inputs(c, ctx, p.key), at = pad.at;
  float scale = scale_of(c), one = 1.0f;
  std::vector<std::pair<int64_t, void*>> b = {{kQ, at[0]},
                                              {kK, at[1]},
                                              {kV, at[2]},
                                              {kO, at[3]},
                                              {kDO, at[5]},
                                              {kStats, at[4]},
                                              {kDQ, at[6]},
                                              {kDK, at[7]},
                                              {kDV, at[8]},
                                              {kScale, &scale},
                                              {kOne, &one},
                                              {kSeqQ, scratch.seq_len},
                                              {kSeqKV, scratch.seq_len},
                                              {kSoftmaxSum, scratch.softmax_sum},
                                              {kRagQ, scratch.off_q},
                                              {kRagKV, scratch.off_kv},
                                              {kRagStats, scratch.off_stats}};
  if (!deterministic) b.push_back({kDQAccum, scratch.dq_accum});
  execute(p, ctx, std::move(b), scratch.workspace);
  if (p.key.padded) unpad_gradients(c, ctx, p.key, pad);
}

}  // namespace

void register_cudnn_attention_kernels(KernelRegistry& r, DType dtype) {
  if (dtype != DType::BF16 && dtype != DType::F16) return;
  // Not registered where they could never run (cudnn_runtime_summary() says why): a registered kernel that no op
  // case reaches fails the op-check's coverage pass.
  if (!runtime_refusal().empty()) return;
  int devices = 0;
  cudaDeviceProp prop{};
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 && cudaGetDeviceProperties(&prop, 0) == cudaSuccess &&
      prop.major != 9)
    return;
  cudaGetLastError();  // a failed query (no device) leaves nothing behind
  r.add(KernelDef{OpId::attention, DeviceType::CUDA, dtype, "cuda/cudnn_sdpa",
                  [](const OpCall& c) {
                    Prepared p;
                    return prepare(c, false, true, &p);
                  },
                  run_forward});
  // Only for calls that allow it (AttentionAttrs::deterministic false); the deterministic kernel takes the rest.
  r.add(KernelDef{OpId::attention_backward, DeviceType::CUDA, dtype, "cuda/cudnn_sdpa_backward_nondeterministic",
                  [](const OpCall& c) {
                    if (c.attr<AttentionAttrs>().deterministic)
                      return Support::no("the call asks for deterministic gradients");
                    Prepared p;
                    return prepare(c, true, false, &p);
                  },
                  [](const OpCall& c, ExecContext& ctx) { run_backward(c, ctx, false); }});
  r.add(KernelDef{OpId::attention_backward, DeviceType::CUDA, dtype, "cuda/cudnn_sdpa_backward",
                  [](const OpCall& c) {
                    Prepared p;
                    return prepare(c, true, true, &p);
                  },
                  [](const OpCall& c, ExecContext& ctx) { run_backward(c, ctx, true); }});
}

void run_cudnn_attention_backward_nondeterministic(const OpCall& call, ExecContext& ctx) {
  run_backward(call, ctx, false);
}

std::string cudnn_runtime_summary() {
  std::string refusal = runtime_refusal();
  int devices = 0;
  cudaDeviceProp prop{};
  if (refusal.empty() && cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 &&
      cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major != 9)
    refusal = fmt::format("only sm_90 (Hopper) is verified, cuda:0 is sm_{}{}", prop.major, prop.minor);
  cudaGetLastError();
  return fmt::format("cuDNN {} (headers {}){}{}", version_string(cudnnGetVersion()), version_string(CUDNN_VERSION),
                     refusal.empty() ? "" : ", attention kernels off: ", refusal);
}

std::vector<std::string> cudnn_attention_plan_log() {
  std::lock_guard<std::mutex> lock(log_mutex());
  return log_lines();
}

}  // namespace lathe::cuda
