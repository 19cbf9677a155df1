// Building a Tokenizer from tokenizer.json (+ tokenizer_config.json): parsing and strict validation.
// Convention: every object we read is checked for unknown keys and every option we do not implement
// is refused with "tokenizer: <file>: <json path>: ..." — an unsupported file fails at load, it never
// tokenizes differently from Hugging Face.
// Covered by tests/data/test_tokenizer.cpp (Load* tests on malformed files, corpus tests).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>

#include "core/error.h"
#include "data/tokenizer_impl.h"

namespace lathe::data {

using nlohmann::json;

namespace {

// GPT-2's split pattern, which HF's ByteLevel pre-tokenizer applies when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Reads JSON fields with the file name and JSON path in every error.
class Reader {
 public:
  explicit Reader(std::string_view source) : source_(source) {}

  template <class... Args>
  [[noreturn]] void fail(std::string_view path, fmt::format_string<Args...> f, Args&&... args) const {
    LATHE_FAIL("tokenizer: {}: {}: {}", source_, path, fmt::format(f, std::forward<Args>(args)...));
  }

  const json& object(const json& j, std::string_view path) const {
    if (!j.is_object()) fail(path, "expected an object, found {}", j.type_name());
    return j;
  }

  void check_keys(const json& obj, std::string_view path, std::initializer_list<std::string_view> allowed) const {
    for (const auto& [key, value] : obj.items()) {
      if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
        fail(path, "unknown field {:?} (not implemented; refusing rather than ignoring it)", key);
      }
    }
  }

  const json& require(const json& obj, std::string_view key, std::string_view path) const {
    const auto it = obj.find(key);
    if (it == obj.end()) fail(path, "missing field {:?}", key);
    return *it;
  }

  std::string string(const json& obj, std::string_view key, std::string_view path) const {
    const json& v = require(obj, key, path);
    if (!v.is_string()) fail(join(path, key), "expected a string, found {}", v.type_name());
    return v.get<std::string>();
  }

  bool boolean(const json& obj, std::string_view key, std::string_view path, bool fallback) const {
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) fail(join(path, key), "expected true or false, found {}", it->type_name());
    return it->get<bool>();
  }

  // A field that must be absent, null, or equal to `expected` (an option we do not implement).
  void expect_bool(const json& obj, std::string_view key, std::string_view path, bool expected) const {
    if (boolean(obj, key, path, expected) != expected) {
      fail(join(path, key), "value {} is not supported (only {})", !expected, expected);
    }
  }

  void expect_empty_string(const json& obj, std::string_view key, std::string_view path) const {
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return;
    if (!it->is_string() || !it->get<std::string>().empty()) {
      fail(join(path, key), "value {} is not supported (only null or \"\")", it->dump());
    }
  }

  const std::string& source() const { return source_; }
  static std::string join(std::string_view path, std::string_view key) { return fmt::format("{}.{}", path, key); }
  static std::string index(std::string_view path, size_t i) { return fmt::format("{}[{}]", path, i); }

 private:
  std::string source_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LATHE_CHECK(in.good(), "tokenizer: cannot open {}: {}", path, std::strerror(errno));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  LATHE_CHECK(!in.bad(), "tokenizer: error reading {}", path);
  return buffer.str();
}

json parse_json(std::string_view text, std::string_view source) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    LATHE_FAIL("tokenizer: {}: not valid JSON: {}", source, e.what());
  }
}

void load_normalizer(const Reader& r, const json& j, std::string_view path, TokenizerImpl& impl) {
  if (j.is_null()) return;
  r.object(j, path);
  const std::string type = r.string(j, "type", path);
  if (type == "NFC") {
    r.check_keys(j, path, {"type"});
    impl.nfc = true;
  } else if (type == "Sequence") {
    r.check_keys(j, path, {"type", "normalizers"});
    const json& list = r.require(j, "normalizers", path);
    if (!list.is_array()) r.fail(Reader::join(path, "normalizers"), "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      load_normalizer(r, list[i], Reader::index(Reader::join(path, "normalizers"), i), impl);
    }
  } else {
    r.fail(Reader::join(path, "type"), "normalizer {:?} is not supported (supported: NFC, Sequence of NFC)", type);
  }
}

