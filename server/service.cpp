#include "server/service.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "server/generation_params_proto.h"
#include "server/fingerprint.h"
#include "server/guards.h"
#include "server/job_store.h"
#include "skyreels/v1/video_service.grpc.pb.h"

namespace skyreels::server {

namespace {

namespace pb = ::skyreels::v1;
using grpc::ServerContext;
using grpc::Status;
using grpc::StatusCode;

constexpr size_t kPartBytes = 1 << 20;                  // result messages stay small whatever the chunk size
constexpr auto kPoll = std::chrono::milliseconds(500);  // how often long streams look for a gone client
constexpr size_t kMaxJobIdBytes = 64;                   // ours are 34 ("j-" + 32 hex digits)
constexpr size_t kMaxIdempotencyKeyBytes = 128;
// Deadlines and timeouts further out than this are refused: no job should wait in a queue for a month.
constexpr std::chrono::hours kMaxJobTimeout{24 * 30};
// google.protobuf.Timestamp's valid range: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59Z.
constexpr int64_t kMinTimestampSeconds = -62135596800;
constexpr int64_t kMaxTimestampSeconds = 253402300799;

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

std::optional<RawTensor> raw_tensor(const pb::Tensor& t, bool present) {
  if (!present) return std::nullopt;
  RawTensor raw;
  switch (t.dtype()) {
    case pb::DTYPE_FLOAT32:
      raw.dtype = "F32";
      break;
    case pb::DTYPE_BFLOAT16:
      raw.dtype = "BF16";
      break;
    case pb::DTYPE_FLOAT16:
      raw.dtype = "F16";
      break;
    default:
      raw.dtype = "";
      break;
  }
  raw.shape.assign(t.shape().begin(), t.shape().end());
  raw.data = t.data();
  return raw;
}

std::optional<PixelRequest> pixel_request(const pb::PixelInput& input, bool present) {
  if (!present) return std::nullopt;
  PixelRequest r;
  if (input.source_case() == pb::PixelInput::kEncoded) r.encoded = input.encoded();
  if (input.source_case() == pb::PixelInput::kTensor) r.tensor = raw_tensor(input.tensor(), true);
  return r;
}

// Image / video conditioning and prompt changes (image-to-video, video extension, a prompt per chunk).
void conditioning_from_proto(const pb::JobSpec& spec, JobRequest& r) {
  r.image = pixel_request(spec.image(), spec.has_image());
  r.last_image = pixel_request(spec.last_image(), spec.has_last_image());
  r.video = pixel_request(spec.video(), spec.has_video());
  for (const pb::PromptChange& c : spec.prompt_changes()) {
    PromptChangeRequest change;
    change.from_frame = c.from_frame();
    if (c.prompt_case() == pb::PromptChange::kText) change.text = c.text();
    if (c.prompt_case() == pb::PromptChange::kEmbeddings) {
      change.prompt_embeds = raw_tensor(c.embeddings().prompt_embeds(), c.embeddings().has_prompt_embeds());
      change.negative_prompt_embeds =
          raw_tensor(c.embeddings().negative_prompt_embeds(), c.embeddings().has_negative_prompt_embeds());
    }
    r.prompt_changes.push_back(std::move(change));
  }
}

JobRequest request_from_proto(const pb::JobSpec& spec) {
  JobRequest r;
  switch (spec.conditioning_case()) {
    case pb::JobSpec::kEmbeddings:
      r.prompt_embeds = raw_tensor(spec.embeddings().prompt_embeds(), spec.embeddings().has_prompt_embeds());
      r.negative_prompt_embeds =
          raw_tensor(spec.embeddings().negative_prompt_embeds(), spec.embeddings().has_negative_prompt_embeds());
      if (!r.prompt_embeds) throw ValidationError("embeddings.prompt_embeds: required");
      break;
    case pb::JobSpec::kEmbeddingsSafetensors:
      r.embeddings_safetensors = spec.embeddings_safetensors();
      break;
    case pb::JobSpec::kText:
      r.prompt = spec.text().prompt();
      r.negative_prompt = spec.text().negative_prompt();
      break;
    case pb::JobSpec::CONDITIONING_NOT_SET:
      break;
  }
  request_params_from_proto(spec.params(), r);
  conditioning_from_proto(spec, r);
  return r;
}

void f32_to_proto(const RawTensor& raw, pb::Tensor* out) {
  out->set_dtype(pb::DTYPE_FLOAT32);
  for (int64_t d : raw.shape) out->add_shape(d);
  out->set_data(raw.data);
}

// Text in a stored request is replaced by the embeddings it was encoded to at submit (setting the embeddings clears
// the text: they are one oneof), so that a resume never encodes text, nor needs a text encoder.
void text_to_embeddings(const ModelJob& job, pb::JobSpec& spec) {
  if (spec.conditioning_case() == pb::JobSpec::kText) {
    pb::PromptEmbeddings embeddings;
    f32_to_proto(job.prompt_embeddings(false), embeddings.mutable_prompt_embeds());
    const RawTensor negative = job.prompt_embeddings(true);
    if (!negative.shape.empty()) f32_to_proto(negative, embeddings.mutable_negative_prompt_embeds());
    *spec.mutable_embeddings() = std::move(embeddings);
  }
  for (int i = 0; i < spec.prompt_changes_size(); ++i) {
    pb::PromptChange& change = *spec.mutable_prompt_changes(i);
    if (change.prompt_case() != pb::PromptChange::kText) continue;
    // No negative embeddings: a change given as text takes the job's negative prompt, which is stored above.
    f32_to_proto(job.prompt_change_embeddings(static_cast<size_t>(i)),
                 change.mutable_embeddings()->mutable_prompt_embeds());
  }
}

// What the job store keeps of a request: the request with the values actually used filled in (the resolved seed; the
// embeddings of every text), serialised deterministically. Deadlines are not part of it: the store keeps the
// absolute deadline of the job.
std::string durable_request(const pb::SubmitJobRequest& request, const ModelJob& job) {
  pb::SubmitJobRequest kept;
  *kept.mutable_spec() = request.spec();
  kept.set_priority(request.priority());
  kept.set_produce_mp4(request.produce_mp4());
  pb::JobSpec& spec = *kept.mutable_spec();
  spec.mutable_params()->set_seed(job.params().seed);
  text_to_embeddings(job, spec);
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    kept.SerializeToCodedStream(&coded);
  }
  return bytes;
}

// Ids are checked against kMaxJobIdBytes before any lookup, and echoed escaped.
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

// A client's deadline or timeout as a point on our monotonic clock, range-checked before any arithmetic (chrono
// overflows on values protobuf itself calls invalid, e.g. a timeout of 1e10 s or negative nanos).
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

// What the deadline fields contribute to the idempotency fingerprint: the same key with another deadline or timeout
// is another request.
uint64_t deadline_fingerprint(const pb::SubmitJobRequest& request) {
  uint64_t h = static_cast<uint64_t>(request.deadline_kind_case()) * 0xC2B2AE3D27D4EB4FULL;
  if (request.has_deadline()) {
    h ^= static_cast<uint64_t>(request.deadline().seconds()) * 0x9E3779B97F4A7C15ULL;
    h ^= static_cast<uint64_t>(request.deadline().nanos()) * 0x165667B19E3779F9ULL;
  } else if (request.has_timeout()) {
    h ^= static_cast<uint64_t>(request.timeout().seconds()) * 0x9E3779B97F4A7C15ULL;
    h ^= static_cast<uint64_t>(request.timeout().nanos()) * 0x165667B19E3779F9ULL;
  }
  return h;
}

// The request's SHA-256 fingerprint with what the submission adds to it (priority, deadline or timeout).
std::string submission_fingerprint_v2(const ModelJob& job, const pb::SubmitJobRequest& request) {
  FingerprintHasher h;
  const std::string& of_request = job.fingerprint_v2();
  h.bytes(of_request.data(), of_request.size());
  const int64_t fields[] = {request.priority(), static_cast<int64_t>(request.deadline_kind_case()),
                            request.has_deadline() ? request.deadline().seconds() : request.timeout().seconds(),
                            request.has_deadline() ? request.deadline().nanos() : request.timeout().nanos()};
  h.bytes(fields, sizeof fields);
  return h.v2();
}

std::function<void(double)> vae_encode_metric(Metrics* metrics) {
  if (metrics == nullptr) return {};
  return [metrics](double seconds) { metrics->vae_call("encode", seconds); };
}

void work_to_proto(const TransformerWork& w, pb::TransformerWork* out) {
  out->set_full(w.full);
  out->set_computed(w.computed);
  out->set_saved_exact(w.saved_exact);
  out->set_saved_cache(w.saved_cache);
}

// The RPC's deadline on the steady clock (store calls made for it end then: StoreCallDeadline); max() when none.
std::chrono::steady_clock::time_point rpc_deadline(const grpc::ServerContextBase& ctx) {
  const auto deadline = ctx.deadline();
  const auto left = deadline - std::chrono::system_clock::now();
  if (deadline == std::chrono::system_clock::time_point::max() || left > std::chrono::hours(24)) {
    return std::chrono::steady_clock::time_point::max();
  }
  return std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(left);
}

// A page token is the decimal offset ListJobs returned, nothing else (no sign, no spaces, no overflow).
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

// Who is calling: `owner` decides which jobs they see ("" without API keys); `client` is what per-client caps count
// (the key's client name, or the peer's address for anonymous callers).
struct Caller {
  std::string owner;
  std::string client;
  ClientLimits limits;
};

// A stream refused before it started: finishes at once with `status`.
template <typename Message>
class FinishedWriter final : public grpc::ServerWriteReactor<Message> {
 public:
  explicit FinishedWriter(const Status& status) { this->Finish(status); }
  void OnDone() override { delete this; }
};

// Runs the work that scheduler notifications ask for on one thread of its own: notifications arrive with the
// scheduler's lock held, and the work takes that lock again.
class StreamPump {
 public:
  StreamPump() : thread_([this] { loop(); }) {}
  ~StreamPump() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (stopping_) return;
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

class VideoServiceImpl;

// WatchJob without a thread: replays the job's events, then writes each new one when the scheduler says there is one
// (subscribe), one write in flight at a time. The reactor is deleted by gRPC in OnDone; what the scheduler and the
// pump may still reach after that is the shared Core, which never touches the reactor once it has called Finish.
class WatchReactor final : public grpc::ServerWriteReactor<pb::JobEvent> {
 public:
  static WatchReactor* start(VideoServiceImpl& service, const pb::WatchJobRequest& request, const std::string& owner,
                             std::unique_ptr<StreamLimiter::Slot> slot);
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  struct Core;
  explicit WatchReactor(std::shared_ptr<Core> core) : core_(std::move(core)) {}
  std::shared_ptr<Core> core_;
};

class VideoServiceImpl final : public pb::VideoService::WithCallbackMethod_WatchJob<pb::VideoService::Service> {
 public:
  friend class WatchReactor;

