// CUDA moe_ep_messages, moe_ep_slots, moe_ep_regroup and moe_ep_sources: expert parallelism's exchange plan on the
// device (formulas and layouts at MoeExchangeAttrs in ops/op_table.h; backend/cpu/moe_exchange.cpp is the spec):
//  - messages: one flag per (rank, token), whether the token has an expert on that rank, in rank-major order; cub's
//    exclusive sum of the flags is each sent token's place in the messages' list; one thread per flag then writes
//    back, tokens and the messages' lengths;
//  - slots: one thread per token sorts its k experts (insertion sort, k <= kMaxTopK) and fills its slots rank by rank;
//  - regroup: one thread per row finds its block by a binary search over the block starts;
//  - sources: one thread per slot writes the row it names (each row is named once: no two threads write one place; the
//    CPU kernel checks that, this one trusts the plan that made the table).
// Integer work only: every output is a pure function of the inputs (no atomics), so the plan is deterministic.
#include <cub/device/device_scan.cuh>

#include "backend/cuda/check.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/model_launchers.h"
#include "backend/cuda/radix_sort_scratch.cuh"

namespace lathe::cuda {

namespace {

constexpr int kMaxTopK = 32;  // moe_ep_slots keeps a token's experts in registers

__global__ void ep_flags_kernel(int64_t tokens, int k, int experts, int mine, int64_t n_flags, const int32_t* picked,
                                int32_t* flags) {
  for (int64_t f = global_thread(); f < n_flags; f += grid_threads()) {
    const int64_t r = f / tokens, i = f % tokens;
    int32_t sent = 0;
    for (int j = 0; j < k; ++j) sent |= (picked[i * k + j] - int32_t(i) * experts) / mine == r;
    flags[f] = sent;
  }
}

__global__ void ep_messages_kernel(int64_t tokens, int ranks, int experts, int64_t n_flags, const int32_t* flags,
                                   const int32_t* place, int32_t* back, int32_t* sent_tokens, int32_t* summary) {
  for (int64_t f = global_thread(); f < n_flags; f += grid_threads()) {
    const int64_t r = f / tokens, i = f % tokens;
    back[i * ranks + r] = flags[f] ? place[f] : -1;
    if (flags[f]) sent_tokens[place[f]] = int32_t(i);
    if (i == tokens - 1) summary[experts + 2 + r] = place[f] + flags[f] - place[r * tokens];
  }
}

__global__ void ep_slots_kernel(int64_t tokens, int k, int ranks, int experts, int slots, const int32_t* picked,
                                const int32_t* position, const int32_t* back, const int32_t* bases, int32_t* slot_row,
                                int32_t* slot_pair) {
  const int mine = experts / ranks;
  for (int64_t i = global_thread(); i < tokens; i += grid_threads()) {
    int32_t ex[kMaxTopK], pos[kMaxTopK];
    for (int j = 0; j < k; ++j) {  // insertion by ascending expert
      const int32_t e = picked[i * k + j] - int32_t(i) * experts, p = position[i * k + j];
      int at = j;
      for (; at > 0 && ex[at - 1] > e; --at) {
        ex[at] = ex[at - 1];
        pos[at] = pos[at - 1];
      }
      ex[at] = e;
      pos[at] = p;
    }
    int rank = -1, f = 0;
    for (int j = 0; j < k; ++j) {
      const int r = ex[j] / mine;
      const int32_t u = back[i * ranks + r], p = pos[j];
      f = r == rank ? f + 1 : 0;
      rank = r;
      slot_row[int64_t(u) * slots + f] = bases[ex[j]] + p;
      slot_pair[int64_t(u) * slots + f] = p;
    }
  }
}

__global__ void ep_regroup_kernel(int64_t rows, int blocks, const int32_t* starts, int32_t* grouped,
                                  int32_t* received) {
  const int32_t* other = starts + blocks + 1;
  for (int64_t q = global_thread(); q < rows; q += grid_threads()) {
    int lo = 0, hi = blocks;  // the last block b with starts[b] <= q (empty blocks before it start there too)
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (starts[mid] <= q) lo = mid;
      else hi = mid;
    }
    const int32_t g = other[lo] + int32_t(q) - starts[lo];
    received[q] = g;
    grouped[g] = int32_t(q);
  }
}

__global__ void ep_sources_kernel(int64_t n, int slots, const int32_t* pairs, int32_t* token, int32_t* slot) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const int32_t g = pairs[i];
    if (g < 0) continue;
    token[g] = int32_t(i / slots);
    slot[g] = int32_t(i);
  }
}

