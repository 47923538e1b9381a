// PostgresLeaseStore (job_store_postgres.h), the LeaseStore seam over PostgresJobStore's database: what a claim reads
// (candidates, replicas' reports), the atomic lease, renew, the fenced commit, release, deadlines, retention, cancel,
// admission under one advisory lock, counts, events and NOTIFY. Every clock comparison is PostgreSQL's
// clock_timestamp() (kNowMs).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>

#include "server/store/job_store_postgres.h"
#include "server/store/job_store_postgres_sql.h"
#include "server/store/pg_db.h"

namespace skyreels::server {

namespace {

using namespace pg_sql;

// What policy::admit decides from, read under the admission lock (so that no pod's insert changes it meanwhile).
policy::AdmissionFacts admission_facts(pg::Connection& c, const std::string& client, const std::string& id) {
  const pg::Result r = c.exec(
      std::string("SELECT count(*), count(*) FILTER (WHERE client = $1),"
                  " min(vbase + chunks_done) FILTER (WHERE client = $1),"
                  " (SELECT min(service) FROM clients WHERE client IN (SELECT client FROM jobs WHERE ") +
          kUnfinished +
          ")),"
          " (SELECT service FROM clients WHERE client = $1),"
          " EXISTS (SELECT 1 FROM jobs WHERE id = $2 UNION ALL SELECT 1 FROM dropped WHERE id = $2)"
          " FROM jobs WHERE " +
          kUnfinished,
      {client, id});
  const auto optional = [&](int column) {
    return r.is_null(0, column) ? std::nullopt : std::optional<int64_t>(r.int64(0, column));
  };
  policy::AdmissionFacts facts;
  facts.unfinished = r.int64(0, 0);
  facts.unfinished_for_client = r.int64(0, 1);
  facts.least_client_fair_key = optional(2);
  facts.least_active_service = optional(3);
  facts.client_service = optional(4);
  facts.id_taken = r.boolean(0, 5);
  return facts;
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

PostgresLeaseStore::PostgresLeaseStore(std::unique_ptr<PostgresJobStore> records)
    : records_(std::move(records)), pool_(records_->pool_.get()) {}

PostgresLeaseStore::~PostgresLeaseStore() = default;

bool PostgresLeaseStore::reachable() const { return records_->measure_clock(); }

int64_t PostgresLeaseStore::now_ms() const { return LeaseStore::now_ms() + records_->clock_offset_ms_.load(); }

std::optional<StoredJob> PostgresLeaseStore::load_job(const std::string& job_id, bool with_request) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(
      "SELECT " + (with_request ? std::string(kJobColumns) : without_request_columns()) + " FROM jobs WHERE id = $1",
      {job_id});
  if (r.rows() == 0) return std::nullopt;
  return job_from_row(r, 0);
}

// ---- leases ----

void PostgresLeaseStore::report_replica(const std::string& replica, const std::vector<std::string>& resident,
                                        bool idle) {
  auto c = pool_->acquire();
  const std::string idle_sql = idle ? "true" : "false";
  c->exec("INSERT INTO replicas(name, idle, adapters, seen_ms) VALUES($1, " + idle_sql + ", $2, " + kNowMs +
              ") ON CONFLICT (name) DO UPDATE SET idle = " + idle_sql + ", adapters = $2, seen_ms = EXCLUDED.seen_ms",
          {replica, join_adapter_names(resident)});
  // Pods come and go under new names (a Deployment's pods): a report a day old is nobody's. Cleared as each replica
  // first reports, not at every claim.
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(reported_mu_);
    first = reported_.insert(replica).second;
  }
  if (first) c->exec(std::string("DELETE FROM replicas WHERE seen_ms < ") + kNowMs + " - 86400000");
}

std::vector<policy::ReplicaReport> PostgresLeaseStore::replica_reports(std::chrono::milliseconds within) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("SELECT name, idle, adapters FROM replicas WHERE seen_ms > ") + kNowMs +
                                   " - $1 ORDER BY name",
                               {static_cast<int64_t>(within.count())});
  std::vector<policy::ReplicaReport> reports;
  for (int i = 0; i < r.rows(); ++i) {
    reports.push_back({r.text(i, 0), r.boolean(i, 1), split_adapter_names(r.text(i, 2))});
  }
  return reports;
}

