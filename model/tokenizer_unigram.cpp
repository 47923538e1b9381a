// SentencePieceUnigram (tokenizer_unigram.h): the vocabulary tables, the Viterbi segmentation over the pieces, the
// encoder's byte fallback and unknown runs, and the public entry points. The .model file's parsing is in
// tokenizer_unigram_proto.cpp, the normalizer in tokenizer_unigram_normalizer.cpp, T5Tokenizer in
// tokenizer_unigram_t5.cpp.
#include "model/tokenizer_unigram.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/tokenizer_unigram_detail.h"

namespace skyreels::model {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TokenizerError("cannot read tokenizer file '" + path + "'");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

}  // namespace

using tokenizer_unigram_detail::one_char_len;

// ---- SentencePieceUnigram::Impl: the vocabulary, the Viterbi, the encoder -------------------------------------------

void SentencePieceUnigram::Impl::init_pieces() {
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

// unigram::Model::EncodeOptimized: Viterbi over byte positions, one unknown node per uncovered character.
std::vector<std::pair<std::string_view, int>> SentencePieceUnigram::Impl::viterbi(std::string_view text) const {
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
      const double score = piece.type == T::UserDefined ? static_cast<double>(static_cast<float>(len) * max_score) - 0.1
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
std::vector<std::pair<std::string, int>> SentencePieceUnigram::Impl::encode(std::string_view text) const {
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

// ---- SentencePieceUnigram -------------------------------------------------------------------------------------------

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

}  // namespace skyreels::model
