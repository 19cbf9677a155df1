// LoRA: parity with transformers + peft fixtures (logits, loss and every LoRA gradient; dev/ref/lora_fixtures.py),
// gradients against central finite differences in f64 for several adapters sharing one batch, isolation of the
// adapters of a multi-tenant batch, PEFT save/load round trips and refusals, merging, and a frozen base.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "io/safetensors.h"
#include "model/lora.h"
#include "model/qwen3.h"
#include "ops/ops.h"
#include "support/lora_support.h"
#include "support/model_support.h"

using namespace lathe;
using namespace lathe::test_support;
namespace fs = std::filesystem;

namespace {

ModelConfig tiny_config() {
  nlohmann::json j = {{"model_type", "qwen3"}, {"vocab_size", 40}, {"hidden_size", 16}, {"intermediate_size", 24},
                      {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"head_dim", 6}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false}};
  return parse_model_config(j, "test");
}

const fs::path kFixtures = fs::path(LATHE_TEST_DATA_DIR) / "models" / "fixtures";

}  // namespace

TEST(LoraParity, MatchesTransformersAndPeftFixtures) {
  const fs::path dir = kFixtures / "lora";
  ASSERT_TRUE(fs::exists(dir)) << "fixtures missing: " << dir << " (made by dev/ref/lora_fixtures.py)";
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_directory()) continue;
    SCOPED_TRACE(entry.path().filename().string());
    const io::SafetensorsFile ref = io::SafetensorsFile::open((entry.path() / "reference.safetensors").string());
    const std::string base = ref.metadata().at("base");
    for (bool recompute : {false, true}) {
      ModelOptions opt;
      opt.recompute = recompute;
      opt.train_base = false;
      Qwen3Model m = Qwen3Model::load(runtime(), (kFixtures / "qwen3" / base / "model").string(), opt);
      LoraBank bank(runtime(), m.config(), Device::cpu(), DType::F32, {read_lora_config((entry.path() / "adapter").string())});
      bank.load_peft(0, (entry.path() / "adapter").string());
      m.attach_lora(&bank);
      PackedBatch b = make_packed_batch(runtime(), Device::cpu(), read_i32(ref, "input_ids"), read_i32(ref, "cu_seqlens"),
                                        read_i32(ref, "labels"), m.config().vocab_size);
      set_segments(b, {{b.tokens(), 0, 1.0, 0}});
      std::vector<double> want_logits;
      for (float x : ref.read_as_f32("logits")) want_logits.push_back(x);
      EXPECT_LT(rel_l2(to_f64(m.logits(b)), want_logits), 1e-5);
      const LossResult r = m.loss(b, true);
      const double want = ref.read_as_f32("loss")[0];
      EXPECT_NEAR(r.loss, want, 1e-5 * std::abs(want));
      for (const Parameter& p : m.parameters()) EXPECT_FALSE(p.grad.defined()) << "frozen base got a gradient: " << p.name;
      int grads = 0;
      for (const Parameter& p : bank.parameters(0)) {
        std::vector<double> want_g;
        for (float x : ref.read_as_f32("grad." + p.name)) want_g.push_back(x);
        std::vector<double> got = to_f64(p.grad);
        if (p.name.find("lora_B") != std::string::npos) got = transpose(got, p.value.size(0), p.value.size(1));
        EXPECT_LT(rel_l2(got, want_g), 1e-5) << p.name;
        ++grads;
      }
      size_t ref_grads = 0;
      for (const auto& t : ref.tensors()) ref_grads += t.name.rfind("grad.", 0) == 0;
      EXPECT_EQ(size_t(grads), ref_grads) << "the adapter's modules differ from peft's";
    }
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

