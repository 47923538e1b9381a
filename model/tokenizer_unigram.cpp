#include "model/tokenizer_unigram.h"

#include <algorithm>
#include <cfloat>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <unordered_set>

#include "model/prompt_clean.h"

namespace fs = std::filesystem;

namespace skyreels::model {
namespace {

// ---- protobuf wire format ------------------------------------------------------------------------------------------

class WireReader {
 public:
  WireReader(std::string_view data, std::string context) : data_(data), context_(std::move(context)) {}

  bool done() const { return pos_ >= data_.size(); }

  uint64_t varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) fail("truncated varint");
      const auto byte = static_cast<uint8_t>(data_[pos_++]);
      value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if (!(byte & 0x80)) return value;
    }
    fail("varint longer than 10 bytes");
    return 0;
  }

  // Reads a field key; returns (field number, wire type).
  std::pair<uint32_t, uint32_t> key() {
    const uint64_t k = varint();
    const auto field = static_cast<uint32_t>(k >> 3);
    if (field == 0) fail("field number 0");
    return {field, static_cast<uint32_t>(k & 7)};
  }

  std::string_view bytes() {
    const uint64_t len = varint();
    if (len > data_.size() - pos_) fail("length-delimited field runs past the end");
    std::string_view out = data_.substr(pos_, static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return out;
  }

  float fixed32_float() {
    if (data_.size() - pos_ < 4) fail("truncated fixed32");
    uint32_t bits = 0;
    for (int i = 0; i < 4; ++i) bits |= static_cast<uint32_t>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
    pos_ += 4;
    float value = 0;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }

  void skip(uint32_t wire_type) {
    switch (wire_type) {
      case 0:
        varint();
        break;
      case 1:
        advance(8);
        break;
      case 2:
        bytes();
        break;
      case 5:
        advance(4);
        break;
      default:
        fail("unsupported wire type " + std::to_string(wire_type) + " (groups are not used by ModelProto)");
    }
  }

  void expect(uint32_t wire_type, uint32_t expected, const char* field) {
    if (wire_type != expected) {
      fail(std::string("field ") + field + " has wire type " + std::to_string(wire_type) + ", expected " +
           std::to_string(expected));
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw TokenizerError(context_ + ": malformed sentencepiece model (" + what + " at byte " + std::to_string(pos_) +
                         ")");
  }

 private:
  void advance(size_t n) {
    if (data_.size() - pos_ < n) fail("truncated fixed-width field");
    pos_ += n;
  }
  std::string_view data_;
  std::string context_;
  size_t pos_ = 0;
};

SentencePieceModelProto::Piece parse_piece(std::string_view bytes, const std::string& context) {
  WireReader r(bytes, context + " (pieces)");
  SentencePieceModelProto::Piece piece;
  while (!r.done()) {
    const auto [field, wt] = r.key();
    if (field == 1) {
      r.expect(wt, 2, "piece");
      piece.piece = std::string(r.bytes());
    } else if (field == 2) {
      r.expect(wt, 5, "score");
      piece.score = r.fixed32_float();
    } else if (field == 3) {
      r.expect(wt, 0, "type");
      const uint64_t type = r.varint();
      if (type < 1 || type > 6) r.fail("unknown piece type " + std::to_string(type));
      piece.type = static_cast<SentencePieceModelProto::PieceType>(type);
    } else {
      r.skip(wt);
    }
  }
  return piece;
}

void parse_trainer_spec(std::string_view bytes, const std::string& context, SentencePieceModelProto& proto) {
  WireReader r(bytes, context + " (trainer_spec)");
  while (!r.done()) {
    const auto [field, wt] = r.key();
    if (field == 3) {
      r.expect(wt, 0, "model_type");
      proto.model_type = static_cast<int>(r.varint());
    } else if (field == 35) {
      r.expect(wt, 0, "byte_fallback");
      proto.byte_fallback = r.varint() != 0;
    } else if (field == 24) {
      r.expect(wt, 0, "treat_whitespace_as_suffix");
      proto.treat_whitespace_as_suffix = r.varint() != 0;
    } else {
      r.skip(wt);
    }
  }
}

void parse_normalizer_spec(std::string_view bytes, const std::string& context, SentencePieceModelProto& proto) {
  WireReader r(bytes, context + " (normalizer_spec)");
  while (!r.done()) {
    const auto [field, wt] = r.key();
    switch (field) {
      case 1:
        r.expect(wt, 2, "name");
        proto.normalizer_name = std::string(r.bytes());
        break;
      case 2:
        r.expect(wt, 2, "precompiled_charsmap");
        proto.precompiled_charsmap = std::string(r.bytes());
        break;
      case 3:
        r.expect(wt, 0, "add_dummy_prefix");
        proto.add_dummy_prefix = r.varint() != 0;
        break;
      case 4:
        r.expect(wt, 0, "remove_extra_whitespaces");
        proto.remove_extra_whitespaces = r.varint() != 0;
        break;
      case 5:
        r.expect(wt, 0, "escape_whitespaces");
        proto.escape_whitespaces = r.varint() != 0;
        break;
      default:
        r.skip(wt);
    }
  }
}

// ---- UTF-8, as sentencepiece's util.cc sees it ---------------------------------------------------------------------

// sentencepiece's OneCharLen: the length a lead byte announces (1 for stray continuation bytes).
size_t one_char_len(unsigned char lead) { return "\1\1\1\1\1\1\1\1\1\1\1\1\2\2\3\4"[lead >> 4]; }

bool is_trail(unsigned char c) { return (c & 0xC0) == 0x80; }
bool valid_codepoint(uint32_t c) { return c < 0xD800 || (c >= 0xE000 && c <= 0x10FFFF); }

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

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581, sentencepiece's escaped space

// Python's str.lstrip() / rstrip() on UTF-8 (whitespace per str.isspace()).
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

std::string py_lstrip(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    char32_t cp = 0;
    const size_t len = decode_one(s, pos, &cp);
    if (!is_python_space(cp)) break;
    pos += len;
  }
  return std::string(s.substr(pos));
}

