#include "model/lora.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "model/safetensors.h"

namespace skyreels::model {
namespace {

// ---- the mapping table ---------------------------------------------------------------------------------------------
// Module names of the non-diffusers formats -> internal (diffusers) module names, as diffusers' converters map them
// (lora_conversion_utils.py). `musubi` is null where musubi-tuner never trains the module.
struct ModuleName {
  const char* original;
  const char* musubi;
  const char* diffusers;
};

// Inside blocks.<N>. (original) / blocks_<N>_ (musubi).
constexpr ModuleName kBlockModules[] = {
    {"self_attn.q", "self_attn_q", "attn1.to_q"},      {"self_attn.k", "self_attn_k", "attn1.to_k"},
    {"self_attn.v", "self_attn_v", "attn1.to_v"},      {"self_attn.o", "self_attn_o", "attn1.to_out.0"},
    {"cross_attn.q", "cross_attn_q", "attn2.to_q"},    {"cross_attn.k", "cross_attn_k", "attn2.to_k"},
    {"cross_attn.v", "cross_attn_v", "attn2.to_v"},    {"cross_attn.o", "cross_attn_o", "attn2.to_out.0"},
    {"ffn.0", "ffn_0", "ffn.net.0.proj"},              {"ffn.2", "ffn_2", "ffn.net.2"},
};
// Outside the blocks (original format only).
constexpr ModuleName kTopModules[] = {
    {"time_projection.1", nullptr, "condition_embedder.time_proj"},
    {"head.head", nullptr, "proj_out"},
    {"text_embedding.0", nullptr, "condition_embedder.text_embedder.linear_1"},
    {"text_embedding.2", nullptr, "condition_embedder.text_embedder.linear_2"},
    {"time_embedding.0", nullptr, "condition_embedder.time_embedder.linear_1"},
    {"time_embedding.2", nullptr, "condition_embedder.time_embedder.linear_2"},
};
// Image-conditioning modules (I2V adapters): not merged (the I2V models load, their adapters are refused by name).
constexpr const char* kImageModules[] = {"cross_attn.k_img", "cross_attn.v_img", "cross_attn_k_img",
                                         "cross_attn_v_img", "img_emb."};

// Per-module tensor suffixes and their role.
enum class Part { Down, Up, Alpha, Bias, Diff, DoraScale };
struct Suffix {
  const char* text;
  Part part;
};
constexpr Suffix kDiffusersSuffixes[] = {{".lora_A.weight", Part::Down}, {".lora_B.weight", Part::Up},
                                         {".lora_B.bias", Part::Bias},   {".alpha", Part::Alpha},
                                         {".dora_scale", Part::DoraScale}};
constexpr Suffix kOriginalSuffixes[] = {{".lora_down.weight", Part::Down}, {".lora_A.weight", Part::Down},
                                        {".lora_up.weight", Part::Up},     {".lora_B.weight", Part::Up},
                                        {".alpha", Part::Alpha},           {".diff_b", Part::Bias},
                                        {".diff", Part::Diff},             {".dora_scale", Part::DoraScale}};
constexpr Suffix kMusubiSuffixes[] = {{".lora_down.weight", Part::Down},
                                      {".lora_up.weight", Part::Up},
                                      {".alpha", Part::Alpha},
                                      {".dora_scale", Part::DoraScale}};

constexpr const char* kDiffusersPrefix = "transformer.";
constexpr const char* kOriginalPrefix = "diffusion_model.";
constexpr const char* kMusubiPrefix = "lora_unet_";

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }
bool ends_with(const std::string& s, const std::string& x) {
  return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
}
bool contains(const std::string& s, const std::string& p) { return s.find(p) != std::string::npos; }

class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw std::invalid_argument("LoRA '" + path_ + "': key '" + key + "': " + what);
  }
  [[noreturn]] void fail_file(const std::string& what) const {
    throw std::invalid_argument("LoRA '" + path_ + "': " + what);
  }

 private:
  std::string path_;
};

