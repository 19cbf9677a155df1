// `lathe convert --model DIR --output DIR [--dtype f32|bf16|f16] [--shard-size-mb N]`: loads a Hugging Face
// model folder, checks it completely, and writes it again in Hugging Face layout (config.json, safetensors
// shards with an index, the tokenizer files and chat_template_kwargs.json of the source), optionally in another dtype.
// Convention: the dtype defaults to the source's (config.json's "dtype"/"torch_dtype", else its tensors'), so a
// plain convert never widens or narrows weights; the output folder appears only once complete (OutputDir), and a
// failure leaves neither it nor a temporary. Covered by tests/e2e/test_cli_outputs.cpp.
#include <fmt/format.h>

#include "cli_support.h"
#include "commands.h"
#include "data/tokenizer_files.h"
#include "model/causal_lm.h"

namespace lathe::cli {

void add_convert_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("convert", "Load a Hugging Face model folder and write it back (dtype, shards)");
  struct Args {
    std::string model, output, dtype;
    uint64_t shard_mb = 5120;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--model", args->model, "Hugging Face model folder")->required();
  cmd->add_option("--output", args->output, "folder to write (appears only once complete)")->required();
  cmd->add_option("--dtype", args->dtype, "weight dtype to write: f32, bf16 or f16 (default: the source's dtype, from "
                  "its config.json's dtype or torch_dtype, else its tensors)");
  cmd->add_option("--shard-size-mb", args->shard_mb, "largest shard, MiB")
      ->capture_default_str()
      ->check(number_in(1, double(uint64_t(1) << 40)));
  cmd->callback([args, &exit_code] {
    check_folder(args->model, "--model", "convert");
    const DType dtype = args->dtype.empty() ? model_folder_dtype(args->model) : dtype_from_name(args->dtype);
    Runtime rt;
    const std::unique_ptr<CausalLm> m = load_causal_lm(rt, args->model, {});
    int copied = 0;
    m->save(args->output, dtype, args->shard_mb << 20,
            [&](const std::string& tmp) { copied = data::copy_tokenizer_files(args->model, tmp); });
    fmt::print("convert: {} ({} parameters) -> {} as {}{}, {} tokenizer files\n", args->model,
               m->config().parameter_count(), args->output, dtype_name(dtype),
               args->dtype.empty() ? " (the source's dtype)" : "", copied);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
