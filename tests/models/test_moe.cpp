// Mixture-of-experts families (qwen3_moe, qwen3_5_moe_text, qwen3_next; model/moe_layer.h): parity with Hugging Face
// fixtures (logits, loss, aux loss, every gradient with and without the aux term; dev/ref/moe_fixtures.py), the
// whole-model gradient against finite differences in f64 with the aux loss on, both expert checkpoint layouts (read,
// written back in the layout read, a mixed checkpoint refused), an expert that receives no token, run-to-run
// determinism, packing isolation, cached decoding against the full forward, and config errors (LoRA:
// test_lora_moe.cpp).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "model/generate.h"
#include "model/rollout_engine.h"
#include "model/qwen3.h"
#include "model/qwen3_5.h"
#include "ops/ops.h"
#include "support/model_support.h"
#include "support/moe_support.h"

using namespace lathe;
using namespace lathe::test_support;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = fs::path(LATHE_TEST_DATA_DIR) / "models" / "fixtures" / "moe";

// padded_max_waste applies where the groups are read on the host (host_groups; the padded form needs the counts there).
std::unique_ptr<CausalLm> tiny_model(const std::string& type, DType dtype, uint64_t seed, bool norm = true,
                                     double padded_max_waste = ModelOptions{}.moe_padded_max_waste,
                                     bool host_groups = false, const nlohmann::json& changes = {}) {
  ModelOptions opt;
  opt.dtype = dtype;
  opt.moe_padded_max_waste = padded_max_waste;
  opt.moe_host_groups = host_groups;
  nlohmann::json config = tiny_moe_json(type, norm);
  if (!changes.is_null()) config.update(changes);
  return random_causal_lm(runtime(), parse_model_config(config, "tiny"), opt, seed, 0.3);
}

// Every parameter's value on the host.
std::map<std::string, std::vector<double>> values(const CausalLm& m) {
  std::map<std::string, std::vector<double>> v;
  for (const Parameter& p : m.parameters()) v[p.name] = to_f64(p.value);
  return v;
}

}  // namespace

TEST(MoeConfig, ParsesTheThreeFamilies) {
  const ModelConfig q = parse_model_config(tiny_moe_json("qwen3_moe", false), "tiny");
  EXPECT_TRUE(q.is_moe());
  EXPECT_FALSE(q.is_hybrid());
  EXPECT_FALSE(q.norm_topk_prob);
  EXPECT_TRUE(q.sparse_layer(0));
  EXPECT_FALSE(q.sparse_layer(1));  // mlp_only_layers
  EXPECT_EQ(q.shared_expert_intermediate_size, 0);
  const ModelConfig n = parse_model_config(tiny_moe_json("qwen3_next"), "tiny");
  EXPECT_TRUE(n.is_hybrid() && n.fused_gdn_projections && n.norm_topk_prob);
  EXPECT_EQ(n.shared_expert_intermediate_size, 10);
  const ModelConfig m = parse_model_config(tiny_moe_json("qwen3_5_moe_text"), "tiny");
  EXPECT_TRUE(m.is_hybrid() && !m.fused_gdn_projections);
  for (int64_t i = 0; i < 3; ++i) EXPECT_TRUE(m.sparse_layer(i));
  nlohmann::json step = tiny_moe_json("qwen3_moe");
  step.erase("mlp_only_layers");
  step["decoder_sparse_step"] = 2;
  const ModelConfig s = parse_model_config(step, "tiny");
  EXPECT_FALSE(s.sparse_layer(0));
  EXPECT_TRUE(s.sparse_layer(1));
  EXPECT_FALSE(s.sparse_layer(2));
  // The multimodal Qwen3.5-MoE release nests the text stack.
  nlohmann::json mm = {{"model_type", "qwen3_5_moe"}, {"text_config", tiny_moe_json("qwen3_5_moe_text")}};
  EXPECT_TRUE(parse_model_config(mm, "mm").multimodal_layout);
}

