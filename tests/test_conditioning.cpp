// Image-to-video, video extension and a prompt per chunk, against diffusers' own DF ImageToVideo / VideoToVideo
// pipelines (tests/data/golden/pipeline_df_i2v, pipeline_df_v2v): the VAE encode of the conditioning on its own,
// the chunk plan, the loop replayed from the recorded transformer outputs, the real tiny transformer from recorded
// noise and from the seed, `skyreels generate`, and the requests diffusers crashes on.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/diffusion_forcing.h"
#include "model/pixel_conditioning.h"
#include "model/transformer_loader.h"
#include "model/transformer_skyreels_v2.h"
#include "model/vae_wan.h"
#include "model/video_mp4.h"
#include "tests/pipeline_case.h"
#include "tests/test_util.h"

namespace skyreels::model {
namespace {

using test::all_close;
using test::golden_path;
using test::load_tensors;
using test::max_abs_diff;
using Json = nlohmann::json;

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- a fixture case ---------------------------------------------------------------------------------------------

// A pipeline fixture plus its pixels and condition.safetensors. Its conditioning holds the prompts only; the
// condition latents come from the VAE (use_encoded_condition) or condition.safetensors (use_recorded_condition).
struct Case : test::PipelineCase {
  PixelConditioning pixels;
  std::map<std::string, at::Tensor> condition;
};

Case load_case(const std::string& name) {
  Case c;
  static_cast<test::PipelineCase&>(c) = test::load_pipeline_case(name, golden_path(name));
  if (c.inputs.count("image")) c.pixels.image = c.inputs.at("image");
  if (c.inputs.count("last_image")) c.pixels.last_image = c.inputs.at("last_image");
  if (c.inputs.count("video")) c.pixels.video = c.inputs.at("video");
  describe_conditioning(c.pixels, c.conditioning.prompt_embeds.size(0), c.params);
  c.condition = load_tensors(c.dir + "/condition.safetensors");
  return c;
}

int64_t model_block(const Case& c) { return c.model_block; }

// condition.safetensors' condition_latents, split as the pipeline splits them (image | last_image).
void use_recorded_condition(Case& c) { test::set_condition_latents(c.condition.at("condition_latents"), c); }

WanVae load_vae(const Case& c) { return WanVae::load(c.dir + "/weights/vae"); }

std::unique_ptr<SkyReelsV2Transformer> load_model(const Case& c) {
  return skyreels::test::load_fixture_transformer(c.dir + "/weights/diffusers");
}

void use_encoded_condition(Case& c) {
  const EncodedConditioning encoded = encode_conditioning(load_vae(c), c.pixels, c.params);
  c.conditioning.prefix_latents = encoded.prefix_latents;
  c.conditioning.last_image_latents = encoded.last_image_latents;
}

using test::fixture_info;
using test::row_key;
using test::run_chunks;
using test::trace_denoiser;

const std::vector<std::string> kAllCases = {"pipeline_df_i2v/i1_sync_1chunk_last_image",
                                            "pipeline_df_i2v/i2_long_3chunks_overlap9",
                                            "pipeline_df_i2v/i3_long_async_cbs2_ar2_addnoise20",
                                            "pipeline_df_v2v/v1_single_chunk",
                                            "pipeline_df_v2v/v2_long_3chunks",
                                            "pipeline_df_v2v/v3_long_async_cbs2_ar2_addnoise20"};
// Cases whose noise the seed alone defines (no addnoise_condition draws from diffusers' global RNG).
const std::vector<std::string> kSeedCases = {"pipeline_df_i2v/i1_sync_1chunk_last_image",
                                             "pipeline_df_i2v/i2_long_3chunks_overlap9",
                                             "pipeline_df_v2v/v1_single_chunk", "pipeline_df_v2v/v2_long_3chunks"};

std::string case_label(const ::testing::TestParamInfo<std::string>& info) {
  return info.param.substr(info.param.find('/') + 1);
}

// ---- the encode step on its own -------------------------------------------------------------------------------

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, VaeEncodeOfTheConditioningMatchesDiffusersWithin1e4) {
  const Case c = load_case(GetParam());
  const EncodedConditioning encoded = encode_conditioning(load_vae(c), c.pixels, c.params);
  const at::Tensor& mode = c.condition.at("vae_encode_mode_00");
  EXPECT_TRUE(all_close(encoded.posterior_mode, mode, 1e-4, 1e-4));
  at::Tensor normalised = encoded.prefix_latents;
  if (encoded.last_image_latents.defined()) normalised = at::cat({normalised, encoded.last_image_latents}, 0);
  // v2v: condition_latents is already cut to a multiple of the block size.
  const at::Tensor& expected = c.condition.at("condition_latents");
  ASSERT_GE(normalised.size(2), expected.size(2));
  EXPECT_TRUE(all_close(normalised.narrow(2, 0, expected.size(2)), expected, 1e-4, 1e-4));
  std::printf("[ %s ] encode max |diff| mode %.3g, condition latents %.3g\n", c.name.c_str(),
              max_abs_diff(encoded.posterior_mode, mode),
              max_abs_diff(normalised.narrow(2, 0, expected.size(2)), expected));
}

TEST_P(Golden, PlanMatchesTheChunksDiffusersRan) {
  const Case c = load_case(GetParam());
  const ChunkPlan plan = plan_chunks(c.params, model_block(c));
  const Json& chunks = c.json.at("chunks");
  ASSERT_EQ(plan.chunks.size(), chunks.size());
  for (size_t k = 0; k < chunks.size(); ++k) {
    EXPECT_EQ(plan.chunks[k].num_latent_frames, chunks[k].at("num_latent_frames").get<int64_t>()) << "chunk " << k;
    EXPECT_EQ(plan.chunks[k].prefix_frames, chunks[k].at("prefix_frames").get<int64_t>()) << "chunk " << k;
    EXPECT_EQ(plan.chunks[k].timestep_rows, chunks[k].at("rows").get<int64_t>()) << "chunk " << k;
  }
  EXPECT_EQ(plan.total_latent_frames, c.output.at("latents").size(2));
  EXPECT_EQ(plan.chunks.back().output_end, plan.total_latent_frames);
}

TEST_P(Golden, LoopReplayedFromRecordedPredictionsMatchesDiffusers) {
  Case c = load_case(GetParam());
  use_recorded_condition(c);
  auto noise = make_recorded_noise(c.noise);
  int calls = 0;
  const at::Tensor video = run_chunks(c, trace_denoiser(c, &calls), fixture_info(c), *noise, 1e-6);
  EXPECT_TRUE(all_close(video, c.output.at("latents"), 1e-6));
  EXPECT_EQ(calls, c.json.at("stats").at("num_transformer_calls").get<int>());
}

TEST_P(Golden, EncodeAndTransformerWithRecordedNoiseMatchDiffusersWithin1e4) {
  Case c = load_case(GetParam());
  use_encoded_condition(c);
  const auto model = load_model(c);
  auto noise = make_recorded_noise(c.noise);
  const at::Tensor video = run_chunks(c, transformer_denoiser(*model, c.params), denoiser_info(*model), *noise, 1e-4);
  EXPECT_TRUE(all_close(video, c.output.at("latents"), 1e-4));
  std::printf("[ %s ] recorded noise: max |diff| = %.3g\n", c.name.c_str(),
              max_abs_diff(video, c.output.at("latents")));
}

INSTANTIATE_TEST_SUITE_P(I2vV2v, Golden, ::testing::ValuesIn(kAllCases), case_label);

class SeedGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(SeedGolden, FromTheSeedAloneMatchesDiffusersWithin1e4) {
  Case c = load_case(GetParam());
  use_encoded_condition(c);
  const auto model = load_model(c);
  auto noise = make_seeded_noise(*c.params.seed);
  const at::Tensor video = generate(*model, c.params, c.conditioning, *noise);
  EXPECT_TRUE(all_close(video, c.output.at("latents"), 1e-4));
  std::printf("[ %s ] seed: max |diff| = %.3g\n", c.name.c_str(), max_abs_diff(video, c.output.at("latents")));
}

INSTANTIATE_TEST_SUITE_P(I2vV2v, SeedGolden, ::testing::ValuesIn(kSeedCases), case_label);

// ---- observations recorded by the fixtures ----------------------------------------------------------------------

TEST(Observations, ImageAndLastImageFramesAreKeptInTheOutput) {
  Case c = load_case("pipeline_df_i2v/i1_sync_1chunk_last_image");
  use_recorded_condition(c);
  auto noise = make_recorded_noise(c.noise);
  int calls = 0;
  const at::Tensor video = run_chunks(c, trace_denoiser(c, &calls), fixture_info(c), *noise, 1e-6);
  EXPECT_TRUE(at::equal(video.narrow(2, 0, 1), c.conditioning.prefix_latents));
  EXPECT_TRUE(at::equal(video.narrow(2, video.size(2) - 1, 1), c.conditioning.last_image_latents));
  // The pinned last_image column, as diffusers edits the matrix.
  const ChunkPlan plan = plan_chunks(c.params, 1);
  const std::vector<int64_t> timesteps =
      FlowUniPCSampler(c.params.scheduler, c.params.num_inference_steps).schedule().timesteps;
  const TimestepMatrix m = chunk_timestep_matrix(plan.chunks[0], timesteps, c.params.ar_step, 1);
  EXPECT_TRUE(at::equal(m.step_matrix, c.trace.at("c0_step_matrix_used")));
  EXPECT_TRUE(at::equal(m.update_mask, c.trace.at("c0_update_mask_used")));
}

// diffusers' quirk, kept by default: with causal_block_size 2 the 1-frame image prefix is not pre-ready and is
// denoised like noise, so the output's first frame is not the image's latent.
TEST(Observations, WithBlockSize2TheImageFrameIsDenoisedAsInDiffusers) {
  Case c = load_case("pipeline_df_i2v/i3_long_async_cbs2_ar2_addnoise20");
  use_recorded_condition(c);
  const ChunkPlan plan = plan_chunks(c.params, 1);
  EXPECT_EQ(plan.chunks[0].prefix_frames, 1);
  const TimestepMatrix m = chunk_timestep_matrix(plan.chunks[0], {999, 500, 1}, c.params.ar_step, 2);
  EXPECT_TRUE(m.update_mask.select(1, 0).any().item<bool>());
  EXPECT_FALSE(at::equal(c.output.at("latents").narrow(2, 0, 1), c.conditioning.prefix_latents));
}

TEST(Observations, PinImagePrefixKeepsTheImageFrameWithBlockSize2) {
  Case c = load_case("pipeline_df_i2v/i3_long_async_cbs2_ar2_addnoise20");
  use_recorded_condition(c);
  c.params.pin_image_prefix = true;
  const ChunkPlan plan = plan_chunks(c.params, 1);
  EXPECT_EQ(plan.chunks[0].timestep_rows, c.json.at("chunks")[0].at("rows").get<int64_t>());  // same schedule
  auto noise = make_recorded_noise(c.noise);
  int calls = 0;
  const Denoiser recorded_shapes = [&](const DenoiseCall& call) {
    ++calls;
    return at::zeros_like(call.latent_model_input);  // any prediction: the pinned frame must not move
  };
  at::Tensor video;
  for (const ChunkSpec& chunk : plan.chunks) {
    video = accumulate(
        video, run_chunk(recorded_shapes, fixture_info(c), c.params, plan, chunk.index, c.conditioning, video, *noise),
        chunk);
  }
  EXPECT_TRUE(at::equal(video.narrow(2, 0, 1), c.conditioning.prefix_latents));
  EXPECT_EQ(calls, c.json.at("stats").at("num_transformer_calls").get<int>());
}

// ---- where diffusers crashes or does the wrong thing ------------------------------------------------------------

at::Tensor synthetic_prediction(const DenoiseCall& call) {
  const at::Tensor x = call.latent_model_input.to(at::kFloat);
  const at::Tensor t = call.timestep.to(at::kFloat).view({x.size(0), 1, x.size(2), 1, 1});
  const at::Tensor text = call.encoder_hidden_states.to(at::kFloat).mean();
  return (0.7 * x + 0.002 * t - 0.5 * text + (call.unconditional ? 0.1 : -0.1))
      .to(call.latent_model_input.scalar_type());
}

GenerationParams small_image_request() {
  GenerationParams p;
  p.height = 32;
  p.width = 32;
  p.num_inference_steps = 3;
  p.guidance_scale = 5.0;
  p.mode = ConditioningMode::kImage;
  return p;
}

Conditioning small_conditioning(int64_t batch, uint64_t seed) {
  at::manual_seed(static_cast<int64_t>(seed));
  Conditioning c;
  c.prompt_embeds = at::randn({batch, 8, 32});
  c.negative_prompt_embeds = at::randn({batch, 8, 32});
  c.prefix_latents = at::randn({1, 16, 4, 4, 4});
  c.last_image_latents = at::randn({1, 16, 1, 4, 4});
  return c;
}

TEST(DiffusersCrashes, ImageToVideoWithLastImageOverALongVideoAppendsItToTheLastChunkOnly) {
  GenerationParams p = small_image_request();
  p.last_image = true;
  p.num_frames = 33;  // 9 latent frames
  p.base_num_frames = 17;
  p.overlap_history = 9;
  const ChunkPlan plan = plan_chunks(p, 1);
  ASSERT_EQ(plan.chunks.size(), 3u);
  EXPECT_EQ(plan.chunks[0].suffix_frames, 0);
  EXPECT_EQ(plan.chunks[2].suffix_frames, 1);
  EXPECT_EQ(plan.total_latent_frames, 10);
  const Conditioning cond = small_conditioning(1, 3);
  DenoiserInfo info;
  auto noise = make_seeded_noise(5);
  const at::Tensor video = generate(synthetic_prediction, info, p, cond, *noise);
  EXPECT_EQ(video.size(2), 10);
  EXPECT_TRUE(at::equal(video.narrow(2, 9, 1), cond.last_image_latents));
  EXPECT_TRUE(at::equal(video.narrow(2, 0, 1), cond.prefix_latents.narrow(2, 0, 1)));
}

TEST(DiffusersCrashes, ImageToVideoWhoseLastChunkIsShorterThanTheBaseRuns) {
  GenerationParams p = small_image_request();
  p.num_frames = 29;  // 8 latent frames: chunks of 5, 5 (3 new) and 4 (1 new)
  p.base_num_frames = 17;
  p.overlap_history = 9;
  const ChunkPlan plan = plan_chunks(p, 1);
  ASSERT_EQ(plan.chunks.size(), 3u);
  EXPECT_LT(plan.chunks.back().num_latent_frames, 5);
  auto noise = make_seeded_noise(5);
  const at::Tensor video = generate(synthetic_prediction, DenoiserInfo{}, p, small_conditioning(1, 4), *noise);
  EXPECT_EQ(video.size(2), 8);
}

TEST(DiffusersCrashes, OneImageServesEveryPromptAndOneImagePerPromptIsUsedPerPrompt) {
  GenerationParams p = small_image_request();
  p.num_frames = 9;
  Conditioning cond = small_conditioning(2, 6);
  auto noise = make_seeded_noise(5);
  const at::Tensor shared = generate(synthetic_prediction, DenoiserInfo{}, p, cond, *noise);
  EXPECT_TRUE(at::equal(shared.select(0, 1).narrow(1, 0, 1), cond.prefix_latents[0].narrow(1, 0, 1)));
  cond.prefix_latents = at::randn({2, 16, 1, 4, 4});
  auto noise2 = make_seeded_noise(5);
  const at::Tensor each = generate(synthetic_prediction, DenoiserInfo{}, p, cond, *noise2);
  EXPECT_TRUE(at::equal(each.narrow(2, 0, 1), cond.prefix_latents));
}

TEST(DiffusersCrashes, BadPixelRequestsAreClearErrors) {
  GenerationParams p = small_image_request();
  p.num_frames = 9;
  p.last_image = true;
  p.causal_block_size = 2;
  p.num_frames = 13;
  EXPECT_TRUE(contains(message_of([&] { plan_chunks(p, 1); }), "last_image: needs causal_block_size 1"));

  GenerationParams v = small_image_request();
  v.mode = ConditioningMode::kVideo;
  v.video_frames = 9;
  v.num_frames = 17;
  EXPECT_TRUE(contains(message_of([&] { plan_chunks(v, 1); }), "overlap_history: required to extend a video"));
  v.overlap_history = 17;  // 5 latent frames, all of the 5 the request has
  v.video_frames = 17;
  EXPECT_TRUE(contains(message_of([&] { plan_chunks(v, 1); }), "nothing would be generated"));
  v.overlap_history = 1;  // 1 latent frame < block 2
  v.causal_block_size = 2;
  v.num_frames = 21;
  EXPECT_TRUE(contains(message_of([&] { plan_chunks(v, 1); }), "video: its last 1 frame(s)"));

  PixelConditioning pixels;
  pixels.image = at::rand({1, 3, 32, 48});
  GenerationParams size = small_image_request();
  EXPECT_TRUE(contains(message_of([&] { describe_conditioning(pixels, 1, size); }), "image: 48x32 pixels"));
  pixels.image = at::rand({1, 3, 32, 32});
  pixels.video = at::rand({1, 5, 3, 32, 32});
  EXPECT_TRUE(contains(message_of([&] { describe_conditioning(pixels, 1, size); }), "cannot both be given"));
}

TEST(DiffusersCrashes, VideoExtensionWithTheVideoShorterThanTheOverlapUsesAllItsFrames) {
  GenerationParams p = small_image_request();
  p.mode = ConditioningMode::kVideo;
  p.video_frames = 5;      // 2 latent frames
  p.overlap_history = 17;  // 5 latent frames
  p.num_frames = 17;
  EXPECT_EQ(condition_prefix_frames(p, 1), 2);
  const ChunkPlan plan = plan_chunks(p, 1);
  EXPECT_EQ(plan.chunks[0].prefix_frames, 2);
  EXPECT_EQ(plan.total_latent_frames, 5);
}

// ---- pixels from untrusted bytes -----------------------------------------------------------------------------------

std::vector<uint8_t> mp4_of(int64_t frames, int64_t size) {
  return video::encode_mp4_segment(at::rand({3, frames, size, size}) * 2 - 1);
}

TEST(DecodePixels, LimitsAreCheckedBeforeDecodingAndOnlyTheLastFramesAreKept) {
  video::ReadLimits limits;
  limits.max_width = 32;
  limits.max_height = 32;
  limits.max_frames = 100;
  limits.keep_last = 5;
  const at::Tensor video = decode_pixels(mp4_of(9, 32), PixelKind::kVideo, limits, "video");
  EXPECT_EQ(video.sizes(), at::IntArrayRef({1, 5, 3, 32, 32}));
  EXPECT_GE(video.min().item<float>(), 0.0f);
  EXPECT_LE(video.max().item<float>(), 1.0f);
  limits.max_frames = 4;
  EXPECT_TRUE(contains(message_of([&] { decode_pixels(mp4_of(9, 32), PixelKind::kVideo, limits, "video"); }),
                       "video: not a readable MP4 video"));
  limits.max_frames = 100;
  EXPECT_TRUE(contains(message_of([&] { decode_pixels(mp4_of(2, 64), PixelKind::kVideo, limits, "video"); }),
                       "larger than the limit"));
  std::string png("\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR\0\x01\x86\xa0\0\x01\x86\xa0\x08\x02\0\0\0", 29);
  EXPECT_TRUE(contains(message_of([&] {
                         decode_pixels(std::vector<uint8_t>(png.begin(), png.end()), PixelKind::kImage, limits,
                                       "image");
                       }),
                       "100000x100000 PNG, larger than the limit"));
  EXPECT_TRUE(contains(message_of([&] { decode_pixels(mp4_of(3, 32), PixelKind::kImage, limits, "image"); }),
                       "image: an image must have exactly 1 frame"));
}

// ---- a prompt per chunk -----------------------------------------------------------------------------------------

TEST(PromptPerChunk, ThreeEqualPromptsEqualOnePromptBitForBitAndAChangedThirdChangesOnlyItsFrames) {
  Case c = load_case("pipeline_df_i2v/i2_long_3chunks_overlap9");
  use_recorded_condition(c);
  const auto model = load_model(c);
  const ChunkPlan plan = plan_chunks(c.params, 1);
  ASSERT_EQ(plan.chunks.size(), 3u);
  auto one_noise = make_seeded_noise(*c.params.seed);
  const at::Tensor one = generate(*model, c.params, c.conditioning, *one_noise);

  Conditioning three = c.conditioning;
  for (size_t k = 1; k < 3; ++k) {
    three.prompt_changes.push_back({plan.chunks[k].first_new_pixel_frame(), c.conditioning.prompt_embeds.clone(), {}});
  }
  auto three_noise = make_seeded_noise(*c.params.seed);
  EXPECT_TRUE(at::equal(generate(*model, c.params, three, *three_noise), one));

  three.prompt_changes[1].prompt_embeds = at::randn_like(c.conditioning.prompt_embeds);
  auto changed_noise = make_seeded_noise(*c.params.seed);
  const at::Tensor changed = generate(*model, c.params, three, *changed_noise);
  const int64_t from = plan.chunks[2].output_begin;
  EXPECT_TRUE(at::equal(changed.narrow(2, 0, from), one.narrow(2, 0, from)));
  EXPECT_FALSE(all_close(changed.narrow(2, from, one.size(2) - from), one.narrow(2, from, one.size(2) - from), 1e-3));
}

TEST(PromptPerChunk, AChunkTakesThePromptInForceAtItsFirstNewFrame) {
  Conditioning c = small_conditioning(1, 1);
  const at::Tensor second = at::randn({1, 8, 32});
  c.prompt_changes.push_back({17, second, {}});
  ChunkSpec chunk;
  chunk.output_begin = 4;  // first new pixel frame 13
  EXPECT_TRUE(at::equal(prompt_for_chunk(c, chunk).prompt_embeds, c.prompt_embeds));
  chunk.output_begin = 5;  // 17
  EXPECT_TRUE(at::equal(prompt_for_chunk(c, chunk).prompt_embeds, second));
  EXPECT_TRUE(at::equal(*prompt_for_chunk(c, chunk).negative_prompt_embeds, *c.negative_prompt_embeds));
  c.prompt_changes.push_back({3, second, {}});
  EXPECT_TRUE(contains(message_of([&] { prompt_for_chunk(c, chunk); }), "increasing order"));
}

// ---- the CLI ----------------------------------------------------------------------------------------------------

// The fixture's call plus its VAE and pixels (--inputs holds the pixel tensors too).
std::string pixel_flags(const Case& c) {
  const std::string inputs = c.dir + "/inputs.safetensors";
  std::string flags = " --vae " + c.dir + "/weights/vae";
  if (c.pixels.image.defined()) flags += " --image " + inputs;
  if (c.pixels.last_image.defined()) flags += " --last-image " + inputs;
  if (c.pixels.video.defined()) flags += " --video " + inputs;
  return flags;
}

void expect_cli_output_matches(const Case& c, const std::string& extra) {
  const double diff = test::expect_generate_matches(c, pixel_flags(c) + extra);
  std::printf("[ %s ] skyreels generate%s: max |diff| = %.3g\n", c.name.c_str(),
              contains(extra, "--seed") ? " --seed" : " --noise", diff);
}

class GenerateCommand : public ::testing::TestWithParam<std::string> {};

TEST_P(GenerateCommand, ReproducesTheFixtureWithRecordedNoise) {
  const Case c = load_case(GetParam());
  expect_cli_output_matches(c, " --noise " + c.dir + "/noise.safetensors");
}

INSTANTIATE_TEST_SUITE_P(I2vV2v, GenerateCommand, ::testing::ValuesIn(kAllCases), case_label);

TEST(GenerateCommandSeed, ReproducesI2AndV2FromTheSeedAlone) {
  for (const char* name : {"pipeline_df_i2v/i2_long_3chunks_overlap9", "pipeline_df_v2v/v2_long_3chunks"}) {
    const Case c = load_case(name);
    expect_cli_output_matches(c, " --seed " + std::to_string(*c.params.seed));
  }
}

TEST(GenerateCommandErrors, InvalidCombinationsAreClearErrorsBeforeTheModelLoads) {
  const Case c = load_case("pipeline_df_v2v/v1_single_chunk");
  const std::string inputs = c.dir + "/inputs.safetensors";
  const std::string base = test::bin_path("skyreels") + " generate --model /nonexistent --inputs " + inputs +
                           " --out /nonexistent/out.safetensors --seed 1 --vae " + c.dir + "/weights/vae";
  std::string log;
  EXPECT_NE(test::run_command(base + " --image " + inputs + " --video " + inputs, &log), 0);
  EXPECT_TRUE(contains(log, "--image and --video are exclusive")) << log;
  EXPECT_NE(test::run_command(base + " --video " + inputs + " --height 32 --width 32 --overlap-history 5", &log), 0);
  EXPECT_TRUE(contains(log, "video: 48x32 pixels")) << log;
  EXPECT_NE(test::run_command(base + " --video " + inputs +
                                  " --height 32 --width 48 --num-frames 5 "
                                  "--overlap-history 5 --causal-block-size 1",
                              &log),
            0);
  EXPECT_TRUE(contains(log, "nothing would be generated")) << log;
}

}  // namespace
}  // namespace skyreels::model
