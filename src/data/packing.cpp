// Epoch plans (deterministic shuffle + greedy packing), batch assembly, and the prefetching loader.
// Convention: shuffling uses splitmix64 and an unbiased bounded draw written out here (not
// std::shuffle, whose output differs between standard libraries), so a seed means the same batches
// on every machine. Covered by tests/data/test_packing.cpp.
#include "data/packing.h"

#include "core/error.h"

#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>

namespace lathe::data {
namespace {

constexpr int kStateVersion = 1;

struct SplitMix64 {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0 (Lemire's multiply-and-reject).
  uint64_t below(uint64_t n) {
    unsigned __int128 m = (unsigned __int128)next() * n;
    uint64_t low = uint64_t(m);
    if (low < n) {
      const uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        m = (unsigned __int128)next() * n;
        low = uint64_t(m);
      }
    }
    return uint64_t(m >> 64);
  }
};

// One batch ready for the consumer, and the loader position once it has been consumed.
struct Item {
  Batch batch;
  LoaderPosition after;
};

}  // namespace

PackingAlgorithm parse_packing_algorithm(const std::string& name) {
  if (name == "best_fit") return PackingAlgorithm::kBestFit;
  if (name == "sequential") return PackingAlgorithm::kSequential;
  LATHE_FAIL("data: unknown packing algorithm '{}' (expected best_fit or sequential)", name);
}

const char* packing_algorithm_name(PackingAlgorithm a) {
  return a == PackingAlgorithm::kBestFit ? "best_fit" : "sequential";
}

double EpochPlan::efficiency(int64_t capacity) const {
  return batches() > 0 && capacity > 0 ? double(tokens) / double(batches() * capacity) : 0.0;
}

uint64_t corpus_fingerprint(const Corpus& corpus) {
  const int64_t n = corpus.size();
  uint64_t h = hash_bytes(&n, sizeof n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = corpus.length(i);
    h = hash_bytes(&len, sizeof len, h);
  }
  return h;
}

EpochPlan plan_epoch(const Corpus& corpus, const LoaderOptions& options, int64_t epoch) {
  const int64_t n = corpus.size(), cap = options.capacity;
  LATHE_CHECK(n > 0, "data: the corpus has no samples");
  LATHE_CHECK(n <= int64_t(std::numeric_limits<uint32_t>::max()), "data: {} samples; at most 2^32 - 1 are supported",
              n);
  LATHE_CHECK(cap > 0, "data: batch capacity must be positive, got {}", cap);
  std::vector<uint32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0u);
  if (options.shuffle) {
    SplitMix64 rng{options.seed + uint64_t(epoch)};
    rng.next();
    for (size_t i = order.size() - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  }
  EpochPlan plan;
  std::vector<uint32_t> bin_of(order.size());
  std::vector<int64_t> fill;  // tokens in each batch
  if (options.packing == PackingAlgorithm::kSequential) {
    for (size_t k = 0; k < order.size(); ++k) {
      const int64_t len = corpus.length(order[k]);
      LATHE_CHECK(len <= cap, "data: sample {} has {} tokens, more than the batch capacity {}", order[k], len, cap);
      if (fill.empty() || fill.back() + len > cap) fill.push_back(0);
      fill.back() += len;
      bin_of[k] = uint32_t(fill.size() - 1);
    }
  } else {
    // Best fit: the open batch with the least room that still takes the sample (LIFO among ties).
    std::map<int64_t, std::vector<uint32_t>> open;  // room left -> batches
    for (size_t k = 0; k < order.size(); ++k) {
      const int64_t len = corpus.length(order[k]);
      LATHE_CHECK(len <= cap, "data: sample {} has {} tokens, more than the batch capacity {}", order[k], len, cap);
      uint32_t b;
      auto it = open.lower_bound(len);
      if (it == open.end()) {
        b = uint32_t(fill.size());
        fill.push_back(0);
      } else {
        b = it->second.back();
        it->second.pop_back();
        if (it->second.empty()) open.erase(it);
      }
      fill[b] += len;
      if (fill[b] < cap) open[cap - fill[b]].push_back(b);
      bin_of[k] = b;
    }
  }
  // Group the samples by batch, keeping the shuffled order inside each batch.
  plan.offsets.assign(fill.size() + 1, 0);
  for (uint32_t b : bin_of) plan.offsets[b + 1] += 1;
  for (size_t b = 0; b < fill.size(); ++b) plan.offsets[b + 1] += plan.offsets[b];
  plan.samples.resize(order.size());
  std::vector<int64_t> next(plan.offsets.begin(), plan.offsets.end() - 1);
  for (size_t k = 0; k < order.size(); ++k) plan.samples[size_t(next[bin_of[k]]++)] = order[k];
  plan.tokens = std::accumulate(fill.begin(), fill.end(), int64_t(0));
  return plan;
}

Batch build_batch(const Corpus& corpus, const EpochPlan& plan, int64_t index, int64_t capacity) {
  LATHE_ASSERT(index >= 0 && index < plan.batches());
  Batch b;
  b.index = index;
  b.capacity = capacity;
  b.cu_seqlens.push_back(0);
  for (int64_t k = plan.offsets[size_t(index)]; k < plan.offsets[size_t(index) + 1]; ++k) {
    const uint32_t i = plan.samples[size_t(k)];
    const SampleRef s = corpus.sample(i);
    LATHE_CHECK(!s.ids.empty() && s.loss_mask.size() == s.ids.size(),
                "data: sample {} of the corpus is empty or its mask has the wrong length", i);
    b.ids.insert(b.ids.end(), s.ids.begin(), s.ids.end());
    for (size_t j = 0; j + 1 < s.ids.size(); ++j) {
      const bool target = s.loss_mask[j + 1] != 0;
      b.labels.push_back(target ? s.ids[j + 1] : -100);
      b.num_labelled += target;
    }
    b.labels.push_back(-100);  // nothing to predict across the document boundary
    b.cu_seqlens.push_back(int32_t(b.ids.size()));
    b.samples.push_back(i);
  }
  LATHE_ASSERT(int64_t(b.ids.size()) <= capacity);
  return b;
}

// ---- the loader ----------------------------------------------------------------------------------

struct PackedLoader::Worker {
  // Producer state: touched only by the prefetch thread once it runs (or by next() without one).
  std::shared_ptr<const Corpus> corpus;
  LoaderOptions options;
  std::map<int64_t, std::shared_ptr<const EpochPlan>> plans;
  LoaderPosition round;  // first global batch of the next round to produce

