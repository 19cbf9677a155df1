// CPU reference kernels of the transformer layer ops: embedding (+ backward), RMSNorm and gated RMSNorm
// (rmsnorm(x) * silu(z)) (+ backward), rotary embedding, SwiGLU (+ backward), causal packed attention
// (+ backward) and cross-entropy.
// Plain loops with double accumulation; templates over float and double. Index inputs are validated
// (an out-of-range token id or label is a data error, reported with its position).
// Covered by tests/ops (forward, backward, finite differences) and tests/models (HF parity).
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/rope_angles.h"
#include "backend/registry.h"
#include "backend/sample_hash.h"

namespace lathe {

namespace {

template <typename T>
void embedding_kernel(const OpCall& c, ExecContext&) {
  const Tensor& w = c.inputs[0];
  const int64_t vocab = w.size(0), hidden = w.size(1), n = c.inputs[1].numel();
  const int32_t* ids = c.inputs[1].data<int32_t>();
  const int64_t first = std::holds_alternative<EmbeddingAttrs>(c.attrs) ? c.attr<EmbeddingAttrs>().first : -1;
  for (int64_t t = 0; t < n; ++t)
    LATHE_CHECK(first >= 0 || (ids[t] >= 0 && ids[t] < vocab),
                "embedding: token id {} at position {} is outside the vocabulary (size {})", ids[t], t, vocab);
  const T* pw = w.data<T>();
  T* out = c.outputs[0].data<T>();
  const int64_t from = std::max<int64_t>(first, 0);
#pragma omp parallel for if (n * hidden > 65536)
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = ids[t] - from;
    if (row >= 0 && row < vocab) std::copy(pw + row * hidden, pw + (row + 1) * hidden, out + t * hidden);
    else std::fill(out + t * hidden, out + (t + 1) * hidden, T(0.0));  // another slice's id
  }
}

template <typename T>
void embedding_backward_kernel(const OpCall& c, ExecContext&) {
  const int64_t hidden = c.inputs[0].size(-1), n = c.inputs[1].numel();
  const int64_t vocab = c.outputs[0].size(0);
  const T* dy = c.inputs[0].data<T>();
  const int32_t* ids = c.inputs[1].data<int32_t>();
  const int64_t first = c.attr<EmbeddingAttrs>().first;  // >= 0: a vocab-parallel slice; other ids are skipped
  for (int64_t t = 0; t < n; ++t)
    LATHE_CHECK(first >= 0 || (ids[t] >= 0 && ids[t] < vocab),
                "embedding: token id {} at position {} is outside the vocabulary (size {})", ids[t], t, vocab);
  const int64_t from = std::max<int64_t>(first, 0);
  std::vector<int64_t> row(static_cast<size_t>(n));  // each token's row of dw, -1 where another slice holds it
  for (int64_t t = 0; t < n; ++t) row[size_t(t)] = ids[t] - from >= 0 && ids[t] - from < vocab ? ids[t] - from : -1;
  // f64 sums in token order, for the ids that occur only (a vocab x hidden buffer would be 1.2 GB at Qwen3-0.6B).
  std::vector<int64_t> slot(size_t(vocab), -1), named;
  for (int64_t t = 0; t < n; ++t) {
    if (row[size_t(t)] < 0 || slot[size_t(row[size_t(t)])] >= 0) continue;
    slot[size_t(row[size_t(t)])] = int64_t(named.size());
    named.push_back(row[size_t(t)]);
  }
  std::vector<double> acc(named.size() * size_t(hidden), 0.0);
#pragma omp parallel for if (n * hidden > 65536)
  for (int64_t j = 0; j < hidden; ++j)
    for (int64_t t = 0; t < n; ++t)
      if (row[size_t(t)] >= 0) acc[size_t(slot[size_t(row[size_t(t)])] * hidden + j)] += double(dy[t * hidden + j]);
  T* dw = c.outputs[0].data<T>();
  const bool accumulate = c.attr<EmbeddingAttrs>().accumulate;
  if (!accumulate) std::fill(dw, dw + vocab * hidden, T(0.0));  // rows no id names keep their bytes when accumulating
  for (size_t i = 0; i < named.size(); ++i) {
    T* row = dw + named[i] * hidden;
    const double* sum = acc.data() + i * size_t(hidden);
    for (int64_t j = 0; j < hidden; ++j) row[j] = T(accumulate ? double(row[j]) + sum[j] : sum[j]);
  }
}

// y = x inv (offset + w) [silu(z) when kGated], inv = 1 / rms(x), silu(z) = z sigmoid(z); one rounding, at y.
// rmsnorm is the kGated = false case; gated_rmsnorm takes z as a third input. kResidual (residual_rmsnorm, inputs
// x, r, w; outputs y, h): the normalised row is h = x + r, rounded to T and written out first.
template <typename T, bool kGated, bool kResidual = false>
void rmsnorm_kernel(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<NormAttrs>();
  const int64_t h = c.inputs[0].size(-1), rows = h ? c.inputs[0].numel() / h : 0;
  T* hsum = kResidual ? c.outputs[1].data<T>() : nullptr;
  if constexpr (kResidual) {
    const T* x0 = c.inputs[0].data<T>();
    const T* res = c.inputs[1].data<T>();
    for (int64_t i = 0; i < rows * h; ++i) hsum[i] = T(double(x0[i]) + double(res[i]));
  }
  const T* x = kResidual ? hsum : c.inputs[0].data<T>();
  const T* w = c.inputs[kResidual ? 2 : 1].data<T>();
  const T* z = kGated ? c.inputs[2].data<T>() : nullptr;
  T* y = c.outputs[0].data<T>();
#pragma omp parallel for if (rows * h > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < h; ++j) ss += double(x[r * h + j]) * double(x[r * h + j]);
    const double inv = 1.0 / std::sqrt(ss / double(h) + a.eps);
    for (int64_t j = 0; j < h; ++j) {
      double v = double(x[r * h + j]) * inv * (a.offset + double(w[j]));
      if constexpr (kGated) {
        const double zj = double(z[r * h + j]);
        v *= zj / (1.0 + std::exp(-zj));
      }
      y[r * h + j] = T(v);
    }
  }
}