// Splits "<module><suffix>" by the longest known suffix.
std::optional<std::pair<std::string, Part>> split_suffix(const std::string& rest, const Suffix* begin,
                                                         const Suffix* end) {
  const Suffix* best = nullptr;
  for (const Suffix* s = begin; s != end; ++s) {
    if (ends_with(rest, s->text) && (best == nullptr || std::string(s->text).size() > std::string(best->text).size())) {
      best = s;
    }
  }
  if (best == nullptr) return std::nullopt;
  return std::make_pair(rest.substr(0, rest.size() - std::string(best->text).size()), best->part);
}

// "blocks.<N>.<rest>" or "blocks_<N>_<rest>": N and rest; nullopt when `module` is not a block module.
std::optional<std::pair<std::string, std::string>> split_block(const std::string& module, char sep) {
  const std::string head = std::string("blocks") + sep;
  if (!starts_with(module, head)) return std::nullopt;
  const size_t digits_end = module.find(sep, head.size());
  if (digits_end == std::string::npos || digits_end == head.size()) return std::nullopt;
  const std::string n = module.substr(head.size(), digits_end - head.size());
  if (!std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; }) || n.size() > 4) {
    return std::nullopt;
  }
  return std::make_pair(std::to_string(std::stoi(n)), module.substr(digits_end + 1));
}

// The internal module of a non-diffusers module name, through the table; "" when the table has none.
std::string internal_module(const std::string& module, LoraFormat format) {
  const char sep = format == LoraFormat::Musubi ? '_' : '.';
  if (auto block = split_block(module, sep)) {
    for (const auto& m : kBlockModules) {
      const char* name = format == LoraFormat::Musubi ? m.musubi : m.original;
      if (name != nullptr && block->second == name) return "blocks." + block->first + "." + m.diffusers;
    }
    return "";
  }
  if (format == LoraFormat::Original) {
    for (const auto& m : kTopModules) {
      if (module == m.original) return m.diffusers;
    }
  }
  return "";
}

LoraFormat detect_format(const std::vector<std::string>& keys) {
  for (const auto& k : keys) {
    if (starts_with(k, kOriginalPrefix)) return LoraFormat::Original;
  }
  for (const auto& k : keys) {
    if (starts_with(k, kMusubiPrefix)) return LoraFormat::Musubi;
  }
  return LoraFormat::Diffusers;
}

