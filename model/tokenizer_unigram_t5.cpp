// T5Tokenizer (tokenizer_unigram.h): transformers' slow T5Tokenizer over our SentencePieceUnigram: reading
// tokenizer_config.json, the added tokens (literal matches splitting the text, their lstrip/rstrip rules), the EOS,
// truncation, padding and the attention mask.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/prompt_clean.h"
#include "model/tokenizer_unigram.h"
#include "model/tokenizer_unigram_detail.h"

namespace fs = std::filesystem;

namespace skyreels::model {
namespace {

using tokenizer_unigram_detail::decode_one;

// Python's str.lstrip() / rstrip() on UTF-8 (whitespace per str.isspace()).
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
