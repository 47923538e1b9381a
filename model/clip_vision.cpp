#include "model/clip_vision.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "model/runtime.h"

namespace fs = std::filesystem;

namespace skyreels::model {

using checkpoint::CheckpointError;
using Json = nlohmann::json;

ClipVisionConfig ClipVisionConfig::vit_h_14() { return {}; }

void ClipVisionConfig::validate() const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  require(hidden_size >= 1 && intermediate_size >= 1 && num_hidden_layers >= 1 && projection_dim >= 1,
          "hidden_size/intermediate_size/num_hidden_layers/projection_dim: must be >= 1");
  require(num_attention_heads >= 1 && hidden_size % num_attention_heads == 0,
          "num_attention_heads: " + std::to_string(num_attention_heads) + " does not divide hidden_size " +
              std::to_string(hidden_size));
  require(patch_size >= 1 && image_size >= patch_size && image_size % patch_size == 0,
          "image_size: " + std::to_string(image_size) + " must be a positive multiple of patch_size " +
              std::to_string(patch_size));
  require(num_channels >= 1, "num_channels: must be >= 1");
  require(hidden_act == "gelu" || hidden_act == "quick_gelu" || hidden_act == "gelu_new" ||
              hidden_act == "gelu_pytorch_tanh",
          "hidden_act: '" + hidden_act + "' is not supported (gelu, quick_gelu, gelu_new, gelu_pytorch_tanh)");
  require(layer_norm_eps > 0, "layer_norm_eps: must be > 0");
}

ClipVisionConfig ClipVisionConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw CheckpointError("cannot read the image encoder's config.json '" + path + "'");
  Json j;
  try {
    j = Json::parse(in);
  } catch (const std::exception& e) {
    throw CheckpointError("'" + path + "' is not valid JSON (" + e.what() + ")");
  }
  if (j.is_object() && j.contains("vision_config") && j["vision_config"].is_object()) j = j["vision_config"];
  if (!j.is_object()) throw CheckpointError("'" + path + "' is not a JSON object");
  const std::string type = j.value("model_type", std::string("clip_vision_model"));
  if (type != "clip_vision_model") {
    throw CheckpointError("'" + path + "': model_type '" + type + "' is not a CLIP vision model (clip_vision_model)");
  }
  ClipVisionConfig c;
  auto integer = [&](const char* field, int64_t& out) {
    if (!j.contains(field) || j[field].is_null()) return;
    if (!j[field].is_number_integer()) {
      throw CheckpointError("'" + path + "': field '" + field + "' must be an integer, got " + j[field].dump());
    }
    out = j[field].get<int64_t>();
  };
  integer("hidden_size", c.hidden_size);
  integer("intermediate_size", c.intermediate_size);
  integer("num_hidden_layers", c.num_hidden_layers);
  integer("num_attention_heads", c.num_attention_heads);
  integer("image_size", c.image_size);
  integer("patch_size", c.patch_size);
  integer("num_channels", c.num_channels);
  integer("projection_dim", c.projection_dim);
  if (j.contains("hidden_act")) {
    if (!j["hidden_act"].is_string()) throw CheckpointError("'" + path + "': field 'hidden_act' must be a string");
    c.hidden_act = j["hidden_act"].get<std::string>();
  }
  if (j.contains("layer_norm_eps")) {
    if (!j["layer_norm_eps"].is_number())
      throw CheckpointError("'" + path + "': field 'layer_norm_eps' must be a number");
    c.layer_norm_eps = j["layer_norm_eps"].get<double>();
  }
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw CheckpointError("'" + path + "': " + e.what());
  }
  return c;
}

std::string ClipVisionConfig::to_transformers_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"CLIPVisionModelWithProjection"};
  j["hidden_act"] = hidden_act;
  j["hidden_size"] = hidden_size;
  j["image_size"] = image_size;
  j["intermediate_size"] = intermediate_size;
  j["layer_norm_eps"] = layer_norm_eps;
  j["model_type"] = "clip_vision_model";
  j["num_attention_heads"] = num_attention_heads;
  j["num_channels"] = num_channels;
  j["num_hidden_layers"] = num_hidden_layers;
  j["patch_size"] = patch_size;
  j["projection_dim"] = projection_dim;
  return j.dump(2);
}

