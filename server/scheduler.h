// The in-memory chunk scheduler: a JobQueue (job_queue.h) whose jobs live in this process, written through to a
// JobStore (job_store.h), and the ChunkSource (replica_pool.h) its own ReplicaPool pulls chunks from. Every decision
// goes through the pure DispatchPolicy (dispatch_policy.h); replica health is the pool's; no gRPC, no LibTorch.
//
// Policy, applied whenever a replica is idle and a chunk is ready:
//  1. Order ready jobs by priority (higher first), then by their client's attained service (chunks started for the
//     client, divided by its weight: a tenant with many jobs gets one share, not one per job), then by the job's
//     attained service within its client (fewest chunks run first: a long video cannot starve short ones, jobs
//     interleave at chunk boundaries), then by submission order.
//  2. For each job in that order pick a replica: the one that ran its previous chunk (affinity: prefix latents and
//     text embeddings are already there) when it is idle; otherwise an idle replica, unless the holder is busy and
//     will finish sooner than a handoff costs (then the job waits for it). Moving a job counts as a handoff.
//  3. A chunk that fails on a replica is retried (bounded) on another replica when there is one. The pool takes a
//     replica whose chunks fail `replica_failure_limit` times in a row out and re-tests it (ChunkExecutor::probe)
//     after a back-off that doubles up to a cap. A chunk that runs out of memory (ResourceExhausted) fails its job,
//     not the replica. When no replica has been healthy for `liveness_grace`, live() turns false.
//  4. Deadlines are checked before a chunk is dispatched and at every step; cancellation at every step.
//  5. A submission reserves its admission slot and idempotency key under the lock, is stored without it (a request
//     may be megabytes), and is published (or its reservation released) afterwards.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "server/dispatch_policy.h"
#include "server/job_queue.h"
#include "server/job_store.h"
#include "server/job_types.h"
#include "server/replica_pool.h"

namespace skyreels::server {

// The replica side of SchedulerOptions (failure limit, re-test back-off, liveness grace).
ReplicaPoolOptions replica_pool_options(const SchedulerOptions& options);

class Scheduler : public JobQueue, private ChunkSource {
 public:
  // `store` (may be null: nothing is written) keeps jobs, chunk results and chunk-level events; it must outlive the
  // scheduler. With a durable store, jobs left unfinished by a stop (destructor, abort_all) stay unfinished in the
  // store, so that the next start resumes them.
  Scheduler(std::vector<std::unique_ptr<ChunkExecutor>> replicas, SchedulerOptions options,
            SchedulerObserver* observer = nullptr, JobStore* store = nullptr);
  ~Scheduler() override;  // hard stop: running chunks are asked to stop, threads joined
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // JobQueue (job_queue.h documents each call).
  void restore(std::vector<RestoredJob> jobs) override;
  void start() override;
  bool all_loaded() const override;
  bool ready() const override;
  bool live() const override;
  SubmitResult submit(JobSpec spec) override;
  void check_admission(const JobSpec& spec) const override;
  std::optional<JobSnapshot> get(const std::string& id, const std::string& owner) const override;
  std::vector<JobSnapshot> list(const std::string& owner) const override;
  std::optional<std::string> dropped(const std::string& id, const std::string& owner) const override;
  std::optional<JobSnapshot> cancel(const std::string& id, const std::string& owner) override;
  std::optional<std::string> chunk_result(const std::string& id, const std::string& owner,
                                          int64_t index) const override;
  std::optional<std::string> segment(const std::string& id, const std::string& owner, int64_t index) const override;
  // Events with sequence > after_sequence; blocks until there is one, the job ended, or `until`.
  EventBatch wait_events(const std::string& id, const std::string& owner, uint64_t after_sequence,
                         Clock::time_point until) const override;
  uint64_t subscribe(const std::string& id, const std::string& owner, std::function<void()> notify) override;
  void unsubscribe(const std::string& id, uint64_t token) override;
  std::optional<JobSnapshot> wait_chunks(const std::string& id, const std::string& owner, int64_t chunks_seen,
                                         Clock::time_point until) const override;
  void begin_drain() override;
  bool draining() const override;
  bool wait_idle(Clock::time_point until) const override;
  void abort_all(const std::string& reason) override;
  std::vector<ReplicaStatus> replicas() const override;
  int64_t queued_jobs() const override;
  int64_t running_jobs() const override;
  const SchedulerOptions& options() const override { return options_; }

