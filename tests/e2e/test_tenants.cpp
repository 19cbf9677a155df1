// Multi-tenant LoRA through the lathe binary, on a tiny base model fine-tuned first: K tenants trained together
// (different data, ranks, targets, learning rates, schedules, accumulation, dropout, step counts) give the same
// adapters as K separate single-adapter runs; a tenant with bad data or a diverging learning rate fails alone and
// the others still match their separate runs; a killed multi-tenant run resumes to the same adapters bitwise;
// adapters export as PEFT folders and merge into a model that scores like base + adapter.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "support/tensor_files.h"
#include "lathe_run.h"

namespace fs = std::filesystem;
using lathe_e2e::LatheRun;
using lathe_e2e::losses;
using lathe_e2e::metrics;
LatheRun cli(const std::string& args, const std::string& env = "") { return lathe_e2e::lathe(args, env); }

namespace {

const fs::path kTests = LATHE_TEST_DATA_DIR;

struct Tenant {
  std::string name, data, extra;  // extra: YAML lines of the tenant's own options (indented by 4 in tenants:)
};

// A work folder with the tokenizer, three tenants' data and a base model (a tiny Qwen3 fine-tuned for 4 steps).
fs::path setup(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("lathe_tenants_{}_{}", name, getpid());
  fs::remove_all(dir);
  fs::create_directories(dir / "tok");
  fs::copy_file(kTests / "data/fixtures/tiny_tokenizer.json", dir / "tok/tokenizer.json");
  const std::vector<std::vector<std::string>> texts = {
      {"the cat sat on the mat", "a cat and a hat", "the mat is flat"},
      {"one two three four five", "six seven eight nine ten", "two four six eight"},
      {"hello world hello world", "we like green tea", "the sun is hot today"}};
  const char* names[] = {"a", "b", "c"};
  for (int t = 0; t < 3; ++t) {
    std::ofstream f(dir / fmt::format("{}.jsonl", names[t]));
    for (int i = 0; i < 40; ++i) f << nlohmann::json{{"text", texts[size_t(t)][size_t(i % 3)]}}.dump() << "\n";
  }
  std::ofstream cfg(dir / "base.yaml");
  cfg << "model:\n  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,\n"
         "           num_key_value_heads: 2, head_dim: 8, tie_word_embeddings: false}\n"
         "  tokenizer: " << (dir / "tok").string() << "\n"
         "data: {train: " << (dir / "a.jsonl").string() << ", format: text, max_seq_len: 64}\n"
         "output_dir: " << (dir / "base").string() << "\n"
         "train: {max_steps: 4, micro_batch_tokens: 128, lr: 0.01, seed: 9}\n";
  cfg.close();
  const LatheRun r = cli("train " + (dir / "base.yaml").string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return dir;
}

std::string shared_yaml(const fs::path& dir, const fs::path& out) {
  return "model: {path: " + (dir / "base/final").string() + "}\n" + "output_dir: " + out.string() + "\n" +
         "data: {format: text, max_seq_len: 64}\n"
         "lora: {rank: 4, alpha: 8}\n"
         "train: {max_steps: 6, micro_batch_tokens: 96, lr: 0.01, save_every: 2, keep_last: 5, warmup_steps: 1}\n";
}

const std::vector<Tenant>& tenants() {
  static const std::vector<Tenant> t = {
      {"a", "a.jsonl", "lora: {rank: 4, targets: all-linear, dropout: 0.1}\ntrain: {seed: 1, lr: 0.02}"},
      {"b", "b.jsonl", "lora: {rank: 2, alpha: 4, targets: \"q_proj,v_proj\", rslora: true}\n"
                       "train: {seed: 2, grad_accum: 2, schedule: constant}"},
      {"c", "c.jsonl", "lora: {rank: 8, targets: [gate_proj, up_proj, down_proj]}\ntrain: {seed: 3, max_steps: 4, micro_batch_tokens: 64}"}};
  return t;
}

std::string indent(const std::string& s, int n) {
  std::string out(size_t(n), ' ');
  for (char ch : s) {
    out += ch;
    if (ch == '\n') out += std::string(size_t(n), ' ');
  }
  return out;
}

fs::path write_multi(const fs::path& dir, const std::string& name, const std::vector<Tenant>& ts) {
  std::string y = shared_yaml(dir, dir / name) + "tenants:\n";
  for (const Tenant& t : ts)
    y += "  - name: " + t.name + "\n    data: {train: " + (dir / t.data).string() + "}\n" + indent(t.extra, 4) + "\n";
  const fs::path path = dir / (name + ".yaml");
  std::ofstream(path) << y;
  return path;
}

// A single-adapter run with the same settings as tenant t (top-level options merged by YAML's last-key-wins is not
// portable, so the tenant's mappings are applied through --set).
LatheRun run_solo(const fs::path& dir, const Tenant& t) {
  std::ofstream(dir / ("solo_" + t.name + ".yaml")) << shared_yaml(dir, dir / ("solo_" + t.name));
  std::string sets = " --set data.train=" + (dir / t.data).string();
  // Flatten "section: {k: v, ...}" lines of extra into --set section.k=v.
  std::istringstream lines(t.extra);
  std::string line;
  while (std::getline(lines, line)) {
    const std::string section = line.substr(0, line.find(':'));
    const std::string body = line.substr(line.find('{') + 1, line.rfind('}') - line.find('{') - 1);
    size_t p = 0;
    while (p < body.size()) {
      size_t q = p, depth = 0;  // split on commas outside [] and ""
      bool quoted = false;
      for (; q < body.size(); ++q) {
        if (body[q] == '"') quoted = !quoted;
        if (body[q] == '[') ++depth;
        if (body[q] == ']') --depth;
        if (body[q] == ',' && depth == 0 && !quoted) break;
      }
      std::string kv = body.substr(p, q - p);
      kv.erase(0, kv.find_first_not_of(' '));
      const std::string key = kv.substr(0, kv.find(':'));
      std::string value = kv.substr(kv.find(':') + 1);
      value.erase(0, value.find_first_not_of(' '));
      sets += " --set '" + section + "." + key + "=" + value + "'";
      p = q + 1;
    }
  }
  return cli("train " + (dir / ("solo_" + t.name + ".yaml")).string() + sets);
}

std::map<std::string, std::vector<float>> adapter(const fs::path& dir) {
  return lathe::test_support::read_f32_tensors(dir / "adapter_model.safetensors");
}

using lathe::test_support::worst_rel_diff;

}  // namespace

TEST(Tenants, TrainingTogetherEqualsSeparateRunsAndFailuresStayIsolated) {
  const fs::path dir = setup("equiv");
  const LatheRun multi = cli("train " + write_multi(dir, "multi", tenants()).string());
  ASSERT_EQ(multi.exit_code, 0) << multi.output;
  EXPECT_NE(multi.output.find("no optimizer state"), std::string::npos) << multi.output;
  for (const Tenant& t : tenants()) {
    SCOPED_TRACE(t.name);
    const LatheRun solo = run_solo(dir, t);
    ASSERT_EQ(solo.exit_code, 0) << solo.output;
    const auto together = adapter(dir / "multi" / t.name / "final"), alone = adapter(dir / ("solo_" + t.name) / "final");
    const double d = worst_rel_diff(together, alone);
    std::printf("[tenants] %s: %zu tensors, worst relative difference together vs alone %.3g\n", t.name.c_str(), alone.size(), d);
    EXPECT_LT(d, 1e-4);
    const std::vector<double> lm = losses(dir / "multi" / t.name), ls = losses(dir / ("solo_" + t.name));
    ASSERT_EQ(lm.size(), ls.size());
    for (size_t i = 0; i < lm.size(); ++i) EXPECT_NEAR(lm[i], ls[i], 1e-5 * std::abs(ls[i])) << "step " << i + 1;
    EXPECT_LT(ls.back(), ls.front()) << "tenant " << t.name << " did not learn";
  }
  EXPECT_EQ(losses(dir / "multi/c").size(), 4u);  // finished early, the others went on
  EXPECT_EQ(losses(dir / "multi/a").size(), 6u);

  // Failure isolation: tenant b's data is malformed, tenant c diverges; tenant a must still equal its solo run.
  {
    std::ofstream bad(dir / "bad.jsonl");
    bad << "{\"text\": \"fine row\"}\n{\"text\": \"broken\n";
  }
  std::vector<Tenant> ts = tenants();
  ts[1].data = "bad.jsonl";
  ts[2].extra = "lora: {rank: 8}\ntrain: {seed: 3, lr: 1.0e+30, warmup_steps: 0, max_grad_norm: 0.0, max_bad_steps: 2}";
  const LatheRun r = cli("train " + write_multi(dir, "isolated", ts).string());
  EXPECT_EQ(r.exit_code, 4) << r.output;
  EXPECT_TRUE(fs::exists(dir / "isolated/b/FAILED"));
  std::ifstream fb(dir / "isolated/b/FAILED");
  const std::string why((std::istreambuf_iterator<char>(fb)), {});
  EXPECT_NE(why.find("bad.jsonl:2"), std::string::npos) << why;
  EXPECT_TRUE(fs::exists(dir / "isolated/c/FAILED")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "isolated/c/final"));
  EXPECT_LT(worst_rel_diff(adapter(dir / "isolated/a/final"), adapter(dir / "solo_a/final")), 1e-4);
  EXPECT_NE(r.output.find("tenant b: FAILED"), std::string::npos) << r.output;
}

