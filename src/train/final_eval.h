// The end-of-training check: for each held-out row {"messages": [...] | "prompt": "...", "answer": "..."},
// render the prompt (chat template with the generation prompt and the run's chat_template_kwargs), generate greedily, and
// count the completions whose trimmed text equals the answer. Used by the demo to show what was learned.
// Generation runs through model/generate.h's Generator, which picks the family's decoder (Qwen3: KV cache; Qwen3.5:
// conv, recurrent and KV caches). Covered by tests/e2e/test_train.cpp and tests/e2e/test_train_qwen3_5.cpp.
#pragma once

#include <functional>
#include <string>

#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "model/causal_lm.h"

namespace lathe {

struct FinalEvalResult {
  int64_t correct = 0, total = 0;
  double accuracy = 0;
};

// One held-out question: the prompt text to generate from (rendered) and the expected answer.
struct FinalEvalRow {
  std::string prompt, answer;
  std::string shown;  // what the log shows of the question
};

// Reads and checks every row of `path` (the trainer does this before it writes anything): 'messages' rows are
// rendered with the chat template, its generation prompt and `kwargs` (the run's data.chat_template_kwargs).
std::vector<FinalEvalRow> read_final_eval(const std::string& path, const ChatTemplate* chat,
                                          const nlohmann::ordered_json& kwargs);

FinalEvalResult run_final_eval(Runtime& rt, CausalLm& model, const data::Tokenizer& tokenizer,
                               const std::vector<FinalEvalRow>& rows, const std::string& path, int64_t max_new_tokens,
                               const std::function<void(const std::string&)>& log);

}  // namespace lathe
