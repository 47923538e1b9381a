// open_job_store(): the --job-store spec to a backend, and lease_store_over() the leases over it; the deadline of store
// calls.
#include "server/store/job_store.h"

#include <algorithm>
#include <memory>

#include "server/store/job_lease_local.h"
#include "server/store/job_store_memory.h"
#include "server/store/job_store_postgres.h"
#include "server/store/job_store_sqlite.h"
#include "server/store/pg_db.h"

namespace skyreels::server {

namespace {

thread_local std::chrono::steady_clock::time_point call_deadline = std::chrono::steady_clock::time_point::max();

// PATH with an optional "?synchronous=normal|full".
}  // namespace

StoreCallDeadline::StoreCallDeadline(std::chrono::steady_clock::time_point until) : previous_(call_deadline) {
  call_deadline = std::min(call_deadline, until);
}

StoreCallDeadline::~StoreCallDeadline() { call_deadline = previous_; }

std::chrono::steady_clock::time_point store_call_deadline() {
  return std::min(call_deadline, std::chrono::steady_clock::now() + kStoreCallTimeout);
}

namespace {

std::unique_ptr<JobStore> open_sqlite(const std::string& spec, int64_t max_growth_pages) {
  std::string path = spec;
  bool full = false;
  const auto query = spec.rfind('?');
  if (query != std::string::npos) {
    const std::string option = spec.substr(query + 1);
    if (option != "synchronous=full" && option != "synchronous=normal") {
      throw StoreError("--job-store: unknown option '" + option + "' (sqlite:PATH?synchronous=normal|full)");
    }
    full = option == "synchronous=full";
    path = spec.substr(0, query);
  }
  if (path.empty()) throw StoreError("--job-store: sqlite: needs a file path");
  return std::make_unique<SqliteJobStore>(path, full, max_growth_pages);
}

}  // namespace

std::optional<std::string> JobStore::load_request(const std::string& job_id) const {
  for (StoredJob& job : load_jobs()) {
    if (job.id == job_id) return std::move(job.request);
  }
  return std::nullopt;
}

std::optional<int64_t> JobStore::blob_size(const std::string& job_id, Blob kind, int64_t index) const {
  const auto bytes = kind == Blob::chunk ? load_chunk_bytes(job_id, index) : load_segment(job_id, index);
  if (!bytes) return std::nullopt;
  return static_cast<int64_t>(bytes->size());
}

std::optional<std::string> JobStore::load_blob_range(const std::string& job_id, Blob kind, int64_t index,
                                                     int64_t offset, int64_t length) const {
  const auto bytes = kind == Blob::chunk ? load_chunk_bytes(job_id, index) : load_segment(job_id, index);
  if (!bytes) return std::nullopt;
  return blob_slice(*bytes, offset, length);
}

std::string blob_slice(const std::string& bytes, int64_t offset, int64_t length) {
  if (offset < 0 || length <= 0 || offset >= static_cast<int64_t>(bytes.size())) return {};
  return bytes.substr(static_cast<size_t>(offset), static_cast<size_t>(length));
}

std::unique_ptr<JobStore> open_job_store(const std::string& spec, int64_t sqlite_max_growth_pages) {
  const std::string sqlite = "sqlite:";
  if (spec.rfind(sqlite, 0) == 0 && spec.size() > sqlite.size()) {
    return open_sqlite(spec.substr(sqlite.size()), sqlite_max_growth_pages);
  }
  if (sqlite_max_growth_pages >= 0) throw StoreError("--job-store-max-growth-pages caps a sqlite: job store only");
  if (spec == "memory") return std::make_unique<MemoryJobStore>();
  if (spec.rfind("postgresql://", 0) == 0 || spec.rfind("postgres://", 0) == 0) {
    return std::make_unique<PostgresJobStore>(spec);
  }
  throw StoreError("--job-store: '" + pg::redact_url(spec) +
                   "' is neither memory, sqlite:PATH nor postgresql://[USER[:PASSWORD]@]HOST[:PORT]/DB");
}

std::unique_ptr<LeaseStore> lease_store_over(std::unique_ptr<JobStore> records, std::string finished_event) {
  if (dynamic_cast<PostgresJobStore*>(records.get()) != nullptr) {
    std::unique_ptr<PostgresJobStore> postgres(static_cast<PostgresJobStore*>(records.release()));
    return std::make_unique<PostgresLeaseStore>(std::move(postgres));
  }
  return std::make_unique<LocalLeaseStore>(std::move(records), std::move(finished_event));
}

std::string join_adapter_names(const std::vector<std::string>& names) {
  std::string joined;
  for (const std::string& name : names) joined += (joined.empty() ? "" : "/") + name;
  return joined;
}

std::vector<std::string> split_adapter_names(const std::string& joined) {
  std::vector<std::string> names;
  for (size_t start = 0; start < joined.size();) {
    const size_t slash = std::min(joined.find('/', start), joined.size());
    names.push_back(joined.substr(start, slash - start));
    start = slash + 1;
  }
  return names;
}

}  // namespace skyreels::server