  VideoServiceImpl(JobQueue& jobs, ServiceConfig config)
      : scheduler_(jobs),
        config_(std::move(config)),
        streams_(config_.transport.max_streams, config_.transport.max_streams_per_client),
        encodes_(config_.transport.max_concurrent_encodes),
        decodes_(config_.transport.max_concurrent_encodes) {
    if (config_.metrics)
      streams_.on_change([metrics = config_.metrics](int64_t open) { metrics->set_streams_open(open); });
  }

  Status SubmitJob(ServerContext* ctx, const pb::SubmitJobRequest* request, pb::SubmitJobResponse* response) override {
    const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
    Caller caller;
    if (Status s = authenticate(ctx, &caller, true); !s.ok()) return s;
    SubmitResult result;
    if (Status s = submit(ctx, *request, caller, &result); !s.ok()) return s;
    job_to_proto(result.job, response->mutable_job());
    response->set_deduplicated(result.deduplicated);
    return Status::OK;
  }

  Status GetJob(ServerContext* ctx, const pb::GetJobRequest* request, pb::Job* response) override {
    const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
    Caller caller;
    if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
    if (Status s = check_job_id(request->job_id()); !s.ok()) return s;
    return store_guard(request->job_id(), [&] {
      auto job = scheduler_.get(request->job_id(), caller.owner);
      if (!job) return job_not_found(request->job_id(), caller.owner);
      job_to_proto(*job, response);
      return Status::OK;
    });
  }

  // A callback stream: an open watch holds no server thread, only its reactor (WatchReactor below).
  grpc::ServerWriteReactor<pb::JobEvent>* WatchJob(grpc::CallbackServerContext* ctx,
                                                   const pb::WatchJobRequest* request) override {
    Caller caller;
    if (Status s = authenticate(ctx, &caller, false); !s.ok()) return new FinishedWriter<pb::JobEvent>(s);
    if (Status s = check_job_id(request->job_id()); !s.ok()) return new FinishedWriter<pb::JobEvent>(s);
    std::unique_ptr<StreamLimiter::Slot> slot;
    if (Status s = open_stream(caller, &slot); !s.ok()) return new FinishedWriter<pb::JobEvent>(s);
    const Status found = store_guard(request->job_id(), [&] {
      return scheduler_.get(request->job_id(), caller.owner) ? Status::OK
                                                             : job_not_found(request->job_id(), caller.owner);
    });
    if (!found.ok()) return new FinishedWriter<pb::JobEvent>(found);
    return WatchReactor::start(*this, *request, caller.owner, std::move(slot));
  }

  Status CancelJob(ServerContext* ctx, const pb::CancelJobRequest* request, pb::Job* response) override {
    const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
    Caller caller;
    if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
    if (Status s = check_job_id(request->job_id()); !s.ok()) return s;
    return store_guard(request->job_id(), [&] {
      auto job = scheduler_.cancel(request->job_id(), caller.owner);
      if (!job) return job_not_found(request->job_id(), caller.owner);
      job_to_proto(*job, response);
      return Status::OK;
    });
  }

