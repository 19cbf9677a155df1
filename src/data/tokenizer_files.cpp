#include "data/tokenizer_files.h"

#include <filesystem>

#include "core/error.h"
#include "core/files.h"

namespace lathe::data {

namespace fs = std::filesystem;

int copy_tokenizer_files(const std::string& from, const std::string& to) {
  if (from.empty()) return 0;
  int copied = 0;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                           "vocab.json", "merges.txt", "special_tokens_map.json", kChatTemplateKwargsFile}) {
    const fs::path src = fs::path(from) / name;
    if (!fs::is_regular_file(src)) continue;
    std::error_code ec;
    fs::copy_file(src, fs::path(to) / name, fs::copy_options::overwrite_existing, ec);
    LATHE_CHECK(!ec, "tokenizer: cannot copy {} to {}: {}", src.string(), to, ec.message());
    ++copied;
  }
  return copied;
}

nlohmann::ordered_json parse_chat_template_kwargs(const std::string& text, const std::string& who) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text, nullptr, false);
  LATHE_CHECK(!j.is_discarded() && j.is_object(), "{}: expected a JSON object such as {{\"enable_thinking\": false}}, got '{}'",
              who, text);
  return j;
}

std::optional<nlohmann::ordered_json> read_chat_template_kwargs(const std::string& dir) {
  const fs::path path = fs::path(dir) / kChatTemplateKwargsFile;
  if (!fs::exists(path)) return std::nullopt;
  return parse_chat_template_kwargs(read_text_file(path.string(), "chat template"), path.string());
}

void write_chat_template_kwargs(const std::string& dir, const nlohmann::ordered_json& kwargs) {
  write_file_atomic((fs::path(dir) / kChatTemplateKwargsFile).string(), kwargs.dump(2) + "\n", "chat template");
}

}  // namespace lathe::data
