#include "server/media/encoders.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <utility>

#include "model/checkpoint.h"
#include "model/clip_vision.h"
#include "model/image_processor.h"
#include "model/text_encoding.h"
#include "model/vae_wan.h"
#include "model/video_mp4.h"
#include "server/job/blob.h"
#include "server/replica/demo_model.h"

namespace skyreels::server {

std::shared_ptr<const ImageEncoder> load_image_encoder(const std::string& path, const std::string& processor_dir,
                                                       const std::string& device, const std::string& dtype,
                                                       int64_t image_dim) {
  const std::string processor = processor_dir.empty() ? model::find_image_processor_dir(path) : processor_dir;
  if (processor.empty()) {
    throw std::runtime_error("--image-encoder: no preprocessor_config.json beside '" + path +
                             "'; pass --image-processor DIR");
  }
  auto encoder = std::make_shared<ImageEncoder>();
  encoder->processor = std::make_shared<const model::ClipImageProcessorConfig>(
      model::ClipImageProcessorConfig::from_file((std::filesystem::path(processor) / "preprocessor_config.json").string()));
  model::ClipVisionLoadOptions options;
  options.device = device;
  options.dtype = dtype;
  model::LoadedClipVision loaded = model::load_clip_vision_encoder(path, options);
  const int64_t hidden = loaded.model->config().hidden_size;
  if (hidden != image_dim) {
    throw std::runtime_error("--image-encoder: hidden size " + std::to_string(hidden) + " does not match the "
                             "transformer's image_dim " + std::to_string(image_dim));
  }
  spdlog::info("event=image_encoder_loaded path={} layout={} device={} hidden_size={} processor={}", loaded.path,
               model::clip_vision_layout_name(loaded.layout), device, hidden, processor);
  encoder->model = std::shared_ptr<const model::ClipVisionEncoder>(std::move(loaded.model));
  return encoder;
}

TextEncoderFn load_text_encoder(const std::string& path, const std::string& tokenizer, const std::string& device,
                                const std::string& dtype, int64_t text_dim, MediaMetrics* metrics) {
  model::TextEncoderOptions options;
  options.device = device;
  options.dtype = dtype;
  std::string encoder_path = path;
  std::string demo_dir;
  if (path == "demo") {  // a tiny random UMT5 matching the transformer's text_dim, for the README's main job
    if (tokenizer.empty()) {
      throw std::runtime_error("--text-encoder demo needs --tokenizer DIR (e.g. assets/demo/tokenizer)");
    }
    demo_dir = make_private_temp_dir("skyreels-demo-t5");
    model::write_tiny_text_encoder(demo_dir, text_dim, 7);
    encoder_path = demo_dir;
  }
  std::shared_ptr<model::TextEncoder> encoder = model::TextEncoder::load(encoder_path, tokenizer, options);
  if (!demo_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(demo_dir, ec);  // loaded (copied) already
  }
  if (encoder->hidden_size() != text_dim) {
    throw std::runtime_error("--text-encoder: hidden size " + std::to_string(encoder->hidden_size()) +
                             " does not match the transformer's text_dim " + std::to_string(text_dim));
  }
  spdlog::info("event=text_encoder_loaded path={} device={} hidden_size={}", path, device, text_dim);
  return [encoder, metrics](const std::vector<std::string>& texts) {
    c10::InferenceMode inference;
    at::Tensor embeds;
    model::TextEncodeStats stats;
    try {
      embeds = encoder->encode(texts, 512, &stats).to(at::kCPU, at::kFloat).contiguous();  // [N, 512, text_dim]
    } catch (const std::invalid_argument& e) {
      throw ValidationError(std::string("text.prompt: ") + e.what());
    }
    if (metrics) metrics->text_embedding_cache(stats.hits, stats.misses, encoder->cache_stats().bytes);
    std::vector<RawTensor> out;
    const size_t row_bytes = static_cast<size_t>(embeds.numel() / embeds.size(0)) * sizeof(float);
    for (int64_t i = 0; i < embeds.size(0); ++i) {
      RawTensor raw;
      raw.dtype = "F32";
      raw.shape = {1, embeds.size(1), embeds.size(2)};
      const char* data = reinterpret_cast<const char*>(embeds.data_ptr<float>()) + static_cast<size_t>(i) * row_bytes;
      raw.data.assign(data, row_bytes);
      out.push_back(std::move(raw));
    }
    return out;
  };
}

// What the encoder keeps per job between its chunks: the VAE's causal cache and the MP4 writer.
struct VideoEncoder::VideoState {
  std::unique_ptr<model::WanVaeDecodeSession> session;
  std::unique_ptr<video::Mp4Writer> writer;
  std::string pending;  // bytes the writer emitted since the last chunk was stored
};

VideoEncoder::VideoEncoder(const std::string& vae_path, const std::string& device, JobStore& store, MediaMetrics* metrics,
                           int64_t max_jobs, const std::vector<FaultRule>& faults)
    : store_(store), metrics_(metrics), max_jobs_(max_jobs) {
  for (const auto& rule : faults) {
    if (rule.replica == kVideoEncoderFaultName) faults_.push_back(rule);
  }
  std::string path = vae_path;
  std::string demo_dir;
  if (vae_path == "demo") {
    demo_dir = make_private_temp_dir("skyreels-demo-vae");
    write_tiny_vae(demo_dir);
    path = demo_dir;
  }
  checkpoint::PlaceOptions place;
  place.device = device;
  place.dtype = at::kFloat;  // the pipeline decodes in float32
  vae_ = std::make_shared<model::WanVae>(model::WanVae::load(path, place));
  if (!demo_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(demo_dir, ec);  // loaded (copied) already
  }
  spdlog::info("event=vae_loaded path={} device={}", vae_path, device);
  thread_ = std::thread([this] { loop(); });
}

VideoEncoder::~VideoEncoder() {
  subscription_.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

// The last segment is made last: when it is stored, every segment is.
bool VideoEncoder::stored_already(const JobSnapshot& job) const {
  if (job.state != JobState::Succeeded || job.description->chunks.empty()) return false;
  try {
    return store_.load_segment(job.id, static_cast<int64_t>(job.description->chunks.size()) - 1).has_value();
  } catch (const StoreError& e) {
    spdlog::warn("job={} event=video_store_read_failed error=\"{}\"", job.id, e.what());
    return false;  // decoded again: costs time, loses nothing
  }
}

void VideoEncoder::want(const JobSnapshot& job) {
  if (!job.description) return;
  const bool stored = stored_already(job);  // outside the lock: a store read
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (wanted_.count(job.id) || errors_.count(job.id) || stored) return;
    if (is_terminal(job.state) && job.state != JobState::Succeeded) {
      fail_locked(job.id, std::string("the job ended ") + job_state_name(job.state) + ": no MP4 is made for it");
    } else if (static_cast<int64_t>(wanted_.size()) >= max_jobs_) {
      fail_locked(job.id, "MP4 decoding is busy with " + std::to_string(wanted_.size()) +
                              " jobs; download the latents, or try again later");
    } else {
      Entry entry;
      entry.id = job.id;
      entry.owner = job.owner;
      entry.job = job.description;
      entry.available = job.chunks_done;
      wanted_.emplace(job.id, std::move(entry));
      stale_.insert(job.id);  // read once more: a chunk may have committed since `job` was read
      spdlog::info("job={} event=video_wanted chunks_available={}", job.id, job.chunks_done);
      publish_locked();
    }
  }
  cv_.notify_all();
}

SegmentWait VideoEncoder::wait_segment(const std::string& id, int64_t chunk, Clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu_);
  SegmentWait result;
  const bool ended = cv_.wait_until(lock, until, [&] {
    if (auto failed = errors_.find(id); failed != errors_.end()) {
      result.error = failed->second;
      return true;
    }
    auto it = wanted_.find(id);
    return it == wanted_.end() || it->second.next_chunk > chunk;
  });
  result.making = !ended;
  return result;
}