  Status ListJobs(ServerContext* ctx, const pb::ListJobsRequest* request, pb::ListJobsResponse* response) override {
    const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
    Caller caller;
    if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
    if (request->page_size() < 0 || request->page_size() > 1000) {
      return Status(StatusCode::INVALID_ARGUMENT, "page_size: must be in [0, 1000]");
    }
    const size_t page_size = request->page_size() == 0 ? 100 : static_cast<size_t>(request->page_size());
    size_t offset = 0;
    if (!request->page_token().empty() && !parse_page_token(request->page_token(), &offset)) {
      return Status(StatusCode::INVALID_ARGUMENT, "page_token: not a token returned by ListJobs");
    }
    std::set<int> states(request->states().begin(), request->states().end());
    std::vector<JobSnapshot> matching;
    std::vector<JobSnapshot> all;
    if (Status s = store_guard("", [&] {
          all = scheduler_.list(caller.owner);
          return Status::OK;
        });
        !s.ok()) {
      return s;
    }
    for (auto& job : all) {
      if (states.empty() || states.count(to_proto(job.state))) matching.push_back(std::move(job));
    }
    for (size_t i = offset; i < matching.size() && i < offset + page_size; ++i) {
      job_to_proto(matching[i], response->add_jobs());
    }
    if (offset + page_size < matching.size()) response->set_next_page_token(std::to_string(offset + page_size));
    return Status::OK;
  }

  Status DownloadResult(ServerContext* ctx, const pb::DownloadResultRequest* request,
                        grpc::ServerWriter<pb::ResultPart>* writer) override {
    const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
    Caller caller;
    if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
    if (Status s = check_job_id(request->job_id()); !s.ok()) return s;
    if (Status s = check_format(request->format(), config_.vae_available); !s.ok()) return s;
    std::unique_ptr<StreamLimiter::Slot> slot;
    if (Status s = open_stream(caller, &slot); !s.ok()) return s;
    const std::string& owner = caller.owner;
    std::optional<JobSnapshot> job;
    if (Status s = store_guard(request->job_id(), [&] {
          job = scheduler_.get(request->job_id(), owner);
          return job ? Status::OK : job_not_found(request->job_id(), caller.owner);
        });
        !s.ok()) {
      return s;
    }
    if (request->from_chunk() < 0 || request->from_chunk() >= job->chunk_count) {
      return Status(StatusCode::INVALID_ARGUMENT, "from_chunk: " + std::to_string(request->from_chunk()) +
                                                      " is outside [0, " + std::to_string(job->chunk_count) + ")");
    }
    for (int64_t chunk = request->from_chunk(); chunk < job->chunk_count; ++chunk) {
      while (true) {
        if (ctx->IsCancelled()) return Status(StatusCode::CANCELLED, "client cancelled the download");
        job = scheduler_.wait_chunks(request->job_id(), owner, chunk, Clock::now() + kPoll);
        if (!job) return job_not_found(request->job_id(), caller.owner);
        if (job->chunks_done > chunk) break;
        if (is_terminal(job->state)) {
          return Status(StatusCode::FAILED_PRECONDITION,
                        "job " + job->id + " ended " + job_state_name(job->state) + " before chunk " +
                            std::to_string(chunk) + " was produced" + (job->error.empty() ? "" : ": " + job->error));
        }
        if (request->no_wait()) return Status::OK;
      }
      if (Status s = send_chunk(ctx, *job, chunk, request->format(), writer, identity_slot); !s.ok()) return s;
    }
    return Status::OK;
  }

  Status Generate(ServerContext* ctx, const pb::GenerateRequest* request,
                  grpc::ServerWriter<pb::GenerateResponse>* writer) override {
    const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
    Caller caller;
    if (Status s = authenticate(ctx, &caller, true); !s.ok()) return s;
    if (Status s = check_format(request->format(), config_.vae_available); !s.ok()) return s;
    std::unique_ptr<StreamLimiter::Slot> slot;
    if (Status s = open_stream(caller, &slot); !s.ok()) return s;
    const std::string& owner = caller.owner;
    SubmitResult submitted;
    if (Status s = submit(ctx, request->job(), caller, &submitted); !s.ok()) return s;
    if (request->format() == pb::RESULT_FORMAT_MP4) want_video(submitted.job);
    const std::string id = submitted.job.id;
    uint64_t after = 0;
    int64_t sent_chunks = 0;
    while (true) {
      if (ctx->IsCancelled()) {
        scheduler_.cancel(id, owner);  // nobody is listening any more
        return Status(StatusCode::CANCELLED, "client cancelled: job " + id + " cancelled");
      }
      const EventBatch batch = scheduler_.wait_events(id, owner, after, Clock::now() + kPoll);
      if (!batch.found) return job_not_found(id, owner);
      for (const auto& event : batch.events) {
        after = event.sequence;
        if (request->skip_steps() && event.type == EventType::Step) continue;
        if (event.type == EventType::Finished) {
          // Every chunk's result goes out before the final event.
          if (Status s = flush_results(ctx, id, owner, request->format(), &sent_chunks, writer); !s.ok()) {
            return stop_generate(id, owner, s);
          }
        }
        pb::GenerateResponse message;
        event_to_proto(id, owner, event, message.mutable_event());
        if (!writer->Write(message)) return gone(id, owner);
        if (event.type == EventType::ChunkFinished) {
          if (Status s = flush_results(ctx, id, owner, request->format(), &sent_chunks, writer); !s.ok()) {
            return stop_generate(id, owner, s);
          }
        }
      }
      if (batch.finished) {
        const auto job = scheduler_.get(id, owner);
        if (!job || job->state == JobState::Succeeded) return Status::OK;
        return Status(to_code(job->error_kind), "job " + id + " " + job_state_name(job->state) + ": " + job->error);
      }
    }
  }

