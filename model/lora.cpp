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

std::string shape_of(const at::Tensor& t) { return checkpoint::shape_str(t.sizes().vec()); }

// The tensors of one module of an adapter, by role, with the keys they came from.
struct ModuleParts {
  std::string module;  // as the adapter names it (for messages)
  std::map<Part, std::pair<std::string, at::Tensor>> parts;
};

class Reader {
 public:
  explicit Reader(const LoraSpec& spec) : spec_(spec) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw std::invalid_argument("LoRA '" + spec_.path + "': key '" + key + "': " + what);
  }
  [[noreturn]] void fail_file(const std::string& what) const {
    throw std::invalid_argument("LoRA '" + spec_.path + "': " + what);
  }
  void ignore(LoraAdapter& adapter, const std::string& key, const std::string& why) const {
    spdlog::warn("LoRA '{}': ignoring key '{}' ({}), as diffusers does", spec_.path, key, why);
    adapter.ignored.push_back(key);
  }

  const LoraSpec& spec() const { return spec_; }

 private:
  LoraSpec spec_;
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

at::Tensor float_tensor(const Reader& r, const safetensors::File& file, const std::string& key, bool check_finite) {
  at::Tensor t = file.tensor(key);
  if (!at::isFloatingType(t.scalar_type())) {
    r.fail(key, std::string("is ") + safetensors::dtype_name(file.find(key)->dtype) + ", not floating point");
  }
  t = t.to(at::kFloat);
  if (check_finite && !at::isfinite(t).all().item<bool>()) r.fail(key, "contains NaN or infinite values");
  return t;
}

