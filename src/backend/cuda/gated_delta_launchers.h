// Raw-pointer launchers of the CUDA Gated DeltaNet kernels, each with its backward: sigmoid, the packed causal
// depthwise conv1d and the log-decay g = -exp(A_log) softplus(a + dt_bias) (gdn_pointwise.cu), and the gated delta
// rule (gated_delta.cu).
// Every tensor is contiguous; cu_seqlens (docs + 1) i32 lives on the device and is not copied to the host: the
// kernels clamp malformed boundaries into [0, tokens] (the model validates them before upload). Tensor checks and
// registration live in gated_delta_ops.cpp; covered by tests/ops (testing/op_cases_gated_delta.cpp). Free of fmt.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

void launch_sigmoid(DType dtype, int64_t n, const void* x, void* y, cudaStream_t stream);
void launch_sigmoid_backward(DType dtype, int64_t n, const void* y, const void* dy, void* dx, cudaStream_t stream);

// Largest conv width (taps live in registers).
constexpr int64_t kMaxConvWidth = 16;
// y (T, C) = depthwise causal conv of x (T, C) with w (C, W); taps before a document's first token read zero.
void launch_causal_conv1d(DType dtype, int64_t tokens, int64_t channels, int64_t width, int64_t docs, const void* x,
                          const void* w, const int32_t* cu_seqlens, void* y, cudaStream_t stream);
// dx (T, C), dw (C, W); dw is a fixed-order reduction (deterministic): per-slab fp32 partials in `workspace`
// (conv_backward_workspace_bytes), then summed in slab order.
size_t conv_backward_workspace_bytes(int64_t tokens, int64_t channels, int64_t width);
void launch_causal_conv1d_backward(DType dtype, int64_t tokens, int64_t channels, int64_t width, int64_t docs,
                                   const void* x, const void* w, const void* dy, const int32_t* cu_seqlens, void* dx,
                                   void* dw, void* workspace, cudaStream_t stream);

// g (T, H) from a (T, H), A_log (H), dt_bias (H); backward gives da (T, H), dA_log (H), ddt_bias (H).
void launch_gdn_decay(DType dtype, int64_t tokens, int64_t heads, const void* a, const void* a_log,
                      const void* dt_bias, void* g, cudaStream_t stream);
void launch_gdn_decay_backward(DType dtype, int64_t tokens, int64_t heads, const void* a, const void* a_log,
                               const void* dt_bias, const void* dg, void* da, void* d_a_log, void* d_dt_bias,
                               cudaStream_t stream);

// The gated delta rule. q, k (T, H_k, d_k); v, o, d_o, dv (T, H_v, d_v); g, beta, dg, dbeta (T, H_v). g must be a
// log-decay (finite, <= 0): the CPU kernel checks it, these kernels cannot (a positive g can overflow the decays).
struct GdnShape {
  int64_t tokens = 0, docs = 0, k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0;
  float scale = 0;  // resolved (never 0 here)
};

// The chunked tensor-core kernels (chunk 64): bf16 with d_k = d_v = 128. Everything else runs the token-by-token
// recurrence with the state in shared memory (fp32), whose size must fit: d_k * d_v <= kMaxRecurrentState.
bool gdn_chunked_supported(DType dtype, int64_t k_dim, int64_t v_dim);
constexpr int64_t kMaxRecurrentState = 128 * 128;

// `chunked` picks the implementation (true only where gdn_chunked_supported). Bytes of device scratch the
// launchers need (the caller allocates them; 256-byte aligned).
// `save_states`: the forward also writes the op's saved states; `saved_states`: the backward is given them;
// `cache`: the chunked forward writes its WY factors and Delta into the op's chunk cache / the backward reads them.
size_t gdn_forward_workspace_bytes(bool chunked, const GdnShape& s, bool save_states, bool cache);
size_t gdn_backward_workspace_bytes(bool chunked, const GdnShape& s, bool saved_states, bool cache);

// `dtype` is that of q, k, v, o (d_o, dq, dk, dv, states); `gate_dtype` that of g, beta (dg, dbeta): `dtype` or F32.
// `states`: null, or the op's saved chunk-start states (tokens / 64 + docs, H_v, d_k, d_v) to write; `cache`: null, or
// the op's chunk cache (T, H_v, kChunkCacheWidth) to write (chunked only).
constexpr int64_t kChunkCacheWidth = 3 * 128 + 2 * 64 + 2;  // = kGdnChunkCacheWidth of ops/ops.h (checked there)
void launch_gated_delta_rule(DType dtype, DType gate_dtype, bool chunked, const GdnShape& s, const void* q,
                             const void* k, const void* v, const void* g, const void* beta, const int32_t* cu_seqlens,
                             void* o, void* states, void* cache, void* workspace, cudaStream_t stream);
// dq, dk come back summed over each group of H_v / H_k value heads, in a fixed order (deterministic). `states`:
// null, or the forward's saved states, which the chunked kernels read instead of running their own forward scan
// (the recurrent kernel recomputes regardless). `cache`: null, or the forward's chunk cache, which the chunked kernels
// read instead of running their prep pass (and, with `states`, their Delta pass).
void launch_gated_delta_rule_backward(DType dtype, DType gate_dtype, bool chunked, const GdnShape& s, const void* q,
                                      const void* k, const void* v, const void* g, const void* beta, const void* d_o,
                                      const int32_t* cu_seqlens, const void* states, const void* cache, void* dq,
                                      void* dk, void* dv, void* dg, void* dbeta, void* workspace, cudaStream_t stream);

}  // namespace lathe::cuda
