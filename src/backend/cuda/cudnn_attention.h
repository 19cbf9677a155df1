// cuDNN fused attention (flash-attention-2 style forward and backward) for the `attention` and
// `attention_backward` ops, built through the cuDNN backend (graph) API: cudnnBackendCreateDescriptor /
// SetAttribute / Finalize / Execute, no cudnn-frontend. Registered before the tiled kernels
// (cuda/flash_attention*), which stay the fallback wherever supports() refuses, with the reason.
//
// Conventions (details and the graphs in cudnn_attention.cpp):
// - The graphs are the composite ones cudnn-frontend emits for cuDNN < 9.21 (matmul, scale, padding and causal
//   masks from GEN_INDEX + compare + BINARY_SELECT, softmax decomposed with a stats output, matmul), on packed
//   documents as a ragged (THD) batch: one batch entry per document, ragged offsets and per-document lengths; or,
//   when every document has one length (a multiple of 128, or any above head dim 128), as a plain dense batch.
// - cuDNN's softmax stats are max + log(sum exp) of the scaled, masked scores in natural log: exactly the op's
//   lse, so o and lse are written in place and the backward reads lse as is (no conversion).
// - cu_seqlens is read on the host (B, the longest document, and the plan that fits), once per live
//   cu_seqlens storage: a cu_seqlens tensor must not be rewritten in place while it is alive.
// - The backward is the deterministic one (dQ by a separate matmul over a dP workspace of B * Hq * S^2 * 2 bytes);
//   supports() refuses when that workspace is above 1/16 of the device's memory, and for head dims above 128 in a
//   ragged batch (cuDNN 9.14's ragged graphs return wrong dK/dV at 256; its dense ones are right); the tiled
//   backward takes those.
// Covered by tests/ops (op_cases.cpp attention cases, bf16/f16, on a GPU with cuDNN 9.6 to 9.20).
#pragma once

#include <string>
#include <vector>

#include "backend/registry.h"

namespace lathe::cuda {

// Adds "cuda/cudnn_sdpa" (attention) and "cuda/cudnn_sdpa_backward" (attention_backward) for `dtype` (bf16 and
// f16; nothing for other dtypes). Call before registering the kernels they should be preferred to.
void register_cudnn_attention_kernels(KernelRegistry& registry, DType dtype);

// The non-deterministic backward graph (fp32 dQ accumulated across key tiles by the engine). Not registered:
// only for measuring what determinism costs (bench/attention_bench). Throws where the registered one would refuse.
void run_cudnn_attention_backward_nondeterministic(const OpCall& call, ExecContext& ctx);

// "cuDNN 9.14.0 (headers 9.19.0)" plus why the attention kernels are unusable here, if they are.
std::string cudnn_runtime_summary();

// One line per execution plan built or refused so far in this process (shape, engine, workspace, build time
// or the failing cuDNN call and its message). Also printed to stderr as they happen when the environment
// variable LATHE_CUDNN_ATTENTION_LOG is set.
std::vector<std::string> cudnn_attention_plan_log();

}  // namespace lathe::cuda
