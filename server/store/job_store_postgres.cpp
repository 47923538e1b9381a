#include "server/store/job_store_postgres.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <random>

#include "server/policy/dispatch_policy.h"
#include "server/store/pg_db.h"

namespace skyreels::server {

namespace {

using pg::Param;

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
constexpr const char* kNowMs = "(extract(epoch from clock_timestamp()) * 1000)::bigint";
constexpr const char* kUnfinished = "state IN ('queued', 'running')";
constexpr int64_t kAdmissionLockKey = 0x736b7972;  // pg_advisory_xact_lock key of submissions ("skyr")
// Claims read the ready jobs (at most this many, highest priority first) and order them by policy::dispatch_before.
constexpr int64_t kMaxClaimCandidates = 4096;
constexpr const char* kJobColumns =
    "id, ord, vbase, owner, client, priority, deadline_ms, idempotency_key, fingerprint, state, error_kind, error,"
    " created_ms, started_ms, finished_ms, chunk_count, chunks_done, retries, handoffs, request, fingerprint_v2,"
    " adapters";

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

// The fair-share start of a new job within its client ($4), as the in-memory scheduler sets it: the least attained
// service among the client's unfinished jobs (0 when none), over every pod's jobs.
std::string least_attained_service_sql() {
  return std::string("COALESCE((SELECT min(vbase + chunks_done) FROM jobs WHERE client = $4 AND ") + kUnfinished +
         "), 0)";
}

// The client's share (policy::client_share_start when it becomes active) and weight, before its job is inserted.
// Runs under the admission lock, so the active clients cannot change meanwhile.
void start_client_share(pg::Connection& c, const std::string& client, int weight) {
  const pg::Result own = c.exec(std::string("SELECT (SELECT service FROM clients WHERE client = $1),"
                                            " EXISTS (SELECT 1 FROM jobs WHERE client = $1 AND ") +
                                    kUnfinished + ")",
                                {client});
  int64_t service = own.is_null(0, 0) ? -1 : own.int64(0, 0);
  if (!own.boolean(0, 1)) {
    const pg::Result active = c.exec(std::string("SELECT service FROM clients WHERE client IN"
                                                 " (SELECT client FROM jobs WHERE ") +
                                     kUnfinished + ")");
    std::vector<int64_t> services;
    for (int i = 0; i < active.rows(); ++i) services.push_back(active.int64(i, 0));
    service = policy::client_share_start(service, services);
  }
  c.exec("INSERT INTO clients(client, service, weight) VALUES($1, $2, $3)"
         " ON CONFLICT (client) DO UPDATE SET service = EXCLUDED.service, weight = EXCLUDED.weight",
         {client, std::max<int64_t>(service, 0), int64_t{std::clamp(weight, 1, policy::kMaxClientWeight)}});
}

// Columns id, fingerprint, ord, vbase, fingerprint_v2.
InsertOutcome insert_outcome(const pg::Result& r, bool inserted) {
  InsertOutcome o;
  o.job_id = r.text(0, 0);
  o.inserted = inserted;
  o.fingerprint = static_cast<uint64_t>(r.int64(0, 1));
  o.order = static_cast<uint64_t>(r.int64(0, 2));
  o.vbase = r.int64(0, 3);
  o.fingerprint_v2 = r.text(0, 4);
  return o;
}

class PgChangeListener final : public ChangeListener {
 public:
  PgChangeListener(const std::string& url, std::string origin)
      : listener_(url, LeaseStore::kChangesChannel), origin_(std::move(origin)) {}
  // A payload is a job id, "ID\nORIGIN" for a change some store announced, or "ID\nSEQUENCE\nEVENT" for step
  // progress (publish_step). Changes this listener's own store announced are skipped.
  JobChanges wait(std::chrono::milliseconds timeout) override {
    pg::Listener::Batch batch = listener_.wait(timeout);
    JobChanges changes;
    changes.missed = batch.missed;
    for (std::string& payload : batch.payloads) {
      const size_t first = payload.find('\n');
      if (first == std::string::npos) {
        changes.job_ids.push_back(std::move(payload));
        continue;
      }
      const size_t second = payload.find('\n', first + 1);
      const std::string id = payload.substr(0, first);
      if (second == std::string::npos && payload.compare(first + 1, std::string::npos, origin_) == 0) continue;
      changes.job_ids.push_back(id);
      if (second == std::string::npos) continue;
      try {
        const uint64_t sequence = std::stoull(payload.substr(first + 1, second - first - 1));
        changes.steps.push_back({id, StoredEvent{sequence, payload.substr(second + 1)}});
      } catch (const std::exception&) {  // not ours: a hint about the job at most
      }
    }
    return changes;
  }

