// Helpers shared by the model tests (tests/models): one Runtime per test binary, a tensor as host f64 values, the
// relative L2 error every parity check reports, a row-major transpose (PEFT's lora_B layout), i32 tensors of a
// fixture file, a random packed batch, the gradient errors against a fixture, a config-refusal check, and the
// finite-difference check of a model's gradients, one greedy request through the rollout engine and a row's
// log-softmax at an id. Header-only; the tests say `using namespace lathe::test_support;`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <random>

#include "backend/runtime.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "model/rollout_engine.h"
#include "ops/ops.h"

namespace lathe::test_support {

inline Runtime& runtime() {
  static Runtime rt;
  return rt;
}

// One greedy request of `new_tokens` tokens after `prompt` through the rollout engine with options `eo`.
inline RolloutResult engine_greedy(CausalLm& m, const std::vector<int32_t>& prompt, int64_t new_tokens,
                                   EngineOptions eo = {}) {
  RolloutEngine engine(runtime(), m, eo);
  RolloutRequest r;
  r.prompt = prompt;
  r.max_new_tokens = new_tokens;
  engine.submit(r);
  std::vector<RolloutResult> out = engine.run();
  EXPECT_EQ(out.size(), 1u);
  return out.empty() ? RolloutResult{} : std::move(out[0]);
}

// log softmax(row)[id] in double.
template <typename V>
double log_softmax_at(const V& row, int32_t id) {
  double mx = -INFINITY, sum = 0;
  for (const auto x : row) mx = std::max(mx, double(x));
  for (const auto x : row) sum += std::exp(double(x) - mx);
  return double(row[size_t(id)]) - mx - std::log(sum);
}

// The values of `t` (any device, any floating dtype) as host doubles.
inline std::vector<double> to_f64(const Tensor& t) {
  ExecContext ctx = runtime().context(t.device());
  const Tensor h = runtime().copy_to(cast(ctx, t, DType::F64), Device::cpu());
  return std::vector<double>(h.data<double>(), h.data<double>() + h.numel());
}

// ||got - want|| / ||want|| over want.size() elements (float or double vectors, computed in double).
template <typename A, typename B>
double rel_l2(const A& got, const B& want) {
  double e = 0, n = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double(got[i]) - double(want[i]);
    e += d * d;
    n += double(want[i]) * double(want[i]);
  }
  return std::sqrt(e / std::max(n, 1e-300));
}

// The (cols, rows) row-major transpose of a (rows, cols) row-major matrix.
inline std::vector<double> transpose(const std::vector<double>& x, int64_t rows, int64_t cols) {
  std::vector<double> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = x[size_t(r * cols + c)];
  return t;
}

inline std::vector<int32_t> read_i32(const io::SafetensorsFile& f, const char* name) {
  const io::SafetensorsTensor& t = f.get(name);
  std::vector<int32_t> v(size_t(t.numel));
  f.read_into(name, DType::I32, v.data(), v.size() * 4);
  return v;
}

// A batch of documents cu = [0, l1, l1 + l2, ...] of seeded random ids below `vocab`, next-token labels.
inline PackedBatch random_batch(int64_t vocab, const std::vector<int32_t>& cu, uint64_t seed,
                                Device device = Device::cpu()) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<int32_t> ids(size_t(cu.back()));
  for (int32_t& x : ids) x = int32_t(rng() % uint32_t(vocab));
  return make_packed_batch(runtime(), device, ids, cu, next_token_labels(ids, cu), vocab);
}

// Batches joined into one CPU batch, in order (each document keeps its rows; next-token labels), of a `vocab`-word
// model: what several ranks' batches are to one process.
inline PackedBatch joined_batch(const std::vector<PackedBatch>& parts, int64_t vocab) {
  std::vector<int32_t> ids, cu = {0};
  for (const PackedBatch& b : parts) {
    for (size_t d = 1; d < b.host_cu.size(); ++d) cu.push_back(int32_t(ids.size()) + b.host_cu[d]);
    ids.insert(ids.end(), b.host_ids.begin(), b.host_ids.end());
  }
  return make_packed_batch(runtime(), Device::cpu(), ids, cu, next_token_labels(ids, cu), vocab);
}

