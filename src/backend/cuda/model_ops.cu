// CUDA kernels of the transformer-layer ops (the CPU kernels in backend/cpu/model_ops.cpp are the spec):
// embedding gather / sorted scatter-add, RMSNorm and gated RMSNorm (rmsnorm(x) * silu(z)) rows (+ backward; one
// warp per row), rotate-half rope, SwiGLU (+ backward), causal packed attention (+ backward; one warp per row,
// online softmax) and cross-entropy rows. Convention: bf16/f16 are read and written through load/store and every
// sum is fp32; reductions that must be deterministic (rmsnorm dw, attention dk/dv, the embedding's dw) use fixed
// orders, never atomics. The gather, RMSNorm, SwiGLU and cross-entropy kernels move 16-byte packs when sizes and
// alignment allow (checked on the host) and single elements otherwise.
// Covered by tests/ops (cases for both the packed and the single-element paths).
#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/model_launchers.h"
#include "backend/cuda/radix_sort_scratch.cuh"

namespace lathe::cuda {

namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------- embedding

// One thread per pack of kN elements of the output (grid-stride over tokens x packs of a row): 16-byte copies
// when hidden is a multiple of the pack and both buffers are aligned, single elements (kN = 1) otherwise.
template <typename T, int kN>
__global__ void embedding_kernel(int64_t n_tokens, int64_t hidden, int64_t vocab, int64_t first, const T* w,
                                 const int32_t* ids, T* out) {
  const int64_t row_packs = hidden / kN, n = n_tokens * row_packs;
  for (int64_t p = global_thread(); p < n; p += grid_threads()) {
    const int64_t t = p / row_packs, c = (p % row_packs) * kN;
    const int64_t id = ids[t] - first;  // a vocab-parallel slice's row; outside it, another slice's id
    Pack<T, kN> v;
    if (id >= 0 && id < vocab) {  // ids are validated on the host before upload; never read outside w
      v = load_pack<T, kN>(w + id * hidden + c);
    } else {
#pragma unroll
      for (int k = 0; k < kN; ++k) store(v.e, k, 0.0f);
    }
    store_pack(out + t * hidden + c, v);
  }
}

// The embedding's dw from the (id, token) pairs sorted by id (a stable sort, so each id's tokens stay in token order):
// the block at the first pair of an id sums that id's dy rows in token order, in fp32, and writes its dw row once.
// Deterministic; rows of ids that no token has are the zeros written before (accumulating: left as they were).
template <typename T>
__global__ void embedding_sorted_sum_kernel(int64_t n_tokens, int64_t hidden, int64_t vocab, int64_t first,
                                            bool accumulate, const T* dy, const int32_t* sorted_ids,
                                            const int32_t* sorted_tokens, T* dw) {
  for (int64_t p = blockIdx.x; p < n_tokens; p += gridDim.x) {
    const int64_t id = int64_t(sorted_ids[p]) - first;  // its row (a vocab-parallel slice: another slice's if outside)
    if ((p > 0 && sorted_ids[p - 1] == sorted_ids[p]) || id < 0 || id >= vocab) continue;  // not an id's first pair
    int64_t end = p + 1;                                                       // (validated on the host) skipped
    while (end < n_tokens && sorted_ids[end] == id) ++end;
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      float acc = 0;
      for (int64_t q = p; q < end; ++q) acc += load(dy, int64_t(sorted_tokens[q]) * hidden + c);
      const int64_t at = id * hidden + c;
      store(dw, at, accumulate ? load(dw, at) + acc : acc);
    }
  }
}

__global__ void iota_kernel(int64_t n, int32_t* out) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) out[i] = int32_t(i);
}

int rows_grid(int64_t rows) { return grid_for(rows, 1); }

// gather_sum: one thread per pack of kN elements of an output row, its S rows summed in order in fp32 (index -1 and
// indices outside [0, n) skipped: a kernel cannot throw; the model builds them in range).
template <typename T, int kN>
__global__ void gather_sum_kernel(int64_t m, int64_t s, int64_t n, int64_t d, const T* x, const int32_t* index,
                                  const T* w, T* out) {
  const int64_t row_packs = d / kN;
  for (int64_t p = global_thread(); p < m * row_packs; p += grid_threads()) {
    const int64_t i = p / row_packs, c = (p % row_packs) * kN;
    float acc[kN] = {};
    for (int64_t j = 0; j < s; ++j) {
      const int64_t id = index[i * s + j];
      if (id < 0 || id >= n) continue;
      const float wj = load(w, i * s + j);
      const Pack<T, kN> v = load_pack<T, kN>(x + id * d + c);
#pragma unroll
      for (int k = 0; k < kN; ++k) acc[k] += wj * load(v.e, k);
    }
    Pack<T, kN> o;
#pragma unroll
    for (int k = 0; k < kN; ++k) store(o.e, k, acc[k]);
    store_pack(out + i * d + c, o);
  }
}

// ---------------------------------------------------------------- rmsnorm, gated rmsnorm
// A group of kLanes lanes per row, kNormThreads / kLanes rows per block: 8 or 16 lanes for rows of at most that many
// packs (head dims 64 and 128 in bf16 would leave half a warp idle with a warp per row), 32, or 64 / 128 for rows too
// wide for a warp's registers (hidden 2048 and 2560 in bf16). Lane l of a group owns the packs (kN consecutive
// elements; 16 bytes when h is a multiple of the pack and the buffers are aligned, else kN = 1) l, l + kLanes,
// l + 2 kLanes, ... of a row: the first kC of them stay in registers between the two passes over the row, as do the
// matching packs of w; the packs of rows wider than kLanes * kC packs are read again. Row sums: group_sum2.
// kGated: the same kernels for gated_rmsnorm, y = rmsnorm(x) * silu(z) (one rounding, at y). The forward reads z
// once, when it writes y; the backward keeps z's packs in registers beside x and dy (its gradient into the norm is
// g = dy silu(z)) and also writes dz. Non-gated calls pass null z / dz, never touched.
// Residual (residual_rmsnorm, runtime: a non-null `res`): the forward first forms each pack of h = x + res, rounded
// as the add op rounds it, writes it out and normalises it (wide rows read their second pass back from h); the
// backward adds the pack of `dres` to dx before its one rounding. Null pointers leave the plain kernels' arithmetic.

constexpr int kNormWarps = 4;
constexpr int kNormThreads = 32 * kNormWarps;

struct WarpIndex {
  int64_t first, stride;
  int lane;
};
__device__ WarpIndex warp_index() {
  const int warps = blockDim.x / 32;
  return {blockIdx.x * int64_t(warps) + threadIdx.x / 32, int64_t(gridDim.x) * warps, int(threadIdx.x % 32)};
}

// This thread's lane group: its index over the grid, the number of groups, its lane in the group, the group's lanes
// in the warp (groups of at most 32) and its slot in the block (groups of 64 or 128: two or one a block of
// kNormThreads).
template <int kLanes> struct LaneGroup {
  int64_t index, count;
  int lane;
  unsigned mask;
  int slot;
};
template <int kLanes> __device__ __forceinline__ LaneGroup<kLanes> lane_group() {
  static_assert(kLanes == 8 || kLanes == 16 || kLanes == 32 || kLanes == 64 || kLanes == 128);
  const int in_warp = int(threadIdx.x % 32);
  const unsigned mask = kLanes >= 32 ? kFullMask : ((1u << kLanes) - 1u) << (in_warp / kLanes * kLanes);
  return {global_thread() / kLanes, grid_threads() / kLanes, int(threadIdx.x % kLanes), mask, int(threadIdx.x / kLanes)};
}
// Per-block scratch of the sums of groups wider than a warp: two values per warp.
struct GroupScratch {
  float v[2][kNormWarps];
};
// a and b summed over the group (every lane gets the totals, in a fixed order). Groups of up to 32 lanes shuffle
// within their mask; wider groups add their warps' sums through shared memory between two barriers of their own
// (named barrier 1 + slot over the group's threads), so groups of one block may run different row counts.
template <int kLanes>
__device__ __forceinline__ void group_sum2(float& a, float& b, const LaneGroup<kLanes>& lg, GroupScratch& scratch) {
  constexpr int kWidth = kLanes < 32 ? kLanes : 32;
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) {
    a += __shfl_xor_sync(lg.mask, a, o);
    b += __shfl_xor_sync(lg.mask, b, o);
  }
  if constexpr (kLanes > 32) {
    constexpr int kWarps = kLanes / 32;
    const int warp = int(threadIdx.x / 32), first = lg.slot * kWarps;
    if (threadIdx.x % 32 == 0) scratch.v[0][warp] = a, scratch.v[1][warp] = b;
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + lg.slot), "n"(kLanes) : "memory");
    a = b = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) a += scratch.v[0][first + i], b += scratch.v[1][first + i];
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + lg.slot), "n"(kLanes) : "memory");  // before the next row's writes
  }
}

// Packs lane, lane + kLanes, ... (kC of them) of a row of `packs` packs; those past the row are left unset.
template <int kLanes, int kC, typename T, int kN>
__device__ __forceinline__ void load_lane_packs(const T* row, int64_t packs, int lane, Pack<T, kN> (&v)[kC]) {
#pragma unroll
  for (int c = 0; c < kC; ++c)
    if (lane + kLanes * c < packs) v[c] = load_pack<T, kN>(row + (lane + kLanes * c) * kN);
}

