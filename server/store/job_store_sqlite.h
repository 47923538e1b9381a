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
  // Throws StoreError naming the file. `synchronous_full`: an fsync per commit (see above). `max_growth_pages` >= 0
  // (the test hook --job-store-max-growth-pages): the file grows by that many pages at most.
  explicit SqliteJobStore(const std::string& path, bool synchronous_full = false, int64_t max_growth_pages = -1);
  ~SqliteJobStore() override;

  // "sqlite:PATH", with "?synchronous=full" when the connection runs so (read back from SQLite, not from the flag).
  std::string describe() const override;
  bool durable() const override { return true; }
  SKYREELS_JOB_STORE_CALLS;

 private:
  void migrate();
  void cap_growth_for_tests(int64_t max_growth_pages);
  std::string path_;
  bool synchronous_full_ = false;
  mutable std::mutex mu_;
  std::unique_ptr<sqlite::Database> db_;
};

}  // namespace skyreels::server