void VideoEncoder::fail_locked(const std::string& id, const std::string& error) {
  if (errors_.emplace(id, error).second) error_order_.push_back(id);
  while (static_cast<int64_t>(error_order_.size()) > max_jobs_) {
    errors_.erase(error_order_.front());
    error_order_.pop_front();
  }
}

void VideoEncoder::consume(const SchedulerEvent& event) {
  switch (event.kind) {
    case SchedulerEventKind::ChunkFinished:
      chunk_committed(event.job_id, event.chunk);
      return;
    case SchedulerEventKind::JobFinished:
      if (event.job) job_ended(*event.job);
      return;
    case SchedulerEventKind::JobChanged:
      heard(event.job_id, false);
      return;
    case SchedulerEventKind::ChangesMissed:
      heard("", true);
      return;
    case SchedulerEventKind::JobSubmitted:  // want() starts a job's MP4, not its submission
    case SchedulerEventKind::JobStarted:
    case SchedulerEventKind::ChunkStarted:
    case SchedulerEventKind::Handoff:
    case SchedulerEventKind::StepTimed:
    case SchedulerEventKind::StepProgress:
    case SchedulerEventKind::PreviewMade:
    case SchedulerEventKind::ChunkFailed:  // its retry commits later, or the job ends
    case SchedulerEventKind::LeaseTakeover:
    case SchedulerEventKind::ReplicaChanged:
    case SchedulerEventKind::ReplicaRecovered:
    case SchedulerEventKind::QueueChanged:
    case SchedulerEventKind::LookAgain:  // a failed lookup retries on its own timer
      return;
  }
}

