// Helpers of the end-to-end tests: run the lathe binary, read a run's metrics.jsonl and a `lathe logprobs` output.
#pragma once

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lathe_e2e {

#ifdef LATHE_TEST_DATA_DIR
// A fresh folder TMP/PREFIX_NAME_PID with the tiny test tokenizer in tok/ (the GPU tests' run folders).
inline std::filesystem::path tokenizer_folder(const std::string& prefix, const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("{}_{}_{}", prefix, name, getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "tok");
  std::filesystem::copy_file(std::filesystem::path(LATHE_TEST_DATA_DIR) / "data/fixtures/tiny_tokenizer.json",
                             dir / "tok/tokenizer.json");
  return dir;
}
#endif

// A word the tiny test tokenizer knows, drawn by `rng`, and a space.
template <typename Rng>
std::string tiny_word(Rng& rng) {
  static const char* words[] = {"the", "cat", "sat", "on", "mat", "a", "dog", "ran", "in", "park", "sun", "is", "hot",
                                "we", "like", "green", "tea", "one", "two", "three", "four", "five"};
  return std::string(words[rng() % std::size(words)]) + " ";
}

struct LatheRun {
  int exit_code;
  std::string output;
};

// Runs `lathe ARGS` with an optional environment assignment; captures stdout+stderr.
inline LatheRun lathe(const std::string& args, const std::string& env = "") {
  const std::filesystem::path log = std::filesystem::temp_directory_path() / fmt::format("lathe_e2e_{}.log", getpid());
  const std::string cmd = fmt::format("{} {} {} > {} 2>&1", env, LATHE_BINARY, args, log.string());
  const int status = std::system(cmd.c_str());
  std::ifstream f(log);
  std::string out((std::istreambuf_iterator<char>(f)), {});
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

inline std::vector<nlohmann::json> metrics(const std::filesystem::path& out) {
  std::vector<nlohmann::json> rows;
  std::ifstream f(out / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

// The `key` ("loss", "aux_loss", ...) of every metrics row of a run that has it, in order.
inline std::vector<double> losses(const std::filesystem::path& out, const std::string& key = "loss") {
  std::vector<double> l;
  for (const auto& r : metrics(out))
    if (r.contains(key)) l.push_back(r[key].get<double>());
  return l;
}

// One {"logprobs": [...]} line per input of `lathe logprobs`.
inline std::vector<std::vector<double>> read_logprobs(const std::filesystem::path& file) {
  std::vector<std::vector<double>> rows;
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line)) rows.push_back(nlohmann::json::parse(line)["logprobs"].get<std::vector<double>>());
  return rows;
}

}  // namespace lathe_e2e
