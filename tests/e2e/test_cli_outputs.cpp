// End-to-end checks of the outputs and options of the subcommands other than `train`, through the lathe binary on a
// tiny model trained for two steps (tiny_chat tokenizer fixture, which has a Qwen3 chat template):
// --output through a symbolic link (the link stays, its target is replaced), into a FIFO (streamed), "-" and
// /dev/stdout; a failure (bad line, file-size limit, a folder in the way) leaves the old output and no temporary;
// out-of-range numeric options are refused before any work; export and convert keep the source's dtype and carry the
// tokenizer files and chat_template_kwargs.json; generate and logprobs take the chat-template kwargs of the model folder
// (--chat-template-kwargs overrides); logprobs scores {"messages"} rows; missing or misplaced paths are named.
// Expected token ids come from `lathe tokenize` (another code path), expected dtypes from the safetensors headers.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const fs::path kTests = LATHE_TEST_DATA_DIR;

struct LatheResult {
  int code;
  std::string out, err;
  std::string all() const { return out + err; }
};

std::string slurp(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

void spit(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

std::string q(const fs::path& p) { return "'" + p.string() + "'"; }

class CliOutputs : public ::testing::Test {
 protected:
  static fs::path w_;  // this process's work folder

  // A tiny model trained for two steps (out/final and a checkpoint), and a LoRA run over an f16 copy of it.
  static void SetUpTestSuite() {
    w_ = fs::temp_directory_path() / fmt::format("lathe_cli_outputs_{}", getpid());
    fs::remove_all(w_);
    fs::create_directories(w_ / "tok");
    for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
      fs::copy_file(kTests / "data/dataset_fixtures/tiny_chat" / f, w_ / "tok" / f);
    std::string rows;
    for (int i = 0; i < 20; ++i) rows += json{{"text", i % 2 ? "the cat sat on the mat" : "a dog ran"}}.dump() + "\n";
    spit(w_ / "train.jsonl", rows);
    spit(w_ / "config.yaml",
         "model:\n  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,\n"
         "           num_key_value_heads: 2, head_dim: 8, tie_word_embeddings: true}\n"
         "  tokenizer: " + (w_ / "tok").string() + "\n"
         "data: {train: " + (w_ / "train.jsonl").string() + ", format: text, max_seq_len: 64}\n"
         "output_dir: " + (w_ / "out").string() + "\n"
         "train: {max_steps: 2, micro_batch_tokens: 96, save_every: 2, seed: 5}\n");
    LatheResult r = lathe("train " + q(w_ / "config.yaml"));
    ASSERT_EQ(r.code, 0) << r.all();
  }
  static void TearDownTestSuite() { fs::remove_all(w_); }

  // Runs `lathe ARGS` (in `cwd` when given) and captures stdout and stderr apart.
  static LatheResult lathe(const std::string& args, const fs::path& cwd = {}) {
    static int n = 0;
    const fs::path out = w_ / fmt::format("stdout.{}", n), err = w_ / fmt::format("stderr.{}", n);
    ++n;
    const std::string cmd = fmt::format("{}{} {} > {} 2> {}", cwd.empty() ? "" : "cd " + q(cwd) + " && ", LATHE_BINARY,
                                        args, q(out), q(err));
    const int status = std::system(cmd.c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
  }

  // A fresh folder for one test.
  static fs::path dir(const std::string& name) {
    const fs::path d = w_ / name;
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
  }

  // A copy of the trained model folder, optionally with a chat_template_kwargs.json.
  static fs::path model_copy(const std::string& name, const std::string& kwargs = "") {
    const fs::path d = w_ / name;
    fs::remove_all(d);
    fs::copy(w_ / "out/final", d, fs::copy_options::recursive);
    if (!kwargs.empty()) spit(d / "chat_template_kwargs.json", kwargs);
    return d;
  }

  // Names in `d` that look like a temporary of an atomic write.
  static std::vector<std::string> temporaries(const fs::path& d) {
    std::vector<std::string> t;
    for (const auto& e : fs::directory_iterator(d))
      if (e.path().filename().string().find(".tmp-") != std::string::npos) t.push_back(e.path().filename().string());
    return t;
  }

  // The ids `lathe tokenize` gives one row: a conversation (no generation prompt unless asked) or a text.
  static std::vector<int32_t> tokenized(const json& row, const std::string& kwargs = "{}") {
    const fs::path d = dir("render");
    spit(d / "in.jsonl", row.dump() + "\n");
    const LatheResult r = lathe("tokenize --tokenizer " + q(w_ / "tok") + " --input " + q(d / "in.jsonl") + " --output " +
                        q(d / "out.jsonl") + " --chat-template-kwargs '" + kwargs + "'");
    EXPECT_EQ(r.code, 0) << r.all();
    return json::parse(slurp(d / "out.jsonl"))["ids"].get<std::vector<int32_t>>();
  }
  static std::vector<int32_t> rendered_ids(const json& messages, bool generation_prompt, const std::string& kwargs) {
    return tokenized(json{{"messages", messages}, {"add_generation_prompt", generation_prompt}}, kwargs);
  }
};

fs::path CliOutputs::w_;

// name -> dtype of every tensor of a safetensors file, from its header (8-byte little-endian length, then JSON).
std::map<std::string, std::string> safetensors_dtypes(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  unsigned char len[8] = {};
  f.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  std::string header(n, ' ');
  f.read(header.data(), std::streamsize(n));
  const json parsed = json::parse(header);  // kept alive: items() refers into it
  std::map<std::string, std::string> out;
  for (const auto& [name, entry] : parsed.items())
    if (name != "__metadata__") out[name] = entry["dtype"].get<std::string>();
  return out;
}

// The one dtype every tensor of the file has ("mixed" otherwise).
std::string only_dtype(const fs::path& path) {
  std::set<std::string> seen;
  for (const auto& [name, dtype] : safetensors_dtypes(path)) seen.insert(dtype);
  return seen.size() == 1 ? *seen.begin() : "mixed";
}

// Text rows whose tokenization is long enough to matter (e.g. past a file-size limit).
std::string text_rows(int n) {
  std::string rows;
  for (int i = 0; i < n; ++i) rows += json{{"text", fmt::format("the cat sat on the mat number {} and a dog ran", i)}}.dump() + "\n";
  return rows;
}

// Reads a FIFO from a thread while `run` writes it; returns what came through. The read end is opened without
// blocking first, so a writer that never opens the FIFO (or replaces it) cannot hang the test.
std::string read_fifo_during(const fs::path& fifo, const std::function<void()>& run) {
  const int fd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  EXPECT_GE(fd, 0);
  std::atomic<bool> done{false};
  std::string got;
  std::thread reader([&] {
    char buf[4096];
    for (;;) {
      const bool last = done.load();
      ssize_t n;
      while ((n = ::read(fd, buf, sizeof buf)) > 0) got.append(buf, size_t(n));
      if (last) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  run();
  done = true;
  reader.join();
  ::close(fd);
  return got;
}

bool is_a_fifo(const fs::path& p) { return fs::is_fifo(fs::symlink_status(p)); }

}  // namespace

// --- item 1: every output file goes through OutputFile ------------------------------------------------------------

TEST_F(CliOutputs, TokenizeThroughASymlinkKeepsTheLinkAndReplacesItsTarget) {
  const fs::path d = dir("symlink");
  spit(d / "in.jsonl", text_rows(3));
  fs::create_directories(d / "real");
  spit(d / "real/target.jsonl", "old\n");
  fs::create_symlink(d / "real/target.jsonl", d / "link.jsonl");
  const LatheResult r = lathe("tokenize --tokenizer " + q(w_ / "tok") + " --input " + q(d / "in.jsonl") + " --output " +
                      q(d / "link.jsonl"));
  ASSERT_EQ(r.code, 0) << r.all();
  EXPECT_TRUE(fs::is_symlink(d / "link.jsonl")) << "the link was replaced by a file";
  const std::string got = slurp(d / "real/target.jsonl");
  EXPECT_EQ(std::count(got.begin(), got.end(), '\n'), 3) << got;
  EXPECT_NE(got.find("\"ids\""), std::string::npos) << got;
  EXPECT_TRUE(temporaries(d).empty());
  EXPECT_TRUE(temporaries(d / "real").empty());
}

TEST_F(CliOutputs, TokenizeIntoAFifoStreamsAndTheFifoStays) {
  const fs::path d = dir("fifo");
  spit(d / "in.jsonl", text_rows(4));
  ASSERT_EQ(::mkfifo((d / "pipe").c_str(), 0600), 0);
  LatheResult r{};
  const std::string got = read_fifo_during(d / "pipe", [&] {
    r = lathe("tokenize --tokenizer " + q(w_ / "tok") + " --input " + q(d / "in.jsonl") + " --output " + q(d / "pipe"));
  });
  ASSERT_EQ(r.code, 0) << r.all();
  EXPECT_EQ(std::count(got.begin(), got.end(), '\n'), 4) << got;
  EXPECT_TRUE(is_a_fifo(d / "pipe")) << "the FIFO was replaced";
  EXPECT_TRUE(temporaries(d).empty());
}

TEST_F(CliOutputs, TokenizeToDashPrintsToStdout) {
  const fs::path d = dir("dash");
  spit(d / "in.jsonl", text_rows(2));
  const LatheResult r = lathe("tokenize --tokenizer " + q(w_ / "tok") + " --input " + q(d / "in.jsonl") + " --output -", d);
  ASSERT_EQ(r.code, 0) << r.all();
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 2) << r.out;
  EXPECT_EQ(json::parse(r.out.substr(0, r.out.find('\n'))).contains("ids"), true) << r.out;
  EXPECT_FALSE(fs::exists(d / "-")) << "wrote a file named '-'";
  EXPECT_TRUE(temporaries(d).empty());
}

TEST_F(CliOutputs, TokenizeBadLineLeavesTheOldOutputAndNoTemporary) {
  const fs::path d = dir("badline");
  spit(d / "in.jsonl", text_rows(3) + "{\"text\": 5}\n");
  spit(d / "out.jsonl", "old\n");
  const LatheResult r = lathe("tokenize --tokenizer " + q(w_ / "tok") + " --input " + q(d / "in.jsonl") + " --output " +
                      q(d / "out.jsonl"));
  EXPECT_EQ(r.code, 1) << r.all();
  EXPECT_NE(r.err.find("in.jsonl:4"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(d / "out.jsonl"), "old\n");
  EXPECT_TRUE(temporaries(d).empty()) << temporaries(d)[0];
}

TEST_F(CliOutputs, LogprobsPastAFileSizeLimitNamesTheFileAndLeavesNoTemporary) {
  const fs::path d = dir("xfsz");
  std::string rows;  // ~1000 log-probs of ~20 characters: past the 8 KiB limit
  for (int i = 0; i < 10; ++i) {
    std::vector<int> ids;
    for (int t = 0; t < 100; ++t) ids.push_back(5 + (t * 7 + i) % 200);
    rows += json{{"tokens", ids}}.dump() + "\n";
  }
  spit(d / "in.jsonl", rows);
  spit(d / "out.jsonl", "old\n");
  const std::string cmd = fmt::format("bash -c \"trap '' XFSZ; ulimit -f 8; exec {} logprobs --model {} --input {} "
                                      "--output {}\" > {} 2>&1", LATHE_BINARY, q(w_ / "out/final"), q(d / "in.jsonl"),
                                      q(d / "out.jsonl"), q(d / "log"));
  const int status = std::system(cmd.c_str());
  const std::string log = slurp(d / "log");
  ASSERT_TRUE(WIFEXITED(status)) << log;
  EXPECT_EQ(WEXITSTATUS(status), 1) << log;
  EXPECT_NE(log.find((d / "out.jsonl").string()), std::string::npos) << log;
  EXPECT_NE(log.find("File too large"), std::string::npos) << log;
  EXPECT_EQ(slurp(d / "out.jsonl"), "old\n");
  EXPECT_TRUE(temporaries(d).empty()) << temporaries(d)[0];
}

TEST_F(CliOutputs, GenerateWritesToDevStdoutAndThroughASymlink) {
  const fs::path d = dir("gen_out");
  spit(d / "in.jsonl", "{\"prompt\": \"hi\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"a dog\"}]}\n");
  const std::string base = "generate --model " + q(w_ / "out/final") + " --max-new-tokens 2 --input " + q(d / "in.jsonl");
  const LatheResult r = lathe(base + " --output /dev/stdout");
  ASSERT_EQ(r.code, 0) << r.all();
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 2) << r.out;
  EXPECT_TRUE(json::parse(r.out.substr(0, r.out.find('\n'))).contains("finish_reason")) << r.out;

  spit(d / "target.jsonl", "old\n");
  fs::create_symlink(d / "target.jsonl", d / "link.jsonl");
  const LatheResult s = lathe(base + " --output " + q(d / "link.jsonl"));
  ASSERT_EQ(s.code, 0) << s.all();
  EXPECT_TRUE(fs::is_symlink(d / "link.jsonl"));
  const std::string got = slurp(d / "target.jsonl");
  EXPECT_EQ(std::count(got.begin(), got.end(), '\n'), 2) << got;
  EXPECT_TRUE(temporaries(d).empty());
}

// --adapters: two PEFT adapters (other ranks and learning rates) and the base serve the lines of one --input run,
// each line with the adapter it names, in the same engine steps; every line's greedy tokens equal those of a run with
// its adapter merged (--adapter DIR) or none, and its log-probabilities agree within 1e-4 (merged weights round
// otherwise). Bad names and specs are refused before any generation.
TEST_F(CliOutputs, GenerateServesAnAdapterPerInputLine) {
  const fs::path d = dir("gen_adapters");
  const auto train = [&](const std::string& name, const std::string& lora, const std::string& lr) {
    spit(d / (name + ".yaml"), "model: {path: " + (w_ / "out/final").string() + "}\n"
                               "data: {train: " + (w_ / "train.jsonl").string() + ", format: text, max_seq_len: 64}\n"
                               "output_dir: " + (d / name).string() + "\n"
                               "lora: " + lora + "\n"
                               "train: {max_steps: 3, micro_batch_tokens: 96, lr: " + lr + ", seed: 5}\n");
    const LatheResult t = lathe("train " + q(d / (name + ".yaml")));
    EXPECT_EQ(t.code, 0) << t.all();
    return d / name / "final";
  };
  const fs::path a = train("a", "{rank: 4, alpha: 8}", "0.05"), b = train("b", "{rank: 2, alpha: 2, targets: [q_proj, v_proj]}", "0.1");
  const std::vector<std::string> prompts = {"the cat", "a dog ran", "hello there", "green tea is"};
  const std::vector<std::string> adapter = {"a", "b", "", "a"};
  std::string mixed;
  for (size_t i = 0; i < prompts.size(); ++i)
    mixed += json{{"prompt", prompts[i]}}.dump().insert(1, adapter[i].empty() ? "" : "\"adapter\": \"" + adapter[i] + "\", ") + "\n";
  spit(d / "mixed.jsonl", mixed);
  const std::string base = "generate --model " + q(w_ / "out/final") + " --max-new-tokens 6 --temperature 0 --ignore-eos";
  const LatheResult m = lathe(base + " --input " + q(d / "mixed.jsonl") + " --adapters a=" + q(a) + " --adapters b=" +
                              q(b) + " --output " + q(d / "mixed.out.jsonl"));
  ASSERT_EQ(m.code, 0) << m.all();
  std::vector<std::string> got;
  {
    std::istringstream in(slurp(d / "mixed.out.jsonl"));
    for (std::string l; std::getline(in, l);) got.push_back(l);
  }
  ASSERT_EQ(got.size(), prompts.size());
  std::set<std::string> distinct;
  for (size_t i = 0; i < prompts.size(); ++i) {
    spit(d / "one.jsonl", json{{"prompt", prompts[i]}}.dump() + "\n");
    const std::string merged = adapter[i].empty() ? "" : " --adapter " + q(adapter[i] == "a" ? a : b);
    const LatheResult r = lathe(base + " --input " + q(d / "one.jsonl") + merged + " --output " + q(d / "one.out.jsonl"));
    ASSERT_EQ(r.code, 0) << r.all();
    const json want = json::parse(slurp(d / "one.out.jsonl")), have = json::parse(got[i]);
    EXPECT_EQ(have["tokens"], want["tokens"]) << "line " << i << " (adapter '" << adapter[i] << "')";
    for (size_t k = 0; k < want["logprobs"].size() && k < have["logprobs"].size(); ++k)
      EXPECT_NEAR(have["logprobs"][k].get<double>(), want["logprobs"][k].get<double>(), 1e-4) << "line " << i;
    distinct.insert(have["logprobs"].dump());
  }
  EXPECT_EQ(distinct.size(), prompts.size()) << "the adapters changed nothing: the comparison says little";
  spit(d / "unknown.jsonl", "{\"prompt\": \"hi\", \"adapter\": \"c\"}\n");
  const LatheResult u = lathe(base + " --input " + q(d / "unknown.jsonl") + " --adapters a=" + q(a));
  EXPECT_NE(u.code, 0);
  EXPECT_NE(u.err.find("adapter 'c' is not among --adapters (a)"), std::string::npos) << u.err;
  EXPECT_NE(u.err.find("unknown.jsonl:1"), std::string::npos) << u.err;
  const LatheResult bad = lathe(base + " --input " + q(d / "mixed.jsonl") + " --adapters " + q(a));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("--adapters takes NAME=DIR"), std::string::npos) << bad.err;
  const LatheResult both = lathe(base + " --input " + q(d / "mixed.jsonl") + " --adapters a=" + q(a) + " --adapter " + q(b));
  EXPECT_NE(both.code, 0);
  EXPECT_NE(both.err.find("not both"), std::string::npos) << both.err;
}

TEST_F(CliOutputs, PrepareFailuresRemoveEveryTemporaryAndNameThePath) {
  const fs::path d = dir("prepare");
  spit(d / "in.jsonl", text_rows(400));  // ~7000 tokens: PREFIX.tokens passes 8 KiB
  const std::string base = "prepare --tokenizer " + q(w_ / "tok") + " --input " + q(d / "in.jsonl") + " --output ";
  // PREFIX.mask is a folder: the writer stops after creating the .tokens temporary, which must go too.
  fs::create_directories(d / "c.mask");
  const LatheResult r = lathe(base + q(d / "c"));
  EXPECT_EQ(r.code, 1) << r.all();
  EXPECT_NE(r.err.find((d / "c.mask").string()), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(d / "c.tokens"));
  EXPECT_TRUE(temporaries(d).empty()) << temporaries(d)[0];
  // A file-size limit: the error names the file, nothing is left.
  const std::string cmd = fmt::format("bash -c \"trap '' XFSZ; ulimit -f 8; exec {} {}{}\" > {} 2>&1", LATHE_BINARY,
                                      base, q(d / "x"), q(d / "log"));
  const int status = std::system(cmd.c_str());
  const std::string log = slurp(d / "log");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << log;
  EXPECT_NE(log.find((d / "x.tokens").string()), std::string::npos) << log;
  fs::remove(d / "log");
  for (const char* suffix : {".tokens", ".mask", ".index", ".json"}) EXPECT_FALSE(fs::exists(d / ("x" + std::string(suffix))));
  EXPECT_TRUE(temporaries(d).empty()) << temporaries(d)[0];
  // The folder of the prefix is a file.
  spit(d / "plain", "x");
  const LatheResult f = lathe(base + q(d / "plain/x"));
  EXPECT_EQ(f.code, 1) << f.all();
  EXPECT_NE(f.err.find((d / "plain").string() + " is a file"), std::string::npos) << f.err;
  // And a success leaves the four files and no temporary.
  const LatheResult ok = lathe(base + q(d / "ok"));
  ASSERT_EQ(ok.code, 0) << ok.all();
  for (const char* suffix : {".tokens", ".mask", ".index", ".json"}) EXPECT_TRUE(fs::exists(d / ("ok" + std::string(suffix))));
  EXPECT_TRUE(temporaries(d).empty());
}

TEST_F(CliOutputs, ConvertShardSizeZeroIsRefusedAndLeavesNothing) {
  const fs::path d = dir("shard0");
  const LatheResult r = lathe("convert --model " + q(w_ / "out/final") + " --output " + q(d / "conv") + " --shard-size-mb 0");
  EXPECT_NE(r.code, 0) << r.all();
  EXPECT_NE(r.err.find("--shard-size-mb"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::is_empty(d)) << fs::directory_iterator(d)->path();
}

// --- item 2: numeric options are range-checked before any work -------------------------------------------------

TEST_F(CliOutputs, OutOfRangeNumericOptionsAreRefusedUpFront) {
  const fs::path d = dir("ranges");
  spit(d / "in.jsonl", "{\"prompt\": \"hi\"}\n");
  spit(d / "tok.jsonl", "{\"tokens\": [5, 6, 7]}\n");
  const std::string model = " --model " + q(w_ / "out/final"), gen = "generate" + model + " --prompt hi";
  const std::string lp = "logprobs" + model + " --input " + q(d / "tok.jsonl") + " --output " + q(d / "o.jsonl");
  const std::string tok = " --tokenizer " + q(w_ / "tok") + " --input " + q(w_ / "train.jsonl") + " --output " + q(d / "t");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {gen + " --max-new-tokens 0", "--max-new-tokens"},
      {gen + " --top-k -1", "--top-k"},
      {gen + " --top-p 0", "--top-p"},
      {gen + " --top-p 1.5", "--top-p"},
      {gen + " --temperature -0.5", "--temperature"},
      {lp + " --batch-tokens 0", "--batch-tokens"},
      {"tokenize" + tok + " --threads -1", "--threads"},
      {"prepare" + tok + " --threads -2", "--threads"},
      {"prepare" + tok + " --max-seq-len -1", "--max-seq-len"},
      {"convert" + model + " --output " + q(d / "c") + " --shard-size-mb 0", "--shard-size-mb"},
      {"bench --shape 0.6b --seq 1", "--seq"},
      {"bench --shape 0.6b --micro-batch 0", "--micro-batch"},
      {"bench --shape 0.6b --steps 0", "--steps"},
      {"bench --shape 0.6b --warmup -1", "--warmup"},
      {"bench --shape 0.6b --layers -1", "--layers"},
      {"bench --shape 0.6b --lora-rank -1", "--lora-rank"},
  };
  for (const auto& [args, option] : cases) {
    const LatheResult r = lathe(args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.err;  // a usage error (3 would be an unexpected exception)
    EXPECT_NE(r.err.find(option + ": must be"), std::string::npos) << args << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << args << ": work started: " << r.out;
  }
  EXPECT_FALSE(fs::exists(d / "o.jsonl"));
  EXPECT_FALSE(fs::exists(d / "c"));
  EXPECT_FALSE(fs::exists(d / "t"));
}

// --- items 3 and 4: export and convert keep the source's dtype and carry the tokenizer files ------------------------

TEST_F(CliOutputs, ConvertKeepsTheSourceDtypeAndCopiesTheTokenizerFiles) {
  const fs::path d = dir("convert");
  const fs::path src = model_copy("convert_src", "{\"enable_thinking\": false}\n");
  ASSERT_EQ(only_dtype(src / "model.safetensors"), "F32");
  const LatheResult half = lathe("convert --model " + q(src) + " --output " + q(d / "bf16") + " --dtype bf16");
  ASSERT_EQ(half.code, 0) << half.all();
  EXPECT_EQ(only_dtype(d / "bf16/model.safetensors"), "BF16");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template_kwargs.json"})
    EXPECT_EQ(slurp(d / "bf16" / f), slurp(src / f)) << f;
  // No --dtype: the source's (config.json says bfloat16).
  const LatheResult same = lathe("convert --model " + q(d / "bf16") + " --output " + q(d / "again"));
  ASSERT_EQ(same.code, 0) << same.all();
  EXPECT_EQ(only_dtype(d / "again/model.safetensors"), "BF16");
  EXPECT_EQ(json::parse(slurp(d / "again/config.json"))["torch_dtype"], "bfloat16");
  EXPECT_EQ(slurp(d / "again/chat_template_kwargs.json"), "{\"enable_thinking\": false}\n");
  // A config.json that names no dtype: the tensors'.
  json config = json::parse(slurp(d / "bf16/config.json"));
  config.erase("dtype");
  config.erase("torch_dtype");
  spit(d / "bf16/config.json", config.dump());
  const LatheResult bare = lathe("convert --model " + q(d / "bf16") + " --output " + q(d / "bare"));
  ASSERT_EQ(bare.code, 0) << bare.all();
  EXPECT_EQ(only_dtype(d / "bare/model.safetensors"), "BF16");
  EXPECT_TRUE(temporaries(d).empty());
}

TEST_F(CliOutputs, ExportOfACheckpointKeepsItsDtypeAndCarriesItsChatTemplateKwargs) {
  const fs::path d = dir("export");
  const fs::path ckpt = w_ / "out/checkpoints/step-00000002";
  ASSERT_TRUE(fs::exists(ckpt / "model/config.json"));
  spit(ckpt / "model/chat_template_kwargs.json", "{\"enable_thinking\": false}\n");
  const LatheResult r = lathe("export --checkpoint " + q(w_ / "out") + " --output " + q(d / "full"));
  fs::remove(ckpt / "model/chat_template_kwargs.json");
  ASSERT_EQ(r.code, 0) << r.all();
  EXPECT_EQ(only_dtype(d / "full/model.safetensors"), "F32");  // trained on the CPU in f32
  EXPECT_EQ(slurp(d / "full/chat_template_kwargs.json"), "{\"enable_thinking\": false}\n");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) EXPECT_EQ(slurp(d / "full" / f), slurp(w_ / "tok" / f)) << f;
  EXPECT_TRUE(temporaries(d).empty());
}

TEST_F(CliOutputs, ExportOfAnAdapterKeepsItsDtypeAndAMergeKeepsTheBaseDtype) {
  const fs::path d = dir("export_lora");
  // An f16 base and a LoRA run on it: the adapter is trained and saved in f32.
  ASSERT_EQ(lathe("convert --model " + q(w_ / "out/final") + " --output " + q(d / "base16") + " --dtype f16").code, 0);
  spit(d / "lora.yaml", "model: {path: " + (d / "base16").string() + "}\n"
                        "data: {train: " + (w_ / "train.jsonl").string() + ", format: text, max_seq_len: 64}\n"
                        "output_dir: " + (d / "run").string() + "\n"
                        "lora: {rank: 4, alpha: 8}\n"
                        "train: {max_steps: 2, micro_batch_tokens: 96, save_every: 2, seed: 5}\n");
  const LatheResult t = lathe("train " + q(d / "lora.yaml"));
  ASSERT_EQ(t.code, 0) << t.all();
  const fs::path adapter = d / "run/checkpoints/step-00000002/adapter";
  ASSERT_EQ(only_dtype(adapter / "adapter_model.safetensors"), "F32");
  spit(adapter / "chat_template_kwargs.json", "{\"enable_thinking\": false}\n");

  const LatheResult a = lathe("export --checkpoint " + q(d / "run") + " --adapter --output " + q(d / "peft"));
  ASSERT_EQ(a.code, 0) << a.all();
  EXPECT_EQ(only_dtype(d / "peft/adapter_model.safetensors"), "F32");
  EXPECT_EQ(slurp(d / "peft/chat_template_kwargs.json"), "{\"enable_thinking\": false}\n");
  EXPECT_TRUE(fs::exists(d / "peft/tokenizer.json"));

  const LatheResult m = lathe("export --checkpoint " + q(d / "run") + " --merge --output " + q(d / "merged"));
  ASSERT_EQ(m.code, 0) << m.all();
  EXPECT_EQ(only_dtype(d / "merged/model.safetensors"), "F16");
  EXPECT_EQ(slurp(d / "merged/chat_template_kwargs.json"), "{\"enable_thinking\": false}\n");

  const LatheResult o = lathe("export --checkpoint " + q(d / "run") + " --merge --dtype bf16 --output " + q(d / "merged16"));
  ASSERT_EQ(o.code, 0) << o.all();
  EXPECT_EQ(only_dtype(d / "merged16/model.safetensors"), "BF16");
  EXPECT_TRUE(temporaries(d).empty());
}

// --- item 5: chat-template kwargs of generate --------------------------------------------------------------------

TEST_F(CliOutputs, GenerateTakesTheModelFoldersChatTemplateKwargsAndTheOptionOverrides) {
  const fs::path model = model_copy("gen_kwargs", "{\"enable_thinking\": false}\n");
  const json user = json::array({{{"role", "user"}, {"content", "the cat"}}});
  const size_t off = rendered_ids(user, true, "{\"enable_thinking\": false}").size();
  const size_t on = rendered_ids(user, true, "{}").size();
  ASSERT_GT(off, on) << "the template should open an empty thinking block with enable_thinking false";
  const std::string base = " --prompt 'the cat' --max-new-tokens 1";

  const LatheResult r = lathe("generate --model " + q(model) + base);
  ASSERT_EQ(r.code, 0) << r.all();
  EXPECT_NE(r.err.find("generate: chat template kwargs {\"enable_thinking\":false} (from " +
                       (model / "chat_template_kwargs.json").string() + ")"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(fmt::format("{} prompt tokens", off)), std::string::npos) << r.err;

  const LatheResult o = lathe("generate --model " + q(model) + base + " --chat-template-kwargs '{}'");
  ASSERT_EQ(o.code, 0) << o.all();
  EXPECT_NE(o.err.find("chat template kwargs {} (from --chat-template-kwargs)"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find(fmt::format("{} prompt tokens", on)), std::string::npos) << o.err;

  // A model folder without the file: the --tokenizer folder's.
  const fs::path tok = w_ / "gen_kwargs_tok";
  fs::remove_all(tok);
  fs::copy(w_ / "tok", tok);
  spit(tok / "chat_template_kwargs.json", "{\"enable_thinking\": false}\n");
  const fs::path bare = w_ / "gen_kwargs_bare";  // the trained model's folder without its chat_template_kwargs.json
  fs::remove_all(bare);
  fs::copy(w_ / "out/final", bare);
  fs::remove(bare / "chat_template_kwargs.json");
  const LatheResult t = lathe("generate --model " + q(bare) + " --tokenizer " + q(tok) + base);
  ASSERT_EQ(t.code, 0) << t.all();
  EXPECT_NE(t.err.find("(from " + (tok / "chat_template_kwargs.json").string() + ")"), std::string::npos) << t.err;
  EXPECT_NE(t.err.find(fmt::format("{} prompt tokens", off)), std::string::npos) << t.err;

  // Not a JSON object: refused.
  const LatheResult bad = lathe("generate --model " + q(model) + base + " --chat-template-kwargs '[1]'");
  EXPECT_EQ(bad.code, 1) << bad.all();
  EXPECT_NE(bad.err.find("--chat-template-kwargs"), std::string::npos) << bad.err;
}

TEST_F(CliOutputs, TokenizeTakesChatTemplateKwargsUnderBothNames) {
  const json user = json::array({{{"role", "user"}, {"content", "hi"}}});
  const fs::path d = dir("tok_alias");
  spit(d / "in.jsonl", json{{"messages", user}, {"add_generation_prompt", true}}.dump() + "\n");
  const std::string base = "tokenize --tokenizer " + q(w_ / "tok") + " --input " + q(d / "in.jsonl") + " --output -";
  const LatheResult a = lathe(base + " --template-kwargs '{\"enable_thinking\": false}'", d);
  const LatheResult b = lathe(base + " --chat-template-kwargs '{\"enable_thinking\": false}'", d);
  const LatheResult c = lathe(base, d);
  ASSERT_EQ(a.code, 0) << a.all();
  ASSERT_EQ(b.code, 0) << b.all();
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.out.find("<think>"), std::string::npos) << a.out;
  EXPECT_EQ(c.out.find("<think>"), std::string::npos) << c.out;
}

// --- item 6: logprobs scores {"messages"} rows -------------------------------------------------------------------

TEST_F(CliOutputs, LogprobsScoresMessagesRowsLikeTheirRenderedTokens) {
  const fs::path model = model_copy("lp_messages", "{\"enable_thinking\": false}\n");
  const fs::path d = dir("lp_messages_run");
  const json conv = json::array({{{"role", "user"}, {"content", "a dog"}}, {{"role", "assistant"}, {"content", "the cat"}}});
  const std::vector<int32_t> ids = rendered_ids(conv, false, "{\"enable_thinking\": false}");
  spit(d / "in.jsonl", json{{"messages", conv}}.dump() + "\n" + json{{"tokens", ids}}.dump() + "\n" +
                           json{{"text", "the cat"}}.dump() + "\n");
  const LatheResult r = lathe("logprobs --model " + q(model) + " --input " + q(d / "in.jsonl") + " --output -");
  ASSERT_EQ(r.code, 0) << r.all();
  EXPECT_NE(r.err.find("logprobs: chat template kwargs {\"enable_thinking\":false} (from " +
                       (model / "chat_template_kwargs.json").string() + ")"), std::string::npos) << r.err;
  std::vector<json> rows;
  for (size_t at = 0, end; (end = r.out.find('\n', at)) != std::string::npos; at = end + 1)
    rows.push_back(json::parse(r.out.substr(at, end - at)));
  ASSERT_EQ(rows.size(), 3u) << r.out;
  EXPECT_EQ(rows[0]["logprobs"].size(), ids.size() - 1);
  EXPECT_EQ(rows[0], rows[1]) << "a messages row scores differently from its rendered tokens";
  EXPECT_EQ(rows[2]["logprobs"].size(), tokenized(json{{"text", "the cat"}}).size() - 1);

  const LatheResult help = lathe("logprobs --help");
  EXPECT_NE(help.out.find("{\"text\""), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("{\"messages\""), std::string::npos) << help.out;
}

// --- item 7: paths that are missing or of the wrong kind are named ----------------------------------------------

TEST_F(CliOutputs, MissingAndMisplacedPathsAreNamed) {
  const fs::path d = dir("paths");
  spit(d / "tok.jsonl", "{\"tokens\": [5, 6, 7]}\n");
  spit(d / "file", "x");
  const fs::path missing = d / "no-such-model";
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      {"logprobs --model " + q(w_ / "out/final") + " --input " + q(d) + " --output " + q(d / "o.jsonl"),
       d.string() + " is a folder"},
      {"generate --model " + q(w_ / "out/final") + " --input " + q(d) + " --output " + q(d / "o.jsonl"),
       d.string() + " is a folder"},
      {"tokenize --tokenizer " + q(w_ / "tok") + " --input " + q(d) + " --output " + q(d / "o.jsonl"),
       d.string() + " is a folder"},
      {"tokenize --tokenizer " + q(w_ / "tok") + " --input " + q(w_ / "train.jsonl") + " --output " + q(d / "file/o.jsonl"),
       (d / "file").string() + " is a file"},
      {"logprobs --model " + q(w_ / "out/final") + " --input " + q(d / "tok.jsonl") + " --output " + q(d / "file/o.jsonl"),
       (d / "file").string() + " is a file"},
      {"generate --model " + q(missing) + " --prompt hi", missing.string() + " does not exist"},
      {"logprobs --model " + q(missing) + " --input " + q(d / "tok.jsonl") + " --output " + q(d / "o.jsonl"),
       missing.string() + " does not exist"},
      {"convert --model " + q(missing) + " --output " + q(d / "c"), missing.string() + " does not exist"},
      {"tokenize --tokenizer " + q(missing) + " --input " + q(w_ / "train.jsonl") + " --output -",
       missing.string() + " does not exist"},
      {"prepare --tokenizer " + q(missing) + " --input " + q(w_ / "train.jsonl") + " --output " + q(d / "p"),
       missing.string() + " does not exist"},
      {"export --checkpoint " + q(missing) + " --output " + q(d / "e"), missing.string() + " does not exist"},
      {"convert --model " + q(w_ / "out/final") + " --output " + q(d / "file/c"), (d / "file").string() + " is a file"},
  };
  for (const Case& c : cases) {
    const LatheResult r = lathe(c.args);
    EXPECT_EQ(r.code, 1) << c.args << ": " << r.err;  // a lathe error, not an unexpected exception (3)
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << ": " << r.err;
  }
  EXPECT_FALSE(fs::exists(d / "o.jsonl"));
  EXPECT_TRUE(temporaries(d).empty());
}
