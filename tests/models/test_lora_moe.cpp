// LoRA on the mixture-of-experts families (model/lora.h, model/moe_layer.cpp): the routed experts through their
// fused parameters (PEFT's target_parameters, per-expert A and B run as grouped GEMMs), the shared expert's
// projections, and the names peft 0.21 re-maps for qwen3_moe / qwen3_next; gradients of several adapters sharing a
// batch (plus a base-only segment) against central finite differences in f64; merging equals the unmerged adapter;
// PEFT files (nested ParamWrapper keys, rank/alpha patterns) round-trip; parity with transformers + peft fixtures
// (dev/ref/lora_moe_fixtures.py) on the CPU in f64 and f32 and on CUDA in f32.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "model/lora.h"
#include "support/error_of.h"
#include "support/lora_support.h"
#include "support/model_support.h"
#include "support/moe_support.h"

using namespace lathe;
using namespace lathe::test_support;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = fs::path(LATHE_TEST_DATA_DIR) / "models" / "fixtures";

ModelConfig tiny(const std::string& type) { return parse_model_config(tiny_moe_json(type), "tiny"); }

LoraConfig experts_lora(int64_t rank, double alpha, std::vector<std::string> targets, std::vector<std::string> params) {
  LoraConfig c = lora(rank, alpha, std::move(targets));
  c.target_parameters = std::move(params);
  return c;
}

// name -> shape of every matrix of the adapter.
std::map<std::string, Shape> shapes(LoraBank& bank, int adapter) {
  std::map<std::string, Shape> out;
  for (const Parameter& p : bank.parameters(adapter)) out[p.name] = p.value.shape();
  return out;
}

std::unique_ptr<CausalLm> frozen_model(const std::string& type, uint64_t seed) {
  ModelOptions opt;
  opt.dtype = DType::F64;
  opt.train_base = false;
  opt.router_aux_loss = false;  // objective() is the segments' cross-entropy
  return random_causal_lm(runtime(), tiny(type), opt, seed, 0.3);
}

}  // namespace