 private:
  pg::Listener listener_;
  std::string origin_;
};

}  // namespace

PostgresJobStore::PostgresJobStore(const std::string& url)
    : url_(url), origin_(new_origin()), pool_(std::make_unique<pg::Pool>(url, kConnections)) {
  migrate();
  reachable();  // the first clock offset, before anything is stamped
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

std::optional<StoredJob> PostgresJobStore::load_job(const std::string& job_id, bool with_request) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec("SELECT " + (with_request ? std::string(kJobColumns) : without_request_columns()) +
                                   " FROM jobs WHERE id = $1",
                               {job_id});
  if (r.rows() == 0) return std::nullopt;
  return job_from_row(r, 0);
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

// ---- leases ----

std::optional<ChunkLease> PostgresJobStore::claim(const std::string& replica, std::chrono::milliseconds ttl,
                                                  const std::vector<std::string>& pass_over,
                                                  const std::vector<std::string>* resident) {
  auto c = pool_->acquire();
  pg::Transaction tx(*c);
  report_replica(*c, replica, resident);
  std::optional<ChunkLease> lease = lease_locked_candidate(*c, replica, ttl, pass_over, resident);
  if (lease && resident) c->exec("UPDATE replicas SET idle = false WHERE name = $1", {replica});
  tx.commit();
  return lease;
}

void PostgresJobStore::report_replica(pg::Connection& c, const std::string& replica,
                                      const std::vector<std::string>* resident) {
  if (!resident) return;
  c.exec(std::string("INSERT INTO replicas(name, idle, adapters, seen_ms) VALUES($1, true, $2, ") + kNowMs +
             ") ON CONFLICT (name) DO UPDATE SET idle = true, adapters = $2, seen_ms = EXCLUDED.seen_ms",
         {replica, join_adapter_names(*resident)});
  // Pods come and go under new names (a Deployment's pods): a report a day old is nobody's. Cleared as each replica
  // first reports, not at every claim.
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(placement_mu_);
    first = reported_.insert(replica).second;
  }
  if (first) c.exec(std::string("DELETE FROM replicas WHERE seen_ms < ") + kNowMs + " - 86400000");
}

// The replicas of other pods that reported within `ttl` (a replica's name is "<pod>/<replica>"; this pod's own
// replicas are its scheduler's to place).
std::vector<ReplicaReport> PostgresJobStore::other_pods_replicas(pg::Connection& c, const std::string& replica,
                                                                 std::chrono::milliseconds ttl) const {
  const auto pod_of = [](const std::string& name) { return name.substr(0, name.find('/')); };
  const pg::Result r = c.exec(std::string("SELECT name, idle, adapters FROM replicas WHERE seen_ms > ") + kNowMs +
                                  " - $1 ORDER BY name",
                              {static_cast<int64_t>(ttl.count())});
  std::vector<ReplicaReport> others;
  for (int i = 0; i < r.rows(); ++i) {
    if (pod_of(r.text(i, 0)) == pod_of(replica)) continue;
    others.push_back({r.text(i, 0), r.boolean(i, 1), split_adapter_names(r.text(i, 2))});
  }
  return others;
}

bool PostgresJobStore::still_leaving(const std::string& key) {
  std::lock_guard<std::mutex> lock(placement_mu_);
  const int64_t now = now_ms();
  for (auto it = left_since_ms_.begin(); it != left_since_ms_.end();) {  // forget chunks long since claimed
    it = now - it->second > 60000 ? left_since_ms_.erase(it) : std::next(it);
  }
  const int64_t since = left_since_ms_.emplace(key, now).first->second;
  return now - since < kLeaveToOtherPodFor.count();
}

namespace {

struct ReadyJob {
  std::string id;
  policy::JobKey key;
  std::string last_replica;
  int weight = 1;
  std::vector<std::string> adapters;
  int64_t chunks_done = 0;
};

// The ready jobs (without locks) in the policy's order: dispatch_before over every pod's jobs.
std::vector<ReadyJob> ready_in_order(pg::Connection& c) {
  const pg::Result rows =
      c.exec("SELECT id, priority, vbase + chunks_done, ord, last_replica, COALESCE(cl.service, 0),"
             " COALESCE(cl.weight, 1), adapters, chunks_done FROM jobs LEFT JOIN clients cl ON cl.client = jobs.client"
             " WHERE " +
                 ready_condition() + " ORDER BY priority DESC, ord LIMIT $1",
             {kMaxClaimCandidates});
  std::vector<ReadyJob> ready;
  for (int i = 0; i < rows.rows(); ++i) {
    ready.push_back({rows.text(i, 0),
                     {static_cast<int>(rows.int64(i, 1)), rows.int64(i, 2), static_cast<uint64_t>(rows.int64(i, 3)),
                      rows.int64(i, 5)},
                     rows.text(i, 4),
                     static_cast<int>(rows.int64(i, 6)),
                     split_adapter_names(rows.text(i, 7)),
                     rows.int64(i, 8)});
  }
  std::stable_sort(ready.begin(), ready.end(),
                   [](const ReadyJob& a, const ReadyJob& b) { return policy::dispatch_before(a.key, b.key); });
  return ready;
}

}  // namespace

// Orders the ready jobs by the policy (dispatch_before, then the affinity rule), then locks ONE row in that order
// (SKIP LOCKED: a job another claim holds is passed over, never waited for); the row is re-checked as it locks, so a
// job claimed meanwhile drops out. The claim charges the job's client its chunk.
std::optional<ChunkLease> PostgresJobStore::lease_locked_candidate(pg::Connection& c, const std::string& replica,
                                                                   std::chrono::milliseconds ttl,
                                                                   const std::vector<std::string>& pass_over,
                                                                   const std::vector<std::string>* resident) {
  const std::string ready = ready_condition();
  std::vector<ReadyJob> jobs = ready_in_order(c);
  jobs.erase(std::remove_if(jobs.begin(), jobs.end(),
                            [&](const ReadyJob& j) {
                              return std::find(pass_over.begin(), pass_over.end(), j.id) != pass_over.end();
                            }),
             jobs.end());
  const bool with_adapters =
      std::any_of(jobs.begin(), jobs.end(), [](const ReadyJob& j) { return !j.adapters.empty(); });
  if (with_adapters) {
    const std::vector<ReplicaReport> others = other_pods_replicas(c, replica, ttl);
    jobs.erase(std::remove_if(jobs.begin(), jobs.end(),
                              [&](const ReadyJob& j) {
                                return leave_to_other_pod(j.adapters, j.last_replica, replica,
                                                          resident ? *resident : std::vector<std::string>(), others) &&
                                       still_leaving(j.id + "#" + std::to_string(j.chunks_done));
                              }),
               jobs.end());
  }
  if (jobs.empty()) return std::nullopt;
  std::vector<ClaimCandidate> candidates;
  for (const ReadyJob& j : jobs) {
    candidates.push_back({j.key.priority, j.key.fair_key, j.last_replica, j.key.client_service});
  }
  const std::string lock_columns = "SELECT id, lease_replica IS NOT NULL, last_replica FROM jobs WHERE ";
  std::optional<pg::Result> locked;
  const ReadyJob* chosen = nullptr;
  for (size_t i : claim_preference(candidates, replica)) {
    chosen = &jobs[i];
    pg::Result r = c.exec(lock_columns + "id = $1 AND " + ready + " FOR UPDATE SKIP LOCKED", {chosen->id});
    if (r.rows() == 1) {
      locked = std::move(r);
      break;
    }
  }
  if (!locked) return std::nullopt;
  const int64_t charge = policy::charge_chunk(chosen->weight);
  ChunkLease lease;
  lease.job_id = locked->text(0, 0);
  lease.takeover = locked->boolean(0, 1);
  lease.previous_replica = locked->text(0, 2);
  lease.handoff = !lease.previous_replica.empty() && lease.previous_replica != replica;
  const pg::Result u = c.exec(
      std::string("WITH u AS (UPDATE jobs SET lease_token = lease_token + 1, lease_replica = $2, lease_expires_ms = ") +
          kNowMs +
          " + $3, retries = retries + $4, handoffs = handoffs + $5, state = 'running',"
          " started_ms = CASE WHEN started_ms = 0 THEN " +
          kNowMs +
          " ELSE started_ms END WHERE id = $1 RETURNING chunks_done, chunk_count, lease_token, lease_expires_ms, client),"
          " charged AS (UPDATE clients SET service = service + $6 FROM u WHERE clients.client = u.client)"
          " SELECT chunks_done, chunk_count, lease_token, lease_expires_ms FROM u",
      {lease.job_id, replica, static_cast<int64_t>(ttl.count()), int64_t{lease.takeover}, int64_t{lease.handoff},
       charge});
  lease.chunk_index = u.int64(0, 0);
  lease.chunk_count = u.int64(0, 1);
  lease.token = static_cast<uint64_t>(u.int64(0, 2));
  lease.expires_ms = u.int64(0, 3);
  return lease;
}

LeaseRenewal PostgresJobStore::renew(const ChunkLease& lease, std::chrono::milliseconds ttl) {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("UPDATE jobs SET lease_expires_ms = ") + kNowMs +
                                   " + $3 WHERE id = $1 AND lease_token = $2 AND lease_replica IS NOT NULL"
                                   " RETURNING cancel_requested",
                               {lease.job_id, static_cast<int64_t>(lease.token), static_cast<int64_t>(ttl.count())});
  if (r.rows() == 0) return {};
  return {true, r.boolean(0, 0)};
}

