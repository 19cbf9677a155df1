// Raw-pointer launchers of the CUDA transformer-layer kernels (model_ops.cu): embedding, RMSNorm, gated RMSNorm,
// rotary embedding, SwiGLU, causal packed attention, cross-entropy, and their backwards. Every tensor is contiguous;
// statistics (attention lse, cross-entropy loss) and scratch buffers are float; the caller allocates scratch.
// Tensor checks and registration live in model_ops_register.cpp; covered by tests/ops. Free of fmt for nvcc.
// Any pointer may be unaligned (views): the launchers check before taking a 16-byte path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

// Largest head dim of the attention kernels (one warp holds a row, 8 values a lane).
constexpr int64_t kMaxAttentionHeadDim = 256;
// Largest rotary_dim / 2 of the rope kernel (the inverse frequencies travel as a kernel argument).
constexpr int kMaxRopeHalf = 256;

// Index inputs (token ids, labels, cu_seqlens) are validated on the host by the model before upload; a
// kernel cannot throw, so out-of-range values are skipped (see each launcher).

// out (n_tokens, hidden) = weight (vocab, hidden) rows at ids - first (first > 0: a vocab-parallel slice, rows the ids
// [first, first + vocab)); an id outside gives a zero row.
void launch_embedding(DType dtype, int64_t n_tokens, int64_t hidden, int64_t vocab, int64_t first, const void* weight,
                      const int32_t* ids, void* out, cudaStream_t stream);
// dweight (vocab, hidden) = rows of dy (n_tokens, hidden) summed per id (out-of-range ids skipped): the (id, token)
// pairs are sorted by id (cub's stable radix sort), then each id's rows are summed in token order in fp32 and written
// once; other rows are zero. `accumulate`: dweight is not zeroed and each sum is added to its row's current value
// (one rounding); other rows are left alone. Bitwise deterministic. `scratch` holds
// embedding_backward_scratch_bytes(n_tokens).
// `first` as launch_embedding's: ids outside [first, first + vocab) are skipped.
size_t embedding_backward_scratch_bytes(int64_t n_tokens);
void launch_embedding_backward(DType dtype, int64_t n_tokens, int64_t hidden, int64_t vocab, int64_t first,
                               const void* dy, const int32_t* ids, bool accumulate, void* scratch, void* dweight,
                               cudaStream_t stream);

// out (m, d) = the gather_sum op (op_table.h) of rows (n, d) at index (m, s) with weights (m, s): fp32 sums in index
// order, one rounding; 16-byte packs when d and the buffers allow.
void launch_gather_sum(DType dtype, int64_t m, int64_t s, int64_t n, int64_t d, const void* rows,
                       const int32_t* index, const void* weights, void* out, cudaStream_t stream);

// y = x * rsqrt(mean(x^2) + eps) * (offset + w) over rows of length h.
void launch_rmsnorm(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x, const void* w,
                    void* y, cudaStream_t stream);
// Floats of scratch launch_rmsnorm_backward and launch_gated_rmsnorm_backward need (per-warp partial column sums
// of dw, then their group sums).
int64_t rmsnorm_backward_scratch_floats(int64_t rows, int64_t h);
void launch_rmsnorm_backward(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                             const void* w, const void* dy, void* dx, void* dw, float* scratch, cudaStream_t stream);
// hsum = x + res (rounded as the add op rounds), y = rmsnorm(hsum) as launch_rmsnorm computes it; backward: dx is
// rmsnorm_backward's plus dres, rounded once (same scratch as launch_rmsnorm_backward).
void launch_residual_rmsnorm(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                             const void* res, const void* w, void* y, void* hsum, cudaStream_t stream);
void launch_residual_rmsnorm_backward(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                                      const void* w, const void* dy, const void* dres, void* dx, void* dw,
                                      float* scratch, cudaStream_t stream);
// y = x * rsqrt(mean(x^2) + eps) * (offset + w) * silu(z), rounded once; backward: dx, dw, dz from x, w, z, dy.
void launch_gated_rmsnorm(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                          const void* w, const void* z, void* y, cudaStream_t stream);
void launch_gated_rmsnorm_backward(DType dtype, int64_t rows, int64_t h, double eps, double offset, const void* x,
                                   const void* w, const void* z, const void* dy, void* dx, void* dw, void* dz,
                                   float* scratch, cudaStream_t stream);

// Rotate-half rotary embedding of x (tokens, heads, d) on the first 2 * half dims (the rest copied), angle =
// float(pos) * inv_freq[i]; inverse rotates by -angle. inv_freq is computed on the host (cpu::rope_inv_freq).
struct RopeFrequencies {
  float inv_freq[kMaxRopeHalf];
};
void launch_rope(DType dtype, int64_t tokens, int64_t heads, int64_t d, int64_t half, bool inverse,
                 const RopeFrequencies& freqs, const void* x, const int32_t* positions, void* y, cudaStream_t stream);

// qk_norm_rope (+ backward) of ops/op_table.h, full rotary dim only: head dims of 8, 16 or 32 16-byte packs (64 or
// 128 in f32; 64, 128 or 256 in bf16/f16; qk_norm_rope_supported), every buffer 16-byte aligned. The backward's
// scratch holds qk_norm_rope_backward_scratch_floats(tokens, d) floats (partial dw rows of q and k).
bool qk_norm_rope_supported(DType dtype, int64_t d);
int64_t qk_norm_rope_backward_scratch_floats(int64_t tokens, int64_t d);
void launch_qk_norm_rope(DType dtype, int64_t tokens, int64_t hq, int64_t hkv, int64_t d, double eps, double offset,
                         const RopeFrequencies& freqs, const void* qkv, const void* wq, const void* wk,
                         const int32_t* positions, void* q, void* k, void* v, cudaStream_t stream);
