// Expert parallelism of the mixture-of-experts layers (CausalLm with ModelOptions::ep) under mpirun (-np 2 and -np 4 in
// ctest), in f64: each rank its own batch (three documents), the experts split over the ranks, every routed row sent to
// its expert's rank and its output back. The reference is the whole model on every rank: each rank's logits (on its
// batch) within 1e-12 relative; the loss (each rank's batch's mean, averaged over the group) and the aux loss and the
// expert loads (the group's: the whole model on the group's batches joined into one); and every gradient within 1e-10
// — a dense parameter's summed over the group, an expert's gathered from its owner — against the whole model's
// gradient on the joined batch. Qwen3-MoE, Qwen3.5-MoE and Qwen3-Next (shared experts, dense layers beside sparse
// ones); at -np 4 also as tp 2 x ep 2; LoRA on the experts. A model saved from the split experts reads back as the
// whole model. Fails with the routing totals left per rank, or the aux gradient not scaled by ep.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "model/config.h"
#include "model/lora.h"
#include "support/error_of.h"
#include "support/lora_support.h"
#include "support/model_support.h"
#include "support/tp_support.h"

using namespace lathe;
using namespace lathe::test_support;

namespace {

// The tiny f64 model of `config` split over tp and ep (either may be null), the aux loss in its trained loss or not.
std::unique_ptr<CausalLm> ep_model(const nlohmann::json& config, Communicator* tp, Communicator* ep, bool aux) {
  ModelOptions o;
  o.dtype = DType::F64;
  o.tp = tp;
  o.ep = ep;
  o.router_aux_loss = aux;
  return random_causal_lm(runtime(), parse_model_config(config, "test"), o, 11, 0.3);
}

// The families with experts, `experts` of them (two query heads and one kv head a tp rank of two).
std::vector<nlohmann::json> ep_configs(int experts) {
  nlohmann::json qwen3_moe = tiny_qwen3(4, 2, 12);
  qwen3_moe["model_type"] = "qwen3_moe";
  std::vector<nlohmann::json> out = {qwen3_moe, tiny_hybrid("qwen3_5_moe_text", 4, 2, 2, 12),
                                     tiny_hybrid("qwen3_next", 4, 2, 2, 12, true)};
  for (nlohmann::json& j : out) {
    add_experts(j);
    j["num_experts"] = experts;
    j["num_experts_per_tok"] = 3;
  }
  return out;
}

// Rank r's batch of a group of n: three documents of 7, 2 and 12 tokens (the same labelled count on every rank).
PackedBatch rank_batch(int r) { return random_batch(40, {0, 7, 9, 21}, 100 + uint64_t(r)); }

// The group's batches joined into one, in rank order.
PackedBatch joined_batch(int n) {
  std::vector<PackedBatch> parts;
  for (int r = 0; r < n; ++r) parts.push_back(rank_batch(r));
  return test_support::joined_batch(parts, 40);
}

struct ExpertParallel : ::testing::Test {
  static std::unique_ptr<Communicator> world;
  static void SetUpTestSuite() { world = mpi_world(60); }
  static void TearDownTestSuite() { world.reset(); }
};
std::unique_ptr<Communicator> ExpertParallel::world;

// `split` (ep group `ep`, this rank's batch the group's `ep_rank`-th) against `whole`.
void expect_ep_equals_whole(CausalLm& split, CausalLm& whole, Communicator& ep, const std::string& what) {
  const int n = ep.size();
  const PackedBatch mine = rank_batch(ep.rank()), all = joined_batch(n);
  EXPECT_LT(rel_l2(to_f64(split.logits(mine)), to_f64(whole.logits(mine))), 1e-12) << what;
  whole.zero_grads();
  split.zero_grads();
  const double scale = 0.7;
  const LossResult want = whole.loss(all, true, scale);
  const LossResult got = split.loss(mine, true, scale / n);  // equal labelled counts: the mean's share
  Tensor mean = runtime().from_host(&got.loss, {1}, DType::F64, Device::cpu());
  ep.all_reduce(mean).wait();
  EXPECT_NEAR(mean.data<double>()[0] / n, want.loss, 1e-12 * std::abs(want.loss)) << what;
  EXPECT_NEAR(got.aux_loss, want.aux_loss, 1e-12 * std::abs(want.aux_loss)) << what;
  ASSERT_EQ(got.expert_load.size(), want.expert_load.size()) << what;
  for (size_t l = 0; l < want.expert_load.size(); ++l)
    EXPECT_EQ(got.expert_load[l].tokens_per_expert, want.expert_load[l].tokens_per_expert) << what;
  split.sum_replicated_grads();
  int experts = 0;
  for (size_t i = 0; i < whole.parameters().size(); ++i) {
    Parameter& p = split.parameters()[i];
    ASSERT_TRUE(p.grad.defined()) << what << ": " << p.name;
    if (p.shard.group == "ep") ++experts;
    else ep.all_reduce(p.grad).wait();  // a dense parameter: each rank's batch's part
    EXPECT_LT(rel_l2(to_f64(split.gathered(p, true)), to_f64(whole.parameters()[i].grad)), 1e-10)
        << what << ": " << p.name;
  }
  EXPECT_GT(experts, 0) << what << ": no parameter was split over the ep group";
}

TEST_F(ExpertParallel, SplitExpertsEqualTheWholeModel) {
  const int n = world->size();
  for (const nlohmann::json& config : ep_configs(2 * n)) {
    const std::string family = config["model_type"];
    const std::unique_ptr<CausalLm> whole = ep_model(config, nullptr, nullptr, true);
    const std::unique_ptr<CausalLm> split = ep_model(config, nullptr, world.get(), true);
    ASSERT_TRUE(split->expert_parallel());
    for (size_t i = 0; i < whole->parameters().size(); ++i)  // the same draws: each rank its experts' slice
      EXPECT_EQ(to_f64(split->gathered(split->parameters()[i])), to_f64(whole->parameters()[i].value))
          << family << ": " << split->parameters()[i].name;
    expect_ep_equals_whole(*split, *whole, *world, family + " at ep " + std::to_string(n));
    if (n == 4) {  // tp 2 x ep 2: the tp groups {0, 1} and {2, 3}, the ep groups {0, 2} and {1, 3}
      const std::unique_ptr<Communicator> tp = world->split(world->rank() / 2, world->rank(), "tp", nullptr);
      const std::unique_ptr<Communicator> ep = world->split(world->rank() % 2, world->rank(), "ep", nullptr);
      const std::unique_ptr<CausalLm> m = ep_model(config, tp.get(), ep.get(), true);
      expect_ep_equals_whole(*m, *whole, *ep, family + " at tp 2 x ep 2");
    }
  }
}

// Ranks whose batches differ in length (the plan's counts differ by rank): logits, the loss (each rank's mean
// weighted by its share of the labelled tokens) and every gradient equal the whole model's on the batches joined. The
// aux loss is off: its gradient takes each rank's loss_scale as the group's mean's share (equal counts).
TEST_F(ExpertParallel, RanksOfDifferentLengthsEqualTheWholeModel) {
  const int n = world->size(), me = world->rank();
  for (const nlohmann::json& config : ep_configs(2 * n)) {
    const std::string what = std::string(config["model_type"]) + " at ep " + std::to_string(n);
    const std::unique_ptr<CausalLm> whole = ep_model(config, nullptr, nullptr, false);
    const std::unique_ptr<CausalLm> split = ep_model(config, nullptr, world.get(), false);
    std::vector<PackedBatch> parts;
    for (int r = 0; r < n; ++r) parts.push_back(random_batch(40, {0, 7, 9, 12 + 5 * r}, 300 + uint64_t(r)));
    const PackedBatch& mine = parts[size_t(me)];
    const PackedBatch all = test_support::joined_batch(parts, 40);
    EXPECT_LT(rel_l2(to_f64(split->logits(mine)), to_f64(whole->logits(mine))), 1e-12) << what;
    const double share = double(mine.num_labelled) / double(all.num_labelled);
    const LossResult want = whole->loss(all, true, 0.7);
    const LossResult got = split->loss(mine, true, 0.7 * share);
    Tensor sum = runtime().from_host(&got.loss, {1}, DType::F64, Device::cpu());
    sum.data<double>()[0] *= share;
    world->all_reduce(sum).wait();
    EXPECT_NEAR(sum.data<double>()[0], want.loss, 1e-12 * std::abs(want.loss)) << what;
    split->sum_replicated_grads();
    for (size_t i = 0; i < whole->parameters().size(); ++i) {
      Parameter& p = split->parameters()[i];
      ASSERT_TRUE(p.grad.defined()) << what << ": " << p.name;
      if (p.shard.group != "ep") world->all_reduce(p.grad).wait();
      EXPECT_LT(rel_l2(to_f64(split->gathered(p, true)), to_f64(whole->parameters()[i].grad)), 1e-10)
          << what << ": " << p.name;
    }
  }
}

// LoRA under ep, the experts' fused parameters and every module adapted, two adapters: each rank's batch one segment
// of its own adapter (rank r: adapter r % 2), the whole model's the ranks' batches joined, a segment each. Each rank's
// expert adapters are used at its experts only (the mask travels with the rows); every adapter gradient, summed over
// the group (a rank's expert parts are its experts'), equals the whole model's. The aux loss is off here: with a
// loss_scale of 1 on every rank (one segment's mean each) its ep scaling would count it ep times.
TEST_F(ExpertParallel, LoraOnTheExpertsEqualsTheWholeModel) {
  const int n = world->size();
  for (const nlohmann::json& config : ep_configs(2 * n)) {
    const std::string family = config["model_type"];
    const std::unique_ptr<CausalLm> whole = ep_model(config, nullptr, nullptr, false);
    const std::unique_ptr<CausalLm> split = ep_model(config, nullptr, world.get(), false);
    AdapterBanks banks = attach_two_adapters(*whole, *split);
    PackedBatch mine = rank_batch(world->rank()), all = joined_batch(n);
    set_segments(mine, {{mine.tokens(), world->rank() % 2, 1.0, 0}});
    std::vector<BatchSegment> joined;
    for (int r = 0; r < n; ++r) joined.push_back({(r + 1) * mine.tokens(), r % 2, 1.0, 0});
    set_segments(all, joined);
    banks.whole->zero_grads();
    banks.split->zero_grads();
    whole->loss(all, true);
    split->loss(mine, true);
    expect_summed_adapter_grads_equal(banks, *world, family);
  }
}

// A model saved from the split experts (the first rank writes, every rank gathers) reads back as the whole model,
// in the fused layout it was made in.
TEST_F(ExpertParallel, SavedExpertsReadBackWhole) {
  const int n = world->size();
  const nlohmann::json config = ep_configs(2 * n)[0];
  const std::unique_ptr<CausalLm> whole = ep_model(config, nullptr, nullptr, true);
  const std::unique_ptr<CausalLm> split = ep_model(config, nullptr, world.get(), true);
  const double pid = double(getpid());
  Tensor first = runtime().from_host(&pid, {1}, DType::F64, Device::cpu());
  world->broadcast(first, 0).wait();  // rank 0's process id names the folder for every rank
  const std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("lathe_ep_save_{}", int64_t(first.data<double>()[0]))).string();
  split->save(dir, DType::F32);
  world->barrier();
  ModelOptions o;
  o.dtype = DType::F64;
  const std::unique_ptr<CausalLm> back = load_causal_lm(runtime(), dir, o);
  for (size_t i = 0; i < whole->parameters().size(); ++i)
    EXPECT_LT(rel_l2(to_f64(back->parameters()[i].value), to_f64(whole->parameters()[i].value)), 1e-6)
        << back->parameters()[i].name;  // f32 on disk
  world->barrier();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

// The ep group as the model sees it, counting the elements each all-to-all sends to the other ranks.
class CountingGroup : public Communicator {
 public:
  explicit CountingGroup(Communicator& inner) : inner_(inner) {}
  int64_t sent_to_others = 0;
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const std::string& name() const override { return inner_.name(); }
  CommWork all_reduce(Tensor& t) override { return inner_.all_reduce(t); }
  CommWork reduce_scatter(const Tensor& in, Tensor& out) override { return inner_.reduce_scatter(in, out); }
  CommWork all_gather(const Tensor& in, Tensor& out) override { return inner_.all_gather(in, out); }
  CommWork all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                      const std::vector<int64_t>& recv_counts) override {
    for (size_t j = 0; j < send_counts.size(); ++j)
      if (int(j) != rank()) sent_to_others += send_counts[j];
    return inner_.all_to_all(in, send_counts, out, recv_counts);
  }
  CommWork broadcast(Tensor& t, int root) override { return inner_.broadcast(t, root); }
  CommWork send(const Tensor& t, int peer) override { return inner_.send(t, peer); }
  CommWork recv(Tensor& t, int peer) override { return inner_.recv(t, peer); }
  CommWork exchange(const std::vector<std::pair<Tensor, int>>& sends,
                    const std::vector<std::pair<Tensor, int>>& recvs) override {
    return inner_.exchange(sends, recvs);
  }
  void barrier(double timeout_s, const char* timeout_name) override { inner_.barrier(timeout_s, timeout_name); }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name, Stream* stream) override {
    return inner_.split(color, key, name, stream);
  }

 private:
  Communicator& inner_;
};

