// The transformer checkpoint loader: every golden layout maps onto the same internal tensors, loads onto the model in
// the right dtypes and devices, converts and round-trips, and every kind of damaged checkpoint fails with a message
// that names what is wrong.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "model/transformer_loader.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
namespace st = skyreels::safetensors;
namespace ck = skyreels::checkpoint;
using namespace skyreels::model;
using skyreels::test::error_of;
using skyreels::test::golden_path;
using skyreels::test::temp_dir;

namespace {

const char* const kCases[] = {"t1_tiny_df_fps", "t6_bf16_checkpoint"};
const char* const kLayouts[] = {"diffusers", "diffusers_sharded", "original", "norm_out_linear"};

std::string weights(const std::string& golden_case, const std::string& layout) {
  return golden_path("transformer_forward/" + golden_case + "/weights/" + layout);
}

std::map<std::string, at::Tensor> diffusers_reference(const std::string& golden_case) {
  return skyreels::test::load_tensors(weights(golden_case, "diffusers") + "/diffusion_pytorch_model.safetensors");
}

std::string copy_of(const std::string& golden_case, const std::string& layout) {
  const std::string dir = temp_dir("loader") + "/" + layout;
  fs::copy(weights(golden_case, layout), dir, fs::copy_options::recursive);
  return dir;
}

std::string load_error(const std::string& path) {
  return error_of([&] { map_transformer_checkpoint(path); });
}

// Rewrites the JSON header of a safetensors file in place; the data area is kept byte for byte.
void edit_header(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  skyreels::test::edit_header_text(path, [&](std::string& text) {
    nlohmann::json header = nlohmann::json::parse(text);
    edit(header);
    text = header.dump();
  });
}

// Rewrites a safetensors file through a map of tensors (to add or change tensors).
void edit_tensors(const std::string& path, const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
  auto tensors = st::load_all(path);
  edit(tensors);
  st::save(path, {tensors.begin(), tensors.end()});
}

void edit_json(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(std::ifstream(path));
  edit(j);
  std::ofstream(path, std::ios::trunc) << j.dump(2);
}

// A tiny model whose inner dim is a multiple of 128, so the config can be inferred from shapes.
TransformerConfig head128_config() {
  TransformerConfig c;
  c.num_attention_heads = 2;
  c.attention_head_dim = 128;
  c.in_channels = 4;
  c.out_channels = 8;
  c.text_dim = 8;
  c.freq_dim = 16;
  c.ffn_dim = 8;
  c.num_layers = 3;
  c.inject_sample_info = true;
  return c;
}

std::vector<std::pair<std::string, at::Tensor>> random_tensors(const TransformerConfig& c,
                                                               const std::function<std::string(std::string)>& key) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& spec : transformer_parameter_specs(c)) out.emplace_back(key(spec.name), at::randn(spec.shape));
  return out;
}

}  // namespace

// ---- layouts ---------------------------------------------------------------------------------------------------

TEST(TransformerLoader, DetectsTheLayoutOfEachGoldenCheckpoint) {
  const std::map<std::string, TransformerLayout> expected = {{"diffusers", TransformerLayout::Diffusers},
                                                             {"diffusers_sharded", TransformerLayout::Diffusers},
                                                             {"original", TransformerLayout::Original},
                                                             {"norm_out_linear", TransformerLayout::NormOutLinear}};
  for (const char* golden_case : kCases) {
    for (const auto& [layout, want] : expected) {
      const auto mapped = map_transformer_checkpoint(weights(golden_case, layout));
      EXPECT_EQ(mapped.report.layout, want) << golden_case << "/" << layout;
    }
  }
}

TEST(TransformerLoader, EveryGoldenLayoutMapsBitwiseOntoTheDiffusersTensors) {
  for (const char* golden_case : kCases) {
    const auto reference = diffusers_reference(golden_case);
    for (const char* layout : kLayouts) {
      SCOPED_TRACE(std::string(golden_case) + "/" + layout);
      const auto mapped = map_transformer_checkpoint(weights(golden_case, layout));
      ASSERT_EQ(mapped.tensors.size(), reference.size());
      for (const auto& [name, want] : reference) {
        auto it = mapped.tensors.find(name);
        ASSERT_NE(it, mapped.tensors.end()) << name;
        EXPECT_EQ(it->second.scalar_type(), want.scalar_type()) << name;
        EXPECT_TRUE(at::equal(it->second, want)) << name;
      }
      EXPECT_EQ(mapped.config.to_diffusers_json(),
                map_transformer_checkpoint(weights(golden_case, "diffusers")).config.to_diffusers_json());
    }
  }
}

