// Store timing, for skyreels_job_store_seconds: TimedJobStore times every call of a JobStore, TimedLeaseStore every
// call of a LeaseStore (and hands out its records timed), whatever the backend. Failed calls are reported too: a
// timeout is latency as well. The assembly (app.cpp) wraps the lease store it opened, so both are timed, visibly.
#pragma once

#include <functional>

#include "server/store/job_lease.h"
#include "server/store/job_store.h"

namespace skyreels::server {

// The `op` label values, one per JobStore call (the method's name); declared once here, created at start by Metrics
// and listed in the operations contract (docs/ARCHITECTURE.md).
inline constexpr const char* kJobStoreOps[] = {"insert_job",   "update_job",  "commit_chunk",
                                               "append_event", "drop_job",    "dropped_reason",
                                               "load_jobs",    "load_chunks", "load_events", "load_request",
                                               "load_chunk_bytes", "put_segment", "load_segment",
                                               "blob_size",    "load_blob_range"};

// The lease store's calls that reach the store (the method's name; records() is timed as above, and shared(),
// reachable(), now_ms() and listen() are answers of the process, not calls).
inline constexpr const char* kLeaseStoreOps[] = {
    "candidates",      "try_lease",   "report_replica",    "replica_reports",   "renew",         "commit",
    "release",         "expire_deadlines", "finished_to_retire", "request_cancel", "insert_job_once",
    "admission_counts", "queue_depth", "jobs_of",           "load_job",          "append_events", "reserve_sequences",
    "publish_step"};

// Receives `op` (one of kJobStoreOps or kLeaseStoreOps, a string literal) and the call's wall-clock seconds, on the calling thread.
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

class TimedLeaseStore final : public LeaseStore {
 public:
  // `inner` must outlive this.
  TimedLeaseStore(LeaseStore& inner, StoreCallReport report);

  JobStore& records() override { return records_; }  // timed
  SKYREELS_LEASE_STORE_CALLS;
  void report_replica(const std::string& replica, const std::vector<std::string>& resident, bool idle) override;
  std::vector<policy::ReplicaReport> replica_reports(std::chrono::milliseconds within) const override;
  bool shared() const override { return inner_.shared(); }
  std::unique_ptr<ChangeListener> listen() override { return inner_.listen(); }
  bool reachable() const override { return inner_.reachable(); }
  int64_t now_ms() const override { return inner_.now_ms(); }

 private:
  template <typename Call>
  auto timed(const char* op, Call&& call) const;

  LeaseStore& inner_;
  StoreCallReport report_;
  TimedJobStore records_;
};

}  // namespace skyreels::server
