// The vocab-parallel embedding and LM head under tensor parallelism (CausalLm with ModelOptions::tp, model/lm_head.h)
// under mpirun (-np 2 and -np 4 in ctest): each rank holds vocab_size / tp rows of embed_tokens and lm_head (a tied
// head the same slice), and the whole model on every rank is the reference. In f64, for Qwen3 with tied and untied
// embeddings and the Qwen3.5 hybrid: the embedding and head are sliced by rows and join (gathered) to the reference's;
// the logits (gathered), the loss of a packed batch with unlabelled positions (-100), the per-token label
// log-probabilities (RL, `lathe logprobs`), and a row loss's terms and entropies (the RL policy losses' head) within
// 1e-12 relative; every gradient, embedding and head included (joined), within 1e-10; the rollout engine's greedy
// decode equal (tokens, log-probabilities within 1e-10). A vocabulary tp does not divide stays whole on every rank.
// Must be able to fail (checked at tp 2): with the embedding's sum over the group skipped (CausalLm::embed's tp_sum),
// the logits, log-prob, loss and gradient checks fail; with each row's log-sum-exp taken locally instead of combined
// over the group (LmHead::cross_entropy without whole_lse), the log-probs (0.19 relative), the loss and the
// gradients (the embedding's 0.56) fail.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "model/config.h"
#include "support/model_support.h"
#include "support/tp_support.h"

using namespace lathe;
using namespace lathe::test_support;

namespace {

constexpr int64_t kVocab = 48;  // divided by 2 and 4

// Two query heads, one kv head, 12 MLP columns and (the hybrid) one GDN key head a rank; kVocab rows.
nlohmann::json tiny_config(const std::string& family, int n, bool tied) {
  nlohmann::json j = family == "qwen3" ? tiny_qwen3(2 * n, n, 12 * n) : tiny_hybrid(family, 2 * n, n, n, 12 * n);
  j["vocab_size"] = kVocab;
  j["tie_word_embeddings"] = tied;
  return j;
}

std::unique_ptr<CausalLm> model(const nlohmann::json& config, Communicator* tp) {
  ModelOptions o;
  o.dtype = DType::F64;
  o.tp = tp;
  o.loss_chunk_rows = 8;  // several chunks, each with its own collectives
  return random_causal_lm(runtime(), parse_model_config(config, "test"), o, 23, 0.3);
}

// A packed batch of three documents whose labels include unlabelled (-100) positions besides the documents' ends.
PackedBatch batch() {
  std::vector<int32_t> ids(26), cu = {0, 7, 16, 26};
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 29 + 5) % kVocab);
  std::vector<int32_t> labels = next_token_labels(ids, cu);
  for (size_t i : {2, 3, 11}) labels[i] = -100;
  return make_packed_batch(runtime(), Device::cpu(), ids, cu, labels, kVocab);
}

struct VocabParallel : ::testing::Test {
  static std::unique_ptr<Communicator> world;
  static void SetUpTestSuite() { world = mpi_world(60); }
  static void TearDownTestSuite() { world.reset(); }
};
std::unique_ptr<Communicator> VocabParallel::world;

struct VocabParallelModels : VocabParallel, ::testing::WithParamInterface<std::pair<std::string, bool>> {};

