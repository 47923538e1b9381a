// The chunk scheduler: policy only (no gRPC, no LibTorch). A job is a chain of chunks; each replica runs one chunk
// at a time on its own worker thread through a ChunkExecutor.
//
// Policy, applied whenever a replica is idle and a chunk is ready:
//  1. Order ready jobs by priority (higher first), then by attained service (fewest chunks run first: a long video
//     cannot starve short ones, jobs interleave at chunk boundaries), then by submission order.
//  2. For each job in that order pick a replica: the one that ran its previous chunk (affinity: prefix latents and
//     text embeddings are already there) when it is idle; otherwise an idle replica, unless the holder is busy and
//     will finish sooner than a handoff costs (then the job waits for it). Moving a job counts as a handoff.
//  3. A chunk that fails on a replica is retried (bounded) on another replica when there is one; a replica whose
//     chunks fail `replica_failure_limit` times in a row is taken out (unhealthy) and re-tested (ChunkExecutor::probe)
//     after a back-off that doubles up to a cap; it comes back when a re-test passes. A chunk that runs out of
//     memory (ResourceExhausted) fails its job, not the replica. When no replica has been healthy for
//     `liveness_grace`, live() turns false so that the orchestrator restarts the process.
//  4. Deadlines are checked before a chunk is dispatched and at every step; cancellation at every step.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "server/job_store.h"

