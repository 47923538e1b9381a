// Chunk leases: how the replicas of one server, or of several servers (pods) sharing one job store, split the chunks
// of its jobs without a coordinator. A replica claims the best ready chunk, renews its lease while the chunk runs (a
// heartbeat), and commits the result under the lease's token. A replica that dies stops renewing; once its lease
// expires another replica takes the chunk over with a higher token, so a late commit of the dead holder is refused
// (fencing) and every chunk is committed exactly once. Implemented by PostgresLeaseStore (job_store_postgres.h: shared
// by pods; the store's clock decides expiry, so pods' clocks never matter) and by LocalLeaseStore (job_lease_local.h:
// memory and SQLite, one process), so a single server runs the very scheduler a fleet runs. A lease store is not a
// JobStore: it holds the records (JobStore) it leases the jobs of, and hands them out as records().
//
// The claim (LeaseStore::claim): the store reports its ready jobs (candidates) and the replicas of other pods
// (replica_reports); the pure functions of policy/claim_order.h decide the order to try them in (dispatch order,
// affinity, placement across pods); the store leases the first that is still ready, atomically (try_lease). Every
// store runs the same claim; each only says what is there and leases.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "server/policy/admission.h"
#include "server/policy/claim_order.h"
#include "server/store/job_store.h"

namespace skyreels::server {

struct ChunkLease {
  std::string job_id;
  int64_t chunk_index = 0;  // the job's chunks_done when claimed
  int64_t chunk_count = 0;
  uint64_t token = 0;       // strictly increasing per job: fences every call made under an older lease
  int64_t expires_ms = 0;   // store clock, ms since the Unix epoch; renew well before (e.g. every ttl / 3)
  bool takeover = false;    // the chunk's previous lease expired unreleased (its holder died): counted as a retry
  bool handoff = false;     // the job's previous chunk ran on another replica: counted as a handoff
  std::string previous_replica;  // the replica that ran the job's previous chunk ("" when none)
};

struct LeaseRenewal {
  bool held = false;              // false: the lease was lost (taken over, committed, released or the job dropped)
  bool cancel_requested = false;  // some pod asked to cancel the job: stop the chunk, then end the job
};

struct LeaseCommit {
  bool committed = false;           // false: the token is stale (nothing was stored)
  std::vector<uint64_t> sequences;  // those given to the commit's events, in order
};

// What request_cancel() found. Running: a replica holds a live lease and sees the request at its next renew. Idle:
// no live lease (and none can be claimed any more): the caller ends the job (update_job).
enum class CancelState { Unknown, AlreadyFinished, Running, Idle };

// The queue limits an insert checks, atomically with it across every pod (policy::admit decides).
using AdmissionLimits = policy::AdmissionLimits;

struct InsertOutcome {
  using Refusal = policy::Refusal;
  std::string job_id;  // the job now stored under (owner, idempotency_key): the new one or the one already there
  bool inserted = false;
  uint64_t fingerprint = 0;  // of the stored job's request (differs from the caller's: the key was reused)
  std::string fingerprint_v2;  // the stored job's ("" when stored before v2)
  uint64_t order = 0;        // the stored job's submission order
  int64_t vbase = 0;         // the stored job's fair-share start
  Refusal refused = Refusal::None;  // not inserted because a limit was reached (job_id empty)
  int64_t unfinished = 0;           // refused: the count that reached the limit
};

struct AdmissionCounts {
  int64_t unfinished = 0;             // queued or running, all clients, all pods
  int64_t unfinished_for_client = 0;  // of those, StoredJob::client == the one asked about
};

// Jobs changed somewhere (any pod): inserted, chunk committed or released, cancel requested, updated, dropped.
struct JobChanges {
  std::vector<std::string> job_ids;  // in arrival order, may repeat
  bool missed = false;               // the listening connection was lost meanwhile: re-read what matters
  // Step progress some pod published (LeaseStore::publish_step): (job id, event); the job is in job_ids too.
  std::vector<std::pair<std::string, StoredEvent>> steps;
};

// One LISTEN connection; used by one thread. Notifications are only hints: poll as well (a lease expiring sends none).
class ChangeListener {
 public:
  virtual ~ChangeListener() = default;
  // Returns at once when changes are pending, else waits up to `timeout` (empty job_ids: timed out).
  virtual JobChanges wait(std::chrono::milliseconds timeout) = 0;
};

class LeaseStore {
 public:
  static constexpr const char* kChangesChannel = "skyreels_jobs";  // NOTIFY payload: the job id

  virtual ~LeaseStore() = default;

  // The records this store leases the jobs of (jobs, chunks, events, segments), which it holds. Every read and write
  // of them goes through here: a store one process holds keeps its rows and events in step (job_lease_local.h).
  virtual JobStore& records() = 0;

