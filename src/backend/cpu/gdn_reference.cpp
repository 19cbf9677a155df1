// CPU reference of the Gated DeltaNet core: the recurrence and the chunked WY form, forward and backward.
// Convention: every routine works on one (document, value head) at a time, on small row-major matrices gathered
// from the packed (T, heads, dim) tensors, so a document boundary is simply where the gathered rows end; the
// symbols (b, Gamma, L, R, W, U, Delta, H, dH) are those of research note gated-deltanet.md §3.
// Covered by tests/models/test_gdn_reference.cpp.
#include "backend/cpu/gdn_reference.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace lathe {

namespace {

template <typename T>
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<T> a;  // (rows, cols)
  Mat() = default;
  Mat(int64_t r, int64_t c) : rows(r), cols(c), a(size_t(r * c), T(0)) {}
  T& operator()(int64_t i, int64_t j) { return a[size_t(i * cols + j)]; }
  const T& operator()(int64_t i, int64_t j) const { return a[size_t(i * cols + j)]; }
  const T* row(int64_t i) const { return a.data() + i * cols; }
};

template <typename T>
Mat<T> mul(const Mat<T>& a, const Mat<T>& b) {  // a b
  LATHE_ASSERT(a.cols == b.rows);
  Mat<T> c(a.rows, b.cols);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t p = 0; p < a.cols; ++p) {
      const T x = a(i, p);
      for (int64_t j = 0; j < b.cols; ++j) c(i, j) += x * b(p, j);
    }
  return c;
}

template <typename T>
Mat<T> mul_tn(const Mat<T>& a, const Mat<T>& b) {  // a^T b
  LATHE_ASSERT(a.rows == b.rows);
  Mat<T> c(a.cols, b.cols);
  for (int64_t p = 0; p < a.rows; ++p)
    for (int64_t i = 0; i < a.cols; ++i) {
      const T x = a(p, i);
      for (int64_t j = 0; j < b.cols; ++j) c(i, j) += x * b(p, j);
    }
  return c;
}

template <typename T>
Mat<T> mul_nt(const Mat<T>& a, const Mat<T>& b) {  // a b^T
  LATHE_ASSERT(a.cols == b.cols);
  Mat<T> c(a.rows, b.rows);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < b.rows; ++j) {
      T s = 0;
      for (int64_t p = 0; p < a.cols; ++p) s += a(i, p) * b(j, p);
      c(i, j) = s;
    }
  return c;
}

template <typename T>
T dot(const T* x, const T* y, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}

// Sizes, validated once per call.
struct Problem {
  int64_t tokens = 0, docs = 0, hk = 0, hv = 0, group = 0, dk = 0, dv = 0;
  double scale = 0.0;
};

template <typename T>
Problem validate(const char* who, const GdnDims& d, const GdnInputs<T>& in) {
  LATHE_CHECK(d.k_heads > 0 && d.v_heads > 0 && d.k_dim > 0 && d.v_dim > 0,
              "gdn: {}: dimensions must be positive (H_k {}, H_v {}, d_k {}, d_v {})", who, d.k_heads, d.v_heads,
              d.k_dim, d.v_dim);
  LATHE_CHECK(d.v_heads % d.k_heads == 0, "gdn: {}: H_v {} is not a multiple of H_k {}", who, d.v_heads,
              d.k_heads);
  LATHE_CHECK(std::isfinite(d.scale) && d.scale >= 0.0, "gdn: {}: query scale {} (0 = d_k^-1/2)", who, d.scale);
  const auto& cu = in.cu_seqlens;
  LATHE_CHECK(cu.size() >= 2 && cu.front() == 0, "gdn: {}: cu_seqlens must have N + 1 >= 2 entries starting at 0",
              who);
  for (size_t i = 1; i < cu.size(); ++i)
    LATHE_CHECK(cu[i] >= cu[i - 1], "gdn: {}: cu_seqlens decreases at entry {}", who, i);
  Problem p;
  p.tokens = cu.back();
  p.docs = int64_t(cu.size()) - 1;
  p.hk = d.k_heads;
  p.hv = d.v_heads;
  p.group = d.v_heads / d.k_heads;
  p.dk = d.k_dim;
  p.dv = d.v_dim;
  p.scale = d.scale > 0.0 ? d.scale : 1.0 / std::sqrt(double(d.k_dim));
  auto check_size = [&](const char* name, size_t got, int64_t want, const char* shape) {
    LATHE_CHECK(got == size_t(want), "gdn: {}: {} has {} elements, expected {} = {} for T {}", who, name, got, want,
                shape, p.tokens);
  };
  check_size("q", in.q.size(), p.tokens * p.hk * p.dk, "(T, H_k, d_k)");
  check_size("k", in.k.size(), p.tokens * p.hk * p.dk, "(T, H_k, d_k)");
  check_size("v", in.v.size(), p.tokens * p.hv * p.dv, "(T, H_v, d_v)");
  check_size("g", in.g.size(), p.tokens * p.hv, "(T, H_v)");
  check_size("beta", in.beta.size(), p.tokens * p.hv, "(T, H_v)");
  LATHE_CHECK(in.initial_state.empty() || in.initial_state.size() == size_t(p.docs * p.hv * p.dk * p.dv),
              "gdn: {}: initial_state has {} elements, expected 0 or {} = (N {}, H_v, d_k, d_v)", who,
              in.initial_state.size(), p.docs * p.hv * p.dk * p.dv, p.docs);
  for (size_t i = 0; i < in.g.size(); ++i)
    LATHE_CHECK(std::isfinite(double(in.g[i])) && in.g[i] <= T(0),
                "gdn: {}: g[{}] = {} but g is a log-decay and must be finite and <= 0", who, i, double(in.g[i]));
  return p;
}