// With g = dy (rmsnorm) or g = dy silu(z) (gated; the gradient reaching the plain norm's output):
// dx_j = inv * g_j (offset + w_j) - x_j * inv^3 / H * sum_k g_k (offset + w_k) x_k; dw_j = sum_rows g_j x_j inv;
// gated also dz_j = dy_j n_j sigmoid(z_j) (1 + z_j (1 - sigmoid(z_j))), n_j = x_j inv (offset + w_j).
// Inputs (x, w, dy) or (x, w, z, dy); outputs (dx, dw) or (dx, dw, dz). kResidual (residual_rmsnorm_backward):
// inputs (x, w, dy, dres), and dx gets dres added before its rounding.
template <typename T, bool kGated, bool kResidual = false>
void rmsnorm_backward_kernel(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<NormAttrs>();
  const int64_t h = c.inputs[0].size(-1), rows = h ? c.inputs[0].numel() / h : 0;
  const T* x = c.inputs[0].data<T>();
  const T* w = c.inputs[1].data<T>();
  const T* z = kGated ? c.inputs[2].data<T>() : nullptr;
  const T* dy = c.inputs[kGated ? 3 : 2].data<T>();
  T* dx = c.outputs[0].data<T>();
  T* dz = kGated ? c.outputs[2].data<T>() : nullptr;
  const T* dres = kResidual ? c.inputs[3].data<T>() : nullptr;
  std::vector<double> dw(size_t(h), 0.0);
  std::vector<double> g(static_cast<size_t>(h));  // the row's gradient at the plain norm's output
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * h;
    const T* dyr = dy + r * h;
    double ss = 0, dot = 0;
    for (int64_t j = 0; j < h; ++j) {
      g[size_t(j)] = double(dyr[j]);
      if constexpr (kGated) {
        const double zj = double(z[r * h + j]);
        g[size_t(j)] = double(dyr[j]) * zj / (1.0 + std::exp(-zj));
      }
      ss += double(xr[j]) * double(xr[j]);
      dot += g[size_t(j)] * (a.offset + double(w[j])) * double(xr[j]);
    }
    const double inv = 1.0 / std::sqrt(ss / double(h) + a.eps);
    for (int64_t j = 0; j < h; ++j) {
      const double gw = g[size_t(j)] * (a.offset + double(w[j]));
      const double d = inv * gw - double(xr[j]) * inv * inv * inv * dot / double(h);
      dx[r * h + j] = T(kResidual ? d + double(dres[r * h + j]) : d);
      dw[size_t(j)] += g[size_t(j)] * double(xr[j]) * inv;
      if constexpr (kGated) {
        const double zj = double(z[r * h + j]);
        const double sig = 1.0 / (1.0 + std::exp(-zj));
        const double n = double(xr[j]) * inv * (a.offset + double(w[j]));
        dz[r * h + j] = T(double(dyr[j]) * n * sig * (1.0 + zj * (1.0 - sig)));
      }
    }
  }
  T* pdw = c.outputs[1].data<T>();
  for (int64_t j = 0; j < h; ++j) pdw[j] = T(dw[size_t(j)]);
}

