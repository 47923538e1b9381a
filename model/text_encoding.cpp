#include "model/text_encoding.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
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
  std::error_code ec;
  const fs::path where = fs::weakly_canonical(text_encoder_path, ec);
  const std::string identity = (ec ? text_encoder_path : where.string()) + "|" +
                               c10::toString(loaded.model->compute_dtype()) + "|" + loaded.model->device().str() +
                               "|" + tok;
  return std::make_unique<TextEncoder>(std::move(loaded.model), std::move(tokenizer), options.cache_bytes, identity);
}

TextEncoder::TextEncoder(std::unique_ptr<UMT5Encoder> encoder, T5Tokenizer tokenizer, size_t cache_bytes,
                         std::string identity)
    : encoder_(std::move(encoder)),
      tokenizer_(std::move(tokenizer)),
      capacity_bytes_(cache_bytes),
      identity_(std::move(identity)) {
  if (!encoder_) throw std::invalid_argument("TextEncoder: no encoder");
  if (identity_.empty()) {
    // No name: this instance alone (its address) and its dtype.
    identity_ = "encoder@" + std::to_string(reinterpret_cast<uintptr_t>(encoder_.get())) + "|" +
                c10::toString(encoder_->compute_dtype());
  }
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
  const at::Tensor lengths_t = tokens.attention_mask.sum(1);
  std::vector<int64_t> lengths;
  for (int64_t k = 0; k < lengths_t.size(0); ++k) lengths.push_back(lengths_t[k].item<int64_t>());
  const auto groups = choose_batches(lengths);
  if (groups.size() == 1) return encode_batch(tokens.input_ids, tokens.attention_mask);
  std::vector<at::Tensor> rows(lengths.size());
  for (const auto& group : groups) {
    const at::Tensor pick = at::tensor(std::vector<int64_t>(group.begin(), group.end()), at::kLong);
    const at::Tensor embeds =
        encode_batch(tokens.input_ids.index_select(0, pick), tokens.attention_mask.index_select(0, pick));
    for (size_t k = 0; k < group.size(); ++k) rows[group[k]] = embeds[static_cast<int64_t>(k)];
  }
  return at::stack(rows, 0);
}

// Pad-aware: only the longest row's positions go through the encoder; the rest of every row is zero, as the
// pipeline makes it.
at::Tensor TextEncoder::encode_batch(const at::Tensor& input_ids, const at::Tensor& attention_mask) const {
  const int64_t width = attention_mask.size(1);
  const int64_t longest = std::max<int64_t>(1, attention_mask.sum(1).max().item<int64_t>());
  const at::Tensor mask = attention_mask.narrow(1, 0, longest);
  const at::Tensor hidden = umt5_zero_pad_rows(encoder_->forward(input_ids.narrow(1, 0, longest), mask), mask);
  if (longest == width) return hidden;
  at::Tensor out = at::zeros({hidden.size(0), width, hidden.size(2)}, hidden.options());
  out.narrow(1, 0, longest).copy_(hidden);
  return out;
}

std::vector<std::vector<size_t>> TextEncoder::choose_batches(const std::vector<int64_t>& lengths) {
  if (lengths.empty()) return {};
  int64_t longest = 0, total = 0;
  for (int64_t l : lengths) {
    longest = std::max(longest, std::max<int64_t>(1, l));
    total += std::max<int64_t>(1, l);
  }
  const int64_t padded = longest * static_cast<int64_t>(lengths.size());
  std::vector<std::vector<size_t>> out;
  if (padded <= kMaxBatchTokens && static_cast<double>(padded) <= kBatchPaddingSlack * static_cast<double>(total)) {
    out.emplace_back();
    for (size_t i = 0; i < lengths.size(); ++i) out.back().push_back(i);
  } else {
    for (size_t i = 0; i < lengths.size(); ++i) out.push_back({i});
  }
  return out;
}

at::Tensor TextEncoder::encode(const std::vector<std::string>& prompts, int64_t max_sequence_length,
                               TextEncodeStats* call_stats) const {
  if (prompts.empty()) throw std::invalid_argument("TextEncoder: no prompts to encode");
  std::vector<at::Tensor> rows(prompts.size());
  std::vector<size_t> missing;           // first occurrence of each text not in the cache
  std::vector<size_t> same(prompts.size());  // the row a repeated text takes its value from
  TextEncodeStats local;
  const std::string prefix = identity_ + "\n" + std::to_string(max_sequence_length) + "\n";
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::unordered_map<std::string, size_t> first;
    for (size_t i = 0; i < prompts.size(); ++i) {
      same[i] = i;
      auto seen = first.find(prompts[i]);
      if (seen != first.end()) {  // the same text earlier in this call: encoded (or served) once
        same[i] = seen->second;
        ++local.hits;
        continue;
      }
      first.emplace(prompts[i], i);
      auto it = capacity_bytes_ ? index_.find(prefix + prompts[i]) : index_.end();
      if (it != index_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second);
        rows[i] = it->second->second;
        ++local.hits;
      } else {
        missing.push_back(i);
        ++local.misses;
      }
    }
    stats_.hits += local.hits;
    stats_.misses += local.misses;
  }
  if (!missing.empty()) {
    std::vector<std::string> todo;
    for (size_t i : missing) todo.push_back(prompts[i]);
    const at::Tensor embeds = encode_uncached(tokenize(todo, max_sequence_length));
    for (size_t k = 0; k < missing.size(); ++k) rows[missing[k]] = embeds[static_cast<int64_t>(k)];
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i : missing) {
      if (!capacity_bytes_) continue;
      const size_t bytes = static_cast<size_t>(rows[i].numel()) * rows[i].element_size();
      const Key key = prefix + prompts[i];
      if (bytes > capacity_bytes_ || index_.count(key)) continue;  // too big to keep; or another thread got there
      lru_.emplace_front(key, rows[i].clone());                      // own copy: the batch tensor can go
      index_[key] = lru_.begin();
      bytes_ += bytes;
      while (bytes_ > capacity_bytes_) {
        const at::Tensor& last = lru_.back().second;
        bytes_ -= static_cast<size_t>(last.numel()) * last.element_size();
        index_.erase(lru_.back().first);
        lru_.pop_back();
      }
    }
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (same[i] != i) rows[i] = rows[same[i]];
  }
  if (call_stats) *call_stats = local;
  return at::stack(rows, 0);
}

TextEncoder::CacheStats TextEncoder::cache_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CacheStats s = stats_;
  s.entries = lru_.size();
  s.bytes = bytes_;
  return s;
}

void TextEncoder::clear_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  lru_.clear();
  index_.clear();
  bytes_ = 0;
}

}  // namespace skyreels::model
