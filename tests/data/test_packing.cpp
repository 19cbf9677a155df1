// Tests of src/data/packing.cpp and src/data/token_file.cpp: epoch plans (every sample exactly once,
// capacity respected, deterministic), labels within documents, the loader's resume state (also across
// epoch boundaries and world-size changes), data-parallel sharding, the prefetch thread (errors and
// shutdown), and the prepared-corpus format (round trip equals the JSONL path; corrupt files refused).
// Convention: synthetic corpora give sample i the ids {i, i, ...} (length from a seeded generator),
// so a batch's contents show which samples it holds.
#include "core/error.h"
#include "data/dataset.h"
#include "data/packing.h"
#include "data/token_file.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>

#include <unistd.h>

namespace {

using namespace lathe::data;
namespace fs = std::filesystem;
using V = std::vector<int32_t>;

const fs::path kTestsDir = LATHE_TEST_DATA_DIR;
const fs::path kTinyChat = kTestsDir / "data" / "dataset_fixtures" / "tiny_chat";
const fs::path kMixed = kTestsDir / "data" / "dataset_fixtures" / "mixed.jsonl";

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const lathe::Error& e) {
    return e.what();
  }
  return "";
}

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("lathe_packing_" + std::to_string(getpid()) + "_" + std::to_string(counter_++))) {
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string prefix(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

// Sample i: length in [min_len, max_len], ids all i, every other token a target.
std::shared_ptr<MemoryCorpus> synthetic(int n, int min_len, int max_len, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  auto corpus = std::make_shared<MemoryCorpus>();
  for (int i = 0; i < n; ++i) {
    const int len = min_len + int(rng() % uint32_t(max_len - min_len + 1));
    Sample s;
    s.ids.assign(size_t(len), i);
    s.loss_mask.resize(size_t(len));
    for (int j = 1; j < len; ++j) s.loss_mask[size_t(j)] = uint8_t(j % 2);
    corpus->append(s);
  }
  return corpus;
}

// What identifies a batch in comparisons.
struct Key {
  int64_t epoch, index;
  std::vector<int64_t> samples;
  V ids, labels, cu;
  bool operator==(const Key&) const = default;
};
Key key_of(const Batch& b) { return {b.epoch, b.index, b.samples, b.ids, b.labels, b.cu_seqlens}; }

std::vector<Key> take(PackedLoader& loader, int n) {
  std::vector<Key> out;
  for (int i = 0; i < n; ++i) out.push_back(key_of(loader.next()));
  return out;
}

LoaderOptions small_options(int prefetch = 3) {
  LoaderOptions o;
  o.capacity = 64;
  o.seed = 11;
  o.prefetch = prefetch;
  return o;
}

// ---- plans and batches --------------------------------------------------------------------------

TEST(Packing, EverySampleExactlyOncePerEpochAndCapacityRespected) {
  auto corpus = synthetic(500, 1, 64);
  for (PackingAlgorithm algo : {PackingAlgorithm::kBestFit, PackingAlgorithm::kSequential}) {
    LoaderOptions o = small_options();
    o.packing = algo;
    for (int64_t epoch : {0, 1, 5}) {
      const EpochPlan plan = plan_epoch(*corpus, o, epoch);
      std::vector<int64_t> seen;
      int64_t tokens = 0;
      for (int64_t b = 0; b < plan.batches(); ++b) {
        const Batch batch = build_batch(*corpus, plan, b, o.capacity);
        ASSERT_LE(batch.tokens(), o.capacity);
        ASSERT_EQ(batch.cu_seqlens.size(), batch.samples.size() + 1);
        for (size_t d = 0; d < batch.samples.size(); ++d) {
          // The document is the whole sample, unsplit.
          const int64_t i = batch.samples[d];
          ASSERT_EQ(batch.cu_seqlens[d + 1] - batch.cu_seqlens[d], corpus->length(i));
          for (int32_t t = batch.cu_seqlens[d]; t < batch.cu_seqlens[d + 1]; ++t) ASSERT_EQ(batch.ids[size_t(t)], i);
          seen.push_back(i);
        }
        tokens += batch.tokens();
      }
      std::sort(seen.begin(), seen.end());
      std::vector<int64_t> all(500);
      std::iota(all.begin(), all.end(), 0);
      EXPECT_EQ(seen, all) << packing_algorithm_name(algo) << " epoch " << epoch;
      EXPECT_EQ(tokens, corpus->total_tokens());
      EXPECT_EQ(plan.tokens, corpus->total_tokens());
    }
  }
}

TEST(Packing, LabelsStayInsideDocuments) {
  auto corpus = synthetic(50, 1, 20);
  const LoaderOptions o = small_options();
  const EpochPlan plan = plan_epoch(*corpus, o, 0);
  for (int64_t b = 0; b < plan.batches(); ++b) {
    const Batch batch = build_batch(*corpus, plan, b, o.capacity);
    int64_t labelled = 0;
    for (size_t d = 0; d + 1 < batch.cu_seqlens.size(); ++d) {
      const int32_t a = batch.cu_seqlens[d], e = batch.cu_seqlens[d + 1];
      const SampleRef s = corpus->sample(batch.samples[d]);
      for (int32_t t = a; t < e; ++t) {
        const int32_t want = t + 1 < e && s.loss_mask[size_t(t - a + 1)] ? batch.ids[size_t(t) + 1] : -100;
        ASSERT_EQ(batch.labels[size_t(t)], want) << "batch " << b << " position " << t;
        labelled += want != -100;
      }
      ASSERT_EQ(batch.labels[size_t(e - 1)], -100);  // never a target across the boundary
    }
    EXPECT_EQ(batch.num_labelled, labelled);
  }
}

TEST(Packing, DeterministicPerSeedAndReshuffledPerEpoch) {
  auto corpus = synthetic(200, 1, 40);
  const LoaderOptions o = small_options();
  const EpochPlan a = plan_epoch(*corpus, o, 3), b = plan_epoch(*corpus, o, 3), c = plan_epoch(*corpus, o, 4);
  EXPECT_EQ(a.samples, b.samples);
  EXPECT_EQ(a.offsets, b.offsets);
  EXPECT_NE(a.samples, c.samples);
  LoaderOptions other = o;
  other.seed = 12;
  EXPECT_NE(plan_epoch(*corpus, other, 3).samples, a.samples);
  LoaderOptions ordered = o;
  ordered.shuffle = false;
  ordered.packing = PackingAlgorithm::kSequential;
  const EpochPlan seq = plan_epoch(*corpus, ordered, 0);
  std::vector<uint32_t> identity(200);
  std::iota(identity.begin(), identity.end(), 0u);
  EXPECT_EQ(seq.samples, identity);
}

TEST(Packing, BestFitPacksTighterThanSequential) {
  auto corpus = synthetic(2000, 16, 1024, 3);
  LoaderOptions o;
  o.capacity = 2048;
  const double best = plan_epoch(*corpus, o, 0).efficiency(o.capacity);
  o.packing = PackingAlgorithm::kSequential;
  const double seq = plan_epoch(*corpus, o, 0).efficiency(o.capacity);
  EXPECT_GT(best, 0.95);
  EXPECT_GT(best, seq);
}

// ---- the loader ---------------------------------------------------------------------------------

TEST(Loader, CyclesThroughEpochsInPlanOrder) {
  auto corpus = synthetic(40, 1, 30);
  const LoaderOptions o = small_options();
  PackedLoader loader(corpus, o);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    const EpochPlan plan = plan_epoch(*corpus, o, epoch);
    for (int64_t b = 0; b < plan.batches(); ++b) {
      Batch want = build_batch(*corpus, plan, b, o.capacity);
      want.epoch = epoch;
      ASSERT_EQ(key_of(loader.next()), key_of(want)) << "epoch " << epoch << " batch " << b;
    }
  }
  EXPECT_EQ(loader.position().epoch, 3);
  EXPECT_GT(loader.stats().efficiency(), 0.5);
  EXPECT_EQ(loader.stats().tokens, 3 * corpus->total_tokens());
}

TEST(Loader, ResumeGivesTheBatchesOfAnUninterruptedRun) {
  auto corpus = synthetic(30, 1, 40);  // a few batches per epoch: resumes land inside and across epochs
  const LoaderOptions o = small_options();
  const int64_t per_epoch = PackedLoader(corpus, o).batches_in_first_epoch();
  PackedLoader reference(corpus, o);
  const std::vector<Key> all = take(reference, int(4 * per_epoch));
  for (int64_t n : {int64_t(0), int64_t(1), per_epoch - 1, per_epoch, per_epoch + 2, 2 * per_epoch + 1}) {
    for (int prefetch : {0, 4}) {
      PackedLoader first(corpus, small_options(prefetch));
      take(first, int(n));
      const nlohmann::json state = nlohmann::json::parse(first.state().dump());  // through text, as saved
      PackedLoader resumed(corpus, small_options(prefetch), state);
      const std::vector<Key> next = take(resumed, int(per_epoch + 1));
      EXPECT_TRUE(std::equal(next.begin(), next.end(), all.begin() + n)) << "resumed after " << n << " batches";
    }
  }
}

TEST(Loader, StateRefusesAnotherSetupOrCorpus) {
  auto corpus = synthetic(30, 1, 40);
  PackedLoader loader(corpus, small_options());
  loader.next();
  const nlohmann::json state = loader.state();
  EXPECT_EQ(state["batches_returned"], 1);
  LoaderOptions seed = small_options();
  seed.seed = 99;
  EXPECT_NE(error_of([&] { PackedLoader(corpus, seed, state); }).find("saved with seed = 11, this run has 99"),
            std::string::npos);
  LoaderOptions cap = small_options();
  cap.capacity = 128;
  EXPECT_NE(error_of([&] { PackedLoader(corpus, cap, state); }).find("capacity"), std::string::npos);
  EXPECT_NE(error_of([&] { PackedLoader(synthetic(30, 1, 40, 8), small_options(), state); }).find("different corpus"),
            std::string::npos);
  nlohmann::json broken = state;
  broken.erase("cursor");
  EXPECT_NE(error_of([&] { PackedLoader(corpus, small_options(), broken); }).find("has no 'cursor'"), std::string::npos);
}

TEST(Loader, ShardsAreDisjointAndCoverTheGlobalStream) {
  auto corpus = synthetic(45, 1, 40);
  const LoaderOptions o = small_options();
  PackedLoader global(corpus, o);
  const int world = 3, steps = 20;  // several epochs; the epoch length is not a multiple of 3
  const std::vector<Key> all = take(global, world * steps);
  std::vector<Key> merged;
  for (int rank = 0; rank < world; ++rank) {
    LoaderOptions r = o;
    r.rank = rank;
    r.world = world;
    PackedLoader loader(corpus, r);
    const std::vector<Key> mine = take(loader, steps);
    for (int k = 0; k < steps; ++k) EXPECT_EQ(mine[size_t(k)], all[size_t(rank + world * k)]) << rank << " " << k;
    merged.insert(merged.end(), mine.begin(), mine.end());
  }
  // Union = all, disjoint: same multiset of (epoch, index).
  auto ids = [](std::vector<Key> v) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const Key& k : v) out.push_back({k.epoch, k.index});
    std::sort(out.begin(), out.end());
    return out;
  };
  EXPECT_EQ(ids(merged), ids(all));
  const auto m = ids(merged);
  EXPECT_EQ(std::adjacent_find(m.begin(), m.end()), m.end());
}

