#include "server/api/codec.h"

#include "server/job/proto_wire.h"

namespace skyreels::server::api {

// ---- conversions --------------------------------------------------------------------------------------------------

google::protobuf::Timestamp to_timestamp(WallClock::time_point t) {
  google::protobuf::Timestamp ts;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  ts.set_seconds(ns / 1000000000);
  ts.set_nanos(static_cast<int32_t>(ns % 1000000000));
  return ts;
}

pb::JobState to_proto(JobState s) {
  switch (s) {
    case JobState::Queued:
      return pb::JOB_STATE_QUEUED;
    case JobState::Running:
      return pb::JOB_STATE_RUNNING;
    case JobState::Succeeded:
      return pb::JOB_STATE_SUCCEEDED;
    case JobState::Failed:
      return pb::JOB_STATE_FAILED;
    case JobState::Cancelled:
      return pb::JOB_STATE_CANCELLED;
    case JobState::DeadlineExceeded:
      return pb::JOB_STATE_DEADLINE_EXCEEDED;
  }
  return pb::JOB_STATE_UNSPECIFIED;
}

StatusCode to_code(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::None:
      return StatusCode::OK;
    case ErrorKind::Internal:
      return StatusCode::INTERNAL;
    case ErrorKind::Unavailable:
      return StatusCode::UNAVAILABLE;
    case ErrorKind::Cancelled:
      return StatusCode::CANCELLED;
    case ErrorKind::DeadlineExceeded:
      return StatusCode::DEADLINE_EXCEEDED;
    case ErrorKind::InvalidArgument:
      return StatusCode::INVALID_ARGUMENT;
    case ErrorKind::ResourceExhausted:
      return StatusCode::RESOURCE_EXHAUSTED;
  }
  return StatusCode::UNKNOWN;
}

ResolvedInputs resolved_inputs(const ModelJob& job) {
  return {job.params(), [&job](bool negative) { return job.prompt_embeddings(negative); },
          [&job](size_t index) { return job.prompt_change_embeddings(index); }};
}

Status not_found(const std::string& id) {
  return Status(StatusCode::NOT_FOUND, "job '" + log_escape(id, kMaxJobIdBytes) + "' not found");
}

Status check_job_id(const std::string& id) {
  if (id.size() > kMaxJobIdBytes) {
    return Status(StatusCode::INVALID_ARGUMENT, "job_id: longer than " + std::to_string(kMaxJobIdBytes) + " bytes");
  }
  return Status::OK;
}

Status check_format(pb::ResultFormat format, bool vae_available) {
  if (!pb::ResultFormat_IsValid(format)) {
    return Status(StatusCode::INVALID_ARGUMENT, "format: " + std::to_string(static_cast<int>(format)) +
                                                    " is not a ResultFormat (0 latents, 1 latents, 2 MP4)");
  }
  if (format == pb::RESULT_FORMAT_MP4 && !vae_available) {
    return Status(StatusCode::FAILED_PRECONDITION, "format: MP4 needs a server started with --vae; ask for latents");
  }
  return Status::OK;
}

Status job_deadline(const pb::SubmitJobRequest& request, std::optional<Clock::time_point>* out) {
  out->reset();
  if (request.has_deadline()) {
    const auto& d = request.deadline();
    if (d.seconds() < kMinTimestampSeconds || d.seconds() > kMaxTimestampSeconds || d.nanos() < 0 ||
        d.nanos() > 999999999) {
      return Status(StatusCode::INVALID_ARGUMENT, "deadline: not a valid google.protobuf.Timestamp");
    }
    const auto now_seconds = std::chrono::duration_cast<std::chrono::seconds>(WallClock::now().time_since_epoch());
    if (d.seconds() > now_seconds.count() + std::chrono::seconds(kMaxJobTimeout).count()) {
      return Status(StatusCode::INVALID_ARGUMENT,
                    "deadline: more than " + std::to_string(std::chrono::seconds(kMaxJobTimeout).count()) + " s ahead");
    }
    const auto wall = WallClock::time_point(std::chrono::duration_cast<WallClock::duration>(
        std::chrono::seconds(d.seconds()) + std::chrono::nanoseconds(d.nanos())));
    const auto left = wall - WallClock::now();
    if (left <= WallClock::duration::zero()) return Status(StatusCode::INVALID_ARGUMENT, "deadline: already passed");
    *out = Clock::now() + std::chrono::duration_cast<Clock::duration>(left);
  } else if (request.has_timeout()) {
    const auto& t = request.timeout();
    const bool same_sign = (t.seconds() >= 0 && t.nanos() >= 0) || (t.seconds() <= 0 && t.nanos() <= 0);
    if (t.nanos() < -999999999 || t.nanos() > 999999999 || !same_sign) {
      return Status(StatusCode::INVALID_ARGUMENT, "timeout: not a valid google.protobuf.Duration");
    }
    if (t.seconds() < 0 || (t.seconds() == 0 && t.nanos() <= 0)) {
      return Status(StatusCode::INVALID_ARGUMENT, "timeout: must be positive");
    }
    if (t.seconds() > std::chrono::seconds(kMaxJobTimeout).count()) {
      return Status(StatusCode::INVALID_ARGUMENT,
                    "timeout: longer than " + std::to_string(std::chrono::seconds(kMaxJobTimeout).count()) + " s");
    }
    *out = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(t.seconds()) +
                                                                      std::chrono::nanoseconds(t.nanos()));
  }
  return Status::OK;
}