namespace skyreels::server {

using Clock = std::chrono::steady_clock;
using WallClock = std::chrono::system_clock;

// What the layers above read of a job without knowing how it runs (parameters in effect, the layout of its chunk
// results): defined by them (server/model_job.h), carried here unopened.
struct JobDescription;

// Per-job data only the executor understands (model inputs, the state carried between chunks; results go to the
// job store). Shared by every replica that runs one of the job's chunks; chunks of one job never run concurrently.
class JobPayload {
 public:
  virtual ~JobPayload() = default;
};

struct ChunkWork {
  std::string job_id;
  int64_t chunk_index = 0;
  int64_t chunk_count = 0;
  int attempt = 0;       // 0 on the first try
  bool handoff = false;  // the previous chunk ran on another replica
  JobPayload* payload = nullptr;
};

// Failed: the replica could not run it (retried elsewhere, counts against the replica). Rejected: the request itself
// cannot run (the job fails at once with ErrorKind::InvalidArgument; no retry, the replica is not blamed).
// ResourceExhausted: the request was too large for the device's memory (the job fails with
// ErrorKind::ResourceExhausted; no retry, the replica is not blamed). NotStored: the chunk ran but the job store could
// not commit its result (full disk, I/O error): the job fails with ErrorKind::Internal naming the reason.
enum class ChunkOutcome { Succeeded, Stopped, Failed, Rejected, ResourceExhausted, NotStored };

struct ChunkResult {
  ChunkOutcome outcome = ChunkOutcome::Succeeded;
  std::string error;             // when Failed
  int64_t frames_generated = 0;  // pixel frames this chunk added to the video
  std::string bytes;             // the chunk's result, committed to the job store with chunks_done (empty: none)
};

struct ChunkCallbacks {
  std::function<void(int64_t row, int64_t rows)> on_step;  // after each denoising row (1-based row)
  std::function<bool()> should_stop;                       // cancelled, deadline passed or hard stop: stop now
};

// One replica: a model on one device. run() is only ever called from the replica's own worker thread.
class ChunkExecutor {
 public:
  virtual ~ChunkExecutor() = default;
  virtual std::string name() const = 0;  // metric label, e.g. "cpu:0"
  // Loads and warms the model, on the worker thread, before any chunk. Throws on failure (replica unhealthy).
  virtual void start() {}
  // Runs one chunk. Should return Stopped when callbacks.should_stop() turned true. Exceptions count as Failed.
  virtual ChunkResult run(const ChunkWork& work, const ChunkCallbacks& callbacks) = 0;
  // Re-tests a replica that was taken out (e.g. one small warm-up forward), on the worker thread. Throws when the
  // replica still does not work.
  virtual void probe() {}
};

enum class JobState { Queued, Running, Succeeded, Failed, Cancelled, DeadlineExceeded };
const char* job_state_name(JobState state);
bool is_terminal(JobState state);

// Why a job ended unsuccessfully, as a gRPC-style category (the transport maps it to a status code).
enum class ErrorKind { None, Internal, Unavailable, Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted };
const char* error_kind_name(ErrorKind kind);

struct JobSpec {
  std::string owner;            // client identity; jobs are only visible to their owner
  std::string client;           // who the per-client cap counts against: the owner, or the peer address when anonymous
  int64_t client_max_jobs = 0;  // this client's cap on unfinished jobs; 0: SchedulerOptions::max_jobs_per_client
  int priority = 0;
  std::optional<Clock::time_point> deadline;
  std::vector<double> chunk_work;   // relative cost of each chunk (e.g. tokens x rows); size = number of chunks
  std::vector<int64_t> chunk_rows;  // denoising rows of each chunk (progress)
  std::string idempotency_key;
  uint64_t fingerprint = 0;  // of the request, to detect a reused idempotency key
  std::shared_ptr<JobPayload> payload;
  std::shared_ptr<const JobDescription> description;
  std::string durable_request;  // what the job store keeps to re-create the payload after a restart (opaque here)
};

// A job read back from the store at startup, with its payload re-created by the layer that owns the request.
struct RestoredJob {
  StoredJob stored;
  std::vector<StoredChunk> chunks;  // committed chunks (bytes may be dropped: results are read from the store)
  std::vector<StoredEvent> events;
  std::shared_ptr<JobPayload> payload;                // null: the job cannot be resumed (see error)
  std::shared_ptr<const JobDescription> description;  // null with the payload
  std::vector<double> chunk_work;
  std::vector<int64_t> chunk_rows;
  std::string error;  // why the payload could not be re-created: the job, if unfinished, fails with it
};

enum class EventType { Queued, ChunkStarted, Step, ChunkFinished, ChunkRetry, Finished };

struct JobEvent {
  uint64_t sequence = 0;
  EventType type = EventType::Queued;
  WallClock::time_point time;
  int64_t chunk = -1;
  int64_t chunk_count = 0;
  std::string replica;
  int64_t step = 0, steps = 0;
  int attempt = 0;
  bool handoff = false;
  double seconds = 0;       // ChunkFinished: chunk duration
  int64_t position = 0;     // Queued
  double eta_seconds = -1;  // Queued
  double progress = 0;      // Step
  std::string message;      // ChunkRetry: the error
};

struct JobSnapshot {
  std::string id;
  std::string owner;
  JobState state = JobState::Queued;
  int priority = 0;
  std::string idempotency_key;
  WallClock::time_point created;
  std::optional<WallClock::time_point> started, finished;
  std::optional<WallClock::time_point> deadline;
  int64_t chunk_count = 0;
  int64_t chunks_done = 0;
  int64_t queue_position = 0;  // 1-based among jobs not started; 0 otherwise
  double eta_seconds = -1;
  double progress = 0;
  std::vector<std::string> chunk_replicas;
  int handoffs = 0;
  int retries = 0;
  ErrorKind error_kind = ErrorKind::None;
  std::string error;
  uint64_t last_sequence = 0;
  std::shared_ptr<JobPayload> payload;
  std::shared_ptr<const JobDescription> description;
};

struct ReplicaStatus {
  std::string name;
  bool loaded = false;
  bool healthy = false;
  bool busy = false;
  int64_t chunks_run = 0;
  int64_t failures = 0;
  int64_t recoveries = 0;  // times a re-test brought it back
  std::string error;
};

// Metrics and logs hook; every call is made with the scheduler's lock held, so keep them cheap.
class SchedulerObserver {
 public:
  virtual ~SchedulerObserver() = default;
  virtual void job_submitted(const JobSnapshot&) {}
  virtual void job_started(const JobSnapshot&, double /*queue_wait_seconds*/) {}
  virtual void job_finished(const JobSnapshot&) {}
  virtual void chunk_started(const JobSnapshot&, const std::string& /*replica*/, int64_t /*chunk*/) {}
  virtual void chunk_finished(const JobSnapshot&, const std::string& /*replica*/, int64_t /*chunk*/, double /*seconds*/,
                              int64_t /*frames*/) {}
  virtual void chunk_failed(const JobSnapshot&, const std::string& /*replica*/, int64_t /*chunk*/,
                            const std::string& /*error*/, bool /*will_retry*/) {}
  virtual void step(const std::string& /*replica*/, double /*seconds*/) {}
  virtual void handoff(const JobSnapshot&, const std::string& /*from*/, const std::string& /*to*/) {}
  virtual void replica_changed(const ReplicaStatus&) {}
  virtual void replica_recovered(const ReplicaStatus&) {}
  virtual void queue_changed(int64_t /*queued*/, int64_t /*running*/) {}
};

struct SchedulerOptions {
  int64_t max_jobs = 64;            // admitted, unfinished jobs (queued or running)
  int64_t max_jobs_per_client = 0;  // of those, per JobSpec::client (0: no cap); the server sets one