TEST(Loader, StateIsTheSameOnEveryRankAndReshardsToAnotherWorld) {
  auto corpus = synthetic(45, 1, 40);
  const LoaderOptions o = small_options();
  PackedLoader global(corpus, o);
  const std::vector<Key> all = take(global, 60);
  nlohmann::json state;
  for (int rank = 0; rank < 2; ++rank) {
    LoaderOptions r = o;
    r.rank = rank;
    r.world = 2;
    PackedLoader loader(corpus, r);
    take(loader, 7);
    nlohmann::json s = loader.state();
    s.erase("rank");
    if (rank == 0) state = s;
    EXPECT_EQ(s, state);
  }
  // 2 ranks x 7 steps consumed global batches 0..13; a world of 3 continues at 14, 15, 16, ...
  for (int rank = 0; rank < 3; ++rank) {
    LoaderOptions r = o;
    r.rank = rank;
    r.world = 3;
    PackedLoader loader(corpus, r, state);
    const std::vector<Key> mine = take(loader, 5);
    for (int k = 0; k < 5; ++k) EXPECT_EQ(mine[size_t(k)], all[size_t(14 + rank + 3 * k)]);
  }
}

// A corpus whose sample `bad` cannot be read, to make the prefetch thread fail.
class FailingCorpus final : public Corpus {
 public:
  FailingCorpus(std::shared_ptr<MemoryCorpus> inner, int64_t bad) : inner_(std::move(inner)), bad_(bad) {}
  int64_t size() const override { return inner_->size(); }
  int64_t length(int64_t i) const override { return inner_->length(i); }
  int64_t total_tokens() const override { return inner_->total_tokens(); }
  SampleRef sample(int64_t i) const override {
    LATHE_CHECK(i != bad_, "data: test: sample {} is unreadable", i);
    return inner_->sample(i);
  }