TEST(TransformerLoader, OriginalConfigJsonReadsAsTheDiffusersConfig) {
  const auto original = parse_transformer_config(weights("t1_tiny_df_fps", "original") + "/config.json");
  const auto diffusers = parse_transformer_config(weights("t1_tiny_df_fps", "diffusers") + "/config.json");
  EXPECT_EQ(original.form, "original");
  EXPECT_EQ(diffusers.form, "diffusers");
  EXPECT_EQ(original.config.to_diffusers_json(), diffusers.config.to_diffusers_json());
  EXPECT_EQ(original.config.num_attention_heads, 2);
  EXPECT_EQ(original.config.attention_head_dim, 12);
  EXPECT_TRUE(original.config.inject_sample_info);
}

TEST(TransformerLoader, OriginalRenameTableIsInvertedExactlyByItsReverse) {
  const auto config = map_transformer_checkpoint(weights("t1_tiny_df_fps", "diffusers")).config;
  std::set<std::string> reversed;
  for (const auto& spec : transformer_parameter_specs(config)) {
    const std::string key = transformer_checkpoint_key(TransformerLayout::Original, spec.name);
    EXPECT_EQ(ck::apply_rules(key, transformer_rename_rules(TransformerLayout::Original)), spec.name) << key;
    reversed.insert(key);
  }
  const auto original = st::File::open(weights("t1_tiny_df_fps", "original") + "/model.safetensors")->names();
  EXPECT_EQ(reversed, std::set<std::string>(original.begin(), original.end()));
}

TEST(TransformerLoader, StripsTheModelDiffusionModelPrefix) {
  const std::string dir = copy_of("t1_tiny_df_fps", "original");
  edit_tensors(dir + "/model.safetensors", [](auto& tensors) {
    std::map<std::string, at::Tensor> prefixed;
    for (auto& [k, v] : tensors) prefixed["model.diffusion_model." + k] = v;
    tensors = prefixed;
  });
  const auto mapped = map_transformer_checkpoint(dir);
  const auto reference = diffusers_reference("t1_tiny_df_fps");
  ASSERT_EQ(mapped.tensors.size(), reference.size());
  for (const auto& [name, want] : reference) EXPECT_TRUE(at::equal(mapped.tensors.at(name), want)) << name;
}

TEST(TransformerLoader, ReadsOriginalShardsThatHaveNoIndexAsDF14BShipsThem) {
  const std::string dir = temp_dir("shards");
  fs::copy(weights("t1_tiny_df_fps", "original") + "/config.json", dir + "/config.json");
  auto all = st::load_all(weights("t1_tiny_df_fps", "original") + "/model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> first, second;
  for (const auto& [k, v] : all) (k.rfind("blocks.", 0) == 0 ? first : second).emplace_back(k, v);
  st::save(dir + "/model-00001-of-00002.safetensors", first);
  st::save(dir + "/model-00002-of-00002.safetensors", second);
  const auto mapped = map_transformer_checkpoint(dir);
  EXPECT_EQ(mapped.report.files.size(), 2u);
  const auto reference = diffusers_reference("t1_tiny_df_fps");
  ASSERT_EQ(mapped.tensors.size(), reference.size());
  for (const auto& [name, want] : reference) EXPECT_TRUE(at::equal(mapped.tensors.at(name), want)) << name;
}

TEST(TransformerLoader, ReadsTheTransformerFolderOfADiffusersPipeline) {
  const std::string pipeline = temp_dir("pipeline");
  fs::copy(weights("t1_tiny_df_fps", "diffusers_sharded"), pipeline + "/transformer", fs::copy_options::recursive);
  std::ofstream(pipeline + "/model_index.json") << R"({"_class_name": "SkyReelsV2DiffusionForcingPipeline"})";
  const auto mapped = map_transformer_checkpoint(pipeline);
  EXPECT_EQ(mapped.tensors.size(), 74u);
  EXPECT_EQ(mapped.report.files.size(), 2u);
}

// ---- image-to-video (I2V) checkpoints: pipeline_i2v's models in both layouts --------------------------------------

// pipeline_i2v's transformer of `name` as one folder: its config.json and the union of case.json's safetensors (the
// FLF2V case adds pos_embed to the I2V model of i1), with every key written by `key` (a layout's naming).
std::string i2v_folder(const std::string& name, const std::function<std::string(const std::string&)>& key) {
  const std::string dir = temp_dir("i2v") + "/" + name;
  fs::create_directories(dir);
  const auto json = nlohmann::json::parse(std::ifstream(golden_path("pipeline_i2v/" + name + "/case.json")));
  const auto& w = json["weights"]["transformer"];
  fs::copy(golden_path(w["dir"].get<std::string>() + "/config.json"), dir + "/config.json");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& file : w["safetensors"]) {
    for (const auto& [k, t] : st::load_all(golden_path(file.get<std::string>()))) tensors.emplace_back(key(k), t);
  }
  st::save(dir + "/diffusion_pytorch_model.safetensors", tensors);
  return dir;
}

