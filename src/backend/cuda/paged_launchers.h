// Launchers of the rollout engine's kernels (paged.cu): paged_attention, scatter_rows and row_argmax_logsumexp
// (ops/op_table.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

inline constexpr int kMaxPagedHeadDim = 256;  // a warp holds a query row, up to 8 values a lane

// How many ways launch_paged_attention splits each query's context (at most `max_context` positions: the block
// table's width x block size) for T tokens of Hq query heads over Hkv kv heads.
int64_t paged_attention_splits(int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t max_context);

// q (T, Hq, D), caches (S, Hkv, D), table (B, M), cu_q (B + 1), context_lens (B); o (T, Hq, D). f32, bf16 or f16.
// With splits > 1, `workspace` holds T x Hq x splits x (D + 2) floats.
void launch_paged_attention(DType dtype, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t batch, int64_t table_width, int64_t splits, float scale,
                            const void* q, const void* k_cache, const void* v_cache, const int32_t* table,
                            const int32_t* cu_q, const int32_t* context_lens, void* o, float* workspace,
                            cudaStream_t stream);

// The pipelined kernel (paged_decode.cu): positions a slot copies at once and the stages of its ring. {4, 3} is built
// for every shape; {4, 2}, {2, 4} and {2, 6} for 128-value bf16 rows only (bench/paged_attention_bench.cpp).
struct PagedPipeline {
  int positions = 4, stages = 3;
};

// Whether launch_paged_attention_pipelined serves rows of `head_dim` values of `dtype` (128, 256 or 512 bytes) and
// pages of `block_size` positions (a power of two, at least 4). Its operands must be 16-byte aligned.
bool paged_attention_pipelined_applies(DType dtype, int64_t head_dim, int64_t block_size);

// launch_paged_attention's contract (the same splits and workspace), through the cp.async pipeline.
void launch_paged_attention_pipelined(DType dtype, int64_t tokens, int64_t q_heads, int64_t kv_heads,
                                      int64_t head_dim, int64_t block_size, int64_t batch, int64_t table_width,
                                      int64_t splits, float scale, const void* q, const void* k_cache,
                                      const void* v_cache, const int32_t* table, const int32_t* cu_q,
                                      const int32_t* context_lens, void* o, float* workspace, PagedPipeline pipe,
                                      cudaStream_t stream);

// The chunks launch_row_argmax_logsumexp cuts each of `rows` rows of `v` values into.
int64_t row_argmax_logsumexp_chunks(int64_t rows, int64_t v);

// x (rows, v) f32, bf16 or f16: argmax over [0, limit) (0: all), its value, log-sum-exp of the row (f32).
// `workspace` holds rows x chunks x 4 floats.
void launch_row_argmax_logsumexp(DType dtype, int64_t rows, int64_t v, int64_t limit, int64_t chunks, const void* x,
                                 int32_t* arg, float* best, float* lse, float* workspace, cudaStream_t stream);

// sample_rows (ops/op_table.h) for m draws from x (N, v) (f32, bf16 or f16; params f32), each row cut into `chunks`
// (row_argmax_logsumexp_chunks of (m, limit)); `maxes` holds m x chunks floats, `cuts` m keys, `part` m x chunks x 3
// doubles.
void launch_sample_rows(DType dtype, int64_t m, int64_t v, int64_t limit, int64_t chunks, const void* x,
                        const int32_t* rows, const void* params, const int32_t* keys, int32_t* token, void* logit,
                        void* logprob, float* maxes, uint32_t* cuts, double* part, cudaStream_t stream);

// penalize_rows (ops/op_table.h) for m draws from x (N, v) (f32, bf16 or f16) with e entries, into y (m, v) f32.
void launch_penalize_rows(DType dtype, int64_t m, int64_t v, int64_t e, const void* x, const int32_t* rows,
                          const float* params, const int32_t* entries, float* y, cudaStream_t stream);

// out[index[i]] = src[i] for rows of `row_bytes` (a multiple of 2); out already holds the rest.
void launch_scatter_rows(int64_t rows, int64_t row_bytes, const void* src, const int32_t* index, void* out,
                         cudaStream_t stream);

}  // namespace lathe::cuda
