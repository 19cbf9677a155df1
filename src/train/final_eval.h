// The end-of-training check: for each held-out row {"messages": [...] | "prompt": "...", "answer": "..."},
// render the prompt (chat template with the generation prompt, thinking off), generate greedily, and
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

FinalEvalResult run_final_eval(Runtime& rt, CausalLm& model, const data::Tokenizer& tokenizer, const ChatTemplate* chat,
                               const std::string& path, int64_t max_new_tokens,
                               const std::function<void(const std::string&)>& log);

}  // namespace lathe
