// A job's payload re-created from its durable request and committed chunks: the Scheduler's JobLoader, for a chunk
// of a job whose payload is not on this server (after a restart, another pod's, or evicted).
//
// It lives here, on the queue's side of ModelJob: job/ holds the durable request's codec but sits below replica/, and
// a restore makes a ModelJob (replica/) and answers the queue's RestoredJob; the transport (api/) has no part in it.
// The Scheduler itself stays payload-blind: it never includes this file; the assembly (app/) hands it over as the
// loader.
#pragma once

#include <vector>

#include "server/queue/job_types.h"
#include "server/replica/model_job.h"

namespace skyreels::server {

// RestoredJob::payload null: RestoredJob::error says why (the job, if unfinished, fails with it).
RestoredJob restore_job(const StoredJob& stored, std::vector<StoredChunk> chunks, const ModelDescription& model,
                        const ServerLimits& limits, const JobParts& parts);

}  // namespace skyreels::server