  Status GetServerInfo(ServerContext* ctx, const pb::GetServerInfoRequest*, pb::ServerInfo* response) override {
    const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
    Caller caller;
    if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
    response->set_version(config_.version);
    const ModelSummary& m = config_.summary;
    auto* model = response->mutable_model();
    model->set_source(m.source);
    model->set_dtype(m.dtype);
    model->set_parameter_count(m.parameter_count);
    model->set_num_layers(m.num_layers);
    model->set_num_attention_heads(m.num_attention_heads);
    model->set_attention_head_dim(m.attention_head_dim);
    model->set_text_dim(m.text_dim);
    model->set_ffn_dim(m.ffn_dim);
    model->set_in_channels(m.in_channels);
    model->set_out_channels(m.out_channels);
    for (int64_t p : m.patch_size) model->add_patch_size(p);
    model->set_inject_sample_info(m.inject_sample_info);
    model->set_num_frame_per_block(m.num_frame_per_block);
    for (const auto& lora : m.loras) {
      auto* l = model->add_loras();
      l->set_path(lora.path);
      l->set_scale(lora.scale);
      l->set_format(lora.format);
      l->set_parameters(lora.parameters);
      l->set_max_rank(static_cast<int32_t>(lora.max_rank));
    }
    const auto statuses = scheduler_.replicas();
    for (size_t i = 0; i < statuses.size(); ++i) {
      auto* r = response->add_replicas();
      r->set_name(statuses[i].name);
      r->set_loaded(statuses[i].loaded);
      r->set_healthy(statuses[i].healthy);
      r->set_busy(statuses[i].busy);
      r->set_chunks_run(statuses[i].chunks_run);
      r->set_failures(statuses[i].failures);
      r->set_error(statuses[i].error);
      if (i < config_.replicas.size()) {
        r->set_device(config_.replicas[i].device);
        r->set_threads(config_.replicas[i].threads);
      }
    }
    auto* limits = response->mutable_limits();
    limits->set_max_queue(static_cast<int32_t>(scheduler_.options().max_jobs));
    limits->set_max_frames(config_.limits.max_frames);
    limits->set_max_height(config_.limits.max_height);
    limits->set_max_width(config_.limits.max_width);
    limits->set_max_steps(config_.limits.max_steps);
    limits->set_max_text_tokens(config_.limits.max_text_tokens);
    limits->set_chunk_retries(scheduler_.options().chunk_retries);
    limits->set_max_request_bytes(config_.max_request_bytes);
    limits->set_max_chunk_tokens(config_.limits.max_chunk_tokens);
    limits->set_max_job_work(config_.limits.max_job_work);
    limits->set_max_chunks(config_.limits.max_chunks);
    response->set_vae_available(config_.vae_available);
    response->set_text_encoder_available(static_cast<bool>(config_.text_encoder));
    response->set_ready(scheduler_.ready());
    response->set_draining(scheduler_.draining());
    response->set_queued_jobs(static_cast<int32_t>(scheduler_.queued_jobs()));
    response->set_running_jobs(static_cast<int32_t>(scheduler_.running_jobs()));
    response->set_api_keys_required(config_.api_keys != nullptr && config_.api_keys->enabled());
    for (const char* kind : {"embeddings", "prompt_changes"}) response->add_conditionings(kind);
    if (config_.text_encoder) response->add_conditionings("text");
    if (config_.vae) {
      for (const char* kind : {"image", "last_image", "video"}) response->add_conditionings(kind);
    }
    return Status::OK;
  }

 private:
  // With API keys configured every call needs one; the job owner is the key's client name.
  Status authenticate(grpc::ServerContextBase* ctx, Caller* caller, bool submission) {
    *caller = Caller{};
    if (config_.api_keys == nullptr || !config_.api_keys->enabled()) {
      caller->client = peer_host(ctx->peer());
      return Status::OK;
    }
    const auto& metadata = ctx->client_metadata();
    auto value = [&](const char* name) -> std::optional<std::string> {
      auto it = metadata.find(name);
      if (it == metadata.end()) return std::nullopt;
      return std::string(it->second.data(), it->second.size());
    };
    const std::string key = presented_key(value("authorization"), value("x-api-key"));
    std::optional<ClientIdentity> identity;
    if (!key.empty()) identity = config_.api_keys->identify(key);
    if (!identity) {
      if (submission && config_.metrics) config_.metrics->rejected(kRejectUnauthenticated);
      const bool own_probe = ctx->peer().rfind("inproc", 0) == 0;  // UnaryProbe: only this process can call inproc
      if (!own_probe) {
        spdlog::warn("event=unauthenticated peer={} key_present={}", log_escape(ctx->peer()), !key.empty());
      }
      return Status(StatusCode::UNAUTHENTICATED,
                    key.empty() ? "missing API key: send metadata 'authorization: Bearer KEY' or 'x-api-key: KEY'"
                                : "invalid API key");
    }
    caller->owner = identity->name;
    caller->client = identity->name;
    caller->limits = identity->limits;
    return Status::OK;
  }

  // A place for one more long stream, or RESOURCE_EXHAUSTED for this stream only.
  Status open_stream(const Caller& caller, std::unique_ptr<StreamLimiter::Slot>* slot) {
    StreamLimiter::Refusal why = StreamLimiter::Refusal::None;
    *slot = streams_.acquire(caller.client, caller.limits.max_streams, &why);
    if (*slot) return Status::OK;
    const bool total = why == StreamLimiter::Refusal::Total;
    if (config_.metrics) config_.metrics->stream_rejected(total ? kStreamRejectTotal : kStreamRejectPerClient);
    const std::string message =
        total ? "too many open streams on this server (--max-streams " + std::to_string(streams_.max_total()) + ")"
              : "too many open streams for this client (cap " +
                    std::to_string(caller.limits.max_streams.value_or(streams_.max_per_client())) +
                    "): close a WatchJob, DownloadResult or Generate stream first";
    spdlog::info("event=stream_rejected client={} reason={}", log_escape(caller.client),
                 total ? kStreamRejectTotal : kStreamRejectPerClient);
    return Status(StatusCode::RESOURCE_EXHAUSTED, message);
  }

  Status reject(const char* reason, StatusCode code, const std::string& message) {
    if (config_.metrics && reason != nullptr) config_.metrics->rejected(reason);
    spdlog::info("event=rejected reason={} code={} message=\"{}\"", reason ? reason : "-", static_cast<int>(code),
                 log_escape(message));
    return Status(code, message);
  }

  Status reject_with_retry_hint(ServerContext* ctx, const char* reason, const std::string& what, double seconds) {
    const auto ms = static_cast<int64_t>(seconds * 1000.0);
    ctx->AddTrailingMetadata("retry-after-ms", std::to_string(ms));
    return reject(reason, StatusCode::RESOURCE_EXHAUSTED, what + "; retry after " + std::to_string(ms) + " ms");
  }

  Status admission_refused(ServerContext* ctx, const AdmissionError& e) {
    switch (e.reason()) {
      case AdmissionError::Reason::QueueFull:
        return reject_with_retry_hint(ctx, kRejectQueueFull, e.what(), e.retry_after_seconds());
      case AdmissionError::Reason::ClientQueueFull:
        return reject_with_retry_hint(ctx, kRejectClientLimit, e.what(), e.retry_after_seconds());
      case AdmissionError::Reason::Draining:
        return reject(kRejectDraining, StatusCode::UNAVAILABLE, e.what());
      case AdmissionError::Reason::Unavailable:
        return reject(nullptr, StatusCode::UNAVAILABLE, e.what());
      case AdmissionError::Reason::IdempotencyConflict:
        return reject(nullptr, StatusCode::ALREADY_EXISTS, e.what());
    }
    return Status(StatusCode::INTERNAL, e.what());
  }