std::string py_rstrip(std::string_view s) {
  size_t keep = 0;  // end of the last non-space character
  for (size_t pos = 0; pos < s.size();) {
    char32_t cp = 0;
    const size_t len = decode_one(s, pos, &cp);
    pos += len;
    if (!is_python_space(cp)) keep = pos;
  }
  return std::string(s.substr(0, keep));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TokenizerError("cannot read tokenizer file '" + path + "'");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

}  // namespace

SentencePieceModelProto SentencePieceModelProto::parse(std::string_view bytes, const std::string& source) {
  SentencePieceModelProto proto;
  WireReader r(bytes, source);
  while (!r.done()) {
    const auto [field, wt] = r.key();
    if (field == 1) {
      r.expect(wt, 2, "pieces");
      proto.pieces.push_back(parse_piece(r.bytes(), source));
    } else if (field == 2) {
      r.expect(wt, 2, "trainer_spec");
      parse_trainer_spec(r.bytes(), source, proto);
    } else if (field == 3) {
      r.expect(wt, 2, "normalizer_spec");
      parse_normalizer_spec(r.bytes(), source, proto);
    } else {
      r.skip(wt);
    }
  }
  return proto;
}

// ---- SentencePieceUnigram ------------------------------------------------------------------------------------------

struct SentencePieceUnigram::Impl {
  SentencePieceModelProto proto;
  std::string source;
  // Keys view the piece strings of `proto` (never resized after construction; Impl lives on the heap).
  std::unordered_map<std::string_view, int> pieces;    // NORMAL, USER_DEFINED, UNUSED: what the Viterbi can emit
  std::unordered_map<std::string_view, int> reserved;  // CONTROL, UNKNOWN, BYTE
  std::unordered_set<std::string_view> user_defined;   // kept whole by the normalizer
  size_t max_piece_bytes = 0;
  size_t max_user_defined_bytes = 0;
  int unk_id = -1;
  float min_score = FLT_MAX;
  float max_score = FLT_MIN;
  std::vector<int> byte_ids;  // byte -> id of <0xNN> when byte fallback is on
  // The precompiled charsmap: Darts double-array units and the NUL-separated replacement strings.
  std::vector<uint32_t> trie;
  std::string_view replacements;

  [[noreturn]] void fail(const std::string& what) const {
    throw TokenizerError(source + ": unusable sentencepiece model (" + what + ")");
  }

