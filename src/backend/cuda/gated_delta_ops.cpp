// Registration of the CUDA Gated DeltaNet kernels (gated_delta.cu, gdn_pointwise.cu): tensor checks, scratch from
// the context's allocator (released when the run function returns; safe on the default stream, as in
// model_ops_register.cpp), launch on the context's stream. The gated delta rule takes the chunked tensor-core path
// for bf16 with d_k = d_v = 128 and the recurrent path otherwise; both ignore attrs.chunk (the result does not
// depend on it) and both take g and beta in q's dtype or in f32 (the shape inference admits nothing else).
// Covered by tests/ops (testing/op_cases_gated_delta.cpp) and tests/ops/test_gdn_cuda.cpp.
#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gated_delta_launchers.h"
#include "backend/registry.h"
#include "ops/ops.h"

namespace lathe::cuda {

namespace {

static_assert(kChunkCacheWidth == kGdnChunkCacheWidth, "the chunk cache layouts of ops/ops.h and gated_delta.cu agree");

Support conv_supports(const OpCall& c) {
  if (c.inputs[1].size(1) > kMaxConvWidth)
    return Support::no(fmt::format("conv width {} above {} (taps live in registers)", c.inputs[1].size(1),
                                   kMaxConvWidth));
  return all_contiguous(c);
}

Support gdr_chunked_supports(const OpCall& c) {
  const Tensor& q = c.inputs[0];
  const Tensor& v = c.inputs[2];
  if (!gdn_chunked_supported(q.dtype(), q.size(2), v.size(2)))
    return Support::no(fmt::format("the chunked tensor-core kernels take bf16 with d_k = d_v = 128, got q {}, v {}",
                                   q.describe(), v.describe()));
  for (const Tensor& t : c.inputs)
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0)
      return Support::no("the chunked kernels need 16-byte aligned inputs (vector tile loads)");
  return all_contiguous(c);
}

Support gdr_recurrent_supports(const OpCall& c) {
  const Tensor& q = c.inputs[0];
  const Tensor& v = c.inputs[2];
  if (q.size(2) * v.size(2) > kMaxRecurrentState)
    return Support::no(fmt::format("q {} / v {}: the recurrent kernel keeps the d_k x d_v state in shared memory "
                                   "(d_k * d_v <= {})",
                                   q.describe(), v.describe(), kMaxRecurrentState));
  return all_contiguous(c);
}

GdnShape shape_of(const OpCall& c) {
  const Tensor& q = c.inputs[0];
  const Tensor& v = c.inputs[2];
  const Tensor& cu = c.inputs[c.op == OpId::gated_delta_rule_backward ? 6 : 5];
  GdnShape s;
  s.tokens = q.size(0);
  s.docs = cu.size(0) - 1;
  s.k_heads = q.size(1);
  s.v_heads = v.size(1);
  s.k_dim = q.size(2);
  s.v_dim = v.size(2);
  const double scale = c.attr<GatedDeltaAttrs>().scale;
  s.scale = float(scale > 0.0 ? scale : 1.0 / std::sqrt(double(s.k_dim)));
  return s;
}

Tensor workspace(ExecContext& ctx, size_t bytes) {
  if (bytes == 0) return Tensor();
  return Tensor::empty({int64_t((bytes + 3) / 4)}, DType::F32, ctx.allocator);
}

void run_gdr(bool chunked, const OpCall& c, ExecContext& ctx) {
  const GdnShape s = shape_of(c);
  const std::vector<Tensor>& in = c.inputs;
  void* states = c.outputs[1].numel() > 0 ? c.outputs[1].data_ptr() : nullptr;
  void* cache = c.outputs[2].numel() > 0 ? c.outputs[2].data_ptr() : nullptr;  // only where the chunked kernels run
  LATHE_CHECK(cache == nullptr || chunked, "cuda: gated_delta_rule: a chunk cache was allocated but the recurrent "
              "kernel runs (gdn_chunk_cache_applies and gdr_chunked_supports disagree)");
  Tensor ws = workspace(ctx, gdn_forward_workspace_bytes(chunked, s, states != nullptr, cache != nullptr));
  launch_gated_delta_rule(in[0].dtype(), in[3].dtype(), chunked, s, in[0].data_ptr(), in[1].data_ptr(),
                          in[2].data_ptr(), in[3].data_ptr(), in[4].data_ptr(), in[5].data<int32_t>(),
                          c.outputs[0].data_ptr(), states, cache, ws.defined() ? ws.data_ptr() : nullptr,
                          stream_of(ctx));
}

void run_gdr_backward(bool chunked, const OpCall& c, ExecContext& ctx) {
  const GdnShape s = shape_of(c);
  const std::vector<Tensor>& in = c.inputs;
  const std::vector<Tensor>& out = c.outputs;
  const void* states = in[7].numel() > 0 ? in[7].data_ptr() : nullptr;
  const void* cache = chunked && in[8].numel() > 0 ? in[8].data_ptr() : nullptr;
  Tensor ws = workspace(ctx, gdn_backward_workspace_bytes(chunked, s, states != nullptr, cache != nullptr));
  launch_gated_delta_rule_backward(in[0].dtype(), in[3].dtype(), chunked, s, in[0].data_ptr(), in[1].data_ptr(),
                                   in[2].data_ptr(), in[3].data_ptr(), in[4].data_ptr(), in[5].data_ptr(),
                                   in[6].data<int32_t>(), states, cache, out[0].data_ptr(), out[1].data_ptr(),
                                   out[2].data_ptr(),
                                   out[3].data_ptr(), out[4].data_ptr(), ws.defined() ? ws.data_ptr() : nullptr,
                                   stream_of(ctx));
}

}  // namespace

