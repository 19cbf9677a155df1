// paged_attention with the cache read through an asynchronous copy pipeline (cuda/paged_attention_pipelined): the
// block layout of paged.cu's packed kernel — a block per (query token, group of up to 8 query heads sharing one kv
// head, split of the context), four warps, a key or value row of D = L x kN elements read by L lanes with 16-byte
// accesses, 32 / L "slots" a warp — but each slot takes a chunk of kU consecutive positions (one page: kU divides the
// block size, a power of two, so the page index is a shift and one table read serves the chunk), and copies its
// chunks' rows into its own ring of kStages shared-memory stages with cp.async, kStages - 1 chunks ahead of the one it
// computes. A lane reads back only the 16 bytes it copied itself, so no barrier is needed inside the loop. The paged
// kernel of paged.cu waited for each chunk's loads before computing it (and divided 64-bit positions by the block
// size): at 256 sequences of ~810 positions it read the cache at 55% of the copy rate (docs/rollout.md).
// After the loop the stages' memory holds the slots' merge (paged_device.cuh: merge_slots). Splits as paged.cu's.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "backend/cuda/paged_device.cuh"
#include "backend/cuda/paged_launchers.h"

namespace lathe::cuda {

namespace {

constexpr int kWarps = 4;

template <int kU, int kStages>
constexpr size_t ring_bytes() {
  return size_t(kWarps) * kStages * kU * 2 * 32 * 16;
}

template <int kSlots, int G, int kD>
constexpr size_t merge_bytes() {
  return size_t(kSlots) * G * (kD + 2) * sizeof(float);
}

template <typename T, int G, int L, int kU, int kStages>
__global__ void __launch_bounds__(32 * kWarps)
    paged_pipelined_kernel(int64_t q_heads, int64_t kv_heads, int bs_shift, int64_t batch, int64_t width,
                           int64_t split_len, float scale, const T* q, const T* kc, const T* vc, const int32_t* table,
                           const int32_t* cu, const int32_t* ctx, T* o, float* part) {
  constexpr int kN = kPackOf16<T>, kD = L * kN, kSub = 32 / L, kSlots = kWarps * kSub;
  extern __shared__ uint4 smem[];
  const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32), sl = lane % L, slot = warp * kSub + lane / L;
  const BlockQuery at = block_query(G, q_heads, kv_heads, batch, split_len, cu, ctx);
  const int64_t i = at.i, h0 = at.h0, b = at.b, kh = at.kh, begin = at.begin, end = at.end;  // (issue() captures them)
  float qv[G][kN], acc[G][kN], mx[G], sum[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const Pack<T, kN> x = load_pack<T, kN>(q + (i * q_heads + h0 + g) * kD + sl * kN);
    mx[g] = -INFINITY;
    sum[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      qv[g][e] = float(x.e[e]) * scale;
      acc[g][e] = 0.0f;
    }
  }
  // Chunk c holds positions [c kU, (c + 1) kU); split_len is a multiple of kU, so the split's chunks are whole. Slot s
  // takes chunks c_begin + s, + kSlots, ...; the warp iterates while its first slot has a chunk (every lane then
  // takes part in every shuffle).
  const int64_t c_begin = begin / kU, c_end = (end + kU - 1) / kU, first = c_begin + warp * kSub;
  const int iters = first < c_end ? int((c_end - first + kSlots - 1) / kSlots) : 0;
  uint4* ring = smem + int64_t(warp) * kStages * kU * 2 * 32;  // [stage][u][key, value][lane]
  const int32_t* pages = table + b * width;
  const int64_t in_page = (int64_t(1) << bs_shift) - 1;
  const auto issue = [&](int t) {  // starts copying iteration t's chunk into its stage (an empty group past the end)
    const int64_t c = c_begin + int64_t(t) * kSlots + slot;
    if (t < iters && c < c_end) {
      uint4* stage = ring + (t % kStages) * kU * 2 * 32;
      const int64_t j = c * kU;
      const int64_t row = ((int64_t(pages[j >> bs_shift]) << bs_shift) + (j & in_page)) * kv_heads + kh;
#pragma unroll
      for (int u = 0; u < kU; ++u) {  // positions past the end read nothing and land as zeros
        const int64_t at = (row + u * kv_heads) * kD + sl * kN;
        cp_async16(stage + (2 * u) * 32 + lane, kc + at, j + u < end);
        cp_async16(stage + (2 * u + 1) * 32 + lane, vc + at, j + u < end);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) issue(t);
  for (int t = 0; t < iters; ++t) {
    __syncwarp();  // the stage issue() refills now was read in iteration t - 1
    issue(t + kStages - 1);
    cp_async_wait<kStages - 1>();
    const uint4* stage = ring + (t % kStages) * kU * 2 * 32;
    const int64_t j = (c_begin + int64_t(t) * kSlots + slot) * kU;
    Pack<T, kN> kp[kU], vp[kU];
    bool ok[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      ok[u] = j + u < end;  // also false for a slot without a chunk in this iteration (j >= c_end kU >= end)
      memcpy(&kp[u], &stage[(2 * u) * 32 + lane], 16);
      memcpy(&vp[u], &stage[(2 * u + 1) * 32 + lane], 16);
    }
    float score[G][kU];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kN; ++e) dot += qv[g][e] * float(kp[u].e[e]);
#pragma unroll
        for (int x = L / 2; x > 0; x >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, x);
        score[g][u] = ok[u] ? dot : -INFINITY;
      }
    if (!ok[0]) continue;  // this slot has no chunk in this iteration (its stage holds an older one)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float nm = mx[g];
#pragma unroll
      for (int u = 0; u < kU; ++u) nm = fmaxf(nm, score[g][u]);
      const float corr = expf(mx[g] - nm);
      float p[kU], ps = 0.0f;
#pragma unroll
      for (int u = 0; u < kU; ++u) ps += (p[u] = expf(score[g][u] - nm));
      sum[g] = sum[g] * corr + ps;
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        float a = acc[g][e] * corr;
#pragma unroll
        for (int u = 0; u < kU; ++u) a += p[u] * float(vp[u].e[e]);
        acc[g][e] = a;
      }
      mx[g] = nm;
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its ring: the memory now holds the merge
  auto& merge_acc = *reinterpret_cast<float (*)[kSlots][G][kD]>(smem);
  auto& merge_m = *reinterpret_cast<float (*)[kSlots][G]>(reinterpret_cast<float*>(smem) + kSlots * G * kD);
  auto& merge_l = *reinterpret_cast<float (*)[kSlots][G]>(reinterpret_cast<float*>(smem) + kSlots * G * (kD + 1));
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < kN; ++e) merge_acc[slot][g][sl * kN + e] = acc[g][e];
    if (sl == 0) merge_m[slot][g] = mx[g], merge_l[slot][g] = sum[g];
  }
  __syncthreads();
  merge_slots<kSlots, G, kD>(merge_acc, merge_m, merge_l, kD, i, q_heads, h0, at.split, at.splits, o, part);
}

