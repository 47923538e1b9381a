// The UMT5 text encoder against transformers' UMT5EncoderModel (fixtures umt5_encoder/e1, e2, e3; both weight
// layouts), the pipeline's zero padding, checkpoint handling, and the end-to-end path strings -> prompt_embeds
// (library and `skyreels encode-text`).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "model/text_encoding.h"
#include "model/umt5_encoder.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

using skyreels::model::TextEncoder;
using skyreels::model::UMT5Layout;
using skyreels::model::UMT5Trace;

std::string case_path(const std::string& name) { return skyreels::test::golden_path("umt5_encoder/" + name); }

struct Case {
  std::string name;
  nlohmann::json json;
  std::map<std::string, at::Tensor> inputs, outputs, intermediates;
};

const Case& fixture(std::string_view name_view) {  // a view: GCC 14 takes a temporary std::string as dangling
  const std::string name(name_view);
  static std::map<std::string, Case> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  Case c;
  c.name = name;
  std::ifstream in(case_path(name) + "/case.json");
  c.json = nlohmann::json::parse(in);
  c.inputs = skyreels::test::load_tensors(case_path(name) + "/inputs.safetensors");
  c.outputs = skyreels::test::load_tensors(case_path(name) + "/output.safetensors");
  c.intermediates = skyreels::test::load_tensors(case_path(name) + "/intermediates.safetensors");
  return cache.emplace(name, std::move(c)).first->second;
}

const std::vector<std::string> kCases = {"e1_b2_T12_pad", "e2_b2_T160_beyond_max_distance", "e3_prompts_to_embeds"};

// Fixture tolerance: |port - golden| <= 1e-4 + 1e-4 |golden| on the rows below seq_len.
::testing::AssertionResult close_on_valid_rows(const at::Tensor& actual, const at::Tensor& expected,
                                               const at::Tensor& seq_lens) {
  for (int64_t b = 0; b < expected.size(0); ++b) {
    const int64_t n = seq_lens[b].item<int64_t>();
    auto r = skyreels::test::all_close(actual[b].slice(0, 0, n), expected[b].slice(0, 0, n), 1e-4, 1e-4);
    if (!r) return r << " (row " << b << ")";
  }
  return ::testing::AssertionSuccess();
}

// ---- the math ----------------------------------------------------------------------------------------------------

TEST(UMT5Buckets, RelativePositionBucketsEqualTransformersOnMinus300To300) {
  for (const auto& name : kCases) {
    const Case& c = fixture(name);
    const auto& cfg = c.json["config"];
    const at::Tensor buckets = skyreels::model::umt5_relative_position_bucket(
        c.intermediates.at("bucket_relative_position"), cfg["relative_attention_num_buckets"].get<int64_t>(),
        cfg["relative_attention_max_distance"].get<int64_t>());
    EXPECT_TRUE(at::equal(buckets, c.intermediates.at("bucket_id"))) << name;
  }
}

TEST(UMT5Buckets, DocumentedExamplesFor32BucketsAndDistance128) {
  const at::Tensor rel = at::tensor(std::vector<int64_t>{-1, 1, -8, -11, 8, 11, -64, -100, -300, 100, 300, 0});
  const at::Tensor expected = at::tensor(std::vector<int64_t>{1, 17, 8, 8, 24, 24, 14, 15, 15, 31, 31, 0});
  EXPECT_TRUE(at::equal(skyreels::model::umt5_relative_position_bucket(rel, 32, 128), expected));
}

