#include "server/api/video_service.h"

namespace skyreels::server::api {

Status VideoServiceImpl::DownloadResult(ServerContext* ctx, const pb::DownloadResultRequest* request,
                      grpc::ServerWriter<pb::ResultPart>* writer) {
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
        job = reads_.get(request->job_id(), owner);
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
      job = reads_.wait_chunks(request->job_id(), owner, chunk, Clock::now() + kPoll);
      if (!job) return job_not_found(request->job_id(), caller.owner);
      if (job->chunks_done > chunk) break;
      if (is_terminal(job->state)) {
        return Status(StatusCode::FAILED_PRECONDITION,
                      "job " + job->id + " ended " + job_state_name(job->state) + " before chunk " +
                          std::to_string(chunk) + " was produced" + (job->error.empty() ? "" : ": " + job->error));
      }
      if (request->no_wait()) return Status::OK;
    }
    const int64_t from = chunk == request->from_chunk() ? static_cast<int64_t>(request->from_offset()) : 0;
    if (Status s = send_chunk(ctx, *job, chunk, request->format(), writer, identity_slot, from, request->sizes_only());
        !s.ok()) {
      return s;
    }
  }
  return Status::OK;
}

pb::ResultPart* VideoServiceImpl::identity_slot(pb::ResultPart& m) { return &m; }

pb::ResultPart* VideoServiceImpl::generate_slot(pb::GenerateResponse& m) { return m.mutable_result(); }

ChunkLayout VideoServiceImpl::chunk_layout(const JobSnapshot& job, int64_t chunk) {
  const JobDescription* d = job.description.get();
  if (d == nullptr || chunk < 0 || chunk >= static_cast<int64_t>(d->chunks.size())) return {};
  return d->chunks[static_cast<size_t>(chunk)];
}

Status VideoServiceImpl::store_unreadable(const std::string& id, const StoreError& e) {
  spdlog::error("job={} event=store_read_failed error=\"{}\"", id, log_escape(e.what()));
  return Status(StatusCode::UNAVAILABLE, std::string("the job store could not be read, try again: ") + e.what());
}

Status VideoServiceImpl::latents_size(const JobSnapshot& job, int64_t chunk, int64_t* size) {
  std::optional<int64_t> stored;
  try {
    stored = reads_.result_size(job.id, job.owner, JobStore::Blob::chunk, chunk);
  } catch (const StoreError& e) {
    return store_unreadable(job.id, e);
  }
  if (stored) {
    *size = *stored;
    return Status::OK;
  }
  if (!reads_.get(job.id, job.owner)) return job_not_found(job.id, job.owner);  // dropped meanwhile
  return Status(StatusCode::INTERNAL, "job " + job.id + ": chunk " + std::to_string(chunk) +
                                          " is done but its result is not in the job store");
}

Status VideoServiceImpl::video_size(ServerContext* ctx, const std::string& id, const std::string& owner,
                                    int64_t chunk, int64_t* size) {
  if (!config_.want_video || !config_.wait_video) {
    return Status(StatusCode::FAILED_PRECONDITION, "format: MP4 needs a server started with --vae");
  }
  bool made = false;  // the worker says the segment was stored (or that it has nothing to make)
  while (!ctx->IsCancelled()) {
    const auto job = reads_.get(id, owner);
    if (!job) return job_not_found(id, owner);
    if (!job->description) {  // its latents still download
      return Status(StatusCode::FAILED_PRECONDITION,
                    "job " + id + ": no MP4 can be made for it: its request could not be read back after a restart");
    }
    std::optional<int64_t> stored;
    try {
      stored = reads_.result_size(id, owner, JobStore::Blob::segment, chunk);
    } catch (const StoreError& e) {
      return store_unreadable(id, e);
    }
    if (stored) {
      *size = *stored;
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

Status VideoServiceImpl::flush_results(ServerContext* ctx, const std::string& id, const std::string& owner, pb::ResultFormat format,
                     int64_t* sent, grpc::ServerWriter<pb::GenerateResponse>* writer) {
  const auto job = reads_.get(id, owner);
  if (!job) return Status::OK;
  while (*sent < job->chunks_done) {
    if (Status s = send_chunk(ctx, *job, *sent, format, writer, generate_slot); !s.ok()) return s;
    ++*sent;
  }
  return Status::OK;
}

void VideoServiceImpl::want_video(const JobSnapshot& job) {
  if (config_.want_video && job.description) config_.want_video(job);
}

}  // namespace skyreels::server::api