LeaseCommit PostgresJobStore::commit(const ChunkLease& lease, const StoredChunk& chunk,
                                     const std::vector<std::string>& events) {
  auto c = pool_->acquire();
  pg::Transaction tx(*c);
  // The fence: the job row locked under the current token, so that no takeover slips in before COMMIT.
  const pg::Result held = c->exec(
      "SELECT chunks_done FROM jobs WHERE id = $1 AND lease_token = $2 AND lease_replica IS NOT NULL FOR UPDATE",
      {lease.job_id, static_cast<int64_t>(lease.token)});
  if (held.rows() == 0 || held.int64(0, 0) != chunk.index || chunk.index != lease.chunk_index) return {};
  c->exec("INSERT INTO chunks(job_id, idx, replica, attempts, bytes) VALUES($1, $2, $3, $4, $5)",
          {lease.job_id, chunk.index, chunk.replica, chunk.attempts, Param::bytes(chunk.bytes)});
  const pg::Result u = c->exec(
      std::string("UPDATE jobs SET chunks_done = $2 + 1, lease_replica = NULL, lease_expires_ms = NULL,"
                  " last_replica = $3, next_seq = next_seq + $4,"
                  // The last chunk ends the job in the same transaction: no pod can die between the two.
                  " state = CASE WHEN $2 + 1 >= chunk_count THEN 'succeeded' ELSE state END,"
                  " finished_ms = CASE WHEN $2 + 1 >= chunk_count THEN ") +
          kNowMs + " ELSE finished_ms END WHERE id = $1 RETURNING next_seq",
      {lease.job_id, chunk.index, chunk.replica, static_cast<int64_t>(events.size())});
  LeaseCommit out{true, {}};
  uint64_t seq = static_cast<uint64_t>(u.int64(0, 0)) - events.size();
  for (const std::string& data : events) {
    out.sequences.push_back(++seq);
    c->exec("INSERT INTO events(job_id, seq, data) VALUES($1, $2, $3)",
            {lease.job_id, static_cast<int64_t>(seq), Param::bytes(data)});
  }
  // The replica is idle again as its chunk commits (when it reports at all): another pod's claim that comes before
  // its own next one leaves the job's next chunk to it, where the job's state and adapters are.
  c->exec(std::string("UPDATE replicas SET idle = true, seen_ms = ") + kNowMs + " WHERE name = $1", {chunk.replica});
  c->exec("SELECT " + notify_change_sql("$1"), {lease.job_id});
  tx.commit();
  return out;
}

