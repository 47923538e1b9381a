// The config of a transformer checkpoint: config.json in its two forms (diffusers SkyReelsV2Transformer3DModel and
// original WanModel, with errors naming the file and field and defaults recorded), the config implied by the tensor
// shapes when there is no config.json, and the contradictions between a config and the shapes. Separate from the
// loader because it only reads JSON and tensor shapes; the loader decides what to do with the result.
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/transformer_loader.h"
#include "model/transformer_loader_detail.h"

namespace skyreels::model {

using checkpoint::CheckpointError;
using json = nlohmann::json;
using loader_detail::shape_of;
using loader_detail::starts_with;

namespace {

constexpr int64_t kAssumedHeadDim = 128;                   // every published SkyReels-V2 / Wan model

// ---- config.json -------------------------------------------------------------------------------------------------

// Typed access to one config.json with errors that name the file and the field, and defaults that are recorded.
class ConfigReader {
 public:
  ConfigReader(const json& j, std::string path, std::string form, std::vector<std::string>& notes)
      : j_(j), path_(std::move(path)), form_(std::move(form)), notes_(notes) {}

  bool has(const char* field) const { return j_.contains(field) && !j_[field].is_null(); }

  int64_t integer(const char* field, int64_t fallback) {
    if (!has(field)) return defaulted(field, fallback);
    const json& v = j_[field];
    if (!v.is_number_integer()) fail(field, "must be an integer, got " + v.dump());
    return v.get<int64_t>();
  }
  std::optional<int64_t> optional_integer(const char* field) {
    if (!has(field)) return std::nullopt;
    return integer(field, 0);
  }
  double number(const char* field, double fallback) {
    if (!has(field)) return defaulted(field, fallback);
    const json& v = j_[field];
    if (!v.is_number()) fail(field, "must be a number, got " + v.dump());
    return v.get<double>();
  }
  bool boolean(const char* field, bool fallback) {
    if (!has(field)) return defaulted(field, fallback);
    const json& v = j_[field];
    if (!v.is_boolean()) fail(field, "must be true or false, got " + v.dump());
    return v.get<bool>();
  }
  std::array<int64_t, 3> triple(const char* field, std::array<int64_t, 3> fallback) {
    if (!has(field)) {
      notes_.push_back("config.json has no '" + std::string(field) + "'; using the " + form_ + " default [" +
                       std::to_string(fallback[0]) + ", " + std::to_string(fallback[1]) + ", " +
                       std::to_string(fallback[2]) + "]");
      return fallback;
    }
    const json& v = j_[field];
    if (!v.is_array() || v.size() != 3 || !v[0].is_number_integer() || !v[1].is_number_integer() ||
        !v[2].is_number_integer()) {
      fail(field, "must be a list of 3 integers, got " + v.dump());
    }
    return {v[0].get<int64_t>(), v[1].get<int64_t>(), v[2].get<int64_t>()};
  }
  std::string string(const char* field, const std::string& fallback) {
    if (!has(field)) return fallback;
    const json& v = j_[field];
    if (!v.is_string()) fail(field, "must be a string, got " + v.dump());
    return v.get<std::string>();
  }
  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw CheckpointError("config.json '" + path_ + "': field '" + field + "' " + what);
  }

 private:
  template <typename T>
  T defaulted(const char* field, T fallback) {
    std::ostringstream os;
    os << std::boolalpha << fallback;
    notes_.push_back("config.json has no '" + std::string(field) + "'; using the " + form_ + " default " + os.str());
    return fallback;
  }

  const json& j_;
  std::string path_;
  std::string form_;
  std::vector<std::string>& notes_;
};

void note_unknown_fields(const json& j, const std::set<std::string>& known, std::vector<std::string>& notes) {
  std::vector<std::string> unknown;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!known.count(it.key()) && it.key().rfind('_', 0) != 0) unknown.push_back(it.key());
  }
  if (unknown.empty()) return;
  std::string list;
  for (const auto& u : unknown) list += (list.empty() ? "" : ", ") + u;
  notes.push_back("config.json fields ignored: " + list);
}