// Appends split steps; sets `byte_level` once a ByteLevel step is seen (it must come last).
void load_pre_tokenizer(const Reader& r, const json& j, std::string_view path, TokenizerImpl& impl,
                        bool& byte_level) {
  r.object(j, path);
  if (byte_level) r.fail(path, "a pre-tokenizer after ByteLevel is not supported");
  const std::string type = r.string(j, "type", path);
  if (type == "Sequence") {
    r.check_keys(j, path, {"type", "pretokenizers"});
    const json& list = r.require(j, "pretokenizers", path);
    if (!list.is_array()) r.fail(Reader::join(path, "pretokenizers"), "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      load_pre_tokenizer(r, list[i], Reader::index(Reader::join(path, "pretokenizers"), i), impl, byte_level);
    }
  } else if (type == "Split") {
    r.check_keys(j, path, {"type", "pattern", "behavior", "invert"});
    r.expect_bool(j, "invert", path, false);
    const std::string behavior_name = r.string(j, "behavior", path);
    RegexSplitter::Behavior behavior;
    if (behavior_name == "Isolated") behavior = RegexSplitter::Behavior::kIsolated;
    else if (behavior_name == "Removed") behavior = RegexSplitter::Behavior::kRemoved;
    else r.fail(Reader::join(path, "behavior"), "{:?} is not supported (supported: Isolated, Removed)", behavior_name);
    const std::string pattern_path = Reader::join(path, "pattern");
    const json& pattern = r.object(r.require(j, "pattern", path), pattern_path);
    r.check_keys(pattern, pattern_path, {"Regex", "String"});
    const std::string where = fmt::format("{}: {}", r.source(), pattern_path);
    if (pattern.contains("Regex")) {
      const std::string onig = r.string(pattern, "Regex", pattern_path);
      impl.splits.push_back(std::make_unique<RegexSplitter>(onig_to_pcre2(onig, where), false, behavior, where));
    } else {
      const std::string literal = r.string(pattern, "String", pattern_path);
      if (literal.empty()) r.fail(pattern_path, "an empty String pattern is not supported");
      impl.splits.push_back(std::make_unique<RegexSplitter>(literal, true, behavior, where));
    }
  } else if (type == "ByteLevel") {
    r.check_keys(j, path, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
    r.expect_bool(j, "add_prefix_space", path, false);
    r.boolean(j, "trim_offsets", path, true);  // offsets only; ids are unaffected
    if (r.boolean(j, "use_regex", path, true)) {
      const std::string where = fmt::format("{}: {} (ByteLevel use_regex)", r.source(), path);
      impl.splits.push_back(std::make_unique<RegexSplitter>(onig_to_pcre2(kGpt2Pattern, where), false,
                                                            RegexSplitter::Behavior::kIsolated, where));
    }
    byte_level = true;
  } else {
    r.fail(Reader::join(path, "type"), "pre-tokenizer {:?} is not supported (supported: Sequence, Split, ByteLevel)",
           type);
  }
}

void load_byte_level_only(const Reader& r, const json& j, std::string_view path, std::string_view role) {
  r.object(j, path);
  const std::string type = r.string(j, "type", path);
  if (type != "ByteLevel") {
    r.fail(Reader::join(path, "type"), "{} {:?} is not supported (supported: ByteLevel)", role, type);
  }
  // add_prefix_space / trim_offsets / use_regex do not change ids or decoded text here.
  r.check_keys(j, path, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
}

void load_model(const Reader& r, const json& j, TokenizerImpl& impl, std::string_view source) {
  const std::string path = "model";
  r.object(j, path);
  r.check_keys(j, path,
               {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                "byte_fallback", "ignore_merges", "vocab", "merges"});
  const std::string type = r.string(j, "type", path);
  if (type != "BPE") r.fail("model.type", "model {:?} is not supported (supported: BPE)", type);
  if (const auto it = j.find("dropout"); it != j.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 0.0) {
      r.fail("model.dropout", "BPE dropout {} is not supported (only null)", it->dump());
    }
  }
  r.expect_empty_string(j, "continuing_subword_prefix", path);
  r.expect_empty_string(j, "end_of_word_suffix", path);
  // unk_token, fuse_unk and byte_fallback only act on symbols missing from the vocab; BpeModel
  // refuses a vocab that lacks any byte symbol, so they can never trigger.
  if (const auto it = j.find("unk_token"); it != j.end() && !it->is_null() && !it->is_string()) {
    r.fail("model.unk_token", "expected a string or null");
  }
  r.boolean(j, "fuse_unk", path, false);
  r.boolean(j, "byte_fallback", path, false);
  const bool ignore_merges = r.boolean(j, "ignore_merges", path, false);

  const json& vocab_json = r.require(j, "vocab", path);
  if (!vocab_json.is_object()) r.fail("model.vocab", "expected an object token -> id");
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(vocab_json.size());
  for (const auto& [token, id] : vocab_json.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      r.fail("model.vocab", "token {:?} has id {}, expected a non-negative 32-bit integer", token, id.dump());
    }
    vocab.emplace_back(token, id.get<int32_t>());
  }

  const json& merges_json = r.require(j, "merges", path);
  if (!merges_json.is_array()) r.fail("model.merges", "expected an array");
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(merges_json.size());
  for (size_t i = 0; i < merges_json.size(); ++i) {
    const json& m = merges_json[i];
    if (m.is_string()) {  // legacy "left right"
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
          s.find(' ', space + 1) != std::string::npos) {
        r.fail(Reader::index("model.merges", i), "{:?} is not two tokens separated by one space", s);
      }
      merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      r.fail(Reader::index("model.merges", i), "expected \"a b\" or [\"a\", \"b\"], found {}", m.dump());
    }
  }
  impl.model = std::make_unique<BpeModel>(std::move(vocab), merges, ignore_merges, source);
}