  // NOT_FOUND, saying so when the job existed and retention dropped it.
  Status job_not_found(const std::string& id, const std::string& owner) const {
    if (auto reason = scheduler_.dropped(id, owner)) {
      return Status(StatusCode::NOT_FOUND, "job '" + log_escape(id, kMaxJobIdBytes) +
                                               "' was dropped by retention (" + *reason + ")");
    }
    return not_found(id);
  }

  // The request's fields the transport owns (the model's fields are ModelJob::create's).
  Status check_submission(const pb::SubmitJobRequest& request, const Caller& caller) {
    if (request.priority() < -10 || request.priority() > 10) {
      return reject(kRejectInvalidArgument, StatusCode::INVALID_ARGUMENT,
                    "priority: " + std::to_string(request.priority()) + " is outside [-10, 10]");
    }
    if (request.produce_mp4()) {
      if (Status s = check_format(pb::RESULT_FORMAT_MP4, config_.vae_available); !s.ok()) return s;
    }
    if (caller.limits.max_priority && request.priority() > *caller.limits.max_priority) {
      return reject(kRejectClientLimit, StatusCode::PERMISSION_DENIED,
                    "priority: " + std::to_string(request.priority()) + " is above this client's max_priority " +
                        std::to_string(*caller.limits.max_priority));
    }
    if (request.idempotency_key().size() > kMaxIdempotencyKeyBytes) {
      return reject(kRejectInvalidArgument, StatusCode::INVALID_ARGUMENT,
                    "idempotency_key: longer than " + std::to_string(kMaxIdempotencyKeyBytes) + " bytes");
    }
    return Status::OK;
  }

  // The text encoder behind the concurrency gate: over --max-concurrent-encodes, the submission is refused at once
  // (RESOURCE_EXHAUSTED with a retry hint) instead of queueing with a server thread held.
  struct EncoderBusy : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  TextEncoderFn gated_text_encoder() {
    if (!config_.text_encoder) return {};
    return [this](const std::vector<std::string>& texts) {
      auto pass = encodes_.try_enter();
      if (!pass) {
        throw EncoderBusy("text encoder busy: " + std::to_string(encodes_.limit()) +
                          " prompts being encoded (--max-concurrent-encodes)");
      }
      const auto start = Clock::now();
      std::vector<RawTensor> out = config_.text_encoder(texts);
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      last_encode_seconds_ = seconds;
      if (config_.metrics) config_.metrics->text_encoded(seconds);
      return out;
    };
  }

  Status submit(ServerContext* ctx, const pb::SubmitJobRequest& request, const Caller& caller, SubmitResult* result) {
    if (scheduler_.draining()) {
      return reject(kRejectDraining, StatusCode::UNAVAILABLE,
                    "server is draining (shutting down): submit to another replica");
    }
    if (Status s = check_submission(request, caller); !s.ok()) return s;
    std::optional<Clock::time_point> deadline;
    if (Status s = job_deadline(request, &deadline); !s.ok()) {
      return reject(kRejectInvalidArgument, s.error_code(), s.error_message());
    }

    JobSpec spec;
    spec.owner = caller.owner;
    spec.client = caller.client;
    spec.client_max_jobs = caller.limits.max_jobs.value_or(0);
    spec.client_weight = caller.limits.weight.value_or(1);
    spec.priority = request.priority();
    spec.deadline = deadline;
    spec.idempotency_key = request.idempotency_key();
    std::shared_ptr<ModelJob> job;
    try {
      // Admission first: a job that would be refused costs no text encoding and no image / video decoding.
      scheduler_.check_admission(spec);
      // Decoding pixels holds up to --max-frames frames per request: bounded like text encodes, refused when full.
      const pb::JobSpec& wanted = request.spec();
      std::unique_ptr<ConcurrencyGate::Pass> decode_pass;
      if (wanted.has_image() || wanted.has_last_image() || wanted.has_video()) {
        decode_pass = decodes_.try_enter();
        if (!decode_pass) {
          return reject_with_retry_hint(ctx, kRejectEncoderBusy,
                                        "pixel decoder busy: " + std::to_string(decodes_.limit()) +
                                            " images / videos being decoded (--max-concurrent-encodes)",
                                        0.1);
        }
      }
      job = ModelJob::create(request_from_proto(request.spec()), config_.model, config_.limits, random_seed(),
                             gated_text_encoder(), config_.vae, vae_encode_metric(config_.metrics));
    } catch (const AdmissionError& e) {
      return admission_refused(ctx, e);
    } catch (const EncoderBusy& e) {
      return reject_with_retry_hint(ctx, kRejectEncoderBusy, e.what(), std::max(0.1, last_encode_seconds_.load()));
    } catch (const ValidationError& e) {
      return reject(kRejectInvalidArgument, StatusCode::INVALID_ARGUMENT, e.what());
    } catch (const PreconditionError& e) {
      return reject(nullptr, StatusCode::FAILED_PRECONDITION, e.what());
    } catch (const std::exception& e) {
      spdlog::error("event=submit_failed error=\"{}\"", log_escape(e.what()));
      return Status(StatusCode::INTERNAL, std::string("could not prepare the job: ") + e.what());
    }

    spec.chunk_work = job->chunk_work();
    spec.chunk_rows = job->chunk_rows();
    spec.fingerprint = job->fingerprint() ^ (static_cast<uint64_t>(request.priority() + 11) * 0x9E3779B97F4A7C15ULL) ^
                       deadline_fingerprint(request);
    spec.fingerprint_v2 = submission_fingerprint_v2(*job, request);
    spec.payload = job;
    spec.description = job->description();
    spec.durable_request = durable_request(request, *job);
    try {
      *result = scheduler_.submit(std::move(spec));
    } catch (const AdmissionError& e) {
      return admission_refused(ctx, e);
    }
    if (request.produce_mp4()) want_video(result->job);
    if (!result->deduplicated) {
      const ResolvedParams& p = job->params();
      spdlog::info("job={} event=accepted frames={} size={}x{} steps={} guidance={} chunks={} seed={} priority={}",
                   result->job.id, p.num_frames, p.width, p.height, p.num_inference_steps, p.guidance_scale,
                   job->chunk_count(), p.seed, request.priority());
      for (const auto& warning : job->warnings()) {
        spdlog::warn("job={} event=plan_warning {}", result->job.id, log_escape(warning, 500));
      }
    }
    return Status::OK;
  }

