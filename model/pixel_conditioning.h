// Image-to-video and video extension: the pixels a video is conditioned on, checked against the request, and turned
// into normalised VAE latents exactly as diffusers' SkyReelsV2DiffusionForcingImageToVideoPipeline and
// SkyReelsV2DiffusionForcingVideoToVideoPipeline prepare them (2x-1, VAE encode, posterior mode, (z - mean) / std).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/video_mp4.h"

namespace skyreels::model {

class WanVae;

// The pixels as the pipelines receive them: float32 RGB in [0, 1] at the request's height x width. Undefined
// tensors are absent. (A tensor with any value < 0 is taken as already in [-1, 1], as diffusers' processor does.)
struct PixelConditioning {
  at::Tensor image;       // [1 or B, 3, H, W]
  at::Tensor last_image;  // [1 or B, 3, H, W], with `image` only
  at::Tensor video;       // [1 or B, F, 3, H, W]
  bool empty() const { return !image.defined() && !last_image.defined() && !video.defined(); }
};

// Checks the pixels against the request (combination, layout, height x width, batch; throws std::invalid_argument
// naming the field) and records in `params` what the chunk plan needs (mode, last_image, video_frames).
void describe_conditioning(const PixelConditioning& pixels, int64_t batch, GenerationParams& params);

struct EncodedConditioning {
  at::Tensor prefix_latents;      // normalised [1 or B, z_dim, P_enc, h, w]: Conditioning::prefix_latents
  at::Tensor last_image_latents;  // normalised [1 or B, z_dim, 1, h, w] or undefined
  at::Tensor posterior_mode;      // the VAE's un-normalised mode of the (first) encode call (tests)
};

// The VAE encode, once per video. Image: image and last_image in one batch, one latent frame each. Video: the last
// overlap_history frames of each video. fp32 out, on the CPU. `params` must have passed describe_conditioning.
EncodedConditioning encode_conditioning(const WanVae& vae, const PixelConditioning& pixels,
                                        const GenerationParams& params);

// uint8 RGB frames [T, H, W, 3] (a decoded PNG/JPEG/MP4) -> float32 [T, 3, H, W] in [0, 1].
at::Tensor frames_to_unit_float(const at::Tensor& frames);

enum class PixelKind { kImage, kVideo };

// A PNG/JPEG (image) or MP4 (video) file decoded with FFmpeg, or a safetensors file holding the tensor
// `tensor_name` exactly as the pipeline receives it. Returns image [B, 3, H, W] / video [B, F, 3, H, W] in [0, 1].
at::Tensor load_pixels(const std::string& path, const std::string& tensor_name, PixelKind kind);
// The bytes of a PNG/JPEG (image: exactly one frame) or an MP4 (video), decoded within `limits`. Errors are
// std::invalid_argument naming `field`.
at::Tensor decode_pixels(const std::vector<uint8_t>& bytes, PixelKind kind, const video::ReadLimits& limits,
                         const std::string& field);

}  // namespace skyreels::model
