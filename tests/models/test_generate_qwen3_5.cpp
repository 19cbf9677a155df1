// Cached decoding of the Qwen3.5 hybrid model (Qwen35Decoder) and its op gated_delta_rule_state.
// References: the op against gdn_recurrent_forward (the plain recurrence with the same initial states; the op's CPU
// kernel is the chunked form); every decoding step's logits against Qwen35Model::logits of the full sequence at that
// position (prefill of k tokens then single steps, and single steps from the start), on a random tiny model with
// several GDN and attention layers and on the committed HF fixtures (whose prefill logits are also checked against
// transformers' goldens); greedy tokens of Generator against the argmax of a full forward recomputed each step; the
// GDN caches keep their size; reset(); `lathe generate` on a fixture folder (greedy tokens against the full forward,
// --adapter refused). CUDA decoding against the CPU skips, with the reason, without a GPU or while
// the GDN ops it needs have no CUDA kernels.
// Convention: random models use weights of std 0.3 so that logits are spread and greedy ties do not occur.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>

#include "../e2e/lathe_run.h"
#include "io/safetensors.h"
#include "model/gdn_reference.h"
#include "model/generate_qwen3_5.h"
#include "ops/ops.h"
#include "support/model_support.h"

using namespace lathe;
using namespace lathe::test_support;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = fs::path(LATHE_TEST_DATA_DIR) / "models" / "fixtures" / "qwen3_5";

template <typename V>
int32_t argmax(const V& v) { return int32_t(std::max_element(v.begin(), v.end()) - v.begin()); }

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& x : ids) x = int32_t(rng() % uint32_t(vocab));
  return ids;
}

// 5 layers: GDN, GDN, attention, GDN, attention; H_v = 2 H_k, d_k != d_v; 4 q / 2 kv heads with partial rotary 0.5.
ModelConfig tiny_config(int64_t conv_width = 4) {
  const std::vector<std::string> types = {"linear_attention", "linear_attention", "full_attention", "linear_attention",
                                          "full_attention"};
  nlohmann::json j = {
      {"model_type", "qwen3_5_text"}, {"vocab_size", 48}, {"hidden_size", 32}, {"intermediate_size", 40},
      {"num_hidden_layers", int64_t(types.size())}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
      {"head_dim", 8}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false}, {"layer_types", types},
      {"linear_num_key_heads", 2}, {"linear_num_value_heads", 4}, {"linear_key_head_dim", 8},
      {"linear_value_head_dim", 6}, {"linear_conv_kernel_dim", conv_width}, {"max_position_embeddings", 64},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}}};
  return parse_model_config(j, "test");
}

Qwen35Model random_model(const ModelConfig& c, DType dt, Device d = Device::cpu()) {
  ModelOptions opt;
  opt.dtype = dt;
  opt.device = d;
  return Qwen35Model::random(runtime(), c, opt, 11, 0.3);
}

// Logits (T, V) of the whole sequence as one document, in f64 on the host: row p is the next-token distribution
// after ids[0..p], the reference for the decoding step that ends at p.
std::vector<std::vector<double>> full_logits(Qwen35Model& m, const std::vector<int32_t>& ids) {
  const int32_t n = int32_t(ids.size());
  const PackedBatch b = make_packed_batch(runtime(), m.options().device, ids, {0, n},
                                          std::vector<int32_t>(ids.size(), -100), m.config().vocab_size);
  const std::vector<double> all = to_f64(m.logits(b));
  const size_t v = size_t(m.config().vocab_size);
  std::vector<std::vector<double>> rows;
  for (size_t p = 0; p < ids.size(); ++p) rows.emplace_back(all.begin() + long(p * v), all.begin() + long((p + 1) * v));
  return rows;
}

// Feeds ids[0..prefill) at once, then one token at a time; every step's logits are compared with the full forward.
// Returns the worst relative L2 error.
double check_decoding(Qwen35Model& m, Qwen35Decoder& dec, const std::vector<int32_t>& ids, size_t prefill, double tol) {
  const std::vector<std::vector<double>> want = full_logits(m, ids);
  dec.reset();
  double worst = 0;
  for (size_t end = prefill; end <= ids.size(); ++end) {
    const size_t first = end == prefill ? 0 : end - 1;
    const std::vector<double> got = to_f64(dec.feed_logits(std::span(ids).subspan(first, end - first)));
    const double err = rel_l2(got, want[end - 1]);
    worst = std::max(worst, err);
    EXPECT_LT(err, tol) << "after " << end << " tokens (prefill " << prefill << ")";
  }
  EXPECT_EQ(dec.length(), int64_t(ids.size()));
  return worst;
}