template <typename T, int kN> __device__ __forceinline__ float sum_squares(const Pack<T, kN>& x) {
  float s = 0;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float v = load(x.e, k);
    s += v * v;
  }
  return s;
}

__device__ __forceinline__ float sigmoid_of(float v) { return 1.0f / (1.0f + expf(-v)); }

// a + b per element in float, rounded to T: what the add op stores.
template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> pack_sum(const Pack<T, kN>& a, const Pack<T, kN>& b) {
  Pack<T, kN> s;
#pragma unroll
  for (int k = 0; k < kN; ++k) store(s.e, k, load(a.e, k) + load(b.e, k));
  return s;
}

// The pack of the output at element `at` of the tensor: x inv (offset + w), times silu(z) where kGated (z is read
// only then); one rounding.
template <bool kGated, typename T, int kN>
__device__ __forceinline__ Pack<T, kN> normalized(const Pack<T, kN>& x, const Pack<T, kN>& w, const T* z, int64_t at,
                                                  float inv, float offset) {
  Pack<T, kN> y;
  if constexpr (kGated) {
    const Pack<T, kN> zv = load_pack<T, kN>(z + at);
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const float zk = load(zv.e, k);
      store(y.e, k, load(x.e, k) * inv * (offset + load(w.e, k)) * (zk * sigmoid_of(zk)));
    }
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) store(y.e, k, load(x.e, k) * inv * (offset + load(w.e, k)));
  }
  return y;
}

template <bool kGated, typename T, int kN, int kC, int kLanes>
__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_kernel(int64_t rows, int64_t h, float eps, float offset, const T* x, const T* res, T* hsum, const T* w,
                   const T* z, T* y) {
  __shared__ GroupScratch scratch;
  const LaneGroup<kLanes> lg = lane_group<kLanes>();
  const int64_t packs = h / kN;
  Pack<T, kN> wv[kC];
  load_lane_packs<kLanes>(w, packs, lg.lane, wv);
  for (int64_t r = lg.index; r < rows; r += lg.count) {
    const T* xr = x + r * h;
    T* yr = y + r * h;
    T* hr = res ? hsum + r * h : nullptr;  // the row of h = x + res (residual calls)
    Pack<T, kN> xv[kC];
    load_lane_packs<kLanes>(xr, packs, lg.lane, xv);
    if (res) {
      Pack<T, kN> rv[kC];
      load_lane_packs<kLanes>(res + r * h, packs, lg.lane, rv);
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        const int64_t a = lg.lane + kLanes * c;
        if (a < packs) {
          xv[c] = pack_sum(xv[c], rv[c]);
          store_pack(hr + a * kN, xv[c]);
        }
      }
    }
    float ss = 0;
#pragma unroll
    for (int c = 0; c < kC; ++c)
      if (lg.lane + kLanes * c < packs) ss += sum_squares(xv[c]);
    for (int64_t a = lg.lane + kLanes * kC; a < packs; a += kLanes) {
      Pack<T, kN> v = load_pack<T, kN>(xr + a * kN);
      if (res) {
        v = pack_sum(v, load_pack<T, kN>(res + r * h + a * kN));
        store_pack(hr + a * kN, v);
      }
      ss += sum_squares(v);
    }
    const T* src = res ? hr : xr;  // what the second pass over a wide row reads (this thread's own writes of h)
    float unused = 0;
    group_sum2(ss, unused, lg, scratch);
    const float inv = rsqrtf(ss / float(h) + eps);
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int64_t a = lg.lane + kLanes * c;
      if (a < packs) store_pack(yr + a * kN, normalized<kGated>(xv[c], wv[c], z, r * h + a * kN, inv, offset));
    }
    for (int64_t a = lg.lane + kLanes * kC; a < packs; a += kLanes)
      store_pack(yr + a * kN, normalized<kGated>(load_pack<T, kN>(src + a * kN), load_pack<T, kN>(w + a * kN), z,
                                                 r * h + a * kN, inv, offset));
  }
}

// The pack of z at element `at` where kGated; an unread placeholder otherwise (z is null).
template <bool kGated, typename T, int kN> __device__ __forceinline__ Pack<T, kN> gate_pack(const T* z, int64_t at) {
  Pack<T, kN> v{};
  if constexpr (kGated) v = load_pack<T, kN>(z + at);
  return v;
}

// Element k of the gradient reaching the plain norm's output: dy, times silu(z) where kGated.
template <bool kGated, typename T, int kN>
__device__ __forceinline__ float norm_dy(const Pack<T, kN>& dy, const Pack<T, kN>& z, int k) {
  if constexpr (kGated) {
    const float zk = load(z.e, k);
    return load(dy.e, k) * (zk * sigmoid_of(zk));
  } else {
    return load(dy.e, k);
  }
}

// ss += x^2 and dot += g (offset + w) x over a pack, g = norm_dy.
template <bool kGated, typename T, int kN>
__device__ __forceinline__ void norm_sums(const Pack<T, kN>& x, const Pack<T, kN>& dy, const Pack<T, kN>& z,
                                          const Pack<T, kN>& w, float offset, float& ss, float& dot) {
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float xv = load(x.e, k);
    ss += xv * xv;
    dot += norm_dy<kGated>(dy, z, k) * (offset + load(w.e, k)) * xv;
  }
}

// dx of a pack (g = norm_dy), plus the residual gradient's pack `res` where `residual`; adds g x inv to the pack's
// partial dw. Where kGated, also the pack's dz = dy x inv (offset + w) silu'(z),
// silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z))).
template <bool kGated, typename T, int kN>
__device__ __forceinline__ Pack<T, kN> norm_grad(const Pack<T, kN>& x, const Pack<T, kN>& dy, const Pack<T, kN>& z,
                                                 const Pack<T, kN>& w, const Pack<T, kN>& res, bool residual,
                                                 float offset, float inv, float coef, float (&dw)[kN],
                                                 Pack<T, kN>& dz) {
  Pack<T, kN> dx;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float xv = load(x.e, k), wv = offset + load(w.e, k), g = norm_dy<kGated>(dy, z, k);
    const float d = inv * g * wv - xv * coef;
    store(dx.e, k, residual ? d + load(res.e, k) : d);
    dw[k] += g * xv * inv;
    if constexpr (kGated) {
      const float zk = load(z.e, k), s = sigmoid_of(zk);
      store(dz.e, k, load(dy.e, k) * xv * inv * wv * (s * (1.0f + zk * (1.0f - s))));
    }
  }
  return dx;
}

// dx_j = inv * g_j (offset + w_j) - x_j * inv^3 / H * sum_k g_k (offset + w_k) x_k with g = dy (times silu(z) where
// kGated). Lane group `group` (< n_partial) takes the rows group, group + n_partial, ... and accumulates dw_j = sum over
// them of g_j x_j inv into its own row of `partial` (n_partial, h): in registers for the packs it keeps there, written
// once at the end; in place for the packs of wider rows. A lane always owns the same columns, so there are no
// atomics and the order is fixed.
template <bool kGated, typename T, int kN, int kC, int kLanes>
__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_backward_kernel(int64_t rows, int64_t h, int64_t n_partial, float eps, float offset, const T* x,
                            const T* w, const T* z, const T* dy, const T* dres, T* dx, T* dz, float* partial) {
  __shared__ GroupScratch scratch;
  const LaneGroup<kLanes> lg = lane_group<kLanes>();
  const int lane = lg.lane;
  if (lg.index >= n_partial) return;  // spare groups of the last block (only group-wide shuffles below)
  const int64_t packs = h / kN;
  float* pdw = partial + lg.index * h;
  Pack<T, kN> wv[kC];
  load_lane_packs<kLanes>(w, packs, lane, wv);
  float dw[kC][kN] = {};
  for (int64_t a = lane + kLanes * kC; a < packs; a += kLanes)
    for (int k = 0; k < kN; ++k) pdw[a * kN + k] = 0.0f;
  for (int64_t r = lg.index; r < rows; r += n_partial) {
    const int64_t row = r * h;  // first element of the row in x, z, dy, dx and dz
    Pack<T, kN> xv[kC], gv[kC], zv[kC], rv[kC];
    load_lane_packs<kLanes>(x + row, packs, lane, xv);
    load_lane_packs<kLanes>(dy + row, packs, lane, gv);
    if constexpr (kGated) load_lane_packs<kLanes>(z + row, packs, lane, zv);
    if (dres) load_lane_packs<kLanes>(dres + row, packs, lane, rv);  // with the row, not after its sums
    float ss = 0, dot = 0;
#pragma unroll
    for (int c = 0; c < kC; ++c)
      if (lane + kLanes * c < packs) norm_sums<kGated>(xv[c], gv[c], zv[c], wv[c], offset, ss, dot);
    for (int64_t a = lane + kLanes * kC; a < packs; a += kLanes)
      norm_sums<kGated>(load_pack<T, kN>(x + row + a * kN), load_pack<T, kN>(dy + row + a * kN),
                        gate_pack<kGated, T, kN>(z, row + a * kN), load_pack<T, kN>(w + a * kN), offset, ss, dot);
    group_sum2(ss, dot, lg, scratch);
    const float inv = rsqrtf(ss / float(h) + eps);
    const float coef = inv * inv * inv * dot / float(h);
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int64_t a = lane + kLanes * c;
      if (a >= packs) continue;
      Pack<T, kN> dzv;
      store_pack(dx + row + a * kN,
                 norm_grad<kGated>(xv[c], gv[c], zv[c], wv[c], rv[c], dres != nullptr, offset, inv, coef, dw[c],
                                   dzv));
      if constexpr (kGated) store_pack(dz + row + a * kN, dzv);
    }
    for (int64_t a = lane + kLanes * kC; a < packs; a += kLanes) {
      float acc[kN];
      for (int k = 0; k < kN; ++k) acc[k] = pdw[a * kN + k];
      Pack<T, kN> dzv;
      store_pack(dx + row + a * kN,
                 norm_grad<kGated>(load_pack<T, kN>(x + row + a * kN), load_pack<T, kN>(dy + row + a * kN),
                                   gate_pack<kGated, T, kN>(z, row + a * kN), load_pack<T, kN>(w + a * kN),
                                   dres ? load_pack<T, kN>(dres + row + a * kN) : Pack<T, kN>{}, dres != nullptr,
                                   offset, inv, coef, acc, dzv));
      if constexpr (kGated) store_pack(dz + row + a * kN, dzv);
      for (int k = 0; k < kN; ++k) pdw[a * kN + k] = acc[k];
    }
  }
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const int64_t a = lane + kLanes * c;
    if (a < packs)
      for (int k = 0; k < kN; ++k) pdw[a * kN + k] = dw[c][k];
  }
}

