// Model FLOPs per token and the peak the MFU divides by (DESIGN.md, "Measuring"): shared by the trainer's progress
// line and `lathe bench`, so both report the same MFU for the same run.
// Convention: 6 x N_matmul per token (every weight used in a matmul; a tied embedding once, through the LM head) plus
// causal attention, 6 L Hq D S averaged over the batch's documents (12 L Hq D S halved for the causal mask). LoRA over
// a frozen base: the base costs 4 N (forward and input gradient; no weight gradient), the adapters 6 N_adapter.
// Qwen3.5: attention counts its full-attention layers only, and each Gated DeltaNet layer adds its chunked core by the
// dense-GEMM count of research/gated-deltanet.md sec. 3.6 (chunk 64, per token and value head: forward
// 6 dk dv + 6 C dk + 4 C dv, backward 16 dk dv + 18 C dk + 10 C dv + 4 C^2; about 688K at dk = dv = 128).
// Covered by tests/unit/test_profiler.cpp (Flops).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/runtime.h"
#include "model/config.h"

namespace lathe {

// Weights used in matmuls: every parameter but the norm gains and an untied input embedding.
double matmul_parameter_count(const ModelConfig& c);
// Causal attention FLOPs per token (forward + backward) of a batch of documents cu_seqlens = [0, l1, l1 + l2, ...].
double attention_flops_per_token(const ModelConfig& c, const std::vector<int32_t>& cu_seqlens);
// Gated DeltaNet core FLOPs per token, forward + backward (0 for Qwen3).
double gdn_core_flops_per_token(const ModelConfig& c);
// Each layer's training FLOPs per token in documents of `document_tokens` (its matmuls, its attention or Gated DeltaNet
// core), the LM head's added to the last: what a pipeline of a hybrid stack is balanced by (balanced_pipeline_layout).
std::vector<double> layer_flops_per_token(const ModelConfig& c, int64_t document_tokens);
// Full training: 6 N_matmul + attention (+ the GDN core).
double flops_per_token(const ModelConfig& c, const std::vector<int32_t>& cu_seqlens);
// LoRA over a frozen base with `adapter_parameters` trainable adapter weights: 4 N_matmul + 6 N_adapter + attention.
double lora_flops_per_token(const ModelConfig& c, double adapter_parameters, const std::vector<int32_t>& cu_seqlens);
// bf16 dense peak of a card by its name (H100/H200 SXM: 989 TFLOP/s); 0 = unknown (no MFU is printed).
double peak_flops(const std::string& device_name);
// A count for people: 1.72G, 3.45M, 12.3k, 512.
std::string human(double x);
// Peak memory so far in MiB: the device allocator's peak on a GPU, the process's peak resident memory on the CPU.
double peak_memory_mib(Runtime& rt, Device device);
// The device allocator's AllocatorStats::num_cache_flushes so far (0 on the CPU).
int64_t cache_flushes(Runtime& rt, Device device);

}  // namespace lathe