void check_grad_inputs(const char* who, const Problem& p, size_t d_o, size_t d_final) {
  LATHE_CHECK(d_o == size_t(p.tokens * p.hv * p.dv), "gdn: {}: d_o has {} elements, expected {} = (T, H_v, d_v)", who,
              d_o, p.tokens * p.hv * p.dv);
  LATHE_CHECK(d_final == 0 || d_final == size_t(p.docs * p.hv * p.dk * p.dv),
              "gdn: {}: d_final_state has {} elements, expected 0 or {} = (N, H_v, d_k, d_v)", who, d_final,
              p.docs * p.hv * p.dk * p.dv);
}

// Tokens [t0, t0 + n) of value head h, with q and k taken from its key head h / group.
template <typename T>
struct Rows {
  Mat<T> q, k, v;           // (n, d_k), (n, d_k), (n, d_v)
  std::vector<T> g, beta;   // (n)
};

template <typename T>
Rows<T> gather(const Problem& p, const GdnInputs<T>& in, int64_t t0, int64_t n, int64_t h) {
  const int64_t hk = h / p.group;
  Rows<T> x{Mat<T>(n, p.dk), Mat<T>(n, p.dk), Mat<T>(n, p.dv), std::vector<T>(size_t(n)), std::vector<T>(size_t(n))};
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = t0 + r;
    for (int64_t i = 0; i < p.dk; ++i) {
      x.q(r, i) = in.q[size_t((t * p.hk + hk) * p.dk + i)];
      x.k(r, i) = in.k[size_t((t * p.hk + hk) * p.dk + i)];
    }
    for (int64_t j = 0; j < p.dv; ++j) x.v(r, j) = in.v[size_t((t * p.hv + h) * p.dv + j)];
    x.g[size_t(r)] = in.g[size_t(t * p.hv + h)];
    x.beta[size_t(r)] = in.beta[size_t(t * p.hv + h)];
  }
  return x;
}

// Rows [t0, t0 + n) of head `head` of a (T, heads, dim) tensor.
template <typename T>
Mat<T> gather_head(std::span<const T> src, int64_t heads, int64_t dim, int64_t t0, int64_t n, int64_t head) {
  Mat<T> m(n, dim);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < dim; ++i) m(r, i) = src[size_t(((t0 + r) * heads + head) * dim + i)];
  return m;
}

template <typename T>
void add_head(std::vector<T>& dst, int64_t heads, int64_t dim, int64_t t0, int64_t head, const Mat<T>& m) {
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t i = 0; i < dim; ++i) dst[size_t(((t0 + r) * heads + head) * dim + i)] += m(r, i);
}

template <typename T>
void add_scalars(std::vector<T>& dst, int64_t heads, int64_t t0, int64_t head, const std::vector<T>& x) {
  for (size_t r = 0; r < x.size(); ++r) dst[size_t((t0 + int64_t(r)) * heads + head)] += x[r];
}

