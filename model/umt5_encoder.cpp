#include "model/umt5_encoder.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>

#include "model/runtime.h"
#include "model/safetensors.h"

namespace fs = std::filesystem;

namespace skyreels::model {

using checkpoint::CheckpointError;

// ---- config ---------------------------------------------------------------------------------------------------------

UMT5Config UMT5Config::umt5_xxl() {
  UMT5Config c;
  c.vocab_size = 256384;
  c.d_model = 4096;
  c.d_kv = 64;
  c.d_ff = 10240;
  c.num_layers = 24;
  c.num_heads = 64;
  return c;
}

void UMT5Config::validate() const {
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0)
      throw std::invalid_argument(std::string("UMT5 config: ") + name + " must be positive, got " + std::to_string(v));
  };
  positive(vocab_size, "vocab_size");
  positive(d_model, "d_model");
  positive(d_kv, "d_kv");
  positive(d_ff, "d_ff");
  positive(num_layers, "num_layers");
  positive(num_heads, "num_heads");
  positive(relative_attention_max_distance, "relative_attention_max_distance");
  if (relative_attention_num_buckets < 4) {
    throw std::invalid_argument("UMT5 config: relative_attention_num_buckets must be at least 4, got " +
                                std::to_string(relative_attention_num_buckets));
  }
  if (relative_attention_max_distance <= relative_attention_num_buckets / 4) {
    throw std::invalid_argument("UMT5 config: relative_attention_max_distance must exceed num_buckets / 4");
  }
  if (!(layer_norm_epsilon > 0.0)) throw std::invalid_argument("UMT5 config: layer_norm_epsilon must be positive");
}

std::string UMT5Config::to_transformers_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"UMT5EncoderModel"};
  j["classifier_dropout"] = 0.0;
  j["d_ff"] = d_ff;
  j["d_kv"] = d_kv;
  j["d_model"] = d_model;
  j["decoder_start_token_id"] = 0;
  j["dense_act_fn"] = "gelu_new";
  j["dropout_rate"] = 0.1;
  j["eos_token_id"] = 1;
  j["feed_forward_proj"] = "gated-gelu";
  j["initializer_factor"] = 1.0;
  j["is_encoder_decoder"] = true;
  j["is_gated_act"] = true;
  j["layer_norm_epsilon"] = layer_norm_epsilon;
  j["model_type"] = "umt5";
  j["num_decoder_layers"] = num_layers;
  j["num_heads"] = num_heads;
  j["num_layers"] = num_layers;
  j["pad_token_id"] = 0;
  j["relative_attention_max_distance"] = relative_attention_max_distance;
  j["relative_attention_num_buckets"] = relative_attention_num_buckets;
  j["tie_word_embeddings"] = false;
  j["tokenizer_class"] = "T5Tokenizer";
  j["torch_dtype"] = "float32";
  j["use_cache"] = true;
  j["vocab_size"] = vocab_size;
  return j.dump(2) + "\n";
}

namespace {

std::string layer_prefix(int64_t i) { return "encoder.block." + std::to_string(i) + "."; }

}  // namespace

std::vector<checkpoint::ParamSpec> umt5_parameter_specs(const UMT5Config& c) {
  std::vector<checkpoint::ParamSpec> specs;
  specs.push_back({"shared.weight", {c.vocab_size, c.d_model}, false});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string a = layer_prefix(i) + "layer.0.";
    const std::string f = layer_prefix(i) + "layer.1.";
    specs.push_back({a + "layer_norm.weight", {c.d_model}, false});
    for (const char* proj : {"q", "k", "v"}) {
      specs.push_back({a + "SelfAttention." + proj + ".weight", {c.inner_dim(), c.d_model}, false});
    }
    specs.push_back({a + "SelfAttention.o.weight", {c.d_model, c.inner_dim()}, false});
    specs.push_back(
        {a + "SelfAttention.relative_attention_bias.weight", {c.relative_attention_num_buckets, c.num_heads}, false});
    specs.push_back({f + "layer_norm.weight", {c.d_model}, false});
    specs.push_back({f + "DenseReluDense.wi_0.weight", {c.d_ff, c.d_model}, false});
    specs.push_back({f + "DenseReluDense.wi_1.weight", {c.d_ff, c.d_model}, false});
    specs.push_back({f + "DenseReluDense.wo.weight", {c.d_model, c.d_ff}, true});  // _keep_in_fp32_modules
  }
  specs.push_back({"encoder.final_layer_norm.weight", {c.d_model}, false});
  return specs;
}

