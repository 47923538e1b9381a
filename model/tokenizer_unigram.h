// Our own SentencePiece unigram tokenizer (no libsentencepiece: Debian's build bundles protobuf-lite 3.14 and
// crashes processes that also load gRPC or LibTorch, build-notes P5), plus the conventions of transformers' slow
// T5Tokenizer on top of it. Equal to sentencepiece 0.1.97 and transformers 4.48 on the golden fixtures.
//
// SentencePieceUnigram reads a `.model` file (ModelProto, protobuf wire format, parsed by hand) and reproduces
// SentencePieceProcessor::Encode for unigram models: the model's own normalizer (the precompiled charsmap of
// nmt_nfkc & co.: a Darts double-array trie over UTF-8 plus a blob of replacement strings; user-defined symbols kept
// whole), whitespace handling (dummy prefix, collapsing and trimming, spaces as U+2581), the optimized Viterbi over
// the pieces (float scores, unknown characters at min score - 10), byte fallback (<0xNN> pieces) for unknown
// characters, or one merged <unk> per run of them when the model has no byte pieces.
//
// T5Tokenizer adds what transformers' slow T5Tokenizer (legacy mode, the default) does: added tokens (</s>, <pad>,
// <unk>, any <extra_id_N>) found literally in the text become their ids and split it (each piece between them is
// encoded separately), EOS appended unless the ids already end with it, truncation to max_length - 1 before the EOS,
// right padding with the pad id, and an attention mask over the real tokens.
//
// Torch-free header; every error is a TokenizerError naming the file and what is wrong.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace skyreels::model {

class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The parts of sentencepiece's ModelProto that encoding needs.
struct SentencePieceModelProto {
  enum class PieceType : int { Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };
  struct Piece {
    std::string piece;
    float score = 0.0f;
    PieceType type = PieceType::Normal;
  };
  std::vector<Piece> pieces;
  // trainer_spec
  int model_type = 1;  // 1 = UNIGRAM (the only type supported), 2 = BPE, 3 = WORD, 4 = CHAR
  bool byte_fallback = false;
  bool treat_whitespace_as_suffix = false;
  // normalizer_spec
  std::string normalizer_name;
  std::string precompiled_charsmap;  // empty: no normalization rules (identity)
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
  bool escape_whitespaces = true;

  // Parses the wire format; `source` names the file in errors.
  static SentencePieceModelProto parse(std::string_view bytes, const std::string& source);
};

class SentencePieceUnigram {
 public:
  static SentencePieceUnigram load(const std::string& model_file);  // a .model file
  SentencePieceUnigram(SentencePieceModelProto proto, std::string source);
  ~SentencePieceUnigram();
  SentencePieceUnigram(SentencePieceUnigram&&) noexcept;
  SentencePieceUnigram& operator=(SentencePieceUnigram&&) noexcept;

  // The model's normalizer on `text` (valid or not: malformed UTF-8 bytes become U+FFFD, as in sentencepiece),
  // spaces escaped as U+2581 when the model says so.
  std::string normalize(std::string_view text) const;
  // SentencePieceProcessor.encode(text, out_type=str) and (out_type=int).
  std::vector<std::string> encode_as_pieces(std::string_view text) const;
  std::vector<int> encode_as_ids(std::string_view text) const;
  // Both at once: (piece, id) as the processor emits them (byte pieces for unknown characters with byte fallback).
  std::vector<std::pair<std::string, int>> encode(std::string_view text) const;

  int piece_to_id(std::string_view piece) const;  // unk id for an unknown piece
  const std::string& id_to_piece(int id) const;   // throws TokenizerError when out of range
  int piece_size() const;
  int unk_id() const;
  const SentencePieceModelProto& proto() const;
  const std::string& source() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// An added token of the T5 tokenizer: matched literally in the text before SentencePiece runs.
struct AddedToken {
  std::string content;
  int64_t id = 0;
  bool lstrip = false;  // eats whitespace on its left
  bool rstrip = false;  // eats whitespace on its right
};

// input_ids and attention_mask, one row per text, each row max_length long.
struct TokenizedBatch {
  std::vector<std::vector<int64_t>> input_ids;
  std::vector<std::vector<int64_t>> attention_mask;
  std::vector<int64_t> seq_lens;  // ones in each mask row
};

struct T5TokenizerOptions {
  std::string eos_token = "</s>";
  std::string pad_token = "<pad>";
  std::string unk_token = "<unk>";
  // <extra_id_0> .. <extra_id_{n-1}> with ids piece_size - 1 + n - i, eating whitespace on both sides (T5Tokenizer's
  // defaults for them).
  int64_t extra_ids = 0;
  // tokenizer_config.json's added_tokens_decoder: when non-empty, these are the added tokens (the special tokens are
  // added too when the list lacks them) and extra_ids only counts towards vocab_size().
  std::vector<AddedToken> added_tokens;
};

class T5Tokenizer {
 public:
  // `path`: a folder holding spiece.model (plus, optionally, transformers' tokenizer_config.json, read for
  // eos_token / pad_token / unk_token, extra_ids and added_tokens_decoder), or a .model file. Without a
  // tokenizer_config.json there are no <extra_id_N> tokens (extra_ids = 0), as the fixtures were made.
  static T5Tokenizer load(const std::string& path);
  explicit T5Tokenizer(SentencePieceUnigram model, T5TokenizerOptions options = {});

  // The ids of `text` before the EOS: SentencePiece ids of the pieces between added tokens, and the added tokens' ids.
  std::vector<int64_t> text_ids(std::string_view text) const;
  // The ids of `text` with the T5 conventions and no length limit (what T5Tokenizer(text)["input_ids"] gives).
  std::vector<int64_t> encode(std::string_view text) const;
  // The same, truncated for max_length (room kept for the EOS). Throws std::invalid_argument when max_length < 1, or
  // when truncation would have to drop every text token (transformers then returns an over-long row and fails later).
  std::vector<int64_t> encode(std::string_view text, int64_t max_length) const;
  // tokenizer(texts, padding="max_length", max_length=L, truncation=True, add_special_tokens=True,
  //           return_attention_mask=True)
  TokenizedBatch operator()(const std::vector<std::string>& texts, int64_t max_length) const;

  // The text split on added tokens, as transformers' tokenize() does before SentencePiece: each element is either a
  // text piece (id -1) or an added token (its id), after the lstrip/rstrip rules; empty pieces dropped.
  std::vector<std::pair<std::string, int64_t>> split_on_added_tokens(std::string_view text) const;

  int64_t pad_id() const { return pad_id_; }
  int64_t eos_id() const { return eos_id_; }
  int64_t unk_id() const { return unk_id_; }
  int64_t vocab_size() const;  // pieces + extra ids
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  const SentencePieceUnigram& sentencepiece() const { return *sp_; }

 private:
  std::shared_ptr<const SentencePieceUnigram> sp_;
  std::vector<AddedToken> added_;
  int64_t extra_ids_ = 0;
  int64_t pad_id_ = 0, eos_id_ = 1, unk_id_ = 2;
};

}  // namespace skyreels::model