TEST(MoeConfig, RefusesBadFields) {
  nlohmann::json j = tiny_moe_json("qwen3_moe");
  j["num_experts_per_tok"] = 5;
  expect_refused(j, "num_experts_per_tok 5 exceeds num_experts 4");
  j = tiny_moe_json("qwen3_moe");
  j["mlp_only_layers"] = {3};
  expect_refused(j, "mlp_only_layers entry 3");
  j = tiny_moe_json("qwen3_5_moe_text");
  j["norm_topk_prob"] = false;  // not read for this family: noted, not refused
  EXPECT_FALSE(parse_model_config(j, "tiny").notes.empty());
  j = tiny_moe_json("qwen3_next");
  j.erase("shared_expert_intermediate_size");
  expect_refused(j, "shared_expert_intermediate_size");
  j = tiny_moe_json("qwen3_moe");
  j["model_type"] = "qwen3";
  expect_refused(j, "model_type qwen3_moe");
  j = tiny_moe_json("qwen3_moe");
  j["shared_expert_intermediate_size"] = 8;
  expect_refused(j, "shared_expert_intermediate_size is not part of qwen3_moe");
  j = tiny_moe_json("qwen3_moe");
  j["mlp_only_layers"] = {0, 1, 2};
  j.erase("intermediate_size");
  expect_refused(j, "intermediate_size is missing");
}

TEST(MoeParity, MatchesTransformersFixtures) {
  ASSERT_TRUE(fs::exists(kFixtures)) << "fixtures missing: " << kFixtures
                                     << " (generate them on the GPU machine: python3 dev/ref/moe_fixtures.py "
                                        "tests/models/fixtures/moe)";
  std::set<std::string> families;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    if (!entry.is_directory()) continue;
    SCOPED_TRACE(entry.path().filename().string());
    const io::SafetensorsFile ref = io::SafetensorsFile::open((entry.path() / "reference.safetensors").string());
    for (const auto& [dtype, recompute, aux] :
         {std::tuple{DType::F64, false, false}, std::tuple{DType::F64, true, true}, std::tuple{DType::F32, false, true}}) {
      SCOPED_TRACE(fmt::format("{} recompute={} aux={}", dtype_name(dtype), recompute, aux));
      ModelOptions opt;
      opt.dtype = dtype;
      opt.recompute = recompute;
      opt.router_aux_loss = aux;
      std::unique_ptr<CausalLm> m = load_causal_lm(runtime(), (entry.path() / "model").string(), opt);
      families.insert(m->config().model_type);
      const PackedBatch b = make_packed_batch(runtime(), Device::cpu(), read_i32(ref, "input_ids"),
                                              read_i32(ref, "cu_seqlens"), read_i32(ref, "labels"), m->config().vocab_size);
      // The goldens are f64 values stored as f32: f64 checks exactness (1e-6); f32 gets the bounds of the dense
      // families (gradients of norm gains and router rows sum many terms).
      const double tol = dtype == DType::F64 ? 1e-6 : 1e-5, grad_tol = dtype == DType::F64 ? 1e-6 : 5e-5;
      EXPECT_LT(rel_l2(to_f64(m->logits(b)), ref.read_as_f32("logits")), tol);
      const LossResult r = m->loss(b, /*backward=*/true);
      const double want = ref.read_as_f32("loss")[0], want_aux = ref.read_as_f32("aux_loss")[0];
      EXPECT_NEAR(r.loss, want, tol * std::abs(want));
      EXPECT_NEAR(r.aux_loss, want_aux, tol * std::abs(want_aux));
      // The routing: each sparse layer's tokens per expert against the golden choices.
      for (const ExpertLoadStat& s : r.expert_load) {
        const std::string key = fmt::format("routing.{}", s.layer);
        ASSERT_NE(ref.find(key), nullptr) << "fixture has no " << key;
        std::vector<int64_t> counts(s.tokens_per_expert.size(), 0);
        for (int32_t e : read_i32(ref, key.c_str())) ++counts.at(size_t(e));
        EXPECT_EQ(s.tokens_per_expert, counts) << "layer " << s.layer;
      }
      for (const Parameter& p : m->parameters()) {
        ASSERT_TRUE(p.grad.defined()) << p.name;
        const std::string key = (aux ? "grad_aux." : "grad.") + p.name;
        ASSERT_NE(ref.find(key), nullptr) << "fixture has no " << key;
        EXPECT_LT(rel_l2(to_f64(p.grad), ref.read_as_f32(key)), grad_tol) << p.name;
      }
    }
  }
  for (const char* f : {"qwen3_moe", "qwen3_5_moe_text", "qwen3_next"})
    EXPECT_TRUE(families.count(f)) << "no fixture of family " << f;
}