// The relative L2 error of every parameter's gradient against the fixture tensor `prefix` + its name: the mean over
// the parameters and the worst, with its name. A parameter without a gradient is a failure (and is skipped).
struct GradErrors {
  double mean = 0, worst = 0;
  std::string worst_name;
};
inline GradErrors grad_errors(const CausalLm& m, const io::SafetensorsFile& ref, const std::string& prefix) {
  GradErrors g;
  double sum = 0;
  int count = 0;
  for (const Parameter& p : m.parameters()) {
    if (!p.grad.defined()) {
      ADD_FAILURE() << "no gradient for " << p.name;
      continue;
    }
    const double e = rel_l2(to_f64(p.grad), ref.read_as_f32(prefix + p.name));
    if (e > g.worst) g.worst = e, g.worst_name = p.name;
    sum += e;
    ++count;
  }
  g.mean = sum / std::max(count, 1);
  return g;
}

// parse_model_config refuses config `j` with an error containing `needle`.
inline void expect_refused(const nlohmann::json& j, const std::string& needle) {
  try {
    parse_model_config(j, "cfg.json");
    ADD_FAILURE() << "accepted: " << j.dump();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// The gradients a backward pass of m.loss(b) left in Parameter::grad (an f64 model) against central finite
// differences (h = 1e-5) of the loss at `trials` random entries of every parameter. Returns the entries checked.
// `aux_coef`: the trained objective is loss + aux_coef x aux_loss (an MoE model with its aux loss on).
inline int expect_gradients_match_finite_differences(CausalLm& m, const PackedBatch& b, int trials,
                                                     double aux_coef = 0.0) {
  auto objective = [&] {
    const LossResult r = m.loss(b, false);
    return r.loss + aux_coef * r.aux_loss;
  };
  std::mt19937 rng(11);
  int checked = 0;
  for (Parameter& p : m.parameters()) {
    double* w = p.value.data<double>();
    const double* g = p.grad.data<double>();
    for (int trial = 0; trial < trials; ++trial) {
      const int64_t i = int64_t(rng() % uint32_t(p.value.numel()));
      const double h = 1e-5, saved = w[i];
      w[i] = saved + h;
      const double lp = objective();
      w[i] = saved - h;
      const double lm = objective();
      w[i] = saved;
      const double numeric = (lp - lm) / (2 * h);
      EXPECT_NEAR(g[i], numeric, 1e-7 + 1e-5 * std::abs(numeric)) << p.name << "[" << i << "]";
      ++checked;
    }
  }
  return checked;
}

// CausalLm::grads_complete_after against the backward itself: at each BackwardHooks::grads_done report, every
// parameter said to be complete by then holds (bitwise) the gradient it ends the backward with, and the reports come
// as documented (the layer count, each layer down to 0, then -1). A data-parallel bucket reduced at that report would
// otherwise miss what the backward adds later.
inline void expect_grads_complete_when_reported(CausalLm& m, const PackedBatch& b) {
  const std::vector<int64_t> after = m.grads_complete_after();
  ASSERT_EQ(after.size(), m.parameters().size());
  const int64_t layers = m.config().num_layers;
  std::vector<std::vector<double>> at_report(after.size());
  std::vector<int64_t> reports;
  BackwardHooks hooks;
  hooks.grads_done = [&](int64_t left) {
    reports.push_back(left);
    for (size_t i = 0; i < after.size(); ++i) {
      const Parameter& p = m.parameters()[i];
      if (after[i] == left) at_report[i] = p.grad.defined() ? to_f64(p.grad) : std::vector<double>{};
    }
  };
  m.zero_grads();
  m.loss(b, true, 1.0, hooks);
  std::vector<int64_t> want = {layers};
  for (int64_t i = layers - 1; i >= -1; --i) want.push_back(i);
  EXPECT_EQ(reports, want);
  size_t before_end = 0;
  for (size_t i = 0; i < after.size(); ++i) {
    const Parameter& p = m.parameters()[i];
    const std::vector<double> final_grad = p.grad.defined() ? to_f64(p.grad) : std::vector<double>{};
    EXPECT_EQ(at_report[i], final_grad) << p.name << " (complete after " << after[i] << ")";
    before_end += after[i] >= 0;
  }
  EXPECT_GT(before_end, after.size() / 2) << "most parameters are complete before the end of the backward";
  m.zero_grads();
}

}  // namespace lathe::test_support
