// `lathe logprobs` on a folder of Hugging Face fixtures against the transformers logits stored with them (the e2e
// tests of the qwen3_5 and MoE families). Kept apart from lathe_run.h, whose users name the binary `lathe`, which
// would clash with the engine's namespace included here.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "lathe_run.h"

namespace lathe_e2e {

// For each fixture folder under `fixtures` (model/ and reference.safetensors with input_ids, cu_seqlens and the
// transformers logits, as dev/ref/*_fixtures.py write them): `lathe logprobs` (CPU, f32) on its documents against
// log_softmax of the stored logits at the next token, within 1e-4. Returns the fixtures checked.
inline int expect_logprobs_match_fixture_logits(const std::filesystem::path& fixtures, const std::string& tag) {
  namespace fs = std::filesystem;
  EXPECT_TRUE(fs::exists(fixtures)) << "fixtures missing: " << fixtures;
  if (!fs::exists(fixtures)) return 0;
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(fixtures)) {
    if (!entry.is_directory()) continue;
    SCOPED_TRACE(entry.path().filename().string());
    const lathe::io::SafetensorsFile ref = lathe::io::SafetensorsFile::open((entry.path() / "reference.safetensors").string());
    auto ints = [&](const char* name) {
      std::vector<int32_t> v(size_t(ref.get(name).numel));
      ref.read_into(name, lathe::DType::I32, v.data(), v.size() * 4);
      return v;
    };
    const std::vector<int32_t> ids = ints("input_ids"), cu = ints("cu_seqlens");
    const std::vector<float> logits = ref.read_as_f32("logits");
    const size_t vocab = logits.size() / ids.size();
    const fs::path tmp = fs::temp_directory_path() / fmt::format("lathe_lp_{}_{}_{}", tag, getpid(), checked);
    {
      std::ofstream in(tmp.string() + ".in.jsonl");
      for (size_t d = 0; d + 1 < cu.size(); ++d)
        in << nlohmann::json{{"tokens", std::vector<int32_t>(ids.begin() + cu[d], ids.begin() + cu[d + 1])}}.dump() << "\n";
    }
    const LatheRun r = lathe("logprobs --model " + (entry.path() / "model").string() + " --input " + tmp.string() +
                             ".in.jsonl --output " + tmp.string() + ".out.jsonl");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const auto got = read_logprobs(tmp.string() + ".out.jsonl");
    EXPECT_EQ(got.size(), cu.size() - 1);
    if (r.exit_code != 0 || got.size() != cu.size() - 1) continue;
    double worst = 0;
    for (size_t d = 0; d + 1 < cu.size(); ++d) {
      EXPECT_EQ(got[d].size(), size_t(cu[d + 1] - cu[d] - 1));
      for (int32_t i = cu[d]; i + 1 < cu[d + 1] && size_t(i - cu[d]) < got[d].size(); ++i) {
        const float* row = logits.data() + size_t(i) * vocab;
        double mx = row[0], sum = 0;
        for (size_t v = 0; v < vocab; ++v) mx = std::max(mx, double(row[v]));
        for (size_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - mx);
        const double want = double(row[ids[size_t(i) + 1]]) - mx - std::log(sum);
        worst = std::max(worst, std::abs(got[d][size_t(i - cu[d])] - want));
      }
    }
    std::printf("[%s logprobs] %s: max abs diff to transformers %.3g\n", tag.c_str(), entry.path().filename().c_str(),
                worst);
    EXPECT_LT(worst, 1e-4);
    fs::remove(tmp.string() + ".in.jsonl");
    fs::remove(tmp.string() + ".out.jsonl");
    ++checked;
  }
  return checked;
}

}  // namespace lathe_e2e
