// JSONL rows → samples: row validation, chat rendering with assistant-span location, token masks,
// the max_seq_len policy and the statistics that account for every line.
// Convention: assistant spans come from renderings of the conversation's prefixes compared with the
// full rendering (common prefix = where the reply starts) plus the template's end-of-turn marker,
// learnt once by rendering a probe conversation; docs/data.md explains why not plain prefix diffing
// (Qwen3 drops the <think> block of earlier turns). Outputs (tokenize_jsonl, PREFIX.json of prepare_corpus) go
// through OutputFile (core/files.h): atomic for files, streamed into pipes and stdout. Covered by
// tests/data/test_dataset.cpp and tests/e2e/test_cli_outputs.cpp.
#include "data/dataset.h"

#include "core/error.h"
#include "core/files.h"
#include "data/pretokenize.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>
#include <unordered_set>


namespace lathe::data {

// What a template writes around an assistant turn, learnt from probe conversations: the end-of-turn
// marker after a reply, up to white space ("<|im_end|>" for ChatML, "<|eot_id|>" for Llama 3, ...),
// and the generation prompt that add_generation_prompt appends ("<|im_start|>assistant\n").
struct TurnMarkers {
  std::string end;
  std::optional<std::string> generation_header;  // unknown when the template is not that regular
};

namespace {

using nlohmann::ordered_json;

constexpr size_t kChunkLines = 4096;    // lines encoded in parallel at a time
constexpr size_t kKeptErrors = 10;      // skipped-row errors kept for the report
constexpr const char* kProbeQuestion = "lathe-probe-question";
constexpr const char* kProbeAnswer = "lathe-probe-answer";

std::string_view trim(std::string_view s) {
  const char* ws = " \t\r\n";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string_view::npos) return {};
  return s.substr(a, s.find_last_not_of(ws) - a + 1);
}

size_t common_prefix(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

TurnMarkers probe_turn_markers(const ChatTemplate& chat, const ordered_json& extra) {
  const ordered_json user = {{"role", "user"}, {"content", kProbeQuestion}};
  const ordered_json reply = {{"role", "assistant"}, {"content", kProbeAnswer}};
  const ordered_json system = {{"role", "system"}, {"content", "lathe-probe-system"}};
  std::string error;
  for (const ordered_json& opening : {ordered_json::array({user}), ordered_json::array({system, user})}) {
    std::string rendered, base, prompt;
    try {
      ordered_json conversation = opening;
      conversation.push_back(reply);
      rendered = chat.render(conversation, false, extra);
      base = chat.render(opening, false, extra);
      prompt = chat.render(opening, true, extra);
    } catch (const Error& e) {
      if (error.empty()) error = e.what();
      continue;
    }
    const size_t at = rendered.rfind(kProbeAnswer);
    LATHE_CHECK(at != std::string::npos, "data: the chat template does not render an assistant message's content");
    TurnMarkers m;
    m.end = std::string(trim(std::string_view(rendered).substr(at + std::strlen(kProbeAnswer))));
    LATHE_CHECK(!m.end.empty(), "data: the chat template writes nothing after an assistant message, so the end of an "
                "assistant turn cannot be found; use train_on_prompt or prompt/completion rows");
    if (prompt.compare(0, base.size(), base) == 0) m.generation_header = prompt.substr(base.size());
    return m;
  }
  LATHE_FAIL("data: cannot render a probe conversation with the chat template: {}", error);
}

ordered_json prefix_of(const ordered_json& messages, size_t n) {
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < n; ++i) out.push_back(messages[i]);
  return out;
}

RenderedChat render_chat_with_markers(const ChatTemplate& chat, const ordered_json& messages,
                                      const ordered_json& extra, const TurnMarkers& markers) {
  const std::string& marker = markers.end;
  RenderedChat out;
  out.text = chat.render(messages, false, extra);
  size_t prev_end = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ordered_json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || m["role"] != "assistant") continue;
    LATHE_CHECK(i > 0, "data: message 1 is an assistant message; a conversation must open with a prompt for it");
    const ordered_json before = prefix_of(messages, i);
    const std::string prompt = chat.render(before, true, extra);
    // The reply starts where the full rendering stops agreeing with the prompt the model would get
    // for this turn at inference time (history + generation prompt). The history itself must agree:
    // the common prefix reaches at least the generation prompt (the history rendered on its own, when
    // the probe could not learn the generation prompt).
    const size_t begin = common_prefix(out.text, prompt);
    size_t history = 0;
    if (markers.generation_header && prompt.size() >= markers.generation_header->size() &&
        prompt.compare(prompt.size() - markers.generation_header->size(), std::string::npos,
                       *markers.generation_header) == 0) {
      history = prompt.size() - markers.generation_header->size();
    } else {
      const std::string base = chat.render(before, false, extra);
      if (prompt.compare(0, base.size(), base) == 0) history = base.size();
    }
    LATHE_CHECK(begin >= history && begin >= prev_end,
                "data: cannot locate assistant message {}: the template renders the conversation before it "
                "differently on its own than inside the whole conversation (two assistant messages in a row?)",
                i + 1);
    const size_t marker_at = out.text.find(marker, begin);
    LATHE_CHECK(marker_at != std::string::npos, "data: no end-of-turn marker '{}' after assistant message {}", marker,
                i + 1);
    // The visible answer (after any </think>) must lie inside the span; this catches a marker that
    // occurs inside the content itself.
    if (m.contains("content") && m["content"].is_string()) {
      std::string_view answer = m["content"].get_ref<const std::string&>();
      const size_t think_end = answer.rfind("</think>");
      if (think_end != std::string_view::npos) answer = answer.substr(think_end + 8);
      answer = trim(answer);
      LATHE_CHECK(answer.empty() || std::string_view(out.text).substr(begin, marker_at - begin).find(answer) !=
                                        std::string_view::npos,
                  "data: assistant message {} is not where the template's turn for it ends; does its content contain "
                  "the end-of-turn marker '{}'?",
                  i + 1, marker);
    }
    out.assistant_spans.push_back({begin, marker_at + marker.size()});
    prev_end = marker_at + marker.size();
  }
  return out;
}

