#include "server/api/video_service.h"

namespace skyreels::server::api {

Status VideoServiceImpl::SubmitJob(ServerContext* ctx, const pb::SubmitJobRequest* request, pb::SubmitJobResponse* response) {
  const StoreCallDeadline store_deadline(rpc_deadline(*ctx));
  Caller caller;
  if (Status s = authenticate(ctx, &caller, true); !s.ok()) return s;
  SubmitResult result;
  if (Status s = submit(ctx, *request, caller, &result); !s.ok()) return s;
  job_to_proto(result.job, response->mutable_job());
  response->set_deduplicated(result.deduplicated);
  return Status::OK;
}

Status VideoServiceImpl::Generate(ServerContext* ctx, const pb::GenerateRequest* request,
                grpc::ServerWriter<pb::GenerateResponse>* writer) {
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
      commands_.cancel(id, owner);  // nobody is listening any more
      return Status(StatusCode::CANCELLED, "client cancelled: job " + id + " cancelled");
    }
    const EventBatch batch = reads_.wait_events(id, owner, after, Clock::now() + kPoll);
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
      const auto job = reads_.get(id, owner);
      if (!job || job->state == JobState::Succeeded) return Status::OK;
      return Status(to_code(job->error_kind), "job " + id + " " + job_state_name(job->state) + ": " + job->error);
    }
  }
}

Status VideoServiceImpl::check_submission(const pb::SubmitJobRequest& request, const Caller& caller) {
  if (request.priority() < kMinPriority || request.priority() > kMaxPriority) {
    return reject(kRejectInvalidArgument, StatusCode::INVALID_ARGUMENT,
                  "priority: " + std::to_string(request.priority()) + " is outside [" + std::to_string(kMinPriority) +
                      ", " + std::to_string(kMaxPriority) + "]");
  }
  if (request.produce_mp4()) {
    if (Status s = check_format(pb::RESULT_FORMAT_MP4, config_.vae_available); !s.ok()) return s;
  }
  if (caller.limits.max_priority && request.priority() > *caller.limits.max_priority) {
    return reject(kRejectClientLimit, StatusCode::PERMISSION_DENIED,
                  "priority: " + std::to_string(request.priority()) + " is above this client's max_priority " +
                      std::to_string(*caller.limits.max_priority));
  }
  if (request.has_webhook()) {
    if (!config_.check_webhook) {
      return reject(kRejectInvalidArgument, StatusCode::FAILED_PRECONDITION,
                    "webhook: this server sends no webhooks (start it with --webhook-secret-file and "
                    "--webhook-allow-hosts)");
    }
    const auto& events = request.webhook().events();
    const std::string why =
        config_.check_webhook(request.webhook().url(), std::vector<std::string>(events.begin(), events.end()));
    if (!why.empty()) return reject(kRejectInvalidArgument, StatusCode::INVALID_ARGUMENT, why);
  }
  if (request.idempotency_key().size() > kMaxIdempotencyKeyBytes) {
    return reject(kRejectInvalidArgument, StatusCode::INVALID_ARGUMENT,
                  "idempotency_key: longer than " + std::to_string(kMaxIdempotencyKeyBytes) + " bytes");
  }
  return Status::OK;
}

TextEncoderFn VideoServiceImpl::gated_text_encoder() {
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

Status VideoServiceImpl::submit(ServerContext* ctx, const pb::SubmitJobRequest& request, const Caller& caller, SubmitResult* result) {
  if (lifecycle_.draining()) {
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
    commands_.check_admission(spec);
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
                           job_parts(config_, gated_text_encoder()));
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
  Fingerprint fingerprint =
      submission_fingerprint({job->fingerprint(), job->fingerprint_v2()}, submission_terms(request));
  spec.fingerprint = fingerprint.v1;
  spec.fingerprint_v2 = std::move(fingerprint.v2);
  spec.payload = job;
  spec.description = job->description();
  spec.durable_request = durable_request(request, resolved_inputs(*job));
  try {
    *result = commands_.submit(std::move(spec));
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

Status VideoServiceImpl::stop_generate(const std::string& id, const std::string& owner, const Status& why) {
  commands_.cancel(id, owner);
  if (why.error_code() == StatusCode::CANCELLED) {
    return Status(StatusCode::CANCELLED, "client went away: job " + id + " cancelled");
  }
  spdlog::error("job={} event=generate_failed code={} error=\"{}\"", id, static_cast<int>(why.error_code()),
                log_escape(why.error_message()));
  return Status(why.error_code(), "job " + id + ": " + why.error_message());
}

}  // namespace skyreels::server::api
