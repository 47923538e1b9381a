#include "server/replica/demo_model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "model/safetensors.h"
#include "model/transformer_skyreels_v2.h"
#include "model/vae_wan.h"

namespace skyreels::server {

namespace {

// Random weights scaled so that activations stay O(1): matrices and kernels ~ N(0, 1/fan_in), norm weights ~ 1,
// biases and modulation tables small.
at::Tensor random_parameter(const checkpoint::ParamSpec& spec, at::Generator& generator) {
  at::Tensor t = at::randn(spec.shape, generator, at::TensorOptions().dtype(at::kFloat));
  const bool is_bias = spec.name.size() > 5 && spec.name.compare(spec.name.size() - 5, 5, ".bias") == 0;
  const bool table = spec.name.find("scale_shift_table") != std::string::npos;
  if (spec.shape.size() >= 2 && !table) {
    int64_t fan_in = 1;
    for (size_t i = 1; i < spec.shape.size(); ++i) fan_in *= spec.shape[i];
    return (t / std::sqrt(static_cast<double>(fan_in))).contiguous();
  }
  if (is_bias || table) return (t * 0.02).contiguous();
  return (1.0 + 0.1 * t).contiguous();  // norm weights
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text << "\n";
  if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace

void write_tiny_vae(const std::string& dir, uint64_t seed) {
  model::WanVaeConfig config = model::WanVaeConfig::wan_2_1();
  config.base_dim = 8;
  config.dim_mult = {1, 1, 1, 1};
  config.num_res_blocks = 1;
  config.validate();
  std::filesystem::create_directories(dir);
  write_text(dir + "/config.json", config.to_json());
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& spec : model::wan_vae_parameter_specs(config))
    tensors.emplace_back(spec.name, random_parameter(spec, generator));
  safetensors::save(dir + "/diffusion_pytorch_model.safetensors", tensors, {{"format", "pt"}});
}

void write_tiny_model(const std::string& dir, const TinyModelOptions& options) {
  model::TransformerConfig config;
  config.num_attention_heads = options.num_attention_heads;
  config.attention_head_dim = options.attention_head_dim;
  config.num_layers = options.num_layers;
  config.text_dim = options.text_dim;
  config.ffn_dim = options.ffn_dim;
  config.freq_dim = options.freq_dim;
  config.inject_sample_info = options.inject_sample_info;
  if (options.image_dim > 0) {
    config.in_channels = 36;  // noise, the 4-channel frame mask, the condition video's latents
    config.image_dim = options.image_dim;
    config.added_kv_proj_dim = options.num_attention_heads * options.attention_head_dim;
  }
  config.validate();

  std::filesystem::create_directories(dir);
  write_text(dir + "/config.json", config.to_diffusers_json());

  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& spec : model::transformer_parameter_specs(config)) {
    tensors.emplace_back(spec.name, random_parameter(spec, generator));
  }
  safetensors::save(dir + "/diffusion_pytorch_model.safetensors", tensors,
                    {{"format", "pt"}, {"skyreels_tiny_seed", std::to_string(options.seed)}});
}

std::string make_private_temp_dir(const std::string& prefix) {
  std::string path = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (::mkdtemp(path.data()) == nullptr) throw std::runtime_error("cannot create a temp directory for " + prefix);
  return path;
}

}  // namespace skyreels::server