const char* json_type(const ordered_json& j) { return j.type_name(); }

// The message of a nested error without its "data: " prefix and its " (file.cpp:123)" origin, for
// rewrapping under a row's location.
std::string inner_message(const Error& e) {
  std::string_view what = e.what();
  if (what.rfind("data: ", 0) == 0) what.remove_prefix(6);
  const size_t open = what.rfind(" (");
  if (!what.empty() && what.back() == ')' && open != std::string_view::npos &&
      what.find(".cpp:", open) != std::string_view::npos)
    what = what.substr(0, open);
  return std::string(what);
}

}  // namespace

// ---- names ---------------------------------------------------------------------------------------

RowFormat parse_row_format(const std::string& name) {
  if (name == "auto") return RowFormat::kAuto;
  if (name == "text") return RowFormat::kText;
  if (name == "messages" || name == "chat") return RowFormat::kMessages;
  if (name == "prompt_completion" || name == "completion") return RowFormat::kPromptCompletion;
  LATHE_FAIL("data: unknown row format '{}' (expected auto, text, messages or prompt_completion)", name);
}

const char* row_format_name(RowFormat f) {
  switch (f) {
    case RowFormat::kAuto: return "auto";
    case RowFormat::kText: return "text";
    case RowFormat::kMessages: return "messages";
    case RowFormat::kPromptCompletion: return "prompt_completion";
  }
  return "?";
}

OverlongPolicy parse_overlong_policy(const std::string& name) {
  if (name == "truncate") return OverlongPolicy::kTruncate;
  if (name == "drop") return OverlongPolicy::kDrop;
  LATHE_FAIL("data: unknown over-long policy '{}' (expected truncate or drop)", name);
}

const char* overlong_policy_name(OverlongPolicy p) { return p == OverlongPolicy::kTruncate ? "truncate" : "drop"; }

// ---- stats ---------------------------------------------------------------------------------------

std::string DatasetStats::summary() const {
  std::string s = fmt::format("{} samples, {} tokens ({} trained on) from {} rows (text {}, messages {}, "
                              "prompt/completion {})",
                              samples, tokens, labelled, text_rows + chat_rows + completion_rows, text_rows,
                              chat_rows, completion_rows);
  s += fmt::format("; skipped: {} bad rows, {} blank lines; over-long: {} truncated, {} dropped; {} dropped with "
                   "nothing to train on",
                   bad_rows, blank_lines, truncated, dropped_too_long, dropped_no_labels);
  return s;
}