// A DecodeCache of several sequences, as a rollout engine keeps them (model/batch.h): per sequence a KvCache over the
// attention layers and a conv history and recurrent state per GDN layer. Each batch's documents continue the
// sequences `active`, in order; `past` is each sequence's length.
class MultiCache final : public DecodeCache {
 public:
  MultiCache(const ModelConfig& c, DType dt, size_t sequences) : c_(c) {
    for (const std::string& type : c.layer_types) slot_.push_back(type == "linear_attention" ? gdn_layers_++ : attn_layers_++);
    ExecContext cx = runtime().context(Device::cpu());
    const int64_t ch = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim;
    for (size_t s = 0; s < sequences; ++s) {
      kv_.emplace_back(attn_layers_, c.num_kv_heads, c.head_dim, dt);
      kv_.back().reserve(cx, 64, 0);
      hist_.emplace_back();
      state_.emplace_back();
      for (size_t g = 0; g < gdn_layers_; ++g) {
        hist_.back().push_back(zeros({c.linear_conv_kernel_dim - 1, ch}, dt));
        state_.back().push_back(zeros({1, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim},
                                      gdn_state_dtype(dt)));
      }
    }
    past.assign(sequences, 0);
  }
  // The batch of `tokens[i]` continuing sequence active[i]; afterwards `past` grows.
  PackedBatch batch(const std::vector<std::vector<int32_t>>& tokens) {
    std::vector<int64_t> lengths;
    for (size_t s : active) lengths.push_back(past[s]);
    PackedBatch b = continuation_batch(runtime(), Device::cpu(), tokens, lengths, c_.vocab_size);
    rows_ = b.host_cu;
    b.cache = this;
    return b;
  }
  void advance() {
    for (size_t i = 0; i < active.size(); ++i) past[active[i]] += rows_[i + 1] - rows_[i];
  }

  Tensor attend(ExecContext& ctx, int64_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v) override {
    Tensor out = Tensor::empty({qr.size(0), qr.size(1), qr.size(2)}, qr.dtype(), ctx.allocator);
    for (size_t i = 0; i < active.size(); ++i) {
      const int64_t first = rows_[i], n = rows_[i + 1] - first;
      const int32_t cu[2] = {0, int32_t(n)};
      const Tensor o = kv_[active[i]].extend(ctx, slot_[size_t(layer)], qr.narrow(0, first, n), kr.narrow(0, first, n),
                                             v.narrow(0, first, n), past[active[i]],
                                             runtime().from_host(cu, {2}, DType::I32, Device::cpu()));
      copy_into(ctx, o, out.narrow(0, first, n));
    }
    return out;
  }
  Tensor conv_history(int64_t layer) override { return stack(hist_, layer); }
  Tensor gdn_state(int64_t layer) override {
    const Tensor s = stack(state_, layer);
    return s.view({s.size(0), s.size(2), s.size(3), s.size(4)});
  }
  void set_gdn(int64_t layer, Tensor conv_history, Tensor state) override {
    for (size_t i = 0; i < active.size(); ++i) {
      hist_[active[i]][slot_[size_t(layer)]] = contiguous_copy(conv_history.narrow(0, int64_t(i), 1)).view(
          {conv_history.size(1), conv_history.size(2)});
      state_[active[i]][slot_[size_t(layer)]] = contiguous_copy(state.narrow(0, int64_t(i), 1));
    }
  }

  std::vector<size_t> active;
  std::vector<int64_t> past;

 private:
  static Tensor zeros(const Shape& shape, DType dt) {
    std::vector<double> z(size_t(std::max<int64_t>(1, std::accumulate(shape.begin(), shape.end(), int64_t(1), std::multiplies<>()))), 0.0);
    ExecContext cx = runtime().context(Device::cpu());
    return cast(cx, runtime().from_host(z.data(), shape, DType::F64, Device::cpu()), dt);
  }
  static Tensor contiguous_copy(const Tensor& t) {
    ExecContext cx = runtime().context(Device::cpu());
    Tensor out = Tensor::empty(t.shape(), t.dtype(), cx.allocator);
    copy_into(cx, t, out);
    return out;
  }
  // The active sequences' tensors of `layer`, stacked along a new first axis.
  Tensor stack(const std::vector<std::vector<Tensor>>& per_seq, int64_t layer) {
    ExecContext cx = runtime().context(Device::cpu());
    const Tensor& one = per_seq[active[0]][slot_[size_t(layer)]];
    Shape shape = one.shape();
    shape.insert(shape.begin(), int64_t(active.size()));
    Tensor out = Tensor::empty(shape, one.dtype(), cx.allocator);
    for (size_t i = 0; i < active.size(); ++i)
      copy_into(cx, per_seq[active[i]][slot_[size_t(layer)]], out.narrow(0, int64_t(i), 1).view(one.shape()));
    return out;
  }