// ---- the math -------------------------------------------------------------------------------------------------------

at::Tensor umt5_relative_position_bucket(const at::Tensor& relative_position, int64_t num_buckets,
                                         int64_t max_distance) {
  const int64_t half = num_buckets / 2;  // bidirectional: half the buckets for keys to the right
  at::Tensor buckets = (relative_position > 0).to(at::kLong) * half;
  const at::Tensor distance = relative_position.abs();
  const int64_t max_exact = half / 2;
  const at::Tensor is_small = distance < max_exact;
  // The same float32 ops as transformers (log of distance / max_exact over a double log ratio), truncated.
  at::Tensor log_ratio = at::log(distance.to(at::kFloat) / max_exact) /
                         std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact));
  log_ratio = log_ratio * (half - max_exact);
  at::Tensor if_large = log_ratio.to(at::kLong) + max_exact;
  if_large = at::min(if_large, at::full_like(if_large, half - 1));
  return buckets + at::where(is_small, distance, if_large);
}

at::Tensor umt5_zero_pad_rows(const at::Tensor& last_hidden_state, const at::Tensor& attention_mask) {
  if (last_hidden_state.dim() != 3 || attention_mask.dim() != 2 ||
      last_hidden_state.size(0) != attention_mask.size(0) || last_hidden_state.size(1) != attention_mask.size(1)) {
    throw std::invalid_argument("umt5_zero_pad_rows: expected hidden states [B, T, D] and a mask [B, T]");
  }
  const at::Tensor mask = attention_mask.to(last_hidden_state.device());
  const at::Tensor seq_lens = mask.gt(0).sum(1);  // rows kept: the first seq_len, as the pipeline slices u[:v]
  const at::Tensor positions = at::arange(last_hidden_state.size(1), seq_lens.options());
  const at::Tensor keep = (positions.unsqueeze(0) < seq_lens.unsqueeze(1)).unsqueeze(-1);
  return at::where(keep, last_hidden_state, at::zeros_like(last_hidden_state));
}

namespace {

double lowest_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return static_cast<double>(std::numeric_limits<float>::lowest());
    case at::kDouble:
      return std::numeric_limits<double>::lowest();
    case at::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
    default:
      throw std::invalid_argument("UMT5: unsupported compute dtype " + std::string(c10::toString(dtype)));
  }
}

// T5's RMS norm: variance in fp32, weight applied after casting back to a half-precision weight's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor variance = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
  at::Tensor h = x * at::rsqrt(variance + eps);
  if (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16) h = h.to(weight.scalar_type());
  return weight * h;
}

// transformers' NewGELUActivation, op for op.
at::Tensor gelu_new(const at::Tensor& x) {
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + at::tanh(c * (x + 0.044715 * at::pow(x, 3.0))));
}

struct Layer {
  at::Tensor norm1, q, k, v, o, relative_bias, norm2, wi_0, wi_1, wo;
};

}  // namespace

struct UMT5Encoder::Impl {
  UMT5Config config;
  checkpoint::StateDict weights;
  c10::Device device{c10::kCPU};
  at::ScalarType dtype = at::kFloat;
  at::Tensor shared, final_norm;
  std::vector<Layer> layers;

  const at::Tensor& get(const std::string& name) const {
    auto it = weights.find(name);
    if (it == weights.end()) throw std::invalid_argument("UMT5Encoder: missing parameter '" + name + "'");
    return it->second;
  }

  // [B, T, inner] -> [B, heads, T, d_kv]
  at::Tensor split_heads(const at::Tensor& x) const {
    return x.view({x.size(0), x.size(1), config.num_heads, config.d_kv}).permute({0, 2, 1, 3});
  }

