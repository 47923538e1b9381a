// The Wan 2.1 causal 3-D VAE (diffusers' AutoencoderKLWan), with layers of its own (vae_wan_layers.h: the blocks in
// vae_wan_layers.cpp, the encoder and decoder in vae_wan_encoder_decoder.cpp; the config in vae_wan_config.cpp; the
// weights, loading, decode and encode in vae_wan.cpp).
//
// Decoding runs through a per-convolution feature cache (the last CACHE_T = 2 frames each causal convolution saw), as
// diffusers does; a DecodeSession keeps that cache between calls, so a long video can be decoded chunk by chunk (and
// written out as it goes) with memory that does not grow with its length. diffusers decodes one latent frame per
// decoder call; every layer is causal in time (or per frame), so several latent frames per call give the same video
// (to float rounding: ≤ 1e-5 in tests) with fewer, larger convolutions. The number per call comes from a memory
// budget (kVaeMemoryBudgetBytes), so memory stays flat with the video's length; frames_per_call = 1 is diffusers'
// frame-by-frame order. The one first-frame rule (the temporal upsamplers let the very first latent frame through
// without their time_conv, and the next frames see zeros before them, diffusers' "Rep") holds inside a call too.
// Encoding runs over 1 frame, then chunks of 4 (several chunks of 4 per call the same way), through the encoder's
// own cache.
//
// Internal parameter names are diffusers' names (encoder.*, decoder.*, quant_conv.*, post_quant_conv.*), so the
// diffusers layout (config.json + diffusion_pytorch_model.safetensors) loads as it is.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/checkpoint.h"

namespace skyreels::model {

struct WanVaeConfig {
  int64_t base_dim = 96;
  std::optional<int64_t> decoder_base_dim;  // null: base_dim
  int64_t z_dim = 16;
  std::vector<int64_t> dim_mult{1, 2, 4, 4};
  int64_t num_res_blocks = 2;
  std::vector<bool> temperal_downsample{false, true, true};  // diffusers' spelling
  std::vector<double> latents_mean;                          // z_dim entries
  std::vector<double> latents_std;                           // z_dim entries
  int64_t in_channels = 3;
  int64_t out_channels = 3;

  static WanVaeConfig wan_2_1();  // Wan2.1_VAE.pth as converted by diffusers (the defaults above + latents stats)

  // diffusers config.json text. Fields this port cannot run (is_residual = true, a patch_size > 1, non-empty
  // attn_scales, another _class_name) are rejected with an error naming the field; `where` names the file.
  static WanVaeConfig from_json(const std::string& json_text, const std::string& where = "config.json");
  std::string to_json() const;
  // Throws std::invalid_argument naming the field when the config is inconsistent.
  void validate() const;

  int64_t decoder_dim() const { return decoder_base_dim.value_or(base_dim); }
  int64_t temporal_factor() const;  // 2^(number of true entries in temperal_downsample): 4
  int64_t spatial_factor() const;   // 2^len(temperal_downsample): 8
  // Pixel frames produced by `latent_frames` latent frames: 1 + temporal_factor * (latent_frames - 1).
  int64_t pixel_frames(int64_t latent_frames) const;
};

// Every parameter of the model (encoder, decoder, quant convs), with its shape, in diffusers' names.
std::vector<checkpoint::ParamSpec> wan_vae_parameter_specs(const WanVaeConfig& config);

// The activation memory the decoder and encoder may use per call (the model's weights not counted): frames per call
// are the most that fit (at least 1). 1 GiB: 64x64 video decodes 17 latent frames per call, 480x832 one (which is
// diffusers' order). On this project's CPU the decode is compute-bound either way (docs/BENCHMARKS.md).
inline constexpr int64_t kVaeMemoryBudgetBytes = int64_t{1} << 30;

class WanVaeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Immutable once built: decode(), encode() and sessions on one instance may run concurrently.
class WanVae {
 public:
  // Takes exactly the tensors named by wan_vae_parameter_specs(config), already on `device` in `dtype`
  // (checkpoint::place_strict does that). Throws WanVaeError naming any missing, extra or misshapen tensor.
  WanVae(WanVaeConfig config, checkpoint::StateDict weights, c10::Device device, at::ScalarType dtype);
  ~WanVae();
  WanVae(WanVae&&) noexcept;
  WanVae& operator=(WanVae&&) noexcept;
  WanVae(const WanVae&) = delete;
  WanVae& operator=(const WanVae&) = delete;

  // A diffusers VAE folder (config.json + diffusion_pytorch_model*.safetensors), or a pipeline folder holding
  // vae/. Strict: every tensor of the file must be a parameter of the model and the other way round.
  static WanVae load(const std::string& path, const checkpoint::PlaceOptions& options = {});

