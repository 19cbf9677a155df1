// Helpers shared by the LoRA tests (tests/models/test_lora.cpp, test_lora_qwen3_5.cpp, test_lora_moe.cpp): a LoRA
// config in one line, random adapter values, the objective a backward pass with segments differentiates, the parity
// check against a transformers + peft fixture and the finite-difference check of a fixture with imprecise goldens.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "io/safetensors.h"
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

// One transformers + peft fixture (dev/ref/lora_*fixtures.py: DIR/adapter and DIR/reference.safetensors) on the
// base model at `model_dir` in opt's dtype and device: logits and loss within `tol` (relative), every LoRA gradient
// within `grad_tol` (rel-L2), the frozen base without gradients, and as many gradients as the fixture holds.
inline void check_lora_parity(const std::filesystem::path& entry, const std::string& model_dir, ModelOptions opt,
                              double tol, double grad_tol) {
  const io::SafetensorsFile ref = io::SafetensorsFile::open((entry / "reference.safetensors").string());
  opt.train_base = false;
  std::unique_ptr<CausalLm> m = load_causal_lm(runtime(), model_dir, opt);
  LoraBank bank(runtime(), m->config(), opt.device, opt.dtype, {read_lora_config((entry / "adapter").string())});
  bank.load_peft(0, (entry / "adapter").string());
  m->attach_lora(&bank);
  PackedBatch b = make_packed_batch(runtime(), opt.device, read_i32(ref, "input_ids"), read_i32(ref, "cu_seqlens"),
                                    read_i32(ref, "labels"), m->config().vocab_size);
  set_segments(b, {{b.tokens(), 0, 1.0, 0}});
  EXPECT_LT(rel_l2(to_f64(m->logits(b)), ref.read_as_f32("logits")), tol);
  bank.zero_grads();
  const LossResult r = m->loss(b, true);
  const double want = ref.read_as_f32("loss")[0];
  EXPECT_NEAR(r.loss, want, tol * std::abs(want));
  for (const Parameter& p : m->parameters()) EXPECT_FALSE(p.grad.defined()) << "frozen base got a gradient: " << p.name;
  int grads = 0;
  double worst = 0;
  for (const Parameter& p : bank.parameters(0)) {
    const std::string key = "grad." + p.name;
    ASSERT_NE(ref.find(key), nullptr) << "fixture has no " << key << " (peft's module names differ from Lathe's)";
    std::vector<double> got = to_f64(p.grad);
    if (p.name.find("lora_B") != std::string::npos) got = transpose(got, p.value.size(0), p.value.size(1));
    const double e = rel_l2(got, ref.read_as_f32(key));
    worst = std::max(worst, e);
    EXPECT_LT(e, grad_tol) << p.name;
    ++grads;
  }
  std::printf("[ %s %s %s ] worst LoRA gradient rel-L2 vs transformers + peft: %.2e\n", entry.filename().c_str(),
              opt.device.str().c_str(), std::string(dtype_name(opt.dtype)).c_str(), worst);
  size_t ref_grads = 0;
  for (const auto& t : ref.tensors()) ref_grads += t.name.rfind("grad.", 0) == 0;
  EXPECT_EQ(size_t(grads), ref_grads) << "the adapter's modules differ from peft's";
}

// The fixture folders under `dir` (sorted), expecting at least `min_count`; `how` says how to generate them.
inline std::vector<std::filesystem::path> fixture_dirs(const std::filesystem::path& dir, size_t min_count,
                                                       const std::string& how) {
  EXPECT_TRUE(std::filesystem::exists(dir)) << "fixtures missing: " << dir << " (generate them on the GPU machine: "
                                            << how << ")";
  std::vector<std::filesystem::path> out;
  if (std::filesystem::exists(dir))
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.is_directory()) out.push_back(entry.path());
  std::sort(out.begin(), out.end());
  EXPECT_GE(out.size(), min_count);
  return out;
}

