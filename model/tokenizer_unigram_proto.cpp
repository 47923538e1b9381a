// The SentencePiece .model file (tokenizer_unigram.h): the parts of sentencepiece's ModelProto that encoding needs,
// read from the protobuf wire format by hand (pieces, trainer_spec, normalizer_spec).
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "model/tokenizer_unigram.h"

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

}  // namespace skyreels::model
