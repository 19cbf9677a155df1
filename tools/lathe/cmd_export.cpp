// `lathe export --checkpoint SRC --output DIR [--adapter | --merge] [--model BASE] [--dtype f32|bf16|f16]`
//   SRC is a checkpoint (…/checkpoints/step-N), a run's or tenant's output_dir (its newest complete checkpoint is
//   taken), or, with --adapter/--merge, a PEFT adapter folder.
//   - full fine-tuning checkpoint: writes a Hugging Face folder (config.json, safetensors, tokenizer files);
//   - --adapter: writes the LoRA adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors);
//   - --merge: adds the adapter into the base weights (W + scaling B A) and writes the merged Hugging Face folder.
//   The base is the one the run trained on (trainer_state.json, or the adapter's base_model_name_or_path) unless
//   --model names it.
// Convention: the dtype defaults to the source's: the checkpoint's model/config.json (or its tensors), the adapter's
// tensors with --adapter, the base model's with --merge. The tokenizer files and the checkpoint's
// chat_template_kwargs.json (the chat-template settings training used) are written into the folder before it
// appears (OutputDir through save()'s add_files hook), so it appears complete or not at all.
// Covered by tests/e2e/test_cli_outputs.cpp (Export* tests) and tests/e2e/test_train.cpp.
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "commands.h"
#include "core/error.h"
#include "core/files.h"
#include "data/tokenizer_files.h"
#include "model/lora.h"
#include "model/causal_lm.h"
#include "train/trainer.h"

namespace lathe::cli {

namespace fs = std::filesystem;

namespace {

struct Args {
  std::string checkpoint, output, model, dtype;
  bool adapter = false, merge = false;
};

nlohmann::json read_json_file(const fs::path& path) {
  nlohmann::json j = nlohmann::json::parse(read_text_file(path.string(), "export"), nullptr, false);
  LATHE_CHECK(!j.is_discarded() && j.is_object(), "export: {} is not a JSON object", path.string());
  return j;
}

void run(const Args& a) {
  LATHE_CHECK(!(a.adapter && a.merge), "export: give at most one of --adapter and --merge");
  check_folder(a.checkpoint, "--checkpoint", "export");
  if (!a.model.empty()) check_folder(a.model, "--model", "export");
  fs::path src = a.checkpoint;
  nlohmann::json state = nlohmann::json::object();
  fs::path peft_dir;  // set for LoRA sources
  std::string base = a.model;
  if (fs::exists(src / "adapter_config.json")) {
    LATHE_CHECK(a.adapter || a.merge, "export: {} is a PEFT adapter folder: use --adapter or --merge", src.string());
    peft_dir = src;
    if (base.empty()) base = read_json_file(src / "adapter_config.json").value("base_model_name_or_path", std::string());
  } else {
    if (!fs::exists(src / "trainer_state.json")) {
      const std::string latest = latest_checkpoint(a.checkpoint);
      LATHE_CHECK(!latest.empty(), "export: {} is neither a checkpoint, an output folder with one, nor a PEFT adapter folder",
                  a.checkpoint);
      src = latest;
    }
    state = read_json_file(src / "trainer_state.json");
    if (fs::exists(src / "adapter")) {
      LATHE_CHECK(a.adapter || a.merge, "export: {} is a LoRA checkpoint: use --adapter (PEFT folder) or --merge (merged model)",
                  src.string());
      peft_dir = src / "adapter";
      if (base.empty()) base = state.value("base_model", std::string());
    } else {
      LATHE_CHECK(!a.adapter && !a.merge, "export: {} is a full fine-tuning checkpoint: it has no adapter", src.string());
    }
  }
  // The folder whose weights are written (or, for an adapter, trained): its chat_template_kwargs.json goes along.
  const fs::path source_dir = peft_dir.empty() ? src / "model" : peft_dir;
  if (!peft_dir.empty())
    LATHE_CHECK(!base.empty() && fs::exists(fs::path(base) / "config.json"),
                "export: the adapter's base model folder '{}' is not available: name it with --model", base);
  const DType dtype = !a.dtype.empty() ? dtype_from_name(a.dtype)
                      : a.adapter          ? adapter_folder_dtype(peft_dir.string())
                      : a.merge            ? model_folder_dtype(base)
                                           : model_folder_dtype(source_dir.string());
  std::string tokenizer = state.value("tokenizer", std::string());
  if (tokenizer.empty()) tokenizer = base;
  int copied = 0;
  bool kwargs_copied = false;
  const auto add_files = [&](const std::string& tmp) {
    copied = data::copy_tokenizer_files(tokenizer, tmp);
    const fs::path kwargs = source_dir / data::kChatTemplateKwargsFile;
    if (!fs::is_regular_file(kwargs)) return;
    std::error_code ec;
    fs::copy_file(kwargs, fs::path(tmp) / data::kChatTemplateKwargsFile, fs::copy_options::overwrite_existing, ec);
    LATHE_CHECK(!ec, "export: cannot copy {} into {}: {}", kwargs.string(), a.output, ec.message());
    kwargs_copied = true;
  };

  Runtime rt;
  if (peft_dir.empty()) {
    load_causal_lm(rt, source_dir.string(), {})->save(a.output, dtype, 5ull << 30, add_files);
  } else {
    const ModelConfig config = load_model_config(base);
    LoraBank bank(rt, config, Device::cpu(), DType::F32, {read_lora_config(peft_dir.string())});
    bank.load_peft(0, peft_dir.string());
    if (a.adapter) {
      bank.save_peft(0, a.output, dtype, fs::absolute(base).string(), add_files);
    } else {
      ModelOptions mo;
      mo.train_base = false;
      const std::unique_ptr<CausalLm> m = load_causal_lm(rt, base, mo);
      merge_lora(*m, bank, 0);
      m->save(a.output, dtype, 5ull << 30, add_files);
    }
  }
  fmt::print("export: {}{} -> {} ({} as {}{}), {} tokenizer files{}\n", src.string(),
             state.contains("step") ? fmt::format(" (step {})", state["step"].get<int64_t>()) : "", a.output,
             a.adapter ? "PEFT adapter" : a.merge ? "merged model" : "model", dtype_name(dtype),
             a.dtype.empty() ? ", the source's dtype" : "", copied,
             kwargs_copied ? " and the checkpoint's chat_template_kwargs.json" : "");
}

}  // namespace

void add_export_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("export", "Write a Hugging Face model folder, a PEFT adapter, or a merged model from a checkpoint");
  auto args = std::make_shared<Args>();
  cmd->add_option("--checkpoint", args->checkpoint, "checkpoint folder, a run's output_dir, or a PEFT adapter folder")->required();
  cmd->add_option("--output", args->output, "folder to write (appears only once complete)")->required();
  cmd->add_flag("--adapter", args->adapter, "write the LoRA adapter as a PEFT folder");
  cmd->add_flag("--merge", args->merge, "merge the LoRA adapter into its base and write the merged model");
  cmd->add_option("--model", args->model, "base model folder of the adapter (default: the one it was trained on)");
  cmd->add_option("--dtype", args->dtype, "weight dtype: f32, bf16 or f16 (default: the source's dtype: the checkpoint's "
                  "model/config.json, the adapter's tensors with --adapter, the base model's with --merge)");
  cmd->callback([args, &exit_code] {
    run(*args);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