TEST(UMT5ZeroPad, KeepsTheFirstSeqLenRowsAndZeroesTheRest) {
  const at::Tensor x = at::ones({2, 4, 3});
  const at::Tensor mask = at::tensor(std::vector<int64_t>{1, 1, 1, 0, 1, 0, 0, 0}).view({2, 4});
  const at::Tensor y = skyreels::model::umt5_zero_pad_rows(x, mask);
  EXPECT_EQ(y.sum().item<float>(), 3.0f * 3 + 1.0f * 3);
  EXPECT_EQ(y[0][3].abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(y[1][1].abs().sum().item<float>(), 0.0f);
}

// ---- every fixture, both layouts ---------------------------------------------------------------------------------

class UMT5Fixture : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(UMT5Fixture, OutputsAndIntermediatesMatchTransformers) {
  const auto& [name, layout] = GetParam();
  const Case& c = fixture(name);
  auto loaded = skyreels::model::load_umt5_encoder(case_path(name) + "/weights/" + layout);
  EXPECT_EQ(skyreels::model::umt5_layout_name(loaded.report.layout), layout);
  const auto& cfg = c.json["config"];
  EXPECT_EQ(loaded.model->config().d_model, cfg["d_model"].get<int64_t>());
  EXPECT_EQ(loaded.model->config().num_layers, cfg["num_layers"].get<int64_t>());
  EXPECT_EQ(loaded.model->config().d_kv, cfg["d_kv"].get<int64_t>());

  UMT5Trace trace;
  const at::Tensor ids = c.inputs.at("input_ids"), mask = c.inputs.at("attention_mask");
  const at::Tensor hidden = loaded.model->forward(ids, mask, &trace);
  const at::Tensor seq_lens = c.outputs.at("seq_lens");
  EXPECT_TRUE(at::equal(mask.gt(0).sum(1), seq_lens));

  EXPECT_TRUE(at::equal(trace.embeddings, c.intermediates.at("embeddings")));
  EXPECT_TRUE(at::equal(trace.extended_attention_mask, c.intermediates.at("extended_attention_mask")));
  for (int64_t l = 0; l < cfg["num_layers"].get<int64_t>(); ++l) {
    char key[64];
    std::snprintf(key, sizeof(key), "position_bias_%02lld", static_cast<long long>(l));
    if (c.intermediates.count(key)) {
      EXPECT_TRUE(at::equal(trace.position_bias[static_cast<size_t>(l)], c.intermediates.at(key))) << key;
    }
    std::snprintf(key, sizeof(key), "block_%02lld_after_self_attention", static_cast<long long>(l));
    EXPECT_TRUE(close_on_valid_rows(trace.after_attention[static_cast<size_t>(l)], c.intermediates.at(key), seq_lens))
        << key;
    std::snprintf(key, sizeof(key), "block_%02lld_out", static_cast<long long>(l));
    EXPECT_TRUE(close_on_valid_rows(trace.block_out[static_cast<size_t>(l)], c.intermediates.at(key), seq_lens)) << key;
  }
  EXPECT_TRUE(close_on_valid_rows(hidden, c.outputs.at("last_hidden_state"), seq_lens)) << "last_hidden_state";
  double worst = 0.0;
  for (int64_t b = 0; b < hidden.size(0); ++b) {
    const int64_t n = seq_lens[b].item<int64_t>();
    worst = std::max(worst, skyreels::test::max_abs_diff(hidden[b].slice(0, 0, n),
                                                         c.outputs.at("last_hidden_state")[b].slice(0, 0, n)));
  }
  std::cout << "[ measured ] " << name << " " << layout
            << ": max |last_hidden_state - golden| on valid rows = " << worst << "\n";

  const at::Tensor embeds = skyreels::model::umt5_zero_pad_rows(hidden, mask);
  EXPECT_TRUE(skyreels::test::all_close(embeds, c.outputs.at("prompt_embeds"), 1e-4, 1e-4)) << "prompt_embeds";
  for (int64_t b = 0; b < embeds.size(0); ++b) {
    const int64_t n = seq_lens[b].item<int64_t>();
    EXPECT_TRUE(at::equal(embeds[b].slice(0, n), at::zeros_like(embeds[b].slice(0, n)))) << "row " << b;
  }
}

INSTANTIATE_TEST_SUITE_P(AllCasesBothLayouts, UMT5Fixture,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::Values(std::string("transformers"), std::string("original"))),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param).substr(0, 2) + "_" + std::get<1>(param_info.param);
                         });