nlohmann::json DatasetStats::to_json() const {
  return {{"lines", lines}, {"blank_lines", blank_lines}, {"text_rows", text_rows}, {"chat_rows", chat_rows},
          {"completion_rows", completion_rows}, {"bad_rows", bad_rows}, {"truncated", truncated},
          {"dropped_too_long", dropped_too_long}, {"dropped_no_labels", dropped_no_labels}, {"samples", samples},
          {"tokens", tokens}, {"labelled", labelled}, {"bad_row_errors", bad_row_errors}};
}

// ---- chat ----------------------------------------------------------------------------------------

RenderedChat render_chat(const ChatTemplate& chat, const ordered_json& messages, const ordered_json& extra_context) {
  return render_chat_with_markers(chat, messages, extra_context, probe_turn_markers(chat, extra_context));
}

// ---- RowEncoder ----------------------------------------------------------------------------------

RowEncoder::RowEncoder(const Tokenizer& tokenizer, const ChatTemplate* chat, DatasetOptions options)
    : tokenizer_(tokenizer), chat_(chat), options_(std::move(options)) {
  LATHE_CHECK(options_.max_seq_len >= 0, "data: max_seq_len must be >= 0 (0 = no limit), got {}",
              options_.max_seq_len);
  LATHE_CHECK(options_.chat_template_kwargs.is_object(), "data: chat_template_kwargs must be a JSON object");
  std::unordered_set<int32_t> added;
  token_bytes_.resize(size_t(tokenizer.vocab_size()));
  for (const AddedToken& t : tokenizer.added_tokens()) {
    token_bytes_[size_t(t.id)] = t.content;
    added.insert(t.id);
  }
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (added.count(id)) continue;
    const auto token = tokenizer.id_to_token(id);
    if (!token) continue;
    if (!byte_level_to_bytes(*token, token_bytes_[size_t(id)])) token_bytes_[size_t(id)] = std::string(*token);
  }
  if (chat_) {
    try {
      markers_ = std::make_shared<const TurnMarkers>(probe_turn_markers(*chat_, options_.chat_template_kwargs));
    } catch (const Error& e) {
      marker_error_ = inner_message(e);  // reported by the first 'messages' row
    }
  }
}

Sample RowEncoder::encode_with_spans(const std::string& text, const std::vector<TextSpan>& spans) const {
  Sample s;
  s.ids = tokenizer_.encode(text);
  s.loss_mask.assign(s.ids.size(), 0);
  // Byte offset of each token, when the tokens spell `text` exactly.
  std::vector<size_t> starts(s.ids.size() + 1);
  size_t pos = 0;
  bool exact = true;
  for (size_t j = 0; j < s.ids.size() && exact; ++j) {
    const std::string& b = token_bytes_[size_t(s.ids[j])];
    exact = text.compare(pos, b.size(), b) == 0;
    starts[j] = pos;
    pos += b.size();
  }
  exact = exact && pos == text.size();
  if (exact) {
    starts[s.ids.size()] = pos;
    size_t k = 0;  // spans are sorted and disjoint
    for (size_t j = 0; j < s.ids.size(); ++j) {
      while (k < spans.size() && spans[k].end <= starts[j]) ++k;
      s.loss_mask[j] = k < spans.size() && spans[k].begin < starts[j + 1] && starts[j] < spans[k].end;
    }
  } else {
    // NFC changed the text (or a token absorbed white space): tokenize span by span instead.
    s.ids.clear();
    s.loss_mask.clear();
    size_t at = 0;
    auto piece = [&](size_t a, size_t b, uint8_t flag) {
      tokenizer_.encode_into(std::string_view(text).substr(a, b - a), s.ids);
      s.loss_mask.resize(s.ids.size(), flag);
    };
    for (const TextSpan& sp : spans) {
      piece(at, sp.begin, 0);
      piece(sp.begin, sp.end, 1);
      at = sp.end;
    }
    piece(at, text.size(), 0);
  }
  if (!s.loss_mask.empty()) s.loss_mask[0] = 0;  // the first token has no context to be predicted from
  return s;
}

