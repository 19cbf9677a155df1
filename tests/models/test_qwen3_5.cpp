// Qwen3.5 text model: parity with Hugging Face fixtures (logits, loss, every parameter gradient on a packed batch of
// three documents; written by dev/ref/qwen3_5_fixtures.py, text-only and multimodal layouts), the whole-model
// gradient against finite differences in f64 (independent of the fixtures), packing isolation, recomputation
// invariance, save/load round trips in both layouts, and config/loader errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "backend/profiler.h"
#include "io/safetensors.h"
#include "model/qwen3_5.h"
#include "ops/ops.h"
#include "support/model_support.h"

using namespace lathe;
using namespace lathe::test_support;
namespace fs = std::filesystem;

namespace {

// 3 layers (GDN, full, GDN) unless `types` says otherwise; H_v = 2 H_k; head_dim 16 with partial rotary 0.25.
nlohmann::json tiny_json(bool tied, std::vector<std::string> types = {"linear_attention", "full_attention",
                                                                       "linear_attention"}) {
  return {{"model_type", "qwen3_5_text"}, {"vocab_size", 40}, {"hidden_size", 16}, {"intermediate_size", 24},
          {"num_hidden_layers", int64_t(types.size())}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
          {"head_dim", 16}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", tied}, {"layer_types", types},
          {"linear_num_key_heads", 1}, {"linear_num_value_heads", 2}, {"linear_key_head_dim", 8},
          {"linear_value_head_dim", 6}, {"linear_conv_kernel_dim", 4},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.25}}}};
}

const fs::path kFixtures = fs::path(LATHE_TEST_DATA_DIR) / "models" / "fixtures" / "qwen3_5";

}  // namespace

TEST(Qwen35Parity, MatchesTransformersFixtures) {
  ASSERT_TRUE(fs::exists(kFixtures)) << "fixtures missing: " << kFixtures
                                     << " (generate them on the GPU machine: python3 dev/ref/qwen3_5_fixtures.py "
                                        "tests/models/fixtures/qwen3_5)";
  int checked = 0;
  bool saw_multimodal = false;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    if (!entry.is_directory()) continue;
    SCOPED_TRACE(entry.path().filename().string());
    const io::SafetensorsFile ref = io::SafetensorsFile::open((entry.path() / "reference.safetensors").string());
    for (const auto& [dtype, recompute] : {std::pair{DType::F32, false}, std::pair{DType::F32, true}, std::pair{DType::F64, false}}) {
      SCOPED_TRACE(fmt::format("{} recompute={}", dtype_name(dtype), recompute));
      ModelOptions opt;
      opt.dtype = dtype;
      opt.recompute = recompute;
      opt.loss_chunk_rows = recompute ? 5 : 1024;
      Qwen35Model m = Qwen35Model::load(runtime(), (entry.path() / "model").string(), opt);
      saw_multimodal |= m.config().multimodal_layout;
      const PackedBatch b = make_packed_batch(runtime(), Device::cpu(), read_i32(ref, "input_ids"),
                                              read_i32(ref, "cu_seqlens"), read_i32(ref, "labels"), m.config().vocab_size);
      // The goldens are f64 values stored as f32. f64 is the exactness check (1e-6). In f32, gradients of the
      // per-head GDN scalars (A_log, dt_bias) and of norm gains sum thousands of terms: transformers' own float32 run
      // is 1.2e-5 to 2.2e-5 (rel-L2) from the goldens (dev/ref/qwen3_5_fixtures.py's log), so f32 gradients get 5e-5.
      const double tol = dtype == DType::F64 ? 1e-6 : 1e-5;
      const double grad_tol = dtype == DType::F64 ? 1e-6 : 5e-5;
      EXPECT_LT(rel_l2(to_f64(m.logits(b)), ref.read_as_f32("logits")), tol);
      const LossResult r = m.loss(b, /*backward=*/true);
      const double want = ref.read_as_f32("loss")[0];
      EXPECT_NEAR(r.loss, want, tol * std::abs(want));
      for (const Parameter& p : m.parameters()) {
        ASSERT_TRUE(p.grad.defined()) << p.name;
        const std::string key = "grad." + p.name;
        ASSERT_NE(ref.find(key), nullptr) << "fixture has no " << key;
        EXPECT_LT(rel_l2(to_f64(p.grad), ref.read_as_f32(key)), grad_tol) << p.name;
      }
    }
    ++checked;
  }
  EXPECT_GE(checked, 4) << "expected several fixture configs";
  EXPECT_TRUE(saw_multimodal) << "expected one fixture in the multimodal (model.language_model.*) layout";
}

