// PNG stills of a video's MP4 (OpenAI's thumbnail and spritesheet variants): decoded with FFmpeg, keeping only the
// frames asked for, so memory follows one frame, not the video's length.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace skyreels::server::http {

// The first frame.
std::string first_frame_png(const std::string& mp4);

// The given frames (ascending indices) side by side in a grid of ceil(sqrt(n)) columns, row by row.
std::string sprite_sheet_png(const std::string& mp4, const std::vector<int64_t>& frames);

}  // namespace skyreels::server::http
