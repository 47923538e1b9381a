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

#include "server/queue/event_stream.h"
#include "server/queue/job_queue.h"
#include "server/queue/job_types.h"
#include "server/replica/chunk_executor.h"

namespace skyreels::server {


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

class ReplicaPool {
 public:
  // `events` (may be null) hears ReplicaChanged, ReplicaRecovered and StepTimed, from the worker threads.
  ReplicaPool(std::vector<std::unique_ptr<ChunkExecutor>> executors, SchedulerOptions options,
              EventStream* events = nullptr);
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
  void publish_locked(const Replica& replica);  // ReplicaChanged
  void publish_status_locked(SchedulerEventKind kind, const Replica& replica);

  SchedulerOptions options_;  // its replica_failure_limit, retest_backoff(_max) and liveness_grace
  EventStream* events_;
  ChunkSource* source_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable retest_cv_;  // re-tests due, or stop
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::optional<Clock::time_point> unhealthy_since_;  // every replica loaded and none healthy since then
  bool stopping_ = false;
};

}  // namespace skyreels::server