TEST(Qwen35Gradient, WholeModelMatchesFiniteDifferencesInF64) {
  ModelOptions opt;
  opt.dtype = DType::F64;
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    Qwen35Model m = Qwen35Model::random(runtime(), parse_model_config(tiny_json(tied), "tiny"), opt, tied ? 8 : 7, 0.3);
    // Non-trivial norm weights and gates so that every gradient is exercised away from its initial value.
    std::mt19937 init(5);
    for (Parameter& p : m.parameters())
      if (p.value.dim() == 1)
        for (int64_t i = 0; i < p.value.numel(); ++i)
          p.value.data<double>()[i] += 0.2 * (double(init() % 1000) / 1000.0 - 0.5);
    const PackedBatch b = random_batch(40, {0, 6, 7, 15}, 3);
    m.loss(b, true);
    expect_gradients_match_finite_differences(m, b, 3);
  }
}

TEST(Qwen35Packing, DocumentsDoNotSeeEachOther) {
  ModelOptions opt;
  opt.dtype = DType::F64;
  Qwen35Model m = Qwen35Model::random(runtime(), parse_model_config(tiny_json(true), "tiny"), opt, 5, 0.3);
  const PackedBatch packed = random_batch(40, {0, 9, 16}, 9);
  const std::vector<double> lp = m.label_logprobs(packed);
  for (int doc = 0; doc < 2; ++doc) {
    const int32_t s = packed.host_cu[size_t(doc)], e = packed.host_cu[size_t(doc) + 1];
    std::vector<int32_t> ids(packed.host_ids.begin() + s, packed.host_ids.begin() + e);
    const std::vector<int32_t> cu = {0, e - s};
    const PackedBatch alone = make_packed_batch(runtime(), Device::cpu(), ids, cu, next_token_labels(ids, cu), 40);
    const std::vector<double> lp_alone = m.label_logprobs(alone);
    for (int32_t i = 0; i < e - s; ++i) EXPECT_NEAR(lp[size_t(s + i)], lp_alone[size_t(i)], 1e-12) << doc << ":" << i;
  }
  // Gradients of the packed batch = the sum of each document's gradients (each scaled by its share of labels).
  m.loss(packed, true);
  std::vector<std::vector<double>> packed_grads;
  for (const Parameter& p : m.parameters()) packed_grads.push_back(to_f64(p.grad));
  m.zero_grads();
  for (int doc = 0; doc < 2; ++doc) {
    const int32_t s = packed.host_cu[size_t(doc)], e = packed.host_cu[size_t(doc) + 1];
    std::vector<int32_t> ids(packed.host_ids.begin() + s, packed.host_ids.begin() + e);
    const std::vector<int32_t> cu = {0, e - s};
    const PackedBatch alone = make_packed_batch(runtime(), Device::cpu(), ids, cu, next_token_labels(ids, cu), 40);
    m.loss(alone, true, double(alone.num_labelled) / double(packed.num_labelled));
  }
  for (size_t i = 0; i < packed_grads.size(); ++i) {
    const std::vector<double> g = to_f64(m.parameters()[i].grad);
    for (size_t j = 0; j < g.size(); ++j)
      ASSERT_NEAR(g[j], packed_grads[i][j], 1e-12 + 1e-9 * std::abs(g[j])) << m.parameters()[i].name << "[" << j << "]";
  }
}