// dw_j = sum of the partial rows in a fixed order (deterministic), in two passes. Pass 1: a block of 32 columns x 8
// row lanes per (column tile, group of kNormGroup partial rows); row lane i sums rows i, i + 8, ... of the group, then
// the 8 row-lane sums are added in order. Pass 2 sums the group sums into dw.
constexpr int64_t kNormGroup = 128;
constexpr int kColumnTile = 32, kColumnRowLanes = 8;

__global__ void __launch_bounds__(kColumnTile * kColumnRowLanes)
    column_group_sum_kernel(int64_t n_partial, int64_t h, const float* partial, float* sums) {
  __shared__ float lane_sums[kColumnRowLanes][kColumnTile + 1];
  const int tx = int(threadIdx.x % kColumnTile), ty = int(threadIdx.x / kColumnTile);
  const int64_t j = blockIdx.x * int64_t(kColumnTile) + tx, g = blockIdx.y;
  const int64_t end = min(n_partial, (g + 1) * kNormGroup);
  float acc = 0;
  if (j < h) {
#pragma unroll 8
    for (int64_t b = g * kNormGroup + ty; b < end; b += kColumnRowLanes) acc += partial[b * h + j];
  }
  lane_sums[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && j < h) {
    float total = 0;
#pragma unroll
    for (int i = 0; i < kColumnRowLanes; ++i) total += lane_sums[i][tx];
    sums[g * h + j] = total;
  }
}

template <typename T> __global__ void column_sum_kernel(int64_t n_partial, int64_t h, const float* partial, T* dw) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < h; j += int64_t(gridDim.x) * blockDim.x) {
    float acc = 0;
    for (int64_t b = 0; b < n_partial; ++b) acc += partial[b * h + j];
    store(dw, j, acc);
  }
}

// Partial dw rows = lane groups of the rmsnorm backward (each walks rows / n_partial rows): about kNormPartialFloats
// floats of partial sums, so that writing and summing them stays small next to the rows, within
// [kMinNormPartials, kMaxNormPartials] groups (enough to keep loads in flight on every SM; 4096 groups of 16 lanes
// are one wave at up to 128 registers a thread on a 132-SM GPU), and never more than rows.
constexpr int64_t kNormPartialFloats = int64_t(1) << 20;
constexpr int64_t kMinNormPartials = 1024, kMaxNormPartials = 4096;

int64_t norm_partials(int64_t rows, int64_t h) {
  int64_t p = h > 0 ? kNormPartialFloats / h : kMaxNormPartials;
  p = p < kMinNormPartials ? kMinNormPartials : (p > kMaxNormPartials ? kMaxNormPartials : p);
  return rows < p ? rows : p;
}

template <int kN, int kC, int kLanes> struct NormShape {
  static constexpr int pack = kN, cached = kC, lanes = kLanes;
  static constexpr int rows_per_block = kNormThreads / kLanes;
};
// Calls f(NormShape<kN, kC, kLanes>{}): kN = 16 / sizeof(T) when `packed` (h a multiple of it, every buffer 16-byte
// aligned), else 1; kLanes = 8 or 16 lanes a row for rows of at most that many packs, else the fewest of 32, 64 and 128
// whose lanes keep the whole row in at most kMaxC packs each (128 past that: the rest is read again); kC = the packs a
// lane keeps, rounded up to 1, 2, 4 or kMaxC. kMaxC is 8 for the forward and 4 for the backward, which also keeps dy
// and dw: 8 spills registers with bf16. The gated backward keeps z too: with bf16 packs, 120 registers at kC = 1
// (h = 128) to 232 at kC = 4, no spills (ptxas, sm_90).
template <typename T, int kMaxC, typename F> void dispatch_norm(int64_t h, bool packed, F f) {
  static_assert(kMaxC == 4 || kMaxC == 8);
  constexpr int kV = kPackOf16<T>;
  const auto by_lane_packs = [&](auto pack) {
    constexpr int kN = decltype(pack)::value;
    const int64_t packs = h / kN;
    const int64_t per_lane = (packs + 31) / 32;
    if (packs <= 8) f(NormShape<kN, 1, 8>{});
    else if (packs <= 16) f(NormShape<kN, 1, 16>{});
    else if (per_lane <= 1) f(NormShape<kN, 1, 32>{});
    else if (per_lane <= 2) f(NormShape<kN, 2, 32>{});
    else if (per_lane <= 4) f(NormShape<kN, 4, 32>{});
    else if (per_lane <= kMaxC) f(NormShape<kN, kMaxC, 32>{});
    // Wider rows: more than kMaxC / 2 packs a lane even at 64 or 128 lanes, so kC = kMaxC.
    else if (packs <= 64 * kMaxC) f(NormShape<kN, kMaxC, 64>{});
    else f(NormShape<kN, kMaxC, 128>{});
  };
  if (packed && h % kV == 0) by_lane_packs(std::integral_constant<int, kV>{});
  else by_lane_packs(std::integral_constant<int, 1>{});
}

// ---------------------------------------------------------------- rope

// One thread per (token, pair i): the angle's cos and sin are computed once (precise cosf/sinf, as the CPU recipe)
// and applied to the pair (i, i + half) of every head; dims beyond the rotary part are copied by the same threads.
template <typename T>
__global__ void rope_kernel(int64_t tokens, int64_t heads, int64_t d, int64_t half, bool inverse,
                            const __grid_constant__ RopeFrequencies freqs, const T* x, const int32_t* pos, T* y) {
  const int64_t lanes = d - half;  // lanes [0, half) rotate a pair; lanes [half, d - half) copy one pass-through dim
  const int64_t n = tokens * lanes;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / lanes, i = idx % lanes;
    const T* xt = x + t * heads * d;
    T* yt = y + t * heads * d;
    if (i >= half) {  // pass-through dims 2 half .. d
      const int64_t e = i + half;
      for (int64_t h = 0; h < heads; ++h) store(yt, h * d + e, load(xt, h * d + e));
      continue;
    }
    const float angle = float(pos[t]) * freqs.inv_freq[i];
    const float cs = cosf(angle), sn = inverse ? -sinf(angle) : sinf(angle);
    for (int64_t h = 0; h < heads; ++h) {
      const float x1 = load(xt, h * d + i), x2 = load(xt, h * d + i + half);
      store(yt, h * d + i, x1 * cs - x2 * sn);
      store(yt, h * d + i + half, x2 * cs + x1 * sn);
    }
  }
}

// ---------------------------------------------------------------- qk_norm_rope

// One group of kLanes = D / kN lanes per token (D = 64 or 128 in f32, 64, 128 or 256 in bf16/f16: 8, 16 or 32 lanes),
// walking the token's heads: lane l holds the pack of elements [l kN, (l + 1) kN) of a head row, so the rotate-half
// partner of its elements (full rotary dim) is lane l ^ kLanes / 2, one shuffle away. A row's sums take group_sum2's
// order, so the norm is bitwise the rmsnorm kernel's at the same lane count (D = 128 in bf16: 16 lanes there too);
// the normalised pack is rounded to T before it is rotated, as the rmsnorm op's output is; the angles (precise cosf
// and sinf, as the rope kernel) are computed once per token and lane, for all heads.

// cos and sin of the angles of this lane's kN elements at position p (sin negated for the inverse rotation).
template <int kN, int kLanes>
__device__ __forceinline__ void rope_angles(const RopeFrequencies& freqs, int32_t p, int lane, bool inverse,
                                            float (&cs)[kN], float (&sn)[kN]) {
  const int first = (lane % (kLanes / 2)) * kN;  // pair index of the lane's first element
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float angle = float(p) * freqs.inv_freq[first + k];
    cs[k] = cosf(angle);
    sn[k] = inverse ? -sinf(angle) : sinf(angle);
  }
}