double alpha_value(const Reader& r, const std::string& key, const at::Tensor& alpha) {
  if (alpha.numel() != 1) r.fail(key, "alpha must be one number, got shape " + shape_of(alpha));
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

PeftConfig read_peft_config(const Reader& r, const safetensors::File& file) {
  PeftConfig config;
  auto it = file.metadata().find("lora_adapter_metadata");
  if (it == file.metadata().end()) return config;
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

// Builds the updates of one module from its parts. `default_alpha`: the alpha of a module without an .alpha tensor
// (PEFT's lora_alpha from the file's metadata), else r.
void add_module(const Reader& r, LoraAdapter& adapter, const std::string& internal, const ModuleParts& m,
                std::optional<double> default_alpha) {
  auto part = [&](Part p) -> const std::pair<std::string, at::Tensor>* {
    auto it = m.parts.find(p);
    return it == m.parts.end() ? nullptr : &it->second;
  };
  const auto* down = part(Part::Down);
  const auto* up = part(Part::Up);
  const auto* alpha = part(Part::Alpha);
  const auto* bias = part(Part::Bias);
  const auto* diff = part(Part::Diff);
  const char* down_name = adapter.format == LoraFormat::Diffusers ? "lora_A" : "lora_down";
  const char* up_name = adapter.format == LoraFormat::Diffusers ? "lora_B" : "lora_up";
  if ((down == nullptr) != (up == nullptr)) {
    const auto* have = down != nullptr ? down : up;
    r.fail(have->first, std::string("has no matching ") + (down != nullptr ? up_name : down_name) +
                            " for module '" + m.module + "': the rank of the update is unknown");
  }
  double alpha_over_rank = 1.0;
  if (down != nullptr) {
    const at::Tensor& A = down->second;
    const at::Tensor& B = up->second;
    if (A.dim() != 2) r.fail(down->first, "must be a matrix [rank, in_features], got shape " + shape_of(A));
    if (B.dim() != 2) r.fail(up->first, "must be a matrix [out_features, rank], got shape " + shape_of(B));
    const int64_t rank = A.size(0);
    if (B.size(1) != rank) {
      r.fail(up->first, "shape " + shape_of(B) + " does not match " + std::string(down_name) + " " + shape_of(A) +
                            " (ranks " + std::to_string(B.size(1)) + " and " + std::to_string(rank) + ")");
    }
    if (rank <= 0 || rank > std::min(A.size(1), B.size(0))) {
      r.fail(down->first, "rank " + std::to_string(rank) + " is absurd for a " + std::to_string(B.size(0)) + " x " +
                              std::to_string(A.size(1)) + " weight (expected 1 ... " +
                              std::to_string(std::min(A.size(1), B.size(0))) + ")");
    }
    if (adapter.format == LoraFormat::Musubi && alpha == nullptr) {
      r.fail(down->first, "module '" + m.module + "' has no '.alpha' (musubi-tuner always writes one; diffusers "
                          "requires it)");
    }
    double a = static_cast<double>(rank);
    if (alpha != nullptr) {
      a = alpha_value(r, alpha->first, alpha->second);
    } else if (default_alpha) {
      if (!std::isfinite(*default_alpha) || *default_alpha <= 0) {
        r.fail(down->first, "the lora_alpha of the file's metadata for module '" + m.module + "' is " +
                                std::to_string(*default_alpha) + "; it must be a finite number > 0");
      }
      a = *default_alpha;
    }
    alpha_over_rank = a / static_cast<double>(rank);
    adapter.updates[internal + ".weight"] = {down->first, A, B, at::Tensor(), r.spec().scale * alpha_over_rank};
    adapter.max_rank = std::max(adapter.max_rank, rank);
  } else if (alpha != nullptr && bias == nullptr && diff == nullptr) {
    r.fail(alpha->first, "alpha for module '" + m.module + "', which has no " + down_name + " / " + up_name);
  }
  if (diff != nullptr) {
    if (down != nullptr) r.fail(diff->first, "module '" + m.module + "' has both a weight diff and a low-rank update");
    adapter.updates[internal + ".weight"] = {diff->first, at::Tensor(), at::Tensor(), diff->second, r.spec().scale};
  }
  if (bias != nullptr) {
    if (bias->second.dim() != 1) r.fail(bias->first, "a bias delta must be a vector, got shape " + shape_of(bias->second));
    // diffusers folds alpha / r into A and B of the non-diffusers formats, never into the bias; PEFT scales a lora_B
    // bias like the rest of lora_B.
    const double factor = r.spec().scale * (adapter.format == LoraFormat::Diffusers ? alpha_over_rank : 1.0);
    adapter.updates[internal + ".bias"] = {bias->first, at::Tensor(), at::Tensor(), bias->second, factor};
  }
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

LoraAdapter read_lora(const LoraSpec& spec) {
  const Reader r(spec);
  if (!std::isfinite(spec.scale)) r.fail_file("scale must be finite");
  std::shared_ptr<safetensors::File> file;
  try {
    file = safetensors::File::open(spec.path);
  } catch (const safetensors::FormatError& e) {
    throw std::invalid_argument(std::string("LoRA: ") + e.what());
  }
  const std::vector<std::string> keys = file->names();
  if (keys.empty()) r.fail_file("holds no tensors");
  LoraAdapter adapter;
  adapter.spec = spec;
  adapter.format = detect_format(keys);

  const char* prefix = adapter.format == LoraFormat::Original ? kOriginalPrefix
                       : adapter.format == LoraFormat::Musubi ? kMusubiPrefix
                                                              : kDiffusersPrefix;
  const Suffix* suffixes = adapter.format == LoraFormat::Original ? std::begin(kOriginalSuffixes)
                           : adapter.format == LoraFormat::Musubi ? std::begin(kMusubiSuffixes)
                                                                  : std::begin(kDiffusersSuffixes);
  const Suffix* suffixes_end = adapter.format == LoraFormat::Original ? std::end(kOriginalSuffixes)
                               : adapter.format == LoraFormat::Musubi ? std::end(kMusubiSuffixes)
                                                                      : std::end(kDiffusersSuffixes);
  // diffusers drops time_projection keys of adapters that have no time_projection weight (AccVideo).
  const bool has_time_projection_weight = std::any_of(keys.begin(), keys.end(), [](const std::string& k) {
    return starts_with(k, std::string(kOriginalPrefix) + "time_projection") && ends_with(k, ".weight");
  });

  std::map<std::string, ModuleParts> modules;  // internal module -> parts
  std::map<std::string, std::string> module_of;  // internal module -> adapter module (one each)
  for (const auto& key : keys) {
    if (!starts_with(key, prefix)) {
      r.fail(key, std::string("does not start with '") + prefix + "' like the other keys of this " +
                      lora_format_name(adapter.format) + "-format adapter");
    }
    const std::string rest = key.substr(std::string(prefix).size());
    for (const char* image : kImageModules) {
      if (contains(rest, image)) {
        r.fail(key, "adapts the image conditioning (an I2V adapter); adapters of the image branch are not supported");
      }
    }
    const auto split = split_suffix(rest, suffixes, suffixes_end);
    if (!split) r.fail(key, "is not a LoRA tensor this format has (" + std::string(lora_format_name(adapter.format)) +
                                " keys end in .lora_A/.lora_B/.lora_down/.lora_up.weight, .alpha" +
                                (adapter.format == LoraFormat::Original ? ", .diff, .diff_b" : "") + ")");
    const auto& [module, part] = *split;
    if (part == Part::DoraScale) {
      r.ignore(adapter, key, "DoRA magnitude: diffusers filters dora_scale out");
      continue;
    }
    if (adapter.format == LoraFormat::Original) {
      if ((part == Part::Diff || part == Part::Bias) && contains(module, "norm")) {
        r.ignore(adapter, key, "norm diff");
        continue;
      }
      if (starts_with(module, "time_projection") && !has_time_projection_weight) {
        r.ignore(adapter, key, "time_projection without weights");
        continue;
      }
      if (part == Part::Diff && module != "head.head") {
        r.ignore(adapter, key, "full weight diff");
        continue;
      }
    }
    std::string internal = adapter.format == LoraFormat::Diffusers ? module : internal_module(module, adapter.format);
    if (internal.empty()) {
      r.fail(key, "module '" + module + "' maps to no layer of the SkyReels-V2 transformer (" +
                      lora_format_name(adapter.format) + " format)");
    }
    auto seen = module_of.find(internal);
    if (seen != module_of.end() && seen->second != module) {
      r.fail(key, "module '" + module + "' and '" + seen->second + "' both map onto '" + internal + "'");
    }
    module_of[internal] = module;
    ModuleParts& m = modules[internal];
    m.module = module;
    if (m.parts.count(part)) r.fail(key, "module '" + module + "' has this tensor twice (lora_A/lora_down naming)");
    at::Tensor value = float_tensor(r, *file, key, part != Part::Alpha);  // alpha_value() names a bad alpha
    m.parts[part] = {key, value};
  }
  const PeftConfig peft =
      adapter.format == LoraFormat::Diffusers ? read_peft_config(r, *file) : PeftConfig{};
  for (const auto& [internal, m] : modules) add_module(r, adapter, internal, m, peft.alpha_for(internal));
  if (adapter.updates.empty()) r.fail_file("changes no parameter (every key was ignored)");
  return adapter;
}

void check_loras(const std::vector<LoraAdapter>& adapters, const std::vector<checkpoint::ParamSpec>& specs) {
  std::map<std::string, const checkpoint::ParamSpec*> by_name;
  for (const auto& s : specs) by_name[s.name] = &s;
  for (const auto& adapter : adapters) {
    for (const auto& [name, u] : adapter.updates) {
      const std::string where = "LoRA '" + adapter.spec.path + "': key '" + u.key + "': ";
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        throw std::invalid_argument(where + "targets '" + name + "', which this model does not have");
      }
      const std::vector<int64_t>& shape = it->second->shape;
      std::vector<int64_t> implied;
      if (u.delta.defined()) {
        implied = u.delta.sizes().vec();
      } else {
        if (shape.size() != 2) {
          throw std::invalid_argument(where + "targets '" + name + "' " + checkpoint::shape_str(shape) +
                                      ", which is not a linear layer's weight");
        }
        implied = {u.up.size(0), u.down.size(1)};
      }
      if (implied != shape) {
        throw std::invalid_argument(where + "implies " + checkpoint::shape_str(implied) + " for '" + name +
                                    "', which is " + checkpoint::shape_str(shape) + " in this model");
      }
    }
  }
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
