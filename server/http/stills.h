// PNG stills of a video's MP4 (OpenAI's thumbnail and spritesheet variants): decoded with FFmpeg, keeping only the
// frames asked for, so memory follows one frame, not the video's length.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace skyreels::server::http {

struct VideoShape {
  int64_t width = 0, height = 0;
  double fps = 0;
};

// A video's size and frame rate (its first frame decoded). Throws when it is not one FFmpeg reads.
VideoShape video_shape(const std::string& mp4);

// The first frame.
std::string first_frame_png(const std::string& mp4);

// The given frames (ascending indices) side by side in a grid of ceil(sqrt(n)) columns, row by row.
std::string sprite_sheet_png(const std::string& mp4, const std::vector<int64_t>& frames);

}  // namespace skyreels::server::http