  // The best ready chunk for `replica` among jobs not in `pass_over` (policy::claim_order over candidates() and the
  // other pods' replica_reports()), leased for `ttl` by try_lease; nullopt when no chunk is ready. `resident`: the
  // adapters the claiming replica holds, null when it serves none (reported for other pods' claims; a store one
  // process holds keeps no reports: that server's own placement sees all of its replicas).
  std::optional<ChunkLease> claim(const std::string& replica, std::chrono::milliseconds ttl,
                                  const std::vector<std::string>& pass_over = {},
                                  const std::vector<std::string>* resident = nullptr);
  // The ready jobs (unfinished, cancel not requested, chunks_done < chunk_count, no live lease: none, released or
  // expired), at most `limit`, highest priority first, then by submission order; the client's attained service and
  // weight as they are now.
  virtual std::vector<policy::ReadyJob> candidates(int64_t limit) const = 0;
  // Leases the job's next chunk for `ttl` if it is still ready, atomically: marks the job running (started_ms on its
  // first chunk), counts a takeover (its previous lease expired unreleased) as a retry and a handoff (its previous
  // chunk ran on another replica) as a handoff in the stored job, and adds `charge` to its client's attained service.
  // Concurrent calls never lease the same chunk twice; nullopt when the job is no longer ready.
  virtual std::optional<ChunkLease> try_lease(const std::string& job_id, const std::string& replica,
                                              std::chrono::milliseconds ttl, int64_t charge) = 0;
  // A replica's report for other pods' claims: idle or not, and the adapters it holds. Kept by a shared store only.
  virtual void report_replica(const std::string& /*replica*/, const std::vector<std::string>& /*resident*/,
                              bool /*idle*/) {}
  // The reports made within `within`, every pod's (policy::other_pods picks the other pods').
  virtual std::vector<policy::ReplicaReport> replica_reports(std::chrono::milliseconds /*within*/) const { return {}; }
  // Heartbeat: extends the lease to now + ttl while it is still the job's current one.
  virtual LeaseRenewal renew(const ChunkLease& lease, std::chrono::milliseconds ttl) = 0;
  // The chunk's result (chunk.index must be lease.chunk_index), chunks_done = index + 1 and `events` (stored with
  // sequence numbers allocated here), atomically, and the lease ends. Fenced: a lease that is no longer current
  // commits nothing.
  virtual LeaseCommit commit(const ChunkLease& lease, const StoredChunk& chunk,
                             const std::vector<std::string>& events) = 0;
  // Drain: gives the chunk back unrun; the next claim is neither a takeover nor a retry. False when already lost.
  virtual bool release(const ChunkLease& lease) = 0;
  // Ends every unfinished job whose deadline passed and that no live lease holds (DEADLINE_EXCEEDED, finished now);
  // returns their ids. Whichever pod calls it first does it.
  virtual std::vector<std::string> expire_deadlines() = 0;
  // Retention over the whole store: finished jobs that ended before `finished_before_ms`, then the oldest finished
  // beyond the newest `keep`; each with its reason for drop_job(). Whichever pod calls it first drops them.
  struct Retired {
    std::string job_id;
    bool expired = false;  // by age (else by count)
  };
  virtual std::vector<Retired> finished_to_retire(int64_t finished_before_ms, int64_t keep) const = 0;
  // From any pod; `owner` must match the job's.
  virtual CancelState request_cancel(const std::string& job_id, const std::string& owner) = 0;

  // Atomic idempotent submit: with a non-empty idempotency_key, the second insert of (owner, key) stores nothing and
  // returns the job already there. The store allocates the submission order and the fair-share start (vbase: the
  // least attained service among unfinished jobs, 0 when none); job.order and job.vbase are ignored.
  // `limits` are checked in the same transaction, serialised across pods, so the queue limit holds globally; a key
  // naming an existing job returns that job whatever the limits.
  // An id that is already taken (a live job or a tombstone) stores nothing and answers Refusal::IdTaken: the caller
  // retries with a fresh id (insert_with_fresh_ids).
  virtual InsertOutcome insert_job_once(const StoredJob& job, AdmissionLimits limits = {}) = 0;
  virtual AdmissionCounts admission_counts(const std::string& client) const = 0;
  // Unfinished jobs without a live lease (waiting for a replica), all pods.
  virtual int64_t queue_depth() const = 0;
  // Where a waiting job stands in the claim order (policy::dispatch_position over candidates()): `ahead` ready jobs
  // go before it; position 0: it is not waiting (running, finished, unknown, or beyond the claim window).
  struct QueuePlace {
    int64_t position = 0;  // 1-based
    int64_t ahead = 0;
  };
  QueuePlace queue_place(const std::string& job_id) const;
  // The owner's jobs without their requests, in submission order.
  virtual std::vector<StoredJob> jobs_of(const std::string& owner) const = 0;
  // True when other servers share the store (PostgreSQL): a draining server stops claiming and leaves queued jobs to
  // them. False (memory, SQLite): this server is the only one, so it finishes what it admitted.
  virtual bool shared() const = 0;
  // with_request false: StoredJob::request stays empty (reads that only need the job's state skip megabytes).
  virtual std::optional<StoredJob> load_job(const std::string& job_id, bool with_request = true) const = 0;