std::vector<std::string> PostgresJobStore::expire_deadlines() {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("WITH u AS (UPDATE jobs SET state = 'deadline_exceeded',"
                                           " error_kind = 'deadline_exceeded', error = $1, finished_ms = ") +
                                   kNowMs + " WHERE " + kUnfinished + " AND deadline_ms IS NOT NULL AND deadline_ms <= " +
                                   kNowMs + " AND (lease_replica IS NULL OR lease_expires_ms <= " + kNowMs +
                                   ") RETURNING id) SELECT id, " + notify_change_sql("id") + " FROM u",
                               {Param::bytes(std::string("deadline passed while queued"))});
  std::vector<std::string> ids;
  for (int i = 0; i < r.rows(); ++i) ids.push_back(r.text(i, 0));
  return ids;
}

std::vector<LeaseStore::Retired> PostgresJobStore::finished_to_retire(int64_t finished_before_ms, int64_t keep) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("SELECT id, finished_ms < $1 FROM (SELECT id, finished_ms, row_number() OVER"
                                           " (ORDER BY finished_ms DESC) AS newer FROM jobs WHERE NOT ") +
                                   kUnfinished + ") f WHERE finished_ms < $1 OR newer > $2 ORDER BY finished_ms LIMIT 1000",
                               {finished_before_ms, keep});
  std::vector<Retired> out;
  for (int i = 0; i < r.rows(); ++i) out.push_back({r.text(i, 0), r.boolean(i, 1)});
  return out;
}

