// CUDA moe_route (formulas and layouts at MoeRouteAttrs in ops/op_table.h; backend/cpu/moe_route.cpp is the spec):
//  1. one warp per token: the row's softmax in fp32 (max and sum by warp reductions), then k rounds of a warp argmax
//     (larger probability first, ties to the lower expert index: the CPU's total order), the picked sum in rank
//     order; a row with a non-finite logit gets the CPU's placeholder choice and its token is reported through an
//     atomicMin (the result does not depend on the order);
//  2. the plan: cub's stable radix sort of the pairs by expert (values: the pair index, so each expert's pairs stay in
//     (token, slot) order), then one thread per sorted row writes its token, the inverse permutation and, at each
//     change of expert, the offsets. No floating-point atomics: the plan is a pure function of the choices.
// moe_pad_plan: one thread per padded row (MoePadAttrs).
#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/model_launchers.h"
#include "backend/cuda/radix_sort_scratch.cuh"

namespace lathe::cuda {

namespace {

constexpr int kRouteWarps = 4;  // tokens per block of the routing kernel
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int32_t kNoBadToken = 0x7f7f7f7f;  // what cudaMemsetAsync(0x7f) leaves: above any token index

__global__ void route_rows_kernel(int64_t tokens, int experts, int k, bool norm, const float* logits, float* probs,
                                  float* weights, int32_t* picked, float* inv_sum, int32_t* bad) {
  extern __shared__ float shared_probs[];  // kRouteWarps rows of `experts`
  const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32);
  float* p = shared_probs + warp * experts;
  for (int64_t t = blockIdx.x * int64_t(kRouteWarps) + warp; t < tokens; t += int64_t(gridDim.x) * kRouteWarps) {
    const float* row = logits + t * experts;
    float* prow = probs + t * experts;
    float* w = weights + t * k;
    int32_t* pk = picked + t * k;
    bool finite = true;
    float mx = -INFINITY;
    for (int e = lane; e < experts; e += 32) {
      const float v = row[e];
      finite = finite && isfinite(v);
      mx = fmaxf(mx, v);
    }
    if (!__all_sync(kFullMask, finite)) {  // the CPU's placeholder: experts 0 .. k-1, weight 0, probabilities 0
      for (int e = lane; e < experts; e += 32) prow[e] = 0.0f;
      for (int j = lane; j < k; j += 32) {
        pk[j] = int32_t(t * experts + j);
        w[j] = 0.0f;
      }
      if (lane == 0) {
        inv_sum[t] = 1.0f;
        atomicMin(bad, int32_t(t));
      }
      continue;
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < experts; e += 32) {
      const float v = expf(row[e] - mx);
      p[e] = v;
      sum += v;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < experts; e += 32) prow[e] = p[e] = p[e] / sum;
    __syncwarp();
    float s = 0.0f;  // the picked probabilities summed in rank order (every lane holds the same)
    for (int j = 0; j < k; ++j) {
      float bv = -1.0f;  // taken entries hold -1; probabilities are >= 0
      int bi = experts;
      for (int e = lane; e < experts; e += 32)
        if (p[e] > bv) {  // ascending e: a tie keeps the lower index
          bv = p[e];
          bi = e;
        }
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(kFullMask, bv, o);
        const int oi = __shfl_xor_sync(kFullMask, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
          bv = ov;
          bi = oi;
        }
      }
      __syncwarp();
      if (lane == 0) {
        p[bi] = -1.0f;
        pk[j] = int32_t(t * experts + bi);
        w[j] = bv;
      }
      s += bv;
      __syncwarp();
    }
    if (norm)
      for (int j = lane; j < k; j += 32) w[j] = w[j] / s;
    if (lane == 0) inv_sum[t] = norm ? 1.0f / s : 1.0f;
  }
}

// keys: the expert of each pair (picked t E + e minus t E); values: the pair index.
__global__ void plan_keys_kernel(int64_t pairs, int k, int experts, const int32_t* picked, int32_t* keys,
                                 int32_t* values) {
  for (int64_t i = global_thread(); i < pairs; i += grid_threads()) {
    keys[i] = picked[i] - int32_t(i / k) * experts;
    values[i] = int32_t(i);
  }
}

// One thread per sorted row: its token and the inverse permutation; the row where an expert's pairs begin writes that
// expert's offset (and those of the empty experts before it); the last row writes the offsets of the experts after it.
__global__ void plan_rows_kernel(int64_t pairs, int k, int experts, const int32_t* sorted_keys,
                                 const int32_t* sorted_pairs, int32_t* token, int32_t* position, int32_t* offsets,
                                 const int32_t* bad) {
  for (int64_t i = global_thread(); i < pairs; i += grid_threads()) {
    const int32_t pr = sorted_pairs[i];
    token[i] = pr / k;
    position[pr] = int32_t(i);
    const int e = sorted_keys[i], before = i > 0 ? sorted_keys[i - 1] : -1;
    for (int f = before + 1; f <= e; ++f) offsets[f] = int32_t(i);
    if (i == pairs - 1)
      for (int f = e + 1; f <= experts; ++f) offsets[f] = int32_t(pairs);
  }
  if (global_thread() == 0) {
    if (pairs == 0)
      for (int f = 0; f <= experts; ++f) offsets[f] = 0;
    offsets[experts + 1] = *bad == kNoBadToken ? -1 : *bad;
  }
}

