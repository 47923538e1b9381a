// Previews of a chunk while it denoises: each frame's predicted clean latents (flow matching: x0 = x_t - sigma * v,
// with the frame's own sigma in diffusion forcing) projected to RGB by a fixed linear map of the 16 latent channels,
// at latent resolution. No VAE: a preview costs a small matrix product, not a decode.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

namespace skyreels::model {

// Wan 2.1's latent -> RGB factors: ComfyUI's comfy/latent_formats.py, class Wan21 (`latent_rgb_factors`, 16 rows of
// R, G, B, and `latent_rgb_factors_bias`), fitted there on the VAE's normalised latents, which are the latents the
// transformer denoises here. The Wan VAE of the SkyReels-V2 checkpoints is Wan 2.1's.
constexpr int64_t kPreviewLatentChannels = 16;
extern const std::array<std::array<float, 3>, kPreviewLatentChannels> kWan21LatentRgbFactors;
extern const std::array<float, 3> kWan21LatentRgbBias;

// Normalised latents [B, 16, F, h, w] (any float dtype, any device) -> RGB in [0, 1], fp32 [B, F, h, w, 3] on the
// same device: rgb = clamp((x . factors + bias + 1) / 2, 0, 1), computed in fp32 (ComfyUI's preview mapping).
at::Tensor latent_rgb(const at::Tensor& latents);
// latent_rgb scaled to 0..255 and rounded: uint8 [B, F, h, w, 3] on the CPU (a host sync: call it per preview only).
at::Tensor latent_rgb_u8(const at::Tensor& latents);
// uint8 frames [F, h, w, 3] side by side, left to right: uint8 [h, F * w, 3] (one image for PNG).
at::Tensor frame_strip(const at::Tensor& frames);

// One preview of the running chunk, made after a timestep row (model/diffusion_forcing.h: StepHooks::on_preview).
struct ChunkPreview {
  int64_t chunk = 0;
  int64_t row = 0;   // 0-based row of the chunk's timestep matrix the preview follows
  int64_t rows = 0;  // rows of the chunk
  // The chunk's new frames: latent frames [first_frame, first_frame + x0.size(2)) of the whole video.
  int64_t first_frame = 0;
  // fp32 [1, 16, F, h, w] on the model's device: the first video of the batch. Frames not yet predicted hold their
  // latents (noise, or the clean frames the chunk continues from).
  at::Tensor x0;
};

// The preview as one image: its frames' RGB side by side, uint8 [h, F * w, 3] on the CPU (a host sync).
at::Tensor preview_strip(const ChunkPreview& preview);
// zlib level of a preview's PNG (video::encode_png): fast, since the replica's thread makes it between two rows.
constexpr int kPreviewPngCompression = 1;

}  // namespace skyreels::model