// Without locks: try_lease re-checks each job as it locks it.
std::vector<policy::ReadyJob> PostgresLeaseStore::candidates(int64_t limit) const {
  auto c = pool_->acquire();
  const pg::Result rows =
      c->exec("SELECT id, priority, vbase + chunks_done, ord, last_replica, COALESCE(cl.service, 0),"
              " COALESCE(cl.weight, 1), adapters, chunks_done FROM jobs LEFT JOIN clients cl ON cl.client = jobs.client"
              " WHERE " +
                  ready_condition() + " ORDER BY priority DESC, ord LIMIT $1",
              {limit});
  std::vector<policy::ReadyJob> ready;
  for (int i = 0; i < rows.rows(); ++i) {
    policy::ReadyJob j;
    j.id = rows.text(i, 0);
    j.key = {static_cast<int>(rows.int64(i, 1)), rows.int64(i, 2), static_cast<uint64_t>(rows.int64(i, 3)),
             rows.int64(i, 5)};
    j.previous_replica = rows.text(i, 4);
    j.client_weight = static_cast<int>(rows.int64(i, 6));
    j.adapters = split_adapter_names(rows.text(i, 7));
    j.chunks_done = rows.int64(i, 8);
    ready.push_back(std::move(j));
  }
  return ready;
}

// Locks the job's row only while it is still ready (SKIP LOCKED: a job another claim holds is passed over, never
// waited for), then leases it and charges its client, in one transaction.
std::optional<ChunkLease> PostgresLeaseStore::try_lease(const std::string& job_id, const std::string& replica,
                                                        std::chrono::milliseconds ttl, int64_t charge) {
  auto c = pool_->acquire();
  pg::Transaction tx(*c);
  const pg::Result locked =
      c->exec("SELECT lease_replica IS NOT NULL, last_replica FROM jobs WHERE id = $1 AND " + ready_condition() +
                  " FOR UPDATE SKIP LOCKED",
              {job_id});
  if (locked.rows() != 1) return std::nullopt;
  ChunkLease lease;
  lease.job_id = job_id;
  lease.takeover = locked.boolean(0, 0);
  lease.previous_replica = locked.text(0, 1);
  lease.handoff = !lease.previous_replica.empty() && lease.previous_replica != replica;
  const pg::Result u = c->exec(
      std::string("WITH u AS (UPDATE jobs SET lease_token = lease_token + 1, lease_replica = $2, lease_expires_ms = ") +
          kNowMs +
          " + $3, retries = retries + $4, handoffs = handoffs + $5, state = 'running',"
          " started_ms = CASE WHEN started_ms = 0 THEN " +
          kNowMs +
          " ELSE started_ms END WHERE id = $1 RETURNING chunks_done, chunk_count, lease_token, lease_expires_ms, client),"
          " charged AS (UPDATE clients SET service = service + $6 FROM u WHERE clients.client = u.client)"
          " SELECT chunks_done, chunk_count, lease_token, lease_expires_ms FROM u",
      {job_id, replica, static_cast<int64_t>(ttl.count()), int64_t{lease.takeover}, int64_t{lease.handoff}, charge});
  lease.chunk_index = u.int64(0, 0);
  lease.chunk_count = u.int64(0, 1);
  lease.token = static_cast<uint64_t>(u.int64(0, 2));
  lease.expires_ms = u.int64(0, 3);
  tx.commit();
  return lease;
}

LeaseRenewal PostgresLeaseStore::renew(const ChunkLease& lease, std::chrono::milliseconds ttl) {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("UPDATE jobs SET lease_expires_ms = ") + kNowMs +
                                   " + $3 WHERE id = $1 AND lease_token = $2 AND lease_replica IS NOT NULL"
                                   " RETURNING cancel_requested",
                               {lease.job_id, static_cast<int64_t>(lease.token), static_cast<int64_t>(ttl.count())});
  if (r.rows() == 0) return {};
  return {true, r.boolean(0, 0)};
}

LeaseCommit PostgresLeaseStore::commit(const ChunkLease& lease, const StoredChunk& chunk,
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

std::vector<std::string> PostgresLeaseStore::expire_deadlines() {
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

std::vector<LeaseStore::Retired> PostgresLeaseStore::finished_to_retire(int64_t finished_before_ms,
                                                                        int64_t keep) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("SELECT id, finished_ms < $1 FROM (SELECT id, finished_ms, row_number() OVER"
                                           " (ORDER BY finished_ms DESC) AS newer FROM jobs WHERE NOT ") +
                                   kUnfinished + ") f WHERE finished_ms < $1 OR newer > $2 ORDER BY finished_ms LIMIT 1000",
                               {finished_before_ms, keep});
  std::vector<Retired> out;
  for (int i = 0; i < r.rows(); ++i) out.push_back({r.text(i, 0), r.boolean(i, 1)});
  return out;
}

