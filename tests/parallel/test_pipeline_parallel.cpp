// Pipeline parallelism (CausalLm with ModelOptions::pp, model/pipeline_step.h) under mpirun (-np 2 and -np 4 in
// ctest), in f64: each family's tiny four-layer model split into stages — pp 2 and pp 2 x vpp 2 (interleaved, also
// recomputing the activations) at two ranks; pp 4, pp 4 x vpp 2 (eight layers), pp 2 x vpp 2 x dp 2, pp 2 x tp 2,
// pp 2 x cp 2 (Qwen3) and, for the MoE families, pp 2 x ep 2 at four — runs a step of micro-batches through the
// schedule. The reference is the whole model on every rank (the same
// seed: the same draws at any layout), the same micro-batches one after another (under ep each micro-batch joined
// with the ep group's, which route together): each micro-batch's loss, aux loss and expert loads within 1e-12, and
// every gradient (summed over dp and cp; a tied embedding's over the first and last stage; gathered over tp and ep)
// within 1e-10 relative; a
// second run of the step is bitwise equal to the first; forward-only runs give the losses too. Qwen3 (tied head),
// Qwen3-MoE with the aux loss, the Qwen3.5 MoE hybrid and Qwen3-Next. Fails with the routing totals left per stage
// (the aux loss is every layer's: planted, the run stops at the size check), or with the tied embedding's halves not
// summed (planted: the embedding's gradient fails). Also: a save from the stages reads back whole, and loads into
// stages; layouts and micro-batch counts that cannot work are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <unistd.h>
#include <string>

#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "model/config.h"
#include "model/pipeline_step.h"
#include "parallel/grid.h"
#include "support/error_of.h"
#include "support/model_support.h"
#include "support/tp_support.h"

using namespace lathe;
using namespace lathe::test_support;

