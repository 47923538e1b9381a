// open_job_store(): the --job-store spec to a backend.
#include <memory>

#include "server/job_store.h"
#include "server/job_store_memory.h"
#include "server/job_store_postgres.h"
#include "server/job_store_sqlite.h"
#include "server/pg_db.h"

namespace skyreels::server {

std::unique_ptr<JobStore> open_job_store(const std::string& spec) {
  if (spec == "memory") return std::make_unique<MemoryJobStore>();
  const std::string sqlite = "sqlite:";
  if (spec.rfind(sqlite, 0) == 0 && spec.size() > sqlite.size()) {
    return std::make_unique<SqliteJobStore>(spec.substr(sqlite.size()));
  }
  if (spec.rfind("postgresql://", 0) == 0 || spec.rfind("postgres://", 0) == 0) {
    return std::make_unique<PostgresJobStore>(spec);
  }
  throw StoreError("--job-store: '" + pg::redact_url(spec) +
                   "' is neither memory, sqlite:PATH nor postgresql://[USER[:PASSWORD]@]HOST[:PORT]/DB");
}

}  // namespace skyreels::server