// ---- checkpoint handling -----------------------------------------------------------------------------------------

// A copy of e1's transformers checkpoint with tensors renamed / dropped, and optionally without config.json.
std::string rewritten_e1(const std::string& tag, const std::map<std::string, std::string>& rename,
                         bool keep_config = true) {
  const std::string src = case_path("e1_b2_T12_pad") + "/weights/transformers";
  const std::string dir = skyreels::test::temp_dir(tag);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, t] : skyreels::test::load_tensors(src + "/model.safetensors")) {
    auto it = rename.find(name);
    if (it == rename.end()) {
      out.emplace_back(name, t);
    } else if (!it->second.empty()) {
      out.emplace_back(it->second, t);
    }
  }
  skyreels::safetensors::save(dir + "/model.safetensors", out);
  if (keep_config) fs::copy_file(src + "/config.json", dir + "/config.json");
  return dir;
}

at::Tensor e1_output(const std::string& dir) {
  const Case& c = fixture("e1_b2_T12_pad");
  return skyreels::model::load_umt5_encoder(dir).model->forward(c.inputs.at("input_ids"),
                                                                c.inputs.at("attention_mask"));
}

TEST(UMT5Loading, EmbedTokensKeyStandsInForSharedWeight) {
  const std::string dir = rewritten_e1("umt5-embed", {{"shared.weight", "encoder.embed_tokens.weight"}});
  const Case& c = fixture("e1_b2_T12_pad");
  EXPECT_TRUE(close_on_valid_rows(e1_output(dir), c.outputs.at("last_hidden_state"), c.outputs.at("seq_lens")));
}

TEST(UMT5Loading, MissingEmbeddingIsAnErrorNeverARandomInit) {
  const std::string dir = rewritten_e1("umt5-noemb", {{"shared.weight", ""}});
  try {
    skyreels::model::load_umt5_encoder(dir);
    FAIL() << "a checkpoint without token embedding was accepted";
  } catch (const skyreels::checkpoint::CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("shared.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("encoder.embed_tokens.weight"), std::string::npos) << msg;
  }
}

TEST(UMT5Loading, MissingLayerTensorIsNamedInTheError) {
  const std::string dir = rewritten_e1("umt5-nowo", {{"encoder.block.1.layer.1.DenseReluDense.wo.weight", ""}});
  try {
    skyreels::model::load_umt5_encoder(dir);
    FAIL();
  } catch (const skyreels::checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("encoder.block.1.layer.1.DenseReluDense.wo.weight"), std::string::npos)
        << e.what();
  }
}

TEST(UMT5Loading, MixedLayoutsAreRejected) {
  const std::string dir = rewritten_e1("umt5-mixed", {{"encoder.final_layer_norm.weight", "norm.weight"}});
  EXPECT_THROW(skyreels::model::load_umt5_encoder(dir), skyreels::checkpoint::CheckpointError);
}

TEST(UMT5Loading, ConfigIsInferredFromShapesWithoutConfigJson) {
  const std::string dir = rewritten_e1("umt5-noconfig", {}, /*keep_config=*/false);
  auto loaded = skyreels::model::load_umt5_encoder(dir);
  EXPECT_EQ(loaded.model->config().num_heads, 4);
  EXPECT_EQ(loaded.model->config().d_kv, 8);
  EXPECT_EQ(loaded.model->config().d_ff, 64);
  EXPECT_EQ(loaded.model->config().vocab_size, 320);
  const Case& c = fixture("e1_b2_T12_pad");
  EXPECT_TRUE(close_on_valid_rows(e1_output(dir), c.outputs.at("last_hidden_state"), c.outputs.at("seq_lens")));
}

