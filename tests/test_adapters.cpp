// Adapters per call (issue 33): the LoRA fixtures of tests/data/lora applied unmerged in the forward give the model of
// diffusers' merge within 1e-4 and our merged forward within 1e-5, never touch the weights, and come and go between
// calls without a trace; the catalogue of a --lora-dir reads headers and digests only and lists what does not fit;
// the bank per device keeps a bounded set, least recently used first out, and computes with the file a job was
// accepted with or fails it; files added or replaced while serving are seen without a restart;
// `skyreels forward --lora-dir D --adapter NAME:SCALE` computes what `--lora D/NAME.safetensors:SCALE` computes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "model/adapter_bank.h"
#include "model/lora.h"
#include "model/safetensors.h"
#include "model/sha256.h"
#include "model/utf8_text.h"
#include "model/transformer_loader.h"
#include "tests/pipeline_case.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
namespace st = skyreels::safetensors;
using namespace skyreels::model;
using skyreels::test::data_path;
using skyreels::test::error_of;
using skyreels::test::golden_path;
using skyreels::test::max_abs_diff;
using skyreels::test::temp_dir;

namespace {

const std::string kT1 = "transformer_forward/t1_tiny_df_fps";
const std::vector<std::string> kFixtures = {"diffusers_format", "original_format", "musubi_format"};

std::string base_dir() { return golden_path(kT1 + "/weights/diffusers"); }
std::string fixture(const std::string& name) { return data_path("lora/" + name + ".safetensors"); }
std::map<std::string, at::Tensor> expected(const std::string& name) {
  return skyreels::test::load_tensors(data_path("lora/expected_" + name + ".safetensors"));
}

LoadedTransformer load_with(const std::vector<LoraSpec>& loras, const std::string& dtype = "float32",
                            const std::string& path = base_dir()) {
  TransformerLoadOptions options{"cpu", dtype};
  options.loras = loras;
  return load_transformer(path, options);
}

at::Tensor forward(const SkyReelsV2Transformer& model, const std::vector<ActiveAdapter>& adapters = {}) {
  const auto inputs = skyreels::test::load_tensors(golden_path(kT1 + "/inputs.safetensors"));
  TransformerForwardArgs args;
  args.hidden_states = inputs.at("hidden_states");
  args.timestep = inputs.at("timestep");
  args.encoder_hidden_states = inputs.at("encoder_hidden_states");
  args.fps = inputs.at("fps");
  args.adapters = adapters;
  return model.forward(args).to(at::kFloat);
}

// The base checkpoint with `merged` (Python's merge, tests/data/lora/make_lora_cases.py) written over it.
std::string merged_checkpoint(const std::map<std::string, at::Tensor>& merged) {
  const std::string dir = temp_dir("merged");
  auto tensors = skyreels::test::load_tensors(base_dir() + "/diffusion_pytorch_model.safetensors");
  for (const auto& [name, t] : merged) tensors[name] = t;
  st::save(dir + "/diffusion_pytorch_model.safetensors", {tensors.begin(), tensors.end()});
  fs::copy(base_dir() + "/config.json", dir + "/config.json");
  return dir;
}

// A --lora-dir holding copies of the fixtures `names`.
std::string lora_dir(const std::vector<std::string>& names = kFixtures) {
  const std::string dir = temp_dir("lora-dir");
  for (const auto& name : names) fs::copy(fixture(name), dir + "/" + name + ".safetensors");
  return dir;
}

std::shared_ptr<const AdapterCatalogue> catalogue_of(const std::string& dir, const LoadedTransformer& loaded,
                                                     AdapterCatalogueOptions options = {}) {
  return std::make_shared<const AdapterCatalogue>(dir, loaded.model->config(), options);
}

AdapterBank bank_for(const std::string& dir, const LoadedTransformer& loaded, size_t max_resident = 4) {
  return AdapterBank(catalogue_of(dir, loaded), loaded.model->device(), loaded.model->compute_dtype(), max_resident);
}

// Every parameter and buffer of the model, copied (for bit-identity after forwards).
std::map<std::string, at::Tensor> snapshot(const SkyReelsV2Transformer& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : model.named_tensors()) out[name] = t.clone();
  return out;
}

void expect_unchanged(const SkyReelsV2Transformer& model, const std::map<std::string, at::Tensor>& before) {
  for (const auto& [name, t] : model.named_tensors()) EXPECT_TRUE(at::equal(t, before.at(name))) << name;
}

// A small adapter of one linear layer (blocks.0.attn1.to_q of the tiny model, 24 x 24) in diffusers keys.
void write_tiny_adapter(const std::string& path, int64_t rank = 1, int64_t out = 24) {
  st::save(path, {{"transformer.blocks.0.attn1.to_q.lora_A.weight", at::randn({rank, 24})},
                  {"transformer.blocks.0.attn1.to_q.lora_B.weight", at::randn({out, rank})}});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file of `header` text (its 8-byte length first) and no data.
std::string with_header(const std::string& header) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes + header;
}