template <typename T>
void rope_kernel(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<RopeAttrs>();
  const Tensor& x = c.inputs[0];
  const int64_t t_len = x.size(0), heads = x.size(1), d = x.size(2);
  const int64_t r = a.rotary_dim ? a.rotary_dim : d, half = r / 2;
  const int32_t* pos = c.inputs[1].data<int32_t>();
  const T* px = x.data<T>();
  T* py = c.outputs[0].data<T>();
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv_freq[size_t(i)] = cpu::rope_inv_freq(a.theta, i, r);
#pragma omp parallel for if (t_len * heads * d > 65536)
  for (int64_t t = 0; t < t_len; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = float(pos[t]) * inv_freq[size_t(i)];
      const double cs = std::cos(angle), sn = a.inverse ? -double(std::sin(angle)) : double(std::sin(angle));
      for (int64_t hd = 0; hd < heads; ++hd) {
        const int64_t base = (t * heads + hd) * d;
        const double x1 = double(px[base + i]), x2 = double(px[base + i + half]);
        py[base + i] = T(x1 * cs - x2 * sn);
        py[base + i + half] = T(x2 * cs + x1 * sn);
      }
    }
    for (int64_t hd = 0; hd < heads; ++hd)
      for (int64_t j = r; j < d; ++j) py[(t * heads + hd) * d + j] = px[(t * heads + hd) * d + j];
  }
}

template <typename T>
void swiglu_kernel(const OpCall& c, ExecContext&) {
  const T* g = c.inputs[0].data<T>();
  const T* u = c.inputs[1].data<T>();
  T* y = c.outputs[0].data<T>();
  const int64_t n = c.outputs[0].numel();
#pragma omp parallel for if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const double gv = double(g[i]);
    y[i] = T(gv / (1.0 + std::exp(-gv)) * double(u[i]));
  }
}

template <typename T>
void swiglu_backward_kernel(const OpCall& c, ExecContext&) {
  const T* g = c.inputs[0].data<T>();
  const T* u = c.inputs[1].data<T>();
  const T* dy = c.inputs[2].data<T>();
  T* dg = c.outputs[0].data<T>();
  T* du = c.outputs[1].data<T>();
  const int64_t n = c.outputs[0].numel();
#pragma omp parallel for if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const double gv = double(g[i]), s = 1.0 / (1.0 + std::exp(-gv));
    du[i] = T(double(dy[i]) * gv * s);
    dg[i] = T(double(dy[i]) * double(u[i]) * s * (1.0 + gv * (1.0 - s)));
  }
}

// Validated document boundaries: 0 = cu[0] <= cu[1] <= ... <= cu[B] = T.
std::vector<int64_t> documents(const Tensor& cu, int64_t total) {
  const int32_t* p = cu.data<int32_t>();
  std::vector<int64_t> out(size_t(cu.numel()));
  for (int64_t i = 0; i < cu.numel(); ++i) {
    out[size_t(i)] = p[i];
    LATHE_CHECK(i == 0 ? p[i] == 0 : p[i] >= p[i - 1], "attention: cu_seqlens must start at 0 and not decrease (entry {} is {})",
                i, p[i]);
  }
  LATHE_CHECK(out.back() == total, "attention: cu_seqlens ends at {} but there are {} tokens", out.back(), total);
  return out;
}

template <typename T>
void attention_kernel(const OpCall& c, ExecContext&) {
  const Tensor& q = c.inputs[0];
  const int64_t t_len = q.size(0), hq = q.size(1), d = q.size(2), hkv = c.inputs[1].size(1), group = hq / hkv;
  const double scale = c.attr<AttentionAttrs>().scale ? c.attr<AttentionAttrs>().scale : 1.0 / std::sqrt(double(d));
  const std::vector<int64_t> cu = documents(c.inputs[3], t_len);
  const T* pq = q.data<T>();
  const T* pk = c.inputs[1].data<T>();
  const T* pv = c.inputs[2].data<T>();
  T* po = c.outputs[0].data<T>();
  auto* plse = static_cast<typename std::conditional<std::is_same_v<T, double>, double, float>::type*>(c.outputs[1].data_ptr());
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t h = 0; h < hq; ++h) {
    for (int64_t i = 0; i < t_len; ++i) {
      const int64_t doc_start = *(std::upper_bound(cu.begin(), cu.end(), i) - 1);
      const int64_t kh = h / group;
      std::vector<double> s(size_t(i - doc_start + 1));
      double mx = -INFINITY;
      for (int64_t j = doc_start; j <= i; ++j) {
        double dot = 0;
        for (int64_t e = 0; e < d; ++e) dot += double(pq[(i * hq + h) * d + e]) * double(pk[(j * hkv + kh) * d + e]);
        s[size_t(j - doc_start)] = dot * scale;
        mx = std::max(mx, dot * scale);
      }
      double l = 0;
      for (double v : s) l += std::exp(v - mx);
      const double lse = mx + std::log(l);
      for (int64_t e = 0; e < d; ++e) {
        double acc = 0;
        for (int64_t j = doc_start; j <= i; ++j) acc += std::exp(s[size_t(j - doc_start)] - lse) * double(pv[(j * hkv + kh) * d + e]);
        po[(i * hq + h) * d + e] = T(acc);
      }
      plse[i * hq + h] = decltype(+plse[0])(lse);
    }
  }
}

