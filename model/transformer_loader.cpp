#include "model/transformer_loader.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "model/runtime.h"

namespace fs = std::filesystem;

namespace skyreels::model {

using checkpoint::CheckpointError;
using checkpoint::RenameRule;
using json = nlohmann::json;

namespace {

constexpr const char* kPrefix = "model.diffusion_model.";  // ComfyUI / single-file checkpoints
constexpr int64_t kAssumedHeadDim = 128;                   // every published SkyReels-V2 / Wan model

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string shape_of(const at::Tensor& t) { return checkpoint::shape_str(t.sizes().vec()); }

std::string gb(uint64_t bytes) {  // decimal units, as file sizes on the Hub are given
  const double b = static_cast<double>(bytes);
  char buf[32];
  if (b >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  } else if (b >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.1f MB", b / 1e6);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f KB", b / 1e3);
  }
  return buf;
}

// ---- rename tables -----------------------------------------------------------------------------------------------
// Ordered substring rules, as diffusers' scripts/convert_skyreelsv2_to_diffusers.py applies them. Every `from` carries
// its dots so that e.g. "ffn.0." cannot match inside another name. Order matters where noted.

const std::vector<RenameRule>& original_rules() {
  static const std::vector<RenameRule> rules = {
      {kPrefix, ""},
      {"text_embedding.0.", "condition_embedder.text_embedder.linear_1."},
      {"text_embedding.2.", "condition_embedder.text_embedder.linear_2."},
      {"time_embedding.0.", "condition_embedder.time_embedder.linear_1."},
      {"time_embedding.2.", "condition_embedder.time_embedder.linear_2."},
      {"time_projection.1.", "condition_embedder.time_proj."},
      {"fps_projection.0.", "fps_projection.net.0.proj."},
      {"fps_projection.2.", "fps_projection.net.2."},
      {"head.modulation", "scale_shift_table"},  // before the per-block rule: the head table is top-level
      {"head.head.", "proj_out."},
      {".modulation", ".scale_shift_table"},
      {"self_attn.q.", "attn1.to_q."},
      {"self_attn.k.", "attn1.to_k."},
      {"self_attn.v.", "attn1.to_v."},
      {"self_attn.o.", "attn1.to_out.0."},
      {"self_attn.norm_q.", "attn1.norm_q."},
      {"self_attn.norm_k.", "attn1.norm_k."},
      {"cross_attn.q.", "attn2.to_q."},
      {"cross_attn.k.", "attn2.to_k."},
      {"cross_attn.v.", "attn2.to_v."},
      {"cross_attn.o.", "attn2.to_out.0."},
      {"cross_attn.norm_q.", "attn2.norm_q."},
      {"cross_attn.norm_k.", "attn2.norm_k."},
      {"cross_attn.k_img.", "attn2.add_k_proj."},  // I2V: the image tokens' key / value projections and key norm
      {"cross_attn.v_img.", "attn2.add_v_proj."},
      {"cross_attn.norm_k_img.", "attn2.norm_added_k."},
      {".ffn.0.", ".ffn.net.0.proj."},
      {".ffn.2.", ".ffn.net.2."},
      // The cross-attention LayerNorm is norm3 in the original and norm2 in diffusers (only it has parameters).
      {".norm2.", ".norm__placeholder."},
      {".norm3.", ".norm2."},
      {".norm__placeholder.", ".norm3."},
      // After the swap, so that image_embedder.norm2 is not swapped. Wan's MLPProj: LayerNorm, Linear, GELU, Linear,
      // LayerNorm (proj.2 is the GELU), and the first-last-frame position embedding.
      {"img_emb.proj.0.", "condition_embedder.image_embedder.norm1."},
      {"img_emb.proj.1.", "condition_embedder.image_embedder.ff.net.0.proj."},
      {"img_emb.proj.3.", "condition_embedder.image_embedder.ff.net.2."},
      {"img_emb.proj.4.", "condition_embedder.image_embedder.norm2."},
      {"img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"},
  };
  return rules;
}

// internal -> original: original_rules() mirrored (each rule swapped, in reverse order; the prefix rule becomes an
// empty `from`, which apply_rules ignores). Tested to invert the forward table on every parameter.
const std::vector<RenameRule>& original_reverse_rules() {
  static const std::vector<RenameRule> rules = [] {
    std::vector<RenameRule> out;
    const auto& forward = original_rules();
    for (auto it = forward.rbegin(); it != forward.rend(); ++it) out.push_back({it->to, it->from});
    return out;
  }();
  return rules;
}

// diffusers and the PR #11850 layout already use the internal names; the norm_out.linear pair is folded afterwards
// (fold_norm_out_linear), a value transform that no rename can express.
const std::vector<RenameRule>& prefix_only_rules() {
  static const std::vector<RenameRule> rules = {{kPrefix, ""}};
  return rules;
}

// ---- layout detection --------------------------------------------------------------------------------------------

bool is_original_key(const std::string& k) {
  static const char* const starts[] = {"head.",    "text_embedding.",   "time_embedding.",  "time_projection.",
                                       "img_emb.", "fps_projection.0.", "fps_projection.2."};
  for (const char* s : starts) {
    if (starts_with(k, s)) return true;
  }
  return contains(k, ".self_attn.") || contains(k, ".cross_attn.") || contains(k, ".ffn.0.") ||
         contains(k, ".ffn.2.") || (starts_with(k, "blocks.") && contains(k, ".modulation"));
}

bool is_diffusers_key(const std::string& k) {
  static const char* const starts[] = {"condition_embedder.", "proj_out.", "scale_shift_table", "fps_projection.net.",
                                       "norm_out."};
  for (const char* s : starts) {
    if (starts_with(k, s)) return true;
  }
  return contains(k, ".attn1.") || contains(k, ".attn2.") || contains(k, ".ffn.net.") ||
         contains(k, ".scale_shift_table");
}

std::string strip_prefix(const std::string& key) { return starts_with(key, kPrefix) ? key.substr(22) : key; }

// ---- PR #11850 fold ----------------------------------------------------------------------------------------------

// norm_out.linear computes [I; I]·temb + b; with exactly that weight it equals the shipped head, where
// scale_shift_table [1, 2, D] = b viewed as [1, 2, D] (shift row first). Anything else cannot be expressed by the
// model and is refused: loading it would silently change the output.
void fold_norm_out_linear(TransformerCheckpointAnalysis& a, const std::string& prefix) {
  const std::string wkey = "norm_out.linear.weight";
  const std::string bkey = "norm_out.linear.bias";
  auto w_it = a.tensors.find(wkey);
  auto b_it = a.tensors.find(bkey);
  if (w_it == a.tensors.end() || b_it == a.tensors.end()) {
    a.problems.push_back("norm_out.linear layout: '" + prefix + (w_it == a.tensors.end() ? wkey : bkey) +
                         "' is missing; both norm_out.linear.weight and .bias are needed to rebuild scale_shift_table");
    return;
  }
  if (a.tensors.count("scale_shift_table")) {
    a.problems.push_back("both 'scale_shift_table' and '" + prefix +
                         "norm_out.linear.*' are present: the output modulation is ambiguous");
    return;
  }
  const at::Tensor w = a.value(wkey);
  const at::Tensor b = a.value(bkey);
  const std::string wname = "'" + prefix + wkey + "'";
  if (w.dim() != 2 || w.size(0) != 2 * w.size(1)) {
    a.problems.push_back(wname + " has shape " + shape_of(w) + "; the norm_out.linear layout needs [2D, D]");
    return;
  }
  const int64_t D = w.size(1);
  if (b.dim() != 1 || b.size(0) != 2 * D) {
    a.problems.push_back("'" + prefix + bkey + "' has shape " + shape_of(b) + "; expected [" + std::to_string(2 * D) +
                         "] to match " + wname + " " + shape_of(w));
    return;
  }
  if (!at::isFloatingType(w_it->second.scalar_type()) && !a.decodings.count(wkey)) {
    a.problems.push_back(wname + " / bias are not floating point");
    return;
  }
  if (!at::isFloatingType(b_it->second.scalar_type()) && !a.decodings.count(bkey)) {
    a.problems.push_back(wname + " / bias are not floating point");
    return;
  }
  // 0 and 1 are exact in every float dtype, so the comparison is exact; the deviation is reported in float32.
  const at::Tensor eye = at::eye(D, at::kFloat);
  const at::Tensor deviation = (w.to(at::kFloat) - at::cat({eye, eye}, 0)).abs();
  const double max_dev = deviation.max().item<double>();
  if (max_dev != 0.0 || !std::isfinite(max_dev)) {
    const int64_t flat = deviation.nan_to_num(1e30).argmax().item<int64_t>();
    std::ostringstream os;
    os << wname << " is not two stacked identities [I; I] (max deviation " << max_dev << " at row " << flat / D
       << ", column " << flat % D << "); this PR #11850 layout can only be folded into scale_shift_table when it "
       << "is, since the model has no output linear. Refusing to load it.";
    a.problems.push_back(os.str());
    return;
  }
  // Still a view of the mapped bias, unless it had to be decoded (fp8 or scaled: its float32 value, 2D numbers).
  a.tensors["scale_shift_table"] = (a.decodings.count(bkey) ? b : b_it->second).view({1, 2, D});
  a.decodings.erase(wkey);
  a.decodings.erase(bkey);
  a.origins.source_key["scale_shift_table"] = prefix + bkey;
  a.origins.source_key.erase(wkey);
  a.origins.source_key.erase(bkey);
  a.tensors.erase(wkey);
  a.tensors.erase(bkey);
  a.report.notes.push_back("folded norm_out.linear into scale_shift_table [1, 2, " + std::to_string(D) +
                           "] = bias viewed as [1, 2, D] (weight checked to be exactly [I; I])");
}

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

// ---- analysis ----------------------------------------------------------------------------------------------------

bool folder_has_weights(const fs::path& dir) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && (contains(name, ".safetensors"))) return true;
  }
  return false;
}