  at::Tensor attention(const Layer& layer, const at::Tensor& x, const at::Tensor& buckets, const at::Tensor& mask,
                       UMT5Trace* trace) const {
    const int64_t batch = x.size(0), length = x.size(1);
    const at::Tensor q = split_heads(at::linear(x, layer.q));
    const at::Tensor k = split_heads(at::linear(x, layer.k));
    const at::Tensor v = split_heads(at::linear(x, layer.v));
    at::Tensor scores = at::matmul(q, k.transpose(-1, -2));  // no 1/sqrt(d_kv): folded into the weights
    const at::Tensor bias = at::embedding(layer.relative_bias, buckets).permute({2, 0, 1}).unsqueeze(0);
    if (trace) trace->position_bias.push_back(bias);
    scores += bias + mask;
    const at::Tensor weights_ = at::softmax(scores.to(at::kFloat), -1).to(scores.scalar_type());
    const at::Tensor context =
        at::matmul(weights_, v).permute({0, 2, 1, 3}).contiguous().view({batch, length, config.inner_dim()});
    return at::linear(context, layer.o);
  }

  at::Tensor feed_forward(const Layer& layer, const at::Tensor& x) const {
    at::Tensor h = gelu_new(at::linear(x, layer.wi_0)) * at::linear(x, layer.wi_1);
    if (h.scalar_type() != layer.wo.scalar_type()) h = h.to(layer.wo.scalar_type());  // wo may be an fp32 island
    return at::linear(h, layer.wo);
  }
};

UMT5Encoder::UMT5Encoder(UMT5Config config, checkpoint::StateDict weights, c10::Device device,
                         at::ScalarType compute_dtype)
    : impl_(std::make_unique<Impl>()) {
  config.validate();
  impl_->config = config;
  impl_->weights = std::move(weights);
  impl_->device = device;
  impl_->dtype = compute_dtype;
  lowest_of(compute_dtype);  // rejects unsupported dtypes early
  for (const auto& spec : umt5_parameter_specs(config)) {
    const at::Tensor& t = impl_->get(spec.name);
    if (t.sizes().vec() != spec.shape) {
      throw std::invalid_argument("UMT5Encoder: parameter '" + spec.name + "' has shape " +
                                  checkpoint::shape_str(t.sizes().vec()) + ", expected " +
                                  checkpoint::shape_str(spec.shape));
    }
  }
  impl_->shared = impl_->get("shared.weight");
  impl_->final_norm = impl_->get("encoder.final_layer_norm.weight");
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const std::string a = layer_prefix(i) + "layer.0.";
    const std::string f = layer_prefix(i) + "layer.1.";
    impl_->layers.push_back(
        Layer{impl_->get(a + "layer_norm.weight"), impl_->get(a + "SelfAttention.q.weight"),
              impl_->get(a + "SelfAttention.k.weight"), impl_->get(a + "SelfAttention.v.weight"),
              impl_->get(a + "SelfAttention.o.weight"), impl_->get(a + "SelfAttention.relative_attention_bias.weight"),
              impl_->get(f + "layer_norm.weight"), impl_->get(f + "DenseReluDense.wi_0.weight"),
              impl_->get(f + "DenseReluDense.wi_1.weight"), impl_->get(f + "DenseReluDense.wo.weight")});
  }
}

UMT5Encoder::~UMT5Encoder() = default;

