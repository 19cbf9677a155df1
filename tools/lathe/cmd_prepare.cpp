// `lathe prepare --tokenizer DIR --input IN.jsonl --output PREFIX`: tokenizes a JSONL dataset once into
// the memory-mapped prepared corpus PREFIX.{tokens,mask,index} (+ PREFIX.json: statistics and options)
// that training reads instead of the JSONL. Same row rules and options as training on JSONL directly;
// the statistics line accounts for every input line. Nothing is written unless the whole input succeeds: each file is
// written as FILE.tmp-PID and renamed at the end, and a failure removes every temporary (errors name the file).
// The work is data::prepare_corpus, covered by tests/data/test_packing.cpp (TokenFile* tests) and
// tests/e2e/test_cli_outputs.cpp (Prepare* tests).
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "commands.h"
#include "core/error.h"
#include "core/files.h"
#include "data/dataset.h"
#include "data/tokenizer_files.h"

namespace lathe::cli {

void add_prepare_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("prepare", "Tokenize a JSONL dataset into a memory-mapped prepared corpus");
  struct Args {
    std::string tokenizer, input, output, format = "auto", overlong = "truncate", template_kwargs = "{}";
    int64_t max_seq_len = 4096;
    bool skip_bad_rows = false, train_on_prompt = false, no_eos = false, text_eos = false;
    int threads = 0;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--tokenizer", args->tokenizer, "model folder with tokenizer.json (and tokenizer_config.json)")
      ->required();
  cmd->add_option("--input", args->input, "JSONL rows: text, messages, or prompt + completion")->required();
  cmd->add_option("--output", args->output, "output prefix: writes PREFIX.tokens, .mask, .index and .json")
      ->required();
  cmd->add_option("--format", args->format, "auto, text, messages or prompt_completion")->capture_default_str();
  cmd->add_option("--max-seq-len", args->max_seq_len, "tokens per sample (0 = no limit)")
      ->capture_default_str()
      ->check(number_in(0));
  cmd->add_option("--overlong", args->overlong, "over-long rows: truncate or drop")->capture_default_str();
  cmd->add_flag("--skip-bad-rows", args->skip_bad_rows, "skip (and count) malformed rows instead of failing");
  cmd->add_flag("--train-on-prompt", args->train_on_prompt, "loss on prompts and user turns too");
  cmd->add_flag("--no-eos", args->no_eos, "do not end prompt/completion rows with the EOS token");
  cmd->add_flag("--text-eos", args->text_eos, "end text rows with the EOS token");
  cmd->add_option("--chat-template-kwargs,--template-kwargs", args->template_kwargs,
                  "JSON object passed to the chat template, e.g. {\"enable_thinking\": false}")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "encoding threads (0 = all cores)")
      ->capture_default_str()
      ->check(number_in(0));
  cmd->callback([args, &exit_code] {
    data::DatasetOptions o;
    o.format = data::parse_row_format(args->format);
    o.max_seq_len = args->max_seq_len;
    o.overlong = data::parse_overlong_policy(args->overlong);
    o.skip_bad_rows = args->skip_bad_rows;
    o.train_on_prompt = args->train_on_prompt;
    o.append_eos = !args->no_eos;
    o.append_eos_to_text = args->text_eos;
    o.num_threads = args->threads;
    o.chat_template_kwargs = data::parse_chat_template_kwargs(args->template_kwargs, "prepare: --chat-template-kwargs");
    check_folder(args->tokenizer, "--tokenizer", "prepare");
    const data::Tokenizer tok = data::Tokenizer::from_dir(args->tokenizer);
    const std::optional<ChatTemplate> chat = data::load_chat_template(args->tokenizer);
    const data::RowEncoder encoder(tok, chat ? &*chat : nullptr, o);
    // Record which tokenizer made the ids (FNV-1a of tokenizer.json).
    const std::string bytes =
        read_text_file((std::filesystem::path(args->tokenizer) / "tokenizer.json").string(), "prepare");
    const data::TokenFileMeta meta{uint32_t(tok.vocab_size()), data::hash_bytes(bytes.data(), bytes.size())};
    const data::DatasetStats stats = data::prepare_corpus(args->input, args->output, encoder, meta);
    fmt::print(stderr, "prepare: {} -> {}.{{tokens,mask,index,json}}: {}\n", args->input, args->output,
               stats.summary());
    for (const std::string& e : stats.bad_row_errors) fmt::print(stderr, "prepare: skipped: {}\n", e);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
