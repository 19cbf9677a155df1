// Tensor parallelism of the Qwen3, Qwen3-MoE, Qwen3.5 (dense and MoE) and Qwen3-Next layers (CausalLm with
// ModelOptions::tp; the hybrids with H_v = 2 H_k, Qwen3-Next through its fused projections; mixture-of-experts blocks
// whole on every rank) under mpirun (-np 2 and -np 4 in ctest):
// every rank holds a slice of each layer, and the whole model on every rank is the reference. In f64, against
// that reference: the slices joined (gathered) equal its parameters; the logits and the loss of a packed batch of
// three documents agree within 1e-12 relative; every gradient, joined, within 1e-10 relative; the rollout engine's
// greedy tokens over the sliced layers (local heads in the paged cache) are the reference's and its log-probabilities
// within 1e-10; a model saved from the slices reads back as the reference; with more ranks than key/value heads each
// kv head is shared by the ranks that read it (their gradient parts summed); layouts the heads do not divide, and
// families not built yet, are refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <span>
#include <string>
#include <unistd.h>

#include "backend/profiler.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "model/config.h"
#include "model/lora.h"
#include "support/lora_support.h"
#include "support/model_support.h"
#include "support/tp_support.h"

using namespace lathe;
using namespace lathe::test_support;

namespace {

// A family's tiny config for n ranks: two query heads a rank, key/value heads kv_per_rank x n (rounded up to one),
// 12 MLP columns a rank, one GDN key head a rank. "qwen3_next_moe": Qwen3-Next with sparse layers.
nlohmann::json tiny_config(const std::string& family, int n, double kv_per_rank) {
  const int kv = std::max(1, int(kv_per_rank * n));
  if (family == "qwen3") return tiny_qwen3(2 * n, kv, 12 * n);
  if (family == "qwen3_moe") {
    nlohmann::json j = tiny_qwen3(2 * n, kv, 12 * n);
    j["model_type"] = "qwen3_moe";
    add_experts(j);
    return j;
  }
  if (family == "qwen3_next_moe") return tiny_hybrid("qwen3_next", 2 * n, kv, n, 12 * n, true);
  return tiny_hybrid(family, 2 * n, kv, n, 12 * n);
}

// Parameters split over the ranks: Qwen3 q, k, v, o, gate, up, down a layer; the hybrids' attention layer the same,
// a GDN layer in_proj_qkv (three sections), z, b, a (Qwen3-Next: in_proj_qkvz, in_proj_ba), the conv (three
// sections), A_log, dt_bias, out_proj, and a dense MLP's three. Mixture-of-experts blocks are whole on every rank.
int split_tensors(const std::string& family) {
  if (family == "qwen3") return 2 * 7;
  if (family == "qwen3_moe") return 2 * 4;
  if (family == "qwen3_5_moe_text") return 4 + 2 * 8;
  if (family == "qwen3_next_moe") return 7 + 2 * 6;
  return 7 + 2 * (family == "qwen3_next" ? 9 : 11);
}

std::unique_ptr<CausalLm> model(const nlohmann::json& config, Communicator* tp, bool sequence_parallel = false) {
  ModelOptions o;
  o.dtype = DType::F64;
  o.tp = tp;
  o.sequence_parallel = sequence_parallel;
  return random_causal_lm(runtime(), parse_model_config(config, "test"), o, 11, 0.3);
}

double rel(const std::vector<double>& got, const std::vector<double>& want) { return rel_l2(got, want); }

struct TensorParallel : ::testing::Test {
  static std::unique_ptr<Communicator> world;
  static void SetUpTestSuite() { world = mpi_world(60); }
  static void TearDownTestSuite() { world.reset(); }
};
std::unique_ptr<Communicator> TensorParallel::world;

struct TensorParallelFamilies : TensorParallel, ::testing::WithParamInterface<std::string> {};

TEST_P(TensorParallelFamilies, SlicedLayersEqualTheWholeModel) {
  const int n = world->size();
  const nlohmann::json config = tiny_config(GetParam(), n, 1.0);  // one kv head a rank
  const std::unique_ptr<CausalLm> whole = model(config, nullptr);
  const std::unique_ptr<CausalLm> sliced = model(config, world.get());
  EXPECT_EQ(sliced->config().num_heads * n, whole->config().num_heads);
  EXPECT_EQ(sliced->global_config().num_heads, whole->config().num_heads);
  int sharded = 0;
  for (size_t i = 0; i < whole->parameters().size(); ++i) {
    const Parameter& p = sliced->parameters()[i];
    sharded += !p.whole();
    EXPECT_EQ(to_f64(sliced->gathered(p)), to_f64(whole->parameters()[i].value)) << p.name;
  }
  EXPECT_EQ(sharded, split_tensors(GetParam()) + 2);  // and the vocab-parallel embedding and LM head
  // Forward and backward of three packed documents.
  const PackedBatch b = random_batch(40, {0, 7, 9, 20}, 3);
  expect_equals_whole(*sliced, *whole, b);
  // Decoding through the rollout engine over the sliced layers.
  const std::vector<int32_t> prompt = {3, 17, 5, 5, 28, 1};
  const RolloutResult a = engine_greedy(*whole, prompt, 9), c = engine_greedy(*sliced, prompt, 9);
  EXPECT_EQ(c.tokens, a.tokens);
  EXPECT_LT(rel(c.logprobs, a.logprobs), 1e-10);
  // Saved from the slices (every rank joins, the first writes), read back whole.
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("lathe_tp_save_" + std::to_string(getppid()))).string();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
  world->barrier();
  sliced->save(dir);
  world->barrier();
  ModelOptions o;
  o.dtype = DType::F64;
  const std::unique_ptr<CausalLm> back = load_causal_lm(runtime(), dir, o);
  // Saved in f32: the logits move by the weights' rounding (up to 6.1e-6 measured, the hybrid at tp 4).
  EXPECT_LT(rel(to_f64(back->logits(b)), to_f64(whole->logits(b))), 2e-5);
  // A sliced model loads from the folder too: each rank reads its rows or columns.
  o.tp = world.get();
  const std::unique_ptr<CausalLm> reloaded = load_causal_lm(runtime(), dir, o);
  EXPECT_LT(rel(to_f64(reloaded->logits(b)), to_f64(back->logits(b))), 1e-12);
  world->barrier();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

// Sequence parallelism (the stream between the blocks split by rows, the blocks' inputs gathered and their outputs
// reduce-scattered) over 21 tokens, which no tp here divides (the last rank's rows padded): logits, loss, every
// gradient (the norms' gains summed from each rank's rows) and the rollout engine's greedy decode equal the whole
// model's; with recomputation too.
TEST_P(TensorParallelFamilies, SequenceParallelEqualsTheWholeModel) {
  const int n = world->size();
  const nlohmann::json config = tiny_config(GetParam(), n, 1.0);
  const std::unique_ptr<CausalLm> whole = model(config, nullptr);
  const std::unique_ptr<CausalLm> sliced = model(config, world.get(), true);
  ASSERT_TRUE(sliced->sequence_parallel());
  expect_equals_whole(*sliced, *whole, random_batch(40, {0, 7, 9, 21}, 5));
  const std::vector<int32_t> prompt = {3, 17, 5, 5, 28, 1, 9};
  const RolloutResult a = engine_greedy(*whole, prompt, 6), c = engine_greedy(*sliced, prompt, 6);
  EXPECT_EQ(c.tokens, a.tokens);
  EXPECT_LT(rel(c.logprobs, a.logprobs), 1e-10);
}

const Parameter& named(LoraBank& bank, int adapter, const std::string& name) {
  for (const Parameter& p : bank.parameters(adapter))
    if (p.name == name) return p;
  throw std::runtime_error("no adapter matrix " + name);
}

// LoRA over the sliced layers (every module a family has, two adapters of ranks 4 and 2 in one batch of two
// segments): a sliced bank's init draws the whole adapter's values; an adapter saved whole loads into the slices; the
// logits, the loss and every adapter gradient (the whole matrices' parts summed over the group, sum_tp_grads) equal
// the whole model's; the slices saved as PEFT files read back as the whole adapter. Fails without sum_tp_grads.
TEST_P(TensorParallelFamilies, LoraSlicesEqualTheWholeAdapters) {
  const int n = world->size();
  for (double kv : {1.0, 0.5}) {
    const nlohmann::json config = tiny_config(GetParam(), n, kv);
    const std::unique_ptr<CausalLm> whole = model(config, nullptr);
    const std::unique_ptr<CausalLm> sliced = model(config, world.get());
    const std::vector<LoraConfig> adapters = {lora(4, 8, {"all-linear"}), lora(2, 3, {"all-linear"})};
    LoraBank wb(runtime(), whole->config(), Device::cpu(), DType::F64, adapters);
    LoraBank sb(runtime(), sliced->config(), Device::cpu(), DType::F64, adapters);
    sb.split_like(*sliced);
    wb.init(0, 5);
    sb.init(0, 5);
    for (const Parameter& p : sb.parameters(0))
      EXPECT_EQ(to_f64(sliced->gathered(p)), to_f64(named(wb, 0, p.name).value)) << "init of " << p.name;
    // Non-zero B everywhere: random whole adapters, saved, and read into the slices.
    const std::string dir = (std::filesystem::temp_directory_path() / ("lathe_tp_lora_" + std::to_string(getppid()))).string();
    for (int a : {0, 1}) {
      randomise(wb, a, 40 + uint64_t(a), 0.2);
      if (world->rank() == 0) wb.save_peft(a, dir + std::to_string(a), DType::F32, "");
    }
    world->barrier();
    for (int a : {0, 1}) {
      wb.load_peft(a, dir + std::to_string(a));  // the f32 values on both sides
      sb.load_peft(a, dir + std::to_string(a));
    }
    whole->attach_lora(&wb);
    sliced->attach_lora(&sb);
    PackedBatch b = random_batch(40, {0, 7, 9, 20}, 3);
    set_segments(b, {{9, 0, 1.0, 0}, {20, 1, 0.5, 0}});
    EXPECT_LT(rel(to_f64(sliced->logits(b)), to_f64(whole->logits(b))), 1e-12) << config.dump();
    wb.zero_grads();
    sb.zero_grads();
    const LossResult want = whole->loss(b, true), got = sliced->loss(b, true);
    EXPECT_NEAR(got.loss, want.loss, 1e-12 * std::abs(want.loss));
    sb.sum_tp_grads();
    for (int a : {0, 1})
      for (const Parameter& p : sb.parameters(a))
        EXPECT_LT(rel(to_f64(sliced->gathered(p, true)), to_f64(named(wb, a, p.name).grad)), 1e-10)
            << p.name << " at " << config.dump();
    // Saved from the slices (every rank joins, the first writes), read back whole.
    world->barrier();
    sb.save_peft(1, dir + "back", DType::F32, "");
    world->barrier();
    LoraBank back(runtime(), whole->config(), Device::cpu(), DType::F64, adapters);
    back.load_peft(1, dir + "back");
    for (const Parameter& p : back.parameters(1))
      EXPECT_EQ(to_f64(p.value), to_f64(named(wb, 1, p.name).value)) << p.name;
    world->barrier();
    if (world->rank() == 0)
      for (const char* d : {"0", "1", "back"}) std::filesystem::remove_all(dir + d);
  }
}

// Context parallelism (the world as the cp group): each rank runs the stack on its rows of three packed documents of
// 7, 2 and 12 tokens (21 rows: the splits fall inside documents, the last rank's rows padded), and of two documents of
// 3 and 2 tokens (at -np 4 the last rank has no row of the batch); attention and Gated DeltaNet (conv, decay, delta
// rule) over whole documents by the head all-to-all, or, where the GDN heads are too few for it, Gated DeltaNet on the
// rank's rows with the conv's history gathered and the rule's state passed rank to rank (documents that cross one and
// two rank boundaries, a history shorter than the conv's, a history from two ranks back), mixture-of-experts layers
// on the rank's rows with the aux loss on (its routing totals summed over the group), for Qwen3, Qwen3-MoE, Qwen3.5
// (dense and MoE) and Qwen3-Next (fused projections, sparse layers): the logits, the loss, the aux loss and the expert
// loads, and every gradient summed over the ranks (each rank's is its rows' part) equal the whole model's; at -np 4
// also as tp 2 x cp 2, with and without sequence parallelism (each cp rank's rows split again over its tp group
// between the blocks); the rollout engine's greedy decode (no split while decoding) is the reference's. Fails with the
// rows' head gradient left at 1 / cp, with the routing totals not summed, or with the passed state, its gradient or
// the history's gradient dropped.
// `keeps`: train.recompute with the attention outputs and delta rule results kept from the forward.
std::unique_ptr<CausalLm> cp_model(const nlohmann::json& config, Communicator* tp, Communicator* cp,
                                   bool sequence_parallel = false, bool keeps = false) {
  ModelOptions o;
  o.dtype = DType::F64;
  o.recompute = o.recompute_keeps_attention = o.recompute_keeps_gdn = keeps;
  o.tp = tp;
  o.cp = cp;
  o.sequence_parallel = sequence_parallel;
  o.router_aux_loss = true;
  return random_causal_lm(runtime(), parse_model_config(config, "test"), o, 11, 0.3);
}

std::vector<nlohmann::json> cp_configs(int n) {
  nlohmann::json qwen3_moe = tiny_qwen3(2 * n, n, 12);
  qwen3_moe["model_type"] = "qwen3_moe";
  add_experts(qwen3_moe);
  // Heads fewer than the ranks, shared: one key/value head for every rank; n / 2 Gated DeltaNet key heads of two
  // value heads each (a key head read by two ranks).
  nlohmann::json shared = tiny_hybrid("qwen3_5_text", 2 * n, 1, n / 2, 12);
  shared["linear_num_value_heads"] = n;
  // Gated DeltaNet heads too few for the all-to-all (n / 2 key heads of three value heads: at cp n, and at tp 2 x cp 2
  // one key head of three a tp rank): the conv's history and the rule's state passed from rank to rank; Qwen3.5 and
  // Qwen3-Next (its fused projections interleaved per key head).
  nlohmann::json passing = tiny_hybrid("qwen3_5_text", 2 * n, n, n / 2, 12);
  passing["linear_num_value_heads"] = 3 * (n / 2);
  nlohmann::json passing_next = tiny_hybrid("qwen3_next", 2 * n, n, n / 2, 12, true);
  passing_next["linear_num_value_heads"] = 3 * (n / 2);
  return {tiny_qwen3(2 * n, n, 12), tiny_qwen3(2 * n, 1, 12), qwen3_moe, tiny_hybrid("qwen3_5_text", 2 * n, n, n, 12),
          shared, tiny_hybrid("qwen3_5_moe_text", 2 * n, n, n, 12), tiny_hybrid("qwen3_next", 2 * n, n, n, 12, true),
          passing, passing_next};
}

// `split`'s loss, aux loss, expert loads and gradients (summed over `cp`, gathered over its tp group) against `whole`'s.
void expect_cp_equals_whole(CausalLm& split, CausalLm& whole, Communicator& cp, const PackedBatch& b,
                            const std::string& what) {
  EXPECT_LT(rel(to_f64(split.logits(b)), to_f64(whole.logits(b))), 1e-12) << what;
  whole.zero_grads();
  split.zero_grads();
  const LossResult want = whole.loss(b, true, 0.7), got = split.loss(b, true, 0.7);
  EXPECT_NEAR(got.loss, want.loss, 1e-12 * std::abs(want.loss)) << what;
  EXPECT_EQ(got.labelled, want.labelled) << what;
  EXPECT_NEAR(got.aux_loss, want.aux_loss, 1e-12 * std::abs(want.aux_loss)) << what;
  ASSERT_EQ(got.expert_load.size(), want.expert_load.size()) << what;
  for (size_t l = 0; l < want.expert_load.size(); ++l)
    EXPECT_EQ(got.expert_load[l].tokens_per_expert, want.expert_load[l].tokens_per_expert) << what;
  const auto expect_grads = [&](const std::string& pass) {
    split.sum_replicated_grads();  // tp above the key/value heads: the parts of the ranks sharing one
    for (size_t i = 0; i < whole.parameters().size(); ++i) {
      Parameter& p = split.parameters()[i];
      ASSERT_TRUE(p.grad.defined()) << what << pass << ": " << p.name;
      cp.all_reduce(p.grad).wait();  // the ranks' parts
      EXPECT_LT(rel(to_f64(split.gathered(p, true)), to_f64(whole.parameters()[i].grad)), 1e-10)
          << what << pass << ": " << p.name;
    }
  };
  expect_grads("");
  // Per-token label log-probs (each rank's rows, joined) and a row loss whose terms couple every row of the batch (a
  // square of the log-probs' sum, as a sequence-level term does): each rank must see every row's log-prob.
  EXPECT_LT(rel(split.label_logprobs(b), whole.label_logprobs(b)), 1e-12) << what;
  const RowLoss row_loss = [](std::span<const double> logp, std::span<double> loss, std::span<double> d) {
    double sum = 0;
    for (double l : logp) sum += l;
    for (size_t i = 0; i < logp.size(); ++i) {
      loss[i] = -(1.0 + 0.1 * double(i % 3)) * logp[i] + (i == 0 ? 0.01 * sum * sum : 0.0);
      d[i] = -(1.0 + 0.1 * double(i % 3)) + 0.02 * sum;
    }
  };
  PackedBatch rw = b, rs = b;
  std::vector<double> h_want, h_got;
  rw.row_loss = rs.row_loss = &row_loss;
  rw.row_entropy = &h_want;
  rs.row_entropy = &h_got;
  whole.zero_grads();
  split.zero_grads();
  const double row_want = whole.loss(rw, true).loss, row_got = split.loss(rs, true).loss;
  EXPECT_NEAR(row_got, row_want, 1e-12 * std::abs(row_want)) << what;
  EXPECT_LT(rel(h_got, h_want), 1e-12) << what;
  expect_grads(", row loss");
}

TEST_F(TensorParallel, ContextParallelEqualsTheWholeModel) {
  const int n = world->size();
  for (const nlohmann::json& config : cp_configs(n)) {
    const std::string family = config["model_type"].get<std::string>() + " (" +
                               std::to_string(config["num_key_value_heads"].get<int>()) + " kv heads)";
    const std::unique_ptr<CausalLm> whole = cp_model(config, nullptr, nullptr);
    const std::unique_ptr<CausalLm> split = cp_model(config, nullptr, world.get());
    ASSERT_TRUE(split->context_parallel());
    for (const PackedBatch& b : {random_batch(40, {0, 7, 9, 21}, 7), random_batch(40, {0, 3, 5}, 8)})
      expect_cp_equals_whole(*split, *whole, *world, b, family + " at " + std::to_string(b.tokens()) + " tokens");
    if (config.contains("layer_types")) {  // recomputing, the cores' results kept (the all-to-all's or the chain's)
      const std::unique_ptr<CausalLm> kept = cp_model(config, nullptr, world.get(), false, true);
      expect_cp_equals_whole(*kept, *whole, *world, random_batch(40, {0, 7, 9, 21}, 7), family + " recomputing, kept");
      // The rule runs once a layer on each rank, the backward's recompute taking its kept results (a chain layer's
      // too: the chain of sends along the group runs once).
      OpProfiler prof(runtime().backend(DeviceType::CPU), Device::cpu());
      runtime().set_profiler(&prof);
      kept->loss(random_batch(40, {0, 7, 9, 21}, 7), true);
      runtime().set_profiler(nullptr);
      int64_t rules = 0, gdn_layers = 0;
      for (const OpProfiler::Total& t : prof.collect().kernels)
        if (t.op == OpId::gated_delta_rule || t.op == OpId::gated_delta_rule_state) rules += t.calls;
      for (const auto& type : config["layer_types"]) gdn_layers += type == "linear_attention";
      EXPECT_EQ(rules, gdn_layers) << family << " recomputing, kept";
    }
    // Decoding runs the whole batch on every rank (no split): the rollout engine's greedy tokens are the reference's.
    const std::vector<int32_t> prompt = {3, 9, 14, 2, 27};
    const RolloutResult a = engine_greedy(*whole, prompt, 6), c = engine_greedy(*split, prompt, 6);
    EXPECT_EQ(c.tokens, a.tokens) << family;
    if (n == 4) {  // tp 2 x cp 2: the tp groups {0, 1} and {2, 3}, the cp groups {0, 2} and {1, 3}
      const std::unique_ptr<Communicator> tp = world->split(world->rank() / 2, world->rank(), "tp", nullptr);
      const std::unique_ptr<Communicator> cp = world->split(world->rank() % 2, world->rank(), "cp", nullptr);
      for (bool sp : {false, true}) {  // with sequence parallelism: the stream of each cp rank's rows split over tp
        const std::unique_ptr<CausalLm> m = cp_model(config, tp.get(), cp.get(), sp);
        for (const PackedBatch& b : {random_batch(40, {0, 7, 9, 21}, 7), random_batch(40, {0, 3, 5}, 8)})
          expect_cp_equals_whole(*m, *whole, *cp, b, (sp ? "tp x cp with sp, " : "tp x cp, ") + family);
      }
    }
  }
  // Three key/value heads over two or four ranks: neither divides the other, refused by name.
  try {
    cp_model(tiny_qwen3(12, 3, 12), nullptr, world.get());
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("and divide or be divided by its key/value heads (3)"), std::string::npos)
        << e.what();
  }
}