AdapterInfo info_of(const AdapterCatalogue& catalogue, const std::string& name) {
  const std::optional<AdapterInfo> info = catalogue.find(name);
  if (!info) throw std::runtime_error("no adapter '" + name + "' in the catalogue");
  return *info;
}

}  // namespace

// ---- SHA-256 -------------------------------------------------------------------------------------------------------

TEST(Sha256, GivesTheFipsDigestsWhateverThePiecesItIsFedIn) {
  auto digest = [](const std::string& text, size_t piece) {
    Sha256 h;
    for (size_t i = 0; i < text.size(); i += piece) h.update(text.data() + i, std::min(piece, text.size() - i));
    return h.hex();
  };
  EXPECT_EQ(digest("", 1), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(digest("abc", 1), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks =
      "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 448 bits: padding spills
  for (size_t piece : {1, 7, 64, 1000}) {
    EXPECT_EQ(digest(two_blocks, piece), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1") << piece;
  }
  const std::string million(1'000'000, 'a');
  EXPECT_EQ(digest(million, 4096), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  const std::string path = temp_dir("sha") + "/a";
  write_bytes(path, million);
  EXPECT_EQ(sha256_file(path), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// ---- the unmerged branch -------------------------------------------------------------------------------------------

TEST(AdaptersPerCall, EachFixtureUnmergedGivesTheMergedModelsForwardAndLeavesTheWeights) {
  const auto base = load_with({});
  const auto before = snapshot(*base.model);
  AdapterBank bank = bank_for(lora_dir(), base);
  struct Case {
    std::string expected;
    std::vector<AdapterRequest> adapters;
  };
  const std::vector<Case> cases = {{"diffusers_format", {{"diffusers_format", 1.0}}},
                                   {"original_format", {{"original_format", 1.0}}},
                                   {"musubi_format", {{"musubi_format", 1.0}}},
                                   {"stack", {{"original_format", 0.7}, {"musubi_format", -0.5}}}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.expected);
    std::vector<LoraSpec> merged_specs;
    for (const auto& a : c.adapters) merged_specs.push_back({fixture(a.name), a.scale});
    const at::Tensor unmerged = forward(*base.model, bank.activate(c.adapters));
    const at::Tensor of_python_merge = forward(*load_transformer(merged_checkpoint(expected(c.expected))).model);
    const at::Tensor of_our_merge = forward(*load_with(merged_specs).model);
    EXPECT_TRUE(skyreels::test::all_close(unmerged, of_python_merge, 1e-4));
    EXPECT_TRUE(skyreels::test::all_close(unmerged, of_our_merge, 1e-5));
    EXPECT_FALSE(at::equal(unmerged, forward(*base.model)));  // the adapter does change the output
    std::cout << "[ fp32 ] " << c.expected << ": max |unmerged - merged| = " << max_abs_diff(unmerged, of_our_merge)
              << ", max |unmerged - diffusers' merge| = " << max_abs_diff(unmerged, of_python_merge) << "\n";
  }
  expect_unchanged(*base.model, before);
}

TEST(AdaptersPerCall, OnThenOffThenOnGivesBitIdenticalOutputsEachTime) {
  const auto base = load_with({});
  AdapterBank bank = bank_for(lora_dir(), base);
  const auto adapters = bank.activate({{"original_format", 0.7}, {"musubi_format", -0.5}});
  const at::Tensor plain = forward(*base.model);
  const at::Tensor on = forward(*base.model, adapters);
  const at::Tensor off = forward(*base.model);
  const at::Tensor on_again = forward(*base.model, adapters);
  const at::Tensor other = forward(*base.model, bank.activate({{"diffusers_format", 1.0}}));  // another chunk's
  EXPECT_TRUE(at::equal(plain, off));
  EXPECT_TRUE(at::equal(on, on_again));
  EXPECT_TRUE(at::equal(on, forward(*base.model, adapters)));  // after another adapter set, the same again
  EXPECT_FALSE(at::equal(on, plain));
  EXPECT_FALSE(at::equal(other, on));
  // the no-adapter path is the one of a model that never saw an adapter
  EXPECT_TRUE(at::equal(plain, forward(*load_with({}).model)));
}

// bf16: the adapter's tensors are bf16 too, so A x and B (A x) round where the merge rounds W + B A once. Measured on
// the tiny model with the stacked fixtures (max |output| 3.7): max |unmerged - merged| 0.055; against the fp32
// merged forward, unmerged 0.053 and merged 0.049: the unmerged branch adds little beyond bf16's own error.
TEST(AdaptersPerCall, Bf16UnmergedIsAsCloseToFloat32AsTheBf16Merge) {
  const auto base = load_with({}, "bfloat16");
  AdapterBank bank = bank_for(lora_dir(), base);
  const auto before = snapshot(*base.model);
  const std::vector<AdapterRequest> stack = {{"original_format", 0.7}, {"musubi_format", -0.5}};
  const at::Tensor unmerged = forward(*base.model, bank.activate(stack));
  const at::Tensor merged =
      forward(*load_with({{fixture("original_format"), 0.7}, {fixture("musubi_format"), -0.5}}, "bfloat16").model);
  const at::Tensor reference =
      forward(*load_with({{fixture("original_format"), 0.7}, {fixture("musubi_format"), -0.5}}).model);
  const double unmerged_error = max_abs_diff(unmerged, reference), merged_error = max_abs_diff(merged, reference);
  std::cout << "[ bf16 ] max |unmerged - merged| = " << max_abs_diff(unmerged, merged) << "; against fp32: unmerged "
            << unmerged_error << ", merged " << merged_error << " (max |fp32 output| "
            << reference.abs().max().item<double>() << ")\n";
  EXPECT_TRUE(skyreels::test::all_close(unmerged, merged, 5e-2, 5e-2));
  EXPECT_LE(unmerged_error, 2 * merged_error + 1e-2);
  expect_unchanged(*base.model, before);
  for (const auto& [name, u] : bank.acquire("original_format")->updates) {
    for (const at::Tensor* t : {&u.down, &u.up, &u.delta}) {
      if (t->defined()) {
        EXPECT_EQ(t->scalar_type(), at::kBFloat16) << name;
      }
    }
  }
}

TEST(AdaptersPerCall, AnAdapterThatDoesNotFitTheCallIsRefusedNamingItsKey) {
  const auto base = load_with({}, "bfloat16");
  auto unplaced = std::make_shared<const LoraAdapter>(read_lora({fixture("musubi_format"), 1.0}));  // float32
  EXPECT_HAS(error_of([&] {
               forward(*base.model, {{unplaced, 1.0}});
             }),
             "key 'lora_unet_blocks_0_self_attn_k.lora_down.weight': is Float on cpu, "
             "'blocks.0.attn1.to_k.weight' is BFloat16 on cpu (place_lora places an adapter for a model)");
  const auto f32 = load_with({});
  EXPECT_HAS(error_of([&] { forward(*f32.model, {{unplaced, NAN}}); }), "scale must be a finite number");
  LoraAdapter norm;  // a bias delta of a LayerNorm: --lora merges it, a call cannot add it to a linear's output
  norm.spec.path = "norm.safetensors";
  norm.updates["blocks.0.norm2.bias"] = {"transformer.blocks.0.norm2.lora_B.bias", {}, {}, at::zeros({24}), 1.0};
  EXPECT_HAS(error_of([&] {
               forward(*f32.model, {{std::make_shared<const LoraAdapter>(norm), 1.0}});
             }),
             "adapter 'norm.safetensors': key 'transformer.blocks.0.norm2.lora_B.bias': targets "
             "'blocks.0.norm2.bias', which is not a linear layer's weight or bias");
}

TEST(AdaptersPerCall, TheLinearLayersAdaptersReachAreEveryLinearButThePatchEmbedding) {
  const auto modules = transformer_linear_modules(load_with({}).model->config());
  EXPECT_EQ(modules.size(), 6u + 2u + 2u * 10u);  // time x3, text x2, proj_out; fps x2; 10 per block
  EXPECT_NE(std::find(modules.begin(), modules.end(), "blocks.1.ffn.net.2"), modules.end());
  EXPECT_EQ(std::find(modules.begin(), modules.end(), "patch_embedding"), modules.end());
}

// A whole diffusion-forcing generation (the pipeline_df/p1_sync_short model, seeded noise) with adapters per call in
// GenerationParams: every transformer call of the loop applies them, so it ends where the merged model ends.
TEST(AdaptersPerCall, AGenerationWithAdaptersInItsParamsEndsWhereTheMergedModelEnds) {
  const skyreels::test::PipelineCase c =
      skyreels::test::load_pipeline_case("p1_sync_short", golden_path("pipeline_df/p1_sync_short"));
  const std::string weights = c.base_dir + "/weights/diffusers";
  const auto base = load_transformer(weights);
  const std::string dir = temp_dir("lora-dir");
  at::manual_seed(5);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& module : transformer_linear_modules(base.model->config())) {  // every linear layer
    const auto w = base.model->named_tensors();
    const auto it = std::find_if(w.begin(), w.end(), [&](const auto& p) { return p.first == module + ".weight"; });
    tensors.emplace_back("transformer." + module + ".lora_A.weight", 0.3 * at::randn({2, it->second.size(1)}));
    tensors.emplace_back("transformer." + module + ".lora_B.weight", 0.3 * at::randn({it->second.size(0), 2}));
  }
  st::save(dir + "/every_linear.safetensors", tensors);
  AdapterBank bank = bank_for(dir, base);

  GenerationParams with = c.params;
  with.adapters = bank.activate({{"every_linear", 0.5}});
  const at::Tensor unmerged = generate(*base.model, with, c.conditioning, *make_seeded_noise(1));
  const at::Tensor merged = generate(*load_with({{dir + "/every_linear.safetensors", 0.5}}, "float32", weights).model,
                                     c.params, c.conditioning, *make_seeded_noise(1));
  const at::Tensor plain = generate(*base.model, c.params, c.conditioning, *make_seeded_noise(1));
  std::cout << "[ fp32 ] generation: max |unmerged - merged| = " << max_abs_diff(unmerged, merged)
            << ", max |adapted - plain| = " << max_abs_diff(unmerged, plain) << "\n";
  EXPECT_TRUE(skyreels::test::all_close(unmerged, merged, 1e-4));
  EXPECT_FALSE(skyreels::test::all_close(unmerged, plain, 1e-2));
}

// ---- the catalogue -------------------------------------------------------------------------------------------------

TEST(AdapterCatalogue, ListsEveryFileWithItsDigestFormatRankAndParameters) {
  const auto base = load_with({});
  const std::string dir = lora_dir();
  write_bytes(dir + "/notes.txt", "not an adapter");
  const auto catalogue = catalogue_of(dir, base);
  ASSERT_EQ(catalogue->adapters().size(), 3u);
  EXPECT_EQ(catalogue->adapters()[0].name, "diffusers_format");  // sorted by name
  for (const auto& [name, format] : std::map<std::string, std::string>{
           {"diffusers_format", "diffusers"}, {"original_format", "original"}, {"musubi_format", "musubi"}}) {
    const AdapterInfo info = info_of(*catalogue, name);
    EXPECT_TRUE(info.available) << info.reason;
    EXPECT_EQ(info.sha256, sha256_file(fixture(name)));
    EXPECT_EQ(info.format, format);
    EXPECT_EQ(info.rank, 4);
    EXPECT_EQ(info.parameters, static_cast<int64_t>(expected(name).size()));
    EXPECT_EQ(info.bytes, fs::file_size(fixture(name)));
  }
  EXPECT_FALSE(catalogue->find("notes").has_value());
}

TEST(AdapterCatalogue, DamagedFilesAreListedUnavailableWithTheReasonAndRefusedUnderStrict) {
  const auto base = load_with({});
  const std::string dir = lora_dir({"musubi_format"});
  write_bytes(dir + "/truncated.safetensors",
              with_header(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets")").substr(0, 20));
  write_bytes(dir + "/garbage.safetensors", with_header("{this is not json"));
  const auto catalogue = catalogue_of(dir, base);
  EXPECT_TRUE(info_of(*catalogue, "musubi_format").available);
  const AdapterInfo truncated = info_of(*catalogue, "truncated");
  EXPECT_FALSE(truncated.available);
  EXPECT_HAS(truncated.reason, "truncated.safetensors': header length");
  EXPECT_HAS(truncated.reason, "is past the end of the file");
  const AdapterInfo garbage = info_of(*catalogue, "garbage");
  EXPECT_FALSE(garbage.available);
  EXPECT_HAS(garbage.reason, "garbage.safetensors'");
  EXPECT_EQ(garbage.sha256, "") << "a refused header is not hashed (issue 46: the header is read first)";
  EXPECT_HAS(error_of([&] {
               catalogue->resolve({{"garbage", 1.0}});
             }),
             "adapters[0].name: adapter 'garbage' is unavailable: ");
  const std::string strict = error_of([&] { catalogue_of(dir, base, {true}); });
  EXPECT_HAS(strict, "adapter 'garbage' is unavailable: ");  // the first by name
}

// Issue 46: names and reasons are valid UTF-8 (they reach proto3 strings, JSON and logs). A file whose name is not
// is listed under its escaped name, unavailable; a header quoting bytes that are not UTF-8 gives an escaped reason.
TEST(AdapterCatalogue, ANonUtf8FileNameOrHeaderIsListedUnavailableWithItsTextEscaped) {
  const auto base = load_with({});
  const std::string dir = lora_dir({"musubi_format"});
  fs::copy(fixture("diffusers_format"), dir + "/bad\xff.safetensors");  // fits, but no request can name it
  fs::copy(fixture("diffusers_format"), dir + "/bad\\xff.safetensors");  // the escaped spelling, literally
  write_bytes(dir + "/garbled.safetensors", with_header("{\"transformer.blocks.0.\xff\xfe\xc0\xaf\": 1}"));
  const auto catalogue = catalogue_of(dir, base);
  ASSERT_EQ(catalogue->adapters().size(), 4u);
  for (const AdapterInfo& a : catalogue->adapters()) {
    EXPECT_TRUE(is_valid_utf8(a.name)) << a.name;
    EXPECT_TRUE(is_valid_utf8(a.reason)) << a.reason;
  }
  EXPECT_TRUE(info_of(*catalogue, "musubi_format").available);
  // Two entries named bad\xff: the file spelled so is available and is the one a request finds.
  const AdapterInfo literal = info_of(*catalogue, "bad\\xff");
  EXPECT_TRUE(literal.available) << literal.reason;
  EXPECT_EQ(catalogue->resolve({{"bad\\xff", 1.0}}).at(0).sha256, literal.sha256);
  const std::vector<AdapterInfo> all = catalogue->adapters();
  const auto escaped = std::find_if(all.begin(), all.end(),
                                    [](const AdapterInfo& a) { return a.name == "bad\\xff" && !a.available; });
  ASSERT_NE(escaped, all.end());
  EXPECT_HAS(escaped->reason, "file name 'bad\\xff.safetensors' is not valid UTF-8");
  EXPECT_EQ(escaped->path, dir + "/bad\xff.safetensors") << "the path stays the file's own bytes";
  const AdapterInfo garbled = info_of(*catalogue, "garbled");
  EXPECT_FALSE(garbled.available);
  EXPECT_HAS(garbled.reason, "last read: '\"transformer.blocks.0.\\xff'");  // nlohmann quotes the byte
  EXPECT_HAS(error_of([&] { catalogue->resolve({{"garbled", 1.0}}); }), "blocks.0.\\xff");
  EXPECT_HAS(error_of([&] { catalogue_of(dir, base, {true}); }), "adapter 'bad\\xff' is unavailable: file name");
}

// Issue 46: the header is read and checked before the file is hashed, so a large file that is not an adapter (a
// renamed .bin, a truncated download) is refused after reading a few bytes. Before, the whole file was hashed first:
// a 2 GiB sparse file held the catalogue for seconds (12-17 s on a loaded machine), a 100 GiB one for minutes.
TEST(AdapterCatalogue, ALargeFileThatIsNotAnAdapterIsRefusedWithoutHashingIt) {
  const auto base = load_with({});
  const std::string dir = lora_dir({"musubi_format"});
  const std::string junk = dir + "/junk.safetensors";
  write_bytes(junk, "\xff\xff\xff\xff\xff\xff\xff\x7f");  // a header length no file has
  fs::resize_file(junk, 2ull << 30);                      // 2 GiB, sparse: no disk used
  const std::string small = dir + "/small_json.safetensors";
  write_bytes(small, with_header("[1, 2, 3]"));           // a valid length, JSON that is no header
  fs::resize_file(small, 2ull << 30);
  const auto start = std::chrono::steady_clock::now();
  const auto catalogue = catalogue_of(dir, base);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0) << "the catalogue read the whole junk files";
  EXPECT_TRUE(info_of(*catalogue, "musubi_format").available);
  for (const char* name : {"junk", "small_json"}) {
    EXPECT_FALSE(info_of(*catalogue, name).available);
    EXPECT_EQ(info_of(*catalogue, name).sha256, "");
    EXPECT_EQ(info_of(*catalogue, name).bytes, 2ull << 30);
  }
  EXPECT_HAS(info_of(*catalogue, "junk").reason, "junk.safetensors'");
}

TEST(AdapterCatalogue, AnAdapterWhoseShapesDoNotFitTheModelNamesTheKeyAndBothShapes) {
  const auto base = load_with({});
  const std::string dir = temp_dir("lora-dir");
  auto tensors = st::load_all(fixture("diffusers_format"));
  tensors["transformer.blocks.0.attn1.to_q.lora_B.weight"] = at::randn({30, 4});
  st::save(dir + "/wide.safetensors", {tensors.begin(), tensors.end()});
  write_tiny_adapter(dir + "/nine_blocks.safetensors");
  st::save(dir + "/nine_blocks.safetensors", {{"transformer.blocks.8.attn1.to_q.lora_A.weight", at::randn({1, 24})},
                                              {"transformer.blocks.8.attn1.to_q.lora_B.weight", at::randn({24, 1})}});
  const auto catalogue = catalogue_of(dir, base);
  const AdapterInfo wide = info_of(*catalogue, "wide");
  EXPECT_FALSE(wide.available);
  EXPECT_HAS(wide.reason,
             "key 'transformer.blocks.0.attn1.to_q.lora_A.weight': implies [30, 24] for "
             "'blocks.0.attn1.to_q.weight', which is [24, 24] in this model");
  EXPECT_HAS(info_of(*catalogue, "nine_blocks").reason,
             "targets 'blocks.8.attn1.to_q.weight', which this model does not have");
}

// The catalogue never reads a tensor: an adapter whose values are NaN is listed available (its header is fine) and
// refused when a bank first reads it.
TEST(AdapterCatalogue, ReadsHeadersOnlyAValueProblemShowsAtTheFirstAcquire) {
  const auto base = load_with({});
  const std::string dir = temp_dir("lora-dir");
  st::save(dir + "/nan.safetensors", {{"transformer.proj_out.lora_A.weight", at::full({1, 24}, NAN)},
                                      {"transformer.proj_out.lora_B.weight", at::ones({64, 1})}});
  AdapterBank bank = bank_for(dir, base);
  EXPECT_TRUE(info_of(bank.catalogue(), "nan").available);
  EXPECT_HAS(error_of([&] { bank.acquire("nan"); }), "key 'transformer.proj_out.lora_A.weight': contains NaN");
  EXPECT_TRUE(bank.resident().empty());
}

TEST(AdapterCatalogue, AThousandSmallFilesAreCataloguedWithoutLoadingAny) {
  const auto base = load_with({});
  const std::string dir = temp_dir("lora-dir");
  for (int i = 0; i < 1000; ++i) write_tiny_adapter(dir + "/a" + std::to_string(1000 + i) + ".safetensors");
  AdapterBank bank = bank_for(dir, base);
  EXPECT_EQ(bank.catalogue().adapters().size(), 1000u);
  const std::vector<AdapterInfo> all = bank.catalogue().adapters();
  EXPECT_TRUE(std::all_of(all.begin(), all.end(),
                          [](const AdapterInfo& a) { return a.available && a.sha256.size() == 64; }));
  EXPECT_TRUE(bank.resident().empty());
  EXPECT_EQ(bank.loads(), 0);
}

TEST(AdapterCatalogue, ResolveRefusesWhatARequestMustNotAskNamingTheField) {
  const auto catalogue = catalogue_of(lora_dir(), load_with({}));
  const auto ok = catalogue->resolve({{"musubi_format", -0.5}, {"original_format", 100.0}});
  ASSERT_EQ(ok.size(), 2u);
  EXPECT_EQ(ok[0].sha256, sha256_file(fixture("musubi_format")));
  EXPECT_HAS(error_of([&] {
               catalogue->resolve({{"musubi_format", 1.0}, {"styel", 1.0}});
             }),
             "adapters[1].name: unknown adapter 'styel'");
  EXPECT_HAS(error_of([&] {
               catalogue->resolve({{"musubi_format", NAN}});
             }),
             "adapters[0].scale: adapter 'musubi_format' has scale nan; it must be a finite number within +-100");
  EXPECT_HAS(error_of([&] { catalogue->resolve({{"musubi_format", INFINITY}}); }), "adapters[0].scale");
  EXPECT_HAS(error_of([&] { catalogue->resolve({{"musubi_format", -100.5}}); }), "has scale -100.5");
  EXPECT_HAS(error_of([&] {
               catalogue->resolve(std::vector<AdapterRequest>(9, {"musubi_format", 1.0}));
             }),
             "adapters: 9 given, at most 8 per request");
  EXPECT_HAS(error_of([&] {
               catalogue->resolve({{"musubi_format", 1.0}, {"diffusers_format", 1.0}, {"musubi_format", 2.0}});
             }),
             "adapters[2].name: adapter 'musubi_format' is given twice (also adapters[0])");
  EXPECT_HAS(error_of([&] { AdapterCatalogue("/nonexistent-dir", load_with({}).model->config()); }),
             "--lora-dir '/nonexistent-dir': not a directory");
}

TEST(AdapterCatalogue, ParsesNameAndScale) {
  EXPECT_EQ(parse_adapter_request("style").name, "style");
  EXPECT_EQ(parse_adapter_request("style").scale, 1.0);
  EXPECT_EQ(parse_adapter_request("style:-0.25").scale, -0.25);
  EXPECT_EQ(parse_adapter_request("style:-0.25").name, "style");
  EXPECT_HAS(error_of([] { parse_adapter_request("style:strong"); }), "'strong' is not a scale");
  EXPECT_HAS(error_of([] { parse_adapter_request(":1"); }), "no name");
}

// ---- the bank ------------------------------------------------------------------------------------------------------

TEST(AdapterBank, KeepsAtMostMaxResidentAndTheLeastRecentlyUsedLeavesFirst) {
  const auto base = load_with({});
  AdapterBank bank = bank_for(lora_dir(), base, 2);
  const auto d = bank.acquire("diffusers_format");
  bank.acquire("original_format");
  EXPECT_EQ(bank.resident(), (std::vector<std::string>{"original_format", "diffusers_format"}));
  EXPECT_EQ(bank.acquire("diffusers_format"), d);  // resident: the same tensors, no load
  EXPECT_EQ(bank.loads(), 2);
  bank.acquire("musubi_format");  // original_format is now the least recently used
  EXPECT_EQ(bank.resident(), (std::vector<std::string>{"musubi_format", "diffusers_format"}));
  EXPECT_EQ(bank.loads(), 3);
  bank.acquire("original_format");
  EXPECT_EQ(bank.resident(), (std::vector<std::string>{"original_format", "musubi_format"}));
  EXPECT_EQ(bank.loads(), 4);
  // A call that still holds an adapter the bank let go computes on with it.
  EXPECT_FALSE(at::equal(forward(*base.model, {{d, 1.0}}), forward(*base.model)));
  EXPECT_HAS(error_of([&] { bank_for(lora_dir(), base, 0); }), "max_resident: must be at least 1");
  EXPECT_HAS(error_of([&] { bank.acquire("nope"); }), "adapter 'nope': unknown");
}

// What a job was accepted with is what it computes with: the file replaced after the catalogue hashed it fails that
// job naming the adapter (never another file's weights), and the next request takes the new file by its new digest.
TEST(AdapterBank, AFileReplacedAfterAJobWasAcceptedFailsThatJobByNameAndTheNextRequestTakesTheNewFile) {
  const auto base = load_with({});
  const std::string dir = lora_dir({"musubi_format", "original_format"});
  AdapterBank bank = bank_for(dir, base);
  const std::string accepted = bank.catalogue().resolve({{"musubi_format", 1.0}}).at(0).sha256;
  EXPECT_EQ(accepted, sha256_file(fixture("musubi_format")));
  fs::copy(fixture("diffusers_format"), dir + "/musubi_format.safetensors", fs::copy_options::overwrite_existing);
  const std::string error = error_of([&] { bank.acquire("musubi_format", accepted); });
  EXPECT_HAS(error, "adapter 'musubi_format' is not the file this job was accepted with (sha256 " + accepted + ")");
  EXPECT_HAS(error, sha256_file(fixture("diffusers_format")));
  EXPECT_TRUE(bank.resident().empty());
  EXPECT_EQ(bank.loads(), 0);
  const std::string now = bank.catalogue().resolve({{"musubi_format", 1.0}}).at(0).sha256;
  EXPECT_EQ(now, sha256_file(fixture("diffusers_format"))) << "a new request gets the new file's digest";
  const auto adapter = bank.acquire("musubi_format", now);
  EXPECT_EQ(bank.loads(), 1);
  EXPECT_EQ(bank.activate({{"musubi_format", 1.0}}).at(0).adapter, adapter) << "resident under its new digest";
  bank.acquire("original_format");  // the others still load
  EXPECT_EQ(bank.loads(), 2);
}

// Operators add, replace and remove adapters while serving: the first request that names a new file finds it, one
// whose file is gone is refused as unknown, and a rescan (SIGHUP) lists what changed without reading unchanged files.
TEST(AdapterCatalogue, FilesAddedChangedOrRemovedWhileServingAreSeenWithoutARestart) {
  const auto base = load_with({});
  const std::string dir = lora_dir({"musubi_format"});
  const auto catalogue = catalogue_of(dir, base);
  EXPECT_FALSE(catalogue->find("original_format").has_value());
  fs::copy(fixture("original_format"), dir + "/original_format.safetensors");
  const auto added = catalogue->resolve({{"original_format", 0.5}});
  EXPECT_EQ(added.at(0).sha256, sha256_file(fixture("original_format")));
  EXPECT_TRUE(info_of(*catalogue, "original_format").available) << "listed once a request found it";
  fs::remove(dir + "/original_format.safetensors");
  EXPECT_HAS(error_of([&] { catalogue->resolve({{"original_format", 1.0}}); }),
             "adapters[0].name: unknown adapter 'original_format'");
  EXPECT_FALSE(catalogue->find("original_format").has_value());
  EXPECT_HAS(error_of([&] { catalogue->resolve({{"../lora-dir/musubi_format", 1.0}}); }), "unknown adapter");

  fs::copy(fixture("diffusers_format"), dir + "/diffusers_format.safetensors");
  fs::copy(fixture("diffusers_format"), dir + "/musubi_format.safetensors", fs::copy_options::overwrite_existing);
  const CatalogueChanges changes = catalogue->rescan();
  EXPECT_EQ(changes.added, 1);
  EXPECT_EQ(changes.changed, 1);
  EXPECT_EQ(changes.removed, 0);
  EXPECT_EQ(info_of(*catalogue, "musubi_format").sha256, sha256_file(fixture("diffusers_format")));
  fs::remove(dir + "/diffusers_format.safetensors");
  const CatalogueChanges again = catalogue->rescan();
  EXPECT_EQ(again.added + again.changed, 0) << "unchanged files are not read again";
  EXPECT_EQ(again.removed, 1);
  EXPECT_EQ(catalogue->adapters().size(), 1u);
}

// The bytes hashed are the bytes used: a resident adapter is memory of its own, so a file rewritten in place (same
// size, other values) or truncated under it changes nothing it computes and faults nothing. (With the file's mapping
// a float32 adapter on CPU viewed the file: the rewrite showed through, the truncation raised SIGBUS.)
TEST(AdapterBank, AResidentAdapterIsItsOwnMemoryAFileRewrittenInPlaceOrTruncatedChangesNothing) {
  const auto base = load_with({});
  const std::string dir = lora_dir({"musubi_format"});
  AdapterBank bank = bank_for(dir, base);
  const std::vector<ActiveAdapter> active = bank.activate({{"musubi_format", 1.0}});
  const at::Tensor before = forward(*base.model, active);
  const std::string path = dir + "/musubi_format.safetensors";
  const auto size = static_cast<std::streamoff>(fs::file_size(path));
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);  // in place: no truncation, no rename
    file.seekp(size - 4096);
    const std::string noise(4096, '\x7f');
    file.write(noise.data(), static_cast<std::streamsize>(noise.size()));
  }
  EXPECT_TRUE(at::equal(forward(*base.model, active), before)) << "the rewrite showed through";
  fs::resize_file(path, 16);
  EXPECT_TRUE(at::equal(forward(*base.model, active), before));
  const std::string accepted = sha256_file(fixture("musubi_format"));  // what a job accepted earlier names
  EXPECT_TRUE(at::equal(forward(*base.model, {{bank.acquire("musubi_format", accepted), 1.0}}), before))
      << "resident: not read again";
  EXPECT_EQ(bank.loads(), 1);
  EXPECT_HAS(error_of([&] { bank.activate({{"musubi_format", 1.0}}); }), "is unavailable");  // a new job: refused
}

// The same for the model's own weights: a float32 checkpoint on CPU is copied out of its mapping at load.
TEST(LoadedWeights, ACheckpointRewrittenInPlaceAfterTheLoadChangesNoWeight) {
  const std::string dir = temp_dir("rewritten-model");
  fs::copy(base_dir() + "/config.json", dir + "/config.json");
  fs::copy(base_dir() + "/diffusion_pytorch_model.safetensors", dir + "/diffusion_pytorch_model.safetensors");
  const auto loaded = load_with({}, "float32", dir);
  const at::Tensor before = forward(*loaded.model);
  const std::string path = dir + "/diffusion_pytorch_model.safetensors";
  const auto size = static_cast<std::streamoff>(fs::file_size(path));
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    const std::string noise(static_cast<size_t>(size / 2), '\x7f');
    file.seekp(size - static_cast<std::streamoff>(noise.size()));
    file.write(noise.data(), static_cast<std::streamsize>(noise.size()));
  }
  EXPECT_TRUE(at::equal(forward(*loaded.model), before)) << "a weight viewed the file";
  fs::resize_file(path, 16);
  EXPECT_TRUE(at::equal(forward(*loaded.model), before));
}

