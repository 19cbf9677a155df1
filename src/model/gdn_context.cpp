#include "model/gdn_context.h"

#include <algorithm>
#include <cmath>

#include "backend/runtime.h"
#include "core/error.h"
#include "ops/ops.h"

namespace lathe {

namespace {

// Rows of `dtype` on the device from host values (rows x the rest of `shape`).
Tensor from_values(Runtime& rt, ExecContext& cx, const std::vector<double>& values, const Shape& shape, DType dtype) {
  return cast(cx, rt.from_host(values.data(), shape, DType::F64, cx.device), dtype);
}

// The rows that the writer and reader tokens of rule_over_chain_backward add: for each of d rows, e_row on every one
// of `heads` heads, times `value` ((d, heads, d) in `dtype`).
Tensor unit_rows(Runtime& rt, ExecContext& cx, int64_t d, int64_t heads, double value, DType dtype) {
  std::vector<double> v(size_t(d * heads * d), 0.0);
  for (int64_t i = 0; i < d; ++i)
    for (int64_t h = 0; h < heads; ++h) v[size_t((i * heads + h) * d + i)] = value;
  return from_values(rt, cx, v, {d, heads, d}, dtype);
}

// x's rows laid out as [pre rows ; x's first `real` rows ; post rows ; x's padding rows] (`pre`, `post`: tensors of
// x's row shape, or undefined for none).
Tensor around_real_rows(ExecContext& cx, const Tensor& x, int64_t real, const Tensor& pre, const Tensor& post) {
  const int64_t a = pre.defined() ? pre.size(0) : 0, z = post.defined() ? post.size(0) : 0, rows = x.size(0);
  Shape shape = x.shape();
  shape[0] = a + rows + z;
  Tensor out = Tensor::empty(shape, x.dtype(), cx.allocator);
  if (a > 0) copy_into(cx, pre, out.narrow(0, 0, a));
  if (real > 0) copy_into(cx, x.narrow(0, 0, real), out.narrow(0, a, real));
  if (z > 0) copy_into(cx, post, out.narrow(0, a + real, z));
  if (rows > real) copy_into(cx, x.narrow(0, real, rows - real), out.narrow(0, a + real + z, rows - real));
  return out;
}

// around_real_rows' inverse: x's rows without the pre and post rows.
Tensor without_added_rows(ExecContext& cx, const Tensor& y, int64_t real, int64_t pre, int64_t post) {
  const int64_t rows = y.size(0) - pre - post;
  Shape shape = y.shape();
  shape[0] = rows;
  Tensor out = Tensor::empty(shape, y.dtype(), cx.allocator);
  if (real > 0) copy_into(cx, y.narrow(0, pre, real), out.narrow(0, 0, real));
  if (rows > real) copy_into(cx, y.narrow(0, pre + real + post, rows - real), out.narrow(0, real, rows - real));
  return out;
}

Tensor rows_like(ExecContext& cx, const Tensor& x, int64_t n) {
  Shape shape = x.shape();
  shape[0] = n;
  return zeros(cx, shape, x.dtype());
}

}  // namespace

int64_t CpChain::last_real_doc() const {
  if (real == 0) return -1;
  return int64_t(cu.size()) - (real < rows ? 3 : 2);
}

CpChain cp_chain(std::span<const int32_t> host_cu, int64_t rows, int rank, int ranks) {
  CpChain ch;
  ch.rank = rank;
  ch.ranks = ranks;
  ch.rows = rows;
  ch.first = int64_t(rank) * rows;
  const int64_t tokens = host_cu.empty() ? 0 : host_cu.back();
  ch.real = std::clamp<int64_t>(tokens - ch.first, 0, rows);
  ch.doc_start = ch.first;
  for (int32_t c : host_cu)
    if (c <= ch.first) ch.doc_start = c;
  ch.from_prev = ch.real > 0 && ch.doc_start < ch.first;
  const int64_t end = ch.first + rows;
  ch.to_next = rank + 1 < ranks && end < tokens && std::find(host_cu.begin(), host_cu.end(), end) == host_cu.end();
  ch.cu = {0};
  for (int32_t c : host_cu)
    if (c > ch.first && c < ch.first + ch.real) ch.cu.push_back(int32_t(c - ch.first));
  if (ch.real > 0) ch.cu.push_back(int32_t(ch.real));
  if (ch.real < rows) ch.cu.push_back(int32_t(rows));
  return ch;
}

std::vector<int32_t> conv_offsets(const CpChain& ch, int64_t history) {
  std::vector<int32_t> cu = {0};
  for (size_t i = 1; i < ch.cu.size(); ++i) cu.push_back(int32_t(ch.cu[i] + history));
  return cu;
}

Tensor conv_input_with_history(ExecContext& cx, Communicator& cp, const CpChain& ch, const Tensor& x, int64_t history) {
  const int64_t rows = x.size(0), width = x.size(1), tail = std::min(history, rows);
  // Every rank's last `history` rows (front-padded with zeros when it has fewer), gathered: (ranks, history, C).
  Tensor mine = zeros(cx, {history, width}, x.dtype());
  if (tail > 0) copy_into(cx, x.narrow(0, rows - tail, tail), mine.narrow(0, history - tail, tail));
  Tensor all = Tensor::empty({int64_t(ch.ranks) * history, width}, x.dtype(), cx.allocator);
  Tensor flat = all.view({int64_t(ch.ranks) * history * width});
  cp.all_gather(mine.view({history * width}), flat).wait();
  Tensor out = zeros(cx, {history + rows, width}, x.dtype());
  // Global row r (first - history <= r < first, inside the rank's first document) is row r - j rows - rows + history
  // of rank j = r / rows's tail.
  for (int64_t r = std::max(ch.doc_start, ch.first - history); r < ch.first; ++r) {
    const int64_t j = r / rows, at = r - j * rows - rows + history;
    copy_into(cx, all.narrow(0, j * history + at, 1), out.narrow(0, history - (ch.first - r), 1));
  }
  copy_into(cx, x, out.narrow(0, history, rows));
  return out;
}

void add_history_grad(ExecContext& cx, Communicator& cp, const CpChain& ch, const Tensor& d_history, Tensor& d_x) {
  const int64_t history = d_history.size(0), width = d_history.size(1), rows = d_x.size(0);
  Tensor all = zeros(cx, {int64_t(ch.ranks) * history, width}, d_x.dtype());
  for (int64_t r = std::max(ch.doc_start, ch.first - history); r < ch.first; ++r) {
    const int64_t j = r / rows, at = r - j * rows - rows + history;
    copy_into(cx, d_history.narrow(0, history - (ch.first - r), 1), all.narrow(0, j * history + at, 1));
  }
  cp.all_reduce(all).wait();
  const int64_t tail = std::min(history, rows);
  if (tail == 0) return;
  const Tensor mine = all.narrow(0, int64_t(ch.rank) * history + history - tail, tail);
  Tensor last = d_x.narrow(0, rows - tail, tail);
  copy_into(cx, add(cx, contiguous(cx, last), mine), last);
}

std::vector<Tensor> rule_over_chain(ExecContext& cx, Communicator& cp, const CpChain& ch, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                    const Tensor& cu) {
  const int64_t hv = v.size(1), dk = k.size(2), dv = v.size(2), docs = int64_t(ch.cu.size()) - 1;
  const DType sd = gdn_state_dtype(q.dtype());
  Tensor start = zeros(cx, {docs, hv, dk, dv}, sd), received;
  if (ch.from_prev) {
    received = Tensor::empty({hv, dk, dv}, sd, cx.allocator);
    cp.recv(received, ch.rank - 1).wait();
    copy_into(cx, received.view({1, hv, dk, dv}), start.narrow(0, 0, 1));
  }
  std::vector<Tensor> r = gated_delta_rule_state(cx, q, k, v, g, beta, cu, start);
  if (ch.to_next) cp.send(contiguous(cx, r[1].narrow(0, ch.last_real_doc(), 1)).view({hv, dk, dv}), ch.rank + 1).wait();
  return {r[0], received};
}

std::vector<Tensor> rule_over_chain_backward(Runtime& rt, ExecContext& cx, Communicator& cp, const CpChain& ch,
                                             const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                             const Tensor& beta, const Tensor& d_o, const Tensor& state_in) {
  const int64_t hk = k.size(1), hv = v.size(1), dk = k.size(2), dv = v.size(2);
  const DType sd = gdn_state_dtype(q.dtype());
  Tensor d_out;  // the gradient of the state sent to rank + 1, (H_v, d_k, d_v)
  if (ch.to_next) {
    d_out = Tensor::empty({hv, dk, dv}, sd, cx.allocator);
    cp.recv(d_out, ch.rank + 1).wait();
  }
  const int64_t pre = ch.from_prev ? dk : 0, post = ch.to_next ? dk : 0;
  // Writers (key e_i, beta 1, value: row i of the state) and readers (query e_j, beta 0, output gradient: row j of the
  // state's gradient over the query scale); neither decays the state (g = 0).
  Tensor q_pre, k_pre, v_pre, g_pre, b_pre, o_pre, q_post, k_post, v_post, g_post, b_post, o_post;
  if (pre > 0) {
    q_pre = rows_like(cx, q, pre);
    k_pre = unit_rows(rt, cx, dk, hk, 1.0, k.dtype());
    v_pre = cast(cx, contiguous(cx, state_in.transpose(0, 1)), v.dtype());  // (d_k, H_v, d_v): each head's row i
    g_pre = rows_like(cx, g, pre);
    b_pre = from_values(rt, cx, std::vector<double>(size_t(pre * hv), 1.0), {pre, hv}, beta.dtype());
    o_pre = rows_like(cx, d_o, pre);
  }
  if (post > 0) {
    const double query_scale = 1.0 / std::sqrt(double(dk));
    q_post = unit_rows(rt, cx, dk, hk, 1.0, q.dtype());
    k_post = rows_like(cx, k, post);
    v_post = rows_like(cx, v, post);
    g_post = rows_like(cx, g, post);
    b_post = rows_like(cx, beta, post);
    o_post = cast(cx, scale(cx, contiguous(cx, d_out.transpose(0, 1)), 1.0 / query_scale), d_o.dtype());
  }
  const auto widen = [&](const Tensor& x, const Tensor& a, const Tensor& z) {
    return around_real_rows(cx, x, ch.real, a, z);
  };
  std::vector<int32_t> cu = {0};
  for (size_t i = 1; i < ch.cu.size(); ++i)
    cu.push_back(int32_t(ch.cu[i] + pre + (int64_t(i) > ch.last_real_doc() ? post : 0)));
  const Tensor cu_t = rt.upload(cu.data(), {int64_t(cu.size())}, DType::I32, cx.device);
  const std::vector<Tensor> d = gated_delta_rule_backward(
      cx, widen(q, q_pre, q_post), widen(k, k_pre, k_post), widen(v, v_pre, v_post), widen(g, g_pre, g_post),
      widen(beta, b_pre, b_post), widen(d_o, o_pre, o_post), cu_t);
  if (ch.from_prev)  // the writers' value gradient: that of the state received, (H_v, d_k, d_v)
    cp.send(cast(cx, contiguous(cx, d[2].narrow(0, 0, pre).transpose(0, 1)), sd), ch.rank - 1).wait();
  std::vector<Tensor> out;
  for (const Tensor& x : d) out.push_back(without_added_rows(cx, x, ch.real, pre, post));
  return out;
}

}  // namespace lathe