// The rotate-half rope of this lane's pack of a head row: first half x1 cs - x2 sn, second half x2 cs + x1 sn (the
// rope kernel's expressions), the pair's other value from lane ^ kLanes / 2.
template <int kLanes, typename T, int kN>
__device__ __forceinline__ Pack<T, kN> rotate_pack(const Pack<T, kN>& x, const float (&cs)[kN], const float (&sn)[kN],
                                                   const LaneGroup<kLanes>& lg) {
  const bool first = lg.lane < kLanes / 2;
  Pack<T, kN> y;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float own = load(x.e, k), other = __shfl_xor_sync(lg.mask, own, kLanes / 2);
    store(y.e, k, first ? own * cs[k] - other * sn[k] : own * cs[k] + other * sn[k]);
  }
  return y;
}

// rope(rmsnorm(x; w)) of this lane's pack of one head row.
template <int kLanes, typename T, int kN>
__device__ __forceinline__ Pack<T, kN> norm_rope_pack(const Pack<T, kN>& x, const Pack<T, kN>& w, float eps,
                                                      float offset, const float (&cs)[kN], const float (&sn)[kN],
                                                      const LaneGroup<kLanes>& lg, GroupScratch& scratch) {
  float ss = sum_squares(x), unused = 0;
  group_sum2(ss, unused, lg, scratch);
  const float inv = rsqrtf(ss / float(kLanes * kN) + eps);
  return rotate_pack(normalized<false>(x, w, static_cast<const T*>(nullptr), 0, inv, offset), cs, sn, lg);
}

// A lane group per (token, head row) of the fused output: q's Hq heads, then k's Hkv, then v's Hkv (copied), so that a
// decoding step's few tokens spread over as many groups as they have heads.
template <typename T, int kN, int kLanes>
__global__ void __launch_bounds__(kNormThreads)
    qk_norm_rope_kernel(int64_t tokens, int64_t hq, int64_t hkv, float eps, float offset,
                        const __grid_constant__ RopeFrequencies freqs, const T* qkv, const T* wq, const T* wk,
                        const int32_t* pos, T* q, T* k, T* v) {
  __shared__ GroupScratch scratch;  // group_sum2's, unused by groups of at most a warp
  const LaneGroup<kLanes> lg = lane_group<kLanes>();
  constexpr int64_t kD = int64_t(kLanes) * kN;
  const int64_t heads = hq + 2 * hkv, cols = heads * kD, at = lg.lane * kN;
  for (int64_t i = lg.index; i < tokens * heads; i += lg.count) {
    const int64_t t = i / heads, h = i % heads;
    const Pack<T, kN> x = load_pack<T, kN>(qkv + t * cols + h * kD + at);
    if (h >= hq + hkv) {
      store_pack(v + (t * hkv + h - hq - hkv) * kD + at, x);
      continue;
    }
    float cs[kN], sn[kN];
    rope_angles<kN, kLanes>(freqs, pos[t], lg.lane, false, cs, sn);
    const bool is_q = h < hq;
    T* out = is_q ? q + (t * hq + h) * kD + at : k + (t * hkv + h - hq) * kD + at;
    store_pack(out, norm_rope_pack(x, load_pack<T, kN>((is_q ? wq : wk) + at), eps, offset, cs, sn, lg, scratch));
  }
}

// The backward of one head row's pack: g = the inverse rotation of dy, rounded to T (the rope op's output), then
// rmsnorm_backward's dx (written to dx_row) and its dw terms added to dw.
template <int kLanes, typename T, int kN>
__device__ __forceinline__ void norm_rope_backward_pack(const T* x_row, const T* dy_row, T* dx_row,
                                                        const Pack<T, kN>& w, float eps, float offset,
                                                        const float (&cs)[kN], const float (&sn)[kN],
                                                        const LaneGroup<kLanes>& lg, GroupScratch& scratch,
                                                        float (&dw)[kN]) {
  const Pack<T, kN> x = load_pack<T, kN>(x_row), g = rotate_pack(load_pack<T, kN>(dy_row), cs, sn, lg);
  float ss = 0, dot = 0;
  norm_sums<false>(x, g, g, w, offset, ss, dot);
  group_sum2(ss, dot, lg, scratch);
  constexpr float kD = float(kLanes * kN);
  const float inv = rsqrtf(ss / kD + eps), coef = inv * inv * inv * dot / kD;
  Pack<T, kN> unused;
  store_pack(dx_row, norm_grad<false>(x, g, g, w, g, false, offset, inv, coef, dw, unused));
}

// Lane group `group` (< n_partial) takes the tokens group, group + n_partial, ... and keeps its dwq and dwk terms in
// registers, written once to its rows of partial_q and partial_k (n_partial, D): fixed order, no atomics.
template <typename T, int kN, int kLanes>
__global__ void __launch_bounds__(kNormThreads)
    qk_norm_rope_backward_kernel(int64_t tokens, int64_t hq, int64_t hkv, int64_t n_partial, float eps, float offset,
                                 const __grid_constant__ RopeFrequencies freqs, const T* qkv, const T* wq,
                                 const T* wk, const int32_t* pos, const T* dq, const T* dk, const T* dv, T* dqkv,
                                 float* partial_q, float* partial_k) {
  __shared__ GroupScratch scratch;
  const LaneGroup<kLanes> lg = lane_group<kLanes>();
  if (lg.index >= n_partial) return;  // spare groups of the last block (only group-wide shuffles below)
  constexpr int64_t kD = int64_t(kLanes) * kN;
  const int64_t cols = (hq + 2 * hkv) * kD, at = lg.lane * kN;
  const Pack<T, kN> wqv = load_pack<T, kN>(wq + at), wkv = load_pack<T, kN>(wk + at);
  float dwq[kN] = {}, dwk[kN] = {};
  for (int64_t t = lg.index; t < tokens; t += n_partial) {
    float cs[kN], sn[kN];
    rope_angles<kN, kLanes>(freqs, pos[t], lg.lane, true, cs, sn);
    const T* row = qkv + t * cols + at;
    T* drow = dqkv + t * cols + at;
    for (int64_t h = 0; h < hq; ++h)
      norm_rope_backward_pack(row + h * kD, dq + (t * hq + h) * kD + at, drow + h * kD, wqv, eps, offset, cs, sn, lg,
                              scratch, dwq);
    for (int64_t h = 0; h < hkv; ++h)
      norm_rope_backward_pack(row + (hq + h) * kD, dk + (t * hkv + h) * kD + at, drow + (hq + h) * kD, wkv, eps,
                              offset, cs, sn, lg, scratch, dwk);
    for (int64_t h = 0; h < hkv; ++h)
      store_pack(drow + (hq + hkv + h) * kD, load_pack<T, kN>(dv + (t * hkv + h) * kD + at));
  }
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    partial_q[lg.index * kD + at + k] = dwq[k];
    partial_k[lg.index * kD + at + k] = dwk[k];
  }
}

// ---------------------------------------------------------------- swiglu

// Packs of kN elements from index i (16 bytes when every buffer is aligned, else kN = 1; 1 for the tail).
template <typename T, int kN> __device__ __forceinline__ void swiglu_pack(int64_t i, const T* g, const T* u, T* y) {
  const Pack<T, kN> pg = load_pack<T, kN>(g + i), pu = load_pack<T, kN>(u + i);
  Pack<T, kN> r;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float gv = load(pg.e, k);
    store(r.e, k, gv / (1.0f + expf(-gv)) * load(pu.e, k));
  }
  store_pack(y + i, r);
}

template <typename T, int kN>
__device__ __forceinline__ void swiglu_backward_pack(int64_t i, const T* g, const T* u, const T* dy, T* dg, T* du) {
  const Pack<T, kN> pg = load_pack<T, kN>(g + i), pu = load_pack<T, kN>(u + i), pdy = load_pack<T, kN>(dy + i);
  Pack<T, kN> rg, ru;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float gv = load(pg.e, k), dyv = load(pdy.e, k), s = 1.0f / (1.0f + expf(-gv));
    store(ru.e, k, dyv * gv * s);
    store(rg.e, k, dyv * load(pu.e, k) * s * (1.0f + gv * (1.0f - s)));
  }
  store_pack(du + i, ru);
  store_pack(dg + i, rg);
}

// Packs over [0, n - n % kN) in a grid-stride loop, then the tail one element a thread.
template <typename T, int kN> __global__ void swiglu_kernel(int64_t n, const T* g, const T* u, T* y) {
  const int64_t full = n - n % kN;
  for (int64_t i = global_thread() * kN; i < full; i += grid_threads() * kN) swiglu_pack<T, kN>(i, g, u, y);
  for (int64_t i = full + global_thread(); i < n; i += grid_threads()) swiglu_pack<T, 1>(i, g, u, y);
}

template <typename T, int kN>
__global__ void swiglu_backward_kernel(int64_t n, const T* g, const T* u, const T* dy, T* dg, T* du) {
  const int64_t full = n - n % kN;
  for (int64_t i = global_thread() * kN; i < full; i += grid_threads() * kN)
    swiglu_backward_pack<T, kN>(i, g, u, dy, dg, du);
  for (int64_t i = full + global_thread(); i < n; i += grid_threads()) swiglu_backward_pack<T, 1>(i, g, u, dy, dg, du);
}

