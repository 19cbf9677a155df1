// Registration of the CUDA transformer-layer kernels (model_ops.cu, flash_attention.cu; cudnn_attention.cpp registers
// its own, ahead of the tiled attention kernels, when cuDNN is in the build): tensor checks, scratch
// buffers from the context's allocator, launch on the context's stream. Convention: scratch tensors are released
// when the run function returns, before the kernels finish; the caching allocator reuses blocks in the default
// stream's order, so this is safe on the default stream (the documented limitation of side streams applies).
// Covered by tests/ops (every model-op case on cuda, f32/bf16/f16).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cpu/rope_angles.h"
#include "backend/cuda/cuda_backend.h"
#ifdef LATHE_WITH_CUDNN
#include "backend/cuda/cudnn_attention.h"
#endif
#include "backend/cuda/flash_attention.h"
#include "backend/cuda/model_launchers.h"
#include "backend/registry.h"

namespace lathe::cuda {

namespace {

// The kernels index rows of contiguous buffers directly (no stride arithmetic).
Support contiguous_supports(const OpCall& c) {
  for (const Tensor& t : c.inputs)
    if (!t.is_contiguous()) return Support::no("inputs must be contiguous");
  for (const Tensor& t : c.outputs)
    if (!t.is_contiguous()) return Support::no("outputs must be contiguous");
  return Support::yes();
}

Support rope_supports(const OpCall& c) {
  const auto& a = c.attr<RopeAttrs>();
  const int64_t rotary = a.rotary_dim ? a.rotary_dim : c.inputs[0].size(-1);
  if (rotary / 2 > kMaxRopeHalf) return Support::no("rotary dim above 512 (inverse frequencies are a kernel argument)");
  return contiguous_supports(c);
}

Support attention_supports(const OpCall& c) {
  if (c.inputs[0].size(-1) > kMaxAttentionHeadDim)
    return Support::no("head dim above 256 (one warp holds a row, 8 values a lane)");
  return contiguous_supports(c);
}

// Whether every tensor but the i32 index ones starts on a 16-byte boundary (the kernels' 16-byte copies).
bool floats_aligned16(const std::vector<Tensor>& tensors) {
  for (const Tensor& t : tensors)
    if (t.dtype() != DType::I32 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  return true;
}

// The tiled kernels: tensor-core fragments of bf16/f16, one instance per head dim, 16-byte cp.async copies.
Support flash_attention_supports(const OpCall& c) {
  const Tensor& q = c.inputs[0];
  if (q.dtype() != DType::BF16 && q.dtype() != DType::F16)
    return Support::no("dtype must be bf16 or f16 (tensor-core operands)");
  if (!flash_attention_head_dim_supported(q.size(-1)))
    return Support::no("head dim must be 64, 128 or 256 (one compiled tile shape each)");
  if (!(c.attr<AttentionAttrs>().scale >= 0.0))
    return Support::no("scale must not be negative (the online softmax takes maxima of the unscaled scores)");
  if (!floats_aligned16(c.inputs)) return Support::no("inputs must be 16-byte aligned (cp.async tile copies)");
  return contiguous_supports(c);
}

int64_t rows_of(const Tensor& t) { return t.size(-1) ? t.numel() / t.size(-1) : 0; }

void run_embedding(const OpCall& c, ExecContext& ctx) {
  const Tensor& w = c.inputs[0];  // (V, H)
  const Tensor& ids = c.inputs[1];
  const int64_t first = std::holds_alternative<EmbeddingAttrs>(c.attrs) ? c.attr<EmbeddingAttrs>().first : -1;
  launch_embedding(w.dtype(), ids.numel(), w.size(1), w.size(0), std::max<int64_t>(first, 0), w.data_ptr(),
                   ids.data<int32_t>(), c.outputs[0].data_ptr(), stream_of(ctx));
}

void run_embedding_backward(const OpCall& c, ExecContext& ctx) {
  const Tensor& dy = c.inputs[0];  // (..., H)
  const Tensor& ids = c.inputs[1];
  const Tensor& dw = c.outputs[0];  // (V, H)
  const int64_t bytes = int64_t(embedding_backward_scratch_bytes(ids.numel()));
  const Tensor scratch = bytes ? Tensor::empty({bytes}, DType::U8, ctx.allocator) : Tensor();  // the sort's buffers
  launch_embedding_backward(dy.dtype(), ids.numel(), dw.size(1), dw.size(0),
                            std::max<int64_t>(c.attr<EmbeddingAttrs>().first, 0), dy.data_ptr(), ids.data<int32_t>(),
                            c.attr<EmbeddingAttrs>().accumulate, bytes ? scratch.data_ptr() : nullptr, dw.data_ptr(),
                            stream_of(ctx));
}

void run_gather_sum(const OpCall& c, ExecContext& ctx) {
  const Tensor& rows = c.inputs[0];
  const Tensor& index = c.inputs[1];
  launch_gather_sum(rows.dtype(), index.size(0), index.size(1), rows.size(0), rows.size(1), rows.data_ptr(),
                    index.data<int32_t>(), c.inputs[2].data_ptr(), c.outputs[0].data_ptr(), stream_of(ctx));
}

void run_rmsnorm(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<NormAttrs>();
  const Tensor& x = c.inputs[0];
  launch_rmsnorm(x.dtype(), rows_of(x), x.size(-1), a.eps, a.offset, x.data_ptr(), c.inputs[1].data_ptr(),
                 c.outputs[0].data_ptr(), stream_of(ctx));
}

// n floats of scratch from the context's allocator, kept alive by `holder` (null for none).
float* float_scratch(ExecContext& ctx, int64_t n, Tensor& holder) {
  if (n == 0) return nullptr;
  holder = Tensor::empty({n}, DType::F32, ctx.allocator);
  return holder.data<float>();
}

// The scratch of the rmsnorm backwards (partial dw rows, then their group sums; rmsnorm_backward_scratch_floats).
float* norm_scratch(ExecContext& ctx, const Tensor& x, Tensor& holder) {
  return float_scratch(ctx, rmsnorm_backward_scratch_floats(rows_of(x), x.size(-1)), holder);
}

void run_rmsnorm_backward(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<NormAttrs>();
  const Tensor& x = c.inputs[0];
  Tensor scratch;
  launch_rmsnorm_backward(x.dtype(), rows_of(x), x.size(-1), a.eps, a.offset, x.data_ptr(), c.inputs[1].data_ptr(),
                          c.inputs[2].data_ptr(), c.outputs[0].data_ptr(), c.outputs[1].data_ptr(),
                          norm_scratch(ctx, x, scratch), stream_of(ctx));
}

void run_residual_rmsnorm(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<NormAttrs>();
  const Tensor& x = c.inputs[0];
  launch_residual_rmsnorm(x.dtype(), rows_of(x), x.size(-1), a.eps, a.offset, x.data_ptr(), c.inputs[1].data_ptr(),
                          c.inputs[2].data_ptr(), c.outputs[0].data_ptr(), c.outputs[1].data_ptr(), stream_of(ctx));
}

void run_residual_rmsnorm_backward(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<NormAttrs>();
  const Tensor& x = c.inputs[0];
  Tensor scratch;
  launch_residual_rmsnorm_backward(x.dtype(), rows_of(x), x.size(-1), a.eps, a.offset, x.data_ptr(),
                                   c.inputs[1].data_ptr(), c.inputs[2].data_ptr(), c.inputs[3].data_ptr(),
                                   c.outputs[0].data_ptr(), c.outputs[1].data_ptr(), norm_scratch(ctx, x, scratch),
                                   stream_of(ctx));
}

void run_gated_rmsnorm(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<NormAttrs>();
  const Tensor& x = c.inputs[0];
  launch_gated_rmsnorm(x.dtype(), rows_of(x), x.size(-1), a.eps, a.offset, x.data_ptr(), c.inputs[1].data_ptr(),
                       c.inputs[2].data_ptr(), c.outputs[0].data_ptr(), stream_of(ctx));
}

void run_gated_rmsnorm_backward(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<NormAttrs>();
  const Tensor& x = c.inputs[0];
  Tensor scratch;
  launch_gated_rmsnorm_backward(x.dtype(), rows_of(x), x.size(-1), a.eps, a.offset, x.data_ptr(),
                                c.inputs[1].data_ptr(), c.inputs[2].data_ptr(), c.inputs[3].data_ptr(),
                                c.outputs[0].data_ptr(), c.outputs[1].data_ptr(), c.outputs[2].data_ptr(),
                                norm_scratch(ctx, x, scratch), stream_of(ctx));
}

// Host-computed with the CPU's function, so the angles match the reference (and transformers) bit for bit.
RopeFrequencies rope_frequencies(double theta, int64_t rotary) {
  RopeFrequencies freqs{};
  for (int64_t i = 0; i < rotary / 2; ++i) freqs.inv_freq[i] = cpu::rope_inv_freq(theta, i, rotary);
  return freqs;
}

void run_rope(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<RopeAttrs>();
  const Tensor& x = c.inputs[0];  // (T, heads, D)
  const int64_t d = x.size(2), rotary = a.rotary_dim ? a.rotary_dim : d;
  launch_rope(x.dtype(), x.size(0), x.size(1), d, rotary / 2, a.inverse, rope_frequencies(a.theta, rotary),
              x.data_ptr(), c.inputs[1].data<int32_t>(), c.outputs[0].data_ptr(), stream_of(ctx));
}

Support qk_norm_rope_supports(const OpCall& c) {
  const auto& a = c.attr<QkNormRopeAttrs>();
  const int64_t d = c.inputs[1].size(0);
  if (a.rope.rotary_dim != 0 && a.rope.rotary_dim != d)
    return Support::no("partial rotary dim (the composite takes it)");
  if (!qk_norm_rope_supported(c.inputs[0].dtype(), d)) return Support::no("head dim not 8, 16 or 32 16-byte packs");
  if (!floats_aligned16(c.inputs) || !floats_aligned16(c.outputs))
    return Support::no("buffers must be 16-byte aligned (16-byte packs)");
  return contiguous_supports(c);
}

void run_qk_norm_rope(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<QkNormRopeAttrs>();
  const Tensor& qkv = c.inputs[0];
  const int64_t d = c.inputs[1].size(0);
  launch_qk_norm_rope(qkv.dtype(), qkv.size(0), a.q_heads, a.kv_heads, d, a.norm.eps, a.norm.offset,
                      rope_frequencies(a.rope.theta, d), qkv.data_ptr(), c.inputs[1].data_ptr(), c.inputs[2].data_ptr(),
                      c.inputs[3].data<int32_t>(), c.outputs[0].data_ptr(), c.outputs[1].data_ptr(),
                      c.outputs[2].data_ptr(), stream_of(ctx));
}

void run_qk_norm_rope_backward(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<QkNormRopeAttrs>();
  const Tensor& qkv = c.inputs[0];
  const int64_t d = c.inputs[1].size(0);
  Tensor scratch;
  float* partials = float_scratch(ctx, qk_norm_rope_backward_scratch_floats(qkv.size(0), d), scratch);
  launch_qk_norm_rope_backward(qkv.dtype(), qkv.size(0), a.q_heads, a.kv_heads, d, a.norm.eps, a.norm.offset,
                               rope_frequencies(a.rope.theta, d), qkv.data_ptr(), c.inputs[1].data_ptr(),
                               c.inputs[2].data_ptr(), c.inputs[3].data<int32_t>(), c.inputs[4].data_ptr(),
                               c.inputs[5].data_ptr(), c.inputs[6].data_ptr(), c.outputs[0].data_ptr(),
                               c.outputs[1].data_ptr(), c.outputs[2].data_ptr(), partials, stream_of(ctx));
}

void run_swiglu(const OpCall& c, ExecContext& ctx) {
  launch_swiglu(c.inputs[0].dtype(), c.outputs[0].numel(), c.inputs[0].data_ptr(), c.inputs[1].data_ptr(),
                c.outputs[0].data_ptr(), stream_of(ctx));
}

void run_swiglu_backward(const OpCall& c, ExecContext& ctx) {
  launch_swiglu_backward(c.inputs[0].dtype(), c.outputs[0].numel(), c.inputs[0].data_ptr(), c.inputs[1].data_ptr(),
                         c.inputs[2].data_ptr(), c.outputs[0].data_ptr(), c.outputs[1].data_ptr(), stream_of(ctx));
}

void run_swiglu_halves(const OpCall& c, ExecContext& ctx) {
  const Tensor& y = c.outputs[0];
  const int64_t cols = y.size(-1);
  launch_swiglu_halves(y.dtype(), cols ? y.numel() / cols : 0, cols, c.inputs[0].data_ptr(), y.data_ptr(),
                       stream_of(ctx));
}

void run_swiglu_halves_backward(const OpCall& c, ExecContext& ctx) {
  const Tensor& dy = c.inputs[1];
  const int64_t cols = dy.size(-1);
  launch_swiglu_halves_backward(dy.dtype(), cols ? dy.numel() / cols : 0, cols, c.inputs[0].data_ptr(),
                                dy.data_ptr(), c.outputs[0].data_ptr(), stream_of(ctx));
}

AttentionDims attention_dims(const OpCall& c, const Tensor& cu) {
  const Tensor& q = c.inputs[0];  // (T, Hq, D)
  AttentionDims d;
  d.tokens = q.size(0);
  d.q_heads = q.size(1);
  d.kv_heads = c.inputs[1].size(1);
  d.head_dim = q.size(2);
  d.n_cu = cu.numel();
  const double scale = c.attr<AttentionAttrs>().scale;
  d.scale = float(scale != 0.0 ? scale : 1.0 / std::sqrt(double(d.head_dim)));
  return d;
}

void run_attention(const OpCall& c, ExecContext& ctx) {
  const Tensor& cu = c.inputs[3];
  launch_attention(c.inputs[0].dtype(), attention_dims(c, cu), c.inputs[0].data_ptr(), c.inputs[1].data_ptr(),
                   c.inputs[2].data_ptr(), cu.data<int32_t>(), c.outputs[0].data_ptr(), c.outputs[1].data<float>(),
                   stream_of(ctx));
}

void run_attention_backward(const OpCall& c, ExecContext& ctx) {
  const Tensor& cu = c.inputs[6];
  const AttentionDims d = attention_dims(c, cu);
  if (d.tokens * d.q_heads == 0) return;
  Tensor delta = Tensor::empty({d.tokens, d.q_heads}, DType::F32, ctx.allocator);  // (T, Hq)
  launch_attention_backward(c.inputs[0].dtype(), d, c.inputs[0].data_ptr(), c.inputs[1].data_ptr(),
                            c.inputs[2].data_ptr(), c.inputs[3].data_ptr(), c.inputs[4].data<float>(),
                            c.inputs[5].data_ptr(), cu.data<int32_t>(), c.outputs[0].data_ptr(), c.outputs[1].data_ptr(),
                            c.outputs[2].data_ptr(), delta.data<float>(), stream_of(ctx));
}

void run_flash_attention(const OpCall& c, ExecContext& ctx) {
  const Tensor& cu = c.inputs[3];
  launch_flash_attention(c.inputs[0].dtype(), attention_dims(c, cu), c.inputs[0].data_ptr(), c.inputs[1].data_ptr(),
                         c.inputs[2].data_ptr(), cu.data<int32_t>(), c.outputs[0].data_ptr(), c.outputs[1].data<float>(),
                         stream_of(ctx));
}

void run_flash_attention_backward(const OpCall& c, ExecContext& ctx) {
  const Tensor& cu = c.inputs[6];
  const AttentionDims d = attention_dims(c, cu);
  if (d.tokens * d.q_heads == 0) return;
  Tensor scratch = Tensor::empty({flash_attention_backward_scratch_floats(d)}, DType::F32, ctx.allocator);  // 2 x (Hq, T)
  launch_flash_attention_backward(c.inputs[0].dtype(), d, c.inputs[0].data_ptr(), c.inputs[1].data_ptr(),
                                  c.inputs[2].data_ptr(), c.inputs[3].data_ptr(), c.inputs[4].data<float>(),
                                  c.inputs[5].data_ptr(), cu.data<int32_t>(), c.outputs[0].data_ptr(),
                                  c.outputs[1].data_ptr(), c.outputs[2].data_ptr(), scratch.data<float>(), stream_of(ctx));
}

// cross_entropy, and cross_entropy_slice (its third input the rows' whole log-sum-exp).
void run_cross_entropy(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<CrossEntropyAttrs>();
  const Tensor& x = c.inputs[0];  // (N, V), rows_layout
  const bool slice = c.op == OpId::cross_entropy_slice;
  launch_cross_entropy(x.dtype(), x.size(0), x.size(1), leading_dim(x), a.with_grad ? leading_dim(c.outputs[1]) : 0,
                       a.ignore_index, a.grad_scale, slice ? a.first : 0, slice ? c.inputs[2].data<float>() : nullptr,
                       x.data_ptr(), c.inputs[1].data<int32_t>(), c.outputs[0].data<float>(),
                       a.with_grad ? c.outputs[1].data_ptr() : nullptr, stream_of(ctx));
}

Support moe_route_supports(const OpCall& c) {
  if (c.inputs[0].size(1) > moe_route_max_experts())
    return Support::no(fmt::format("more than {} experts", moe_route_max_experts()));
  return contiguous_supports(c);
}

void run_moe_route(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<MoeRouteAttrs>();
  const Tensor& logits = c.inputs[0];
  const int64_t bytes = int64_t(moe_route_scratch_bytes(logits.size(0) * a.top_k));
  const Tensor scratch = Tensor::empty({bytes}, DType::U8, ctx.allocator);  // the sort's buffers
  MoeRouteArgs args;
  args.tokens = logits.size(0);
  args.experts = logits.size(1);
  args.top_k = a.top_k;
  args.norm_topk_prob = a.norm_topk_prob;
  args.logits = logits.data<float>();
  args.probs = c.outputs[0].data<float>();
  args.weights = c.outputs[1].data<float>();
  args.picked = c.outputs[2].data<int32_t>();
  args.inv_sum = c.outputs[3].data<float>();
  args.offsets = c.outputs[4].data<int32_t>();
  args.token = c.outputs[5].data<int32_t>();
  args.pair = c.outputs[6].data<int32_t>();
  args.position = c.outputs[7].data<int32_t>();
  launch_moe_route(args, scratch.data_ptr(), stream_of(ctx));
}

void run_moe_pad_plan(const OpCall& c, ExecContext& ctx) {
  const auto& a = c.attr<MoePadAttrs>();
  launch_moe_pad_plan(c.inputs[0].size(0) - 2, a.rows_per_expert, a.top_k, c.inputs[1].size(0),
                      c.inputs[0].data<int32_t>(), c.inputs[1].data<int32_t>(), c.outputs[0].data<int32_t>(),
                      c.outputs[1].data<int32_t>(), c.outputs[2].data<int32_t>(), stream_of(ctx));
}

void run_moe_ep_messages(const OpCall& c, ExecContext& ctx) {
  const int64_t tokens = c.inputs[0].size(0), ranks = c.attr<MoeExchangeAttrs>().ranks;
  const int64_t bytes = int64_t(moe_ep_messages_scratch_bytes(tokens, ranks));
  const Tensor scratch = Tensor::empty({bytes}, DType::U8, ctx.allocator);  // the flags, their sum, cub's storage
  launch_moe_ep_messages(tokens, c.inputs[0].size(1), c.inputs[1].size(0) - 2, ranks, c.inputs[0].data<int32_t>(),
                         c.inputs[1].data<int32_t>(), c.outputs[0].data<int32_t>(), c.outputs[1].data<int32_t>(),
                         c.outputs[2].data<int32_t>(), scratch.data_ptr(), stream_of(ctx));
}

Support moe_ep_slots_supports(const OpCall& c) {
  if (c.inputs[0].size(1) > moe_ep_slots_max_top_k())
    return Support::no(fmt::format("top_k above {}", moe_ep_slots_max_top_k()));
  return contiguous_supports(c);
}

void run_moe_ep_slots(const OpCall& c, ExecContext& ctx) {
  const int64_t ranks = c.attr<MoeExchangeAttrs>().ranks;
  launch_moe_ep_slots(c.inputs[0].size(0), c.inputs[0].size(1), c.inputs[3].size(0), ranks, c.outputs[0].size(1),
                      c.inputs[0].data<int32_t>(), c.inputs[1].data<int32_t>(), c.inputs[2].data<int32_t>(),
                      c.inputs[3].data<int32_t>(), c.outputs[0].data<int32_t>(), c.outputs[1].data<int32_t>(),
                      stream_of(ctx));
}

void run_moe_ep_regroup(const OpCall& c, ExecContext& ctx) {
  launch_moe_ep_regroup(c.attr<MoeExchangeAttrs>().rows, (c.inputs[0].size(0) - 1) / 2, c.inputs[0].data<int32_t>(),
                        c.outputs[0].data<int32_t>(), c.outputs[1].data<int32_t>(), stream_of(ctx));
}

void run_moe_ep_sources(const OpCall& c, ExecContext& ctx) {
  launch_moe_ep_sources(c.inputs[0].size(0), c.inputs[0].size(1), c.inputs[0].data<int32_t>(),
                        c.outputs[0].data<int32_t>(), c.outputs[1].data<int32_t>(), stream_of(ctx));
}

}  // namespace

void register_cuda_model_kernels(KernelRegistry& r) {
  r.add(KernelDef{OpId::moe_pad_plan, DeviceType::CUDA, DType::I32, "cuda/pad_rows", contiguous_supports,
                  run_moe_pad_plan});
  r.add(KernelDef{OpId::moe_ep_messages, DeviceType::CUDA, DType::I32, "cuda/ep_messages_scan", contiguous_supports,
                  run_moe_ep_messages});
  r.add(KernelDef{OpId::moe_ep_slots, DeviceType::CUDA, DType::I32, "cuda/ep_slots", moe_ep_slots_supports,
                  run_moe_ep_slots});
  r.add(KernelDef{OpId::moe_ep_regroup, DeviceType::CUDA, DType::I32, "cuda/ep_regroup", contiguous_supports,
                  run_moe_ep_regroup});
  r.add(KernelDef{OpId::moe_ep_sources, DeviceType::CUDA, DType::I32, "cuda/ep_sources", contiguous_supports,
                  run_moe_ep_sources});
  r.add(KernelDef{OpId::moe_route, DeviceType::CUDA, DType::F32, "cuda/route_rows_radix_plan", moe_route_supports,
                  run_moe_route});
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const auto add = [&](OpId op, const char* name, SupportsFn supports, RunFn run) {
      r.add(KernelDef{op, DeviceType::CUDA, dt, name, std::move(supports), std::move(run)});
    };
    add(OpId::embedding, "cuda/embedding_gather", contiguous_supports, run_embedding);
    add(OpId::embedding_backward, "cuda/embedding_sorted_sum", contiguous_supports, run_embedding_backward);
    add(OpId::gather_sum, "cuda/gather_sum_rows", contiguous_supports, run_gather_sum);
    add(OpId::rmsnorm, "cuda/rmsnorm_rows", contiguous_supports, run_rmsnorm);
    add(OpId::rmsnorm_backward, "cuda/rmsnorm_backward_rows", contiguous_supports, run_rmsnorm_backward);
    add(OpId::residual_rmsnorm, "cuda/residual_rmsnorm_rows", contiguous_supports, run_residual_rmsnorm);
    add(OpId::residual_rmsnorm_backward, "cuda/residual_rmsnorm_backward_rows", contiguous_supports,
        run_residual_rmsnorm_backward);
    add(OpId::gated_rmsnorm, "cuda/gated_rmsnorm_rows", contiguous_supports, run_gated_rmsnorm);
    add(OpId::gated_rmsnorm_backward, "cuda/gated_rmsnorm_backward_rows", contiguous_supports,
        run_gated_rmsnorm_backward);
    add(OpId::rope, "cuda/rope_rotate_half", rope_supports, run_rope);
    add(OpId::qk_norm_rope, "cuda/qk_norm_rope_heads", qk_norm_rope_supports, run_qk_norm_rope);
    add(OpId::qk_norm_rope_backward, "cuda/qk_norm_rope_heads", qk_norm_rope_supports, run_qk_norm_rope_backward);
    add(OpId::swiglu, "cuda/swiglu", contiguous_supports, run_swiglu);
    add(OpId::swiglu_backward, "cuda/swiglu_backward", contiguous_supports, run_swiglu_backward);
    add(OpId::swiglu_halves, "cuda/swiglu_halves", contiguous_supports, run_swiglu_halves);
    add(OpId::swiglu_halves_backward, "cuda/swiglu_halves", contiguous_supports, run_swiglu_halves_backward);
    if (dt != DType::F32) {  // registered first: preferred wherever its predicate holds
#ifdef LATHE_WITH_CUDNN
      register_cudnn_attention_kernels(r, dt);  // cuDNN's fused attention first; the tiled kernels are its fallback
#endif
      add(OpId::attention, "cuda/flash_attention", flash_attention_supports, run_flash_attention);
      add(OpId::attention_backward, "cuda/flash_attention_backward", flash_attention_supports,
          run_flash_attention_backward);
    }
    add(OpId::attention, "cuda/causal_varlen_attention", attention_supports, run_attention);
    add(OpId::attention_backward, "cuda/causal_varlen_attention_backward", attention_supports, run_attention_backward);
    add(OpId::cross_entropy, "cuda/cross_entropy_rows", rows_layout, run_cross_entropy);
    add(OpId::cross_entropy_slice, "cuda/cross_entropy_slice_rows", rows_layout, run_cross_entropy);
  }
}

}  // namespace lathe::cuda