  const WanVaeConfig& config() const;
  c10::Device device() const;
  at::ScalarType dtype() const;

  // The generator works on normalised latents: z = latents * std + mean, per channel (dim 1), in float32 (the
  // pipeline's latents are float32), returned on the VAE's device in its dtype.
  at::Tensor denormalize(const at::Tensor& latents) const;
  // The inverse, as the I2V/V2V pipelines do it: (z - mean) * (1 / std); float32 out.
  at::Tensor normalize(const at::Tensor& z) const;

  // post_quant_conv(z) (exposed for tests; decode() applies it).
  at::Tensor post_quant_conv(const at::Tensor& z) const;

  // z: [B, z_dim, F, h, w] in the VAE's own latent space. Returns [B, out_channels, 1 + 4(F-1), 8h, 8w] clamped to
  // [-1, 1], in the VAE's dtype. `frames_per_call` latent frames go through the decoder at once: 0 derives it from
  // kVaeMemoryBudgetBytes (decode_frames_per_call), 1 is diffusers' frame by frame. Memory for the activations is
  // that of one call; the output is the whole video (use a DecodeSession to hand frames on as they come).
  at::Tensor decode(const at::Tensor& z, int64_t frames_per_call = 0) const;

  // Estimated activation bytes of one decoder call on one latent frame of batch `batch` and latent size h x w, and
  // of one encoder call on 4 pixel frames of that (pixel) size / 8: the largest level's live tensors.
  int64_t decode_bytes_per_latent_frame(int64_t batch, int64_t h, int64_t w) const;
  int64_t encode_bytes_per_chunk(int64_t batch, int64_t h, int64_t w) const;
  // Latent frames per decoder call / chunks of 4 pixel frames per encoder call within `budget_bytes` (>= 1).
  int64_t decode_frames_per_call(int64_t batch, int64_t h, int64_t w,
                                 int64_t budget_bytes = kVaeMemoryBudgetBytes) const;
  int64_t encode_chunks_per_call(int64_t batch, int64_t h, int64_t w,
                                 int64_t budget_bytes = kVaeMemoryBudgetBytes) const;

  // The posterior of `video` ([B, in_channels, T, H, W] in [-1, 1]): frames are taken as 1, then chunks of 4;
  // trailing frames beyond 1 + 4k are dropped as diffusers does (with a warning). `chunks_per_call` chunks of 4 go
  // through the encoder at once: 0 derives it from kVaeMemoryBudgetBytes, 1 (the default) is diffusers' order. The
  // default stays 1: batched it is as fast on CPU (bench_vae) but oneDNN's larger convolutions round differently
  // with another thread count, and image / video conditioning must give the same latents bit for bit in the server
  // (any replica, any threads) as in `skyreels generate` (test_server_conditioning).
  struct Posterior {
    at::Tensor mean;    // [B, z_dim, 1 + (T-1)/4, H/8, W/8]; also the mode()
    at::Tensor logvar;  // clamped to [-30, 20]
    const at::Tensor& mode() const { return mean; }
  };
  Posterior encode(const at::Tensor& video, int64_t chunks_per_call = 1) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  friend class WanVaeDecodeSession;
};

// Decoding of one video, keeping the causal cache between calls: decoding a latent sequence in any split gives what
// decode() gives for the whole (to float rounding). Each call runs the decoder on `frames_per_call` latent frames at
// a time (0: decode_frames_per_call at the first call's size; 1: diffusers' frame by frame). Not thread-safe; one
// per video. The WanVae must outlive it.
class WanVaeDecodeSession {
 public:
  explicit WanVaeDecodeSession(const WanVae& vae, int64_t frames_per_call = 0);
  ~WanVaeDecodeSession();
  WanVaeDecodeSession(const WanVaeDecodeSession&) = delete;
  WanVaeDecodeSession& operator=(const WanVaeDecodeSession&) = delete;

  // z: [B, z_dim, n, h, w] (n >= 1), the next latent frames in the VAE's latent space; B, h, w fixed per session.
  // Returns their pixel frames: 1 + 4(n-1) for the very first call, 4n afterwards. clamp=false returns the raw
  // decoder output (diffusers clamps the concatenation, which is the same thing).
  at::Tensor decode(const at::Tensor& z, bool clamp = true);
  int64_t latent_frames_done() const { return frames_done_; }
  // Latent frames per decoder call: as given, or (0) as derived at the first call; 0 before it.
  int64_t frames_per_call() const { return frames_per_call_; }

 private:
  const WanVae& vae_;
  struct Cache;
  std::unique_ptr<Cache> cache_;
  int64_t frames_done_ = 0;
  int64_t frames_per_call_ = 0;
  std::vector<int64_t> shape_;  // B, h, w of the first call
};

}  // namespace skyreels::model
