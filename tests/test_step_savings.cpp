// Fewer transformer passes (issue 21): exact savings under the block-causal mask, diffusers' FirstBlockCache
// reproduced call by call from tests/data/golden/pipeline_df_cache, and the cache per causal block reproduced from
// its Python reference over diffusers' pipeline (tests/data/per_block_cache/make_cases.py).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/diffusion_forcing.h"
#include "model/transformer_loader.h"
#include "model/transformer_skyreels_v2.h"
#include "tests/pipeline_case.h"
#include "tests/test_util.h"

namespace {

using namespace skyreels::model;
using skyreels::test::all_close;
using skyreels::test::golden_path;
using skyreels::test::max_abs_diff;
using skyreels::test::PipelineCase;
using Json = nlohmann::json;

std::unique_ptr<SkyReelsV2Transformer> load_model(const std::string& dir) {
  return skyreels::test::load_fixture_transformer(dir);
}

// Token-blocks of a whole generation, by what happened to them.
struct Work {
  int64_t full = 0, computed = 0, saved_exact = 0, saved_cache = 0;
  double saved_share() const { return full ? static_cast<double>(saved_exact + saved_cache) / full : 0.0; }
};

struct Generation {
  at::Tensor latents;
  std::vector<at::Tensor> chunk_latents, video_before;  // per chunk: its own latents, the video it continued
  Work work;
  std::vector<TransformerCallReport> calls;
};

// Every chunk through run_chunk, as the server runs them (one DenoiseCache for the request when its scope says so).
Generation run_all(const SkyReelsV2Transformer& model, const GenerationParams& params, const Conditioning& conditioning,
        NoiseSource& noise) {
  Generation r;
  StepHooks hooks;
  hooks.on_call = [&r](const TransformerCallReport& c) {
    r.calls.push_back(c);
    r.work.full += c.token_blocks_full;
    r.work.computed += c.token_blocks_computed;
    r.work.saved_exact += c.token_blocks_saved_exact;
    r.work.saved_cache += c.token_blocks_saved_cache;
  };
  const ChunkPlan plan = plan_chunks(params, model.config().num_frame_per_block);
  const auto request_cache = params.cache.scope == StepCacheScope::kRequest ? make_denoise_cache() : nullptr;
  for (const ChunkSpec& chunk : plan.chunks) {
    r.video_before.push_back(r.latents);
    const at::Tensor latents =
        run_chunk(model, params, plan, chunk.index, conditioning, r.latents, noise, hooks, request_cache);
    r.chunk_latents.push_back(latents);
    r.latents = accumulate(r.latents, latents, chunk);
  }
  return r;
}

// "Within 1e-6" of the full path: 1e-6 of the largest latent (fp32 keeps ~7 digits; where the kernels differ
// between a smaller and a larger matrix, such as OpenBLAS' small-matrix path, results move by an ulp or so).
::testing::AssertionResult within_1e6(const at::Tensor& saved, const at::Tensor& full) {
  const double scale = std::max(1.0, full.abs().max().item<double>());
  const double diff = max_abs_diff(saved, full);
  if (diff <= 1e-6 * scale) return ::testing::AssertionSuccess() << "max |diff| " << diff;
  return ::testing::AssertionFailure() << "max |diff| " << diff << " > 1e-6 x " << scale;
}

PipelineCase load(const std::string& kind, const std::string& name) {
  return skyreels::test::load_pipeline_case(name, golden_path(kind + "/" + name));
}

// ---- exact savings ---------------------------------------------------------------------------------------------

class ExactSavingsOnFixtures : public ::testing::TestWithParam<std::string> {};

// p2: async, block 2, one chunk.
TEST_P(ExactSavingsOnFixtures, EqualTheFullPathWithin1e6AndDiffusersWithin1e4WhileComputingLess) {
  const PipelineCase c = load("pipeline_df", GetParam());
  const auto model = load_model(c.dir + "/weights/diffusers");
  GenerationParams exact = c.params, full = c.params;
  full.exact_savings = false;
  auto noise_a = make_recorded_noise(c.noise), noise_b = make_recorded_noise(c.noise);
  const Generation saved = run_all(*model, exact, c.conditioning, *noise_a);
  const Generation plain = run_all(*model, full, c.conditioning, *noise_b);
  EXPECT_TRUE(within_1e6(saved.latents, plain.latents));
  EXPECT_TRUE(all_close(saved.latents, c.output.at("latents"), 1e-4));
  EXPECT_EQ(plain.work.computed, plain.work.full);
  EXPECT_EQ(saved.work.full, plain.work.full);
  EXPECT_GT(saved.work.saved_exact, 0);
  EXPECT_EQ(saved.work.saved_exact + saved.work.computed, saved.work.full);
  std::printf("[ %s ] exact savings: %.1f %% of token-blocks saved, max |diff| vs full %.3g\n", c.name.c_str(),
              100.0 * saved.work.saved_share(), max_abs_diff(saved.latents, plain.latents));
}

INSTANTIATE_TEST_SUITE_P(Golden, ExactSavingsOnFixtures, ::testing::Values("p2_async_cbs2_ar2"));

// c4's request without its step cache: a long async video, block 2, addnoise_condition 20 (the prefix of chunks 1
// and 2 is re-noised every row, so neither it nor the blocks after it are kept; not-started blocks still go).
TEST(ExactSavings, ALongAsyncVideoWithAddnoiseConditionEqualsTheFullPath) {
  PipelineCase c = load("pipeline_df_cache", "c4_long_async_addnoise20_cfg");
  c.params.cache = {};
  const auto model = load_model(c.dir + "/weights/diffusers");
  GenerationParams full = c.params;
  full.exact_savings = false;
  auto noise_a = make_recorded_noise(c.noise), noise_b = make_recorded_noise(c.noise);
  const Generation saved = run_all(*model, c.params, c.conditioning, *noise_a);
  const Generation plain = run_all(*model, full, c.conditioning, *noise_b);
  EXPECT_TRUE(within_1e6(saved.latents, plain.latents));
  EXPECT_GT(saved.work.saved_exact, 0);
  std::printf("c4 without cache: %.1f %% of token-blocks saved exactly\n", 100.0 * saved.work.saved_share());
}

// The tiny fixture model at the SkyReels-V2 README's async setting (25 latent frames = 97 pixel frames, 30 steps,
// ar_step 5, causal_block_size 5), scaled down in space only.
GenerationParams readme_async(int64_t num_frames) {
  GenerationParams p;
  p.num_frames = num_frames;
  p.base_num_frames = 97;
  if (num_frames > 97) p.overlap_history = 17;
  p.height = 16;
  p.width = 16;
  p.num_inference_steps = 30;
  p.ar_step = 5;
  p.causal_block_size = 5;
  p.guidance_scale = 1.0;
  p.seed = 11;
  return p;
}

Conditioning one_prompt(const SkyReelsV2Transformer& model) {
  Conditioning c;
  c.prompt_embeds = at::randn({1, 8, model.config().text_dim}, at::TensorOptions().dtype(at::kFloat));
  return c;
}

TEST(ExactSavings, TheReadmeAsyncSettingComputesAtLeast35PercentFewerTokenBlocksAtEqualOutput) {
  const auto model = load_model(golden_path("pipeline_df/p2_async_cbs2_ar2/weights/diffusers"));
  at::manual_seed(3);
  const Conditioning prompt = one_prompt(*model);
  GenerationParams exact = readme_async(97), full = exact;
  full.exact_savings = false;
  auto noise_a = make_seeded_noise(11), noise_b = make_seeded_noise(11);
  const Generation saved = run_all(*model, exact, prompt, *noise_a);
  const Generation plain = run_all(*model, full, prompt, *noise_b);
  EXPECT_TRUE(within_1e6(saved.latents, plain.latents));
  EXPECT_GE(saved.work.saved_share(), 0.35);
  std::printf("one 25-frame async chunk: %.1f %% of token-blocks saved\n", 100.0 * saved.work.saved_share());
}

TEST(ExactSavings, ALongAsyncVideoSavesInEveryChunkAndTheKeptKeysRespectTheBudget) {
  const auto model = load_model(golden_path("pipeline_df/p2_async_cbs2_ar2/weights/diffusers"));
  at::manual_seed(4);
  const Conditioning prompt = one_prompt(*model);
  GenerationParams exact = readme_async(177), no_memory = exact, full = exact;  // 2 chunks
  no_memory.kv_cache_max_bytes = 0;  // nothing kept: only not-started blocks are left out
  full.exact_savings = false;
  auto n1 = make_seeded_noise(11), n2 = make_seeded_noise(11), n3 = make_seeded_noise(11);
  const Generation saved = run_all(*model, exact, prompt, *n1);
  const Generation unkept = run_all(*model, no_memory, prompt, *n2);
  const Generation plain = run_all(*model, full, prompt, *n3);
  EXPECT_TRUE(within_1e6(saved.latents, plain.latents));
  EXPECT_TRUE(within_1e6(unkept.latents, plain.latents));
  EXPECT_GT(unkept.work.saved_share(), 0.0);
  EXPECT_GT(saved.work.saved_share(), unkept.work.saved_share());
  std::map<int64_t, int64_t> saved_by_chunk;
  for (const auto& call : saved.calls) saved_by_chunk[call.chunk] += call.token_blocks_saved_exact;
  ASSERT_EQ(saved_by_chunk.size(), 2u);
  for (const auto& [chunk, blocks] : saved_by_chunk) EXPECT_GT(blocks, 0) << "chunk " << chunk;
  std::printf("two-chunk async video: %.1f %% saved (%.1f %% without kept keys)\n", 100.0 * saved.work.saved_share(),
              100.0 * unkept.work.saved_share());
}

TEST(ExactSavings, FullAttentionRunsEveryFrame) {
  const PipelineCase c = load("pipeline_df", "p1_sync_short");  // causal_block_size 1
  const auto model = load_model(c.dir + "/weights/diffusers");
  auto noise = make_recorded_noise(c.noise);
  const Generation r = run_all(*model, c.params, c.conditioning, *noise);
  EXPECT_EQ(r.work.computed, r.work.full);
}

TEST(ExactSavings, TheTransformerRefusesReuseItCannotHonour) {
  const auto model = load_model(golden_path("pipeline_df/p2_async_cbs2_ar2/weights/diffusers"));
  TransformerCallState state;
  TransformerForwardArgs args;
  args.hidden_states = at::randn({1, 16, 4, 4, 4});
  args.timestep = at::zeros({1, 4}, at::kLong);
  args.encoder_hidden_states = at::randn({1, 3, model->config().text_dim});
  args.fps = at::ones({1}, at::kLong);
  args.num_frame_per_block = 2;
  args.state = &state;
  args.reuse_frames = 2;  // nothing kept yet
  args.keep_frames = 2;
  EXPECT_THROW(model->forward(args), std::invalid_argument);
  args.reuse_frames = 0;
  args.keep_frames = 3;  // not whole blocks
  EXPECT_THROW(model->forward(args), std::invalid_argument);
  args.keep_frames = 2;
  const at::Tensor full = model->forward(args);
  EXPECT_EQ(state.kept_frames(), 2);
  EXPECT_GT(state.kept_bytes(), 0);
  args.reuse_frames = 2;
  const at::Tensor tail = model->forward(args);  // frames [2, 4) only, from the kept keys of frames [0, 2)
  ASSERT_EQ(tail.size(2), 2);
  EXPECT_TRUE(within_1e6(tail, full.narrow(2, 2, 2)));  // 1e-6 of the largest value, as the other cases
}

// ---- FirstBlockCache equal to diffusers ------------------------------------------------------------------------

Json read_json(const std::string& path) { return Json::parse(std::ifstream(path)); }

// decisions.json's form of our reports (what `skyreels generate --cache-log` writes).
Json decisions_of(const std::vector<TransformerCallReport>& calls) {
  return Json::parse(step_cache_decisions_json(calls));
}

void expect_same_decisions(const Json& ours, const Json& theirs) {
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    for (const char* key : {"chunk", "row", "context", "skipped", "source"}) {
      EXPECT_EQ(ours[i][key], theirs[i][key]) << "call " << i << " " << key;
    }
    ASSERT_EQ(ours[i]["rel"].is_null(), theirs[i]["rel"].is_null()) << "call " << i;
    if (!theirs[i]["rel"].is_null()) {
      const double a = ours[i]["rel"].get<double>(), b = theirs[i]["rel"].get<double>();
      EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(b)) << "call " << i << " rel " << a << " vs " << b;
    }
  }
}

class FirstBlockCacheGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(FirstBlockCacheGolden, EveryCallsDecisionAndTheLatentsEqualDiffusers) {
  const PipelineCase c = load("pipeline_df_cache", GetParam());
  const auto model = load_model(c.dir + "/weights/diffusers");
  auto noise = make_recorded_noise(c.noise);
  const Generation r = run_all(*model, c.params, c.conditioning, *noise);
  expect_same_decisions(decisions_of(r.calls), read_json(c.dir + "/decisions.json"));
  EXPECT_TRUE(all_close(r.latents, c.output.at("latents"), 1e-4));
  EXPECT_GT(r.work.saved_cache, 0);
  std::printf("[ %s ] max |diff| %.3g, %.1f %% of token-blocks saved (%.1f %% by the cache)\n", c.name.c_str(),
              max_abs_diff(r.latents, c.output.at("latents")), 100.0 * r.work.saved_share(),
              100.0 * r.work.saved_cache / r.work.full);
}

INSTANTIATE_TEST_SUITE_P(Golden, FirstBlockCacheGolden,
                         ::testing::Values("c1_sync_cfg", "c2_async_ar2_cbs2_cfg", "c3_long_sync_3chunks_overlap9_cfg",
                                           "c4_long_async_addnoise20_cfg", "c5_long_last_chunk_shorter_cfg",
                                           "c6_scope_request_long_sync_cfg"));