TEST(Qwen35Recompute, SameLossAndGradients) {
  const ModelConfig cfg = parse_model_config(tiny_json(false), "tiny");
  ModelOptions a, b;
  a.dtype = b.dtype = DType::F64;
  b.recompute = true;
  b.loss_chunk_rows = 3;
  Qwen35Model ma = Qwen35Model::random(runtime(), cfg, a, 3, 0.3), mb = Qwen35Model::random(runtime(), cfg, b, 3, 0.3);
  const PackedBatch batch = random_batch(40, {0, 5, 14}, 2);
  EXPECT_NEAR(ma.loss(batch, true).loss, mb.loss(batch, true).loss, 1e-13);
  for (size_t i = 0; i < ma.parameters().size(); ++i) {
    const std::vector<double> ga = to_f64(ma.parameters()[i].grad), gb = to_f64(mb.parameters()[i].grad);
    for (size_t j = 0; j < ga.size(); ++j) ASSERT_NEAR(ga[j], gb[j], 1e-13 + 1e-11 * std::abs(ga[j])) << ma.parameters()[i].name;
  }
}

namespace {

// One training pass under train.recompute, keeping the attention outputs and / or the delta rule results: its loss,
// every gradient and how often the attention and delta rule kernels ran.
struct RecomputeRun {
  double loss = 0;
  std::vector<std::vector<double>> grads;
  int64_t attention_calls = 0, rule_calls = 0;
};
RecomputeRun recompute_run(const std::vector<std::string>& layers, bool keeps_attention, bool keeps_gdn,
                           int64_t recompute_layers = -1, bool recompute = true) {
  ModelOptions o;
  o.dtype = DType::F64;
  o.recompute = recompute;
  o.recompute_layers = recompute_layers;
  o.recompute_keeps_attention = keeps_attention;
  o.recompute_keeps_gdn = keeps_gdn;
  Qwen35Model m = Qwen35Model::random(runtime(), parse_model_config(tiny_json(false, layers), "tiny"), o, 3, 0.3);
  OpProfiler prof(runtime().backend(DeviceType::CPU), Device::cpu());
  runtime().set_profiler(&prof);
  RecomputeRun r;
  r.loss = m.loss(random_batch(40, {0, 5, 14}, 2), true).loss;
  runtime().set_profiler(nullptr);
  for (const OpProfiler::Total& t : prof.collect().kernels) {
    if (t.op == OpId::attention) r.attention_calls += t.calls;
    if (t.op == OpId::gated_delta_rule) r.rule_calls += t.calls;
  }
  for (const Parameter& p : m.parameters()) r.grads.push_back(to_f64(p.grad));
  return r;
}

void expect_same_pass(const RecomputeRun& got, const RecomputeRun& want) {
  EXPECT_EQ(got.loss, want.loss);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i) EXPECT_EQ(got.grads[i], want.grads[i]) << "parameter " << i;
}

}  // namespace

// train.recompute_keeps_attention: the backward's recompute takes each attention layer's output from the forward,
// so a training step runs the attention kernel once a layer (twice under plain recompute), with the same loss and
// gradients bitwise (the kept outputs are the ones the recompute would make: a stale or wrong one changes them).
TEST(Qwen35Recompute, KeptAttentionIsUsedAndChangesNothing) {
  const std::vector<std::string> layers = {"linear_attention", "full_attention", "full_attention", "linear_attention"};
  const RecomputeRun plain = recompute_run(layers, false, false), kept = recompute_run(layers, true, false);
  EXPECT_EQ(plain.attention_calls, 4);  // two attention layers, each run again by the backward
  EXPECT_EQ(kept.attention_calls, 2);
  EXPECT_EQ(kept.rule_calls, plain.rule_calls);
  expect_same_pass(kept, plain);
}

