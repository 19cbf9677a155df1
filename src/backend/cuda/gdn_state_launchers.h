// Raw-pointer launcher of the CUDA gated_delta_rule_state kernel (gdn_state.cu): the gated delta rule from given
// per-document states, for prefill and decoding (formulas at GatedDeltaAttrs in ops/op_table.h). Tensor checks and
// the registration live in gdn_state_register.cpp. Kept free of fmt so nvcc sees little.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

struct GdnStateDims {
  int64_t docs = 0;     // N
  int64_t k_heads = 0;  // H_k
  int64_t v_heads = 0;  // H_v, a multiple of H_k
  int64_t k_dim = 0;    // d_k
  int64_t v_dim = 0;    // d_v
  double scale = 0.0;   // the query scale itself (already resolved from 0 = d_k^-1/2)
};

// Dynamic shared memory of one block: the state (d_k, d_v) plus the key and the scaled query, in the accumulation
// type (float; double for f64).
size_t gdn_state_smem_bytes(DType dtype, int64_t k_dim, int64_t v_dim);

// Whether the register kernel takes these head dims (d_k = d_v = 128).
bool gdn_state_registers_apply(int64_t k_dim, int64_t v_dim);

// q, k (T, H_k, d_k), v (T, H_v, d_v) of `dtype` (f32, f64, bf16, f16); g, beta (T, H_v) of `gate_dtype` (`dtype`,
// or f32 beside bf16/f16); cu (N + 1) i32 on the device; state and final_state (N, H_v, d_k, d_v) in the
// accumulation type; o (T, H_v, d_v) of `dtype`. registers: the register kernel (gdn_state_registers_apply), else
// the shared-memory one.
void launch_gdn_state(DType dtype, DType gate_dtype, const GdnStateDims& dims, const void* q, const void* k, const void* v,
                      const void* g, const void* beta, const int32_t* cu, int64_t tokens, const void* state, void* o,
                      void* final_state, bool registers, cudaStream_t stream);

}  // namespace lathe::cuda