TEST(LoraMoe, TargetsFollowPeft) {
  // qwen3_moe: gate_proj + up_proj + down_proj name the experts (peft 0.21's conversion): gate_up_proj at twice the
  // rank and alpha, down_proj as is, two nested wrappers; the dense MLP of layer 1 takes no adapter.
  const ModelConfig q = tiny("qwen3_moe");
  const LoraConfig converted = lora_config_for_model(lora(2, 4, {"q_proj", "gate_proj", "up_proj", "down_proj"}), q, "t");
  EXPECT_EQ(converted.targets, std::vector<std::string>{"q_proj"});
  EXPECT_EQ(converted.target_parameters, (std::vector<std::string>{"gate_up_proj", "down_proj"}));
  EXPECT_EQ(converted.rank_of("model.layers.0.mlp.experts.gate_up_proj"), 4);
  EXPECT_EQ(converted.scaling_of("model.layers.0.mlp.experts.gate_up_proj"), 2.0);
  EXPECT_EQ(converted.rank_of("model.layers.0.mlp.experts.down_proj"), 2);
  LoraBank bank(runtime(), q, Device::cpu(), DType::F64, {lora(2, 4, {"q_proj", "gate_proj", "up_proj", "down_proj"})});
  const std::map<std::string, Shape> s = shapes(bank, 0);
  const std::string l0 = "base_model.model.model.layers.0.";
  EXPECT_EQ(s.at(l0 + "mlp.experts.base_layer.lora_A.weight"), Shape({4 * 4, 16}));  // (E r', H), r' = 4
  EXPECT_EQ(s.at(l0 + "mlp.experts.base_layer.lora_B.weight"), Shape({4 * 4, 24}));  // stored (r' E, 2I)
  EXPECT_EQ(s.at(l0 + "mlp.experts.lora_A.weight"), Shape({4 * 2, 12}));             // down: (E r, I)
  EXPECT_EQ(s.at(l0 + "mlp.experts.lora_B.weight"), Shape({4 * 2, 16}));
  EXPECT_EQ(s.size(), size_t(3 * 2 + 2 * 2 * 2));  // q_proj of 3 layers, 2 expert parameters of 2 sparse layers
  for (const auto& [name, shape] : s) EXPECT_EQ(name.find("layers.1.mlp"), std::string::npos) << name;
  EXPECT_EQ(lora_target_names(q), (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  // One of the fused pair alone, a router, and dropout on experts are refused.
  EXPECT_NE(error_of([&] { LoraBank(runtime(), q, Device::cpu(), DType::F64, {lora(2, 4, {"gate_proj"})}); })
                .find("needs up_proj"), std::string::npos);
  EXPECT_NE(error_of([&] { LoraBank(runtime(), q, Device::cpu(), DType::F64, {lora(2, 4, {"gate"})}); })
                .find("routers take no adapter"), std::string::npos);
  LoraConfig dropped = experts_lora(2, 4, {}, {"experts.down_proj"});
  dropped.dropout = 0.1;
  EXPECT_NE(error_of([&] { LoraBank(runtime(), q, Device::cpu(), DType::F64, {dropped}); }).find("dropout"),
            std::string::npos);
  // qwen3_5_moe: no conversion; gate_proj names the shared expert's, target_parameters the experts' (one wrapper).
  const ModelConfig m = tiny("qwen3_5_moe_text");
  LoraBank shared(runtime(), m, Device::cpu(), DType::F64, {experts_lora(3, 6, {"gate_proj"}, {"experts.down_proj"})});
  std::set<std::string> names;
  for (const auto& [name, shape] : shapes(shared, 0)) names.insert(name);
  EXPECT_EQ(names, (std::set<std::string>{
                       l0 + "mlp.shared_expert.gate_proj.lora_A.weight", l0 + "mlp.shared_expert.gate_proj.lora_B.weight",
                       l0 + "mlp.experts.lora_A.weight", l0 + "mlp.experts.lora_B.weight",
                       "base_model.model.model.layers.1.mlp.shared_expert.gate_proj.lora_A.weight",
                       "base_model.model.model.layers.1.mlp.shared_expert.gate_proj.lora_B.weight",
                       "base_model.model.model.layers.1.mlp.experts.lora_A.weight",
                       "base_model.model.model.layers.1.mlp.experts.lora_B.weight",
                       "base_model.model.model.layers.2.mlp.shared_expert.gate_proj.lora_A.weight",
                       "base_model.model.model.layers.2.mlp.shared_expert.gate_proj.lora_B.weight",
                       "base_model.model.model.layers.2.mlp.experts.lora_A.weight",
                       "base_model.model.model.layers.2.mlp.experts.lora_B.weight"}));
}

TEST(LoraMoe, GradientsOfSeveralAdaptersMatchFiniteDifferences) {
  for (const char* type : {"qwen3_moe", "qwen3_5_moe_text", "qwen3_next"}) {
    SCOPED_TRACE(type);
    std::unique_ptr<CausalLm> m = frozen_model(type, 17);
    // Adapter 0: everything (experts by target_parameters, all-linear for the rest); adapter 1: one expert parameter
    // and attention k at another rank; adapter 2: the experts' gate_up only.
    LoraBank bank(runtime(), m->config(), Device::cpu(), DType::F64,
                  {experts_lora(2, 4, {"all-linear"}, {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}),
                   experts_lora(3, 5, {"k_proj"}, {"experts.down_proj"}), experts_lora(1, 2, {}, {"gate_up_proj"})});
    for (int a = 0; a < 3; ++a) randomise(bank, a, 100 + uint64_t(a), 0.3);
    m->attach_lora(&bank);
    // Four segments: adapter 1, adapter 0 (two documents), the bare base, adapter 2.
    PackedBatch b = random_batch(40, {0, 5, 9, 16, 20, 26}, 3);
    set_segments(b, {{5, 1, 0.7, 0}, {16, 0, 1.3, 0}, {20, -1, 1.0, 0}, {26, 2, 0.5, 0}});
    bank.zero_grads();
    m->loss(b, true);
    for (const Parameter& p : m->parameters()) EXPECT_FALSE(p.grad.defined()) << "frozen base got a gradient: " << p.name;
    const double h = 1e-6;
    int checked = 0, experts = 0;
    for (int a = 0; a < 3; ++a) {
      for (Parameter& p : bank.parameters(a)) {
        experts += p.name.find("mlp.experts") != std::string::npos;
        double* v = p.value.data<double>();
        const std::vector<double> g = to_f64(p.grad);
        double norm = 0;
        for (double x : g) norm += x * x;
        EXPECT_GT(norm, 0.0) << p.name << " has a zero gradient";
        for (int64_t i : {int64_t(0), p.value.numel() / 3, p.value.numel() - 1}) {
          const double x = v[i];
          v[i] = x + h;
          const double up = objective(*m, b);
          v[i] = x - h;
          const double down = objective(*m, b);
          v[i] = x;
          const double fd = (up - down) / (2 * h);
          EXPECT_NEAR(g[size_t(i)], fd, 1e-7 + 1e-5 * std::abs(fd)) << p.name << "[" << i << "]";
          ++checked;
        }
      }
    }
    EXPECT_GE(experts, 2 * 2 * (2 + 1 + 1));  // A and B of each adapter's expert parameters in the 2 sparse layers
    EXPECT_GT(checked, 60);
  }
}

TEST(LoraMoe, MergeEqualsTheAdapterAndAFreshAdapterChangesNothing) {
  for (const char* type : {"qwen3_moe", "qwen3_5_moe_text", "qwen3_next"}) {
    SCOPED_TRACE(type);
    std::unique_ptr<CausalLm> m = frozen_model(type, 19);
    LoraBank bank(runtime(), m->config(), Device::cpu(), DType::F64,
                  {experts_lora(3, 5, {"all-linear"}, {"gate_up_proj", "down_proj"})});
    bank.init(0, 5);
    m->attach_lora(&bank);
    PackedBatch b = random_batch(40, {0, 8, 19}, 5);
    const PackedBatch bare = b;
    set_segments(b, {{19, 0, 1.0, 0}});
    EXPECT_EQ(to_f64(m->logits(b)), to_f64(m->logits(bare)));
    randomise(bank, 0, 6, 0.3);
    const std::vector<double> adapted = to_f64(m->logits(b));
    EXPECT_GT(rel_l2(adapted, to_f64(m->logits(bare))), 1e-3);
    std::set<std::string> merged;
    for (const std::string& name : lora_merge_targets(bank, 0)) merged.insert(name);
    EXPECT_TRUE(merged.count("model.layers.0.mlp.experts.gate_up_proj"));
    EXPECT_TRUE(merged.count("model.layers.2.mlp.experts.down_proj"));
    merge_lora(*m, bank, 0);
    EXPECT_LT(rel_l2(to_f64(m->logits(bare)), adapted), 1e-12);
  }
}

TEST(LoraMoe, PeftFilesRoundTripWithPatternsAndNestedKeys) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_lora_moe_{}", getpid());
  fs::remove_all(dir);
  const ModelConfig q = tiny("qwen3_next");
  LoraBank a(runtime(), q, Device::cpu(), DType::F64, {lora(2, 3, {"in_proj_qkvz", "gate_proj", "up_proj", "down_proj"})});
  randomise(a, 0, 21, 0.2);
  a.save_peft(0, dir.string(), DType::F64, "/models/next");
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(dir / "adapter_config.json"));
  EXPECT_EQ(j["target_modules"], nlohmann::json({"in_proj_qkvz"}));
  EXPECT_EQ(j["target_parameters"], nlohmann::json({"gate_up_proj", "down_proj"}));
  EXPECT_EQ(j["rank_pattern"], nlohmann::json({{".*\\.gate_up_proj", 4}}));
  EXPECT_EQ(j["alpha_pattern"], nlohmann::json({{".*\\.gate_up_proj", 6.0}}));
  const io::SafetensorsFile st = io::SafetensorsFile::open((dir / "adapter_model.safetensors").string());
  EXPECT_EQ(st.get("base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight").shape,
            (std::vector<int64_t>{24, 4 * 4}));  // PEFT's (out, r' E)
  LoraBank b(runtime(), q, Device::cpu(), DType::F64, {read_lora_config(dir.string())});
  b.load_peft(0, dir.string());
  for (size_t i = 0; i < a.parameters(0).size(); ++i)
    EXPECT_EQ(to_f64(a.parameters(0)[i].value), to_f64(b.parameters(0)[i].value)) << a.parameters(0)[i].name;
  // The same adapter asked with another alpha for the experts is refused (the patterns differ).
  LoraConfig other = lora(2, 3, {"in_proj_qkvz"});
  other.target_parameters = {"gate_up_proj", "down_proj"};
  other.rank_pattern = {{".*\\.gate_up_proj", 4}};
  LoraBank c(runtime(), q, Device::cpu(), DType::F64, {other});
  EXPECT_NE(error_of([&] { c.load_peft(0, dir.string()); }).find("alpha_pattern"), std::string::npos);
  fs::remove_all(dir);
}