size_t scan_temp_bytes(int64_t n) {
  size_t bytes = 0;
  LATHE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), n));
  return bytes;
}

}  // namespace

int64_t moe_ep_slots_max_top_k() { return kMaxTopK; }

size_t moe_ep_messages_scratch_bytes(int64_t tokens, int64_t ranks) {
  const int64_t n = tokens * ranks;
  return n > 0 ? 2 * align256(size_t(n) * sizeof(int32_t)) + align256(scan_temp_bytes(n)) : 0;
}

void launch_moe_ep_messages(int64_t tokens, int64_t top_k, int64_t experts, int64_t ranks, const int32_t* picked,
                            const int32_t* offsets, int32_t* back, int32_t* sent_tokens, int32_t* summary,
                            void* scratch, cudaStream_t stream) {
  const int64_t n = tokens * ranks;
  LATHE_CUDA_CHECK(cudaMemcpyAsync(summary, offsets, size_t(experts + 2) * sizeof(int32_t), cudaMemcpyDeviceToDevice,
                                   stream));
  if (n == 0) {
    LATHE_CUDA_CHECK(cudaMemsetAsync(summary + experts + 2, 0, size_t(ranks) * sizeof(int32_t), stream));
    return;
  }
  LATHE_CUDA_CHECK(cudaMemsetAsync(sent_tokens, 0xff, size_t(n) * sizeof(int32_t), stream));  // -1 past the list
  auto* base = static_cast<uint8_t*>(scratch);
  const size_t ints = align256(size_t(n) * sizeof(int32_t));
  auto* flags = reinterpret_cast<int32_t*>(base);
  auto* place = reinterpret_cast<int32_t*>(base + ints);
  ep_flags_kernel<<<grid_for(n, 256), 256, 0, stream>>>(tokens, int(top_k), int(experts), int(experts / ranks), n,
                                                         picked, flags);
  LATHE_CUDA_LAUNCH_CHECK("ep_flags_kernel");
  size_t temp = scan_temp_bytes(n);
  LATHE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(base + 2 * ints, temp, flags, place, n, stream));
  ep_messages_kernel<<<grid_for(n, 256), 256, 0, stream>>>(tokens, int(ranks), int(experts), n, flags, place, back,
                                                            sent_tokens, summary);
  LATHE_CUDA_LAUNCH_CHECK("ep_messages_kernel");
}

void launch_moe_ep_slots(int64_t tokens, int64_t top_k, int64_t experts, int64_t ranks, int64_t slots,
                         const int32_t* picked, const int32_t* position, const int32_t* back, const int32_t* bases,
                         int32_t* slot_row, int32_t* slot_pair, cudaStream_t stream) {
  const size_t table = size_t(tokens * ranks * slots) * sizeof(int32_t);
  if (table == 0) return;
  LATHE_CUDA_CHECK(cudaMemsetAsync(slot_row, 0xff, table, stream));  // -1
  LATHE_CUDA_CHECK(cudaMemsetAsync(slot_pair, 0, table, stream));
  ep_slots_kernel<<<grid_for(tokens, 128), 128, 0, stream>>>(tokens, int(top_k), int(ranks), int(experts), int(slots),
                                                              picked, position, back, bases, slot_row, slot_pair);
  LATHE_CUDA_LAUNCH_CHECK("ep_slots_kernel");
}

void launch_moe_ep_regroup(int64_t rows, int64_t blocks, const int32_t* starts, int32_t* grouped, int32_t* received,
                           cudaStream_t stream) {
  if (rows == 0) return;
  ep_regroup_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(rows, int(blocks), starts, grouped, received);
  LATHE_CUDA_LAUNCH_CHECK("ep_regroup_kernel");
}

void launch_moe_ep_sources(int64_t tokens, int64_t slots, const int32_t* pairs, int32_t* token, int32_t* slot,
                           cudaStream_t stream) {
  if (tokens * slots == 0) return;
  ep_sources_kernel<<<grid_for(tokens * slots, 256), 256, 0, stream>>>(tokens * slots, int(slots), pairs, token, slot);
  LATHE_CUDA_LAUNCH_CHECK("ep_sources_kernel");
}

}  // namespace lathe::cuda
