// Idempotency fingerprints: what a reused idempotency key is checked against. Version 2 is SHA-256 (OpenSSL, already
// in the process for TLS), written "sha256:" + 64 hex digits; version 1 was a 64-bit FNV-1a of the same bytes, kept
// beside it so that retries of jobs stored before the upgrade (only v1) still match, and pods of the previous version
// in a rolling update still compare what they know. No LibTorch, no gRPC.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace skyreels::server {

inline constexpr const char* kFingerprintV2Prefix = "sha256:";

// Both versions over one stream of bytes.
class FingerprintHasher {
 public:
  FingerprintHasher();
  ~FingerprintHasher();
  FingerprintHasher(const FingerprintHasher&) = delete;
  FingerprintHasher& operator=(const FingerprintHasher&) = delete;
  void bytes(const void* data, size_t size);
  uint64_t v1() const { return fnv_; }
  std::string v2();  // "sha256:" + hex; once (finishes the digest)

 private:
  uint64_t fnv_ = 1469598103934665603ULL;
  void* ctx_;  // EVP_MD_CTX
};

// Lower-case hex of `size` bytes (fingerprints, job ids).
std::string hex_digits(const void* data, size_t size);

// Whether a stored job's fingerprints match a new request's: by v2 when the job has one, else by v1.
bool same_fingerprint(uint64_t stored_v1, const std::string& stored_v2, uint64_t v1, const std::string& v2);

}  // namespace skyreels::server
