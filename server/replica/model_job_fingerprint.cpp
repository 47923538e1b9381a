// A job's idempotency fingerprint: every byte of the request that determines its output, in a fixed order, hashed
// into both fingerprint versions (server/job/fingerprint.h), the adapters' files by their SHA-256.
#include <cstdint>
#include <optional>
#include <string>

#include "server/job/fingerprint.h"
#include "server/job/generation_params.h"
#include "server/replica/model_job_impl.h"

namespace skyreels::server::model_job_detail {

namespace {

// The request's bytes in a fixed order, into both fingerprint versions (server/fingerprint.h).
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
};

}  // namespace

// `adapters`: the job's, resolved (their files' SHA-256); none adds nothing (older fingerprints stay valid).
RequestFingerprint fingerprint_of(const JobRequest& r, const std::vector<AdapterChoice>& adapters) {
  RequestHasher f;
  f.tensor(r.prompt_embeds);
  f.tensor(r.negative_prompt_embeds);
  f.add(static_cast<uint8_t>(r.embeddings_safetensors.has_value()));
  if (r.embeddings_safetensors) f.str(*r.embeddings_safetensors);
  f.add(static_cast<uint8_t>(r.prompt.has_value()));
  if (r.prompt) f.str(*r.prompt);
  f.add(static_cast<uint8_t>(r.negative_prompt.has_value()));
  if (r.negative_prompt) f.str(*r.negative_prompt);
  fingerprint_generation_params(r, [&f](const void* data, size_t size) { f.bytes(data, size); });
  for (const auto* pixels : {&r.image, &r.last_image, &r.video}) {
    f.add(static_cast<uint8_t>(pixels->has_value()));
    if (!*pixels) continue;
    f.add(static_cast<uint8_t>((*pixels)->encoded.has_value()));
    if ((*pixels)->encoded) f.str(*(*pixels)->encoded);
    f.tensor((*pixels)->tensor);
  }
  f.add(static_cast<uint64_t>(r.prompt_changes.size()));
  for (const auto& change : r.prompt_changes) {
    f.add(change.from_frame);
    f.tensor(change.prompt_embeds);
    f.tensor(change.negative_prompt_embeds);
    f.add(static_cast<uint8_t>(change.text.has_value()));
    if (change.text) f.str(*change.text);
  }
  for (const AdapterChoice& a : adapters) {
    f.str(a.name);
    f.add(a.scale.value_or(1.0));
    f.str(a.sha256);
  }
  const uint64_t v1 = f.h.v1();
  return {v1, f.h.v2()};
}

}  // namespace skyreels::server::model_job_detail
