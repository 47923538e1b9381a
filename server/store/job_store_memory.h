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
  SKYREELS_JOB_STORE_CALLS;

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
