// The prepared-corpus format (PREFIX.tokens / .mask / .index) and the in-memory corpus.
// Convention: every file starts with the same 64-byte little-endian header; the payload follows at
// byte 64, so int32 and uint64 arrays are naturally aligned in the mapping. A random corpus id ties
// the three files of one `prepare` run together, so a mix of files from two runs is refused. The writer writes
// PREFIX.*.tmp-PID and renames them at finish(); a failure anywhere before (constructor included) removes them all.
// Covered by tests/data/test_packing.cpp (TokenFile* tests).
#include "data/token_file.h"

#include "core/error.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace lathe::data {
namespace {

constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 64;

struct FileHeader {
  char magic[8];
  uint32_t version;
  uint32_t elem_size;
  uint64_t count;        // elements after the header
  uint64_t num_samples;
  uint64_t num_tokens;
  uint64_t corpus_id;
  uint32_t vocab_size;
  uint32_t reserved;
  uint64_t tokenizer_hash;
};
static_assert(sizeof(FileHeader) == kHeaderBytes);

struct Part {
  const char* suffix;
  const char* magic;
  uint32_t elem_size;
};
constexpr Part kParts[3] = {{".tokens", "LATHETOK", 4}, {".mask", "LATHEMSK", 1}, {".index", "LATHEIDX", 8}};

uint64_t random_corpus_id() {
  std::random_device rd;
  const uint64_t id = (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(getpid());
  return id == 0 ? 1 : id;
}

void write_all(std::FILE* f, const void* data, size_t n, const std::string& path) {
  if (n == 0) return;
  LATHE_CHECK(std::fwrite(data, 1, n, f) == n, "data: writing {} failed: {}", path, std::strerror(errno));
}

}  // namespace

int64_t Sample::labelled() const {
  int64_t n = 0;
  for (uint8_t m : loss_mask) n += m != 0;
  return n;
}

uint64_t hash_bytes(const void* data, size_t n, uint64_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

// ---- MemoryCorpus --------------------------------------------------------------------------------

void MemoryCorpus::append(const Sample& s) {
  LATHE_CHECK(!s.ids.empty(), "data: cannot add an empty sample to a corpus");
  LATHE_CHECK(s.loss_mask.size() == s.ids.size(), "data: sample has {} ids but {} mask entries", s.ids.size(),
              s.loss_mask.size());
  tokens_.insert(tokens_.end(), s.ids.begin(), s.ids.end());
  mask_.insert(mask_.end(), s.loss_mask.begin(), s.loss_mask.end());
  offsets_.push_back(tokens_.size());
}

void MemoryCorpus::reserve(int64_t samples, int64_t tokens) {
  offsets_.reserve(size_t(samples) + 1);
  tokens_.reserve(size_t(tokens));
  mask_.reserve(size_t(tokens));
}

int64_t MemoryCorpus::length(int64_t i) const {
  LATHE_ASSERT(i >= 0 && i < size());
  return int64_t(offsets_[size_t(i) + 1] - offsets_[size_t(i)]);
}

SampleRef MemoryCorpus::sample(int64_t i) const {
  LATHE_ASSERT(i >= 0 && i < size());
  const size_t a = offsets_[size_t(i)], n = offsets_[size_t(i) + 1] - a;
  return {std::span<const int32_t>(tokens_).subspan(a, n), std::span<const uint8_t>(mask_).subspan(a, n)};
}

// ---- TokenFileWriter -----------------------------------------------------------------------------

struct TokenFileWriter::Files {
  std::string tmp[3], final[3];
  std::FILE* f[3] = {nullptr, nullptr, nullptr};
  std::vector<char> buffers[3];
};

TokenFileWriter::TokenFileWriter(std::string prefix, TokenFileMeta meta)
    : prefix_(std::move(prefix)), meta_(meta), files_(std::make_unique<Files>()) {
  LATHE_CHECK(!prefix_.empty(), "data: the output prefix of a prepared corpus is empty");
  const std::filesystem::path dir = std::filesystem::path(prefix_).parent_path();
  std::error_code ec;
  LATHE_CHECK(dir.empty() || std::filesystem::exists(dir, ec), "data: cannot write {}.tokens: its folder {} does not "
              "exist", prefix_, dir.string());
  LATHE_CHECK(dir.empty() || std::filesystem::is_directory(dir, ec), "data: cannot write {}.tokens: {} is a file, not "
              "a folder", prefix_, dir.string());
  try {
    for (int p = 0; p < 3; ++p) {
      files_->final[p] = prefix_ + kParts[p].suffix;
      LATHE_CHECK(!std::filesystem::is_directory(files_->final[p], ec), "data: output {} is a folder, not a file",
                  files_->final[p]);
      files_->tmp[p] = files_->final[p] + fmt::format(".tmp-{}", getpid());
      files_->f[p] = std::fopen(files_->tmp[p].c_str(), "wb");
      LATHE_CHECK(files_->f[p] != nullptr, "data: cannot create {}: {}", files_->tmp[p], std::strerror(errno));
      files_->buffers[p].resize(1 << 20);
      std::setvbuf(files_->f[p], files_->buffers[p].data(), _IOFBF, files_->buffers[p].size());
      const char zeros[kHeaderBytes] = {};
      write_all(files_->f[p], zeros, kHeaderBytes, files_->tmp[p]);  // the header is written by finish()
    }
    const uint64_t zero = 0;
    write_all(files_->f[2], &zero, sizeof zero, files_->tmp[2]);  // offsets start at 0
  } catch (...) {
    remove_temporaries();  // a constructor that throws gets no destructor
    throw;
  }
}

TokenFileWriter::~TokenFileWriter() {
  if (finished_ || !files_) return;
  remove_temporaries();
}

void TokenFileWriter::remove_temporaries() noexcept {
  for (int p = 0; p < 3; ++p) {
    if (files_->f[p]) std::fclose(files_->f[p]);
    files_->f[p] = nullptr;
    if (!files_->tmp[p].empty()) std::remove(files_->tmp[p].c_str());
  }
}

void TokenFileWriter::append(const Sample& s) {
  LATHE_CHECK(!finished_, "data: {} is already finished", prefix_);
  LATHE_CHECK(!s.ids.empty(), "data: cannot add an empty sample to {}", prefix_);
  LATHE_CHECK(s.loss_mask.size() == s.ids.size(), "data: sample has {} ids but {} mask entries", s.ids.size(),
              s.loss_mask.size());
  write_all(files_->f[0], s.ids.data(), s.ids.size() * sizeof(int32_t), files_->tmp[0]);
  write_all(files_->f[1], s.loss_mask.data(), s.loss_mask.size(), files_->tmp[1]);
  tokens_ += int64_t(s.ids.size());
  samples_ += 1;
  const uint64_t end = uint64_t(tokens_);
  write_all(files_->f[2], &end, sizeof end, files_->tmp[2]);
}

void TokenFileWriter::finish() {
  LATHE_CHECK(!finished_, "data: {} is already finished", prefix_);
  const uint64_t id = random_corpus_id();
  const uint64_t counts[3] = {uint64_t(tokens_), uint64_t(tokens_), uint64_t(samples_) + 1};
  for (int p = 0; p < 3; ++p) {
    FileHeader h{};
    std::memcpy(h.magic, kParts[p].magic, 8);
    h.version = kVersion;
    h.elem_size = kParts[p].elem_size;
    h.count = counts[p];
    h.num_samples = uint64_t(samples_);
    h.num_tokens = uint64_t(tokens_);
    h.corpus_id = id;
    h.vocab_size = meta_.vocab_size;
    h.tokenizer_hash = meta_.tokenizer_hash;
    std::FILE* f = files_->f[p];
    LATHE_CHECK(std::fflush(f) == 0 && std::fseek(f, 0, SEEK_SET) == 0, "data: writing {} failed: {}",
                files_->tmp[p], std::strerror(errno));
    write_all(f, &h, sizeof h, files_->tmp[p]);
    LATHE_CHECK(std::fflush(f) == 0 && fsync(fileno(f)) == 0, "data: writing {} failed: {}", files_->tmp[p],
                std::strerror(errno));
    files_->f[p] = nullptr;  // closed even when fclose fails: the destructor must not close it again
    LATHE_CHECK(std::fclose(f) == 0, "data: writing {} failed: {}", files_->tmp[p], std::strerror(errno));
  }
  // The index goes last: a reader that finds the new index finds the new tokens and mask too.
  for (int p = 0; p < 3; ++p) {
    std::error_code ec;
    std::filesystem::rename(files_->tmp[p], files_->final[p], ec);
    LATHE_CHECK(!ec, "data: cannot rename {} to {}: {}", files_->tmp[p], files_->final[p], ec.message());
  }
  finished_ = true;
}

// ---- TokenFile -----------------------------------------------------------------------------------

bool is_prepared_corpus(const std::string& prefix) { return std::filesystem::is_regular_file(prefix + ".index"); }

std::shared_ptr<TokenFile> TokenFile::open(const std::string& prefix) {
  std::shared_ptr<TokenFile> tf(new TokenFile());
  tf->prefix_ = prefix;
  FileHeader headers[3];
  for (int p = 0; p < 3; ++p) {
    const std::string path = prefix + kParts[p].suffix;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    LATHE_CHECK(fd >= 0, "data: cannot open prepared corpus file {}: {}", path, std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      ::close(fd);
      LATHE_FAIL("data: cannot stat {}: {}", path, std::strerror(errno));
    }
    const size_t bytes = size_t(st.st_size);
    if (bytes < kHeaderBytes) {
      ::close(fd);
      LATHE_FAIL("data: {} is not a prepared corpus file: {} bytes, shorter than the {}-byte header", path, bytes,
                 kHeaderBytes);
    }
    void* addr = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    LATHE_CHECK(addr != MAP_FAILED, "data: cannot map {}: {}", path, std::strerror(errno));
    tf->maps_[p] = {addr, bytes};
    FileHeader& h = headers[p];
    std::memcpy(&h, addr, sizeof h);
    LATHE_CHECK(std::memcmp(h.magic, kParts[p].magic, 8) == 0, "data: {} is not a prepared corpus {} file (bad magic)",
                path, kParts[p].suffix + 1);
    LATHE_CHECK(h.version == kVersion, "data: {} has format version {}; this build reads version {}", path, h.version,
                kVersion);
    LATHE_CHECK(h.elem_size == kParts[p].elem_size, "data: {} declares {}-byte elements, expected {}", path,
                h.elem_size, kParts[p].elem_size);
    LATHE_CHECK(h.count <= (bytes - kHeaderBytes) / h.elem_size && bytes == kHeaderBytes + h.count * h.elem_size,
                "data: {} is {} bytes but its header declares {} elements ({} bytes expected); the file is truncated "
                "or corrupt",
                path, bytes, h.count, kHeaderBytes + h.count * h.elem_size);
  }
  const std::string index_path = prefix + ".index";
  for (int p = 0; p < 2; ++p) {
    const std::string path = prefix + kParts[p].suffix;
    LATHE_CHECK(headers[p].corpus_id == headers[2].corpus_id,
                "data: {} and {} come from different `lathe prepare` runs (corpus ids differ)", path, index_path);
    LATHE_CHECK(headers[p].num_samples == headers[2].num_samples && headers[p].num_tokens == headers[2].num_tokens,
                "data: {} and {} disagree on the sample or token count", path, index_path);
    LATHE_CHECK(headers[p].count == headers[2].num_tokens, "data: {} holds {} tokens, the index declares {}", path,
                headers[p].count, headers[2].num_tokens);
  }
  LATHE_CHECK(headers[2].count == headers[2].num_samples + 1, "data: {} holds {} offsets for {} samples (expected {})",
              index_path, headers[2].count, headers[2].num_samples, headers[2].num_samples + 1);
  const auto payload = [&](int p) { return static_cast<const char*>(tf->maps_[p].addr) + kHeaderBytes; };
  tf->tokens_ = {reinterpret_cast<const int32_t*>(payload(0)), size_t(headers[0].count)};
  tf->mask_ = {reinterpret_cast<const uint8_t*>(payload(1)), size_t(headers[1].count)};
  tf->offsets_ = {reinterpret_cast<const uint64_t*>(payload(2)), size_t(headers[2].count)};
  const auto& off = tf->offsets_;
  LATHE_CHECK(off[0] == 0, "data: {}: the first offset is {}, not 0", index_path, off[0]);
  for (size_t i = 1; i < off.size(); ++i) {
    LATHE_CHECK(off[i] > off[i - 1], "data: {}: offsets are not increasing at sample {} ({} after {}); the index is "
                "corrupt", index_path, i - 1, off[i], off[i - 1]);
  }
  LATHE_CHECK(off.back() == headers[2].num_tokens, "data: {}: the last offset is {} but the corpus has {} tokens",
              index_path, off.back(), headers[2].num_tokens);
  tf->meta_.vocab_size = headers[2].vocab_size;
  tf->meta_.tokenizer_hash = headers[2].tokenizer_hash;
  return tf;
}

TokenFile::~TokenFile() {
  for (auto& m : maps_)
    if (m.addr) munmap(m.addr, m.bytes);
}

int64_t TokenFile::length(int64_t i) const {
  LATHE_ASSERT(i >= 0 && i < size());
  return int64_t(offsets_[size_t(i) + 1] - offsets_[size_t(i)]);
}

SampleRef TokenFile::sample(int64_t i) const {
  LATHE_ASSERT(i >= 0 && i < size());
  const size_t a = offsets_[size_t(i)], n = offsets_[size_t(i) + 1] - a;
  return {tokens_.subspan(a, n), mask_.subspan(a, n)};
}

}  // namespace lathe::data