TEST(UMT5Loading, ShardedCheckpointWithIndexLoads) {
  const std::string src = case_path("e1_b2_T12_pad") + "/weights/transformers";
  const std::string dir = skyreels::test::temp_dir("umt5-sharded");
  std::vector<std::pair<std::string, at::Tensor>> shard[2];
  nlohmann::json index;
  int k = 0;
  for (const auto& [name, t] : skyreels::test::load_tensors(src + "/model.safetensors")) {
    const int s = (k++) % 2;
    shard[s].emplace_back(name, t);
    index["weight_map"][name] = "model-0000" + std::to_string(s + 1) + "-of-00002.safetensors";
  }
  for (int s = 0; s < 2; ++s) {
    skyreels::safetensors::save(dir + "/model-0000" + std::to_string(s + 1) + "-of-00002.safetensors", shard[s]);
  }
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  fs::copy_file(src + "/config.json", dir + "/config.json");
  const Case& c = fixture("e1_b2_T12_pad");
  EXPECT_TRUE(close_on_valid_rows(e1_output(dir), c.outputs.at("last_hidden_state"), c.outputs.at("seq_lens")));
}

TEST(UMT5Loading, TokenIdsOutsideTheEmbeddingAreRejected) {
  auto loaded = skyreels::model::load_umt5_encoder(case_path("e1_b2_T12_pad") + "/weights/transformers");
  const at::Tensor ids = at::full({1, 3}, 320, at::kLong);
  EXPECT_THROW(loaded.model->forward(ids, at::ones({1, 3}, at::kLong)), std::invalid_argument);
}

TEST(UMT5BFloat16, RunsInBf16WithWoKeptInFloat32) {
  const Case& c = fixture("e1_b2_T12_pad");
  skyreels::model::UMT5LoadOptions options;
  options.dtype = "bfloat16";
  auto loaded = skyreels::model::load_umt5_encoder(case_path("e1_b2_T12_pad") + "/weights/transformers", options);
  const auto& w = loaded.model->weights();
  EXPECT_EQ(w.at("encoder.block.0.layer.1.DenseReluDense.wo.weight").scalar_type(), at::kFloat);
  EXPECT_EQ(w.at("encoder.block.0.layer.0.SelfAttention.q.weight").scalar_type(), at::kBFloat16);
  const at::Tensor hidden = loaded.model->forward(c.inputs.at("input_ids"), c.inputs.at("attention_mask"));
  EXPECT_EQ(hidden.scalar_type(), at::kBFloat16);
  // bf16 keeps ~3 significant digits; the outputs reach |4.2|.
  const at::Tensor golden = c.outputs.at("last_hidden_state");
  const at::Tensor seq_lens = c.outputs.at("seq_lens");
  for (int64_t b = 0; b < 2; ++b) {
    const int64_t n = seq_lens[b].item<int64_t>();
    EXPECT_TRUE(skyreels::test::all_close(hidden[b].slice(0, 0, n), golden[b].slice(0, 0, n), 0.1, 0.02));
    std::cout << "[ measured ] bf16 row " << b << ": max |diff| vs fp32 golden = "
              << skyreels::test::max_abs_diff(hidden[b].slice(0, 0, n), golden[b].slice(0, 0, n)) << "\n";
  }
}

// ---- strings -> prompt_embeds ------------------------------------------------------------------------------------

std::vector<std::string> e3_prompts() { return fixture("e3_prompts_to_embeds").json["call"]["prompts"]; }

TEST(TextEncoding, E3TokenizationEqualsThePipelineInputs) {
  const Case& c = fixture("e3_prompts_to_embeds");
  auto te = TextEncoder::load(case_path("e3_prompts_to_embeds") + "/weights/transformers",
                              case_path("e3_prompts_to_embeds") + "/tokenizer");
  const auto tokens = te->tokenize(e3_prompts(), 32);
  EXPECT_EQ(tokens.cleaned, c.json["call"]["prompts_after_prompt_clean"].get<std::vector<std::string>>());
  EXPECT_TRUE(at::equal(tokens.input_ids, c.inputs.at("input_ids")));
  EXPECT_TRUE(at::equal(tokens.attention_mask, c.inputs.at("attention_mask")));
}

