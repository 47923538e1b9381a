// Protocol Buffers' wire format, the little of it that the watch streams write and read by hand: a preview's image
// travels as the hub's own bytes (a slice that refers to them), never inside a copy of the message (issue 46).
#pragma once

#include <cstdint>
#include <string>

namespace skyreels::server::wire {

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

constexpr uint64_t field_key(int field, WireType type) { return (static_cast<uint64_t>(field) << 3) | type; }

inline void append_varint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

}  // namespace skyreels::server::wire