  ModelConfig c_;
  std::vector<size_t> slot_;
  size_t gdn_layers_ = 0, attn_layers_ = 0;
  std::vector<KvCache> kv_;
  std::vector<std::vector<Tensor>> hist_, state_;
  std::vector<int32_t> rows_;
};

}  // namespace

// Several sequences decoded as one batch through the model's own layers (a multi-sequence DecodeCache, as a rollout
// engine keeps): a prefill of three prompts of different lengths in one batch, steps of one token per sequence, and
// steps where one sequence has left the batch; every row's logits against that sequence decoded alone
// (Qwen35Decoder, itself checked against the full forward above), in f64.
TEST(Qwen35Decode, ABatchOfSequencesDecodesAsEachAlone) {
  const ModelConfig c = tiny_config();
  Qwen35Model m = random_model(c, DType::F64);
  const std::vector<std::vector<int32_t>> prompts = {random_ids(5, c.vocab_size, 3), random_ids(2, c.vocab_size, 4),
                                                     random_ids(7, c.vocab_size, 5)};
  std::vector<Qwen35Decoder> alone;
  for (size_t s = 0; s < 3; ++s) alone.emplace_back(runtime(), m, 4);
  MultiCache cache(c, DType::F64, 3);
  const size_t v = size_t(c.vocab_size);
  const auto check = [&](const std::vector<std::vector<int32_t>>& tokens, const std::string& what) {
    const PackedBatch b = cache.batch(tokens);
    const std::vector<double> got = to_f64(m.last_logits(b));
    cache.advance();
    ASSERT_EQ(got.size(), cache.active.size() * v);
    for (size_t i = 0; i < cache.active.size(); ++i) {
      const std::vector<double> want = to_f64(alone[cache.active[i]].feed_logits(tokens[i]));
      const std::vector<double> row(got.begin() + long(i * v), got.begin() + long((i + 1) * v));
      EXPECT_LT(rel_l2(row, want), 1e-12) << what << ", sequence " << cache.active[i];
    }
  };
  cache.active = {0, 1, 2};
  check(prompts, "prefill");
  for (int step = 0; step < 4; ++step) {
    const std::vector<int32_t> next = random_ids(3, c.vocab_size, uint64_t(10 + step));
    check({{next[0]}, {next[1]}, {next[2]}}, "step " + std::to_string(step));
  }
  cache.active = {0, 2};  // sequence 1 finished
  for (int step = 0; step < 3; ++step) {
    const std::vector<int32_t> next = random_ids(2, c.vocab_size, uint64_t(20 + step));
    check({{next[0]}, {next[1]}}, "without sequence 1, step " + std::to_string(step));
  }
  EXPECT_EQ(cache.past, (std::vector<int64_t>{12, 6, 14}));
}

