// The end-of-training check: for each held-out row {"messages": [...] | "prompt": "...", "answer": "..."},
// render the prompt (chat template with the generation prompt, thinking off), generate greedily, and
// count the completions whose trimmed text equals the answer. Used by the demo to show what was learned.
// Generation exists for Qwen3 only for now (model/generate.h takes Qwen3Model); for another family the check is
// refused with a clear error (check_final_eval_supported, called by the trainer before step 1).
// Covered by tests/e2e/test_train.cpp.
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

// Throws, naming the reason, when the model's family cannot run the generation-based final eval.
void check_final_eval_supported(const CausalLm& model);

FinalEvalResult run_final_eval(Runtime& rt, CausalLm& model, const data::Tokenizer& tokenizer, const ChatTemplate* chat,
                               const std::string& path, int64_t max_new_tokens,
                               const std::function<void(const std::string&)>& log);

}  // namespace lathe
