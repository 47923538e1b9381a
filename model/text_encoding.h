// Prompts to prompt_embeds, as diffusers' SkyReelsV2DiffusionForcingPipeline._get_t5_prompt_embeds does it:
// prompt_clean (ftfy, HTML unescape twice, whitespace collapse) -> T5Tokenizer (padding to max_sequence_length,
// truncation, EOS) -> UMT5 encoder -> each row keeps its first seq_len positions and is zero after them.
//
// One TextEncoder per server (one device), shared by every request: encode() is thread-safe and keeps a bounded
// LRU cache of embedding rows by (prompt text, max_sequence_length), so a repeated prompt or negative prompt costs
// nothing after its first use.
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

struct TextEncoderOptions {
  std::string device = "cpu";     // cpu, cuda, cuda:N
  std::string dtype = "float32";  // float32, bfloat16, auto
  // Prompts kept (least recently used dropped first), on the encoder's device; 0 disables the cache. One entry is
  // max_sequence_length x d_model values: 4 MiB for UMT5-XXL in bf16 at 512 tokens.
  size_t cache_capacity = 32;
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
  TextEncoder(std::unique_ptr<UMT5Encoder> encoder, T5Tokenizer tokenizer, size_t cache_capacity = 32);
  ~TextEncoder();
  TextEncoder(const TextEncoder&) = delete;
  TextEncoder& operator=(const TextEncoder&) = delete;

  // prompt_embeds [N, max_sequence_length, d_model] in the encoder's compute dtype on its device (cast it to the
  // transformer's dtype as the pipeline does). Throws std::invalid_argument on an empty batch, max_sequence_length
  // < 1, or text that is not valid UTF-8. Thread-safe.
  at::Tensor encode(const std::vector<std::string>& prompts, int64_t max_sequence_length = 512) const;
  // The same without the cache and with the tokens (what `skyreels encode-text` reports).
  at::Tensor encode_uncached(const TokenizedPrompts& tokens) const;
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
  };
  CacheStats cache_stats() const;
  void clear_cache();

 private:
  std::unique_ptr<UMT5Encoder> encoder_;
  T5Tokenizer tokenizer_;
  size_t capacity_;
  mutable std::mutex mutex_;
  using Key = std::string;                             // max_sequence_length + '\n' + prompt
  mutable std::list<std::pair<Key, at::Tensor>> lru_;  // front = most recent; rows [L, d_model]
  mutable std::unordered_map<Key, std::list<std::pair<Key, at::Tensor>>::iterator> index_;
  mutable CacheStats stats_;
};

// The tokenizer of a text encoder when none is named: `dir` itself when it holds spiece.model, else `dir`/tokenizer,
// else the sibling ../tokenizer (diffusers pipeline layout). Throws TokenizerError listing the places looked at.
std::string find_tokenizer(const std::string& text_encoder_path);

}  // namespace skyreels::model
