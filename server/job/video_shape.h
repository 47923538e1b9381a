// A request's video shape in the units the doors speak, derived from the model's (model/video_shape.h: the VAE's
// factors, 4k+1 frame counts, the fps default): seconds of video <-> frame counts. Torch-free, header only (the HTTP
// door links no job library).
#pragma once

#include <cmath>
#include <cstdint>

#include "model/video_shape.h"

namespace skyreels::server {

using model::kDefaultFps;  // GenerationParams.fps' default

// `seconds` of video at `fps` as the nearest 4k+1 frame count, as the model needs: 4 s at 24 fps = 97.
inline int64_t frames_for_seconds(double seconds, int64_t fps) {
  constexpr auto kFactor = model::kVaeTemporalFactor;
  return kFactor * std::llround(seconds * static_cast<double>(fps) / static_cast<double>(kFactor)) + 1;
}

// The seconds `frames` frames span at `fps`, from the first frame to the last: 97 frames at 24 fps = 4 s.
inline double seconds_of_frames(int64_t frames, int64_t fps) {
  return static_cast<double>(frames - 1) / static_cast<double>(fps);
}

}  // namespace skyreels::server