// The op's CPU kernel (the chunked form) against the plain recurrence, with non-zero initial states, several
// documents (one of one token, one empty), H_v > H_k.
TEST(GdnStateOp, MatchesRecurrentReferenceWithInitialStates) {
  const GdnDims dims{2, 4, 8, 6, 0.0};
  const std::vector<int32_t> cu = {0, 5, 6, 6, 19};  // documents of 5, 1, 0 and 13 tokens
  const int64_t t = cu.back(), n = int64_t(cu.size()) - 1;
  std::mt19937_64 rng(3);
  auto draw = [&](int64_t count, double lo, double hi) {
    std::uniform_real_distribution<double> u(lo, hi);
    std::vector<double> out(static_cast<size_t>(count));
    for (double& x : out) x = u(rng);
    return out;
  };
  const std::vector<double> q = draw(t * 2 * 8, -0.35, 0.35), k = draw(t * 2 * 8, -0.35, 0.35);
  const std::vector<double> v = draw(t * 4 * 6, -2, 2), g = draw(t * 4, -1.5, -0.001), beta = draw(t * 4, 0.001, 1);
  const std::vector<double> s0 = draw(n * 4 * 8 * 6, -1, 1);
  const GdnOutputs<double> ref = gdn_recurrent_forward<double>(dims, {q, k, v, g, beta, cu, s0});

  Runtime& rt = runtime();
  ExecContext cx = rt.context(Device::cpu());
  auto host = [&](const std::vector<double>& x, Shape s) { return rt.from_host(x.data(), s, DType::F64, Device::cpu()); };
  const Tensor cu_t = rt.from_host(cu.data(), {n + 1}, DType::I32, Device::cpu());
  for (int64_t chunk : {int64_t(4), int64_t(64)}) {
    SCOPED_TRACE(chunk);
    const std::vector<Tensor> out =
        gated_delta_rule_state(cx, host(q, {t, 2, 8}), host(k, {t, 2, 8}), host(v, {t, 4, 6}), host(g, {t, 4}),
                               host(beta, {t, 4}), cu_t, host(s0, {n, 4, 8, 6}), GatedDeltaAttrs{0.0, chunk});
    EXPECT_LT(rel_l2(to_f64(out[0]), ref.o), 1e-12);
    EXPECT_LT(rel_l2(to_f64(out[1]), ref.final_state), 1e-12);
    // The empty document's final state is its initial state, exactly.
    const std::vector<double> fin = to_f64(out[1]);
    const size_t doc = 4 * 8 * 6;
    EXPECT_TRUE(std::equal(fin.begin() + 2 * doc, fin.begin() + 3 * doc, s0.begin() + 2 * doc));
  }
  // Bad states are refused by name.
  const size_t per = 4 * 8 * 6;
  auto expect_error = [&](const Tensor& state, const std::string& needle) {
    try {
      gated_delta_rule_state(cx, host(q, {t, 2, 8}), host(k, {t, 2, 8}), host(v, {t, 4, 6}), host(g, {t, 4}),
                             host(beta, {t, 4}), cu_t, state);
      ADD_FAILURE() << "accepted a state " << state.describe();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(host(s0, {n, 4, 6, 8}), "state (N, H_v, d_k, d_v)");
  expect_error(host(std::vector<double>(3 * per, 0.0), {3, 4, 8, 6}), "for 4 documents");
  expect_error(cast(cx, host(s0, {n, 4, 8, 6}), DType::F32), "needs the state in f64");
}

TEST(Qwen35Decode, EveryStepMatchesTheFullForward) {
  const ModelConfig c = tiny_config();
  const std::vector<int32_t> ids = random_ids(20, c.vocab_size, 1);
  for (const auto& [dtype, tol] : {std::pair{DType::F64, 1e-9}, std::pair{DType::F32, 1e-4}}) {
    SCOPED_TRACE(dtype_name(dtype));
    Qwen35Model m = random_model(c, dtype);
    Qwen35Decoder dec(runtime(), m, 2);  // a small KV cache, so it grows while decoding
    double worst = 0;
    for (size_t prefill : {size_t(7), size_t(1), size_t(20)}) {  // k tokens then steps; all single steps; all at once
      SCOPED_TRACE(prefill);
      worst = std::max(worst, check_decoding(m, dec, ids, prefill, tol));
    }
    std::printf("[ %s ] worst relative L2 error of decoded logits: %.2e\n", std::string(dtype_name(dtype)).c_str(),
                worst);
  }
}

// A conv of width 1 has no history to cache; width 2 keeps one row.
TEST(Qwen35Decode, ConvWidthsOneAndTwo) {
  for (int64_t width : {1, 2}) {
    SCOPED_TRACE(width);
    const ModelConfig c = tiny_config(width);
    Qwen35Model m = random_model(c, DType::F64);
    Qwen35Decoder dec(runtime(), m);
    check_decoding(m, dec, random_ids(9, c.vocab_size, 4), 3, 1e-9);
    EXPECT_EQ(dec.conv_state(0).size(0), width - 1);
  }
}

TEST(Qwen35Decode, GdnCachesKeepTheirSizeAndResetRepeats) {
  const ModelConfig c = tiny_config();
  Qwen35Model m = random_model(c, DType::F32);
  Qwen35Decoder dec(runtime(), m, 4);
  const int64_t channels = 2 * 2 * 8 + 4 * 6;
  const int64_t gdn_bytes = dec.gdn_cache_bytes();
  // 3 GDN layers x (conv (3, 56) f32 + state (1, 4, 8, 6) f32).
  EXPECT_EQ(gdn_bytes, 3 * (3 * channels * 4 + 4 * 8 * 6 * 4));
  const std::vector<int32_t> ids = random_ids(40, c.vocab_size, 2);
  const std::vector<float> first = dec.feed(std::span(ids).subspan(0, 5));
  std::vector<double> state_before = to_f64(dec.recurrent_state(0));
  std::vector<float> last;
  for (size_t i = 5; i < ids.size(); ++i) {
    last = dec.feed(std::span(ids).subspan(i, 1));
    for (size_t layer : {size_t(0), size_t(1), size_t(3)}) {
      EXPECT_EQ(dec.conv_state(layer).shape(), (Shape{3, channels}));
      EXPECT_EQ(dec.recurrent_state(layer).shape(), (Shape{1, 4, 8, 6}));
    }
    EXPECT_EQ(dec.gdn_cache_bytes(), gdn_bytes) << "after " << i + 1 << " tokens";
  }
  EXPECT_GE(dec.capacity(), 40);  // the KV cache of the attention layers grew; the GDN caches did not
  EXPECT_GT(rel_l2(to_f64(dec.recurrent_state(0)), state_before), 1e-3);  // the state does move
  EXPECT_THROW(dec.conv_state(2), Error);  // an attention layer
  // reset() forgets the sequence: the same tokens give the same logits, bit for bit.
  dec.reset();
  EXPECT_EQ(dec.length(), 0);
  EXPECT_EQ(dec.feed(std::span(ids).subspan(0, 5)), first);
  std::vector<float> again;
  for (size_t i = 5; i < ids.size(); ++i) again = dec.feed(std::span(ids).subspan(i, 1));
  EXPECT_EQ(again, last);
  // A bad id is refused and leaves the caches as they were.
  const int64_t before = dec.length();
  EXPECT_THROW(dec.feed(std::vector<int32_t>{int32_t(c.vocab_size)}), Error);
  EXPECT_THROW(dec.feed(std::vector<int32_t>{}), Error);
  EXPECT_EQ(dec.length(), before);
}

TEST(Qwen35Decode, GreedyGeneratorMatchesRecompute) {
  const ModelConfig c = tiny_config();
  Qwen35Model m = random_model(c, DType::F32);
  Generator gen(runtime(), m, nullptr);
  const std::vector<int32_t> prompt = random_ids(6, c.vocab_size, 5);
  GenerateOptions o;
  o.max_new_tokens = 16;
  const GenerateResult r = gen.generate(prompt, o);
  ASSERT_EQ(r.tokens.size(), 16u);
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  std::vector<int32_t> seq = prompt;
  for (int32_t t : r.tokens) {
    EXPECT_EQ(t, argmax(full_logits(m, seq).back())) << "after " << seq.size() << " tokens";
    seq.push_back(t);
  }
  // Generating again (the decoder is reset) gives the same tokens; sampling is seeded.
  EXPECT_EQ(gen.generate(prompt, o).tokens, r.tokens);
  o.sampling = {1.0, 0, 1.0};
  o.seed = 3;
  EXPECT_EQ(gen.generate(prompt, o).tokens, gen.generate(prompt, o).tokens);
}

// The committed HF fixtures: the prefill logits match transformers' goldens, and decoding matches the full forward.
TEST(Qwen35Decode, MatchesOnHfFixtures) {
  ASSERT_TRUE(fs::exists(kFixtures)) << "fixtures missing: " << kFixtures << " (made by dev/ref/qwen3_5_fixtures.py)";
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    if (!entry.is_directory()) continue;
    SCOPED_TRACE(entry.path().filename().string());
    const io::SafetensorsFile ref = io::SafetensorsFile::open((entry.path() / "reference.safetensors").string());
    std::vector<int32_t> ids(size_t(ref.get("input_ids").numel)), cu(size_t(ref.get("cu_seqlens").numel));
    ref.read_into("input_ids", DType::I32, ids.data(), ids.size() * 4);
    ref.read_into("cu_seqlens", DType::I32, cu.data(), cu.size() * 4);
    const std::vector<float> golden = ref.read_as_f32("logits");  // (T, V)
    for (const auto& [dtype, tol] : {std::pair{DType::F64, 1e-9}, std::pair{DType::F32, 1e-4}}) {
      SCOPED_TRACE(dtype_name(dtype));
      ModelOptions opt;
      opt.dtype = dtype;
      Qwen35Model m = Qwen35Model::load(runtime(), (entry.path() / "model").string(), opt);
      const int64_t vocab = m.config().vocab_size;
      // Document 1 alone (positions 0.. of its own sequence): the prefill's last-position logits against HF.
      const std::vector<int32_t> doc(ids.begin() + cu[1], ids.begin() + cu[2]);
      Qwen35Decoder dec(runtime(), m);
      const std::vector<double> got = to_f64(dec.feed_logits(doc));
      const std::vector<float> want(golden.begin() + (cu[2] - 1) * vocab, golden.begin() + cu[2] * vocab);
      const double vs_hf = rel_l2(got, want);
      EXPECT_LT(vs_hf, dtype == DType::F64 ? 1e-6 : 1e-5);
      // Extend the document greedily (from the full forward) and check every decoding step.
      std::vector<int32_t> seq = doc;
      for (int s = 0; s < 12; ++s) seq.push_back(argmax(full_logits(m, seq).back()));
      const double worst = std::max(check_decoding(m, dec, seq, doc.size(), tol), check_decoding(m, dec, seq, 1, tol));
      std::printf("[ %s %s ] prefill vs transformers %.2e, worst decoding step vs full forward %.2e\n",
                  entry.path().filename().string().c_str(), std::string(dtype_name(dtype)).c_str(), vs_hf, worst);
    }
    ++checked;
  }
  EXPECT_GE(checked, 4);
}

// `lathe generate` reads a qwen3_5 folder: its greedy tokens equal the argmax of the full forward at each step.
TEST(Qwen35GenerateCli, GreedyTokensMatchTheFullForward) {
  const fs::path dir = kFixtures / "hv_gt_hk_untied" / "model";
  const lathe_e2e::LatheRun run = lathe_e2e::lathe("generate --model " + dir.string() +
                                                   " --prompt-tokens 3,1,4,1,5 --max-new-tokens 8 --print-tokens "
                                                   "--ignore-eos --dtype f64");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const size_t at = run.output.find("{\"completion\"");
  ASSERT_NE(at, std::string::npos) << run.output;
  const nlohmann::json result = nlohmann::json::parse(run.output.substr(at, run.output.find('\n', at) - at));
  const std::vector<int32_t> tokens = result["tokens"].get<std::vector<int32_t>>();
  ASSERT_EQ(tokens.size(), 8u);
  ModelOptions opt;
  opt.dtype = DType::F64;
  Qwen35Model m = Qwen35Model::load(runtime(), dir.string(), opt);
  std::vector<int32_t> seq = {3, 1, 4, 1, 5};
  for (int32_t t : tokens) {
    EXPECT_EQ(t, argmax(full_logits(m, seq).back())) << "after " << seq.size() << " tokens";
    seq.push_back(t);
  }
  // A folder without a PEFT adapter is refused by name (the adapter path itself: tests/e2e/test_train_qwen3_5.cpp).
  const lathe_e2e::LatheRun refused = lathe_e2e::lathe("generate --model " + dir.string() +
                                                       " --prompt-tokens 3 --adapter " + dir.string());
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("adapter_config.json"), std::string::npos) << refused.output;
}

