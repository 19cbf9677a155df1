// Registration of the CUDA gated_delta_rule_state kernels (gdn_state.cu: the register kernel for 128 x 128 heads, then
// the shared-memory one) for f32, f64, bf16 and f16 inputs (g and
// beta in the same dtype, or f32 beside bf16/f16; states in f32, f64 for f64; shapes and dtypes are checked by
// shape inference in ops/gated_delta.cpp). The predicate
// refuses, with the sizes, a state too large for one block's shared memory on this device.
// Covered by the gated_delta_rule_state op-check cases (src/testing/op_cases_gdn_state.cpp).
#include <cmath>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gdn_state_launchers.h"
#include "backend/registry.h"

namespace lathe::cuda {

namespace {

Support gdn_state_supports(const OpCall& c) {
  const Tensor& q = c.inputs[0];
  const Tensor& v = c.inputs[2];
  const size_t need = gdn_state_smem_bytes(q.dtype(), q.size(2), v.size(2));
  int limit = 0;
  LATHE_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, c.device().index));
  if (need > size_t(limit))
    return Support::no(fmt::format("the state of one head (d_k {} x d_v {}, {} bytes with the key and query) exceeds "
                                   "the {} bytes of shared memory a block may use on this device",
                                   q.size(2), v.size(2), need, limit));
  return all_contiguous(c);
}

Support gdn_state_registers_supports(const OpCall& c) {
  if (!gdn_state_registers_apply(c.inputs[0].size(2), c.inputs[2].size(2)))
    return Support::no(fmt::format("head dims d_k {} x d_v {} (the register kernel is built for 128 x 128)",
                                   c.inputs[0].size(2), c.inputs[2].size(2)));
  return all_contiguous(c);
}

template <bool kRegisters>
void run_gdn_state(const OpCall& c, ExecContext& ctx) {
  const Tensor& q = c.inputs[0];  // (T, H_k, d_k)
  const Tensor& v = c.inputs[2];  // (T, H_v, d_v)
  const Tensor& cu = c.inputs[5];
  const double scale = c.attr<GatedDeltaAttrs>().scale;
  GdnStateDims d;
  d.docs = cu.numel() - 1;
  d.k_heads = q.size(1);
  d.v_heads = v.size(1);
  d.k_dim = q.size(2);
  d.v_dim = v.size(2);
  d.scale = scale > 0 ? scale : 1.0 / std::sqrt(double(d.k_dim));
  launch_gdn_state(q.dtype(), c.inputs[3].dtype(), d, q.data_ptr(), c.inputs[1].data_ptr(), v.data_ptr(), c.inputs[3].data_ptr(),
                   c.inputs[4].data_ptr(), cu.data<int32_t>(), q.size(0), c.inputs[6].data_ptr(),
                   c.outputs[0].data_ptr(), c.outputs[1].data_ptr(), kRegisters, as_cuda(ctx.stream).handle());
}

}  // namespace

void register_cuda_gdn_state_kernels(KernelRegistry& r) {
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16}) {
    r.add(KernelDef{OpId::gated_delta_rule_state, DeviceType::CUDA, dt, "cuda/gated_delta_rule_state_registers",
                    gdn_state_registers_supports, run_gdn_state<true>});
    r.add(KernelDef{OpId::gated_delta_rule_state, DeviceType::CUDA, dt, "cuda/gated_delta_rule_state_recurrent",
                    gdn_state_supports, run_gdn_state<false>});
  }
}

}  // namespace lathe::cuda
