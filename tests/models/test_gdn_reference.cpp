// The CPU reference of the Gated DeltaNet core (src/backend/cpu/gdn_reference.h): the recurrence against the note's
// closed form, recurrent vs chunked forward and backward (chunk 64 and small chunks, packed documents of lengths
// 1, 5, 64, 65, 130, H_v = 2 H_k), both backwards against central finite differences, packing (each document alone
// gives the same outputs and gradients as the packed batch), fp32 chunked vs fp64, and input validation.
// Convention: agreements are max-norm relative, max|a - b| / max|b| over a whole tensor; each test prints its worst
// figure so that the margins are visible in the log.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "core/error.h"
#include "backend/cpu/gdn_reference.h"

using namespace lathe;

namespace {

const std::vector<int32_t> kPackedCu = {0, 1, 6, 70, 135, 265};  // documents of 1, 5, 64, 65, 130 tokens

template <typename T>
struct Case {
  GdnDims dims;
  std::vector<int32_t> cu;
  std::vector<T> q, k, v, g, beta, h0;  // h0 empty = zero initial states
  std::vector<T> w_o, w_s;              // objective J = sum(o * w_o) + sum(final_state * w_s)

  GdnInputs<T> inputs() const { return {q, k, v, g, beta, cu, h0}; }
  int64_t tokens() const { return cu.back(); }
  int64_t docs() const { return int64_t(cu.size()) - 1; }
  template <typename U>
  Case<U> cast() const {
    auto c = [](const std::vector<T>& x) { return std::vector<U>(x.begin(), x.end()); };
    return {dims, cu, c(q), c(k), c(v), c(g), c(beta), c(h0), c(w_o), c(w_s)};
  }
};

// q, k unit vectors per (token, key head); v ~ N(0, 1); g ~ U[g_lo, g_hi]; beta = sigmoid(N(0, 1.5)).
Case<double> make_case(GdnDims dims, std::vector<int32_t> cu, double g_lo, double g_hi, bool with_h0, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(g_lo, g_hi);
  Case<double> c;
  c.dims = dims;
  c.cu = std::move(cu);
  const int64_t t = c.tokens(), n = c.docs();
  auto unit_rows = [&](int64_t rows, int64_t dim) {
    std::vector<double> x(static_cast<size_t>(rows * dim));
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < dim; ++i) ss += (x[size_t(r * dim + i)] = normal(rng)) * x[size_t(r * dim + i)];
      for (int64_t i = 0; i < dim; ++i) x[size_t(r * dim + i)] /= std::sqrt(ss);
    }
    return x;
  };
  auto gaussian = [&](int64_t size, double std) {
    std::vector<double> x(static_cast<size_t>(size));
    for (double& y : x) y = std * normal(rng);
    return x;
  };
  c.q = unit_rows(t * dims.k_heads, dims.k_dim);
  c.k = unit_rows(t * dims.k_heads, dims.k_dim);
  c.v = gaussian(t * dims.v_heads * dims.v_dim, 1.0);
  c.g.resize(size_t(t * dims.v_heads));
  for (double& y : c.g) y = uniform(rng);
  c.beta = gaussian(t * dims.v_heads, 1.5);
  for (double& y : c.beta) y = 1.0 / (1.0 + std::exp(-y));
  const int64_t state = n * dims.v_heads * dims.k_dim * dims.v_dim;
  if (with_h0) c.h0 = gaussian(state, 0.5);
  c.w_o = gaussian(t * dims.v_heads * dims.v_dim, 1.0);
  c.w_s = gaussian(state, 1.0);
  return c;
}

