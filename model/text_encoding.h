// Prompts to prompt_embeds, as diffusers' SkyReelsV2DiffusionForcingPipeline._get_t5_prompt_embeds does it:
// prompt_clean (ftfy, HTML unescape twice, whitespace collapse) -> T5Tokenizer (padding to max_sequence_length,
// truncation, EOS) -> UMT5 encoder -> each row keeps its first seq_len positions and is zero after them.
//
// One TextEncoder per server (one device), shared by every request: encode() is thread-safe and keeps a cache of
// embedding rows keyed by (encoder identity, max_sequence_length, prompt text), bounded by bytes (least recently used
// dropped first), so a resubmitted prompt, a repeated negative prompt or a prompt change seen before costs nothing
// after its first use, and an encoder loaded from other weights or in another dtype never serves another's rows.
//
// Encoding is pad-aware: a batch runs the encoder only over its longest row's tokens, not max_sequence_length. The
// rows are the same (padded keys get exactly zero attention weight, every other op is per position; the positions
// after seq_len are zeroed by the pipeline anyway), to float rounding of the shorter matrix products.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/tokenizer_unigram.h"
#include "model/umt5_encoder.h"

namespace skyreels::model {

// Default bound of the embedding cache: 64 rows of UMT5-XXL at 512 tokens in float32 (8 MiB each).
inline constexpr size_t kTextEmbeddingCacheBytes = size_t{512} << 20;

struct TextEncoderOptions {
  std::string device = "cpu";     // cpu, cuda, cuda:N
  std::string dtype = "float32";  // float32, bfloat16, auto
  // Bytes of embedding rows kept on the encoder's device; 0 disables the cache. One row is max_sequence_length x
  // d_model values: 8 MiB for UMT5-XXL in float32 at 512 tokens, 4 MiB in bf16.
  size_t cache_bytes = kTextEmbeddingCacheBytes;
};

// How one encode() call went: rows served from the cache, rows encoded (a text twice in one call counts once as a
// miss, then as a hit).
struct TextEncodeStats {
  uint64_t hits = 0;
  uint64_t misses = 0;
};

// What the tokenizer made of a batch of prompts.
struct TokenizedPrompts {
  std::vector<std::string> cleaned;  // prompt_clean(prompt), what was tokenized
  at::Tensor input_ids;              // int64 [N, L] (CPU)
  at::Tensor attention_mask;         // int64 [N, L] (CPU)
};

class TextEncoder {
 public:
  // `text_encoder_path`: see load_umt5_encoder (a text_encoder folder, a pipeline folder, a file). `tokenizer_path`:
  // see T5Tokenizer::load; empty means find_tokenizer(text_encoder_path).
  static std::unique_ptr<TextEncoder> load(const std::string& text_encoder_path, const std::string& tokenizer_path,
                                           const TextEncoderOptions& options = {});
  // `identity` names the weights and dtype (load() uses the resolved path, the dtype and the device); it is part of
  // every cache key.
  TextEncoder(std::unique_ptr<UMT5Encoder> encoder, T5Tokenizer tokenizer,
              size_t cache_bytes = kTextEmbeddingCacheBytes, std::string identity = "");
  ~TextEncoder();
  TextEncoder(const TextEncoder&) = delete;
  TextEncoder& operator=(const TextEncoder&) = delete;

  // prompt_embeds [N, max_sequence_length, d_model] in the encoder's compute dtype on its device (cast it to the
  // transformer's dtype as the pipeline does). Throws std::invalid_argument on an empty batch, max_sequence_length
  // < 1, or text that is not valid UTF-8. Thread-safe.
  // Rows missing from the cache are encoded once each, grouped into calls by choose_batches().
  at::Tensor encode(const std::vector<std::string>& prompts, int64_t max_sequence_length = 512,
                    TextEncodeStats* stats = nullptr) const;
  // The same without the cache and with the tokens (what `skyreels encode-text` reports): the rows grouped by
  // choose_batches(), each group one pad-aware encoder call, so a row gets the same numbers either way.
  at::Tensor encode_uncached(const TokenizedPrompts& tokens) const;
  // How rows of these token counts are encoded: groups of row indexes, each one encoder call cut to its longest
  // row. One batch when its padded tokens (rows x longest) are at most kBatchPaddingSlack times the rows' own and
  // at most kMaxBatchTokens, else every row alone. Measured (bench_text_encoder, UMT5-XXL width, docs/BENCHMARKS.md):
  // a batch of short rows runs about 10 % more GFLOP/s than single rows, so it pays while the padding it adds stays
  // under that; at 2 x 512 tokens the batch is 2-6 % slower than two single rows.
  static std::vector<std::vector<size_t>> choose_batches(const std::vector<int64_t>& lengths);
  static constexpr double kBatchPaddingSlack = 1.1;
  static constexpr int64_t kMaxBatchTokens = 512;
  const std::string& identity() const { return identity_; }
  TokenizedPrompts tokenize(const std::vector<std::string>& prompts, int64_t max_sequence_length = 512) const;

  const UMT5Encoder& encoder() const { return *encoder_; }
  const T5Tokenizer& tokenizer() const { return tokenizer_; }
  int64_t hidden_size() const;
  c10::Device device() const;
  at::ScalarType dtype() const;

  struct CacheStats {
    uint64_t hits = 0;
    uint64_t misses = 0;
    size_t entries = 0;
    size_t bytes = 0;
  };
  CacheStats cache_stats() const;
  void clear_cache();

 private:
  at::Tensor encode_batch(const at::Tensor& input_ids, const at::Tensor& attention_mask) const;
  std::unique_ptr<UMT5Encoder> encoder_;
  T5Tokenizer tokenizer_;
  size_t capacity_bytes_;
  std::string identity_;
  mutable std::mutex mutex_;
  mutable size_t bytes_ = 0;
  using Key = std::string;                             // identity + '\n' + max_sequence_length + '\n' + prompt
  mutable std::list<std::pair<Key, at::Tensor>> lru_;  // front = most recent; rows [L, d_model]
  mutable std::unordered_map<Key, std::list<std::pair<Key, at::Tensor>>::iterator> index_;
  mutable CacheStats stats_;
};

// The tokenizer of a text encoder when none is named: `dir` itself when it holds spiece.model, else `dir`/tokenizer,
// else the sibling ../tokenizer (diffusers pipeline layout). Throws TokenizerError listing the places looked at.
std::string find_tokenizer(const std::string& text_encoder_path);

}  // namespace skyreels::model