namespace {

std::string layer_prefix(int64_t i) { return "vision_model.encoder.layers." + std::to_string(i) + "."; }

}  // namespace

std::vector<checkpoint::ParamSpec> clip_vision_parameter_specs(const ClipVisionConfig& c) {
  const int64_t h = c.hidden_size;
  std::vector<checkpoint::ParamSpec> specs;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) { specs.push_back({name, std::move(shape)}); };
  auto linear = [&](const std::string& prefix, int64_t out, int64_t in) {
    add(prefix + ".weight", {out, in});
    add(prefix + ".bias", {out});
  };
  auto norm = [&](const std::string& prefix) {
    add(prefix + ".weight", {h});
    add(prefix + ".bias", {h});
  };
  add("vision_model.embeddings.class_embedding", {h});
  add("vision_model.embeddings.patch_embedding.weight", {h, c.num_channels, c.patch_size, c.patch_size});
  add("vision_model.embeddings.position_embedding.weight", {c.tokens(), h});
  norm("vision_model.pre_layrnorm");  // transformers' spelling
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = layer_prefix(i);
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"}) linear(p + "self_attn." + proj, h, h);
    norm(p + "layer_norm1");
    linear(p + "mlp.fc1", c.intermediate_size, h);
    linear(p + "mlp.fc2", h, c.intermediate_size);
    norm(p + "layer_norm2");
  }
  norm("vision_model.post_layernorm");
  add("visual_projection.weight", {c.projection_dim, h});
  return specs;
}

// ---- the model --------------------------------------------------------------------------------------------------

namespace {

using at::Tensor;

struct Linear {
  Tensor weight, bias;
  Tensor operator()(const Tensor& x) const { return at::linear(x, weight, bias); }
};

struct LayerNorm {
  Tensor weight, bias;
};

struct EncoderLayer {
  Linear q, k, v, out, fc1, fc2;
  LayerNorm norm1, norm2;
};

}  // namespace

struct ClipVisionEncoder::Impl {
  ClipVisionConfig config;
  checkpoint::StateDict weights;
  c10::Device device{c10::kCPU};
  at::ScalarType dtype = at::kFloat;

  Tensor class_embedding, patch_weight, position_embedding, projection;
  LayerNorm pre_norm, post_norm;
  std::vector<EncoderLayer> layers;

  const Tensor& w(const std::string& name) const { return weights.at(name); }
  Linear linear(const std::string& p) const { return {w(p + ".weight"), w(p + ".bias")}; }
  LayerNorm norm(const std::string& p) const { return {w(p + ".weight"), w(p + ".bias")}; }

  void check_weights() const;
  void bind_weights();
  Tensor layer_norm(const Tensor& x, const LayerNorm& n) const {
    return at::layer_norm(x, {config.hidden_size}, n.weight, n.bias, config.layer_norm_eps);
  }
  Tensor activation(const Tensor& x) const;
  Tensor embeddings(const Tensor& pixel_values) const;
  Tensor attention(const EncoderLayer& l, const Tensor& x) const;
  Tensor layer_forward(const EncoderLayer& l, const Tensor& x) const;
};

void ClipVisionEncoder::Impl::check_weights() const {
  std::vector<std::string> problems;
  std::set<std::string> expected;
  for (const auto& spec : clip_vision_parameter_specs(config)) {
    expected.insert(spec.name);
    auto it = weights.find(spec.name);
    if (it == weights.end() || !it->second.defined()) {
      problems.push_back(spec.name + ": missing");
    } else if (it->second.sizes().vec() != spec.shape) {
      problems.push_back(spec.name + ": shape " + checkpoint::shape_str(it->second.sizes().vec()) + ", expected " +
                         checkpoint::shape_str(spec.shape));
    } else if (it->second.scalar_type() != dtype) {
      problems.push_back(spec.name + ": dtype " + c10::toString(it->second.scalar_type()) + ", expected " +
                         c10::toString(dtype));
    }
  }
  for (const auto& [name, t] : weights) {
    if (!expected.count(name)) problems.push_back(name + ": unexpected (no such parameter in this config)");
  }
  if (problems.empty()) return;
  std::string text;
  for (const auto& p : problems) text += "\n  " + p;
  throw std::invalid_argument("ClipVisionEncoder: " + std::to_string(problems.size()) + " weight problem(s):" + text);
}