  void job_to_proto(const JobSnapshot& s, pb::Job* out) const {
    out->set_job_id(s.id);
    out->set_state(to_proto(s.state));
    out->set_priority(s.priority);
    *out->mutable_created_at() = to_timestamp(s.created);
    if (s.started) *out->mutable_started_at() = to_timestamp(*s.started);
    if (s.finished) *out->mutable_finished_at() = to_timestamp(*s.finished);
    if (s.deadline) *out->mutable_deadline() = to_timestamp(*s.deadline);
    out->set_chunks_total(static_cast<int32_t>(s.chunk_count));
    out->set_chunks_done(static_cast<int32_t>(s.chunks_done));
    work_to_proto(s.work, out->mutable_transformer_work());
    out->set_queue_position(static_cast<int32_t>(s.queue_position));
    out->set_estimated_start_seconds(s.eta_seconds);
    out->set_progress(s.progress);
    for (const auto& r : s.chunk_replicas) out->add_chunk_replicas(r);
    out->set_handoffs(s.handoffs);
    out->set_retries(s.retries);
    if (s.error_kind != ErrorKind::None) {
      out->mutable_error()->set_code(static_cast<int32_t>(to_code(s.error_kind)));
      out->mutable_error()->set_message(s.error);
    }
    out->set_idempotency_key(s.idempotency_key);
    if (const JobDescription* job = s.description.get()) {
      resolved_params_to_proto(job->params, out->mutable_params());
      for (int64_t d : job->latent_shape) out->add_latent_shape(d);
      out->set_num_frames(static_cast<int32_t>(job->params.num_frames));
      out->set_video_available(config_.vae_available);
    }
  }

  void event_to_proto(const std::string& id, const std::string& owner, const JobEvent& e, pb::JobEvent* out) const {
    out->set_job_id(id);
    out->set_sequence(e.sequence);
    *out->mutable_time() = to_timestamp(e.time);
    switch (e.type) {
      case EventType::Queued: {
        auto* q = out->mutable_queued();
        q->set_position(static_cast<int32_t>(e.position));
        q->set_estimated_start_seconds(e.eta_seconds);
        break;
      }
      case EventType::ChunkStarted: {
        auto* c = out->mutable_chunk_started();
        c->set_chunk_index(static_cast<int32_t>(e.chunk));
        c->set_chunk_count(static_cast<int32_t>(e.chunk_count));
        c->set_replica(e.replica);
        c->set_handoff(e.handoff);
        c->set_attempt(e.attempt);
        break;
      }
      case EventType::Step: {
        auto* s = out->mutable_step();
        s->set_chunk_index(static_cast<int32_t>(e.chunk));
        s->set_step(static_cast<int32_t>(e.step));
        s->set_steps(static_cast<int32_t>(e.steps));
        s->set_progress(e.progress);
        break;
      }
      case EventType::ChunkFinished: {
        auto* c = out->mutable_chunk_finished();
        c->set_chunk_index(static_cast<int32_t>(e.chunk));
        c->set_replica(e.replica);
        c->set_seconds(e.seconds);
        work_to_proto(e.work, c->mutable_transformer_work());
        if (auto job = scheduler_.get(id, owner)) {
          const ChunkLayout layout = chunk_layout(*job, e.chunk);
          c->set_latent_frame_begin(static_cast<int32_t>(layout.latent_begin));
          c->set_latent_frame_end(static_cast<int32_t>(layout.latent_end));
        }
        break;
      }
      case EventType::ChunkRetry: {
        auto* r = out->mutable_chunk_retry();
        r->set_chunk_index(static_cast<int32_t>(e.chunk));
        r->set_replica(e.replica);
        r->set_error(e.message);
        r->set_attempt(e.attempt);
        break;
      }
      case EventType::Finished: {
        if (auto job = scheduler_.get(id, owner)) job_to_proto(*job, out->mutable_finished()->mutable_job());
        break;
      }
    }
  }

  static pb::ResultPart* identity_slot(pb::ResultPart& m) { return &m; }
  static pb::ResultPart* generate_slot(pb::GenerateResponse& m) { return m.mutable_result(); }

  static ChunkLayout chunk_layout(const JobSnapshot& job, int64_t chunk) {
    const JobDescription* d = job.description.get();
    if (d == nullptr || chunk < 0 || chunk >= static_cast<int64_t>(d->chunks.size())) return {};
    return d->chunks[static_cast<size_t>(chunk)];
  }

  // One chunk's blob as parts of at most kPartBytes.
  template <typename Message>
  bool write_blob(const JobSnapshot& job, int64_t chunk, pb::ResultFormat format, const std::string& bytes,
                  grpc::ServerWriter<Message>* writer, pb::ResultPart* (*slot)(Message&)) {
    const ChunkLayout layout = chunk_layout(job, chunk);
    const int64_t begin = layout.latent_begin, end = layout.latent_end;
    const size_t total = bytes.size();
    size_t offset = 0;
    do {
      const size_t n = std::min(kPartBytes, total - offset);
      Message message;
      pb::ResultPart* part = slot(message);
      part->set_job_id(job.id);
      part->set_chunk_index(static_cast<int32_t>(chunk));
      part->set_chunk_count(static_cast<int32_t>(job.chunk_count));
      part->set_format(format);
      part->set_offset(offset);
      part->set_chunk_bytes(total);
      part->set_data(bytes.data() + offset, n);
      part->set_last_part(offset + n == total);
      part->set_latent_frame_begin(static_cast<int32_t>(begin));
      part->set_latent_frame_end(static_cast<int32_t>(end));
      if (!writer->Write(message)) return false;
      offset += n;
    } while (offset < total);
    return true;
  }

  Status store_unreadable(const std::string& id, const StoreError& e) {
    spdlog::error("job={} event=store_read_failed error=\"{}\"", id, log_escape(e.what()));
    return Status(StatusCode::UNAVAILABLE, std::string("the job store could not be read, try again: ") + e.what());
  }

  // A shared store (PostgreSQL) may be unreachable for a while: the call answers UNAVAILABLE, never NOT_FOUND.
  template <typename Call>
  Status store_guard(const std::string& id, Call&& call) {
    try {
      return call();
    } catch (const StoreError& e) {
      return store_unreadable(id, e);
    }
  }

  // Chunk `chunk`'s committed latents, from the job store (the job has chunks_done > chunk).
  Status load_latents(const JobSnapshot& job, int64_t chunk, std::string* bytes) {
    std::optional<std::string> stored;
    try {
      stored = scheduler_.chunk_result(job.id, job.owner, chunk);
    } catch (const StoreError& e) {
      return store_unreadable(job.id, e);
    }
    if (stored) {
      *bytes = std::move(*stored);
      return Status::OK;
    }
    if (!scheduler_.get(job.id, job.owner)) return job_not_found(job.id, job.owner);  // dropped meanwhile
    return Status(StatusCode::INTERNAL, "job " + job.id + ": chunk " + std::to_string(chunk) +
                                            " is done but its result is not in the job store");
  }