void VideoEncoder::chunk_committed(const std::string& id, int64_t chunk) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = wanted_.find(id);
    if (it == wanted_.end()) return;  // nobody asked for this job's MP4 (yet)
    it->second.available = std::max(it->second.available, chunk + 1);
  }
  cv_.notify_all();  // the worker and the waiters share this condition variable
}

void VideoEncoder::job_ended(const JobSnapshot& job) {
  if (job.state == JobState::Succeeded) return;  // its wanted chunks are still encoded
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop_locked(job.id, job.state);
  }
  cv_.notify_all();
}

// Drops the job's pending work and its decode cache (a chunk being encoded right now finishes on its own copy).
void VideoEncoder::drop_locked(const std::string& id, JobState state) {
  if (wanted_.erase(id) == 0) return;
  spdlog::info("job={} event=video_dropped state={}", id, job_state_name(state));
  fail_locked(id, std::string("the job ended ") + job_state_name(state) + " before its MP4 was complete");
  publish_locked();
}

void VideoEncoder::follow_with(JobLookup lookup, EventStream* events) {
  subscription_.reset();  // outside mu_: consume() runs under the stream's lock and takes mu_
  const bool following = static_cast<bool>(lookup);
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !catching_up_; });
    lookup_ = std::move(lookup);
    stale_.clear();
    stale_all_ = false;
  }
  if (!following) return;
  if (events != nullptr) {
    subscription_ = Subscription(*events, events->subscribe([this](const SchedulerEvent& e) { consume(e); }));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stale_all_ = true;  // after follow(): a change from here on is heard, one before it is read now
  }
  cv_.notify_all();
}

void VideoEncoder::heard(const std::string& id, bool missed) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (missed) {
      stale_all_ = true;
    } else if (wanted_.count(id)) {
      stale_.insert(id);
    } else {
      return;  // not a job whose MP4 is being made
    }
  }
  cv_.notify_all();
}

