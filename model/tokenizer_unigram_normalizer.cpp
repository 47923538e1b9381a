// SentencePiece's normalizer (tokenizer_unigram_detail.h): UTF-8 as sentencepiece's util.cc sees it, the
// precompiled charsmap (a Darts double-array trie over UTF-8 and its replacement strings), user-defined symbols kept
// whole, and the whitespace handling (dummy prefix, collapsing and trimming, spaces escaped as U+2581).
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "model/tokenizer_unigram_detail.h"

namespace skyreels::model {

namespace tokenizer_unigram_detail {
namespace {

bool is_trail(unsigned char c) { return (c & 0xC0) == 0x80; }
bool valid_codepoint(uint32_t c) { return c < 0xD800 || (c >= 0xE000 && c <= 0x10FFFF); }

}  // namespace

// string_util::IsValidDecodeUTF8: true and the length of one valid character; false (length 1) otherwise.
bool valid_utf8_prefix(std::string_view s, size_t* len) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  *len = 1;
  if (b[0] < 0x80) return true;
  if (n >= 2 && (b[0] & 0xE0) == 0xC0) {
    const uint32_t cp = ((b[0] & 0x1Fu) << 6) | (b[1] & 0x3Fu);
    if (is_trail(b[1]) && cp >= 0x80 && valid_codepoint(cp)) return *len = 2, true;
  } else if (n >= 3 && (b[0] & 0xF0) == 0xE0) {
    const uint32_t cp = ((b[0] & 0x0Fu) << 12) | ((b[1] & 0x3Fu) << 6) | (b[2] & 0x3Fu);
    if (is_trail(b[1]) && is_trail(b[2]) && cp >= 0x800 && valid_codepoint(cp)) return *len = 3, true;
  } else if (n >= 4 && (b[0] & 0xF8) == 0xF0) {
    const uint32_t cp = ((b[0] & 0x07u) << 18) | ((b[1] & 0x3Fu) << 12) | ((b[2] & 0x3Fu) << 6) | (b[3] & 0x3Fu);
    if (is_trail(b[1]) && is_trail(b[2]) && is_trail(b[3]) && cp >= 0x10000 && valid_codepoint(cp)) {
      return *len = 4, true;
    }
  }
  return false;
}

// The code point starting at `pos` (U+FFFD for a byte that starts no valid character); returns its length.
size_t decode_one(std::string_view s, size_t pos, char32_t* cp) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  size_t len = 1;
  if (!valid_utf8_prefix(s.substr(pos), &len)) {
    *cp = 0xFFFD;
    return 1;
  }
  uint32_t v = b[pos];
  if (len == 2) v = ((b[pos] & 0x1Fu) << 6) | (b[pos + 1] & 0x3Fu);
  if (len == 3) v = ((b[pos] & 0x0Fu) << 12) | ((b[pos + 1] & 0x3Fu) << 6) | (b[pos + 2] & 0x3Fu);
  if (len == 4) {
    v = ((b[pos] & 0x07u) << 18) | ((b[pos + 1] & 0x3Fu) << 12) | ((b[pos + 2] & 0x3Fu) << 6) | (b[pos + 3] & 0x3Fu);
  }
  *cp = v;
  return len;
}

}  // namespace tokenizer_unigram_detail

namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581, sentencepiece's escaped space

}  // namespace

using tokenizer_unigram_detail::valid_utf8_prefix;

// ---- SentencePieceUnigram::Impl: the normalizer ---------------------------------------------------------------------

void SentencePieceUnigram::Impl::init_normalizer() {
  const std::string& blob = proto.precompiled_charsmap;
  if (blob.empty()) return;
  // <uint32 trie size><trie units><replacement strings>
  uint32_t trie_size = 0;
  if (blob.size() <= 4) fail("precompiled_charsmap is broken (" + std::to_string(blob.size()) + " bytes)");
  for (int i = 0; i < 4; ++i) trie_size |= static_cast<uint32_t>(static_cast<uint8_t>(blob[i])) << (8 * i);
  if (trie_size >= blob.size() || trie_size % 4 != 0) fail("precompiled_charsmap trie size exceeds the blob");
  trie.resize(trie_size / 4);
  for (size_t u = 0; u < trie.size(); ++u) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(blob[4 + 4 * u + i])) << (8 * i);
    trie[u] = v;
  }
  replacements = std::string_view(blob).substr(4 + trie_size);
  if (trie.empty()) fail("precompiled_charsmap has an empty trie");
}

