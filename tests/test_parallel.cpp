// One video on several devices (issue 43): the --parallel layout, the ranks joined by torch's c10d over Gloo (threads
// of this process, as a replica's ranks are), and the transformer and the loops on guidance-parallel (cfg=2) and
// Ulysses ranks reproducing the single-device run on diffusers' fixtures and on a 4-head tiny model.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <cstdio>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/diffusion_forcing.h"
#include "model/lora.h"
#include "model/sampler_table.h"
#include "model/transformer_loader.h"
#include "model/parallel_layout.h"
#include "model/rank_group.h"
#include "model/transformer_skyreels_v2.h"
#include "server/replica/demo_model.h"
#include "tests/pipeline_case.h"
#include "tests/test_util.h"

namespace skyreels::model {
namespace {

using test::error_of;
using test::golden_path;
using test::max_abs_diff;
using test::PipelineCase;

constexpr std::chrono::milliseconds kTimeout{60000};

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- the layout --------------------------------------------------------------------------------------------------

TEST(ParallelLayout, ParsesBothDegreesInAnyOrderWithDefaultsOfOne) {
  EXPECT_EQ(parse_parallel_layout("cfg=2,ulysses=2"), (ParallelLayout{2, 2}));
  EXPECT_EQ(parse_parallel_layout("ulysses=4"), (ParallelLayout{1, 4}));
  EXPECT_EQ(parse_parallel_layout("ulysses=8,cfg=2"), (ParallelLayout{2, 8}));
  EXPECT_EQ(parse_parallel_layout("cfg=1,ulysses=1"), ParallelLayout{});
  EXPECT_EQ(parse_parallel_layout("cfg=2,ulysses=4").ranks(), 8);
  EXPECT_EQ(parse_parallel_layout("cfg=2,ulysses=4").text(), "cfg=2,ulysses=4");
}

TEST(ParallelLayout, RefusesUnknownKeysZeroNegativeHugeOrRepeatedDegreesNamingTheFlag) {
  for (const char* bad : {"", "cfg", "cfg=", "cfg=0", "ulysses=-2", "ulysses=65", "ulysses=99999999999", "tp=2",
                          "cfg=2,cfg=2", "cfg=3", "cfg=2;ulysses=2", "cfg=2,", "ulysses=2x", "cfg=1.5"}) {
    const std::string message = error_of([&] { parse_parallel_layout(bad); });
    EXPECT_TRUE(starts_with(message, "--parallel: ")) << bad << ": " << message;
  }
}

TEST(ParallelLayout, RefusesDevicesThatDoNotGroupAndADegreeThatDoesNotDivideTheHeadsSayingWhichWould) {
  EXPECT_NO_THROW(check_parallel_layout({2, 2}, 4, 12));
  EXPECT_NO_THROW(check_parallel_layout({2, 2}, 8, 40, true));
  const std::string devices = error_of([] { check_parallel_layout({2, 2}, 6, 12); });
  EXPECT_TRUE(starts_with(devices, "--devices: 6 device(s)")) << devices;
  EXPECT_TRUE(contains(devices, "multiple of 4")) << devices;
  const std::string too_few = error_of([] { check_parallel_layout({1, 4}, 2, 12); });
  EXPECT_TRUE(starts_with(too_few, "--devices: 2 device(s)")) << too_few;
  const std::string heads = error_of([] { check_parallel_layout({1, 8}, 8, 12); });
  EXPECT_TRUE(starts_with(heads, "--parallel: ulysses=8 does not divide the 12 attention heads")) << heads;
  EXPECT_TRUE(contains(heads, "1, 2, 3, 4, 6, 12")) << heads;
  const std::string fourteen_b = error_of([] { check_parallel_layout({1, 3}, 3, 40); });
  EXPECT_TRUE(contains(fourteen_b, "1, 2, 4, 5, 8, 10, 20, 40")) << fourteen_b;
  const std::string shard = error_of([] { check_parallel_layout({1, 1}, 1, 12, true); });
  EXPECT_TRUE(starts_with(shard, "--shard-weights: ")) << shard;
}

// ---- the ranks ---------------------------------------------------------------------------------------------------

TEST(RankGroups, AllToAllSendsSliceJToRankJAndAllGatherStacksEveryRanksTensorInRankOrder) {
  const ParallelLayout layout{2, 2};
  std::vector<at::Tensor> swapped(4), gathered(4), pairs(4);
  std::vector<int64_t> seq_rank(4, -1), half(4, -1);
  run_on_ranks(layout, kTimeout, [&](int64_t rank, const RankGroups& groups) {
    ASSERT_NE(groups.ulysses, nullptr);
    ASSERT_NE(groups.cfg, nullptr);
    seq_rank[rank] = groups.ulysses->rank();
    half[rank] = groups.cfg->rank();
    // slice j of rank r holds 10 * r + j
    const at::Tensor mine = at::arange(2, at::kFloat).add(10.0 * static_cast<double>(rank)).view({2, 1});
    swapped[rank] = groups.ulysses->all_to_all(mine);
    gathered[rank] = groups.ulysses->all_gather(at::full({3}, static_cast<double>(rank)));
    pairs[rank] = groups.cfg->all_gather(at::full({1}, static_cast<double>(rank)));
  });
  EXPECT_EQ(seq_rank, (std::vector<int64_t>{0, 1, 0, 1}));
  EXPECT_EQ(half, (std::vector<int64_t>{0, 0, 1, 1}));
  // Ulysses groups are {0, 1} and {2, 3}; guidance pairs {0, 2} and {1, 3}.
  EXPECT_TRUE(at::equal(swapped[0].flatten(), at::tensor({0.f, 10.f})));
  EXPECT_TRUE(at::equal(swapped[1].flatten(), at::tensor({1.f, 11.f})));
  EXPECT_TRUE(at::equal(swapped[3].flatten(), at::tensor({21.f, 31.f})));
  EXPECT_TRUE(at::equal(gathered[2], at::stack({at::full({3}, 2.f), at::full({3}, 3.f)})));
  EXPECT_TRUE(at::equal(pairs[1].flatten(), at::tensor({1.f, 3.f})));
}

TEST(RankGroups, ARankThatThrowsFailsThePeersWaitingOnItAndItsErrorIsTheOneReported) {
  std::vector<std::string> peer_errors(2);
  const auto start = std::chrono::steady_clock::now();
  const std::string message = error_of([&] {
    run_on_ranks(ParallelLayout{1, 2}, std::chrono::milliseconds(20000), [&](int64_t rank, const RankGroups& g) {
      if (rank == 1) throw std::runtime_error("injected fault on rank 1");
      try {
        g.ulysses->all_gather(at::ones({4}));
      } catch (const RankGroupError& e) {
        peer_errors[rank] = e.what();
        throw;
      }
    });
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(contains(message, "injected fault on rank 1")) << message;
  EXPECT_TRUE(contains(peer_errors[0], "all_gather in group ulysses0 (rank 0 of 2)")) << peer_errors[0];
  std::printf("[ rank fault ] the peer's collective failed after %.2f s (timeout 20 s): %s\n", seconds,
              peer_errors[0].c_str());
}

TEST(RankGroups, ARankThatStallsFailsItsPeersWithinTheTimeoutAndEveryThreadEnds) {
  std::atomic<bool> release{false};
  const std::string message = error_of([&] {
    run_on_ranks(ParallelLayout{1, 2}, std::chrono::milliseconds(1500), [&](int64_t rank, const RankGroups& g) {
      if (rank == 1) {  // stalls past its peer's timeout, then joins too late
        while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return;
      }
      try {
        g.ulysses->all_gather(at::ones({4}));
      } catch (...) {
        release = true;
        throw;
      }
    });
  });
  EXPECT_TRUE(contains(message, "all_gather in group ulysses0 (rank 0 of 2)")) << message;
}

// ---- the transformer ---------------------------------------------------------------------------------------------

// A group that counts the collectives it passes on: a layout whose ranks never exchanged anything proves nothing.
class CountingGroup final : public RankGroup {
 public:
  CountingGroup(RankGroup* inner, std::atomic<int64_t>* calls) : inner_(inner), calls_(calls) {}
  int64_t rank() const override { return inner_->rank(); }
  int64_t size() const override { return inner_->size(); }
  at::Tensor all_to_all(const at::Tensor& input) override {
    ++*calls_;
    return inner_->all_to_all(input);
  }
  at::Tensor all_gather(const at::Tensor& input) override {
    ++*calls_;
    return inner_->all_gather(input);
  }

 private:
  RankGroup* inner_;
  std::atomic<int64_t>* calls_;
};

// `splits_tokens`: false where Ulysses ranks each compute every token (the cache per causal block).
at::Tensor on_ranks(const ParallelLayout& layout, const std::function<at::Tensor(const RankGroups&)>& run,
                    bool splits_tokens = true) {
  std::vector<at::Tensor> out(static_cast<size_t>(layout.ranks()));
  std::atomic<int64_t> sequence_calls{0}, guidance_calls{0};
  run_on_ranks(layout, kTimeout, [&](int64_t rank, const RankGroups& groups) {
    at::set_num_threads(1);
    CountingGroup ulysses(groups.ulysses, &sequence_calls), cfg(groups.cfg, &guidance_calls);
    out[static_cast<size_t>(rank)] =
        run(RankGroups{groups.ulysses ? &ulysses : nullptr, groups.cfg ? &cfg : nullptr, groups.all});
  });
  EXPECT_EQ(sequence_calls > 0, layout.ulysses > 1 && splits_tokens) << sequence_calls << " Ulysses exchanges";
  EXPECT_EQ(guidance_calls > 0, layout.cfg > 1) << guidance_calls << " guidance exchanges";
  for (size_t r = 1; r < out.size(); ++r) {
    EXPECT_TRUE(at::equal(out[r], out[0])) << "rank " << r << " differs from rank 0 by " << max_abs_diff(out[r], out[0]);
  }
  return out[0];
}

at::Tensor single(const std::function<at::Tensor(const RankGroups&)>& run) {
  at::set_num_threads(1);
  return run(RankGroups{});
}

std::unique_ptr<SkyReelsV2Transformer> tiny_model(int64_t heads, const std::string& tag) {
  server::TinyModelOptions options;
  options.num_attention_heads = heads;
  options.num_layers = 3;
  const std::string dir = test::temp_dir(tag);
  server::write_tiny_model(dir, options);
  return test::load_fixture_transformer(dir);
}

TEST(UlyssesTransformer, EveryTokenSplitAcrossTwoAndFourRanksGivesTheSingleDeviceSampleWithin1e5) {
  const auto model = tiny_model(4, "ulysses4");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  TransformerForwardArgs args;
  args.hidden_states = at::randn({1, 16, 6, 6, 10}, gen);  // 6 x 3 x 5 = 90 tokens: not a multiple of 4
  args.timestep = at::randint(0, 1000, {1, 6}, gen);
  args.encoder_hidden_states = at::randn({1, 7, 32}, gen);
  args.fps = at::zeros({1}, at::kLong);
  args.num_frame_per_block = 2;
  const at::Tensor reference = single([&](const RankGroups&) { return model->forward(args); });
  for (const ParallelLayout layout : {ParallelLayout{1, 2}, ParallelLayout{1, 4}}) {
    const at::Tensor split = on_ranks(layout, [&](const RankGroups& g) {
      TransformerForwardArgs a = args;
      a.sequence_parallel = g.ulysses;
      return model->forward(a);
    });
    EXPECT_LE(max_abs_diff(split, reference), 1e-5) << layout.text();
    std::printf("[ %s ] forward max |diff| = %.3g\n", layout.text().c_str(), max_abs_diff(split, reference));
  }
}

TEST(ShardedWeights, EachOfFourRanksHoldsAQuarterOfTheBlocksAndGathersThemToTheSameSample) {
  server::TinyModelOptions options;
  options.num_attention_heads = 4;
  options.num_layers = 3;
  const std::string dir = test::temp_dir("sharded");
  server::write_tiny_model(dir, options);
  const auto whole = test::load_fixture_transformer(dir);
  std::vector<std::unique_ptr<SkyReelsV2Transformer>> ranks;
  for (int64_t r = 0; r < 4; ++r) {
    ranks.push_back(test::load_fixture_transformer(dir));
    ranks.back()->shard_blocks(r, 4);
  }
  // What a rank holds: every parameter outside the blocks, a quarter of the blocks (padded), two block buffers.
  int64_t block_bytes = 0, other_bytes = 0;
  for (const auto& [name, t] : whole->named_tensors()) {
    if (name.rfind("rope.", 0) == 0) continue;
    (name.rfind("blocks.", 0) == 0 ? block_bytes : other_bytes) += t.numel() * t.element_size();
  }
  const int64_t expected = other_bytes + block_bytes / 4 + 2 * block_bytes / 3;
  EXPECT_NEAR(static_cast<double>(ranks[1]->held_weight_bytes()), static_cast<double>(expected), 64.0 * 3);
  EXPECT_EQ(whole->held_weight_bytes(), other_bytes + block_bytes);
  std::printf("[ sharded ] whole %lld bytes, per rank %lld (blocks %lld)\n",
              static_cast<long long>(whole->held_weight_bytes()), static_cast<long long>(ranks[1]->held_weight_bytes()),
              static_cast<long long>(block_bytes));

  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  TransformerForwardArgs args;
  args.hidden_states = at::randn({1, 16, 4, 6, 8}, gen);
  args.timestep = at::randint(0, 1000, {1, 4}, gen);
  args.encoder_hidden_states = at::randn({1, 5, 32}, gen);
  args.fps = at::ones({1}, at::kLong);
  args.num_frame_per_block = 2;
  const at::Tensor reference = single([&](const RankGroups&) { return whole->forward(args); });
  {
    const ParallelLayout layout{1, 4};
    const at::Tensor split = on_ranks(layout, [&](const RankGroups& g) {
      TransformerForwardArgs a = args;
      a.sequence_parallel = g.ulysses;
      a.weight_ranks = g.all;
      const at::Tensor first = ranks.at(static_cast<size_t>(g.all->rank()))->forward(a);
      const at::Tensor again = ranks.at(static_cast<size_t>(g.all->rank()))->forward(a);  // slots reused, refilled
      EXPECT_TRUE(at::equal(first, again));
      return first;
    });
    EXPECT_LE(max_abs_diff(split, reference), 1e-5) << layout.text();
  }
  // A sharded model without its ranks is refused, naming the argument.
  const std::string message = error_of([&] { ranks[0]->forward(args); });
  EXPECT_TRUE(starts_with(message, "weight_ranks: this transformer holds shard 0 of 4")) << message;
}

TEST(UlyssesTransformer, RefusesADegreeThatDoesNotDivideTheHeads) {
  const auto model = tiny_model(4, "ulysses_refuse");
  TransformerForwardArgs args;
  args.hidden_states = at::zeros({1, 16, 2, 4, 4});
  args.timestep = at::zeros({1, 2}, at::kLong);
  args.encoder_hidden_states = at::zeros({1, 3, 32});
  args.fps = at::zeros({1}, at::kLong);
  std::string message;
  run_on_ranks(ParallelLayout{1, 3}, kTimeout, [&](int64_t rank, const RankGroups& g) {
    TransformerForwardArgs a = args;
    a.sequence_parallel = g.ulysses;
    const std::string m = error_of([&] { model->forward(a); });
    if (rank == 0) message = m;
  });
  EXPECT_TRUE(starts_with(message, "sequence_parallel: 3 ranks do not divide the 4 attention heads")) << message;
}

// ---- the diffusion-forcing loop on diffusers' fixtures -----------------------------------------------------------

PipelineCase df_case(const std::string& name) {
  const std::string tree = starts_with(name, "i")   ? "pipeline_df_i2v/"
                           : starts_with(name, "c") ? "pipeline_df_cache/"
                                                    : "pipeline_df/";
  PipelineCase c = test::load_pipeline_case(name, golden_path(tree + name));
  test::use_recorded_conditioning(c);
  return c;
}

struct LayoutCase {
  std::string fixture;
  ParallelLayout layout;
  // "", "no-exact" (every frame of every row computed), "euler4", "lora", "per-block", "shard", "taylorseer",
  // "magcache", "fp8", "previews"; "X-shard": X with sharded weights
  std::string variant;
};

std::string layout_case_name(const ::testing::TestParamInfo<LayoutCase>& info) {
  std::string name = info.param.fixture + "_cfg" + std::to_string(info.param.layout.cfg) + "_u" +
                     std::to_string(info.param.layout.ulysses) + (info.param.variant.empty() ? "" : "_");
  for (char ch : info.param.variant) name += ch == '-' ? '_' : ch;
  return name;
}

class DiffusionForcingOnRanks : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(DiffusionForcingOnRanks, ReproducesTheSingleDeviceVideoWithin1e5AndDiffusersWithin1e4) {
  const LayoutCase& lc = GetParam();
  PipelineCase c = df_case(lc.fixture);
  // "X-shard": variant X with sharded weights too; "shard" alone: sharded weights on the fixture as it is.
  const bool shard = lc.variant == "shard" || (lc.variant.size() > 6 &&
                                               lc.variant.compare(lc.variant.size() - 6, 6, "-shard") == 0);
  const std::string variant = lc.variant == "shard" ? "" : shard ? lc.variant.substr(0, lc.variant.size() - 6)
                                                                 : lc.variant;
  if (variant == "no-exact") c.params.exact_savings = false;
  if (variant == "per-block") {  // the cache per causal block: every token on every rank, the same video
    c.params.cache.kind = StepCacheKind::kFirstBlockPerBlock;
    c.params.cache.max_skips = 2;
  }
  if (variant == "taylorseer") {  // diffusers' TaylorSeer on self-attention
    c.params.cache.kind = StepCacheKind::kTaylorSeer;
    c.params.cache.taylorseer.cache_modules = {"blocks\\.\\d+\\.attn1"};
    c.params.cache.taylorseer.cache_interval = 2;
    c.params.cache.taylorseer.disable_cache_before_step = 1;
    c.params.cache.taylorseer.factors_dtype = TaylorFactorsDtype::kFloat32;
  }
  if (variant == "taylorseer-lite") {  // diffusers' lite mode: blocks skipped, proj_out predicted
    c.params.cache.kind = StepCacheKind::kTaylorSeer;
    c.params.cache.taylorseer.lite = true;
    c.params.cache.taylorseer.cache_interval = 2;
    c.params.cache.taylorseer.disable_cache_before_step = 1;
    c.params.cache.taylorseer.factors_dtype = TaylorFactorsDtype::kFloat32;
  }
  if (variant == "magcache") {  // diffusers' MagCache with made-up ratios that let it skip
    c.params.cache.kind = StepCacheKind::kMagCache;
    c.params.cache.magcache.threshold = 0.5;
    c.params.cache.magcache.retention_ratio = 0.2;
    c.params.cache.magcache.mag_ratios.assign(static_cast<size_t>(c.params.num_inference_steps), 1.01F);
  }
  if (variant == "euler4") {  // the few-step Euler path
    c.params.sampler = SamplerKind::kEuler;
    c.params.num_inference_steps = 4;
  }
  // "fp8": the fixture's weights converted to a float8_e4m3fn checkpoint (our convert) and loaded through the loader.
  std::string weights = c.base_dir + "/weights/diffusers";
  if (variant == "fp8") {
    const std::string fp8 = test::temp_dir("parallel_fp8") + "/fp8";
    convert_transformer_checkpoint(weights, fp8, {"float8_e4m3fn", 5'000'000'000ull});
    weights = fp8;
  }
  const auto model = variant == "fp8" ? load_transformer(weights).model : test::load_fixture_transformer(weights);
  // "shard": every rank its own instance holding 1/ranks of the blocks' weights (--shard-weights).
  std::vector<std::unique_ptr<SkyReelsV2Transformer>> shards;
  if (shard) {
    for (int64_t r = 0; r < lc.layout.ranks(); ++r) {
      shards.push_back(test::load_fixture_transformer(weights));
      shards.back()->shard_blocks(r, lc.layout.ranks());
    }
  }
  auto model_of = [&](const RankGroups& g) -> const SkyReelsV2Transformer& {
    return shards.empty() || g.all == nullptr ? *model : *shards.at(static_cast<size_t>(g.all->rank()));
  };
  if (variant == "lora") {  // an adapter of this request, unmerged in every call
    LoraSpec spec;
    spec.path = test::data_path("lora/diffusers_format.safetensors");
    const LoraAdapter placed = place_lora(read_lora(spec), transformer_parameter_specs(model->config()),
                                          model->device(), model->compute_dtype());
    c.params.adapters = {ActiveAdapter{std::make_shared<const LoraAdapter>(placed), 0.8}};
  }
  std::vector<TransformerCallReport> reports_single, reports_split;
  // "previews": a preview after every row, from rank 0 (the ranks hold the same latents).
  std::vector<at::Tensor> previews_single, previews_split;
  if (variant == "previews") c.params.preview_every = 1;
  auto run = [&](const RankGroups& g, std::vector<TransformerCallReport>* reports) {
    auto noise = make_recorded_noise(c.noise);
    StepHooks hooks;
    if (variant == "previews" && g.first()) {
      auto* previews = reports == &reports_single ? &previews_single : &previews_split;
      hooks.on_preview = [previews](const ChunkPreview& p) { previews->push_back(p.x0.clone()); };
    }
    const bool first_rank = (g.ulysses == nullptr || g.ulysses->rank() == 0) && (g.cfg == nullptr || g.cfg->rank() == 0);
    if (first_rank) hooks.on_call = [reports](const TransformerCallReport& r) { reports->push_back(r); };
    return generate(model_of(g), c.params, c.conditioning, *noise, hooks, {}, &g);
  };
  const at::Tensor reference = single([&](const RankGroups& g) { return run(g, &reports_single); });
  // The cache per causal block computes every token on every rank (not split yet).
  const bool splits = variant != "per-block";
  const at::Tensor split = on_ranks(lc.layout, [&](const RankGroups& g) { return run(g, &reports_split); }, splits);
  const double diff = max_abs_diff(split, reference);
  EXPECT_LE(diff, 1e-5);
  if (shard && variant.empty() && lc.layout.ulysses == 1) {
    EXPECT_TRUE(at::equal(split, reference)) << "gathered weights are the same bits: sharding moves no number";
  }
  if (variant.empty()) {
    EXPECT_LE(max_abs_diff(split, c.output.at("latents")), 1e-4);
  }
  std::printf("[ %s %s %s ] max |diff| to one device = %.3g\n", lc.fixture.c_str(), lc.layout.text().c_str(),
              lc.variant.c_str(), diff);
  // Each guidance half makes its own context's calls: the rank-0 log holds the conditional ones, and the step
  // cache decides the same on them as one device does.
  std::vector<TransformerCallReport> cond_single;
  for (const auto& r : reports_single) {
    if (!r.unconditional || lc.layout.cfg == 1) cond_single.push_back(r);
  }
  ASSERT_EQ(reports_split.size(), cond_single.size());
  int64_t skipped = 0;
  for (size_t i = 0; i < cond_single.size(); ++i) {
    EXPECT_EQ(reports_split[i].skipped, cond_single[i].skipped) << i;
    EXPECT_EQ(reports_split[i].token_blocks_computed, cond_single[i].token_blocks_computed) << i;
    skipped += reports_split[i].skipped ? 1 : 0;
  }
  if (c.params.cache.kind == StepCacheKind::kFirstBlock) {
    EXPECT_GT(skipped, 0) << "FirstBlockCache never skipped: the case proves nothing";
  }
  if (variant == "previews") {
    ASSERT_EQ(previews_split.size(), previews_single.size());
    EXPECT_FALSE(previews_single.empty());
    for (size_t i = 0; i < previews_single.size(); ++i) {
      EXPECT_LE(max_abs_diff(previews_split[i], previews_single[i]), 1e-5) << "preview " << i;
    }
  }
  if (c.params.cache.kind == StepCacheKind::kTaylorSeer || c.params.cache.kind == StepCacheKind::kMagCache) {
    int64_t saved = 0;
    for (size_t i = 0; i < cond_single.size(); ++i) {
      EXPECT_EQ(reports_split[i].predicted, cond_single[i].predicted) << i;
      saved += reports_split[i].token_blocks_saved_cache;
    }
    EXPECT_GT(saved, 0) << "the step cache never saved a token-block: the case proves nothing";
  }
  if (c.params.cache.kind == StepCacheKind::kFirstBlockPerBlock) {
    int64_t block_skips = 0;
    for (const auto& r : reports_split) {
      for (const auto& b : r.blocks) block_skips += b.skipped ? 1 : 0;
    }
    EXPECT_GT(block_skips, 0) << "the cache per causal block never skipped: the case proves nothing";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Golden, DiffusionForcingOnRanks,
    ::testing::Values(LayoutCase{"p1_sync_short", {2, 1}, ""}, LayoutCase{"p1_sync_short", {1, 2}, ""},
                      LayoutCase{"p1_sync_short", {2, 2}, ""}, LayoutCase{"p2_async_cbs2_ar2", {2, 1}, ""},
                      LayoutCase{"p2_async_cbs2_ar2", {1, 2}, ""}, LayoutCase{"p2_async_cbs2_ar2", {2, 2}, ""},
                      LayoutCase{"p2_async_cbs2_ar2", {1, 2}, "no-exact"},
                      LayoutCase{"p2_async_cbs2_ar2", {2, 2}, "euler4"}, LayoutCase{"p2_async_cbs2_ar2", {2, 2}, "lora"},
                      LayoutCase{"c2_async_ar2_cbs2_cfg", {2, 2}, ""}, LayoutCase{"c1_sync_cfg", {1, 2}, ""},
                      LayoutCase{"c4_long_async_addnoise20_cfg", {1, 2}, ""},
                      LayoutCase{"c2_async_ar2_cbs2_cfg", {2, 2}, "per-block"},
                      LayoutCase{"p1_sync_short", {1, 2}, "shard"}, LayoutCase{"p2_async_cbs2_ar2", {2, 2}, "lora-shard"},
                      LayoutCase{"p2_async_cbs2_ar2", {2, 2}, "euler4-shard"},
                      LayoutCase{"p4_long_addnoise20", {1, 2}, "shard"},
                      LayoutCase{"p2_async_cbs2_ar2", {2, 2}, "fp8"}, LayoutCase{"p4_long_addnoise20", {2, 2}, "previews"},
                      LayoutCase{"c1_sync_cfg", {2, 2}, "taylorseer"}, LayoutCase{"c1_sync_cfg", {2, 2}, "magcache"},
                      LayoutCase{"c1_sync_cfg", {1, 2}, "taylorseer-lite"},
                      LayoutCase{"c3_long_sync_3chunks_overlap9_cfg", {1, 2}, "magcache-shard"},
                      LayoutCase{"c3_long_sync_3chunks_overlap9_cfg", {2, 2}, "taylorseer-shard"},
                      LayoutCase{"p2_async_cbs2_ar2", {2, 1}, "shard"}, LayoutCase{"p2_async_cbs2_ar2", {1, 2}, "shard"},
                      LayoutCase{"c2_async_ar2_cbs2_cfg", {2, 2}, "shard"},
                      LayoutCase{"i3_long_async_cbs2_ar2_addnoise20", {2, 2}, "shard"},
                      LayoutCase{"p4_long_addnoise20", {2, 2}, ""},
                      LayoutCase{"i3_long_async_cbs2_ar2_addnoise20", {2, 2}, ""},
                      LayoutCase{"i1_sync_1chunk_last_image", {1, 2}, ""}),
    layout_case_name);

// ---- four heads: ulysses=4 -----------------------------------------------------------------------------------------

TEST(DiffusionForcingOnFourHeads, Ulysses4AndCfg2Ulysses4FromTheSeedGiveOneDevicesVideoWithin1e5) {
  const auto model = tiny_model(4, "df_four_heads");
  GenerationParams p;
  p.num_frames = 17;  // 5 latent frames of 4 x 6 latents: 5 x 2 x 3 = 30 tokens, not a multiple of 4 or 8
  p.base_num_frames = 17;
  p.height = 32;
  p.width = 48;
  p.num_inference_steps = 3;
  p.guidance_scale = 5.0;
  p.ar_step = 0;
  p.seed = 42;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  Conditioning cond;
  cond.prompt_embeds = at::randn({1, 8, 32}, gen);
  cond.negative_prompt_embeds = at::randn({1, 8, 32}, gen);
  auto run = [&](const RankGroups& g) {
    auto noise = make_seeded_noise(*p.seed);
    return generate(*model, p, cond, *noise, {}, {}, &g);
  };
  const at::Tensor one = single(run);
  for (const ParallelLayout layout : {ParallelLayout{1, 4}, ParallelLayout{2, 4}}) {
    const at::Tensor split = on_ranks(layout, run);
    EXPECT_LE(max_abs_diff(split, one), 1e-5) << layout.text();
    std::printf("[ four heads %s ] max |diff| to one device = %.3g\n", layout.text().c_str(), max_abs_diff(split, one));
  }
}

// ---- skyreels generate -------------------------------------------------------------------------------------------

// `skyreels generate <case flags> <extra>`: its latents, or undefined (with the failure recorded) when it failed.
at::Tensor generate_latents(const PipelineCase& c, const std::string& extra, std::string* log = nullptr) {
  const std::string out = test::temp_dir("parallel_generate") + "/out.safetensors";
  std::string output;
  const int status = test::run_command(
      test::bin_path("skyreels") + " generate" + test::generate_flags(c) + extra + " --out " + out, &output);
  if (log) *log = output;
  if (status != 0) return at::Tensor();
  return test::load_tensors(out).at("latents");
}

TEST(ParallelGenerate, FourCpuRanksAsCfg2Ulysses2GiveOneDevicesLatentsWithin1e5AndDiffusersWithin1e4) {
  const PipelineCase c = df_case("p2_async_cbs2_ar2");
  std::string log;
  const std::string seed = " --seed " + std::to_string(*c.params.seed);  // each rank draws from its own seeded source
  const at::Tensor one = generate_latents(c, seed);
  const at::Tensor four = generate_latents(c, seed + " --devices cpu,cpu,cpu,cpu --parallel cfg=2,ulysses=2", &log);
  ASSERT_TRUE(one.defined() && four.defined()) << log;
  EXPECT_TRUE(contains(log, "one replica of 4 ranks (cfg=2,ulysses=2) on cpu,cpu,cpu,cpu")) << log;
  EXPECT_LE(max_abs_diff(four, one), 1e-5);
  EXPECT_LE(max_abs_diff(four, c.output.at("latents")), 1e-4);
  const at::Tensor sharded =
      generate_latents(c, seed + " --devices cpu,cpu,cpu,cpu --parallel cfg=2,ulysses=2 --shard-weights", &log);
  ASSERT_TRUE(sharded.defined()) << log;
  EXPECT_TRUE(contains(log, "weights sharded: rank 0 holds")) << log;
  EXPECT_TRUE(at::equal(sharded, four)) << "sharding moves no number: " << max_abs_diff(sharded, four);
  std::printf("[ skyreels generate cfg=2,ulysses=2 ] max |diff| to one device %.3g, to diffusers %.3g\n",
              max_abs_diff(four, one), max_abs_diff(four, c.output.at("latents")));
}

TEST(ParallelForward, SkyreelsForwardOnTwoUlyssesRanksGivesDiffusersSampleWithin1e4AndOneDevicesWithin1e5) {
  const std::string dir = golden_path("transformer_forward/t3_block_causal_nfpb2");
  auto forward = [&](const std::string& extra) {
    const std::string out = test::temp_dir("parallel_forward") + "/sample.safetensors";
    std::string log;
    const int status = test::run_command(test::bin_path("skyreels") + " forward --model " + dir +
                                             "/weights/diffusers --inputs " + dir + "/inputs.safetensors --out " + out +
                                             extra,
                                         &log);
    EXPECT_EQ(status, 0) << log;
    return status == 0 ? test::load_tensors(out).at("sample") : at::Tensor();
  };
  const at::Tensor one = forward("");
  const at::Tensor two = forward(" --devices cpu,cpu --parallel ulysses=2");
  ASSERT_TRUE(one.defined() && two.defined());
  EXPECT_LE(max_abs_diff(two, one), 1e-5);
  EXPECT_LE(max_abs_diff(two, test::load_tensors(dir + "/output.safetensors").at("sample")), 1e-4);
}

TEST(ParallelGenerate, BadLayoutsExitWithUsageErrorsNamingTheFlag) {
  const PipelineCase c = df_case("p1_sync_short");
  const std::pair<const char*, const char*> cases[] = {
      {" --devices cpu,cpu,cpu --parallel cfg=2,ulysses=2", "--devices: 3 device(s) for --parallel cfg=2,ulysses=2"},
      {" --parallel ulysses=2", "--parallel cfg=1,ulysses=2 needs --devices"},
      {" --devices cpu,cpu,cpu,cpu --parallel ulysses=4", "--parallel: ulysses=4 does not divide the 2 attention heads"},
      {" --devices cpu,cpu --parallel tp=2", "--parallel: unknown item 'tp=2'"},
      {" --devices cpu,,cpu --parallel ulysses=2", "--devices: an empty entry"},
      {" --devices cpu,cpu --device cpu --parallel ulysses=2", "give --device or --devices, not both"},
      {" --shard-weights", "--shard-weights: needs a replica of more than one device"},
  };
  for (const auto& [flags, expected] : cases) {
    std::string log;
    const std::string out = test::temp_dir("parallel_bad") + "/out.safetensors";
    const int status = test::run_command(
        test::bin_path("skyreels") + " generate" + test::generate_flags(c) + flags + " --out " + out, &log);
    EXPECT_EQ(status, 2) << flags << "\n" << log;
    EXPECT_TRUE(contains(log, expected)) << flags << "\n" << log;
  }
}

}  // namespace
}  // namespace skyreels::model
