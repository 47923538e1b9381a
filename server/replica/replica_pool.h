// The replicas and their worker threads: one thread per ChunkExecutor loads its model, then pulls chunks from a
// ChunkSource, runs them and reports each result back. The pool owns what belongs to a replica (loading, health:
// consecutive failures take it out, re-tests with a doubling capped back-off bring it back, liveness grace, status);
// the source owns what belongs to a job (which chunk runs where, retries, handoffs, commits, events). The pool does
// not know where work comes from (the Scheduler's chunk leases; a scripted source in tests). No gRPC, no LibTorch.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "server/queue/job_types.h"

namespace skyreels::server {

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
  TransformerWork work;          // what the chunk's transformer calls computed and saved
};

struct ChunkCallbacks {
  std::function<void(int64_t row, int64_t rows)> on_step;  // after each denoising row (1-based row)
  std::function<bool()> should_stop;                       // cancelled, deadline passed or hard stop: stop now
  std::function<void(ChunkPreviewImage)> on_preview;       // a preview of the running chunk (preview_every)
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

// One chunk handed to a replica: what to run, the payload kept alive while it runs, and the source's callbacks.
struct ChunkAssignment {
  ChunkWork work;
  std::shared_ptr<JobPayload> payload;
  ChunkCallbacks callbacks;
};

// Where the pool's workers get their chunks. Called from the workers without any pool lock held; the replica index
// is the executor's position in the pool.
class ChunkSource {
 public:
  virtual ~ChunkSource() = default;
  // Blocks until there is a chunk for this (loaded, healthy) replica; nullopt once the source stops handing out work
  // (the worker then ends).
  virtual std::optional<ChunkAssignment> next_chunk(size_t replica) = 0;
  // The chunk's result. The pool has already counted it for the replica's health (a replica taken out reads
  // unhealthy here); the source decides what happens to the job (commit, retry elsewhere, fail, events). Exceptions
  // of run() arrive as Failed, a Stopped nobody asked for (should_stop never said true) as Failed too.
  virtual void chunk_done(size_t replica, ChunkAssignment assignment, ChunkResult result, double seconds) = 0;
  // A replica finished loading, was taken out or came back: work may now go elsewhere (or nowhere).
  virtual void replicas_changed() = 0;
  // Wakes every next_chunk() and makes it and later calls return nullopt (once no chunk is pending for the replica).
  virtual void interrupt() = 0;
};

struct ReplicaPoolOptions {
  int failure_limit = 3;  // consecutive failed chunks before a replica is taken out
  // Re-test of a replica taken out: first after retest_backoff, then doubling up to retest_backoff_max.
  std::chrono::milliseconds retest_backoff{30000};
  std::chrono::milliseconds retest_backoff_max{600000};
  // live() turns false once no replica has been healthy for this long (after loading).
  std::chrono::milliseconds liveness_grace{300000};
};

class ReplicaPool {
 public:
  // `observer` (may be null) hears replica_changed, replica_recovered and step, from the worker threads.
  ReplicaPool(std::vector<std::unique_ptr<ChunkExecutor>> executors, ReplicaPoolOptions options,
              SchedulerObserver* observer = nullptr);
  ~ReplicaPool();  // stop()
  ReplicaPool(const ReplicaPool&) = delete;
  ReplicaPool& operator=(const ReplicaPool&) = delete;

  // Starts one worker thread per replica; each loads its model (ChunkExecutor::start) and then pulls from `source`,
  // which must outlive stop().
  void start(ChunkSource& source);
  // Interrupts the source, wakes replicas waiting for a re-test and joins every worker. A running chunk ends when its
  // executor returns: the source makes should_stop() true first for a prompt stop.
  void stop();

  size_t size() const { return replicas_.size(); }
  const std::string& name(size_t replica) const;
  bool all_loaded() const;   // every replica finished loading, successfully or not
  bool any_healthy() const;  // loaded and not taken out
  bool healthy(size_t replica) const;
  // False once every replica has been unhealthy (taken out or failed to load) for options.liveness_grace.
  bool live() const;
  std::vector<ReplicaStatus> status() const;
  ReplicaStatus status(size_t replica) const;

 private:
  struct Replica;
  void worker(size_t index);
  void load(Replica& replica);
  void wait_and_probe(Replica& replica);
  ChunkResult run_chunk(Replica& replica, const ChunkAssignment& assignment);
  void count_result_locked(Replica& replica, const ChunkResult& result);
  void take_out_locked(Replica& replica, Clock::time_point now);
  void update_liveness_locked(Clock::time_point now);
  bool all_loaded_locked() const;
  bool any_healthy_locked() const;
  ReplicaStatus status_locked(const Replica& replica) const;
  void publish_locked(const Replica& replica);

  ReplicaPoolOptions options_;
  SchedulerObserver* observer_;
  ChunkSource* source_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable retest_cv_;  // re-tests due, or stop
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::optional<Clock::time_point> unhealthy_since_;  // every replica loaded and none healthy since then
  bool stopping_ = false;
};

}  // namespace skyreels::server
