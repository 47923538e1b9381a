// The transformer checkpoint loader's reading and placing: resolves the path, opens the files, maps the keys, runs
// the analysis steps in order, checks strictly against the model's parameters, and places every tensor on the target
// device in the target dtype (LoRA adapters merged on the way), with the load report. The other concepts of the
// loader live beside it: key names and layout detection (transformer_layout.cpp), config.json and the config implied
// by shapes (transformer_checkpoint_config.cpp), fp8 / scale decoding and the norm_out.linear fold
// (transformer_decode.cpp), and writing the diffusers layout (transformer_convert.cpp).
#include "model/transformer_loader.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <set>
#include <sstream>
#include <stdexcept>

#include "model/runtime.h"
#include "model/transformer_loader_detail.h"

namespace fs = std::filesystem;

namespace skyreels::model {

using checkpoint::CheckpointError;
using loader_detail::collect_decodings;
using loader_detail::contains;
using loader_detail::encoded_names;
using loader_detail::fold_norm_out_linear;
using loader_detail::gb;
using loader_detail::kPrefix;
using loader_detail::original_rules;
using loader_detail::seconds_since;
using loader_detail::starts_with;

namespace {

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

}  // namespace

// ---- public ------------------------------------------------------------------------------------------------------

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
    return value;  // place_strict releases the stored bytes' pages once the value is placed
  };
  int64_t copied = 0, converted = 0, islands = 0;
  for (const auto& spec : specs) {
    const at::Tensor& t = a.tensors.at(spec.name);
    islands += spec.keep_fp32 ? 1 : 0;
    const bool same = t.scalar_type() == checkpoint::placed_dtype(spec, place) && !a.decodings.count(spec.name) &&
                      std::none_of(adapters.begin(), adapters.end(),
                                   [&](const LoraAdapter& x) { return x.updates.count(spec.name) != 0; });
    (device.is_cpu() && same ? copied : converted) += 1;
  }
  checkpoint::StateDict weights =
      checkpoint::place_strict(a.tensors, specs, place, "transformer checkpoint '" + a.path + "'", a.origins);
  a.tensors.clear();  // every placed weight is memory of its own: the mapping goes here
  for (const auto& adapter : adapters) {
    a.report.loras.push_back(lora_report(adapter));
    const LoraReport& r = a.report.loras.back();
    a.report.notes.push_back("LoRA '" + r.path + "' (" + r.format + " format, rank <= " + std::to_string(r.max_rank) +
                             ", scale " + std::to_string(r.scale) + "): " + std::to_string(r.parameters) +
                             " parameters merged in float32" +
                             (r.ignored ? ", " + std::to_string(r.ignored) + " keys ignored as diffusers does" : ""));
  }
  a.report.notes.push_back("placed on " + device.str() + " as " + dtype_name + ": " + std::to_string(islands) +
                           " fp32-island tensors kept float32, " + std::to_string(converted) + " converted" +
                           (a.report.fp8_tensors ? " (" + std::to_string(a.report.fp8_tensors) + " from fp8)" : "") +
                           (merged ? " (" + std::to_string(merged) + " with LoRA merged)" : "") + ", " +
                           std::to_string(copied) + " copied out of the file as they are");

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

}  // namespace skyreels::model