std::string same_name(const std::string& name) { return name; }
std::string original_name(const std::string& name) {
  return transformer_checkpoint_key(TransformerLayout::Original, name);
}

TEST(TransformerLoaderI2v, BothLayoutsOfTheI2vAndFlf2vModelsMapOntoTheSameTensors) {
  for (const char* name : {"i1_image_cfg5_shift5", "i2_flf2v_last_image_cfg4"}) {
    SCOPED_TRACE(name);
    const auto diffusers = map_transformer_checkpoint(i2v_folder(name, same_name));
    const std::string original_dir = i2v_folder(name, original_name);
    const auto keys = st::File::open(original_dir + "/diffusion_pytorch_model.safetensors")->names();
    const std::set<std::string> key_set(keys.begin(), keys.end());
    for (const char* k : {"img_emb.proj.0.weight", "img_emb.proj.1.weight", "img_emb.proj.3.weight",
                          "img_emb.proj.4.bias", "blocks.1.cross_attn.k_img.weight", "blocks.1.cross_attn.v_img.bias",
                          "blocks.1.cross_attn.norm_k_img.weight"}) {
      EXPECT_TRUE(key_set.count(k)) << "the original name '" << k << "' (Wan's WanI2VCrossAttention / MLPProj)";
    }
    EXPECT_EQ(key_set.count("img_emb.emb_pos"), std::string(name).rfind("i2", 0) == 0 ? 1u : 0u);
    const auto original = map_transformer_checkpoint(original_dir);
    EXPECT_EQ(original.report.layout, TransformerLayout::Original);
    ASSERT_EQ(original.tensors.size(), diffusers.tensors.size());
    for (const auto& [n, t] : diffusers.tensors) EXPECT_TRUE(at::equal(original.tensors.at(n), t)) << n;
    EXPECT_EQ(original.config.to_diffusers_json(), diffusers.config.to_diffusers_json());
    EXPECT_EQ(*diffusers.config.image_dim, 8);
    EXPECT_EQ(*diffusers.config.added_kv_proj_dim, 12);
  }
}

TEST(TransformerLoaderI2v, LoadsOntoTheDeviceWithTheImageEmbedderNormsAsFp32Islands) {
  TransformerLoadOptions options;
  options.dtype = "bfloat16";
  const auto loaded = load_transformer(i2v_folder("i2_flf2v_last_image_cfg4", same_name), options);
  std::map<std::string, at::ScalarType> dtypes;
  for (const auto& [name, t] : loaded.model->named_tensors()) dtypes[name] = t.scalar_type();
  EXPECT_EQ(dtypes.at("condition_embedder.image_embedder.norm1.weight"), at::kFloat);
  EXPECT_EQ(dtypes.at("condition_embedder.image_embedder.norm2.bias"), at::kFloat);
  EXPECT_EQ(dtypes.at("condition_embedder.image_embedder.pos_embed"), at::kBFloat16);
  EXPECT_EQ(dtypes.at("blocks.0.attn2.norm_added_k.weight"), at::kBFloat16);
  EXPECT_EQ(dtypes.at("blocks.0.attn2.add_k_proj.weight"), at::kBFloat16);
  EXPECT_EQ(loaded.report.placed_device, "cpu");
  EXPECT_EQ(loaded.report.placed_tensors, static_cast<int64_t>(loaded.model->named_tensors().size()));
}

TEST(TransformerLoaderI2v, OriginalConfigOfI2vAndFlf2vModels) {
  const std::string dir = copy_of("t1_tiny_df_fps", "original");
  for (const char* type : {"i2v", "flf2v"}) {
    edit_json(dir + "/config.json", [&](auto& j) { j["model_type"] = type; });
    const auto parsed = parse_transformer_config(dir + "/config.json").config;
    EXPECT_EQ(parsed.image_dim, 1280);
    EXPECT_EQ(parsed.added_kv_proj_dim, parsed.inner_dim());
    EXPECT_EQ(parsed.pos_embed_seq_len.value_or(0), std::string(type) == "flf2v" ? 514 : 0);
  }
}

