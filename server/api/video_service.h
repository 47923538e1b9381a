// skyreels.v1.VideoService: the class every RPC family's file (rpc_*.cpp) defines its methods of, and the pieces
// they share (the caller, refused streams, the pump that runs scheduler notifications). Internal to api/.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "server/api/codec.h"

namespace skyreels::server::api {

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

// Runs the work that scheduler notifications and stream reactions ask for on one thread of its own: notifications
// arrive with the scheduler's lock held, and the work takes that lock again; reactions run on gRPC's callback
// threads, which also answer the health checks, and the work may wait for the store.
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
// Its messages are bytes (a raw method): a preview's image is the hub's own PNG, referred to by every watcher's write
// rather than copied into it (preview_message), however slowly the watcher's client reads.
class WatchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
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

class VideoServiceImpl final : public pb::VideoService::WithRawCallbackMethod_WatchJob<pb::VideoService::Service> {
 public:
  friend class WatchReactor;

  // The three seams of the queue it uses (job_queue.h), named apart so that each call says which it is.
  VideoServiceImpl(JobCommands& commands, JobReads& reads, const QueueLifecycle& lifecycle, ServiceConfig config);

  Status SubmitJob(ServerContext* ctx, const pb::SubmitJobRequest* request, pb::SubmitJobResponse* response) override;

  Status GetJob(ServerContext* ctx, const pb::GetJobRequest* request, pb::Job* response) override;

  // A callback stream: an open watch holds no server thread, only its reactor (WatchReactor above). Raw: the request
  // is a WatchJobRequest's bytes, each message a JobEvent's.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* WatchJob(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request) override;

  Status CancelJob(ServerContext* ctx, const pb::CancelJobRequest* request, pb::Job* response) override;

  Status DeleteJob(ServerContext* ctx, const pb::DeleteJobRequest* request, pb::Job* response) override;

  Status ListJobs(ServerContext* ctx, const pb::ListJobsRequest* request, pb::ListJobsResponse* response) override;

  Status DownloadResult(ServerContext* ctx, const pb::DownloadResultRequest* request,
                        grpc::ServerWriter<pb::ResultPart>* writer) override;

  Status Generate(ServerContext* ctx, const pb::GenerateRequest* request,
                  grpc::ServerWriter<pb::GenerateResponse>* writer) override;

  Status GetServerInfo(ServerContext* ctx, const pb::GetServerInfoRequest*, pb::ServerInfo* response) override;

 private:
  // With API keys configured every call needs one; the job owner is the key's client name.
  Status authenticate(grpc::ServerContextBase* ctx, Caller* caller, bool submission);

  // A place for one more long stream, or RESOURCE_EXHAUSTED for this stream only.
  Status open_stream(const Caller& caller, std::unique_ptr<StreamLimiter::Slot>* slot);

  Status reject(const char* reason, StatusCode code, const std::string& message);

  Status reject_with_retry_hint(ServerContext* ctx, const char* reason, const std::string& what, double seconds);

  Status admission_refused(ServerContext* ctx, const AdmissionError& e);

  // NOT_FOUND, saying so when the job existed and retention dropped it.
  Status job_not_found(const std::string& id, const std::string& owner) const;

  // The request's fields the transport owns (the model's fields are ModelJob::create's).
  Status check_submission(const pb::SubmitJobRequest& request, const Caller& caller);

  // The text encoder behind the concurrency gate: over --max-concurrent-encodes, the submission is refused at once
  // (RESOURCE_EXHAUSTED with a retry hint) instead of queueing with a server thread held.
  struct EncoderBusy : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  TextEncoderFn gated_text_encoder();

  Status submit(ServerContext* ctx, const pb::SubmitJobRequest& request, const Caller& caller, SubmitResult* result);

  void job_to_proto(const JobSnapshot& s, pb::Job* out) const;

  void event_to_proto(const std::string& id, const std::string& owner, const JobEvent& e, pb::JobEvent* out) const;

  static pb::ResultPart* identity_slot(pb::ResultPart& m);
  static pb::ResultPart* generate_slot(pb::GenerateResponse& m);

  static ChunkLayout chunk_layout(const JobSnapshot& job, int64_t chunk);