template <typename T>
double rel_diff(const std::vector<T>& a, const std::vector<T>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    num = std::max(num, std::abs(double(a[i]) - double(b[i])));
    den = std::max(den, std::abs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

template <typename T>
std::vector<std::pair<const char*, const std::vector<T>*>> grad_fields(const GdnGrads<T>& g) {
  return {{"dq", &g.dq}, {"dk", &g.dk}, {"dv", &g.dv}, {"dg", &g.dg}, {"dbeta", &g.dbeta},
          {"d_initial_state", &g.d_initial_state}};
}

// Worst relative difference over every gradient tensor (and prints each).
template <typename T>
double grads_diff(const char* what, const GdnGrads<T>& a, const GdnGrads<T>& b) {
  const auto fa = grad_fields(a), fb = grad_fields(b);
  double worst = 0;
  for (size_t i = 0; i < fa.size(); ++i) {
    const double d = rel_diff(*fa[i].second, *fb[i].second);
    std::printf("  %s %s: %.3g\n", what, fa[i].first, d);
    worst = std::max(worst, d);
  }
  return worst;
}

enum class Form { kRecurrent, kChunked };

template <typename T>
GdnOutputs<T> forward(Form form, const Case<T>& c, int64_t chunk) {
  return form == Form::kRecurrent ? gdn_recurrent_forward(c.dims, c.inputs())
                                  : gdn_chunked_forward(c.dims, c.inputs(), chunk);
}

template <typename T>
GdnGrads<T> backward(Form form, const Case<T>& c, int64_t chunk) {
  return form == Form::kRecurrent
             ? gdn_recurrent_backward<T>(c.dims, c.inputs(), c.w_o, c.w_s)
             : gdn_chunked_backward<T>(c.dims, c.inputs(), c.w_o, c.w_s, chunk);
}

double objective(Form form, const Case<double>& c, int64_t chunk) {
  const GdnOutputs<double> out = forward(form, c, chunk);
  double j = 0;
  for (size_t i = 0; i < out.o.size(); ++i) j += out.o[i] * c.w_o[i];
  for (size_t i = 0; i < out.final_state.size(); ++i) j += out.final_state[i] * c.w_s[i];
  return j;
}

GdnDims gqa_dims() { return {2, 4, 16, 12, 0.0}; }  // H_v = 2 H_k, d_k != d_v so that a transposition shows
GdnDims mha_dims() { return {3, 3, 8, 8, 0.0}; }

// ---------------------------------------------------------------------------------------------------------------

// The recurrence against the note's other statement of it, S_t = e^g (I - beta k k^T) S_{t-1} + beta k v^T and
// o_t = S_t^T q_t / sqrt(d_k), written here independently with the repeat of q, k to value heads done by hand.
TEST(GdnReference, RecurrenceMatchesClosedForm) {
  const GdnDims dims{1, 2, 3, 2, 0.0};
  const Case<double> c = make_case(dims, {0, 3, 7}, -1.0, -0.01, true, 1);
  const GdnOutputs<double> out = gdn_recurrent_forward(dims, c.inputs());
  double worst = 0;
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t h = 0; h < 2; ++h) {
      double s[3][2];
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 2; ++j) s[i][j] = c.h0[size_t(((n * 2 + h) * 3 + i) * 2 + j)];
      for (int32_t t = c.cu[size_t(n)]; t < c.cu[size_t(n) + 1]; ++t) {
        const double* k = &c.k[size_t(t * 3)];  // key head 0 serves both value heads
        const double* q = &c.q[size_t(t * 3)];
        const double* v = &c.v[size_t((t * 2 + h) * 2)];
        const double a = std::exp(c.g[size_t(t * 2 + h)]), b = c.beta[size_t(t * 2 + h)];
        double next[3][2];
        for (int i = 0; i < 3; ++i)
          for (int j = 0; j < 2; ++j) {
            double m = 0;  // ((I - b k k^T) S)_ij
            for (int p = 0; p < 3; ++p) m += ((i == p ? 1.0 : 0.0) - b * k[i] * k[p]) * s[p][j];
            next[i][j] = a * m + b * k[i] * v[j];
          }
        for (int j = 0; j < 2; ++j) {
          double o = 0;
          for (int i = 0; i < 3; ++i) {
            s[i][j] = next[i][j];
            o += s[i][j] * q[i] / std::sqrt(3.0);
          }
          worst = std::max(worst, std::abs(o - out.o[size_t((t * 2 + h) * 2 + j)]));
        }
      }
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 2; ++j)
          worst = std::max(worst, std::abs(s[i][j] - out.final_state[size_t(((n * 2 + h) * 3 + i) * 2 + j)]));
    }
  std::printf("  closed form vs recurrent: max abs %.3g\n", worst);
  EXPECT_LT(worst, 1e-14);
  // An explicit query scale replaces d_k^{-1/2}: twice the default doubles every output, in both forms.
  GdnDims doubled = dims;
  doubled.scale = 2.0 / std::sqrt(3.0);
  const GdnOutputs<double> rec2 = gdn_recurrent_forward(doubled, c.inputs());
  const GdnOutputs<double> chk2 = gdn_chunked_forward(doubled, c.inputs(), 2);
  for (size_t i = 0; i < out.o.size(); ++i) {
    EXPECT_NEAR(rec2.o[i], 2.0 * out.o[i], 1e-14);
    EXPECT_NEAR(chk2.o[i], 2.0 * out.o[i], 1e-14);
  }
}