// `lathe generate --input` runs the rollout engine: three token lines of different lengths, two samples each, at most
// two sequences at once; greedy, so every sample's tokens are the argmax chain of the full forward from its prompt and
// its log-probs that forward's log-softmax; two lines per input line, in input order (no tokenizer here: no "text").
TEST(Qwen35GenerateCli, InputLinesGenerateTogetherAsEachAlone) {
  const fs::path dir = kFixtures / "hv_gt_hk_untied" / "model";
  const fs::path work = fs::temp_directory_path() / "lathe_test_generate_input";
  fs::remove_all(work);
  fs::create_directories(work);
  const std::vector<std::vector<int32_t>> prompts = {{3, 1, 4, 1, 5}, {2}, {7, 7, 0, 9, 2, 6, 5, 3, 1}};
  {
    std::ofstream f(work / "in.jsonl");
    for (const auto& p : prompts) f << nlohmann::json{{"tokens", p}}.dump() << "\n";
  }
  const lathe_e2e::LatheRun run = lathe_e2e::lathe(
      "generate --model " + dir.string() + " --input " + (work / "in.jsonl").string() + " --output " +
      (work / "out.jsonl").string() + " --n 2 --max-new-tokens 6 --ignore-eos --dtype f64 --max-running 2");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ModelOptions opt;
  opt.dtype = DType::F64;
  Qwen35Model m = Qwen35Model::load(runtime(), dir.string(), opt);
  std::ifstream in(work / "out.jsonl");
  std::string line;
  for (const auto& prompt : prompts)
    for (int sample = 0; sample < 2; ++sample) {
      ASSERT_TRUE(std::getline(in, line)) << "fewer lines than prompts x 2";
      const nlohmann::json j = nlohmann::json::parse(line);
      EXPECT_FALSE(j.contains("text"));
      EXPECT_EQ(j["finish_reason"], "length");
      const std::vector<int32_t> tokens = j["tokens"].get<std::vector<int32_t>>();
      const std::vector<double> logprobs = j["logprobs"].get<std::vector<double>>();
      ASSERT_EQ(tokens.size(), 6u);
      ASSERT_EQ(logprobs.size(), 6u);
      std::vector<int32_t> seq = prompt;
      for (size_t k = 0; k < tokens.size(); ++k) {
        const std::vector<double> row = full_logits(m, seq).back();
        EXPECT_EQ(tokens[k], argmax(row)) << "prompt of " << prompt.size() << ", token " << k;
        const double mx = *std::max_element(row.begin(), row.end());
        double sum = 0;
        for (double x : row) sum += std::exp(x - mx);
        EXPECT_NEAR(logprobs[k], row[size_t(tokens[k])] - mx - std::log(sum), 1e-9);
        seq.push_back(tokens[k]);
      }
    }
  EXPECT_FALSE(std::getline(in, line)) << "more lines than prompts x 2: " << line;
  EXPECT_NE(run.output.find("prompt tokens shared"), std::string::npos) << run.output;
  fs::remove_all(work);
}