// A diffusers pipeline folder (model_index.json, transformer/, vae/, ...) is read through its transformer/.
std::string resolve_transformer_path(const std::string& path, std::vector<std::string>& notes) {
  const fs::path p(path);
  if (fs::is_directory(p) && !folder_has_weights(p) && fs::is_directory(p / "transformer")) {
    notes.push_back("diffusers pipeline folder: reading its transformer/ subfolder");
    return (p / "transformer").string();
  }
  return path;
}

// One error type for callers: a damaged file is a checkpoint problem like any other.
checkpoint::Source open_source(const std::string& path) {
  try {
    return checkpoint::Source::open(path, "diffusion_pytorch_model");
  } catch (const safetensors::FormatError& e) {
    throw CheckpointError(e.what());
  } catch (const fs::filesystem_error& e) {
    throw CheckpointError("cannot read checkpoint '" + path + "': " + e.what());
  }
}

void map_keys(const checkpoint::Source& src, TransformerLayout layout, TransformerCheckpointAnalysis& a) {
  const auto& rules = transformer_rename_rules(layout);
  for (const auto& key : src.keys()) {
    const std::string name = checkpoint::apply_rules(key, rules);
    auto seen = a.origins.source_key.find(name);
    if (seen != a.origins.source_key.end()) {
      a.match.duplicates.push_back(name + ": both '" + seen->second + "' and '" + key + "'");
      continue;
    }
    a.tensors[name] = src.tensor(key);
    a.origins.source_key[name] = key;
  }
}

