// Text generation for one prompt: sampling (greedy, temperature, top-k, top-p, min-p, penalties: sample_next, as the
// rollout engine's host sampler uses it), stop conditions (EOS ids, stop strings on the decoded text, max_new_tokens),
// streaming of complete UTF-8 text (TextStream), and Generator, which runs one prompt through the rollout engine
// (model/rollout_engine.h) — the one path generation takes, through the families' own layers.
// tests/models/test_generate.cpp (sampling, text streams, Generator against a full recompute); dev/ref/check_generate.py
// compares greedy tokens with transformers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"
#include "model/causal_lm.h"

namespace lathe {

struct SamplingOptions {
  double temperature = 0.0;  // 0 = greedy: the largest logit, the lowest id on ties
  int64_t top_k = 0;         // keep the k most likely ids; 0 = all
  double top_p = 1.0;        // then keep the most likely ids until their probability reaches p; 1 = all
  double min_p = 0.0;        // then keep the ids whose probability is at least min_p x the largest; 0 = all
  // Penalties on the logits before everything else (sample_next): Hugging Face's repetition penalty over the prompt
  // and the generated ids (a logit l of an id seen becomes l / r if l > 0, else l r; 1 = off), and the frequency
  // penalty over the generated ids (l - f x its count, as vLLM and OpenAI's API; 0 = off).
  double repetition_penalty = 1.0;
  double frequency_penalty = 0.0;
};

// Throws a lathe::Error naming the first option out of range.
void check_sampling_options(const SamplingOptions& options);

struct SampledToken {
  int32_t id = 0;
  // Its log-probability under the distribution it was drawn from (after penalties, temperature, top-k, top-p and
  // min-p; 0 for greedy, a point mass): what an RL importance ratio divides by.
  double logprob = 0.0;
};

// The next token from `logits`; ids >= `allowed_vocab` and ids whose logit is -inf are never chosen (the embedding may
// be larger than the tokenizer, which may have holes). Applied in Hugging Face's order: penalties (from `prompt` and
// `generated`), temperature, top-k, top-p on the distribution top-k left, min-p on what is left, one draw.
SampledToken sample_next(std::span<const float> logits, int64_t allowed_vocab, const SamplingOptions& options,
                         std::span<const int32_t> prompt, std::span<const int32_t> generated, std::mt19937_64& rng);
// sample_next without a history (no penalty applies).
int32_t sample_token(std::span<const float> logits, int64_t allowed_vocab, const SamplingOptions& options,
                     std::mt19937_64& rng);

// Generated tokens to text, as they come. Text is released only when final: whole UTF-8 characters (a token
// that ends inside a character is held until the character completes) and nothing that could still grow into a
// stop string. The released pieces concatenate to text().
class TextStream {
 public:
  TextStream(const data::Tokenizer& tokenizer, std::vector<std::string> stop_strings, bool skip_special_tokens);

  // Adds one generated token; true when the text now holds a stop string (text() then ends before it).
  bool push(int32_t id);
  // Final text not taken yet (may be empty).
  std::string take_ready();
  // Ends the stream: everything not taken yet, an unfinished character as U+FFFD, cut before a stop string.
  std::string take_rest();
  const std::string& text() const { return text_; }
  bool stopped() const { return stopped_; }

 private:
  bool check_stop(size_t from);
  size_t held_back() const;  // bytes at the end of text_ that could start a stop string

  const data::Tokenizer* tokenizer_;
  std::vector<std::string> stop_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t pending_ = 0;     // ids_[pending_..] are not yet fully decoded
  std::string base_;       // text of ids_[..pending_]
  std::string text_;       // base_ plus the final part of the pending text
  size_t taken_ = 0;       // bytes of text_ already released
  bool stopped_ = false;
};

enum class FinishReason { kEos, kStop, kLength };
const char* finish_reason_name(FinishReason reason);  // "eos", "stop", "length"

struct GenerateOptions {
  int64_t max_new_tokens = 256;
  SamplingOptions sampling;
  uint64_t seed = 0;                  // the request's seed (the rollout engine's sample 0 draws from it)
  std::vector<int32_t> eos_ids;       // any of them ends generation
  std::vector<std::string> stop;      // stop strings, matched on the decoded text (needs a tokenizer)
  bool skip_special_tokens = true;    // special tokens are left out of the text (not out of the tokens)
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids, including the EOS or the token that completed a stop string
  std::string text;             // the completion, cut before a stop string; empty without a tokenizer
  FinishReason finish_reason = FinishReason::kLength;
};

using TextCallback = std::function<void(std::string_view piece)>;

// Generation for one prompt at a time, through the rollout engine (model/rollout_engine.h: the model's own layers over
// a paged cache sized for the prompt and max_new_tokens; sampling as the engine samples, seeded by
// GenerateOptions::seed). Stops on an EOS id, a stop string, max_new_tokens, or when the sequence reaches the model's
// max_position_embeddings (reported as "length").
class Generator {
 public:
  // `tokenizer` may be null: tokens only (no text, no stop strings, ids below the model's vocab_size).
  Generator(Runtime& rt, CausalLm& model, const data::Tokenizer* tokenizer);

  // `on_text` receives the completion in pieces as soon as they are final (see TextStream).
  GenerateResult generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                          const TextCallback& on_text = {});

 private:
  Runtime* rt_;
  CausalLm* model_;
  const data::Tokenizer* tokenizer_;
  std::vector<int32_t> unknown_ids_;  // ids below the tokenizer's vocab_size that it has no token for (never drawn)
};

}  // namespace lathe
