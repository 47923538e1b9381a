// The chunk scheduler: the one JobQueue (job_queue.h), for one server and for many pods alike. No pod owns a job:
// the store is the queue. Every server accepts submissions (the queue limit and idempotency keys are the store's,
// so global), answers reads and waits for any job from the store (woken by the store's change notifications, polling
// as a fallback), and its idle replicas claim chunk leases (job_lease.h): the store orders the ready chunks by the
// pure policy (dispatch_policy.h), this server's placement rule passes over jobs it sends to another of its replicas,
// a heartbeat renews the lease while the chunk runs, and the result commits under the lease's token, so a replica
// that lost its lease (its pod died, or paused past the expiry) commits nothing and each chunk is committed once.
// Memory and SQLite stores get their leases from LocalLeaseStore (with_leases()), PostgreSQL has its own.
//
// Policy, whatever the store:
//  1. Order: priority, then the client's attained service (a tenant with many jobs gets one share, weighted), then
//     the job's within its client (a long video cannot starve short ones; jobs interleave at chunk boundaries), then
//     submission order. Among jobs that tie, the one whose previous chunk ran on the claiming replica.
//  2. Placement (policy::choose_replica): a job whose payload is on one of this server's replicas stays there when
//     that replica is idle, or busy for less than a handoff costs; a chunk that failed is retried on another replica
//     when there is one. A moved job counts a handoff; a taken-over lease (its holder died) counts a retry.
//  3. Retries are bounded (policy::should_retry); the pool takes a failing replica out and re-tests it.
//  4. Deadlines are checked at claim and at every step, cancellation at every step (from any pod).
//  5. Queue position, ETA and retry-after hints come from policy::queue_eta / retry_after_seconds.
//
// What stays in this server: the replicas (ReplicaPool), the payload of jobs whose previous chunk ran here (their
// latents are already on the device; any other replica re-creates the payload from the stored request and chunks),
// step-progress events, and watchers' subscriptions. Draining: on a shared store it stops claiming (other pods
// continue the queue); alone, it finishes what it admitted. On a drain timeout (abort_all) running chunks stop and
// give their leases back.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server/store/job_lease.h"
#include "server/queue/job_queue.h"
#include "server/store/job_store.h"
#include "server/queue/replica_pool.h"

namespace skyreels::server {

// Re-creates a job's payload from its stored request and committed chunks (the layer that owns the request does it:
// the service). RestoredJob::payload null: the job cannot run (RestoredJob::error says why).
using JobLoader = std::function<RestoredJob(const StoredJob& job, std::vector<StoredChunk> chunks)>;

// Readiness follows a store check every kStoreCheckPeriod that must answer within kStoreCheckTimeout; after
// kStoreChecksToFail failures in a row readiness is off (about 6 s after the store stops answering).
inline constexpr std::chrono::milliseconds kStoreCheckPeriod{1000}, kStoreCheckTimeout{2000};
inline constexpr int kStoreChecksToFail = 2;

// `store` itself when it hands out leases (PostgreSQL), else a LocalLeaseStore over it (memory, SQLite).
std::unique_ptr<JobStore> with_leases(std::unique_ptr<JobStore> store);
std::unique_ptr<JobStore> with_leases(JobStore& borrowed);  // always a LocalLeaseStore; `borrowed` outlives it

struct PodOptions {
  SchedulerOptions scheduling;
  std::string pod = "local";  // this pod's name (e.g. the hostname): replicas claim as "<pod>/<replica>"
  std::chrono::milliseconds lease_ttl{30000};
  std::chrono::milliseconds poll{1000};  // store polling when no notification arrives
};

class Scheduler final : public JobQueue, private ChunkSource {
 public:
  // `store` must hand out leases (with_leases()) and outlive the scheduler; throws std::invalid_argument otherwise.
  Scheduler(std::vector<std::unique_ptr<ChunkExecutor>> executors, PodOptions options, JobStore& store,
            JobLoader loader, SchedulerObserver* observer = nullptr);
  ~Scheduler() override;  // running chunks stop and give their leases back
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void start() override;
  bool all_loaded() const override;
  bool ready() const override;  // also: the store answers
  bool live() const override;