SubmissionTerms submission_terms(const pb::SubmitJobRequest& request) {
  SubmissionTerms terms;
  terms.priority = request.priority();
  terms.deadline_kind = static_cast<int64_t>(request.deadline_kind_case());
  if (request.has_deadline()) {
    terms.seconds = request.deadline().seconds();
    terms.nanos = request.deadline().nanos();
  } else {  // without either, timeout() is the default instance: 0 s
    terms.seconds = request.timeout().seconds();
    terms.nanos = request.timeout().nanos();
  }
  return terms;
}

std::function<void(double)> vae_encode_metric(ApiMetrics* metrics) {
  if (metrics == nullptr) return {};
  return [metrics](double seconds) { metrics->vae_call("encode", seconds); };
}

void work_to_proto(const TransformerWork& w, pb::TransformerWork* out) {
  out->set_full(w.full);
  out->set_computed(w.computed);
  out->set_saved_exact(w.saved_exact);
  out->set_saved_cache(w.saved_cache);
}

std::chrono::steady_clock::time_point rpc_deadline(const grpc::ServerContextBase& ctx) {
  const auto deadline = ctx.deadline();
  const auto left = deadline - std::chrono::system_clock::now();
  if (deadline == std::chrono::system_clock::time_point::max() || left > std::chrono::hours(24)) {
    return std::chrono::steady_clock::time_point::max();
  }
  return std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(left);
}

bool parse_page_token(const std::string& token, size_t* offset) {
  if (token.empty() || token.size() > 18 || token.find_first_not_of("0123456789") != std::string::npos) return false;
  *offset = static_cast<size_t>(std::stoull(token));
  return true;
}

uint64_t random_seed() {
  uint64_t seed = 0;
  random_bytes(&seed, sizeof seed);
  return seed >> 1;  // 63 bits: also fits signed 64-bit consumers
}

grpc::ByteBuffer event_message(const pb::JobEvent& event) {
  grpc::ByteBuffer out;
  bool own = false;
  (void)grpc::SerializationTraits<pb::JobEvent>::Serialize(event, &out, &own);
  return out;
}

// The event without its preview, then the preview's key and length, its fields, the image's key and length, and the
// PNG as a slice of its own. preview (17) and image (9) are the last fields of their messages, so these are the bytes
// protobuf writes for the whole event.
grpc::ByteBuffer preview_message(const pb::JobEvent& event, std::shared_ptr<const ChunkPreviewImage> image) {
  const std::string& png = image->png;
  if (png.empty()) return event_message(event);
  pb::JobEvent outer = event;
  outer.clear_preview();
  std::string head = outer.SerializeAsString();
  const std::string fields = event.preview().SerializeAsString();
  std::string image_key;
  wire::append_varint(wire::field_key(pb::ChunkPreview::kImageFieldNumber, wire::kLengthDelimited), &image_key);
  wire::append_varint(png.size(), &image_key);
  wire::append_varint(wire::field_key(pb::JobEvent::kPreviewFieldNumber, wire::kLengthDelimited), &head);
  wire::append_varint(fields.size() + image_key.size() + png.size(), &head);
  head += fields;
  head += image_key;
  // The slice holds a reference to the image until gRPC lets go of the last copy of the message.
  auto* kept = new std::shared_ptr<const ChunkPreviewImage>(std::move(image));
  const grpc::Slice slices[] = {
      grpc::Slice(head),
      grpc::Slice(const_cast<char*>(png.data()), png.size(),
                  [](void* p) { delete static_cast<std::shared_ptr<const ChunkPreviewImage>*>(p); }, kept)};
  return grpc::ByteBuffer(slices, 2);
}

// Who is calling: `owner` decides which jobs they see ("" without API keys); `client` is what per-client caps count
// (the key's client name, or the peer's address for anonymous callers).

}  // namespace skyreels::server::api
