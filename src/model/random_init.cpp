#include "model/random_init.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <thread>

#include "backend/dropout_hash.h"

namespace lathe {

namespace {

// A uniform double in (0, 1] from the 53 high bits of one splitmix64 output.
double unit(uint64_t bits) { return double((bits >> 11) + 1) * 0x1.0p-53; }

uint64_t draw(uint64_t seed, uint64_t n) { return splitmix64(seed ^ (n * kDropoutGolden)); }

// f(begin, end) over [0, n) in contiguous pieces, one per host thread (one piece for small n).
void parallel_ranges(size_t n, const std::function<void(size_t, size_t)>& f) {
  const size_t threads = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), n / (1 << 16) + 1);
  const size_t piece = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t)
    pool.emplace_back(f, std::min(n, t * piece), std::min(n, (t + 1) * piece));
  f(0, std::min(n, piece));
  for (std::thread& th : pool) th.join();
}

}  // namespace

uint64_t tensor_seed(uint64_t seed, uint64_t index) { return splitmix64(splitmix64(seed) ^ splitmix64(index + 1)); }

void fill_normal(std::vector<double>& out, uint64_t seed, double std) {
  const size_t pairs = (out.size() + 1) / 2;
  parallel_ranges(pairs, [&](size_t begin, size_t end) {
    for (size_t k = begin; k < end; ++k) {
      const double r = std * std::sqrt(-2.0 * std::log(unit(draw(seed, 2 * k)))), a = 2.0 * M_PI * unit(draw(seed, 2 * k + 1));
      out[2 * k] = r * std::cos(a);
      if (2 * k + 1 < out.size()) out[2 * k + 1] = r * std::sin(a);
    }
  });
}

void fill_uniform(std::vector<double>& out, uint64_t seed, double lo, double hi) {
  parallel_ranges(out.size(), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) out[i] = lo + (hi - lo) * (1.0 - unit(draw(seed, i)));
  });
}

}  // namespace lathe