// paged_attention (op_table.h), in double; each sequence's block table and lengths checked first.
template <typename T>
void paged_attention_kernel(const OpCall& c, ExecContext&) {
  const Tensor& q = c.inputs[0];
  const int64_t t_len = q.size(0), hq = q.size(1), d = q.size(2), hkv = c.inputs[1].size(1), group = hq / hkv;
  const auto& a = c.attr<PagedAttentionAttrs>();
  const double scale = a.scale ? a.scale : 1.0 / std::sqrt(double(d));
  const int64_t bs = a.block_size, rows = c.inputs[1].size(0), b_count = c.inputs[3].size(0);
  const int64_t m = c.inputs[3].size(1);
  const int32_t* table = c.inputs[3].data<int32_t>();
  const std::vector<int64_t> cu = documents(c.inputs[4], t_len);
  const int32_t* ctx_len = c.inputs[5].data<int32_t>();
  for (int64_t b = 0; b < b_count; ++b) {
    const int64_t n = cu[size_t(b + 1)] - cu[size_t(b)], len = ctx_len[b];
    LATHE_CHECK(len >= n && len <= m * bs, "paged_attention: sequence {} has {} new tokens and a context of {} (its block "
                "table holds {})", b, n, len, m * bs);
    for (int64_t j = 0; j < (len + bs - 1) / bs; ++j)
      LATHE_CHECK(table[b * m + j] >= 0 && (table[b * m + j] + 1) * bs <= rows,
                  "paged_attention: sequence {} names block {} of a cache of {} rows", b, table[b * m + j], rows);
  }
  const T* pq = q.data<T>();
  const T* pk = c.inputs[1].data<T>();
  const T* pv = c.inputs[2].data<T>();
  T* po = c.outputs[0].data<T>();
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t h = 0; h < hq; ++h) {
    for (int64_t i = 0; i < t_len; ++i) {
      const int64_t b = int64_t(std::upper_bound(cu.begin(), cu.end(), i) - cu.begin()) - 1;
      const int64_t n = cu[size_t(b + 1)] - cu[size_t(b)], pos = ctx_len[b] - n + (i - cu[size_t(b)]);
      const int64_t kh = h / group;
      const auto row = [&](int64_t j) { return (int64_t(table[b * m + j / bs]) * bs + j % bs) * hkv + kh; };
      std::vector<double> s(size_t(pos + 1));
      double mx = -INFINITY;
      for (int64_t j = 0; j <= pos; ++j) {
        double dot = 0;
        for (int64_t e = 0; e < d; ++e) dot += double(pq[(i * hq + h) * d + e]) * double(pk[row(j) * d + e]);
        s[size_t(j)] = dot * scale;
        mx = std::max(mx, dot * scale);
      }
      double l = 0;
      for (double& v : s) l += (v = std::exp(v - mx));
      for (int64_t e = 0; e < d; ++e) {
        double acc = 0;
        for (int64_t j = 0; j <= pos; ++j) acc += s[size_t(j)] * double(pv[row(j) * d + e]);
        po[(i * hq + h) * d + e] = T(acc / l);
      }
    }
  }
}

