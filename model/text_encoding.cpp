#include "model/text_encoding.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <stdexcept>

#include "model/prompt_clean.h"

namespace fs = std::filesystem;

namespace skyreels::model {

namespace {

at::Tensor to_tensor(const std::vector<std::vector<int64_t>>& rows, int64_t length) {
  at::Tensor t = at::empty({static_cast<int64_t>(rows.size()), length}, at::kLong);
  auto acc = t.accessor<int64_t, 2>();
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int64_t j = 0; j < length; ++j) acc[static_cast<int64_t>(i)][j] = rows[i][static_cast<size_t>(j)];
  }
  return t;
}

}  // namespace

std::string find_tokenizer(const std::string& text_encoder_path) {
  const fs::path p(text_encoder_path);
  const fs::path dir = fs::is_directory(p) ? p : p.parent_path();
  const std::vector<fs::path> candidates = {dir, dir / "tokenizer", dir.parent_path() / "tokenizer"};
  std::string looked;
  for (const auto& c : candidates) {
    if (fs::exists(c / "spiece.model")) return c.string();
    looked += (looked.empty() ? "" : ", ") + (c / "spiece.model").string();
  }
  throw TokenizerError("no tokenizer found for text encoder '" + text_encoder_path + "' (looked for " + looked +
                       "); pass the tokenizer folder");
}

std::unique_ptr<TextEncoder> TextEncoder::load(const std::string& text_encoder_path, const std::string& tokenizer_path,
                                               const TextEncoderOptions& options) {
  const std::string tok = tokenizer_path.empty() ? find_tokenizer(text_encoder_path) : tokenizer_path;
  T5Tokenizer tokenizer = T5Tokenizer::load(tok);
  LoadedUMT5 loaded = load_umt5_encoder(text_encoder_path, UMT5LoadOptions{options.device, options.dtype});
  if (tokenizer.vocab_size() > loaded.model->config().vocab_size) {
    spdlog::warn("tokenizer '{}' has {} ids but the text encoder embeds only {}; larger ids will be rejected", tok,
                 tokenizer.vocab_size(), loaded.model->config().vocab_size);
  }
  return std::make_unique<TextEncoder>(std::move(loaded.model), std::move(tokenizer), options.cache_capacity);
}

TextEncoder::TextEncoder(std::unique_ptr<UMT5Encoder> encoder, T5Tokenizer tokenizer, size_t cache_capacity)
    : encoder_(std::move(encoder)), tokenizer_(std::move(tokenizer)), capacity_(cache_capacity) {
  if (!encoder_) throw std::invalid_argument("TextEncoder: no encoder");
}

TextEncoder::~TextEncoder() = default;

int64_t TextEncoder::hidden_size() const { return encoder_->config().d_model; }
c10::Device TextEncoder::device() const { return encoder_->device(); }
at::ScalarType TextEncoder::dtype() const { return encoder_->compute_dtype(); }

TokenizedPrompts TextEncoder::tokenize(const std::vector<std::string>& prompts, int64_t max_sequence_length) const {
  if (prompts.empty()) throw std::invalid_argument("TextEncoder: no prompts to encode");
  if (max_sequence_length < 1) {
    throw std::invalid_argument("TextEncoder: max_sequence_length must be at least 1, got " +
                                std::to_string(max_sequence_length));
  }
  TokenizedPrompts out;
  for (const auto& p : prompts) out.cleaned.push_back(prompt_clean(p));
  const TokenizedBatch batch = tokenizer_(out.cleaned, max_sequence_length);
  out.input_ids = to_tensor(batch.input_ids, max_sequence_length);
  out.attention_mask = to_tensor(batch.attention_mask, max_sequence_length);
  return out;
}

at::Tensor TextEncoder::encode_uncached(const TokenizedPrompts& tokens) const {
  const at::Tensor hidden = encoder_->forward(tokens.input_ids, tokens.attention_mask);
  return umt5_zero_pad_rows(hidden, tokens.attention_mask);
}

at::Tensor TextEncoder::encode(const std::vector<std::string>& prompts, int64_t max_sequence_length) const {
  if (prompts.empty()) throw std::invalid_argument("TextEncoder: no prompts to encode");
  std::vector<at::Tensor> rows(prompts.size());
  std::vector<size_t> missing;
  const std::string length_tag = std::to_string(max_sequence_length) + "\n";
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto it = capacity_ ? index_.find(length_tag + prompts[i]) : index_.end();
      if (it != index_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second);
        rows[i] = it->second->second;
        ++stats_.hits;
      } else {
        missing.push_back(i);
        ++stats_.misses;
      }
    }
  }
  if (!missing.empty()) {
    std::vector<std::string> todo;
    for (size_t i : missing) todo.push_back(prompts[i]);
    // One batch for every miss, as the pipeline encodes its prompts (rows do not interact).
    const at::Tensor embeds = encode_uncached(tokenize(todo, max_sequence_length));
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t k = 0; k < missing.size(); ++k) {
      rows[missing[k]] = embeds[static_cast<int64_t>(k)];
      if (!capacity_) continue;
      const Key key = length_tag + prompts[missing[k]];
      if (index_.count(key)) continue;                    // another thread got there first
      lru_.emplace_front(key, rows[missing[k]].clone());  // own copy: the batch tensor can go
      index_[key] = lru_.begin();
      while (lru_.size() > capacity_) {
        index_.erase(lru_.back().first);
        lru_.pop_back();
      }
    }
  }
  return at::stack(rows, 0);
}

TextEncoder::CacheStats TextEncoder::cache_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CacheStats s = stats_;
  s.entries = lru_.size();
  return s;
}

void TextEncoder::clear_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  lru_.clear();
  index_.clear();
}

}  // namespace skyreels::model