at::Tensor UMT5Encoder::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask, UMT5Trace* trace) const {
  const auto& c = impl_->config;
  if (input_ids.dim() != 2 || attention_mask.sizes() != input_ids.sizes()) {
    throw std::invalid_argument("UMT5Encoder: input_ids and attention_mask must both be [B, T]; got " +
                                checkpoint::shape_str(input_ids.sizes().vec()) + " and " +
                                checkpoint::shape_str(attention_mask.sizes().vec()));
  }
  if (at::isFloatingType(input_ids.scalar_type()) || input_ids.scalar_type() == at::kBool) {
    throw std::invalid_argument("UMT5Encoder: input_ids must be an integer tensor");
  }
  if (input_ids.numel() == 0) throw std::invalid_argument("UMT5Encoder: empty input_ids");
  const at::Tensor ids = input_ids.to(impl_->device, at::kLong);
  const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
  if (lo < 0 || hi >= c.vocab_size) {
    throw std::invalid_argument("UMT5Encoder: token id " + std::to_string(lo < 0 ? lo : hi) +
                                " is outside the embedding (vocab_size " + std::to_string(c.vocab_size) + ")");
  }
  at::Tensor x = at::embedding(impl_->shared, ids);
  // (1 - mask) * finfo(dtype).min on padded keys, in the embeddings' dtype.
  const at::Tensor mask = (1.0 - attention_mask.to(impl_->device).unsqueeze(1).unsqueeze(1).to(x.scalar_type())) *
                          lowest_of(x.scalar_type());
  const int64_t length = ids.size(1);
  const at::Tensor positions = at::arange(length, ids.options());
  const at::Tensor buckets =
      umt5_relative_position_bucket(positions.unsqueeze(0) - positions.unsqueeze(1), c.relative_attention_num_buckets,
                                    c.relative_attention_max_distance);
  if (trace) {
    trace->embeddings = x;
    trace->extended_attention_mask = mask;
  }
  for (const Layer& layer : impl_->layers) {
    x = x + impl_->attention(layer, rms_norm(x, layer.norm1, c.layer_norm_epsilon), buckets, mask, trace);
    if (trace) trace->after_attention.push_back(x);
    x = x + impl_->feed_forward(layer, rms_norm(x, layer.norm2, c.layer_norm_epsilon));
    if (trace) trace->block_out.push_back(x);
  }
  return rms_norm(x, impl_->final_norm, c.layer_norm_epsilon).to(impl_->dtype);
}

const UMT5Config& UMT5Encoder::config() const { return impl_->config; }
c10::Device UMT5Encoder::device() const { return impl_->device; }
at::ScalarType UMT5Encoder::compute_dtype() const { return impl_->dtype; }
const checkpoint::StateDict& UMT5Encoder::weights() const { return impl_->weights; }

// ---- loading --------------------------------------------------------------------------------------------------------

const char* umt5_layout_name(UMT5Layout layout) {
  return layout == UMT5Layout::Transformers ? "transformers" : "original";
}

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

bool is_transformers_key(const std::string& k) {
  return k == "shared.weight" || starts_with(k, "encoder.") || starts_with(k, "decoder.") || k == "lm_head.weight";
}
bool is_original_key(const std::string& k) {
  return k == "token_embedding.weight" || starts_with(k, "blocks.") || k == "norm.weight" ||
         starts_with(k, "pos_embedding.");
}

// Original names -> internal; the inverse (for naming a missing key) is the same table read backwards.
const std::vector<checkpoint::RenameRule>& original_rules() {
  static const std::vector<checkpoint::RenameRule> rules = {
      {"norm.weight", "encoder.final_layer_norm.weight"},  // first: only the top-level key contains it
      {"token_embedding.weight", "shared.weight"},
      {"blocks.", "encoder.block."},
      {".attn.q.", ".layer.0.SelfAttention.q."},
      {".attn.k.", ".layer.0.SelfAttention.k."},
      {".attn.v.", ".layer.0.SelfAttention.v."},
      {".attn.o.", ".layer.0.SelfAttention.o."},
      {".pos_embedding.embedding.", ".layer.0.SelfAttention.relative_attention_bias."},
      {".norm1.", ".layer.0.layer_norm."},
      {".norm2.", ".layer.1.layer_norm."},
      {".ffn.gate.0.", ".layer.1.DenseReluDense.wi_0."},
      {".ffn.fc1.", ".layer.1.DenseReluDense.wi_1."},
      {".ffn.fc2.", ".layer.1.DenseReluDense.wo."},
  };
  return rules;
}

std::string original_key_of(const std::string& internal) {
  if (internal == "encoder.final_layer_norm.weight") return "norm.weight";
  std::vector<checkpoint::RenameRule> inverse;
  const auto& rules = original_rules();
  for (auto it = rules.rbegin(); it != rules.rend(); ++it) {
    if (it->from != "norm.weight") inverse.push_back({it->to, it->from});
  }
  return checkpoint::apply_rules(internal, inverse);
}

nlohmann::json read_json(const fs::path& file) {
  std::ifstream in(file);
  if (!in) throw CheckpointError("cannot read '" + file.string() + "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw CheckpointError("'" + file.string() + "' is not valid JSON (" + e.what() + ")");
  }
}