// sample_rows' top-k / top-p cut (op_table.h) of the ids with finite z below the limit, given as (key, exp(z - max z))
// and sorted here, largest key first: the smallest key kept (0: all).
uint32_t sample_cut(std::vector<std::pair<uint32_t, double>>& s, int64_t top_k, double top_p) {
  std::sort(s.begin(), s.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  uint32_t cut = 0;
  size_t kept = s.size();
  if (top_k > 0 && size_t(top_k) < s.size()) {
    cut = s[size_t(top_k) - 1].first;
    while (kept > 0 && s[kept - 1].first < cut) --kept;
  }
  if (top_p < 1) {
    double mass = 0;
    for (size_t i = 0; i < kept; ++i) mass += s[i].second;
    double above = 0;  // the mass of the keys above the current group of equal keys
    uint32_t lowest = cut;
    for (size_t i = 0; i < kept && above < top_p * mass;) {
      lowest = s[i].first;
      while (i < kept && s[i].first == lowest) above += s[i++].second;
    }
    cut = std::max(cut, lowest);
  }
  return cut;
}

// sample_rows (op_table.h), in double: one pass for the largest z, the cut, one pass for the Gumbel argmax and the sum.
template <typename T>
void sample_rows_kernel(const OpCall& c, ExecContext&) {
  const Tensor& x = c.inputs[0];
  const int64_t v = x.size(1), m = c.inputs[1].size(0);
  const int64_t limit = c.attr<ArgmaxAttrs>().limit ? c.attr<ArgmaxAttrs>().limit : v;
  using S = typename std::conditional<std::is_same_v<T, double>, double, float>::type;
  const int32_t* rows = c.inputs[1].data<int32_t>();
  const S* params = static_cast<const S*>(c.inputs[2].data_ptr());
  const int32_t* keys = c.inputs[3].data<int32_t>();
  int32_t* token = c.outputs[0].data<int32_t>();
  S* logit = static_cast<S*>(c.outputs[1].data_ptr());
  S* logprob = static_cast<S*>(c.outputs[2].data_ptr());
  std::vector<std::pair<uint32_t, double>> keyed;
  for (int64_t i = 0; i < m; ++i) {
    LATHE_CHECK(rows[i] >= 0 && rows[i] < x.size(0), "cpu: sample_rows: draw {} names row {} of {}", i, rows[i],
                x.size(0));
    const T* row = x.data<T>() + int64_t(rows[i]) * v;
    const double t = double(params[4 * i]), min_p = double(params[4 * i + 1]);
    const int64_t top_k = int64_t(params[4 * i + 2]);
    const double top_p = double(params[4 * i + 3]);
    const uint64_t key = sample_key(keys[3 * i], keys[3 * i + 1]), counter = uint64_t(uint32_t(keys[3 * i + 2]));
    double zmax = -INFINITY;
    for (int64_t j = 0; j < limit; ++j)
      if (std::isfinite(double(row[j]))) zmax = std::max(zmax, double(row[j]) / t);
    uint32_t cut_key = 0;
    if ((top_k > 0 || top_p < 1) && std::isfinite(zmax)) {
      keyed.clear();
      for (int64_t j = 0; j < limit; ++j) {
        const double z = double(row[j]) / t;
        if (std::isfinite(z)) keyed.push_back({ordered_key(float(z)), std::exp(z - zmax)});
      }
      cut_key = sample_cut(keyed, top_k, top_p);
    }
    const double cut = min_p > 0 ? zmax + std::log(min_p) : -INFINITY;
    double best = -INFINITY, sum = 0;
    int64_t chosen = -1;
    for (int64_t j = 0; j < limit; ++j) {
      const double z = double(row[j]) / t;
      if (!std::isfinite(z) || z < cut || ordered_key(float(z)) < cut_key) continue;
      sum += std::exp(z - zmax);
      const double score = z - std::log(-std::log(sample_uniform(key, counter, uint64_t(j))));
      if (chosen < 0 || score > best) best = score, chosen = j;
    }
    if (chosen < 0) {  // no finite logit below the limit: token -1 (the CUDA kernel's answer too)
      token[i] = -1;
      logit[i] = logprob[i] = S(NAN);
      continue;
    }
    token[i] = int32_t(chosen);
    logit[i] = S(row[chosen]);
    logprob[i] = S(double(row[chosen]) / t - zmax - std::log(sum));
  }
}

// penalize_rows (op_table.h): the rows copied in the stats dtype, then each entry's id changed.
template <typename T>
void penalize_rows_kernel(const OpCall& c, ExecContext&) {
  const Tensor& x = c.inputs[0];
  const int64_t v = x.size(1), m = c.inputs[1].size(0), e = c.inputs[3].size(0);
  using S = typename std::conditional<std::is_same_v<T, double>, double, float>::type;
  const int32_t* rows = c.inputs[1].data<int32_t>();
  const S* params = static_cast<const S*>(c.inputs[2].data_ptr());
  const int32_t* entries = c.inputs[3].data<int32_t>();
  S* y = static_cast<S*>(c.outputs[0].data_ptr());
  for (int64_t i = 0; i < m; ++i) {
    LATHE_CHECK(rows[i] >= 0 && rows[i] < x.size(0), "cpu: penalize_rows: draw {} names row {} of {}", i, rows[i],
                x.size(0));
    const T* row = x.data<T>() + int64_t(rows[i]) * v;
    for (int64_t j = 0; j < v; ++j) y[i * v + j] = S(row[j]);
  }
  for (int64_t k = 0; k < e; ++k) {
    const int32_t i = entries[3 * k], j = entries[3 * k + 1], count = entries[3 * k + 2];
    LATHE_CHECK(i >= 0 && i < m && j >= 0 && j < v && count >= -1,
                "cpu: penalize_rows: entry {} is ({}, {}, {}) for {} draws of {} ids", k, i, j, count, m, v);
    S& l = y[int64_t(i) * v + j];
    if (count < 0) {
      l = -std::numeric_limits<S>::infinity();
      continue;
    }
    const S p = params[2 * i], f = params[2 * i + 1];
    l = l > 0 ? l / p : l * p;
    l -= f * S(count);
  }
}

// row_argmax_logsumexp (op_table.h), in double.
template <typename T>
void row_argmax_logsumexp_kernel(const OpCall& c, ExecContext&) {
  const Tensor& x = c.inputs[0];
  const int64_t n = x.size(0), v = x.size(1), limit = c.attr<ArgmaxAttrs>().limit ? c.attr<ArgmaxAttrs>().limit : v;
  const T* px = x.data<T>();
  int32_t* arg = c.outputs[0].data<int32_t>();
  using S = typename std::conditional<std::is_same_v<T, double>, double, float>::type;
  S* best_value = static_cast<S*>(c.outputs[1].data_ptr());
  S* lse = static_cast<S*>(c.outputs[2].data_ptr());
  for (int64_t r = 0; r < n; ++r) {
    const T* row = px + r * v;
    int64_t best = 0;
    for (int64_t j = 1; j < limit; ++j)
      if (row[j] > row[best]) best = j;
    double mx = -INFINITY;
    bool nan = false;
    for (int64_t j = 0; j < v; ++j) {
      nan = nan || std::isnan(double(row[j]));
      mx = std::max(mx, double(row[j]));
    }
    double sum = 0;
    for (int64_t j = 0; j < v && std::isfinite(mx); ++j) sum += std::exp(double(row[j]) - mx);
    arg[r] = int32_t(best);
    best_value[r] = S(row[best]);
    lse[r] = nan ? S(NAN) : std::isfinite(mx) ? S(mx + std::log(sum)) : S(mx);
  }
}

// scatter_rows (op_table.h): dst copied to the output unless it is the output (scatter_rows_into), then the rows.
template <typename T>
void scatter_rows_kernel(const OpCall& c, ExecContext&) {
  const Tensor& src = c.inputs[0];
  const Tensor& dst = c.inputs[2];
  const int64_t t = src.size(0), n = dst.size(0), width = t > 0 ? src.numel() / t : 0;
  const int32_t* index = c.inputs[1].data<int32_t>();
  T* out = c.outputs[0].data<T>();
  if (dst.data_ptr() != c.outputs[0].data_ptr()) std::copy(dst.data<T>(), dst.data<T>() + dst.numel(), out);
  for (int64_t i = 0; i < t; ++i) {
    LATHE_CHECK(index[i] >= 0 && index[i] < n, "scatter_rows: index {} at row {} is outside [0, {})", index[i], i, n);
    std::copy(src.data<T>() + i * width, src.data<T>() + (i + 1) * width, out + int64_t(index[i]) * width);
  }
}

// gather_sum (op_table.h), accumulated in double.
template <typename T>
void gather_sum_kernel(const OpCall& c, ExecContext&) {
  const Tensor& rows = c.inputs[0];
  const int64_t n = rows.size(0), d = rows.size(1), m = c.inputs[1].size(0), s = c.inputs[1].size(1);
  const T* x = rows.data<T>();
  const int32_t* index = c.inputs[1].data<int32_t>();
  const T* w = c.inputs[2].data<T>();
  T* out = c.outputs[0].data<T>();
  for (int64_t i = 0; i < m * s; ++i)
    LATHE_CHECK(index[i] >= -1 && index[i] < n, "gather_sum: index {} at ({}, {}) is outside [-1, {})", index[i],
                i / s, i % s, n);
#pragma omp parallel for if (m * d > 65536)
  for (int64_t i = 0; i < m; ++i)
    for (int64_t col = 0; col < d; ++col) {
      double acc = 0;
      for (int64_t j = 0; j < s; ++j)
        if (index[i * s + j] >= 0) acc += double(w[i * s + j]) * double(x[int64_t(index[i * s + j]) * d + col]);
      out[i * d + col] = T(acc);
    }
}

template <typename T>
void attention_backward_kernel(const OpCall& c, ExecContext&) {
  const Tensor& q = c.inputs[0];
  const int64_t t_len = q.size(0), hq = q.size(1), d = q.size(2), hkv = c.inputs[1].size(1), group = hq / hkv;
  const double scale = c.attr<AttentionAttrs>().scale ? c.attr<AttentionAttrs>().scale : 1.0 / std::sqrt(double(d));
  const std::vector<int64_t> cu = documents(c.inputs[6], t_len);
  const T* pq = q.data<T>();
  const T* pk = c.inputs[1].data<T>();
  const T* pv = c.inputs[2].data<T>();
  const T* po = c.inputs[3].data<T>();
  const auto* plse = static_cast<const typename std::conditional<std::is_same_v<T, double>, double, float>::type*>(c.inputs[4].data_ptr());
  const T* pdo = c.inputs[5].data<T>();
  std::vector<double> dq(size_t(q.numel()), 0.0), dk(size_t(c.inputs[1].numel()), 0.0), dv(dk.size(), 0.0);
  // One kv head per thread: it owns dk/dv of that head and dq of the query heads of its group.
#pragma omp parallel for schedule(dynamic)
  for (int64_t kh = 0; kh < hkv; ++kh) {
    for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
      for (int64_t i = 0; i < t_len; ++i) {
        const int64_t doc_start = *(std::upper_bound(cu.begin(), cu.end(), i) - 1);
        double delta = 0;  // D_i = do_i . o_i
        for (int64_t e = 0; e < d; ++e) delta += double(pdo[(i * hq + h) * d + e]) * double(po[(i * hq + h) * d + e]);
        for (int64_t j = doc_start; j <= i; ++j) {
          double s = 0, dp = 0;
          for (int64_t e = 0; e < d; ++e) {
            s += double(pq[(i * hq + h) * d + e]) * double(pk[(j * hkv + kh) * d + e]);
            dp += double(pdo[(i * hq + h) * d + e]) * double(pv[(j * hkv + kh) * d + e]);
          }
          const double p = std::exp(s * scale - double(plse[i * hq + h]));
          const double ds = p * (dp - delta) * scale;
          for (int64_t e = 0; e < d; ++e) {
            dq[size_t((i * hq + h) * d + e)] += ds * double(pk[(j * hkv + kh) * d + e]);
            dk[size_t((j * hkv + kh) * d + e)] += ds * double(pq[(i * hq + h) * d + e]);
            dv[size_t((j * hkv + kh) * d + e)] += p * double(pdo[(i * hq + h) * d + e]);
          }
        }
      }
    }
  }
  auto write = [](const std::vector<double>& src, const Tensor& dst) {
    T* p = dst.data<T>();
    for (size_t i = 0; i < src.size(); ++i) p[i] = T(src[i]);
  };
  write(dq, c.outputs[0]);
  write(dk, c.outputs[1]);
  write(dv, c.outputs[2]);
}

