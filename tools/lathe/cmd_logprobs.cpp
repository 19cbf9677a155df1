// `lathe logprobs --model DIR [--adapter PEFT_DIR] --input IN.jsonl --output OUT.jsonl [--device cpu|cuda]`: for each
// input line {"tokens": [...]}, {"text": "..."} (encoded without special tokens, as `lathe tokenize` does) or
// {"messages": [...]} (rendered with the model folder's chat template and chat-template kwargs, no generation prompt),
// writes {"logprobs": [...]} with n-1 entries, entry i = log p(tokens[i+1] | tokens[..i]).
// Lines are packed into batches of documents (no attention across them); output order is input order. Under mpirun,
// srun or --nproc N the lines are split over the ranks (rank r scores lines r, r + N, ...) and rank 0 writes them all. The output
// goes through OutputFile: a file appears only when every line succeeded (a failure leaves the old one and no
// temporary), while "-", /dev/stdout or a pipe are streamed. The chat-template kwargs are --chat-template-kwargs, else
// the adapter's, then the model folder's chat_template_kwargs.json (cli_support.h). Covered by
// tests/e2e/test_cli_outputs.cpp (Logprobs* tests) and tests/e2e/test_train.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "comm/launch.h"
#include "comm/local_launch.h"
#include "commands.h"
#include "core/fault_inject.h"
#include "core/files.h"
#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "model/lora.h"
#include "model/causal_lm.h"
#include "model/pipeline_step.h"
#include "parallel_job.h"

namespace lathe::cli {

namespace {

struct Args {
  std::string model, adapter, input, output, device = "cpu", dtype, chat_template_kwargs;
  bool has_chat_template_kwargs = false;
  int64_t batch_tokens = 8192;
  int nproc = 0;
  int tp = 1;  // tensor parallelism: each model replica split over tp ranks
  int cp = 1;  // context parallelism: each replica's batches split by rows over cp ranks (times tp)
  int ep = 1;  // expert parallelism: ep replicas (each its own lines) share one copy of the experts
  int pp = 1;  // pipeline parallelism: each replica's layers in pp stages
};

// The tokenizer and chat template of the model folder, loaded when a 'text' or 'messages' line first needs them.
class TextEncoder {
 public:
  TextEncoder(const Args& a, nlohmann::ordered_json kwargs) : dir_(a.model), kwargs_(std::move(kwargs)) {}

  std::vector<int32_t> text(const std::string& text) { return tokenizer().encode(text); }
  std::vector<int32_t> messages(const nlohmann::ordered_json& messages) {
    if (!chat_loaded_) {
      chat_ = data::load_chat_template(dir_);
      chat_loaded_ = true;
    }
    LATHE_CHECK(chat_.has_value(), "'messages' need a chat template, and {} has none (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja)", dir_);
    return tokenizer().encode(chat_->render(messages, /*add_generation_prompt=*/false, kwargs_));
  }

 private:
  const data::Tokenizer& tokenizer() {
    if (!tokenizer_) {
      LATHE_CHECK(std::filesystem::exists(std::filesystem::path(dir_) / "tokenizer.json"),
                  "'text' and 'messages' input need {}/tokenizer.json; pass 'tokens' instead", dir_);
      tokenizer_.emplace(data::Tokenizer::from_dir(dir_));
    }
    return *tokenizer_;
  }