bool PostgresJobStore::release(const ChunkLease& lease) {
  auto c = pool_->acquire();
  const pg::Result r = c->exec("WITH u AS (UPDATE jobs SET lease_replica = NULL, lease_expires_ms = NULL"
                               " WHERE id = $1 AND lease_token = $2 AND lease_replica IS NOT NULL RETURNING id)"
                               " SELECT " +
                                   notify_change_sql("id") + " FROM u",
                               {lease.job_id, static_cast<int64_t>(lease.token)});
  return r.rows() == 1;
}

CancelState PostgresJobStore::request_cancel(const std::string& job_id, const std::string& owner) {
  auto c = pool_->acquire();
  pg::Transaction tx(*c);
  const pg::Result r = c->exec(std::string("UPDATE jobs SET cancel_requested = true WHERE id = $1 AND owner = $2 AND ") +
                                   kUnfinished + " RETURNING lease_replica IS NOT NULL AND lease_expires_ms > " +
                                   kNowMs,
                               {job_id, owner});
  CancelState state = CancelState::Unknown;
  if (r.rows() == 1) {
    state = r.boolean(0, 0) ? CancelState::Running : CancelState::Idle;
    c->exec("SELECT " + notify_change_sql("$1"), {job_id});
  } else if (c->exec("SELECT 1 FROM jobs WHERE id = $1 AND owner = $2", {job_id, owner}).rows() == 1) {
    state = CancelState::AlreadyFinished;
  }
  tx.commit();
  return state;
}

InsertOutcome PostgresJobStore::insert_job_once(const StoredJob& j, AdmissionLimits limits) {
  auto c = pool_->acquire();
  const std::vector<Param> params = job_params(j);
  pg::Transaction tx(*c);
  // Submissions of every pod queue here for the few statements below, so that a count and its insert are one step.
  c->exec("SELECT pg_advisory_xact_lock($1)", {kAdmissionLockKey});
  if (!j.idempotency_key.empty()) {
    const pg::Result existing =
        c->exec("SELECT id, fingerprint, ord, vbase, fingerprint_v2 FROM jobs WHERE owner = $1 AND idempotency_key = $2",
                {j.owner, Param::bytes(j.idempotency_key)});
    if (existing.rows() == 1) {
      tx.commit();
      return insert_outcome(existing, false);
    }
  }
  if (limits.max_unfinished > 0 || limits.max_for_client > 0) {
    const pg::Result n =
        c->exec(std::string("SELECT count(*), count(*) FILTER (WHERE client = $1) FROM jobs WHERE ") + kUnfinished,
                {j.client});
    InsertOutcome refused;
    if (limits.max_unfinished > 0 && n.int64(0, 0) >= limits.max_unfinished) {
      refused.refused = InsertOutcome::Refusal::QueueFull;
      refused.unfinished = n.int64(0, 0);
    } else if (limits.max_for_client > 0 && n.int64(0, 1) >= limits.max_for_client) {
      refused.refused = InsertOutcome::Refusal::ClientQueueFull;
      refused.unfinished = n.int64(0, 1);
    }
    if (refused.refused != InsertOutcome::Refusal::None) {
      tx.commit();
      return refused;
    }
  }
  if (c->exec("SELECT 1 FROM jobs WHERE id = $1 UNION ALL SELECT 1 FROM dropped WHERE id = $1", {j.id}).rows() > 0) {
    tx.commit();
    InsertOutcome taken;
    taken.refused = InsertOutcome::Refusal::IdTaken;
    return taken;
  }
  start_client_share(*c, j.client, j.client_weight);
  const pg::Result inserted =
      c->exec("WITH i AS (" + insert_job_sql("nextval('job_order')", least_attained_service_sql()) +
                  " RETURNING id, fingerprint, ord, vbase, fingerprint_v2) SELECT id, fingerprint, ord, vbase,"
                  " fingerprint_v2, " + notify_change_sql("id") +
                  " FROM i",
              params);
  tx.commit();
  return insert_outcome(inserted, true);
}