  // Event sequence numbers are allocated per job in the store, so they stay monotonic across pods. append_events
  // stores events under fresh numbers (returned); reserve_sequences hands out `count` numbers for events that are
  // not stored (steps) and returns the first. Both throw StoreError for an unknown job.
  virtual std::vector<uint64_t> append_events(const std::string& job_id, const std::vector<std::string>& events) = 0;
  virtual uint64_t reserve_sequences(const std::string& job_id, int64_t count) = 0;

  // Step progress of a chunk running here, for watchers on every pod: a notification only (nothing is stored), with
  // a sequence number from reserve_sequences. Callers coalesce (a few per second per chunk at most).
  virtual void publish_step(const std::string& job_id, const StoredEvent& event) = 0;
  // A LISTEN on kChangesChannel over its own connection.
  virtual std::unique_ptr<ChangeListener> listen() = 0;
  // Readiness: the store answers now (false during an outage or a reconnect back-off).
  virtual bool reachable() const = 0;
  // The store's clock, ms since the Unix epoch, without a store call: every wall-clock stamp and comparison that
  // another pod may read (created, finished, deadlines, retention, event times) uses it, so that pods whose clocks
  // disagree still agree on what is due. A store one process holds: this process's clock.
  virtual int64_t now_ms() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch()).count();
  }

 private:
  std::mutex left_mu_;
  policy::LeftChunks left_;  // chunks this process's claims left to other pods
};

// The LeaseStore calls every lease store makes against its store (one per kLeaseStoreOps name but report_replica and
// replica_reports, which a store one process holds leaves to their defaults), declared once: the lease stores and
// the timing wrapper name this in their public part instead of restating the list.
#define SKYREELS_LEASE_STORE_CALLS                                                                                 \
  std::vector<policy::ReadyJob> candidates(int64_t limit) const override;                                          \
  std::optional<ChunkLease> try_lease(const std::string& job_id, const std::string& replica,                       \
                                      std::chrono::milliseconds ttl, int64_t charge) override;                     \
  LeaseRenewal renew(const ChunkLease& lease, std::chrono::milliseconds ttl) override;                             \
  LeaseCommit commit(const ChunkLease& lease, const StoredChunk& chunk,                                            \
                     const std::vector<std::string>& events) override;                                             \
  bool release(const ChunkLease& lease) override;                                                                 \
  std::vector<std::string> expire_deadlines() override;                                                            \
  std::vector<Retired> finished_to_retire(int64_t finished_before_ms, int64_t keep) const override;                \
  CancelState request_cancel(const std::string& job_id, const std::string& owner) override;                        \
  InsertOutcome insert_job_once(const StoredJob& job, AdmissionLimits limits = {}) override;                       \
  AdmissionCounts admission_counts(const std::string& client) const override;                                      \
  int64_t queue_depth() const override;                                                                            \
  std::vector<StoredJob> jobs_of(const std::string& owner) const override;                                         \
  std::optional<StoredJob> load_job(const std::string& job_id, bool with_request = true) const override;           \
  std::vector<uint64_t> append_events(const std::string& job_id, const std::vector<std::string>& events) override; \
  uint64_t reserve_sequences(const std::string& job_id, int64_t count) override;                                   \
  void publish_step(const std::string& job_id, const StoredEvent& event) override

// The leases over `records` (as open_job_store() made them), which then hold them: PostgreSQL's own (shared by pods),
// else a LocalLeaseStore (memory, SQLite: one process holds the store; `finished_event`: see LocalLeaseStore).
std::unique_ptr<LeaseStore> lease_store_over(std::unique_ptr<JobStore> records, std::string finished_event);

// Inserts `job` under fresh ids from `new_id` until one is not taken (at most kIdAttempts; 128 random bits make a
// second attempt already astronomically rare). Returns the last outcome; job.id is the id it was tried under.
inline constexpr int kIdAttempts = 8;
InsertOutcome insert_with_fresh_ids(LeaseStore& store, StoredJob& job, const AdmissionLimits& limits,
                                    const std::function<std::string()>& new_id);

}  // namespace skyreels::server