// train.recompute_keeps_gdn: the same for each Gated DeltaNet layer's delta rule results (output, chunk-start states,
// chunk cache): the rule runs once a layer; with both options, both kinds of layer keep theirs.
TEST(Qwen35Recompute, KeptDeltaRuleIsUsedAndChangesNothing) {
  const std::vector<std::string> layers = {"linear_attention", "full_attention", "linear_attention",
                                           "linear_attention"};
  const RecomputeRun plain = recompute_run(layers, false, false), kept = recompute_run(layers, false, true),
                     both = recompute_run(layers, true, true);
  EXPECT_EQ(plain.rule_calls, 6);  // three Gated DeltaNet layers, each run again by the backward
  EXPECT_EQ(kept.rule_calls, 3);
  EXPECT_EQ(kept.attention_calls, 2);  // the attention layer's outputs not kept: run again
  EXPECT_EQ(both.rule_calls, 3);
  EXPECT_EQ(both.attention_calls, 1);
  expect_same_pass(kept, plain);
  expect_same_pass(both, plain);
}

// train.recompute_layers: only the model's first N layers recompute, the others keep their activations: the kernels
// run again for those N only (none at N = 0, as without recompute), with the same loss and gradients bitwise; with
// both keeping options the recomputing layers keep their kernels' outputs, the others nothing beside their activations.
TEST(Qwen35Recompute, OnlyTheFirstLayersRecompute) {
  const std::vector<std::string> layers = {"linear_attention", "full_attention", "linear_attention", "full_attention"};
  const RecomputeRun plain = recompute_run(layers, false, false), none = recompute_run(layers, false, false, -1, false);
  EXPECT_EQ(plain.rule_calls, 4);
  EXPECT_EQ(plain.attention_calls, 4);
  EXPECT_EQ(none.rule_calls, 2);
  for (const int64_t n : {0, 1, 2, 3, 4}) {
    SCOPED_TRACE(fmt::format("recompute_layers {}", n));
    const RecomputeRun some = recompute_run(layers, false, false, n);
    EXPECT_EQ(some.rule_calls, 2 + (n >= 1) + (n >= 3));  // layers 0 and 2 are Gated DeltaNet's
    EXPECT_EQ(some.attention_calls, 2 + (n >= 2) + (n >= 4));
    expect_same_pass(some, plain);
    const RecomputeRun kept = recompute_run(layers, true, true, n);
    EXPECT_EQ(kept.rule_calls, 2);
    EXPECT_EQ(kept.attention_calls, 2);
    expect_same_pass(kept, plain);
  }
  expect_same_pass(none, plain);
}