// (1) forward: chunked == recurrent, outputs and final states, several chunk sizes, slow and fast decay.
TEST(GdnReference, ChunkedForwardMatchesRecurrent) {
  for (const GdnDims& dims : {gqa_dims(), mha_dims()})
    for (const auto& [g_lo, g_hi] : {std::pair{-0.2, 0.0}, std::pair{-5.0, 0.0}})
      for (bool with_h0 : {true, false}) {
        const Case<double> c = make_case(dims, kPackedCu, g_lo, g_hi, with_h0, 2);
        const GdnOutputs<double> ref = gdn_recurrent_forward(dims, c.inputs());
        for (int64_t chunk : {int64_t(64), int64_t(16), int64_t(4), int64_t(1)}) {
          const GdnOutputs<double> got = gdn_chunked_forward(dims, c.inputs(), chunk);
          const double d_o = rel_diff(got.o, ref.o), d_s = rel_diff(got.final_state, ref.final_state);
          std::printf("  H_k %lld H_v %lld g [%g, %g] h0 %d chunk %lld: o %.3g final state %.3g\n",
                      (long long)dims.k_heads, (long long)dims.v_heads, g_lo, g_hi, int(with_h0), (long long)chunk,
                      d_o, d_s);
          EXPECT_LT(d_o, 1e-10);
          EXPECT_LT(d_s, 1e-10);
        }
      }
}

// (2) both backwards against central finite differences of J, for every input, at sampled positions including
// each document's first and last token.
TEST(GdnReference, BackwardMatchesFiniteDifferences) {
  const GdnDims dims{2, 4, 8, 6, 0.0};
  const Case<double> base = make_case(dims, kPackedCu, -1.0, -0.01, true, 3);
  std::mt19937_64 rng(4);
  for (const auto& [form, chunk] : {std::pair{Form::kRecurrent, int64_t(0)}, std::pair{Form::kChunked, int64_t(64)},
                                    std::pair{Form::kChunked, int64_t(4)}}) {
    const GdnGrads<double> gr = backward(form, base, chunk);
    struct Field {
      const char* name;
      std::vector<double> Case<double>::*member;
      const std::vector<double>* grad;
      int64_t row;  // elements per token (0: not token-major)
    };
    const std::vector<Field> fields = {
        {"q", &Case<double>::q, &gr.dq, dims.k_heads * dims.k_dim},
        {"k", &Case<double>::k, &gr.dk, dims.k_heads * dims.k_dim},
        {"v", &Case<double>::v, &gr.dv, dims.v_heads * dims.v_dim},
        {"g", &Case<double>::g, &gr.dg, dims.v_heads},
        {"beta", &Case<double>::beta, &gr.dbeta, dims.v_heads},
        {"initial_state", &Case<double>::h0, &gr.d_initial_state, 0},
    };
    for (const Field& f : fields) {
      const size_t size = (base.*f.member).size();
      double grad_max = 0;
      for (double x : *f.grad) grad_max = std::max(grad_max, std::abs(x));
      std::vector<size_t> idx;
      std::uniform_int_distribution<size_t> any(0, size - 1);
      if (f.row > 0) {
        std::uniform_int_distribution<int64_t> in_row(0, f.row - 1);
        for (size_t d = 0; d + 1 < base.cu.size(); ++d)
          for (int32_t t : {base.cu[d], base.cu[d + 1] - 1}) idx.push_back(size_t(t * f.row + in_row(rng)));
      }
      while (idx.size() < 24) idx.push_back(any(rng));
      double worst = 0;
      for (size_t i : idx) {
        const double eps = 1e-5;
        Case<double> c = base;
        (c.*f.member)[i] = (base.*f.member)[i] + eps;
        const double jp = objective(form, c, chunk);
        (c.*f.member)[i] = (base.*f.member)[i] - eps;
        const double jm = objective(form, c, chunk);
        const double fd = (jp - jm) / (2 * eps), an = (*f.grad)[i];
        // Relative to the entry, floored at 1e-3 of the tensor's largest gradient (FD rounding is absolute).
        worst = std::max(worst, std::abs(an - fd) / std::max({std::abs(fd), std::abs(an), 1e-3 * grad_max}));
      }
      std::printf("  %s chunk %lld: d%s vs finite differences %.3g (%zu samples, max |grad| %.3g)\n",
                  form == Form::kRecurrent ? "recurrent" : "chunked", (long long)chunk, f.name, worst, idx.size(),
                  grad_max);
      EXPECT_LT(worst, 1e-6) << f.name;
    }
  }
}