TEST(FirstBlockCache, ScopeRequestIsRefusedForAVideoWhoseLastChunkIsShorter) {
  PipelineCase c = load("pipeline_df_cache", "c5_long_last_chunk_shorter_cfg");
  c.params.cache.scope = StepCacheScope::kRequest;
  try {
    plan_chunks(c.params, c.model_block);
    FAIL() << "scope request over chunks of different lengths was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("cache_scope:", 0), 0u) << e.what();
  }
}

TEST(FirstBlockCache, ScopeRequestNeedsTheRequestsCacheForLaterChunks) {
  const PipelineCase c = load("pipeline_df_cache", "c6_scope_request_long_sync_cfg");
  const auto model = load_model(c.dir + "/weights/diffusers");
  const ChunkPlan plan = plan_chunks(c.params, c.model_block);
  auto noise = make_recorded_noise(c.noise);
  const at::Tensor first = run_chunk(*model, c.params, plan, 0, c.conditioning, {}, *noise);
  EXPECT_THROW(run_chunk(*model, c.params, plan, 1, c.conditioning, first, *noise), std::invalid_argument);
}

// With scope chunk a chunk's output depends on that chunk alone: run on its own (another replica, a retry after a
// handoff), from a fresh noise source and a fresh model, it equals the same chunk inside the whole run bit for bit.
TEST(FirstBlockCache, AChunkRunOnAnotherReplicaEqualsTheSameChunkInTheWholeRun) {
  const PipelineCase c = load("pipeline_df_cache", "c4_long_async_addnoise20_cfg");
  const auto model = load_model(c.dir + "/weights/diffusers");
  auto whole_noise = make_seeded_noise(*c.params.seed);
  const Generation whole = run_all(*model, c.params, c.conditioning, *whole_noise);
  ASSERT_EQ(whole.chunk_latents.size(), 3u);
  const auto replica = load_model(c.dir + "/weights/diffusers");
  const ChunkPlan plan = plan_chunks(c.params, c.model_block);
  auto fresh_noise = make_seeded_noise(*c.params.seed);
  const at::Tensor alone = run_chunk(*replica, c.params, plan, 2, c.conditioning, whole.video_before[2], *fresh_noise);
  EXPECT_TRUE(at::equal(alone, whole.chunk_latents[2]));
}