  // Shared with the consumer.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> queue;
  std::exception_ptr error;
  bool stop = false;
  std::thread thread;

  const EpochPlan& plan(int64_t epoch) {
    auto it = plans.find(epoch);
    if (it == plans.end())
      it = plans.emplace(epoch, std::make_shared<const EpochPlan>(plan_epoch(*corpus, options, epoch))).first;
    return *it->second;
  }

  // `p` moved forward by k global batches (p normalized: cursor < batches of p.epoch).
  LoaderPosition advance(LoaderPosition p, int64_t k) {
    while (k > 0) {
      const int64_t left = plan(p.epoch).batches() - p.cursor;
      if (k < left) {
        p.cursor += k;
        break;
      }
      k -= left;
      p.epoch += 1;
      p.cursor = 0;
    }
    return p;
  }

  LoaderPosition normalize(LoaderPosition p) {
    while (p.cursor >= plan(p.epoch).batches()) {
      p.cursor -= plan(p.epoch).batches();
      p.epoch += 1;
    }
    return p;
  }

  Item produce() {
    const LoaderPosition at = advance(round, options.rank);
    Item item;
    item.batch = build_batch(*corpus, plan(at.epoch), at.cursor, options.capacity);
    item.batch.epoch = at.epoch;
    item.after = advance(round, options.world);
    round = item.after;
    while (!plans.empty() && plans.begin()->first < round.epoch) plans.erase(plans.begin());
    return item;
  }

  void run() {
    const size_t depth = size_t(options.prefetch);
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || queue.size() < depth; });
        if (stop) return;
      }
      Item item;
      try {
        item = produce();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        error = std::current_exception();
        cv.notify_all();
        return;
      }
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(item));
      cv.notify_all();
    }
  }

  Item take() {
    if (options.prefetch == 0) return produce();
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return !queue.empty() || error; });
    if (queue.empty()) std::rethrow_exception(error);
    Item item = std::move(queue.front());
    queue.pop_front();
    cv.notify_all();
    return item;
  }
};