TEST(TransformerLoaderI2v, InfersTheImageBranchFromShapesWhenConfigJsonIsAbsent) {
  TransformerConfig want = head128_config();
  want.inject_sample_info = false;
  want.in_channels = 36;
  want.image_dim = 16;
  want.added_kv_proj_dim = want.inner_dim();
  want.pos_embed_seq_len = 6;
  for (const auto layout : {TransformerLayout::Diffusers, TransformerLayout::Original}) {
    const std::string dir = temp_dir("infer-i2v");
    st::save(dir + "/model.safetensors",
             random_tensors(want, [&](std::string n) { return transformer_checkpoint_key(layout, n); }));
    const auto analysis = analyze_transformer_checkpoint(dir);
    ASSERT_TRUE(analysis.ok()) << analysis.error_message();
    EXPECT_EQ(analysis.config->to_diffusers_json(), want.to_diffusers_json());
  }
}

TEST(TransformerLoaderI2v, MissingImageTensorsAndAConfigThatContradictsThemAreNamed) {
  const std::string dir = i2v_folder("i1_image_cfg5_shift5", original_name);
  edit_json(dir + "/config.json", [](auto& j) { j["pos_embed_seq_len"] = 10; });
  EXPECT_HAS(load_error(dir), "pos_embed_seq_len: config says 10, but the checkpoint has no image position embedding");
  edit_json(dir + "/config.json", [](auto& j) { j["pos_embed_seq_len"] = nullptr; });
  edit_tensors(dir + "/diffusion_pytorch_model.safetensors",
               [](auto& t) { t.erase("blocks.1.cross_attn.norm_k_img.weight"); });
  EXPECT_HAS(load_error(dir), "blocks.1.cross_attn.norm_k_img.weight");
}

// ---- config inference ------------------------------------------------------------------------------------------

TEST(TransformerLoader, InfersTheConfigFromShapesWhenConfigJsonIsAbsent) {
  const TransformerConfig want = head128_config();
  for (const auto layout : {TransformerLayout::Diffusers, TransformerLayout::Original}) {
    const std::string dir = temp_dir("infer");
    st::save(dir + "/model.safetensors",
             random_tensors(want, [&](std::string n) { return transformer_checkpoint_key(layout, n); }));
    const auto analysis = analyze_transformer_checkpoint(dir);
    ASSERT_TRUE(analysis.ok()) << analysis.error_message();
    EXPECT_EQ(analysis.config->to_diffusers_json(), want.to_diffusers_json());
    EXPECT_HAS(analysis.report.config_source, "inferred from tensor shapes");
    std::string notes;
    for (const auto& n : analysis.report.notes) notes += n + "\n";
    EXPECT_HAS(notes, "assumed attention_head_dim 128");
  }
}

TEST(TransformerLoader, RefusesToGuessTheHeadsWhenTheInnerDimIsNotAMultipleOf128) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  fs::remove(dir + "/config.json");
  const std::string msg = load_error(dir);
  EXPECT_HAS(msg, "cannot infer num_attention_heads: the inner dim 24 (patch_embedding.weight [24, 16, 1, 2, 2])");
  EXPECT_HAS(msg, "add a config.json");
}

// ---- placement -------------------------------------------------------------------------------------------------

TEST(TransformerLoader, Bf16LoadKeepsFp32IslandsInFloat32AndEverythingOnTheTargetDevice) {
  const auto loaded = load_transformer(weights("t1_tiny_df_fps", "original"), {"cpu", "bfloat16"});
  EXPECT_EQ(loaded.model->compute_dtype(), at::kBFloat16);
  std::map<std::string, at::Tensor> held;
  for (const auto& [name, t] : loaded.model->named_tensors()) held[name] = t;
  int islands = 0;
  for (const auto& spec : transformer_parameter_specs(loaded.model->config())) {
    ASSERT_TRUE(held.count(spec.name)) << spec.name;
    const at::Tensor& t = held.at(spec.name);
    EXPECT_EQ(t.scalar_type(), spec.keep_fp32 ? at::kFloat : at::kBFloat16) << spec.name;
    EXPECT_TRUE(t.device().is_cpu()) << spec.name;
    islands += spec.keep_fp32;
  }
  EXPECT_EQ(islands, 4 + 2 * 3 + 1);  // time_embedder (4), per block table + norm2 (2 x 3), head table
  for (const auto& [name, t] : held) EXPECT_TRUE(t.device().is_cpu()) << name;
}

