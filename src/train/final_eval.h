// The end-of-training check: for each held-out row {"messages": [...] | "prompt": "...", "answer": "..."},
// render the prompt (chat template with the generation prompt, thinking off), generate greedily, and
// count the completions whose trimmed text equals the answer. Used by the demo to show what was learned.
// Covered by tests/e2e/test_train.cpp.
#pragma once

#include <functional>
#include <string>

#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "model/qwen3.h"

namespace lathe {

struct FinalEvalResult {
  int64_t correct = 0, total = 0;
  double accuracy = 0;
};

FinalEvalResult run_final_eval(Runtime& rt, Qwen3Model& model, const data::Tokenizer& tokenizer, const ChatTemplate* chat,
                               const std::string& path, int64_t max_new_tokens,
                               const std::function<void(const std::string&)>& log);

}  // namespace lathe
