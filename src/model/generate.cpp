// Generation: the shared KV cache, KV-cache decoding of Qwen3, sampling, streaming detokenisation. Shapes: n new tokens, S cached tokens,
// H hidden, Hq/Hkv heads of D (group = Hq / Hkv query heads share one kv head, as HF's repeat_kv), V vocab.
// The decoding step's attention is built from ops: q (Hkv, group, D) @ K (Hkv, S, D)^T -> softmax -> @ V, in f32
// whatever the model dtype, f64 for f64 (the gathered K and V are copied anyway, so the upcast costs nothing extra).
// Covered by tests/models/test_generate.cpp.
#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "model/generate_qwen3_5.h"
#include "ops/ops.h"

namespace lathe {

namespace {

Tensor to_f32(ExecContext& ctx, const Tensor& x) {
  return x.dtype() == DType::F32 && x.is_contiguous() ? x : cast(ctx, x, DType::F32);
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD, what decode() makes of a cut character

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// KvCache

void KvCache::reserve(ExecContext& cx, int64_t tokens, int64_t length) {
  if (tokens <= capacity_) return;
  const int64_t cap = std::max(tokens, 2 * capacity_);
  for (size_t l = 0; l < k_.size(); ++l) {
    for (std::vector<Tensor>* cache : {&k_, &v_}) {
      Tensor grown = Tensor::empty({cap, heads_, dim_}, dtype_, cx.allocator);
      if (length > 0) copy_into(cx, (*cache)[l].narrow(0, 0, length), grown.narrow(0, 0, length));
      (*cache)[l] = grown;
    }
  }
  capacity_ = cap;
}

void KvCache::write(ExecContext& cx, size_t layer, const Tensor& k, const Tensor& v, int64_t pos) {
  LATHE_ASSERT(pos + k.size(0) <= capacity_);
  copy_into(cx, k, k_[layer].narrow(0, pos, k.size(0)));
  copy_into(cx, v, v_[layer].narrow(0, pos, v.size(0)));
}

Tensor KvCache::attend(ExecContext& cx, size_t layer, const Tensor& q, int64_t length) const {
  const int64_t q_heads = q.size(1), group = q_heads / heads_;
  const DType acc = dtype_ == DType::F64 ? DType::F64 : DType::F32;
  const Tensor k = cast(cx, k_[layer].narrow(0, 0, length).permute({1, 0, 2}), acc);  // (Hkv, S, D)
  const Tensor v = cast(cx, v_[layer].narrow(0, 0, length).permute({1, 0, 2}), acc);  // (Hkv, S, D)
  const Tensor q3 = contiguous(cx, cast(cx, q.view({heads_, group, dim_}), acc));    // (Hkv, group, D)
  // The scale as its own op: matmul's alpha is a float, which an f64 cache must not round to.
  const Tensor scores = scale(cx, matmul(cx, q3, k, {false, true}), 1.0 / std::sqrt(double(dim_)));  // (Hkv, group, S)
  const Tensor p = softmax(cx, scores);                                                               // (Hkv, group, S)
  const Tensor o = matmul(cx, p, v);                                      // (Hkv, group, D)
  return cast(cx, o, dtype_).view({1, q_heads, dim_});
}

Tensor KvCache::extend(ExecContext& ctx, size_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v, int64_t past,
                       const Tensor& prefill_cu) {
  write(ctx, layer, kr, v, past);
  if (past == 0) return attention(ctx, qr, kr, v, prefill_cu, {})[0];
  LATHE_CHECK(qr.size(0) == 1, "generate: a decoding step takes one token at a time, not {}", qr.size(0));
  return attend(ctx, layer, qr, past + 1);
}

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (size_t l = 0; l < k_.size(); ++l) total += k_[l].defined() ? k_[l].nbytes() + v_[l].nbytes() : 0;
  return total;
}

// ---------------------------------------------------------------------------------------------------------------
// KvCacheDecoder

KvCacheDecoder::KvCacheDecoder(Runtime& rt, Qwen3Model& model, int64_t capacity)
    : rt_(&rt), model_(&model),
      cache_(size_t(model.config().num_layers), model.config().num_kv_heads, model.config().head_dim,
             model.options().dtype) {
  reserve(std::max<int64_t>(capacity, 1));
}

void KvCacheDecoder::reserve(int64_t tokens) {
  ExecContext cx = rt_->context(model_->options().device);
  cache_.reserve(cx, tokens, length_);
}

void Decoder::check_feed(std::span<const int32_t> ids, int64_t vocab_size) {
  LATHE_CHECK(!ids.empty(), "generate: no tokens to feed");
  for (int32_t id : ids)
    LATHE_CHECK(id >= 0 && id < vocab_size, "generate: token id {} is outside the vocabulary (size {})", id,
                vocab_size);
}

// The decoder's cache as the model's attention layers see it (DecodeCache): the new tokens' keys and values are
// stored at `past`; a prefill (past 0) attends causally within the new tokens, a step (one token) over the cache.
class KvCacheDecoder::View final : public DecodeCache {
 public:
  View(KvCache& cache, int64_t past, const Tensor& cu_seqlens) : cache_(&cache), past_(past), cu_seqlens_(cu_seqlens) {}
  Tensor attend(ExecContext& ctx, int64_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v) override {
    return cache_->extend(ctx, size_t(layer), qr, kr, v, past_, cu_seqlens_);
  }
  // Qwen3 has no Gated DeltaNet layers.
  Tensor conv_history(int64_t layer) override { LATHE_FAIL("generate: layer {} of a Qwen3 model is not GDN", layer); }
  Tensor gdn_state(int64_t layer) override { LATHE_FAIL("generate: layer {} of a Qwen3 model is not GDN", layer); }
  void set_gdn(int64_t layer, Tensor, Tensor) override { LATHE_FAIL("generate: layer {} of a Qwen3 model is not GDN", layer); }

