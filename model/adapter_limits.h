// The bounds of a request's adapter list, declared once: the model's catalogue checks them, and the server's doors
// (gRPC, HTTP) check the count and the name length before copying anything (model/ and server/ include this header,
// which includes nothing).
#pragma once

#include <cstddef>

namespace skyreels::model {

inline constexpr size_t kMaxAdaptersPerRequest = 8;
// An adapter's name is a file name in --lora-dir without ".safetensors": no file system has longer names. A longer
// one is refused without being echoed back.
inline constexpr size_t kMaxAdapterNameBytes = 255;
// |scale| <= 100: published adapters use scales within about [-2, 2]; 100 leaves room for unusual ones while a typo
// such as 1e6 (which drives the activations to inf) is refused before it costs a generation.
inline constexpr double kMaxAdapterScale = 100.0;

}  // namespace skyreels::model
