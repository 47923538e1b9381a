#include "model/preview.h"

#include <ATen/ATen.h>

#include <stdexcept>

namespace skyreels::model {

// clang-format off
const std::array<std::array<float, 3>, kPreviewLatentChannels> kWan21LatentRgbFactors = {{
    {-0.1299f, -0.1692f,  0.2932f},
    { 0.0671f,  0.0406f,  0.0442f},
    { 0.3568f,  0.2548f,  0.1747f},
    { 0.0372f,  0.2344f,  0.1420f},
    { 0.0313f,  0.0189f, -0.0328f},
    { 0.0296f, -0.0956f, -0.0665f},
    {-0.3477f, -0.4059f, -0.2925f},
    { 0.0166f,  0.1902f,  0.1975f},
    {-0.0412f,  0.0267f, -0.1364f},
    {-0.1293f,  0.0740f,  0.1636f},
    { 0.0680f,  0.3019f,  0.1128f},
    { 0.0032f,  0.0581f,  0.0639f},
    {-0.1251f,  0.0927f,  0.1699f},
    { 0.0060f, -0.0633f,  0.0005f},
    { 0.3477f,  0.2275f,  0.2950f},
    { 0.1984f,  0.0913f,  0.1861f},
}};
const std::array<float, 3> kWan21LatentRgbBias = {-0.1835f, -0.0868f, -0.3360f};
// clang-format on

at::Tensor latent_rgb(const at::Tensor& latents) {
  if (latents.dim() != 5 || latents.size(1) != kPreviewLatentChannels) {
    throw std::invalid_argument("preview: latents must be [B, 16, F, h, w]");
  }
  const auto cpu = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor factors =
      at::from_blob(const_cast<float*>(kWan21LatentRgbFactors[0].data()), {kPreviewLatentChannels, 3}, cpu)
          .to(latents.device());
  const at::Tensor bias = at::from_blob(const_cast<float*>(kWan21LatentRgbBias.data()), {3}, cpu).to(latents.device());
  const at::Tensor rgb = at::matmul(latents.to(at::kFloat).permute({0, 2, 3, 4, 1}), factors) + bias;
  return ((rgb + 1.0) / 2.0).clamp(0.0, 1.0);
}

at::Tensor latent_rgb_u8(const at::Tensor& latents) {
  return (latent_rgb(latents) * 255.0).round().to(at::kByte).cpu().contiguous();
}

at::Tensor frame_strip(const at::Tensor& frames) {
  if (frames.dim() != 4 || frames.size(3) != 3) throw std::invalid_argument("preview: frames must be [F, h, w, 3]");
  return frames.permute({1, 0, 2, 3}).reshape({frames.size(1), frames.size(0) * frames.size(2), 3}).contiguous();
}

at::Tensor preview_strip(const ChunkPreview& preview) { return frame_strip(latent_rgb_u8(preview.x0)[0]); }

}  // namespace skyreels::model