bool is_float(safetensors::DType dtype) {
  using safetensors::DType;
  return dtype == DType::F64 || dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

at::Tensor float_tensor(const Reader& r, const safetensors::File& file, const std::string& key, bool check_finite) {
  at::Tensor t = file.tensor(key).to(at::kFloat);  // the header check made sure it is floating point
  if (check_finite && !at::isfinite(t).all().item<bool>()) r.fail(key, "contains NaN or infinite values");
  return t;
}

double alpha_value(const Reader& r, const std::string& key, const at::Tensor& alpha) {
  const double a = alpha.to(at::kDouble).item<double>();
  if (!std::isfinite(a) || a <= 0) {
    std::ostringstream os;
    os << "alpha is " << a << "; it must be a finite number > 0";
    r.fail(key, os.str());
  }
  return a;
}

// PEFT's LoraConfig as diffusers saves it in a diffusers-format file (__metadata__["lora_adapter_metadata"], JSON with
// "transformer.lora_alpha", "transformer.alpha_pattern", ...): the alpha of modules that have no .alpha tensor.
struct PeftConfig {
  std::optional<double> lora_alpha;
  std::map<std::string, double> alpha_pattern;  // module name (or its dotted suffix) -> alpha

  std::optional<double> alpha_for(const std::string& module) const {
    for (const auto& [pattern, alpha] : alpha_pattern) {
      if (module == pattern || ends_with(module, "." + pattern)) return alpha;
    }
    return lora_alpha;
  }
};

PeftConfig read_peft_config(const Reader& r, const std::map<std::string, std::string>& metadata) {
  PeftConfig config;
  auto it = metadata.find("lora_adapter_metadata");
  if (it == metadata.end()) return config;
  const std::string where = "__metadata__ lora_adapter_metadata";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(it->second);
  } catch (const std::exception& e) {
    r.fail(where, std::string("is not JSON (") + e.what() + ")");
  }
  if (!j.is_object()) r.fail(where, "is not a JSON object");
  auto field = [&](const std::string& name) -> const nlohmann::json* {
    for (const std::string& key : {std::string(kDiffusersPrefix) + name, name}) {
      if (j.contains(key) && !j[key].is_null()) return &j[key];
    }
    return nullptr;
  };
  for (const char* unsupported : {"use_rslora", "use_dora"}) {
    if (const auto* v = field(unsupported); v != nullptr && v->is_boolean() && v->get<bool>()) {
      r.fail(where, std::string(unsupported) + " is true; only plain LoRA (scaling alpha / r) is supported");
    }
  }
  if (const auto* v = field("lora_alpha")) {
    if (!v->is_number()) r.fail(where, "lora_alpha is not a number");
    config.lora_alpha = v->get<double>();
  }
  if (const auto* v = field("alpha_pattern"); v != nullptr && v->is_object()) {
    for (auto p = v->begin(); p != v->end(); ++p) {
      if (!p.value().is_number()) r.fail(where, "alpha_pattern['" + p.key() + "'] is not a number");
      config.alpha_pattern[p.key()] = p.value().get<double>();
    }
  }
  return config;
}

// The tensors of one module of an adapter, by role: the keys they come from and their header entries.
struct ModuleLayout {
  std::string module;  // as the adapter names it (for messages)
  std::map<Part, std::pair<std::string, const safetensors::TensorInfo*>> parts;
  int64_t rank = 0;                     // of its low-rank update; 0 without one
  std::optional<double> default_alpha;  // PEFT's lora_alpha for a module without an .alpha tensor

  const std::pair<std::string, const safetensors::TensorInfo*>* part(Part p) const {
    auto it = parts.find(p);
    return it == parts.end() ? nullptr : &it->second;
  }
  const std::string& key(Part p) const { return parts.at(p).first; }
};

// An adapter file as its header describes it: everything checked that needs no tensor value.
struct FileLayout {
  LoraFormat format = LoraFormat::Diffusers;
  std::map<std::string, ModuleLayout> modules;               // internal module -> its tensors
  std::vector<std::pair<std::string, std::string>> ignored;  // key, why diffusers drops it too
};

