// Bounds on safetensors headers read from untrusted bytes (request blobs, downloaded results) and from files.
// nlohmann::json parses any nesting depth and allocates per value: 60 MB of "[[[[" took 18 s and 4 GB. So the length
// and the nesting are checked before anything is parsed. LibTorch-free: the wire code (server/blob.cpp) includes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace skyreels::safetensors {

// Headers that travel inside a message (embeddings_safetensors, result chunks). Real ones are under 1 KiB.
inline constexpr uint64_t kMaxBlobHeaderBytes = 64 << 10;
// Checkpoint files: the reference implementation's limit (a sharded 14B model has ~100 KiB headers).
inline constexpr uint64_t kMaxFileHeaderBytes = 100ull << 20;
// A safetensors header nests 3 deep ({name: {shape: [..]}}); anything deeper than this is not one.
inline constexpr size_t kMaxJsonDepth = 8;

// True when no object or array in `json` nests deeper than `max_depth` (brackets inside strings do not count).
// Linear, no allocation: run it before handing untrusted text to a JSON parser.
inline bool json_nesting_within(std::string_view json, size_t max_depth) {
  size_t depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (const char c : json) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return true;
}

}  // namespace skyreels::safetensors