int64_t json_int(const nlohmann::json& j, const fs::path& file, const char* key, std::optional<int64_t> fallback,
                 std::vector<std::string>& notes) {
  if (!j.contains(key) || j[key].is_null()) {
    if (!fallback) throw CheckpointError("'" + file.string() + "': required field '" + key + "' is missing");
    notes.push_back(std::string(key) + " not in config.json; using " + std::to_string(*fallback));
    return *fallback;
  }
  if (!j[key].is_number_integer())
    throw CheckpointError("'" + file.string() + "': field '" + key + "' is not an integer");
  return j[key].get<int64_t>();
}

UMT5Config parse_transformers_config(const nlohmann::json& j, const fs::path& file, std::vector<std::string>& notes) {
  const std::string model_type = j.value("model_type", std::string("umt5"));
  if (model_type == "t5" || model_type == "mt5") {
    throw CheckpointError(
        "'" + file.string() + "': model_type '" + model_type +
        "' shares layer 0's relative attention bias; this encoder implements UMT5 (a bias per layer)");
  }
  const std::string ffn = j.value("feed_forward_proj", std::string("gated-gelu"));
  if (ffn != "gated-gelu") {
    throw CheckpointError("'" + file.string() + "': feed_forward_proj '" + ffn +
                          "' is not supported (UMT5 text encoders use gated-gelu)");
  }
  UMT5Config c;
  c.vocab_size = json_int(j, file, "vocab_size", std::nullopt, notes);
  c.d_model = json_int(j, file, "d_model", std::nullopt, notes);
  c.d_kv = json_int(j, file, "d_kv", std::nullopt, notes);
  c.d_ff = json_int(j, file, "d_ff", std::nullopt, notes);
  c.num_layers = json_int(j, file, "num_layers", std::nullopt, notes);
  c.num_heads = json_int(j, file, "num_heads", std::nullopt, notes);
  c.relative_attention_num_buckets = json_int(j, file, "relative_attention_num_buckets", 32, notes);
  c.relative_attention_max_distance = json_int(j, file, "relative_attention_max_distance", 128, notes);
  if (j.contains("layer_norm_epsilon")) {
    if (!j["layer_norm_epsilon"].is_number()) {
      throw CheckpointError("'" + file.string() + "': field 'layer_norm_epsilon' is not a number");
    }
    c.layer_norm_epsilon = j["layer_norm_epsilon"].get<double>();
  }
  return c;
}

// Wan's T5Encoder constructor arguments (vocab, dim, dim_attn, dim_ffn, num_heads, num_layers, num_buckets,
// shared_pos, dropout); its relative embedding has max_dist 128 and its norms eps 1e-6.
UMT5Config parse_original_config(const nlohmann::json& j, const fs::path& file, std::vector<std::string>& notes) {
  if (j.value("shared_pos", false)) {
    throw CheckpointError("'" + file.string() +
                          "': shared_pos=true (one position bias for all layers) is T5, not the UMT5 encoder of Wan");
  }
  UMT5Config c;
  c.vocab_size = json_int(j, file, "vocab", std::nullopt, notes);
  c.d_model = json_int(j, file, "dim", std::nullopt, notes);
  const int64_t dim_attn = json_int(j, file, "dim_attn", std::nullopt, notes);
  c.d_ff = json_int(j, file, "dim_ffn", std::nullopt, notes);
  c.num_heads = json_int(j, file, "num_heads", std::nullopt, notes);
  c.num_layers = json_int(j, file, "num_layers", std::nullopt, notes);
  c.relative_attention_num_buckets = json_int(j, file, "num_buckets", 32, notes);
  if (c.num_heads <= 0 || dim_attn % c.num_heads != 0) {
    throw CheckpointError("'" + file.string() + "': dim_attn " + std::to_string(dim_attn) +
                          " is not a multiple of num_heads " + std::to_string(c.num_heads));
  }
  c.d_kv = dim_attn / c.num_heads;
  return c;
}