 private:
  struct Job;
  struct Slot;
  struct ClientShare {
    int64_t service = 0;  // policy::charge_chunk per chunk started for the client
    int weight = 1;
  };
  static constexpr size_t kMaxIdleClients = 10000;

  // ChunkSource: the pool's workers pull here; dispatching happens under mu_ and hands the chunk to the slot.
  std::optional<ChunkAssignment> next_chunk(size_t replica) override;
  void chunk_done(size_t replica, ChunkAssignment assignment, ChunkResult result, double seconds) override;
  void replicas_changed() override;
  void interrupt() override;

  void dispatch_locked();
  policy::JobKey key_locked(const Job& job) const;
  void sort_for_dispatch_locked(std::vector<Job*>& jobs) const;
  void start_shares_locked(Job& job);
  void forget_idle_clients_locked();
  void expire_locked(Clock::time_point now);
  void fail_waiting_jobs_locked(const std::string& reason);
  std::vector<policy::ReplicaView> replica_views_locked(Clock::time_point now) const;
  int choose_replica_locked(const Job& job, std::vector<policy::ReplicaView> views) const;
  void assign_locked(Job& job, size_t replica, Clock::time_point now);
  ChunkCallbacks callbacks_for_locked(Job& job, size_t replica, int64_t chunk);
  void complete_locked(size_t replica, const ChunkResult& result, double seconds);
  void end_stopped_job_locked(Job& job);
  void finish_locked(Job& job, JobState state, ErrorKind kind, const std::string& error);
  void push_event_locked(Job& job, JobEvent event);
  // Write-through to the store (no-ops without one). A failed job or event write is logged; submit() fails instead.
  StoredJob stored_locked(const Job& job) const;
  void persist_update_locked(const Job& job);
  bool persisting_locked() const;
  void wake_watchers_locked(Job& job);
  void update_positions_locked(Clock::time_point now);
  void gc_locked();
  void notify_queue_locked();
  int64_t count_locked(JobState state) const;
  // submit() in three steps: a known key answers (waiting for one still being stored), a reservation holds the
  // admission slot and the key while the store writes, then the job is published or the reservation released.
  std::optional<SubmitResult> known_key_locked(const JobSpec& spec, std::unique_lock<std::mutex>& lock);
  Job& reserve_locked(JobSpec spec);
  SubmitResult publish_locked(const std::string& id);
  void release_locked(const std::string& id);
  void check_admission_locked(const std::string& client, int64_t client_max_jobs) const;
  JobSnapshot snapshot_locked(const Job& job) const;
  double estimate_seconds_locked(double work) const;
  bool have_estimate_locked() const { return seconds_per_work_ > 0; }
  Job* find_locked(const std::string& id, const std::string& owner) const;
  bool stop_requested_locked(const Job& job, Clock::time_point now) const;
  void timer_loop();

  SchedulerOptions options_;
  SchedulerObserver* observer_;
  JobStore* store_;
  mutable std::mutex mu_;
  mutable std::condition_variable changed_;   // job ends, chunks done, drain, reservations settled (wait_idle, submit);
                                              // job events wake only the job's own watchers (Job::watchers)
  std::vector<std::unique_ptr<Slot>> slots_;  // per replica: the chunk handed to it (pending or running)
  std::map<std::string, std::unique_ptr<Job>> jobs_;
  std::map<std::string, std::unique_ptr<Job>> reserving_;                   // admitted, being stored: not visible yet
  std::map<std::pair<std::string, std::string>, std::string> idempotency_;  // (owner, key) -> id (reserved too)
  std::map<std::string, ClientShare> clients_;  // by JobSpec::client: fair share between tenants
  uint64_t next_seq_ = 0;
  uint64_t next_listener_ = 1;
  bool draining_ = false;
  bool stopping_ = false;
  bool interrupted_ = false;      // the pool stops: next_chunk() hands out nothing more
  bool keep_unfinished_ = false;  // abort_all() with a durable store: unfinished jobs stay so in the store
  bool started_ = false;
  double seconds_per_work_ = 0;  // moving average over all replicas; 0 = no measurement yet
  std::thread timer_;
  std::condition_variable timer_cv_;
  ReplicaPool pool_;  // last: its workers call back into everything above until ~Scheduler stops it
};

}  // namespace skyreels::server
