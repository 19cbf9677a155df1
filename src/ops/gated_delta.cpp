// The Gated DeltaNet ops (sigmoid, causal_conv1d, gdn_decay, gated_delta_rule, their backward ops, and the
// forward-only gated_delta_rule_state of decoding): the op functions, their shape inference and the backward
// compositions, kept out of the generic op files.
// Formulas at GatedDeltaAttrs in ops/op_table.h. Convention: every op takes packed documents through cu_seqlens
// (N + 1) i32; the shapes are checked here, the boundaries (0 = cu[0] <= ... <= cu[N] = T) by the kernels.
// gated_delta_rule(_backward) accepts f32 g and beta beside bf16/f16 q, k, v (the model's fp32 log-decay).
// Covered by tests/ops (op cases in testing/op_cases_gated_delta.cpp and op_cases_gdn_state.cpp) and
// tests/models/test_qwen3_5.cpp, test_generate_qwen3_5.cpp (the op gated_delta_rule_state).
#include <cmath>

#include "ops/ops.h"

namespace lathe {

namespace {

bool is_16bit_float(DType t) { return t == DType::BF16 || t == DType::F16; }

void same_dtype(OpId op, const Tensor& a, const Tensor& b) {
  LATHE_CHECK(a.dtype() == b.dtype(), "ops: {} needs inputs of one dtype, got {} and {}", op_name(op), a.describe(),
              b.describe());
}

void check_cu(OpId op, const Tensor& cu) {
  LATHE_CHECK(cu.dtype() == DType::I32 && cu.dim() == 1 && cu.size(0) >= 2,
              "ops: {} cu_seqlens must be (N + 1) i32 with N >= 1, got {}", op_name(op), cu.describe());
}

}  // namespace

bool gdn_chunk_cache_applies(const std::vector<Tensor>& in, const GatedDeltaAttrs& attrs) {
  if (!attrs.save_states || in.size() < 6 || !in[0].device().is_cuda()) return false;
  const Tensor& q = in[0];
  const Tensor& v = in[2];
  if (q.dtype() != DType::BF16 || q.dim() != 3 || v.dim() != 3 || q.size(2) != 128 || v.size(2) != 128) return false;
  for (size_t i = 0; i < 6; ++i)
    if (!in[i].is_contiguous() || reinterpret_cast<uintptr_t>(in[i].data_ptr()) % 16 != 0) return false;
  return true;
}

bool is_opaque_output(OpId op, size_t index) { return op == OpId::gated_delta_rule && index == 2; }

std::vector<TensorSpec> infer_gated_delta_outputs(OpId op, const std::vector<Tensor>& in, const OpAttrs& attrs) {
  const std::string_view name = op_name(op);
  LATHE_CHECK(is_floating(in[0].dtype()), "ops: {} needs a floating-point input, got {}", name, in[0].describe());
  switch (op) {
    case OpId::sigmoid:
      return {{in[0].shape(), in[0].dtype()}};
    case OpId::sigmoid_backward:
      same_dtype(op, in[0], in[1]);
      LATHE_CHECK(in[0].shape() == in[1].shape(), "ops: sigmoid_backward shapes differ: {} and {}", in[0].describe(),
                  in[1].describe());
      return {{in[0].shape(), in[0].dtype()}};
    case OpId::causal_conv1d:
    case OpId::causal_conv1d_backward: {
      const Tensor& x = in[0];
      const Tensor& w = in[1];
      same_dtype(op, x, w);
      LATHE_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(0) == x.size(1) && w.size(1) >= 1,
                  "ops: {} needs x (T, C) and w (C, W), got {} and {}", name, x.describe(), w.describe());
      check_cu(op, in[op == OpId::causal_conv1d ? 2 : 3]);
      if (op == OpId::causal_conv1d) return {{x.shape(), x.dtype()}};
      same_dtype(op, x, in[2]);
      LATHE_CHECK(in[2].shape() == x.shape(), "ops: causal_conv1d_backward dy {} does not match x {}", in[2].describe(),
                  x.describe());
      return {{x.shape(), x.dtype()}, {w.shape(), w.dtype()}};
    }
    case OpId::gdn_decay:
    case OpId::gdn_decay_backward: {
      const Tensor& a = in[0];
      for (size_t i = 1; i < in.size(); ++i) same_dtype(op, a, in[i]);
      LATHE_CHECK(a.dim() == 2 && in[1].dim() == 1 && in[2].dim() == 1 && in[1].size(0) == a.size(1) &&
                      in[2].size(0) == a.size(1),
                  "ops: {} needs a (T, H), A_log (H) and dt_bias (H), got {}, {}, {}", name, a.describe(),
                  in[1].describe(), in[2].describe());
      if (op == OpId::gdn_decay) return {{a.shape(), a.dtype()}};
      LATHE_CHECK(in[3].shape() == a.shape(), "ops: gdn_decay_backward dg {} does not match a {}", in[3].describe(),
                  a.describe());
      return {{a.shape(), a.dtype()}, {in[1].shape(), a.dtype()}, {in[2].shape(), a.dtype()}};
    }
    case OpId::gated_delta_rule:
    case OpId::gated_delta_rule_backward:
    case OpId::gated_delta_rule_state: {
      const Tensor& q = in[0];
      const Tensor& k = in[1];
      const Tensor& v = in[2];
      const Tensor& g = in[3];
      const Tensor& beta = in[4];
      // q, k, v (and do) share one dtype; g and beta share q's or, under bf16/f16 q, f32 (the model keeps the
      // log-decay in fp32 as transformers does). dg and dbeta come back in the dtype of g and beta.
      same_dtype(op, q, k);
      same_dtype(op, q, v);
      same_dtype(op, g, beta);
      LATHE_CHECK(g.dtype() == q.dtype() || (g.dtype() == DType::F32 && is_16bit_float(q.dtype())),
                  "ops: {} takes g and beta in the dtype of q or, for bf16/f16 q, in f32; got q {}, g {}", name,
                  q.describe(), g.describe());
      LATHE_CHECK(q.dim() == 3 && k.shape() == q.shape() && v.dim() == 3 && v.size(0) == q.size(0) &&
                      q.size(1) > 0 && v.size(1) % q.size(1) == 0,
                  "ops: {} needs q and k (T, H_k, d_k), v (T, H_v, d_v) with H_v a multiple of H_k; got {}, {}, {}",
                  name, q.describe(), k.describe(), v.describe());
      const Shape gate{v.size(0), v.size(1)};
      LATHE_CHECK(g.shape() == gate && beta.shape() == gate, "ops: {} needs g and beta (T, H_v) = {}, got {} and {}",
                  name, shape_str(gate), g.describe(), beta.describe());
      const auto& a = std::get<GatedDeltaAttrs>(attrs);
      LATHE_CHECK(a.chunk >= 1 && std::isfinite(a.scale) && a.scale >= 0.0,
                  "ops: {} needs chunk >= 1 and a finite scale >= 0 (0 = d_k^-1/2), got chunk {}, scale {}", name,
                  a.chunk, a.scale);
      const Shape states{a.save_states ? gdn_state_rows(q.size(0), in[5].size(0) - 1) : 0, v.size(1), q.size(2),
                         v.size(2)};
      const Shape cache{gdn_chunk_cache_applies(in, a) ? q.size(0) : 0, v.size(1), kGdnChunkCacheWidth};
      if (op == OpId::gated_delta_rule) {
        check_cu(op, in[5]);
        return {{v.shape(), v.dtype()}, {states, v.dtype()}, {cache, v.dtype()}};
      }
      if (op == OpId::gated_delta_rule_state) {
        check_cu(op, in[5]);
        const Tensor& state = in[6];
        const Shape want{in[5].size(0) - 1, v.size(1), q.size(2), v.size(2)};
        LATHE_CHECK(state.shape() == want, "ops: gated_delta_rule_state needs a state (N, H_v, d_k, d_v) = {} for {} "
                    "documents, got {}", shape_str(want), want[0], state.describe());
        LATHE_CHECK(state.dtype() == gdn_state_dtype(q.dtype()), "ops: gated_delta_rule_state needs the state in {} "
                    "for {} inputs (the accumulation dtype), got {}", dtype_name(gdn_state_dtype(q.dtype())),
                    dtype_name(q.dtype()), state.describe());
        return {{v.shape(), v.dtype()}, {state.shape(), state.dtype()}};
      }
      same_dtype(op, q, in[5]);
      LATHE_CHECK(in[5].shape() == v.shape(), "ops: gated_delta_rule_backward do {} does not match v {}",
                  in[5].describe(), v.describe());
      check_cu(op, in[6]);
      const Tensor& saved = in[7];
      Shape full = states;
      full[0] = gdn_state_rows(q.size(0), in[6].size(0) - 1);
      LATHE_CHECK(saved.dtype() == v.dtype() && saved.dim() == 4 && (saved.size(0) == 0 || saved.shape() == full) &&
                      saved.size(1) == full[1] && saved.size(2) == full[2] && saved.size(3) == full[3],
                  "ops: gated_delta_rule_backward needs the forward's states {} in {} (or 0 rows), got {}",
                  shape_str(full), dtype_name(v.dtype()), saved.describe());
      const Tensor& chunk_cache = in[8];
      const Shape full_cache{q.size(0), v.size(1), kGdnChunkCacheWidth};
      LATHE_CHECK(chunk_cache.dtype() == v.dtype() && chunk_cache.dim() == 3 && (chunk_cache.size(0) == 0 ||
                      chunk_cache.shape() == full_cache) && chunk_cache.size(1) == v.size(1) &&
                      chunk_cache.size(2) == kGdnChunkCacheWidth,
                  "ops: gated_delta_rule_backward needs the forward's chunk cache {} in {} (or 0 rows), got {}",
                  shape_str(full_cache), dtype_name(v.dtype()), chunk_cache.describe());
      return {{q.shape(), q.dtype()}, {k.shape(), k.dtype()}, {v.shape(), v.dtype()}, {g.shape(), g.dtype()},
              {beta.shape(), beta.dtype()}};
    }
    default: break;
  }
  LATHE_FAIL("ops: {} is not a Gated DeltaNet op", name);
}

