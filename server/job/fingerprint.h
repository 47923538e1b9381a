// Idempotency fingerprints: what a reused idempotency key is checked against, all of it here (the transport, the
// replica and the queue call it). Version 2 is SHA-256 (OpenSSL, already in the process for TLS), written "sha256:" +
// 64 hex digits; version 1 was a 64-bit FNV-1a of the same bytes, kept beside it so that retries of jobs stored before
// the upgrade (only v1) still match, and pods of the previous version in a rolling update still compare what they
// know. The values are stored with the jobs: never change what goes in (tests/test_fingerprint.cpp pins them). No
// LibTorch, no gRPC.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace skyreels::server {

struct AdapterChoice;
struct JobRequest;

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

struct Fingerprint {
  uint64_t v1 = 0;
  std::string v2;
};

// Every byte of the request that determines its output, in a fixed order. `adapters`: the job's, resolved (their
// files' SHA-256); none adds nothing (older fingerprints stay valid).
Fingerprint request_fingerprint(const JobRequest& request, const std::vector<AdapterChoice>& adapters);

// What a submission adds to its request: the same key with another priority, deadline or timeout is another request.
struct SubmissionTerms {
  int64_t priority = 0;
  int64_t deadline_kind = 0;  // the proto's deadline_kind case (0: neither)
  int64_t seconds = 0;        // of the deadline or the timeout (0: neither)
  int64_t nanos = 0;
};
Fingerprint submission_fingerprint(const Fingerprint& request, const SubmissionTerms& terms);

// Whether a stored job's fingerprints match a new request's: by v2 when the job has one, else by v1.
bool same_fingerprint(uint64_t stored_v1, const std::string& stored_v2, uint64_t v1, const std::string& v2);

}  // namespace skyreels::server
