// Loading chat templates from tokenizer configs and building the context transformers renders with.
// Convention: special tokens may be plain strings or AddedToken objects ({"content": ...}); like
// transformers' special_tokens_map, unset or empty ones are left out of the context entirely.
// Covered by tests/data/test_chat_template.cpp (ChatTemplate* tests).
#include "data/chat_template.h"

#include "core/error.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace lathe {
namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  LATHE_CHECK(in, "chat_template: cannot open {}", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The template text of a config's chat_template: a string, or a list of {"name", "template"}.
std::string select_template(const nlohmann::ordered_json& entry, const std::string& name) {
  if (entry.is_string()) {
    LATHE_CHECK(name.empty() || name == "default",
                "chat_template: the config has a single chat template, not one named '{}'", name);
    return entry.get<std::string>();
  }
  LATHE_CHECK(entry.is_array(), "chat_template: 'chat_template' must be a string or a list of named templates, not {}",
              entry.type_name());
  std::string wanted = name.empty() ? "default" : name;
  std::string available;
  for (const auto& item : entry) {
    LATHE_CHECK(item.is_object() && item.contains("name") && item.contains("template"),
                "chat_template: each named template needs 'name' and 'template'");
    if (item["name"] == wanted) return item["template"].get<std::string>();
    available += (available.empty() ? "" : ", ") + item["name"].get<std::string>();
  }
  LATHE_FAIL("chat_template: no chat template named '{}' (the config has: {})", wanted, available);
}

nlohmann::ordered_json special_tokens_of(const nlohmann::ordered_json& config) {
  static const char* const kTokens[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                        "pad_token", "cls_token", "mask_token"};
  auto token_text = [](const nlohmann::ordered_json& t) -> std::string {
    if (t.is_string()) return t.get<std::string>();
    if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
    return "";
  };
  nlohmann::ordered_json tokens = nlohmann::ordered_json::object();
  for (const char* key : kTokens) {
    if (!config.contains(key)) continue;
    std::string text = token_text(config[key]);
    if (!text.empty()) tokens[key] = text;
  }
  if (config.contains("additional_special_tokens") && config["additional_special_tokens"].is_array()) {
    nlohmann::ordered_json extra = nlohmann::ordered_json::array();
    for (const auto& t : config["additional_special_tokens"]) {
      std::string text = token_text(t);
      if (!text.empty()) extra.push_back(text);
    }
    if (!extra.empty()) tokens["additional_special_tokens"] = extra;
  }
  return tokens;
}

}  // namespace

ChatTemplate ChatTemplate::from_config(const nlohmann::ordered_json& config, const std::string& name) {
  LATHE_CHECK(config.is_object(), "chat_template: a tokenizer config must be a JSON object");
  LATHE_CHECK(config.contains("chat_template") && !config["chat_template"].is_null(),
              "chat_template: the tokenizer config has no 'chat_template'");
  return ChatTemplate(select_template(config["chat_template"], name), special_tokens_of(config));
}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path, const std::string& name) {
  nlohmann::ordered_json config;
  try {
    config = nlohmann::ordered_json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    LATHE_FAIL("chat_template: {} is not valid JSON: {}", path, e.what());
  }
  std::filesystem::path sibling = std::filesystem::path(path).parent_path() / "chat_template.jinja";
  try {
    if (std::filesystem::exists(sibling)) return ChatTemplate(read_file(sibling), special_tokens_of(config));
    return from_config(config, name);
  } catch (const Error& e) {
    std::string_view what = e.what();
    if (what.rfind("chat_template:", 0) == 0) throw;
    LATHE_FAIL("chat_template: in the template of {}: {}", path, what);
  }
}

ChatTemplate::ChatTemplate(std::string source, nlohmann::ordered_json special_tokens)
    : source_(std::move(source)), special_tokens_(std::move(special_tokens)), template_(source_) {
  LATHE_CHECK(special_tokens_.is_object(), "chat_template: special tokens must be a JSON object");
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                 const nlohmann::ordered_json& extra_context) const {
  LATHE_CHECK(messages.is_array(), "chat_template: messages must be a JSON array, not {}", messages.type_name());
  LATHE_CHECK(extra_context.is_object() || extra_context.is_null(),
              "chat_template: extra_context must be a JSON object, not {}", extra_context.type_name());
  nlohmann::ordered_json context = special_tokens_;
  if (extra_context.is_object()) {
    for (const auto& [key, value] : extra_context.items()) {
      LATHE_CHECK(key != "messages" && key != "add_generation_prompt",
                  "chat_template: '{}' is set by render() and cannot come from extra_context", key);
      context[key] = value;
    }
  }
  if (!context.contains("tools")) context["tools"] = nullptr;
  if (!context.contains("documents")) context["documents"] = nullptr;
  context["messages"] = messages;
  context["add_generation_prompt"] = add_generation_prompt;
  return template_.render(context);
}

std::string ChatTemplate::render(const nlohmann::json& messages, bool add_generation_prompt,
                                 const nlohmann::json& extra_context) const {
  return render(nlohmann::ordered_json(messages), add_generation_prompt, nlohmann::ordered_json(extra_context));
}

}  // namespace lathe
