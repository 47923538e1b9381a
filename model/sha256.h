// SHA-256 (FIPS 180-4) of our own, streamed: model/ reads no OpenSSL (model-only builds have none). It identifies
// adapter files (model/adapter_bank.h): a file replaced after it was catalogued no longer matches.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace skyreels::model {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  // The digest as 64 lower-case hex digits; finishes the hash (update() after it is an error).
  std::string hex();

 private:
  void block(const uint8_t* p);
  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t length_ = 0;  // bytes hashed
  bool finished_ = false;
};

// The SHA-256 of a whole file, read in 1 MiB pieces. Throws std::runtime_error naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace skyreels::model