TEST(Lora, GradientsOfSeveralAdaptersMatchFiniteDifferences) {
  ModelOptions opt;
  opt.dtype = DType::F64;
  opt.train_base = false;
  Qwen3Model m = Qwen3Model::random(runtime(), tiny_config(), opt, 7, 0.3);
  LoraBank bank(runtime(), m.config(), Device::cpu(), DType::F64,
                {lora(3, 6, {"all-linear"}), lora(2, 3, {"q_proj", "v_proj", "down_proj"}, true),
                 lora(4, 4, {"re:.*layers\\.1\\.mlp\\..*"})});
  for (int a = 0; a < 3; ++a) randomise(bank, a, 100 + uint64_t(a), 0.2);
  m.attach_lora(&bank);
  // Four documents: adapter 1, adapter 0 (two documents), the bare base, adapter 2.
  PackedBatch b = random_batch(40, {0, 5, 9, 16, 20, 26}, 3);
  set_segments(b, {{5, 1, 0.7, 0}, {16, 0, 1.3, 0}, {20, -1, 1.0, 0}, {26, 2, 0.5, 0}});
  bank.zero_grads();
  m.loss(b, true);
  const double h = 1e-6;
  int checked = 0;
  for (int a = 0; a < 3; ++a) {
    for (Parameter& p : bank.parameters(a)) {
      double* v = p.value.data<double>();
      const std::vector<double> g = to_f64(p.grad);
      for (int64_t i : {int64_t(0), p.value.numel() / 2, p.value.numel() - 1}) {
        const double x = v[i];
        v[i] = x + h;
        const double up = objective(m, b);
        v[i] = x - h;
        const double down = objective(m, b);
        v[i] = x;
        const double fd = (up - down) / (2 * h);
        EXPECT_NEAR(g[size_t(i)], fd, 1e-6 + 1e-5 * std::abs(fd)) << p.name << "[" << i << "]";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(Lora, AdaptersSharingABatchDoNotInteract) {
  // Each adapter's gradient from a mixed batch equals its gradient from a batch of its own rows only.
  ModelOptions opt;
  opt.dtype = DType::F64;
  opt.train_base = false;
  Qwen3Model m = Qwen3Model::random(runtime(), tiny_config(), opt, 8, 0.3);
  LoraBank bank(runtime(), m.config(), Device::cpu(), DType::F64, {lora(2, 4, {"all-linear"}), lora(5, 5, {"k_proj", "up_proj"})});
  randomise(bank, 0, 1, 0.2);
  randomise(bank, 1, 2, 0.2);
  m.attach_lora(&bank);
  PackedBatch mixed = random_batch(40, {0, 6, 13, 21}, 4);
  set_segments(mixed, {{6, 0, 1.0, 0}, {13, 1, 1.0, 0}, {21, 0, 1.0, 0}});
  bank.zero_grads();
  const LossResult rm = m.loss(mixed, true);
  std::vector<std::vector<double>> mixed_grads;
  for (int a = 0; a < 2; ++a)
    for (const Parameter& p : bank.parameters(a)) mixed_grads.push_back(to_f64(p.grad));
  // Adapter 1 alone: the middle document.
  std::vector<int32_t> ids1(mixed.host_ids.begin() + 6, mixed.host_ids.begin() + 13);
  PackedBatch alone1 = make_packed_batch(runtime(), Device::cpu(), ids1, {0, 7}, next_token_labels(ids1, {0, 7}), 40);
  set_segments(alone1, {{7, 1, 1.0, 0}});
  bank.zero_grads();
  const LossResult r1 = m.loss(alone1, true);
  EXPECT_NEAR(r1.loss, rm.segments[1].loss_sum / double(rm.segments[1].labelled), 1e-12);
  size_t k = bank.parameters(0).size();
  for (const Parameter& p : bank.parameters(1)) {
    const std::vector<double> g = to_f64(p.grad);
    for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], mixed_grads[k][i], 1e-12) << p.name;
    ++k;
  }
  for (const Parameter& p : bank.parameters(0))  // adapter 0 had no rows: zero gradient
    for (double x : to_f64(p.grad)) ASSERT_EQ(x, 0.0) << p.name;
}

TEST(Lora, FreshAdapterChangesNothingAndMergeEqualsTheAdapter) {
  ModelOptions opt;
  opt.dtype = DType::F64;
  opt.train_base = false;
  Qwen3Model m = Qwen3Model::random(runtime(), tiny_config(), opt, 9, 0.3);
  LoraBank bank(runtime(), m.config(), Device::cpu(), DType::F64, {lora(4, 8, {"all-linear"})});
  bank.init(0, 5);  // PEFT init: B = 0, so the adapter adds nothing yet
  m.attach_lora(&bank);
  PackedBatch b = random_batch(40, {0, 8, 19}, 5);
  PackedBatch bare = b;
  set_segments(b, {{19, 0, 1.0, 0}});
  EXPECT_EQ(to_f64(m.logits(b)), to_f64(m.logits(bare)));
  randomise(bank, 0, 6, 0.2);
  const std::vector<double> adapted = to_f64(m.logits(b));
  EXPECT_GT(rel_l2(adapted, to_f64(m.logits(bare))), 1e-3);
  merge_lora(m, bank, 0);
  EXPECT_LT(rel_l2(to_f64(m.logits(bare)), adapted), 1e-12);
}

TEST(Lora, PeftFilesRoundTripAndBadAdaptersAreRefused) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_lora_{}", getpid());
  fs::remove_all(dir);
  ModelOptions opt;
  opt.dtype = DType::F64;
  Qwen3Model m = Qwen3Model::random(runtime(), tiny_config(), opt, 10, 0.3);
  const LoraConfig cfg = lora(3, 7, {"q_proj", "o_proj", "gate_proj"}, true);
  LoraBank a(runtime(), m.config(), Device::cpu(), DType::F64, {cfg});
  randomise(a, 0, 11, 0.2);
  a.save_peft(0, (dir / "adapter").string(), DType::F64, "/models/base");
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(dir / "adapter/adapter_config.json"));
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["r"], 3);
  EXPECT_EQ(j["lora_alpha"], 7.0);
  EXPECT_EQ(j["use_rslora"], true);
  EXPECT_EQ(j["base_model_name_or_path"], "/models/base");
  const io::SafetensorsFile st = io::SafetensorsFile::open((dir / "adapter/adapter_model.safetensors").string());
  const io::SafetensorsTensor& bt = st.get("base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight");
  EXPECT_EQ(bt.shape, (std::vector<int64_t>{16, 3}));  // PEFT layout (out, r)
  EXPECT_EQ(st.tensors().size(), size_t(2 * 3 * 2));

  LoraBank b(runtime(), m.config(), Device::cpu(), DType::F64, {read_lora_config((dir / "adapter").string())});
  b.load_peft(0, (dir / "adapter").string());
  ASSERT_EQ(a.parameters(0).size(), b.parameters(0).size());
  for (size_t i = 0; i < a.parameters(0).size(); ++i)
    EXPECT_EQ(to_f64(a.parameters(0)[i].value), to_f64(b.parameters(0)[i].value)) << a.parameters(0)[i].name;

  // A run whose adapter differs from the file's: refused, naming both.
  LoraBank other(runtime(), m.config(), Device::cpu(), DType::F64, {lora(4, 7, {"q_proj"})});
  EXPECT_THROW(
      {
        try {
          other.load_peft(0, (dir / "adapter").string());
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("r=3"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  // Unsupported PEFT features are refused by name.
  nlohmann::json dora = j;
  dora["use_dora"] = true;
  EXPECT_THROW(
      {
        try {
          lora_config_from_peft(dora, "x");
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("use_dora"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  // A target that matches nothing is an error, not an adapter that trains nothing.
  EXPECT_THROW(LoraBank(runtime(), m.config(), Device::cpu(), DType::F64, {lora(2, 2, {"qproj"})}), Error);
  fs::remove_all(dir);
}

// The CUDA path (bf16 parameters and activations, the segment ops' CUDA kernels) against the CPU in f64.
TEST(LoraCuda, Bf16MatchesCpuReference) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  const std::vector<LoraConfig> configs = {lora(4, 8, {"all-linear"}), lora(2, 3, {"q_proj", "o_proj", "up_proj"}, true)};
  std::vector<std::vector<double>> logits, grads;
  for (Device d : {Device::cpu(), Device::cuda(0)}) {
    ModelOptions opt;
    opt.device = d;
    opt.dtype = d.is_cpu() ? DType::F64 : DType::BF16;
    opt.train_base = false;
    Qwen3Model m = Qwen3Model::random(runtime(), tiny_config(), opt, 12, 0.3);
    LoraBank bank(runtime(), m.config(), d, opt.dtype, configs);
    for (int a = 0; a < 2; ++a) {  // the same random values on both devices, through a PEFT file
      LoraBank host(runtime(), m.config(), Device::cpu(), DType::F64, {configs[size_t(a)]});
      randomise(host, 0, 20 + uint64_t(a), 0.2);
      const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_lora_cuda_{}_{}", getpid(), a);
      host.save_peft(0, dir.string(), DType::F32, "");
      bank.load_peft(a, dir.string());
      fs::remove_all(dir);
    }
    m.attach_lora(&bank);
    std::mt19937 rng(5);
    std::vector<int32_t> ids(30), cu = {0, 9, 21, 30};
    for (int32_t& x : ids) x = int32_t(rng() % 40u);
    PackedBatch b = make_packed_batch(runtime(), d, ids, cu, next_token_labels(ids, cu), 40);
    set_segments(b, {{9, 1, 1.0, 0}, {21, 0, 1.0, 0}, {30, 1, 0.5, 0}});
    logits.push_back(to_f64(m.logits(b)));
    bank.zero_grads();
    m.loss(b, true);
    std::vector<double> g;
    for (int a = 0; a < 2; ++a)
      for (const Parameter& p : bank.parameters(a))
        for (double x : to_f64(p.grad)) g.push_back(x);
    grads.push_back(g);
  }
  const double dl = rel_l2(logits[1], logits[0]), dg = rel_l2(grads[1], grads[0]);
  std::printf("[lora cuda bf16] logits rel-L2 %.3g, LoRA gradients rel-L2 %.3g\n", dl, dg);
  EXPECT_LT(dl, 3e-2);
  EXPECT_LT(dg, 1e-1);
}