int log2_of(int64_t x) {
  int s = 0;
  while ((int64_t(1) << s) < x) ++s;
  return s;
}

}  // namespace

bool paged_attention_pipelined_applies(DType dtype, int64_t head_dim, int64_t block_size) {
  const int64_t row_bytes = head_dim * int64_t(dtype_size(dtype));
  const bool power_of_two = block_size > 0 && (block_size & (block_size - 1)) == 0;
  return (row_bytes == 128 || row_bytes == 256 || row_bytes == 512) && power_of_two && block_size >= 4 &&
         (dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16);
}

void launch_paged_attention_pipelined(DType dtype, int64_t tokens, int64_t q_heads, int64_t kv_heads,
                                      int64_t head_dim, int64_t block_size, int64_t batch, int64_t table_width,
                                      int64_t splits, float scale, const void* q, const void* k_cache,
                                      const void* v_cache, const int32_t* table, const int32_t* cu_q,
                                      const int32_t* context_lens, void* o, float* workspace, PagedPipeline pipe,
                                      cudaStream_t stream) {
  if (tokens == 0) return;
  const int64_t g = heads_a_block(q_heads / kv_heads);
  const dim3 grid(unsigned(tokens), unsigned(q_heads / g), unsigned(splits));
  dispatch_f32_bf16_f16(dtype, "paged_attention_pipelined dispatch (unsupported dtype)", [&](auto t) {
    using T = decltype(t);
    const int64_t row_bytes = head_dim * int64_t(sizeof(T));
    const auto run = [&](auto heads, auto lanes, auto positions, auto stages) {
      constexpr int G = decltype(heads)::value, L = decltype(lanes)::value, kU = decltype(positions)::value,
                    kStages = decltype(stages)::value;
      constexpr int kSlots = kWarps * (32 / L), kD = L * kPackOf16<T>;
      constexpr size_t bytes = std::max(ring_bytes<kU, kStages>(), merge_bytes<kSlots, G, kD>());
      static_assert(bytes <= 48 * 1024, "the kernel's shared memory must fit the default limit");
      const int64_t per_split = (table_width * block_size + splits - 1) / splits;
      const int64_t split_len = (per_split + kU - 1) / kU * kU;
      paged_pipelined_kernel<T, G, L, kU, kStages><<<grid, 32 * kWarps, bytes, stream>>>(
          q_heads, kv_heads, log2_of(block_size), batch, table_width, split_len, scale, static_cast<const T*>(q),
          static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), table, cu_q, context_lens,
          static_cast<T*>(o), workspace);
    };
    const auto with_pipe = [&](auto heads, auto lanes) {
      // The default pipeline for every shape; the others (bench/paged_attention_bench.cpp) for 128-value bf16 rows.
      if (pipe.positions == 4 && pipe.stages == 3) return run(heads, lanes, std::integral_constant<int, 4>{},
                                                              std::integral_constant<int, 3>{});
      if constexpr (std::is_same_v<T, __nv_bfloat16> && decltype(lanes)::value == 16) {
        if (pipe.positions == 4 && pipe.stages == 2)
          return run(heads, lanes, std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{});
        if (pipe.positions == 2 && pipe.stages == 4)
          return run(heads, lanes, std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{});
        if (pipe.positions == 2 && pipe.stages == 6)
          return run(heads, lanes, std::integral_constant<int, 2>{}, std::integral_constant<int, 6>{});
      }
      throw_cuda_error("paged_attention_pipelined: no kernel built for this pipeline", cudaErrorInvalidValue,
                       __FILE__, __LINE__);
    };
    const auto with_lanes = [&](auto heads) {
      if (row_bytes == 128) with_pipe(heads, std::integral_constant<int, 8>{});
      else if (row_bytes == 256) with_pipe(heads, std::integral_constant<int, 16>{});
      else with_pipe(heads, std::integral_constant<int, 32>{});
    };
    with_heads_a_block(q_heads / kv_heads, with_lanes);
    LATHE_CUDA_LAUNCH_CHECK("paged_pipelined_kernel");
    merge_paged_splits(tokens, q_heads, head_dim, splits, workspace, static_cast<T*>(o), stream);
  });
}

}  // namespace lathe::cuda