TransformerConfig parse_diffusers_config(const json& j, ConfigReader& r, std::vector<std::string>& notes) {
  TransformerConfig c;
  c.patch_size = r.triple("patch_size", {1, 2, 2});
  c.num_attention_heads = r.integer("num_attention_heads", 16);
  c.attention_head_dim = r.integer("attention_head_dim", 128);
  c.in_channels = r.integer("in_channels", 16);
  c.out_channels = r.has("out_channels") ? r.integer("out_channels", 16) : c.in_channels;  // diffusers: or in_channels
  c.text_dim = r.integer("text_dim", 4096);
  c.freq_dim = r.integer("freq_dim", 256);
  c.ffn_dim = r.integer("ffn_dim", 8192);
  c.num_layers = r.integer("num_layers", 32);
  c.cross_attn_norm = r.boolean("cross_attn_norm", true);
  c.eps = r.number("eps", 1e-6);
  c.image_dim = r.optional_integer("image_dim");
  c.added_kv_proj_dim = r.optional_integer("added_kv_proj_dim");
  c.rope_max_seq_len = r.integer("rope_max_seq_len", 1024);
  c.inject_sample_info = r.boolean("inject_sample_info", false);
  c.num_frame_per_block = r.integer("num_frame_per_block", 1);
  c.pos_embed_seq_len = r.optional_integer("pos_embed_seq_len");
  const std::string qk_norm = r.string("qk_norm", "rms_norm_across_heads");
  if (qk_norm != "rms_norm_across_heads") {
    notes.push_back("config.json qk_norm '" + qk_norm + "' is ignored: diffusers always builds the q/k RMSNorm");
  }
  note_unknown_fields(
      j,
      {"patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim", "freq_dim",
       "ffn_dim", "num_layers", "cross_attn_norm", "qk_norm", "eps", "image_dim", "added_kv_proj_dim",
       "rope_max_seq_len", "pos_embed_seq_len", "inject_sample_info", "num_frame_per_block"},
      notes);
  return c;
}

TransformerConfig parse_original_config(const json& j, ConfigReader& r, std::vector<std::string>& notes) {
  // Defaults are WanModel.__init__'s (real configs omit patch_size, cross_attn_norm, qk_norm and text_dim).
  TransformerConfig c;
  const std::string model_type = r.string("model_type", "t2v");
  c.patch_size = r.triple("patch_size", {1, 2, 2});
  const int64_t dim = r.integer("dim", 2048);
  c.num_attention_heads = r.integer("num_heads", 16);
  if (c.num_attention_heads <= 0 || dim % c.num_attention_heads != 0) {
    r.fail("num_heads", "= " + std::to_string(c.num_attention_heads) + " does not divide dim = " + std::to_string(dim));
  }
  c.attention_head_dim = dim / c.num_attention_heads;
  c.in_channels = r.integer("in_dim", 16);
  c.out_channels = r.integer("out_dim", 16);
  c.text_dim = r.integer("text_dim", 4096);
  c.freq_dim = r.integer("freq_dim", 256);
  c.ffn_dim = r.integer("ffn_dim", 8192);
  c.num_layers = r.integer("num_layers", 32);
  c.cross_attn_norm = r.boolean("cross_attn_norm", true);
  c.eps = r.number("eps", 1e-6);
  c.inject_sample_info = r.boolean("inject_sample_info", false);
  if (!r.boolean("qk_norm", true)) r.fail("qk_norm", "is false: only the q/k-normalised model is supported");
  if (r.has("window_size") && j["window_size"] != json::array({-1, -1})) {
    r.fail("window_size", "is " + j["window_size"].dump() + ": only global attention [-1, -1] is supported");
  }
  if (model_type == "i2v" || model_type == "flf2v") {
    // WanModel's image branch: MLPProj(1280, dim) on CLIP ViT-H/14 tokens; flf2v adds emb_pos for 2 x 257 tokens.
    c.image_dim = 1280;
    c.added_kv_proj_dim = dim;
    if (model_type == "flf2v") c.pos_embed_seq_len = 2 * 257;
  } else if (model_type != "t2v") {
    r.fail("model_type", "is '" + model_type + "' (expected t2v, i2v or flf2v)");
  }
  note_unknown_fields(
      j,
      {"model_type", "patch_size", "text_len", "in_dim", "dim", "ffn_dim", "freq_dim", "text_dim", "out_dim",
       "num_heads", "num_layers", "window_size", "qk_norm", "cross_attn_norm", "eps", "inject_sample_info"},
      notes);
  return c;
}