TEST(TextEncoding, E3StringsToPromptEmbedsMatchThePipelineWithBothLayouts) {
  const Case& c = fixture("e3_prompts_to_embeds");
  for (const std::string layout : {"transformers", "original"}) {
    auto te = TextEncoder::load(case_path("e3_prompts_to_embeds") + "/weights/" + layout,
                                case_path("e3_prompts_to_embeds") + "/tokenizer");
    const at::Tensor embeds = te->encode(e3_prompts(), 32);
    EXPECT_TRUE(skyreels::test::all_close(embeds, c.outputs.at("prompt_embeds"), 1e-4, 1e-4)) << layout;
    const at::Tensor seq_lens = c.outputs.at("seq_lens");
    for (int64_t b = 0; b < embeds.size(0); ++b) {
      const at::Tensor pad = embeds[b].slice(0, seq_lens[b].item<int64_t>());
      EXPECT_TRUE(at::equal(pad, at::zeros_like(pad))) << layout << " row " << b;
    }
  }
}

TEST(TextEncoding, CacheServesRepeatedPromptsWithIdenticalRows) {
  auto te = TextEncoder::load(case_path("e3_prompts_to_embeds") + "/weights/transformers",
                              case_path("e3_prompts_to_embeds") + "/tokenizer");
  const auto prompts = e3_prompts();
  const at::Tensor first = te->encode(prompts, 32);
  EXPECT_EQ(te->cache_stats().misses, prompts.size());
  const at::Tensor again = te->encode({prompts[2], prompts[0]}, 32);
  EXPECT_EQ(te->cache_stats().hits, 2u);
  EXPECT_TRUE(at::equal(again[0], first[2]));
  EXPECT_TRUE(at::equal(again[1], first[0]));
  // Another length is another entry.
  EXPECT_EQ(te->encode({prompts[0]}, 16).size(1), 16);
  EXPECT_EQ(te->cache_stats().entries, prompts.size() + 1);
}

TEST(TextEncoding, PadAwareEncodeEqualsTheFullPaddedForward) {
  auto te = TextEncoder::load(case_path("e3_prompts_to_embeds") + "/weights/transformers",
                              case_path("e3_prompts_to_embeds") + "/tokenizer");
  const auto tokens = te->tokenize({"a fox in the snow", "A cat walks on the grass, realistic style.", ""}, 64);
  ASSERT_LT(tokens.attention_mask.sum(1).max().item<int64_t>(), 64) << "the case must have padding to cut";
  const at::Tensor full = skyreels::model::umt5_zero_pad_rows(
      te->encoder().forward(tokens.input_ids, tokens.attention_mask), tokens.attention_mask);
  const at::Tensor cut = te->encode_uncached(tokens);
  ASSERT_EQ(cut.sizes(), full.sizes());
  EXPECT_TRUE(skyreels::test::all_close(cut, full, 1e-5, 1e-5));
}

TEST(TextEncoding, BatchesOnlyRowsOfAlmostEqualLength) {
  using Groups = std::vector<std::vector<size_t>>;
  EXPECT_EQ(TextEncoder::choose_batches({60, 120}), (Groups{{0}, {1}}));
  EXPECT_EQ(TextEncoder::choose_batches({100, 105}), (Groups{{0, 1}}));
  EXPECT_EQ(TextEncoder::choose_batches({7}), (Groups{{0}}));
  EXPECT_EQ(TextEncoder::choose_batches({512, 512}), (Groups{{0}, {1}})) << "long rows: two singles are faster";
  EXPECT_EQ(TextEncoder::choose_batches({1, 1, 1}), (Groups{{0, 1, 2}}));
}