Sample RowEncoder::encode(const ordered_json& row, const std::string& where, RowFormat* kind_out) const {
  LATHE_CHECK(row.is_object(), "data: {}: expected a JSON object, got {}", where, json_type(row));
  const bool has_text = row.contains("text"), has_messages = row.contains("messages");
  const bool has_pc = row.contains("prompt") || row.contains("completion");
  RowFormat kind = options_.format;
  if (kind == RowFormat::kAuto) {
    const int kinds = int(has_text) + int(has_messages) + int(has_pc);
    if (kinds == 0) {
      std::string keys;
      for (const auto& [k, v] : row.items()) keys += (keys.empty() ? "" : ", ") + k;
      LATHE_FAIL("data: {}: expected a 'text', 'messages' or 'prompt'+'completion' row; found keys: {}", where,
                 keys.empty() ? "none" : keys);
    }
    LATHE_CHECK(kinds == 1, "data: {}: ambiguous row: it has more than one of 'text', 'messages' and "
                "'prompt'/'completion'; choose one with an explicit format", where);
    kind = has_text ? RowFormat::kText : has_messages ? RowFormat::kMessages : RowFormat::kPromptCompletion;
  } else {
    const bool own = kind == RowFormat::kText ? has_text : kind == RowFormat::kMessages ? has_messages : has_pc;
    if (!own) {
      const char* other = has_text ? "text" : has_messages ? "messages" : has_pc ? "prompt_completion" : nullptr;
      LATHE_CHECK(other == nullptr, "data: {}: a '{}' row, but the format is '{}'", where, other,
                  row_format_name(kind));
    }
  }
  if (kind_out) *kind_out = kind;
  auto string_field = [&](const char* key, bool allow_empty) -> const std::string& {
    LATHE_CHECK(row.contains(key), "data: {}: missing '{}'", where, key);
    const ordered_json& v = row[key];
    LATHE_CHECK(v.is_string(), "data: {}: '{}' must be a string, got {}", where, key, json_type(v));
    LATHE_CHECK(allow_empty || !v.get_ref<const std::string&>().empty(), "data: {}: empty '{}'", where, key);
    return v.get_ref<const std::string&>();
  };
  const std::optional<int32_t> eos = tokenizer_.eos_id();
  Sample s;
  try {
    if (kind == RowFormat::kText) {
      s.ids = tokenizer_.encode(string_field("text", false));
      if (options_.append_eos_to_text && eos) s.ids.push_back(*eos);
      s.loss_mask.assign(s.ids.size(), 1);
    } else if (kind == RowFormat::kPromptCompletion) {
      const std::string& prompt = string_field("prompt", true);
      const std::string& completion = string_field("completion", false);
      s.ids = tokenizer_.encode(prompt);
      const size_t n_prompt = s.ids.size();
      tokenizer_.encode_into(completion, s.ids);
      if (options_.append_eos && eos) s.ids.push_back(*eos);
      s.loss_mask.assign(s.ids.size(), 1);
      if (!options_.train_on_prompt) std::fill(s.loss_mask.begin(), s.loss_mask.begin() + long(n_prompt), 0);
    } else {
      LATHE_CHECK(chat_ != nullptr, "data: {}: a 'messages' row needs a chat template, and the tokenizer has none",
                  where);
      LATHE_CHECK(row.contains("messages"), "data: {}: missing 'messages'", where);
      const ordered_json& messages = row["messages"];
      LATHE_CHECK(messages.is_array(), "data: {}: 'messages' must be an array, got {}", where, json_type(messages));
      LATHE_CHECK(!messages.empty(), "data: {}: empty 'messages'", where);
      for (size_t i = 0; i < messages.size(); ++i) {
        const ordered_json& m = messages[i];
        LATHE_CHECK(m.is_object(), "data: {}: message {} must be an object, got {}", where, i + 1, json_type(m));
        LATHE_CHECK(m.contains("role") && m["role"].is_string(), "data: {}: message {} needs a string 'role'", where,
                    i + 1);
        LATHE_CHECK(!m.contains("content") || m["content"].is_string() || m["content"].is_null(),
                    "data: {}: message {}: 'content' must be a string, got {}", where, i + 1,
                    json_type(m["content"]));
      }
      ordered_json extra = options_.chat_template_kwargs;
      if (row.contains("chat_template_kwargs")) {
        LATHE_CHECK(row["chat_template_kwargs"].is_object(), "data: {}: 'chat_template_kwargs' must be an object",
                    where);
        for (const auto& [k, v] : row["chat_template_kwargs"].items()) extra[k] = v;
      }
      if (row.contains("tools")) {
        LATHE_CHECK(row["tools"].is_array() || row["tools"].is_null(), "data: {}: 'tools' must be an array", where);
        extra["tools"] = row["tools"];
      }
      const bool own_context = row.contains("chat_template_kwargs") || row.contains("tools");
      LATHE_CHECK(own_context || marker_error_.empty(), "data: {}: {}", where, marker_error_);
      RenderedChat chat;
      try {
        chat = render_chat_with_markers(*chat_, messages, extra,
                                        own_context ? probe_turn_markers(*chat_, extra) : *markers_);
      } catch (const Error& e) {
        LATHE_FAIL("data: {}: {}", where, inner_message(e));
      }
      LATHE_CHECK(!chat.text.empty(), "data: {}: the chat template rendered nothing", where);
      if (options_.train_on_prompt) chat.assistant_spans = {{0, chat.text.size()}};
      s = encode_with_spans(chat.text, chat.assistant_spans);
    }
  } catch (const Error& e) {
    if (std::string_view(e.what()).rfind("data: ", 0) == 0) throw;  // already names the row
    LATHE_FAIL("data: {}: {}", where, inner_message(e));
  }
  LATHE_CHECK(!s.ids.empty(), "data: {}: the row has no tokens", where);
  s.loss_mask[0] = 0;
  return s;
}