// swiglu_halves (+ backward): row r of gu (rows, 2 cols) holds the gate [0, cols) and the up [cols, 2 cols) of y's
// row r (rows, cols); dgu has gu's layout. Packs of kN within a row (cols a multiple of the pack), grid-stride.
template <typename T, int kN> __global__ void swiglu_halves_kernel(int64_t rows, int64_t cols, const T* gu, T* y) {
  const int64_t n = rows * cols;
  for (int64_t i = global_thread() * kN; i < n; i += grid_threads() * kN) {
    const int64_t r = i / cols;
    const T* g = gu + i + r * cols;  // row r of gu starts at 2 r cols: element (r, c) of the gate half is i + r cols
    swiglu_pack<T, kN>(0, g, g + cols, y + i);
  }
}

template <typename T, int kN>
__global__ void swiglu_halves_backward_kernel(int64_t rows, int64_t cols, const T* gu, const T* dy, T* dgu) {
  const int64_t n = rows * cols;
  for (int64_t i = global_thread() * kN; i < n; i += grid_threads() * kN) {
    const int64_t at = i + i / cols * cols;
    swiglu_backward_pack<T, kN>(0, gu + at, gu + at + cols, dy + i, dgu + at, dgu + at + cols);
  }
}

// ---------------------------------------------------------------- attention
// One warp per (row, head); lane l holds dims l, l + 32, ... of a row (C = ceil(D / 32) values, C <= 8).
// Keys (or queries) are streamed kBatch at a time so the warp reductions of a batch overlap.

constexpr int kAttnThreads = 128;
constexpr int kBatch = 4;

// Document [start, end) of token i: first index b with cu[b] > i by binary search. cu_seqlens is validated on
// the host before upload; the clamps only keep malformed values from indexing outside [0, tokens).
struct DocSpan {
  int64_t start, end;
};
__device__ DocSpan document_of(const int32_t* cu, int64_t n_cu, int64_t i, int64_t tokens) {
  int64_t lo = 0, hi = n_cu;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= i) lo = mid + 1;
    else hi = mid;
  }
  int64_t start = lo > 0 ? cu[lo - 1] : 0, end = lo < n_cu ? cu[lo] : tokens;
  start = start < 0 ? 0 : (start > i ? i : start);
  end = end <= i ? i + 1 : (end > tokens ? tokens : end);
  return {start, end};
}

template <int C, typename T> __device__ void load_row(const T* p, int d, int lane, bool valid, float (&r)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) r[c] = valid && lane + 32 * c < d ? float(load(p, lane + 32 * c)) : 0.0f;
}
template <int C, typename T> __device__ void store_row(T* p, int d, int lane, const float (&r)[C], float mul) {
#pragma unroll
  for (int c = 0; c < C; ++c)
    if (lane + 32 * c < d) store(p, lane + 32 * c, r[c] * mul);
}
template <int C> __device__ float lane_dot(const float (&a)[C], const float (&b)[C]) {
  float s = 0;
#pragma unroll
  for (int c = 0; c < C; ++c) s += a[c] * b[c];
  return s;
}
// Sums each of the kBatch values over the warp (interleaved butterflies).
__device__ void warp_sum_batch(float (&s)[kBatch]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int b = 0; b < kBatch; ++b) s[b] += __shfl_xor_sync(kFullMask, s[b], o);
}

template <typename T, int C>
__global__ void __launch_bounds__(kAttnThreads)
    attention_forward_kernel(AttentionDims dm, const T* q, const T* k, const T* v, const int32_t* cu, T* o, float* lse) {
  const WarpIndex wi = warp_index();
  const int d = int(dm.head_dim), lane = wi.lane;
  const int64_t rows = dm.tokens * dm.q_heads, group = dm.q_heads / dm.kv_heads;
  for (int64_t w = wi.first; w < rows; w += wi.stride) {
    // Rows in reverse: the last tokens of a document see the most keys, so they start first. Consecutive warps
    // are the heads of one token: same key count, and GQA groups share their K/V rows through L1.
    const int64_t r = rows - 1 - w, i = r / dm.q_heads, kh = (r % dm.q_heads) / group;
    const DocSpan doc = document_of(cu, dm.n_cu, i, dm.tokens);
    float qr[C], acc[C];
    load_row(q + r * d, d, lane, true, qr);
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.0f;
    float m = -INFINITY, l = 0.0f;  // running max and sum of exp(s - m)
    for (int64_t j0 = doc.start; j0 <= i; j0 += kBatch) {
      float kr[kBatch][C], vr[kBatch][C], s[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t base = ((j0 + b) * dm.kv_heads + kh) * d;
        load_row(k + base, d, lane, j0 + b <= i, kr[b]);
        load_row(v + base, d, lane, j0 + b <= i, vr[b]);
        s[b] = lane_dot(qr, kr[b]);
      }
      warp_sum_batch(s);
      float m_new = m;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        s[b] = j0 + b <= i ? s[b] * dm.scale : -INFINITY;
        m_new = fmaxf(m_new, s[b]);
      }
      const float corr = expf(m - m_new);  // m_new is finite: key j0 <= i is always valid
      l *= corr;
#pragma unroll
      for (int c = 0; c < C; ++c) acc[c] *= corr;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const float p = expf(s[b] - m_new);
        l += p;
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c] += p * vr[b][c];
      }
      m = m_new;
    }
    store_row(o + r * d, d, lane, acc, 1.0f / l);
    if (lane == 0) lse[r] = m + logf(l);
  }
}

// dq_i = sum_j dS_ij k_j with P_ij = exp(s_ij - lse_i), dS_ij = P_ij (do_i . v_j - D_i) scale; also writes
// D_i = do_i . o_i to `delta` for the dk/dv kernel (which runs after it on the same stream).
template <typename T, int C>
__global__ void __launch_bounds__(kAttnThreads)
    attention_backward_dq_kernel(AttentionDims dm, const T* q, const T* k, const T* v, const T* o, const float* lse,
                                 const T* dout, const int32_t* cu, T* dq, float* delta) {
  const WarpIndex wi = warp_index();
  const int d = int(dm.head_dim), lane = wi.lane;
  const int64_t rows = dm.tokens * dm.q_heads, group = dm.q_heads / dm.kv_heads;
  for (int64_t w = wi.first; w < rows; w += wi.stride) {
    const int64_t r = rows - 1 - w, i = r / dm.q_heads, kh = (r % dm.q_heads) / group;
    const DocSpan doc = document_of(cu, dm.n_cu, i, dm.tokens);
    float qr[C], dor[C], acc[C];
    load_row(q + r * d, d, lane, true, qr);
    load_row(dout + r * d, d, lane, true, dor);
    load_row(o + r * d, d, lane, true, acc);
    float di = lane_dot(dor, acc);
    for (int off = 16; off > 0; off >>= 1) di += __shfl_xor_sync(kFullMask, di, off);
    if (lane == 0) delta[r] = di;
    const float lse_r = lse[r];
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.0f;
    for (int64_t j0 = doc.start; j0 <= i; j0 += kBatch) {
      float kr[kBatch][C], s[kBatch], dp[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t base = ((j0 + b) * dm.kv_heads + kh) * d;
        float vr[C];
        load_row(k + base, d, lane, j0 + b <= i, kr[b]);
        load_row(v + base, d, lane, j0 + b <= i, vr);
        s[b] = lane_dot(qr, kr[b]);
        dp[b] = lane_dot(dor, vr);
      }
      warp_sum_batch(s);
      warp_sum_batch(dp);
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const float ds = j0 + b <= i ? expf(s[b] * dm.scale - lse_r) * (dp[b] - di) * dm.scale : 0.0f;
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c] += ds * kr[b][c];
      }
    }
    store_row(dq + r * d, d, lane, acc, 1.0f);
  }
}

// dk_j = sum dS_ij q_i, dv_j = sum P_ij do_i over the (query, head) pairs that see key j: queries i in
// [j, end of j's document) and the q heads of kv head kh, in a fixed order (deterministic, no atomics).
template <typename T, int C>
__global__ void __launch_bounds__(kAttnThreads)
    attention_backward_dkdv_kernel(AttentionDims dm, const T* q, const T* k, const T* v, const float* lse,
                                   const T* dout, const int32_t* cu, const float* delta, T* dk, T* dv) {
  const WarpIndex wi = warp_index();
  const int d = int(dm.head_dim), lane = wi.lane;
  const int64_t rows = dm.tokens * dm.kv_heads, group = dm.q_heads / dm.kv_heads;
  for (int64_t r = wi.first; r < rows; r += wi.stride) {  // early keys (most queries) first
    const int64_t j = r / dm.kv_heads, kh = r % dm.kv_heads;
    const DocSpan doc = document_of(cu, dm.n_cu, j, dm.tokens);
    float kr[C], vr[C], dka[C], dva[C];
    load_row(k + r * d, d, lane, true, kr);
    load_row(v + r * d, d, lane, true, vr);
#pragma unroll
    for (int c = 0; c < C; ++c) dka[c] = dva[c] = 0.0f;
    // Pairs p = (i - j) * group + (h - kh * group): the q rows of one token's group are adjacent in memory.
    const int64_t pairs = (doc.end - j) * group;
    for (int64_t p0 = 0; p0 < pairs; p0 += kBatch) {
      float qr[kBatch][C], dor[kBatch][C], s[kBatch], dp[kBatch];
      int64_t qrow[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t p = p0 + b;
        qrow[b] = (j + p / group) * dm.q_heads + kh * group + p % group;
        load_row(q + qrow[b] * d, d, lane, p < pairs, qr[b]);
        load_row(dout + qrow[b] * d, d, lane, p < pairs, dor[b]);
        s[b] = lane_dot(qr[b], kr);
        dp[b] = lane_dot(dor[b], vr);
      }
      warp_sum_batch(s);
      warp_sum_batch(dp);
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (p0 + b >= pairs) continue;
        const float pij = expf(s[b] * dm.scale - lse[qrow[b]]);
        const float ds = pij * (dp[b] - delta[qrow[b]]) * dm.scale;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          dka[c] += ds * qr[b][c];
          dva[c] += pij * dor[b][c];
        }
      }
    }
    store_row(dk + r * d, d, lane, dka, 1.0f);
    store_row(dv + r * d, d, lane, dva, 1.0f);
  }
}

