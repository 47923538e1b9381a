// A tiny SkyReels-V2 transformer with random weights from a fixed seed, written as a diffusers-layout checkpoint
// (config.json + diffusion_pytorch_model.safetensors) so that it is loaded through the normal loader. Used by
// `skyreels-server --demo` (the README's main job, tests) and `skyreels make-tiny`.
#pragma once

#include <cstdint>
#include <string>

namespace skyreels::server {

struct TinyModelOptions {
  uint64_t seed = 20250101;
  int64_t num_attention_heads = 2;
  int64_t attention_head_dim = 12;  // inner dim 24
  int64_t num_layers = 2;
  int64_t text_dim = 32;
  int64_t ffn_dim = 48;
  int64_t freq_dim = 256;
  bool inject_sample_info = true;
  // > 0: an image-to-video (I2V) model: 36 input channels and the image branch for CLIP tokens this wide
  // (added_kv_proj_dim = the inner dim).
  int64_t image_dim = 0;
};

// Writes the checkpoint into `dir` (created if missing). Same options, same bytes.
void write_tiny_model(const std::string& dir, const TinyModelOptions& options = {});

// A tiny Wan VAE (base_dim 8, dim_mult [1,1,1,1], one res block; z_dim 16, 4x temporal / 8x spatial like the real
// one) with random weights, in the diffusers layout: `--vae demo`.
void write_tiny_vae(const std::string& dir, uint64_t seed = 20250102);

// A fresh directory only this process can have made (mkdtemp: random name, mode 0700) under the system temp dir,
// never a predictable path that another local user could have created or linked first. Where demo weights go.
std::string make_private_temp_dir(const std::string& prefix);

}  // namespace skyreels::server