// The same through `skyreels generate --cache first-block ... --cache-log FILE.json`: the log is decisions.json.
class GenerateWithCache : public ::testing::TestWithParam<std::string> {};

TEST_P(GenerateWithCache, ReproducesTheFixtureAndLogsItsDecisions) {
  const PipelineCase c = load("pipeline_df_cache", GetParam());
  const std::string log = skyreels::test::temp_dir("cache_log") + "/decisions.json";
  char threshold[32];
  std::snprintf(threshold, sizeof(threshold), "%.17g", c.params.cache.threshold);
  const std::string scope = c.params.cache.scope == StepCacheScope::kRequest ? "request" : "chunk";
  const double diff = skyreels::test::expect_generate_matches(
      c, std::string(" --cache first-block --cache-threshold ") + threshold + " --cache-scope " + scope + " --noise " +
             c.dir + "/noise.safetensors --cache-log " + log);
  EXPECT_LE(diff, 1e-4);
  expect_same_decisions(read_json(log), read_json(c.dir + "/decisions.json"));
}

INSTANTIATE_TEST_SUITE_P(Golden, GenerateWithCache,
                         ::testing::Values("c2_async_ar2_cbs2_cfg", "c5_long_last_chunk_shorter_cfg",
                                           "c6_scope_request_long_sync_cfg"));