// The (d_k, d_v) state of (document n, value head h) in a (N, H_v, d_k, d_v) tensor; empty = zeros.
template <typename T>
Mat<T> load_state(const Problem& p, std::span<const T> src, int64_t n, int64_t h) {
  Mat<T> s(p.dk, p.dv);
  if (src.empty()) return s;
  const size_t base = size_t((n * p.hv + h) * p.dk * p.dv);
  for (size_t i = 0; i < s.a.size(); ++i) s.a[i] = src[base + i];
  return s;
}

template <typename T>
void store_state(const Problem& p, std::vector<T>& dst, int64_t n, int64_t h, const Mat<T>& s) {
  const size_t base = size_t((n * p.hv + h) * p.dk * p.dv);
  for (size_t i = 0; i < s.a.size(); ++i) dst[base + i] = s.a[i];
}

template <typename T>
GdnGrads<T> zero_grads(const Problem& p) {
  GdnGrads<T> gr;
  gr.dq.assign(size_t(p.tokens * p.hk * p.dk), T(0));
  gr.dk.assign(size_t(p.tokens * p.hk * p.dk), T(0));
  gr.dv.assign(size_t(p.tokens * p.hv * p.dv), T(0));
  gr.dg.assign(size_t(p.tokens * p.hv), T(0));
  gr.dbeta.assign(size_t(p.tokens * p.hv), T(0));
  gr.d_initial_state.assign(size_t(p.docs * p.hv * p.dk * p.dv), T(0));
  return gr;
}

// ---------------------------------------------------------------------------------------------------------------
// Recurrent form.

// One token: S <- e^g S, then returns u = beta (v - S^T k) and writes S <- S + k u^T.
template <typename T>
std::vector<T> recurrent_step(Mat<T>& s, const T* k, const T* v, T g, T beta) {
  const T alpha = std::exp(g);
  for (T& x : s.a) x *= alpha;
  std::vector<T> u(static_cast<size_t>(s.cols));
  for (int64_t j = 0; j < s.cols; ++j) {
    T pred = 0;
    for (int64_t i = 0; i < s.rows; ++i) pred += s(i, j) * k[i];
    u[size_t(j)] = beta * (v[j] - pred);
  }
  for (int64_t i = 0; i < s.rows; ++i)
    for (int64_t j = 0; j < s.cols; ++j) s(i, j) += k[i] * u[size_t(j)];
  return u;
}

// ---------------------------------------------------------------------------------------------------------------
// Chunked form: the chunk-local quantities of §3.1-3.2, which depend only on the chunk's own inputs.

template <typename T>
struct ChunkWy {
  std::vector<T> b;   // (n) chunk-local cumsum of g
  Mat<T> gamma;       // (n, n) e^{b_r - b_s} for r >= s, else 0 (masked before exp)
  Mat<T> kk;          // (n, n) K K^T
  Mat<T> l;           // (n, n) strictly lower: beta_r (K K^T)_rs Gamma_rs
  Mat<T> r;           // (n, n) (I + L)^{-1}, unit lower triangular
  Mat<T> w;           // (n, d_k) R diag(beta e^b) K
  Mat<T> u;           // (n, d_v) R diag(beta) V
};

template <typename T>
ChunkWy<T> chunk_wy(const Rows<T>& x) {
  const int64_t n = x.k.rows;
  ChunkWy<T> c;
  c.b.resize(size_t(n));
  T acc = 0;
  for (int64_t i = 0; i < n; ++i) c.b[size_t(i)] = acc += x.g[size_t(i)];
  c.gamma = Mat<T>(n, n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) c.gamma(i, j) = std::exp(c.b[size_t(i)] - c.b[size_t(j)]);
  c.kk = mul_nt(x.k, x.k);
  c.l = Mat<T>(n, n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) c.l(i, j) = x.beta[size_t(i)] * c.kk(i, j) * c.gamma(i, j);
  // (I + L) R = I, so row m of R is e_m - sum_{j<m} L_mj R_j (forward substitution, rows in increasing order).
  c.r = Mat<T>(n, n);
  for (int64_t m = 0; m < n; ++m) {
    c.r(m, m) = 1;
    for (int64_t j = 0; j < m; ++j) {
      const T lmj = c.l(m, j);
      for (int64_t col = 0; col <= j; ++col) c.r(m, col) -= lmj * c.r(j, col);
    }
  }
  Mat<T> kbe = x.k, vb = x.v;  // diag(beta e^b) K, diag(beta) V
  for (int64_t i = 0; i < n; ++i) {
    const T be = x.beta[size_t(i)] * std::exp(c.b[size_t(i)]);
    for (int64_t col = 0; col < kbe.cols; ++col) kbe(i, col) *= be;
    for (int64_t col = 0; col < vb.cols; ++col) vb(i, col) *= x.beta[size_t(i)];
  }
  c.w = mul(c.r, kbe);
  c.u = mul(c.r, vb);
  return c;
}

