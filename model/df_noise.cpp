// The noise sources of diffusion-forcing generation: seeded (torch.Generator("cpu") streams in diffusers' draw
// order, positioned on any chunk by re-drawing the earlier ones, copyable so a server keeps one per job) and recorded
// (the fixtures' noise tensors, consumed in order). Separate from the loop because the loop only asks for tensors of
// a shape; where they come from, and how a chunk run on another replica draws the same values, is this file's concern.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/shape_text.h"

namespace skyreels::model {

namespace {

at::Tensor draw(at::Generator& generator, at::IntArrayRef shape) {
  return at::randn(shape, generator, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
}

std::vector<int64_t> with_frames(at::IntArrayRef shape, int64_t frames) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  out.at(2) = frames;
  return out;
}

// Latent noise: torch.Generator("cpu").manual_seed(seed) drawing every chunk's latents in order, as diffusers'
// prepare_latents does. Condition noise (addnoise_condition): diffusers draws it with torch.randn_like from the
// global (device) RNG, which no seed of ours can reproduce; here it comes from a second CPU generator seeded with
// seed + 1, consumed in the same order (every row of every chunk that has a prefix). Either stream is positioned on
// chunk k by re-drawing (and discarding) the draws of the chunks before it, so any chunk can run first, anywhere.
class SeededNoise final : public NoiseSource {
 public:
  explicit SeededNoise(uint64_t seed) : seed_(seed) {
    reset_latent();
    reset_condition();
  }

  void begin_chunk(const ChunkPlan& plan, int64_t /*chunk_index*/) override { plan_ = plan; }

  // The generators' whole state (mt19937 and the cached normal samples) is copied: the copy continues bit for bit.
  std::unique_ptr<NoiseSource> clone() const override {
    std::unique_ptr<SeededNoise> copy(new SeededNoise(*this));
    copy->latent_ = latent_.clone();
    copy->condition_ = condition_.clone();
    return copy;
  }
  int64_t values_drawn() const override { return drawn_; }

  at::Tensor latent_noise(int64_t chunk_index, at::IntArrayRef shape) override {
    if (chunk_index < latent_next_) reset_latent();
    while (latent_next_ < chunk_index) {
      take(latent_, with_frames(shape, chunk(latent_next_).num_latent_frames));
      ++latent_next_;
    }
    ++latent_next_;
    return take(latent_, shape);
  }

  at::Tensor condition_noise(int64_t chunk_index, int64_t row, at::IntArrayRef shape) override {
    if (std::make_pair(chunk_index, row) < std::make_pair(cond_chunk_, cond_row_)) reset_condition();
    while (cond_chunk_ < chunk_index) {  // skip the rest of an earlier chunk
      const ChunkSpec& c = chunk(cond_chunk_);
      if (c.prefix_frames > 0) {
        for (; cond_row_ < c.timestep_rows; ++cond_row_) take(condition_, with_frames(shape, c.prefix_frames));
      }
      ++cond_chunk_;
      cond_row_ = 0;
    }
    for (; cond_row_ < row; ++cond_row_) take(condition_, shape);
    ++cond_row_;
    return take(condition_, shape);
  }

 private:
  SeededNoise(const SeededNoise&) = default;  // clone() only: the generators are then cloned, not shared
  at::Tensor take(at::Generator& generator, at::IntArrayRef shape) {
    at::Tensor t = draw(generator, shape);
    drawn_ += t.numel();
    return t;
  }

  void reset_latent() {
    latent_ = at::make_generator<at::CPUGeneratorImpl>(seed_);
    latent_next_ = 0;
  }
  void reset_condition() {
    condition_ = at::make_generator<at::CPUGeneratorImpl>(seed_ + 1);
    cond_chunk_ = 0;
    cond_row_ = 0;
  }
  const ChunkSpec& chunk(int64_t index) const {
    if (!plan_ || index >= static_cast<int64_t>(plan_->chunks.size())) {
      throw std::logic_error("seeded noise: chunk " + std::to_string(index) +
                             " requested without its plan (call begin_chunk first)");
    }
    return plan_->chunks[static_cast<size_t>(index)];
  }

  uint64_t seed_;
  std::optional<ChunkPlan> plan_;
  at::Generator latent_;
  int64_t latent_next_ = 0;
  at::Generator condition_;
  int64_t cond_chunk_ = 0;
  int64_t cond_row_ = 0;
  int64_t drawn_ = 0;
};

class RecordedNoise final : public NoiseSource {
 public:
  explicit RecordedNoise(std::vector<at::Tensor> draws) : draws_(std::move(draws)) {}

  at::Tensor latent_noise(int64_t chunk_index, at::IntArrayRef shape) override {
    return next(shape, "latent noise of chunk " + std::to_string(chunk_index));
  }
  at::Tensor condition_noise(int64_t chunk_index, int64_t row, at::IntArrayRef shape) override {
    return next(shape, "condition noise of chunk " + std::to_string(chunk_index) + " row " + std::to_string(row));
  }

 private:
  at::Tensor next(at::IntArrayRef shape, const std::string& what) {
    char name[32];
    std::snprintf(name, sizeof(name), "noise_%03zu", next_);
    if (next_ >= draws_.size()) {
      throw std::invalid_argument(std::string("recorded noise: ") + name + " is missing (needed as " + what + ", " +
                                  std::to_string(draws_.size()) + " draws given)");
    }
    const at::Tensor& t = draws_[next_++];
    if (t.sizes() != shape) {
      throw std::invalid_argument(std::string("recorded noise: ") + name + " has shape " + shape_text(t.sizes()) +
                                  " but " + what + " needs " + shape_text(shape));
    }
    return t.to(at::kFloat).clone();  // a copy: the loop writes its latents in place, the recording stays as given
  }

  std::vector<at::Tensor> draws_;
  size_t next_ = 0;
};

}  // namespace

std::unique_ptr<NoiseSource> make_seeded_noise(uint64_t seed) { return std::make_unique<SeededNoise>(seed); }

std::unique_ptr<NoiseSource> make_recorded_noise(std::vector<at::Tensor> draws_in_order) {
  return std::make_unique<RecordedNoise>(std::move(draws_in_order));
}

}  // namespace skyreels::model