// A non-finite router logit on one cp rank only (its own copy of the routers poisoned): with the groups on the device
// the flag travels in the group's sum of the routing figures, so every rank refuses the batch once its backward is
// queued, the poisoned one naming its token and the others that rank's group; none goes on alone into the next
// collective. Fails with the flag left out of the sum (the other ranks would take the step).
TEST_F(TensorParallel, ContextParallelRanksRefuseANonFiniteRouterTogether) {
  const int n = world->size();
  nlohmann::json config = tiny_qwen3(2 * n, n, 12);
  config["model_type"] = "qwen3_moe";
  add_experts(config);
  const std::unique_ptr<CausalLm> split = cp_model(config, nullptr, world.get());
  if (world->rank() == n - 1)
    for (Parameter& p : split->parameters())
      if (p.name.find("mlp.gate.weight") != std::string::npos) p.value.data<double>()[0] = std::nan("");
  std::string error;
  try {
    split->loss(random_batch(40, {0, 7, 9, 21}, 7), true);
  } catch (const Error& e) {
    error = e.what();
  }
  const std::string want = world->rank() == n - 1 ? "is not finite (layer 0's router produced NaN or Inf)"
                                                  : "a router logit on another context-parallel rank is not finite";
  EXPECT_NE(error.find(want), std::string::npos) << "rank " << world->rank() << ": " << error;
}

