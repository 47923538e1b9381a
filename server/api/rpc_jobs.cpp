#include "server/api/video_service.h"

namespace skyreels::server::api {

Status VideoServiceImpl::GetJob(ServerContext* ctx, const pb::GetJobRequest* request, pb::Job* response) {
  const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
  Caller caller;
  if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
  if (Status s = check_job_id(request->job_id()); !s.ok()) return s;
  return store_guard(request->job_id(), [&] {
    auto job = reads_.get(request->job_id(), caller.owner);
    if (!job) return job_not_found(request->job_id(), caller.owner);
    job_to_proto(*job, response);
    return Status::OK;
  });
}

Status VideoServiceImpl::CancelJob(ServerContext* ctx, const pb::CancelJobRequest* request, pb::Job* response) {
  const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
  Caller caller;
  if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
  if (Status s = check_job_id(request->job_id()); !s.ok()) return s;
  return store_guard(request->job_id(), [&] {
    auto job = commands_.cancel(request->job_id(), caller.owner);
    if (!job) return job_not_found(request->job_id(), caller.owner);
    job_to_proto(*job, response);
    return Status::OK;
  });
}

Status VideoServiceImpl::DeleteJob(ServerContext* ctx, const pb::DeleteJobRequest* request, pb::Job* response) {
  const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
  Caller caller;
  if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
  if (Status s = check_job_id(request->job_id()); !s.ok()) return s;
  return store_guard(request->job_id(), [&] {
    auto job = commands_.remove(request->job_id(), caller.owner);
    if (!job) return job_not_found(request->job_id(), caller.owner);
    job_to_proto(*job, response);
    return Status::OK;
  });
}

Status VideoServiceImpl::ListJobs(ServerContext* ctx, const pb::ListJobsRequest* request, pb::ListJobsResponse* response) {
  const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
  Caller caller;
  if (Status s = authenticate(ctx, &caller, false); !s.ok()) return s;
  if (request->page_size() < 0 || request->page_size() > kMaxPageSize) {
    return Status(StatusCode::INVALID_ARGUMENT, "page_size: must be in [0, " + std::to_string(kMaxPageSize) + "]");
  }
  const auto page_size = static_cast<size_t>(request->page_size() == 0 ? kDefaultPageSize : request->page_size());
  size_t offset = 0;
  if (!request->page_token().empty() && !parse_page_token(request->page_token(), &offset)) {
    return Status(StatusCode::INVALID_ARGUMENT, "page_token: not a token returned by ListJobs");
  }
  std::set<int> states(request->states().begin(), request->states().end());
  std::vector<JobSnapshot> matching;
  std::vector<JobSnapshot> all;
  if (Status s = store_guard("", [&] {
        all = reads_.list(caller.owner);
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

Status VideoServiceImpl::job_not_found(const std::string& id, const std::string& owner) const {
  if (auto reason = reads_.dropped(id, owner); reason && reason->rfind("deleted", 0) == 0) {
    return Status(StatusCode::NOT_FOUND, "job '" + log_escape(id, kMaxJobIdBytes) + "' was " + *reason);
  }
  if (auto reason = reads_.dropped(id, owner)) {
    return Status(StatusCode::NOT_FOUND, "job '" + log_escape(id, kMaxJobIdBytes) +
                                             "' was dropped by retention (" + *reason + ")");
  }
  return not_found(id);
}

void VideoServiceImpl::job_to_proto(const JobSnapshot& s, pb::Job* out) const {
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
    out->set_prompt(job->prompt);
  }
}

void VideoServiceImpl::event_to_proto(const std::string& id, const std::string& owner, const JobEvent& e, pb::JobEvent* out) const {
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
      if (auto job = reads_.get(id, owner)) {
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
      r->set_takeover(e.takeover);
      break;
    }
    case EventType::Finished: {
      if (auto job = reads_.get(id, owner)) job_to_proto(*job, out->mutable_finished()->mutable_job());
      break;
    }
    case EventType::Webhook: {
      auto* w = out->mutable_webhook();
      w->set_event_sequence(e.target);
      w->set_attempt(e.attempt);
      w->set_outcome(e.message);
      w->set_http_status(e.status);
      break;
    }
  }
}

Status VideoServiceImpl::gone(const std::string& id, const std::string& owner) {
  return stop_generate(id, owner, Status(StatusCode::CANCELLED, ""));
}

}  // namespace skyreels::server::api