template <int C> struct LaneValues {
  static constexpr int value = C;
};
// Calls f(LaneValues<C>{}) with C = ceil(head_dim / 32) rounded up to 1, 2, 4 or 8.
template <typename F> void dispatch_head_dim(int64_t head_dim, F f) {
  if (head_dim <= 32) f(LaneValues<1>{});
  else if (head_dim <= 64) f(LaneValues<2>{});
  else if (head_dim <= 128) f(LaneValues<4>{});
  else if (head_dim <= kMaxAttentionHeadDim) f(LaneValues<8>{});
  else throw_cuda_error("attention (head dim above 256)", cudaErrorInvalidValue, __FILE__, __LINE__);
}

// ---------------------------------------------------------------- cross-entropy

// One block per row: a per-thread online (max, sum of exp) over a block-stride pass of packs (kN logits; 16 bytes
// when the rows start on 16-byte boundaries, `ld` and `ld_grad` elements apart) and the row's last vocab % kN logits
// one at a time, combined across the block; a second pass writes the gradient. Ignored rows skip the statistics.
template <typename T, int kN>
// With row_lse (cross_entropy_slice), the statistics pass is skipped: the row's lse is given and the label's column is
// label - first, held by this slice or not.
__global__ void cross_entropy_kernel(int64_t rows, int64_t vocab, int64_t ld, int64_t ld_grad, int64_t ignore_index,
                                     float grad_scale, int64_t first, const float* row_lse, const T* x,
                                     const int32_t* labels, float* loss, T* dx) {
  __shared__ float scratch[32];
  const int64_t packs = vocab / kN, tail = packs * kN;  // logits [tail, vocab) are read one at a time
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * ld;
    T* dxr = dx ? dx + r * ld_grad : nullptr;
    const int64_t label = labels[r] == ignore_index ? ignore_index : labels[r] - first;
    if (labels[r] == ignore_index) {
      if (threadIdx.x == 0) loss[r] = 0.0f;
      if (dxr) {
        Pack<T, kN> zero;
#pragma unroll
        for (int k = 0; k < kN; ++k) store(zero.e, k, 0.0f);
        for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) store_pack(dxr + p * kN, zero);
        for (int64_t j = tail + threadIdx.x; j < vocab; j += blockDim.x) store(dxr, j, 0.0f);
      }
      continue;
    }
    float m = -INFINITY, s = 0.0f;
    for (int64_t p = threadIdx.x; !row_lse && p < packs; p += blockDim.x) {
      const Pack<T, kN> v = load_pack<T, kN>(xr + p * kN);
      float f[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) f[k] = load(v.e, k);
      online_logsumexp_add(m, s, f);
    }
    for (int64_t j = tail + threadIdx.x; !row_lse && j < vocab; j += blockDim.x) {
      const float f[1] = {float(load(xr, j))};
      online_logsumexp_add(m, s, f);
    }
    float lse = 0.0f;
    if (row_lse) {
      lse = row_lse[r];
    } else {
      const float mx = block_reduce<float, true>(m, scratch);
      const float total = block_reduce<float, false>(m == -INFINITY ? s : s * expf(m - mx), scratch);
      lse = mx + logf(total);
    }
    // Labels are validated on the host before upload; an out-of-range one gives a NaN loss, not a bad read (a slice:
    // another slice's label, a zero loss part).
    const bool valid = label >= 0 && label < vocab;
    if (threadIdx.x == 0) loss[r] = valid ? lse - float(load(xr, label)) : row_lse ? 0.0f : NAN;
    if (dxr) {
      for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
        const Pack<T, kN> v = load_pack<T, kN>(xr + p * kN);
        Pack<T, kN> g;
#pragma unroll
        for (int k = 0; k < kN; ++k)
          store(g.e, k, grad_scale * (expf(load(v.e, k) - lse) - (p * kN + k == label ? 1.0f : 0.0f)));
        store_pack(dxr + p * kN, g);
      }
      for (int64_t j = tail + threadIdx.x; j < vocab; j += blockDim.x)
        store(dxr, j, grad_scale * (expf(load(xr, j) - lse) - (j == label ? 1.0f : 0.0f)));
    }
  }
}

}  // namespace

void launch_embedding(DType dtype, int64_t n_tokens, int64_t hidden, int64_t vocab, int64_t first, const void* weight,
                      const int32_t* ids, void* out, cudaStream_t stream) {
  if (n_tokens == 0 || hidden == 0) return;
  dispatch_f32_bf16_f16(dtype, "embedding dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const auto* pw = static_cast<const T*>(weight);
    auto* po = static_cast<T*>(out);
    constexpr int kN = kPackOf16<T>;
    if (hidden % kN == 0 && aligned16(pw) && aligned16(po))
      embedding_kernel<T, kN><<<grid_for(n_tokens * (hidden / kN), kThreads), kThreads, 0, stream>>>(
          n_tokens, hidden, vocab, first, pw, ids, po);
    else
      embedding_kernel<T, 1><<<grid_for(n_tokens * hidden, kThreads), kThreads, 0, stream>>>(n_tokens, hidden, vocab,
                                                                                          first, pw, ids, po);
  });
  LATHE_CUDA_LAUNCH_CHECK("embedding_kernel");
}

void launch_gather_sum(DType dtype, int64_t m, int64_t s, int64_t n, int64_t d, const void* rows,
                       const int32_t* index, const void* weights, void* out, cudaStream_t stream) {
  if (m == 0 || d == 0) return;
  dispatch_f32_bf16_f16(dtype, "gather_sum dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const auto* px = static_cast<const T*>(rows);
    const auto* pw = static_cast<const T*>(weights);
    auto* po = static_cast<T*>(out);
    constexpr int kN = kPackOf16<T>;
    if (d % kN == 0 && aligned16(px) && aligned16(po))
      gather_sum_kernel<T, kN><<<grid_for(m * (d / kN), kThreads), kThreads, 0, stream>>>(m, s, n, d, px, index, pw, po);
    else
      gather_sum_kernel<T, 1><<<grid_for(m * d, kThreads), kThreads, 0, stream>>>(m, s, n, d, px, index, pw, po);
  });
  LATHE_CUDA_LAUNCH_CHECK("gather_sum_kernel");
}

size_t embedding_backward_scratch_bytes(int64_t n_tokens) {
  if (n_tokens == 0) return 0;
  return 3 * align256(size_t(n_tokens) * sizeof(int32_t)) + align256(radix_sort_pairs_temp_bytes(n_tokens));
}

void launch_embedding_backward(DType dtype, int64_t n_tokens, int64_t hidden, int64_t vocab, int64_t first,
                               const void* dy, const int32_t* ids, bool accumulate, void* scratch, void* dweight,
                               cudaStream_t stream) {
  const int64_t n = vocab * hidden;
  if (n == 0) return;
  if (!accumulate) LATHE_CUDA_CHECK(cudaMemsetAsync(dweight, 0, size_t(n) * dtype_size(dtype), stream));
  if (n_tokens == 0) return;
  // scratch: token indices, sorted ids, sorted tokens, then cub's storage
  const size_t ints = align256(size_t(n_tokens) * sizeof(int32_t));
  auto* base = static_cast<uint8_t*>(scratch);
  auto* tokens = reinterpret_cast<int32_t*>(base);
  auto* sorted_ids = reinterpret_cast<int32_t*>(base + ints);
  auto* sorted_tokens = reinterpret_cast<int32_t*>(base + 2 * ints);
  size_t temp = radix_sort_pairs_temp_bytes(n_tokens);
  iota_kernel<<<grid_for(n_tokens, kThreads), kThreads, 0, stream>>>(n_tokens, tokens);
  LATHE_CUDA_LAUNCH_CHECK("iota_kernel");
  // The bits the ids use (non-negative below vocab: validated on the host). A vocab-parallel slice (first > 0) sees
  // every slice's ids, whose range it does not know: all 31 bits.
  int end_bit = first > 0 ? 31 : 1;
  while (end_bit < 31 && (int64_t(1) << end_bit) < vocab) ++end_bit;
  LATHE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + 3 * ints, temp, ids, sorted_ids, tokens, sorted_tokens,
                                                   n_tokens, 0, end_bit, stream));
  dispatch_f32_bf16_f16(dtype, "embedding_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    embedding_sorted_sum_kernel<T><<<rows_grid(n_tokens), 128, 0, stream>>>(
        n_tokens, hidden, vocab, first, accumulate, static_cast<const T*>(dy), sorted_ids, sorted_tokens,
        static_cast<T*>(dweight));
  });
  LATHE_CUDA_LAUNCH_CHECK("embedding_sorted_sum_kernel");
}

