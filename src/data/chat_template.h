// Hugging Face chat templates: load a tokenizer's template and render conversations to text.
// Convention: the render context is what transformers' apply_chat_template passes: the tokenizer's
// special tokens (bos_token, eos_token, ...), then extra_context on top (enable_thinking, tools,
// ...), with tools and documents defined as none unless given, then messages and
// add_generation_prompt. Pass nlohmann::ordered_json where tojson output matters (tool schemas):
// plain nlohmann::json sorts object keys, which changes the rendered text.
// Covered by tests/data/test_chat_template.cpp.
#pragma once

#include "data/jinja.h"

#include <nlohmann/json.hpp>

#include <string>

namespace lathe {

class ChatTemplate {
 public:
  // Reads a tokenizer_config.json. A chat_template.jinja file beside it takes precedence over the
  // config's chat_template, as in transformers. When the config holds a list of named templates,
  // `name` picks one ("default" when empty).
  static ChatTemplate from_tokenizer_config(const std::string& path, const std::string& name = "");

  // From a parsed tokenizer_config.json; `name` as above.
  static ChatTemplate from_config(const nlohmann::ordered_json& config, const std::string& name = "");

  // A template source and the special tokens it sees, e.g. {"eos_token": "<|im_end|>"}.
  explicit ChatTemplate(std::string source,
                        nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object());

  // Renders a conversation (a JSON array of messages). Throws lathe::Error on template errors,
  // including the template's own raise_exception().
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::ordered_json& extra_context = nlohmann::ordered_json::object()) const;
  std::string render(const nlohmann::json& messages, bool add_generation_prompt,
                     const nlohmann::json& extra_context = nlohmann::json::object()) const;

  const std::string& source() const { return source_; }
  const nlohmann::ordered_json& special_tokens() const { return special_tokens_; }

 private:
  std::string source_;
  nlohmann::ordered_json special_tokens_;
  jinja::Template template_;
};

}  // namespace lathe