  int chunk_retries = 2;               // extra attempts per chunk after a failure
  int replica_failure_limit = 3;       // consecutive failed chunks before a replica is taken out
  double handoff_cost_seconds = 0.25;  // expected cost of moving a job's state to another replica
  int64_t max_retained_jobs = 256;     // finished jobs kept for Get/List/Download (oldest dropped first)
  std::chrono::seconds retention{3600};
  // Re-test of a replica taken out: first after retest_backoff, then doubling up to retest_backoff_max.
  std::chrono::milliseconds retest_backoff{30000};
  std::chrono::milliseconds retest_backoff_max{600000};
  // live() turns false once no replica has been healthy for this long (after loading).
  std::chrono::milliseconds liveness_grace{300000};
};

// Submission refused: queue full or this client's share of it full (retry later), or draining.
class AdmissionError : public std::runtime_error {
 public:
  enum class Reason { QueueFull, ClientQueueFull, Draining, Unavailable, IdempotencyConflict };
  AdmissionError(Reason reason, const std::string& message, double retry_after_seconds = 0)
      : std::runtime_error(message), reason_(reason), retry_after_seconds_(retry_after_seconds) {}
  Reason reason() const { return reason_; }
  double retry_after_seconds() const { return retry_after_seconds_; }

 private:
  Reason reason_;
  double retry_after_seconds_;
};

struct SubmitResult {
  JobSnapshot job;
  bool deduplicated = false;
};

struct EventBatch {
  std::vector<JobEvent> events;  // sequence > after
  bool finished = false;         // the job is terminal and every event was returned
  bool found = true;
};

class Scheduler {
 public:
  // `store` (may be null: nothing is written) keeps jobs, chunk results and chunk-level events; it must outlive the
  // scheduler. With a durable store, jobs left unfinished by a stop (destructor, abort_all) stay unfinished in the
  // store, so that the next start resumes them.
  Scheduler(std::vector<std::unique_ptr<ChunkExecutor>> replicas, SchedulerOptions options,
            SchedulerObserver* observer = nullptr, JobStore* store = nullptr);
  ~Scheduler();  // hard stop: running chunks are asked to stop, threads joined
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Before start(): takes over jobs read back from the store. Queued jobs queue again in their order; a job whose
  // chunk was running restarts that chunk (counted as a retry); finished jobs stay readable until retention drops
  // them; deadlines that passed meanwhile end their jobs at the first dispatch. Event sequence numbers continue
  // above every number handed out before the restart.
  void restore(std::vector<RestoredJob> jobs);
  // Starts one worker thread per replica; each loads its model (ChunkExecutor::start) in parallel.
  void start();
  // True once every replica finished loading (successfully or not).
  bool all_loaded() const;
  // Readiness: loaded, not draining, and at least one replica healthy.
  bool ready() const;
  // Liveness: false once every replica has been unhealthy (loaded or failed to load) for options.liveness_grace.
  bool live() const;

  // Throws AdmissionError. `spec.chunk_work` must not be empty.
  SubmitResult submit(JobSpec spec);
  // The checks submit() makes before a job exists (draining, no healthy replica, queue or client share full), so that
  // expensive request preparation (text encoding) is skipped when the job would be refused anyway. Reads owner,
  // client, client_max_jobs and idempotency_key (a key naming an existing job passes: submit() deduplicates it).
  // Throws AdmissionError; a later submit() may still refuse.
  void check_admission(const JobSpec& spec) const;
  // nullopt when unknown or owned by another client (`owner` must match; empty matches only unowned jobs).
  std::optional<JobSnapshot> get(const std::string& id, const std::string& owner) const;
  std::vector<JobSnapshot> list(const std::string& owner) const;
  // Why a job the store once had is gone (dropped by retention), nullopt when the id is unknown to the store.
  std::optional<std::string> dropped(const std::string& id, const std::string& owner) const;
  // Results, read from the job store (not from the payload): the committed result of chunk `index`, and its MP4
  // segment once made. nullopt when the job is unknown, owned by another client, or has no such result (yet); always
  // without a store. Throws StoreError when the store cannot be read.
  std::optional<std::string> chunk_result(const std::string& id, const std::string& owner, int64_t index) const;
  std::optional<std::string> segment(const std::string& id, const std::string& owner, int64_t index) const;
  // Cancels at the next step boundary (queued or between chunks: at once). Returns the snapshot, nullopt if unknown.
  std::optional<JobSnapshot> cancel(const std::string& id, const std::string& owner);

