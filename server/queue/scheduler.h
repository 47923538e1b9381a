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
//
// The scheduler is split by role, each in its own files: the chunk runner (chunk_runner.h: claims, leases,
// heartbeats, outcomes, retries, placement), the job event hub (job_event_hub.h: event logs, waiters, and the one
// stream of scheduler events, event_stream.h, that metrics, the MP4 encoder, the webhook sender and the watchers
// consume), and this facade, which answers the RPCs (JobQueue) from the store and from the other two.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/queue/chunk_runner.h"
#include "server/queue/job_event_hub.h"
#include "server/queue/job_queue.h"
#include "server/queue/scheduler_shared.h"
#include "server/store/job_lease.h"
#include "server/store/job_store.h"

namespace skyreels::server {

// Readiness follows a store check every kStoreCheckPeriod that must answer within kStoreCheckTimeout; after
// kStoreChecksToFail failures in a row readiness is off (about 6 s after the store stops answering).
inline constexpr std::chrono::milliseconds kStoreCheckPeriod{1000}, kStoreCheckTimeout{2000};
inline constexpr int kStoreChecksToFail = 2;

// The leases over `store`, which they then hold: PostgreSQL's own, else a LocalLeaseStore (memory, SQLite).
std::unique_ptr<LeaseStore> with_leases(std::unique_ptr<JobStore> store);
std::unique_ptr<LeaseStore> with_leases(JobStore& borrowed);  // always a LocalLeaseStore; `borrowed` outlives it

class Scheduler final : public JobQueue {
 public:
  // `leases` (with_leases()) and `store`, its records() or a wrapper of them (TimedJobStore), outlive the scheduler.
  Scheduler(std::vector<std::unique_ptr<ChunkExecutor>> executors, PodOptions options, JobStore& store,
            LeaseStore& leases, JobLoader loader);
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
  EventStream& events() override { return hub_.events(); }

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
  void store_health_loop();
  void place_in_queue(JobSnapshot& s) const;  // queue position and ETA of a waiting job
  double retry_after() const;                 // the hint of a refused submission
  // What the transport reads of a job (parameters, chunk layout), re-created from the stored request the first time
  // this pod is asked about a job it never ran; kept (bounded) since it never changes.
  std::shared_ptr<const JobDescription> description_of(const StoredJob& job) const;
  std::optional<StoredJob> find(const std::string& id, const std::string& owner) const;
  void answer_aborted_locked(JobSnapshot& s) const;  // after abort_all: unfinished jobs end UNAVAILABLE here
  void admit_here() const;  // draining, a healthy replica
  void admit(const JobSpec& spec) const;
  AdmissionError queue_full(int64_t admitted) const;
  AdmissionError client_queue_full(int64_t unfinished, int64_t cap) const;
  int64_t client_cap(const JobSpec& spec) const;  // the key's cap, else --max-jobs-per-client

  PodOptions options_;
  JobStore& store_;
  LeaseStore& leases_;
  JobLoader loader_;
  mutable SchedulerShared shared_;
  JobEventHub hub_;
  ChunkRunner runner_;
  mutable std::map<std::string, std::shared_ptr<const JobDescription>> descriptions_;  // bounded, under shared_.mu
  bool started_ = false;  // under shared_.mu
  std::thread store_health_;
  std::atomic<bool> store_answers_{true};
};

}  // namespace skyreels::server