// cross_entropy, and with kSlice cross_entropy_slice: the row's lse is given (input 2), the label's column is
// label - first, and a label outside the slice's columns contributes neither loss nor one-hot.
template <typename T, bool kSlice = false>
void cross_entropy_kernel(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<CrossEntropyAttrs>();
  const int64_t n = c.inputs[0].size(0), v = c.inputs[0].size(1);
  const int64_t ld = leading_dim(c.inputs[0]), ld_grad = a.with_grad ? leading_dim(c.outputs[1]) : 0;  // rows_layout
  const T* x = c.inputs[0].data<T>();
  const int32_t* labels = c.inputs[1].data<int32_t>();
  using S = typename std::conditional<std::is_same_v<T, double>, double, float>::type;
  S* loss = static_cast<S*>(c.outputs[0].data_ptr());
  T* dx = a.with_grad ? c.outputs[1].data<T>() : nullptr;
  if constexpr (kSlice) {
    const S* given = static_cast<const S*>(c.inputs[2].data_ptr());
#pragma omp parallel for if (n * v > 65536)
    for (int64_t r = 0; r < n; ++r) {
      const T* xr = x + r * ld;
      const bool ignored = labels[r] == a.ignore_index;
      const int64_t col = int64_t(labels[r]) - a.first;
      const bool held = !ignored && col >= 0 && col < v;
      const double lse = double(given[r]);
      loss[r] = held ? S(lse - double(xr[col])) : S(0);
      if (!dx) continue;
      T* dr = dx + r * ld_grad;
      for (int64_t j = 0; j < v; ++j) dr[j] = ignored ? T(0) : T(a.grad_scale * std::exp(double(xr[j]) - lse));
      if (held) dr[col] -= T(a.grad_scale);
    }
    return;
  }
  for (int64_t r = 0; r < n; ++r)
    LATHE_CHECK(labels[r] == a.ignore_index || (labels[r] >= 0 && labels[r] < v),
                "cross_entropy: label {} at position {} is outside the vocabulary (size {})", labels[r], r, v);
#pragma omp parallel for if (n * v > 65536)
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * ld;
    const bool ignored = labels[r] == a.ignore_index;
    T mx = xr[0];
    for (int64_t j = 1; j < v; ++j) mx = std::max(mx, xr[j]);
    // exp(x - max) in the input's precision (one exp per element, kept in dlogits when it is wanted),
    // summed in double.
    T* dr = dx ? dx + r * ld_grad : nullptr;
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) {
      const T e = std::exp(xr[j] - mx);
      sum += double(e);
      if (dr) dr[j] = e;
    }
    const double lse = double(mx) + std::log(sum);
    loss[r] = ignored ? S(0) : S(lse - double(xr[labels[r]]));
    if (dr) {
      const T scale = ignored ? T(0) : T(a.grad_scale / sum);
      for (int64_t j = 0; j < v; ++j) dr[j] *= scale;
      if (!ignored) dr[labels[r]] -= T(a.grad_scale);
    }
  }
}