UMT5Config infer_config(const std::map<std::string, at::Tensor>& tensors) {
  auto shape = [&](const std::string& name) {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      throw CheckpointError("no config.json, and the config cannot be inferred without '" + name + "'");
    }
    return it->second.sizes().vec();
  };
  UMT5Config c;
  const auto emb = shape("shared.weight");
  c.vocab_size = emb.at(0);
  c.d_model = emb.at(1);
  int64_t layers = 0;
  static const std::regex block(R"(encoder\.block\.(\d+)\..*)");
  for (const auto& [name, t] : tensors) {
    std::smatch m;
    if (std::regex_match(name, m, block)) layers = std::max<int64_t>(layers, std::stoll(m[1].str()) + 1);
  }
  c.num_layers = layers;
  const std::string a = layer_prefix(0) + "layer.0.SelfAttention.";
  const auto bias = shape(a + "relative_attention_bias.weight");
  c.relative_attention_num_buckets = bias.at(0);
  c.num_heads = bias.at(1);
  const int64_t inner = shape(a + "q.weight").at(0);
  if (inner % c.num_heads != 0) throw CheckpointError("q rows " + std::to_string(inner) + " not divisible by heads");
  c.d_kv = inner / c.num_heads;
  c.d_ff = shape(layer_prefix(0) + "layer.1.DenseReluDense.wi_0.weight").at(0);
  return c;  // max distance 128 and eps 1e-6: what every UMT5 / Wan T5 uses
}

// A pipeline folder holds text_encoder/; a text encoder folder holds the weights itself.
fs::path resolve_encoder_path(const std::string& path) {
  fs::path p(path);
  if (fs::is_directory(p) && !fs::exists(p / "config.json") && fs::is_directory(p / "text_encoder")) {
    return p / "text_encoder";
  }
  return p;
}

}  // namespace

UMT5Layout detect_umt5_layout(const std::vector<std::string>& keys) {
  size_t transformers = 0, original = 0;
  for (const auto& k : keys) {
    transformers += is_transformers_key(k);
    original += is_original_key(k);
  }
  if (transformers && original) {
    throw CheckpointError("checkpoint mixes transformers UMT5 names (" + std::to_string(transformers) +
                          " keys such as 'shared.weight', 'encoder.block.N...') and original Wan T5 names (" +
                          std::to_string(original) + " keys such as 'token_embedding.weight', 'blocks.N...')");
  }
  if (transformers) return UMT5Layout::Transformers;
  if (original) return UMT5Layout::Original;
  throw CheckpointError(
      "no UMT5 text encoder keys found (expected 'shared.weight' / 'encoder.block.N...' or "
      "'token_embedding.weight' / 'blocks.N...')");
}

const std::vector<checkpoint::RenameRule>& umt5_rename_rules(UMT5Layout layout) {
  static const std::vector<checkpoint::RenameRule> transformers = {
      {"encoder.embed_tokens.weight", "shared.weight"}};  // used only when shared.weight itself is absent
  return layout == UMT5Layout::Transformers ? transformers : original_rules();
}

