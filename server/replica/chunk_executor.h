// The seam between the chunk runner (server/queue: the replica pool and the scheduler) and the devices
// (server/replica): what a chunk of work is, what running it returns, the callbacks it gets, and the executor a
// replica implements. A leaf: it includes nothing of server/, so that the queue includes the replicas' seam and never
// the other way round. No gRPC, no LibTorch, no threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace skyreels::server {

// Per-job data only the executor understands (model inputs, the state carried between chunks; results go to the
// job store). Shared by every replica that runs one of the job's chunks; chunks of one job never run concurrently.
class JobPayload {
 public:
  virtual ~JobPayload() = default;
};

// Transformer work in token-blocks (one token through one transformer block, as in
// skyreels_transformer_token_blocks_total): what the uncached plan would compute, what was computed, and what the
// exact savings and the step cache left out (full = computed + saved_exact + saved_cache).
struct TransformerWork {
  int64_t full = 0, computed = 0, saved_exact = 0, saved_cache = 0;
  TransformerWork& operator+=(const TransformerWork& o) {
    full += o.full;
    computed += o.computed;
    saved_exact += o.saved_exact;
    saved_cache += o.saved_cache;
    return *this;
  }
};

// A preview of a running chunk (model/preview.h) as the replica encoded it: never stored, the latest one per job is
// kept in memory for its watchers.
struct ChunkPreviewImage {
  int64_t chunk = 0;
  int64_t step = 0, steps = 0;  // 1-based row and rows of the chunk
  int64_t frame_begin = 0, frame_end = 0;  // latent frames of the whole video, left to right in the image
  int64_t frame_width = 0, frame_height = 0;
  std::string png;
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
  TransformerWork work;          // what the chunk's transformer calls computed and saved
};

struct ChunkCallbacks {
  std::function<void(int64_t row, int64_t rows)> on_step;  // after each denoising row (1-based row)
  std::function<bool()> should_stop;                       // cancelled, deadline passed or hard stop: stop now
  std::function<void(ChunkPreviewImage)> on_preview;       // a preview of the running chunk (preview_every)
};

// What a replica holds of the adapters chosen per request (--lora-dir): its status, and what placement prefers.
struct AdapterResidency {
  std::vector<std::string> resident;  // on its device now, most recently used first
  int64_t loads = 0;                  // adapters read from disk so far
  bool serves = false;                // it has an adapter bank (--lora-dir)
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
  // Cheap and thread-safe (read from any thread, never waits for a chunk or an adapter load).
  virtual AdapterResidency adapter_residency() const { return {}; }
};

}  // namespace skyreels::server
