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