 private:
  std::shared_ptr<MemoryCorpus> inner_;
  int64_t bad_;
};

TEST(Loader, WorkerErrorsAreRethrownInNext) {
  auto inner = synthetic(30, 1, 40);
  LoaderOptions o = small_options(2);
  o.shuffle = false;
  o.packing = PackingAlgorithm::kSequential;
  const EpochPlan plan = plan_epoch(*inner, o, 0);
  const int64_t bad = plan.samples[size_t(plan.offsets[2])];  // first sample of batch 2
  PackedLoader loader(std::make_shared<FailingCorpus>(inner, bad), o);
  loader.next();
  loader.next();  // batches 0 and 1 were built before the failure and are still delivered
  for (int i = 0; i < 2; ++i) {
    const std::string msg = error_of([&] { loader.next(); });
    EXPECT_NE(msg.find("sample " + std::to_string(bad) + " is unreadable"), std::string::npos) << msg;
  }
}

TEST(Loader, ShutsDownCleanlyWithAFullQueue) {
  auto corpus = synthetic(100, 1, 40);
  for (int i = 0; i < 20; ++i) {
    PackedLoader loader(corpus, small_options(8));
    if (i % 2) loader.next();
  }  // destructors join a worker that is blocked on a full queue or still producing
  SUCCEED();
}