std::set<std::string> encoded_names(const TransformerCheckpointAnalysis& a) {
  std::set<std::string> out;
  for (const auto& [name, d] : a.decodings) {
    if (d.format) out.insert(name);
  }
  return out;
}

std::string last_component(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

// ---- fp8 and scale tensors ---------------------------------------------------------------------------------------
// Conventions of the fp8 files in circulation (ComfyUI and its wrappers, llm-compressor / vLLM / ModelOpt):
//   <module>.scale_weight   ComfyUI "scaled fp8": weight = fp8 codes x scale_weight (with a `scaled_fp8` marker)
//   <module>.weight_scale   compressed-tensors / vLLM / ModelOpt: the same product
//   <module>.scale_input, <module>.input_scale   activation scales for an fp8 matmul; weights are upcast here, so
//                           they are dropped (noted)
//   scaled_fp8              ComfyUI's marker (an empty tensor whose dtype is the fp8 format): dropped (noted)
// Any other tensor whose last name part mentions "scale" (e.g. DeepSeek-style block-wise weight_scale_inv) is refused
// by name rather than loaded as a stray parameter or applied wrongly.
struct ScaleConvention {
  const char* suffix;  // last name part
  bool weight_scale;   // true: scales <module>.weight; false: an activation scale, dropped
};
constexpr ScaleConvention kScaleConventions[] = {
    {"scale_weight", true}, {"weight_scale", true}, {"scale_input", false}, {"input_scale", false}};
constexpr const char* kScaledFp8Marker = "scaled_fp8";

void erase_tensor(TransformerCheckpointAnalysis& a, const std::string& name) {
  a.tensors.erase(name);
  a.origins.source_key.erase(name);
}

void collect_decodings(const checkpoint::Source& src, TransformerCheckpointAnalysis& a) {
  auto key_of = [&](const std::string& name) {
    auto it = a.origins.source_key.find(name);
    return it == a.origins.source_key.end() ? name : it->second;
  };
  for (const auto& [name, key] : a.origins.source_key) {
    const safetensors::DType dtype = src.info(key).dtype;
    if (safetensors::is_fp8(dtype)) {
      a.decodings[name].format = dtype == safetensors::DType::F8_E4M3 ? fp8::Format::E4M3FN : fp8::Format::E5M2;
    }
  }
  if (a.tensors.count(kScaledFp8Marker)) {
    a.report.notes.push_back(std::string("'") + key_of(kScaledFp8Marker) + "': ComfyUI scaled-fp8 marker (" +
                             safetensors::dtype_name(src.info(key_of(kScaledFp8Marker)).dtype) + "), dropped");
    a.decodings.erase(kScaledFp8Marker);
    erase_tensor(a, kScaledFp8Marker);
  }
  std::vector<std::string> names;
  for (const auto& [name, t] : a.tensors) names.push_back(name);
  int64_t dropped_inputs = 0;
  std::map<std::string, int64_t> scale_kinds;
  for (const auto& name : names) {
    const std::string part = last_component(name);
    if (part.find("scale") == std::string::npos || part == "scale_shift_table") continue;
    const std::string key = key_of(name);
    const ScaleConvention* convention = nullptr;
    for (const auto& c : kScaleConventions) {
      if (part == c.suffix) convention = &c;
    }
    if (convention == nullptr) {
      a.problems.push_back("'" + key +
                           "': unknown scale tensor (supported: <module>.scale_weight and <module>.weight_scale, "
                           "one scale per tensor or per output row; scale_input / input_scale are dropped)");
      continue;
    }
    const at::Tensor scale = a.tensors.at(name);
    const bool scale_is_fp8 = a.decodings.count(name) != 0;
    a.decodings.erase(name);
    erase_tensor(a, name);
    if (!convention->weight_scale) {
      ++dropped_inputs;
      continue;
    }
    const std::string target = name.substr(0, name.size() - part.size()) + "weight";
    auto w = a.tensors.find(target);
    if (w == a.tensors.end()) {
      a.problems.push_back("'" + key + "': a weight scale, but the checkpoint has no '" +
                           key.substr(0, key.size() - part.size()) + "weight' to scale");
      continue;
    }
    if (scale_is_fp8 || !at::isFloatingType(scale.scalar_type())) {
      a.problems.push_back("'" + key + "': a weight scale must be stored as F32, BF16 or F16");
      continue;
    }
    const int64_t rows = w->second.dim() > 0 ? w->second.size(0) : 1;
    const bool per_tensor = scale.numel() == 1;
    const bool per_row = scale.numel() == rows && (scale.dim() == 1 || (scale.dim() == 2 && scale.size(1) == 1));
    if (!per_tensor && !per_row) {
      a.problems.push_back("'" + key + "': scale of shape " + shape_of(scale) + " for '" + key_of(target) + "' " +
                           shape_of(w->second) + "; expected one value, or one per output row [" +
                           std::to_string(rows) + "]");
      continue;
    }
    at::Tensor s = scale.to(at::kFloat).reshape({per_tensor ? 1 : rows});
    if (!(at::isfinite(s).all().item<bool>() && (s > 0).all().item<bool>())) {
      a.problems.push_back("'" + key + "': scale is not a finite positive number (" +
                           std::to_string(s.min().item<double>()) + " ... " + std::to_string(s.max().item<double>()) +
                           ")");
      continue;
    }
    if (!per_tensor) {
      std::vector<int64_t> shape(static_cast<size_t>(w->second.dim()), 1);
      shape[0] = rows;
      s = s.view(shape);
    }
    StoredDecoding& d = a.decodings[target];
    d.scale = s;
    d.scale_key = key;
    ++scale_kinds[part];
  }
  for (const auto& [name, d] : a.decodings) {
    a.report.fp8_tensors += d.format ? 1 : 0;
    a.report.scaled_tensors += d.scale.defined() ? 1 : 0;
  }
  if (a.report.fp8_tensors > 0) {
    std::map<std::string, int64_t> formats;
    for (const auto& [name, d] : a.decodings) {
      if (d.format) formats[fp8::format_name(*d.format)] += 1;
    }
    std::string list;
    for (const auto& [f, n] : formats) list += (list.empty() ? "" : ", ") + std::to_string(n) + " " + f;
    a.report.notes.push_back("fp8: " + list + " tensors, decoded exactly (256-entry table) to the compute dtype at "
                             "load, tensor by tensor");
  }
  for (const auto& [kind, n] : scale_kinds) {
    a.report.notes.push_back("scales: " + std::to_string(n) + " '<module>." + kind +
                             "' tensors applied in float32 (value = stored value x scale) before the cast");
  }
  if (dropped_inputs > 0) {
    a.report.notes.push_back("dropped " + std::to_string(dropped_inputs) +
                             " activation scales (scale_input / input_scale): weights are upcast, no fp8 matmul");
  }
}

void read_config(TransformerCheckpointAnalysis& a, const std::string& folder) {
  const fs::path config_path = fs::path(folder) / "config.json";
  if (fs::exists(config_path)) {
    try {
      ParsedTransformerConfig parsed = parse_transformer_config(config_path.string());
      a.report.config_source = "config.json (" + parsed.form + ")";
      a.report.notes.insert(a.report.notes.end(), parsed.notes.begin(), parsed.notes.end());
      for (const auto& c : transformer_config_contradictions(parsed.config, a.tensors, parsed.form)) {
        a.problems.push_back("config.json '" + config_path.string() + "' contradicts the tensors: " + c);
      }
      a.config = parsed.config;
    } catch (const CheckpointError& e) {
      a.report.config_source = "config.json (unreadable)";
      a.problems.push_back(e.what());
    }
    return;
  }
  try {
    std::vector<std::string> notes;
    a.config = infer_transformer_config(a.tensors, &notes);
    a.report.config_source = "inferred from tensor shapes (no config.json in '" + folder + "')";
    for (const auto& n : notes) spdlog::warn("transformer config: {}", n);
    a.report.notes.insert(a.report.notes.end(), notes.begin(), notes.end());
  } catch (const CheckpointError& e) {
    a.report.config_source = "none (no config.json, and inference failed)";
    a.problems.push_back(e.what());
  }
}

void check_against_model(TransformerCheckpointAnalysis& a) {
  if (!a.config) return;
  try {
    a.config->validate();
  } catch (const std::invalid_argument& e) {
    a.problems.push_back(std::string("config: ") + e.what());
    return;  // the parameter list of an unsupported config would only add noise
  }
  auto duplicates = std::move(a.match.duplicates);
  a.match = checkpoint::match_specs(a.tensors, transformer_parameter_specs(*a.config), a.origins, encoded_names(a));
  a.match.duplicates = std::move(duplicates);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// ---- public ------------------------------------------------------------------------------------------------------

const char* layout_name(TransformerLayout layout) {
  switch (layout) {
    case TransformerLayout::Diffusers:
      return "diffusers";
    case TransformerLayout::Original:
      return "original";
    case TransformerLayout::NormOutLinear:
      return "norm_out_linear";
  }
  return "?";
}

TransformerLayout detect_transformer_layout(const std::vector<std::string>& keys) {
  std::string original_example, diffusers_example;
  bool norm_out_linear = false;
  for (const auto& raw : keys) {
    const std::string k = strip_prefix(raw);
    if (original_example.empty() && is_original_key(k)) original_example = raw;
    if (diffusers_example.empty() && is_diffusers_key(k)) diffusers_example = raw;
    if (starts_with(k, "norm_out.linear.")) norm_out_linear = true;
  }
  if (!original_example.empty() && !diffusers_example.empty()) {
    throw CheckpointError("checkpoint mixes original SkyReels-V2/Wan key names ('" + original_example +
                          "') with diffusers names ('" + diffusers_example + "'); it is neither layout");
  }
  if (!original_example.empty()) return TransformerLayout::Original;
  if (norm_out_linear) return TransformerLayout::NormOutLinear;
  if (!diffusers_example.empty()) return TransformerLayout::Diffusers;
  std::string seen;
  for (size_t i = 0; i < keys.size() && i < 3; ++i) seen += (i ? ", '" : "'") + keys[i] + "'";
  throw CheckpointError("no SkyReels-V2 transformer keys found (" + std::to_string(keys.size()) + " tensors" +
                        (seen.empty() ? "" : ", e.g. " + seen) + "); is this a VAE or text-encoder checkpoint?");
}

const std::vector<RenameRule>& transformer_rename_rules(TransformerLayout layout) {
  return layout == TransformerLayout::Original ? original_rules() : prefix_only_rules();
}

std::string transformer_checkpoint_key(TransformerLayout layout, const std::string& internal) {
  switch (layout) {
    case TransformerLayout::Original:
      return checkpoint::apply_rules(internal, original_reverse_rules());
    case TransformerLayout::NormOutLinear:
      return internal == "scale_shift_table" ? "norm_out.linear.bias" : internal;
    case TransformerLayout::Diffusers:
      break;
  }
  return internal;
}

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

std::string TransformerCheckpointAnalysis::error_message() const {
  std::ostringstream os;
  os << "transformer checkpoint '" << path << "' (layout " << layout_name(report.layout)
     << ") cannot be loaded: " << (problems.size() + match.count()) << " problem(s)";
  for (const auto& p : problems) os << "\n  " << p;
  os << match.describe();
  return os.str();
}

TransformerCheckpointAnalysis analyze_transformer_checkpoint(const std::string& path) {
  TransformerCheckpointAnalysis a;
  a.path = resolve_transformer_path(path, a.report.notes);
  const checkpoint::Source src = open_source(a.path);
  a.report.files = src.files();
  a.report.bytes = src.total_bytes();
  const std::vector<std::string> keys = src.keys();
  for (const auto& key : keys) a.report.stored_dtypes[safetensors::dtype_name(src.info(key).dtype)] += 1;

  a.report.layout = detect_transformer_layout(keys);
  const bool prefixed =
      std::any_of(keys.begin(), keys.end(), [](const std::string& k) { return starts_with(k, kPrefix); });
  const std::string prefix = prefixed ? kPrefix : "";
  a.report.notes.push_back(std::string("layout ") + layout_name(a.report.layout) + ": " +
                           (a.report.layout == TransformerLayout::Original
                                ? "original SkyReels-V2/Wan names renamed with the diffusers converter's table (" +
                                      std::to_string(original_rules().size()) + " ordered rules)"
                                : std::string("names are already the internal (diffusers) names")));
  if (prefixed) a.report.notes.push_back(std::string("stripped the '") + kPrefix + "' prefix");

  map_keys(src, a.report.layout, a);
  const TransformerLayout layout = a.report.layout;
  a.origins.expected_key = [layout, prefix](const std::string& internal) {
    return prefix + transformer_checkpoint_key(layout, internal);
  };
  collect_decodings(src, a);
  if (layout == TransformerLayout::NormOutLinear) fold_norm_out_linear(a, prefix);

  const std::string folder = src.folder().empty() ? std::string(".") : src.folder();
  read_config(a, folder);
  check_against_model(a);
  for (const auto& [name, t] : a.tensors) a.report.parameter_count += t.numel();
  return a;
}

MappedTransformerCheckpoint map_transformer_checkpoint(const std::string& path) {
  TransformerCheckpointAnalysis a = analyze_transformer_checkpoint(path);
  if (!a.ok()) throw CheckpointError(a.error_message());
  return {*a.config, std::move(a.tensors), std::move(a.decodings), std::move(a.report)};
}

at::Tensor stored_value(const at::Tensor& stored, const StoredDecoding* decoding) {
  if (decoding == nullptr) return stored.to(at::kFloat);
  at::Tensor value = decoding->format ? fp8::decode(stored, *decoding->format) : stored.to(at::kFloat);
  if (decoding->scale.defined()) value = value * decoding->scale;
  return value;
}

namespace {
at::Tensor value_in(const std::map<std::string, at::Tensor>& tensors, const StoredDecodings& decodings,
                    const std::string& name) {
  auto it = tensors.find(name);
  if (it == tensors.end()) throw CheckpointError("checkpoint has no tensor '" + name + "'");
  auto d = decodings.find(name);
  return stored_value(it->second, d == decodings.end() ? nullptr : &d->second);
}
}  // namespace

at::Tensor MappedTransformerCheckpoint::value(const std::string& name) const {
  return value_in(tensors, decodings, name);
}

at::Tensor TransformerCheckpointAnalysis::value(const std::string& name) const {
  return value_in(tensors, decodings, name);
}

LoadedTransformer load_transformer(const std::string& path, const TransformerLoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  std::string dtype_name;
  try {
    dtype_name = runtime::resolve_dtype_name(options.dtype, options.device);
  } catch (const std::invalid_argument& e) {
    throw CheckpointError(std::string("transformer dtype: ") + e.what());
  }
  const c10::Device device = checkpoint::parse_device(options.device);
  const at::ScalarType dtype = checkpoint::parse_dtype(dtype_name);

  TransformerCheckpointAnalysis a = analyze_transformer_checkpoint(path);
  if (!a.ok()) throw CheckpointError(a.error_message());
  spdlog::info("transformer checkpoint '{}': layout {}, {} tensors in {} file(s), {}, config {}", a.path,
               layout_name(a.report.layout), a.tensors.size(), a.report.files.size(), gb(a.report.bytes),
               a.report.config_source);
  for (const auto& note : a.report.notes) spdlog::info("transformer mapping: {}", note);

  const auto specs = transformer_parameter_specs(*a.config);
  std::vector<LoraAdapter> adapters;
  for (const auto& spec : options.loras) adapters.push_back(read_lora(spec));
  check_loras(adapters, specs);

  checkpoint::PlaceOptions place{options.device, dtype};
  place.encoded = encoded_names(a);
  int64_t merged = 0;
  // fp8 codes decoded (and scales applied) and adapters merged in float32, one parameter at a time.
  place.value = [&](const std::string& name, const at::Tensor& stored) -> at::Tensor {
    auto d = a.decodings.find(name);
    const StoredDecoding* decoding = d == a.decodings.end() ? nullptr : &d->second;
    const bool adapted = std::any_of(adapters.begin(), adapters.end(),
                                     [&](const LoraAdapter& x) { return x.updates.count(name) != 0; });
    if (decoding == nullptr && !adapted) return at::Tensor();
    at::Tensor value = stored_value(stored, decoding);
    if (adapted) {
      if (value.data_ptr() == stored.data_ptr()) value = value.clone();  // never write into the mapping
      merge_loras(adapters, name, value);
      ++merged;
    }
    // The stored bytes are done with: their pages leave the RSS (the value is new memory; nothing views them).
    safetensors::release_mapped_pages(stored);
    return value;
  };
  int64_t views = 0, converted = 0, islands = 0;
  for (const auto& spec : specs) {
    const at::Tensor& t = a.tensors.at(spec.name);
    islands += spec.keep_fp32 ? 1 : 0;
    const bool same = t.scalar_type() == checkpoint::placed_dtype(spec, place) && !a.decodings.count(spec.name) &&
                      std::none_of(adapters.begin(), adapters.end(),
                                   [&](const LoraAdapter& x) { return x.updates.count(spec.name) != 0; });
    (device.is_cpu() && same ? views : converted) += 1;
  }
  checkpoint::StateDict weights =
      checkpoint::place_strict(a.tensors, specs, place, "transformer checkpoint '" + a.path + "'", a.origins);
  a.tensors.clear();  // converted tensors no longer need the mapping; zero-copy ones keep it alive themselves
  for (const auto& adapter : adapters) {
    a.report.loras.push_back(lora_report(adapter));
    const LoraReport& r = a.report.loras.back();
    a.report.notes.push_back("LoRA '" + r.path + "' (" + r.format + " format, rank <= " + std::to_string(r.max_rank) +
                             ", scale " + std::to_string(r.scale) + "): " + std::to_string(r.parameters) +
                             " parameters merged in float32" +
                             (r.ignored ? ", " + std::to_string(r.ignored) + " keys ignored as diffusers does" : ""));
  }
  a.report.notes.push_back("placed on " + device.str() + " as " + dtype_name + ": " + std::to_string(islands) +
                           " fp32-island tensors kept float32, " + std::to_string(converted) + " copied/converted" +
                           (a.report.fp8_tensors ? " (" + std::to_string(a.report.fp8_tensors) + " from fp8)" : "") +
                           (merged ? " (" + std::to_string(merged) + " with LoRA merged)" : "") + ", " +
                           std::to_string(views) + " zero-copy views of the file");

  LoadedTransformer out;
  out.model = std::make_unique<SkyReelsV2Transformer>(*a.config, std::move(weights), device, dtype);
  // Device exactness (the diffusers PR #11850 failure mode: tensors left on meta or on the CPU): every parameter and
  // buffer of the built model is on the requested device, or the load fails naming them.
  std::vector<std::string> misplaced;
  for (const auto& [name, t] : out.model->named_tensors()) {
    const bool right = !t.is_meta() && t.device().type() == device.type() &&
                       (!device.has_index() || t.device().index() == device.index());
    if (!right) misplaced.push_back(name + " on " + (t.is_meta() ? std::string("meta") : t.device().str()));
    a.report.placed_tensors += right ? 1 : 0;
    a.report.placed_fp32 += right && t.scalar_type() == at::kFloat ? 1 : 0;
  }
  if (!misplaced.empty()) {
    std::string list;
    for (size_t i = 0; i < misplaced.size() && i < 8; ++i) list += (i ? ", " : "") + misplaced[i];
    throw checkpoint::CheckpointError("transformer checkpoint '" + a.path + "': " + std::to_string(misplaced.size()) +
                                      " tensor(s) not on " + device.str() + " after loading: " + list);
  }
  a.report.placed_device = out.model->device().str();
  a.report.seconds = seconds_since(t0);
  spdlog::info("transformer loaded: {} parameters, {} in {:.3f} s ({}/s) onto {} as {} ({})", a.report.parameter_count,
               gb(a.report.bytes), a.report.seconds,
               gb(static_cast<uint64_t>(static_cast<double>(a.report.bytes) / std::max(a.report.seconds, 1e-9))),
               device.str(), dtype_name, a.report.notes.back());
  out.report = std::move(a.report);
  return out;
}

// ---- convert -----------------------------------------------------------------------------------------------------

namespace {

struct PlannedTensor {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;  // of the tensor produce() returns
  std::optional<safetensors::DType> stored_as;
  std::function<at::Tensor()> produce;
  uint64_t bytes;
};

// diffusers' rule (huggingface_hub split_torch_state_dict_into_shards): fill shards in key order and start a new
// one when the next tensor would cross the limit; a tensor larger than the limit gets a shard of its own.
std::vector<std::vector<PlannedTensor>> plan_shards(std::vector<PlannedTensor> tensors, uint64_t max_shard_size) {
  std::vector<std::vector<PlannedTensor>> shards(1);
  uint64_t current = 0;
  for (auto& t : tensors) {
    if (!shards.back().empty() && current + t.bytes > max_shard_size) {
      shards.emplace_back();
      current = 0;
    }
    current += t.bytes;
    shards.back().push_back(std::move(t));
  }
  return shards;
}

std::string shard_name(size_t index, size_t count) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "diffusion_pytorch_model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text << "\n";
  out.close();
  if (!out) throw CheckpointError("cannot write '" + path.string() + "'");
}

void require_empty_destination(const fs::path& dst) {
  if (!fs::exists(dst)) return;
  if (!fs::is_directory(dst)) throw CheckpointError("convert destination '" + dst.string() + "' is not a folder");
  if (!fs::is_empty(dst)) {
    throw CheckpointError("convert destination '" + dst.string() + "' is not empty; convert never overwrites");
  }
}

}  // namespace

ConvertResult convert_transformer_checkpoint(const std::string& src, const std::string& dst,
                                             const ConvertOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<at::ScalarType> target;
  const bool to_fp8 = options.dtype == "float8_e4m3fn";
  if (!options.dtype.empty() && !to_fp8) {
    if (options.dtype != "float32" && options.dtype != "bfloat16") {
      throw CheckpointError("convert --dtype '" + options.dtype + "': expected float32, bfloat16 or float8_e4m3fn");
    }
    target = checkpoint::parse_dtype(options.dtype);
  }
  if (options.max_shard_size == 0) throw CheckpointError("convert: max shard size must be > 0 bytes");
  const fs::path out_dir(dst);
  require_empty_destination(out_dir);

  TransformerCheckpointAnalysis a = analyze_transformer_checkpoint(src);
  if (!a.ok()) throw CheckpointError(a.error_message());

  if (!a.decodings.empty() && options.dtype.empty()) {
    throw CheckpointError("convert: '" + a.path + "' has " + std::to_string(a.decodings.size()) +
                          " fp8 or scaled tensors, which the diffusers layout cannot hold as stored; pass --dtype "
                          "float32, bfloat16 or float8_e4m3fn");
  }
  std::vector<PlannedTensor> planned;
  for (const auto& spec : transformer_parameter_specs(*a.config)) {
    const at::Tensor t = a.tensors.at(spec.name);
    auto d = a.decodings.find(spec.name);
    const std::optional<StoredDecoding> decoding =
        d == a.decodings.end() ? std::nullopt : std::optional<StoredDecoding>(d->second);
    PlannedTensor p{spec.name, t.sizes().vec(), t.scalar_type(), std::nullopt, nullptr, 0};
    if (to_fp8 && !spec.keep_fp32 && t.dim() >= 2) {
      p.dtype = at::kByte;
      p.stored_as = safetensors::DType::F8_E4M3;
      const std::string what = "convert to float8_e4m3fn: tensor '" + spec.name + "'";
      p.produce = [t, decoding, what] {
        return fp8::encode_e4m3fn(stored_value(t, decoding ? &*decoding : nullptr), what);
      };
    } else {
      p.dtype = target ? (spec.keep_fp32 ? at::kFloat : *target) : (decoding ? at::kFloat : t.scalar_type());
      const at::ScalarType dtype = p.dtype;
      p.produce = [t, decoding, dtype] {
        return decoding ? stored_value(t, &*decoding).to(dtype) : t.to(dtype);
      };
    }
    p.bytes = static_cast<uint64_t>(t.numel()) * (p.stored_as ? 1 : c10::elementSize(p.dtype));
    planned.push_back(std::move(p));
  }
  std::sort(planned.begin(), planned.end(), [](const auto& x, const auto& y) { return x.name < y.name; });
  const auto shards = plan_shards(std::move(planned), options.max_shard_size);

  ConvertResult result;
  result.source = a.report;
  const bool created = !fs::exists(out_dir);
  fs::create_directories(out_dir);
  try {
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string file =
          shards.size() == 1 ? "diffusion_pytorch_model.safetensors" : shard_name(i, shards.size());
      std::vector<safetensors::SaveItem> items;
      for (const auto& t : shards[i]) {
        items.push_back({t.name, t.dtype, t.shape, t.produce, t.stored_as});
        weight_map[t.name] = file;
        result.bytes += t.bytes;
      }
      result.files.push_back((out_dir / file).string());
      safetensors::save_streaming(result.files.back(), items, {{"format", "pt"}});
    }
    if (shards.size() > 1) {
      nlohmann::ordered_json index;
      index["metadata"] = {{"total_size", result.bytes}};
      index["weight_map"] = weight_map;
      result.files.push_back((out_dir / "diffusion_pytorch_model.safetensors.index.json").string());
      write_text(result.files.back(), index.dump(2));
    }
    result.files.push_back((out_dir / "config.json").string());
    write_text(result.files.back(), a.config->to_diffusers_json());
  } catch (...) {
    std::error_code ec;
    for (const auto& f : result.files) fs::remove(f, ec);
    if (created) fs::remove(out_dir, ec);
    throw;
  }
  spdlog::info("converted '{}' (layout {}) to diffusers layout in '{}': {} file(s), {} of tensors{}, {:.2f} s", a.path,
               layout_name(a.report.layout), dst, result.files.size(), gb(result.bytes),
               to_fp8   ? " with matrix weights as float8_e4m3fn"
               : target ? " as " + options.dtype + " (fp32 islands kept float32)"
                        : std::string(" in stored dtypes"),
               seconds_since(t0));
  return result;
}

}  // namespace skyreels::model