  // Chunk `chunk`'s MP4 segment: from the job store when it was made before (even before a restart), else made now
  // by the VAE worker (it follows the latents by one decode), which stores it.
  Status load_video(ServerContext* ctx, const std::string& id, const std::string& owner, int64_t chunk,
                    std::string* bytes) {
    if (!config_.want_video || !config_.wait_video) {
      return Status(StatusCode::FAILED_PRECONDITION, "format: MP4 needs a server started with --vae");
    }
    bool made = false;  // the worker says the segment was stored (or that it has nothing to make)
    while (!ctx->IsCancelled()) {
      const auto job = scheduler_.get(id, owner);
      if (!job) return job_not_found(id, owner);
      if (!job->description) {  // its latents still download
        return Status(StatusCode::FAILED_PRECONDITION,
                      "job " + id + ": no MP4 can be made for it: its request could not be read back after a restart");
      }
      std::optional<std::string> stored;
      try {
        stored = scheduler_.segment(id, owner, chunk);
      } catch (const StoreError& e) {
        return store_unreadable(id, e);
      }
      if (stored) {
        *bytes = std::move(*stored);
        return Status::OK;
      }
      if (made) {  // asking again would decode again, and again
        return Status(StatusCode::INTERNAL, "job " + id + ": the MP4 of chunk " + std::to_string(chunk) +
                                                " was made but is not in the job store");
      }
      config_.want_video(*job);  // a download that misses starts the job's decode (no-op when it runs already)
      const SegmentWait wait = config_.wait_video(id, chunk, Clock::now() + kPoll);
      if (!wait.error.empty()) return Status(StatusCode::INTERNAL, wait.error);
      made = !wait.making;
    }
    return Status(StatusCode::CANCELLED, "client cancelled the download");
  }

  // One chunk's result in `format`. CANCELLED: the client went away.
  template <typename Message>
  Status send_chunk(ServerContext* ctx, const JobSnapshot& job, int64_t chunk, pb::ResultFormat format,
                    grpc::ServerWriter<Message>* writer, pb::ResultPart* (*slot)(Message&)) {
    std::string bytes;
    const bool mp4 = format == pb::RESULT_FORMAT_MP4;
    if (Status s = mp4 ? load_video(ctx, job.id, job.owner, chunk, &bytes) : load_latents(job, chunk, &bytes);
        !s.ok()) {
      return s;
    }
    if (!write_blob(job, chunk, mp4 ? pb::RESULT_FORMAT_MP4 : pb::RESULT_FORMAT_LATENTS, bytes, writer, slot)) {
      return Status(StatusCode::CANCELLED, "client went away");
    }
    return Status::OK;
  }

  // Sends every chunk result not sent yet. CANCELLED: the client went away; INTERNAL: a chunk's MP4 could not be
  // made (a server fault, not the client's doing).
  Status flush_results(ServerContext* ctx, const std::string& id, const std::string& owner, pb::ResultFormat format,
                       int64_t* sent, grpc::ServerWriter<pb::GenerateResponse>* writer) {
    const auto job = scheduler_.get(id, owner);
    if (!job) return Status::OK;
    while (*sent < job->chunks_done) {
      if (Status s = send_chunk(ctx, *job, *sent, format, writer, generate_slot); !s.ok()) return s;
      ++*sent;
    }
    return Status::OK;
  }

  // Generate ends early: nobody will read the job's results, so it is cancelled; the status says why.
  Status stop_generate(const std::string& id, const std::string& owner, const Status& why) {
    scheduler_.cancel(id, owner);
    if (why.error_code() == StatusCode::CANCELLED) {
      return Status(StatusCode::CANCELLED, "client went away: job " + id + " cancelled");
    }
    spdlog::error("job={} event=generate_failed code={} error=\"{}\"", id, static_cast<int>(why.error_code()),
                  log_escape(why.error_message()));
    return Status(why.error_code(), "job " + id + ": " + why.error_message());
  }

  // MP4 is made on demand only (issue 12, item 6): a job asks at submit, or its first MP4 download does.
  void want_video(const JobSnapshot& job) {
    if (config_.want_video && job.description) config_.want_video(job);
  }

  Status gone(const std::string& id, const std::string& owner) {
    return stop_generate(id, owner, Status(StatusCode::CANCELLED, ""));
  }

  JobQueue& scheduler_;
  ServiceConfig config_;
  StreamLimiter streams_;
  ConcurrencyGate encodes_;  // text prompts being encoded
  ConcurrencyGate decodes_;  // request images / videos being decoded
  std::atomic<double> last_encode_seconds_{0.5};
  StreamPump pump_;  // last: stopped first, before what its tasks use
};

struct WatchReactor::Core : std::enable_shared_from_this<WatchReactor::Core> {
  VideoServiceImpl& service;
  WatchReactor* reactor = nullptr;  // valid until `finished`
  std::string id, owner;
  bool skip_steps = false;
  std::unique_ptr<StreamLimiter::Slot> slot;
  uint64_t token = 0;
  std::atomic<bool> queued{false};  // a pump task is pending: notifications in between need no other

  std::mutex mu;  // guards what follows
  uint64_t after = 0;
  std::deque<pb::JobEvent> pending;
  pb::JobEvent writing;  // the message of the write in flight
  bool in_flight = false, cancelled = false, job_done = false, finished = false;

  Core(VideoServiceImpl& s, const pb::WatchJobRequest& request, std::string job_owner)
      : service(s),
        id(request.job_id()),
        owner(std::move(job_owner)),
        skip_steps(request.skip_steps()),
        after(request.after_sequence()) {}

  // From the scheduler, its lock held: only schedules a pump.
  void notify() {
    if (queued.exchange(true)) return;
    service.pump_.post([self = shared_from_this()] {
      self->queued = false;
      self->pump();
    });
  }

  // Reads new events when nothing is queued, then starts the next write or the finish. Never holds `mu` while
  // calling into gRPC (a reaction may run inline).
  void pump() {
    std::optional<Status> finish;
    bool write = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (finished || in_flight) return;
      if (cancelled) {
        finish = Status(StatusCode::CANCELLED, "client cancelled the watch");
      } else {
        if (pending.empty() && !job_done) read_events_locked(&finish);
        if (!finish && !pending.empty()) {
          writing = std::move(pending.front());
          pending.pop_front();
          in_flight = write = true;
        } else if (!finish && job_done) {
          finish = Status::OK;
        }
      }
      if (finish) finished = true;
    }
    if (write) reactor->StartWrite(&writing);
    if (finish) reactor->Finish(*finish);
  }

  void read_events_locked(std::optional<Status>* finish) {
    const EventBatch batch = service.scheduler_.wait_events(id, owner, after, Clock::now());
    if (!batch.found) {
      *finish = service.job_not_found(id, owner);
      return;
    }
    for (const auto& event : batch.events) {
      after = event.sequence;
      if (skip_steps && event.type == EventType::Step) continue;
      pending.emplace_back();
      service.event_to_proto(id, owner, event, &pending.back());
    }
    job_done = batch.finished;
  }
};

WatchReactor* WatchReactor::start(VideoServiceImpl& service, const pb::WatchJobRequest& request,
                                  const std::string& owner, std::unique_ptr<StreamLimiter::Slot> slot) {
  auto core = std::make_shared<Core>(service, request, owner);
  core->slot = std::move(slot);
  auto* reactor = new WatchReactor(core);
  core->reactor = reactor;
  core->token = service.scheduler_.subscribe(core->id, owner, [weak = std::weak_ptr<Core>(core)] {
    if (auto c = weak.lock()) c->notify();
  });
  core->pump();  // the replay (or NOT_FOUND when the job went away meanwhile)
  return reactor;
}

void WatchReactor::OnWriteDone(bool ok) {
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->in_flight = false;
    if (!ok) core_->cancelled = true;  // the client went away
  }
  core_->pump();
}

