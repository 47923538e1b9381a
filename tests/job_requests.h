// Small job requests for the server's unit tests (no process, no model weights): random prompt embeddings and a
// six-chunk long video on the tiny model's text width.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "server/replica/model_job.h"

namespace skyreels::server::test_requests {

inline RawTensor embeddings(int64_t tokens, int64_t dim, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> normal;
  std::vector<float> v(static_cast<size_t>(tokens * dim));
  for (auto& x : v) x = normal(rng);
  RawTensor t;
  t.dtype = "F32";
  t.shape = {1, tokens, dim};
  t.data.assign(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  return t;
}

inline JobRequest long_video() {
  JobRequest r;
  r.prompt_embeds = embeddings(8, 32, 1);
  r.negative_prompt_embeds = embeddings(8, 32, 2);
  r.num_frames = 57;
  r.base_num_frames = 17;
  r.overlap_history = 9;
  r.height = 64;
  r.width = 96;
  r.num_inference_steps = 4;
  r.seed = 5;
  return r;
}

}  // namespace skyreels::server::test_requests