// tril_0(Q K^T ⊙ Gamma), the intra-chunk attention-like matrix of the output.
template <typename T>
Mat<T> chunk_p(const Rows<T>& x, const ChunkWy<T>& c) {
  Mat<T> p = mul_nt(x.q, x.k);
  for (int64_t i = 0; i < p.rows; ++i)
    for (int64_t j = 0; j < p.cols; ++j) p(i, j) = j <= i ? p(i, j) * c.gamma(i, j) : T(0);
  return p;
}

// Delta = U - W S0: the writes u_r of the recurrence, given the chunk's entering state.
template <typename T>
Mat<T> chunk_delta(const ChunkWy<T>& c, const Mat<T>& s0) {
  Mat<T> d = mul(c.w, s0);
  for (size_t i = 0; i < d.a.size(); ++i) d.a[i] = c.u.a[i] - d.a[i];
  return d;
}

// S1 = e^{b_n} S0 + (diag(e^{b_n - b}) K)^T Delta.
template <typename T>
Mat<T> chunk_next_state(const Rows<T>& x, const ChunkWy<T>& c, const Mat<T>& s0, const Mat<T>& delta) {
  const int64_t n = x.k.rows;
  const T b_last = c.b[size_t(n - 1)];
  Mat<T> kd = x.k;
  for (int64_t i = 0; i < n; ++i) {
    const T gam = std::exp(b_last - c.b[size_t(i)]);
    for (int64_t col = 0; col < kd.cols; ++col) kd(i, col) *= gam;
  }
  Mat<T> s1 = mul_tn(kd, delta);
  const T e_last = std::exp(b_last);
  for (size_t i = 0; i < s1.a.size(); ++i) s1.a[i] += e_last * s0.a[i];
  return s1;
}

// O = s [diag(e^b) Q S0 + P Delta].
template <typename T>
Mat<T> chunk_output(const Rows<T>& x, const ChunkWy<T>& c, const Mat<T>& s0, const Mat<T>& delta, T scale) {
  Mat<T> o = mul(x.q, s0);
  const Mat<T> pd = mul(chunk_p(x, c), delta);
  for (int64_t i = 0; i < o.rows; ++i) {
    const T e = std::exp(c.b[size_t(i)]);
    for (int64_t j = 0; j < o.cols; ++j) o(i, j) = scale * (e * o(i, j) + pd(i, j));
  }
  return o;
}

template <typename T>
struct ChunkGrads {
  Mat<T> dq, dk, dv;               // (n, d_k), (n, d_k), (n, d_v)
  std::vector<T> dbeta, dg;        // (n)
};

