// Previews of the running chunk (issue 35), model side: the loop's latents are the same with previews on or off, a
// preview's pixels are the projection of x0 = x_t - sigma * v computed independently from a fixture, and previews
// come after the rows `preview_every` selects with the chunk's new frames.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "model/diffusion_forcing.h"
#include "model/preview.h"
#include "model/video_mp4.h"
#include "tests/pipeline_case.h"
#include "tests/test_util.h"

namespace skyreels::model {
namespace {

using test::golden_path;
using test::max_abs_diff;

test::PipelineCase load_case(const std::string& name) {
  test::PipelineCase c = test::load_pipeline_case(name, golden_path(name));
  test::use_recorded_conditioning(c);
  return c;
}

// The video and every preview of one run of the fixture's transformer from its recorded noise.
struct PreviewRun {
  at::Tensor latents;
  std::vector<ChunkPreview> previews;
};

PreviewRun run_with_previews(const test::PipelineCase& c, const SkyReelsV2Transformer& model, int64_t preview_every) {
  GenerationParams params = c.params;
  params.preview_every = preview_every;
  PreviewRun run;
  StepHooks hooks;
  hooks.on_preview = [&](const ChunkPreview& p) { run.previews.push_back(p); };
  auto noise = make_recorded_noise(c.noise);
  run.latents = generate(model, params, c.conditioning, *noise, hooks);
  return run;
}

// DF text (async, long), image-to-video with a last image, video extension (long, async, addnoise_condition).
const std::vector<std::string> kCases = {"pipeline_df/p2_async_cbs2_ar2", "pipeline_df/p4_long_addnoise20",
                                         "pipeline_df_i2v/i1_sync_1chunk_last_image",
                                         "pipeline_df_v2v/v3_long_async_cbs2_ar2_addnoise20"};

class PreviewCase : public ::testing::TestWithParam<std::string> {};

TEST_P(PreviewCase, LatentsWithAPreviewAfterEveryRowEqualThoseWithoutBitForBit) {
  const test::PipelineCase c = load_case(GetParam());
  const auto model = test::load_fixture_transformer(c.base_dir + "/weights/diffusers");
  const PreviewRun off = run_with_previews(c, *model, 0);
  const PreviewRun on = run_with_previews(c, *model, 1);
  EXPECT_TRUE(off.previews.empty());
  int64_t rows = 0;
  for (const ChunkSpec& chunk : plan_chunks(c.params, c.model_block).chunks) rows += chunk.timestep_rows;
  EXPECT_EQ(static_cast<int64_t>(on.previews.size()), rows);
  EXPECT_TRUE(at::equal(on.latents, off.latents)) << "max |diff| " << max_abs_diff(on.latents, off.latents);
  EXPECT_TRUE(test::all_close(on.latents, c.output.at("latents"), 1e-4));
}

std::string label(const ::testing::TestParamInfo<std::string>& info) {
  return info.param.substr(info.param.find('/') + 1);
}
INSTANTIATE_TEST_SUITE_P(Fixtures, PreviewCase, ::testing::ValuesIn(kCases), label);

// diffusers' (>= 0.37) flow sigma of step 0: linspace(1, 1/T, N+1)[0] = 1 shifted by s*x/(1+(s-1)*x) is 1, which
// set_timesteps nudges to 1 - 1e-6 (so that log(sigma) stays finite).
float first_flow_sigma(double shift) {
  const double x = 1.0;
  return static_cast<float>(shift * x / (1.0 + (shift - 1.0) * x) - 1e-6);
}

// The previews of the fixture's loop replayed from its recorded predictions (no transformer).
std::vector<ChunkPreview> replayed_previews(const test::PipelineCase& c, int64_t preview_every) {
  GenerationParams params = c.params;
  params.preview_every = preview_every;
  std::vector<ChunkPreview> previews;
  StepHooks hooks;
  hooks.on_preview = [&](const ChunkPreview& p) { previews.push_back(p); };
  int calls = 0;
  auto noise = make_recorded_noise(c.noise);
  generate(test::trace_denoiser(c, &calls), test::fixture_info(c), params, c.conditioning, *noise, hooks);
  return previews;
}

TEST(Preview, PixelsAreTheFactorsTimesTheFixturesNoiseMinusSigmaTimesVelocity) {
  const test::PipelineCase c = load_case("pipeline_df/p1_sync_short");  // sync: row 0 updates every frame
  const std::vector<ChunkPreview> previews = replayed_previews(c, 1);
  ASSERT_FALSE(previews.empty());
  ASSERT_EQ(previews[0].row, 0);

  // Independently: the recorded model input and predictions of row 0, guidance, sigma, the projection per pixel.
  const at::Tensor x_t = c.trace.at(test::row_key(0, 0, "model_input"));
  const at::Tensor cond = c.trace.at(test::row_key(0, 0, "noise_pred_cond"));
  const at::Tensor uncond = c.trace.at(test::row_key(0, 0, "noise_pred_uncond"));
  const at::Tensor v = uncond + c.params.guidance_scale * (cond - uncond);
  const float sigma = first_flow_sigma(c.params.flow_shift);
  const auto x = x_t.accessor<float, 5>();
  const auto vel = v.accessor<float, 5>();
  const at::Tensor rgb = latent_rgb(previews[0].x0);  // [1, F, h, w, 3]
  const at::Tensor u8 = latent_rgb_u8(previews[0].x0);
  ASSERT_EQ(rgb.sizes(), (std::vector<int64_t>{1, x_t.size(2), x_t.size(3), x_t.size(4), 3}));
  const auto got = rgb.accessor<float, 5>();
  const auto got8 = u8.accessor<uint8_t, 5>();
  double worst = 0.0;
  int worst8 = 0;
  for (int64_t f = 0; f < x_t.size(2); ++f) {
    for (int64_t i = 0; i < x_t.size(3); ++i) {
      for (int64_t j = 0; j < x_t.size(4); ++j) {
        for (int k = 0; k < 3; ++k) {
          double sum = kWan21LatentRgbBias[k];
          for (int64_t ch = 0; ch < kPreviewLatentChannels; ++ch) {
            const float x0 = x[0][ch][f][i][j] - sigma * vel[0][ch][f][i][j];
            sum += static_cast<double>(x0) * kWan21LatentRgbFactors[ch][k];
          }
          const double expected = std::min(1.0, std::max(0.0, (sum + 1.0) / 2.0));
          worst = std::max(worst, std::abs(expected - got[0][f][i][j][k]));
          worst8 = std::max(worst8, std::abs(static_cast<int>(std::lround(expected * 255.0)) - got8[0][f][i][j][k]));
        }
      }
    }
  }
  std::printf("preview pixels: max |diff| %.3g before rounding, %d after\n", worst, worst8);
  EXPECT_LE(worst, 1e-5);
  EXPECT_LE(worst8, 1);  // only where the value sits on a rounding boundary
}

TEST(Preview, EveryNthRowAndTheLastRowOfEachChunkCarryTheChunksNewFrames) {
  const test::PipelineCase c = load_case("pipeline_df/p3_long_overlap_4chunks");
  const std::vector<ChunkPreview> previews = replayed_previews(c, 3);
  const ChunkPlan plan = plan_chunks(c.params, c.model_block);
  size_t next = 0;
  for (const ChunkSpec& chunk : plan.chunks) {
    for (int64_t row = 0; row < chunk.timestep_rows; ++row) {
      if ((row + 1) % 3 != 0 && row + 1 != chunk.timestep_rows) continue;
      ASSERT_LT(next, previews.size());
      const ChunkPreview& p = previews[next++];
      EXPECT_EQ(p.chunk, chunk.index);
      EXPECT_EQ(p.row, row);
      EXPECT_EQ(p.rows, chunk.timestep_rows);
      EXPECT_EQ(p.first_frame, chunk.output_begin);
      EXPECT_EQ(p.x0.size(2), chunk.output_end - chunk.output_begin);
      EXPECT_EQ(p.x0.size(0), 1);
    }
  }
  EXPECT_EQ(next, previews.size());
}

TEST(Preview, SkyreelsGenerateWritesAPngPerPreviewAndItsLatentsStayDiffusers) {
  const test::PipelineCase c = load_case("pipeline_df/p1_sync_short");  // 4 rows, 3 latent frames of 6x4
  const std::string dir = test::temp_dir("generate-previews");
  const double diff = test::expect_generate_matches(c, " --noise " + c.dir + "/noise.safetensors --preview-every 2 --previews " + dir);
  EXPECT_LE(diff, 1e-4);
  std::set<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    files.insert(entry.path().filename().string());
    const at::Tensor image = video::read_video(entry.path().string()).frames;
    EXPECT_EQ(image.sizes(), (std::vector<int64_t>{1, 4, 3 * 6, 3})) << entry.path();
  }
  EXPECT_EQ(files, (std::set<std::string>{"chunk000_row0001.png", "chunk000_row0003.png"}));
}

TEST(Preview, FramesGoSideBySideInTheStrip) {
  const at::Tensor frames = at::arange(2 * 3 * 4 * 3, at::kInt).to(at::kByte).reshape({2, 3, 4, 3});
  const at::Tensor strip = frame_strip(frames);
  ASSERT_EQ(strip.sizes(), (std::vector<int64_t>{3, 8, 3}));
  EXPECT_TRUE(at::equal(strip.narrow(1, 0, 4), frames[0]));
  EXPECT_TRUE(at::equal(strip.narrow(1, 4, 4), frames[1]));
}

}  // namespace
}  // namespace skyreels::model
