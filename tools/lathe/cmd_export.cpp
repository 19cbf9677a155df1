// `lathe export --checkpoint DIR --output DIR [--dtype f32|bf16|f16]`: writes a Hugging Face folder (config.json,
// safetensors, tokenizer files) from a training checkpoint. DIR may be a checkpoint (…/checkpoints/step-N) or a
// run's output_dir (its newest complete checkpoint is taken). The output folder appears only once complete.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "model/qwen3.h"
#include "train/trainer.h"

namespace lathe::cli {

namespace fs = std::filesystem;

void add_export_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("export", "Write a Hugging Face model folder from a training checkpoint");
  struct Args {
    std::string checkpoint, output, dtype = "bf16";
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--checkpoint", args->checkpoint, "checkpoint folder, or a run's output_dir")->required();
  cmd->add_option("--output", args->output, "folder to write")->required();
  cmd->add_option("--dtype", args->dtype, "weight dtype: f32, bf16 or f16")->capture_default_str();
  cmd->callback([args, &exit_code] {
    fs::path ckpt = args->checkpoint;
    if (!fs::exists(ckpt / "trainer_state.json")) {
      const std::string latest = latest_checkpoint(args->checkpoint);
      LATHE_CHECK(!latest.empty(), "export: {} is neither a checkpoint nor an output folder with one", args->checkpoint);
      ckpt = latest;
    }
    std::ifstream f(ckpt / "trainer_state.json");
    const nlohmann::json state = nlohmann::json::parse(f);
    Runtime rt;
    const Qwen3Model m = Qwen3Model::load(rt, (ckpt / "model").string(), {});
    m.save(args->output, dtype_from_name(args->dtype));
    const std::string tok = state.value("tokenizer", std::string());
    int copied = 0;
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}) {
      if (!tok.empty() && fs::exists(fs::path(tok) / name)) {
        fs::copy_file(fs::path(tok) / name, fs::path(args->output) / name, fs::copy_options::overwrite_existing);
        ++copied;
      }
    }
    fmt::print("export: {} (step {}) -> {} as {}, {} tokenizer files\n", ckpt.string(), state.value("step", 0),
               args->output, args->dtype, copied);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
