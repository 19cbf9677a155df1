// CPU reference kernels of the Gated DeltaNet ops: depthwise causal conv1d over packed documents (+ backward), the
// log-decay g = -exp(A_log) softplus(a + dt_bias) (+ backward), and the gated delta rule (+ backward, + the form
// with initial/final states of decoding), through the chunked WY reference of backend/cpu/gdn_reference (which checks its
// own inputs: g <= 0, boundaries).
// Convention: cu_seqlens is validated here (0 = cu[0] <= ... <= cu[N] = T); a conv tap whose source lies before
// its document's first token reads zero, in both passes. Plain loops, double accumulation, float and double.
// Covered by tests/ops (cases in testing/op_cases_gated_delta.cpp) and tests/models/test_qwen3_5.cpp.
#include <cmath>
#include <span>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/registry.h"
#include "backend/cpu/gdn_reference.h"

namespace lathe {

namespace {

std::vector<int32_t> documents(const char* who, const Tensor& cu, int64_t total) {
  const int32_t* p = cu.data<int32_t>();
  std::vector<int32_t> out(p, p + cu.numel());
  for (size_t i = 0; i < out.size(); ++i)
    LATHE_CHECK(i == 0 ? out[i] == 0 : out[i] >= out[i - 1],
                "{}: cu_seqlens must start at 0 and not decrease (entry {} is {})", who, i, out[i]);
  LATHE_CHECK(out.back() == total, "{}: cu_seqlens ends at {} but there are {} tokens", who, out.back(), total);
  return out;
}

// For each token, the first token of its document.
std::vector<int64_t> doc_starts(const std::vector<int32_t>& cu, int64_t total) {
  std::vector<int64_t> s(static_cast<size_t>(total), 0);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t t = cu[d]; t < cu[d + 1]; ++t) s[size_t(t)] = cu[d];
  return s;
}

template <typename T>
void conv_kernel(const OpCall& c, ExecContext&) {
  const Tensor& x = c.inputs[0];
  const int64_t t_len = x.size(0), ch = x.size(1), width = c.inputs[1].size(1);
  const std::vector<int64_t> start = doc_starts(documents("causal_conv1d", c.inputs[2], t_len), t_len);
  const T* px = x.data<T>();
  const T* pw = c.inputs[1].data<T>();
  T* py = c.outputs[0].data<T>();
#pragma omp parallel for if (t_len * ch * width > 65536)
  for (int64_t t = 0; t < t_len; ++t)
    for (int64_t cc = 0; cc < ch; ++cc) {
      double acc = 0;
      for (int64_t j = 0; j < width; ++j) {
        const int64_t s = t - (width - 1) + j;
        if (s >= start[size_t(t)]) acc += double(pw[cc * width + j]) * double(px[s * ch + cc]);
      }
      py[t * ch + cc] = T(acc);
    }
}

// dx[s, c] = sum_j w[c, j] dy[s + W - 1 - j, c] over targets in s's document; dw[c, j] = sum_t dy[t, c] x[t - W + 1 + j, c].
template <typename T>
void conv_backward_kernel(const OpCall& c, ExecContext&) {
  const Tensor& x = c.inputs[0];
  const int64_t t_len = x.size(0), ch = x.size(1), width = c.inputs[1].size(1);
  const std::vector<int64_t> start = doc_starts(documents("causal_conv1d", c.inputs[3], t_len), t_len);
  const T* px = x.data<T>();
  const T* pw = c.inputs[1].data<T>();
  const T* pdy = c.inputs[2].data<T>();
  T* pdx = c.outputs[0].data<T>();
  T* pdw = c.outputs[1].data<T>();
#pragma omp parallel for if (t_len * ch * width > 65536)
  for (int64_t cc = 0; cc < ch; ++cc) {
    for (int64_t s = 0; s < t_len; ++s) {
      double acc = 0;
      for (int64_t j = 0; j < width; ++j) {
        const int64_t t = s + (width - 1) - j;
        if (t < t_len && start[size_t(t)] <= s) acc += double(pw[cc * width + j]) * double(pdy[t * ch + cc]);
      }
      pdx[s * ch + cc] = T(acc);
    }
    for (int64_t j = 0; j < width; ++j) {
      double acc = 0;
      for (int64_t t = 0; t < t_len; ++t) {
        const int64_t s = t - (width - 1) + j;
        if (s >= start[size_t(t)]) acc += double(pdy[t * ch + cc]) * double(px[s * ch + cc]);
      }
      pdw[cc * width + j] = T(acc);
    }
  }
}

double softplus(double x) { return std::max(x, 0.0) + std::log1p(std::exp(-std::abs(x))); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

template <typename T>
void decay_kernel(const OpCall& c, ExecContext&) {
  const int64_t t_len = c.inputs[0].size(0), h = c.inputs[0].size(1);
  const T* a = c.inputs[0].data<T>();
  const T* a_log = c.inputs[1].data<T>();
  const T* dt = c.inputs[2].data<T>();
  T* g = c.outputs[0].data<T>();
  for (int64_t t = 0; t < t_len; ++t)
    for (int64_t j = 0; j < h; ++j)
      g[t * h + j] = T(-std::exp(double(a_log[j])) * softplus(double(a[t * h + j]) + double(dt[j])));
}

// da = dg (-exp(A_log)) sigmoid(a + dt_bias); ddt_bias = sum_t da; dA_log = sum_t dg g.
template <typename T>
void decay_backward_kernel(const OpCall& c, ExecContext&) {
  const int64_t t_len = c.inputs[0].size(0), h = c.inputs[0].size(1);
  const T* a = c.inputs[0].data<T>();
  const T* a_log = c.inputs[1].data<T>();
  const T* dt = c.inputs[2].data<T>();
  const T* dg = c.inputs[3].data<T>();
  T* da = c.outputs[0].data<T>();
  std::vector<double> d_alog(size_t(h), 0.0), d_dt(size_t(h), 0.0);
  for (int64_t t = 0; t < t_len; ++t)
    for (int64_t j = 0; j < h; ++j) {
      const double x = double(a[t * h + j]) + double(dt[j]), e = std::exp(double(a_log[j]));
      const double dgv = double(dg[t * h + j]);
      const double dav = -dgv * e * sigmoid(x);
      da[t * h + j] = T(dav);
      d_dt[size_t(j)] += dav;
      d_alog[size_t(j)] += dgv * (-e * softplus(x));
    }
  for (int64_t j = 0; j < h; ++j) {
    c.outputs[1].data<T>()[j] = T(d_alog[size_t(j)]);
    c.outputs[2].data<T>()[j] = T(d_dt[size_t(j)]);
  }
}

template <typename T>
std::span<const T> span_of(const Tensor& t) {
  return {t.data<T>(), size_t(t.numel())};
}

template <typename T>
GdnDims dims_of(const OpCall& c) {
  const Tensor& q = c.inputs[0];
  const Tensor& v = c.inputs[2];
  return {q.size(1), v.size(1), q.size(2), v.size(2), c.attr<GatedDeltaAttrs>().scale};
}

template <typename T>
void copy_out(const std::vector<T>& src, const Tensor& dst) {
  LATHE_ASSERT(int64_t(src.size()) == dst.numel());
  std::copy(src.begin(), src.end(), dst.data<T>());
}

template <typename T>
void gdr_kernel(const OpCall& c, ExecContext&) {
  const std::vector<int32_t> cu = documents("gated_delta_rule", c.inputs[5], c.inputs[0].size(0));
  GdnInputs<T> in{span_of<T>(c.inputs[0]), span_of<T>(c.inputs[1]), span_of<T>(c.inputs[2]),
                  span_of<T>(c.inputs[3]), span_of<T>(c.inputs[4]), std::span<const int32_t>(cu), {}};
  copy_out(gdn_chunked_forward<T>(dims_of<T>(c), in, c.attr<GatedDeltaAttrs>().chunk).o, c.outputs[0]);
  // The saved chunk-start states, from the plain recurrence (independent of the chunked form above).
  if (c.outputs[1].numel() > 0) copy_out(gdn_recurrent_forward<T>(dims_of<T>(c), in).chunk_states, c.outputs[1]);
}

// The rule from given states (the state has the key dtype here: f32 or f64, the accumulation dtype of each).
template <typename T>
void gdr_state_kernel(const OpCall& c, ExecContext&) {
  const std::vector<int32_t> cu = documents("gated_delta_rule_state", c.inputs[5], c.inputs[0].size(0));
  GdnInputs<T> in{span_of<T>(c.inputs[0]), span_of<T>(c.inputs[1]), span_of<T>(c.inputs[2]),
                  span_of<T>(c.inputs[3]), span_of<T>(c.inputs[4]), std::span<const int32_t>(cu),
                  span_of<T>(c.inputs[6])};
  const GdnOutputs<T> out = gdn_chunked_forward<T>(dims_of<T>(c), in, c.attr<GatedDeltaAttrs>().chunk);
  copy_out(out.o, c.outputs[0]);
  copy_out(out.final_state, c.outputs[1]);
}

// The forward's saved states (input 7) are not read: this specification recomputes everything from the inputs.
template <typename T>
void gdr_backward_kernel(const OpCall& c, ExecContext&) {
  const std::vector<int32_t> cu = documents("gated_delta_rule", c.inputs[6], c.inputs[0].size(0));
  GdnInputs<T> in{span_of<T>(c.inputs[0]), span_of<T>(c.inputs[1]), span_of<T>(c.inputs[2]),
                  span_of<T>(c.inputs[3]), span_of<T>(c.inputs[4]), std::span<const int32_t>(cu), {}};
  const GdnGrads<T> g =
      gdn_chunked_backward<T>(dims_of<T>(c), in, span_of<T>(c.inputs[5]), {}, c.attr<GatedDeltaAttrs>().chunk);
  copy_out(g.dq, c.outputs[0]);
  copy_out(g.dk, c.outputs[1]);
  copy_out(g.dv, c.outputs[2]);
  copy_out(g.dg, c.outputs[3]);
  copy_out(g.dbeta, c.outputs[4]);
}

template <typename T>
void register_for(KernelRegistry& r) {
  const DType dt = DTypeOf<T>::value;
  const auto add = [&](OpId op, const char* name, RunFn run) {
    r.add(KernelDef{op, DeviceType::CPU, dt, name, all_contiguous, run});
  };
  add(OpId::causal_conv1d, "cpu/causal_conv1d_varlen", conv_kernel<T>);
  add(OpId::causal_conv1d_backward, "cpu/causal_conv1d_varlen_backward", conv_backward_kernel<T>);
  add(OpId::gdn_decay, "cpu/gdn_decay", decay_kernel<T>);
  add(OpId::gdn_decay_backward, "cpu/gdn_decay_backward", decay_backward_kernel<T>);
  add(OpId::gated_delta_rule, "cpu/gated_delta_rule_chunked", gdr_kernel<T>);
  add(OpId::gated_delta_rule_backward, "cpu/gated_delta_rule_chunked_backward", gdr_backward_kernel<T>);
  add(OpId::gated_delta_rule_state, "cpu/gated_delta_rule_chunked_state", gdr_state_kernel<T>);
}

}  // namespace

void register_cpu_gated_delta_kernels(KernelRegistry& r) {
  register_for<float>(r);
  register_for<double>(r);
}

}  // namespace lathe