// (3) backward: chunked == recurrent for every gradient.
TEST(GdnReference, ChunkedBackwardMatchesRecurrent) {
  for (const GdnDims& dims : {gqa_dims(), mha_dims()})
    for (const auto& [g_lo, g_hi] : {std::pair{-0.2, 0.0}, std::pair{-5.0, 0.0}}) {
      const Case<double> c = make_case(dims, kPackedCu, g_lo, g_hi, true, 5);
      const GdnGrads<double> ref = backward(Form::kRecurrent, c, 0);
      for (int64_t chunk : {int64_t(64), int64_t(16), int64_t(4), int64_t(1)}) {
        std::printf(" H_k %lld H_v %lld g [%g, %g] chunk %lld\n", (long long)dims.k_heads, (long long)dims.v_heads,
                    g_lo, g_hi, (long long)chunk);
        EXPECT_LT(grads_diff("chunked vs recurrent", backward(Form::kChunked, c, chunk), ref), 1e-9);
      }
    }
}

// (4) packing: each document run alone (its own inputs, initial state and output gradients) reproduces its slice
// of the packed outputs, final states and gradients, so no state leaks across a boundary in either pass. An empty
// document passes its initial state through (and d_final_state back).
TEST(GdnReference, PackedEqualsDocumentsAlone) {
  const GdnDims dims = gqa_dims();
  std::vector<int32_t> cu = kPackedCu;
  cu.insert(cu.begin() + 3, cu[2]);  // an empty document between those of 5 and 64 tokens
  const Case<double> c = make_case(dims, cu, -0.5, 0.0, true, 6);
  const int64_t tok_q = dims.k_heads * dims.k_dim, tok_v = dims.v_heads * dims.v_dim, tok_s = dims.v_heads;
  const int64_t state = dims.v_heads * dims.k_dim * dims.v_dim;
  auto slice = [](const std::vector<double>& x, int64_t from, int64_t to) {
    return std::vector<double>(x.begin() + from, x.begin() + to);
  };
  for (const auto& [form, chunk] : {std::pair{Form::kRecurrent, int64_t(0)}, std::pair{Form::kChunked, int64_t(64)},
                                    std::pair{Form::kChunked, int64_t(4)}}) {
    const GdnOutputs<double> packed = forward(form, c, chunk);
    const GdnGrads<double> packed_g = backward(form, c, chunk);
    double worst = 0;
    for (int64_t n = 0; n < c.docs(); ++n) {
      const int64_t a = c.cu[size_t(n)], b = c.cu[size_t(n) + 1];
      Case<double> d;
      d.dims = dims;
      d.cu = {0, int32_t(b - a)};
      d.q = slice(c.q, a * tok_q, b * tok_q);
      d.k = slice(c.k, a * tok_q, b * tok_q);
      d.v = slice(c.v, a * tok_v, b * tok_v);
      d.g = slice(c.g, a * tok_s, b * tok_s);
      d.beta = slice(c.beta, a * tok_s, b * tok_s);
      d.h0 = slice(c.h0, n * state, (n + 1) * state);
      d.w_o = slice(c.w_o, a * tok_v, b * tok_v);
      d.w_s = slice(c.w_s, n * state, (n + 1) * state);
      const GdnOutputs<double> alone = forward(form, d, chunk);
      const GdnGrads<double> alone_g = backward(form, d, chunk);
      auto cmp = [&](const std::vector<double>& x, const std::vector<double>& packed_x, int64_t from, int64_t to) {
        const std::vector<double> part = slice(packed_x, from, to);
        for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - part[i]));
        EXPECT_EQ(x.size(), part.size());
      };
      cmp(alone.o, packed.o, a * tok_v, b * tok_v);
      cmp(alone.final_state, packed.final_state, n * state, (n + 1) * state);
      cmp(alone_g.dq, packed_g.dq, a * tok_q, b * tok_q);
      cmp(alone_g.dk, packed_g.dk, a * tok_q, b * tok_q);
      cmp(alone_g.dv, packed_g.dv, a * tok_v, b * tok_v);
      cmp(alone_g.dg, packed_g.dg, a * tok_s, b * tok_s);
      cmp(alone_g.dbeta, packed_g.dbeta, a * tok_s, b * tok_s);
      cmp(alone_g.d_initial_state, packed_g.d_initial_state, n * state, (n + 1) * state);
      if (a == b) {  // empty: final state = initial state, d_initial_state = d_final_state
        EXPECT_EQ(alone.final_state, d.h0);
        EXPECT_EQ(alone_g.d_initial_state, d.w_s);
      }
    }
    std::printf("  %s chunk %lld: packed vs documents alone, max abs %.3g\n",
                form == Form::kRecurrent ? "recurrent" : "chunked", (long long)chunk, worst);
    EXPECT_EQ(worst, 0.0);  // the same operations in the same order
  }
}

