#include "server/store/job_store_postgres.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "server/store/job_store_postgres_sql.h"
#include "server/store/pg_db.h"

namespace skyreels::server {

namespace pg_sql {

// Claimable now: the job runs on, nobody cancelled it, a chunk is left and no lease is live.
std::string ready_condition() {
  return std::string(kUnfinished) + " AND NOT cancel_requested AND chunks_done < chunk_count" +
         " AND (lease_replica IS NULL OR lease_expires_ms <= " + kNowMs + ")";
}

// kJobColumns with the request read as empty.
const std::string& without_request_columns() {
  static const std::string columns = [] {
    std::string c = kJobColumns;
    const size_t at = c.rfind("request");
    return c.replace(at, std::string("request").size(), "''::bytea");
  }();
  return columns;
}

std::string notify_sql(const std::string& payload) { return "pg_notify('skyreels_jobs', " + payload + ")"; }

// This store's tag on the changes it announces ("ID\nORIGIN"), so that its own listener skips them: the scheduler
// that made a change has already woken its waiters. (A pod of the version before reads the id and ignores the rest.)
std::string new_origin() {
  std::random_device os;  // a tag, not a secret
  return std::to_string(os()) + std::to_string(os());
}

StoredJob job_from_row(const pg::Result& r, int i) {
  StoredJob j;
  j.id = r.text(i, 0);
  j.order = static_cast<uint64_t>(r.int64(i, 1));
  j.vbase = r.int64(i, 2);
  j.owner = r.text(i, 3);
  j.client = r.text(i, 4);
  j.priority = static_cast<int>(r.int64(i, 5));
  if (!r.is_null(i, 6)) j.deadline_ms = r.int64(i, 6);
  j.idempotency_key = r.text(i, 7);
  j.fingerprint = static_cast<uint64_t>(r.int64(i, 8));
  j.state = r.text(i, 9);
  j.error_kind = r.text(i, 10);
  j.error = r.text(i, 11);
  j.created_ms = r.int64(i, 12);
  j.started_ms = r.int64(i, 13);
  j.finished_ms = r.int64(i, 14);
  j.chunk_count = r.int64(i, 15);
  j.chunks_done = r.int64(i, 16);
  j.retries = static_cast<int>(r.int64(i, 17));
  j.handoffs = static_cast<int>(r.int64(i, 18));
  j.request = r.text(i, 19);
  j.fingerprint_v2 = r.text(i, 20);
  j.adapters = split_adapter_names(r.text(i, 21));
  return j;
}

// Parameters $1..$21 of an insert (ord is the caller's).
std::vector<Param> job_params(const StoredJob& j) {
  return {j.id,
          j.vbase,
          j.owner,
          j.client,
          j.priority,
          j.deadline_ms,
          Param::bytes(j.idempotency_key),
          static_cast<int64_t>(j.fingerprint),
          j.state,
          j.error_kind,
          Param::bytes(j.error),
          j.created_ms,
          j.started_ms,
          j.finished_ms,
          j.chunk_count,
          j.chunks_done,
          j.retries,
          j.handoffs,
          Param::bytes(j.request),
          j.fingerprint_v2,
          join_adapter_names(j.adapters)};
}

// `ord` and `vbase`: SQL for them ($21 / $2: the caller's values).
std::string insert_job_sql(const std::string& ord, const std::string& vbase) {
  return "INSERT INTO jobs(id, vbase, owner, client, priority, deadline_ms, idempotency_key, fingerprint, state,"
         " error_kind, error, created_ms, started_ms, finished_ms, chunk_count, chunks_done, retries, handoffs,"
         " request, fingerprint_v2, adapters, ord) VALUES($1," +
         vbase + ",$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15,$16,$17,$18,$19,$20,$21," + ord + ")";
}

}  // namespace pg_sql

namespace {

using pg::Param;
using namespace pg_sql;

// Forward migrations: entry i takes the schema from version i to i + 1. Never edit an entry once released; append.
// Free-form strings a client or an exception may fill (idempotency key, error, reason, event data) are bytea: text
// columns refuse NUL bytes and invalid UTF-8.
const std::vector<std::string>& migrations() {
  static const std::vector<std::string> list = {
      // 0 -> 1
      "CREATE SEQUENCE job_order;"
      "CREATE TABLE jobs(id text PRIMARY KEY, ord bigint NOT NULL, vbase bigint NOT NULL, owner text NOT NULL,"
      " client text NOT NULL, priority integer NOT NULL, deadline_ms bigint, idempotency_key bytea NOT NULL,"
      " fingerprint bigint NOT NULL, state text NOT NULL, error_kind text NOT NULL, error bytea NOT NULL,"
      " created_ms bigint NOT NULL, started_ms bigint NOT NULL, finished_ms bigint NOT NULL,"
      " chunk_count bigint NOT NULL, chunks_done bigint NOT NULL, retries integer NOT NULL,"
      " handoffs integer NOT NULL, request bytea NOT NULL,"
      " next_seq bigint NOT NULL DEFAULT 0,"               // the last event sequence number handed out
      " cancel_requested boolean NOT NULL DEFAULT false,"  // by any pod; the lease holder sees it at its renew
      " lease_token bigint NOT NULL DEFAULT 0,"            // the last lease's; never decreases
      " lease_replica text, lease_expires_ms bigint,"      // the live lease, if any (NULL: none)
      " last_replica text NOT NULL DEFAULT '');"           // ran the previous chunk (affinity)
      "CREATE UNIQUE INDEX jobs_idempotency ON jobs(owner, idempotency_key) WHERE idempotency_key <> ''::bytea;"
      "CREATE INDEX jobs_ord ON jobs(ord);"
      "CREATE INDEX jobs_ready ON jobs(priority DESC, (vbase + chunks_done), ord)"
      " WHERE state IN ('queued', 'running') AND NOT cancel_requested;"
      "CREATE TABLE chunks(job_id text NOT NULL REFERENCES jobs(id) ON DELETE CASCADE, idx bigint NOT NULL,"
      " replica text NOT NULL, attempts integer NOT NULL, bytes bytea NOT NULL, PRIMARY KEY(job_id, idx));"
      "CREATE TABLE events(job_id text NOT NULL REFERENCES jobs(id) ON DELETE CASCADE, seq bigint NOT NULL,"
      " data bytea NOT NULL, PRIMARY KEY(job_id, seq));"
      "CREATE TABLE segments(job_id text NOT NULL REFERENCES jobs(id) ON DELETE CASCADE, idx bigint NOT NULL,"
      " bytes bytea NOT NULL, PRIMARY KEY(job_id, idx));"
      "CREATE TABLE dropped(id text PRIMARY KEY, owner text NOT NULL, reason bytea NOT NULL,"
      " dropped_ms bigint NOT NULL, seq bigserial NOT NULL);"
      "CREATE INDEX dropped_seq ON dropped(seq);"
      // Latents and embeddings are float data: compressing them costs CPU and saves next to nothing.
      "ALTER TABLE jobs ALTER COLUMN request SET STORAGE EXTERNAL;"
      "ALTER TABLE chunks ALTER COLUMN bytes SET STORAGE EXTERNAL;",
      // 1 -> 2: fair share between tenants (policy::charge_chunk per chunk claimed for the client)
      "CREATE TABLE clients(client text PRIMARY KEY, service bigint NOT NULL DEFAULT 0,"
      " weight integer NOT NULL DEFAULT 1);"
      "INSERT INTO clients(client) SELECT DISTINCT client FROM jobs;"
      // ... and SHA-256 idempotency fingerprints ('' for jobs stored before: their 64-bit one decides)
      "ALTER TABLE jobs ADD COLUMN fingerprint_v2 text NOT NULL DEFAULT '';",
      // 2 -> 3: placement that knows adapters across pods: each job's adapter names, and the adapters each idle
      // replica holds (reported by its claims)
      "ALTER TABLE jobs ADD COLUMN adapters text NOT NULL DEFAULT '';"
      "CREATE TABLE replicas(name text PRIMARY KEY, idle boolean NOT NULL, adapters text NOT NULL,"
      " seen_ms bigint NOT NULL);",
  };
  return list;
}

constexpr int64_t kMigrationLock = 0x736b7972656c7331;  // "skyrels1": pg_advisory_xact_lock key of migrations

}  // namespace

PostgresJobStore::PostgresJobStore(const std::string& url)
    : url_(url), origin_(new_origin()), pool_(std::make_unique<pg::Pool>(url, kConnections)) {
  migrate();
  measure_clock();  // the first clock offset, before anything is stamped
  spdlog::info("event=job_store_opened store=postgresql url={} schema_version={} clock_offset_ms={}", describe(),
               kSchemaVersion, clock_offset_ms_.load());
}

PostgresJobStore::~PostgresJobStore() = default;

std::string PostgresJobStore::describe() const { return pg::redact_url(url_); }

// One transaction under an advisory lock: pods starting together migrate once, the others then see the result.
void PostgresJobStore::migrate() {
  auto c = pool_->acquire();
  pg::Transaction tx(*c);
  c->exec("SELECT pg_advisory_xact_lock($1)", {kMigrationLock});
  const pg::Result tables = c->exec(
      "SELECT to_regclass('skyreels_schema_version') IS NOT NULL, to_regclass('jobs') IS NOT NULL");
  const bool has_version = tables.boolean(0, 0);
  if (!has_version && tables.boolean(0, 1)) {
    throw StoreError("job store " + describe() +
                     ": not a job store (a table 'jobs' exists without skyreels_schema_version)");
  }
  int64_t version = 0;
  if (has_version) {
    const pg::Result r = c->exec("SELECT version FROM skyreels_schema_version");
    if (r.rows() != 1) throw StoreError("job store " + describe() + ": skyreels_schema_version must hold one row");
    version = r.int64(0, 0);
  }
  const auto latest = static_cast<int64_t>(migrations().size());
  if (version > latest) {
    throw StoreError("job store " + describe() + ": schema version " + std::to_string(version) +
                     " is newer than this server's " + std::to_string(latest) + " (upgrade the server)");
  }
  if (version < 0) throw StoreError("job store " + describe() + ": invalid schema version " + std::to_string(version));
  if (!has_version) {
    c->exec_script("CREATE TABLE skyreels_schema_version(version integer NOT NULL);"
                   "INSERT INTO skyreels_schema_version VALUES(0)");
  }
  for (int64_t v = version; v < latest; ++v) {
    c->exec_script(migrations()[static_cast<size_t>(v)]);
    spdlog::info("event=job_store_migrated store={} from={} to={}", describe(), v, v + 1);
  }
  c->exec("UPDATE skyreels_schema_version SET version = $1", {latest});
  tx.commit();
}

void PostgresJobStore::insert_job(StoredJob j) {
  auto c = pool_->acquire();
  std::vector<Param> params = job_params(j);
  params.emplace_back(static_cast<int64_t>(j.order));
  c->exec("WITH i AS (" + insert_job_sql("$22", "$2") + " RETURNING id) SELECT " + notify_change_sql("id") + " FROM i",
          params);
}

void PostgresJobStore::update_job(const StoredJob& j) {
  auto c = pool_->acquire();
  c->exec("WITH u AS (UPDATE jobs SET state=$2, error_kind=$3, error=$4, started_ms=$5, finished_ms=$6, retries=$7,"
          " handoffs=$8 WHERE id=$1 RETURNING id) SELECT " +
              notify_change_sql("id") + " FROM u",
          {j.id, j.state, j.error_kind, Param::bytes(j.error), j.started_ms, j.finished_ms, j.retries, j.handoffs});
}

void PostgresJobStore::commit_chunk(const std::string& job_id, const StoredChunk& chunk) {
  auto c = pool_->acquire();
  // One statement, so one transaction: the result and chunks_done together, or neither.
  c->exec("WITH u AS (UPDATE jobs SET chunks_done = $2 + 1, last_replica = $3 WHERE id = $1 RETURNING id),"
          " c AS (INSERT INTO chunks(job_id, idx, replica, attempts, bytes) SELECT id, $2, $3, $4, $5 FROM u"
          " ON CONFLICT (job_id, idx) DO UPDATE SET replica = EXCLUDED.replica, attempts = EXCLUDED.attempts,"
          " bytes = EXCLUDED.bytes RETURNING job_id) SELECT " +
              notify_change_sql("job_id") + " FROM c",
          {job_id, chunk.index, chunk.replica, chunk.attempts, Param::bytes(chunk.bytes)});
}

void PostgresJobStore::append_event(const std::string& job_id, const StoredEvent& event) {
  auto c = pool_->acquire();
  // The allocator (next_seq) stays above every number stored, whoever chose it.
  c->exec("WITH u AS (UPDATE jobs SET next_seq = GREATEST(next_seq, $2) WHERE id = $1 RETURNING id)"
          " INSERT INTO events(job_id, seq, data) SELECT id, $2, $3 FROM u"
          " ON CONFLICT (job_id, seq) DO UPDATE SET data = EXCLUDED.data",
          {job_id, static_cast<int64_t>(event.sequence), Param::bytes(event.data)});
}

void PostgresJobStore::drop_job(const std::string& job_id, const std::string& reason) {
  auto c = pool_->acquire();
  pg::Transaction tx(*c);
  const pg::Result tomb = c->exec(std::string("INSERT INTO dropped(id, owner, reason, dropped_ms)"
                                              " SELECT id, owner, $2, ") +
                                      kNowMs +
                                      " FROM jobs WHERE id = $1 ON CONFLICT (id) DO UPDATE SET owner ="
                                      " EXCLUDED.owner, reason = EXCLUDED.reason, dropped_ms = EXCLUDED.dropped_ms,"
                                      " seq = DEFAULT RETURNING seq",
                                  {job_id, Param::bytes(reason)});
  if (tomb.rows() == 1) {  // bounded: the oldest tombstones go (seq has gaps, so at most kMaxTombstones stay)
    c->exec("DELETE FROM dropped WHERE seq <= $1", {tomb.int64(0, 0) - kMaxTombstones});
  }
  const pg::Result gone = c->exec("WITH d AS (DELETE FROM jobs WHERE id = $1 RETURNING id, client) SELECT " +
                                       notify_change_sql("id") + ", client FROM d",
                                   {job_id});  // chunks, events and segments cascade
  if (gone.rows() == 1) {  // a client none of whose jobs is left starts afresh (bounded: clients may be addresses)
    c->exec("DELETE FROM clients WHERE client = $1 AND NOT EXISTS (SELECT 1 FROM jobs WHERE client = $1)",
            {gone.text(0, 1)});
  }
  tx.commit();
}

std::optional<std::string> PostgresJobStore::dropped_reason(const std::string& job_id, const std::string& owner) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec("SELECT reason FROM dropped WHERE id = $1 AND owner = $2", {job_id, owner});
  if (r.rows() == 0) return std::nullopt;
  return r.text(0, 0);
}

