// Training data rows (JSONL, one object per line) turned into tokenized samples with loss masks.
// Row kinds: {"text"} (loss on every token), {"messages"} (rendered with the chat template; loss on
// assistant turns only unless train_on_prompt), {"prompt", "completion"} (loss on the completion).
// Convention: a chat row is rendered and tokenized as ONE text, exactly as inference would see it;
// assistant spans are found as character ranges of that text (docs/data.md, "How assistant turns
// are found") and a token is a target when its bytes overlap a span. Every row that is not turned
// into a sample is counted in DatasetStats — bad rows fail with "data: FILE:LINE: ..." unless
// skip_bad_rows. Covered by tests/data/test_dataset.cpp.
#pragma once

#include "data/chat_template.h"
#include "data/token_file.h"
#include "data/tokenizer.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lathe::data {

enum class RowFormat { kAuto, kText, kMessages, kPromptCompletion };
enum class OverlongPolicy { kTruncate, kDrop };

// "auto", "text", "messages", "prompt_completion" (also "completion"); throws on anything else.
RowFormat parse_row_format(const std::string& name);
const char* row_format_name(RowFormat f);
OverlongPolicy parse_overlong_policy(const std::string& name);  // "truncate" or "drop"
const char* overlong_policy_name(OverlongPolicy p);

struct DatasetOptions {
  RowFormat format = RowFormat::kAuto;  // kAuto detects per row; otherwise rows of other kinds are errors
  int64_t max_seq_len = 4096;           // tokens per sample; 0 = no limit
  OverlongPolicy overlong = OverlongPolicy::kTruncate;
  bool skip_bad_rows = false;           // count and skip malformed rows instead of failing
  bool train_on_prompt = false;         // chat and prompt/completion rows: loss on every token
  bool append_eos = true;               // prompt/completion rows end with the tokenizer's EOS (when it has one)
  bool append_eos_to_text = false;      // text rows end with EOS too (continued pre-training with packing)
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();  // e.g. {"enable_thinking": false}
  int num_threads = 0;                  // encoding threads; 0 = hardware concurrency
};

struct DatasetStats {
  int64_t lines = 0;              // lines read, blank ones included
  int64_t blank_lines = 0;        // white-space-only lines (not rows; skipped)
  int64_t text_rows = 0, chat_rows = 0, completion_rows = 0;  // well-formed rows by kind
  int64_t bad_rows = 0;           // malformed rows skipped (only with skip_bad_rows)
  int64_t truncated = 0;          // over-long rows cut to max_seq_len
  int64_t dropped_too_long = 0;   // over-long rows dropped (policy drop)
  int64_t dropped_no_labels = 0;  // rows left with no training target (e.g. no assistant turn)
  int64_t samples = 0;            // samples produced
  int64_t tokens = 0;             // tokens in those samples
  int64_t labelled = 0;           // training targets in those samples
  std::vector<std::string> bad_row_errors;  // the first few skipped rows' errors

  std::string summary() const;  // one line for logs
  nlohmann::json to_json() const;
};

struct TurnMarkers;  // what the chat template writes around an assistant turn (dataset.cpp)

// A character range [begin, end) of a rendered conversation that is trained on.
struct TextSpan {
  size_t begin = 0, end = 0;
  bool operator==(const TextSpan&) const = default;
};

// A rendered conversation and its assistant spans (each from where the reply starts — after the
// generation prompt — through the template's end-of-turn marker, e.g. "<|im_end|>").
struct RenderedChat {
  std::string text;
  std::vector<TextSpan> assistant_spans;
};

// Finds where each assistant message of `messages` lies in the template's rendering of the whole
// conversation. Throws lathe::Error (prefix "data: ") when a span cannot be located consistently.
RenderedChat render_chat(const ChatTemplate& chat, const nlohmann::ordered_json& messages,
                         const nlohmann::ordered_json& extra_context);

// Turns parsed rows into samples. Thread-safe (const); one per dataset.
class RowEncoder {
 public:
  // `chat` may be null when the data has no "messages" rows. Both must outlive the encoder.
  RowEncoder(const Tokenizer& tokenizer, const ChatTemplate* chat, DatasetOptions options);

