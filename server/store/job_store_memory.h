// `--job-store memory`: nothing survives a restart. Keeps everything SQLite keeps (job rows with their requests, chunk
// results, MP4 segments, events): results and evicted payloads are read back from the store, so both backends answer
// the same.
#pragma once

#include <deque>
#include <map>
#include <mutex>

#include "server/store/job_store.h"

namespace skyreels::server {

class MemoryJobStore final : public JobStore {
 public:
  std::string describe() const override { return "memory"; }
  bool durable() const override { return false; }
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

 public:  // for the blob lookup in the .cpp
  struct Entry {
    StoredJob job;
    std::map<int64_t, StoredChunk> chunks;  // by index
    std::map<int64_t, std::string> segments;
    std::vector<StoredEvent> events;
  };

 private:
  mutable std::mutex mu_;
  std::map<std::string, Entry> jobs_;
  std::map<std::string, std::pair<std::string, std::string>> tombstones_;  // id -> (owner, reason)
  std::deque<std::string> tombstone_order_;
};

}  // namespace skyreels::server
