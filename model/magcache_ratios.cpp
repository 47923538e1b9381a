#include "model/magcache_ratios.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "model/transformer_loader.h"
#include "model/transformer_skyreels_v2.h"

namespace skyreels::model {

namespace {

constexpr const char* kFormat = "skyreels-magcache-ratios/1";

std::string sums_of(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kCPU, at::kDouble);
  std::ostringstream out;
  out.precision(4);  // of values that may be bf16 / fp8 / on another device: four digits say which model
  out << d.abs().sum().item<double>();
  return out.str();
}

std::vector<float> ratios_of(const nlohmann::json& j, const char* key, const std::string& path) {
  std::vector<float> out;
  if (!j.contains(key)) return out;
  const auto& list = j.at(key);
  if (!list.is_array()) throw std::invalid_argument(path + ": \"" + key + "\" is not a list of numbers");
  for (const auto& v : list) {
    if (!v.is_number()) throw std::invalid_argument(path + ": \"" + key + "\" holds something other than numbers");
    const double r = v.get<double>();
    if (!std::isfinite(r) || r <= 0 || r > 1e6) {
      throw std::invalid_argument(path + ": \"" + key + "\" holds " + std::to_string(r) +
                                  " (ratios are finite and positive)");
    }
    out.push_back(static_cast<float>(r));
  }
  return out;
}

std::string signature(const TransformerConfig& c, const std::function<at::Tensor(const std::string&)>& tensor) {
  std::ostringstream out;
  out << "layers=" << c.num_layers << " dim=" << c.inner_dim() << " ffn=" << c.ffn_dim << " in=" << c.in_channels
      << " out=" << c.out_channels << " image=" << c.image_dim.value_or(0) << " fps=" << c.inject_sample_info;
  for (const char* name : {"proj_out.weight", "blocks.0.scale_shift_table"})
    out << " " << name << "=" << sums_of(tensor(name));
  return out.str();
}

}  // namespace

std::string magcache_model_signature(const SkyReelsV2Transformer& model) {
  std::map<std::string, at::Tensor> tensors;
  for (auto& [name, t] : model.named_tensors()) tensors[name] = t;
  return signature(model.config(), [&](const std::string& name) { return tensors.at(name); });
}

std::string magcache_model_signature(const MappedTransformerCheckpoint& checkpoint) {
  return signature(checkpoint.config, [&](const std::string& name) { return checkpoint.value(name); });
}

MagCacheRatios load_magcache_ratios(const std::string& path, const std::string& here) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) throw std::invalid_argument(path + ": cannot read the MagCache ratios (" + ec.message() + ")");
  if (static_cast<int64_t>(size) > kMaxMagCacheRatiosBytes) {
    throw std::invalid_argument(path + ": " + std::to_string(size) + " bytes, more than a MagCache ratios file has (" +
                                std::to_string(kMaxMagCacheRatiosBytes) + ")");
  }
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw std::invalid_argument(path + ": not a JSON object (damaged?)");
  if (j.value("format", std::string()) != kFormat) {
    throw std::invalid_argument(path + ": not a MagCache ratios file (\"format\" is not \"" + kFormat + "\")");
  }
  MagCacheRatios r;
  r.cond = ratios_of(j, "ratios_cond", path);
  r.uncond = ratios_of(j, "ratios_uncond", path);
  r.num_inference_steps = j.value("num_inference_steps", int64_t{0});
  r.model = j.value("model", std::string());
  r.settings = j.value("settings", std::string());
  if (r.cond.empty() || r.num_inference_steps != static_cast<int64_t>(r.cond.size()) ||
      (!r.uncond.empty() && r.uncond.size() != r.cond.size())) {
    throw std::invalid_argument(path +
                                ": needs num_inference_steps ratios in \"ratios_cond\" (and as many in "
                                "\"ratios_uncond\" when present)");
  }
  if (r.model != here) {
    throw std::invalid_argument(path + ": calibrated on another model (" + r.model + "; this one: " + here + ")");
  }
  return r;
}

void save_magcache_ratios(const std::string& path, const MagCacheRatios& ratios) {
  nlohmann::json j = {{"format", kFormat},
                      {"model", ratios.model},
                      {"num_inference_steps", ratios.num_inference_steps},
                      {"settings", ratios.settings},
                      {"ratios_cond", ratios.cond}};
  if (!ratios.uncond.empty()) j["ratios_uncond"] = ratios.uncond;
  std::ofstream out(path);
  out << j.dump(1) << "\n";
  if (!out) throw std::runtime_error(path + ": cannot write the MagCache ratios");
}

}  // namespace skyreels::model