void ClipVisionEncoder::Impl::bind_weights() {
  class_embedding = w("vision_model.embeddings.class_embedding");
  const Tensor& patch = w("vision_model.embeddings.patch_embedding.weight");
  patch_weight = patch.reshape({patch.size(0), -1});  // the stride == kernel convolution as a linear
  position_embedding = w("vision_model.embeddings.position_embedding.weight");
  projection = w("visual_projection.weight");
  pre_norm = norm("vision_model.pre_layrnorm");
  post_norm = norm("vision_model.post_layernorm");
  layers.clear();
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const std::string p = layer_prefix(i);
    layers.push_back({linear(p + "self_attn.q_proj"), linear(p + "self_attn.k_proj"), linear(p + "self_attn.v_proj"),
                      linear(p + "self_attn.out_proj"), linear(p + "mlp.fc1"), linear(p + "mlp.fc2"),
                      norm(p + "layer_norm1"), norm(p + "layer_norm2")});
  }
}

Tensor ClipVisionEncoder::Impl::activation(const Tensor& x) const {
  const std::string& act = config.hidden_act;
  if (act == "gelu") return at::gelu(x);
  if (act == "quick_gelu") return x * at::sigmoid(1.702 * x);
  return at::gelu(x, "tanh");  // gelu_new, gelu_pytorch_tanh
}

Tensor ClipVisionEncoder::Impl::embeddings(const Tensor& pixel_values) const {
  // Patches in (c, kh, kw) order, row-major over the grid: the conv2d with kernel == stride as one GEMM.
  const int64_t n = pixel_values.size(0), c = config.num_channels, p = config.patch_size;
  const int64_t g = config.image_size / p;
  const Tensor patches = pixel_values.to(device, dtype)
                             .reshape({n, c, g, p, g, p})
                             .permute({0, 2, 4, 1, 3, 5})
                             .reshape({n, g * g, c * p * p});
  const Tensor patch_embeds = at::matmul(patches, patch_weight.t());
  const Tensor cls = class_embedding.view({1, 1, -1}).expand({n, 1, config.hidden_size});
  return at::cat({cls, patch_embeds}, 1) + position_embedding.unsqueeze(0);
}

Tensor ClipVisionEncoder::Impl::attention(const EncoderLayer& l, const Tensor& x) const {
  const int64_t n = x.size(0), t = x.size(1), heads = config.num_attention_heads, hd = config.head_dim();
  auto split = [&](const Tensor& y) { return y.view({n, t, heads, hd}).transpose(1, 2); };
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const Tensor q = split(l.q(x) * scale), k = split(l.k(x)), v = split(l.v(x));
  const Tensor probs = at::softmax(at::matmul(q, k.transpose(-1, -2)), -1);
  return l.out(at::matmul(probs, v).transpose(1, 2).reshape({n, t, config.hidden_size}));
}

Tensor ClipVisionEncoder::Impl::layer_forward(const EncoderLayer& l, const Tensor& x) const {
  const Tensor h = x + attention(l, layer_norm(x, l.norm1));
  return h + l.fc2(activation(l.fc1(layer_norm(h, l.norm2))));
}

ClipVisionEncoder::ClipVisionEncoder(ClipVisionConfig config, checkpoint::StateDict weights, c10::Device device,
                                     at::ScalarType compute_dtype)
    : impl_(std::make_unique<Impl>()) {
  config.validate();
  if (compute_dtype != at::kFloat && compute_dtype != at::kBFloat16 && compute_dtype != at::kHalf) {
    throw std::invalid_argument(std::string("compute_dtype: expected float32, bfloat16 or float16, got ") +
                                c10::toString(compute_dtype));
  }
  impl_->config = std::move(config);
  impl_->weights = std::move(weights);
  impl_->device = device;
  impl_->dtype = compute_dtype;
  impl_->check_weights();
  impl_->device = impl_->weights.at("visual_projection.weight").device();
  impl_->bind_weights();
}

ClipVisionEncoder::~ClipVisionEncoder() = default;

const ClipVisionConfig& ClipVisionEncoder::config() const { return impl_->config; }
c10::Device ClipVisionEncoder::device() const { return impl_->device; }
at::ScalarType ClipVisionEncoder::compute_dtype() const { return impl_->dtype; }