bool PostgresLeaseStore::release(const ChunkLease& lease) {
  auto c = pool_->acquire();
  const pg::Result r = c->exec("WITH u AS (UPDATE jobs SET lease_replica = NULL, lease_expires_ms = NULL"
                               " WHERE id = $1 AND lease_token = $2 AND lease_replica IS NOT NULL RETURNING id)"
                               " SELECT " +
                                   notify_change_sql("id") + " FROM u",
                               {lease.job_id, static_cast<int64_t>(lease.token)});
  return r.rows() == 1;
}

CancelState PostgresLeaseStore::request_cancel(const std::string& job_id, const std::string& owner) {
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

InsertOutcome PostgresLeaseStore::insert_job_once(const StoredJob& j, AdmissionLimits limits) {
  auto c = pool_->acquire();
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
  const policy::Admission admission = policy::admit(admission_facts(*c, j.client, j.id), limits, j.client_weight);
  if (admission.refused != policy::Refusal::None) {
    tx.commit();
    InsertOutcome refused;
    refused.refused = admission.refused;
    refused.unfinished = admission.count_at_limit;
    return refused;
  }
  c->exec("INSERT INTO clients(client, service, weight) VALUES($1, $2, $3)"
          " ON CONFLICT (client) DO UPDATE SET service = EXCLUDED.service, weight = EXCLUDED.weight",
          {j.client, admission.client_service, int64_t{admission.client_weight}});
  std::vector<Param> params = job_params(j);
  params[1] = admission.vbase;
  const pg::Result inserted =
      c->exec("WITH i AS (" + insert_job_sql("nextval('job_order')", "$2") +
                  " RETURNING id, fingerprint, ord, vbase, fingerprint_v2) SELECT id, fingerprint, ord, vbase,"
                  " fingerprint_v2, " + notify_change_sql("id") +
                  " FROM i",
              params);
  tx.commit();
  return insert_outcome(inserted, true);
}

AdmissionCounts PostgresLeaseStore::admission_counts(const std::string& client) const {
  auto c = pool_->acquire();
  const pg::Result r =
      c->exec(std::string("SELECT count(*), count(*) FILTER (WHERE client = $1) FROM jobs WHERE ") + kUnfinished,
              {client});
  return {r.int64(0, 0), r.int64(0, 1)};
}

std::vector<StoredJob> PostgresLeaseStore::jobs_of(const std::string& owner) const {
  auto c = pool_->acquire();
  const pg::Result r = c->exec(std::string("SELECT ") + without_request_columns() +
                                   " FROM jobs WHERE owner = $1 ORDER BY ord",
                               {owner});
  std::vector<StoredJob> out;
  for (int i = 0; i < r.rows(); ++i) out.push_back(job_from_row(r, i));
  return out;
}

int64_t PostgresLeaseStore::queue_depth() const {
  auto c = pool_->acquire();
  return c->exec("SELECT count(*) FROM jobs WHERE " + ready_condition()).int64(0, 0);
}

std::vector<uint64_t> PostgresLeaseStore::append_events(const std::string& job_id,
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

uint64_t PostgresLeaseStore::reserve_sequences(const std::string& job_id, int64_t count) {
  auto c = pool_->acquire();
  const pg::Result u = c->exec("UPDATE jobs SET next_seq = next_seq + $2 WHERE id = $1 RETURNING next_seq - $2 + 1",
                               {job_id, std::max<int64_t>(count, 0)});
  if (u.rows() == 0) throw StoreError("job store " + describe() + ": reserve_sequences: no job " + job_id);
  return static_cast<uint64_t>(u.int64(0, 0));
}

void PostgresLeaseStore::publish_step(const std::string& job_id, const StoredEvent& event) {
  auto c = pool_->acquire();
  c->exec("SELECT " + notify_sql("$1"), {job_id + "\n" + std::to_string(event.sequence) + "\n" + event.data});
}

std::unique_ptr<ChangeListener> PostgresLeaseStore::listen() {
  return std::make_unique<PgChangeListener>(records_->url_, records_->origin_);
}

std::string PostgresJobStore::notify_change_sql(const std::string& job_id) const {
  return notify_sql("(" + job_id + ")::text || E'\\n" + origin_ + "'");
}

}  // namespace skyreels::server
