// A JobStore that times every call of another one and reports the operation and its duration (for
// skyreels_job_store_seconds), whatever the backend. Failed calls are reported too: a timeout is latency as well.
// It times the records only: the lease store (job_lease.h) is a store of its own, and whoever assembles the two says
// which of them is timed (app.cpp: the records the layers above use; the leases are not timed).
#pragma once

#include <functional>

#include "server/store/job_store.h"

namespace skyreels::server {

// The `op` label values, one per JobStore call (the method's name); declared once here, created at start by Metrics
// and listed in the operations contract (docs/ARCHITECTURE.md).
inline constexpr const char* kJobStoreOps[] = {"insert_job",   "update_job",  "commit_chunk",
                                               "append_event", "drop_job",    "dropped_reason",
                                               "load_jobs",    "load_chunks", "load_events", "load_request",
                                               "load_chunk_bytes", "put_segment", "load_segment",
                                               "blob_size",    "load_blob_range"};

// Receives `op` (one of kJobStoreOps, a string literal) and the call's wall-clock seconds, on the calling thread.
using StoreCallReport = std::function<void(const char* op, double seconds)>;

class TimedJobStore final : public JobStore {
 public:
  // `inner` must outlive this.
  TimedJobStore(JobStore& inner, StoreCallReport report);

  std::string describe() const override { return inner_.describe(); }
  bool durable() const override { return inner_.durable(); }
  SKYREELS_JOB_STORE_CALLS;

 private:
  template <typename Call>
  auto timed(const char* op, Call&& call) const;

  JobStore& inner_;
  StoreCallReport report_;
};

}  // namespace skyreels::server
