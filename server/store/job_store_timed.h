// A JobStore that times every call of another one and reports the operation and its duration (for
// skyreels_job_store_seconds), whatever the backend. Failed calls are reported too: a timeout is latency as well.
#pragma once

#include <functional>
#include <memory>

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
  TimedJobStore(std::unique_ptr<JobStore> inner, StoreCallReport report);

  std::string describe() const override { return inner_->describe(); }
  bool durable() const override { return inner_->durable(); }
  LeaseStore* leases() override { return inner_->leases(); }  // leases are not timed here (claim, renew)
  void insert_job(StoredJob job) override;
  void update_job(const StoredJob& job) override;
  void commit_chunk(const std::string& job_id, const StoredChunk& chunk) override;
  void append_event(const std::string& job_id, const StoredEvent& event) override;
  void drop_job(const std::string& job_id, const std::string& reason) override;
  std::optional<std::string> dropped_reason(const std::string& job_id, const std::string& owner) const override;
  std::vector<StoredJob> load_jobs() const override;
  std::vector<StoredChunk> load_chunks(const std::string& job_id) const override;
  std::vector<StoredEvent> load_events(const std::string& job_id) const override;
  std::optional<std::string> load_request(const std::string& job_id) const override;
  std::optional<std::string> load_chunk_bytes(const std::string& job_id, int64_t index) const override;
  void put_segment(const std::string& job_id, int64_t index, const std::string& bytes) override;
  std::optional<std::string> load_segment(const std::string& job_id, int64_t index) const override;
  std::optional<int64_t> blob_size(const std::string& job_id, Blob kind, int64_t index) const override;
  std::optional<std::string> load_blob_range(const std::string& job_id, Blob kind, int64_t index, int64_t offset,
                                             int64_t length) const override;

 private:
  template <typename Call>
  auto timed(const char* op, Call&& call) const;

  std::unique_ptr<JobStore> inner_;
  StoreCallReport report_;
};

}  // namespace skyreels::server
