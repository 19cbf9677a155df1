// Text generation: the Decoder interface (feed tokens, get the next-token logits) with KvCacheDecoder for the Qwen3
// model (a per-layer KV cache: the prompt runs as one packed causal forward that fills the cache, then one token per
// step; Qwen35Decoder in generate_qwen3_5.h is the other implementation), sampling (greedy, temperature, top-k,
// top-p, seeded mt19937_64), stop conditions (EOS ids, stop strings on the decoded text, max_new_tokens) and
// streaming of complete UTF-8 text; Generator drives any Decoder.
// KvCacheDecoder runs the model's own layers (Qwen3Model::layer_forward through CausalLm::last_logits), its attention
// through the decoder's KvCache (the DecodeCache the batch carries), so there is one source of the layer maths;
// Qwen35Decoder does the same for the hybrid models.
// tests/models/test_generate.cpp compares every decoding step's logits with a full recompute;
// dev/ref/check_generate.py compares greedy tokens with transformers. One sequence at a time (no batch of prompts).
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
#include "model/qwen3.h"

namespace lathe {

class Qwen35Model;  // model/qwen3_5.h

// Decoding of one sequence with caches. The model is not modified; its parameter tensors are looked up at every
// call, so a model trained in between is used as it is now (the caches are not: reset() after a weight change).
class Decoder {
 public:
  virtual ~Decoder() = default;
  // Appends `ids` to the sequence and returns the logits for the token after the last one: f32 on the host,
  // (vocab_size). With an empty cache the ids run as one packed causal forward (prefill); after that each id
  // runs as one decoding step over the cache. A failed call leaves the caches as they were.
  virtual std::vector<float> feed(std::span<const int32_t> ids) = 0;
  virtual void reset() = 0;                 // forget the sequence, keep the memory
  virtual void reserve(int64_t tokens) = 0;  // grow the caches that grow with the sequence to `tokens` now
  virtual int64_t length() const = 0;       // tokens fed since the last reset

 protected:
  // What feed() checks before touching a cache: at least one id, every id inside the vocabulary.
  static void check_feed(std::span<const int32_t> ids, int64_t vocab_size);
};

// The rotated keys and values of a set of attention layers, (capacity, Hkv, D) each, grown by doubling; and the
// decoding step's attention over them. Shared by KvCacheDecoder and Qwen35Decoder.
class KvCache {
 public:
  KvCache(size_t layers, int64_t kv_heads, int64_t head_dim, DType dtype)
      : k_(layers), v_(layers), heads_(kv_heads), dim_(head_dim), dtype_(dtype) {}
  // Grows every layer to at least `tokens` rows, keeping the first `length` rows.
  void reserve(ExecContext& ctx, int64_t tokens, int64_t length);
  // Rows [pos, pos + n) of layer `layer` = k, v (n, Hkv, D); the capacity must suffice.
  void write(ExecContext& ctx, size_t layer, const Tensor& k, const Tensor& v, int64_t pos);
  // Attention of one query q (1, Hq, D) over the first `length` rows of `layer` (its own included; no mask:
  // every cached position precedes the query), in f32 (f64 for an f64 cache), returned as (1, Hq, D) of the
  // cache's dtype. Query head h reads kv head h / (Hq / Hkv), as HF's repeat_kv.
  Tensor attend(ExecContext& ctx, size_t layer, const Tensor& q, int64_t length) const;
  // A decoding call's attention layer (DecodeCache::attend): stores the n new tokens' kr, v at rows [past, past + n)
  // and returns their attention: a prefill (past 0) causal within them (`prefill_cu`: {0, n}), a step (n 1) over
  // the cache.
  Tensor extend(ExecContext& ctx, size_t layer, const Tensor& qr, const Tensor& kr, const Tensor& v, int64_t past,
                const Tensor& prefill_cu);
  int64_t capacity() const { return capacity_; }
  int64_t bytes() const;  // all layers

 private:
  std::vector<Tensor> k_, v_;
  int64_t heads_, dim_;
  DType dtype_;
  int64_t capacity_ = 0;
};

// KV-cache decoding of one sequence with the Qwen3 model.
class KvCacheDecoder : public Decoder {
 public:
  // `capacity`: initial cache length in tokens; the cache doubles when a sequence outgrows it.
  KvCacheDecoder(Runtime& rt, Qwen3Model& model, int64_t capacity = 256);

  std::vector<float> feed(std::span<const int32_t> ids) override;
  void reset() override { length_ = 0; }
  void reserve(int64_t tokens) override;
  int64_t length() const override { return length_; }
  int64_t capacity() const { return cache_.capacity(); }

 private:
  class View;  // the cache as the model's attention layers see it

  Runtime* rt_;
  Qwen3Model* model_;
  KvCache cache_;
  int64_t length_ = 0;
};

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
  uint64_t seed = 0;                  // seeds the mt19937_64 of each generate() call
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

// Generation for one prompt at a time, reusing one cache. Stops on an EOS id, a stop string, max_new_tokens, or
// when the sequence reaches the model's max_position_embeddings (reported as "length").
class Generator {
 public:
  // `tokenizer` may be null: tokens only (no text, no stop strings, ids below the model's vocab_size).
  Generator(Runtime& rt, Qwen3Model& model, const data::Tokenizer* tokenizer);   // KvCacheDecoder
  Generator(Runtime& rt, Qwen35Model& model, const data::Tokenizer* tokenizer);  // Qwen35Decoder
  Generator(Runtime& rt, CausalLm& model, const data::Tokenizer* tokenizer);     // either, by the model's class
  ~Generator();
  Generator(Generator&&) noexcept;
  Generator& operator=(Generator&&) noexcept;

  // `on_text` receives the completion in pieces as soon as they are final (see TextStream).
  GenerateResult generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                          const TextCallback& on_text = {});
  Decoder& decoder() { return *decoder_; }

 private:
  Generator(const ModelConfig& config, const data::Tokenizer* tokenizer, std::unique_ptr<Decoder> decoder);

  const ModelConfig* config_;
  const data::Tokenizer* tokenizer_;
  std::vector<int32_t> unknown_ids_;  // ids below the tokenizer's vocab_size that it has no token for (masked)
  std::unique_ptr<Decoder> decoder_;
};

}  // namespace lathe
