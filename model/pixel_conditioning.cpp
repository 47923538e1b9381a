#include "model/pixel_conditioning.h"

#include <ATen/ATen.h>

#include <sstream>
#include <stdexcept>
#include <vector>

#include "model/safetensors.h"
#include "model/shape_text.h"
#include "model/vae_wan.h"

namespace skyreels::model {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// Channels at `channel_dim`, then H, W at the end; batch 1 or `batch`.
void check_pixels(const at::Tensor& t, const std::string& field, int64_t dims, int64_t channel_dim,
                  const std::string& layout, int64_t batch, const GenerationParams& p) {
  require(t.dim() == dims && t.size(channel_dim) == 3,
          field + ": expected " + layout + " RGB, got shape " + shape_text(t.sizes()));
  require(t.size(-2) == p.height && t.size(-1) == p.width,
          field + ": " + std::to_string(t.size(-1)) + "x" + std::to_string(t.size(-2)) +
              " pixels, but the request is " + std::to_string(p.width) + "x" + std::to_string(p.height) +
              " (width x height); resize it first");
  require(t.size(0) == 1 || t.size(0) == batch,
          field + ": batch " + std::to_string(t.size(0)) + " must be 1 or the prompt batch " + std::to_string(batch));
  require(at::isFloatingType(t.scalar_type()), field + ": expected float pixels in [0, 1]");
  require(t.numel() > 0 && at::isfinite(t).all().item<bool>(), field + ": contains NaN or infinite values");
}

// diffusers' VaeImageProcessor.preprocess for tensors already at size: x -> 2x - 1, unless any value is < 0 (then
// the tensor is taken as already in [-1, 1]).
at::Tensor to_signed_unit(const at::Tensor& pixels) {
  const at::Tensor x = pixels.to(at::kFloat);
  if (x.lt(0).any().item<bool>()) return x;
  return 2.0 * x - 1.0;
}

at::Tensor encode_mode(const WanVae& vae, const at::Tensor& pixels) {
  return vae.encode(pixels.to(vae.device(), vae.dtype())).mode().to(at::kFloat);
}

}  // namespace

void describe_conditioning(const PixelConditioning& pixels, int64_t batch, GenerationParams& params) {
  params.mode = ConditioningMode::kText;
  params.last_image = false;
  params.video_frames = 0;
  if (pixels.empty()) return;
  require(!(pixels.image.defined() && pixels.video.defined()),
          "image: an image (image-to-video) and a video (video extension) cannot both be given");
  require(!pixels.last_image.defined() || pixels.image.defined(), "last_image: needs an image as the first frame");
  if (pixels.image.defined()) {
    check_pixels(pixels.image, "image", 4, 1, "[B, 3, H, W]", batch, params);
    if (pixels.last_image.defined()) {
      check_pixels(pixels.last_image, "last_image", 4, 1, "[B, 3, H, W]", batch, params);
      require(pixels.last_image.size(0) == pixels.image.size(0),
              "last_image: batch " + std::to_string(pixels.last_image.size(0)) + " differs from the image's " +
                  std::to_string(pixels.image.size(0)));
    }
    params.mode = ConditioningMode::kImage;
    params.last_image = pixels.last_image.defined();
    return;
  }
  check_pixels(pixels.video, "video", 5, 2, "[B, F, 3, H, W]", batch, params);
  params.mode = ConditioningMode::kVideo;
  params.video_frames = pixels.video.size(1);
}

EncodedConditioning encode_conditioning(const WanVae& vae, const PixelConditioning& pixels,
                                        const GenerationParams& params) {
  EncodedConditioning out;
  if (params.mode == ConditioningMode::kImage) {
    require(pixels.image.defined(), "image: missing for image-to-video");
    // One encode of [image; last_image] as single frames (diffusers' prepare_latents), then split the batch.
    at::Tensor batch = to_signed_unit(pixels.image);
    if (params.last_image) batch = at::cat({batch, to_signed_unit(pixels.last_image)}, 0);
    out.posterior_mode = encode_mode(vae, batch.unsqueeze(2));
    const at::Tensor normalised = vae.normalize(out.posterior_mode).to(at::kCPU);
    const int64_t images = pixels.image.size(0);
    out.prefix_latents = normalised.narrow(0, 0, images).contiguous();
    if (params.last_image) out.last_image_latents = normalised.narrow(0, images, images).contiguous();
    return out;
  }
  if (params.mode == ConditioningMode::kVideo) {
    require(pixels.video.defined(), "video: missing for video extension");
    require(params.overlap_history.has_value(), "overlap_history: required to extend a video");
    // Per video: 2x-1, [F, 3, H, W] -> [1, 3, F, H, W], its last overlap_history frames, one encode each.
    std::vector<at::Tensor> modes;
    for (int64_t b = 0; b < pixels.video.size(0); ++b) {
      const at::Tensor video = to_signed_unit(pixels.video[b]).permute({1, 0, 2, 3}).unsqueeze(0);
      const int64_t frames = std::min(video.size(2), *params.overlap_history);
      modes.push_back(encode_mode(vae, video.narrow(2, video.size(2) - frames, frames)));
    }
    out.posterior_mode = modes.front();
    out.prefix_latents = vae.normalize(at::cat(modes, 0)).to(at::kCPU).contiguous();
    return out;
  }
  throw std::invalid_argument("conditioning: text-to-video has no pixels to encode");
}

namespace {

at::Tensor shaped(const at::Tensor& unit_frames, PixelKind kind, const std::string& what) {
  if (kind == PixelKind::kVideo) return unit_frames.unsqueeze(0);
  require(unit_frames.size(0) == 1,
          what + ": an image must have exactly 1 frame, got " + std::to_string(unit_frames.size(0)));
  return unit_frames;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

at::Tensor load_pixels(const std::string& path, const std::string& tensor_name, PixelKind kind) {
  if (ends_with(path, ".safetensors")) {
    auto file = safetensors::File::open(path);
    require(file->contains(tensor_name), "'" + path + "' holds no tensor `" + tensor_name + "`");
    return file->tensor(tensor_name).to(at::kFloat).clone();
  }
  const video::DecodedVideo decoded = video::read_video(path);
  require(decoded.info.frames > 0, "'" + path + "' has no frames");
  return shaped(frames_to_unit_float(decoded.frames), kind, "'" + path + "'");
}

at::Tensor decode_pixels(const std::vector<uint8_t>& bytes, PixelKind kind, const video::ReadLimits& limits,
                         const std::string& field) {
  video::DecodedVideo decoded;
  try {
    decoded = video::read_video_bytes(bytes, limits);
  } catch (const video::VideoError& e) {
    throw std::invalid_argument(field + ": not a readable " +
                                (kind == PixelKind::kImage ? std::string("PNG/JPEG image") : std::string("MP4 video")) +
                                " (" + e.what() + ")");
  }
  require(decoded.info.frames > 0, field + ": no frames could be decoded");
  return shaped(frames_to_unit_float(decoded.frames), kind, field);
}

at::Tensor frames_to_unit_float(const at::Tensor& frames) {
  require(frames.dim() == 4 && frames.size(3) == 3 && frames.scalar_type() == at::kByte,
          "frames: expected uint8 [T, H, W, 3], got shape " + shape_text(frames.sizes()));
  return frames.permute({0, 3, 1, 2}).to(at::kFloat).div(255.0).contiguous();
}

}  // namespace skyreels::model
