// Random initial weights (model.config without a checkpoint): counter-based draws — element i of a tensor is a function
// of (the tensor's seed, i) alone — so any rank draws the same values for its slice as one process does for the
// whole, and the draws run on every host thread. (std::mt19937_64 one value after another took about 150 s for the
// 8.2G normals of the Qwen3-8B shape: most of a run's start.) Covered by tests/models/test_random_init.cpp.
#pragma once

#include <cstdint>
#include <vector>

namespace lathe {

// The seed of a model's `index`-th tensor under the run's `seed`.
uint64_t tensor_seed(uint64_t seed, uint64_t index);
// out[i] = std x a standard normal draw of (seed, i): Box-Muller from two splitmix64 uniforms per pair of elements.
void fill_normal(std::vector<double>& out, uint64_t seed, double std);
// out[i] = a uniform draw of (seed, i) in [lo, hi).
void fill_uniform(std::vector<double>& out, uint64_t seed, double lo, double hi);

}  // namespace lathe