// Steps 5-7 of §3.5 for one chunk, given its entering state H, its writes Delta, the output gradient dO, the
// gradient dH of the state LEAVING the chunk and the total gradient dDelta of the writes (from the reverse scan).
template <typename T>
ChunkGrads<T> chunk_backward_local(const Rows<T>& x, const ChunkWy<T>& c, const Mat<T>& h, const Mat<T>& delta,
                                   const Mat<T>& d_o, const Mat<T>& dh, const Mat<T>& d_delta, T scale) {
  const int64_t n = x.k.rows, dk = x.k.cols;
  const T b_last = c.b[size_t(n - 1)];
  std::vector<T> e(static_cast<size_t>(n)), gam(static_cast<size_t>(n));  // e^{b_r}, e^{b_n - b_r}
  for (int64_t r = 0; r < n; ++r) {
    e[size_t(r)] = std::exp(c.b[size_t(r)]);
    gam[size_t(r)] = std::exp(b_last - c.b[size_t(r)]);
  }
  ChunkGrads<T> out;
  std::vector<T> db(size_t(n), T(0));

  // Step 5: through O = s[diag(e) Q H + P Delta] and S1 = e_n H + (diag(gam) K)^T Delta.
  Mat<T> pt = mul_nt(d_o, delta);  // P~ = s tril_0(dO Delta^T ⊙ Gamma)
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < n; ++i) pt(r, i) = i <= r ? scale * pt(r, i) * c.gamma(r, i) : T(0);
  out.dq = mul_nt(d_o, h);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < dk; ++i) out.dq(r, i) *= scale * e[size_t(r)];
  const Mat<T> ptk = mul(pt, x.k);
  for (size_t i = 0; i < out.dq.a.size(); ++i) out.dq.a[i] += ptk.a[i];
  const Mat<T> delta_dh = mul_nt(delta, dh);  // (n, d_k) Delta dH^T
  out.dk = delta_dh;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < dk; ++i) out.dk(r, i) *= gam[size_t(r)];
  const Mat<T> ptq = mul_tn(pt, x.q);
  for (size_t i = 0; i < out.dk.a.size(); ++i) out.dk.a[i] += ptq.a[i];
  for (int64_t r = 0; r < n; ++r)
    db[size_t(r)] = dot(out.dq.row(r), x.q.row(r), dk) - dot(out.dk.row(r), x.k.row(r), dk);
  T last = e[size_t(n - 1)] * dot(h.a.data(), dh.a.data(), int64_t(h.a.size()));
  for (int64_t i = 0; i < n; ++i) last += gam[size_t(i)] * dot(delta_dh.row(i), x.k.row(i), dk);
  db[size_t(n - 1)] += last;
  Mat<T> dw = mul_nt(d_delta, h);  // dW = -dDelta H^T (sign applied below); dU = dDelta
  for (T& v : dw.a) v = -v;
  const Mat<T>& du = d_delta;

  // Step 6: through W = R diag(beta e) K, U = R diag(beta) V, R = (I + L)^{-1},
  // L = tril_-1(diag(beta) K K^T ⊙ Gamma).
  Mat<T> kbe = x.k, vb = x.v;
  for (int64_t r = 0; r < n; ++r) {
    const T be = x.beta[size_t(r)] * e[size_t(r)];
    for (int64_t i = 0; i < kbe.cols; ++i) kbe(r, i) *= be;
    for (int64_t i = 0; i < vb.cols; ++i) vb(r, i) *= x.beta[size_t(r)];
  }
  Mat<T> dr = mul_nt(dw, kbe);
  const Mat<T> dr_v = mul_nt(du, vb);
  for (size_t i = 0; i < dr.a.size(); ++i) dr.a[i] += dr_v.a[i];
  const Mat<T> dkbe = mul_tn(c.r, dw);
  const Mat<T> dvb = mul_tn(c.r, du);
  const Mat<T> rt_dr_rt = mul_nt(mul_tn(c.r, dr), c.r);  // R^T dR R^T
  Mat<T> dl(n, n), dlh(n, n);                           // dL = -tril_-1(R^T dR R^T), dL^ = dL ⊙ Gamma
  for (int64_t r = 0; r < n; ++r)
    for (int64_t s = 0; s < r; ++s) {
      dl(r, s) = -rt_dr_rt(r, s);
      dlh(r, s) = dl(r, s) * c.gamma(r, s);
    }
  Mat<T> bdlh = dlh;  // diag(beta) dL^
  for (int64_t r = 0; r < n; ++r)
    for (int64_t s = 0; s < n; ++s) bdlh(r, s) *= x.beta[size_t(r)];
  const Mat<T> dk_a = mul(bdlh, x.k);     // diag(beta) dL^ K
  const Mat<T> dk_b = mul_tn(bdlh, x.k);  // dL^T diag(beta) K
  out.dv = dvb;
  out.dbeta.assign(size_t(n), T(0));
  for (int64_t r = 0; r < n; ++r) {
    const T be = x.beta[size_t(r)] * e[size_t(r)];
    for (int64_t i = 0; i < dk; ++i) out.dk(r, i) += dk_a(r, i) + dk_b(r, i) + be * dkbe(r, i);
    for (int64_t i = 0; i < out.dv.cols; ++i) out.dv(r, i) *= x.beta[size_t(r)];
    const T k_dkbe = dot(x.k.row(r), dkbe.row(r), dk);
    T dbeta = e[size_t(r)] * k_dkbe + dot(x.v.row(r), dvb.row(r), x.v.cols);
    T dbr = x.beta[size_t(r)] * e[size_t(r)] * k_dkbe;
    for (int64_t s = 0; s < n; ++s) {
      dbeta += dlh(r, s) * c.kk(r, s);
      dbr += dl(r, s) * c.l(r, s) - dl(s, r) * c.l(s, r);
    }
    out.dbeta[size_t(r)] = dbeta;
    db[size_t(r)] += dbr;
  }

  // Step 7: b = cumsum(g) inside the chunk, so dg_i = sum_{r >= i} db_r.
  out.dg.assign(size_t(n), T(0));
  T acc = 0;
  for (int64_t i = n - 1; i >= 0; --i) out.dg[size_t(i)] = acc += db[size_t(i)];
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