std::vector<StoredJob> PostgresJobStore::load_jobs() const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("SELECT ") + kJobColumns + " FROM jobs ORDER BY ord");
  std::vector<StoredJob> out;
  for (int i = 0; i < r.rows(); ++i) out.push_back(job_from_row(r, i));
  return out;
}

std::vector<StoredChunk> PostgresJobStore::load_chunks(const std::string& job_id) const {
  auto c = pool_->acquire();
  const pg::Result r =
      c->exec("SELECT idx, replica, attempts, bytes FROM chunks WHERE job_id = $1 ORDER BY idx", {job_id});
  std::vector<StoredChunk> out;
  for (int i = 0; i < r.rows(); ++i) {
    out.push_back({r.int64(i, 0), r.text(i, 1), static_cast<int>(r.int64(i, 2)), r.text(i, 3)});
  }
  return out;
}

std::vector<StoredEvent> PostgresJobStore::load_events(const std::string& job_id) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec("SELECT seq, data FROM events WHERE job_id = $1 ORDER BY seq", {job_id});
  std::vector<StoredEvent> out;
  for (int i = 0; i < r.rows(); ++i) out.push_back({static_cast<uint64_t>(r.int64(i, 0)), r.text(i, 1)});
  return out;
}

std::optional<std::string> PostgresJobStore::load_chunk_bytes(const std::string& job_id, int64_t index) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec("SELECT bytes FROM chunks WHERE job_id = $1 AND idx = $2", {job_id, index});
  if (r.rows() == 0) return std::nullopt;
  return r.text(0, 0);
}