  std::string dir_;
  nlohmann::ordered_json kwargs_;
  std::optional<data::Tokenizer> tokenizer_;
  std::optional<ChatTemplate> chat_;
  bool chat_loaded_ = false;
};

std::vector<int32_t> line_ids(const nlohmann::ordered_json& j, int64_t vocab, TextEncoder& encoder) {
  LATHE_CHECK(j.is_object(), "expected an object");
  const int kinds = int(j.contains("tokens")) + int(j.contains("text")) + int(j.contains("messages"));
  LATHE_CHECK(kinds == 1, "expected exactly one of {{\"tokens\": [int, ...]}}, {{\"text\": ...}} and "
              "{{\"messages\": [...]}}");
  std::vector<int32_t> ids;
  if (j.contains("tokens")) {
    LATHE_CHECK(j["tokens"].is_array(), "'tokens' must be an array of integers");
    for (const auto& t : j["tokens"]) {
      LATHE_CHECK(t.is_number_integer(), "token {} is not an integer", t.dump());
      const int64_t v = t.get<int64_t>();
      LATHE_CHECK(v >= 0 && v < vocab, "token {} is outside the vocabulary (size {})", v, vocab);
      ids.push_back(int32_t(v));
    }
    LATHE_CHECK(!ids.empty(), "empty token list");
    return ids;
  }
  if (j.contains("text")) {
    LATHE_CHECK(j["text"].is_string(), "'text' must be a string");
    ids = encoder.text(j["text"].get<std::string>());
    LATHE_CHECK(!ids.empty(), "empty text");
  } else {
    LATHE_CHECK(j["messages"].is_array() && !j["messages"].empty(),
                "'messages' must be a non-empty array of {{\"role\", \"content\"}} objects");
    ids = encoder.messages(j["messages"]);
    LATHE_CHECK(!ids.empty(), "the conversation renders to no tokens");
  }
  for (int32_t id : ids)
    LATHE_CHECK(id < vocab, "token {} is outside the model's vocabulary (size {})", id, vocab);
  return ids;
}

// Every non-blank line of the input; errors name FILE:LINE.
std::vector<std::vector<int32_t>> read_token_lines(const std::string& path, int64_t vocab, TextEncoder& encoder) {
  std::vector<std::vector<int32_t>> lines;
  for_each_jsonl_row(path, "logprobs", [&](const nlohmann::ordered_json& j, int64_t) { lines.push_back(line_ids(j, vocab, encoder)); });
  return lines;
}

// Scores every line with `model` into a.output. Under a parallel launch replica r (a rank, or with --tp a group of
// ranks) scores lines r, r + n, ... and rank 0 writes them all in input order.
void score(Runtime& rt, const Args& a, const ModelOptions& options, CausalLm& model, const LoraBank* bank,
           TextEncoder& encoder, const LineRanks& g) {
  const std::vector<std::vector<int32_t>> all_lines = read_token_lines(a.input, model.global_config().vocab_size, encoder);
  const int n = g.replicas, me = g.replica;
  std::vector<std::vector<int32_t>> lines;
  for (size_t i = size_t(me); i < all_lines.size(); i += size_t(n)) lines.push_back(all_lines[i]);

  // Whole lines packed until a batch is full (a longer line gets a batch of its own).
  struct Pack {
    std::vector<int32_t> ids, cu = {0};
  };
  std::vector<Pack> packs;
  for (size_t first = 0; first < lines.size();) {
    Pack p;
    size_t last = first;
    while (last < lines.size() && (last == first || int64_t(p.ids.size() + lines[last].size()) <= a.batch_tokens)) {
      p.ids.insert(p.ids.end(), lines[last].begin(), lines[last].end());
      p.cu.push_back(int32_t(p.ids.size()));
      ++last;
    }
    packs.push_back(std::move(p));
    first = last;
  }
  // Expert parallelism: each forward is a collective of the ep group (its ranks serve each other's rows), so every
  // rank runs as many as the one with most batches, the others' last ones a two-token filler whose output is dropped.
  size_t forwards = packs.size();
  if (g.ep)
    for (double n : values_over(rt, options.device, *g.ep, double(packs.size())))
      forwards = std::max(forwards, size_t(n));
  const Pack filler{{0, 0}, {0, 2}};
  std::vector<PackedBatch> batches;
  for (size_t k = 0; k < forwards; ++k) {
    const std::vector<int32_t>& ids = k < packs.size() ? packs[k].ids : filler.ids;
    const std::vector<int32_t>& cu = k < packs.size() ? packs[k].cu : filler.cu;
    std::vector<int32_t> labels = next_token_labels(ids, cu);
    batches.push_back(make_packed_batch(rt, options.device, ids, cu, std::move(labels), model.global_config().vocab_size));
    if (bank) set_segments(batches.back(), {{batches.back().tokens(), 0, 1.0, 0}});
  }
  // Pipeline parallelism: the batches stream through the stages (every stage gets the log-probabilities).
  std::vector<std::vector<double>> logprobs;
  if (g.pp) logprobs = pipeline_label_logprobs(model, batches);
  else
    for (const PackedBatch& b : batches) logprobs.push_back(model.label_logprobs(b));
  std::vector<std::string> rows;  // this rank's output lines
  for (size_t k = 0; k < packs.size(); ++k) {  // (the fillers' dropped)
    const std::vector<int32_t>& cu = packs[k].cu;
    const std::vector<double>& lp = logprobs[k];
    for (size_t b = 0; b + 1 < cu.size(); ++b) {
      nlohmann::json row = nlohmann::json::array();
      for (int32_t i = cu[b]; i + 1 < cu[b + 1]; ++i) row.push_back(lp[size_t(i)]);
      rows.push_back(nlohmann::json{{"logprobs", row}}.dump() + "\n");
    }
  }
  const std::vector<std::string> in_order = g.in_input_order(rt, options.device, rows, all_lines.size());
  if (!g.writer()) return;  // rank 0 writes
  OutputFile file(a.output, "logprobs");
  for (const std::string& line : in_order) file.stream() << line;
  file.commit();
  fmt::print(stderr, "logprobs: {} lines scored with {}{} on {} ({}){}\n", all_lines.size(), a.model,
             a.adapter.empty() ? "" : " + adapter " + a.adapter, options.device.str(), dtype_name(options.dtype),
             g.world ? fmt::format(", {} ranks{}{}{}{}", g.world->size(), g.tp ? fmt::format(", tp {}", g.tp->size()) : "",
                                     g.cp ? fmt::format(", cp {}", g.cp->size()) : "",
                                     g.ep ? fmt::format(", ep {}", g.ep->size()) : "",
                                     g.pp ? fmt::format(", pp {}", g.pp->size()) : "")
                     : "");
}

// One rank's work (or the whole of an unlaunched run). `mpi` belongs to the caller: an error here ends the job
// through run_as_rank while MPI is still up, instead of waiting in MPI_Finalize for ranks that wait on this one.
void run_rank(Args& a, const LaunchEnv& env, std::optional<MpiSession>& mpi) {
  check_folder(a.model, "--model", "logprobs");
  if (!a.adapter.empty()) check_folder(a.adapter, "--adapter", "logprobs");
  TextEncoder encoder(a, resolve_chat_template_kwargs(a.has_chat_template_kwargs, a.chat_template_kwargs,
                                                      {a.adapter, a.model}, "logprobs").kwargs);
  Runtime rt;
  const LineRanks ranks =
      line_ranks(join_world(rt, a.device, env, 600, mpi, "logprobs"), a.tp, a.cp, a.ep, a.pp, "logprobs");
  ModelOptions options;
  ranks.place(options, a.model);
  options.device = parse_device(a.device);
  options.dtype = !a.dtype.empty() ? dtype_from_name(a.dtype) : options.device.is_cpu() ? DType::F32 : DType::BF16;
  options.train_base = false;
  const std::unique_ptr<CausalLm> model = load_causal_lm(rt, a.model, options);
  // An adapter is applied unmerged, through the same LoRA path as training (under tp each matrix split as its base
  // weight; under cp, ep and pp whole on every rank, as in training).
  std::unique_ptr<LoraBank> bank;
  if (!a.adapter.empty()) {
    bank = std::make_unique<LoraBank>(rt, model->config(), options.device, options.dtype,
                                      std::vector<LoraConfig>{read_lora_config(a.adapter)});
    bank->split_like(*model);  // tensor parallelism: each matrix split as its base weight
    bank->load_peft(0, a.adapter);
    model->attach_lora(bank.get());
  }
  // A rank that fails while the others wait in a collective for it (the test of run_as_rank's job end).
  LATHE_CHECK(!fault_injected("logprobs_rank_error", env.rank), "logprobs: rank {} failed (LATHE_FAULT_INJECT)",
              env.rank);
  score(rt, a, options, *model, bank.get(), encoder, ranks);
}

void run(Args a) {
  const LaunchEnv env = launch_env();
  if (a.nproc > 1 && env.world == 1) {  // the parent of a --nproc job (GPU ranks)
    LATHE_CHECK(a.device != "cpu", "logprobs: --nproc starts GPU ranks (NCCL); CPU ranks talk over MPI: launch them "
                "with `mpirun -np {} lathe logprobs ...`", a.nproc);
    std::vector<std::string> args = {"logprobs", "--model", a.model, "--input", a.input, "--output", a.output, "--device",
                                     a.device, "--batch-tokens", std::to_string(a.batch_tokens), "--tp",
                                     std::to_string(a.tp), "--cp", std::to_string(a.cp), "--ep", std::to_string(a.ep),
                                     "--pp", std::to_string(a.pp)};
    if (!a.adapter.empty()) args.insert(args.end(), {"--adapter", a.adapter});
    if (!a.dtype.empty()) args.insert(args.end(), {"--dtype", a.dtype});
    if (a.has_chat_template_kwargs) args.insert(args.end(), {"--chat-template-kwargs", a.chat_template_kwargs});
    const int rc = run_local_ranks("/proc/self/exe", args, a.nproc);
    LATHE_CHECK(rc == 0, "logprobs: a rank failed (status {})", rc);
    return;
  }
  std::optional<MpiSession> mpi;
  run_as_rank(env, [&] { run_rank(a, env, mpi); });
}

}  // namespace

void add_logprobs_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("logprobs", "Score token sequences: log p(token i+1 | tokens up to i)");
  auto args = std::make_shared<Args>();
  cmd->add_option("--model", args->model, "Hugging Face model folder")->required();
  cmd->add_option("--adapter", args->adapter, "PEFT LoRA adapter folder applied to the model");
  cmd->add_option("--input", args->input, "JSONL, one {\"tokens\": [...]}, {\"text\": ...} (encoded without special "
                  "tokens) or {\"messages\": [...]} (the model's chat template, no generation prompt) per line")
      ->required();
  cmd->add_option("--output", args->output, "JSONL, one {\"logprobs\": [...]} per input line; written whole when every "
                  "line succeeded (- or a pipe: streamed)")->required();
  cmd->add_option("--device", args->device, "cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "compute dtype (default f32 on cpu, bf16 on cuda)");
  cmd->add_option("--batch-tokens", args->batch_tokens, "tokens packed into one forward pass")
      ->capture_default_str()
      ->check(number_in(1));
  cmd->add_option("--chat-template-kwargs", args->chat_template_kwargs,
                  "JSON object passed to the chat template for 'messages' lines, e.g. {\"enable_thinking\": false} "
                  "(default: chat_template_kwargs.json of the --adapter folder, else of the --model folder, else {})");
  cmd->add_option("--tp", args->tp, "under a parallel launch: each model split over N ranks (tensor parallelism; the "
                  "launch's ranks form groups of N, the lines go to the groups; docs/parallel.md)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--cp", args->cp, "under a parallel launch: each batch split by rows over N ranks (context "
                  "parallelism; with --tp, replicas of tp x cp ranks; docs/parallel.md)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--ep", args->ep, "under a parallel launch: the experts of a mixture-of-experts model split over N "
                  "ranks, each scoring its own lines (expert parallelism; docs/moe.md)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--pp", args->pp, "under a parallel launch: each model's layers split into N pipeline stages, one a "
                  "rank, the batches streamed through them (pipeline parallelism; docs/parallel.md)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--nproc", args->nproc, "score on N GPUs of this machine (ranks started by lathe; mpirun and srun work "
                  "too): the lines are split over the ranks, the output keeps input order")
      ->check(number_in(1, 1024));
  cmd->callback([cmd, args, &exit_code] {
    args->has_chat_template_kwargs = cmd->count("--chat-template-kwargs") > 0;
    run(*args);
    exit_code = 0;
  });
}

}  // namespace lathe::cli