TEST(Qwen35Checkpoint, SaveThenLoadInBothLayouts) {
  for (bool multimodal : {false, true}) {
    SCOPED_TRACE(multimodal ? "multimodal" : "text");
    nlohmann::json j = tiny_json(false);
    if (multimodal) {
      nlohmann::json text = j;
      j = {{"model_type", "qwen3_5"}, {"text_config", text}, {"vision_config", {{"depth", 1}}}, {"image_token_id", 3},
           {"tie_word_embeddings", false}};
    }
    Qwen35Model m = Qwen35Model::random(runtime(), parse_model_config(j, "cfg"), {}, 21, 0.2);
    EXPECT_EQ(m.parameters().front().name, multimodal ? "model.language_model.embed_tokens.weight" : "model.embed_tokens.weight");
    const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_q35_save_{}_{}", getpid(), int(multimodal));
    m.save(dir.string());
    if (multimodal) {
      // Add a vision tensor and an MTP tensor, as released checkpoints have: loaded aside, written back.
      const io::SafetensorsFile f = io::SafetensorsFile::open((dir / "model.safetensors").string());
      std::vector<std::vector<uint8_t>> bytes;
      std::vector<io::TensorRef> refs;
      for (const io::SafetensorsTensor& t : f.tensors()) {
        bytes.emplace_back(t.data, t.data + t.byte_size());
        refs.push_back({t.name, t.dtype, t.shape, bytes.back().data(), bytes.back().size()});
      }
      const std::vector<float> extra = {1.5f, -2.0f, 3.25f};
      refs.push_back({"model.visual.patch_embed.proj.weight", DType::F32, {3}, extra.data(), 12});
      refs.push_back({"mtp.fc.weight", DType::F32, {3}, extra.data(), 12});
      io::write_safetensors((dir / "model.safetensors").string(), refs, {{"format", "pt"}});
    }
    Qwen35Model back = Qwen35Model::load(runtime(), dir.string(), {});
    EXPECT_EQ(back.config().multimodal_layout, multimodal);
    const PackedBatch b = random_batch(40, {0, 10}, 4);
    EXPECT_EQ(to_f64(m.logits(b)), to_f64(back.logits(b)));
    if (multimodal) {
      const fs::path again = dir.string() + "_again";
      back.save(again.string());
      const io::SafetensorsFile f = io::SafetensorsFile::open((again / "model.safetensors").string());
      ASSERT_NE(f.find("model.visual.patch_embed.proj.weight"), nullptr);
      EXPECT_EQ(f.read_as_f32("model.visual.patch_embed.proj.weight"), (std::vector<float>{1.5f, -2.0f, 3.25f}));
      ASSERT_NE(f.find("mtp.fc.weight"), nullptr);
      nlohmann::json cfg = nlohmann::json::parse(std::ifstream(again / "config.json"));
      EXPECT_EQ(cfg["model_type"], "qwen3_5");
      EXPECT_TRUE(cfg.contains("text_config"));
      fs::remove_all(again);
    }
    fs::remove_all(dir);
  }
}

