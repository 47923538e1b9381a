// The bounds of a request's adapter list, declared once: the model's catalogue checks them, and the server's doors
// (gRPC, HTTP) check the count and the name length before copying anything (model/ and server/ include this header;
// it needs nothing but the standard library).
#pragma once

#include <cstddef>
#include <string>

namespace skyreels::model {

inline constexpr size_t kMaxAdaptersPerRequest = 8;
// An adapter's name is a file name in --lora-dir without ".safetensors": no file system has longer names. A longer
// one is refused without being echoed back.
inline constexpr size_t kMaxAdapterNameBytes = 255;
// |scale| <= 100: published adapters use scales within about [-2, 2]; 100 leaves room for unusual ones while a typo
// such as 1e6 (which drives the activations to inf) is refused before it costs a generation.
inline constexpr double kMaxAdapterScale = 100.0;

// Why a list `list` of `count` adapters is refused ("" when it fits).
inline std::string adapter_count_problem(size_t count, const std::string& list) {
  if (count <= kMaxAdaptersPerRequest) return "";
  return list + ": " + std::to_string(count) + " given, at most " + std::to_string(kMaxAdaptersPerRequest) +
         " per request";
}

// Why the name `field` of `bytes` bytes is refused ("" when it fits); the name itself is never echoed.
inline std::string adapter_name_problem(size_t bytes, const std::string& field) {
  if (bytes <= kMaxAdapterNameBytes) return "";
  return field + ": " + std::to_string(bytes) + " bytes, longer than any adapter's name (at most " +
         std::to_string(kMaxAdapterNameBytes) + ")";
}

}  // namespace skyreels::model