ClipVisionOutput ClipVisionEncoder::forward(const at::Tensor& pixel_values, bool image_embeds,
                                            bool all_hidden_states) const {
  const Impl& m = *impl_;
  const ClipVisionConfig& c = m.config;
  if (!pixel_values.defined() || pixel_values.dim() != 4 || pixel_values.size(1) != c.num_channels ||
      pixel_values.size(2) != c.image_size || pixel_values.size(3) != c.image_size || pixel_values.size(0) < 1 ||
      !at::isFloatingType(pixel_values.scalar_type())) {
    std::ostringstream os;
    if (pixel_values.defined()) os << ", got " << pixel_values.sizes();
    throw std::invalid_argument("pixel_values: expected float [N, " + std::to_string(c.num_channels) + ", " +
                                std::to_string(c.image_size) + ", " + std::to_string(c.image_size) +
                                "] (the image processor's crop must be the encoder's image_size)" + os.str());
  }
  c10::NoGradGuard no_grad;
  ClipVisionOutput out;
  auto keep = [&](const Tensor& h) {
    if (all_hidden_states) out.hidden_states.push_back(h.to(at::kCPU, at::kFloat));
  };
  Tensor h = m.layer_norm(m.embeddings(pixel_values), m.pre_norm);
  keep(h);
  const int64_t layers = static_cast<int64_t>(m.layers.size());
  for (int64_t i = 0; i + 1 < layers; ++i) {
    h = m.layer_forward(m.layers[static_cast<size_t>(i)], h);
    keep(h);
  }
  out.penultimate = h.to(at::kCPU, at::kFloat);
  if (image_embeds || all_hidden_states) {
    const Tensor last = m.layer_forward(m.layers.back(), h);
    keep(last);
    if (image_embeds) {
      const Tensor pooled = m.layer_norm(last.select(1, 0), m.post_norm);
      out.image_embeds = at::matmul(pooled, m.projection.t()).to(at::kCPU, at::kFloat);
    }
  }
  return out;
}

// ---- loading ----------------------------------------------------------------------------------------------------

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// A pipeline folder holds image_encoder/; an image encoder folder holds the weights itself.
fs::path resolve_encoder_path(const std::string& path) {
  const fs::path p(path);
  if (fs::is_directory(p) && !fs::exists(p / "config.json") && fs::is_directory(p / "image_encoder")) {
    return p / "image_encoder";
  }
  return p;
}

// The text tower of a full CLIP model (transformers' CLIPModel, Wan's XLMRobertaCLIP), which the pipeline never runs.
bool is_text_tower(const std::string& key) {
  return starts_with(key, "text_model.") || key == "text_projection.weight" || key == "logit_scale" ||
         starts_with(key, "textual.") || key == "log_scale";
}

ClipVisionLayout detect_layout(const std::vector<std::string>& keys, const std::string& context) {
  bool transformers = false, original = false;
  for (const auto& k : keys) {
    transformers = transformers || starts_with(k, "vision_model.") || k == "visual_projection.weight";
    original = original || starts_with(k, "visual.");
  }
  if (transformers && original) {
    throw CheckpointError(context + " mixes transformers names (vision_model.*) with original Wan names (visual.*)");
  }
  if (original) return ClipVisionLayout::Original;
  if (transformers) return ClipVisionLayout::Transformers;
  throw CheckpointError(context +
                        " holds no CLIP image encoder tensors (expected transformers' vision_model.* or the "
                        "original visual.*)");
}

// The fused projection of the original layout: to_qkv rows [q; k; v] (Wan views them as [.., 3, heads, head_dim]).
constexpr const char* kFusedQkv = ".self_attn.qkv_proj.";

