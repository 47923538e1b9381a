// Running a job's chunk on a replica (ModelJob::run_chunk): the image / video conditioning encoded once, the chunk's
// noise from a copy of the job's committed streams, the video's tail for the next chunk, the result's bytes; a t2v /
// i2v job's whole video as one run; and a job restored from the results the store holds (ModelJob::restore_results).
#include <ATen/ATen.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "model/clip_vision.h"
#include "model/image_processor.h"
#include "model/rank_group.h"
#include "model/transformer_skyreels_v2.h"
#include "model/vae_wan.h"
#include "server/job/blob.h"
#include "server/replica/model_job_impl.h"

namespace skyreels::server {

// The VAE encode of the job's image / video, on the first chunk's replica thread. Chunks of one job never run
// concurrently, so the job's state needs no lock here.
void ModelJob::Impl::encode_conditioning_once() {
  if (pixels.empty()) return;
  model::EncodedConditioning encoded;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    encoded = model::encode_conditioning(*vae, pixels, generation);
  } catch (const std::invalid_argument& e) {
    throw ValidationError(e.what());
  }
  if (on_vae_encode) on_vae_encode(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  conditioning.prefix_latents = encoded.prefix_latents;
  conditioning.last_image_latents = encoded.last_image_latents;
  pixels = {};
}

// The i2v images' CLIP tokens and VAE condition video, as `skyreels generate --pipeline i2v` makes them.
void ModelJob::Impl::encode_images_once(const model::TransformerConfig& config) {
  if (!image_rgb.defined()) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<at::Tensor> images{image_rgb};
  if (last_image_rgb.defined()) images.push_back(last_image_rgb);
  const at::Tensor tokens =
      image_encoder->model->forward(model::clip_preprocess(*image_encoder->processor, images).pixel_values).penultimate;
  video.image_tokens = model::prepare_image_tokens(config, tokens.narrow(0, 0, 1),
                                                   last_image_rgb.defined() ? tokens.narrow(0, 1, 1) : at::Tensor());
  auto vae_side = [&](const at::Tensor& rgb) {
    return rgb.defined() ? model::vae_image_preprocess(rgb, generation.height, generation.width) : at::Tensor();
  };
  video.condition =
      model::prepare_i2v_condition(*vae, vae_side(image_rgb), vae_side(last_image_rgb), generation.num_frames)
          .condition;
  if (on_vae_encode) on_vae_encode(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  image_rgb = at::Tensor();
  last_image_rgb = at::Tensor();
}

namespace {

// Every rank's own copy of the job's committed noise streams (every rank draws the same values); rank 0's copy is the
// one committed when the chunk succeeds.
class RankDraws {
 public:
  explicit RankDraws(const model::NoiseSource& committed) : committed_(committed) {}
  model::NoiseSource& of(const model::RankGroups* groups) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto draws = committed_.clone();
    model::NoiseSource& mine = *draws;
    if (groups == nullptr || groups->first()) first_ = std::move(draws);
    else others_.push_back(std::move(draws));
    return mine;
  }
  std::unique_ptr<model::NoiseSource> committed() { return std::move(first_); }

 private:
  const model::NoiseSource& committed_;
  std::mutex mutex_;
  std::unique_ptr<model::NoiseSource> first_;
  std::vector<std::unique_ptr<model::NoiseSource>> others_;
};

// The loop on the replica's ranks, or once on its one device.
at::Tensor on_ranks(const RankRunner* ranks, const model::SkyReelsV2Transformer& transformer,
                    const model::StepHooks& hooks, const RankLoop& loop) {
  return ranks != nullptr ? (*ranks)(loop) : loop(transformer, hooks, nullptr);
}

// A chunk's result as the job store keeps it: its new latent frames (fp32, CPU) and where they belong.
std::string chunk_result_bytes(const at::Tensor& fresh, int64_t chunk, int64_t chunk_count,
                               const model::ChunkSpec& spec, uint64_t seed) {
  if (fresh.size(2) != spec.output_end - spec.output_begin) {
    throw std::logic_error("chunk " + std::to_string(chunk) + " produced " + std::to_string(fresh.size(2)) +
                           " new latent frames, the plan expects " +
                           std::to_string(spec.output_end - spec.output_begin));
  }
  return safetensors_bytes("latents", fresh.sizes().vec(), fresh.data_ptr<float>(),
                           {{"chunk_index", std::to_string(chunk)},
                            {"chunk_count", std::to_string(chunk_count)},
                            {"latent_frame_begin", std::to_string(spec.output_begin)},
                            {"latent_frame_end", std::to_string(spec.output_end)},
                            {"seed", std::to_string(seed)}});
}
}  // namespace

// The t2v / i2v call, as `skyreels generate --pipeline t2v|i2v` makes it: one video from the job's noise stream.
std::string ModelJob::Impl::run_whole_video(const model::SkyReelsV2Transformer& transformer,
                                            const model::StepHooks& hooks, const model::GenerationParams& params,
                                            const RankRunner* ranks) {
  encode_images_once(transformer.config());
  if (!noise) noise = model::make_seeded_noise(resolved.seed);
  RankDraws draws(*noise);
  const at::Tensor latents =
      on_ranks(ranks, transformer, hooks,
               [&](const model::SkyReelsV2Transformer& t, const model::StepHooks& h, const model::RankGroups* g) {
                 model::VideoHooks video_hooks;
                 video_hooks.cancelled = h.cancelled;
                 video_hooks.on_call = h.on_call;  // the transformer work and the step cache's decisions
                 video_hooks.on_step = [&h](int64_t step, int64_t steps, const at::Tensor&) {
                   if (h.on_step) h.on_step(0, step, steps);
                 };
                 return model::generate_video(t, pipeline, params, video, draws.of(g), 1, video_hooks, g);
               })
          .contiguous();
  std::string bytes = chunk_result_bytes(latents, 0, 1, plan.chunks.front(), resolved.seed);
  noise = draws.committed();
  return bytes;
}

std::string ModelJob::run_chunk(const model::SkyReelsV2Transformer& transformer, int64_t chunk,
                                const model::StepHooks& hooks, const std::vector<model::ActiveAdapter>& adapters,
                                const RankRunner* ranks) {
  Impl& d = *impl_;
  model::GenerationParams params = d.generation;  // the job's, with this replica's copy of its adapters
  params.adapters = adapters;
  if (d.pipeline != model::PipelineKind::kDiffusionForcing) return d.run_whole_video(transformer, hooks, params, ranks);
  const model::ChunkSpec& spec = d.plan.chunks.at(static_cast<size_t>(chunk));
  // Chunk k's noise depends on (seed, k) only, never on where chunk k-1 ran. The chunk draws from a copy of the
  // job's committed streams (O(chunk) draws, not O(all chunks so far)); a failed chunk leaves them untouched, so its
  // retry, on any replica, draws the same values.
  d.encode_conditioning_once();
  if (!d.noise) d.noise = model::make_seeded_noise(d.resolved.seed);
  RankDraws draws(*d.noise);
  const at::Tensor latents = on_ranks(
      ranks, transformer, hooks,
      [&](const model::SkyReelsV2Transformer& t, const model::StepHooks& h, const model::RankGroups* g) {
        return model::run_chunk(t, params, d.plan, chunk, d.conditioning, d.tail, draws.of(g), h, nullptr, g);
      });

  // The video's tail for the next chunk, on this replica's device, as diffusers' accumulated video would end.
  const int64_t overlap = d.plan.overlap_latent_frames;
  at::Tensor tail;
  if (overlap > 0 && chunk + 1 < chunk_count()) {
    const at::Tensor video = model::accumulate(chunk == 0 ? at::Tensor() : d.tail.to(latents.device()), latents, spec);
    tail = video.narrow(2, video.size(2) - overlap, overlap).clone();
  }
  const at::Tensor fresh =
      latents.narrow(2, spec.keep_from, latents.size(2) - spec.keep_from).to(at::kCPU, at::kFloat).contiguous();
  std::string bytes = chunk_result_bytes(fresh, chunk, chunk_count(), spec, d.resolved.seed);
  d.tail = tail;
  d.noise = draws.committed();
  return bytes;
}

void ModelJob::restore_results(const std::vector<std::string>& chunk_bytes) {
  Impl& d = *impl_;
  const auto n = static_cast<int64_t>(chunk_bytes.size());
  if (n > chunk_count()) throw std::runtime_error("more stored chunks than the plan has");
  // The accumulated video is chunk 0's whole output (keep_from is 0) then every later chunk's new frames; the next
  // chunk reads its last overlap frames.
  const int64_t overlap = d.plan.overlap_latent_frames;
  const bool need_tail = overlap > 0 && n > 0 && n < chunk_count();
  std::vector<at::Tensor> video;
  for (int64_t k = 0; k < n; ++k) {
    const model::ChunkSpec& spec = d.plan.chunks[static_cast<size_t>(k)];
    const F32View view = parse_f32_tensor(chunk_bytes[static_cast<size_t>(k)], "latents");
    if (view.shape.size() != 5 || view.shape[2] != spec.output_end - spec.output_begin) {
      throw std::runtime_error("stored chunk " + std::to_string(k) + " does not match the job's plan");
    }
    if (need_tail) {
      at::Tensor t = at::empty(view.shape, at::kFloat);
      std::memcpy(t.data_ptr<float>(), view.data, view.bytes);
      video.push_back(std::move(t));
    }
  }
  if (need_tail) {
    const at::Tensor joined = at::cat(video, 2);
    if (joined.size(2) < overlap) {
      throw std::runtime_error("the stored chunks hold fewer latent frames than the next chunk's overlap");
    }
    d.tail = joined.narrow(2, joined.size(2) - overlap, overlap).clone();
  }
}

}  // namespace skyreels::server
