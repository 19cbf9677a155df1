// Tokenized corpora: the Corpus interface the packer reads, an in-memory corpus, and the prepared
// (pre-tokenized, memory-mapped) on-disk format that `lathe prepare` writes.
// Convention: a sample is its token ids plus a per-token loss mask where mask[j] = 1 means "token j
// is a training target" (predicted from tokens < j); mask[0] is always 0. Labels are derived from it
// when batches are packed (packing.h): labels[i] = mask[i+1] ? ids[i+1] : -100.
// Prepared corpus = PREFIX.tokens (int32), PREFIX.mask (uint8), PREFIX.index (uint64 offsets, n+1),
// each with a 64-byte header (magic, version, counts, a corpus id shared by the three files); see
// docs/data.md. Covered by tests/data/test_packing.cpp (TokenFile* tests).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace lathe::data {

// One tokenized sample, owned.
struct Sample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> loss_mask;  // same length as ids; 1 = token is a training target

  int64_t labelled() const;  // number of targets (mask entries set)
};

// One sample inside a corpus; the spans stay valid as long as the corpus lives.
struct SampleRef {
  std::span<const int32_t> ids;
  std::span<const uint8_t> loss_mask;
};

// A read-only, indexable collection of samples. Implementations must be safe to read from several
// threads at once (the loader's prefetch thread reads while the trainer holds the corpus).
class Corpus {
 public:
  virtual ~Corpus() = default;
  virtual int64_t size() const = 0;                  // number of samples
  virtual int64_t length(int64_t i) const = 0;       // tokens of sample i
  virtual SampleRef sample(int64_t i) const = 0;     // sample i, 0 <= i < size()
  virtual int64_t total_tokens() const = 0;
};

// Samples held in memory (what a JSONL file becomes once tokenized). Same flat layout as the file.
class MemoryCorpus final : public Corpus {
 public:
  MemoryCorpus() = default;
  void append(const Sample& s);  // s.ids non-empty, mask of the same length
  void reserve(int64_t samples, int64_t tokens);

  int64_t size() const override { return int64_t(offsets_.size()) - 1; }
  int64_t length(int64_t i) const override;
  SampleRef sample(int64_t i) const override;
  int64_t total_tokens() const override { return int64_t(tokens_.size()); }

 private:
  std::vector<int32_t> tokens_;
  std::vector<uint8_t> mask_;
  std::vector<uint64_t> offsets_ = {0};
};

// What a prepared corpus records about how it was made (stored in the index header).
struct TokenFileMeta {
  uint32_t vocab_size = 0;       // one past the largest id the tokenizer can produce; 0 = unknown
  uint64_t tokenizer_hash = 0;   // e.g. FNV-1a of tokenizer.json (hash_bytes); 0 = unknown
};

// Writes a prepared corpus. Data goes to PREFIX.{tokens,mask,index}.tmp-<pid> files; finish() writes
// the headers and renames them into place (tokens, mask, then index last). Destroying a writer that
// was not finished (or a constructor that fails part-way) removes its temporary files, so a failed run leaves no
// partial corpus behind.
class TokenFileWriter {
 public:
  TokenFileWriter(std::string prefix, TokenFileMeta meta);
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  void append(const Sample& s);
  void finish();
  int64_t samples() const { return samples_; }
  int64_t tokens() const { return tokens_; }

 private:
  struct Files;
  void remove_temporaries() noexcept;  // closes and removes every PREFIX.*.tmp-<pid> opened so far

  std::string prefix_;
  TokenFileMeta meta_;
  std::unique_ptr<Files> files_;
  int64_t samples_ = 0, tokens_ = 0;
  bool finished_ = false;
};

// A prepared corpus opened read-only with mmap. open() validates everything that can be checked
// without reading every token: magics, version, element sizes, file sizes against the counts, the
// three headers against each other, and the offsets (start at 0, strictly increasing, end at the
// token count). Token ids are range-checked later, when a batch is built (make_packed_batch).
class TokenFile final : public Corpus {
 public:
  static std::shared_ptr<TokenFile> open(const std::string& prefix);
  ~TokenFile() override;

  int64_t size() const override { return int64_t(offsets_.size()) - 1; }
  int64_t length(int64_t i) const override;
  SampleRef sample(int64_t i) const override;
  int64_t total_tokens() const override { return int64_t(tokens_.size()); }
  const TokenFileMeta& meta() const { return meta_; }
  const std::string& prefix() const { return prefix_; }

 private:
  struct Mapping {
    void* addr = nullptr;
    size_t bytes = 0;
  };
  TokenFile() = default;
  std::string prefix_;
  TokenFileMeta meta_;
  Mapping maps_[3];
  std::span<const int32_t> tokens_;
  std::span<const uint8_t> mask_;
  std::span<const uint64_t> offsets_;
};

// True when PREFIX.index exists (used to tell a prepared corpus from a JSONL file).
bool is_prepared_corpus(const std::string& prefix);

// FNV-1a, 64 bit. Deterministic everywhere; used for corpus fingerprints and tokenizer hashes.
uint64_t hash_bytes(const void* data, size_t n, uint64_t seed = 0xcbf29ce484222325ull);

}  // namespace lathe::data
