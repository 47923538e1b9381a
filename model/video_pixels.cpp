// Pixel conversions of model/video_mp4.h that need no FFmpeg (built with or without it).
#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <string>

#include "model/video_mp4.h"

namespace skyreels::video {

at::Tensor to_rgb_uint8(const at::Tensor& video) {
  if (video.dim() != 4 || video.size(0) != 3 || !at::isFloatingType(video.scalar_type())) {
    throw VideoError("to_rgb_uint8: expected a float video [3, T, H, W], got dims " + std::to_string(video.dim()));
  }
  // diffusers: (x / 2 + 0.5).clamp(0, 1) in float32, then (frame * 255).astype(np.uint8), which truncates.
  // The same ops in place on one float temporary, and the truncating cast written straight into the [T, H, W, 3]
  // frames: two full-size buffers instead of six (the VAE's frames go to the encoder chunk after chunk).
  at::Tensor scaled = video.to(at::kCPU, at::kFloat) * 0.5f;
  scaled.add_(0.5f).clamp_(0.0, 1.0).mul_(255.0f);
  at::Tensor frames = at::empty({video.size(1), video.size(2), video.size(3), 3}, at::TensorOptions().dtype(at::kByte));
  frames.copy_(scaled.permute({1, 2, 3, 0}));
  return frames;
}

at::Tensor from_rgb_uint8(const at::Tensor& frames) {
  if (frames.dim() != 4 || frames.size(3) != 3 || frames.scalar_type() != at::kByte) {
    throw VideoError("from_rgb_uint8: expected uint8 [T, H, W, 3]");
  }
  return (frames.to(at::kFloat) / 255.0f * 2.0f - 1.0f).permute({3, 0, 1, 2}).contiguous();
}

double psnr(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) throw VideoError("psnr: tensors differ in shape");
  const double mse = (a.to(at::kDouble) - b.to(at::kDouble)).pow(2).mean().item<double>();
  if (mse == 0.0) return std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(255.0 * 255.0 / mse);
}

}  // namespace skyreels::video