void register_cuda_gated_delta_kernels(KernelRegistry& r) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const auto add = [&](OpId op, const char* name, SupportsFn sup, RunFn run) {
      r.add(KernelDef{op, DeviceType::CUDA, dt, name, std::move(sup), std::move(run)});
    };
    add(OpId::sigmoid, "cuda/sigmoid", all_contiguous, [](const OpCall& c, ExecContext& ctx) {
      launch_sigmoid(c.inputs[0].dtype(), c.inputs[0].numel(), c.inputs[0].data_ptr(), c.outputs[0].data_ptr(),
                     stream_of(ctx));
    });
    add(OpId::sigmoid_backward, "cuda/sigmoid_backward", all_contiguous, [](const OpCall& c, ExecContext& ctx) {
      launch_sigmoid_backward(c.inputs[0].dtype(), c.inputs[0].numel(), c.inputs[0].data_ptr(),
                              c.inputs[1].data_ptr(), c.outputs[0].data_ptr(), stream_of(ctx));
    });
    add(OpId::causal_conv1d, "cuda/causal_conv1d_varlen", conv_supports, [](const OpCall& c, ExecContext& ctx) {
      const Tensor& x = c.inputs[0];
      launch_causal_conv1d(x.dtype(), x.size(0), x.size(1), c.inputs[1].size(1), c.inputs[2].size(0) - 1,
                           x.data_ptr(), c.inputs[1].data_ptr(), c.inputs[2].data<int32_t>(), c.outputs[0].data_ptr(),
                           stream_of(ctx));
    });
    add(OpId::causal_conv1d_backward, "cuda/causal_conv1d_varlen_backward", conv_supports,
        [](const OpCall& c, ExecContext& ctx) {
          const Tensor& x = c.inputs[0];
          const Tensor ws = workspace(ctx, conv_backward_workspace_bytes(x.size(0), x.size(1), c.inputs[1].size(1)));
          launch_causal_conv1d_backward(x.dtype(), x.size(0), x.size(1), c.inputs[1].size(1),
                                        c.inputs[3].size(0) - 1, x.data_ptr(), c.inputs[1].data_ptr(),
                                        c.inputs[2].data_ptr(), c.inputs[3].data<int32_t>(), c.outputs[0].data_ptr(),
                                        c.outputs[1].data_ptr(), ws.defined() ? ws.data_ptr() : nullptr, stream_of(ctx));
        });
    add(OpId::gdn_decay, "cuda/gdn_decay", all_contiguous, [](const OpCall& c, ExecContext& ctx) {
      const Tensor& a = c.inputs[0];
      launch_gdn_decay(a.dtype(), a.size(0), a.size(1), a.data_ptr(), c.inputs[1].data_ptr(), c.inputs[2].data_ptr(),
                       c.outputs[0].data_ptr(), stream_of(ctx));
    });
    add(OpId::gdn_decay_backward, "cuda/gdn_decay_backward", all_contiguous, [](const OpCall& c, ExecContext& ctx) {
      const Tensor& a = c.inputs[0];
      launch_gdn_decay_backward(a.dtype(), a.size(0), a.size(1), a.data_ptr(), c.inputs[1].data_ptr(),
                                c.inputs[2].data_ptr(), c.inputs[3].data_ptr(), c.outputs[0].data_ptr(),
                                c.outputs[1].data_ptr(), c.outputs[2].data_ptr(), stream_of(ctx));
    });
    if (dt == DType::BF16) {  // tried first; the recurrent kernel takes what it declines
      add(OpId::gated_delta_rule, "cuda/gated_delta_rule_chunk64", gdr_chunked_supports,
          [](const OpCall& c, ExecContext& ctx) { run_gdr(true, c, ctx); });
      add(OpId::gated_delta_rule_backward, "cuda/gated_delta_rule_chunk64_backward", gdr_chunked_supports,
          [](const OpCall& c, ExecContext& ctx) { run_gdr_backward(true, c, ctx); });
    }
    add(OpId::gated_delta_rule, "cuda/gated_delta_rule_recurrent", gdr_recurrent_supports,
        [](const OpCall& c, ExecContext& ctx) { run_gdr(false, c, ctx); });
    add(OpId::gated_delta_rule_backward, "cuda/gated_delta_rule_recurrent_backward", gdr_recurrent_supports,
        [](const OpCall& c, ExecContext& ctx) { run_gdr_backward(false, c, ctx); });
  }
}

}  // namespace lathe::cuda