// ---- JSONL ---------------------------------------------------------------------------------------

struct JsonlReader::Impl {
  std::ifstream in;
  std::vector<char> buffer = std::vector<char>(1 << 20);
};

JsonlReader::JsonlReader(const std::string& path) : path_(path), impl_(std::make_unique<Impl>()) {
  std::error_code ec;
  LATHE_CHECK(std::filesystem::exists(path, ec), "data: cannot open {}: it does not exist", path);
  LATHE_CHECK(!std::filesystem::is_directory(path, ec), "data: {} is a folder, not a JSONL file", path);
  impl_->in.rdbuf()->pubsetbuf(impl_->buffer.data(), std::streamsize(impl_->buffer.size()));
  impl_->in.open(path, std::ios::binary);
  LATHE_CHECK(impl_->in.good(), "data: cannot open {}: {}", path, std::strerror(errno));
}

JsonlReader::~JsonlReader() = default;

bool JsonlReader::next_chunk(std::vector<JsonlLine>& out, size_t max_lines) {
  out.clear();
  std::string line;
  while (out.size() < max_lines && std::getline(impl_->in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    out.push_back({++line_, std::move(line)});
    line.clear();
  }
  LATHE_CHECK(!impl_->in.bad(), "data: reading {} failed", path_);
  return !out.empty();
}

void parallel_for(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  threads = int(std::min<int64_t>(threads, n));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(size_t(threads));
  for (int t = 0; t < threads; ++t) {
    const int64_t a = n * t / threads, b = n * (t + 1) / threads;
    pool.emplace_back([a, b, &fn] {
      for (int64_t i = a; i < b; ++i) fn(i);
    });
  }
  for (auto& th : pool) th.join();
}

DatasetStats encode_jsonl(const std::string& path, const RowEncoder& encoder,
                          const std::function<void(Sample&&)>& sink) {
  const DatasetOptions& opt = encoder.options();
  struct Result {
    Sample sample;
    RowFormat kind = RowFormat::kAuto;
    std::string error;
    bool blank = false;
  };
  DatasetStats stats;
  JsonlReader reader(path);
  std::vector<JsonlLine> lines;
  std::vector<Result> results;
  while (reader.next_chunk(lines, kChunkLines)) {
    results.assign(lines.size(), Result{});
    parallel_for(int64_t(lines.size()), opt.num_threads, [&](int64_t i) {
      const JsonlLine& line = lines[size_t(i)];
      Result& r = results[size_t(i)];
      if (trim(line.text).empty()) {
        r.blank = true;
        return;
      }
      const std::string where = fmt::format("{}:{}", path, line.number);
      try {
        ordered_json row;
        try {
          row = ordered_json::parse(line.text);
        } catch (const nlohmann::json::exception& e) {
          std::string_view what = e.what();
          if (const size_t at = what.find("] "); at != std::string_view::npos) what.remove_prefix(at + 2);
          LATHE_FAIL("data: {}: invalid JSON: {}", where, what);
        }
        r.sample = encoder.encode(row, where, &r.kind);
      } catch (const std::exception& e) {
        r.error = e.what();
      }
    });
    for (Result& r : results) {
      stats.lines += 1;
      if (r.blank) {
        stats.blank_lines += 1;
        continue;
      }
      if (!r.error.empty()) {
        if (!opt.skip_bad_rows) throw Error(r.error);
        stats.bad_rows += 1;
        if (stats.bad_row_errors.size() < kKeptErrors) stats.bad_row_errors.push_back(r.error);
        continue;
      }
      (r.kind == RowFormat::kText ? stats.text_rows
       : r.kind == RowFormat::kMessages ? stats.chat_rows
                                        : stats.completion_rows) += 1;
      Sample& s = r.sample;
      if (opt.max_seq_len > 0 && int64_t(s.ids.size()) > opt.max_seq_len) {
        if (opt.overlong == OverlongPolicy::kDrop) {
          stats.dropped_too_long += 1;
          continue;
        }
        s.ids.resize(size_t(opt.max_seq_len));
        s.loss_mask.resize(size_t(opt.max_seq_len));
        stats.truncated += 1;
      }
      const int64_t labelled = s.labelled();
      if (labelled == 0) {
        stats.dropped_no_labels += 1;
        continue;
      }
      stats.samples += 1;
      stats.tokens += int64_t(s.ids.size());
      stats.labelled += labelled;
      sink(std::move(s));
    }
  }
  return stats;
}

std::shared_ptr<MemoryCorpus> load_jsonl(const std::string& path, const RowEncoder& encoder, DatasetStats* stats) {
  auto corpus = std::make_shared<MemoryCorpus>();
  DatasetStats s = encode_jsonl(path, encoder, [&](Sample&& sample) { corpus->append(sample); });
  if (stats) *stats = std::move(s);
  return corpus;
}

std::shared_ptr<const Corpus> open_corpus(const std::string& path, const RowEncoder& encoder, DatasetStats* stats) {
  std::string prefix = path;
  for (const char* suffix : {".index", ".tokens", ".mask"}) {
    const std::string_view sv(suffix);
    if (prefix.size() > sv.size() && prefix.compare(prefix.size() - sv.size(), sv.size(), sv) == 0 &&
        is_prepared_corpus(prefix.substr(0, prefix.size() - sv.size()))) {
      prefix.resize(prefix.size() - sv.size());
      break;
    }
  }
  if (is_prepared_corpus(prefix)) {
    std::shared_ptr<TokenFile> tf = TokenFile::open(prefix);
    const uint32_t vocab = tf->meta().vocab_size;
    LATHE_CHECK(vocab == 0 || int64_t(vocab) == encoder.tokenizer().vocab_size(),
                "data: {} was prepared with a tokenizer of {} tokens, but this one has {}", prefix, vocab,
                encoder.tokenizer().vocab_size());
    if (stats) {
      *stats = DatasetStats{};
      stats->samples = tf->size();
      stats->tokens = tf->total_tokens();
    }
    return tf;
  }
  return load_jsonl(path, encoder, stats);
}

namespace {

std::string tokenize_row(const std::string& line, const std::string& where, const Tokenizer& tok,
                         const ChatTemplate* chat, const ordered_json& kwargs) {
  ordered_json row;
  try {
    row = ordered_json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    std::string_view what = e.what();
    if (const size_t at = what.find("] "); at != std::string_view::npos) what.remove_prefix(at + 2);
    LATHE_FAIL("data: {}: invalid JSON: {}", where, what);
  }
  LATHE_CHECK(row.is_object(), "data: {}: expected a JSON object, got {}", where, json_type(row));
  const bool has_text = row.contains("text"), has_messages = row.contains("messages");
  LATHE_CHECK(has_text != has_messages, "data: {}: expected either 'text' or 'messages'{}", where,
              has_text ? ", not both" : "");
  try {
    if (has_text) {
      LATHE_CHECK(row["text"].is_string(), "data: {}: 'text' must be a string, got {}", where,
                  json_type(row["text"]));
      return ordered_json{{"ids", tok.encode(row["text"].get_ref<const std::string&>())}}.dump();
    }
    LATHE_CHECK(chat != nullptr, "data: {}: a 'messages' row needs a chat template, and the tokenizer has none",
                where);
    const ordered_json& messages = row["messages"];
    LATHE_CHECK(messages.is_array(), "data: {}: 'messages' must be an array, got {}", where, json_type(messages));
    const ordered_json agp = row.value("add_generation_prompt", ordered_json(false));
    LATHE_CHECK(agp.is_boolean(), "data: {}: 'add_generation_prompt' must be true or false", where);
    ordered_json extra = kwargs;
    if (row.contains("chat_template_kwargs")) {
      LATHE_CHECK(row["chat_template_kwargs"].is_object(), "data: {}: 'chat_template_kwargs' must be an object",
                  where);
      for (const auto& [k, v] : row["chat_template_kwargs"].items()) extra[k] = v;
    }
    if (row.contains("tools")) extra["tools"] = row["tools"];
    std::string text = chat->render(messages, agp.get<bool>(), extra);
    std::vector<int32_t> ids = tok.encode(text);
    return ordered_json{{"text", std::move(text)}, {"ids", std::move(ids)}}.dump();
  } catch (const Error& e) {
    if (std::string_view(e.what()).rfind("data: ", 0) == 0) throw;
    LATHE_FAIL("data: {}: {}", where, inner_message(e));
  }
}

}  // namespace

int64_t tokenize_jsonl(const std::string& input, const std::string& output, const Tokenizer& tokenizer,
                       const ChatTemplate* chat, const ordered_json& template_kwargs, int threads) {
  LATHE_CHECK(template_kwargs.is_object(), "data: chat template kwargs must be a JSON object");
  JsonlReader reader(input);
  OutputFile out(output, "data");
  std::vector<JsonlLine> lines;
  std::vector<std::string> results, errors;
  int64_t rows = 0;
  while (reader.next_chunk(lines, kChunkLines)) {
    results.assign(lines.size(), std::string());
    errors.assign(lines.size(), std::string());
    parallel_for(int64_t(lines.size()), threads, [&](int64_t i) {
      const JsonlLine& line = lines[size_t(i)];
      if (trim(line.text).empty()) return;
      try {
        results[size_t(i)] =
            tokenize_row(line.text, fmt::format("{}:{}", input, line.number), tokenizer, chat, template_kwargs);
      } catch (const std::exception& e) {
        errors[size_t(i)] = e.what();
      }
    });
    for (size_t i = 0; i < lines.size(); ++i) {
      if (!errors[i].empty()) throw Error(errors[i]);
      if (results[i].empty()) continue;
      out.stream() << results[i] << '\n';
      rows += 1;
    }
  }
  out.commit();
  return rows;
}

DatasetStats prepare_corpus(const std::string& input, const std::string& prefix, const RowEncoder& encoder,
                            const TokenFileMeta& meta) {
  TokenFileWriter writer(prefix, meta);
  DatasetStats stats = encode_jsonl(input, encoder, [&](Sample&& s) { writer.append(s); });
  const DatasetOptions& o = encoder.options();
  nlohmann::ordered_json info = {
      {"input", input},
      {"format", row_format_name(o.format)},
      {"max_seq_len", o.max_seq_len},
      {"overlong", overlong_policy_name(o.overlong)},
      {"skip_bad_rows", o.skip_bad_rows},
      {"train_on_prompt", o.train_on_prompt},
      {"append_eos", o.append_eos},
      {"append_eos_to_text", o.append_eos_to_text},
      {"chat_template_kwargs", o.chat_template_kwargs},
      {"vocab_size", meta.vocab_size},
      {"tokenizer_hash", fmt::format("{:016x}", meta.tokenizer_hash)},
      {"stats", stats.to_json()}};
  OutputFile json(prefix + ".json", "data");
  json.stream() << info.dump(2) << '\n';
  writer.finish();
  json.commit();
  return stats;
}

std::optional<ChatTemplate> load_chat_template(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path config = fs::path(dir) / "tokenizer_config.json", jinja = fs::path(dir) / "chat_template.jinja";
  if (fs::exists(config)) {
    if (fs::exists(jinja)) return ChatTemplate::from_tokenizer_config(config.string());
    std::ifstream in(config);
    ordered_json j;
    try {
      j = ordered_json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      LATHE_FAIL("data: {} is not valid JSON: {}", config.string(), e.what());
    }
    if (!j.is_object() || !j.contains("chat_template") || j["chat_template"].is_null()) return std::nullopt;
    return ChatTemplate::from_tokenizer_config(config.string());
  }
  if (fs::exists(jinja)) {
    std::ifstream in(jinja, std::ios::binary);
    return ChatTemplate(std::string(std::istreambuf_iterator<char>(in), {}));
  }
  return std::nullopt;
}

}  // namespace lathe::data