TEST(Tenants, KilledRunResumesEveryTenantBitwise) {
  const fs::path dir = setup("resume");
  ASSERT_EQ(cli("train " + write_multi(dir, "ref", tenants()).string()).exit_code, 0);
  const fs::path cfg = write_multi(dir, "killed", tenants());
  EXPECT_EQ(cli("train " + cfg.string(), "LATHE_FAULT_INJECT=after_step:3").exit_code, 9);
  const LatheRun resumed = cli("train " + cfg.string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  for (const Tenant& t : tenants()) {
    EXPECT_EQ(adapter(dir / "killed" / t.name / "final"), adapter(dir / "ref" / t.name / "final")) << t.name;
    EXPECT_EQ(losses(dir / "killed" / t.name), losses(dir / "ref" / t.name)) << t.name;
  }
  // Run again: every tenant has finished, so nothing is done; overwrite trains them all again, to the same adapters.
  const LatheRun again = cli("train " + cfg.string());
  EXPECT_EQ(again.exit_code, 0) << again.output;
  for (const Tenant& t : tenants())
    EXPECT_NE(again.output.find("tenant " + t.name + ": " + (dir / "killed" / t.name).string() + " already finished"),
              std::string::npos) << again.output;
  const LatheRun over = cli("train " + cfg.string() + " --set overwrite=true");
  ASSERT_EQ(over.exit_code, 0) << over.output;
  for (const Tenant& t : tenants()) {
    EXPECT_EQ(adapter(dir / "killed" / t.name / "final"), adapter(dir / "ref" / t.name / "final")) << t.name;
    EXPECT_EQ(losses(dir / "killed" / t.name), losses(dir / "ref" / t.name)) << t.name;
  }
}

TEST(Tenants, AdapterExportsMergeAndScoresAgree) {
  const fs::path dir = setup("export");
  std::string one = shared_yaml(dir, dir / "one");  // its data mapping gains the training file (a key given twice is refused)
  one.replace(one.find("data: {"), 7, "data: {train: " + (dir / "a.jsonl").string() + ", ");
  std::ofstream(dir / "one.yaml") << one;
  ASSERT_EQ(cli("train " + (dir / "one.yaml").string()).exit_code, 0);
  for (const char* f : {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"})
    EXPECT_TRUE(fs::exists(dir / "one/final" / f)) << f;
  const LatheRun e = cli("export --checkpoint " + (dir / "one").string() + " --adapter --dtype f32 --output " + (dir / "peft").string());
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_EQ(adapter(dir / "peft"), adapter(dir / "one/final"));
  const LatheRun m = cli("export --checkpoint " + (dir / "peft").string() + " --merge --dtype f32 --output " + (dir / "merged").string());
  ASSERT_EQ(m.exit_code, 0) << m.output;
  const LatheRun plain = cli("export --checkpoint " + (dir / "one").string() + " --output " + (dir / "x").string());
  EXPECT_NE(plain.exit_code, 0);
  EXPECT_NE(plain.output.find("--adapter"), std::string::npos) << plain.output;

  std::ofstream(dir / "in.jsonl") << "{\"tokens\": [5, 9, 12, 40, 7, 3, 22]}\n{\"tokens\": [1, 2, 3]}\n";
  auto score = [&](const std::string& args, const std::string& out) {
    const LatheRun r = cli("logprobs " + args + " --input " + (dir / "in.jsonl").string() + " --output " + (dir / out).string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::vector<double> v;
    std::ifstream f(dir / out);
    std::string line;
    while (std::getline(f, line)) {
      const nlohmann::json row = nlohmann::json::parse(line);
      for (double x : row["logprobs"]) v.push_back(x);
    }
    return v;
  };
  const std::vector<double> with_adapter = score("--model " + (dir / "base/final").string() + " --adapter " + (dir / "peft").string(), "lp_adapter.jsonl");
  const std::vector<double> merged = score("--model " + (dir / "merged").string(), "lp_merged.jsonl");
  const std::vector<double> base = score("--model " + (dir / "base/final").string(), "lp_base.jsonl");
  ASSERT_EQ(with_adapter.size(), 8u);
  ASSERT_EQ(merged.size(), with_adapter.size());
  double diff = 0, moved = 0;
  for (size_t i = 0; i < merged.size(); ++i) {
    diff = std::max(diff, std::abs(merged[i] - with_adapter[i]));
    moved = std::max(moved, std::abs(base[i] - with_adapter[i]));
  }
  EXPECT_LT(diff, 1e-4) << "merged model and base + adapter disagree";
  EXPECT_GT(moved, 1e-3) << "the adapter changed nothing";
  // lora.init continues from a PEFT adapter: with a vanishing learning rate the result is that adapter.
  const LatheRun cont = cli("train " + (dir / "one.yaml").string() + " --set lora.init=" + (dir / "peft").string() +
                            " --set output_dir=" + (dir / "cont").string() + " --set train.lr=1e-12 --set train.max_steps=2");
  ASSERT_EQ(cont.exit_code, 0) << cont.output;
  EXPECT_LT(worst_rel_diff(adapter(dir / "cont/final"), adapter(dir / "peft")), 1e-6);
  const LatheRun wrong = cli("train " + (dir / "one.yaml").string() + " --set lora.init=" + (dir / "peft").string() +
                             " --set output_dir=" + (dir / "wrong").string() + " --set lora.rank=8");
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.output.find("r=4"), std::string::npos) << wrong.output;
  // Generation with --adapter (merged into the weights at load) equals generation with the merged export.
  const std::string gen = " --prompt-tokens 5,9,12 --max-new-tokens 6 --print-tokens --ignore-eos --no-chat-template";
  const LatheRun g1 = cli("generate --model " + (dir / "base/final").string() + " --adapter " + (dir / "peft").string() + gen);
  const LatheRun g2 = cli("generate --model " + (dir / "merged").string() + gen);
  ASSERT_EQ(g1.exit_code, 0) << g1.output;
  ASSERT_EQ(g2.exit_code, 0) << g2.output;
  EXPECT_EQ(g1.output.substr(g1.output.find('{')), g2.output.substr(g2.output.find('{')));
  // A missing or mismatched adapter is refused.
  EXPECT_NE(cli("logprobs --model " + (dir / "base/final").string() + " --adapter " + (dir / "nope").string() +
                  " --input " + (dir / "in.jsonl").string() + " --output " + (dir / "z.jsonl").string()).exit_code, 0);
}