TEST(GenerateWithCache, ScopeRequestOverAShorterLastChunkIsRefused) {
  const PipelineCase c = load("pipeline_df_cache", "c5_long_last_chunk_shorter_cfg");
  std::string out;
  const int status = skyreels::test::run_command(
      skyreels::test::bin_path("skyreels") + " generate" + skyreels::test::generate_flags(c) +
          " --cache first-block --cache-threshold 0.2 --cache-scope request --seed 1 --out " +
          skyreels::test::temp_dir("refused") + "/out.safetensors",
      &out);
  EXPECT_NE(status, 0);
  EXPECT_NE(out.find("cache_scope"), std::string::npos) << out;
}

// ---- the cache per causal block, equal to its reference over diffusers' pipeline ----------------------------------

struct PerBlockCase {
  PipelineCase base;  // the pipeline_df_cache fixture whose weights, inputs and noise it runs
  Json decisions;
  at::Tensor latents;
};

PerBlockCase load_per_block(const std::string& name) {
  const std::string dir = skyreels::test::data_path("per_block_cache/" + name);
  const Json json = read_json(dir + "/case.json");
  PerBlockCase c{skyreels::test::load_pipeline_case(name, dir + "/" + json.at("base").get<std::string>()),
                 read_json(dir + "/decisions.json"), skyreels::test::load_tensors(dir + "/output.safetensors").at("latents")};
  const Json& cache = json.at("cache");
  c.base.params.cache.kind = StepCacheKind::kFirstBlockPerBlock;
  c.base.params.cache.threshold = cache.at("threshold").get<double>();
  c.base.params.cache.max_skips = cache.at("max_skips").get<int64_t>();
  c.base.params.cache.scope = StepCacheScope::kChunk;
  return c;
}

void expect_same_block_decisions(const Json& ours, const Json& theirs) {
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    for (const char* key : {"chunk", "row", "context", "skipped"}) {
      EXPECT_EQ(ours[i][key], theirs[i][key]) << "call " << i << " " << key;
    }
    const Json &a = ours[i].at("blocks"), &b = theirs[i].at("blocks");
    ASSERT_EQ(a.size(), b.size()) << "call " << i;
    for (size_t j = 0; j < a.size(); ++j) {
      for (const char* key : {"block", "updated", "skipped", "reused", "source"}) {
        EXPECT_EQ(a[j][key], b[j][key]) << "call " << i << " block " << j << " " << key;
      }
      ASSERT_EQ(a[j]["rel"].is_null(), b[j]["rel"].is_null()) << "call " << i << " block " << j;
      if (!b[j]["rel"].is_null()) {
        const double x = a[j]["rel"].get<double>(), y = b[j]["rel"].get<double>();
        // 1e-5 relative, and 1e-6 absolute for the tiny rels of still frames (every threshold is >= 1e-3 away from
        // every rel of its run, so neither can flip a decision).
        EXPECT_LE(std::abs(x - y), 1e-5 * std::abs(y) + 1e-6)
            << "call " << i << " block " << j << ": " << x << " vs " << y;
      }
    }
  }
}

class PerBlockCacheReference : public ::testing::TestWithParam<std::string> {};

TEST_P(PerBlockCacheReference, EveryBlocksDecisionAndTheLatentsEqualThePythonReferenceOverDiffusers) {
  const PerBlockCase c = load_per_block(GetParam());
  const auto model = load_model(c.base.dir + "/weights/diffusers");
  auto noise = make_recorded_noise(c.base.noise);
  const Generation r = run_all(*model, c.base.params, c.base.conditioning, *noise);
  expect_same_block_decisions(decisions_of(r.calls), c.decisions);
  EXPECT_TRUE(all_close(r.latents, c.latents, 1e-4));
  EXPECT_GT(r.work.saved_cache, 0);
  std::printf("[ %s ] max |diff| %.3g, %.1f %% of token-blocks saved (%.1f %% by the cache)\n", GetParam().c_str(),
              max_abs_diff(r.latents, c.latents), 100.0 * r.work.saved_share(),
              100.0 * r.work.saved_cache / r.work.full);
}

