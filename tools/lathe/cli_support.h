// What several lathe subcommands share: range checks for their numeric options, the JSONL row reader, the dtype a source folder's weights are stored in (the default of export and
// convert), and where the chat-template settings of generate and logprobs come from.
// Convention: the chat-template settings are --chat-template-kwargs when given, else the first
// chat_template_kwargs.json found in the folders passed (adapter, model, tokenizer, in that order), else {}; the
// choice is printed on one stderr line. Covered by tests/e2e/test_cli_outputs.cpp.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/device.h"
#include "core/files.h"  // check_folder, which the subcommands use for --model, --adapter, --tokenizer

namespace lathe {
class Communicator;
class Runtime;
}  // namespace lathe

namespace lathe::cli {

// CLI11 checks of numeric options, run before any work: a number in [min, max] ("--top-k: must be >= 0, not -1"),
// and one in (0, 1] (--top-p).
CLI::Validator number_in(double min, double max = std::numeric_limits<double>::infinity());
CLI::Validator in_unit_interval();

// Calls `row` with each non-blank line of the JSONL file `path`, parsed, and its line number; invalid JSON is an
// error naming FILE:LINE, and so is any lathe::Error `row` throws (its message gets the FILE:LINE prefix).
void for_each_jsonl_row(const std::string& path, const std::string& who,
                        const std::function<void(const nlohmann::ordered_json& row, int64_t line)>& row);

// The dtype a model folder's weights are stored in: config.json's "dtype" or "torch_dtype" (float32, bfloat16,
// float16), else the floating dtype that holds most of its safetensors elements. f64 weights give f32 (the widest a
// save writes).
DType model_folder_dtype(const std::string& dir);
// The dtype of a PEFT adapter folder's adapter_model.safetensors (the floating dtype holding most elements).
DType adapter_folder_dtype(const std::string& dir);

struct ChatTemplateKwargs {
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
  std::string source;  // "--chat-template-kwargs", a chat_template_kwargs.json path, or "default"
};

// The chat-template settings to render with: `option_text` when `given`, else the first chat_template_kwargs.json
// of `dirs` (empty entries are skipped), else {}. Prints "WHO: chat template kwargs {...} (from SOURCE)" to stderr.
ChatTemplateKwargs resolve_chat_template_kwargs(bool given, const std::string& option_text,
                                                const std::vector<std::string>& dirs, const std::string& who);

// Every rank's output lines on rank 0, in rank order (rank r's lines in its own order); empty on the other ranks
// (`lathe logprobs` and `lathe generate --input` under mpirun, srun or --nproc). The bytes travel as one u8 tensor per
// rank through an uneven all-to-all on the world's data plane.
std::vector<std::vector<std::string>> gather_lines(Runtime& rt, Communicator& world, Device device,
                                                   const std::vector<std::string>& mine);

}  // namespace lathe::cli