  SubmitResult submit(JobSpec spec) override;
  void check_admission(const JobSpec& spec) const override;
  std::optional<JobSnapshot> get(const std::string& id, const std::string& owner) const override;
  std::vector<JobSnapshot> list(const std::string& owner) const override;
  std::optional<std::string> dropped(const std::string& id, const std::string& owner) const override;
  std::optional<int64_t> result_size(const std::string& id, const std::string& owner, JobStore::Blob kind,
                                     int64_t index) const override;
  std::optional<std::string> result_range(const std::string& id, const std::string& owner, JobStore::Blob kind,
                                          int64_t index, int64_t offset, int64_t length) const override;
  std::optional<JobSnapshot> cancel(const std::string& id, const std::string& owner) override;
  std::optional<JobSnapshot> remove(const std::string& id, const std::string& owner) override;

  EventBatch wait_events(const std::string& id, const std::string& owner, uint64_t after_sequence,
                         Clock::time_point until) const override;
  uint64_t subscribe(const std::string& id, std::function<void()> notify) override;
  void unsubscribe(const std::string& id, uint64_t token) override;
  std::optional<LatestPreview> latest_preview(const std::string& id, uint64_t after_serial) const override;
  std::optional<JobSnapshot> wait_chunks(const std::string& id, const std::string& owner, int64_t chunks_seen,
                                         Clock::time_point until) const override;

  void begin_drain() override;
  bool draining() const override;
  // Shared store, or after abort_all: no chunk runs on this server. Alone: no job is unfinished.
  bool wait_idle(Clock::time_point until) const override;
  // Running chunks stop and give their leases back; this server answers for its unfinished jobs as ended
  // (UNAVAILABLE, `reason`) while the store keeps them for the next start or another pod.
  void abort_all(const std::string& reason) override;

  std::vector<ReplicaStatus> replicas() const override;
  int64_t queued_jobs() const override;  // in the whole store
  int64_t running_jobs() const override;  // chunks running on this pod
  const SchedulerOptions& options() const override { return options_.scheduling; }

 private:
  struct Running;
  struct Cached;

  // ChunkSource (the pool's workers)
  std::optional<ChunkAssignment> next_chunk(size_t replica) override;
  void chunk_done(size_t replica, ChunkAssignment assignment, ChunkResult result, double seconds) override;
  void replicas_changed() override;
  void interrupt() override;