// CUDA decoding (f32, bf16) against the CPU f32 full forward of the same weights.
TEST(Qwen35DecodeCuda, MatchesCpu) {
  std::string why;
  if (!runtime().has_device(Device::cuda(0), &why)) GTEST_SKIP() << "no CUDA device: " << why;
  std::vector<std::string> missing;
  for (DType dt : {DType::F32, DType::BF16})
    for (OpId op : {OpId::sigmoid, OpId::causal_conv1d, OpId::gdn_decay, OpId::gated_delta_rule_state})
      if (!runtime().registry().has_kernel(op, DeviceType::CUDA, dt))
        missing.push_back(fmt::format("{} {}", op_name(op), dtype_name(dt)));
  if (!missing.empty())
    GTEST_SKIP() << "no CUDA kernel yet for: " << fmt::format("{}", fmt::join(missing, ", "));
  const ModelConfig c = tiny_config();
  Qwen35Model cpu = random_model(c, DType::F32);
  const std::vector<int32_t> ids = random_ids(24, c.vocab_size, 6);
  const std::vector<std::vector<double>> want = full_logits(cpu, ids);
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Qwen35Model gpu = random_model(c, dtype, Device::cuda(0));
    // The same weights' full forward on CUDA in this dtype (the training path: chunked kernels), against the CPU.
    const std::vector<std::vector<double>> forward = full_logits(gpu, ids);
    Qwen35Decoder dec(runtime(), gpu, 4);
    double worst = 0, forward_worst = 0;
    std::vector<float> got = dec.feed(std::span(ids).subspan(0, 8));
    for (size_t end = 8;; ++end) {
      worst = std::max(worst, rel_l2(got, want[end - 1]));
      forward_worst = std::max(forward_worst, rel_l2(forward[end - 1], want[end - 1]));
      if (end == ids.size()) break;
      got = dec.feed(std::span(ids).subspan(end, 1));
    }
    std::printf("[ cuda %s ] worst relative L2 error vs the CPU f32 forward: decoded logits %.2e, full forward %.2e\n",
                std::string(dtype_name(dtype)).c_str(), worst, forward_worst);
    // f32: rounding only. bf16: the rounding of bf16 weights and activations, which the full forward in bf16 shows
    // too (a broken cache gives errors of order 1); decoding may round differently but not twice as far.
    if (dtype == DType::F32) EXPECT_LT(worst, 1e-4);
    else EXPECT_LT(worst, 2.0 * forward_worst + 1e-3);
  }
}
