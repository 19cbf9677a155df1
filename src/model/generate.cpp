// Generation of one prompt through the rollout engine, sampling, streaming detokenisation (generate.h).
// Covered by tests/models/test_generate.cpp.
#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "model/rollout_engine.h"

namespace lathe {

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD, what decode() makes of a cut character

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

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

Generator::Generator(Runtime& rt, CausalLm& model, const data::Tokenizer* tokenizer)
    : rt_(&rt), model_(&model), tokenizer_(tokenizer) {
  if (tokenizer) unknown_ids_ = tokenizer->ids_without_token(model.global_config().vocab_size);
}

GenerateResult Generator::generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                   const TextCallback& on_text) {
  const ModelConfig& c = model_->config();
  LATHE_CHECK(!prompt.empty(), "generate: the prompt is empty");
  LATHE_CHECK(options.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, not {}", options.max_new_tokens);
  LATHE_CHECK(options.stop.empty() || tokenizer_ != nullptr, "generate: stop strings need a tokenizer");
  check_sampling_options(options.sampling);
  const int64_t max_len = c.max_position_embeddings > 0 ? c.max_position_embeddings : std::numeric_limits<int64_t>::max();
  LATHE_CHECK(int64_t(prompt.size()) < max_len, "generate: the prompt has {} tokens; the model takes at most {} "
              "(max_position_embeddings)", prompt.size(), max_len);
  const int64_t budget = std::min(options.max_new_tokens, max_len - int64_t(prompt.size()));
  const int64_t vocab = model_->global_config().vocab_size;  // config()'s is a tp rank's rows
  const int64_t allowed = tokenizer_ ? std::min<int64_t>(vocab, tokenizer_->vocab_size()) : vocab;

  GenerateResult result;
  std::optional<TextStream> stream;
  if (tokenizer_) stream.emplace(*tokenizer_, options.stop, options.skip_special_tokens);
  if (budget > 0) {
    EngineOptions eo;  // one sequence: a cache just large enough for it
    eo.max_running = 1;
    eo.share_prefixes = false;
    eo.cache_blocks = (int64_t(prompt.size()) + budget + eo.block_size - 1) / eo.block_size + 1;
    RolloutEngine engine(*rt_, *model_, eo);
    RolloutRequest r;
    r.prompt.assign(prompt.begin(), prompt.end());
    r.max_new_tokens = budget;
    r.sampling = options.sampling;
    r.seed = options.seed;
    r.stop_ids = options.eos_ids;
    r.allowed_vocab = allowed;
    for (int32_t id : unknown_ids_)
      if (id < allowed) r.banned_ids.push_back(id);
    r.on_token = [&](int, int32_t id) {  // an EOS id ends the sample and stays out of the text
      const bool eos = std::find(options.eos_ids.begin(), options.eos_ids.end(), id) != options.eos_ids.end();
      if (!stream || eos) return false;
      if (stream->push(id)) return true;  // a stop string: finish reason "stop"
      if (on_text) {
        const std::string piece = stream->take_ready();
        if (!piece.empty()) on_text(piece);
      }
      return false;
    };
    engine.submit(std::move(r));
    std::vector<RolloutResult> out = engine.run();
    LATHE_ASSERT(out.size() == 1);
    result.tokens = std::move(out[0].tokens);
    result.finish_reason = out[0].finish_reason;
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
