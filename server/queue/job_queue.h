// What the doors and the assembly need from a job queue, as three small seams: what the doors command
// (JobCommands), what they read (JobReads), and what the assembly and the probes see (QueueLifecycle). Implemented
// once, by the Scheduler (scheduler.h), over every store. No gRPC, no LibTorch.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "server/queue/event_stream.h"
#include "server/queue/job_types.h"

namespace skyreels::server {

// The scheduler's settings, with their defaults stated here only (skyreels-server's flags write them: server_flags.h).
struct SchedulerOptions {
  int64_t max_jobs = 64;            // admitted, unfinished jobs (queued or running)
  int64_t max_jobs_per_client = 0;  // of those, per JobSpec::client (0: no cap); the server sets one

  int chunk_retries = 2;               // extra attempts per chunk after a failure
  // Takeovers of a chunk whose process died (or went silent) before the job fails: a crash is not the chunk's error,
  // so it is counted apart, with a larger bound that only stops a chunk that kills every process running it.
  int chunk_takeover_limit = 10;
  int replica_failure_limit = 3;       // consecutive failed chunks before a replica is taken out
  double handoff_cost_seconds = 0.25;  // expected cost of moving a job's state to another replica
  int64_t max_retained_jobs = 256;     // finished jobs kept for Get/List/Download (oldest dropped first)
  std::chrono::seconds retention{3600};
  // Re-test of a replica taken out: first after retest_backoff, then doubling up to retest_backoff_max (never below
  // retest_backoff).
  std::chrono::milliseconds retest_backoff{30000};
  std::chrono::milliseconds retest_backoff_max{600000};
  // live() turns false once no replica has been healthy for this long (after loading).
  std::chrono::milliseconds liveness_grace{300000};
};

// What the doors command: admission and submission, cancel, delete, and the drain.
class JobCommands {
 public:
  virtual ~JobCommands() = default;
  // Answers once the job is stored (a durable store: it survives a SIGKILL from then on). Throws AdmissionError
  // (Unavailable when the store refused it); `spec.chunk_work` must not be empty. A second submit with the same
  // (owner, idempotency_key) returns the first job (deduplicated), even while the first is still being stored.
  virtual SubmitResult submit(JobSpec spec) = 0;
  // The checks submit() makes before a job exists (draining, no healthy replica, queue or client share full), so that
  // expensive request preparation (text encoding) is skipped when the job would be refused anyway. Reads owner,
  // client, client_max_jobs and idempotency_key (a key naming an existing job passes: submit() deduplicates it).
  // Throws AdmissionError; a later submit() may still refuse.
  virtual void check_admission(const JobSpec& spec) const = 0;
  // Cancels at the next step boundary (queued or between chunks: at once). Returns the snapshot, nullopt if unknown.
  virtual std::optional<JobSnapshot> cancel(const std::string& id, const std::string& owner) = 0;
  // Cancels the job if it has not ended, and drops it with its results once it has (at once, or at the next
  // housekeeping after its running chunk stopped). nullopt: unknown to this owner.
  virtual std::optional<JobSnapshot> remove(const std::string& id, const std::string& owner) = 0;
  // Draining: new submissions are refused (AdmissionError::Draining); queued and running jobs continue (on a shared
  // store, on the other pods).
  virtual void begin_drain() = 0;
  // Ends every unfinished job now, as this server answers for it (running chunks stop at the next step), with
  // ErrorKind::Unavailable. They stay unfinished in the store, so that the next start (or another pod) resumes them.
  virtual void abort_all(const std::string& reason) = 0;
};

// What the doors read: jobs, their results, their events and previews.
class JobReads {
 public:
  virtual ~JobReads() = default;
  // nullopt when unknown or owned by another client (`owner` must match; empty matches only unowned jobs).
  virtual std::optional<JobSnapshot> get(const std::string& id, const std::string& owner) const = 0;
  // The owner's jobs, oldest first.
  virtual std::vector<JobSnapshot> list(const std::string& owner) const = 0;
  // Why a job the store once had is gone (dropped by retention), nullopt when the id is unknown to the store.
  virtual std::optional<std::string> dropped(const std::string& id, const std::string& owner) const = 0;
  // Results, read from the job store (not from the payload) a piece at a time, so that a download holds one piece
  // whatever the result's size: the size of chunk `index`'s committed result (JobStore::Blob::chunk) or of its MP4
  // segment once made (Blob::segment), and its bytes [offset, offset + length). nullopt when the job is unknown, owned
  // by another client, or has no such result (yet). Throws StoreError when the store cannot be read.
  virtual std::optional<int64_t> result_size(const std::string& id, const std::string& owner, JobStore::Blob kind,
                                             int64_t index) const = 0;
  virtual std::optional<std::string> result_range(const std::string& id, const std::string& owner,
                                                  JobStore::Blob kind, int64_t index, int64_t offset,
                                                  int64_t length) const = 0;
  // Events with sequence > after_sequence; blocks until there is one, the job ended, or `until`.
  virtual EventBatch wait_events(const std::string& id, const std::string& owner, uint64_t after_sequence,
                                 Clock::time_point until) const = 0;
  // For watchers that hold no thread (gRPC callback streams): `notify` runs after each of the job's events and when
  // the job is dropped, on the publishing thread with the stream's lock held, so it must only schedule work (then
  // read with wait_events(..., Clock::now())). Returns a token for unsubscribe(). Never calls the store (gRPC's
  // callback threads subscribe): whether the job exists is the reader's question; a job that does not is never told.
  virtual uint64_t subscribe(const std::string& id, std::function<void()> notify) = 0;
  virtual void unsubscribe(const std::string& id, uint64_t token) = 0;
  // The job's latest preview when its serial is above `after_serial` (subscribers are notified of each). Only the
  // pod running the chunk has its previews. Never calls the store.
  virtual std::optional<LatestPreview> latest_preview(const std::string& id, uint64_t after_serial) const = 0;
  // Blocks until the job has more than `chunks_seen` chunks done, ended, or `until`; returns the snapshot.
  virtual std::optional<JobSnapshot> wait_chunks(const std::string& id, const std::string& owner, int64_t chunks_seen,
                                                 Clock::time_point until) const = 0;
};

// What the assembly and the probes see: start, health, the drain's progress, replicas, and the event stream.
class QueueLifecycle {
 public:
  virtual ~QueueLifecycle() = default;
  // Starts the replicas (each loads its model in parallel) and dispatching.
  virtual void start() = 0;
  // True once every replica finished loading (successfully or not).
  virtual bool all_loaded() const = 0;
  // Readiness: loaded, not draining, and at least one replica healthy.
  virtual bool ready() const = 0;
  // Liveness: false once every replica has been unhealthy (loaded or failed to load) for options().liveness_grace.
  virtual bool live() const = 0;
  virtual bool draining() const = 0;
  // Blocks until no job is unfinished (none being stored either; on a shared store: no chunk runs here) or `until`;
  // returns true when idle.
  virtual bool wait_idle(Clock::time_point until) const = 0;
  virtual std::vector<ReplicaStatus> replicas() const = 0;
  virtual int64_t queued_jobs() const = 0;
  virtual int64_t running_jobs() const = 0;
  virtual const SchedulerOptions& options() const = 0;
  // The one stream of scheduler events (event_stream.h): this pod's, and other pods' changes as JobChanged.
  virtual EventStream& events() = 0;
};

// The three seams together, as the one Scheduler implements them (the doors take the ones they use).
class JobQueue : public JobCommands, public JobReads, public QueueLifecycle {};

}  // namespace skyreels::server
