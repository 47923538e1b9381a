#include "model/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace skyreels::checkpoint {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::vector<std::string> list_sorted(const fs::path& dir, const std::string& suffix) {
  std::vector<std::string> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && ends_with(name, suffix)) out.push_back(entry.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Reads an index json: returns key -> shard file (absolute), in a stable order.
std::map<std::string, std::string> read_index(const fs::path& index_path) {
  std::ifstream in(index_path);
  if (!in) throw CheckpointError("cannot read checkpoint index '" + index_path.string() + "'");
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw CheckpointError("checkpoint index '" + index_path.string() + "' is not valid JSON (" + e.what() + ")");
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw CheckpointError("checkpoint index '" + index_path.string() + "' has no weight_map object");
  }
  std::map<std::string, std::string> out;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (!it.value().is_string()) {
      throw CheckpointError("checkpoint index '" + index_path.string() + "': weight_map['" + it.key() +
                            "'] is not a file name");
    }
    out[it.key()] = (index_path.parent_path() / it.value().get<std::string>()).string();
  }
  return out;
}

bool is_shard_name(const std::string& name) {
  static const std::regex shard(R"(.*-\d{5}-of-\d{5}\.safetensors$)");
  return std::regex_match(name, shard);
}

}  // namespace

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

Source Source::open(const std::string& path, const std::string& preferred_stem) {
  Source src;
  fs::path p(path);
  if (!fs::exists(p)) throw CheckpointError("checkpoint path '" + path + "' does not exist");

  std::map<std::string, std::string> key_to_file;  // only for indexed checkpoints
  std::vector<std::string> files;
  if (fs::is_directory(p)) {
    src.folder_ = p.string();
    auto indexes = list_sorted(p, ".safetensors.index.json");
    auto singles = list_sorted(p, ".safetensors");
    auto pick = [&](std::vector<std::string>& candidates, const std::string& suffix) -> std::string {
      if (candidates.size() == 1) return candidates[0];
      for (const auto& c : candidates) {
        if (!preferred_stem.empty() && fs::path(c).filename().string() == preferred_stem + suffix) return c;
      }
      return {};
    };
    if (!indexes.empty()) {
      std::string index = pick(indexes, ".safetensors.index.json");
      if (index.empty()) throw CheckpointError("checkpoint folder '" + path + "' has several index files; pass one");
      key_to_file = read_index(index);
    } else if (!singles.empty()) {
      std::string single = pick(singles, ".safetensors");
      if (!single.empty()) {
        files.push_back(single);
      } else if (std::all_of(singles.begin(), singles.end(),
                             [](const std::string& f) { return is_shard_name(fs::path(f).filename().string()); })) {
        files = singles;  // shards without an index (the original SkyReels repos ship them so)
      } else {
        throw CheckpointError("checkpoint folder '" + path + "' has several .safetensors files and no index json");
      }
    } else {
      throw CheckpointError("checkpoint folder '" + path + "' has no .safetensors file");
    }
  } else if (ends_with(path, ".index.json")) {
    src.folder_ = p.parent_path().string();
    key_to_file = read_index(p);
  } else {
    src.folder_ = p.parent_path().string();
    files.push_back(p.string());
  }

  if (!key_to_file.empty()) {
    std::set<std::string> unique;
    for (const auto& [key, file] : key_to_file) unique.insert(file);
    for (const auto& file : unique) {
      if (!fs::exists(file)) {
        throw CheckpointError("checkpoint shard '" + file + "' named by the index is missing");
      }
    }
    files.assign(unique.begin(), unique.end());
  }

  std::map<std::string, size_t> file_pos;
  for (const auto& file : files) {
    file_pos[file] = src.opened_.size();
    src.opened_.push_back(safetensors::File::open(file));
    src.files_.push_back(file);
  }
  if (!key_to_file.empty()) {
    for (const auto& [key, file] : key_to_file) {
      const size_t idx = file_pos.at(file);
      if (!src.opened_[idx]->contains(key)) {
        throw CheckpointError("checkpoint index maps '" + key + "' to '" + file + "', which does not hold it");
      }
      src.where_[key] = idx;
    }
  } else {
    for (size_t i = 0; i < src.opened_.size(); ++i) {
      for (const auto& info : src.opened_[i]->tensors()) {
        if (src.where_.count(info.name)) {
          throw CheckpointError("tensor '" + info.name + "' appears in both '" + src.files_[src.where_[info.name]] +
                                "' and '" + src.files_[i] + "'");
        }
        src.where_[info.name] = i;
      }
    }
  }
  return src;
}

std::vector<std::string> Source::keys() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [key, idx] : where_) out.push_back(key);
  return out;
}

const safetensors::TensorInfo& Source::info(const std::string& key) const {
  auto it = where_.find(key);
  if (it == where_.end()) throw CheckpointError("checkpoint has no tensor '" + key + "'");
  return *opened_[it->second]->find(key);
}

const std::string& Source::file_of(const std::string& key) const {
  auto it = where_.find(key);
  if (it == where_.end()) throw CheckpointError("checkpoint has no tensor '" + key + "'");
  return files_[it->second];
}

at::Tensor Source::tensor(const std::string& key) const {
  auto it = where_.find(key);
  if (it == where_.end()) throw CheckpointError("checkpoint has no tensor '" + key + "'");
  return opened_[it->second]->tensor(key);
}

uint64_t Source::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [key, idx] : where_) {
    const auto* info = opened_[idx]->find(key);
    total += info->end - info->begin;
  }
  return total;
}