  // The sample of one row, before the max_seq_len policy. Throws lathe::Error "data: WHERE: ..."
  // naming the problem (missing key, wrong type, empty, kind not allowed by the format, template
  // failure). `kind` receives the detected row kind.
  Sample encode(const nlohmann::ordered_json& row, const std::string& where, RowFormat* kind = nullptr) const;

  // Ids of `text` with a per-token flag: true when the token's bytes overlap one of `spans`.
  // Exact on the whole-text tokenization when the tokens' bytes concatenate back to `text`
  // (always, unless NFC normalization changed the text); otherwise each span boundary is a
  // tokenization boundary.
  Sample encode_with_spans(const std::string& text, const std::vector<TextSpan>& spans) const;

  const DatasetOptions& options() const { return options_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }

 private:
  const Tokenizer& tokenizer_;
  const ChatTemplate* chat_;
  DatasetOptions options_;
  std::vector<std::string> token_bytes_;  // raw bytes of each id ("" for gaps)
  std::shared_ptr<const TurnMarkers> markers_;  // learnt from probe renderings with the default context
  std::string marker_error_;                     // why they could not be learnt
};

// One line of a JSONL file.
struct JsonlLine {
  int64_t number = 0;  // 1-based
  std::string text;
};

// Reads a JSONL file in chunks of lines (a final '\r' is removed).
class JsonlReader {
 public:
  explicit JsonlReader(const std::string& path);
  ~JsonlReader();
  // Fills `out` with up to `max_lines` lines; false at the end of the file.
  bool next_chunk(std::vector<JsonlLine>& out, size_t max_lines);
  const std::string& path() const { return path_; }

 private:
  struct Impl;
  std::string path_;
  std::unique_ptr<Impl> impl_;
  int64_t line_ = 0;
};

// Runs fn(i) for i in [0, n) on `threads` threads (0 = hardware concurrency), contiguous blocks.
// fn must not throw; capture errors per item.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t)>& fn);

// Reads and encodes `path` (in parallel, in chunks), applying the max_seq_len policy and counting
// everything, and passes each sample to `sink` in file order. Throws on the first bad row unless
// skip_bad_rows.
DatasetStats encode_jsonl(const std::string& path, const RowEncoder& encoder,
                          const std::function<void(Sample&&)>& sink);

// encode_jsonl into memory.
std::shared_ptr<MemoryCorpus> load_jsonl(const std::string& path, const RowEncoder& encoder, DatasetStats* stats);

// Training data from `path`: a prepared corpus (PATH.index exists, or PATH names one of its files)
// or a JSONL file tokenized now with `encoder`. `stats` (optional) gets the JSONL statistics, or
// the sample/token counts of a prepared corpus.
std::shared_ptr<const Corpus> open_corpus(const std::string& path, const RowEncoder& encoder, DatasetStats* stats);

// `lathe tokenize`: each non-blank line of `input`, {"text"} or {"messages", "add_generation_prompt"
// (default false), "tools", "chat_template_kwargs"}, becomes {"ids"} or {"text": rendered, "ids"} in
// `output`, in input order (ids without added special tokens). `output` is written atomically;
// errors name FILE:LINE. Returns the number of rows written.
int64_t tokenize_jsonl(const std::string& input, const std::string& output, const Tokenizer& tokenizer,
                       const ChatTemplate* chat, const nlohmann::ordered_json& template_kwargs, int threads);

// `lathe prepare`: encodes `input` into the prepared corpus PREFIX.{tokens,mask,index}, plus
// PREFIX.json (statistics and options, for people). Nothing is left behind on failure.
DatasetStats prepare_corpus(const std::string& input, const std::string& prefix, const RowEncoder& encoder,
                            const TokenFileMeta& meta);

// The chat template of a model folder (chat_template.jinja or tokenizer_config.json's
// chat_template), or nullopt when the folder has none. Broken templates throw.
std::optional<ChatTemplate> load_chat_template(const std::string& dir);

}  // namespace lathe::data