// ---- the CLI -------------------------------------------------------------------------------------------------------

TEST(AdaptersCli, ForwardWithAnAdapterOfTheDirectoryWritesWhatMergingItWrites) {
  const std::string bin = skyreels::test::bin_path("skyreels");
  ASSERT_TRUE(fs::exists(bin)) << bin << " is not built";
  const std::string dir = lora_dir(), out = temp_dir("forward");
  const std::string common =
      bin + " forward --model " + base_dir() + " --inputs " + golden_path(kT1 + "/inputs.safetensors");
  std::string log;
  ASSERT_EQ(skyreels::test::run_command(common + " --out " + out + "/unmerged.safetensors --lora-dir " + dir +
                                            " --adapter original_format:0.7 --adapter musubi_format:-0.5",
                                        &log),
            0)
      << log;
  ASSERT_EQ(skyreels::test::run_command(common + " --out " + out + "/merged.safetensors --lora " + dir +
                                            "/original_format.safetensors:0.7 --lora " + dir +
                                            "/musubi_format.safetensors:-0.5",
                                        &log),
            0)
      << log;
  const at::Tensor unmerged = skyreels::test::load_tensors(out + "/unmerged.safetensors").at("sample");
  const at::Tensor merged = skyreels::test::load_tensors(out + "/merged.safetensors").at("sample");
  EXPECT_TRUE(skyreels::test::all_close(unmerged, merged, 1e-5));

  EXPECT_EQ(skyreels::test::run_command(common + " --out /dev/null --adapter musubi_format", &log), 2) << log;
  EXPECT_HAS(log, "--adapter needs --lora-dir DIR");
  EXPECT_EQ(skyreels::test::run_command(common + " --out /dev/null --lora-dir " + dir + " --adapter styel:0.5", &log),
            2)
      << log;
  EXPECT_HAS(log, "adapters[0].name: unknown adapter 'styel'");
}