// No weight views the file (issue 46): a float32 checkpoint placed on CPU as float32 is copied out of its mapping
// (same values, memory of its own), so rewriting the file while serving cannot change the model.
TEST(TransformerLoader, Float32LoadOnCpuCopiesEveryWeightOutOfTheFile) {
  const std::string path = weights("t1_tiny_df_fps", "diffusers");
  const auto mapped = map_transformer_checkpoint(path);
  const auto specs = transformer_parameter_specs(mapped.config);
  const auto placed = ck::place_strict(mapped.tensors, specs, {"cpu", at::kFloat}, "test");
  for (const auto& spec : specs) {
    EXPECT_TRUE(skyreels::safetensors::views_mapping(mapped.tensors.at(spec.name))) << spec.name;
    EXPECT_FALSE(skyreels::safetensors::views_mapping(placed.at(spec.name))) << spec.name;
    EXPECT_TRUE(at::equal(placed.at(spec.name), mapped.tensors.at(spec.name))) << spec.name;
  }
  // and the bf16 fixture converted to float32 is a copy with the same values
  const auto bf16 = map_transformer_checkpoint(weights("t6_bf16_checkpoint", "diffusers"));
  const auto converted = ck::place_strict(bf16.tensors, specs, {"cpu", at::kFloat}, "test");
  for (const auto& spec : specs) {
    EXPECT_EQ(converted.at(spec.name).scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(converted.at(spec.name), bf16.tensors.at(spec.name).to(at::kFloat))) << spec.name;
  }
}

TEST(TransformerLoader, Fp16CheckpointIsConvertedBecauseCpuCannotComputeInFp16) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  edit_tensors(dir + "/diffusion_pytorch_model.safetensors", [](auto& tensors) {
    for (auto& [k, v] : tensors) v = v.to(at::kHalf);
  });
  const auto f32 = load_transformer(dir, {"cpu", "float32"});
  const auto bf16 = load_transformer(dir, {"cpu", "bfloat16"});
  EXPECT_EQ(f32.report.stored_dtypes.at("F16"), 74);
  const auto reference = diffusers_reference("t1_tiny_df_fps");
  std::map<std::string, at::Tensor> held;
  for (const auto& [name, t] : f32.model->named_tensors()) held[name] = t;
  for (const auto& [name, want] : reference) {
    EXPECT_EQ(held.at(name).scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(at::equal(held.at(name), want.to(at::kHalf).to(at::kFloat))) << name;
  }
  for (const auto& [name, t] : bf16.model->named_tensors()) EXPECT_NE(t.scalar_type(), at::kHalf) << name;
}

TEST(TransformerLoader, AutoDtypeResolvesAndUnknownDtypeOrDeviceIsRefused) {
  const std::string path = weights("t1_tiny_df_fps", "diffusers");
  const auto loaded = load_transformer(path, {"cpu", "auto"});
  EXPECT_TRUE(loaded.model->compute_dtype() == at::kFloat || loaded.model->compute_dtype() == at::kBFloat16);
  EXPECT_HAS(error_of([&] { load_transformer(path, {"cpu", "float8"}); }), "unknown dtype 'float8'");
  EXPECT_HAS(error_of([&] { load_transformer(path, {"tpu:0", "float32"}); }), "device 'tpu:0'");
}

// Same output as diffusers for every layout (a forward that throws fails the test; nothing is skipped).
TEST(TransformerLoader, EveryGoldenLayoutGivesTheFixtureForwardOutput) {
  for (const char* golden_case : kCases) {
    const std::string dir = golden_path(std::string("transformer_forward/") + golden_case);
    const auto inputs = skyreels::test::load_tensors(dir + "/inputs.safetensors");
    const at::Tensor expected = skyreels::test::load_tensors(dir + "/output.safetensors").at("sample");
    for (const char* layout : kLayouts) {
      SCOPED_TRACE(std::string(golden_case) + "/" + layout);
      const auto loaded = load_transformer(weights(golden_case, layout), {"cpu", "float32"});
      TransformerForwardArgs args;
      args.hidden_states = inputs.at("hidden_states");
      args.timestep = inputs.at("timestep");
      args.encoder_hidden_states = inputs.at("encoder_hidden_states");
      args.fps = inputs.at("fps");
      const at::Tensor out = loaded.model->forward(args);
      EXPECT_TRUE(skyreels::test::all_close(out, expected, 1e-4, 1e-4));
    }
  }
}

// ---- convert ---------------------------------------------------------------------------------------------------

TEST(TransformerConvert, OriginalToDiffusersRoundTripsEveryTensorBitwise) {
  const std::string dst = temp_dir("convert") + "/out";
  const auto result = convert_transformer_checkpoint(weights("t1_tiny_df_fps", "original"), dst);
  EXPECT_TRUE(fs::exists(dst + "/diffusion_pytorch_model.safetensors"));
  EXPECT_TRUE(fs::exists(dst + "/config.json"));
  EXPECT_FALSE(fs::exists(dst + "/diffusion_pytorch_model.safetensors.index.json"));
  EXPECT_EQ(result.bytes, 130304u);
  const auto written = skyreels::test::load_tensors(dst + "/diffusion_pytorch_model.safetensors");
  const auto reference = diffusers_reference("t1_tiny_df_fps");
  ASSERT_EQ(written.size(), reference.size());
  for (const auto& [name, want] : reference) EXPECT_TRUE(at::equal(written.at(name), want)) << name;
  EXPECT_EQ(
      parse_transformer_config(dst + "/config.json").config.to_diffusers_json(),
      parse_transformer_config(weights("t1_tiny_df_fps", "diffusers") + "/config.json").config.to_diffusers_json());
  EXPECT_EQ(map_transformer_checkpoint(dst).report.layout, TransformerLayout::Diffusers);
}

