// Tokenizer run time: encode (added tokens -> NFC -> regex splits -> byte-level BPE) and decode.
// Convention: the order of steps is HF's AddedVocabulary::extract_and_normalize followed by the
// pre-tokenizer and model; lstrip/rstrip/single_word use Unicode White_Space and Rust regex's \w
// (Alphabetic, marks, Nd, Pc, Join_Control), which is what HF evaluates them with.
// Covered by tests/data/test_tokenizer.cpp.
#include "data/tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>

#include "core/error.h"
#include "data/tokenizer_impl.h"

namespace lathe::data {

namespace {

bool is_word_char(char32_t c) {
  const auto cp = static_cast<UChar32>(c);
  return u_hasBinaryProperty(cp, UCHAR_ALPHABETIC) ||
         (U_GET_GC_MASK(cp) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0 ||
         u_hasBinaryProperty(cp, UCHAR_JOIN_CONTROL);
}

bool is_white_space(char32_t c) { return u_isUWhiteSpace(static_cast<UChar32>(c)); }

// The code point that ends text[0, end), and its start offset.
char32_t last_code_point(std::string_view text, size_t end, size_t& start) {
  start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  size_t i = start;
  return next_code_point(text, i);
}

}  // namespace

template <class Plain>
void TokenizerImpl::split_added(std::string_view text, const AddedTokenTrie& trie, std::vector<int32_t>& ids,
                                  Plain&& plain) const {
  if (trie.empty()) {
    if (!text.empty()) plain(text);
    return;
  }
  size_t emitted = 0;  // text before this offset has been handed out
  size_t pos = 0;
  while (pos < text.size()) {
    if (!trie.may_start(static_cast<unsigned char>(text[pos]))) {
      ++pos;
      continue;
    }
    size_t length = 0;
    const int32_t index = trie.longest_at(text, pos, length);
    if (index < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = added[index];
    size_t start = pos, stop = pos + length;
    pos = stop;  // matching resumes after this match, kept or not (non-overlapping iteration)
    if (token.single_word) {
      size_t before = 0;
      const bool word_before = start > 0 && is_word_char(last_code_point(text, start, before));
      size_t after = stop;
      const bool word_after = stop < text.size() && is_word_char(next_code_point(text, after));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      size_t s = start;
      while (s > emitted) {
        size_t cp_start = 0;
        if (!is_white_space(last_code_point(text, s, cp_start))) break;
        s = cp_start;
      }
      start = s;
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t next = stop;
        if (!is_white_space(next_code_point(text, next))) break;
        stop = next;
      }
      pos = stop;
    }
    if (start > emitted) plain(text.substr(emitted, start - emitted));
    ids.push_back(token.id);
    emitted = stop;
  }
  if (emitted < text.size()) plain(text.substr(emitted));
}

void TokenizerImpl::encode_pretokenized(std::string_view text, std::vector<int32_t>& ids) const {
  thread_local std::vector<std::string_view> pieces, next_pieces;
  pieces.clear();
  pieces.push_back(text);
  for (const auto& splitter : splits) {
    next_pieces.clear();
    for (std::string_view piece : pieces) splitter->split(piece, next_pieces);
    pieces.swap(next_pieces);
  }
  for (std::string_view piece : pieces) model->encode_word(piece, ids);
}

void TokenizerImpl::encode_segment(std::string_view text, std::vector<int32_t>& ids) const {
  thread_local std::string normalized;
  std::string_view view = text;
  if (nfc && nfc_normalize(text, normalized)) view = normalized;
  split_added(view, normalized_trie, ids, [&](std::string_view piece) { encode_pretokenized(piece, ids); });
}

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

void Tokenizer::encode_into(std::string_view text, std::vector<int32_t>& ids) const {
  const size_t bad = find_invalid_utf8(text);
  LATHE_CHECK(bad == std::string_view::npos,
              "tokenizer: input text is not valid UTF-8 (byte 0x{:02X} at offset {} of {}); "
              "clean it first, e.g. with lathe::data::replace_invalid_utf8",
              static_cast<unsigned char>(text[bad == std::string_view::npos ? 0 : bad]), bad, text.size());
  const TokenizerImpl& impl = *impl_;
  impl.split_added(text, impl.raw_trie, ids, [&](std::string_view piece) { impl.encode_segment(piece, ids); });
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  encode_into(text, ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const TokenizerImpl& impl = *impl_;
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    LATHE_CHECK(id >= 0 && id < impl.vocab_size && impl.kind[id] != TokenizerImpl::Kind::kAbsent,
                "tokenizer: decode: id {} (position {}) is not in the vocabulary of {} (size {})", id, i,
                impl.source, impl.vocab_size);
    if (skip_special_tokens && impl.kind[id] == TokenizerImpl::Kind::kSpecial) continue;
    bytes += impl.decoded[id];
  }
  if (find_invalid_utf8(bytes) == std::string::npos) return bytes;
  return replace_invalid_utf8(bytes);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) {
    return impl_->added[it->second].id;
  }
  return impl_->model->token_to_id(token);
}

std::optional<std::string_view> Tokenizer::id_to_token(int32_t id) const {
  if (id >= 0 && id < impl_->vocab_size && impl_->added_index_of_id[id] >= 0) {
    return std::string_view(impl_->added[impl_->added_index_of_id[id]].content);
  }
  return impl_->model->id_to_token(id);
}

std::vector<int32_t> Tokenizer::ids_without_token(int64_t below) const {
  std::vector<int32_t> out;
  for (int32_t id = 0; id < int32_t(std::min<int64_t>(below, vocab_size())); ++id)
    if (!id_to_token(id)) out.push_back(id);
  return out;
}

std::vector<int32_t> Tokenizer::end_of_turn_ids() const {
  std::vector<int32_t> ids;
  if (eos_id()) ids.push_back(*eos_id());
  if (auto im_end = token_to_id("<|im_end|>"); im_end && (ids.empty() || ids[0] != *im_end)) ids.push_back(*im_end);
  return ids;
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < impl_->vocab_size && impl_->kind[id] == TokenizerImpl::Kind::kSpecial;
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<int32_t> Tokenizer::pad_id() const { return impl_->pad; }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }

}  // namespace lathe::data
