// A job's payload re-created from its durable request and committed chunks: the Scheduler's JobLoader, for a chunk
// of a job whose payload is not on this server (after a restart, another pod's, or evicted).
//
// It lives in the assembly, which hands it to the Scheduler as the loader: a restore makes a ModelJob (replica/) and
// answers the queue's RestoredJob, so it sits above both; the Scheduler stays payload-blind (and queue/ builds without
// replica/), and the transport (api/) has no part in it.
#pragma once

#include <vector>

#include "server/queue/job_types.h"
#include "server/replica/model_job.h"

namespace skyreels::server {

// RestoredJob::payload null: RestoredJob::error says why (the job, if unfinished, fails with it).
RestoredJob restore_job(const StoredJob& stored, std::vector<StoredChunk> chunks, const ModelDescription& model,
                        const ServerLimits& limits, const JobParts& parts);

}  // namespace skyreels::server
