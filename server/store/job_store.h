// The durable side of jobs: what must survive a SIGKILL (the request, its state, its chunk results, its MP4 segments
// and its chunk-level events), behind one seam with two backends: `memory` (nothing survives a restart) and SQLite
// (the default; WAL). Results are read back from here, not from the running job, so every backend keeps them.
// No LibTorch, no gRPC: the request and events are opaque bytes owned by the layers above. No threads either; every
// method is safe to call from any thread (the SQLite backend serialises on its own mutex).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace skyreels::server {

// A store operation failed (full disk, I/O error, corrupt file). `what()` names the file and the cause.
class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One job as stored. Times are wall-clock milliseconds since the Unix epoch (0: not yet).
struct StoredJob {
  std::string id;
  uint64_t order = 0;  // submission order across restarts
  int64_t vbase = 0;   // fair-share start (scheduler policy)
  std::string owner, client;
  int priority = 0;
  std::optional<int64_t> deadline_ms;
  std::string idempotency_key;
  uint64_t fingerprint = 0;
  std::string fingerprint_v2;  // "sha256:..." ("" for jobs stored before it existed: then `fingerprint` decides)
  std::string state;       // job_state_name()
  std::string error_kind;  // error_kind_name()
  std::string error;
  int64_t created_ms = 0, started_ms = 0, finished_ms = 0;
  int64_t chunk_count = 0;
  int64_t chunks_done = 0;  // written only by commit_chunk(), atomically with the chunk's result
  int retries = 0;
  int handoffs = 0;
  std::string request;  // the canonical request with the conditioning actually used (the service's encoding)
  // Not a column of the job: the client's share weight at this submission (LeaseStore::insert_job_once records it).
  int client_weight = 1;
  // The names of the adapters the job applies (GenerationParams.loras), for placement across pods.
  std::vector<std::string> adapters;
};

// StoredJob::adapters as one column: names joined by '/', which no file name (so no adapter's name) contains.
std::string join_adapter_names(const std::vector<std::string>& names);
std::vector<std::string> split_adapter_names(const std::string& joined);

struct StoredChunk {
  int64_t index = 0;
  std::string replica;
  int attempts = 0;
  std::string bytes;  // the chunk's result (safetensors latents, fp32)
};

struct StoredEvent {
  uint64_t sequence = 0;
  std::string data;  // the scheduler's encoding
};

// How long one store call may take at most. A store that stops answering (a frozen database, a black-holed network:
// the kernel still ACKs, so TCP keepalives never fire) fails the call with StoreError after this, never later.
inline constexpr std::chrono::milliseconds kStoreCallTimeout{15000};

// Store calls this thread makes while the object lives end by `until` (the RPC's deadline, a health check's); nested
// scopes keep the earlier deadline. Backends that talk to a server (PostgreSQL) honour it.
class StoreCallDeadline {
 public:
  explicit StoreCallDeadline(std::chrono::steady_clock::time_point until);
  ~StoreCallDeadline();
  StoreCallDeadline(const StoreCallDeadline&) = delete;
  StoreCallDeadline& operator=(const StoreCallDeadline&) = delete;

 private:
  std::chrono::steady_clock::time_point previous_;
};
// When this thread's store call must end: its scope's deadline, at most kStoreCallTimeout from now.
std::chrono::steady_clock::time_point store_call_deadline();

// The records of jobs: their rows, chunk results, events and MP4 segments. Chunk leases over them are a store of their
// own (LeaseStore, job_lease.h), which holds the records it leases the jobs of.
class JobStore {
 public:
  virtual ~JobStore() = default;
  virtual std::string describe() const = 0;  // "memory" or "sqlite:PATH"
  virtual bool durable() const = 0;          // false: nothing survives a restart (no resume)

  // Each call is one transaction; StoreError when it could not be committed (nothing of it is then stored).
  virtual void insert_job(StoredJob job) = 0;  // by value: the request may be megabytes
  // State, times, error, retries, handoffs (not chunks_done: see commit_chunk).
  virtual void update_job(const StoredJob& job) = 0;
  // The chunk's result and chunks_done = chunk.index + 1, atomically.
  virtual void commit_chunk(const std::string& job_id, const StoredChunk& chunk) = 0;
  virtual void append_event(const std::string& job_id, const StoredEvent& event) = 0;
  // Retention: the job, its chunks, its segments and its events go; a tombstone (owner, reason) stays, so that the id
  // answers "dropped" rather than "never existed". Tombstones are bounded (kMaxTombstones, oldest dropped first).
  virtual void drop_job(const std::string& job_id, const std::string& reason) = 0;
  // The reason `job_id` (owned by `owner`) was dropped, nullopt when the store has no tombstone for it.
  virtual std::optional<std::string> dropped_reason(const std::string& job_id, const std::string& owner) const = 0;
  static constexpr int64_t kMaxTombstones = 100000;