  // One chunk's blob as parts of at most kPartBytes, from byte `from` on, each part read from the job store when it
  // is written (a slow reader holds one part, whatever the blob's size); sizes_only: one part without data.
  template <typename Message>
  Status write_blob(const JobSnapshot& job, int64_t chunk, pb::ResultFormat format, int64_t total, int64_t from,
                    bool sizes_only, grpc::ServerWriter<Message>* writer, pb::ResultPart* (*slot)(Message&)) {
    const ChunkLayout layout = chunk_layout(job, chunk);
    const JobStore::Blob kind = format == pb::RESULT_FORMAT_MP4 ? JobStore::Blob::segment : JobStore::Blob::chunk;
    int64_t offset = from;
    do {
      const int64_t n = sizes_only ? 0 : std::min(static_cast<int64_t>(kPartBytes), total - offset);
      Message message;
      pb::ResultPart* part = slot(message);
      part->set_job_id(job.id);
      part->set_chunk_index(static_cast<int32_t>(chunk));
      part->set_chunk_count(static_cast<int32_t>(job.chunk_count));
      part->set_format(format);
      part->set_offset(static_cast<uint64_t>(offset));
      part->set_chunk_bytes(static_cast<uint64_t>(total));
      if (n > 0) {
        std::optional<std::string> piece;
        try {
          piece = reads_.result_range(job.id, job.owner, kind, chunk, offset, n);
        } catch (const StoreError& e) {
          return store_unreadable(job.id, e);
        }
        if (!piece) return job_not_found(job.id, job.owner);  // dropped meanwhile
        if (static_cast<int64_t>(piece->size()) != n) {
          return Status(StatusCode::INTERNAL, "job " + job.id + ": chunk " + std::to_string(chunk) +
                                                  "'s result changed size while it was read");
        }
        part->set_data(std::move(*piece));
      }
      part->set_last_part(sizes_only || offset + n == total);
      part->set_latent_frame_begin(static_cast<int32_t>(layout.latent_begin));
      part->set_latent_frame_end(static_cast<int32_t>(layout.latent_end));
      part->set_pixel_frame_begin(static_cast<int32_t>(layout.pixel_begin));
      part->set_pixel_frame_end(static_cast<int32_t>(layout.pixel_end));
      if (!writer->Write(message)) return Status(StatusCode::CANCELLED, "client went away");
      offset += n;
    } while (!sizes_only && offset < total);
    return Status::OK;
  }

  Status store_unreadable(const std::string& id, const StoreError& e);

  // A shared store (PostgreSQL) may be unreachable for a while: the call answers UNAVAILABLE, never NOT_FOUND.
  template <typename Call>
  Status store_guard(const std::string& id, Call&& call) {
    try {
      return call();
    } catch (const StoreError& e) {
      return store_unreadable(id, e);
    }
  }

  // The size of chunk `chunk`'s committed latents in the job store (the job has chunks_done > chunk).
  Status latents_size(const JobSnapshot& job, int64_t chunk, int64_t* size);

  // The size of chunk `chunk`'s MP4 segment: stored when it was made before (even before a restart), else made now by
  // the VAE worker (it follows the latents by one decode), which stores it.
  Status video_size(ServerContext* ctx, const std::string& id, const std::string& owner, int64_t chunk,
                    int64_t* size);

  // One chunk's result in `format`, from byte `from` of it on (sizes_only: its size only). CANCELLED: the client went
  // away.
  template <typename Message>
  Status send_chunk(ServerContext* ctx, const JobSnapshot& job, int64_t chunk, pb::ResultFormat format,
                    grpc::ServerWriter<Message>* writer, pb::ResultPart* (*slot)(Message&), int64_t from = 0,
                    bool sizes_only = false) {
    int64_t size = 0;
    const bool mp4 = format == pb::RESULT_FORMAT_MP4;
    if (Status s = mp4 ? video_size(ctx, job.id, job.owner, chunk, &size) : latents_size(job, chunk, &size); !s.ok()) {
      return s;
    }
    if (from < 0 || (from > 0 && from >= size)) {
      return Status(StatusCode::INVALID_ARGUMENT, "from_offset: " + std::to_string(from) + " is not within chunk " +
                                                      std::to_string(chunk) + "'s " + std::to_string(size) + " bytes");
    }
    return write_blob(job, chunk, mp4 ? pb::RESULT_FORMAT_MP4 : pb::RESULT_FORMAT_LATENTS, size, from, sizes_only,
                      writer, slot);
  }

  // Sends every chunk result not sent yet. CANCELLED: the client went away; INTERNAL: a chunk's MP4 could not be
  // made (a server fault, not the client's doing).
  Status flush_results(ServerContext* ctx, const std::string& id, const std::string& owner, pb::ResultFormat format,
                       int64_t* sent, grpc::ServerWriter<pb::GenerateResponse>* writer);

  // Generate ends early: nobody will read the job's results, so it is cancelled; the status says why.
  Status stop_generate(const std::string& id, const std::string& owner, const Status& why);

  // MP4 is made on demand only (issue 12, item 6): a job asks at submit, or its first MP4 download does.
  void want_video(const JobSnapshot& job);

  Status gone(const std::string& id, const std::string& owner);

  JobCommands& commands_;         // submit, cancel, delete
  JobReads& reads_;               // jobs, events, previews, results
  const QueueLifecycle& lifecycle_;  // readiness, drain, replicas (GetServerInfo)
  ServiceConfig config_;
  IdleTrimmer idle_trimmer_;  // before streams_: it outlives their last release
  StreamLimiter streams_;
  ConcurrencyGate encodes_;  // text prompts being encoded
  ConcurrencyGate decodes_;  // request images / videos being decoded
  std::atomic<double> last_encode_seconds_{0.5};
  StreamPump pump_;  // last: stopped first, before what its tasks use
};

}  // namespace skyreels::server::api
