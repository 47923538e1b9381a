// What the encoders report, declared where they report it (Metrics implements it; the process wires it in), so that
// media/ never includes the metrics registry above it. Torch-free.
#pragma once

#include <cstddef>
#include <cstdint>

namespace skyreels::server {

class MediaMetrics {
 public:
  virtual ~MediaMetrics() = default;
  // One encoder call of the text embedding cache: rows served from it, rows encoded, bytes it holds now.
  virtual void text_embedding_cache(uint64_t hits, uint64_t misses, size_t bytes) = 0;
  // One VAE call: "encode" (conditioning frames to latents) or "decode" (a chunk's latents for its MP4).
  virtual void vae_call(const char* op, double seconds) = 0;
  virtual void video_chunk_encoded() = 0;               // one chunk's MP4 made
  virtual void video_jobs_pending(int64_t jobs) = 0;    // jobs with MP4 work left
};

}  // namespace skyreels::server