namespace {

std::vector<fs::path> parity_fixtures() {
  return fixture_dirs(kFixtures / "lora_moe", 3,
                      "python3 dev/ref/lora_moe_fixtures.py tests/models/fixtures/moe tests/models/fixtures/lora_moe");
}

std::string base_model_dir(const io::SafetensorsFile& ref) {
  return (kFixtures / "moe" / ref.metadata().at("base") / "model").string();
}

// The goldens are transformers + peft in f64 (stored as f32); f32 gets the MoE base fixtures' bounds. On
// qwen3_next_gate_up the goldens' own gradient error is ~1e-5 upstream of the last Gated DeltaNet layer
// (StiffFixtureGradientsMatchFiniteDifferences, below, checks Lathe against finite differences there instead): its
// gradient bounds are 3e-5 (f64) and 1e-4 (f32).
void check_fixture(const fs::path& entry, DType dtype, bool recompute, Device device) {
  const io::SafetensorsFile ref = io::SafetensorsFile::open((entry / "reference.safetensors").string());
  ModelOptions opt;
  opt.dtype = dtype;
  opt.recompute = recompute;
  opt.device = device;
  opt.router_aux_loss = false;  // the goldens are the cross-entropy alone
  const bool stiff = entry.filename() == "qwen3_next_gate_up";
  check_lora_parity(entry, base_model_dir(ref), opt, dtype == DType::F64 ? 1e-6 : 1e-5,
                    dtype == DType::F64 ? (stiff ? 3e-5 : 1e-6) : (stiff ? 1e-4 : 5e-5));
}

}  // namespace

