#include "server/job/fingerprint.h"

#include <openssl/evp.h>

#include <stdexcept>

namespace skyreels::server {

FingerprintHasher::FingerprintHasher() : ctx_(EVP_MD_CTX_new()) {
  if (ctx_ == nullptr || EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) != 1) {
    EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_));
    throw std::runtime_error("SHA-256: cannot initialise OpenSSL's digest");
  }
}

FingerprintHasher::~FingerprintHasher() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void FingerprintHasher::bytes(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < size; ++i) fnv_ = (fnv_ ^ p[i]) * 1099511628211ULL;
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, size);
}

std::string FingerprintHasher::v2() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), digest, &size) != 1) {
    throw std::runtime_error("SHA-256: OpenSSL's digest failed");
  }
  return kFingerprintV2Prefix + hex_digits(digest, size);
}

std::string hex_digits(const void* data, size_t size) {
  static constexpr char kHex[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out;
  out.reserve(2 * size);
  for (size_t i = 0; i < size; ++i) {
    out += kHex[p[i] >> 4];
    out += kHex[p[i] & 15];
  }
  return out;
}

bool same_fingerprint(uint64_t stored_v1, const std::string& stored_v2, uint64_t v1, const std::string& v2) {
  return stored_v2.empty() ? stored_v1 == v1 : stored_v2 == v2;
}

}  // namespace skyreels::server