// LoRA under context parallelism: two adapters (every module, and on the mixture-of-experts families the experts'
// fused parameters) in one batch of two segments whose boundary falls inside a rank's rows: the logits, the loss and
// every adapter gradient, summed over the group (each rank's is its rows' part), equal the whole model's. Fails with the
// segments left at the batch's rows.
TEST_F(TensorParallel, ContextParallelLoraEqualsTheWholeModel) {
  const int n = world->size();
  for (const nlohmann::json& config : cp_configs(n)) {
    const std::string family = config["model_type"];
    const std::unique_ptr<CausalLm> whole = cp_model(config, nullptr, nullptr);
    const std::unique_ptr<CausalLm> split = cp_model(config, nullptr, world.get());
    AdapterBanks banks = attach_two_adapters(*whole, *split);
    PackedBatch b = random_batch(40, {0, 7, 9, 21}, 3);
    set_segments(b, {{9, 0, 1.0, 0}, {21, 1, 0.5, 0}});
    EXPECT_LT(rel(to_f64(split->logits(b)), to_f64(whole->logits(b))), 1e-12) << family;
    banks.whole->zero_grads();
    banks.split->zero_grads();
    const LossResult want = whole->loss(b, true), got = split->loss(b, true);
    EXPECT_NEAR(got.loss, want.loss, 1e-12 * std::abs(want.loss)) << family;
    expect_summed_adapter_grads_equal(banks, *world, family);
  }
}

