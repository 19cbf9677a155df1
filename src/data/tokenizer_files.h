// The files beside the weights that make a model folder usable on its own: the tokenizer's files (copied from the
// folder training read them from) and the chat-template settings a run trained with.
// chat_template_kwargs.json holds the extra variables the chat template was rendered with in training (for Qwen3,
// {"enable_thinking": false}); `lathe generate`, `lathe logprobs` and the final evaluation render with them unless
// told otherwise (docs/chat_templates.md). Covered by tests/e2e/test_train.cpp and tests/e2e/test_cli_outputs.cpp.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace lathe::data {

inline constexpr const char* kChatTemplateKwargsFile = "chat_template_kwargs.json";

// tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json, vocab.json, merges.txt,
// special_tokens_map.json and chat_template_kwargs.json: each that exists in `from` is copied into `to`. Returns the
// number copied.
int copy_tokenizer_files(const std::string& from, const std::string& to);

// DIR/chat_template_kwargs.json, or nothing when the folder has none; an error names a file that is not a JSON object.
std::optional<nlohmann::ordered_json> read_chat_template_kwargs(const std::string& dir);
void write_chat_template_kwargs(const std::string& dir, const nlohmann::ordered_json& kwargs);

// A --chat-template-kwargs argument: a JSON object (an error names the option and what is wrong).
nlohmann::ordered_json parse_chat_template_kwargs(const std::string& text, const std::string& who);

}  // namespace lathe::data
