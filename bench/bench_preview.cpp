// Previews of the running chunk (issue 35): what one preview adds to the denoising loop, and what making its image
// costs, at the chunk sizes of DF-1.3B-540P and -720P (97 frames: 25 latent frames).
//
//   bench_preview [--steps 10] [--repeats 3] [--threads N]
//
// The loop runs one chunk with a stand-in denoiser (velocity = 0.1 * input: no transformer), so its row time is the
// sampler's alone and the difference with previews after every row is the loop's preview cost (x0 of the updated
// frames, the copy handed out), in CPU seconds of this process. The image (RGB projection, host copy, frames side by side, PNG through FFmpeg) is
// timed apart: the server makes it on the replica's thread. Compare both with a transformer pass: BENCHMARKS.md.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "model/diffusion_forcing.h"
#include "model/preview.h"
#include "model/video_mp4.h"

namespace {

namespace model = skyreels::model;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Shape {
  const char* name;
  int64_t height, width;
};

// Seconds of one chunk loop; previews are counted into *made.
double loop_seconds(const model::GenerationParams& params, int64_t* made) {
  const model::DenoiserInfo info;
  const model::Denoiser denoiser = [](const model::DenoiseCall& call) { return call.latent_model_input * 0.1; };
  model::Conditioning conditioning;
  conditioning.prompt_embeds = at::zeros({1, 4, 8});
  model::StepHooks hooks;
  hooks.on_preview = [made](const model::ChunkPreview&) { ++*made; };
  auto noise = model::make_seeded_noise(7);
  const double start = skyreels::bench::process_cpu_seconds();  // robust to other processes on the cores
  model::generate(denoiser, info, params, conditioning, *noise, hooks);
  return skyreels::bench::process_cpu_seconds() - start;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 10;
  int repeats = 3, threads = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--steps") steps = std::atoll(argv[i + 1]);
    if (flag == "--repeats") repeats = std::atoi(argv[i + 1]);
    if (flag == "--threads") threads = std::atoi(argv[i + 1]);
  }
  if (threads > 0) at::set_num_threads(threads);
  std::printf("threads %d, %lld steps, guidance off, one chunk of 97 frames (25 latent frames), median of %d\n",
              at::get_num_threads(), static_cast<long long>(steps), repeats);
  std::printf("| size | latents | loop row | + preview in the loop | image (RGB, copy, PNG) | PNG bytes |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const Shape& shape : {Shape{"540P", 544, 960}, Shape{"720P", 720, 1280}}) {
    model::GenerationParams params;
    params.num_frames = 97;
    params.height = shape.height;
    params.width = shape.width;
    params.num_inference_steps = steps;
    params.guidance_scale = 1.0;
    std::vector<double> off, on;
    int64_t made = 0;
    for (int r = 0; r < repeats; ++r) {
      params.preview_every = 0;
      off.push_back(loop_seconds(params, &made));
      params.preview_every = 1;
      on.push_back(loop_seconds(params, &made));
    }
    const double row_off = median(off) / static_cast<double>(steps);
    const double row_on = median(on) / static_cast<double>(steps);

    // One preview's image, as the replica makes it.
    model::ChunkPreview preview;
    preview.x0 = at::randn({1, 16, 25, shape.height / 8, shape.width / 8});
    std::vector<double> image_seconds, default_level_seconds;
    size_t bytes = 0, default_level_bytes = 0;
    for (int r = 0; r < repeats; ++r) {
      auto start = Clock::now();
      bytes = skyreels::video::encode_png(model::preview_strip(preview), model::kPreviewPngCompression).size();
      image_seconds.push_back(seconds_since(start));
      start = Clock::now();
      default_level_bytes = skyreels::video::encode_png(model::preview_strip(preview)).size();
      default_level_seconds.push_back(seconds_since(start));
    }
    std::printf("| %s | 25x%lldx%lld | %.1f ms | %.2f ms | %.1f ms (FFmpeg's default level: %.1f ms) | %zu (%zu) |\n",
                shape.name, static_cast<long long>(shape.height / 8), static_cast<long long>(shape.width / 8),
                row_off * 1e3, (row_on - row_off) * 1e3, median(image_seconds) * 1e3,
                median(default_level_seconds) * 1e3, bytes, default_level_bytes);
  }
  return 0;
}
