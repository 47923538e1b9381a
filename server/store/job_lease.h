// Chunk leases: how the replicas of one server, or of several servers (pods) sharing one job store, split the chunks
// of its jobs without a coordinator. A replica claims the best ready chunk, renews its lease while the chunk runs (a
// heartbeat), and commits the result under the lease's token. A replica that dies stops renewing; once its lease
// expires another replica takes the chunk over with a higher token, so a late commit of the dead holder is refused
// (fencing) and every chunk is committed exactly once. Implemented by PostgresJobStore (shared by pods; the store's
// clock decides expiry, so pods' clocks never matter) and by LocalLeaseStore (job_lease_local.h: memory and SQLite,
// one process), so a single server runs the very scheduler a fleet runs.
//
// Claim order (the pure functions of dispatch_policy.h, over the whole store):
//   ready     = unfinished job (queued or running), cancel not requested, chunks_done < chunk_count, and no live lease
//               (none, released, or expired);
//   order     = policy::dispatch_before: priority desc, then the client's attained service asc (the store keeps it
//               per client, charged at each claim), then the job's (vbase + chunks_done) asc, then submission order;
//   affinity  = among the first kAffinityWindow ready jobs that tie with the first on priority AND attained service,
//               the first whose previous chunk ran on the claiming replica is taken (its state is already there);
//               else the first in order. Affinity never overrides the order itself, so jobs still interleave at chunk
//               boundaries (a long video cannot starve short ones). See claim_preference().
//   pass over = jobs the claiming server's placement rule (policy::choose_replica: the holder is idle, or busy for
//               less than a handoff costs; a chunk that just failed here) sends elsewhere;
//   adapters  = a shared store (PostgreSQL) also leaves a job with adapters, for a few seconds at most, to an idle
//               replica of ANOTHER pod that the same policy prefers (it holds more of the job's adapters, or ran the
//               job's previous chunk): each claim reports the adapters its replica holds (see leave_to_other_pod).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

// The queue limits an insert checks, atomically with it across every pod (0: no limit).
struct AdmissionLimits {
  int64_t max_unfinished = 0;   // queued or running jobs in the whole store
  int64_t max_for_client = 0;   // of those, StoredJob::client's
};

struct InsertOutcome {
  enum class Refusal { None, QueueFull, ClientQueueFull, IdTaken };
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
  static constexpr int kAffinityWindow = 4;
  static constexpr const char* kChangesChannel = "skyreels_jobs";  // NOTIFY payload: the job id

  virtual ~LeaseStore() = default;

  // The best ready chunk for `replica` (see the order above) among jobs not in `pass_over`, leased for `ttl`, in one
  // transaction; nullopt when no chunk is ready. Marks the job running (started_ms on its first chunk) and counts a
  // takeover as a retry and a handoff as a handoff in the stored job. Concurrent claims never get the same job.
  // `resident`: the adapters the claiming replica holds, null when it serves none (its report to other pods'
  // claims; a store one process holds ignores it: that server's own placement sees all of its replicas).
  virtual std::optional<ChunkLease> claim(const std::string& replica, std::chrono::milliseconds ttl,
                                          const std::vector<std::string>& pass_over = {},
                                          const std::vector<std::string>* resident = nullptr) = 0;
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
  // Where a waiting job stands in the claim order: `ahead` ready jobs go before it; position 0: it is not waiting
  // (running, finished, unknown).
  struct QueuePlace {
    int64_t position = 0;  // 1-based
    int64_t ahead = 0;
  };
  virtual QueuePlace queue_place(const std::string& job_id) const = 0;
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
};

// The affinity rule as a pure function. `candidates` are the first ready jobs in claim order; returns the indices to
// try, best first: within the leading run of jobs that tie with candidates[0] on priority and attained service (at
// most kAffinityWindow), the ones whose previous chunk ran on `replica`, then every candidate in order.
struct ClaimCandidate {
  int priority = 0;
  int64_t service = 0;  // vbase + chunks_done
  std::string previous_replica;
  int64_t client_service = 0;  // the job's client's (policy::JobKey::client_service)
};
std::vector<size_t> claim_preference(const std::vector<ClaimCandidate>& candidates, const std::string& replica);

// A replica of another pod as its last claim reported it (within the lease ttl): idle, and the adapters it holds.
struct ReplicaReport {
  std::string name;
  bool idle = false;
  std::vector<std::string> adapters;
};
// Whether `replica` (idle, holding `resident`) leaves a ready job that applies `job_adapters` to a replica of another
// pod: policy::choose_replica over the claimant and `others`, the job's holder being the one named
// `previous_replica`, picks one of `others`. A job without adapters is never left (the order decides it).
bool leave_to_other_pod(const std::vector<std::string>& job_adapters, const std::string& previous_replica,
                        const std::string& replica, const std::vector<std::string>& resident,
                        const std::vector<ReplicaReport>& others);
// How long a claim leaves one ready chunk to another pod's replica at most: several of that replica's claim polls
// (1 s), so it takes the chunk if it still can, and short against a chunk, so a report that is wrong (the replica
// passes the job over for its own reasons) costs this much once.
inline constexpr std::chrono::milliseconds kLeaveToOtherPodFor{3000};

// Inserts `job` under fresh ids from `new_id` until one is not taken (at most kIdAttempts; 128 random bits make a
// second attempt already astronomically rare). Returns the last outcome; job.id is the id it was tried under.
inline constexpr int kIdAttempts = 8;
InsertOutcome insert_with_fresh_ids(LeaseStore& store, StoredJob& job, const AdmissionLimits& limits,
                                    const std::function<std::string()>& new_id);

}  // namespace skyreels::server