  std::optional<ChunkAssignment> prepare(size_t replica, const ChunkLease& lease);
  bool claiming_locked() const;
  // Jobs `replica` leaves to another replica of this server (policy::choose_replica over what this server knows:
  // where each job's payload is, which replica just failed its chunk, how long busy replicas still need).
  // `resident`: each replica's adapters now (a job with adapters prefers the replica holding them).
  std::vector<std::string> pass_over_locked(size_t replica, const std::vector<bool>& healthy,
                                            const std::vector<std::vector<std::string>>& resident) const;
  void place_in_queue(JobSnapshot& s) const;  // queue position and ETA of a waiting job
  double retry_after() const;                 // the hint of a refused submission
  std::string settle(size_t replica, ChunkResult result, double seconds);  // returns the job's id
  // The payload with its chunk plan, held by the caller: the cache may evict or replace its entry meanwhile.
  std::shared_ptr<Cached> payload_for(const StoredJob& job, const ChunkLease& lease, std::string& error);
  struct Attempts {
    int failures = 0;   // the chunk raised an error
    int takeovers = 0;  // the process running it died or went silent
    int total() const { return failures + takeovers; }
  };
  Attempts attempts_of(const std::string& job_id, int64_t chunk) const;
  void finish(const std::string& job_id, JobState state, ErrorKind kind, const std::string& error);
  void fail_or_retry(const Running& run, const std::string& error);
  uint64_t append(const std::string& job_id, const JobEvent& event);
  void push_step(Running& run, int64_t row, int64_t rows);
  void push_preview(const Running& run, ChunkPreviewImage image);
  void keep_step_locked(const std::string& job_id, const JobEvent& event);
  bool stop_requested(const Running& run) const;
  std::string lease_name(size_t replica) const;
  JobSnapshot snapshot(const StoredJob& job) const;
  // What the transport reads of a job (parameters, chunk layout), re-created from the stored request the first time
  // this pod is asked about a job it never ran; kept (bounded) since it never changes.
  std::shared_ptr<const JobDescription> description_of(const StoredJob& job) const;
  std::optional<StoredJob> find(const std::string& id, const std::string& owner) const;
  void admit_here() const;  // draining, a healthy replica
  void admit(const JobSpec& spec) const;
  AdmissionError queue_full(int64_t admitted) const;
  AdmissionError client_queue_full(int64_t unfinished, int64_t cap) const;
  int64_t client_cap(const JobSpec& spec) const;  // the key's cap, else --max-jobs-per-client
  void report_queue();
  void changed(const std::string& job_id);  // wakes waiters and the job's subscribers
  void changed_maybe_cancelled(const std::string& job_id);  // and a chunk of it running here renews now
  void stepped(const std::string& job_id);  // wakes the job's waiters and subscribers only
  void notify_subscribers_locked(const std::string& job_id);
  double remaining_locked(const Running& run, Clock::time_point now) const;
  void listen_loop();
  void hear_other_pods(std::unique_ptr<ChangeListener>& listener, Clock::time_point& last_poll);
  void heartbeat_loop();
  void store_health_loop();
  void housekeeping();
  void retire_finished();
  void drop_removed();  // jobs removed while running, once they have ended
  std::set<std::string> removed_;  // under mu_

  PodOptions options_;
  JobStore& store_;
  LeaseStore& leases_;
  JobLoader loader_;
  SchedulerObserver* observer_;
  ReplicaPool pool_;

  mutable std::mutex mu_;
  mutable std::condition_variable changed_;  // any job changed (store notification, local event), running chunk ended
  std::condition_variable work_;             // a chunk may have become ready
  std::map<size_t, std::shared_ptr<Running>> running_;  // by replica
  std::map<std::string, std::shared_ptr<Cached>> cache_;  // payloads of jobs whose last chunk ran here
  std::map<std::string, std::deque<JobEvent>> steps_;     // step events of chunks run here or elsewhere (bounded)
  std::map<std::string, LatestPreview> previews_;         // the latest preview of jobs running here (bounded)
  uint64_t preview_serial_ = 0;
  std::map<std::string, size_t> avoid_;  // jobs whose chunk just failed on this replica (until claimed again)
  double seconds_per_chunk_ = 0;         // moving average of this server's chunks (0: none measured yet)
  std::optional<std::string> aborted_;   // abort_all's reason
  bool retire_now_ = false;              // a job ended: retention runs at the next heartbeat
  mutable std::map<std::string, std::shared_ptr<const JobDescription>> descriptions_;  // bounded
  std::map<std::string, std::map<uint64_t, std::function<void()>>> listeners_;
  uint64_t next_listener_ = 1;
  uint64_t change_count_ = 0;  // bumped by every change: next_chunk sleeps only when nothing changed since it looked
  bool draining_ = false;
  bool hard_stop_ = false;  // abort_all / destructor: running chunks stop now
  bool interrupted_ = false;
  bool stopping_ = false;
  bool started_ = false;
  std::thread listener_, heartbeat_, store_health_;
  std::atomic<bool> store_answers_{true};
  std::condition_variable heartbeat_cv_;
  bool renew_now_ = false;
};

}  // namespace skyreels::server