bool VideoEncoder::catch_up_pending_locked() const {
  return lookup_ && !catching_up_ && (stale_all_ || !stale_.empty());
}

bool VideoEncoder::catch_up_due_locked() const { return catch_up_pending_locked() && Clock::now() >= retry_at_; }

// Wanted jobs the feed named (or all of them) read their job again, without the lock: a store read per job.
void VideoEncoder::catch_up(std::unique_lock<std::mutex>& lock) {
  std::vector<std::pair<std::string, std::string>> reads;  // (id, owner)
  for (const auto& [id, entry] : wanted_) {
    if (stale_all_ || stale_.count(id)) reads.emplace_back(id, entry.owner);
  }
  stale_.clear();
  stale_all_ = false;
  if (reads.empty()) return;
  const JobLookup lookup = lookup_;
  catching_up_ = true;
  lock.unlock();
  std::vector<std::pair<std::string, std::optional<JobSnapshot>>> seen;
  std::vector<std::string> failed;
  for (const auto& [id, owner] : reads) {
    try {
      seen.emplace_back(id, lookup(id, owner));
    } catch (const std::exception& e) {  // the store is away: look again after kCatchUpRetry
      spdlog::warn("job={} event=video_catch_up_failed error=\"{}\"", id, e.what());
      failed.push_back(id);
    }
  }
  lock.lock();
  catching_up_ = false;
  stale_.insert(failed.begin(), failed.end());
  if (!failed.empty()) retry_at_ = Clock::now() + kCatchUpRetry;
  for (const auto& [id, job] : seen) {
    auto it = wanted_.find(id);
    if (it == wanted_.end()) continue;
    if (!job) {
      drop_locked(id, JobState::Failed);  // dropped by retention meanwhile
    } else if (is_terminal(job->state) && job->state != JobState::Succeeded) {
      drop_locked(id, job->state);
    } else {
      it->second.available = std::max(it->second.available, job->chunks_done);
    }
  }
  cv_.notify_all();
}

VideoEncoder::Entry* VideoEncoder::next_work_locked() {
  // Round robin over the jobs with a chunk to encode, starting after the one served last.
  Entry* first = nullptr;
  for (auto& [id, entry] : wanted_) {
    if (entry.next_chunk >= entry.available) continue;
    if (last_served_ < id) return &entry;
    if (first == nullptr) first = &entry;
  }
  return first;
}

void VideoEncoder::publish_locked() {
  if (metrics_) metrics_->video_jobs_pending(static_cast<int64_t>(wanted_.size()));
}

int64_t VideoEncoder::pending_jobs() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(wanted_.size());
}

void VideoEncoder::loop() {
  c10::InferenceMode inference;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    Entry* entry = nullptr;
    auto ready = [&] { return stopping_ || catch_up_due_locked() || (entry = next_work_locked()) != nullptr; };
    if (catch_up_pending_locked()) {
      cv_.wait_until(lock, retry_at_, ready);  // a lookup failed: the retry is due then
    } else {
      cv_.wait(lock, ready);  // the feed, an observer call or want() wakes it
    }
    if (stopping_) return;
    if (catch_up_due_locked()) {
      catch_up(lock);  // also between chunks of busy work: a job waiting on another pod is not starved
      continue;
    }
    if (entry == nullptr) continue;
    // Copies: the entry may be dropped (its job cancelled) while the chunk is encoded.
    const std::string id = entry->id;
    const std::shared_ptr<const JobDescription> job = entry->job;
    std::shared_ptr<VideoState> state = entry->state;
    const int64_t chunk = entry->next_chunk;
    last_served_ = id;
    busy_ = true;
    lock.unlock();
    const std::string error = make_segment(id, *job, chunk, state);
    lock.lock();
    busy_ = false;
    settle_locked(id, *job, chunk, state, error);
    publish_locked();
    cv_.notify_all();
  }
}

