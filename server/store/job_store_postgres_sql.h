// Internal to the PostgreSQL job store (included by server/store/job_store_postgres*.cpp only): the SQL both of its
// files use. job_store_postgres.cpp: the schema and its migrations, the JobStore seam (records, blobs, the clock);
// job_store_postgres_leases.cpp: the LeaseStore seam (what a claim reads, leases, admission, events, NOTIFY).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "server/store/job_store.h"
#include "server/store/pg_db.h"

namespace skyreels::server::pg_sql {

using pg::Param;

inline constexpr const char* kNowMs = "(extract(epoch from clock_timestamp()) * 1000)::bigint";
inline constexpr const char* kUnfinished = "state IN ('queued', 'running')";
inline constexpr int64_t kAdmissionLockKey = 0x736b7972;  // pg_advisory_xact_lock key of submissions ("skyr")
inline constexpr const char* kJobColumns =
    "id, ord, vbase, owner, client, priority, deadline_ms, idempotency_key, fingerprint, state, error_kind, error,"
    " created_ms, started_ms, finished_ms, chunk_count, chunks_done, retries, handoffs, request, fingerprint_v2,"
    " adapters";

// Claimable now: the job runs on, nobody cancelled it, a chunk is left and no lease is live.
std::string ready_condition();

// kJobColumns with the request read as empty.
const std::string& without_request_columns();

std::string notify_sql(const std::string& payload);

// This store's tag on the changes it announces ("ID\nORIGIN"), so that its own listener skips them: the scheduler
// that made a change has already woken its waiters. (A pod of the version before reads the id and ignores the rest.)
std::string new_origin();

StoredJob job_from_row(const pg::Result& r, int i);

// Parameters $1..$21 of an insert (ord is the caller's).
std::vector<Param> job_params(const StoredJob& j);

// `ord` and `vbase`: SQL for them ($21 / $2: the caller's values).
std::string insert_job_sql(const std::string& ord, const std::string& vbase);

}  // namespace skyreels::server::pg_sql
