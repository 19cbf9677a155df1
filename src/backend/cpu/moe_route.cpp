// CPU moe_route (formulas and layouts at MoeRouteAttrs in ops/op_table.h): each token's softmax, top-k and
// renormalisation in the logits' type (float for f32 logits, as transformers' fp32 router; double for f64), then the
// plan by a stable counting sort of the pairs by expert. Also moe_pad_plan (MoePadAttrs): that plan at a fixed number
// of rows per expert. A token with a non-finite logit is reported through
// offsets[E + 1] and routed to experts 0 .. k-1 with weight 0 and probabilities 0, so every output stays a valid plan.
// The host reference it must equal is model/moe_routing.cpp (tests/models/test_moe_routing.cpp); the CUDA kernel is
// checked against this one by tests/ops (testing/op_cases_moe.cpp).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/cpu_backend.h"
#include "backend/registry.h"
#include "ops/ops.h"

namespace lathe {

namespace {

template <typename T>
void moe_route_cpu(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<MoeRouteAttrs>();
  const Tensor& logits = c.inputs[0];
  const int64_t tokens = logits.size(0), experts = logits.size(1), k = a.top_k, pairs = tokens * k;
  const T* x = logits.data<T>();
  T* probs = c.outputs[0].data<T>();
  T* weights = c.outputs[1].data<T>();
  int32_t* picked = c.outputs[2].data<int32_t>();
  T* inv_sum = c.outputs[3].data<T>();
  int32_t* offsets = c.outputs[4].data<int32_t>();
  int64_t bad = -1;
#pragma omp parallel
  {
    std::vector<int32_t> order(static_cast<size_t>(experts));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* row = x + t * experts;
      T* p = probs + t * experts;
      if (!std::all_of(row, row + experts, [](T v) { return std::isfinite(v); })) {
#pragma omp critical
        bad = bad < 0 ? t : std::min(bad, t);
        std::fill(p, p + experts, T(0));
        for (int64_t j = 0; j < k; ++j) {
          picked[t * k + j] = int32_t(t * experts + j);
          weights[t * k + j] = T(0);
        }
        inv_sum[t] = T(1);
        continue;
      }
      const T mx = *std::max_element(row, row + experts);
      T sum = 0;
      for (int64_t e = 0; e < experts; ++e) sum += (p[e] = std::exp(row[e] - mx));
      for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
      // Larger first, ties to the lower index: a strict total order, so the first k are unique.
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int32_t i, int32_t j) { return p[i] > p[j] || (p[i] == p[j] && i < j); });
      T s = 0;
      for (int64_t j = 0; j < k; ++j) s += p[order[size_t(j)]];
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = order[size_t(j)];
        picked[t * k + j] = int32_t(t * experts) + e;
        weights[t * k + j] = a.norm_topk_prob ? p[e] / s : p[e];
      }
      inv_sum[t] = a.norm_topk_prob ? T(1) / s : T(1);
    }
  }
  // The plan: counts, offsets, then each pair in (token, slot) order to the next free row of its expert.
  std::vector<int64_t> next(static_cast<size_t>(experts + 1), 0);
  for (int64_t i = 0; i < pairs; ++i) ++next[size_t(picked[i] % experts + 1)];
  for (int64_t e = 0; e < experts; ++e) next[size_t(e + 1)] += next[size_t(e)];
  for (int64_t e = 0; e <= experts; ++e) offsets[e] = int32_t(next[size_t(e)]);
  offsets[experts + 1] = int32_t(bad);
  int32_t* token = c.outputs[5].data<int32_t>();
  int32_t* pair = c.outputs[6].data<int32_t>();
  int32_t* position = c.outputs[7].data<int32_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t row = next[size_t(picked[i] % experts)]++;
    token[row] = int32_t(i / k);
    pair[row] = int32_t(i);
    position[i] = int32_t(row);
  }
}

void moe_pad_plan_cpu(const OpCall& c, ExecContext&) {
  const auto& a = c.attr<MoePadAttrs>();
  const int32_t* offsets = c.inputs[0].data<int32_t>();
  const int32_t* pair = c.inputs[1].data<int32_t>();
  const int64_t experts = c.inputs[0].size(0) - 2, m = a.rows_per_expert, pairs = c.inputs[1].size(0);
  int32_t* pad_token = c.outputs[0].data<int32_t>();
  int32_t* pad_pair = c.outputs[1].data<int32_t>();
  int32_t* pad_position = c.outputs[2].data<int32_t>();
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = offsets[e + 1] - offsets[e];
    LATHE_CHECK(count <= m, "moe_pad_plan: expert {} has {} rows, more than the {} rows per expert", e, count, m);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t q = e * m + r;
      if (r < count) {
        const int32_t pr = pair[offsets[e] + r];
        pad_token[q] = int32_t(pr / a.top_k);
        pad_pair[q] = pr;
        pad_position[pr] = int32_t(q);
      } else {
        pad_token[q] = 0;
        pad_pair[q] = int32_t(pairs);
      }
    }
  }
}

}  // namespace

void register_cpu_moe_route_kernels(KernelRegistry& r) {
  r.add(KernelDef{OpId::moe_pad_plan, DeviceType::CPU, DType::I32, "cpu/pad_rows",
                  [](const OpCall&) { return Support::yes(); }, moe_pad_plan_cpu});
  const auto any = [](const OpCall&) { return Support::yes(); };
  r.add(KernelDef{OpId::moe_route, DeviceType::CPU, DType::F32, "cpu/route_rows", any, moe_route_cpu<float>});
  r.add(KernelDef{OpId::moe_route, DeviceType::CPU, DType::F64, "cpu/route_rows", any, moe_route_cpu<double>});
}

}  // namespace lathe
