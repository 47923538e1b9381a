#include "server/store/job_store_timed.h"

#include <chrono>
#include <utility>

namespace skyreels::server {

namespace {

// Reports on scope exit, so that a call ending in a StoreError is measured like one that returns.
class CallTimer {
 public:
  CallTimer(const StoreCallReport& report, const char* op)
      : report_(report), op_(op), start_(std::chrono::steady_clock::now()) {}
  ~CallTimer() { report_(op_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count()); }
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;

 private:
  const StoreCallReport& report_;
  const char* op_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

TimedJobStore::TimedJobStore(JobStore& inner, StoreCallReport report) : inner_(inner), report_(std::move(report)) {}

template <typename Call>
auto TimedJobStore::timed(const char* op, Call&& call) const {
  const CallTimer timer(report_, op);
  return call();
}

void TimedJobStore::insert_job(StoredJob job) {
  timed("insert_job", [&] { inner_.insert_job(std::move(job)); });
}

void TimedJobStore::update_job(const StoredJob& job) {
  timed("update_job", [&] { inner_.update_job(job); });
}

void TimedJobStore::commit_chunk(const std::string& job_id, const StoredChunk& chunk) {
  timed("commit_chunk", [&] { inner_.commit_chunk(job_id, chunk); });
}

void TimedJobStore::append_event(const std::string& job_id, const StoredEvent& event) {
  timed("append_event", [&] { inner_.append_event(job_id, event); });
}

void TimedJobStore::drop_job(const std::string& job_id, const std::string& reason) {
  timed("drop_job", [&] { inner_.drop_job(job_id, reason); });
}

std::optional<std::string> TimedJobStore::dropped_reason(const std::string& job_id, const std::string& owner) const {
  return timed("dropped_reason", [&] { return inner_.dropped_reason(job_id, owner); });
}

std::vector<StoredJob> TimedJobStore::load_jobs() const {
  return timed("load_jobs", [&] { return inner_.load_jobs(); });
}

std::vector<StoredChunk> TimedJobStore::load_chunks(const std::string& job_id) const {
  return timed("load_chunks", [&] { return inner_.load_chunks(job_id); });
}

std::vector<StoredEvent> TimedJobStore::load_events(const std::string& job_id) const {
  return timed("load_events", [&] { return inner_.load_events(job_id); });
}

std::optional<std::string> TimedJobStore::load_request(const std::string& job_id) const {
  return timed("load_request", [&] { return inner_.load_request(job_id); });
}

std::optional<std::string> TimedJobStore::load_chunk_bytes(const std::string& job_id, int64_t index) const {
  return timed("load_chunk_bytes", [&] { return inner_.load_chunk_bytes(job_id, index); });
}

void TimedJobStore::put_segment(const std::string& job_id, int64_t index, const std::string& bytes) {
  timed("put_segment", [&] { inner_.put_segment(job_id, index, bytes); });
}

std::optional<std::string> TimedJobStore::load_segment(const std::string& job_id, int64_t index) const {
  return timed("load_segment", [&] { return inner_.load_segment(job_id, index); });
}

std::optional<int64_t> TimedJobStore::blob_size(const std::string& job_id, Blob kind, int64_t index) const {
  return timed("blob_size", [&] { return inner_.blob_size(job_id, kind, index); });
}

std::optional<std::string> TimedJobStore::load_blob_range(const std::string& job_id, Blob kind, int64_t index,
                                                          int64_t offset, int64_t length) const {
  return timed("load_blob_range", [&] { return inner_.load_blob_range(job_id, kind, index, offset, length); });
}

TimedLeaseStore::TimedLeaseStore(LeaseStore& inner, StoreCallReport report)
    : inner_(inner), report_(report), records_(inner.records(), std::move(report)) {}

template <typename Call>
auto TimedLeaseStore::timed(const char* op, Call&& call) const {
  const CallTimer timer(report_, op);
  return call();
}

std::vector<policy::ReadyJob> TimedLeaseStore::candidates(int64_t limit) const {
  return timed("candidates", [&] { return inner_.candidates(limit); });
}

std::optional<ChunkLease> TimedLeaseStore::try_lease(const std::string& job_id, const std::string& replica,
                                                     std::chrono::milliseconds ttl, int64_t charge) {
  return timed("try_lease", [&] { return inner_.try_lease(job_id, replica, ttl, charge); });
}

void TimedLeaseStore::report_replica(const std::string& replica, const std::vector<std::string>& resident, bool idle) {
  timed("report_replica", [&] { inner_.report_replica(replica, resident, idle); });
}

std::vector<policy::ReplicaReport> TimedLeaseStore::replica_reports(std::chrono::milliseconds within) const {
  return timed("replica_reports", [&] { return inner_.replica_reports(within); });
}

LeaseRenewal TimedLeaseStore::renew(const ChunkLease& lease, std::chrono::milliseconds ttl) {
  return timed("renew", [&] { return inner_.renew(lease, ttl); });
}

LeaseCommit TimedLeaseStore::commit(const ChunkLease& lease, const StoredChunk& chunk,
                                    const std::vector<std::string>& events) {
  return timed("commit", [&] { return inner_.commit(lease, chunk, events); });
}

bool TimedLeaseStore::release(const ChunkLease& lease) {
  return timed("release", [&] { return inner_.release(lease); });
}

std::vector<std::string> TimedLeaseStore::expire_deadlines() {
  return timed("expire_deadlines", [&] { return inner_.expire_deadlines(); });
}

std::vector<LeaseStore::Retired> TimedLeaseStore::finished_to_retire(int64_t finished_before_ms, int64_t keep) const {
  return timed("finished_to_retire", [&] { return inner_.finished_to_retire(finished_before_ms, keep); });
}

CancelState TimedLeaseStore::request_cancel(const std::string& job_id, const std::string& owner) {
  return timed("request_cancel", [&] { return inner_.request_cancel(job_id, owner); });
}

InsertOutcome TimedLeaseStore::insert_job_once(const StoredJob& job, AdmissionLimits limits) {
  return timed("insert_job_once", [&] { return inner_.insert_job_once(job, limits); });
}

AdmissionCounts TimedLeaseStore::admission_counts(const std::string& client) const {
  return timed("admission_counts", [&] { return inner_.admission_counts(client); });
}

int64_t TimedLeaseStore::queue_depth() const {
  return timed("queue_depth", [&] { return inner_.queue_depth(); });
}

std::vector<StoredJob> TimedLeaseStore::jobs_of(const std::string& owner) const {
  return timed("jobs_of", [&] { return inner_.jobs_of(owner); });
}

std::optional<StoredJob> TimedLeaseStore::load_job(const std::string& job_id, bool with_request) const {
  return timed("load_job", [&] { return inner_.load_job(job_id, with_request); });
}

std::vector<uint64_t> TimedLeaseStore::append_events(const std::string& job_id, const std::vector<std::string>& events) {
  return timed("append_events", [&] { return inner_.append_events(job_id, events); });
}

uint64_t TimedLeaseStore::reserve_sequences(const std::string& job_id, int64_t count) {
  return timed("reserve_sequences", [&] { return inner_.reserve_sequences(job_id, count); });
}

void TimedLeaseStore::publish_step(const std::string& job_id, const StoredEvent& event) {
  timed("publish_step", [&] { inner_.publish_step(job_id, event); });
}

}  // namespace skyreels::server
