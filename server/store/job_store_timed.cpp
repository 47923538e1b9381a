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

}  // namespace skyreels::server
