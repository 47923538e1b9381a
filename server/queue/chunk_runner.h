// The chunk runner: this pod's replicas' side of the scheduler (scheduler.h has the policy). Idle replicas claim
// chunk leases (the placement rule passes over jobs it sends to another replica here), a heartbeat renews the leases
// while the chunks run, and each chunk's outcome is committed under its lease, retried, or ends the job. It keeps
// the payloads of jobs whose last chunk ran here, and the housekeeping every pod shares (deadlines, retention).
// Idle replicas wait for the hub's changes, and look again every PodOptions::poll without one: a lease that expires
// (its holder died or paused) makes a chunk claimable and notifies nobody.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server/queue/job_event_hub.h"
#include "server/queue/job_queue.h"
#include "server/queue/replica_pool.h"
#include "server/queue/scheduler_shared.h"
#include "server/store/job_lease.h"

namespace skyreels::server {

// Re-creates a job's payload from its stored request and committed chunks (the layer that owns the request does it:
// the service). RestoredJob::payload null: the job cannot run (RestoredJob::error says why).
using JobLoader = std::function<RestoredJob(const StoredJob& job, std::vector<StoredChunk> chunks)>;

struct PodOptions {
  SchedulerOptions scheduling;
  std::string pod = "local";  // this pod's name (e.g. the hostname): replicas claim as "<pod>/<replica>"
  std::chrono::milliseconds lease_ttl{30000};
  std::chrono::milliseconds poll{1000};  // store polling when no notification arrives
};

// What a stored job looks like to the transport (without what only this pod knows: steps, payload, queue place).
JobSnapshot snapshot_of(const StoredJob& job);

class ChunkRunner final : private ChunkSource {
 public:
  // A job's payload kept on this pod after its chunk ran here (or it was submitted here): the next chunk continues
  // from it without a reload.
  struct Cached {
    std::shared_ptr<JobPayload> payload;
    std::shared_ptr<const JobDescription> description;
    int64_t chunks_held = 0;  // chunks the payload holds the results of
    int holder = -1;          // the replica of this server that ran its last chunk (-1: none yet)
    std::vector<int64_t> chunk_rows;
    Clock::time_point used;
  };

  ChunkRunner(std::vector<std::unique_ptr<ChunkExecutor>> executors, const PodOptions& options,
              SchedulerShared& shared, JobEventHub& hub, JobStore& store, LeaseStore& leases, JobLoader loader,
              EventStream& events);
  ~ChunkRunner() override;
  void start();
  void stop();  // after shared.stopping and hard_stop: running chunks give their leases back, the heartbeat ends

  const ReplicaPool& pool() const { return pool_; }
  // Ends a job in the store (whichever pod gets there first), with its Finished event.
  void finish(const std::string& job_id, JobState state, ErrorKind kind, const std::string& error);
  void renew_if_running(const std::string& job_id);  // a change that may be a cancel
  void report_queue();
  void remove_when_ended(const std::string& job_id);  // dropped at the housekeeping after its chunk stopped

  // Under shared.mu, for the facade's reads and submissions.
  void hold_payload_locked(const std::string& job_id, std::shared_ptr<Cached> cached);
  void forget_payload_locked(const std::string& job_id, const std::shared_ptr<Cached>& cached);
  std::shared_ptr<const JobDescription> description_locked(const std::string& job_id) const;
  // The job's progress on this pod and its payload, if held here; true when a chunk of it runs here.
  bool describe_locked(const std::string& job_id, JobSnapshot& s) const;
  size_t running_locked() const { return running_.size(); }
  int64_t running_jobs() const;
  double seconds_per_chunk() const;
  // When a job with `ahead` ready jobs before it should start (policy::queue_eta over this pod's replicas).
  double queue_eta(int64_t ahead) const;

