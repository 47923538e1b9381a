// safetensors in memory (no LibTorch): what result chunks travel as, and how the client joins them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace skyreels::server {

// One float32 tensor `name` as safetensors bytes (data area aligned to 8 bytes).
std::string safetensors_bytes(const std::string& name, const std::vector<int64_t>& shape, const float* data,
                              const std::map<std::string, std::string>& metadata = {});

// A view of one F32 tensor inside safetensors bytes (which must outlive it). Throws std::runtime_error.
struct F32View {
  std::vector<int64_t> shape;
  const char* data = nullptr;
  size_t bytes = 0;
  std::map<std::string, std::string> metadata;
};
F32View parse_f32_tensor(const std::string& safetensors, const std::string& name);

// Joins per-chunk `latents` [B, C, n_k, h, w] along the frame axis into one safetensors file's bytes.
std::string concat_latent_chunks(const std::vector<std::string>& chunk_blobs,
                                 const std::map<std::string, std::string>& metadata = {});

}  // namespace skyreels::server