void load_added_tokens(const Reader& r, const json& j, TokenizerImpl& impl) {
  if (j.is_null()) return;
  if (!j.is_array()) r.fail("added_tokens", "expected an array");
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string path = Reader::index("added_tokens", i);
    const json& t = r.object(j[i], path);
    r.check_keys(t, path, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
    AddedToken token;
    const json& id = r.require(t, "id", path);
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      r.fail(Reader::join(path, "id"), "expected a non-negative 32-bit integer, found {}", id.dump());
    }
    token.id = id.get<int32_t>();
    token.content = r.string(t, "content", path);
    if (token.content.empty()) r.fail(Reader::join(path, "content"), "an empty added token is not supported");
    if (find_invalid_utf8(token.content) != std::string::npos) {
      r.fail(Reader::join(path, "content"), "not valid UTF-8");
    }
    token.special = r.boolean(t, "special", path, false);
    token.single_word = r.boolean(t, "single_word", path, false);
    token.lstrip = r.boolean(t, "lstrip", path, false);
    token.rstrip = r.boolean(t, "rstrip", path, false);
    token.normalized = r.boolean(t, "normalized", path, !token.special);
    if (const auto model_id = impl.model->token_to_id(token.content); model_id && *model_id != token.id) {
      r.fail(Reader::join(path, "id"), "{:?} has id {} but the model vocab has it as {}", token.content, token.id,
             *model_id);
    }
    if (const auto other = impl.model->id_to_token(token.id); other && *other != token.content) {
      r.fail(Reader::join(path, "id"), "id {} of {:?} is taken by model token {:?}", token.id, token.content,
             std::string(*other));
    }
    const int32_t index = static_cast<int32_t>(impl.added.size());
    if (!impl.added_by_content.emplace(token.content, index).second) {
      r.fail(Reader::join(path, "content"), "duplicate added token {:?}", token.content);
    }
    for (const AddedToken& prior : impl.added) {
      if (prior.id == token.id) r.fail(Reader::join(path, "id"), "id {} is used by {:?} too", token.id, prior.content);
    }
    if (token.normalized) {
      std::string nfc_content;
      const bool changed = impl.nfc && nfc_normalize(token.content, nfc_content);
      impl.normalized_trie.add(changed ? nfc_content : token.content, index);
    } else {
      impl.raw_trie.add(token.content, index);
    }
    impl.added.push_back(std::move(token));
  }
}

// Precomputes, per id, the bytes HF's ByteLevel decoder produces and whether the id is special.
void build_id_tables(TokenizerImpl& impl) {
  int32_t size = impl.model->id_limit();
  for (const AddedToken& t : impl.added) {
    if (static_cast<size_t>(t.id) >= 4 * (impl.model->vocab_count() + impl.added.size()) + 1024) {
      LATHE_FAIL("tokenizer: {}: added_tokens: id {} of {:?} is far beyond the vocabulary ({} entries)",
                 impl.source, t.id, t.content, impl.model->vocab_count());
    }
    size = std::max(size, t.id + 1);
  }
  impl.vocab_size = size;
  impl.decoded.assign(size, std::string());
  impl.kind.assign(size, TokenizerImpl::Kind::kAbsent);
  impl.added_index_of_id.assign(size, -1);
  auto decode_token = [](std::string_view token, std::string& out) {
    if (!byte_level_to_bytes(token, out)) out.assign(token);  // a char outside the table: raw bytes
  };
  for (int32_t id = 0; id < impl.model->id_limit(); ++id) {
    if (const auto token = impl.model->id_to_token(id)) {
      decode_token(*token, impl.decoded[id]);
      impl.kind[id] = TokenizerImpl::Kind::kModel;
    }
  }
  for (size_t i = 0; i < impl.added.size(); ++i) {
    const AddedToken& t = impl.added[i];
    impl.decoded[t.id].clear();
    decode_token(t.content, impl.decoded[t.id]);
    impl.kind[t.id] = t.special ? TokenizerImpl::Kind::kSpecial : TokenizerImpl::Kind::kAdded;
    impl.added_index_of_id[t.id] = static_cast<int32_t>(i);
  }
}

