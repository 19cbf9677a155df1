// CPU moe_ep_messages, moe_ep_slots, moe_ep_regroup and moe_ep_sources: expert parallelism's exchange plan
// (formulas and layouts at MoeExchangeAttrs in ops/op_table.h). Plain loops in the order the formulas read; the CUDA
// kernels (backend/cuda/moe_exchange.cu) are checked against these by tests/ops (testing/op_cases_moe.cpp), all of them
// on a hand-worked routing by tests/ops/test_moe_route.cpp, and the plan they make end to end by the expert-parallel
// runs equal to the whole model (tests/parallel).
#include <algorithm>
#include <utility>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/registry.h"
#include "ops/ops.h"

namespace lathe {

namespace {

void moe_ep_messages_cpu(const OpCall& c, ExecContext&) {
  const int64_t t = c.inputs[0].size(0), k = c.inputs[0].size(1), e = c.inputs[1].size(0) - 2;
  const int64_t n = c.attr<MoeExchangeAttrs>().ranks, mine = e / n;
  const int32_t* picked = c.inputs[0].data<int32_t>();
  const int32_t* offsets = c.inputs[1].data<int32_t>();
  int32_t* back = c.outputs[0].data<int32_t>();
  int32_t* tokens = c.outputs[1].data<int32_t>();
  int32_t* summary = c.outputs[2].data<int32_t>();
  std::fill(back, back + t * n, -1);
  std::fill(tokens, tokens + t * n, -1);
  std::copy(offsets, offsets + e + 2, summary);
  int64_t u = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t first = u;
    for (int64_t i = 0; i < t; ++i) {
      bool sent = false;
      for (int64_t j = 0; j < k; ++j) sent = sent || (picked[i * k + j] - i * e) / mine == r;
      if (!sent) continue;
      back[i * n + r] = int32_t(u);
      tokens[u++] = int32_t(i);
    }
    summary[e + 2 + r] = int32_t(u - first);
  }
}

void moe_ep_slots_cpu(const OpCall& c, ExecContext&) {
  const int64_t t = c.inputs[0].size(0), k = c.inputs[0].size(1), n = c.attr<MoeExchangeAttrs>().ranks;
  const int64_t e = c.inputs[3].size(0), mine = e / n, s = c.outputs[0].size(1);
  const int32_t* picked = c.inputs[0].data<int32_t>();
  const int32_t* position = c.inputs[1].data<int32_t>();
  const int32_t* back = c.inputs[2].data<int32_t>();
  const int32_t* bases = c.inputs[3].data<int32_t>();
  int32_t* slot_row = c.outputs[0].data<int32_t>();
  int32_t* slot_pair = c.outputs[1].data<int32_t>();
  std::fill(slot_row, slot_row + t * n * s, -1);
  std::fill(slot_pair, slot_pair + t * n * s, 0);
  std::vector<std::pair<int64_t, int64_t>> order(static_cast<size_t>(k));  // (expert, slot j) of each pair
  for (int64_t i = 0; i < t; ++i) {
    // The token's pairs by ascending expert: the slots of each rank fill in that order.
    for (int64_t j = 0; j < k; ++j) order[size_t(j)] = {picked[i * k + j] - i * e, j};
    std::sort(order.begin(), order.end());
    int64_t rank = -1, f = 0;
    for (const auto& [ex, j] : order) {
      const int64_t r = ex / mine, p = position[i * k + j], u = back[i * n + r];
      f = r == rank ? f + 1 : 0;
      rank = r;
      slot_row[u * s + f] = bases[ex] + int32_t(p);
      slot_pair[u * s + f] = int32_t(p);
    }
  }
}

void moe_ep_regroup_cpu(const OpCall& c, ExecContext&) {
  const int64_t b = (c.inputs[0].size(0) - 1) / 2, rows = c.attr<MoeExchangeAttrs>().rows;
  const int32_t* starts = c.inputs[0].data<int32_t>();
  const int32_t* other = starts + b + 1;
  LATHE_CHECK(starts[b] == rows, "moe_ep_regroup: the blocks end at row {}, not at the {} rows", starts[b], rows);
  int32_t* grouped = c.outputs[0].data<int32_t>();
  int32_t* received = c.outputs[1].data<int32_t>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t q = starts[i]; q < starts[i + 1]; ++q) {
      const int64_t g = other[i] + q - starts[i];
      LATHE_CHECK(g >= 0 && g < rows, "moe_ep_regroup: block {} maps row {} to {}, outside {} rows", i, q, g, rows);
      received[q] = int32_t(g);
      grouped[g] = int32_t(q);
    }
}

void moe_ep_sources_cpu(const OpCall& c, ExecContext&) {
  const int64_t u = c.inputs[0].size(0), s = c.inputs[0].size(1), rows = c.attr<MoeExchangeAttrs>().rows;
  const int32_t* pairs = c.inputs[0].data<int32_t>();
  int32_t* token = c.outputs[0].data<int32_t>();
  int32_t* slot = c.outputs[1].data<int32_t>();
  std::fill(slot, slot + rows, -1);
  for (int64_t i = 0; i < u * s; ++i) {
    const int64_t g = pairs[i];
    if (g < 0) continue;
    LATHE_CHECK(g < rows && slot[g] < 0, "moe_ep_sources: slot {} names row {}: outside the {} rows or named twice", i,
                g, rows);
    token[g] = int32_t(i / s);
    slot[g] = int32_t(i);
  }
  for (int64_t g = 0; g < rows; ++g)
    LATHE_CHECK(slot[g] >= 0, "moe_ep_sources: no slot names row {} of {}", g, rows);
}

}  // namespace

void register_cpu_moe_exchange_kernels(KernelRegistry& r) {
  const auto any = [](const OpCall&) { return Support::yes(); };
  r.add(KernelDef{OpId::moe_ep_messages, DeviceType::CPU, DType::I32, "cpu/ep_messages", any, moe_ep_messages_cpu});
  r.add(KernelDef{OpId::moe_ep_slots, DeviceType::CPU, DType::I32, "cpu/ep_slots", any, moe_ep_slots_cpu});
  r.add(KernelDef{OpId::moe_ep_regroup, DeviceType::CPU, DType::I32, "cpu/ep_regroup", any, moe_ep_regroup_cpu});
  r.add(KernelDef{OpId::moe_ep_sources, DeviceType::CPU, DType::I32, "cpu/ep_sources", any, moe_ep_sources_cpu});
}

}  // namespace lathe