// Checks the shapes of one module's tensors and sets its rank.
void check_module(const Reader& r, LoraFormat format, ModuleLayout& m) {
  const auto* down = m.part(Part::Down);
  const auto* up = m.part(Part::Up);
  const auto* alpha = m.part(Part::Alpha);
  const auto* bias = m.part(Part::Bias);
  const auto* diff = m.part(Part::Diff);
  const char* down_name = format == LoraFormat::Diffusers ? "lora_A" : "lora_down";
  const char* up_name = format == LoraFormat::Diffusers ? "lora_B" : "lora_up";
  if ((down == nullptr) != (up == nullptr)) {
    const auto* have = down != nullptr ? down : up;
    r.fail(have->first, std::string("has no matching ") + (down != nullptr ? up_name : down_name) + " for module '" +
                            m.module + "': the rank of the update is unknown");
  }
  if (down != nullptr) {
    const std::vector<int64_t>& A = down->second->shape;
    const std::vector<int64_t>& B = up->second->shape;
    if (A.size() != 2)
      r.fail(down->first, "must be a matrix [rank, in_features], got shape " + checkpoint::shape_str(A));
    if (B.size() != 2)
      r.fail(up->first, "must be a matrix [out_features, rank], got shape " + checkpoint::shape_str(B));
    const int64_t rank = A[0];
    if (B[1] != rank) {
      r.fail(up->first, "shape " + checkpoint::shape_str(B) + " does not match " + std::string(down_name) + " " +
                            checkpoint::shape_str(A) + " (ranks " + std::to_string(B[1]) + " and " +
                            std::to_string(rank) + ")");
    }
    if (rank <= 0 || rank > std::min(A[1], B[0])) {
      r.fail(down->first, "rank " + std::to_string(rank) + " is absurd for a " + std::to_string(B[0]) + " x " +
                              std::to_string(A[1]) + " weight (expected 1 ... " + std::to_string(std::min(A[1], B[0])) +
                              ")");
    }
    if (format == LoraFormat::Musubi && alpha == nullptr) {
      r.fail(down->first, "module '" + m.module + "' has no '.alpha' (musubi-tuner always writes one; diffusers "
                          "requires it)");
    }
    if (alpha != nullptr && numel_of(alpha->second->shape) != 1) {
      r.fail(alpha->first, "alpha must be one number, got shape " + checkpoint::shape_str(alpha->second->shape));
    }
    if (alpha == nullptr && m.default_alpha && (!std::isfinite(*m.default_alpha) || *m.default_alpha <= 0)) {
      r.fail(down->first, "the lora_alpha of the file's metadata for module '" + m.module + "' is " +
                              std::to_string(*m.default_alpha) + "; it must be a finite number > 0");
    }
    m.rank = rank;
  } else if (alpha != nullptr && bias == nullptr && diff == nullptr) {
    r.fail(alpha->first, "alpha for module '" + m.module + "', which has no " + down_name + " / " + up_name);
  }
  if (diff != nullptr && down != nullptr) {
    r.fail(diff->first, "module '" + m.module + "' has both a weight diff and a low-rank update");
  }
  if (bias != nullptr && bias->second->shape.size() != 1) {
    r.fail(bias->first, "a bias delta must be a vector, got shape " + checkpoint::shape_str(bias->second->shape));
  }
}