// Darts commonPrefixSearch: the longest rule matching a prefix of `input` (length, value); length 0 if none.
std::pair<size_t, uint32_t> SentencePieceUnigram::Impl::longest_rule(std::string_view input) const {
  if (trie.empty()) return {0, 0};
  auto offset = [](uint32_t unit) { return (unit >> 10) << ((unit & (1u << 9)) >> 6); };
  auto label = [](uint32_t unit) { return unit & ((1u << 31) | 0xFFu); };
  auto has_leaf = [](uint32_t unit) { return ((unit >> 8) & 1u) == 1u; };
  size_t best_len = 0;
  uint32_t best_value = 0;
  size_t node = offset(trie[0]);
  for (size_t i = 0; i < input.size(); ++i) {
    const auto c = static_cast<uint8_t>(input[i]);
    node ^= c;
    if (node >= trie.size()) break;
    const uint32_t unit = trie[node];
    if (label(unit) != c) break;
    node ^= offset(unit);
    if (has_leaf(unit)) {
      if (node >= trie.size()) fail("precompiled_charsmap trie points outside itself");
      best_len = i + 1;
      best_value = trie[node] & ((1u << 31) - 1);
    }
  }
  return {best_len, best_value};
}

// Normalizer::NormalizePrefix: (normalized text of the next unit, bytes consumed).
std::pair<std::string_view, size_t> SentencePieceUnigram::Impl::normalize_prefix(std::string_view input) const {
  // The longest user-defined symbol at the start (sentencepiece's PrefixMatcher).
  for (size_t len = std::min(max_user_defined_bytes, input.size()); len > 0; --len) {
    if (user_defined.count(input.substr(0, len))) return {input.substr(0, len), len};
  }
  const auto [len, value] = longest_rule(input);
  if (len == 0) {
    size_t n = 1;
    if (!valid_utf8_prefix(input, &n)) return {std::string_view("\xEF\xBF\xBD"), 1};
    return {input.substr(0, n), n};
  }
  if (value >= replacements.size()) fail("precompiled_charsmap replacement offset out of range");
  const std::string_view rest = replacements.substr(value);
  const size_t end = rest.find('\0');
  return {rest.substr(0, end == std::string_view::npos ? rest.size() : end), len};
}

std::string SentencePieceUnigram::Impl::normalize(std::string_view input) const {
  std::string out;
  if (input.empty()) return out;
  if (proto.remove_extra_whitespaces) {
    while (!input.empty()) {
      const auto [sp, consumed] = normalize_prefix(input);
      if (sp != " ") break;
      input.remove_prefix(consumed);
    }
  }
  if (input.empty()) return out;
  const std::string_view space = proto.escape_whitespaces ? kSpaceSymbol : std::string_view(" ");
  const bool prefix = proto.add_dummy_prefix && !proto.treat_whitespace_as_suffix;
  const bool suffix = proto.add_dummy_prefix && proto.treat_whitespace_as_suffix;
  if (prefix) out += space;
  bool prev_space = proto.remove_extra_whitespaces;
  while (!input.empty()) {
    auto [sp, consumed] = normalize_prefix(input);
    while (prev_space && !sp.empty() && sp.front() == ' ') sp.remove_prefix(1);
    if (!sp.empty()) {
      for (char c : sp) {
        if (c == ' ' && proto.escape_whitespaces) {
          out += kSpaceSymbol;
        } else {
          out += c;
        }
      }
      prev_space = sp.back() == ' ';
    }
    input.remove_prefix(consumed);
    if (!proto.remove_extra_whitespaces) prev_space = false;
  }
  if (proto.remove_extra_whitespaces) {
    while (out.size() >= space.size() && std::string_view(out).substr(out.size() - space.size()) == space) {
      out.resize(out.size() - space.size());
    }
  }
  if (suffix) out += space;
  return out;
}

}  // namespace skyreels::model