TEST_P(VocabParallelModels, SlicedEmbeddingAndHeadEqualTheWholeModel) {
  const int n = world->size();
  const auto& [family, tied] = GetParam();
  const nlohmann::json config = tiny_config(family, n, tied);
  const std::unique_ptr<CausalLm> whole = model(config, nullptr);
  const std::unique_ptr<CausalLm> sliced = model(config, world.get());
  EXPECT_EQ(sliced->config().vocab_size * n, kVocab);
  EXPECT_EQ(sliced->global_config().vocab_size, kVocab);
  for (size_t i = 0; i < whole->parameters().size(); ++i) {
    const Parameter& p = sliced->parameters()[i];
    if (p.name.find("embed_tokens") != std::string::npos || p.name == "lm_head.weight") {
      EXPECT_EQ(p.value.size(0), kVocab / n) << p.name;
      EXPECT_EQ(p.shard.offset[0], world->rank() * kVocab / n) << p.name;
    }
    EXPECT_EQ(to_f64(sliced->gathered(p)), to_f64(whole->parameters()[i].value)) << p.name;
  }
  const PackedBatch b = batch();
  EXPECT_LT(rel_l2(to_f64(sliced->logits(b)), to_f64(whole->logits(b))), 1e-12);
  const std::vector<double> lp_want = whole->label_logprobs(b), lp_got = sliced->label_logprobs(b);
  ASSERT_EQ(lp_got.size(), lp_want.size());
  EXPECT_LT(rel_l2(lp_got, lp_want), 1e-12);
  for (size_t i = 0; i < lp_want.size(); ++i)
    EXPECT_NEAR(lp_got[i], lp_want[i], 1e-12 * (1 + std::abs(lp_want[i]))) << "position " << i;
  const LossResult want = whole->loss(b, true, 0.7), got = sliced->loss(b, true, 0.7);
  EXPECT_EQ(got.labelled, want.labelled);
  EXPECT_NEAR(got.loss, want.loss, 1e-12 * std::abs(want.loss));
  for (size_t i = 0; i < whole->parameters().size(); ++i) {
    const Parameter& p = sliced->parameters()[i];
    ASSERT_TRUE(p.grad.defined()) << p.name;
    EXPECT_LT(rel_l2(to_f64(sliced->gathered(p, true)), to_f64(whole->parameters()[i].grad)), 1e-10) << p.name;
  }
  // A row loss (the RL policy losses' path: log-probs, then the cross-entropy gradients scaled row by row) with the
  // rows' entropies.
  const RowLoss row_loss = [](std::span<const double> logp, std::span<double> loss, std::span<double> d) {
    for (size_t i = 0; i < logp.size(); ++i) {
      loss[i] = -(1.0 + 0.1 * double(i % 3)) * logp[i];
      d[i] = -(1.0 + 0.1 * double(i % 3));
    }
  };
  whole->zero_grads();
  sliced->zero_grads();
  std::vector<double> h_want, h_got;
  PackedBatch rb = batch(), rs = batch();
  rb.row_loss = rs.row_loss = &row_loss;
  rb.row_entropy = &h_want;
  rs.row_entropy = &h_got;
  const LossResult rw = whole->loss(rb, true), rg = sliced->loss(rs, true);
  EXPECT_NEAR(rg.loss, rw.loss, 1e-12 * std::abs(rw.loss));
  ASSERT_EQ(h_got.size(), h_want.size());
  EXPECT_LT(rel_l2(h_got, h_want), 1e-12);
  for (size_t i = 0; i < whole->parameters().size(); ++i) {
    const Parameter& p = sliced->parameters()[i];
    ASSERT_TRUE(p.grad.defined()) << p.name;
    EXPECT_LT(rel_l2(to_f64(sliced->gathered(p, true)), to_f64(whole->parameters()[i].grad)), 1e-10)
        << "row loss: " << p.name;
  }
  // Decoding: the rollout engine's sampling reads whole rows of logits (the pieces gathered).
  const std::vector<int32_t> prompt = {3, 17, 5, 5, 44, 1};
  const RolloutResult a = engine_greedy(*whole, prompt, 9), c = engine_greedy(*sliced, prompt, 9);
  EXPECT_EQ(c.tokens, a.tokens);
  EXPECT_LT(rel_l2(c.logprobs, a.logprobs), 1e-10);
}

INSTANTIATE_TEST_SUITE_P(Models, VocabParallelModels,
                         ::testing::Values(std::pair<std::string, bool>{"qwen3", false},
                                           std::pair<std::string, bool>{"qwen3", true},
                                           std::pair<std::string, bool>{"qwen3_5_text", true}));

// A vocabulary tp does not divide (a tokenizer's own size): the embedding and the head stay whole on every rank, and
// the model still equals the whole one.
TEST_F(VocabParallel, AVocabularyTpDoesNotDivideStaysWhole) {
  const int n = world->size();
  nlohmann::json config = tiny_config("qwen3", n, false);
  config["vocab_size"] = kVocab + 1;
  const std::unique_ptr<CausalLm> whole = model(config, nullptr);
  const std::unique_ptr<CausalLm> sliced = model(config, world.get());
  EXPECT_FALSE(sliced->vocab_parallel());
  EXPECT_EQ(sliced->config().vocab_size, kVocab + 1);
  for (const Parameter& p : sliced->parameters())
    if (p.name.find("embed_tokens") != std::string::npos || p.name == "lm_head.weight") EXPECT_TRUE(p.whole()) << p.name;
  expect_equals_whole(*sliced, *whole, batch());
}

}  // namespace