template <typename T>
GdnOutputs<T> gdn_recurrent_forward(const GdnDims& dims, const GdnInputs<T>& in) {
  const Problem p = validate("recurrent forward", dims, in);
  const T scale = T(p.scale);
  GdnOutputs<T> out;
  out.o.assign(size_t(p.tokens * p.hv * p.dv), T(0));
  out.final_state.assign(size_t(p.docs * p.hv * p.dk * p.dv), T(0));
  out.chunk_states.assign(size_t((p.tokens / kGdnChunk + p.docs) * p.hv * p.dk * p.dv), T(0));
  int64_t chunk_base = 0;  // chunks of the documents before this one
  for (int64_t doc = 0; doc < p.docs; ++doc) {
    const int64_t t0 = in.cu_seqlens[size_t(doc)], n = in.cu_seqlens[size_t(doc) + 1] - t0;
    for (int64_t h = 0; h < p.hv; ++h) {
      const Rows<T> x = gather(p, in, t0, n, h);
      Mat<T> s = load_state(p, in.initial_state, doc, h);
      Mat<T> o(n, p.dv);
      for (int64_t r = 0; r < n; ++r) {
        if (r % kGdnChunk == 0) store_state(p, out.chunk_states, chunk_base + r / kGdnChunk, h, s);
        recurrent_step(s, x.k.row(r), x.v.row(r), x.g[size_t(r)], x.beta[size_t(r)]);
        for (int64_t i = 0; i < p.dk; ++i)
          for (int64_t j = 0; j < p.dv; ++j) o(r, j) += scale * x.q(r, i) * s(i, j);
      }
      add_head(out.o, p.hv, p.dv, t0, h, o);
      store_state(p, out.final_state, doc, h, s);
    }
    chunk_base += (n + kGdnChunk - 1) / kGdnChunk;
  }
  return out;
}

template <typename T>
GdnGrads<T> gdn_recurrent_backward(const GdnDims& dims, const GdnInputs<T>& in, std::span<const T> d_o,
                                   std::span<const T> d_final_state) {
  const Problem p = validate("recurrent backward", dims, in);
  check_grad_inputs("recurrent backward", p, d_o.size(), d_final_state.size());
  const T scale = T(p.scale);
  GdnGrads<T> gr = zero_grads<T>(p);
  for (int64_t doc = 0; doc < p.docs; ++doc) {
    const int64_t t0 = in.cu_seqlens[size_t(doc)], n = in.cu_seqlens[size_t(doc) + 1] - t0;
    for (int64_t h = 0; h < p.hv; ++h) {
      const Rows<T> x = gather(p, in, t0, n, h);
      const Mat<T> dout = gather_head(d_o, p.hv, p.dv, t0, n, h);
      // states[r] = S before token r (states[0] = initial state), states[r + 1] = S after it.
      std::vector<Mat<T>> states{load_state(p, in.initial_state, doc, h)};
      std::vector<std::vector<T>> u;
      for (int64_t r = 0; r < n; ++r) {
        states.push_back(states.back());
        u.push_back(recurrent_step(states.back(), x.k.row(r), x.v.row(r), x.g[size_t(r)], x.beta[size_t(r)]));
      }
      Mat<T> dq(n, p.dk), dk(n, p.dk), dv(n, p.dv);
      std::vector<T> dg(static_cast<size_t>(n)), dbeta(static_cast<size_t>(n));
      Mat<T> ds = load_state(p, d_final_state, doc, h);  // gradient of the state after the current token
      for (int64_t r = n - 1; r >= 0; --r) {
        const Mat<T>& s_new = states[size_t(r) + 1];
        const T alpha = std::exp(x.g[size_t(r)]), beta = x.beta[size_t(r)];
        const T* q = x.q.row(r);
        const T* k = x.k.row(r);
        const T* d_or = dout.row(r);
        // o = s S_new^T q
        for (int64_t i = 0; i < p.dk; ++i)
          for (int64_t j = 0; j < p.dv; ++j) {
            dq(r, i) += scale * s_new(i, j) * d_or[j];
            ds(i, j) += scale * q[i] * d_or[j];
          }
        // S_new = S_bar + k u^T
        std::vector<T> du(size_t(p.dv), T(0));
        for (int64_t i = 0; i < p.dk; ++i)
          for (int64_t j = 0; j < p.dv; ++j) {
            du[size_t(j)] += ds(i, j) * k[i];
            dk(r, i) += ds(i, j) * u[size_t(r)][size_t(j)];
          }
        // u = beta (v - pred), pred = S_bar^T k; S_bar = alpha S_old
        Mat<T> s_bar = states[size_t(r)];
        for (T& y : s_bar.a) y *= alpha;
        std::vector<T> dpred(static_cast<size_t>(p.dv));
        T db = 0;
        for (int64_t j = 0; j < p.dv; ++j) {
          T pred = 0;
          for (int64_t i = 0; i < p.dk; ++i) pred += s_bar(i, j) * k[i];
          db += du[size_t(j)] * (x.v(r, j) - pred);
          dv(r, j) = beta * du[size_t(j)];
          dpred[size_t(j)] = -beta * du[size_t(j)];
        }
        dbeta[size_t(r)] = db;
        for (int64_t i = 0; i < p.dk; ++i)
          for (int64_t j = 0; j < p.dv; ++j) {
            dk(r, i) += s_bar(i, j) * dpred[size_t(j)];
            ds(i, j) += k[i] * dpred[size_t(j)];  // ds is now dS_bar
          }
        // S_bar = e^g S_old: dg = <S_bar, dS_bar>, dS_old = e^g dS_bar
        dg[size_t(r)] = dot(s_bar.a.data(), ds.a.data(), int64_t(ds.a.size()));
        for (T& y : ds.a) y *= alpha;
      }
      add_head(gr.dq, p.hk, p.dk, t0, h / p.group, dq);
      add_head(gr.dk, p.hk, p.dk, t0, h / p.group, dk);
      add_head(gr.dv, p.hv, p.dv, t0, h, dv);
      add_scalars(gr.dg, p.hv, t0, h, dg);
      add_scalars(gr.dbeta, p.hv, t0, h, dbeta);
      store_state(p, gr.d_initial_state, doc, h, ds);
    }
  }
  return gr;
}

