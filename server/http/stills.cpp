#include "server/http/stills.h"

#include <ATen/ATen.h>

#include <cmath>
#include <stdexcept>

#include "model/video_mp4.h"

namespace skyreels::server::http {

namespace {

at::Tensor frames_of(const std::string& mp4, std::vector<int64_t> keep) {
  video::ReadLimits limits;
  limits.keep_frames = std::move(keep);
  const auto video = video::read_video_bytes(std::vector<uint8_t>(mp4.begin(), mp4.end()), limits);
  if (video.frames.size(0) == 0) throw std::runtime_error("the video has none of the frames asked for");
  return video.frames;  // [n, H, W, 3]
}

std::string png(const at::Tensor& rgb) {
  const auto bytes = video::encode_png(rgb);
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace

VideoShape video_shape(const std::string& mp4) {
  video::ReadLimits limits;
  limits.keep_frames = {0};
  const auto video = video::read_video_bytes(std::vector<uint8_t>(mp4.begin(), mp4.end()), limits);
  return {video.info.width, video.info.height, video.info.fps};
}

std::string first_frame_png(const std::string& mp4) { return png(frames_of(mp4, {0}).select(0, 0)); }

std::string sprite_sheet_png(const std::string& mp4, const std::vector<int64_t>& frames) {
  const at::Tensor picked = frames_of(mp4, frames);
  const int64_t n = picked.size(0), h = picked.size(1), w = picked.size(2);
  const int64_t columns = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n))));
  const int64_t rows = (n + columns - 1) / columns;
  at::Tensor sheet = at::zeros({rows * h, columns * w, 3}, at::kByte);
  for (int64_t i = 0; i < n; ++i) {
    sheet.narrow(0, (i / columns) * h, h).narrow(1, (i % columns) * w, w).copy_(picked[i]);
  }
  return png(sheet);
}

}  // namespace skyreels::server::http
