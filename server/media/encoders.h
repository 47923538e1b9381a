// The optional model parts around the transformer: the text encoder (text prompts -> prompt embeddings, in the
// submitting RPC) and the VAE (chunk latents -> MP4 on demand, on a worker thread, chunk after chunk in each job's
// order).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "server/queue/event_stream.h"
#include "server/queue/job_types.h"
#include "server/media/media_metrics.h"
#include "server/replica/model_job.h"
#include "server/replica/replica.h"

namespace skyreels::model {
class WanVae;
}

namespace skyreels::server {

// Loads the UMT5 text encoder; the function returns F32 [1, T, text_dim] (T = 512) per text, all texts of a call in
// one TextEncoder::encode (cached by text and encoder, pad-aware, batched where that is faster). Each call's cache
// hits and misses go to `metrics` (may be null). Throws when its hidden size is not the transformer's text_dim.
TextEncoderFn load_text_encoder(const std::string& path, const std::string& tokenizer, const std::string& device,
                                const std::string& dtype, int64_t text_dim, MediaMetrics* metrics = nullptr);

// Loads the i2v pipeline's CLIP image encoder (model::load_clip_vision_encoder: a transformers folder, a pipeline
// folder holding image_encoder/, or the original open-clip weights) and its preprocessor_config.json (from
// `processor_dir`, else found beside the encoder as diffusers lays out a pipeline). Throws naming what is missing or
// does not fit the transformer's image_dim.
std::shared_ptr<const ImageEncoder> load_image_encoder(const std::string& path, const std::string& processor_dir,
                                                       const std::string& device, const std::string& dtype,
                                                       int64_t image_dim);

// Decodes a job's chunk latents with the Wan VAE (a decode session per job keeps the causal cache between chunks)
// and encodes them into one fragmented MP4 per job: chunk 0's segment is the init segment plus its fragment, later
// chunks' segments are one fragment each, so the segments joined in order are a playable MP4. Latents are read from
// the job store and each segment is stored there as soon as it is made (JobStore::put_segment), so an MP4 made once is
// never decoded again, not even after a restart.
//
// Only for jobs that want MP4 (issue 12, item 6): want() is called when a job asks for it at submit or on an MP4
// download that finds a segment missing; from then on its chunks are decoded as they finish. The work list holds one
// entry per such job (not one per chunk), so it is bounded by the jobs the scheduler keeps, and at most `max_jobs`. A
// job that ends without succeeding (failed, cancelled, deadline) loses its entry and its decode cache at once.
// --fault-inject's name for the video encoder: "vae@N" makes the N-th chunk encode throw (tests).
inline constexpr const char* kVideoEncoderFaultName = "vae";

class VideoEncoder {
 public:
  // `vae_path` "demo": a tiny random-weight VAE (for tests and the demo). `store` must outlive the encoder. `metrics`
  // may be null. Rules of `faults` named kVideoEncoderFaultName apply to the encodes (others are ignored).
  VideoEncoder(const std::string& vae_path, const std::string& device, JobStore& store, MediaMetrics* metrics = nullptr,
               int64_t max_jobs = 1024, const std::vector<FaultRule>& faults = {});
  ~VideoEncoder();
  // Starts (or keeps) decoding this job's chunks: those done already and every later one; nothing when its MP4 is
  // stored already. A job that ended without succeeding gets a video error instead; so does one beyond `max_jobs`
  // pending jobs.
  void want(const JobSnapshot& job);
  // Blocks until segment `chunk` of job `id` has been stored, the job's MP4 failed, the job is not being decoded, or
  // `until` (then `making` is set).
  SegmentWait wait_segment(const std::string& id, int64_t chunk, Clock::time_point until);
  // Blocks until no wanted chunk is left to encode, or `until`; true when idle (used by the drain).
  bool wait_idle(Clock::time_point until);
  // How the encoder reads a job's committed state (JobQueue::get), and the queue's stream of scheduler events
  // (JobQueue::events()), which it consumes: this pod's commits and ends as they happen, and a wanted job named by a
  // JobChanged is read again, so chunks committed on another pod and jobs that ended there are caught up; every
  // wanted job is read again at start and after ChangesMissed. follow_with({}, nullptr) before the queue goes: it
  // returns once no lookup is running.
  using JobLookup = std::function<std::optional<JobSnapshot>(const std::string& id, const std::string& owner)>;
  static constexpr std::chrono::milliseconds kCatchUpRetry{500};  // after a lookup failed (the store is away)
  void follow_with(JobLookup lookup, EventStream* events);
  void consume(const SchedulerEvent& event);
  // The loaded VAE, shared with jobs that encode image / video conditioning (its encode and decode may run
  // concurrently).
  std::shared_ptr<const model::WanVae> vae() const { return vae_; }
  int64_t pending_jobs();  // jobs with MP4 work left

 private:
  struct VideoState;
  struct Entry {
    std::string id;
    std::string owner;
    std::shared_ptr<const JobDescription> job;
    int64_t next_chunk = 0;  // next chunk to encode
    int64_t available = 0;   // chunks whose latents exist
    std::shared_ptr<VideoState> state;
  };
  void loop();
  void chunk_committed(const std::string& id, int64_t chunk);
  void job_ended(const JobSnapshot& job);
  void heard(const std::string& id, bool missed);  // notes the change, the worker reads the job (every one, `missed`)
  bool catch_up_pending_locked() const;
  bool catch_up_due_locked() const;
  void catch_up(std::unique_lock<std::mutex>& lock);
  void drop_locked(const std::string& id, JobState state);
  // Decodes chunk `chunk` of job `id` (its latents read from the store); returns its MP4 segment.
  std::string encode(const std::string& id, const JobDescription& job, int64_t chunk,
                     std::shared_ptr<VideoState>& state);
  std::string make_segment(const std::string& id, const JobDescription& job, int64_t chunk,
                           std::shared_ptr<VideoState>& state);
  void settle_locked(const std::string& id, const JobDescription& job, int64_t chunk,
                     const std::shared_ptr<VideoState>& state, const std::string& error);
  bool stored_already(const JobSnapshot& job) const;
  Entry* next_work_locked();
  void fail_locked(const std::string& id, const std::string& error);
  void publish_locked();
  std::shared_ptr<model::WanVae> vae_;
  JobStore& store_;
  MediaMetrics* metrics_;
  int64_t max_jobs_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Entry> wanted_;  // by job id
  // Jobs whose MP4 cannot be made, with the reason (bounded: the oldest are forgotten, and a later want() retries).
  std::map<std::string, std::string> errors_;
  std::deque<std::string> error_order_;
  std::string last_served_;
  bool busy_ = false;
  bool stopping_ = false;
  std::vector<FaultRule> faults_;
  int64_t encodes_ = 0;  // chunk encodes started, for faults_
  JobLookup lookup_;
  bool catching_up_ = false;  // a lookup runs without the lock
  std::set<std::string> stale_;  // wanted jobs the feed named since they were last read
  bool stale_all_ = false;       // every wanted job: at start, and after the feed missed changes
  Clock::time_point retry_at_{};  // a lookup failed: the next one waits until then
  Subscription subscription_;     // set and reset by follow_with's caller only
  std::thread thread_;
};

}  // namespace skyreels::server