std::string apply_rules(const std::string& key, const std::vector<RenameRule>& rules) {
  std::string out = key;
  for (const auto& rule : rules) {
    if (rule.from.empty()) continue;
    size_t pos = 0;
    while ((pos = out.find(rule.from, pos)) != std::string::npos) {
      out.replace(pos, rule.from.size(), rule.to);
      pos += rule.to.size();
    }
  }
  return out;
}

std::string KeyOrigins::describe(const std::string& internal) const {
  std::string key;
  auto it = source_key.find(internal);
  if (it != source_key.end()) {
    key = it->second;
  } else if (expected_key) {
    key = expected_key(internal);
  }
  if (key.empty() || key == internal) return internal;
  return internal + " (checkpoint key '" + key + "')";
}

size_t MatchProblems::count() const {
  return missing.size() + unexpected.size() + shape_mismatch.size() + bad_dtype.size() + duplicates.size();
}

std::string MatchProblems::describe() const {
  std::ostringstream os;
  auto section = [&](const char* title, const std::vector<std::string>& items) {
    if (items.empty()) return;
    os << "\n  " << title << " (" << items.size() << "):";
    for (const auto& item : items) os << "\n    " << item;
  };
  section("missing keys", missing);
  section("unexpected keys", unexpected);
  section("shape mismatches", shape_mismatch);
  section("non-floating tensors", bad_dtype);
  section("several checkpoint keys for one parameter", duplicates);
  return os.str();
}

MatchProblems match_specs(const std::map<std::string, at::Tensor>& tensors, const std::vector<ParamSpec>& specs,
                          const KeyOrigins& origins, const std::set<std::string>& encoded) {
  MatchProblems problems;
  std::set<std::string> expected;
  for (const auto& spec : specs) {
    expected.insert(spec.name);
    auto it = tensors.find(spec.name);
    if (it == tensors.end()) {
      problems.missing.push_back(origins.describe(spec.name));
      continue;
    }
    if (it->second.sizes().vec() != spec.shape) {
      problems.shape_mismatch.push_back(origins.describe(spec.name) + ": checkpoint " +
                                        shape_str(it->second.sizes().vec()) + " vs model " + shape_str(spec.shape));
    }
    if (!at::isFloatingType(it->second.scalar_type()) && !encoded.count(spec.name)) {
      problems.bad_dtype.push_back(origins.describe(spec.name) + ": " + c10::toString(it->second.scalar_type()));
    }
  }
  for (const auto& [name, tensor] : tensors) {
    if (!expected.count(name)) problems.unexpected.push_back(origins.describe(name));
  }
  return problems;
}

at::ScalarType placed_dtype(const ParamSpec& spec, const PlaceOptions& options) {
  at::ScalarType target = spec.keep_fp32 ? at::kFloat : options.dtype;
  // fp16 cannot run on CPU with LibTorch 1.13 and is not what we compute in: convert.
  if (target == at::kHalf && parse_device(options.device).is_cpu()) target = at::kFloat;
  return target;
}

c10::Device parse_device(const std::string& device) {
  c10::Device parsed(c10::kCPU);
  try {
    parsed = c10::Device(device);
  } catch (const std::exception&) {
    throw CheckpointError("bad device '" + device + "' (expected cpu, cuda or cuda:N)");
  }
  if (parsed.is_cuda() && !at::hasCUDA()) {
    throw CheckpointError("device '" + device + "' requested, but this build of LibTorch has no CUDA devices");
  }
  if (!parsed.is_cpu() && !parsed.is_cuda()) throw CheckpointError("unsupported device '" + device + "'");
  return parsed;
}

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16") return at::kHalf;
  throw CheckpointError("unknown dtype '" + name + "' (expected float32 or bfloat16)");
}

StateDict place_strict(const std::map<std::string, at::Tensor>& tensors, const std::vector<ParamSpec>& specs,
                       const PlaceOptions& options, const std::string& context) {
  return place_strict(tensors, specs, options, context, KeyOrigins{});
}

StateDict place_strict(const std::map<std::string, at::Tensor>& tensors, const std::vector<ParamSpec>& specs,
                       const PlaceOptions& options, const std::string& context, const KeyOrigins& origins) {
  const c10::Device device = parse_device(options.device);
  const MatchProblems problems = match_specs(tensors, specs, origins, options.encoded);
  if (!problems.empty()) throw CheckpointError(context + ": checkpoint does not match the model" + problems.describe());

  StateDict out;
  for (const auto& spec : specs) {
    const at::Tensor& stored = tensors.at(spec.name);
    const at::Tensor value = options.value ? options.value(spec.name, stored) : at::Tensor();
    if (!value.defined() && options.encoded.count(spec.name)) {
      throw CheckpointError(context + ": parameter '" + origins.describe(spec.name) + "' is stored encoded (" +
                            c10::toString(stored.scalar_type()) + " codes) and nothing decodes it");
    }
    const at::Tensor& src = value.defined() ? value : stored;
    const at::ScalarType target = placed_dtype(spec, options);
    at::Tensor placed;
    if (device.is_cpu()) {
      placed = src.to(target);
      // A weight never views a file's mapping: a file rewritten in place would change it, a truncated one would fault.
      if (safetensors::views_mapping(placed)) placed = placed.clone();
    } else {
      // Stored bytes go to the device as they are and are converted there: one tensor at a time, no converted
      // host copy of the whole model.
      placed = src.to(device).to(target);
    }
    safetensors::release_mapped_pages(stored);  // copied: its pages leave the RSS (a no-op for memory we own)
    out[spec.name] = std::move(placed);
  }
  return out;
}

}  // namespace skyreels::checkpoint