TEST(TextEncoding, ATextTwiceInOneCallIsEncodedOnce) {
  auto te = TextEncoder::load(case_path("e3_prompts_to_embeds") + "/weights/transformers",
                              case_path("e3_prompts_to_embeds") + "/tokenizer");
  skyreels::model::TextEncodeStats stats;
  const at::Tensor out = te->encode({"a fox", "", "a fox"}, 16, &stats);
  EXPECT_EQ(stats.misses, 2u);
  EXPECT_EQ(stats.hits, 1u);
  EXPECT_TRUE(at::equal(out[0], out[2]));
  te->encode({"", "a fox"}, 16, &stats);
  EXPECT_EQ(stats.misses, 0u);
  EXPECT_EQ(stats.hits, 2u);
  EXPECT_EQ(te->cache_stats().misses, 2u);
  EXPECT_EQ(te->cache_stats().hits, 3u);
}

TEST(TextEncoding, CacheIsBoundedByBytesAndKeyedByTheEncoder) {
  const std::string weights = case_path("e3_prompts_to_embeds") + "/weights/transformers";
  const std::string tokenizer = case_path("e3_prompts_to_embeds") + "/tokenizer";
  skyreels::model::TextEncoderOptions options;
  options.cache_bytes = 2 * 16 * 32 * sizeof(float);  // two rows of 16 tokens x d_model 32
  auto te = TextEncoder::load(weights, tokenizer, options);
  te->encode({"one"}, 16);
  te->encode({"two"}, 16);
  te->encode({"three"}, 16);
  EXPECT_EQ(te->cache_stats().entries, 2u);
  EXPECT_EQ(te->cache_stats().bytes, options.cache_bytes);
  skyreels::model::TextEncodeStats stats;
  te->encode({"one"}, 16, &stats);  // the least recently used went first
  EXPECT_EQ(stats.misses, 1u);
  te->encode({"three"}, 16, &stats);
  EXPECT_EQ(stats.hits, 1u);
  // The identity names the weights and the dtype: the same folder in bf16 is another encoder.
  options.dtype = "bfloat16";
  auto bf16 = TextEncoder::load(weights, tokenizer, options);
  EXPECT_NE(bf16->identity(), te->identity());
  EXPECT_EQ(TextEncoder::load(weights, tokenizer)->identity(), te->identity());
}

TEST(TextEncoding, TokenizerIsFoundNextToAPipelineTextEncoder) {
  const std::string root = skyreels::test::temp_dir("pipeline");
  fs::copy(case_path("e3_prompts_to_embeds") + "/weights/transformers", root + "/text_encoder");
  fs::copy(case_path("e3_prompts_to_embeds") + "/tokenizer", root + "/tokenizer");
  EXPECT_EQ(fs::path(skyreels::model::find_tokenizer(root + "/text_encoder")), fs::path(root + "/tokenizer"));
  auto te = TextEncoder::load(root, "");  // the pipeline root: text_encoder/ and tokenizer/ are found
  EXPECT_EQ(te->hidden_size(), 32);
}