TEST(Loader, RefusesBadSetups) {
  auto corpus = synthetic(10, 70, 80);
  LoaderOptions o = small_options();
  EXPECT_NE(error_of([&] { PackedLoader(corpus, o); }).find("more than the batch capacity 64"), std::string::npos);
  o.capacity = 64;
  o.rank = 2;
  o.world = 2;
  EXPECT_NE(error_of([&] { PackedLoader(synthetic(10, 1, 5), o); }).find("rank 2 is not in a data-parallel world of 2"),
            std::string::npos);
  EXPECT_NE(error_of([&] { PackedLoader(std::make_shared<MemoryCorpus>(), small_options()); }).find("no samples"),
            std::string::npos);
}

// ---- prepared corpora ---------------------------------------------------------------------------

void write_corpus(const Corpus& corpus, const std::string& prefix, TokenFileMeta meta = {}) {
  TokenFileWriter w(prefix, meta);
  for (int64_t i = 0; i < corpus.size(); ++i) {
    const SampleRef s = corpus.sample(i);
    w.append(Sample{V(s.ids.begin(), s.ids.end()), std::vector<uint8_t>(s.loss_mask.begin(), s.loss_mask.end())});
  }
  w.finish();
}

TEST(TokenFile, RoundTripGivesTheSameBatchesAsMemory) {
  TempDir dir;
  auto corpus = synthetic(80, 1, 40);
  write_corpus(*corpus, dir.prefix("c"), {305, 42});
  auto file = TokenFile::open(dir.prefix("c"));
  ASSERT_EQ(file->size(), corpus->size());
  EXPECT_EQ(file->total_tokens(), corpus->total_tokens());
  EXPECT_EQ(file->meta().vocab_size, 305u);
  EXPECT_EQ(file->meta().tokenizer_hash, 42u);
  PackedLoader a(corpus, small_options()), b(file, small_options());
  EXPECT_EQ(take(a, 30), take(b, 30));
  // Only the three files remain (no temporaries).
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator{}), 3);
}

TEST(TokenFile, PreparedJsonlEqualsTheJsonlPath) {
  TempDir dir;
  const Tokenizer tok = Tokenizer::from_dir(kTinyChat.string());
  const auto chat = load_chat_template(kTinyChat.string());
  DatasetOptions o;
  o.skip_bad_rows = true;
  RowEncoder enc(tok, &*chat, o);
  const DatasetStats prepared = prepare_corpus(kMixed.string(), dir.prefix("mixed"), enc, {uint32_t(tok.vocab_size()), 7});
  EXPECT_EQ(prepared.bad_rows, 3);
  const nlohmann::json info = nlohmann::json::parse(std::ifstream(dir.prefix("mixed") + ".json"));
  EXPECT_EQ(info["stats"]["samples"], prepared.samples);
  EXPECT_EQ(info["tokenizer_hash"], "0000000000000007");
  DatasetStats from_file, from_jsonl;
  auto file = open_corpus(dir.prefix("mixed") + ".index", enc, &from_file);
  auto memory = open_corpus(kMixed.string(), enc, &from_jsonl);
  EXPECT_NE(dynamic_cast<const TokenFile*>(file.get()), nullptr);
  EXPECT_NE(dynamic_cast<const MemoryCorpus*>(memory.get()), nullptr);
  EXPECT_EQ(from_file.samples, prepared.samples);
  EXPECT_EQ(from_jsonl.samples, prepared.samples);
  EXPECT_EQ(from_file.tokens, from_jsonl.tokens);
  LoaderOptions lo = small_options();
  lo.capacity = 256;
  PackedLoader a(file, lo), b(memory, lo);
  EXPECT_EQ(take(a, 12), take(b, 12));
  // A corpus made with another tokenizer is refused.
  TokenFileWriter other(dir.prefix("other"), {999, 0});
  other.append(Sample{{1, 2}, {0, 1}});
  other.finish();
  EXPECT_NE(error_of([&] { open_corpus(dir.prefix("other"), enc, nullptr); }).find("tokenizer of 999 tokens"),
            std::string::npos);
}

