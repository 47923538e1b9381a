// The values the job queue (the Scheduler), the replica pool and the transport share:
// what a submission carries (JobSpec), what a reader sees (JobSnapshot, JobEvent, EventBatch), why a submission is
// refused (AdmissionError) and a replica's status. What happens to them travels as SchedulerEvent records
// (scheduler_event.h). No gRPC, no LibTorch, no threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "server/replica/chunk_executor.h"
#include "server/store/job_store.h"

namespace skyreels::server {

using Clock = std::chrono::steady_clock;
using WallClock = std::chrono::system_clock;

// What the layers above read of a job without knowing how it runs (parameters in effect, the layout of its chunk
// results): defined by them (server/model_job.h), carried here unopened.
struct JobDescription;


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
  int client_weight = 1;        // this client's share of the replicas relative to others (key file `weight=N`)
  int priority = 0;
  std::optional<Clock::time_point> deadline;
  std::vector<double> chunk_work;   // relative cost of each chunk (e.g. tokens x rows); size = number of chunks
  std::vector<int64_t> chunk_rows;  // denoising rows of each chunk (progress)
  std::string idempotency_key;
  uint64_t fingerprint = 0;    // of the request, to detect a reused idempotency key (v1: FNV-1a)
  std::string fingerprint_v2;  // the same as SHA-256 (server/fingerprint.h); compared when the stored job has one
  std::shared_ptr<JobPayload> payload;
  std::shared_ptr<const JobDescription> description;
  std::string durable_request;  // what the job store keeps to re-create the payload after a restart (opaque here)
};

// A job read back from the store at startup, with its payload re-created by the layer that owns the request.
struct RestoredJob {
  StoredJob stored;
  std::vector<StoredChunk> chunks;  // committed chunks (bytes may be dropped once the payload holds them)
  std::vector<StoredEvent> events;
  std::shared_ptr<JobPayload> payload;                // null: the job cannot be resumed (see error)
  std::shared_ptr<const JobDescription> description;  // null with the payload
  std::vector<double> chunk_work;
  std::vector<int64_t> chunk_rows;
  std::string error;  // why the payload could not be re-created: the job, if unfinished, fails with it
};


enum class EventType { Queued, ChunkStarted, Step, ChunkFinished, ChunkRetry, Finished, Webhook };


// The latest preview of a job, numbered per job on this pod (a watcher delivers each number once, skipping to the
// latest when it falls behind).
struct LatestPreview {
  uint64_t serial = 0;
  uint64_t count = 0;  // previews made for the job on this pod (a watcher's gap in it: the ones it skipped)
  std::shared_ptr<const ChunkPreviewImage> image;
};

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
  bool takeover = false;    // ChunkRetry: the process running the chunk died or went silent (not the chunk's error)
  double seconds = 0;       // ChunkFinished: chunk duration
  TransformerWork work;     // ChunkFinished: the chunk's transformer work
  int64_t position = 0;     // Queued
  double eta_seconds = -1;  // Queued
  double progress = 0;      // Step
  std::string message;      // ChunkRetry: the error; Webhook: the outcome (attempting, delivered, abandoned)
  uint64_t target = 0;      // Webhook: the sequence of the event delivered
  int status = 0;           // Webhook: the receiver's HTTP status
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
  TransformerWork work;  // of the chunks done (from their ChunkFinished events)
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
  AdapterResidency adapters;
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

JobState parse_job_state(const std::string& name);  // job_state_name()'s inverse (unknown: Failed)
ErrorKind parse_error_kind(const std::string& name);  // error_kind_name()'s inverse (unknown: None)
int64_t wall_ms(WallClock::time_point t);  // ms since the Unix epoch, as the store keeps times
int64_t wall_ms(const std::optional<WallClock::time_point>& t);  // 0 when unset
WallClock::time_point from_wall_ms(int64_t ms);
// Chunk-level events as job stores keep them (step events stay in memory).
std::string encode_stored_event(const JobEvent& event);
JobEvent decode_stored_event(const StoredEvent& stored);

// Fresh random job id: "j-" + 32 hex digits of 128 bits from the OS (getrandom), so ids of pods started together
// never collide in practice and cannot be predicted from earlier ones.
inline constexpr int kJobIdBits = 128;
std::string new_job_id();
// `size` bytes from the OS's random source (getrandom); throws std::runtime_error when it fails.
void random_bytes(void* out, size_t size);

}  // namespace skyreels::server
