// src/train/config.cpp: the option table is the one source of truth — every option the docs, the README and the
// example configs name exists in it, every example config loads, every number option states its range in
// --help-config — and its checks: ranges, keys given twice, paths relative to the config file, --set into a mapping.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "core/error.h"
#include "support/error_of.h"
#include "train/config.h"

namespace fs = std::filesystem;
using lathe::test_support::error_of;

namespace {

const fs::path kRepo = fs::path(LATHE_TEST_DATA_DIR).parent_path();

// The option paths --help-config lists (the first word of each indented line).
std::set<std::string> help_options() {
  std::set<std::string> out;
  std::istringstream in(lathe::train_config_help());
  for (std::string line; std::getline(in, line);)
    if (line.rfind("  ", 0) == 0) out.insert(line.substr(2, line.find(' ', 2) - 2));
  return out;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("lathe_config_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

}  // namespace

TEST(TrainConfig, EveryOptionTheDocsNameExists) {
  const std::set<std::string> options = help_options();
  ASSERT_GT(options.size(), 40u);
  // Backticked `section.key` names in the docs; the words after "model." that name tensors or files are not options.
  const std::regex key(R"(`((model|data|train|lora|final_eval|parallel)\.([a-z_]+)))");
  const std::set<std::string> not_options = {"safetensors", "layers", "language_model", "logits", "jsonl", "json", "yaml"};
  std::vector<fs::path> files = {kRepo / "README.md"};
  for (const auto& e : fs::directory_iterator(kRepo / "docs"))
    if (e.path().extension() == ".md") files.push_back(e.path());
  int checked = 0;
  for (const fs::path& f : files) {
    const std::string text = slurp(f);
    for (std::sregex_iterator it(text.begin(), text.end(), key), end; it != end; ++it) {
      if (not_options.count((*it)[3].str())) continue;
      ++checked;
      EXPECT_TRUE(options.count((*it)[1].str())) << f.filename().string() << " names `" << (*it)[1].str()
                                                 << "`, which --help-config does not list";
    }
  }
  EXPECT_GT(checked, 20);
}

TEST(TrainConfig, EveryExampleConfigLoads) {
  int loaded = 0;
  for (const auto& e : fs::directory_iterator(kRepo / "examples")) {
    if (e.path().extension() != ".yaml") continue;
    // An RL config (it has an rl: section) is lathe rl's.
    std::ifstream f(e.path());
    const std::string text((std::istreambuf_iterator<char>(f)), {});
    const bool rl = text.find("\nrl:\n") != std::string::npos;
    EXPECT_EQ(error_of([&] {
                lathe::load_train_config(e.path().string(), {}, rl ? lathe::ConfigFor::rl : lathe::ConfigFor::train);
              }),
              "(no error)")
        << e.path();
    ++loaded;
  }
  EXPECT_GE(loaded, 5);
}

TEST(TrainConfig, EveryNumberOptionStatesItsRange) {
  std::istringstream in(lathe::train_config_help());
  int numbers = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.find(" int ") == std::string::npos && line.find(" float ") == std::string::npos) continue;
    ++numbers;
    EXPECT_TRUE(std::regex_search(line, std::regex(R"(\(range: (>=|>|in) .+\)$)"))) << line;
  }
  EXPECT_GT(numbers, 20);
}

TEST(TrainConfig, RangesAreCheckedAndEveryProblemIsReported) {
  const std::string e = error_of([] {
    lathe::load_train_config("", {"model.config={hidden_size: 8}", "model.tokenizer=t", "data.train=x.jsonl",
                                  "output_dir=o", "train.max_steps=0", "train.log_every=0", "train.seed=-1",
                                  "train.beta2=1", "lora.dropout=1", "train.lr=0", "train.warmup_steps=-2"});
  });
  for (const char* needle : {"7 problems", "train.max_steps: must be in [1, 1000000000000] (got 0)", "train.log_every: must be >= 1 (got 0)",
                             "train.seed: must be >= 0 (got -1)", "train.beta2: must be in [0, 1) (got 1)",
                             "lora.dropout: must be in [0, 1) (got 1)", "train.lr: must be > 0 (got 0)",
                             "train.warmup_steps: must be >= 0 (got -2)"})
    EXPECT_NE(e.find(needle), std::string::npos) << needle << "\n" << e;
}

// The pipeline options, each wrong in its own way, every problem reported at once: a stage count that is no number,
// counts for another number of stages, virtual stages without a pipeline, and (at pp 2) ZeRO and a grad_accum the
// interleaved schedule cannot group.
TEST(TrainConfig, PipelineOptionsAreChecked) {
  const std::vector<std::string> base = {"model.config={hidden_size: 8}", "model.tokenizer=t", "data.train=x.jsonl",
                                         "output_dir=o", "train.max_steps=1"};
  auto problems = [&](const std::vector<std::string>& more) {
    std::vector<std::string> sets = base;
    sets.insert(sets.end(), more.begin(), more.end());
    return error_of([&] { lathe::load_train_config("", sets); });
  };
  const std::string one = problems({"parallel.vpp=2", "parallel.pp_layers=[2,x,1]"});
  for (const char* needle : {"3 problems", "parallel.vpp: 2 virtual stages need pipeline parallelism (parallel.pp above 1)",
                             "parallel.pp_layers: 'x' is not a layer count (or give [balanced] alone)",
                             "parallel.pp_layers: 3 counts for 2 pipeline stages (pp 1 x vpp 2)"})
    EXPECT_NE(one.find(needle), std::string::npos) << needle << "\n" << one;
  const std::string two =
      problems({"parallel.pp=2", "parallel.vpp=2", "train.grad_accum=3", "parallel.zero=2", "parallel.pp_layers=[1,1]"});
  for (const char* needle : {"parallel.pp: 2 with parallel.zero 2: under pipeline parallelism the gradients are reduced "
                             "once after the schedule",
                             "train.grad_accum = 3 is not a multiple of it",
                             "parallel.pp_layers: 2 counts for 4 pipeline stages (pp 2 x vpp 2)"})
    EXPECT_NE(two.find(needle), std::string::npos) << needle << "\n" << two;
}

