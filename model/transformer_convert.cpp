// `skyreels convert`: writes a transformer checkpoint of any accepted layout in the diffusers layout (config.json plus
// one file or shards with an index, as save_pretrained), optionally cast to float32 / bfloat16 or encoded as
// float8_e4m3fn. Separate from the loader because it is the writing side: it reads through
// analyze_transformer_checkpoint like every other caller and shares nothing else with loading.
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "model/transformer_loader.h"
#include "model/transformer_loader_detail.h"

namespace fs = std::filesystem;

namespace skyreels::model {

using checkpoint::CheckpointError;
using loader_detail::gb;
using loader_detail::seconds_since;

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
