// Shape inference and validation for every op in the op table.
#include <algorithm>
#include <cmath>

#include "ops/ops.h"

namespace lathe {

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    LATHE_CHECK(da == db || da == 1 || db == 1, "ops: shapes {} and {} do not broadcast", shape_str(a),
                shape_str(b));
    out[i] = da == 1 ? db : da;
  }
  return out;
}

std::vector<int> normalize_reduce_dims(const std::vector<int>& dims, int rank) {
  std::vector<int> out;
  if (dims.empty()) {
    for (int i = 0; i < rank; ++i) out.push_back(i);
    return out;
  }
  for (int d : dims) {
    const int w = d < 0 ? d + rank : d;
    LATHE_CHECK(w >= 0 && w < rank, "ops: reduction dim {} out of range for a {}-d tensor", d, rank);
    LATHE_CHECK(std::find(out.begin(), out.end(), w) == out.end(), "ops: reduction dim {} repeated", d);
    out.push_back(w);
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

void check_same_dtype(OpId op, const Tensor& a, const Tensor& b) {
  LATHE_CHECK(a.dtype() == b.dtype(), "ops: {} needs inputs of one dtype, got {} and {}", op_name(op),
              a.describe(), b.describe());
}

// Softmax statistics and losses are f32, except in the f64 reference.
DType stats_dtype(DType t) { return t == DType::F64 ? DType::F64 : DType::F32; }

void check_index(OpId op, const Tensor& t, const char* what) {
  LATHE_CHECK(t.dtype() == DType::I32, "ops: {} {} must be i32, got {}", op_name(op), what, t.describe());
}

void check_floating(OpId op, const Tensor& a) {
  LATHE_CHECK(is_floating(a.dtype()), "ops: {} needs a floating-point input, got {}", op_name(op), a.describe());
}

TensorSpec matmul_output(const Tensor& a, const Tensor& b, const MatmulAttrs& attrs) {
  LATHE_CHECK(a.dim() >= 2 && b.dim() >= 2, "ops: matmul needs inputs of at least 2 dims, got {} and {}",
              a.describe(), b.describe());
  const int64_t m = attrs.trans_a ? a.size(-1) : a.size(-2);
  const int64_t ka = attrs.trans_a ? a.size(-2) : a.size(-1);
  const int64_t kb = attrs.trans_b ? b.size(-1) : b.size(-2);
  const int64_t n = attrs.trans_b ? b.size(-2) : b.size(-1);
  LATHE_CHECK(ka == kb, "ops: matmul inner dimensions differ: {}{} x {}{}", a.describe(),
              attrs.trans_a ? "^T" : "", b.describe(), attrs.trans_b ? "^T" : "");
  if (b.dim() == 2 && a.dim() > 2) {
    LATHE_CHECK(!attrs.trans_a, "ops: matmul with batched A and 2-D B needs trans_a=false");
  } else {
    LATHE_CHECK(a.dim() == b.dim(), "ops: matmul batch ranks differ: {} x {}", a.describe(), b.describe());
    for (int i = 0; i < a.dim() - 2; ++i)
      LATHE_CHECK(a.size(i) == b.size(i), "ops: matmul batch dims differ: {} x {}", a.describe(), b.describe());
  }
  Shape out(a.shape().begin(), a.shape().end() - 2);
  out.push_back(m);
  out.push_back(n);
  return {out, a.dtype()};
}

// Segment attrs of segment_mask / dropout on x (T, C): each op checks the fields it reads (op_table.h).
void check_segments(OpId op, const Tensor& x, const SegmentAttrs& a) {
  const std::string_view name = op_name(op);
  LATHE_CHECK(x.dim() == 2, "ops: {} needs x (T, C), got {}", name, x.describe());
  const int64_t t = x.size(0), c = x.size(1);
  LATHE_CHECK(!a.rows.empty(), "ops: {} needs S + 1 row offsets (rows is empty)", name);
  const size_t n_seg = a.rows.size() - 1;
  LATHE_CHECK(a.rows[0] == 0, "ops: {} rows must start at 0, got {}", name, a.rows[0]);
  for (size_t s = 0; s < n_seg; ++s)
    LATHE_CHECK(a.rows[s] <= a.rows[s + 1], "ops: {} row offsets must be non-decreasing: rows[{}] = {} > rows[{}] = {}",
                name, s, a.rows[s], s + 1, a.rows[s + 1]);
  LATHE_CHECK(a.rows[n_seg] <= t, "ops: {} rows end at {}, beyond the {} rows of x {}", name, a.rows[n_seg], t,
              x.describe());
  const auto check_size = [&](size_t size, const char* field) {
    LATHE_CHECK(size == n_seg, "ops: {} needs one {} per segment: {} segments, {} {}", name, field, n_seg, size, field);
  };
  if (op == OpId::segment_mask) {
    check_size(a.col_begin.size(), "col_begin");
    check_size(a.col_end.size(), "col_end");
    check_size(a.scale.size(), "scale");
    for (size_t s = 0; s < n_seg; ++s)
      LATHE_CHECK(0 <= a.col_begin[s] && a.col_begin[s] <= a.col_end[s] && a.col_end[s] <= c,
                  "ops: segment_mask columns [{}, {}) of segment {} are not a range within [0, {}]", a.col_begin[s],
                  a.col_end[s], s, c);
  } else {
    check_size(a.p.size(), "p");
    check_size(a.seed.size(), "seed");
    for (size_t s = 0; s < n_seg; ++s)
      LATHE_CHECK(a.p[s] >= 0.0 && a.p[s] < 1.0, "ops: dropout p of segment {} must lie in [0, 1), got {}", s, a.p[s]);
    if (!a.row_shift.empty()) check_size(a.row_shift.size(), "row_shift");
    for (int64_t shift : a.row_shift) LATHE_CHECK(shift >= 0, "ops: dropout row_shift {} is negative", shift);
    const int64_t width = a.row_width > 0 ? a.row_width : c;
    LATHE_CHECK(a.col_offset >= 0 && a.row_width >= 0 && a.col_offset + c <= width,
                "ops: dropout columns [{}, {}) of x {} do not lie within rows of {} columns", a.col_offset,
                a.col_offset + c, x.describe(), width);
  }
}

}  // namespace

std::vector<TensorSpec> infer_outputs(OpId op, const std::vector<Tensor>& in, const OpAttrs& attrs) {
  if (op_num_inputs(op) < 0)
    LATHE_CHECK(!in.empty(), "ops: {} takes a list of at least one input, got none", op_name(op));
  else
    LATHE_CHECK(int(in.size()) == op_num_inputs(op), "ops: {} takes {} inputs, got {}", op_name(op),
                op_num_inputs(op), in.size());
  for (const Tensor& t : in) LATHE_CHECK(t.defined(), "ops: {} got an undefined input", op_name(op));
  switch (op) {
    case OpId::matmul:
      check_same_dtype(op, in[0], in[1]);
      check_floating(op, in[0]);
      return {matmul_output(in[0], in[1], std::get<MatmulAttrs>(attrs))};
    case OpId::add:
    case OpId::mul:
      check_same_dtype(op, in[0], in[1]);
      check_floating(op, in[0]);
      return {{broadcast_shapes(in[0].shape(), in[1].shape()), in[0].dtype()}};
    case OpId::scale:
    case OpId::softmax:
    case OpId::silu:
      check_floating(op, in[0]);
      if (op == OpId::softmax) LATHE_CHECK(in[0].dim() >= 1, "ops: softmax of a 0-d tensor");
      return {{in[0].shape(), in[0].dtype()}};
    case OpId::softmax_backward:
    case OpId::silu_backward:
      check_same_dtype(op, in[0], in[1]);
      check_floating(op, in[0]);
      LATHE_CHECK(in[0].shape() == in[1].shape(), "ops: {} shapes differ: {} and {}", op_name(op),
                  in[0].describe(), in[1].describe());
      return {{in[0].shape(), in[0].dtype()}};
    case OpId::cast:
      return {{in[0].shape(), std::get<CastAttrs>(attrs).to}};
    case OpId::sum:
    case OpId::mean: {
      check_floating(op, in[0]);
      const auto& r = std::get<ReduceAttrs>(attrs);
      const std::vector<int> dims = normalize_reduce_dims(r.dims, in[0].dim());
      Shape out;
      for (int i = 0; i < in[0].dim(); ++i) {
        const bool reduced = std::find(dims.begin(), dims.end(), i) != dims.end();
        if (!reduced) out.push_back(in[0].size(i));
        else if (r.keepdim) out.push_back(1);
      }
      return {{out, in[0].dtype()}};
    }
    case OpId::sum_squares:
      check_floating(op, in[0]);
      return {{Shape{}, stats_dtype(in[0].dtype())}};
    case OpId::sum_squares_list:
      check_floating(op, in[0]);
      for (const Tensor& t : in) {
        check_same_dtype(op, in[0], t);
        LATHE_CHECK(t.is_contiguous(), "ops: sum_squares_list needs contiguous inputs, got {}", t.describe());
      }
      return {{Shape{int64_t(in.size())}, stats_dtype(in[0].dtype())}};
    case OpId::swiglu:
    case OpId::swiglu_backward: {
      for (size_t i = 1; i < in.size(); ++i) {
        check_same_dtype(op, in[0], in[i]);
        LATHE_CHECK(in[0].shape() == in[i].shape(), "ops: {} shapes differ: {} and {}", op_name(op),
                    in[0].describe(), in[i].describe());
      }
      check_floating(op, in[0]);
      const TensorSpec s{in[0].shape(), in[0].dtype()};
      return op == OpId::swiglu ? std::vector<TensorSpec>{s} : std::vector<TensorSpec>{s, s};
    }
    case OpId::swiglu_halves:
    case OpId::swiglu_halves_backward: {
      check_floating(op, in[0]);
      LATHE_CHECK(in[0].dim() >= 1 && in[0].size(-1) % 2 == 0,
                  "ops: {} needs gate and up side by side in the last dim (even), got {}", op_name(op),
                  in[0].describe());
      Shape half = in[0].shape();
      half.back() /= 2;
      if (op == OpId::swiglu_halves) return {{half, in[0].dtype()}};
      check_same_dtype(op, in[0], in[1]);
      LATHE_CHECK(in[1].shape() == half, "ops: swiglu_halves_backward dy {} does not match half of {}",
                  in[1].describe(), in[0].describe());
      return {{in[0].shape(), in[0].dtype()}};
    }
    case OpId::embedding: {
      check_floating(op, in[0]);
      LATHE_CHECK(in[0].dim() == 2, "ops: embedding weight must be (vocab, hidden), got {}", in[0].describe());
      check_index(op, in[1], "ids");
      Shape out = in[1].shape();
      out.push_back(in[0].size(1));
      return {{out, in[0].dtype()}};
    }
    case OpId::embedding_backward: {
      check_floating(op, in[0]);
      check_index(op, in[1], "ids");
      const int64_t vocab = std::get<EmbeddingAttrs>(attrs).vocab;
      LATHE_CHECK(vocab > 0, "ops: embedding_backward needs the vocabulary size");
      LATHE_CHECK(in[0].dim() == in[1].dim() + 1 && in[0].numel() == in[1].numel() * in[0].size(-1),
                  "ops: embedding_backward dy {} does not match ids {}", in[0].describe(), in[1].describe());
      return {{{vocab, in[0].size(-1)}, in[0].dtype()}};
    }
    case OpId::rmsnorm:
    case OpId::rmsnorm_backward: {
      check_floating(op, in[0]);
      check_same_dtype(op, in[0], in[1]);
      LATHE_CHECK(in[1].dim() == 1 && in[0].dim() >= 1 && in[1].size(0) == in[0].size(-1),
                  "ops: {} weight {} does not match input {}", op_name(op), in[1].describe(), in[0].describe());
      if (op == OpId::rmsnorm) return {{in[0].shape(), in[0].dtype()}};
      check_same_dtype(op, in[0], in[2]);
      LATHE_CHECK(in[2].shape() == in[0].shape(), "ops: rmsnorm_backward dy {} does not match x {}",
                  in[2].describe(), in[0].describe());
      return {{in[0].shape(), in[0].dtype()}, {in[1].shape(), in[1].dtype()}};
    }
    case OpId::residual_rmsnorm:
    case OpId::residual_rmsnorm_backward: {
      const bool fwd = op == OpId::residual_rmsnorm;
      const Tensor& w = in[fwd ? 2 : 1];
      check_floating(op, in[0]);
      check_same_dtype(op, in[0], w);
      LATHE_CHECK(w.dim() == 1 && in[0].dim() >= 1 && w.size(0) == in[0].size(-1),
                  "ops: {} weight {} does not match input {}", op_name(op), w.describe(), in[0].describe());
      for (size_t i : fwd ? std::vector<size_t>{1} : std::vector<size_t>{2, 3}) {
        check_same_dtype(op, in[0], in[i]);
        LATHE_CHECK(in[i].shape() == in[0].shape(), "ops: {} input {} {} does not match x {}", op_name(op), i,
                    in[i].describe(), in[0].describe());
      }
      if (fwd) return {{in[0].shape(), in[0].dtype()}, {in[0].shape(), in[0].dtype()}};
      return {{in[0].shape(), in[0].dtype()}, {w.shape(), w.dtype()}};
    }
    case OpId::gated_rmsnorm:
    case OpId::gated_rmsnorm_backward: {
      check_floating(op, in[0]);
      check_same_dtype(op, in[0], in[1]);
      LATHE_CHECK(in[1].dim() == 1 && in[0].dim() >= 1 && in[1].size(0) == in[0].size(-1),
                  "ops: {} weight {} does not match input {}", op_name(op), in[1].describe(), in[0].describe());
      check_same_dtype(op, in[0], in[2]);
      LATHE_CHECK(in[2].shape() == in[0].shape(), "ops: {} gate z {} does not match x {}", op_name(op),
                  in[2].describe(), in[0].describe());
      if (op == OpId::gated_rmsnorm) return {{in[0].shape(), in[0].dtype()}};
      check_same_dtype(op, in[0], in[3]);
      LATHE_CHECK(in[3].shape() == in[0].shape(), "ops: gated_rmsnorm_backward dy {} does not match x {}",
                  in[3].describe(), in[0].describe());
      return {{in[0].shape(), in[0].dtype()}, {in[1].shape(), in[1].dtype()}, {in[0].shape(), in[0].dtype()}};
    }
    case OpId::rope: {
      check_floating(op, in[0]);
      check_index(op, in[1], "positions");
      LATHE_CHECK(in[0].dim() == 3 && in[1].dim() == 1 && in[1].size(0) == in[0].size(0),
                  "ops: rope needs x (T, heads, D) and positions (T), got {} and {}", in[0].describe(),
                  in[1].describe());
      const int64_t r = std::get<RopeAttrs>(attrs).rotary_dim;
      LATHE_CHECK(r >= 0 && r <= in[0].size(2) && r % 2 == 0, "ops: rope rotary_dim {} invalid for head dim {}", r,
                  in[0].size(2));
      return {{in[0].shape(), in[0].dtype()}};
    }
    case OpId::qk_norm_rope:
    case OpId::qk_norm_rope_backward: {
      const auto& a = std::get<QkNormRopeAttrs>(attrs);
      const Tensor& qkv = in[0];
      check_floating(op, qkv);
      check_same_dtype(op, qkv, in[1]);
      check_same_dtype(op, qkv, in[2]);
      check_index(op, in[3], "positions");
      const int64_t d = in[1].dim() == 1 ? in[1].size(0) : 0;
      LATHE_CHECK(a.q_heads > 0 && a.kv_heads > 0 && d > 0 && in[2].shape() == in[1].shape(),
                  "ops: {} needs q_heads and kv_heads above 0 and wq, wk (D); got {} and {} heads, wq {}, wk {}",
                  op_name(op), a.q_heads, a.kv_heads, in[1].describe(), in[2].describe());
      const int64_t t = qkv.dim() == 2 ? qkv.size(0) : -1;
      LATHE_CHECK(t >= 0 && qkv.size(1) == (a.q_heads + 2 * a.kv_heads) * d && in[3].dim() == 1 &&
                      in[3].size(0) == t,
                  "ops: {} needs qkv (T, (q_heads + 2 kv_heads) D) = (T, {}) and positions (T); got {} and {}",
                  op_name(op), (a.q_heads + 2 * a.kv_heads) * d, qkv.describe(), in[3].describe());
      LATHE_CHECK(!a.rope.inverse && a.rope.rotary_dim >= 0 && a.rope.rotary_dim <= d && a.rope.rotary_dim % 2 == 0,
                  "ops: {} needs a forward rope with an even rotary_dim of at most {}", op_name(op), d);
      const Shape qs{t, a.q_heads, d}, ks{t, a.kv_heads, d};
      if (op == OpId::qk_norm_rope) return {{qs, qkv.dtype()}, {ks, qkv.dtype()}, {ks, qkv.dtype()}};
      for (size_t i = 4; i < 7; ++i) check_same_dtype(op, qkv, in[i]);
      LATHE_CHECK(in[4].shape() == qs && in[5].shape() == ks && in[6].shape() == ks,
                  "ops: qk_norm_rope_backward needs dq {}, dk and dv {}; got {}, {}, {}", shape_str(qs),
                  shape_str(ks), in[4].describe(), in[5].describe(), in[6].describe());
      return {{qkv.shape(), qkv.dtype()}, {in[1].shape(), qkv.dtype()}, {in[2].shape(), qkv.dtype()}};
    }
    case OpId::attention:
    case OpId::attention_backward: {
      const Tensor& q = in[0];
      const Tensor& k = in[1];
      const Tensor& v = in[2];
      const Tensor& cu = in[op == OpId::attention ? 3 : 6];
      check_floating(op, q);
      check_same_dtype(op, q, k);
      check_same_dtype(op, q, v);
      LATHE_CHECK(q.dim() == 3 && k.dim() == 3 && v.shape() == k.shape() && q.size(0) == k.size(0) &&
                      q.size(2) == k.size(2) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                  "ops: {} needs q (T, Hq, D), k and v (T, Hkv, D) with Hq a multiple of Hkv; got {}, {}, {}",
                  op_name(op), q.describe(), k.describe(), v.describe());
      check_index(op, cu, "cu_seqlens");
      LATHE_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "ops: {} cu_seqlens must be (B + 1), got {}", op_name(op),
                  cu.describe());
      if (op == OpId::attention) return {{q.shape(), q.dtype()}, {{q.size(0), q.size(1)}, stats_dtype(q.dtype())}};
      LATHE_CHECK(in[3].shape() == q.shape() && in[5].shape() == q.shape() && in[4].dtype() == stats_dtype(q.dtype()) &&
                      in[4].shape() == (Shape{q.size(0), q.size(1)}),
                  "ops: attention_backward o, lse or do do not match q {}", q.describe());
      return {{q.shape(), q.dtype()}, {k.shape(), k.dtype()}, {v.shape(), v.dtype()}};
    }
    case OpId::paged_attention: {
      const Tensor& q = in[0];
      const Tensor& kc = in[1];
      check_floating(op, q);
      check_same_dtype(op, q, kc);
      check_same_dtype(op, q, in[2]);
      const auto& a = std::get<PagedAttentionAttrs>(attrs);
      LATHE_CHECK(a.block_size >= 1, "ops: paged_attention block_size must be >= 1, got {}", a.block_size);
      LATHE_CHECK(q.dim() == 3 && kc.dim() == 3 && in[2].shape() == kc.shape() && q.size(2) == kc.size(2) &&
                      kc.size(1) > 0 && q.size(1) % kc.size(1) == 0 && kc.size(0) % a.block_size == 0,
                  "ops: paged_attention needs q (T, Hq, D), k_cache and v_cache (S, Hkv, D) with Hq a multiple of Hkv "
                  "and S of block_size {}; got {}, {}, {}", a.block_size, q.describe(), kc.describe(), in[2].describe());
      check_index(op, in[3], "block_table");
      check_index(op, in[4], "cu_q");
      check_index(op, in[5], "context_lens");
      LATHE_CHECK(in[3].dim() == 2 && in[4].dim() == 1 && in[5].dim() == 1 && in[4].size(0) == in[3].size(0) + 1 &&
                      in[5].size(0) == in[3].size(0),
                  "ops: paged_attention needs block_table (B, M), cu_q (B + 1) and context_lens (B); got {}, {}, {}",
                  in[3].describe(), in[4].describe(), in[5].describe());
      return {{q.shape(), q.dtype()}};
    }
    case OpId::scatter_rows: {
      const Tensor& src = in[0];
      const Tensor& dst = in[2];
      check_same_dtype(op, src, dst);
      check_index(op, in[1], "index");
      LATHE_CHECK(src.dim() >= 1 && dst.dim() == src.dim() && in[1].dim() == 1 && in[1].size(0) == src.size(0) &&
                      std::equal(src.shape().begin() + 1, src.shape().end(), dst.shape().begin() + 1),
                  "ops: scatter_rows needs src (T, ...), index (T) and dst (N, ...) with the same row shape; got {}, "
                  "{}, {}", src.describe(), in[1].describe(), dst.describe());
      return {{dst.shape(), dst.dtype()}};
    }
    case OpId::gather_sum: {
      const Tensor& rows = in[0];
      check_floating(op, rows);
      check_index(op, in[1], "index");
      check_same_dtype(op, rows, in[2]);
      LATHE_CHECK(rows.dim() == 2 && in[1].dim() == 2 && in[2].shape() == in[1].shape(),
                  "ops: gather_sum needs rows (N, D), index (M, S) and weights (M, S); got {}, {}, {}",
                  rows.describe(), in[1].describe(), in[2].describe());
      return {{{in[1].size(0), rows.size(1)}, rows.dtype()}};
    }
    case OpId::row_argmax_logsumexp: {
      check_floating(op, in[0]);
      const int64_t limit = std::get<ArgmaxAttrs>(attrs).limit;
      LATHE_CHECK(in[0].dim() == 2 && in[0].size(1) > 0 && limit >= 0 && limit <= in[0].size(1),
                  "ops: row_argmax_logsumexp needs x (N, V) with V > 0 and a limit in [0, V]; got {}, limit {}",
                  in[0].describe(), limit);
      const DType st = stats_dtype(in[0].dtype());
      return {{{in[0].size(0)}, DType::I32}, {{in[0].size(0)}, st}, {{in[0].size(0)}, st}};
    }
    case OpId::sample_rows: {
      check_floating(op, in[0]);
      check_index(op, in[1], "rows");
      check_index(op, in[3], "keys");
      const int64_t limit = std::get<ArgmaxAttrs>(attrs).limit, m = in[1].dim() == 1 ? in[1].size(0) : -1;
      const DType st = stats_dtype(in[0].dtype());
      LATHE_CHECK(in[0].dim() == 2 && in[0].size(1) > 0 && limit >= 0 && limit <= in[0].size(1) && m >= 0 &&
                      in[2].dim() == 2 && in[2].size(0) == m && in[2].size(1) == 4 && in[2].dtype() == st &&
                      in[3].dim() == 2 && in[3].size(0) == m && in[3].size(1) == 3,
                  "ops: sample_rows needs x (N, V) with V > 0, rows (M), params (M, 4) in {} and keys (M, 3), and a "
                  "limit in [0, V]; got {}, {}, {}, {}, limit {}",
                  dtype_name(st), in[0].describe(), in[1].describe(), in[2].describe(), in[3].describe(), limit);
      return {{{m}, DType::I32}, {{m}, st}, {{m}, st}};
    }
    case OpId::penalize_rows: {
      check_floating(op, in[0]);
      check_index(op, in[1], "rows");
      check_index(op, in[3], "entries");
      const int64_t m = in[1].dim() == 1 ? in[1].size(0) : -1;
      const DType st = stats_dtype(in[0].dtype());
      LATHE_CHECK(in[0].dim() == 2 && m >= 0 && in[2].dim() == 2 && in[2].size(0) == m && in[2].size(1) == 2 &&
                      in[2].dtype() == st && in[3].dim() == 2 && in[3].size(1) == 3,
                  "ops: penalize_rows needs x (N, V), rows (M), params (M, 2) in {} and entries (E, 3); got {}, {}, "
                  "{}, {}", dtype_name(st), in[0].describe(), in[1].describe(), in[2].describe(), in[3].describe());
      return {{{m, in[0].size(1)}, st}};
    }
    case OpId::cross_entropy:
    case OpId::cross_entropy_slice: {
      check_floating(op, in[0]);
      check_index(op, in[1], "labels");
      LATHE_CHECK(in[0].dim() == 2 && in[1].dim() == 1 && in[1].size(0) == in[0].size(0),
                  "ops: cross_entropy needs logits (N, V) and labels (N), got {} and {}", in[0].describe(),
                  in[1].describe());
      if (op == OpId::cross_entropy_slice)
        LATHE_CHECK(in[2].dim() == 1 && in[2].size(0) == in[0].size(0) && in[2].dtype() == stats_dtype(in[0].dtype()),
                    "ops: cross_entropy_slice needs the rows' log-sum-exp (N) in {}, got {}",
                    dtype_name(stats_dtype(in[0].dtype())), in[2].describe());
      std::vector<TensorSpec> out = {{{in[0].size(0)}, stats_dtype(in[0].dtype())}};
      if (std::get<CrossEntropyAttrs>(attrs).with_grad) out.push_back({in[0].shape(), in[0].dtype()});
      return out;
    }
    case OpId::adamw: {
      // Key dtype = the master's; the gradient may be any float dtype (bf16 gradients, f32 masters). A bf16 key is the
      // parameter itself with bf16 moments (no master), so it takes no rounded_to.
      const Tensor& w = in[0];
      check_floating(op, w);
      check_floating(op, in[1]);
      check_same_dtype(op, w, in[2]);
      check_same_dtype(op, w, in[3]);
      for (size_t i = 1; i < 4; ++i)
        LATHE_CHECK(in[i].shape() == w.shape(), "ops: adamw {} {} does not match the master {}",
                    i == 1 ? "grad" : i == 2 ? "m" : "v", in[i].describe(), w.describe());
      const auto& a = std::get<AdamWAttrs>(attrs);
      LATHE_CHECK(a.step >= 1, "ops: adamw step must be >= 1 (bias correction), got {}", a.step);
      LATHE_CHECK(a.beta1 >= 0 && a.beta1 < 1 && a.beta2 >= 0 && a.beta2 < 1,
                  "ops: adamw betas must lie in [0, 1), got {} and {}", a.beta1, a.beta2);
      LATHE_CHECK(a.eps >= 0 && a.lr >= 0 && a.weight_decay >= 0 && std::isfinite(a.lr) && std::isfinite(a.grad_scale),
                  "ops: adamw needs finite lr >= 0, eps >= 0, weight_decay >= 0 and a finite grad_scale; got lr {}, "
                  "eps {}, weight_decay {}, grad_scale {}", a.lr, a.eps, a.weight_decay, a.grad_scale);
      const TensorSpec s{w.shape(), w.dtype()};
      if (!a.rounded_to) return {s, s, s};
      LATHE_CHECK(w.dtype() != DType::BF16,
                  "ops: adamw with a bf16 master (bf16 optimizer states) updates the parameter itself: rounded_to ({}) "
                  "is for f32 masters of bf16/f16 parameters", dtype_name(*a.rounded_to));
      LATHE_CHECK(*a.rounded_to == DType::BF16 || *a.rounded_to == DType::F16,
                  "ops: adamw rounded_to must be bf16 or f16 (the dtype of a parameter with a master), got {}",
                  dtype_name(*a.rounded_to));
      return {s, s, s, {w.shape(), *a.rounded_to}};
    }
    case OpId::adamw_list: {
      LATHE_CHECK(in.size() % 4 == 0, "ops: adamw_list takes groups of four (master, grad, m, v), got {} inputs",
                  in.size());
      std::vector<TensorSpec> out;
      for (size_t i = 0; i < in.size(); i += 4) {
        LATHE_CHECK(in[i].dtype() == in[0].dtype() && in[i + 1].dtype() == in[1].dtype(),
                    "ops: adamw_list group {} has dtypes ({}, {}), the first group ({}, {})", i / 4,
                    dtype_name(in[i].dtype()), dtype_name(in[i + 1].dtype()), dtype_name(in[0].dtype()),
                    dtype_name(in[1].dtype()));
        for (const TensorSpec& s : infer_outputs(OpId::adamw, {in[i], in[i + 1], in[i + 2], in[i + 3]}, attrs))
          out.push_back(s);
      }
      return out;
    }
    case OpId::segment_mask:
    case OpId::dropout:
      check_floating(op, in[0]);
      check_segments(op, in[0], std::get<SegmentAttrs>(attrs));
      return {{in[0].shape(), in[0].dtype()}};
    case OpId::sigmoid:
    case OpId::sigmoid_backward:
    case OpId::causal_conv1d:
    case OpId::causal_conv1d_backward:
    case OpId::gdn_decay:
    case OpId::gdn_decay_backward:
    case OpId::gated_delta_rule:
    case OpId::gated_delta_rule_backward:
    case OpId::gated_delta_rule_state:
      return infer_gated_delta_outputs(op, in, attrs);  // ops/gated_delta.cpp
    case OpId::grouped_matmul:
    case OpId::grouped_matmul_weight_grad:
    case OpId::grouped_matmul_routed:
    case OpId::grouped_matmul_weight_grad_routed:
      return infer_grouped_matmul_outputs(op, in, attrs);  // ops/grouped_matmul.cpp
    case OpId::moe_route: {
      const auto& a = std::get<MoeRouteAttrs>(attrs);
      LATHE_CHECK(in[0].dim() == 2 && (in[0].dtype() == DType::F32 || in[0].dtype() == DType::F64),
                  "ops: moe_route needs f32 or f64 router logits (T, E), got {}", in[0].describe());
      const int64_t t = in[0].size(0), e = in[0].size(1), k = a.top_k;
      LATHE_CHECK(e >= 1 && k >= 1 && k <= e, "ops: moe_route needs 1 <= top_k <= experts, got top_k {} of {}", k, e);
      LATHE_CHECK(t * e < (int64_t(1) << 31), "ops: moe_route: {} tokens x {} experts exceed the i32 index range", t,
                  e);
      const DType dt = in[0].dtype();
      return {{{t, e}, dt}, {{t, k}, dt}, {{t, k}, DType::I32}, {{t, 1}, dt}, {{e + 2}, DType::I32},
              {{t * k}, DType::I32}, {{t * k}, DType::I32}, {{t * k}, DType::I32}};
    }
    case OpId::moe_pad_plan: {
      const auto& a = std::get<MoePadAttrs>(attrs);
      LATHE_CHECK(in[0].dim() == 1 && in[0].size(0) >= 3 && in[0].dtype() == DType::I32 && in[1].dim() == 1 &&
                      in[1].dtype() == DType::I32,
                  "ops: moe_pad_plan needs moe_route's offsets (E + 2) i32 and pairs (P) i32, got {} and {}",
                  in[0].describe(), in[1].describe());
      const int64_t e = in[0].size(0) - 2, p = in[1].size(0);
      LATHE_CHECK(a.rows_per_expert >= 0 && a.top_k >= 1 && p % a.top_k == 0 &&
                      e * a.rows_per_expert < (int64_t(1) << 31),
                  "ops: moe_pad_plan: {} rows per expert of {} experts, {} pairs with top_k {}", a.rows_per_expert, e,
                  p, a.top_k);
      return {{{e * a.rows_per_expert}, DType::I32}, {{e * a.rows_per_expert}, DType::I32}, {{p}, DType::I32}};
    }
    case OpId::moe_ep_messages: {
      const auto& a = std::get<MoeExchangeAttrs>(attrs);
      LATHE_CHECK(in[0].dim() == 2 && in[0].dtype() == DType::I32 && in[1].dim() == 1 && in[1].size(0) >= 3 &&
                      in[1].dtype() == DType::I32,
                  "ops: moe_ep_messages needs moe_route's picked (T, k) i32 and offsets (E + 2) i32, got {} and {}",
                  in[0].describe(), in[1].describe());
      const int64_t t = in[0].size(0), e = in[1].size(0) - 2, n = a.ranks;
      LATHE_CHECK(n >= 1 && e % n == 0, "ops: moe_ep_messages: {} experts do not split over {} ranks", e, n);
      LATHE_CHECK(t * n < (int64_t(1) << 31), "ops: moe_ep_messages: {} tokens x {} ranks exceed the i32 range", t, n);
      return {{{t, n}, DType::I32}, {{t * n}, DType::I32}, {{e + 2 + n}, DType::I32}};
    }
    case OpId::moe_ep_slots: {
      const auto& a = std::get<MoeExchangeAttrs>(attrs);
      const int64_t t = in[0].size(0), k = in[0].dim() == 2 ? in[0].size(1) : 0, n = a.ranks;
      LATHE_CHECK(in[0].dim() == 2 && in[1].dim() == 1 && in[1].size(0) == t * k && in[2].dim() == 2 &&
                      in[2].size(0) == t && in[2].size(1) == n && in[3].dim() == 1 && in[0].dtype() == DType::I32 &&
                      in[1].dtype() == DType::I32 && in[2].dtype() == DType::I32 && in[3].dtype() == DType::I32,
                  "ops: moe_ep_slots needs picked (T, k), position (T k), back (T, {}) and bases (E) i32, got {}, {}, "
                  "{} and {}",
                  n, in[0].describe(), in[1].describe(), in[2].describe(), in[3].describe());
      const int64_t e = in[3].size(0);
      LATHE_CHECK(n >= 1 && e % n == 0, "ops: moe_ep_slots: {} experts do not split over {} ranks", e, n);
      const int64_t s = std::min(k, e / n);
      return {{{t * n, s}, DType::I32}, {{t * n, s}, DType::I32}};
    }
    case OpId::moe_ep_regroup: {
      const auto& a = std::get<MoeExchangeAttrs>(attrs);
      LATHE_CHECK(in[0].dim() == 1 && in[0].size(0) % 2 == 1 && in[0].dtype() == DType::I32 && a.rows >= 0,
                  "ops: moe_ep_regroup needs blocks (2 B + 1) i32 and rows >= 0, got {} and {} rows",
                  in[0].describe(), a.rows);
      return {{{a.rows}, DType::I32}, {{a.rows}, DType::I32}};
    }
    case OpId::moe_ep_sources: {
      const auto& a = std::get<MoeExchangeAttrs>(attrs);
      LATHE_CHECK(in[0].dim() == 2 && in[0].dtype() == DType::I32 && a.rows >= 0 &&
                      a.rows <= in[0].size(0) * in[0].size(1),
                  "ops: moe_ep_sources needs pairs (U, S) i32 naming rows 0 .. {} - 1, got {}", a.rows,
                  in[0].describe());
      return {{{a.rows}, DType::I32}, {{a.rows}, DType::I32}};
    }
    case OpId::kCount: break;
  }
  LATHE_FAIL("ops: invalid op id {}", int(op));
}

}  // namespace lathe