// Original tensors renamed, then the transforms a rename cannot do.
void convert_original(std::map<std::string, at::Tensor>& tensors, checkpoint::KeyOrigins& origins,
                      const std::string& context) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : tensors) {
    const std::string& key = origins.source_key.at(name);
    const size_t fused = name.find(kFusedQkv);
    if (fused != std::string::npos) {
      if (t.dim() < 1 || t.size(0) % 3 != 0) {
        throw CheckpointError(context + ": '" + key + "' has shape " + checkpoint::shape_str(t.sizes().vec()) +
                              "; a fused q/k/v projection needs 3 x hidden rows");
      }
      const int64_t rows = t.size(0) / 3;
      const std::string prefix = name.substr(0, fused) + ".self_attn.";
      const std::string leaf = name.substr(fused + std::string(kFusedQkv).size());  // weight / bias
      const char* parts[] = {"q_proj.", "k_proj.", "v_proj."};
      for (int64_t i = 0; i < 3; ++i) {
        const std::string split = prefix + parts[i] + leaf;
        out[split] = t.narrow(0, i * rows, rows);
        origins.source_key[split] =
            key + " (rows " + std::to_string(i * rows) + ".." + std::to_string((i + 1) * rows) + ")";
      }
      origins.source_key.erase(name);
      continue;
    }
    if (name == "vision_model.embeddings.class_embedding" && t.dim() == 3 && t.size(0) == 1 && t.size(1) == 1) {
      out[name] = t.reshape({t.size(2)});  // [1, 1, H] -> [H]
    } else if (name == "vision_model.embeddings.position_embedding.weight" && t.dim() == 3 && t.size(0) == 1) {
      out[name] = t.reshape({t.size(1), t.size(2)});  // [1, T, H] -> [T, H]
    } else if (name == "visual_projection.weight" && t.dim() == 2) {
      out[name] = t.t().contiguous();  // x @ head -> a linear's [projection, H] weight
    } else {
      out[name] = t;
    }
  }
  tensors = std::move(out);
}

// The original key an internal name is read from (to name a missing one): the rename table backwards, q / k / v
// from the fused projection.
std::string original_key_of(const std::string& internal) {
  std::string name = internal;
  for (const char* part : {".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."}) {
    const size_t at = name.find(part);
    if (at != std::string::npos) name.replace(at, std::string(part).size(), kFusedQkv);
  }
  std::vector<checkpoint::RenameRule> inverse;
  const auto& rules = clip_vision_original_rules();
  for (auto it = rules.rbegin(); it != rules.rend(); ++it) inverse.push_back({it->to, it->from});
  return checkpoint::apply_rules(name, inverse);
}

// The original layout's config, read off the shapes (its .pth has no config). The head split is not in the weights.
ClipVisionConfig infer_original_config(const std::map<std::string, at::Tensor>& t, const std::string& context,
                                       std::vector<std::string>& notes) {
  auto shape = [&](const std::string& name) {
    auto it = t.find(name);
    if (it == t.end()) throw CheckpointError(context + ": cannot infer the config without tensor '" + name + "'");
    return it->second.sizes().vec();
  };
  ClipVisionConfig c;
  const auto patch = shape("vision_model.embeddings.patch_embedding.weight");
  if (patch.size() != 4) throw CheckpointError(context + ": the patch embedding is not a 4-D convolution weight");
  c.hidden_size = patch[0];
  c.num_channels = patch[1];
  c.patch_size = patch[2];
  const int64_t tokens = shape("vision_model.embeddings.position_embedding.weight").at(0);
  const auto grid = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(tokens - 1))));
  if (grid * grid + 1 != tokens) {
    throw CheckpointError(context + ": " + std::to_string(tokens) + " positions are not a square grid plus CLS");
  }
  c.image_size = grid * c.patch_size;
  c.intermediate_size = shape("vision_model.encoder.layers.0.mlp.fc1.weight").at(0);
  c.projection_dim = shape("visual_projection.weight").at(0);
  int64_t layers = 0;
  while (t.count(layer_prefix(layers) + "layer_norm1.weight")) ++layers;
  c.num_hidden_layers = layers;
  constexpr int64_t kHeadDim = 80;  // ViT-H/14: 1280 = 16 heads x 80
  if (c.hidden_size % kHeadDim != 0) {
    throw CheckpointError(context + ": hidden size " + std::to_string(c.hidden_size) +
                          " is not a multiple of 80, and the weights do not record the head split; add a "
                          "transformers config.json beside the file");
  }
  c.num_attention_heads = c.hidden_size / kHeadDim;
  notes.push_back("config inferred from the shapes: " + std::to_string(c.num_hidden_layers) + " layers, hidden " +
                  std::to_string(c.hidden_size) + ", " + std::to_string(c.image_size) + " px; assumed " +
                  std::to_string(c.num_attention_heads) + " heads of 80, gelu, eps 1e-5 (Wan's ViT-H/14)");
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw CheckpointError(context + ": inferred config: " + e.what());
  }
  return c;
}

}  // namespace

