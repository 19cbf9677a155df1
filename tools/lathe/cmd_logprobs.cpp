// `lathe logprobs --model DIR [--adapter PEFT_DIR] --input IN.jsonl --output OUT.jsonl [--device cpu|cuda]`: for each input line
// {"tokens": [...]}, writes {"logprobs": [...]} with n-1 entries, entry i = log p(tokens[i+1] | tokens[..i]).
// Lines are packed into batches of documents (no attention across them); output order is input order and
// the output file appears only when every line succeeded.
#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "commands.h"
#include "data/tokenizer.h"
#include "model/lora.h"
#include "model/causal_lm.h"

namespace lathe::cli {

namespace {

struct Args {
  std::string model, adapter, input, output, device = "cpu", dtype;
  int64_t batch_tokens = 8192;
};

// Lines are {"tokens": [...]} or, when the model folder has a tokenizer.json, {"text": "..."} (encoded without
// special tokens, as `lathe tokenize` does).
std::vector<std::vector<int32_t>> read_token_lines(const std::string& path, int64_t vocab, const std::string& model_dir) {
  std::optional<data::Tokenizer> tokenizer;
  std::ifstream in(path);
  LATHE_CHECK(in.good(), "logprobs: cannot open input {}", path);
  std::vector<std::vector<int32_t>> lines;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines carry no request
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      LATHE_FAIL("logprobs: {}:{}: invalid JSON: {}", path, n, e.what());
    }
    LATHE_CHECK(j.is_object(), "logprobs: {}:{}: expected an object", path, n);
    std::vector<int32_t> ids;
    if (j.contains("text")) {
      LATHE_CHECK(j["text"].is_string(), "logprobs: {}:{}: 'text' must be a string", path, n);
      if (!tokenizer) {
        LATHE_CHECK(std::filesystem::exists(model_dir + "/tokenizer.json"),
                    "logprobs: {}:{}: 'text' input needs {}/tokenizer.json; pass 'tokens' instead", path, n, model_dir);
        tokenizer.emplace(data::Tokenizer::from_dir(model_dir));
      }
      ids = tokenizer->encode(j["text"].get<std::string>());
      LATHE_CHECK(!ids.empty(), "logprobs: {}:{}: empty text", path, n);
      for (int32_t id : ids)
        LATHE_CHECK(id < vocab, "logprobs: {}:{}: token {} is outside the model's vocabulary (size {})", path, n, id, vocab);
      lines.push_back(std::move(ids));
      continue;
    }
    LATHE_CHECK(j.contains("tokens") && j["tokens"].is_array(), "logprobs: {}:{}: expected {{\"tokens\": [int, ...]}} or "
                "{{\"text\": ...}}", path, n);
    for (const auto& t : j["tokens"]) {
      LATHE_CHECK(t.is_number_integer(), "logprobs: {}:{}: token {} is not an integer", path, n, t.dump());
      const int64_t v = t.get<int64_t>();
      LATHE_CHECK(v >= 0 && v < vocab, "logprobs: {}:{}: token {} is outside the vocabulary (size {})", path, n, v, vocab);
      ids.push_back(int32_t(v));
    }
    LATHE_CHECK(!ids.empty(), "logprobs: {}:{}: empty token list", path, n);
    lines.push_back(std::move(ids));
  }
  return lines;
}

// Scores every line with `model` into a.output.
void score(Runtime& rt, const Args& a, const ModelOptions& options, CausalLm& model, const LoraBank* bank) {
  const std::vector<std::vector<int32_t>> lines = read_token_lines(a.input, model.config().vocab_size, a.model);

  const std::string tmp = a.output + fmt::format(".tmp-{}", getpid());
  std::ofstream out(tmp);
  LATHE_CHECK(out.good(), "logprobs: cannot write {}", tmp);
  for (size_t first = 0; first < lines.size();) {
    // Pack whole lines until the batch is full (a longer line gets a batch of its own).
    std::vector<int32_t> ids, cu = {0};
    size_t last = first;
    while (last < lines.size() && (last == first || int64_t(ids.size() + lines[last].size()) <= a.batch_tokens)) {
      ids.insert(ids.end(), lines[last].begin(), lines[last].end());
      cu.push_back(int32_t(ids.size()));
      ++last;
    }
    std::vector<int32_t> labels = next_token_labels(ids, cu);
    PackedBatch batch = make_packed_batch(rt, options.device, ids, cu, std::move(labels), model.config().vocab_size);
    if (bank) set_segments(batch, {{batch.tokens(), 0, 1.0, 0}});
    const std::vector<double> lp = model.label_logprobs(batch);
    for (size_t b = 0; b + 1 < cu.size(); ++b) {
      nlohmann::json row = nlohmann::json::array();
      for (int32_t i = cu[b]; i + 1 < cu[b + 1]; ++i) row.push_back(lp[size_t(i)]);
      out << nlohmann::json{{"logprobs", row}}.dump() << "\n";
    }
    first = last;
  }
  out.close();
  LATHE_CHECK(out.good(), "logprobs: writing {} failed", tmp);
  std::filesystem::rename(tmp, a.output);
  fmt::print(stderr, "logprobs: {} lines scored with {}{} on {} ({})\n", lines.size(), a.model,
             a.adapter.empty() ? "" : " + adapter " + a.adapter, options.device.str(), dtype_name(options.dtype));
}

void run(const Args& a) {
  Runtime rt;
  ModelOptions options;
  options.device = parse_device(a.device);
  options.dtype = !a.dtype.empty() ? dtype_from_name(a.dtype) : options.device.is_cpu() ? DType::F32 : DType::BF16;
  options.train_base = false;
  const std::unique_ptr<CausalLm> model = load_causal_lm(rt, a.model, options);
  // An adapter is applied unmerged, through the same LoRA path as training.
  std::unique_ptr<LoraBank> bank;
  if (!a.adapter.empty()) {
    bank = std::make_unique<LoraBank>(rt, model->config(), options.device, options.dtype,
                                      std::vector<LoraConfig>{read_lora_config(a.adapter)});
    bank->load_peft(0, a.adapter);
    model->attach_lora(bank.get());
  }
  score(rt, a, options, *model, bank.get());
}

}  // namespace

void add_logprobs_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("logprobs", "Score token sequences: log p(token i+1 | tokens up to i)");
  auto args = std::make_shared<Args>();
  cmd->add_option("--model", args->model, "Hugging Face model folder")->required();
  cmd->add_option("--adapter", args->adapter, "PEFT LoRA adapter folder applied to the model");
  cmd->add_option("--input", args->input, "JSONL, one {\"tokens\": [...]} per line")->required();
  cmd->add_option("--output", args->output, "JSONL, one {\"logprobs\": [...]} per input line")->required();
  cmd->add_option("--device", args->device, "cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "compute dtype (default f32 on cpu, bf16 on cuda)");
  cmd->add_option("--batch-tokens", args->batch_tokens, "tokens packed into one forward pass")->capture_default_str();
  cmd->callback([args, &exit_code] {
    run(*args);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
