#include "server/job/fingerprint.h"

#include <openssl/evp.h>

#include <optional>
#include <stdexcept>

#include "server/job/generation_params.h"

namespace skyreels::server {

namespace {

// The request's bytes in a fixed order, into both fingerprint versions.
struct RequestHasher {
  FingerprintHasher h;
  void bytes(const void* data, size_t n) { h.bytes(data, n); }
  void str(const std::string& s) {
    add(static_cast<uint64_t>(s.size()));
    bytes(s.data(), s.size());
  }
  template <typename T>
  void add(const T& v) {
    bytes(&v, sizeof v);
  }
  void tensor(const std::optional<RawTensor>& t) {
    add(static_cast<uint8_t>(t.has_value()));
    if (!t) return;
    str(t->dtype);
    for (int64_t d : t->shape) add(d);
    str(t->data);
  }
  void text(const std::optional<std::string>& s) {
    add(static_cast<uint8_t>(s.has_value()));
    if (s) str(*s);
  }
};

void add_pixels(RequestHasher& f, const JobRequest& r) {
  for (const auto* pixels : {&r.image, &r.last_image, &r.video}) {
    f.add(static_cast<uint8_t>(pixels->has_value()));
    if (!*pixels) continue;
    f.text((*pixels)->encoded);
    f.tensor((*pixels)->tensor);
  }
}

void add_prompt_changes(RequestHasher& f, const JobRequest& r) {
  f.add(static_cast<uint64_t>(r.prompt_changes.size()));
  for (const auto& change : r.prompt_changes) {
    f.add(change.from_frame);
    f.tensor(change.prompt_embeds);
    f.tensor(change.negative_prompt_embeds);
    f.text(change.text);
  }
}

}  // namespace

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

Fingerprint request_fingerprint(const JobRequest& r, const std::vector<AdapterChoice>& adapters) {
  RequestHasher f;
  f.tensor(r.prompt_embeds);
  f.tensor(r.negative_prompt_embeds);
  f.text(r.embeddings_safetensors);
  f.text(r.prompt);
  f.text(r.negative_prompt);
  fingerprint_generation_params(r, [&f](const void* data, size_t size) { f.bytes(data, size); });
  add_pixels(f, r);
  add_prompt_changes(f, r);
  for (const AdapterChoice& a : adapters) {
    f.str(a.name);
    f.add(a.scale.value_or(1.0));
    f.str(a.sha256);
  }
  const uint64_t v1 = f.h.v1();
  return {v1, f.h.v2()};
}

Fingerprint submission_fingerprint(const Fingerprint& request, const SubmissionTerms& t) {
  const uint64_t deadline = static_cast<uint64_t>(t.deadline_kind) * 0xC2B2AE3D27D4EB4FULL ^
                            static_cast<uint64_t>(t.seconds) * 0x9E3779B97F4A7C15ULL ^
                            static_cast<uint64_t>(t.nanos) * 0x165667B19E3779F9ULL;
  Fingerprint out;
  out.v1 = request.v1 ^ (static_cast<uint64_t>(t.priority + 11) * 0x9E3779B97F4A7C15ULL) ^ deadline;
  FingerprintHasher h;
  h.bytes(request.v2.data(), request.v2.size());
  const int64_t fields[] = {t.priority, t.deadline_kind, t.seconds, t.nanos};
  h.bytes(fields, sizeof fields);
  out.v2 = h.v2();
  return out;
}

}  // namespace skyreels::server