INSTANTIATE_TEST_SUITE_P(Reference, PerBlockCacheReference,
                         ::testing::Values("b1_async_ar2_cbs2", "b2_long_async_addnoise20"));

// Each block decides on its own: no block skips more than max_skips calls in a row, blocks the row does not update
// never skip, and a threshold of 0 skips nothing (the output is then the uncached one within 1e-6).
TEST(PerBlockCache, BlocksTheRowDoesNotUpdateNeverSkipAndNoBlockSkipsMoreThanMaxSkipsInARow) {
  PerBlockCase c = load_per_block("b2_long_async_addnoise20");
  c.base.params.cache.threshold = 10.0;  // every eligible block would skip
  c.base.params.cache.max_skips = 2;
  const auto model = load_model(c.base.dir + "/weights/diffusers");
  auto noise = make_recorded_noise(c.base.noise);
  const Generation r = run_all(*model, c.base.params, c.base.conditioning, *noise);
  std::map<std::tuple<int64_t, bool, int64_t>, int> in_a_row;  // (chunk, uncond, block)
  int skipped = 0;
  for (const TransformerCallReport& call : r.calls) {
    for (const auto& b : call.blocks) {
      int& run = in_a_row[{call.chunk, call.unconditional, b.block}];
      if (b.skipped) {
        EXPECT_TRUE(b.updated) << "chunk " << call.chunk << " row " << call.row << " block " << b.block;
        EXPECT_LE(++run, 2) << "chunk " << call.chunk << " row " << call.row << " block " << b.block;
        ++skipped;
      } else {
        run = 0;
      }
    }
  }
  EXPECT_GT(skipped, 0);

  PerBlockCase none = load_per_block("b2_long_async_addnoise20");
  none.base.params.cache.threshold = 0.0;
  auto noise_a = make_recorded_noise(none.base.noise);
  const Generation cached = run_all(*model, none.base.params, none.base.conditioning, *noise_a);
  EXPECT_EQ(cached.work.saved_cache, 0);
  GenerationParams plain = none.base.params;
  plain.cache = {};
  auto noise_b = make_recorded_noise(none.base.noise);
  const Generation uncached = run_all(*model, plain, none.base.conditioning, *noise_b);
  EXPECT_TRUE(within_1e6(cached.latents, uncached.latents));
}

// The kept keys / values stay within max_kv_bytes: a block whose keys / values do not fit keeps none and so never
// skips, however low its rel; with no budget at all nothing is kept and nothing skips.
TEST(PerBlockCache, KeptKeysAndValuesStayWithinTheBudgetAndABlockWithoutThemNeverSkips) {
  const auto model = load_model(golden_path("pipeline_df/p2_async_cbs2_ar2/weights/diffusers"));
  const TransformerConfig& config = model->config();
  at::manual_seed(5);
  const at::Tensor latents = at::randn({1, 16, 4, 4, 4}), text = at::randn({1, 3, config.text_dim});
  auto forward = [&](TransformerCallState& state, int64_t budget, TransformerCallStats& stats) {
    PerBlockCache cache;
    cache.threshold = 10.0;  // every block that may skip does
    cache.max_skips = 100;
    cache.updated_blocks = {1, 1};
    cache.final_blocks = {0, 0};
    cache.max_kv_bytes = budget;
    TransformerForwardArgs args;
    args.hidden_states = latents;
    args.timestep = at::full({1, 4}, 500, at::kLong);
    args.encoder_hidden_states = text;
    args.fps = at::ones({1}, at::kLong);
    args.num_frame_per_block = 2;
    args.state = &state;
    args.per_block_cache = &cache;
    args.stats = &stats;
    model->forward(args);
  };
  const int64_t block_tokens = 2 * 2 * 2;  // 2 frames of 4x4 latents, patch 2x2
  const int64_t one_block = 2 * (config.num_layers - 1) * block_tokens * config.inner_dim() * 4;  // fp32 k and v
  for (const int64_t budget : {int64_t{0}, one_block, 2 * one_block}) {
    TransformerCallState state;
    TransformerCallStats first, second;
    forward(state, budget, first);
    EXPECT_LE(state.kept_bytes(), budget);
    EXPECT_EQ(state.kept_bytes(), std::min(budget, 2 * one_block));
    forward(state, budget, second);
    ASSERT_EQ(second.blocks.size(), 2u);
    EXPECT_LE(state.kept_bytes(), budget);
    // Block b kept its keys / values on the first call iff they fitted after blocks 0..b-1.
    for (size_t b = 0; b < 2; ++b) {
      const bool kept = budget >= static_cast<int64_t>(b + 1) * one_block;
      EXPECT_EQ(second.blocks[b].skipped, kept) << "budget " << budget << " block " << b;
    }
  }
}