template <typename T>
GdnOutputs<T> gdn_chunked_forward(const GdnDims& dims, const GdnInputs<T>& in, int64_t chunk) {
  const Problem p = validate("chunked forward", dims, in);
  LATHE_CHECK(chunk >= 1, "gdn: chunked forward: chunk size {} must be >= 1", chunk);
  const T scale = T(p.scale);
  GdnOutputs<T> out;
  out.o.assign(size_t(p.tokens * p.hv * p.dv), T(0));
  out.final_state.assign(size_t(p.docs * p.hv * p.dk * p.dv), T(0));
  for (int64_t doc = 0; doc < p.docs; ++doc) {
    const int64_t begin = in.cu_seqlens[size_t(doc)], end = in.cu_seqlens[size_t(doc) + 1];
    for (int64_t h = 0; h < p.hv; ++h) {
      Mat<T> s = load_state(p, in.initial_state, doc, h);
      for (int64_t t0 = begin; t0 < end; t0 += chunk) {  // chunks start at the document's first token
        const Rows<T> x = gather(p, in, t0, std::min(chunk, end - t0), h);
        const ChunkWy<T> c = chunk_wy(x);
        const Mat<T> delta = chunk_delta(c, s);
        add_head(out.o, p.hv, p.dv, t0, h, chunk_output(x, c, s, delta, scale));
        s = chunk_next_state(x, c, s, delta);
      }
      store_state(p, out.final_state, doc, h, s);
    }
  }
  return out;
}