template <typename T>
void register_for(KernelRegistry& r) {
  const DType dt = DTypeOf<T>::value;
  const auto add = [&](OpId op, const char* name, RunFn run) { r.add(KernelDef{op, DeviceType::CPU, dt, name, all_contiguous, run}); };
  add(OpId::embedding, "cpu/embedding_gather", embedding_kernel<T>);
  add(OpId::embedding_backward, "cpu/embedding_scatter_add", embedding_backward_kernel<T>);
  add(OpId::rmsnorm, "cpu/rmsnorm_rows", rmsnorm_kernel<T, false>);
  add(OpId::rmsnorm_backward, "cpu/rmsnorm_backward_rows", rmsnorm_backward_kernel<T, false>);
  add(OpId::residual_rmsnorm, "cpu/residual_rmsnorm_rows", rmsnorm_kernel<T, false, true>);
  add(OpId::residual_rmsnorm_backward, "cpu/residual_rmsnorm_backward_rows", rmsnorm_backward_kernel<T, false, true>);
  add(OpId::gated_rmsnorm, "cpu/gated_rmsnorm_rows", rmsnorm_kernel<T, true>);
  add(OpId::gated_rmsnorm_backward, "cpu/gated_rmsnorm_backward_rows", rmsnorm_backward_kernel<T, true>);
  add(OpId::rope, "cpu/rope_rotate_half", rope_kernel<T>);
  add(OpId::swiglu, "cpu/swiglu", swiglu_kernel<T>);
  add(OpId::swiglu_backward, "cpu/swiglu_backward", swiglu_backward_kernel<T>);
  add(OpId::attention, "cpu/causal_varlen_attention", attention_kernel<T>);
  add(OpId::attention_backward, "cpu/causal_varlen_attention_backward", attention_backward_kernel<T>);
  add(OpId::paged_attention, "cpu/paged_attention", paged_attention_kernel<T>);
  add(OpId::scatter_rows, "cpu/scatter_rows", scatter_rows_kernel<T>);
  add(OpId::gather_sum, "cpu/gather_sum_rows", gather_sum_kernel<T>);
  add(OpId::row_argmax_logsumexp, "cpu/row_argmax_logsumexp", row_argmax_logsumexp_kernel<T>);
  add(OpId::sample_rows, "cpu/sample_rows", sample_rows_kernel<T>);
  add(OpId::penalize_rows, "cpu/penalize_rows", penalize_rows_kernel<T>);
  r.add(KernelDef{OpId::cross_entropy, DeviceType::CPU, dt, "cpu/cross_entropy_rows", rows_layout,
                  cross_entropy_kernel<T>});
  r.add(KernelDef{OpId::cross_entropy_slice, DeviceType::CPU, dt, "cpu/cross_entropy_slice_rows", rows_layout,
                  cross_entropy_kernel<T, true>});
}

}  // namespace

void register_cpu_model_kernels(KernelRegistry& r) {
  register_for<float>(r);
  register_for<double>(r);
}

}  // namespace lathe