AdmissionCounts PostgresJobStore::admission_counts(const std::string& client) const {
  auto c = pool_->acquire();
  const pg::Result r =
      c->exec(std::string("SELECT count(*), count(*) FILTER (WHERE client = $1) FROM jobs WHERE ") + kUnfinished,
              {client});
  return {r.int64(0, 0), r.int64(0, 1)};
}

LeaseStore::QueuePlace PostgresJobStore::queue_place(const std::string& job_id) const {
  auto c = pool_->acquire();
  const std::vector<ReadyJob> jobs = ready_in_order(*c);
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (jobs[i].id == job_id) return {static_cast<int64_t>(i) + 1, static_cast<int64_t>(i)};
  }
  return {};
}

std::vector<StoredJob> PostgresJobStore::jobs_of(const std::string& owner) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("SELECT ") + without_request_columns() +
                                   " FROM jobs WHERE owner = $1 ORDER BY ord",
                               {owner});
  std::vector<StoredJob> out;
  for (int i = 0; i < r.rows(); ++i) out.push_back(job_from_row(r, i));
  return out;
}

std::optional<std::string> PostgresJobStore::load_request(const std::string& job_id) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec("SELECT request FROM jobs WHERE id = $1", {job_id});
  if (r.rows() == 0) return std::nullopt;
  return r.text(0, 0);
}

int64_t PostgresJobStore::queue_depth() const {
  auto c = pool_->acquire();
  return c->exec("SELECT count(*) FROM jobs WHERE " + ready_condition()).int64(0, 0);
}

std::vector<uint64_t> PostgresJobStore::append_events(const std::string& job_id,
                                                      const std::vector<std::string>& events) {
  auto c = pool_->acquire();
  pg::Transaction tx(*c);
  const pg::Result u = c->exec("UPDATE jobs SET next_seq = next_seq + $2 WHERE id = $1 RETURNING next_seq",
                               {job_id, static_cast<int64_t>(events.size())});
  if (u.rows() == 0) throw StoreError("job store " + describe() + ": append_events: no job " + job_id);
  std::vector<uint64_t> sequences;
  uint64_t seq = static_cast<uint64_t>(u.int64(0, 0)) - events.size();
  for (const std::string& data : events) {
    sequences.push_back(++seq);
    c->exec("INSERT INTO events(job_id, seq, data) VALUES($1, $2, $3)",
            {job_id, static_cast<int64_t>(seq), Param::bytes(data)});
  }
  tx.commit();
  return sequences;
}

uint64_t PostgresJobStore::reserve_sequences(const std::string& job_id, int64_t count) {
  auto c = pool_->acquire();
  const pg::Result u = c->exec("UPDATE jobs SET next_seq = next_seq + $2 WHERE id = $1 RETURNING next_seq - $2 + 1",
                               {job_id, std::max<int64_t>(count, 0)});
  if (u.rows() == 0) throw StoreError("job store " + describe() + ": reserve_sequences: no job " + job_id);
  return static_cast<uint64_t>(u.int64(0, 0));
}

void PostgresJobStore::publish_step(const std::string& job_id, const StoredEvent& event) {
  auto c = pool_->acquire();
  c->exec("SELECT " + notify_sql("$1"), {job_id + "\n" + std::to_string(event.sequence) + "\n" + event.data});
}

std::unique_ptr<ChangeListener> PostgresJobStore::listen() { return std::make_unique<PgChangeListener>(url_, origin_); }

std::string PostgresJobStore::notify_change_sql(const std::string& job_id) const {
  return notify_sql("(" + job_id + ")::text || E'\\n" + origin_ + "'");
}

bool PostgresJobStore::reachable() const {
  try {
    auto c = pool_->acquire();
    const int64_t before = LeaseStore::now_ms();
    const pg::Result r = c->exec(std::string("SELECT ") + kNowMs);
    const int64_t after = LeaseStore::now_ms();
    // The store's reading falls within the round trip: take its middle (off by half the round trip at most).
    clock_offset_ms_ = r.int64(0, 0) - (before + (after - before) / 2);
    return true;
  } catch (const StoreError&) {
    return false;
  }
}

int64_t PostgresJobStore::now_ms() const { return LeaseStore::now_ms() + clock_offset_ms_.load(); }

}  // namespace skyreels::server
