// Internal to the transformer checkpoint loader, which is split by concept over transformer_layout.cpp (key names),
// transformer_checkpoint_config.cpp (config.json and the config the shapes imply), transformer_decode.cpp (fp8 codes,
// scale tensors, the norm_out.linear fold), transformer_loader.cpp (reading and placing) and transformer_convert.cpp
// (writing the diffusers layout): the few helpers and steps these files share. Not a public header: only those files
// include it.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "model/transformer_loader.h"

namespace skyreels::model::loader_detail {

inline constexpr const char* kPrefix = "model.diffusion_model.";  // ComfyUI / single-file checkpoints

inline bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

inline std::string shape_of(const at::Tensor& t) { return checkpoint::shape_str(t.sizes().vec()); }

inline std::string gb(uint64_t bytes) {  // decimal units, as file sizes on the Hub are given
  const double b = static_cast<double>(bytes);
  char buf[32];
  if (b >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  } else if (b >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.1f MB", b / 1e6);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f KB", b / 1e3);
  }
  return buf;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// transformer_layout.cpp: the original -> internal rename table (its size is reported by the loader).
const std::vector<checkpoint::RenameRule>& original_rules();

// transformer_decode.cpp: the steps of the analysis that turn stored tensors into values.
void fold_norm_out_linear(TransformerCheckpointAnalysis& a, const std::string& prefix);
void collect_decodings(const checkpoint::Source& src, TransformerCheckpointAnalysis& a);
std::set<std::string> encoded_names(const TransformerCheckpointAnalysis& a);

}  // namespace skyreels::model::loader_detail
