// Jinja template interpreter for the subset Hugging Face chat templates use: parse once, render
// many times. docs/chat_templates.md lists what is supported and what is refused.
// Convention: contexts are nlohmann::ordered_json, because tojson prints object keys in insertion
// order as Python does; plain nlohmann::json would reorder them alphabetically.
// Covered by tests/data/test_chat_template.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <string_view>

namespace lathe::jinja {

// Lexer settings. The defaults are the ones transformers uses for chat templates.
struct Options {
  bool trim_blocks = true;             // drop the first newline after a block or comment tag
  bool lstrip_blocks = true;           // drop spaces and tabs before a block or comment tag on its line
  bool keep_trailing_newline = false;  // Jinja's default: one trailing newline of the source is dropped
};

struct Program;  // the parsed template; defined in jinja_internal.h

class Template {
 public:
  // Parses `source`. Throws lathe::Error naming the construct and its line and column.
  explicit Template(std::string_view source, const Options& options = {});

  // Renders with the top-level variables of `context` (a JSON object) over the built-in globals
  // (range, namespace, dict, raise_exception, strftime_now). Throws lathe::Error on a runtime error
  // (naming the line and column) and when the template calls raise_exception.
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace lathe::jinja