// ---- shapes -> config --------------------------------------------------------------------------------------------

// One fact read off a tensor shape, with the tensor that shows it.
struct Fact {
  int64_t value = 0;
  std::string evidence;
};

struct ShapeFacts {
  std::optional<Fact> inner_dim, in_channels, patch_t, patch_h, patch_w, proj_out_rows, text_dim, freq_dim, ffn_dim,
      num_layers, image_dim, added_kv_proj_dim, pos_embed_seq_len;
  bool has_fps = false;
  bool has_cross_norm = false;
};

std::optional<Fact> dim_of(const std::map<std::string, at::Tensor>& t, const std::string& key, int64_t d) {
  auto it = t.find(key);
  if (it == t.end() || it->second.dim() <= d) return std::nullopt;
  return Fact{it->second.size(d), key + " " + shape_of(it->second)};
}

ShapeFacts read_facts(const std::map<std::string, at::Tensor>& t) {
  ShapeFacts f;
  f.inner_dim = dim_of(t, "patch_embedding.weight", 0);
  f.in_channels = dim_of(t, "patch_embedding.weight", 1);
  f.patch_t = dim_of(t, "patch_embedding.weight", 2);
  f.patch_h = dim_of(t, "patch_embedding.weight", 3);
  f.patch_w = dim_of(t, "patch_embedding.weight", 4);
  f.proj_out_rows = dim_of(t, "proj_out.weight", 0);
  f.text_dim = dim_of(t, "condition_embedder.text_embedder.linear_1.weight", 1);
  f.freq_dim = dim_of(t, "condition_embedder.time_embedder.linear_1.weight", 1);
  f.ffn_dim = dim_of(t, "blocks.0.ffn.net.0.proj.weight", 0);
  f.image_dim = dim_of(t, "condition_embedder.image_embedder.norm1.weight", 0);
  f.added_kv_proj_dim = dim_of(t, "blocks.0.attn2.add_k_proj.weight", 1);
  f.pos_embed_seq_len = dim_of(t, "condition_embedder.image_embedder.pos_embed", 1);
  f.has_fps = t.count("fps_embedding.weight") != 0;
  f.has_cross_norm = t.count("blocks.0.norm2.weight") != 0;
  int64_t max_block = -1;
  for (const auto& [name, tensor] : t) {
    if (!starts_with(name, "blocks.")) continue;
    const size_t dot = name.find('.', 7);
    try {
      max_block = std::max<int64_t>(max_block, std::stoll(name.substr(7, dot - 7)));
    } catch (const std::exception&) {
    }
  }
  if (max_block >= 0) f.num_layers = Fact{max_block + 1, "blocks.0 ... blocks." + std::to_string(max_block)};
  return f;
}

}  // namespace

// ---- public ------------------------------------------------------------------------------------------------------

