// WanVaeConfig: the Wan 2.1 preset, diffusers' config.json (read and written), validation and the factors the
// config implies.
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/vae_wan.h"

namespace skyreels::model {
namespace {

std::vector<double> wan21_latents_mean() {
  return {-0.7571, -0.7089, -0.9113, 0.1075,  -0.1745, 0.9653,  -0.1517, 1.5508,
          0.4134,  -0.0715, 0.5517,  -0.3632, -0.1922, -0.9497, 0.2503,  -0.2921};
}
std::vector<double> wan21_latents_std() {
  return {2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
          3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160};
}

// ---------------------------------------------------------------------------------------------------------------
// Config parsing.
template <typename T>
T json_get(const nlohmann::json& j, const std::string& key, const T& fallback, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  try {
    return j[key].get<T>();
  } catch (const std::exception& e) {
    throw std::invalid_argument(where + ": field '" + key + "' has the wrong type (" + e.what() + ")");
  }
}

}  // namespace

WanVaeConfig WanVaeConfig::wan_2_1() {
  WanVaeConfig c;
  c.latents_mean = wan21_latents_mean();
  c.latents_std = wan21_latents_std();
  return c;
}

int64_t WanVaeConfig::temporal_factor() const {
  int64_t f = 1;
  for (bool d : temperal_downsample) f *= d ? 2 : 1;
  return f;
}

int64_t WanVaeConfig::spatial_factor() const { return int64_t{1} << temperal_downsample.size(); }

int64_t WanVaeConfig::pixel_frames(int64_t latent_frames) const {
  return latent_frames <= 0 ? 0 : 1 + temporal_factor() * (latent_frames - 1);
}

void WanVaeConfig::validate() const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument("Wan VAE config: " + message);
  };
  require(base_dim >= 1, "base_dim must be >= 1");
  require(decoder_dim() >= 1, "decoder_base_dim must be >= 1");
  require(z_dim >= 1, "z_dim must be >= 1");
  require(!dim_mult.empty(), "dim_mult must not be empty");
  for (int64_t m : dim_mult) require(m >= 1, "dim_mult entries must be >= 1");
  require(num_res_blocks >= 1, "num_res_blocks must be >= 1");
  require(temperal_downsample.size() + 1 == dim_mult.size(),
          "temperal_downsample needs len(dim_mult) - 1 = " + std::to_string(dim_mult.size() - 1) + " entries, has " +
              std::to_string(temperal_downsample.size()));
  require(static_cast<int64_t>(latents_mean.size()) == z_dim,
          "latents_mean has " + std::to_string(latents_mean.size()) + " entries, z_dim is " + std::to_string(z_dim));
  require(static_cast<int64_t>(latents_std.size()) == z_dim,
          "latents_std has " + std::to_string(latents_std.size()) + " entries, z_dim is " + std::to_string(z_dim));
  for (double s : latents_std) require(s > 0.0, "latents_std entries must be > 0");
  require(in_channels >= 1 && out_channels >= 1, "in_channels/out_channels must be >= 1");
  // Upsamplers halve the channels; the level after one must start from an integer width.
  for (size_t i = 0; i + 1 < dim_mult.size(); ++i) {
    require(decoder_dim() * dim_mult[dim_mult.size() - 1 - i] % 2 == 0,
            "decoder widths must be even where an upsampler halves them");
  }
}

WanVaeConfig WanVaeConfig::from_json(const std::string& json_text, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(where + " is not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw std::invalid_argument(where + " is not a JSON object");
  const std::string cls = json_get<std::string>(j, "_class_name", "AutoencoderKLWan", where);
  if (cls != "AutoencoderKLWan") {
    throw std::invalid_argument(where + ": _class_name is '" + cls + "', expected 'AutoencoderKLWan'");
  }
  if (json_get<bool>(j, "is_residual", false, where)) {
    throw std::invalid_argument(where + ": is_residual = true (the Wan 2.2 VAE) is not supported; only Wan 2.1");
  }
  if (json_get<int64_t>(j, "patch_size", 1, where) != 1) {
    throw std::invalid_argument(where + ": patch_size > 1 (the Wan 2.2 VAE) is not supported; only Wan 2.1");
  }
  if (!json_get<std::vector<double>>(j, "attn_scales", {}, where).empty()) {
    // diffusers' encoder calls attention blocks with cache arguments they do not take, so no checkpoint has them.
    throw std::invalid_argument(where + ": attn_scales must be [] (as in every Wan 2.1 VAE)");
  }
  const WanVaeConfig d = wan_2_1();
  WanVaeConfig c;
  c.base_dim = json_get<int64_t>(j, "base_dim", d.base_dim, where);
  if (j.contains("decoder_base_dim") && !j["decoder_base_dim"].is_null()) {
    c.decoder_base_dim = json_get<int64_t>(j, "decoder_base_dim", 0, where);
  }
  c.z_dim = json_get<int64_t>(j, "z_dim", d.z_dim, where);
  c.dim_mult = json_get<std::vector<int64_t>>(j, "dim_mult", d.dim_mult, where);
  c.num_res_blocks = json_get<int64_t>(j, "num_res_blocks", d.num_res_blocks, where);
  c.temperal_downsample = json_get<std::vector<bool>>(j, "temperal_downsample", d.temperal_downsample, where);
  c.latents_mean = json_get<std::vector<double>>(j, "latents_mean", d.latents_mean, where);
  c.latents_std = json_get<std::vector<double>>(j, "latents_std", d.latents_std, where);
  c.in_channels = json_get<int64_t>(j, "in_channels", d.in_channels, where);
  c.out_channels = json_get<int64_t>(j, "out_channels", d.out_channels, where);
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + ": " + e.what());
  }
  return c;
}

std::string WanVaeConfig::to_json() const {
  nlohmann::ordered_json j;
  j["_class_name"] = "AutoencoderKLWan";
  j["base_dim"] = base_dim;
  j["decoder_base_dim"] = decoder_base_dim ? nlohmann::ordered_json(*decoder_base_dim) : nlohmann::ordered_json();
  j["z_dim"] = z_dim;
  j["dim_mult"] = dim_mult;
  j["num_res_blocks"] = num_res_blocks;
  j["attn_scales"] = nlohmann::ordered_json::array();
  j["temperal_downsample"] = temperal_downsample;
  j["dropout"] = 0.0;
  j["latents_mean"] = latents_mean;
  j["latents_std"] = latents_std;
  j["is_residual"] = false;
  j["in_channels"] = in_channels;
  j["out_channels"] = out_channels;
  j["patch_size"] = nullptr;
  j["scale_factor_temporal"] = temporal_factor();
  j["scale_factor_spatial"] = spatial_factor();
  return j.dump(2);
}

}  // namespace skyreels::model