// Where a fixture's goldens carry transformers' own gradient error, the truth is central finite differences in f64:
// the fixture's adapter on the base at `model_dir` (f64, CPU), then for every LoRA matrix whose name contains one of
// `parts`, the loss's derivative along a random direction u (seeded) of that matrix by the gradient (grad . u) and by
// finite differences with step 1e-6 (converged on the stiff fixtures: 1e-4 and 1e-5 are off by the curvature); they
// must agree to 1e-6 relative, and every part must name one matrix.
inline void expect_gradients_match_finite_differences(const std::filesystem::path& entry, const std::string& model_dir,
                                                      ModelOptions opt, const std::vector<std::string>& parts) {
  const io::SafetensorsFile ref = io::SafetensorsFile::open((entry / "reference.safetensors").string());
  opt.dtype = DType::F64;
  opt.device = Device::cpu();
  opt.train_base = false;
  std::unique_ptr<CausalLm> m = load_causal_lm(runtime(), model_dir, opt);
  LoraBank bank(runtime(), m->config(), Device::cpu(), DType::F64, {read_lora_config((entry / "adapter").string())});
  bank.load_peft(0, (entry / "adapter").string());
  m->attach_lora(&bank);
  PackedBatch b = make_packed_batch(runtime(), Device::cpu(), read_i32(ref, "input_ids"), read_i32(ref, "cu_seqlens"),
                                    read_i32(ref, "labels"), m->config().vocab_size);
  set_segments(b, {{b.tokens(), 0, 1.0, 0}});
  bank.zero_grads();
  m->loss(b, true);
  size_t checked = 0;
  for (Parameter& p : bank.parameters(0)) {
    if (std::none_of(parts.begin(), parts.end(), [&](const std::string& s) { return p.name.find(s) != std::string::npos; }))
      continue;
    const std::vector<double> g = to_f64(p.grad);
    std::mt19937_64 rng(7);
    std::normal_distribution<double> normal;
    std::vector<double> u(g.size());
    double along = 0;
    for (size_t i = 0; i < u.size(); ++i) along += g[i] * (u[i] = normal(rng));
    double* v = p.value.data<double>();
    const double h = 1e-6;
    for (size_t i = 0; i < u.size(); ++i) v[i] += h * u[i];
    const double up = m->loss(b, false).loss;
    for (size_t i = 0; i < u.size(); ++i) v[i] -= 2 * h * u[i];
    const double down = m->loss(b, false).loss;
    for (size_t i = 0; i < u.size(); ++i) v[i] += h * u[i];
    const double fd = (up - down) / (2 * h);
    std::printf("[ %s ] directional derivative: lathe %.12g, finite differences %.12g\n", p.name.c_str(), along, fd);
    EXPECT_NEAR(along, fd, 1e-6 * std::abs(fd)) << p.name;
    ++checked;
  }
  EXPECT_EQ(checked, parts.size());
}

// The parallel tests' two adapters (rank 4, alpha 8 and rank 2, alpha 3) over every module and, on a model with
// experts, the experts' fused parameters: one bank for the whole model and one for the split one, randomised alike
// (seeds 40 and 41) and attached.
struct AdapterBanks {
  std::unique_ptr<LoraBank> whole, split;
};
inline AdapterBanks attach_two_adapters(CausalLm& whole, CausalLm& split) {
  std::vector<LoraConfig> adapters = {lora(4, 8, {"all-linear"}), lora(2, 3, {"all-linear"})};
  for (LoraConfig& a : adapters) {
    if (whole.config().num_experts > 0) a.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
    a = lora_config_for_model(a, whole.config(), "test");
  }
  AdapterBanks b{std::make_unique<LoraBank>(runtime(), whole.config(), Device::cpu(), DType::F64, adapters),
                 std::make_unique<LoraBank>(runtime(), split.config(), Device::cpu(), DType::F64, adapters)};
  for (int a : {0, 1}) {
    randomise(*b.whole, a, 40 + uint64_t(a), 0.2);
    randomise(*b.split, a, 40 + uint64_t(a), 0.2);
  }
  whole.attach_lora(b.whole.get());
  split.attach_lora(b.split.get());
  return b;
}

// Every adapter gradient of the split bank, summed over `group` (each rank's its part), against the whole bank's:
// within 1e-10 relative.
inline void expect_summed_adapter_grads_equal(AdapterBanks& b, Communicator& group, const std::string& what) {
  for (int a : {0, 1})
    for (size_t i = 0; i < b.whole->parameters(a).size(); ++i) {
      Parameter& p = b.split->parameters(a)[i];
      group.all_reduce(p.grad).wait();
      EXPECT_LT(rel_l2(to_f64(p.grad), to_f64(b.whole->parameters(a)[i].grad)), 1e-10) << what << ": " << p.name;
    }
}

}  // namespace lathe::test_support