template <typename T>
GdnGrads<T> gdn_chunked_backward(const GdnDims& dims, const GdnInputs<T>& in, std::span<const T> d_o,
                                 std::span<const T> d_final_state, int64_t chunk) {
  const Problem p = validate("chunked backward", dims, in);
  check_grad_inputs("chunked backward", p, d_o.size(), d_final_state.size());
  LATHE_CHECK(chunk >= 1, "gdn: chunked backward: chunk size {} must be >= 1", chunk);
  const T scale = T(p.scale);
  GdnGrads<T> gr = zero_grads<T>(p);
  for (int64_t doc = 0; doc < p.docs; ++doc) {
    const int64_t begin = in.cu_seqlens[size_t(doc)], end = in.cu_seqlens[size_t(doc) + 1];
    const int64_t num_chunks = (end - begin + chunk - 1) / chunk;
    for (int64_t h = 0; h < p.hv; ++h) {
      // Steps 1-2: recompute the WY matrices, the chunk-start states H[c] and the writes Delta[c].
      std::vector<Rows<T>> xs;
      std::vector<ChunkWy<T>> wy;
      std::vector<Mat<T>> hs, deltas, d_os;
      Mat<T> s = load_state(p, in.initial_state, doc, h);
      for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t t0 = begin + c * chunk, n = std::min(chunk, end - t0);
        xs.push_back(gather(p, in, t0, n, h));
        wy.push_back(chunk_wy(xs.back()));
        d_os.push_back(gather_head(d_o, p.hv, p.dv, t0, n, h));
        hs.push_back(s);
        deltas.push_back(chunk_delta(wy.back(), s));
        s = chunk_next_state(xs.back(), wy.back(), s, deltas.back());
      }
      // Steps 3-4: the reverse scan. dS is the gradient of the state leaving chunk c.
      std::vector<Mat<T>> dhs(static_cast<size_t>(num_chunks)), d_deltas(static_cast<size_t>(num_chunks));
      Mat<T> ds = load_state(p, d_final_state, doc, h);
      for (int64_t c = num_chunks - 1; c >= 0; --c) {
        const Rows<T>& x = xs[size_t(c)];
        const ChunkWy<T>& cw = wy[size_t(c)];
        const Mat<T>& dout = d_os[size_t(c)];
        const int64_t n = x.k.rows;
        const T b_last = cw.b[size_t(n - 1)];
        dhs[size_t(c)] = ds;
        // dDelta = s P^T dO + diag(e^{b_n - b}) K dS
        Mat<T> d_delta = mul_tn(chunk_p(x, cw), dout);
        const Mat<T> k_ds = mul(x.k, ds);
        for (int64_t r = 0; r < n; ++r) {
          const T gam = std::exp(b_last - cw.b[size_t(r)]);
          for (int64_t j = 0; j < p.dv; ++j) d_delta(r, j) = scale * d_delta(r, j) + gam * k_ds(r, j);
        }
        // dS0 = e^{b_n} dS + s (diag(e^b) Q)^T dO - W^T dDelta
        Mat<T> qe = x.q;
        for (int64_t r = 0; r < n; ++r)
          for (int64_t i = 0; i < p.dk; ++i) qe(r, i) *= scale * std::exp(cw.b[size_t(r)]);
        const Mat<T> from_o = mul_tn(qe, dout);
        const Mat<T> from_w = mul_tn(cw.w, d_delta);
        const T e_last = std::exp(b_last);
        for (size_t i = 0; i < ds.a.size(); ++i) ds.a[i] = e_last * ds.a[i] + from_o.a[i] - from_w.a[i];
        d_deltas[size_t(c)] = std::move(d_delta);
      }
      store_state(p, gr.d_initial_state, doc, h, ds);
      // Steps 5-7, independent per chunk.
      for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t t0 = begin + c * chunk;
        const ChunkGrads<T> cg = chunk_backward_local(xs[size_t(c)], wy[size_t(c)], hs[size_t(c)], deltas[size_t(c)],
                                                      d_os[size_t(c)], dhs[size_t(c)], d_deltas[size_t(c)], scale);
        add_head(gr.dq, p.hk, p.dk, t0, h / p.group, cg.dq);
        add_head(gr.dk, p.hk, p.dk, t0, h / p.group, cg.dk);
        add_head(gr.dv, p.hv, p.dv, t0, h, cg.dv);
        add_scalars(gr.dg, p.hv, t0, h, cg.dg);
        add_scalars(gr.dbeta, p.hv, t0, h, cg.dbeta);
      }
    }
  }
  return gr;
}

#define LATHE_GDN_INSTANTIATE(T)                                                                               \
  template GdnOutputs<T> gdn_recurrent_forward<T>(const GdnDims&, const GdnInputs<T>&);                      \
  template GdnGrads<T> gdn_recurrent_backward<T>(const GdnDims&, const GdnInputs<T>&, std::span<const T>,    \
                                                 std::span<const T>);                                        \
  template GdnOutputs<T> gdn_chunked_forward<T>(const GdnDims&, const GdnInputs<T>&, int64_t);               \
  template GdnGrads<T> gdn_chunked_backward<T>(const GdnDims&, const GdnInputs<T>&, std::span<const T>,      \
                                               std::span<const T>, int64_t);
LATHE_GDN_INSTANTIATE(float)
LATHE_GDN_INSTANTIATE(double)
#undef LATHE_GDN_INSTANTIATE

}  // namespace lathe