TEST(TransformerConvert, ShardsAboveTheSizeLimitWithAnIndexThatLoadsBack) {
  const std::string dst = temp_dir("convert") + "/out";
  const uint64_t limit = 40000;
  convert_transformer_checkpoint(weights("t6_bf16_checkpoint", "norm_out_linear"), dst, {"", limit});
  const nlohmann::json index =
      nlohmann::json::parse(std::ifstream(dst + "/diffusion_pytorch_model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), 65152u);  // bf16: 32576 x 2
  EXPECT_EQ(index["weight_map"].size(), 74u);
  std::set<std::string> shards;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) shards.insert(it.value());
  EXPECT_EQ(shards.size(), 2u);
  for (const auto& shard : shards) {
    EXPECT_HAS(shard, "-of-00002.safetensors");
    uint64_t data = 0;
    for (const auto& info : st::File::open(dst + "/" + shard)->tensors()) data += info.end - info.begin;
    EXPECT_LE(data, limit) << shard;
  }
  EXPECT_FALSE(fs::exists(dst + "/diffusion_pytorch_model.safetensors"));
  const auto back = map_transformer_checkpoint(dst);
  const auto reference = diffusers_reference("t6_bf16_checkpoint");
  for (const auto& [name, want] : reference) EXPECT_TRUE(at::equal(back.tensors.at(name), want)) << name;
}

TEST(TransformerConvert, Bf16OutputKeepsFp32IslandsInFloat32) {
  const std::string dst = temp_dir("convert") + "/out";
  convert_transformer_checkpoint(weights("t1_tiny_df_fps", "diffusers"), dst, {"bfloat16", 5'000'000'000ull});
  const auto written = skyreels::test::load_tensors(dst + "/diffusion_pytorch_model.safetensors");
  const auto reference = diffusers_reference("t1_tiny_df_fps");
  const auto config = map_transformer_checkpoint(dst).config;
  for (const auto& spec : transformer_parameter_specs(config)) {
    const at::Tensor& t = written.at(spec.name);
    EXPECT_EQ(t.scalar_type(), spec.keep_fp32 ? at::kFloat : at::kBFloat16) << spec.name;
    EXPECT_TRUE(at::equal(t, reference.at(spec.name).to(t.scalar_type()))) << spec.name;
  }
}

TEST(TransformerConvert, NeverWritesIntoANonEmptyFolderOrFromABrokenCheckpoint) {
  const std::string dst = temp_dir("convert");
  std::ofstream(dst + "/keep.txt") << "x";
  EXPECT_HAS(error_of([&] { convert_transformer_checkpoint(weights("t1_tiny_df_fps", "original"), dst); }),
             "is not empty; convert never overwrites");
  const std::string broken = copy_of("t1_tiny_df_fps", "diffusers");
  edit_json(broken + "/config.json", [](auto& j) { j["num_layers"] = 3; });
  const std::string out = temp_dir("convert") + "/out";
  EXPECT_HAS(error_of([&] { convert_transformer_checkpoint(broken, out); }), "num_layers: config says 3");
  EXPECT_FALSE(fs::exists(out));
}

// ---- the damage matrix -----------------------------------------------------------------------------------------

TEST(TransformerLoaderDamage, TruncatedFileNamesTheFileAndTheTensor) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 100);
  const std::string msg = load_error(dir);
  EXPECT_HAS(msg, "diffusion_pytorch_model.safetensors', tensor '");
  EXPECT_HAS(msg, "is past the data area");
  EXPECT_HAS(msg, "truncated?");
}

TEST(TransformerLoaderDamage, HeaderLengthPastTheEndOfTheFile) {
  const std::string dir = copy_of("t1_tiny_df_fps", "original");
  const std::string file = dir + "/model.safetensors";
  std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
  const char huge[8] = {0, 0, 0, 0, 1, 0, 0, 0};  // 2^32
  f.write(huge, 8);
  f.close();
  const std::string msg = load_error(dir);
  EXPECT_HAS(msg, "model.safetensors': header length 4294967296 is past the end of the file");
}

TEST(TransformerLoaderDamage, InvalidJsonHeader) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
  f.seekp(8);
  f.put('[');  // the opening brace of the header
  f.close();
  EXPECT_HAS(load_error(dir), "header is not valid JSON");
}