 private:
  // A chunk running on one of this pod's replicas, under its lease.
  struct Running {
    ChunkLease lease;
    StoredJob job;  // as it was when the chunk was claimed (without the request)
    std::string replica;  // lease name
    std::shared_ptr<JobPayload> payload;  // the one this chunk runs on (the cache may hold another meanwhile)
    int attempt = 0;   // earlier attempts of the chunk, failures and takeovers
    int failures = 0;  // of those, the chunk's own errors (bounded by chunk_retries)
    int64_t rows_total = 0, rows_before = 0;
    // Sequence numbers reserved for this chunk's steps: one store call per chunk for its planned rows, another when a
    // chunk reports more rows than planned. (first row, its number) per reservation, ascending.
    std::vector<std::pair<int64_t, uint64_t>> step_numbers;
    int64_t steps_reserved = 0;  // rows numbered so far
    Clock::time_point last_published{};  // the worker's own: its last step sent to other pods
    std::atomic<bool> lost{false};    // the store says another replica holds the chunk now
    std::atomic<bool> cancel{false};  // some pod asked to cancel the job
    double progress = 0;
    Clock::time_point started = Clock::now();
    size_t index = 0;  // the replica
  };
  struct Attempts {
    int failures = 0;   // the chunk raised an error
    int takeovers = 0;  // the process running it died or went silent
    int total() const { return failures + takeovers; }
  };

  // ChunkSource (the pool's workers)
  std::optional<ChunkAssignment> next_chunk(size_t replica) override;
  void chunk_done(size_t replica, ChunkAssignment assignment, ChunkResult result, double seconds) override;
  void replicas_changed() override;
  void interrupt() override;

  bool claiming_locked() const;
  // Jobs `replica` leaves to another replica of this server (policy::choose_replica over what this server knows:
  // where each job's payload is, which replica just failed its chunk, how long busy replicas still need).
  // `resident`: each replica's adapters now (a job with adapters prefers the replica holding them).
  std::vector<std::string> pass_over_locked(size_t replica, const std::vector<bool>& healthy,
                                            const std::vector<std::vector<std::string>>& resident) const;
  std::optional<ChunkAssignment> prepare(size_t replica, const ChunkLease& lease);
  std::optional<Attempts> attempts_allowed(const StoredJob& job, const ChunkLease& lease, const std::string& name);
  std::shared_ptr<Running> start_run(size_t replica, const StoredJob& job, const ChunkLease& lease,
                                     const Attempts& attempts, const std::shared_ptr<Cached>& cached);
  void announce_start(Running& run, const StoredJob& job, const Cached& cached);
  ChunkAssignment assignment_for(const std::shared_ptr<Running>& run, const Cached& cached);
  // The payload with its chunk plan, held by the caller: the cache may evict or replace its entry meanwhile.
  std::shared_ptr<Cached> payload_for(const StoredJob& job, const ChunkLease& lease, std::string& error);
  Attempts attempts_of(const std::string& job_id, int64_t chunk) const;
  std::string settle(size_t replica, ChunkResult result, double seconds);  // returns the job's id
  void commit_result(const Running& run, ChunkResult& result, double seconds);
  void fail_or_retry(const Running& run, const std::string& error);
  void push_step(Running& run, int64_t row, int64_t rows);
  void push_preview(const Running& run, ChunkPreviewImage image);
  bool stop_requested(const Running& run) const;
  std::string lease_name(size_t replica) const;
  double remaining_locked(const Running& run, Clock::time_point now) const;
  void heartbeat_loop();
  void housekeeping();
  void retire_finished();
  void drop_removed();  // jobs removed while running, once they have ended

  const PodOptions& options_;
  SchedulerShared& shared_;
  JobEventHub& hub_;
  JobStore& store_;
  LeaseStore& leases_;
  JobLoader loader_;
  EventStream& events_;
  ReplicaPool pool_;
  // The shared lock and state under the names the claim path has always used (it is kept verbatim).
  std::mutex& mu_;
  std::condition_variable& work_;
  std::condition_variable& changed_;
  std::condition_variable& heartbeat_cv_;
  uint64_t& change_count_;
  bool& draining_;
  bool& hard_stop_;
  // Under mu_:
  std::map<size_t, std::shared_ptr<Running>> running_;    // by replica
  std::map<std::string, std::shared_ptr<Cached>> cache_;  // payloads of jobs whose last chunk ran here
  std::map<std::string, size_t> avoid_;  // jobs whose chunk just failed on this replica (until claimed again)
  double seconds_per_chunk_ = 0;         // moving average of this server's chunks (0: none measured yet)
  bool retire_now_ = false;              // a job ended: retention runs at the next heartbeat
  bool renew_now_ = false;
  bool interrupted_ = false;
  std::set<std::string> removed_;
  std::thread heartbeat_;
};

}  // namespace skyreels::server