std::vector<Tensor> gated_delta_op_backward(ExecContext& ctx, OpId op, const std::vector<Tensor>& in,
                                            const OpAttrs& attrs, const std::vector<Tensor>& outputs,
                                            const Tensor& dy) {
  switch (op) {
    case OpId::sigmoid:
      return {sigmoid_backward(ctx, outputs.at(0), dy)};
    case OpId::causal_conv1d: {
      std::vector<Tensor> g = causal_conv1d_backward(ctx, in[0], in[1], dy, in[2]);
      g.push_back(Tensor());
      return g;
    }
    case OpId::gdn_decay:
      return gdn_decay_backward(ctx, in[0], in[1], in[2], dy);
    case OpId::gated_delta_rule: {
      std::vector<Tensor> g = gated_delta_rule_backward(ctx, in[0], in[1], in[2], in[3], in[4], dy, in[5],
                                                        outputs.at(1), std::get<GatedDeltaAttrs>(attrs), outputs.at(2));
      g.push_back(Tensor());
      return g;
    }
    default: break;
  }
  LATHE_FAIL("ops: {} has no backward", op_name(op));
}

Tensor sigmoid(ExecContext& ctx, const Tensor& x) { return call_op(ctx, OpId::sigmoid, {contiguous(ctx, x)})[0]; }