TEST(TransformerLoaderDamage, UnknownDtypeNamesTheTensor) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  edit_header(dir + "/diffusion_pytorch_model.safetensors", [](auto& h) { h["proj_out.bias"]["dtype"] = "F8_E9M9"; });
  EXPECT_HAS(load_error(dir), "tensor 'proj_out.bias': unknown dtype 'F8_E9M9'");
}

TEST(TransformerLoaderDamage, OverlappingOffsetsNameBothTensors) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  edit_header(dir + "/diffusion_pytorch_model.safetensors", [](auto& h) {
    h["blocks.0.attn1.norm_q.weight"]["data_offsets"] = h["blocks.0.attn1.norm_k.weight"]["data_offsets"];
  });
  const std::string msg = load_error(dir);
  EXPECT_HAS(msg, "'blocks.0.attn1.norm_k.weight' and 'blocks.0.attn1.norm_q.weight' have overlapping data_offsets");
}

TEST(TransformerLoaderDamage, WrongShapeNamesTheInternalNameAndTheCheckpointKey) {
  const std::string dir = copy_of("t1_tiny_df_fps", "original");
  edit_header(dir + "/model.safetensors", [](auto& h) { h["blocks.1.self_attn.q.weight"]["shape"] = {12, 48}; });
  EXPECT_HAS(load_error(dir),
             "blocks.1.attn1.to_q.weight (checkpoint key 'blocks.1.self_attn.q.weight'): checkpoint [12, 48] vs "
             "model [24, 24]");
}

TEST(TransformerLoaderDamage, MissingKeyNamesTheCheckpointKeyItWasExpectedUnder) {
  const std::string dir = copy_of("t1_tiny_df_fps", "original");
  edit_tensors(dir + "/model.safetensors", [](auto& t) { t.erase("blocks.1.norm3.weight"); });
  EXPECT_HAS(load_error(dir), "missing keys (1):\n    blocks.1.norm2.weight (checkpoint key 'blocks.1.norm3.weight')");
}

TEST(TransformerLoaderDamage, UnexpectedKey) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  edit_tensors(dir + "/diffusion_pytorch_model.safetensors",
               [](auto& t) { t["blocks.0.norm1.weight"] = at::ones({24}); });
  EXPECT_HAS(load_error(dir), "unexpected keys (1):\n    blocks.0.norm1.weight");
}

TEST(TransformerLoaderDamage, MissingUnexpectedAndMisshapenKeysAreReportedTogether) {
  const std::string dir = copy_of("t1_tiny_df_fps", "original");
  edit_tensors(dir + "/model.safetensors", [](auto& t) {
    t.erase("head.modulation");
    t["blocks.0.extra.weight"] = at::ones({3});
    t["fps_embedding.weight"] = at::ones({3, 24});
  });
  const std::string msg = load_error(dir);
  EXPECT_HAS(msg, "3 problem(s)");
  EXPECT_HAS(msg, "missing keys (1):\n    scale_shift_table (checkpoint key 'head.modulation')");
  EXPECT_HAS(msg, "unexpected keys (1):\n    blocks.0.extra.weight");
  EXPECT_HAS(msg, "shape mismatches (1):\n    fps_embedding.weight: checkpoint [3, 24] vs model [2, 24]");
}

TEST(TransformerLoaderDamage, MissingShardIsNamed) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers_sharded");
  fs::remove(dir + "/diffusion_pytorch_model-00002-of-00002.safetensors");
  EXPECT_HAS(load_error(dir), "diffusion_pytorch_model-00002-of-00002.safetensors' named by the index is missing");
}

TEST(TransformerLoaderDamage, NonIdentityNormOutLinearWeightIsRefusedWithItsDeviation) {
  const std::string dir = copy_of("t1_tiny_df_fps", "norm_out_linear");
  edit_tensors(dir + "/diffusion_pytorch_model.safetensors", [](auto& t) { t["norm_out.linear.weight"][30][6] = 0.5; });
  const std::string msg = load_error(dir);
  EXPECT_HAS(msg,
             "'norm_out.linear.weight' is not two stacked identities [I; I] (max deviation 0.5 at row 30, column 6)");
  EXPECT_HAS(msg, "Refusing to load it");
}

TEST(TransformerLoaderDamage, ConfigThatContradictsTheTensorsNamesTheFieldAndTheTensor) {
  const std::string dir = copy_of("t1_tiny_df_fps", "original");
  edit_json(dir + "/config.json", [](auto& j) {
    j["ffn_dim"] = 64;
    j["inject_sample_info"] = false;
  });
  const std::string msg = load_error(dir);
  EXPECT_HAS(msg,
             "contradicts the tensors: ffn_dim: config says 64, the tensors say 32 "
             "(blocks.0.ffn.net.0.proj.weight [32, 24])");
  EXPECT_HAS(msg, "inject_sample_info: config says false, but the checkpoint has fps_embedding.weight");
}

