#include "train/final_eval.h"

#include <fstream>

#include "model/generate.h"
#include "model/qwen3.h"

namespace lathe {

namespace {
std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  const size_t e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}
}  // namespace

FinalEvalResult run_final_eval(Runtime& rt, CausalLm& model, const data::Tokenizer& tokenizer, const ChatTemplate* chat,
                               const std::string& path, int64_t max_new_tokens,
                               const std::function<void(const std::string&)>& log) {
  std::ifstream in(path);
  LATHE_CHECK(in.good(), "final_eval: cannot open {}", path);
  Generator gen(rt, model, &tokenizer);
  GenerateOptions opt;
  opt.max_new_tokens = max_new_tokens;
  if (tokenizer.eos_id()) opt.eos_ids.push_back(*tokenizer.eos_id());
  if (auto im_end = tokenizer.token_to_id("<|im_end|>")) opt.eos_ids.push_back(*im_end);
  FinalEvalResult r;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::ordered_json row;
    try {
      row = nlohmann::ordered_json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      LATHE_FAIL("final_eval: {}:{}: invalid JSON: {}", path, n, e.what());
    }
    LATHE_CHECK(row.is_object() && row.contains("answer") && row["answer"].is_string() &&
                    (row.contains("messages") || (row.contains("prompt") && row["prompt"].is_string())),
                "final_eval: {}:{}: expected {{\"messages\": [...] or \"prompt\": \"...\", \"answer\": \"...\"}}", path, n);
    std::string prompt;
    if (row.contains("messages")) {
      LATHE_CHECK(chat != nullptr, "final_eval: {}:{}: 'messages' need a chat template in the tokenizer folder", path, n);
      prompt = chat->render(row["messages"], true, nlohmann::ordered_json{{"enable_thinking", false}});
    } else {
      prompt = row["prompt"].get<std::string>();
    }
    const std::vector<int32_t> ids = tokenizer.encode(prompt);
    const GenerateResult g = gen.generate(ids, opt);
    const bool ok = trim(g.text) == trim(row["answer"].get<std::string>());
    r.correct += ok;
    r.total++;
    if (r.total <= 5 && log)
      log(fmt::format("  {} -> {:?} (expected {}) {}", row.contains("messages") ? row["messages"].back().value("content", std::string()) : prompt,
                      trim(g.text), row["answer"].get<std::string>(), ok ? "ok" : "wrong"));
  }
  r.accuracy = r.total ? double(r.correct) / double(r.total) : 0.0;
  if (log) log(fmt::format("final eval: {}/{} correct ({:.1f}%) on {}", r.correct, r.total, 100.0 * r.accuracy, path));
  return r;
}

}  // namespace lathe