LoadedUMT5 load_umt5_encoder(const std::string& path, const UMT5LoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path where = resolve_encoder_path(path);
  const checkpoint::Source source = checkpoint::Source::open(where.string(), "model");
  LoadedUMT5 loaded;
  UMT5LoadReport& report = loaded.report;
  report.files = source.files();
  const std::vector<std::string> keys = source.keys();
  report.layout = detect_umt5_layout(keys);
  const bool hf = report.layout == UMT5Layout::Transformers;

  // The token embedding: never left to chance (transformers 5.x once skipped the tie and left it uninitialised).
  std::string embedding_key;
  if (hf) {
    if (source.contains("shared.weight")) {
      embedding_key = "shared.weight";
      if (source.contains("encoder.embed_tokens.weight")) {
        report.notes.push_back("encoder.embed_tokens.weight ignored: shared.weight is the (tied) embedding");
      }
    } else if (source.contains("encoder.embed_tokens.weight")) {
      embedding_key = "encoder.embed_tokens.weight";
    }
  } else if (source.contains("token_embedding.weight")) {
    embedding_key = "token_embedding.weight";
  }
  if (embedding_key.empty()) {
    throw CheckpointError("UMT5 text encoder '" + path + "' has no token embedding: expected " +
                          (hf ? std::string("'shared.weight' or 'encoder.embed_tokens.weight'")
                              : std::string("'token_embedding.weight'")) +
                          " (it is never initialised at random)");
  }
  report.notes.push_back("token embedding read from '" + embedding_key + "'");

  std::map<std::string, at::Tensor> tensors;
  checkpoint::KeyOrigins origins;
  if (!hf) origins.expected_key = original_key_of;
  size_t ignored = 0;
  for (const auto& key : keys) {
    if (hf && (starts_with(key, "decoder.") || key == "lm_head.weight")) {
      ++ignored;
      continue;
    }
    if (hf && key == "encoder.embed_tokens.weight" && embedding_key != key) continue;
    const std::string internal = checkpoint::apply_rules(key, umt5_rename_rules(report.layout));
    tensors[internal] = source.tensor(key);
    origins.source_key[internal] = key;
  }
  if (ignored) report.notes.push_back(std::to_string(ignored) + " decoder / lm_head tensors ignored (encoder only)");

  UMT5Config config;
  const fs::path config_file = fs::path(source.folder()) / "config.json";
  if (fs::exists(config_file)) {
    const nlohmann::json j = read_json(config_file);
    const bool original_form = j.contains("dim") && !j.contains("d_model");
    config = original_form ? parse_original_config(j, config_file, report.notes)
                           : parse_transformers_config(j, config_file, report.notes);
    report.config_source = original_form ? "config.json (original)" : "config.json (transformers)";
  } else {
    config = infer_config(tensors);
    report.config_source = "inferred from shapes (max distance 128, eps 1e-6)";
  }
  try {
    config.validate();
  } catch (const std::invalid_argument& e) {
    throw CheckpointError("UMT5 text encoder '" + path + "': " + e.what());
  }

  const std::string dtype_name = runtime::resolve_dtype_name(options.dtype, options.device);
  checkpoint::PlaceOptions place;
  place.device = options.device;
  place.dtype = checkpoint::parse_dtype(dtype_name);
  checkpoint::StateDict placed = checkpoint::place_strict(tensors, umt5_parameter_specs(config), place,
                                                          "UMT5 text encoder '" + path + "'", origins);
  for (const auto& [name, t] : placed) report.parameter_count += t.numel();
  loaded.model =
      std::make_unique<UMT5Encoder>(config, std::move(placed), checkpoint::parse_device(options.device), place.dtype);
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  spdlog::info("UMT5 text encoder: {} layout, {} layers, d_model {}, {} parameters, {} on {}, {:.2f} s",
               umt5_layout_name(report.layout), config.num_layers, config.d_model, report.parameter_count, dtype_name,
               options.device, report.seconds);
  return loaded;
}

// ---- random checkpoints ---------------------------------------------------------------------------------------------

void write_random_umt5_encoder(const std::string& dir, const UMT5Config& config, uint64_t seed) {
  config.validate();
  fs::create_directories(dir);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& spec : umt5_parameter_specs(config)) {
    at::Tensor t = at::empty(spec.shape, at::kFloat);
    const std::string& n = spec.name;
    if (n == "shared.weight") {
      t.normal_(0.0, 1.0, gen);
    } else if (n.find("layer_norm") != std::string::npos) {
      t.normal_(1.0, 0.1, gen);
    } else if (n.find("relative_attention_bias") != std::string::npos) {
      t.normal_(0.0, 1.0, gen);
    } else {
      t.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(spec.shape[1])), gen);
    }
    tensors.emplace_back(n, t);
  }
  safetensors::save((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  std::ofstream((fs::path(dir) / "config.json").string()) << config.to_transformers_json();
}

UMT5Config tiny_umt5_config(int64_t d_model, int64_t vocab_size) {
  UMT5Config c;
  c.vocab_size = vocab_size;
  c.d_model = d_model;
  c.num_heads = 2;
  c.d_kv = std::max<int64_t>(1, d_model / 2);
  c.d_ff = 2 * d_model;
  c.num_layers = 2;
  return c;
}

void write_tiny_text_encoder(const std::string& dir, int64_t d_model, uint64_t seed) {
  write_random_umt5_encoder(dir, tiny_umt5_config(d_model), seed);
}

}  // namespace skyreels::model