// What `lathe plan` counts as a rank's weights (the local config's parameter count) is what a sliced model holds.
TEST_P(TensorParallelFamilies, TheLocalConfigCountsTheRanksParameters) {
  const int n = world->size();
  for (double kv : {1.0, 0.5}) {
    const nlohmann::json config = tiny_config(GetParam(), n, kv);
    const std::unique_ptr<CausalLm> sliced = model(config, world.get());
    int64_t held = 0;
    for (const Parameter& p : sliced->parameters()) held += p.value.numel();
    EXPECT_EQ(tensor_parallel_config(sliced->global_config(), n).parameter_count(), held) << config.dump();
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TensorParallelFamilies,
                         ::testing::Values("qwen3", "qwen3_5_text", "qwen3_next", "qwen3_moe", "qwen3_5_moe_text",
                                           "qwen3_next_moe"));

// More ranks than key/value heads (MQA at tp 2: one kv head; at tp 4, two kv heads each held by two ranks): the
// gathered parameters, logits, loss and the engine's greedy decode equal the whole model's, and every gradient too
// once the shared k/v slices' parts are summed (sum_replicated_grads; the k/v ones differ without it).
TEST_P(TensorParallelFamilies, RanksAboveTheKeyValueHeadsShareThem) {
  const int n = world->size();
  const nlohmann::json config = tiny_config(GetParam(), n, 0.5);
  const std::unique_ptr<CausalLm> whole = model(config, nullptr);
  const std::unique_ptr<CausalLm> sliced = model(config, world.get());
  EXPECT_EQ(sliced->config().num_kv_heads, 1);
  for (size_t i = 0; i < whole->parameters().size(); ++i)
    EXPECT_EQ(to_f64(sliced->gathered(sliced->parameters()[i])), to_f64(whole->parameters()[i].value))
        << sliced->parameters()[i].name;
  const PackedBatch b = random_batch(40, {0, 5, 16}, 4);
  EXPECT_LT(rel(to_f64(sliced->logits(b)), to_f64(whole->logits(b))), 1e-12);
  EXPECT_NEAR(sliced->loss(b, true).loss, whole->loss(b, true).loss, 1e-12);
  const auto grads_equal = [&] {
    bool all = true;
    for (size_t i = 0; i < whole->parameters().size(); ++i)
      all = all && rel(to_f64(sliced->gathered(sliced->parameters()[i], true)), to_f64(whole->parameters()[i].grad)) < 1e-10;
    return all;
  };
  EXPECT_FALSE(grads_equal()) << "the shared k/v slices' gradients should be parts before their sum";
  sliced->sum_replicated_grads();
  for (size_t i = 0; i < whole->parameters().size(); ++i)
    EXPECT_LT(rel(to_f64(sliced->gathered(sliced->parameters()[i], true)), to_f64(whole->parameters()[i].grad)), 1e-10)
        << sliced->parameters()[i].name;
  const std::vector<int32_t> prompt = {9, 2, 30, 30, 7};
  const RolloutResult a = engine_greedy(*whole, prompt, 8), c = engine_greedy(*sliced, prompt, 8);
  EXPECT_EQ(c.tokens, a.tokens);
  EXPECT_LT(rel(c.logprobs, a.logprobs), 1e-10);
}

TEST_F(TensorParallel, RefusesWhatItCannotSlice) {
  const int n = world->size();
  const auto refused = [&](const nlohmann::json& config, const std::string& needle) {
    try {
      model(config, world.get());
      ADD_FAILURE() << "expected a refusal naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused(tiny_qwen3(2 * n + 1, 1, 12 * n), "must divide the attention heads");
  refused(tiny_hybrid("qwen3_5_text", 2 * n, n, 1, 12 * n), "must divide the Gated DeltaNet key heads (1;");
}

}  // namespace
