// `--job-store postgresql://...` (or postgres://; also $SKYREELS_JOB_STORE, so that the password stays out of the
// process list): the job store that several servers share. Unlike SQLite it is not held exclusively; the servers
// split the chunks through leases (job_lease.h). Versioned schema, migrated forward at startup under an advisory lock
// so that pods starting together agree; a newer schema stops the start. Every failure is a StoreError naming the
// store (password redacted); a lost connection is re-made on the next call (pg_db.h).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "server/store/job_lease.h"
#include "server/store/job_store.h"

namespace skyreels::server {

namespace pg {
class Pool;
class Connection;
}  // namespace pg

// The records (JobStore): the schema, its migrations and the connection pool, which PostgresLeaseStore shares.
class PostgresJobStore final : public JobStore {
 public:
  static constexpr int kSchemaVersion = 3;
  static constexpr int kConnections = 4;
  explicit PostgresJobStore(const std::string& url);  // connects and migrates; throws StoreError
  ~PostgresJobStore() override;

  std::string describe() const override;
  bool durable() const override { return true; }
  SKYREELS_JOB_STORE_CALLS;

 private:
  friend class PostgresLeaseStore;  // the same database and pool
  void migrate();
  // Measures PostgreSQL's clock against this pod's (one round trip); false when the store does not answer.
  bool measure_clock() const;
  // SQL announcing a change of `job_id` (an expression).
  std::string notify_change_sql(const std::string& job_id) const;
  std::string url_;
  std::string origin_;  // tags the changes this store announces (its own listener skips them)
  std::unique_ptr<pg::Pool> pool_;
  mutable std::atomic<int64_t> clock_offset_ms_{0};  // PostgreSQL's clock minus this pod's
};

// The leases (job_store_postgres_leases.cpp), over the records it holds: one database, one pool.
class PostgresLeaseStore final : public LeaseStore {
 public:
  explicit PostgresLeaseStore(std::unique_ptr<PostgresJobStore> records);
  ~PostgresLeaseStore() override;

  JobStore& records() override { return *records_; }
  SKYREELS_LEASE_STORE_CALLS;
  void report_replica(const std::string& replica, const std::vector<std::string>& resident, bool idle) override;
  std::vector<policy::ReplicaReport> replica_reports(std::chrono::milliseconds within) const override;
  bool shared() const override { return true; }
  std::unique_ptr<ChangeListener> listen() override;
  // Also measures PostgreSQL's clock against this pod's (the health check's one round trip, every few seconds).
  bool reachable() const override;
  // This pod's clock plus the offset last measured (PostgreSQL's clock_timestamp(), the clock leases use).
  int64_t now_ms() const override;

 private:
  std::string describe() const { return records_->describe(); }
  std::string notify_change_sql(const std::string& job_id) const { return records_->notify_change_sql(job_id); }
  std::unique_ptr<PostgresJobStore> records_;
  pg::Pool* pool_;  // records_'s
  std::mutex reported_mu_;
  std::set<std::string> reported_;  // this pod's replicas that have reported
};

}  // namespace skyreels::server
