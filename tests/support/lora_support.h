// Helpers shared by the LoRA tests of both families (tests/models/test_lora.cpp, test_lora_qwen3_5.cpp): a LoRA
// config in one line, random adapter values, and the objective a backward pass with segments differentiates.
#pragma once

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "model/lora.h"
#include "support/model_support.h"

namespace lathe::test_support {

inline LoraConfig lora(int64_t rank, double alpha, std::vector<std::string> targets, bool rslora = false) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = alpha;
  c.targets = std::move(targets);
  c.rslora = rslora;
  return c;
}

// Overwrites every value of an f64 adapter with N(0, std^2) (so B is not zero and every gradient is non-trivial).
inline void randomise(LoraBank& bank, int adapter, uint64_t seed, double std) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, std);
  for (Parameter& p : bank.parameters(adapter)) {
    ASSERT_EQ(p.value.dtype(), DType::F64);
    double* d = p.value.data<double>();
    for (int64_t i = 0; i < p.value.numel(); ++i) d[i] = n(rng);
  }
}

// sum over segments of loss_scale x mean segment loss: what loss(backward) differentiates.
inline double objective(CausalLm& m, const PackedBatch& b) {
  const LossResult r = m.loss(b, false);
  double f = 0;
  for (size_t s = 0; s < r.segments.size(); ++s)
    if (r.segments[s].labelled) f += b.segments[s].loss_scale * r.segments[s].loss_sum / double(r.segments[s].labelled);
  return f;
}

}  // namespace lathe::test_support