// eos_token / pad_token / bos_token: a string, {"content": ...}, or null.
std::optional<int32_t> config_token(const Reader& r, const json& config, std::string_view key,
                                    const Tokenizer& tokenizer) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  std::string content;
  if (it->is_string()) {
    content = it->get<std::string>();
  } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    content = (*it)["content"].get<std::string>();
  } else {
    r.fail(key, "expected a token string, {{\"content\": ...}} or null, found {}", it->dump());
  }
  const auto id = tokenizer.token_to_id(content);
  if (!id) r.fail(key, "token {:?} is not in the vocabulary", content);
  return id;
}

}  // namespace

void AddedTokenTrie::add(std::string_view content, int32_t token_index) {
  int32_t node = 0;
  for (char ch : content) {
    const auto b = static_cast<unsigned char>(ch);
    auto& children = nodes_[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(b, int32_t{-1}));
    if (it == children.end() || it->first != b) {
      const int32_t child = static_cast<int32_t>(nodes_.size());
      children.insert(it, {b, child});
      nodes_.emplace_back();  // invalidates `children`; not used after this
      node = child;
    } else {
      node = it->second;
    }
  }
  nodes_[node].token = token_index;
  first_byte_[static_cast<unsigned char>(content[0])] = true;
}

int32_t AddedTokenTrie::longest_at(std::string_view text, size_t pos, size_t& length) const {
  int32_t node = 0, best = -1;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto b = static_cast<unsigned char>(text[i]);
    const auto& children = nodes_[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(b, int32_t{-1}));
    if (it == children.end() || it->first != b) break;
    node = it->second;
    if (nodes_[node].token >= 0) {
      best = nodes_[node].token;
      length = i + 1 - pos;
    }
  }
  return best;
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               std::string_view source) {
  auto impl = std::make_unique<TokenizerImpl>();
  impl->source = std::string(source);
  const Reader r(source);
  const json root = parse_json(tokenizer_json, source);
  r.object(root, "(root)");
  r.check_keys(root, "(root)",
               {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "post_processor",
                "decoder", "model"});
  if (const auto it = root.find("version"); it != root.end() && !(it->is_string() && *it == "1.0")) {
    r.fail("version", "format version {} is not supported (only \"1.0\")", it->dump());
  }
  for (const char* key : {"truncation", "padding"}) {
    if (const auto it = root.find(key); it != root.end() && !it->is_null()) {
      r.fail(key, "{} is not supported (must be null; Lathe truncates and pads itself)", key);
    }
  }
  load_model(r, r.require(root, "model", "(root)"), *impl, source);
  if (const auto it = root.find("normalizer"); it != root.end()) load_normalizer(r, *it, "normalizer", *impl);

  const auto pre = root.find("pre_tokenizer");
  if (pre == root.end() || pre->is_null()) {
    r.fail("pre_tokenizer", "missing; a byte-level BPE needs a ByteLevel pre-tokenizer");
  }
  bool byte_level = false;
  load_pre_tokenizer(r, *pre, "pre_tokenizer", *impl, byte_level);
  if (!byte_level) r.fail("pre_tokenizer", "no ByteLevel step; only byte-level BPE is supported");

  if (const auto it = root.find("post_processor"); it != root.end() && !it->is_null()) {
    load_byte_level_only(r, *it, "post_processor", "post-processor");
  }
  const auto decoder = root.find("decoder");
  if (decoder == root.end() || decoder->is_null()) r.fail("decoder", "missing; expected a ByteLevel decoder");
  load_byte_level_only(r, *decoder, "decoder", "decoder");

  if (const auto it = root.find("added_tokens"); it != root.end()) load_added_tokens(r, *it, *impl);
  build_id_tables(*impl);

  Tokenizer tokenizer(std::move(impl));
  if (!config_json.empty()) {
    const std::string config_source = fmt::format("{} (tokenizer_config.json)", source);
    const Reader cr(config_source);
    const json config = parse_json(config_json, config_source);
    cr.object(config, "(root)");
    TokenizerImpl& state = *tokenizer.impl_;
    state.eos = config_token(cr, config, "eos_token", tokenizer);
    state.pad = config_token(cr, config, "pad_token", tokenizer);
    state.bos = config_token(cr, config, "bos_token", tokenizer);
  }
  return tokenizer;
}

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json) {
  const std::string text = read_file(tokenizer_json);
  const std::filesystem::path config_path =
      std::filesystem::path(tokenizer_json).parent_path() / "tokenizer_config.json";
  std::string config;
  std::error_code ec;
  if (std::filesystem::exists(config_path, ec)) config = read_file(config_path.string());
  return from_json(text, config, tokenizer_json);
}

Tokenizer Tokenizer::from_dir(const std::string& dir) {
  const std::filesystem::path path = std::filesystem::path(dir) / "tokenizer.json";
  std::error_code ec;
  LATHE_CHECK(std::filesystem::exists(path, ec), "tokenizer: {} has no tokenizer.json", dir);
  return from_file(path.string());
}

}  // namespace lathe::data
