// Raw-pointer launchers of the tiled (flash-attention-2 style) causal packed attention kernels in
// flash_attention.cu: bf16/f16 tensor-core tiles with fp32 accumulation, head dims 64, 128 and 256. Same
// semantics as launch_attention / launch_attention_backward in model_launchers.h (which stay the fallback for
// other dtypes and head dims). Every tensor is contiguous and 16-byte aligned; registration and tensor checks
// live in model_ops_register.cpp; covered by tests/ops (op_cases.cpp, attention cases with D = 64/128/256).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/model_launchers.h"
#include "core/dtype.h"

namespace lathe::cuda {

// Whether a kernel instance exists for this head dim (64, 128 or 256).
bool flash_attention_head_dim_supported(int64_t head_dim);

// o (tokens, q_heads, head_dim), lse (tokens, q_heads) float. dims.scale must be positive.
void launch_flash_attention(DType dtype, const AttentionDims& dims, const void* q, const void* k, const void* v,
                            const int32_t* cu_seqlens, void* o, float* lse, cudaStream_t stream);

// Floats of scratch launch_flash_attention_backward needs: lse * log2(e) and D_i = do_i . o_i, per q head.
int64_t flash_attention_backward_scratch_floats(const AttentionDims& dims);
// dq like q, dk and dv like k. Deterministic: dk/dv sum the q heads of a GQA group and the query tiles in a
// fixed order in one CTA; dq is a separate pass over key tiles (no atomics anywhere).
void launch_flash_attention_backward(DType dtype, const AttentionDims& dims, const void* q, const void* k,
                                     const void* v, const void* o, const float* lse, const void* dout,
                                     const int32_t* cu_seqlens, void* dq, void* dk, void* dv, float* scratch,
                                     cudaStream_t stream);

}  // namespace lathe::cuda