const char* clip_vision_layout_name(ClipVisionLayout layout) {
  return layout == ClipVisionLayout::Original ? "original" : "transformers";
}

const std::vector<checkpoint::RenameRule>& clip_vision_original_rules() {
  // Wan's clip.py VisionTransformer -> transformers' CLIPVisionModelWithProjection.
  static const std::vector<checkpoint::RenameRule> rules = {
      {"visual.patch_embedding.", "vision_model.embeddings.patch_embedding."},
      {"visual.cls_embedding", "vision_model.embeddings.class_embedding"},
      {"visual.pos_embedding", "vision_model.embeddings.position_embedding.weight"},
      {"visual.pre_norm.", "vision_model.pre_layrnorm."},
      {"visual.post_norm.", "vision_model.post_layernorm."},
      {"visual.head", "visual_projection.weight"},
      {"visual.transformer.", "vision_model.encoder.layers."},
      {".norm1.", ".layer_norm1."},
      {".norm2.", ".layer_norm2."},
      {".attn.to_qkv.", kFusedQkv},  // split into q_proj / k_proj / v_proj by the loader
      {".attn.proj.", ".self_attn.out_proj."},
      {".mlp.0.", ".mlp.fc1."},
      {".mlp.2.", ".mlp.fc2."},
  };
  return rules;
}

LoadedClipVision load_clip_vision_encoder(const std::string& path, const ClipVisionLoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadedClipVision loaded;
  const fs::path where = resolve_encoder_path(path);
  loaded.path = where.string();
  const std::string context = "CLIP image encoder '" + loaded.path + "'";
  checkpoint::Source source = [&] {
    try {
      return checkpoint::Source::open(where.string(), "model");
    } catch (const safetensors::FormatError& e) {
      throw CheckpointError(context + ": " + e.what());
    } catch (const fs::filesystem_error& e) {
      throw CheckpointError(context + ": " + e.what());
    }
  }();
  std::vector<std::string> keys;
  int64_t ignored = 0;
  for (const auto& key : source.keys()) {
    if (is_text_tower(key)) {
      ++ignored;
    } else {
      keys.push_back(key);
    }
  }
  loaded.layout = detect_layout(keys, context);
  const bool original = loaded.layout == ClipVisionLayout::Original;
  if (ignored) loaded.notes.push_back(std::to_string(ignored) + " text-tower tensors ignored (image encoder only)");

  std::map<std::string, at::Tensor> tensors;
  checkpoint::KeyOrigins origins;
  for (const auto& key : keys) {
    const std::string name = original ? checkpoint::apply_rules(key, clip_vision_original_rules()) : key;
    tensors[name] = source.tensor(key);
    origins.source_key[name] = key;
  }
  if (original) {
    convert_original(tensors, origins, context);
    origins.expected_key = original_key_of;
  }

  const fs::path config_file = fs::path(source.folder()) / "config.json";
  ClipVisionConfig config;
  if (fs::exists(config_file)) {
    config = ClipVisionConfig::from_file(config_file.string());
    loaded.config_source = "config.json";
  } else if (original) {
    config = infer_original_config(tensors, context, loaded.notes);
    loaded.config_source = "inferred from the shapes";
  } else {
    throw CheckpointError(context + ": no config.json in '" + source.folder() +
                          "' (transformers' CLIPVisionConfig: hidden_size, num_hidden_layers, ...)");
  }

  const std::string dtype_name = runtime::resolve_dtype_name(options.dtype, options.device);
  checkpoint::PlaceOptions place;
  place.device = options.device;
  place.dtype = checkpoint::parse_dtype(dtype_name);
  checkpoint::StateDict placed =
      checkpoint::place_strict(tensors, clip_vision_parameter_specs(config), place, context, origins);
  loaded.model = std::make_unique<ClipVisionEncoder>(config, std::move(placed),
                                                     checkpoint::parse_device(options.device), place.dtype);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  spdlog::info("CLIP image encoder '{}': {} layout, {} layers, hidden {}, {}x{} px, {} on {}, {:.2f} s", loaded.path,
               clip_vision_layout_name(loaded.layout), config.num_hidden_layers, config.hidden_size, config.image_size,
               config.image_size, dtype_name, options.device, seconds);
  for (const auto& note : loaded.notes) spdlog::info("CLIP image encoder: {}", note);
  return loaded;
}

}  // namespace skyreels::model