TEST(TextEncoding, TinyRandomTextEncoderLoadsAndEncodes) {
  const std::string dir = skyreels::test::temp_dir("tiny-te");
  skyreels::model::write_tiny_text_encoder(dir, 48, 7);
  auto te = TextEncoder::load(dir, skyreels::test::golden_path("tokenizer/k1_unigram768_bytefallback"));
  const at::Tensor embeds = te->encode({"A red fox runs through the snowy forest.", ""}, 64);
  EXPECT_EQ(embeds.sizes(), (std::vector<int64_t>{2, 64, 48}));
  EXPECT_TRUE(embeds.isfinite().all().item<bool>());
  EXPECT_GT(embeds[0][0].abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(embeds[1].slice(0, 1).abs().sum().item<float>(), 0.0f);  // "" is just the EOS
}

// ---- the CLI -----------------------------------------------------------------------------------------------------

TEST(EncodeTextCli, ReproducesE3PromptEmbedsFromItsStrings) {
  const std::string bin = skyreels::test::bin_path("skyreels");
  ASSERT_TRUE(fs::exists(bin)) << bin << " is not built";
  const Case& c = fixture("e3_prompts_to_embeds");
  const std::string out = skyreels::test::temp_dir("encode-text") + "/embeds.safetensors";
  std::string cmd = bin + " encode-text --text-encoder " + case_path("e3_prompts_to_embeds") +
                    "/weights/transformers --tokenizer " + case_path("e3_prompts_to_embeds") +
                    "/tokenizer --max-sequence-length 32 --out " + out;
  for (const auto& p : e3_prompts()) {
    std::string quoted = "'";
    for (char ch : p) quoted += (ch == '\'') ? std::string("'\\''") : std::string(1, ch);
    cmd += " --prompt " + quoted + "'";
  }
  std::string log;
  ASSERT_EQ(skyreels::test::run_command(cmd, &log), 0) << log;
  const auto tensors = skyreels::test::load_tensors(out);
  ASSERT_TRUE(tensors.count("prompt_embeds")) << log;
  EXPECT_TRUE(skyreels::test::all_close(tensors.at("prompt_embeds"), c.outputs.at("prompt_embeds"), 1e-4, 1e-4));
  EXPECT_TRUE(at::equal(tensors.at("input_ids"), c.inputs.at("input_ids")));
}

TEST(EncodeTextCli, MissingFlagIsAUsageError) {
  const std::string bin = skyreels::test::bin_path("skyreels");
  ASSERT_TRUE(fs::exists(bin)) << bin << " is not built";
  std::string log;
  EXPECT_EQ(skyreels::test::run_command(bin + " encode-text --prompt hi --out /dev/null", &log), 2) << log;
  EXPECT_NE(log.find("--text-encoder"), std::string::npos) << log;
}

}  // namespace

TEST(GenerateCli, TextPromptGivesTheSameLatentsAsItsEncodedEmbeddings) {
  const std::string bin = skyreels::test::bin_path("skyreels");
  ASSERT_TRUE(fs::exists(bin)) << bin << " is not built";
  const std::string dir = skyreels::test::temp_dir("generate-prompt");
  const std::string encoder = case_path("e3_prompts_to_embeds") + "/weights/transformers";  // d_model 32
  const std::string tokenizer = case_path("e3_prompts_to_embeds") + "/tokenizer";
  std::string log;
  ASSERT_EQ(skyreels::test::run_command(bin + " make-tiny --out " + dir + "/model", &log), 0) << log;  // text_dim 32

  // The same embeddings, once as tensors (encode-text; "" is the default negative prompt) and once from text.
  const std::string embeds = dir + "/embeds.safetensors";
  ASSERT_EQ(skyreels::test::run_command(bin + " encode-text --text-encoder " + encoder + " --tokenizer " + tokenizer +
                                            " --prompt 'a fox in the snow' --prompt '' --out " + embeds,
                                        &log),
            0)
      << log;
  const auto encoded = skyreels::test::load_tensors(embeds);
  skyreels::safetensors::save(dir + "/inputs.safetensors",
                              {{"prompt_embeds", encoded.at("prompt_embeds").slice(0, 0, 1)},
                               {"negative_prompt_embeds", encoded.at("prompt_embeds").slice(0, 1, 2)}});
  const std::string common = " generate --model " + dir + "/model --num-frames 17 --height 32 --width 32" +
                             " --num-inference-steps 3 --guidance-scale 5 --seed 3";
  ASSERT_EQ(
      skyreels::test::run_command(
          bin + common + " --inputs " + dir + "/inputs.safetensors --out " + dir + "/from_tensors.safetensors", &log),
      0)
      << log;
  ASSERT_EQ(skyreels::test::run_command(bin + common + " --text-encoder " + encoder + " --tokenizer " + tokenizer +
                                            " --prompt 'a fox in the snow' --out " + dir + "/from_text.safetensors",
                                        &log),
            0)
      << log;
  const at::Tensor a = skyreels::test::load_tensors(dir + "/from_tensors.safetensors").at("latents");
  const at::Tensor b = skyreels::test::load_tensors(dir + "/from_text.safetensors").at("latents");
  EXPECT_TRUE(at::equal(a, b));
}