  void init_pieces() {
    if (proto.model_type != 1) {
      fail("model_type " + std::to_string(proto.model_type) + " is not UNIGRAM; only unigram models are supported");
    }
    if (proto.pieces.empty()) fail("no pieces");
    std::vector<bool> byte_found(256, false);
    byte_ids.assign(256, -1);
    for (size_t i = 0; i < proto.pieces.size(); ++i) {
      const auto& p = proto.pieces[i];
      const int id = static_cast<int>(i);
      if (p.piece.empty()) fail("piece " + std::to_string(i) + " is empty");
      using T = SentencePieceModelProto::PieceType;
      const bool normal = p.type == T::Normal || p.type == T::UserDefined || p.type == T::Unused;
      auto& table = normal ? pieces : reserved;
      if (!table.emplace(p.piece, id).second) fail("piece '" + p.piece + "' is defined twice");
      if (normal) max_piece_bytes = std::max(max_piece_bytes, p.piece.size());
      if (p.type == T::UserDefined) {
        user_defined.insert(p.piece);
        max_user_defined_bytes = std::max(max_user_defined_bytes, p.piece.size());
      }
      if (p.type == T::Normal) {
        min_score = std::min(min_score, p.score);
        max_score = std::max(max_score, p.score);
      }
      if (p.type == T::Unknown) {
        if (unk_id >= 0) fail("two unknown pieces");
        unk_id = id;
      }
      if (p.type == T::Byte) {
        if (!proto.byte_fallback) fail("byte piece " + p.piece + " although byte_fallback is off");
        unsigned value = 0;
        char tail = 0;
        if (p.piece.size() != 6 || std::sscanf(p.piece.c_str(), "<0x%2X>%c", &value, &tail) != 1 || value > 255) {
          fail("invalid byte piece " + p.piece);
        }
        byte_found[value] = true;
        byte_ids[value] = id;
      }
    }
    if (unk_id < 0) fail("no unknown piece");
    if (proto.byte_fallback && std::find(byte_found.begin(), byte_found.end(), false) != byte_found.end()) {
      fail("byte_fallback is on but there are not 256 byte pieces");
    }
  }