namespace {

// rmsnorm (kGated false, z null), residual_rmsnorm (res and hsum not null) and gated_rmsnorm.
template <bool kGated>
void launch_norm(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x, const void* res,
                 void* hsum, const void* w, const void* z, void* y, cudaStream_t stream) {
  if (rows == 0 || h == 0) return;
  const bool packed = aligned16(x) && aligned16(w) && (!kGated || aligned16(z)) && aligned16(y) &&
                      (!res || (aligned16(res) && aligned16(hsum)));
  dispatch_f32_bf16_f16(dtype, "rmsnorm dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    dispatch_norm<T, 8>(h, packed, [&](auto shape) {
      using S = decltype(shape);
      rmsnorm_kernel<kGated, T, S::pack, S::cached, S::lanes>
          <<<grid_for(rows, S::rows_per_block), kNormThreads, 0, stream>>>(
          rows, h, float(eps), float(offset), static_cast<const T*>(x), static_cast<const T*>(res),
          static_cast<T*>(hsum), static_cast<const T*>(w), static_cast<const T*>(z), static_cast<T*>(y));
    });
  });
  LATHE_CUDA_LAUNCH_CHECK("rmsnorm_kernel");
}

// dw (h) = the sum of the (n_partial, h) partial rows at `scratch`, in the fixed order of column_group_sum_kernel and
// column_sum_kernel; the group sums go after the partial rows (norm_backward_scratch_floats).
template <typename T>
void sum_partial_rows(int64_t n_partial, int64_t h, float* scratch, void* dw, cudaStream_t stream) {
  const int64_t groups = (n_partial + kNormGroup - 1) / kNormGroup;
  float* sums = scratch + n_partial * h;
  const unsigned tiles = unsigned((h + kColumnTile - 1) / kColumnTile);
  column_group_sum_kernel<<<dim3(tiles, unsigned(groups)), kColumnTile * kColumnRowLanes, 0, stream>>>(
      n_partial, h, scratch, sums);
  LATHE_CUDA_LAUNCH_CHECK("column_group_sum_kernel");
  column_sum_kernel<T><<<grid_for(h, kThreads), kThreads, 0, stream>>>(groups, h, sums, static_cast<T*>(dw));
  LATHE_CUDA_LAUNCH_CHECK("column_sum_kernel");
}

// Calls f(std::integral_constant<int, kLanes>{}) for the qk_norm_rope kernels' lane count at head dim d (d / pack of
// 8, 16 or 32), or returns false.
template <typename T, typename F> bool dispatch_qk_lanes(int64_t d, F f) {
  constexpr int64_t kN = kPackOf16<T>;
  if (d == 8 * kN) f(std::integral_constant<int, 8>{});
  else if (d == 16 * kN) f(std::integral_constant<int, 16>{});
  else if (d == 32 * kN) f(std::integral_constant<int, 32>{});
  else return false;
  return true;
}

// rmsnorm_backward (kGated false, z and dz null), residual_rmsnorm_backward (dres not null) and
// gated_rmsnorm_backward.
template <bool kGated>
void launch_norm_backward(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                          const void* w, const void* z, const void* dy, const void* dres, void* dx, void* dw, void* dz,
                          float* scratch, cudaStream_t stream) {
  if (h == 0) return;
  if (rows == 0) {  // no rows: dw is zero (every dtype's zero is all-zero bytes)
    LATHE_CUDA_CHECK(cudaMemsetAsync(dw, 0, size_t(h) * dtype_size(dtype), stream));
    return;
  }
  const int64_t n_partial = norm_partials(rows, h);
  const bool packed = aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx) &&
                      (!kGated || (aligned16(z) && aligned16(dz))) && (!dres || aligned16(dres));
  dispatch_f32_bf16_f16(dtype, "rmsnorm_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    dispatch_norm<T, 4>(h, packed, [&](auto shape) {
      using S = decltype(shape);
      const int blocks = int((n_partial + S::rows_per_block - 1) / S::rows_per_block);
      rmsnorm_backward_kernel<kGated, T, S::pack, S::cached, S::lanes><<<blocks, kNormThreads, 0, stream>>>(
          rows, h, n_partial, float(eps), float(offset), static_cast<const T*>(x), static_cast<const T*>(w),
          static_cast<const T*>(z), static_cast<const T*>(dy), static_cast<const T*>(dres), static_cast<T*>(dx),
          static_cast<T*>(dz), scratch);
    });
    LATHE_CUDA_LAUNCH_CHECK("rmsnorm_backward_kernel");
    sum_partial_rows<T>(n_partial, h, scratch, dw, stream);
  });
}

}  // namespace

void launch_rmsnorm(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x, const void* w,
                    void* y, cudaStream_t stream) {
  launch_norm<false>(dtype, rows, h, eps, offset, x, nullptr, nullptr, w, nullptr, y, stream);
}

void launch_residual_rmsnorm(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                             const void* res, const void* w, void* y, void* hsum, cudaStream_t stream) {
  launch_norm<false>(dtype, rows, h, eps, offset, x, res, hsum, w, nullptr, y, stream);
}

void launch_gated_rmsnorm(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                          const void* w, const void* z, void* y, cudaStream_t stream) {
  launch_norm<true>(dtype, rows, h, eps, offset, x, nullptr, nullptr, w, z, y, stream);
}

int64_t rmsnorm_backward_scratch_floats(int64_t rows, int64_t h) {
  const int64_t n_partial = norm_partials(rows, h);
  return (n_partial + (n_partial + kNormGroup - 1) / kNormGroup) * h;  // partial rows, then the group sums
}

void launch_rmsnorm_backward(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                             const void* w, const void* dy, void* dx, void* dw, float* scratch, cudaStream_t stream) {
  launch_norm_backward<false>(dtype, rows, h, eps, offset, x, w, nullptr, dy, nullptr, dx, dw, nullptr, scratch,
                              stream);
}

void launch_residual_rmsnorm_backward(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                                      const void* w, const void* dy, const void* dres, void* dx, void* dw,
                                      float* scratch, cudaStream_t stream) {
  launch_norm_backward<false>(dtype, rows, h, eps, offset, x, w, nullptr, dy, dres, dx, dw, nullptr, scratch, stream);
}

void launch_gated_rmsnorm_backward(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                                   const void* w, const void* z, const void* dy, void* dx, void* dw, void* dz,
                                   float* scratch, cudaStream_t stream) {
  launch_norm_backward<true>(dtype, rows, h, eps, offset, x, w, z, dy, nullptr, dx, dw, dz, scratch, stream);
}

void launch_rope(DType dtype, int64_t tokens, int64_t heads, int64_t d, int64_t half, bool inverse,
                 const RopeFrequencies& freqs, const void* x, const int32_t* positions, void* y, cudaStream_t stream) {
  const int64_t n = tokens * heads * d;
  if (n == 0) return;
  if (half > kMaxRopeHalf) throw_cuda_error("rope (rotary dim above 512)", cudaErrorInvalidValue, __FILE__, __LINE__);
  dispatch_f32_bf16_f16(dtype, "rope dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const int64_t threads = tokens * (d - half);
    rope_kernel<T><<<grid_for(threads, kThreads), kThreads, 0, stream>>>(tokens, heads, d, half, inverse, freqs,
                                                                         static_cast<const T*>(x), positions, static_cast<T*>(y));
  });
  LATHE_CUDA_LAUNCH_CHECK("rope_kernel");
}

bool qk_norm_rope_supported(DType dtype, int64_t d) {
  bool ok = false;
  dispatch_f32_bf16_f16(dtype, "qk_norm_rope dispatch (unsupported dtype)", [&](auto t) {
    ok = dispatch_qk_lanes<decltype(t)>(d, [](auto) {});
  });
  return ok;
}

int64_t qk_norm_rope_backward_scratch_floats(int64_t tokens, int64_t d) {
  return 2 * rmsnorm_backward_scratch_floats(tokens, d);  // q's partial rows and group sums, then k's
}

void launch_qk_norm_rope(DType dtype, int64_t tokens, int64_t hq, int64_t hkv, int64_t d, double eps, double offset,
                         const RopeFrequencies& freqs, const void* qkv, const void* wq, const void* wk,
                         const int32_t* positions, void* q, void* k, void* v, cudaStream_t stream) {
  if (tokens == 0) return;
  dispatch_f32_bf16_f16(dtype, "qk_norm_rope dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const bool ok = dispatch_qk_lanes<T>(d, [&](auto lanes) {
      constexpr int kLanes = decltype(lanes)::value;
      const int blocks = grid_for(tokens * (hq + 2 * hkv), kNormThreads / kLanes);
      qk_norm_rope_kernel<T, kPackOf16<T>, kLanes><<<blocks, kNormThreads, 0, stream>>>(
          tokens, hq, hkv, float(eps), float(offset), freqs, static_cast<const T*>(qkv), static_cast<const T*>(wq),
          static_cast<const T*>(wk), positions, static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v));
    });
    if (!ok)
      throw_cuda_error("qk_norm_rope (head dim not 8, 16 or 32 packs)", cudaErrorInvalidValue, __FILE__, __LINE__);
  });
  LATHE_CUDA_LAUNCH_CHECK("qk_norm_rope_kernel");
}