TEST(TransformerLoaderDamage, MalformedOrForeignConfigJsonNamesTheField) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  edit_json(dir + "/config.json", [](auto& j) { j["num_layers"] = "two"; });
  EXPECT_HAS(load_error(dir), "field 'num_layers' must be an integer, got \"two\"");
  edit_json(dir + "/config.json", [](auto& j) { j["_class_name"] = "AutoencoderKLWan"; });
  EXPECT_HAS(load_error(dir), "describes a 'AutoencoderKLWan', not a SkyReels-V2 transformer");
}

TEST(TransformerLoaderDamage, AnImageToVideoConfigOnATextCheckpointNamesTheMissingImageBranch) {
  const std::string dir = copy_of("t1_tiny_df_fps", "original");
  edit_json(dir + "/config.json", [](auto& j) { j["model_type"] = "i2v"; });
  EXPECT_HAS(load_error(dir), "image_dim: config says 1280, but the checkpoint has no image embedder");
  EXPECT_HAS(load_error(dir), "added_kv_proj_dim: config says 24, but the checkpoint has no image key projection");
}

TEST(TransformerLoaderDamage, ForeignOrMixedKeysAreNotGuessed) {
  EXPECT_HAS(load_error(golden_path("transformer_forward/t1_tiny_df_fps/inputs.safetensors")),
             "no SkyReels-V2 transformer keys found");
  const std::string dir = copy_of("t1_tiny_df_fps", "original");
  edit_tensors(dir + "/model.safetensors", [](auto& t) { t["proj_out.weight"] = at::ones({64, 24}); });
  EXPECT_HAS(load_error(dir), "mixes original SkyReels-V2/Wan key names");
  EXPECT_HAS(load_error(dir + "/nothing-here"), "does not exist");
}

// ---- fp8 headers (issue 23) --------------------------------------------------------------------------------------

TEST(TransformerLoaderDamage, Fp8HeaderWhoseByteLengthIsNotOneBytePerElementNamesTheTensor) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  // proj_out.bias: 64 float32 = 256 bytes; as F8_E4M3 the header now claims 64 one-byte codes in 256 bytes.
  edit_header(dir + "/diffusion_pytorch_model.safetensors", [](auto& h) { h["proj_out.bias"]["dtype"] = "F8_E4M3"; });
  EXPECT_HAS(load_error(dir), "tensor 'proj_out.bias': byte length 256 does not match shape x F8_E4M3 = 64");
}

TEST(TransformerLoaderDamage, Fp8HeaderPastTheDataAreaAndUnknownFp8VariantsAreNamed) {
  const std::string dir = copy_of("t1_tiny_df_fps", "diffusers");
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  edit_header(file, [](auto& h) {
    h["proj_out.bias"]["dtype"] = "F8_E5M2";
    h["proj_out.bias"]["data_offsets"][1] = h["proj_out.bias"]["data_offsets"][0].template get<uint64_t>() + 64;
  });
  EXPECT_EQ(load_error(dir), "");  // a consistent F8_E5M2 header loads (its first 64 bytes are codes now)
  edit_header(file, [](auto& h) {
    h["proj_out.bias"]["shape"] = {1u << 20};
    h["proj_out.bias"]["data_offsets"][1] = h["proj_out.bias"]["data_offsets"][0].template get<uint64_t>() + (1u << 20);
  });
  EXPECT_HAS(load_error(dir), "tensor 'proj_out.bias': data_offsets end");
  EXPECT_HAS(load_error(dir), "is past the data area");
  edit_header(file, [](auto& h) { h["proj_out.bias"]["dtype"] = "F8_E4M3FNUZ"; });
  EXPECT_HAS(load_error(dir), "tensor 'proj_out.bias': unknown dtype 'F8_E4M3FNUZ'");
}

TEST(TransformerLoaderDamage, Fp8TensorWithAShapeThatDoesNotMatchTheModelIsNamed) {
  const std::string dst = temp_dir("fp8") + "/out";
  convert_transformer_checkpoint(weights("t1_tiny_df_fps", "original"), dst, {"float8_e4m3fn", 5'000'000'000ull});
  edit_header(dst + "/diffusion_pytorch_model.safetensors",
              [](auto& h) { h["blocks.0.attn1.to_q.weight"]["shape"] = {12, 48}; });
  EXPECT_HAS(load_error(dst), "blocks.0.attn1.to_q.weight: checkpoint [12, 48] vs model [24, 24]");
}