PackedLoader::PackedLoader(std::shared_ptr<const Corpus> corpus, const LoaderOptions& options,
                           const nlohmann::json& state)
    : corpus_(std::move(corpus)), options_(options) {
  LATHE_CHECK(corpus_ != nullptr, "data: the loader needs a corpus");
  LATHE_CHECK(options_.capacity > 0, "data: batch capacity must be positive, got {}", options_.capacity);
  LATHE_CHECK(options_.world >= 1 && options_.rank >= 0 && options_.rank < options_.world,
              "data: rank {} is not in a data-parallel world of {}", options_.rank, options_.world);
  LATHE_CHECK(options_.prefetch >= 0, "data: prefetch must be >= 0, got {}", options_.prefetch);
  LATHE_CHECK(corpus_->size() > 0, "data: the corpus has no samples");
  int64_t longest = 0;
  for (int64_t i = 0; i < corpus_->size(); ++i) longest = std::max(longest, corpus_->length(i));
  LATHE_CHECK(longest <= options_.capacity,
              "data: the longest sample has {} tokens, more than the batch capacity {}; raise the capacity or lower "
              "max_seq_len",
              longest, options_.capacity);
  fingerprint_ = corpus_fingerprint(*corpus_);

  if (!state.is_null()) {
    LATHE_CHECK(state.is_object(), "data: loader state must be a JSON object, got {}", state.type_name());
    auto field = [&](const char* key) -> const nlohmann::json& {
      LATHE_CHECK(state.contains(key), "data: loader state has no '{}'", key);
      return state[key];
    };
    LATHE_CHECK(field("version") == kStateVersion, "data: loader state version {} (this build reads {})",
                field("version").dump(), kStateVersion);
    auto same = [&](const char* key, const nlohmann::json& now) {
      LATHE_CHECK(field(key) == now, "data: the loader state was saved with {} = {}, this run has {}; resuming would "
                  "not continue the same batches",
                  key, field(key).dump(), now.dump());
    };
    same("seed", options_.seed);
    same("capacity", options_.capacity);
    same("shuffle", options_.shuffle);
    same("packing", packing_algorithm_name(options_.packing));
    const nlohmann::json& c = field("corpus");
    LATHE_CHECK(c.is_object() && c.value("samples", int64_t(-1)) == corpus_->size() &&
                    c.value("tokens", int64_t(-1)) == corpus_->total_tokens() &&
                    c.value("fingerprint", std::string()) == fmt::format("{:016x}", fingerprint_),
                "data: the loader state was saved for a different corpus (state: {}; this corpus: {} samples, {} "
                "tokens, fingerprint {:016x})",
                c.dump(), corpus_->size(), corpus_->total_tokens(), fingerprint_);
    LATHE_CHECK(field("epoch").is_number_integer() && field("cursor").is_number_integer() &&
                    field("epoch").get<int64_t>() >= 0 && field("cursor").get<int64_t>() >= 0,
                "data: loader state needs non-negative integer 'epoch' and 'cursor'");
    position_ = {field("epoch").get<int64_t>(), field("cursor").get<int64_t>()};
    returned_ = state.value("batches_returned", int64_t(0));  // informational: keeps counting across resumes
  }

  worker_ = std::make_unique<Worker>();
  worker_->corpus = corpus_;
  worker_->options = options_;
  first_epoch_batches_ = worker_->plan(0).batches();
  position_ = worker_->normalize(position_);
  worker_->round = position_;
  if (position_.epoch > 0) worker_->plans.erase(0);
  if (options_.prefetch > 0) worker_->thread = std::thread([w = worker_.get()] { w->run(); });
}

PackedLoader::~PackedLoader() {
  if (!worker_ || !worker_->thread.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(worker_->mu);
    worker_->stop = true;
  }
  worker_->cv.notify_all();
  worker_->thread.join();
}

Batch PackedLoader::next() {
  Item item = worker_->take();
  position_ = item.after;
  returned_ += 1;
  stats_.batches += 1;
  stats_.samples += int64_t(item.batch.samples.size());
  stats_.tokens += item.batch.tokens();
  stats_.labelled += item.batch.num_labelled;
  stats_.capacity_tokens += options_.capacity;
  return std::move(item.batch);
}

LoaderPosition PackedLoader::position() const { return position_; }

nlohmann::json PackedLoader::state() const {
  return {{"version", kStateVersion},
          {"epoch", position_.epoch},
          {"cursor", position_.cursor},
          {"seed", options_.seed},
          {"capacity", options_.capacity},
          {"shuffle", options_.shuffle},
          {"packing", packing_algorithm_name(options_.packing)},
          {"corpus",
           {{"samples", corpus_->size()},
            {"tokens", corpus_->total_tokens()},
            {"fingerprint", fmt::format("{:016x}", fingerprint_)}}},
          {"rank", options_.rank},
          {"world", options_.world},
          {"batches_returned", returned_}};
}

}  // namespace lathe::data
