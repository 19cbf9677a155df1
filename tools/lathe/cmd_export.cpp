// `lathe export --checkpoint SRC --output DIR [--adapter | --merge] [--model BASE] [--dtype f32|bf16|f16]`
//   SRC is a checkpoint (…/checkpoints/step-N), a run's or tenant's output_dir (its newest complete checkpoint is
//   taken), or, with --adapter/--merge, a PEFT adapter folder.
//   - full fine-tuning checkpoint: writes a Hugging Face folder (config.json, safetensors, tokenizer files);
//   - --adapter: writes the LoRA adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors);
//   - --merge: adds the adapter into the base weights (W + scaling B A) and writes the merged Hugging Face folder.
//   The base is the one the run trained on (trainer_state.json, or the adapter's base_model_name_or_path) unless
//   --model names it. The output folder appears only once complete.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "model/lora.h"
#include "model/causal_lm.h"
#include "train/trainer.h"

namespace lathe::cli {

namespace fs = std::filesystem;

namespace {

struct Args {
  std::string checkpoint, output, model, dtype = "bf16";
  bool adapter = false, merge = false;
};

int copy_tokenizer_files(const std::string& from, const fs::path& to) {
  int copied = 0;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}) {
    if (!from.empty() && fs::exists(fs::path(from) / name)) {
      fs::copy_file(fs::path(from) / name, to / name, fs::copy_options::overwrite_existing);
      ++copied;
    }
  }
  return copied;
}

void run(const Args& a) {
  LATHE_CHECK(!(a.adapter && a.merge), "export: give at most one of --adapter and --merge");
  const DType dtype = dtype_from_name(a.dtype);
  fs::path src = a.checkpoint;
  nlohmann::json state = nlohmann::json::object();
  fs::path peft_dir;  // set for LoRA sources
  std::string base = a.model;
  if (fs::exists(src / "adapter_config.json")) {
    LATHE_CHECK(a.adapter || a.merge, "export: {} is a PEFT adapter folder: use --adapter or --merge", src.string());
    peft_dir = src;
    if (base.empty()) {
      std::ifstream f(src / "adapter_config.json");
      base = nlohmann::json::parse(f).value("base_model_name_or_path", std::string());
    }
  } else {
    if (!fs::exists(src / "trainer_state.json")) {
      const std::string latest = latest_checkpoint(a.checkpoint);
      LATHE_CHECK(!latest.empty(), "export: {} is neither a checkpoint, an output folder with one, nor a PEFT adapter folder",
                  a.checkpoint);
      src = latest;
    }
    std::ifstream f(src / "trainer_state.json");
    state = nlohmann::json::parse(f);
    if (fs::exists(src / "adapter")) {
      LATHE_CHECK(a.adapter || a.merge, "export: {} is a LoRA checkpoint: use --adapter (PEFT folder) or --merge (merged model)",
                  src.string());
      peft_dir = src / "adapter";
      if (base.empty()) base = state.value("base_model", std::string());
    } else {
      LATHE_CHECK(!a.adapter && !a.merge, "export: {} is a full fine-tuning checkpoint: it has no adapter", src.string());
    }
  }
  Runtime rt;
  std::string tokenizer = state.value("tokenizer", std::string());
  if (peft_dir.empty()) {
    load_causal_lm(rt, (src / "model").string(), {})->save(a.output, dtype);
  } else {
    LATHE_CHECK(!base.empty() && fs::exists(fs::path(base) / "config.json"),
                "export: the adapter's base model folder '{}' is not available: name it with --model", base);
    if (tokenizer.empty()) tokenizer = base;
    const ModelConfig config = load_model_config(base);
    if (a.adapter) {
      LoraBank bank(rt, config, Device::cpu(), DType::F32, {read_lora_config(peft_dir.string())});
      bank.load_peft(0, peft_dir.string());
      bank.save_peft(0, a.output, dtype, fs::absolute(base).string());
    } else {
      ModelOptions mo;
      mo.train_base = false;
      const std::unique_ptr<CausalLm> m = load_causal_lm(rt, base, mo);
      LoraBank bank(rt, config, Device::cpu(), DType::F32, {read_lora_config(peft_dir.string())});
      bank.load_peft(0, peft_dir.string());
      merge_lora(*m, bank, 0);
      m->save(a.output, dtype);
    }
  }
  const int copied = copy_tokenizer_files(tokenizer, a.output);
  fmt::print("export: {}{} -> {} ({}{}), {} tokenizer files\n", src.string(),
             state.contains("step") ? fmt::format(" (step {})", state["step"].get<int64_t>()) : "", a.output,
             a.adapter ? "PEFT adapter" : a.merge ? "merged model" : "model", fmt::format(" as {}", a.dtype), copied);
}

}  // namespace

void add_export_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("export", "Write a Hugging Face model folder, a PEFT adapter, or a merged model from a checkpoint");
  auto args = std::make_shared<Args>();
  cmd->add_option("--checkpoint", args->checkpoint, "checkpoint folder, a run's output_dir, or a PEFT adapter folder")->required();
  cmd->add_option("--output", args->output, "folder to write")->required();
  cmd->add_flag("--adapter", args->adapter, "write the LoRA adapter as a PEFT folder");
  cmd->add_flag("--merge", args->merge, "merge the LoRA adapter into its base and write the merged model");
  cmd->add_option("--model", args->model, "base model folder of the adapter (default: the one it was trained on)");
  cmd->add_option("--dtype", args->dtype, "weight dtype: f32, bf16 or f16")->capture_default_str();
  cmd->callback([args, &exit_code] {
    run(*args);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