TEST(LoraMoeParity, MatchesTransformersAndPeftFixtures) {
  for (const fs::path& entry : parity_fixtures()) {
    SCOPED_TRACE(entry.filename().string());
    for (const auto& [dtype, recompute] : {std::pair{DType::F64, false}, std::pair{DType::F64, true}, std::pair{DType::F32, false}}) {
      SCOPED_TRACE(fmt::format("{} recompute={}", dtype_name(dtype), recompute));
      check_fixture(entry, dtype, recompute, Device::cpu());
    }
  }
}

TEST(LoraMoeParity, CudaF32MatchesTransformersAndPeftFixtures) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  for (const fs::path& entry : parity_fixtures()) {
    SCOPED_TRACE(entry.filename().string());
    check_fixture(entry, DType::F32, false, Device::cuda(0));
  }
}

// Where the goldens carry transformers' own error (qwen3_next_gate_up: ~1e-5 rel-L2 on the adapters upstream of the
// last GDN layer, the pattern of lora_qwen3_5's hv_gt_hk_all_linear), the truth is central finite differences in f64
// along a random direction; Lathe's gradient must match it.
TEST(LoraMoeParity, StiffFixtureGradientsMatchFiniteDifferences) {
  const fs::path entry = kFixtures / "lora_moe" / "qwen3_next_gate_up";
  ASSERT_TRUE(fs::exists(entry)) << "fixtures missing: " << entry;
  const io::SafetensorsFile ref = io::SafetensorsFile::open((entry / "reference.safetensors").string());
  ModelOptions opt;
  opt.router_aux_loss = false;
  expect_gradients_match_finite_differences(entry, base_model_dir(ref), opt,
                                            {"layers.0.linear_attn.in_proj_qkvz.lora_A", "layers.0.mlp.experts.lora_A",
                                             "layers.1.linear_attn.in_proj_qkvz.lora_B"});
}
