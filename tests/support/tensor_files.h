// Test helpers over safetensors files: every tensor of a file as f32, and the worst relative difference of two such
// sets (||a - b|| / ||b|| per tensor), for the tests that compare a run's weights against a reference run's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace lathe::test_support {

inline std::map<std::string, std::vector<float>> read_f32_tensors(const std::filesystem::path& file) {
  const io::SafetensorsFile f = io::SafetensorsFile::open(file.string());
  std::map<std::string, std::vector<float>> out;
  for (const auto& t : f.tensors()) out[t.name] = f.read_as_f32(t.name);
  return out;
}

// Worst over tensors of ||a - b|| / ||b||; a tensor missing from `a`, or of another size, is a test failure.
inline double worst_rel_diff(const std::map<std::string, std::vector<float>>& a,
                             const std::map<std::string, std::vector<float>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [name, vb] : b) {
    const auto it = a.find(name);
    if (it == a.end() || it->second.size() != vb.size()) {
      ADD_FAILURE() << "tensor " << name << " missing or of another size";
      continue;
    }
    double e = 0, n = 0;
    for (size_t i = 0; i < vb.size(); ++i) {
      const double d = double(it->second[i]) - double(vb[i]);
      e += d * d;
      n += double(vb[i]) * double(vb[i]);
    }
    worst = std::max(worst, std::sqrt(e / std::max(n, 1e-30)));
  }
  return worst;
}

}  // namespace lathe::test_support