void WatchReactor::OnCancel() {
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->cancelled = true;
  }
  core_->pump();
}

void WatchReactor::OnDone() {
  core_->service.scheduler_.unsubscribe(core_->id, core_->token);
  core_->slot.reset();  // the stream's place is free again
  delete this;
}

}  // namespace

RestoredJob restore_job(const StoredJob& stored, std::vector<StoredChunk> chunks, const ServiceConfig& config) {
  RestoredJob r;
  r.stored = stored;
  r.stored.request.clear();
  const std::string& id = stored.id;
  try {
    pb::SubmitJobRequest request;
    if (!request.ParseFromString(stored.request)) throw std::runtime_error("the stored request is unreadable");
    // Requests are stored with embeddings, never text: no text is encoded again. (Only a request stored by an older
    // server may still hold prompt changes as text; they are encoded with this server's encoder.)
    auto job = ModelJob::create(request_from_proto(request.spec()), config.model, config.limits, 0,
                                config.text_encoder, config.vae, vae_encode_metric(config.metrics));
    std::vector<std::string> bytes;
    for (auto& chunk : chunks) bytes.push_back(std::move(chunk.bytes));
    job->restore_results(bytes);  // the next chunk's tail; the results stay in the store
    r.chunk_work = job->chunk_work();
    r.chunk_rows = job->chunk_rows();
    if (static_cast<int64_t>(r.chunk_work.size()) != stored.chunk_count) {
      throw std::runtime_error("the request now plans " + std::to_string(r.chunk_work.size()) + " chunks, it had " +
                               std::to_string(stored.chunk_count));
    }
    r.description = job->description();
    r.payload = std::move(job);
  } catch (const std::exception& e) {
    r.error = e.what();
    r.payload.reset();
    r.description.reset();
    spdlog::error("job={} event=restore_failed error=\"{}\"", id, log_escape(e.what()));
  }
  for (auto& chunk : chunks) chunk.bytes.clear();  // read back from the store when asked for
  r.chunks = std::move(chunks);
  return r;
}

std::unique_ptr<grpc::Service> make_video_service(JobQueue& jobs, ServiceConfig config) {
  return std::make_unique<VideoServiceImpl>(jobs, std::move(config));
}

namespace {

// gRPC answers a request message it cannot deserialize with INTERNAL and the parser's (empty, for proto3) error
// string before any handler runs. Our handlers never send INTERNAL without a message, so that pair means "bad input".
class MalformedRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const Status status = methods->GetSendStatus();
      if (status.error_code() == StatusCode::INTERNAL && status.error_message().empty()) {
        methods->ModifySendStatus(Status(StatusCode::INVALID_ARGUMENT,
                                         "request: not a valid message of this method (malformed protobuf, or a "
                                         "string field that is not UTF-8)"));
      }
    }
    methods->Proceed();
  }
};

class MalformedRequestInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo*) override {
    return new MalformedRequestInterceptor();
  }
};

// grpc_server_* metrics per RPC (Metrics::rpc_started / rpc_handled): its status as the client gets it (after the
// malformed-request rewrite), timed from the interceptor's creation at the call's start. A call that ends without
// sending a status (the client went away) counts as Canceled.
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(Metrics& metrics, std::string type, std::string service, std::string method)
      : metrics_(metrics), type_(std::move(type)), service_(std::move(service)), method_(std::move(method)) {
    metrics_.rpc_started(type_, service_, method_);
  }
  ~RpcMetricsInterceptor() override {
    if (!handled_) handled(static_cast<int>(StatusCode::CANCELLED));
  }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (!handled_ && methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      handled(static_cast<int>(methods->GetSendStatus().error_code()));
    }
    methods->Proceed();
  }

 private:
  void handled(int code) {
    handled_ = true;
    metrics_.rpc_handled(type_, service_, method_, code,
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  Metrics& metrics_;
  std::string type_, service_, method_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  bool handled_ = false;
};

class RpcMetricsInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsInterceptorFactory(Metrics& metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    using Type = grpc::experimental::ServerRpcInfo::Type;
    const char* type = "unary";
    switch (info->type()) {
      case Type::CLIENT_STREAMING:
        type = "client_stream";
        break;
      case Type::SERVER_STREAMING:
        type = "server_stream";
        break;
      case Type::BIDI_STREAMING:
        type = "bidi_stream";
        break;
      default:
        break;
    }
    // "/package.Service/Method"; anything else (or an unbounded variety: Metrics caps the series) is "unknown".
    const std::string name = info->method() != nullptr ? info->method() : "";
    const size_t slash = name.find('/', 1);
    if (name.size() > 128 || name.empty() || name[0] != '/' || slash == std::string::npos) {
      return new RpcMetricsInterceptor(metrics_, type, "unknown", "unknown");
    }
    return new RpcMetricsInterceptor(metrics_, type, name.substr(1, slash - 1), name.substr(slash + 1));
  }

 private:
  Metrics& metrics_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> make_malformed_request_interceptor() {
  return std::make_unique<MalformedRequestInterceptorFactory>();
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> make_rpc_metrics_interceptor(Metrics& metrics) {
  return std::make_unique<RpcMetricsInterceptorFactory>(metrics);
}

struct UnaryProbe::Impl {
  std::unique_ptr<pb::VideoService::Stub> stub;
  std::chrono::milliseconds period;
  Clock::time_point next{};
  bool answered = true;
};

UnaryProbe::UnaryProbe(grpc::Server& server, std::chrono::milliseconds period) : impl_(std::make_unique<Impl>()) {
  impl_->stub = pb::VideoService::NewStub(server.InProcessChannel(grpc::ChannelArguments()));
  impl_->period = period;
}

UnaryProbe::~UnaryProbe() = default;

bool UnaryProbe::answered() {
  const auto now = Clock::now();
  if (now < impl_->next) return impl_->answered;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + impl_->period);
  pb::ServerInfo info;
  const Status status = impl_->stub->GetServerInfo(&ctx, pb::GetServerInfoRequest(), &info);
  const bool answered = status.ok() || status.error_code() == StatusCode::UNAUTHENTICATED;
  if (answered != impl_->answered) {
    spdlog::warn("event=unary_probe answered={} status=\"{}\"", answered, log_escape(status.error_message()));
  }
  impl_->answered = answered;
  impl_->next = Clock::now() + impl_->period;
  return answered;
}

}  // namespace skyreels::server