void launch_qk_norm_rope_backward(DType dtype, int64_t tokens, int64_t hq, int64_t hkv, int64_t d, double eps,
                                  double offset, const RopeFrequencies& freqs, const void* qkv, const void* wq,
                                  const void* wk, const int32_t* positions, const void* dq, const void* dk,
                                  const void* dv, void* dqkv, void* dwq, void* dwk, float* scratch,
                                  cudaStream_t stream) {
  if (tokens == 0) {  // no rows: dwq and dwk are zero
    LATHE_CUDA_CHECK(cudaMemsetAsync(dwq, 0, size_t(d) * dtype_size(dtype), stream));
    LATHE_CUDA_CHECK(cudaMemsetAsync(dwk, 0, size_t(d) * dtype_size(dtype), stream));
    return;
  }
  const int64_t n_partial = norm_partials(tokens, d);
  float* scratch_k = scratch + rmsnorm_backward_scratch_floats(tokens, d);
  dispatch_f32_bf16_f16(dtype, "qk_norm_rope_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const bool ok = dispatch_qk_lanes<T>(d, [&](auto lanes) {
      constexpr int kLanes = decltype(lanes)::value;
      const int blocks = int((n_partial * kLanes + kNormThreads - 1) / kNormThreads);
      qk_norm_rope_backward_kernel<T, kPackOf16<T>, kLanes><<<blocks, kNormThreads, 0, stream>>>(
          tokens, hq, hkv, n_partial, float(eps), float(offset), freqs, static_cast<const T*>(qkv),
          static_cast<const T*>(wq), static_cast<const T*>(wk), positions, static_cast<const T*>(dq),
          static_cast<const T*>(dk), static_cast<const T*>(dv), static_cast<T*>(dqkv), scratch, scratch_k);
    });
    if (!ok) {
      throw_cuda_error("qk_norm_rope_backward (head dim not 8, 16 or 32 packs)", cudaErrorInvalidValue, __FILE__,
                       __LINE__);
    }
    LATHE_CUDA_LAUNCH_CHECK("qk_norm_rope_backward_kernel");
    sum_partial_rows<T>(n_partial, d, scratch, dwq, stream);
    sum_partial_rows<T>(n_partial, d, scratch_k, dwk, stream);
  });
}

void launch_swiglu(DType dtype, int64_t n, const void* g, const void* u, void* y, cudaStream_t stream) {
  if (n == 0) return;
  dispatch_f32_bf16_f16(dtype, "swiglu dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const auto* pg = static_cast<const T*>(g);
    const auto* pu = static_cast<const T*>(u);
    auto* py = static_cast<T*>(y);
    constexpr int kN = kPackOf16<T>;
    if (aligned16(pg) && aligned16(pu) && aligned16(py))
      swiglu_kernel<T, kN><<<grid_for((n + kN - 1) / kN, kThreads), kThreads, 0, stream>>>(n, pg, pu, py);
    else
      swiglu_kernel<T, 1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, pg, pu, py);
  });
  LATHE_CUDA_LAUNCH_CHECK("swiglu_kernel");
}

void launch_swiglu_backward(DType dtype, int64_t n, const void* g, const void* u, const void* dy, void* dg, void* du,
                            cudaStream_t stream) {
  if (n == 0) return;
  dispatch_f32_bf16_f16(dtype, "swiglu_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const auto* pg = static_cast<const T*>(g);
    const auto* pu = static_cast<const T*>(u);
    const auto* pdy = static_cast<const T*>(dy);
    auto* pdg = static_cast<T*>(dg);
    auto* pdu = static_cast<T*>(du);
    constexpr int kN = kPackOf16<T>;
    if (aligned16(pg) && aligned16(pu) && aligned16(pdy) && aligned16(pdg) && aligned16(pdu))
      swiglu_backward_kernel<T, kN><<<grid_for((n + kN - 1) / kN, kThreads), kThreads, 0, stream>>>(n, pg, pu, pdy,
                                                                                                     pdg, pdu);
    else
      swiglu_backward_kernel<T, 1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(n, pg, pu, pdy, pdg, pdu);
  });
  LATHE_CUDA_LAUNCH_CHECK("swiglu_backward_kernel");
}

void launch_swiglu_halves(DType dtype, int64_t rows, int64_t cols, const void* gu, void* y, cudaStream_t stream) {
  if (rows * cols == 0) return;
  dispatch_f32_bf16_f16(dtype, "swiglu_halves dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    constexpr int kN = kPackOf16<T>;
    const auto* pgu = static_cast<const T*>(gu);
    auto* py = static_cast<T*>(y);
    if (cols % kN == 0 && aligned16(pgu) && aligned16(py))
      swiglu_halves_kernel<T, kN><<<grid_for(rows * cols / kN, kThreads), kThreads, 0, stream>>>(rows, cols, pgu, py);
    else
      swiglu_halves_kernel<T, 1><<<grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(rows, cols, pgu, py);
  });
  LATHE_CUDA_LAUNCH_CHECK("swiglu_halves_kernel");
}

void launch_swiglu_halves_backward(DType dtype, int64_t rows, int64_t cols, const void* gu, const void* dy, void* dgu,
                                   cudaStream_t stream) {
  if (rows * cols == 0) return;
  dispatch_f32_bf16_f16(dtype, "swiglu_halves_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    constexpr int kN = kPackOf16<T>;
    const auto* pgu = static_cast<const T*>(gu);
    const auto* pdy = static_cast<const T*>(dy);
    auto* pd = static_cast<T*>(dgu);
    if (cols % kN == 0 && aligned16(pgu) && aligned16(pdy) && aligned16(pd))
      swiglu_halves_backward_kernel<T, kN><<<grid_for(rows * cols / kN, kThreads), kThreads, 0, stream>>>(
          rows, cols, pgu, pdy, pd);
    else
      swiglu_halves_backward_kernel<T, 1><<<grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(rows, cols, pgu,
                                                                                                   pdy, pd);
  });
  LATHE_CUDA_LAUNCH_CHECK("swiglu_halves_backward_kernel");
}

void launch_attention(DType dtype, const AttentionDims& dims, const void* q, const void* k, const void* v,
                      const int32_t* cu_seqlens, void* o, float* lse, cudaStream_t stream) {
  const int64_t rows = dims.tokens * dims.q_heads;
  if (rows == 0 || dims.head_dim == 0) return;
  dispatch_f32_bf16_f16(dtype, "attention dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    dispatch_head_dim(dims.head_dim, [&](auto c) {
      attention_forward_kernel<T, decltype(c)::value><<<grid_for(rows * 32, kAttnThreads), kAttnThreads, 0, stream>>>(
          dims, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), cu_seqlens,
          static_cast<T*>(o), lse);
    });
  });
  LATHE_CUDA_LAUNCH_CHECK("attention_forward_kernel");
}

void launch_attention_backward(DType dtype, const AttentionDims& dims, const void* q, const void* k, const void* v,
                               const void* o, const float* lse, const void* dout, const int32_t* cu_seqlens,
                               void* dq, void* dk, void* dv, float* delta, cudaStream_t stream) {
  const int64_t rows = dims.tokens * dims.q_heads, kv_rows = dims.tokens * dims.kv_heads;
  if (rows == 0 || dims.head_dim == 0) return;
  dispatch_f32_bf16_f16(dtype, "attention_backward dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    dispatch_head_dim(dims.head_dim, [&](auto c) {
      constexpr int kC = decltype(c)::value;
      attention_backward_dq_kernel<T, kC><<<grid_for(rows * 32, kAttnThreads), kAttnThreads, 0, stream>>>(
          dims, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(o),
          lse, static_cast<const T*>(dout), cu_seqlens, static_cast<T*>(dq), delta);
      LATHE_CUDA_LAUNCH_CHECK("attention_backward_dq_kernel");
      attention_backward_dkdv_kernel<T, kC><<<grid_for(kv_rows * 32, kAttnThreads), kAttnThreads, 0, stream>>>(
          dims, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), lse,
          static_cast<const T*>(dout), cu_seqlens, delta, static_cast<T*>(dk), static_cast<T*>(dv));
      LATHE_CUDA_LAUNCH_CHECK("attention_backward_dkdv_kernel");
    });
  });
}

void launch_cross_entropy(DType dtype, int64_t rows, int64_t vocab, int64_t ld, int64_t ld_grad, int64_t ignore_index,
                          double grad_scale, int64_t first, const float* row_lse, const void* logits,
                          const int32_t* labels, float* loss, void* dlogits, cudaStream_t stream) {
  if (rows == 0) return;
  const int threads = vocab >= 8192 ? 512 : 128;
  dispatch_f32_bf16_f16(dtype, "cross_entropy dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    constexpr int kN = kPackOf16<T>;
    const auto* x = static_cast<const T*>(logits);
    auto* dx = static_cast<T*>(dlogits);
    if (ld % kN == 0 && aligned16(x) && (!dx || (ld_grad % kN == 0 && aligned16(dx))))  // rows start on 16 bytes
      cross_entropy_kernel<T, kN><<<rows_grid(rows), threads, 0, stream>>>(
          rows, vocab, ld, ld_grad, ignore_index, float(grad_scale), first, row_lse, x, labels, loss, dx);
    else
      cross_entropy_kernel<T, 1><<<rows_grid(rows), threads, 0, stream>>>(
          rows, vocab, ld, ld_grad, ignore_index, float(grad_scale), first, row_lse, x, labels, loss, dx);
  });
  LATHE_CUDA_LAUNCH_CHECK("cross_entropy_kernel");
}

}  // namespace lathe::cuda