Tensor sigmoid_backward(ExecContext& ctx, const Tensor& y, const Tensor& dy) {
  return call_op(ctx, OpId::sigmoid_backward, {contiguous(ctx, y), contiguous(ctx, dy)})[0];
}

Tensor causal_conv1d(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens) {
  return call_op(ctx, OpId::causal_conv1d, {contiguous(ctx, x), contiguous(ctx, w), contiguous(ctx, cu_seqlens)})[0];
}

std::vector<Tensor> causal_conv1d_backward(ExecContext& ctx, const Tensor& x, const Tensor& w, const Tensor& dy,
                                           const Tensor& cu_seqlens) {
  return call_op(ctx, OpId::causal_conv1d_backward,
                 {contiguous(ctx, x), contiguous(ctx, w), contiguous(ctx, dy), contiguous(ctx, cu_seqlens)});
}

Tensor gdn_decay(ExecContext& ctx, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias) {
  return call_op(ctx, OpId::gdn_decay, {contiguous(ctx, a), contiguous(ctx, a_log), contiguous(ctx, dt_bias)})[0];
}

std::vector<Tensor> gdn_decay_backward(ExecContext& ctx, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias,
                                       const Tensor& dg) {
  return call_op(ctx, OpId::gdn_decay_backward,
                 {contiguous(ctx, a), contiguous(ctx, a_log), contiguous(ctx, dt_bias), contiguous(ctx, dg)});
}

std::vector<Tensor> gated_delta_rule(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                     GatedDeltaAttrs attrs) {
  return call_op(ctx, OpId::gated_delta_rule,
                 {contiguous(ctx, q), contiguous(ctx, k), contiguous(ctx, v), contiguous(ctx, g), contiguous(ctx, beta),
                  contiguous(ctx, cu_seqlens)},
                 attrs);
}

std::vector<Tensor> gated_delta_rule_state(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                           const Tensor& state, GatedDeltaAttrs attrs) {
  return call_op(ctx, OpId::gated_delta_rule_state,
                 {contiguous(ctx, q), contiguous(ctx, k), contiguous(ctx, v), contiguous(ctx, g), contiguous(ctx, beta),
                  contiguous(ctx, cu_seqlens), contiguous(ctx, state)},
                 attrs);
}

std::vector<Tensor> gated_delta_rule_backward(ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& g, const Tensor& beta, const Tensor& d_o,
                                              const Tensor& cu_seqlens, const Tensor& states,
                                              GatedDeltaAttrs attrs, const Tensor& chunk_cache) {
  // Nothing saved: (0, ...) placeholders (nothing allocated) ask the kernels to recompute.
  const Tensor saved = states.defined() ? contiguous(ctx, states)
                                        : Tensor::empty({0, v.size(1), q.size(2), v.size(2)}, v.dtype(), ctx.allocator);
  const Tensor cache = chunk_cache.defined()
                           ? contiguous(ctx, chunk_cache)
                           : Tensor::empty({0, v.size(1), kGdnChunkCacheWidth}, v.dtype(), ctx.allocator);
  return call_op(ctx, OpId::gated_delta_rule_backward,
                 {contiguous(ctx, q), contiguous(ctx, k), contiguous(ctx, v), contiguous(ctx, g), contiguous(ctx, beta),
                  contiguous(ctx, d_o), contiguous(ctx, cu_seqlens), saved, cache},
                 attrs);
}

}  // namespace lathe