TEST(PerBlockCache, IsRefusedWithoutTheBlockCausalMaskAndWithScopeRequest) {
  PipelineCase c = load("pipeline_df_cache", "c1_sync_cfg");  // causal_block_size 1
  c.params.cache.kind = StepCacheKind::kFirstBlockPerBlock;
  c.params.cache.threshold = 0.3;
  const auto model = load_model(c.dir + "/weights/diffusers");
  auto noise = make_recorded_noise(c.noise);
  try {
    run_all(*model, c.params, c.conditioning, *noise);
    FAIL() << "the cache per causal block ran under full attention";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("causal_block_size"), std::string::npos) << e.what();
  }
  PipelineCase block_causal = load("pipeline_df_cache", "c2_async_ar2_cbs2_cfg");
  block_causal.params.cache.kind = StepCacheKind::kFirstBlockPerBlock;
  EXPECT_NO_THROW(plan_chunks(block_causal.params, block_causal.model_block));
  block_causal.params.cache.scope = StepCacheScope::kRequest;
  EXPECT_THROW(plan_chunks(block_causal.params, block_causal.model_block), std::invalid_argument);
}

// A chunk gives the same output on any replica: the state belongs to one chunk's loop.
TEST(PerBlockCache, AChunkRunOnAnotherReplicaEqualsTheSameChunkInTheWholeRun) {
  const PerBlockCase c = load_per_block("b2_long_async_addnoise20");
  const auto model = load_model(c.base.dir + "/weights/diffusers");
  auto whole_noise = make_seeded_noise(*c.base.params.seed);
  const Generation whole = run_all(*model, c.base.params, c.base.conditioning, *whole_noise);
  ASSERT_EQ(whole.chunk_latents.size(), 3u);
  const auto replica = load_model(c.base.dir + "/weights/diffusers");
  const ChunkPlan plan = plan_chunks(c.base.params, c.base.model_block);
  auto fresh_noise = make_seeded_noise(*c.base.params.seed);
  const at::Tensor alone =
      run_chunk(*replica, c.base.params, plan, 2, c.base.conditioning, whole.video_before[2], *fresh_noise);
  EXPECT_TRUE(at::equal(alone, whole.chunk_latents[2]));
}

// Through `skyreels generate --cache first-block-per-block ... --cache-log FILE.json`.
TEST(GenerateWithCache, ThePerBlockCacheReproducesItsReferenceAndLogsEveryBlock) {
  const PerBlockCase c = load_per_block("b1_async_ar2_cbs2");
  const std::string log = skyreels::test::temp_dir("per_block_log") + "/decisions.json";
  char threshold[32];
  std::snprintf(threshold, sizeof(threshold), "%.17g", c.base.params.cache.threshold);
  const std::string dir = skyreels::test::temp_dir("per_block_out");
  std::string out;
  const int status = skyreels::test::run_command(
      skyreels::test::bin_path("skyreels") + " generate" + skyreels::test::generate_flags(c.base) +
          " --cache first-block-per-block --cache-threshold " + threshold + " --cache-max-skips " +
          std::to_string(c.base.params.cache.max_skips) + " --noise " + c.base.dir + "/noise.safetensors --cache-log " +
          log + " --out " + dir + "/out.safetensors",
      &out);
  ASSERT_EQ(status, 0) << out;
  EXPECT_NE(out.find("by the step cache"), std::string::npos) << out;
  const auto latents = skyreels::test::load_tensors(dir + "/out.safetensors").at("latents");
  EXPECT_TRUE(all_close(latents, c.latents, 1e-4));
  expect_same_block_decisions(read_json(log), c.decisions);
}

}  // namespace
