// `--job-store sqlite:PATH[?synchronous=full]`: the embedded default. One file, WAL journal, held exclusively by one
// server (a second server on the same file fails to start). synchronous=NORMAL (the default): a commit survives the
// process being killed (SIGKILL, OOM kill) at any moment; a power loss may lose the last commits. synchronous=FULL:
// a commit survives a power loss too, at the cost of an fsync per commit. Schema versions with forward migrations.
#pragma once

#include <memory>
#include <mutex>

#include "server/store/job_store.h"

namespace skyreels::server {

namespace sqlite {
class Database;
}

class SqliteJobStore final : public JobStore {
 public:
  static constexpr int kSchemaVersion = 5;
  // Throws StoreError naming the file. `synchronous_full`: an fsync per commit (see above).
  explicit SqliteJobStore(const std::string& path, bool synchronous_full = false);
  ~SqliteJobStore() override;

  // "sqlite:PATH", with "?synchronous=full" when the connection runs so (read back from SQLite, not from the flag).
  std::string describe() const override;
  bool durable() const override { return true; }
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
  void migrate();
  void cap_growth_for_tests();
  std::string path_;
  bool synchronous_full_ = false;
  mutable std::mutex mu_;
  std::unique_ptr<sqlite::Database> db_;
};

}  // namespace skyreels::server