// One thread per padded row q = e M + r (MoePadAttrs in ops/op_table.h).
__global__ void pad_plan_kernel(int64_t experts, int64_t m, int k, int64_t pairs, const int32_t* offsets,
                                const int32_t* pair, int32_t* pad_token, int32_t* pad_pair, int32_t* pad_position) {
  for (int64_t q = global_thread(); q < experts * m; q += grid_threads()) {
    const int64_t e = q / m, r = q % m;
    if (r < offsets[e + 1] - offsets[e]) {
      const int32_t pr = pair[offsets[e] + r];
      pad_token[q] = pr / k;
      pad_pair[q] = pr;
      pad_position[pr] = int32_t(q);
    } else {
      pad_token[q] = 0;
      pad_pair[q] = int32_t(pairs);
    }
  }
}

}  // namespace

size_t moe_route_scratch_bytes(int64_t pairs) {
  const size_t sort = pairs > 0 ? align256(radix_sort_pairs_temp_bytes(pairs)) : 0;
  return 256 + 3 * align256(size_t(pairs) * sizeof(int32_t)) + sort;
}

int64_t moe_route_max_experts() { return 2048; }  // kRouteWarps rows of fp32 in 32 KiB of shared memory

void launch_moe_route(const MoeRouteArgs& a, void* scratch, cudaStream_t stream) {
  const int64_t pairs = a.tokens * a.top_k;
  // scratch: the bad-token word, keys, sorted keys, pair indices, then cub's storage
  auto* base = static_cast<uint8_t*>(scratch);
  auto* bad = reinterpret_cast<int32_t*>(base);
  const size_t ints = align256(size_t(pairs) * sizeof(int32_t));
  auto* keys = reinterpret_cast<int32_t*>(base + 256);
  auto* sorted_keys = reinterpret_cast<int32_t*>(base + 256 + ints);
  auto* values = reinterpret_cast<int32_t*>(base + 256 + 2 * ints);
  LATHE_CUDA_CHECK(cudaMemsetAsync(bad, 0x7f, sizeof(int32_t), stream));
  const int experts = int(a.experts), k = int(a.top_k);
  if (a.tokens > 0) {
    const int blocks = grid_for(a.tokens, kRouteWarps);
    const size_t shared = size_t(kRouteWarps) * size_t(experts) * sizeof(float);
    route_rows_kernel<<<blocks, kRouteWarps * 32, shared, stream>>>(a.tokens, experts, k, a.norm_topk_prob, a.logits,
                                                                     a.probs, a.weights, a.picked, a.inv_sum, bad);
    LATHE_CUDA_LAUNCH_CHECK("route_rows_kernel");
    plan_keys_kernel<<<grid_for(pairs, 256), 256, 0, stream>>>(pairs, k, experts, a.picked, keys, values);
    LATHE_CUDA_LAUNCH_CHECK("plan_keys_kernel");
    int end_bit = 1;  // the bits expert indices use
    while (end_bit < 31 && (int64_t(1) << end_bit) < a.experts) ++end_bit;
    size_t temp = radix_sort_pairs_temp_bytes(pairs);
    LATHE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + 256 + 3 * ints, temp, keys, sorted_keys, values, a.pair,
                                                     pairs, 0, end_bit, stream));
  }
  plan_rows_kernel<<<grid_for(pairs, 256), 256, 0, stream>>>(pairs, k, experts, sorted_keys, a.pair, a.token,
                                                             a.position, a.offsets, bad);
  LATHE_CUDA_LAUNCH_CHECK("plan_rows_kernel");
}

void launch_moe_pad_plan(int64_t experts, int64_t rows_per_expert, int64_t top_k, int64_t pairs,
                         const int32_t* offsets, const int32_t* pair, int32_t* pad_token, int32_t* pad_pair,
                         int32_t* pad_position, cudaStream_t stream) {
  if (experts * rows_per_expert == 0) return;
  pad_plan_kernel<<<grid_for(experts * rows_per_expert, 256), 256, 0, stream>>>(
      experts, rows_per_expert, int(top_k), pairs, offsets, pair, pad_token, pad_pair, pad_position);
  LATHE_CUDA_LAUNCH_CHECK("pad_plan_kernel");
}

}  // namespace lathe::cuda