 private:
  KvCache* cache_;
  int64_t past_;
  Tensor cu_seqlens_;
};

std::vector<float> KvCacheDecoder::feed(std::span<const int32_t> ids) {
  const ModelConfig& c = model_->config();
  check_feed(ids, c.vocab_size);
  // After the prefill, tokens go one at a time: the step's attention has no causal mask within new tokens.
  const size_t chunk = length_ == 0 ? ids.size() : 1;
  const Device device = model_->options().device;
  std::vector<float> out;
  for (size_t first = 0; first < ids.size(); first += chunk) {
    const int64_t n = int64_t(chunk), past = length_;
    reserve(past + n);
    // The model's own layers over the new tokens at positions past.., their attention through the cache.
    const std::vector<int32_t> step(ids.begin() + std::ptrdiff_t(first), ids.begin() + std::ptrdiff_t(first + chunk));
    PackedBatch b = continuation_batch(*rt_, device, {step}, {past}, c.vocab_size);
    View view(cache_, past, b.cu_seqlens);
    b.cache = &view;
    const Tensor logits = model_->last_logits(b);  // (1, V)
    length_ = past + n;  // only now: a failed step leaves the cache as it was
    if (first + chunk < ids.size()) continue;  // logits of the last position only
    ExecContext cx = rt_->context(device);
    const Tensor host = rt_->copy_to(to_f32(cx, logits), Device::cpu());
    out.assign(host.data<float>(), host.data<float>() + host.numel());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Sampling

void check_sampling_options(const SamplingOptions& o) {
  LATHE_CHECK(std::isfinite(o.temperature) && o.temperature >= 0, "generate: temperature must be >= 0, not {}",
              o.temperature);
  LATHE_CHECK(o.top_k >= 0, "generate: top_k must be >= 0 (0 = off), not {}", o.top_k);
  LATHE_CHECK(o.top_p > 0 && o.top_p <= 1, "generate: top_p must be in (0, 1] (1 = off), not {}", o.top_p);
  LATHE_CHECK(o.min_p >= 0 && o.min_p <= 1, "generate: min_p must be in [0, 1] (0 = off), not {}", o.min_p);
  LATHE_CHECK(std::isfinite(o.repetition_penalty) && o.repetition_penalty > 0,
              "generate: repetition_penalty must be > 0 (1 = off), not {}", o.repetition_penalty);
  LATHE_CHECK(std::isfinite(o.frequency_penalty), "generate: frequency_penalty must be finite (0 = off), not {}",
              o.frequency_penalty);
}

SampledToken sample_next(std::span<const float> raw, int64_t allowed_vocab, const SamplingOptions& o,
                         std::span<const int32_t> prompt, std::span<const int32_t> generated, std::mt19937_64& rng) {
  check_sampling_options(o);
  const int64_t n = std::min<int64_t>(allowed_vocab, int64_t(raw.size()));
  LATHE_CHECK(n > 0, "generate: no token id is allowed (allowed vocab {}, {} logits)", allowed_vocab, raw.size());
  for (int64_t i = 0; i < n; ++i)  // -inf marks a masked id; NaN or +inf means the model went wrong
    LATHE_CHECK(!std::isnan(raw[size_t(i)]) && raw[size_t(i)] != std::numeric_limits<float>::infinity(),
                "generate: the model produced a non-finite logit ({} for id {})", raw[size_t(i)], i);
  std::vector<double> logits(raw.begin(), raw.begin() + n);
  if (o.repetition_penalty != 1.0) {
    std::vector<bool> seen(size_t(n), false);
    for (std::span<const int32_t> ids : {prompt, generated})
      for (int32_t id : ids)
        if (id >= 0 && id < n) seen[size_t(id)] = true;
    for (int64_t i = 0; i < n; ++i)
      if (seen[size_t(i)]) {
        double& l = logits[size_t(i)];
        l = l > 0 ? l / o.repetition_penalty : l * o.repetition_penalty;
      }
  }
  if (o.frequency_penalty != 0.0)
    for (int32_t id : generated)
      if (id >= 0 && id < n && std::isfinite(logits[size_t(id)])) logits[size_t(id)] -= o.frequency_penalty;
  const int32_t best = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  LATHE_CHECK(std::isfinite(logits[size_t(best)]), "generate: every token id is masked");
  if (o.temperature == 0) return {best, 0.0};

  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  auto more_likely = [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
  };
  int64_t keep = n;
  if (o.top_k > 0 && o.top_k < n) {
    std::partial_sort(ids.begin(), ids.begin() + o.top_k, ids.end(), more_likely);
    keep = o.top_k;
  } else if (o.top_p < 1) {
    std::sort(ids.begin(), ids.end(), more_likely);
  }
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < keep; ++i) max_logit = std::max(max_logit, logits[size_t(ids[size_t(i)])]);
  std::vector<double> p(static_cast<size_t>(keep));  // unnormalised probabilities of ids[0..keep)
  double total = 0;
  for (int64_t i = 0; i < keep; ++i)
    total += (p[size_t(i)] = std::exp((logits[size_t(ids[size_t(i)])] - max_logit) / o.temperature));
  if (o.top_p < 1) {  // ids are sorted here: keep each id while the mass before it is below p (HF's rule)
    double before = 0;
    int64_t m = 0;
    while (m < keep && before < o.top_p * total) before += p[size_t(m++)];
    keep = m;
    total = before;
  }
  if (o.min_p > 0) {  // the largest probability is the max logit's, exp(0) = 1 unnormalised
    total = 0;
    for (int64_t i = 0; i < keep; ++i) {
      if (p[size_t(i)] < o.min_p) p[size_t(i)] = 0;
      total += p[size_t(i)];
    }
  }
  const double u = double(rng() >> 11) * 0x1.0p-53 * total;  // uniform in [0, total), same on every platform
  double acc = 0;
  int64_t chosen = keep - 1;  // u rounded up to the total: the last id with mass
  while (chosen > 0 && p[size_t(chosen)] == 0) --chosen;
  for (int64_t i = 0; i < keep; ++i) {
    acc += p[size_t(i)];
    if (u < acc) {
      chosen = i;
      break;
    }
  }
  return {ids[size_t(chosen)], std::log(p[size_t(chosen)] / total)};
}

int32_t sample_token(std::span<const float> logits, int64_t allowed_vocab, const SamplingOptions& o,
                     std::mt19937_64& rng) {
  return sample_next(logits, allowed_vocab, o, {}, {}, rng).id;
}

// ---------------------------------------------------------------------------------------------------------------
// TextStream

TextStream::TextStream(const data::Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                       bool skip_special_tokens)
    : tokenizer_(&tokenizer), stop_(std::move(stop_strings)), skip_special_(skip_special_tokens) {
  for (const std::string& s : stop_) LATHE_CHECK(!s.empty(), "generate: a stop string is empty");
}

bool TextStream::push(int32_t id) {
  LATHE_ASSERT(!stopped_);
  ids_.push_back(id);
  const std::string pending = tokenizer_->decode(std::span(ids_).subspan(pending_), skip_special_);
  const size_t before = text_.size();
  // A trailing U+FFFD may be a character cut by the token boundary: hold it (and its tokens) until more tokens
  // decide. Everything before it is final: UTF-8 decoding of earlier bytes does not depend on later ones.
  if (ends_with(pending, kReplacement)) {
    text_ = base_ + pending.substr(0, pending.size() - kReplacement.size());
  } else {
    base_ += pending;
    text_ = base_;
    pending_ = ids_.size();
  }
  LATHE_ASSERT(text_.size() >= before);
  return check_stop(before);
}

bool TextStream::check_stop(size_t from) {
  size_t longest = 0;
  for (const std::string& s : stop_) longest = std::max(longest, s.size());
  if (longest == 0) return false;
  const size_t start = from >= longest - 1 ? from - (longest - 1) : 0;
  size_t cut = std::string::npos;
  for (const std::string& s : stop_) cut = std::min(cut, text_.find(s, start));
  if (cut == std::string::npos) return false;
  LATHE_ASSERT(cut >= taken_);  // held_back() never released text that could start a stop string
  text_.resize(cut);
  stopped_ = true;
  return true;
}

size_t TextStream::held_back() const {
  const std::string_view rest = std::string_view(text_).substr(taken_);
  size_t held = 0;
  for (const std::string& s : stop_)
    for (size_t k = std::min(s.size() - 1, rest.size()); k > held; --k)
      if (ends_with(rest, std::string_view(s).substr(0, k))) {
        held = k;
        break;
      }
  return held;
}

std::string TextStream::take_ready() {
  if (stopped_) return {};
  const size_t end = text_.size() - held_back();
  if (end <= taken_) return {};
  std::string piece = text_.substr(taken_, end - taken_);
  taken_ = end;
  return piece;
}

std::string TextStream::take_rest() {
  if (!stopped_ && pending_ < ids_.size()) {
    const size_t before = text_.size();
    base_ += tokenizer_->decode(std::span(ids_).subspan(pending_), skip_special_);
    text_ = base_;
    pending_ = ids_.size();
    check_stop(before);
  }
  std::string piece = text_.substr(taken_);
  taken_ = text_.size();
  return piece;
}

// ---------------------------------------------------------------------------------------------------------------
// Generator

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEos: return "eos";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
  }
  return "?";
}

Generator::Generator(Runtime& rt, Qwen3Model& model, const data::Tokenizer* tokenizer)
    : Generator(model.config(), tokenizer, std::make_unique<KvCacheDecoder>(rt, model)) {}

Generator::Generator(Runtime& rt, Qwen35Model& model, const data::Tokenizer* tokenizer)
    : Generator(model.config(), tokenizer, std::make_unique<Qwen35Decoder>(rt, model)) {}

namespace {
std::unique_ptr<Decoder> decoder_for(Runtime& rt, CausalLm& model) {
  if (auto* m = dynamic_cast<Qwen3Model*>(&model)) return std::make_unique<KvCacheDecoder>(rt, *m);
  if (auto* m = dynamic_cast<Qwen35Model*>(&model)) return std::make_unique<Qwen35Decoder>(rt, *m);
  LATHE_FAIL("generate: no decoder for {} models", model.config().model_type);
}
}  // namespace

Generator::Generator(Runtime& rt, CausalLm& model, const data::Tokenizer* tokenizer)
    : Generator(model.config(), tokenizer, decoder_for(rt, model)) {}

Generator::~Generator() = default;
Generator::Generator(Generator&&) noexcept = default;
Generator& Generator::operator=(Generator&&) noexcept = default;

Generator::Generator(const ModelConfig& config, const data::Tokenizer* tokenizer, std::unique_ptr<Decoder> decoder)
    : config_(&config), tokenizer_(tokenizer), decoder_(std::move(decoder)) {
  if (tokenizer) unknown_ids_ = tokenizer->ids_without_token(config.vocab_size);
}

GenerateResult Generator::generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                   const TextCallback& on_text) {
  const ModelConfig& c = *config_;
  LATHE_CHECK(!prompt.empty(), "generate: the prompt is empty");
  LATHE_CHECK(options.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, not {}", options.max_new_tokens);
  LATHE_CHECK(options.stop.empty() || tokenizer_ != nullptr, "generate: stop strings need a tokenizer");
  check_sampling_options(options.sampling);
  const int64_t max_len = c.max_position_embeddings > 0 ? c.max_position_embeddings : std::numeric_limits<int64_t>::max();
  LATHE_CHECK(int64_t(prompt.size()) < max_len, "generate: the prompt has {} tokens; the model takes at most {} "
              "(max_position_embeddings)", prompt.size(), max_len);
  const int64_t budget = std::min(options.max_new_tokens, max_len - int64_t(prompt.size()));
  const int64_t allowed = tokenizer_ ? std::min<int64_t>(c.vocab_size, tokenizer_->vocab_size()) : c.vocab_size;

  GenerateResult result;
  std::optional<TextStream> stream;
  if (tokenizer_) stream.emplace(*tokenizer_, options.stop, options.skip_special_tokens);
  std::mt19937_64 rng(options.seed);
  decoder_->reset();
  if (budget > 0) {
    decoder_->reserve(int64_t(prompt.size()) + budget);
    std::vector<float> logits = decoder_->feed(prompt);
    while (true) {
      for (int32_t id : unknown_ids_) logits[size_t(id)] = -std::numeric_limits<float>::infinity();
      const std::span<const int32_t> done(result.tokens);
      const int32_t token = sample_next(logits, allowed, options.sampling, prompt, done, rng).id;
      result.tokens.push_back(token);
      if (std::find(options.eos_ids.begin(), options.eos_ids.end(), token) != options.eos_ids.end()) {
        result.finish_reason = FinishReason::kEos;
        break;
      }
      if (stream && stream->push(token)) {
        result.finish_reason = FinishReason::kStop;
        break;
      }
      if (stream && on_text) {
        const std::string piece = stream->take_ready();
        if (!piece.empty()) on_text(piece);
      }
      if (int64_t(result.tokens.size()) >= budget) break;  // kLength
      logits = decoder_->feed(std::span(&token, 1));
    }
  }
  if (stream) {
    const std::string rest = stream->take_rest();
    if (on_text && !rest.empty()) on_text(rest);
    if (stream->stopped()) result.finish_reason = FinishReason::kStop;
    result.text = stream->text();
  }
  return result;
}

}  // namespace lathe
