// Work folders for the tests that run the trainer on text (tests/e2e/test_train.cpp, tests/unit/test_plan.cpp, the
// GPU tests): the tiny test tokenizer and a few short text rows, or words to make longer ones. Needs LATHE_TEST_DATA_DIR (the tests' data folder).
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

namespace lathe_e2e {

// <tmp>/<prefix>_<name>_<pid>, emptied, with the tiny tokenizer in tok/.
inline std::filesystem::path tokenizer_folder(const std::string& prefix, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / fmt::format("{}_{}_{}", prefix, name, getpid());
  fs::remove_all(dir);
  fs::create_directories(dir / "tok");
  fs::copy_file(fs::path(LATHE_TEST_DATA_DIR) / "data/fixtures/tiny_tokenizer.json", dir / "tok/tokenizer.json");
  return dir;
}

// tokenizer_folder with `rows` rows {"text": ...} cycling over seven short sentences in train.jsonl.
inline std::filesystem::path tiny_text_folder(const std::string& prefix, const std::string& name, int rows) {
  const std::filesystem::path dir = tokenizer_folder(prefix, name);
  std::ofstream data(dir / "train.jsonl");
  const char* lines[] = {"the cat sat on the mat", "a dog ran in the park", "the sun is hot", "we like green tea",
                         "hello world hello world", "one two three four five", "cats and dogs play"};
  for (int i = 0; i < rows; ++i) data << nlohmann::json{{"text", lines[i % 7]}}.dump() << "\n";
  return dir;
}

// A word the tiny test tokenizer knows, drawn by `rng`, and a space.
template <typename Rng>
std::string tiny_word(Rng& rng) {
  static const char* words[] = {"the", "cat", "sat", "on", "mat", "a", "dog", "ran", "in", "park", "sun", "is", "hot",
                                "we", "like", "green", "tea", "one", "two", "three", "four", "five"};
  return std::string(words[rng() % std::size(words)]) + " ";
}

}  // namespace lathe_e2e