  // Events with sequence > after_sequence; blocks until there is one, the job ended, or `until`.
  EventBatch wait_events(const std::string& id, const std::string& owner, uint64_t after_sequence,
                         Clock::time_point until) const;
  // For watchers that hold no thread (gRPC callback streams): `notify` runs after each of the job's events and when
  // the job is dropped, with the scheduler's lock held, so it must only schedule work (then read with
  // wait_events(..., Clock::now())). Returns a token for unsubscribe(), 0 when the job is unknown.
  uint64_t subscribe(const std::string& id, const std::string& owner, std::function<void()> notify);
  void unsubscribe(const std::string& id, uint64_t token);
  // Blocks until the job has more than `chunks_seen` chunks done, ended, or `until`; returns the snapshot.
  std::optional<JobSnapshot> wait_chunks(const std::string& id, const std::string& owner, int64_t chunks_seen,
                                         Clock::time_point until) const;

  // Draining: new submissions are refused (AdmissionError::Draining); queued and running jobs continue.
  void begin_drain();
  bool draining() const;
  // Blocks until no job is unfinished or `until`; returns true when idle.
  bool wait_idle(Clock::time_point until) const;
  // Ends every unfinished job now (running chunks stop at the next step) with ErrorKind::Unavailable.
  void abort_all(const std::string& reason);

  std::vector<ReplicaStatus> replicas() const;
  int64_t queued_jobs() const;
  int64_t running_jobs() const;
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Job;
  struct Replica;
  struct Assignment;

  void worker(size_t index);
  void dispatch_locked();
  void expire_locked(Clock::time_point now);
  int choose_replica_locked(Job& job, const std::vector<size_t>& idle, Clock::time_point now) const;
  void assign_locked(Job& job, size_t replica, Clock::time_point now);
  void complete_locked(size_t replica, const ChunkResult& result, double seconds);
  void finish_locked(Job& job, JobState state, ErrorKind kind, const std::string& error);
  void push_event_locked(Job& job, JobEvent event);
  // Write-through to the store (no-ops without one). A failed job or event write is logged; submit() fails instead.
  StoredJob stored_locked(const Job& job) const;
  void persist_update_locked(const Job& job);
  bool persisting_locked() const;
  void wake_watchers_locked(Job& job);
  void update_positions_locked(Clock::time_point now);
  void gc_locked();
  void schedule_retests_locked(Clock::time_point now);
  void run_probe(Replica& replica, std::unique_lock<std::mutex>& lock);
  void update_liveness_locked(Clock::time_point now);
  void notify_queue_locked();
  int64_t count_locked(JobState state) const;
  void check_admission_locked(const std::string& client, int64_t client_max_jobs) const;
  JobSnapshot snapshot_locked(const Job& job) const;
  ReplicaStatus replica_status_locked(const Replica& replica) const;
  double estimate_seconds_locked(double work) const;
  Job* find_locked(const std::string& id, const std::string& owner) const;
  bool stop_requested_locked(const Job& job, Clock::time_point now) const;

  SchedulerOptions options_;
  SchedulerObserver* observer_;
  JobStore* store_;
  mutable std::mutex mu_;
  mutable std::condition_variable changed_;  // job ends, chunks done, drain (wait_idle); job events wake only the job's
                                             // own watchers (Job::watchers), not every watcher of every job
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::map<std::string, std::unique_ptr<Job>> jobs_;
  std::map<std::pair<std::string, std::string>, std::string> idempotency_;  // (owner, key) -> id
  uint64_t next_seq_ = 0;
  uint64_t next_listener_ = 1;
  bool draining_ = false;
  bool stopping_ = false;
  bool keep_unfinished_ = false;  // abort_all() with a durable store: unfinished jobs stay so in the store
  bool started_ = false;
  double seconds_per_work_ = 0;  // exponential moving average over all replicas; 0 = no measurement yet
  std::optional<Clock::time_point> unhealthy_since_;  // every replica loaded and none healthy since then
  std::thread timer_;
  std::condition_variable timer_cv_;
  void timer_loop();
};

// Fresh random job id ("j-" + 16 hex digits).
std::string new_job_id();

}  // namespace skyreels::server