TEST(TokenFile, UnfinishedWriterLeavesNothing) {
  TempDir dir;
  {
    // A failing prepare (bad row 4 of mixed.jsonl) leaves no files either.
    const Tokenizer tok = Tokenizer::from_dir(kTinyChat.string());
    RowEncoder enc(tok, nullptr, {});
    EXPECT_NE(error_of([&] { prepare_corpus(kMixed.string(), dir.prefix("c"), enc, {}); }).find("mixed.jsonl:2:"),
              std::string::npos);  // row 2 is a chat row and there is no template
  }
  {
    TokenFileWriter w(dir.prefix("c"), {});
    w.append(Sample{{1, 2, 3}, {0, 1, 1}});
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator{}), 0);
  EXPECT_NE(error_of([&] { TokenFileWriter(dir.prefix("missing/c"), {}); }).find("does not exist"), std::string::npos);
}

// Patches `bytes` at `offset` of a file.
void patch(const std::string& path, size_t offset, const void* bytes, size_t n) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(std::streamoff(offset));
  f.write(static_cast<const char*>(bytes), std::streamsize(n));
}

TEST(TokenFile, CorruptFilesAreRefusedWithClearErrors) {
  TempDir dir;
  auto corpus = synthetic(10, 2, 9);
  auto fresh = [&](const std::string& name) {
    write_corpus(*corpus, dir.prefix(name));
    return dir.prefix(name);
  };
  auto open_error = [](const std::string& prefix) { return error_of([&] { TokenFile::open(prefix); }); };

  EXPECT_NE(open_error(dir.prefix("none")).find("cannot open prepared corpus file"), std::string::npos);
  {
    const std::string p = fresh("magic");
    patch(p + ".tokens", 0, "NOTLATHE", 8);
    EXPECT_NE(open_error(p).find("magic.tokens is not a prepared corpus tokens file (bad magic)"), std::string::npos)
        << open_error(p);
  }
  {
    const std::string p = fresh("version");
    const uint32_t v = 7;
    patch(p + ".mask", 8, &v, 4);
    EXPECT_NE(open_error(p).find("format version 7"), std::string::npos) << open_error(p);
  }
  {
    const std::string p = fresh("truncated");
    fs::resize_file(p + ".tokens", fs::file_size(p + ".tokens") - 4);
    EXPECT_NE(open_error(p).find("truncated or corrupt"), std::string::npos) << open_error(p);
    const std::string q = fresh("short");
    fs::resize_file(q + ".mask", 10);
    EXPECT_NE(open_error(q).find("shorter than the 64-byte header"), std::string::npos) << open_error(q);
  }
  {
    const std::string p = fresh("order");
    const uint64_t big = 1000;
    patch(p + ".index", 64 + 8 * 3, &big, 8);  // offsets[3]
    EXPECT_NE(open_error(p).find("offsets are not increasing at sample 3"), std::string::npos) << open_error(p);
  }
  {
    const std::string p = fresh("last");
    const uint64_t n = corpus->total_tokens() - 1;
    patch(p + ".index", 64 + 8 * 10, &n, 8);  // offsets[10], the end
    EXPECT_NE(open_error(p).find("the last offset is"), std::string::npos) << open_error(p);
  }
  {
    const std::string p = fresh("mixed");
    write_corpus(*corpus, dir.prefix("again"));
    fs::copy_file(dir.prefix("again") + ".mask", p + ".mask", fs::copy_options::overwrite_existing);
    EXPECT_NE(open_error(p).find("come from different `lathe prepare` runs"), std::string::npos) << open_error(p);
  }
  {
    const std::string p = fresh("count");
    const uint64_t n = 11;
    patch(p + ".index", 24, &n, 8);  // num_samples in the index header
    EXPECT_NE(open_error(p).find("disagree on the sample or token count"), std::string::npos) << open_error(p);
  }
  EXPECT_NO_THROW(TokenFile::open(fresh("good")));
}

}  // namespace