namespace {

// The four-layer families: Qwen3 with a tied head, Qwen3-MoE (every layer sparse), the Qwen3.5 MoE hybrid (GDN, full
// attention, GDN, full attention) and Qwen3-Next (layer 1's MLP dense).
std::vector<nlohmann::json> pp_configs() {
  nlohmann::json qwen3 = tiny_qwen3(4, 2, 12);
  qwen3["tie_word_embeddings"] = true;
  nlohmann::json moe = tiny_qwen3(4, 2, 12);
  moe["model_type"] = "qwen3_moe";
  add_experts(moe);
  std::vector<nlohmann::json> out = {qwen3, moe, tiny_hybrid("qwen3_5_moe_text", 4, 2, 2, 12),
                                     tiny_hybrid("qwen3_next", 4, 2, 2, 12, true)};
  for (nlohmann::json& j : out) {
    j["num_hidden_layers"] = 4;
    if (j.contains("layer_types"))
      j["layer_types"] = {"linear_attention", "full_attention", "linear_attention", "full_attention"};
  }
  return out;
}

std::unique_ptr<CausalLm> model(const nlohmann::json& config, Communicator* pp, const PipelineLayout& layout,
                                Communicator* tp = nullptr, Communicator* ep = nullptr, Communicator* cp = nullptr,
                                bool recompute = false, bool keeps_attention = false, bool keeps_gdn = false,
                                int64_t recompute_layers = -1) {
  ModelOptions o;
  o.recompute = recompute;
  o.recompute_layers = recompute_layers;
  o.recompute_keeps_attention = keeps_attention;
  o.recompute_keeps_gdn = keeps_gdn;
  o.tp = tp;
  o.ep = ep;
  o.cp = cp;
  o.dtype = DType::F64;
  o.router_aux_loss = true;
  o.pp = pp;
  o.pipeline = layout;
  return random_causal_lm(runtime(), parse_model_config(config, "test"), o, 5, 0.3);
}

// Micro-batch k of a step: documents of varying lengths and counts (a different token count every other one).
std::vector<int32_t> micro_cu(int k) {
  const std::vector<std::vector<int32_t>> cus = {{0, 7, 9, 21}, {0, 13}, {0, 4, 10, 11, 19}, {0, 6, 17}};
  return cus[size_t(k) % cus.size()];
}
PackedBatch micro_batch(int k) { return random_batch(40, micro_cu(k), 300 + uint64_t(k)); }


struct PipelineParallel : ::testing::Test {
  static std::unique_ptr<Communicator> world;
  static void SetUpTestSuite() { world = mpi_world(60); }
  static void TearDownTestSuite() { world.reset(); }
};
std::unique_ptr<Communicator> PipelineParallel::world;

struct Layout {
  int pp, vpp, dp, tp = 1, ep = 1, cp = 1;
  bool recompute = false, keeps_attention = false, keeps_gdn = false;
  int64_t recompute_layers = -1;
};

void expect_pipeline_equals_whole(const nlohmann::json& config, const Layout& lay, Communicator& world) {
  const std::string what = fmt::format(
      "{} at pp {} x vpp {} x dp {} x tp {} x ep {} x cp {}{}{}{}{}", config["model_type"].get<std::string>(), lay.pp,
      lay.vpp, lay.dp, lay.tp, lay.ep, lay.cp, lay.recompute ? ", recomputing" : "",
      lay.recompute_layers >= 0 ? fmt::format(" the first {} layers", lay.recompute_layers) : "",
      lay.keeps_attention ? " (attention kept)" : "", lay.keeps_gdn ? " (GDN kept)" : "");
  const ParallelGrid grid(world.size(), {.tp = lay.tp, .cp = lay.cp, .ep = lay.ep, .dp = lay.dp, .pp = lay.pp});
  const ParallelGrid::Coords me = grid.coords(world.rank());
  const int rank = world.rank();
  const std::unique_ptr<Communicator> pp = world.split(grid.group_index(GroupKind::Pp, rank), me.pp, "pp", nullptr);
  const std::unique_ptr<Communicator> dp = world.split(grid.group_index(GroupKind::Dp, rank), me.dp, "dp", nullptr);
  const std::unique_ptr<Communicator> tp = world.split(grid.group_index(GroupKind::Tp, rank), me.tp, "tp", nullptr);
  const std::unique_ptr<Communicator> ep = world.split(grid.group_index(GroupKind::Ep, rank), me.ep, "ep", nullptr);
  const std::unique_ptr<Communicator> cp = world.split(grid.group_index(GroupKind::Cp, rank), me.cp, "cp", nullptr);
  const int64_t layers = config["num_hidden_layers"].get<int64_t>();
  const PipelineLayout layout(layers, lay.pp, lay.vpp);
  const std::unique_ptr<CausalLm> split = model(config, pp.get(), layout, lay.tp > 1 ? tp.get() : nullptr,
                                                lay.ep > 1 ? ep.get() : nullptr, lay.cp > 1 ? cp.get() : nullptr,
                                                lay.recompute, lay.keeps_attention, lay.keeps_gdn,
                                                lay.recompute_layers);
  const std::unique_ptr<CausalLm> whole = model(config, nullptr, PipelineLayout());
  for (const Parameter& p : split->parameters())  // the same draws at any layout
    EXPECT_EQ(to_f64(split->gathered(p)), to_f64(whole->parameter(p.name).value)) << what << ": " << p.name;
  // Each dp rank its micro-batches. Under ep the dp ranks are the ep group, which routes its ranks' k-th micro-batches
  // together (the aux loss and loads are theirs): there the k-th have the same documents on every rank (equal
  // labelled counts), and the reference is the whole model on them joined, at ep times the scale (the mean of a joined
  // batch is the ranks' means' mean).
  const int per_replica = lay.vpp > 1 ? std::max(2, lay.pp) : 2, all = per_replica * lay.dp;  // (interleaved: k x pp)
  const double scale = 1.0 / double(all);
  const auto batch = [&](int d, int k) {
    return lay.ep > 1 ? random_batch(40, micro_cu(k), 500 + 10 * uint64_t(d) + uint64_t(k)) : micro_batch(d * per_replica + k);
  };
  std::vector<PackedBatch> mine;
  for (int k = 0; k < per_replica; ++k) mine.push_back(batch(me.dp, k));
  std::vector<LossResult> want;
  whole->zero_grads();
  if (lay.ep == 1) {
    for (int k = 0; k < all; ++k) want.push_back(whole->loss(micro_batch(k), true, scale));
  } else {
    for (int k = 0; k < per_replica; ++k) {
      std::vector<PackedBatch> parts;
      for (int d = 0; d < lay.dp; ++d) parts.push_back(batch(d, k));
      want.push_back(whole->loss(joined_batch(parts, 40), true, scale * lay.ep));
    }
  }

  std::vector<std::vector<double>> first_run;
  for (int run = 0; run < 2; ++run) {
    split->zero_grads();
    std::vector<LossResult> got = run_pipeline(*split, mine, true, scale);
    broadcast_losses(*split, got);
    sum_tied_embedding_grads(*split);
    for (int k = 0; k < per_replica; ++k) {
      const LossResult& w = want[size_t(lay.ep > 1 ? k : me.dp * per_replica + k)];
      double loss_sum = got[size_t(k)].loss_sum;
      if (lay.ep > 1) {  // the joined batch's: every rank's rows
        Tensor t = runtime().from_host(&loss_sum, {1}, DType::F64, Device::cpu());
        dp->all_reduce(t).wait();
        loss_sum = t.data<double>()[0];
      }
      EXPECT_NEAR(loss_sum, w.loss_sum, 1e-12 * std::abs(w.loss_sum)) << what << " micro " << k;
      EXPECT_NEAR(got[size_t(k)].aux_loss, w.aux_loss, 1e-12 * std::abs(w.aux_loss)) << what << " micro " << k;
      ASSERT_EQ(got[size_t(k)].expert_load.size(), w.expert_load.size()) << what;
      for (size_t l = 0; l < w.expert_load.size(); ++l)
        EXPECT_EQ(got[size_t(k)].expert_load[l].tokens_per_expert, w.expert_load[l].tokens_per_expert) << what;
    }
    split->sum_replicated_grads();
    std::vector<std::vector<double>> grads;
    for (Parameter& p : split->parameters()) {
      ASSERT_TRUE(p.grad.defined()) << what << ": " << p.name;
      if (p.shard.group != "ep") dp->all_reduce(p.grad).wait();  // an expert's: its ep rank's (one replica here)
      if (lay.cp > 1) cp->all_reduce(p.grad).wait();  // each cp rank's rows' part
      grads.push_back(to_f64(split->gathered(p, true)));
      EXPECT_LT(rel_l2(grads.back(), to_f64(whole->parameter(p.name).grad)), 1e-10) << what << ": " << p.name;
    }
    if (run == 0) first_run = grads;
    else EXPECT_EQ(grads, first_run) << what << ": a second run of the step is not bitwise equal";
  }
  // Every parameter is held by one stage (a tied embedding by the first and the last).
  double held = double(split->parameters().size());
  Tensor count = runtime().from_host(&held, {1}, DType::F64, Device::cpu());
  pp->all_reduce(count).wait();
  const bool tied = config.value("tie_word_embeddings", false);
  EXPECT_EQ(count.data<double>()[0], double(whole->parameters().size() + (tied && lay.pp > 1 ? 1 : 0))) << what;

  std::vector<LossResult> eval = run_pipeline(*split, mine, false, 1.0);  // forward only
  broadcast_losses(*split, eval);
  for (int k = 0; k < per_replica; ++k) {
    const LossResult w = whole->loss(mine[size_t(k)], false);
    EXPECT_NEAR(eval[size_t(k)].loss, w.loss, 1e-12 * w.loss) << what << " forward only, micro " << k;
  }
}

TEST_F(PipelineParallel, EveryLayoutEqualsTheWholeModel) {
  const int n = world->size();
  Layout recomputing{2, 2, 1};  // the layers' activations recomputed in the backward from their kept inputs
  recomputing.recompute = true;
  // and the attention outputs and delta rule results kept from the forward (train.recompute_keeps_attention, _gdn)
  Layout keeping = recomputing;
  keeping.keeps_attention = keeping.keeps_gdn = true;
  Layout keeping_cp{2, 1, 1, 1, 1, 2};  // the same over context-parallel ranks
  keeping_cp.recompute = keeping_cp.keeps_attention = keeping_cp.keeps_gdn = true;
  // only the model's first three layers recomputing (train.recompute_layers): a stage of each kind, and one of both
  Layout keeping_some = keeping;
  keeping_some.recompute_layers = 3;
  const std::vector<Layout> layouts = n == 2 ? std::vector<Layout>{{2, 1, 1}, {2, 2, 1}, recomputing, keeping,
                                                                   keeping_some}
                                             : std::vector<Layout>{{4, 1, 1}, {2, 2, 2}, {2, 1, 1, 2, 1}};
  for (const nlohmann::json& config : pp_configs()) {
    for (const Layout& lay : layouts) expect_pipeline_equals_whole(config, lay, *world);
    if (n == 4) {  // pp 4 x vpp 2: eight stages of the model doubled to eight layers
      nlohmann::json deep = config;
      deep["num_hidden_layers"] = 8;
      if (config.contains("layer_types"))
        for (const auto& t : config["layer_types"]) deep["layer_types"].push_back(t);
      expect_pipeline_equals_whole(deep, {4, 2, 1}, *world);
    }
    if (n == 4 && config.value("num_experts", 0) > 0) expect_pipeline_equals_whole(config, {2, 1, 2, 1, 2}, *world);
    if (n == 4 && config.value("num_experts", 0) == 0)
      for (const Layout& lay : {Layout{2, 1, 1, 1, 1, 2}, keeping_cp})
        expect_pipeline_equals_whole(config, lay, *world);
  }
}

// Decoding through the stages (CausalLm::last_logits under pp: each step's rows stage to stage, the last stage's logits
// broadcast): the rollout engine at pp = the world size, and at pp 2 x vpp 2 on two ranks, decodes three requests of
// different prompt lengths batched (prefill chunks, then one token a sequence) as the whole model does: the same
// greedy tokens, each log-probability within 1e-10; and two sampled requests (temperature 1, seeded) draw the same
// tokens. Every family (the hybrid's conv and delta-rule states, the experts routed while decoding).
TEST_F(PipelineParallel, DecodingThroughStagesEqualsTheWholeModel) {
  const int n = world->size();
  for (const nlohmann::json& config : pp_configs()) {
    for (const int vpp : n == 2 ? std::vector<int>{1, 2} : std::vector<int>{1}) {
      const std::string what = fmt::format("{} at pp {} x vpp {}", config["model_type"].get<std::string>(), n, vpp);
      const std::unique_ptr<CausalLm> whole = model(config, nullptr, PipelineLayout());
      const std::unique_ptr<CausalLm> split = model(config, world.get(), PipelineLayout(4, n, vpp));
      const auto decode = [&](CausalLm& m, bool sample) {
        RolloutEngine engine(runtime(), m, {});
        const std::vector<std::vector<int32_t>> prompts = {{3, 9, 14, 2, 27}, {5}, {8, 1, 30, 7, 7, 12, 4, 19, 2}};
        for (size_t i = 0; i < prompts.size(); ++i) {
          RolloutRequest r;
          r.prompt = prompts[i];
          r.max_new_tokens = 6 + int64_t(i);
          if (sample) r.sampling.temperature = 1.0, r.seed = 40 + i;
          engine.submit(r);
        }
        std::vector<RolloutResult> out = engine.run();
        std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.request < b.request; });
        return out;
      };
      for (bool sample : {false, true}) {
        const std::vector<RolloutResult> want = decode(*whole, sample), got = decode(*split, sample);
        ASSERT_EQ(got.size(), want.size()) << what;
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_EQ(got[i].tokens, want[i].tokens) << what << (sample ? ", sampled" : "") << ", request " << i;
          ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size()) << what;
          for (size_t t = 0; t < want[i].logprobs.size(); ++t)
            EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], 1e-10) << what << ", request " << i << " token " << t;
        }
      }
    }
  }
}

