// `lathe convert --model DIR --output DIR [--dtype f32|bf16|f16] [--shard-size-mb N]`: loads a Hugging Face
// model folder, checks it completely, and writes it again in Hugging Face layout (config.json, safetensors
// shards with an index), optionally in another dtype. The output folder appears only once complete.
#include <fmt/format.h>

#include "commands.h"
#include "model/causal_lm.h"

namespace lathe::cli {

void add_convert_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("convert", "Load a Hugging Face model folder and write it back (dtype, shards)");
  struct Args {
    std::string model, output, dtype = "f32";
    uint64_t shard_mb = 5120;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--model", args->model, "Hugging Face model folder")->required();
  cmd->add_option("--output", args->output, "folder to write")->required();
  cmd->add_option("--dtype", args->dtype, "weight dtype to write: f32, bf16 or f16")->capture_default_str();
  cmd->add_option("--shard-size-mb", args->shard_mb, "largest shard, MiB")->capture_default_str();
  cmd->callback([args, &exit_code] {
    Runtime rt;
    const std::unique_ptr<CausalLm> m = load_causal_lm(rt, args->model, {});
    m->save(args->output, dtype_from_name(args->dtype), args->shard_mb << 20);
    fmt::print("convert: {} ({} parameters) -> {} as {}\n", args->model, m->config().parameter_count(), args->output,
               args->dtype);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
