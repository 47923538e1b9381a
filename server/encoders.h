// The optional model parts around the transformer: the text encoder (text prompts -> prompt embeddings, in the
// submitting RPC) and the VAE (chunk latents -> MP4, on a worker thread, chunk after chunk in each job's order).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "server/model_job.h"
#include "server/replica.h"
#include "server/scheduler.h"

namespace skyreels::model {
class WanVae;
}

namespace skyreels::server {

// Loads the UMT5 text encoder; the function returns F32 [1, T, text_dim] (T = 512) for one prompt. Throws when its
// hidden size is not the transformer's text_dim.
TextEncoderFn load_text_encoder(const std::string& path, const std::string& tokenizer, const std::string& device,
                                const std::string& dtype, int64_t text_dim);

// Decodes each finished chunk's latents with the Wan VAE (a decode session per job keeps the causal cache between
// chunks) and encodes them into one fragmented MP4 per job: chunk 0's blob is the init segment plus its fragment,
// later chunks' blobs are one fragment each, so the chunks joined in order are a playable MP4.
// Hooked in as a SchedulerObserver (chunk_finished enqueues; the work happens on its own thread).
// --fault-inject's name for the video encoder: "vae@N" makes the N-th chunk encode throw (tests).
inline constexpr const char* kVideoEncoderFaultName = "vae";

class VideoEncoder : public SchedulerObserver {
 public:
  // `vae_path` "demo": a tiny random-weight VAE (for tests and the demo). Rules of `faults` named
  // kVideoEncoderFaultName apply to the encodes (others are ignored).
  VideoEncoder(const std::string& vae_path, const std::string& device, const std::vector<FaultRule>& faults = {});
  ~VideoEncoder() override;
  void chunk_finished(const JobSnapshot& job, const std::string& replica, int64_t chunk, double seconds,
                      int64_t frames) override;
  // Blocks until every queued chunk is encoded, or `until`; true when idle (used by the drain).
  bool wait_idle(Clock::time_point until);

 private:
  struct Task {
    std::shared_ptr<JobPayload> job;
    int64_t chunk;
  };
  void loop();
  void encode(ModelJob& job, int64_t chunk);
  std::unique_ptr<model::WanVae> vae_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  bool busy_ = false;
  bool stopping_ = false;
  std::vector<FaultRule> faults_;
  int64_t encodes_ = 0;  // chunk encodes started, for faults_
  std::thread thread_;
};

// Forwards every observer call to several observers (metrics, the video encoder).
class ObserverList : public SchedulerObserver {
 public:
  void add(SchedulerObserver* observer) { observers_.push_back(observer); }
  void job_submitted(const JobSnapshot& j) override {
    for (auto* o : observers_) o->job_submitted(j);
  }
  void job_started(const JobSnapshot& j, double w) override {
    for (auto* o : observers_) o->job_started(j, w);
  }
  void job_finished(const JobSnapshot& j) override {
    for (auto* o : observers_) o->job_finished(j);
  }
  void chunk_started(const JobSnapshot& j, const std::string& r, int64_t c) override {
    for (auto* o : observers_) o->chunk_started(j, r, c);
  }
  void chunk_finished(const JobSnapshot& j, const std::string& r, int64_t c, double s, int64_t f) override {
    for (auto* o : observers_) o->chunk_finished(j, r, c, s, f);
  }
  void chunk_failed(const JobSnapshot& j, const std::string& r, int64_t c, const std::string& e, bool w) override {
    for (auto* o : observers_) o->chunk_failed(j, r, c, e, w);
  }
  void step(const std::string& r, double s) override {
    for (auto* o : observers_) o->step(r, s);
  }
  void handoff(const JobSnapshot& j, const std::string& f, const std::string& t) override {
    for (auto* o : observers_) o->handoff(j, f, t);
  }
  void replica_changed(const ReplicaStatus& r) override {
    for (auto* o : observers_) o->replica_changed(r);
  }
  void queue_changed(int64_t q, int64_t r) override {
    for (auto* o : observers_) o->queue_changed(q, r);
  }

 private:
  std::vector<SchedulerObserver*> observers_;
};

}  // namespace skyreels::server
