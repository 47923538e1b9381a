// What happened to a job, a chunk, a replica or the queue, as one record (SchedulerEvent) that every consumer reads
// from the one stream (event_stream.h): metrics, the webhook sender, the MP4 encoder and the job watchers. Adding a
// kind is one enumerator here and its publisher; every consumer switches over all kinds (no default; a missed kind is a build error),
// so a consumer that ignores a kind says so in its one switch. No store, no threads, no gRPC.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "server/queue/job_types.h"

// A consumer's switch that misses a kind does not build (wherever this header is seen).
#pragma GCC diagnostic error "-Wswitch"

namespace skyreels::server {

enum class SchedulerEventKind {
  JobSubmitted,      // job: admitted and stored on this pod
  JobStarted,        // job, seconds: its first chunk's first attempt started here, after `seconds` in the queue
  ChunkStarted,      // job, replica, chunk
  Handoff,           // job, replica, from_replica: the job's chunk moved from one replica to another
  StepTimed,         // replica, seconds: one denoising step of a chunk running here took `seconds`
  StepProgress,      // job_id: a step's progress event was kept (watchers read it)
  PreviewMade,       // job_id, replica, bytes: a preview of a running chunk, made by this pod's replicas
  ChunkFinished,     // job, replica, chunk, seconds, frames: committed here
  ChunkFailed,       // job, replica, chunk, error, will_retry
  JobFinished,       // job: ended here (any terminal state)
  LeaseTakeover,     // replica: took over a chunk whose lease ran out (its pod died or stalled)
  ReplicaChanged,    // replica_status
  ReplicaRecovered,  // replica_status: a re-test brought it back
  QueueChanged,      // queued (in the store), running (chunks here)
  JobChanged,        // job_id: its stored state changed, here or on another pod (read it again)
  ChangesMissed,     // changes may have gone unheard (the store's listener was re-made): read again what you follow
  LookAgain,         // nothing known changed, but a lease may have expired unannounced: waiters and watchers read again
};
// Records about every job at once (no job_id): they also reach the consumers of a single job.
bool about_every_job(SchedulerEventKind kind);

struct SchedulerEvent {
  explicit SchedulerEvent(SchedulerEventKind what = SchedulerEventKind::JobChanged) : kind(what) {}
  SchedulerEventKind kind;
  std::string job_id;                          // every job kind (also when `job` is set: job->id)
  std::optional<JobSnapshot> job;              // the kinds that name "job" above
  std::string replica;
  std::string from_replica;                    // Handoff
  int64_t chunk = -1;
  double seconds = 0;                          // JobStarted: queue wait; ChunkFinished: chunk; StepTimed: step
  int64_t frames = 0;                          // ChunkFinished
  int64_t bytes = 0;                           // PreviewMade
  std::string error;                           // ChunkFailed
  bool will_retry = false;                     // ChunkFailed
  int64_t queued = 0, running = 0;             // QueueChanged
  std::optional<ReplicaStatus> replica_status;  // ReplicaChanged, ReplicaRecovered

  // A record about `job` (job_id set from it).
  static SchedulerEvent about(SchedulerEventKind kind, JobSnapshot job);
  // A record about the job `job_id` alone.
  static SchedulerEvent about(SchedulerEventKind kind, const std::string& job_id);
};

}  // namespace skyreels::server