TEST(MoeGradient, WholeModelMatchesFiniteDifferencesInF64) {
  for (const char* type : {"qwen3_moe", "qwen3_5_moe_text", "qwen3_next"}) {
    for (bool norm : {false, true}) {
      if (norm == false && std::string(type) != "qwen3_moe") continue;
      SCOPED_TRACE(fmt::format("{} norm_topk_prob={}", type, norm));
      std::unique_ptr<CausalLm> m = tiny_model(type, DType::F64, 21, norm);
      const PackedBatch b = random_batch(40, {0, 7, 16}, 4);
      const LossResult r = m->loss(b, true);
      EXPECT_GT(r.aux_loss, 0.0);
      expect_gradients_match_finite_differences(*m, b, 3, m->config().router_aux_loss_coef);
    }
  }
}

TEST(MoeLayouts, ReadsBothLayoutsAndWritesBackTheOneRead) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_moe_layout_{}", getpid());
  fs::remove_all(dir);
  std::unique_ptr<CausalLm> m = tiny_model("qwen3_next", DType::F32, 3);
  m->save((dir / "fused").string());
  const io::SafetensorsModel fused = io::SafetensorsModel::open((dir / "fused").string());
  ASSERT_NE(fused.find("model.layers.0.mlp.experts.gate_up_proj"), nullptr);
  // The same weights split per expert, written by hand: experts.N.{gate,up}_proj.weight are the halves of each
  // expert's gate_up_proj block, experts.N.down_proj.weight its down_proj block.
  std::vector<std::vector<float>> keep;
  std::vector<io::TensorRef> refs;
  auto add = [&](const std::string& name, Shape shape, std::vector<float> v) {
    keep.push_back(std::move(v));
    refs.push_back({name, DType::F32, shape, keep.back().data(), keep.back().size() * 4});
  };
  keep.reserve(200);
  for (const std::string& name : fused.names()) {
    const std::vector<float> v = fused.read_as_f32(name);
    const Shape shape = fused.get(name).shape;
    const bool gate_up = name.ends_with("experts.gate_up_proj"), down = name.ends_with("experts.down_proj");
    if (!gate_up && !down) {
      add(name, shape, v);
      continue;
    }
    const std::string base = name.substr(0, name.rfind('.') + 1);
    const int64_t rows = shape[1], cols = shape[2], half = gate_up ? rows / 2 : rows;
    for (int64_t e = 0; e < shape[0]; ++e) {
      auto block = [&](int64_t r0) {
        return std::vector<float>(v.begin() + (e * rows + r0) * cols, v.begin() + (e * rows + r0 + half) * cols);
      };
      if (gate_up) {
        add(fmt::format("{}{}.gate_proj.weight", base, e), {half, cols}, block(0));
        add(fmt::format("{}{}.up_proj.weight", base, e), {half, cols}, block(half));
      } else {
        add(fmt::format("{}{}.down_proj.weight", base, e), {half, cols}, block(0));
      }
    }
  }
  fs::create_directories(dir / "split");
  fs::copy_file(dir / "fused" / "config.json", dir / "split" / "config.json");
  io::write_safetensors((dir / "split" / "model.safetensors").string(), refs, {{"format", "pt"}});
  ModelOptions opt;
  std::unique_ptr<CausalLm> split = load_causal_lm(runtime(), (dir / "split").string(), opt);
  EXPECT_EQ(values(*split), values(*m));
  split->save((dir / "split_saved").string());
  const io::SafetensorsModel resaved = io::SafetensorsModel::open((dir / "split_saved").string());
  EXPECT_EQ(resaved.find("model.layers.0.mlp.experts.gate_up_proj"), nullptr);
  ASSERT_NE(resaved.find("model.layers.0.mlp.experts.3.up_proj.weight"), nullptr);
  {  // expert 3's up_proj is the second half of its gate_up_proj block (E, 2I, D) = (4, 24, 16)
    const std::vector<float> gu = fused.read_as_f32("model.layers.0.mlp.experts.gate_up_proj");
    const int64_t at = (3 * 24 + 12) * 16;
    EXPECT_EQ(resaved.read_as_f32("model.layers.0.mlp.experts.3.up_proj.weight"),
              std::vector<float>(gu.begin() + at, gu.begin() + at + 12 * 16));
  }
  EXPECT_EQ(values(*load_causal_lm(runtime(), (dir / "split_saved").string(), opt)), values(*m));
  // A checkpoint with both layouts is refused; so is one missing an expert.
  std::vector<std::vector<float>> fused_layer2;
  for (const char* name : {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"}) {
    fused_layer2.push_back(fused.read_as_f32(name));
    refs.push_back({name, DType::F32, fused.get(name).shape, fused_layer2.back().data(), fused_layer2.back().size() * 4});
  }
  for (auto it = refs.begin(); it != refs.end();)  // layer 2 fused, layer 0 per expert
    it = it->name.starts_with("model.layers.2.mlp.experts.") && it->name.ends_with(".weight") ? refs.erase(it) : it + 1;
  io::write_safetensors((dir / "split" / "model.safetensors").string(), refs, {{"format", "pt"}});
  EXPECT_THROW(
      {
        try {
          load_causal_lm(runtime(), (dir / "split").string(), opt);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("mixes fused"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  refs.erase(std::find_if(refs.begin(), refs.end(), [](const io::TensorRef& r) {
    return r.name == "model.layers.0.mlp.experts.1.down_proj.weight";
  }));
  io::write_safetensors((dir / "split" / "model.safetensors").string(), refs, {{"format", "pt"}});
  try {
    load_causal_lm(runtime(), (dir / "split").string(), opt);
    ADD_FAILURE() << "a checkpoint missing an expert was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.mlp.experts.1.down_proj.weight"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(MoeExperts, AnExpertWithoutTokensGetsAZeroGradient) {
  std::unique_ptr<CausalLm> m = tiny_model("qwen3_moe", DType::F64, 5);
  // Three tokens route six pairs to four experts: some seed leaves an expert of layer 0 without a token.
  for (uint64_t seed = 1; seed < 64; ++seed) {
    const PackedBatch b = random_batch(40, {0, 3}, seed);
    m->zero_grads();
    const LossResult res = m->loss(b, true);
    ASSERT_FALSE(res.expert_load.empty());
    const std::vector<int64_t>& counts = res.expert_load[0].tokens_per_expert;
    const auto it = std::find(counts.begin(), counts.end(), 0);
    if (it == counts.end()) continue;
    const int64_t empty = it - counts.begin();
    SCOPED_TRACE(fmt::format("seed {}, expert {} empty", seed, empty));
    const std::vector<double> gu = to_f64(m->parameter("model.layers.0.mlp.experts.gate_up_proj").grad);
    const std::vector<double> down = to_f64(m->parameter("model.layers.0.mlp.experts.down_proj").grad);
    const int64_t gu_block = 2 * 12 * 16, down_block = 16 * 12;
    double used = 0;
    for (int64_t i = 0; i < int64_t(gu.size()); ++i) {
      if (i / gu_block == empty) EXPECT_EQ(gu[size_t(i)], 0.0);
      else used += std::abs(gu[size_t(i)]);
    }
    for (int64_t i = 0; i < down_block; ++i) EXPECT_EQ(down[size_t(empty * down_block + i)], 0.0);
    EXPECT_GT(used, 0.0);
    expect_gradients_match_finite_differences(*m, b, 1, m->config().router_aux_loss_coef);
    return;
  }
  FAIL() << "no seed left an expert of layer 0 without tokens";
}

TEST(MoeDeterminism, SameBatchGivesBitwiseTheSameResult) {
  for (const char* type : {"qwen3_moe", "qwen3_next"}) {
    SCOPED_TRACE(type);
    std::unique_ptr<CausalLm> m = tiny_model(type, DType::F32, 9);
    const PackedBatch b = random_batch(40, {0, 11, 30}, 2);
    const LossResult r1 = m->loss(b, true);
    std::map<std::string, std::vector<double>> g1;
    for (const Parameter& p : m->parameters()) g1[p.name] = to_f64(p.grad);
    m->zero_grads();
    const LossResult r2 = m->loss(b, true);
    EXPECT_EQ(r1.loss, r2.loss);
    EXPECT_EQ(r1.aux_loss, r2.aux_loss);
    for (const Parameter& p : m->parameters()) EXPECT_EQ(to_f64(p.grad), g1[p.name]) << p.name;
  }
}

// The experts as one batched GEMM over blocks padded to the largest expert's rows (ModelOptions::moe_padded_max_waste
// high) and as grouped GEMMs over the exact rows (0): the same loss, aux loss and gradients (f64; the padding rows
// only add zeros to the weight gradients).
TEST(MoePadded, BatchedExpertGemmsAgreeWithGroupedOnes) {
  for (const char* type : {"qwen3_moe", "qwen3_next", "qwen3_5_moe_text"}) {
    SCOPED_TRACE(type);
    std::unique_ptr<CausalLm> grouped = tiny_model(type, DType::F64, 31, true, 0.0, true);
    std::unique_ptr<CausalLm> padded = tiny_model(type, DType::F64, 31, true, 1e9, true);
    const PackedBatch b = random_batch(40, {0, 17, 40}, 5);
    const LossResult rg = grouped->loss(b, true), rp = padded->loss(b, true);
    EXPECT_NEAR(rp.loss, rg.loss, 1e-12 * std::abs(rg.loss));
    EXPECT_NEAR(rp.aux_loss, rg.aux_loss, 1e-12 * std::abs(rg.aux_loss));
    int64_t compared = 0;
    for (size_t i = 0; i < grouped->parameters().size(); ++i) {
      const Parameter& pg = grouped->parameters()[i];
      const std::vector<double> g = to_f64(pg.grad), q = to_f64(padded->parameters()[i].grad);
      ASSERT_EQ(g.size(), q.size()) << pg.name;
      double scale = 0;
      for (double v : g) scale = std::max(scale, std::abs(v));
      for (size_t j = 0; j < g.size(); ++j) EXPECT_NEAR(q[j], g[j], 1e-12 * scale) << pg.name << "[" << j << "]";
      compared += pg.name.find("experts") != std::string::npos && scale > 0;
    }
    EXPECT_GE(compared, 2) << "the experts' gradients are non-zero and compared";
  }
}

// Training leaves each layer's row groups on the device (the routed grouped GEMMs read them there) and reads the aux
// loss, the loads and the non-finite check once the backward is queued; with ModelOptions::moe_host_groups each layer
// reads its groups at once. Both give the same loss, aux loss, loads and gradients (f64), and the device path's
// reads back do not grow with the number of sparse layers while the host path's do.
TEST(MoeGroupsOnDevice, AgreeWithHostGroupsAndReadBackOnceABatch) {
  for (const char* type : {"qwen3_moe", "qwen3_next", "qwen3_5_moe_text"}) {
    SCOPED_TRACE(type);
    std::unique_ptr<CausalLm> device = tiny_model(type, DType::F64, 41, true, 0.0, false);
    std::unique_ptr<CausalLm> host = tiny_model(type, DType::F64, 41, true, 0.0, true);
    const PackedBatch b = random_batch(40, {0, 13, 40}, 6);
    const LossResult rd = device->loss(b, true), rh = host->loss(b, true);
    EXPECT_EQ(rd.loss, rh.loss);
    EXPECT_GT(rh.aux_loss, 0.0);
    EXPECT_NEAR(rd.aux_loss, rh.aux_loss, 1e-12 * rh.aux_loss);
    ASSERT_EQ(rd.expert_load.size(), rh.expert_load.size());
    ASSERT_FALSE(rh.expert_load.empty());
    for (size_t i = 0; i < rh.expert_load.size(); ++i) {
      EXPECT_EQ(rd.expert_load[i].layer, rh.expert_load[i].layer);
      EXPECT_EQ(rd.expert_load[i].tokens_per_expert, rh.expert_load[i].tokens_per_expert);
    }
    for (size_t i = 0; i < host->parameters().size(); ++i) {
      const std::vector<double> g = to_f64(host->parameters()[i].grad), q = to_f64(device->parameters()[i].grad);
      EXPECT_LT(rel_l2(q, g), 1e-12) << host->parameters()[i].name;
    }
  }
  // qwen3_moe with layer 1 dense: 2 sparse layers of 3, then 5 of 6.
  const PackedBatch b = random_batch(40, {0, 20, 40}, 3);
  for (bool host : {false, true}) {
    std::vector<int64_t> reads;
    for (int64_t layers : {3, 6}) {
      std::unique_ptr<CausalLm> m = tiny_model("qwen3_moe", DType::F32, 5, true, 0.0, host,
                                               {{"num_hidden_layers", layers}});
      const int64_t before = runtime().downloads();
      m->loss(b, true);
      reads.push_back(runtime().downloads() - before);
    }
    if (host) EXPECT_GE(reads[1], reads[0] + 3) << "a wait for each sparse layer";
    else EXPECT_EQ(reads[1], reads[0]) << "no wait inside the pass for the routing";
  }
}

// A non-finite router logit, with the groups on the device: the routing reads it with the loads once the backward is
// queued and refuses the batch, naming the token and the layer, before any update could use its gradients.
TEST(MoeGroupsOnDevice, ANonFiniteRouterLogitIsRefusedAtTheBatchEnd) {
  std::unique_ptr<CausalLm> m = tiny_model("qwen3_moe", DType::F32, 7);
  const PackedBatch b = random_batch(40, {0, 20}, 4);
  for (Parameter& p : m->parameters())
    if (p.name == "model.layers.2.mlp.gate.weight") p.value.data<float>()[0] = std::nanf("");
  try {
    m->loss(b, true);
    ADD_FAILURE() << "a NaN router weight was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("router logit of token 0 is not finite (layer 2's router"), std::string::npos)
        << e.what();
  }
}

// Gradient accumulation over micro-batches: the experts' gradients (added in place from the second micro-batch on,
// by the grouped GEMMs and by the padded batched ones) equal the sum of each micro-batch's own, every parameter's too.
TEST(MoeAccumulation, TwoMicroBatchesAddUpInPlace) {
  for (const auto& [waste, host] : {std::pair{0.0, false}, std::pair{0.0, true}, std::pair{1e9, true}}) {
    for (const char* type : {"qwen3_moe", "qwen3_next"}) {
      SCOPED_TRACE(fmt::format("{}, {}", type, waste > 0 ? "padded" : host ? "grouped, host groups" : "grouped"));
      std::unique_ptr<CausalLm> m = tiny_model(type, DType::F64, 13, true, waste, host);
      const PackedBatch b1 = random_batch(40, {0, 9, 21}, 7), b2 = random_batch(40, {0, 14}, 8);
      std::map<std::string, std::vector<double>> want;
      for (const PackedBatch* b : {&b1, &b2}) {
        m->zero_grads();
        m->loss(*b, true, 0.5);
        for (const Parameter& p : m->parameters()) {
          std::vector<double>& w = want[p.name];
          const std::vector<double> g = to_f64(p.grad);
          if (w.empty()) w.assign(g.size(), 0.0);
          for (size_t i = 0; i < g.size(); ++i) w[i] += g[i];
        }
      }
      m->zero_grads();
      m->loss(b1, true, 0.5);
      m->loss(b2, true, 0.5);
      int64_t experts = 0;
      for (const Parameter& p : m->parameters()) {
        EXPECT_LT(rel_l2(to_f64(p.grad), want[p.name]), 1e-12) << p.name;
        experts += p.name.find("experts") != std::string::npos;
      }
      EXPECT_GT(experts, 0);
    }
  }
}

TEST(MoePacking, DocumentsDoNotSeeEachOther) {
  for (const char* type : {"qwen3_moe", "qwen3_5_moe_text"}) {
    SCOPED_TRACE(type);
    std::unique_ptr<CausalLm> m = tiny_model(type, DType::F64, 13);
    const PackedBatch packed = random_batch(40, {0, 9, 16}, 9);
    const std::vector<double> lp = m->label_logprobs(packed);
    for (int doc = 0; doc < 2; ++doc) {
      const int32_t s = packed.host_cu[size_t(doc)], e = packed.host_cu[size_t(doc) + 1];
      std::vector<int32_t> ids(packed.host_ids.begin() + s, packed.host_ids.begin() + e);
      const std::vector<int32_t> cu = {0, e - s};
      const PackedBatch alone = make_packed_batch(runtime(), Device::cpu(), ids, cu, next_token_labels(ids, cu), 40);
      const std::vector<double> lp_alone = m->label_logprobs(alone);
      for (int32_t i = 0; i < e - s; ++i) EXPECT_NEAR(lp[size_t(s + i)], lp_alone[size_t(i)], 1e-12) << doc << ":" << i;
    }
  }
}

TEST(MoeGenerate, EveryDecodingStepMatchesTheFullForward) {
  // Each family through the rollout engine (qwen3_5_moe and qwen3_next: fused GDN projections, GDN state slots), the
  // prompt prefilled in chunks of 5: each step routes its own rows; every greedy token is the full forward's argmax and
  // its log-probability that row's log-softmax.
  for (const char* type : {"qwen3_moe", "qwen3_5_moe_text", "qwen3_next"}) {
    SCOPED_TRACE(type);
    std::unique_ptr<CausalLm> m = tiny_model(type, DType::F64, 23);
    std::mt19937 rng(4);
    std::vector<int32_t> ids(9);
    for (int32_t& id : ids) id = int32_t(rng() % 40);
    EngineOptions eo;
    eo.max_step_tokens = 5;
    const RolloutResult out = engine_greedy(*m, ids, 6, eo);
    ASSERT_EQ(out.tokens.size(), 6u);
    double worst = 0;
    for (size_t s = 0; s < out.tokens.size(); ++s) {
      const int32_t n = int32_t(ids.size());
      const std::vector<int32_t> cu = {0, n};
      const std::vector<double> full = to_f64(m->logits(make_packed_batch(runtime(), Device::cpu(), ids, cu,
                                                                          next_token_labels(ids, cu), 40)));
      const std::vector<double> row(full.begin() + (n - 1) * 40, full.end());
      const int32_t want = int32_t(std::max_element(row.begin(), row.end()) - row.begin());
      EXPECT_EQ(out.tokens[s], want) << "step " << s;
      worst = std::max(worst, std::abs(out.logprobs[s] - log_softmax_at(row, want)));
      ids.push_back(want);
    }
    std::printf("[%s] decoded log-probabilities against the full forward: worst gap %.2e\n", type, worst);
    EXPECT_LT(worst, 1e-9);
  }
}


// BackwardHooks::grads_done and grads_complete_after agree with the backward in every MoE family (experts, routers,
// shared experts, Gated DeltaNet layers); data-parallel buckets rely on it (parallel/grad_reducer.h).
TEST(MoeBackward, GradientsAreCompleteWhenTheBackwardSaysSo) {
  for (const std::string type : {"qwen3_moe", "qwen3_next", "qwen3_5_moe_text"}) {
    SCOPED_TRACE(type);
    std::unique_ptr<CausalLm> m = tiny_model(type, DType::F64, 3);
    expect_grads_complete_when_reported(*m, random_batch(m->config().vocab_size, {0, 7, 16}, 5));
  }
}
