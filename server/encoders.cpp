#include "server/encoders.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

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

namespace {

// A fresh directory only this process can have made (mkdtemp: random name, mode 0700), never a predictable path that
// another local user could have created or linked first.
std::string make_private_temp_dir(const std::string& prefix) {
  std::string path = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (::mkdtemp(path.data()) == nullptr) throw std::runtime_error("cannot create a temp directory for " + prefix);
  return path;
}

}  // namespace

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

namespace {

// What the encoder keeps per job between its chunks.
struct VideoState {
  std::unique_ptr<model::WanVaeDecodeSession> session;
  std::unique_ptr<video::Mp4Writer> writer;
  std::string pending;  // bytes the writer emitted since the last chunk was stored
};

}  // namespace

VideoEncoder::VideoEncoder(const std::string& vae_path, const std::string& device,
                           const std::vector<FaultRule>& faults) {
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
  vae_ = std::make_unique<model::WanVae>(model::WanVae::load(path, place));
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

void VideoEncoder::chunk_finished(const JobSnapshot& job, const std::string&, int64_t chunk, double, int64_t) {
  if (dynamic_cast<ModelJob*>(job.payload.get()) == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back({job.payload, chunk});
  }
  cv_.notify_all();  // the worker and drain waiters share this condition variable
}

void VideoEncoder::loop() {
  c10::InferenceMode inference;
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (stopping_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
    }
    auto& job = static_cast<ModelJob&>(*task.job);
    try {
      encode(job, task.chunk);
    } catch (const std::exception& e) {
      spdlog::error("event=video_encode_failed chunk={} error=\"{}\"", task.chunk, e.what());
      job.set_video_error(std::string("video encoding failed at chunk ") + std::to_string(task.chunk) + ": " +
                          e.what());
      job.video_state().reset();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

bool VideoEncoder::wait_idle(Clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, until, [&] { return tasks_.empty() && !busy_; });
}

void VideoEncoder::encode(ModelJob& job, int64_t chunk) {
  ++encodes_;
  for (const auto& rule : faults_) {
    if (encodes_ == rule.nth || (rule.and_later && encodes_ > rule.nth)) {
      throw std::runtime_error("injected fault (--fault-inject vae@" + std::to_string(rule.nth) + ")");
    }
  }
  auto blob = job.chunk_result(chunk);
  if (!blob) throw std::logic_error("chunk latents missing");
  const F32View view = parse_f32_tensor(blob->bytes, "latents");
  const at::Tensor latents = at::from_blob(const_cast<char*>(view.data), view.shape, at::kFloat);

  auto& slot = job.video_state();
  if (chunk == 0) {
    auto state = std::make_shared<VideoState>();
    state->session = std::make_unique<model::WanVaeDecodeSession>(*vae_);
    video::Mp4Options options;
    options.fps = static_cast<int>(job.params().fps);
    options.fragmented = true;
    VideoState* raw = state.get();
    state->writer = std::make_unique<video::Mp4Writer>(
        [raw](const uint8_t* data, size_t size) { raw->pending.append(reinterpret_cast<const char*>(data), size); },
        static_cast<int>(job.params().width), static_cast<int>(job.params().height), options);
    slot = state;
  }
  auto* state = static_cast<VideoState*>(slot.get());
  if (state == nullptr) throw std::logic_error("no decode session (an earlier chunk failed)");
  const at::Tensor frames = state->session->decode(vae_->denormalize(latents.to(vae_->device())));  // [1,3,T,H,W]
  state->writer->write_video(frames.select(0, 0).to(at::kCPU, at::kFloat));
  state->writer->end_segment();
  if (chunk + 1 == job.chunk_count()) state->writer->finish();
  job.set_chunk_video(chunk, std::move(state->pending));
  state->pending.clear();
  if (chunk + 1 == job.chunk_count()) slot.reset();  // the job's video is complete
}

}  // namespace skyreels::server