// A model saved from the stages (every stage sends the first its tensors, which writes one HF folder) reads back as
// the whole model; loading that folder at a pp layout gives each stage its own tensors (and refuses none of the
// others'). The Qwen3.5 hybrid, at pp = the world size.
TEST_F(PipelineParallel, SavedStagesReadBackWholeAndLoadIntoStages) {
  const int n = world->size();
  const nlohmann::json config = pp_configs()[2];
  const PipelineLayout layout(4, n, 1);
  const std::unique_ptr<CausalLm> split = model(config, world.get(), layout);
  const std::unique_ptr<CausalLm> whole = model(config, nullptr, PipelineLayout());
  const double pid = double(getpid());
  Tensor first = runtime().from_host(&pid, {1}, DType::F64, Device::cpu());
  world->broadcast(first, 0).wait();  // rank 0's process id names the folder for every rank
  const std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("lathe_pp_save_{}", int64_t(first.data<double>()[0]))).string();
  split->save(dir, DType::F32);
  world->barrier();
  ModelOptions o;
  o.dtype = DType::F64;
  const std::unique_ptr<CausalLm> back = load_causal_lm(runtime(), dir, o);
  ASSERT_EQ(back->parameters().size(), whole->parameters().size());
  for (size_t i = 0; i < whole->parameters().size(); ++i)
    EXPECT_LT(rel_l2(to_f64(back->parameters()[i].value), to_f64(whole->parameters()[i].value)), 1e-6)
        << back->parameters()[i].name;  // f32 on disk
  o.pp = world.get();
  o.pipeline = layout;
  const std::unique_ptr<CausalLm> staged = load_causal_lm(runtime(), dir, o);
  ASSERT_EQ(staged->parameters().size(), split->parameters().size());
  for (const Parameter& p : staged->parameters())
    EXPECT_EQ(to_f64(p.value), to_f64(back->parameter(p.name).value)) << p.name;
  world->barrier();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

TEST_F(PipelineParallel, RefusesWhatItCannotSchedule) {
  const int n = world->size();
  const std::string wrong_size = error_of([&] { model(pp_configs()[0], world.get(), PipelineLayout(4, n / 2, 1)); });
  EXPECT_NE(wrong_size.find("is not one for " + std::to_string(n) + " ranks"), std::string::npos) << wrong_size;
  if (n != 2) return;  // three micro-batches on the interleaved pp 2 x vpp 2
  const std::unique_ptr<CausalLm> m = model(pp_configs()[0], world.get(), PipelineLayout(4, 2, 2));
  const std::string odd = error_of([&] { run_pipeline(*m, {micro_batch(0), micro_batch(1), micro_batch(2)}, true, 1.0); });
  EXPECT_NE(odd.find("3 micro-batches (train.grad_accum) are not a multiple of it"), std::string::npos) << odd;
}

}  // namespace
