// Internal to the SentencePiece unigram tokenizer (tokenizer_unigram.h), which is split by concept over
// tokenizer_unigram_proto.cpp (the .model file's ModelProto, parsed from the protobuf wire format),
// tokenizer_unigram_normalizer.cpp (UTF-8 as sentencepiece sees it, the precompiled charsmap, whitespace handling),
// tokenizer_unigram.cpp (SentencePieceUnigram: the vocabulary tables, the Viterbi, the encoder, the entry points) and
// tokenizer_unigram_t5.cpp (T5Tokenizer): SentencePieceUnigram's state and the UTF-8 helpers these files share. Not a
// public header: only those files include it. Torch-free.
#pragma once

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "model/tokenizer_unigram.h"

namespace skyreels::model {

namespace tokenizer_unigram_detail {

// ---- UTF-8, as sentencepiece's util.cc sees it (tokenizer_unigram_normalizer.cpp) -----------------------------------

// sentencepiece's OneCharLen: the length a lead byte announces (1 for stray continuation bytes).
inline size_t one_char_len(unsigned char lead) { return "\1\1\1\1\1\1\1\1\1\1\1\1\2\2\3\4"[lead >> 4]; }

// string_util::IsValidDecodeUTF8: true and the length of one valid character; false (length 1) otherwise.
bool valid_utf8_prefix(std::string_view s, size_t* len);

// The code point starting at `pos` (U+FFFD for a byte that starts no valid character); returns its length.
size_t decode_one(std::string_view s, size_t pos, char32_t* cp);

}  // namespace tokenizer_unigram_detail

// ---- SentencePieceUnigram's state -----------------------------------------------------------------------------------

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

  // tokenizer_unigram.cpp: the vocabulary tables from the pieces, the Viterbi and the encoder.
  void init_pieces();
  std::vector<std::pair<std::string_view, int>> viterbi(std::string_view text) const;
  std::vector<std::pair<std::string, int>> encode(std::string_view text) const;

  // tokenizer_unigram_normalizer.cpp: the charsmap read from the proto, its trie's lookup, the normalizer.
  void init_normalizer();
  std::pair<size_t, uint32_t> longest_rule(std::string_view input) const;
  std::pair<std::string_view, size_t> normalize_prefix(std::string_view input) const;
  std::string normalize(std::string_view input) const;
};

}  // namespace skyreels::model
