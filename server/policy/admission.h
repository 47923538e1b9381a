// Admission as a pure function over what a store reports, in the transaction that inserts the job (so that a limit
// holds across pods): which refusal comes first, where the client's share starts when it becomes active, its weight,
// and where the job starts within its client's share. The store then stores exactly what this decides.
#pragma once

#include <cstdint>
#include <optional>

namespace skyreels::server::policy {

// The queue limits an insert checks (0: no limit).
struct AdmissionLimits {
  int64_t max_unfinished = 0;   // queued or running jobs in the whole store
  int64_t max_for_client = 0;   // of those, the submitting client's
};

// What the store finds, atomically with the insert, for a job of `client`.
struct AdmissionFacts {
  int64_t unfinished = 0;             // queued or running jobs, every client, every pod
  int64_t unfinished_for_client = 0;  // of those, the client's
  bool id_taken = false;              // the job's id names a stored job or a tombstone
  std::optional<int64_t> client_service;         // the client's attained service on record (none: never charged)
  std::optional<int64_t> least_client_fair_key;  // least vbase + chunks_done among the client's unfinished jobs
  std::optional<int64_t> least_active_service;   // least attained service among clients with unfinished jobs
};

enum class Refusal { None, QueueFull, ClientQueueFull, IdTaken };

struct Admission {
  Refusal refused = Refusal::None;
  int64_t count_at_limit = 0;  // refused for a limit: the count that reached it
  int64_t client_service = 0;  // admitted: the client's attained service to store
  int client_weight = 1;       // admitted: the client's weight to store
  int64_t vbase = 0;           // admitted: the job's fair-share start
};

// The queue limit first, then the client's, then a taken id. A client counts as active while it has an unfinished
// job: one that becomes active starts at client_share_start, one that is active keeps its service. The job starts at
// fair_share_start among the client's unfinished jobs.
Admission admit(const AdmissionFacts& facts, const AdmissionLimits& limits, int requested_weight);

}  // namespace skyreels::server::policy