void PostgresJobStore::put_segment(const std::string& job_id, int64_t index, const std::string& bytes) {
  auto c = pool_->acquire();
  c->exec("INSERT INTO segments(job_id, idx, bytes) SELECT id, $2, $3 FROM jobs WHERE id = $1"
          " ON CONFLICT (job_id, idx) DO UPDATE SET bytes = EXCLUDED.bytes",
          {job_id, index, Param::bytes(bytes)});
}

std::optional<std::string> PostgresJobStore::load_segment(const std::string& job_id, int64_t index) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec("SELECT bytes FROM segments WHERE job_id = $1 AND idx = $2", {job_id, index});
  if (r.rows() == 0) return std::nullopt;
  return r.text(0, 0);
}

std::optional<int64_t> PostgresJobStore::blob_size(const std::string& job_id, Blob kind, int64_t index) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("SELECT octet_length(bytes)::bigint FROM ") +
                                   (kind == Blob::chunk ? "chunks" : "segments") + " WHERE job_id = $1 AND idx = $2",
                               {job_id, index});
  if (r.rows() == 0) return std::nullopt;
  return r.int64(0, 0);
}

// substring() of the bytea (a bytea is at most 1 GiB, so integer positions): only the piece crosses the connection (TOAST slices an uncompressed value; a compressed
// one is decompressed up to the piece's end by the server).
std::optional<std::string> PostgresJobStore::load_blob_range(const std::string& job_id, Blob kind, int64_t index,
                                                             int64_t offset, int64_t length) const {
  if (offset < 0 || length <= 0) {
    if (!blob_size(job_id, kind, index)) return std::nullopt;
    return std::string();
  }
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("SELECT substring(bytes FROM LEAST($3::bigint + 1, 1073741825)::integer"
                                   " FOR LEAST($4::bigint, 1073741824)::integer) FROM ") +
                                   (kind == Blob::chunk ? "chunks" : "segments") + " WHERE job_id = $1 AND idx = $2",
                               {job_id, index, offset, length});
  if (r.rows() == 0) return std::nullopt;
  return r.text(0, 0);
}

std::optional<std::string> PostgresJobStore::load_request(const std::string& job_id) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec("SELECT request FROM jobs WHERE id = $1", {job_id});
  if (r.rows() == 0) return std::nullopt;
  return r.text(0, 0);
}

bool PostgresJobStore::measure_clock() const {
  const auto wall_ms = [] {  // this pod's clock (LeaseStore::now_ms() of a store one process holds)
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  try {
    auto c = pool_->acquire();
    const int64_t before = wall_ms();
    const pg::Result r = c->exec(std::string("SELECT ") + kNowMs);
    const int64_t after = wall_ms();
    // The store's reading falls within the round trip: take its middle (off by half the round trip at most).
    clock_offset_ms_ = r.int64(0, 0) - (before + (after - before) / 2);
    return true;
  } catch (const StoreError&) {
    return false;
  }
}

}  // namespace skyreels::server
