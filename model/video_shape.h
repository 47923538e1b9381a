// The video's shape as the model runs it, stated once: the Wan VAE's factors (4 pixel frames per latent frame after
// the first, 8x8 pixels per latent position), the 4k+1 frame counts that follow from them, the pixel multiple of the
// transformer's 2x2 patches, and the frame rate a video is told when nobody says. The server (server/job/) and the
// CLI derive from these. Torch-free.
#pragma once

#include <cstdint>

namespace skyreels::model {

inline constexpr int64_t kVaeTemporalFactor = 4;  // the Wan VAE's (WanVaeConfig::temporal_factor())
inline constexpr int64_t kVaeSpatialFactor = 8;   // the Wan VAE's (WanVaeConfig::spatial_factor())
inline constexpr int64_t kPixelMultiple = 2 * kVaeSpatialFactor;  // height and width: whole 2x2 patches of latents
inline constexpr int64_t kDefaultFps = 24;                        // diffusers' default (and the MP4's)

// Frame counts the VAE packs exactly: the first frame alone, then kVaeTemporalFactor per latent frame.
constexpr bool is_4k_plus_1(int64_t pixel_frames) { return (pixel_frames - 1) % kVaeTemporalFactor == 0; }
// The 4k+1 count at or below `pixel_frames` (>= 1).
constexpr int64_t four_k_plus_one_below(int64_t pixel_frames) {
  return (pixel_frames - 1) / kVaeTemporalFactor * kVaeTemporalFactor + 1;
}
// Latent frames of a 4k+1 pixel video (the frames past the last 4k+1 are dropped, as the VAE drops them).
constexpr int64_t latent_frames_of(int64_t pixel_frames) { return (pixel_frames - 1) / kVaeTemporalFactor + 1; }
// Pixel frames `latent_frames` latent frames decode to (1 + 4 (latent_frames - 1)); 0 for none.
constexpr int64_t pixel_frames_of(int64_t latent_frames) {
  return latent_frames <= 0 ? 0 : 1 + kVaeTemporalFactor * (latent_frames - 1);
}
// Latent positions along a side of `pixels` pixels.
constexpr int64_t latent_size_of(int64_t pixels) { return pixels / kVaeSpatialFactor; }

}  // namespace skyreels::model