  virtual std::vector<StoredJob> load_jobs() const = 0;  // in submission order
  virtual std::vector<StoredChunk> load_chunks(const std::string& job_id) const = 0;
  virtual std::vector<StoredEvent> load_events(const std::string& job_id) const = 0;
  // The job's StoredJob::request, nullopt when the job is gone: re-creating a job's payload reads it (after a restart,
  // on another pod, or after this pod evicted the payload). The default reads every job; backends read one row.
  virtual std::optional<std::string> load_request(const std::string& job_id) const;

  // The committed result of chunk `index`, nullopt when it was not committed (or the job is gone).
  virtual std::optional<std::string> load_chunk_bytes(const std::string& job_id, int64_t index) const = 0;
  // MP4 segment `index` of a job (made on demand); kept until the job is dropped. One transaction. A job the store
  // does not have (dropped meanwhile) keeps nothing.
  virtual void put_segment(const std::string& job_id, int64_t index, const std::string& bytes) = 0;
  virtual std::optional<std::string> load_segment(const std::string& job_id, int64_t index) const = 0;

  // Ranged reads of those two kinds of blob, for downloads that hold a bounded piece at a time whatever the blob's
  // size (a slow reader of a large video holds one piece, not the video). The size of the blob, and its bytes
  // [offset, offset + length) (fewer at its end, none past it); nullopt when the blob is absent. Every backend reads
  // only the piece (memory: a copy of it; SQLite: incremental blob I/O; PostgreSQL: substring of the bytea). The
  // defaults read the whole blob (for wrappers and test stores).
  enum class Blob { chunk, segment };
  virtual std::optional<int64_t> blob_size(const std::string& job_id, Blob kind, int64_t index) const;
  virtual std::optional<std::string> load_blob_range(const std::string& job_id, Blob kind, int64_t index,
                                                     int64_t offset, int64_t length) const;
};

// The JobStore calls (one per kJobStoreOps name, job_store_timed.h), declared once: a class that implements every one
// of them (the backends, the timing wrapper) names this in its public part instead of restating the list.
#define SKYREELS_JOB_STORE_CALLS                                                                                  \
  void insert_job(StoredJob job) override;                                                                        \
  void update_job(const StoredJob& job) override;                                                                 \
  void commit_chunk(const std::string& job_id, const StoredChunk& chunk) override;                                \
  void append_event(const std::string& job_id, const StoredEvent& event) override;                                \
  void drop_job(const std::string& job_id, const std::string& reason) override;                                   \
  std::optional<std::string> dropped_reason(const std::string& job_id, const std::string& owner) const override;  \
  std::vector<StoredJob> load_jobs() const override;                                                              \
  std::vector<StoredChunk> load_chunks(const std::string& job_id) const override;                                 \
  std::vector<StoredEvent> load_events(const std::string& job_id) const override;                                 \
  std::optional<std::string> load_request(const std::string& job_id) const override;                              \
  std::optional<std::string> load_chunk_bytes(const std::string& job_id, int64_t index) const override;           \
  void put_segment(const std::string& job_id, int64_t index, const std::string& bytes) override;                  \
  std::optional<std::string> load_segment(const std::string& job_id, int64_t index) const override;               \
  std::optional<int64_t> blob_size(const std::string& job_id, Blob kind, int64_t index) const override;           \
  std::optional<std::string> load_blob_range(const std::string& job_id, Blob kind, int64_t index, int64_t offset, \
                                             int64_t length) const override

// bytes[offset, offset + length), clipped to the bytes (empty past the end or for a negative offset).
std::string blob_slice(const std::string& bytes, int64_t offset, int64_t length);

// "memory", "sqlite:PATH[?synchronous=full]" or "postgresql://..." (postgres://). SQLite: creates the file (and its
// directory) when missing; a file that is corrupt, of a newer schema, not a store, or held by another server is a
// StoreError naming the file (never re-initialised). PostgreSQL: job_store_postgres.h (shared by several servers).
// `sqlite_max_growth_pages` >= 0 (a test hook, --job-store-max-growth-pages): a SQLite file grows by that many pages
// at most; any other store is then a StoreError.
std::unique_ptr<JobStore> open_job_store(const std::string& spec, int64_t sqlite_max_growth_pages = -1);

}  // namespace skyreels::server