// train.recompute_layers chooses which layers recompute: without train.recompute it is an error, not ignored; below -1
// it is out of range.
TEST(TrainConfig, RecomputeLayersNeedRecompute) {
  const std::vector<std::string> base = {"model.config={hidden_size: 8}", "model.tokenizer=t", "data.train=x.jsonl",
                                         "output_dir=o", "train.max_steps=1"};
  auto with = [&](const std::vector<std::string>& more) {
    std::vector<std::string> sets = base;
    sets.insert(sets.end(), more.begin(), more.end());
    return sets;
  };
  const std::string alone = error_of([&] { lathe::load_train_config("", with({"train.recompute_layers=3"})); });
  EXPECT_NE(alone.find("train.recompute_layers: 3 with train.recompute false"), std::string::npos) << alone;
  const std::string low =
      error_of([&] { lathe::load_train_config("", with({"train.recompute=true", "train.recompute_layers=-2"})); });
  EXPECT_NE(low.find("train.recompute_layers: must be"), std::string::npos) << low;
  const lathe::TrainConfig c =
      lathe::load_train_config("", with({"train.recompute=true", "train.recompute_layers=2"}));
  EXPECT_TRUE(c.recomputes(1));
  EXPECT_FALSE(c.recomputes(2));
  EXPECT_TRUE(lathe::load_train_config("", with({"train.recompute=true"})).recomputes(1000));
  EXPECT_FALSE(lathe::load_train_config("", base).recomputes(0));
}

TEST(TrainConfig, PathsInAFileAreRelativeToItsFolder) {
  const fs::path d = scratch("paths");
  fs::create_directories(d / "conf");
  std::ofstream(d / "conf/run.yaml") << "model: {config: {hidden_size: 8}, tokenizer: ../tok}\n"
                                        "data: {train: [a.jsonl, /abs/b.jsonl], eval: ../e.jsonl}\n"
                                        "output_dir: out\nresume: auto\ntrain: {max_steps: 3}\n"
                                        "final_eval: {file: ../../h.jsonl}\n";
  const lathe::TrainConfig c = lathe::load_train_config((d / "conf/run.yaml").string(), {"lora.init=adapter", "lora.rank=4"});
  EXPECT_EQ(c.tokenizer, (d / "tok").string());
  EXPECT_EQ(c.train_files, (std::vector<std::string>{(d / "conf/a.jsonl").string(), "/abs/b.jsonl"}));
  EXPECT_EQ(c.eval_files, std::vector<std::string>{(d / "e.jsonl").string()});
  EXPECT_EQ(c.output_dir, (d / "conf/out").string());
  EXPECT_EQ(c.final_eval_file, (d.parent_path() / "h.jsonl").string());
  EXPECT_EQ(c.resume, "auto");  // a word, not a path
  EXPECT_EQ(c.lora_init, "adapter");  // --set: relative to the current directory, as given
}

TEST(TrainConfig, KeysGivenTwiceAreProblems) {
  const fs::path d = scratch("dups");
  std::ofstream(d / "dup.yaml") << "output_dir: o\ntrain:\n  max_steps: 2\n  lr: 0.1\n  max_steps: 3\n"
                                   "data: {train: a.jsonl, train: b.jsonl}\n";
  const std::string e = error_of([&] { lathe::load_train_config((d / "dup.yaml").string(), {}); });
  EXPECT_NE(e.find("dup.yaml:5: key 'max_steps' is given twice in one mapping (first at line 3)"), std::string::npos) << e;
  EXPECT_NE(e.find("dup.yaml:6: key 'train' is given twice in one mapping (first at line 6)"), std::string::npos) << e;
}

TEST(TrainConfig, SetReachesIntoMappingOptions) {
  const lathe::TrainConfig c = lathe::load_train_config(
      "", {"model.config={hidden_size: 8, num_hidden_layers: 2}", "model.config.hidden_size=16", "model.tokenizer=t",
           "data.train=x.jsonl", "output_dir=o", "train.max_steps=1", "data.chat_template_kwargs.enable_thinking=true"});
  EXPECT_EQ(c.model_config["hidden_size"], 16);
  EXPECT_EQ(c.model_config["num_hidden_layers"], 2);
  EXPECT_EQ(c.chat_template_kwargs, (nlohmann::json{{"enable_thinking", true}}));
  const std::string help = lathe::train_config_help();
  EXPECT_NE(help.find("model.config                   mapping          (none)"), std::string::npos) << help;
  EXPECT_NE(help.find("tenants"), std::string::npos);
  EXPECT_NE(help.find("data.format                    string           auto       auto (each row by its keys) | text | "
                      "messages (alias: chat)"), std::string::npos);
}