// Maps and checks every key of an adapter from its header alone.
FileLayout layout_of(const Reader& r, const std::vector<safetensors::TensorInfo>& tensors,
                     const std::map<std::string, std::string>& metadata) {
  if (tensors.empty()) r.fail_file("holds no tensors");
  std::vector<std::string> keys;
  for (const auto& t : tensors) keys.push_back(t.name);
  FileLayout layout;
  layout.format = detect_format(keys);

  const char* prefix = layout.format == LoraFormat::Original ? kOriginalPrefix
                       : layout.format == LoraFormat::Musubi ? kMusubiPrefix
                                                             : kDiffusersPrefix;
  const Suffix* suffixes = layout.format == LoraFormat::Original ? std::begin(kOriginalSuffixes)
                           : layout.format == LoraFormat::Musubi ? std::begin(kMusubiSuffixes)
                                                                 : std::begin(kDiffusersSuffixes);
  const Suffix* suffixes_end = layout.format == LoraFormat::Original ? std::end(kOriginalSuffixes)
                               : layout.format == LoraFormat::Musubi ? std::end(kMusubiSuffixes)
                                                                     : std::end(kDiffusersSuffixes);
  // diffusers drops time_projection keys of adapters that have no time_projection weight (AccVideo).
  const bool has_time_projection_weight = std::any_of(keys.begin(), keys.end(), [](const std::string& k) {
    return starts_with(k, std::string(kOriginalPrefix) + "time_projection") && ends_with(k, ".weight");
  });

  std::map<std::string, std::string> module_of;  // internal module -> adapter module (one each)
  for (const auto& info : tensors) {
    const std::string& key = info.name;
    if (!starts_with(key, prefix)) {
      r.fail(key, std::string("does not start with '") + prefix + "' like the other keys of this " +
                      lora_format_name(layout.format) + "-format adapter");
    }
    const std::string rest = key.substr(std::string(prefix).size());
    for (const char* image : kImageModules) {
      if (contains(rest, image)) {
        r.fail(key, "adapts the image conditioning (an I2V adapter); adapters of the image branch are not supported");
      }
    }
    const auto split = split_suffix(rest, suffixes, suffixes_end);
    if (!split)
      r.fail(key, "is not a LoRA tensor this format has (" + std::string(lora_format_name(layout.format)) +
                      " keys end in .lora_A/.lora_B/.lora_down/.lora_up.weight, .alpha" +
                      (layout.format == LoraFormat::Original ? ", .diff, .diff_b" : "") + ")");
    const auto& [module, part] = *split;
    if (part == Part::DoraScale) {
      layout.ignored.emplace_back(key, "DoRA magnitude: diffusers filters dora_scale out");
      continue;
    }
    if (layout.format == LoraFormat::Original) {
      if ((part == Part::Diff || part == Part::Bias) && contains(module, "norm")) {
        layout.ignored.emplace_back(key, "norm diff");
        continue;
      }
      if (starts_with(module, "time_projection") && !has_time_projection_weight) {
        layout.ignored.emplace_back(key, "time_projection without weights");
        continue;
      }
      if (part == Part::Diff && module != "head.head") {
        layout.ignored.emplace_back(key, "full weight diff");
        continue;
      }
    }
    std::string internal = layout.format == LoraFormat::Diffusers ? module : internal_module(module, layout.format);
    if (internal.empty()) {
      r.fail(key, "module '" + module + "' maps to no layer of the SkyReels-V2 transformer (" +
                      lora_format_name(layout.format) + " format)");
    }
    auto seen = module_of.find(internal);
    if (seen != module_of.end() && seen->second != module) {
      r.fail(key, "module '" + module + "' and '" + seen->second + "' both map onto '" + internal + "'");
    }
    module_of[internal] = module;
    ModuleLayout& m = layout.modules[internal];
    m.module = module;
    if (m.parts.count(part)) r.fail(key, "module '" + module + "' has this tensor twice (lora_A/lora_down naming)");
    if (!is_float(info.dtype)) {
      r.fail(key, std::string("is ") + safetensors::dtype_name(info.dtype) + ", not floating point");
    }
    m.parts[part] = {key, &info};
  }
  const PeftConfig peft = layout.format == LoraFormat::Diffusers ? read_peft_config(r, metadata) : PeftConfig{};
  for (auto& [internal, m] : layout.modules) {
    m.default_alpha = peft.alpha_for(internal);
    check_module(r, layout.format, m);
  }
  return layout;
}

// The updates of one module from its tensors' values (finite, alpha > 0); `scale` multiplies every factor.
void add_module(const Reader& r, const safetensors::File& file, LoraFormat format, const std::string& internal,
                const ModuleLayout& m, double scale, LoraAdapter& adapter) {
  auto value = [&](Part p) { return float_tensor(r, file, m.key(p), p != Part::Alpha); };  // alpha_value() checks
  double alpha_over_rank = 1.0;
  if (m.part(Part::Down) != nullptr) {
    double alpha = static_cast<double>(m.rank);
    if (m.part(Part::Alpha) != nullptr) {
      alpha = alpha_value(r, m.key(Part::Alpha), value(Part::Alpha));
    } else if (m.default_alpha) {
      alpha = *m.default_alpha;
    }
    alpha_over_rank = alpha / static_cast<double>(m.rank);
    adapter.updates[internal + ".weight"] = {m.key(Part::Down), value(Part::Down), value(Part::Up), at::Tensor(),
                                             scale * alpha_over_rank};
    adapter.max_rank = std::max(adapter.max_rank, m.rank);
  }
  if (m.part(Part::Diff) != nullptr) {
    adapter.updates[internal + ".weight"] = {m.key(Part::Diff), at::Tensor(), at::Tensor(), value(Part::Diff), scale};
  }
  if (m.part(Part::Bias) != nullptr) {
    // diffusers folds alpha / r into A and B of the non-diffusers formats, never into the bias; PEFT scales a lora_B
    // bias like the rest of lora_B.
    const double factor = scale * (format == LoraFormat::Diffusers ? alpha_over_rank : 1.0);
    adapter.updates[internal + ".bias"] = {m.key(Part::Bias), at::Tensor(), at::Tensor(), value(Part::Bias), factor};
  }
}

