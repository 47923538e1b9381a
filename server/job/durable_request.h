// A job's request as the job store keeps it (the durable request) and the codec it is read back with: the bytes a
// submission is stored as, so that any pod can re-create the job later (after a restart, a takeover, an eviction),
// and skyreels.v1.JobSpec -> JobRequest, which the submit path and that re-creation share. Protobuf messages, no
// gRPC (the transport hands the messages over; app/restore_job.h re-creates the job).
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "server/job/job_request.h"
#include "skyreels/v1/video_service.pb.h"

namespace skyreels::server {

// The spec as the request the job is made from; the fields are checked when it is (ModelJob::create). Throws
// ValidationError for embeddings without prompt_embeds.
JobRequest request_from_proto(const v1::JobSpec& spec);

// What a submission resolved that its request may leave open: the parameters in effect (the seed drawn, the
// adapters' SHA-256) and the embeddings its texts were encoded to (F32, as ModelJob hands them out).
struct ResolvedInputs {
  const ResolvedParams& params;
  std::function<RawTensor(bool negative)> prompt_embeddings;  // the negative's shape is empty without guidance
  std::function<RawTensor(size_t index)> prompt_change_embeddings;
};

// What the job store keeps of a request: the request with the values actually used filled in (the resolved seed,
// the adapters' files as accepted, the embeddings of every text), serialised deterministically. Deadlines are not
// part of it: the store keeps the absolute deadline of the job.
std::string durable_request(const v1::SubmitJobRequest& request, const ResolvedInputs& resolved);

// The stored bytes back as the request they were made from; std::runtime_error when they are unreadable.
v1::SubmitJobRequest parse_durable_request(const std::string& bytes);

}  // namespace skyreels::server