void launch_qk_norm_rope_backward(DType dtype, int64_t tokens, int64_t hq, int64_t hkv, int64_t d, double eps,
                                  double offset, const RopeFrequencies& freqs, const void* qkv, const void* wq,
                                  const void* wk, const int32_t* positions, const void* dq, const void* dk,
                                  const void* dv, void* dqkv, void* dwq, void* dwk, float* scratch,
                                  cudaStream_t stream);

// swiglu_halves (+ backward): gu (rows, 2 cols) holds gate and up side by side in each row; y and dy (rows, cols),
// dgu like gu.
void launch_swiglu_halves(DType dtype, int64_t rows, int64_t cols, const void* gu, void* y, cudaStream_t stream);
void launch_swiglu_halves_backward(DType dtype, int64_t rows, int64_t cols, const void* gu, const void* dy, void* dgu,
                                   cudaStream_t stream);

// y = silu(g) * u; backward: dg, du from g, u, dy. n elements each.
void launch_swiglu(DType dtype, int64_t n, const void* g, const void* u, void* y, cudaStream_t stream);
void launch_swiglu_backward(DType dtype, int64_t n, const void* g, const void* u, const void* dy, void* dg, void* du,
                            cudaStream_t stream);

// q (tokens, q_heads, head_dim), k and v (tokens, kv_heads, head_dim), cu_seqlens (n_cu) i32 on the device.
struct AttentionDims {
  int64_t tokens = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;  // at most kMaxAttentionHeadDim
  int64_t n_cu = 0;      // number of cu_seqlens entries (documents + 1)
  float scale = 0;       // already resolved (never 0 here)
};
// o (tokens, q_heads, head_dim), lse (tokens, q_heads) float.
void launch_attention(DType dtype, const AttentionDims& dims, const void* q, const void* k, const void* v,
                      const int32_t* cu_seqlens, void* o, float* lse, cudaStream_t stream);
// dq like q, dk and dv like k; `delta` is scratch of tokens * q_heads floats (D_i = do_i . o_i).
void launch_attention_backward(DType dtype, const AttentionDims& dims, const void* q, const void* k, const void* v,
                               const void* o, const float* lse, const void* dout, const int32_t* cu_seqlens,
                               void* dq, void* dk, void* dv, float* delta, cudaStream_t stream);

// loss (rows) float = logsumexp(x) - x[label] (0 where label == ignore_index; NaN for any other out-of-range
// label); with dlogits non-null, dlogits (rows, vocab) = grad_scale * (softmax - onehot), zero rows if ignored.
// With row_lse non-null (cross_entropy_slice): the logits are the columns [first, first + vocab) of the whole
// vocabulary, row_lse the rows' whole log-sum-exp: loss = lse - x[label - first] where the slice holds the label, else
// 0; dlogits = grad_scale * (exp(x - lse) - onehot), the one-hot only where held.
void launch_cross_entropy(DType dtype, int64_t rows, int64_t vocab, int64_t ld, int64_t ld_grad, int64_t ignore_index,
                          double grad_scale, int64_t first, const float* row_lse, const void* logits,
                          const int32_t* labels, float* loss, void* dlogits,
                          cudaStream_t stream);  // rows of logits and dlogits `ld` and `ld_grad` elements apart

// moe_route (moe_route.cu) on f32 logits (tokens, experts); outputs as MoeRouteAttrs in ops/op_table.h lays them out.
struct MoeRouteArgs {
  int64_t tokens = 0, experts = 0, top_k = 0;
  bool norm_topk_prob = false;
  const float* logits = nullptr;
  float *probs = nullptr, *weights = nullptr, *inv_sum = nullptr;
  int32_t *picked = nullptr, *offsets = nullptr, *token = nullptr, *pair = nullptr, *position = nullptr;
};
size_t moe_route_scratch_bytes(int64_t pairs);
int64_t moe_route_max_experts();  // a row of probabilities per warp lives in shared memory
void launch_moe_route(const MoeRouteArgs& args, void* scratch, cudaStream_t stream);
// moe_pad_plan (MoePadAttrs in ops/op_table.h): rows_per_expert must cover every expert's count.
void launch_moe_pad_plan(int64_t experts, int64_t rows_per_expert, int64_t top_k, int64_t pairs,
                         const int32_t* offsets, const int32_t* pair, int32_t* pad_token, int32_t* pad_pair,
                         int32_t* pad_position, cudaStream_t stream);
// Expert parallelism's exchange plan (moe_exchange.cu; MoeExchangeAttrs in ops/op_table.h).
size_t moe_ep_messages_scratch_bytes(int64_t tokens, int64_t ranks);
void launch_moe_ep_messages(int64_t tokens, int64_t top_k, int64_t experts, int64_t ranks, const int32_t* picked,
                            const int32_t* offsets, int32_t* back, int32_t* sent_tokens, int32_t* summary,
                            void* scratch, cudaStream_t stream);
int64_t moe_ep_slots_max_top_k();  // a token's experts live in registers
void launch_moe_ep_slots(int64_t tokens, int64_t top_k, int64_t experts, int64_t ranks, int64_t slots,
                         const int32_t* picked, const int32_t* position, const int32_t* back, const int32_t* bases,
                         int32_t* slot_row, int32_t* slot_pair, cudaStream_t stream);
void launch_moe_ep_regroup(int64_t rows, int64_t blocks, const int32_t* starts, int32_t* grouped, int32_t* received,
                           cudaStream_t stream);
void launch_moe_ep_sources(int64_t tokens, int64_t slots, const int32_t* pairs, int32_t* token, int32_t* slot,
                           cudaStream_t stream);

}  // namespace lathe::cuda