TEST(Qwen35Checkpoint, MissingOrUnexpectedTensorsAreClearErrors) {
  Qwen35Model m = Qwen35Model::random(runtime(), parse_model_config(tiny_json(true), "tiny"), {}, 1, 0.2);
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_q35_bad_{}", getpid());
  m.save(dir.string());
  nlohmann::json cfg = m.config().raw;
  cfg["layer_types"] = {"full_attention", "full_attention", "linear_attention"};
  std::ofstream(dir / "config.json") << cfg.dump();
  try {
    Qwen35Model::load(runtime(), dir.string(), {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'model.layers.0.self_attn.q_proj.weight' is missing"), std::string::npos)
        << e.what();
  }
  cfg["layer_types"] = m.config().raw["layer_types"];
  cfg["linear_value_head_dim"] = 4;
  std::ofstream(dir / "config.json") << cfg.dump();
  try {
    Qwen35Model::load(runtime(), dir.string(), {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("but the config implies"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Qwen35Config, FieldsDefaultsNotesAndRefusals) {
  // layer_types derived from full_attention_interval; partial rotary inside rope_parameters or at the top level.
  nlohmann::json j = tiny_json(true);
  j.erase("layer_types");
  j["num_hidden_layers"] = 8;
  j["full_attention_interval"] = 4;
  ModelConfig c = parse_model_config(j, "a");
  EXPECT_EQ(c.layer_types, (std::vector<std::string>{"linear_attention", "linear_attention", "linear_attention",
                                                     "full_attention", "linear_attention", "linear_attention",
                                                     "linear_attention", "full_attention"}));
  EXPECT_EQ(c.rotary_dim(), 4);
  EXPECT_EQ(c.rope_theta, 10000.0);
  nlohmann::json top = tiny_json(true);
  top["rope_parameters"].erase("partial_rotary_factor");
  top["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(parse_model_config(top, "b").rotary_dim(), 8);
  nlohmann::json dflt = tiny_json(true);
  dflt["rope_parameters"].erase("partial_rotary_factor");
  EXPECT_EQ(parse_model_config(dflt, "c").partial_rotary_factor, 0.25);  // transformers' default
  // Released-config fields: MTP and cache dtype are reported, mrope sections accepted with a note.
  nlohmann::json rel = tiny_json(false);
  rel["mtp_num_hidden_layers"] = 1;
  rel["mtp_use_dedicated_embeddings"] = false;
  rel["mamba_ssm_dtype"] = "float32";
  rel["attn_output_gate"] = true;
  rel["rope_parameters"]["mrope_section"] = {11, 11, 10};
  rel["rope_parameters"]["mrope_interleaved"] = true;
  const ModelConfig r = parse_model_config(rel, "d");
  auto has_note = [&](const ModelConfig& m, const std::string& s) {
    return std::any_of(m.notes.begin(), m.notes.end(), [&](const std::string& n) { return n.find(s) != std::string::npos; });
  };
  EXPECT_TRUE(has_note(r, "mtp_num_hidden_layers")) << fmt::format("{}", fmt::join(r.notes, " | "));
  EXPECT_TRUE(has_note(r, "mamba_ssm_dtype"));
  EXPECT_TRUE(has_note(r, "mrope_section"));
  // Multimodal: the text_config is the model, the vision tower is reported.
  nlohmann::json mm = {{"model_type", "qwen3_5"}, {"text_config", tiny_json(true)}, {"vision_config", {{"depth", 2}}}};
  const ModelConfig mc = parse_model_config(mm, "e");
  EXPECT_TRUE(mc.multimodal_layout);
  EXPECT_TRUE(mc.tie_word_embeddings);
  EXPECT_TRUE(has_note(mc, "vision tower"));
  EXPECT_GT(mc.parameter_count(), 0);

  nlohmann::json bad = tiny_json(true);
  bad["attn_output_gate"] = false;
  expect_refused(bad, "attn_output_gate");
  bad = tiny_json(true);
  bad["num_experts"] = 8;
  expect_refused(bad, "num_experts");
  bad = tiny_json(true);
  bad["layer_types"] = {"linear_attention"};
  expect_refused(bad, "layer_types must be a list of num_hidden_layers = 3");
  bad = tiny_json(true);
  bad["layer_types"][1] = "sliding_attention";
  expect_refused(bad, "sliding_attention");
  bad = tiny_json(true);
  bad["linear_num_value_heads"] = 3;
  bad["linear_num_key_heads"] = 2;
  expect_refused(bad, "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2");
  bad = tiny_json(true);
  bad["partial_rotary_factor"] = 0.5;
  expect_refused(bad, "partial_rotary_factor 0.5 and rope_parameters.partial_rotary_factor 0.25 disagree");
  bad = tiny_json(true);
  bad["rope_parameters"]["rope_type"] = "yarn";
  expect_refused(bad, "rope_type 'yarn' is not supported");
  bad = tiny_json(true);
  bad["hidden_act"] = "gelu";
  expect_refused(bad, "hidden_act 'gelu'");
  expect_refused({{"model_type", "qwen3_5"}}, "needs a 'text_config' object");
  expect_refused({{"model_type", "qwen3_5"}, {"text_config", tiny_json(true)}, {"tie_word_embeddings", false}},
                 "tie_word_embeddings false and text_config.tie_word_embeddings true disagree");
  expect_refused({{"model_type", "qwen3_5_moe"}}, "a qwen3_5_moe (multimodal) config needs a 'text_config' object");
  expect_refused({{"model_type", "qwen3_vl"}}, "model_type 'qwen3_vl' is not supported");
}

// BackwardHooks::grads_done and grads_complete_after agree with the backward (Gated DeltaNet and gated attention
// layers, tied and untied).
TEST(Qwen35Backward, GradientsAreCompleteWhenTheBackwardSaysSo) {
  for (const bool tied : {true, false}) {
    Qwen35Model m = Qwen35Model::random(runtime(), parse_model_config(tiny_json(tied), "tiny"), {}, 5, 0.3);
    expect_grads_complete_when_reported(m, random_batch(m.config().vocab_size, {0, 9, 16}, 4));
  }
}