// A token's row goes once to each rank holding one of its experts, however many of them that rank holds, and one
// summed row comes back. With the router's weights zero every token picks experts 0, 1 and 2 (ties go to the lower
// expert): two on rank 0, one on rank 1. So in a forward each sparse layer sends, of T tokens a rank and H wide:
// rank 0 its T rows to rank 1, rank 1 its T rows to rank 0, every other rank its T rows to both; ranks 0 and 1 one row
// back for each other rank's token; and 2 S values per token sent away (its pairs' rows there and their weights,
// S = min(3, experts a rank) = 2), nothing per pair (the experts' rank finds each pair's token from them). One row per
// pair (the exchange of session 23) would have rank 1 send 2 T rows and ranks from 2 on 3 T.
TEST_F(ExpertParallel, EachTokenGoesOnceToEachRankOfItsExperts) {
  const int n = world->size(), me = world->rank();
  for (const nlohmann::json& config : ep_configs(2 * n)) {
    const std::string family = config["model_type"];
    CountingGroup ep(*world);
    const std::unique_ptr<CausalLm> split = ep_model(config, nullptr, &ep, true);
    for (Parameter& p : split->parameters())
      if (p.name.ends_with("mlp.gate.weight")) std::fill_n(p.value.data<double>(), p.value.numel(), 0.0);
    const PackedBatch mine = rank_batch(me);
    split->logits(mine);
    const ModelConfig& c = split->global_config();
    int64_t sparse = 0;
    for (int64_t i = 0; i < c.num_layers; ++i) sparse += c.sparse_layer(i) ? 1 : 0;
    const int64_t t = mine.tokens(), h = c.hidden_size;
    const int64_t rows_out = me < 2 ? t : 2 * t, rows_back = me < 2 ? (n - 1) * t : 0;
    EXPECT_EQ(ep.sent_to_others, sparse * ((rows_out + rows_back) * h + 2 * 2 * rows_out))
        << family;
    EXPECT_GT(sparse, 0) << family;
  }
}