// fp32 chunked (chunk 64) against the fp64 recurrence at T = 256, realistic decays g in [-5, 0] and head size 64.
TEST(GdnReference, FloatChunkedStaysCloseToDouble) {
  const GdnDims dims{1, 2, 64, 64, 0.0};
  for (const std::vector<int32_t>& cu : {std::vector<int32_t>{0, 256}, std::vector<int32_t>{0, 100, 256}}) {
    const Case<double> c = make_case(dims, cu, -5.0, 0.0, true, 7);
    const Case<float> f = c.cast<float>();
    const GdnOutputs<double> ref = gdn_recurrent_forward(dims, c.inputs());
    const GdnOutputs<float> got = gdn_chunked_forward(dims, f.inputs(), 64);
    const GdnOutputs<float> got_rec = gdn_recurrent_forward(dims, f.inputs());
    auto widen = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
    const double d_o = rel_diff(widen(got.o), ref.o), d_s = rel_diff(widen(got.final_state), ref.final_state);
    std::printf("  %zu documents: fp32 chunked vs fp64: o %.3g final state %.3g; fp32 recurrent o %.3g\n",
                cu.size() - 1, d_o, d_s, rel_diff(widen(got_rec.o), ref.o));
    EXPECT_LT(d_o, 1e-4);
    EXPECT_LT(d_s, 1e-4);
    // The backward in fp32, to the same bound.
    const GdnGrads<double> ref_g = backward(Form::kRecurrent, c, 0);
    const GdnGrads<float> got_g = backward(Form::kChunked, f, 64);
    const auto fa = grad_fields(got_g);
    const auto fb = grad_fields(ref_g);
    for (size_t i = 0; i < fa.size(); ++i) {
      const double d = rel_diff(widen(*fa[i].second), *fb[i].second);
      std::printf("  fp32 chunked backward vs fp64 %s: %.3g\n", fa[i].first, d);
      EXPECT_LT(d, 1e-4) << fa[i].first;
    }
  }
}

TEST(GdnReference, RejectsBadInputs) {
  const GdnDims dims = gqa_dims();
  Case<double> c = make_case(dims, {0, 3, 8}, -1.0, 0.0, false, 8);
  EXPECT_NO_THROW(gdn_chunked_forward(dims, c.inputs()));
  const std::vector<double> d_o(c.v.size(), 1.0);
  EXPECT_THROW(gdn_recurrent_backward<double>(dims, c.inputs(), std::span<const double>(d_o).first(3), {}), Error);
  EXPECT_THROW(gdn_chunked_forward(dims, c.inputs(), 0), Error);
  GdnDims bad = dims;
  bad.v_heads = 3;  // not a multiple of H_k
  EXPECT_THROW(gdn_recurrent_forward(bad, c.inputs()), Error);
  Case<double> cu_bad = c;
  cu_bad.cu = {0, 5, 3, 8};
  EXPECT_THROW(gdn_recurrent_forward(dims, cu_bad.inputs()), Error);
  Case<double> short_q = c;
  short_q.q.pop_back();
  EXPECT_THROW(gdn_chunked_forward(dims, short_q.inputs()), Error);
  Case<double> positive_g = c;
  positive_g.g[4] = 0.5;  // e.g. the decay factor e^g (> 0) passed for the log-decay
  EXPECT_THROW(gdn_recurrent_forward(dims, positive_g.inputs()), Error);
  Case<double> bad_h0 = c;
  bad_h0.h0.assign(5, 0.0);
  EXPECT_THROW(gdn_chunked_forward(dims, bad_h0.inputs()), Error);
}

}  // namespace