// Checks one update's target against the model: it exists and has the shape the update implies.
void check_target(const std::string& where, const std::string& name, const std::vector<int64_t>& implied, bool low_rank,
                  const std::map<std::string, const checkpoint::ParamSpec*>& by_name) {
  auto it = by_name.find(name);
  if (it == by_name.end())
    throw std::invalid_argument(where + "targets '" + name + "', which this model does not have");
  const std::vector<int64_t>& shape = it->second->shape;
  if (low_rank && shape.size() != 2) {
    throw std::invalid_argument(where + "targets '" + name + "' " + checkpoint::shape_str(shape) +
                                ", which is not a linear layer's weight");
  }
  if (implied != shape) {
    throw std::invalid_argument(where + "implies " + checkpoint::shape_str(implied) + " for '" + name + "', which is " +
                                checkpoint::shape_str(shape) + " in this model");
  }
}

std::map<std::string, const checkpoint::ParamSpec*> specs_by_name(const std::vector<checkpoint::ParamSpec>& specs) {
  std::map<std::string, const checkpoint::ParamSpec*> by_name;
  for (const auto& s : specs) by_name[s.name] = &s;
  return by_name;
}

}  // namespace

LoraSpec parse_lora_spec(const std::string& text) {
  LoraSpec spec;
  spec.path = text;
  const size_t colon = text.rfind(':');
  if (colon != std::string::npos) {
    const std::string tail = text.substr(colon + 1);
    char* end = nullptr;
    const double value = std::strtod(tail.c_str(), &end);
    if (!tail.empty() && end == tail.c_str() + tail.size()) {
      if (!std::isfinite(value)) throw std::invalid_argument("--lora '" + text + "': scale must be a finite number");
      spec.path = text.substr(0, colon);
      spec.scale = value;
    } else if (!std::filesystem::exists(text)) {
      throw std::invalid_argument("--lora '" + text + "': '" + tail + "' is not a scale (expected FILE[:SCALE])");
    }
  }
  if (spec.path.empty()) throw std::invalid_argument("--lora '" + text + "': no file (expected FILE[:SCALE])");
  return spec;
}

std::string describe_loras(const std::vector<LoraSpec>& specs) {
  std::ostringstream os;
  for (size_t i = 0; i < specs.size(); ++i) {
    os << (i ? "," : "") << std::filesystem::path(specs[i].path).filename().string() << ":" << specs[i].scale;
  }
  return os.str();
}

const char* lora_format_name(LoraFormat format) {
  switch (format) {
    case LoraFormat::Diffusers:
      return "diffusers";
    case LoraFormat::Original:
      return "original";
    case LoraFormat::Musubi:
      return "musubi";
  }
  return "?";
}

LoraLayout read_lora_layout(const std::string& path, const safetensors::Header& header) {
  const Reader r(path);
  const FileLayout file = layout_of(r, header.tensors, header.metadata);
  LoraLayout layout;
  layout.format = file.format;
  for (const auto& [key, why] : file.ignored) layout.ignored.push_back(key);
  for (const auto& [internal, m] : file.modules) {
    if (const auto* down = m.part(Part::Down)) {
      const int64_t out = m.part(Part::Up)->second->shape[0], in = down->second->shape[1];
      layout.targets[internal + ".weight"] = {down->first, {out, in}, m.rank};
      layout.max_rank = std::max(layout.max_rank, m.rank);
    }
    if (const auto* diff = m.part(Part::Diff))
      layout.targets[internal + ".weight"] = {diff->first, diff->second->shape, 0};
    if (const auto* bias = m.part(Part::Bias))
      layout.targets[internal + ".bias"] = {bias->first, bias->second->shape, 0};
  }
  if (layout.targets.empty()) r.fail_file("changes no parameter (every key was ignored)");
  return layout;
}

