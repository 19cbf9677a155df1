// Raw-pointer launcher of the CUDA AdamW kernel (optim.cu). Masters and moments are f32, or bf16 (bf16 optimizer
// states: the master is the bf16 parameter itself); the gradient is f32, bf16 or f16; the optional parameter output
// (the new f32 master rounded) is bf16 or f16, and only with f32 states. The scalars are precomputed on the host in
// double (bias corrections, decay factor) and rounded once to float. Registration and tensor checks live in
// optim_ops.cpp; covered by the adamw op-check cases.
// Free of fmt so nvcc sees little.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace lathe::cuda {

struct AdamWScalars {
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;  // from double: 1 - float(0.999) would be 4.7e-5 off
  float step_size;  // lr / (1 - beta1^step)
  float sqrt_bc2;   // sqrt(1 - beta2^step)
  float eps;
  float lr_wd;      // lr * weight_decay, applied as w - lr_wd * w: float(1 - lr_wd) would quantise it in 6e-8 steps
  float grad_scale;
};

// Elementwise; the outputs may alias the inputs (each element is read before it is written). w, m, v and their
// outputs are of `state_dtype` (f32 or bf16). `param` (of `param_dtype`, ignored when param is null; f32 states only)
// also receives the new master converted as the cast kernel does.
void launch_adamw(DType state_dtype, DType grad_dtype, int64_t n, const void* w, const void* grad, const void* m,
                  const void* v, void* w_out, void* m_out, void* v_out, DType param_dtype, void* param,
                  const AdamWScalars& s, cudaStream_t stream);

// One tensor of an adamw_list launch (device-resident table; pointers as in launch_adamw). Its chunks of
// kAdamWListChunk elements are blocks first_chunk, first_chunk + 1, ... of the launch. `packed`: every pointer is
// 16-byte aligned (then 16-byte accesses). param is null without a parameter output.
constexpr int64_t kAdamWListChunk = 1 << 16;
struct AdamWListEntry {
  const void *w, *grad, *m, *v;
  void *w_out, *m_out, *v_out, *param;
  int64_t n, first_chunk;
  int32_t packed;
};

// adamw over every tensor of `table` (n_tensors entries, `chunks` chunks in all) in one launch; each tensor gets
// bitwise what launch_adamw gives it. All share the dtypes and the scalars.
void launch_adamw_list(DType state_dtype, DType grad_dtype, DType param_dtype, bool with_param,
                       const AdamWListEntry* table, int n_tensors, int64_t chunks, const AdamWScalars& s,
                       cudaStream_t stream);

}  // namespace lathe::cuda