// A router that gives one rank non-finite logits (its copy of a router weight NaN) stops every rank of the group in
// that layer's one wait, each with the error naming the rank: none goes on to an exchange the others never join.
TEST_F(ExpertParallel, ANonFiniteRouterOnOneRankStopsEveryRank) {
  const int n = world->size(), me = world->rank();
  const nlohmann::json config = ep_configs(2 * n)[0];
  const std::unique_ptr<CausalLm> split = ep_model(config, nullptr, world.get(), true);
  if (me == n - 1)
    for (Parameter& p : split->parameters())
      if (p.name.ends_with("mlp.gate.weight")) p.value.data<double>()[0] = std::nan("");
  const std::string error = error_of([&] { split->logits(rank_batch(me)); });
  EXPECT_NE(error.find(fmt::format("on expert-parallel rank {} is not finite", n - 1)), std::string::npos) << error;
}

TEST_F(ExpertParallel, RefusesWhatItCannotSplit) {
  const int n = world->size();
  nlohmann::json odd = ep_configs(2 * n)[0];
  odd["num_experts"] = 2 * n + 1;
  try {
    ep_model(odd, nullptr, world.get(), true);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("experts do not split evenly over"), std::string::npos) << e.what();
  }
  try {
    ep_model(tiny_qwen3(4, 2, 12), nullptr, world.get(), true);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no mixture-of-experts layers"), std::string::npos) << e.what();
  }
}

}  // namespace
