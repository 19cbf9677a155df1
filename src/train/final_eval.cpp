#include "train/final_eval.h"

#include <sstream>

#include "core/files.h"

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

std::vector<FinalEvalRow> read_final_eval(const std::string& path, const ChatTemplate* chat,
                                          const nlohmann::ordered_json& kwargs) {
  std::istringstream in(read_text_file(path, "final_eval.file"));
  std::vector<FinalEvalRow> rows;
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
                    ((row.contains("messages") && row["messages"].is_array() && !row["messages"].empty()) ||
                     (row.contains("prompt") && row["prompt"].is_string())),
                "final_eval: {}:{}: expected {{\"messages\": [...] or \"prompt\": \"...\", \"answer\": \"...\"}}", path, n);
    FinalEvalRow r;
    r.answer = row["answer"].get<std::string>();
    if (row.contains("messages")) {
      LATHE_CHECK(chat != nullptr, "final_eval: {}:{}: 'messages' need a chat template in the tokenizer folder", path, n);
      try {
        r.prompt = chat->render(row["messages"], true, kwargs);
      } catch (const Error& e) {
        LATHE_FAIL("final_eval: {}:{}: {}", path, n, e.what());
      }
      const auto& last = row["messages"].back();
      r.shown = last.is_object() && last.contains("content") && last["content"].is_string() ? last["content"].get<std::string>() : "";
    } else {
      r.prompt = r.shown = row["prompt"].get<std::string>();
    }
    rows.push_back(std::move(r));
  }
  LATHE_CHECK(!rows.empty(), "final_eval: {} has no rows", path);
  return rows;
}

FinalEvalResult run_final_eval(Runtime& rt, CausalLm& model, const data::Tokenizer& tokenizer,
                               const std::vector<FinalEvalRow>& rows, const std::string& path, int64_t max_new_tokens,
                               const std::function<void(const std::string&)>& log) {
  Generator gen(rt, model, &tokenizer);
  GenerateOptions opt;
  opt.max_new_tokens = max_new_tokens;
  opt.eos_ids = tokenizer.end_of_turn_ids();
  FinalEvalResult r;
  for (const FinalEvalRow& row : rows) {
    const GenerateResult g = gen.generate(tokenizer.encode(row.prompt), opt);
    const bool ok = trim(g.text) == trim(row.answer);
    r.correct += ok;
    r.total++;
    if (r.total <= 5 && log)
      log(fmt::format("  {} -> {:?} (expected {}) {}", row.shown, trim(g.text), row.answer, ok ? "ok" : "wrong"));
  }
  r.accuracy = r.total ? double(r.correct) / double(r.total) : 0.0;
  if (log) log(fmt::format("final eval: {}/{} correct ({:.1f}%) on {}", r.correct, r.total, 100.0 * r.accuracy, path));
  return r;
}

}  // namespace lathe