// On the worker, without the lock. Returns the error, "" when stored (or not wanted any more).
std::string VideoEncoder::make_segment(const std::string& id, const JobDescription& job, int64_t chunk,
                                       std::shared_ptr<VideoState>& state) {
  try {
    const std::string segment = encode(id, job, chunk, state);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (wanted_.count(id) == 0) return "";          // dropped meanwhile (cancelled): nothing is kept
      if (metrics_) metrics_->video_chunk_encoded();  // before it is stored: whoever reads it sees it counted
    }
    store_.put_segment(id, chunk, segment);  // StoreError: this job's MP4 fails, like a decode error
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

void VideoEncoder::settle_locked(const std::string& id, const JobDescription& job, int64_t chunk,
                                 const std::shared_ptr<VideoState>& state, const std::string& error) {
  auto it = wanted_.find(id);
  if (!error.empty()) {
    spdlog::error("job={} event=video_encode_failed chunk={} error=\"{}\"", id, chunk, error);
    fail_locked(id, "video encoding failed at chunk " + std::to_string(chunk) + ": " + error);
    if (it != wanted_.end()) wanted_.erase(it);
  } else if (it != wanted_.end()) {
    it->second.state = state;
    it->second.next_chunk = chunk + 1;
    if (it->second.next_chunk == static_cast<int64_t>(job.chunks.size())) {
      wanted_.erase(it);  // complete: the decode cache goes
    }
  }
}

bool VideoEncoder::wait_idle(Clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, until, [&] {
    return !busy_ && std::none_of(wanted_.begin(), wanted_.end(),
                                  [](const auto& e) { return e.second.next_chunk < e.second.available; });
  });
}

std::string VideoEncoder::encode(const std::string& id, const JobDescription& job, int64_t chunk,
                                 std::shared_ptr<VideoState>& state) {
  ++encodes_;
  for (const auto& rule : faults_) {
    if (encodes_ == rule.nth || (rule.and_later && encodes_ > rule.nth)) {
      throw std::runtime_error("injected fault (--fault-inject vae@" + std::to_string(rule.nth) + ")");
    }
  }
  const auto bytes = store_.load_chunk_bytes(id, chunk);
  if (!bytes) throw std::runtime_error("chunk latents are not in the job store (the job was dropped)");
  const F32View view = parse_f32_tensor(*bytes, "latents");
  const at::Tensor all = at::from_blob(const_cast<char*>(view.data), view.shape, at::kFloat);
  const auto& layout = job.chunks.at(static_cast<size_t>(chunk));
  const at::Tensor latents = all.narrow(2, 0, all.size(2) - layout.suffix_frames);  // no last_image frame

  if (chunk == 0) {
    state = std::make_shared<VideoState>();
    state->session = std::make_unique<model::WanVaeDecodeSession>(*vae_);
    video::Mp4Options options;
    options.fps = static_cast<int>(job.params.fps);
    options.fragmented = true;
    VideoState* raw = state.get();
    state->writer = std::make_unique<video::Mp4Writer>(
        [raw](const uint8_t* data, size_t size) { raw->pending.append(reinterpret_cast<const char*>(data), size); },
        static_cast<int>(job.params.width), static_cast<int>(job.params.height), options);
  }
  if (!state) throw std::logic_error("no decode session (an earlier chunk failed)");
  const auto t0 = std::chrono::steady_clock::now();
  const at::Tensor frames = state->session->decode(vae_->denormalize(latents.to(vae_->device())));  // [1,3,T,H,W]
  const at::Tensor host = frames.select(0, 0).to(at::kCPU, at::kFloat);  // waits for the device: the decode's end
  if (metrics_) metrics_->vae_call("decode", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  state->writer->write_video(host);
  state->writer->end_segment();
  if (chunk + 1 == static_cast<int64_t>(job.chunks.size())) state->writer->finish();
  return std::exchange(state->pending, {});
}

}  // namespace skyreels::server
