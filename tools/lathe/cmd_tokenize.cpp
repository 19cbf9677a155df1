// `lathe tokenize --tokenizer DIR --input IN.jsonl --output OUT.jsonl`: an input line {"text": "..."}
// gives {"ids": [...]} (no special tokens added); {"messages": [...], "add_generation_prompt": bool}
// gives {"text": rendered, "ids": [...]} (DIR's chat template with --chat-template-kwargs, alias --template-kwargs;
// a row's optional "tools" and "chat_template_kwargs" are passed to it too). Output line k answers non-blank input line
// k; errors name FILE:LINE. The output goes through OutputFile: a file appears only when every line succeeded (the old
// one stays otherwise, and no temporary), "-", /dev/stdout or a pipe are streamed.
// The work is data::tokenize_jsonl, covered by tests/data/test_dataset.cpp (Tokenize* tests) and
// tests/e2e/test_cli_outputs.cpp (Tokenize* tests: outputs and options).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "commands.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/tokenizer_files.h"

namespace lathe::cli {

void add_tokenize_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("tokenize", "Tokenize JSONL text or chat rows with a model's tokenizer");
  struct Args {
    std::string tokenizer, input, output, template_kwargs = "{}";
    int threads = 0;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--tokenizer", args->tokenizer, "model folder with tokenizer.json (and tokenizer_config.json)")
      ->required();
  cmd->add_option("--input", args->input,
                  "JSONL: {\"text\": ...} or {\"messages\": [...], \"add_generation_prompt\": bool} per line")
      ->required();
  cmd->add_option("--output", args->output, "JSONL: {\"ids\": [...]} or {\"text\": ..., \"ids\": [...]} per line")
      ->required();
  cmd->add_option("--chat-template-kwargs,--template-kwargs", args->template_kwargs,
                  "JSON object passed to the chat template, e.g. {\"enable_thinking\": false}")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "encoding threads (0 = all cores)")
      ->capture_default_str()
      ->check(number_in(0));
  cmd->callback([args, &exit_code] {
    const nlohmann::ordered_json kwargs =
        data::parse_chat_template_kwargs(args->template_kwargs, "tokenize: --chat-template-kwargs");
    check_folder(args->tokenizer, "--tokenizer", "tokenize");
    const data::Tokenizer tok = data::Tokenizer::from_dir(args->tokenizer);
    const std::optional<ChatTemplate> chat = data::load_chat_template(args->tokenizer);
    const int64_t rows =
        data::tokenize_jsonl(args->input, args->output, tok, chat ? &*chat : nullptr, kwargs, args->threads);
    fmt::print(stderr, "tokenize: {} rows of {} -> {}\n", rows, args->input, args->output);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