ParsedTransformerConfig parse_transformer_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw CheckpointError("cannot read config.json '" + path + "'");
  json j;
  try {
    j = json::parse(in);
  } catch (const std::exception& e) {
    throw CheckpointError("config.json '" + path + "' is not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw CheckpointError("config.json '" + path + "' is not a JSON object");
  const std::string cls =
      j.contains("_class_name") && j["_class_name"].is_string() ? j["_class_name"].get<std::string>() : "";
  const bool original = cls == "WanModel" || (cls.empty() && (j.contains("dim") || j.contains("num_heads")));
  const bool diffusers = cls == "SkyReelsV2Transformer3DModel" ||
                         (cls.empty() && (j.contains("num_attention_heads") || j.contains("attention_head_dim")));
  ParsedTransformerConfig out;
  if (original) {
    out.form = "original";
    ConfigReader r(j, path, "WanModel", out.notes);
    out.config = parse_original_config(j, r, out.notes);
  } else if (diffusers) {
    out.form = "diffusers";
    ConfigReader r(j, path, "diffusers", out.notes);
    out.config = parse_diffusers_config(j, r, out.notes);
  } else if (!cls.empty()) {
    throw CheckpointError("config.json '" + path + "' describes a '" + cls +
                          "', not a SkyReels-V2 transformer (SkyReelsV2Transformer3DModel or WanModel)");
  } else {
    throw CheckpointError("config.json '" + path +
                          "' is neither a diffusers transformer config (num_attention_heads, attention_head_dim, ...) "
                          "nor an original WanModel config (dim, num_heads, ...)");
  }
  return out;
}

TransformerConfig infer_transformer_config(const std::map<std::string, at::Tensor>& tensors,
                                           std::vector<std::string>* notes) {
  const ShapeFacts f = read_facts(tensors);
  auto need = [](const std::optional<Fact>& fact, const char* what, const char* key) {
    if (!fact) {
      throw CheckpointError(std::string("cannot infer the transformer config: ") + what + " needs tensor '" + key +
                            "', which the checkpoint lacks; add a config.json");
    }
    return fact->value;
  };
  TransformerConfig c;
  const int64_t D = need(f.inner_dim, "the inner dim", "patch_embedding.weight");
  c.in_channels = need(f.in_channels, "in_channels", "patch_embedding.weight");
  c.patch_size = {need(f.patch_t, "patch_size", "patch_embedding.weight"),
                  need(f.patch_h, "patch_size", "patch_embedding.weight"),
                  need(f.patch_w, "patch_size", "patch_embedding.weight")};
  const int64_t patch_volume = c.patch_size[0] * c.patch_size[1] * c.patch_size[2];
  const int64_t rows = need(f.proj_out_rows, "out_channels", "proj_out.weight");
  if (patch_volume <= 0 || rows % patch_volume != 0) {
    throw CheckpointError("cannot infer out_channels: " + f.proj_out_rows->evidence +
                          " is not a multiple of the patch volume " + std::to_string(patch_volume));
  }
  c.out_channels = rows / patch_volume;
  c.text_dim = need(f.text_dim, "text_dim", "condition_embedder.text_embedder.linear_1.weight");
  c.freq_dim = need(f.freq_dim, "freq_dim", "condition_embedder.time_embedder.linear_1.weight");
  c.ffn_dim = need(f.ffn_dim, "ffn_dim", "blocks.0.ffn.net.0.proj.weight");
  c.num_layers = need(f.num_layers, "num_layers", "blocks.0.*");
  c.inject_sample_info = f.has_fps;
  c.cross_attn_norm = f.has_cross_norm;
  if (f.image_dim || f.added_kv_proj_dim) {
    c.image_dim = need(f.image_dim, "image_dim", "condition_embedder.image_embedder.norm1.weight");
    c.added_kv_proj_dim = f.added_kv_proj_dim ? f.added_kv_proj_dim->value : D;
    if (f.pos_embed_seq_len) c.pos_embed_seq_len = f.pos_embed_seq_len->value;
  }
  // The split of D into heads changes the attention and the RoPE split but is recorded nowhere in the weights.
  if (D % kAssumedHeadDim != 0) {
    throw CheckpointError("cannot infer num_attention_heads: the inner dim " + std::to_string(D) + " (" +
                          f.inner_dim->evidence +
                          ") is not a multiple of 128, and the weights do not record how it "
                          "splits into heads (the q/k RMSNorm spans all heads); add a config.json");
  }
  c.attention_head_dim = kAssumedHeadDim;
  c.num_attention_heads = D / kAssumedHeadDim;
  if (notes != nullptr) {
    notes->push_back("no config.json: config inferred from tensor shapes");
    notes->push_back(
        "assumed attention_head_dim 128 (every published SkyReels-V2/Wan model), so num_attention_heads = " +
        std::to_string(D) + " / 128 = " + std::to_string(c.num_attention_heads) +
        "; the weights do not record the head split");
    notes->push_back("eps 1e-06, rope_max_seq_len 1024 and num_frame_per_block 1 are defaults (not in the weights)");
  }
  return c;
}

std::vector<std::string> transformer_config_contradictions(const TransformerConfig& c,
                                                           const std::map<std::string, at::Tensor>& tensors,
                                                           const std::string& form) {
  const bool original = form == "original";
  const ShapeFacts f = read_facts(tensors);
  std::vector<std::string> out;
  auto check = [&](const char* diffusers_field, const char* original_field, int64_t configured,
                   const std::optional<Fact>& fact) {
    if (!fact || fact->value == configured) return;
    out.push_back(std::string(original ? original_field : diffusers_field) + ": config says " +
                  std::to_string(configured) + ", the tensors say " + std::to_string(fact->value) + " (" +
                  fact->evidence + ")");
  };
  check(original ? "dim" : "num_attention_heads x attention_head_dim", "dim", c.inner_dim(), f.inner_dim);
  check("in_channels", "in_dim", c.in_channels, f.in_channels);
  check("patch_size[0]", "patch_size[0]", c.patch_size[0], f.patch_t);
  check("patch_size[1]", "patch_size[1]", c.patch_size[1], f.patch_h);
  check("patch_size[2]", "patch_size[2]", c.patch_size[2], f.patch_w);
  check("out_channels x patch volume", "out_dim x patch volume",
        c.out_channels * c.patch_size[0] * c.patch_size[1] * c.patch_size[2], f.proj_out_rows);
  check("text_dim", "text_dim", c.text_dim, f.text_dim);
  check("freq_dim", "freq_dim", c.freq_dim, f.freq_dim);
  check("ffn_dim", "ffn_dim", c.ffn_dim, f.ffn_dim);
  check("num_layers", "num_layers", c.num_layers, f.num_layers);
  // The image branch (I2V) and the first-last-frame position embedding: present in both or in neither.
  auto optional_field = [&](const char* diffusers_field, const char* what, const std::optional<int64_t>& configured,
                            const std::optional<Fact>& fact) {
    if (configured && fact) {
      check(diffusers_field, diffusers_field, *configured, fact);
    } else if (configured.has_value() != fact.has_value() && f.inner_dim) {
      out.push_back(std::string(diffusers_field) + ": config " +
                    (configured ? "says " + std::to_string(*configured) : std::string("has none")) +
                    ", but the checkpoint " + (fact ? "has " + fact->evidence : "has no " + std::string(what)));
    }
  };
  optional_field("image_dim", "image embedder (condition_embedder.image_embedder / img_emb)", c.image_dim, f.image_dim);
  optional_field("added_kv_proj_dim", "image key projection (attn2.add_k_proj / cross_attn.k_img)", c.added_kv_proj_dim,
                 f.added_kv_proj_dim);
  optional_field("pos_embed_seq_len", "image position embedding (image_embedder.pos_embed / img_emb.emb_pos)",
                 c.pos_embed_seq_len, f.pos_embed_seq_len);
  if (c.inject_sample_info != f.has_fps && f.inner_dim) {
    out.push_back(std::string("inject_sample_info: config says ") + (c.inject_sample_info ? "true" : "false") +
                  ", but the checkpoint " + (f.has_fps ? "has" : "has no") + " fps_embedding.weight");
  }
  if (c.cross_attn_norm != f.has_cross_norm && f.num_layers) {
    out.push_back(std::string("cross_attn_norm: config says ") + (c.cross_attn_norm ? "true" : "false") +
                  ", but the checkpoint " + (f.has_cross_norm ? "has" : "has no") + " blocks.0.norm2.weight" +
                  (original ? " (original: norm3)" : ""));
  }
  return out;
}

}  // namespace skyreels::model