void check_lora_layout(const std::string& path, const LoraLayout& layout,
                       const std::vector<checkpoint::ParamSpec>& specs) {
  const auto by_name = specs_by_name(specs);
  for (const auto& [name, t] : layout.targets) {
    check_target("LoRA '" + path + "': key '" + t.key + "': ", name, t.shape, t.rank > 0, by_name);
  }
}

LoraAdapter read_lora(const LoraSpec& spec) {
  const Reader r(spec.path);
  if (!std::isfinite(spec.scale)) r.fail_file("scale must be finite");
  try {
    return read_lora(spec, *safetensors::File::read(spec.path));
  } catch (const safetensors::FormatError& e) {
    throw std::invalid_argument(std::string("LoRA: ") + e.what());
  }
}

LoraAdapter read_lora(const LoraSpec& spec, const safetensors::File& file) {
  const Reader r(spec.path);
  if (!std::isfinite(spec.scale)) r.fail_file("scale must be finite");
  const FileLayout layout = layout_of(r, file.tensors(), file.metadata());
  LoraAdapter adapter;
  adapter.spec = spec;
  adapter.format = layout.format;
  for (const auto& [key, why] : layout.ignored) {
    spdlog::warn("LoRA '{}': ignoring key '{}' ({}), as diffusers does", spec.path, key, why);
    adapter.ignored.push_back(key);
  }
  for (const auto& [internal, m] : layout.modules) add_module(r, file, layout.format, internal, m, spec.scale, adapter);
  if (adapter.updates.empty()) r.fail_file("changes no parameter (every key was ignored)");
  return adapter;
}

void check_loras(const std::vector<LoraAdapter>& adapters, const std::vector<checkpoint::ParamSpec>& specs) {
  const auto by_name = specs_by_name(specs);
  for (const auto& adapter : adapters) {
    for (const auto& [name, u] : adapter.updates) {
      const bool low_rank = !u.delta.defined();
      const std::vector<int64_t> implied =
          low_rank ? std::vector<int64_t>{u.up.size(0), u.down.size(1)} : u.delta.sizes().vec();
      check_target("LoRA '" + adapter.spec.path + "': key '" + u.key + "': ", name, implied, low_rank, by_name);
    }
  }
}

LoraAdapter place_lora(const LoraAdapter& adapter, const std::vector<checkpoint::ParamSpec>& specs, c10::Device device,
                       at::ScalarType compute_dtype) {
  const auto by_name = specs_by_name(specs);
  LoraAdapter placed = adapter;
  for (auto& [name, u] : placed.updates) {
    auto it = by_name.find(name);
    const at::ScalarType dtype = it != by_name.end() && it->second->keep_fp32 ? at::kFloat : compute_dtype;
    for (at::Tensor* t : {&u.down, &u.up, &u.delta}) {
      if (t->defined()) *t = t->to(device, dtype).contiguous();
    }
  }
  return placed;
}

bool merge_loras(const std::vector<LoraAdapter>& adapters, const std::string& name, at::Tensor& value) {
  bool merged = false;
  for (const auto& adapter : adapters) {
    auto it = adapter.updates.find(name);
    if (it == adapter.updates.end()) continue;
    const LoraUpdate& u = it->second;
    if (u.delta.defined()) {
      value.add_(u.delta, u.factor);
    } else {
      value.addmm_(u.up, u.down, 1.0, u.factor);
    }
    merged = true;
  }
  return merged;
}

LoraReport lora_report(const LoraAdapter& adapter) {
  return {adapter.spec.path,
          adapter.spec.scale,
          lora_format_name(adapter.format),
          static_cast<int64_t>(adapter.updates.size()),
          adapter.max_rank,
          static_cast<int64_t>(adapter.ignored.size())};
}

}  // namespace skyreels::model
