#include "server/encoders.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "model/checkpoint.h"
#include "model/text_encoding.h"
#include "model/vae_wan.h"
#include "model/video_mp4.h"
#include "server/blob.h"
#include "server/demo_model.h"

namespace skyreels::server {

TextEncoderFn load_text_encoder(const std::string& path, const std::string& tokenizer, const std::string& device,
                                const std::string& dtype, int64_t text_dim) {
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
  return [encoder](const std::string& text) {
    c10::InferenceMode inference;
    at::Tensor embeds;
    try {
      embeds = encoder->encode({text}).to(at::kCPU, at::kFloat).contiguous();  // [1, 512, text_dim]
    } catch (const std::invalid_argument& e) {
      throw ValidationError(std::string("text.prompt: ") + e.what());
    }
    RawTensor raw;
    raw.dtype = "F32";
    raw.shape = embeds.sizes().vec();
    raw.data.assign(reinterpret_cast<const char*>(embeds.data_ptr<float>()), embeds.numel() * sizeof(float));
    return raw;
  };
}

// What the encoder keeps per job between its chunks: the VAE's causal cache and the MP4 writer.
struct VideoEncoder::VideoState {
  std::unique_ptr<model::WanVaeDecodeSession> session;
  std::unique_ptr<video::Mp4Writer> writer;
  std::string pending;  // bytes the writer emitted since the last chunk was stored
};

VideoEncoder::VideoEncoder(const std::string& vae_path, const std::string& device, Metrics* metrics, int64_t max_jobs,
                           const std::vector<FaultRule>& faults)
    : metrics_(metrics), max_jobs_(max_jobs) {
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void VideoEncoder::want(const JobSnapshot& snapshot) {
  auto* job = dynamic_cast<ModelJob*>(snapshot.payload.get());
  if (job == nullptr) return;
  if (is_terminal(snapshot.state) && snapshot.state != JobState::Succeeded) {
    job->set_video_error(std::string("the job ended ") + job_state_name(snapshot.state) + ": no MP4 is made for it");
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (wanted_.count(job) || job->video_complete() || !job->video_error().empty()) return;
    if (static_cast<int64_t>(wanted_.size()) >= max_jobs_) {
      job->set_video_error("MP4 decoding is busy with " + std::to_string(wanted_.size()) +
                           " jobs; download the latents, or try again later");
      return;
    }
    Entry entry;
    entry.job = snapshot.payload;
    entry.available = job->chunks_available();
    wanted_.emplace(job, std::move(entry));
    spdlog::info("job={} event=video_wanted chunks_available={}", snapshot.id, job->chunks_available());
    publish_locked();
  }
  cv_.notify_all();
}

void VideoEncoder::chunk_finished(const JobSnapshot& job, const std::string&, int64_t chunk, double, int64_t) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = wanted_.find(job.payload.get());
    if (it == wanted_.end()) return;  // nobody asked for this job's MP4 (yet)
    it->second.available = std::max(it->second.available, chunk + 1);
  }
  cv_.notify_all();  // the worker and drain waiters share this condition variable
}

void VideoEncoder::job_finished(const JobSnapshot& snapshot) {
  if (snapshot.state == JobState::Succeeded) return;  // its wanted chunks are still encoded
  auto* job = dynamic_cast<ModelJob*>(snapshot.payload.get());
  if (job == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Drops the job's pending work and its decode cache (a chunk being encoded right now finishes on its own copy).
    if (wanted_.erase(job) > 0) {
      spdlog::info("job={} event=video_dropped state={}", snapshot.id, job_state_name(snapshot.state));
    }
    publish_locked();
  }
  job->set_video_error(std::string("the job ended ") + job_state_name(snapshot.state) + " before its MP4 was complete");
  cv_.notify_all();
}

VideoEncoder::Entry* VideoEncoder::next_work_locked() {
  // Round robin over the jobs with a chunk to encode, starting after the one served last.
  Entry* first = nullptr;
  for (auto& [key, entry] : wanted_) {
    if (entry.next_chunk >= entry.available) continue;
    if (std::less<const JobPayload*>()(last_served_, key)) return &entry;
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
    cv_.wait(lock, [&] { return stopping_ || (entry = next_work_locked()) != nullptr; });
    if (stopping_) return;
    // Copies: the entry may be dropped (its job cancelled) while the chunk is encoded.
    const std::shared_ptr<JobPayload> payload = entry->job;
    std::shared_ptr<VideoState> state = entry->state;
    const int64_t chunk = entry->next_chunk;
    last_served_ = payload.get();
    busy_ = true;
    lock.unlock();
    auto& job = static_cast<ModelJob&>(*payload);
    std::string error;
    try {
      encode(job, chunk, state);
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    busy_ = false;
    auto it = wanted_.find(payload.get());
    if (!error.empty()) {
      spdlog::error("event=video_encode_failed chunk={} error=\"{}\"", chunk, error);
      job.set_video_error("video encoding failed at chunk " + std::to_string(chunk) + ": " + error);
      if (it != wanted_.end()) wanted_.erase(it);
    } else if (it != wanted_.end()) {
      if (metrics_) metrics_->video_chunk_encoded();
      it->second.state = state;
      it->second.next_chunk = chunk + 1;
      if (it->second.next_chunk == job.chunk_count()) wanted_.erase(it);  // complete: the decode cache goes
    }
    publish_locked();
    cv_.notify_all();
  }
}

bool VideoEncoder::wait_idle(Clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, until, [&] {
    return !busy_ && std::none_of(wanted_.begin(), wanted_.end(),
                                  [](const auto& e) { return e.second.next_chunk < e.second.available; });
  });
}

void VideoEncoder::encode(ModelJob& job, int64_t chunk, std::shared_ptr<VideoState>& state) {
  ++encodes_;
  for (const auto& rule : faults_) {
    if (encodes_ == rule.nth || (rule.and_later && encodes_ > rule.nth)) {
      throw std::runtime_error("injected fault (--fault-inject vae@" + std::to_string(rule.nth) + ")");
    }
  }
  auto blob = job.chunk_result(chunk);
  if (!blob) throw std::logic_error("chunk latents missing");
  const F32View view = parse_f32_tensor(blob->bytes, "latents");
  const at::Tensor all = at::from_blob(const_cast<char*>(view.data), view.shape, at::kFloat);
  const at::Tensor latents = all.narrow(2, 0, all.size(2) - job.chunk_suffix_frames(chunk));  // no last_image frame

  if (chunk == 0) {
    state = std::make_shared<VideoState>();
    state->session = std::make_unique<model::WanVaeDecodeSession>(*vae_);
    video::Mp4Options options;
    options.fps = static_cast<int>(job.params().fps);
    options.fragmented = true;
    VideoState* raw = state.get();
    state->writer = std::make_unique<video::Mp4Writer>(
        [raw](const uint8_t* data, size_t size) { raw->pending.append(reinterpret_cast<const char*>(data), size); },
        static_cast<int>(job.params().width), static_cast<int>(job.params().height), options);
  }
  if (!state) throw std::logic_error("no decode session (an earlier chunk failed)");
  const at::Tensor frames = state->session->decode(vae_->denormalize(latents.to(vae_->device())));  // [1,3,T,H,W]
  state->writer->write_video(frames.select(0, 0).to(at::kCPU, at::kFloat));
  state->writer->end_segment();
  if (chunk + 1 == job.chunk_count()) state->writer->finish();
  job.set_chunk_video(chunk, std::move(state->pending));
  state->pending.clear();
}

}  // namespace skyreels::server