  void init_normalizer() {
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
  std::pair<size_t, uint32_t> longest_rule(std::string_view input) const {
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
  std::pair<std::string_view, size_t> normalize_prefix(std::string_view input) const {
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

  std::string normalize(std::string_view input) const {
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

  // unigram::Model::EncodeOptimized: Viterbi over byte positions, one unknown node per uncovered character.
  std::vector<std::pair<std::string_view, int>> viterbi(std::string_view text) const {
    struct Best {
      int id = -1;
      float score = 0.0f;
      int64_t starts_at = -1;
    };
    const auto size = static_cast<int64_t>(text.size());
    const float unk_score = min_score - 10.0f;
    std::vector<Best> best(text.size() + 1);
    using T = SentencePieceModelProto::PieceType;
    for (int64_t start = 0; start < size;) {
      const float till_here = best[static_cast<size_t>(start)].score;
      const auto mblen = static_cast<int64_t>(std::min<size_t>(
          one_char_len(static_cast<uint8_t>(text[static_cast<size_t>(start)])), static_cast<size_t>(size - start)));
      bool has_single_node = false;
      const size_t max_len = std::min(max_piece_bytes, static_cast<size_t>(size - start));
      for (size_t len = 1; len <= max_len; ++len) {
        auto it = pieces.find(text.substr(static_cast<size_t>(start), len));
        if (it == pieces.end()) continue;
        const auto& piece = proto.pieces[static_cast<size_t>(it->second)];
        if (piece.type == T::Unused) continue;
        // As in sentencepiece, the candidate is computed in double (the user-defined bonus is a double expression),
        // the stored best score in float.
        const double score = piece.type == T::UserDefined
                                 ? static_cast<double>(static_cast<float>(len) * max_score) - 0.1
                                 : static_cast<double>(piece.score);
        const double candidate = score + static_cast<double>(till_here);
        Best& target = best[static_cast<size_t>(start) + len];
        if (target.starts_at == -1 || candidate > static_cast<double>(target.score)) {
          target.score = static_cast<float>(candidate);
          target.starts_at = start;
          target.id = it->second;
        }
        if (!has_single_node && static_cast<int64_t>(len) == mblen) has_single_node = true;
      }
      if (!has_single_node) {
        Best& target = best[static_cast<size_t>(start + mblen)];
        const double candidate = static_cast<double>(unk_score) + static_cast<double>(till_here);
        if (target.starts_at == -1 || candidate > static_cast<double>(target.score)) {
          target.score = static_cast<float>(candidate);
          target.starts_at = start;
          target.id = unk_id;
        }
      }
      start += mblen;
    }
    std::vector<std::pair<std::string_view, int>> out;
    for (int64_t end = size; end > 0;) {
      const Best& node = best[static_cast<size_t>(end)];
      out.emplace_back(text.substr(static_cast<size_t>(node.starts_at), static_cast<size_t>(end - node.starts_at)),
                       node.id);
      end = node.starts_at;
    }
    std::reverse(out.begin(), out.end());
    return out;
  }

  // SentencePieceProcessor::Encode + PopulateSentencePieceText: byte fallback or merged unknown runs.
  std::vector<std::pair<std::string, int>> encode(std::string_view text) const {
    const std::string normalized = normalize(text);
    std::vector<std::pair<std::string, int>> out;
    bool prev_unk = false;
    for (const auto& [piece, id] : viterbi(normalized)) {
      const bool unk = id == unk_id;
      if (unk && proto.byte_fallback) {
        for (char b : piece) {
          const int byte_id = byte_ids[static_cast<uint8_t>(b)];
          out.emplace_back(proto.pieces[static_cast<size_t>(byte_id)].piece, byte_id);
        }
      } else if (unk && prev_unk) {
        out.back().first += std::string(piece);
      } else {
        out.emplace_back(std::string(piece), id);
      }
      prev_unk = unk;
    }
    return out;
  }
};

SentencePieceUnigram SentencePieceUnigram::load(const std::string& model_file) {
  const std::string bytes = read_file(model_file);
  return SentencePieceUnigram(SentencePieceModelProto::parse(bytes, model_file), model_file);
}

SentencePieceUnigram::SentencePieceUnigram(SentencePieceModelProto proto, std::string source)
    : impl_(std::make_unique<Impl>()) {
  impl_->proto = std::move(proto);
  impl_->source = std::move(source);
  impl_->init_pieces();
  impl_->init_normalizer();
}

SentencePieceUnigram::~SentencePieceUnigram() = default;
SentencePieceUnigram::SentencePieceUnigram(SentencePieceUnigram&&) noexcept = default;
SentencePieceUnigram& SentencePieceUnigram::operator=(SentencePieceUnigram&&) noexcept = default;

std::string SentencePieceUnigram::normalize(std::string_view text) const { return impl_->normalize(text); }

std::vector<std::pair<std::string, int>> SentencePieceUnigram::encode(std::string_view text) const {
  return impl_->encode(text);
}

std::vector<std::string> SentencePieceUnigram::encode_as_pieces(std::string_view text) const {
  std::vector<std::string> out;
  for (auto& [piece, id] : impl_->encode(text)) out.push_back(std::move(piece));
  return out;
}

std::vector<int> SentencePieceUnigram::encode_as_ids(std::string_view text) const {
  std::vector<int> out;
  for (const auto& [piece, id] : impl_->encode(text)) out.push_back(id);
  return out;
}

int SentencePieceUnigram::piece_to_id(std::string_view piece) const {
  if (auto it = impl_->reserved.find(piece); it != impl_->reserved.end()) return it->second;
  if (auto it = impl_->pieces.find(piece); it != impl_->pieces.end()) return it->second;
  return impl_->unk_id;
}

const std::string& SentencePieceUnigram::id_to_piece(int id) const {
  if (id < 0 || id >= piece_size()) {
    throw TokenizerError(impl_->source + ": id " + std::to_string(id) + " is outside the vocabulary of " +
                         std::to_string(piece_size()) + " pieces");
  }
  return impl_->proto.pieces[static_cast<size_t>(id)].piece;
}

int SentencePieceUnigram::piece_size() const { return static_cast<int>(impl_->proto.pieces.size()); }
int SentencePieceUnigram::unk_id() const { return impl_->unk_id; }
const SentencePieceModelProto& SentencePieceUnigram::proto() const { return impl_->proto; }
const std::string& SentencePieceUnigram::source() const { return impl_->source; }

// ---- T5Tokenizer ---------------------------------------------------------------------------------------------------

namespace {

T5TokenizerOptions read_tokenizer_config(const fs::path& file) {
  T5TokenizerOptions options;
  std::ifstream in(file);
  if (!in) throw TokenizerError("cannot read '" + file.string() + "'");
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw TokenizerError("'" + file.string() + "' is not valid JSON (" + e.what() + ")");
  }
  auto token_string = [&](const char* key, std::string& out) {
    if (!config.contains(key) || config[key].is_null()) return;
    const auto& v = config[key];
    if (v.is_string()) {
      out = v.get<std::string>();
    } else if (v.is_object() && v.contains("content") && v["content"].is_string()) {
      out = v["content"].get<std::string>();
    } else {
      throw TokenizerError("'" + file.string() + "': field '" + key + "' is neither a string nor a token object");
    }
  };
  token_string("eos_token", options.eos_token);
  token_string("pad_token", options.pad_token);
  token_string("unk_token", options.unk_token);
  options.extra_ids = 100;  // T5Tokenizer's own default when a config does not say
  if (config.contains("extra_ids")) {
    if (!config["extra_ids"].is_number_integer() || config["extra_ids"].get<int64_t>() < 0) {
      throw TokenizerError("'" + file.string() + "': field 'extra_ids' is not a non-negative integer");
    }
    options.extra_ids = config["extra_ids"].get<int64_t>();
  }
  if (config.contains("added_tokens_decoder")) {
    const auto& dec = config["added_tokens_decoder"];
    if (!dec.is_object()) throw TokenizerError("'" + file.string() + "': 'added_tokens_decoder' is not an object");
    for (auto it = dec.begin(); it != dec.end(); ++it) {
      const auto& t = it.value();
      AddedToken token;
      try {
        token.id = std::stoll(it.key());
        token.content = t.at("content").get<std::string>();
        token.lstrip = t.value("lstrip", false);
        token.rstrip = t.value("rstrip", false);
      } catch (const std::exception& e) {
        throw TokenizerError("'" + file.string() + "': added_tokens_decoder['" + it.key() + "'] is malformed (" +
                             e.what() + ")");
      }
      if (t.value("single_word", false)) {
        throw TokenizerError("'" + file.string() + "': added token '" + token.content +
                             "' has single_word=true, which is not supported");
      }
      options.added_tokens.push_back(token);
    }
  }
  return options;
}

}  // namespace

T5Tokenizer T5Tokenizer::load(const std::string& path) {
  fs::path p(path);
  if (!fs::exists(p)) throw TokenizerError("tokenizer path '" + path + "' does not exist");
  fs::path model_file = p;
  T5TokenizerOptions options;
  if (fs::is_directory(p)) {
    model_file = p / "spiece.model";
    if (!fs::exists(model_file)) {
      throw TokenizerError("tokenizer folder '" + path +
                           "' has no spiece.model (the SentencePiece model of a T5/UMT5 tokenizer)");
    }
    if (fs::exists(p / "tokenizer_config.json")) options = read_tokenizer_config(p / "tokenizer_config.json");
  }
  return T5Tokenizer(SentencePieceUnigram::load(model_file.string()), options);
}

T5Tokenizer::T5Tokenizer(SentencePieceUnigram model, T5TokenizerOptions options)
    : sp_(std::make_shared<const SentencePieceUnigram>(std::move(model))), extra_ids_(options.extra_ids) {
  auto special_id = [&](const std::string& content, const char* role) -> int64_t {
    for (const auto& t : options.added_tokens) {
      if (t.content == content) return t.id;
    }
    const int id = sp_->piece_to_id(content);
    if (id == sp_->unk_id() && content != sp_->id_to_piece(id)) {
      throw TokenizerError(sp_->source() + ": the " + role + " token '" + content + "' is not a piece of the model");
    }
    return id;
  };
  eos_id_ = special_id(options.eos_token, "eos");
  pad_id_ = special_id(options.pad_token, "pad");
  unk_id_ = special_id(options.unk_token, "unk");
  if (!options.added_tokens.empty()) {
    added_ = options.added_tokens;
  } else {
    const auto n = static_cast<int64_t>(sp_->piece_size());
    for (int64_t i = 0; i < options.extra_ids; ++i) {
      added_.push_back({"<extra_id_" + std::to_string(i) + ">", n - 1 + options.extra_ids - i, true, true});
    }
  }
  for (const auto& [content, id] : {std::pair{options.eos_token, eos_id_}, std::pair{options.pad_token, pad_id_},
                                    std::pair{options.unk_token, unk_id_}}) {
    const bool present =
        std::any_of(added_.begin(), added_.end(), [&](const AddedToken& t) { return t.content == content; });
    if (!present) added_.push_back({content, id, false, false});
  }
}

int64_t T5Tokenizer::vocab_size() const { return sp_->piece_size() + extra_ids_; }

std::vector<std::pair<std::string, int64_t>> T5Tokenizer::split_on_added_tokens(std::string_view text) const {
  // Leftmost-longest matches of the added tokens (transformers' Trie.split), then the strip rules.
  struct Part {
    std::string text;
    const AddedToken* token = nullptr;
  };
  std::vector<Part> parts;
  size_t piece_start = 0;
  for (size_t i = 0; i < text.size();) {
    const AddedToken* hit = nullptr;
    for (const auto& t : added_) {
      if (!t.content.empty() && text.substr(i, t.content.size()) == t.content &&
          (hit == nullptr || t.content.size() > hit->content.size())) {
        hit = &t;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    parts.push_back({std::string(text.substr(piece_start, i - piece_start)), nullptr});
    parts.push_back({hit->content, hit});
    i += hit->content.size();
    piece_start = i;
  }
  parts.push_back({std::string(text.substr(piece_start)), nullptr});
  // An empty text part between or around tokens is never produced by the trie split; drop it before the strip rules
  // look at neighbours, as transformers' list holds only non-empty strings.
  parts.erase(std::remove_if(parts.begin(), parts.end(), [](const Part& p) { return !p.token && p.text.empty(); }),
              parts.end());
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i].token) continue;
    if (parts[i].token->rstrip && i + 1 < parts.size() && !parts[i + 1].text.empty()) {
      parts[i + 1].text = py_lstrip(parts[i + 1].text);
    }
    if (parts[i].token->lstrip && i > 0 && !parts[i - 1].text.empty()) {
      parts[i - 1].text = py_rstrip(parts[i - 1].text);
    }
  }
  std::vector<std::pair<std::string, int64_t>> out;
  for (auto& p : parts) {
    if (p.token) {
      out.emplace_back(p.text, p.token->id);
    } else if (!p.text.empty()) {
      out.emplace_back(std::move(p.text), -1);
    }
  }
  return out;
}

std::vector<int64_t> T5Tokenizer::text_ids(std::string_view text) const {
  std::vector<int64_t> ids;
  for (const auto& [part, token_id] : split_on_added_tokens(text)) {
    if (token_id >= 0) {
      ids.push_back(token_id);
      continue;
    }
    for (const auto& piece : sp_->encode_as_pieces(part)) {
      // convert_tokens_to_ids: the added vocabulary first, then the model's piece_to_id.
      const auto added =
          std::find_if(added_.begin(), added_.end(), [&](const AddedToken& t) { return t.content == piece; });
      ids.push_back(added != added_.end() ? added->id : sp_->piece_to_id(piece));
    }
  }
  return ids;
}

std::vector<int64_t> T5Tokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids = text_ids(text);
  if (ids.empty() || ids.back() != eos_id_) ids.push_back(eos_id_);  // _add_eos_if_not_present
  return ids;
}

std::vector<int64_t> T5Tokenizer::encode(std::string_view text, int64_t max_length) const {
  if (max_length < 1) throw std::invalid_argument("max_length must be at least 1, got " + std::to_string(max_length));
  std::vector<int64_t> ids = text_ids(text);
  // prepare_for_model: the EOS slot counts towards the length whether or not it is appended later.
  const auto total = static_cast<int64_t>(ids.size()) + 1;
  if (total > max_length) {
    const int64_t remove = total - max_length;
    if (static_cast<int64_t>(ids.size()) <= remove) {
      throw std::invalid_argument("max_length " + std::to_string(max_length) + " leaves no room for the " +
                                  std::to_string(ids.size()) + " tokens of the text and the EOS");
    }
    ids.resize(ids.size() - static_cast<size_t>(remove));
  }
  if (ids.empty() || ids.back() != eos_id_) ids.push_back(eos_id_);
  return ids;
}

TokenizedBatch T5Tokenizer::operator()(const std::vector<std::string>& texts, int64_t max_length) const {
  TokenizedBatch batch;
  for (const auto& text : texts) {
    std::vector<int64_t> ids = encode(text, max_length);
    const auto real = static_cast<int64_t>(ids.size());
    std::vector<int64_t> mask(static_cast<size_t>(max_length), 0);
    std::fill(mask.begin(), mask.begin() + real, 1);
    ids.resize(static_cast<size_t>(max_length), pad_id_);
    batch.input_ids.push_back(std::move(ids));
    batch.attention_mask.push_back(std::move(mask));
    batch.seq_lens.push_back(real);
  }
  return batch;
}

}  // namespace skyreels::model
