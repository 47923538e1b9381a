// The server's small parts in isolation: replica planning, fault rules, API keys, addresses, result blobs, job
// validation and planning, metrics exposition, the job store's backends.
#include <c10/util/Exception.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "model/utf8_text.h"
#include "server/api/auth.h"
#include "server/job/blob.h"
#include "server/job/limits.h"
#include "server/api/guards.h"
#include "server/store/job_store_sqlite.h"
#include "server/app/host_port.h"
#include "server/metrics/metrics.h"
#include "server/replica/model_job.h"
#include "server/replica/replica.h"
#include "server/api/interceptors.h"
#include "server/api/probes.h"
#include "server/api/service.h"
#include "server/store/sqlite_db.h"
#include "skyreels/v1/video_service.grpc.pb.h"
#include "tests/pg_fixture.h"
#include "tests/test_util.h"
#include "tests/job_requests.h"

namespace skyreels::server {
namespace {

TEST(PlanReplicas, RepeatedCpuReplicasSplitTheCores) {
  const auto replicas = plan_replicas("cpu,cpu", 8, 0);
  ASSERT_EQ(replicas.size(), 2u);
  EXPECT_EQ(replicas[0].name, "cpu:0");
  EXPECT_EQ(replicas[1].name, "cpu:1");
  EXPECT_EQ(replicas[0].device, "cpu");
  EXPECT_EQ(replicas[0].threads, 4);
  EXPECT_EQ(plan_replicas("cpu,cpu,cpu", 2, 0)[2].threads, 1) << "at least one thread each";
}

TEST(PlanReplicas, AutoTakesEveryCudaDeviceElseOneCpuReplica) {
  EXPECT_EQ(plan_replicas("auto", 4, 0).size(), 1u);
  EXPECT_EQ(plan_replicas("auto", 4, 0)[0].threads, 4);
  const auto gpus = plan_replicas("auto", 4, 2);
  ASSERT_EQ(gpus.size(), 2u);
  EXPECT_EQ(gpus[1].name, "cuda:1");
  EXPECT_EQ(gpus[1].device, "cuda:1");
  EXPECT_EQ(gpus[1].threads, 1);
}

TEST(PlanReplicas, RepeatedCudaDevicesGetDistinctNames) {
  const auto replicas = plan_replicas("cuda:0, cuda:0", 4, 1);
  EXPECT_EQ(replicas[0].name, "cuda:0");
  EXPECT_EQ(replicas[1].name, "cuda:0/1");
  EXPECT_EQ(replicas[1].device, "cuda:0");
}

TEST(PlanReplicas, UnknownOrMissingDevicesAreRefusedByName) {
  for (const std::string bad : {"cuda:3", "tpu", "cuda:x", ""}) {
    try {
      plan_replicas(bad, 4, 1);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--devices", 0), 0u) << e.what();
    }
  }
}

TEST(FaultRules, ParseReplicaRunAndRepeat) {
  const auto rules = parse_fault_rules("cpu:1@2, cpu:0@1+");
  ASSERT_EQ(rules.size(), 2u);
  EXPECT_EQ(rules[0].replica, "cpu:1");
  EXPECT_EQ(rules[0].nth, 2);
  EXPECT_FALSE(rules[0].and_later);
  EXPECT_EQ(rules[1].replica, "cpu:0");
  EXPECT_TRUE(rules[1].and_later);
  EXPECT_TRUE(parse_fault_rules("").empty());
  EXPECT_THROW(parse_fault_rules("cpu:1"), std::invalid_argument);
  EXPECT_THROW(parse_fault_rules("cpu:1@0"), std::invalid_argument);
  EXPECT_THROW(parse_fault_rules("cpu:1@two"), std::invalid_argument);
}

TEST(ApiKeys, FileLinesAreKeysWithOptionalClientNamesAndLimits) {
  const std::string path = test::temp_dir("keys") + "/keys";
  const std::string alice(32, 'a'), bob(40, 'b'), carol(32, 'c');
  std::ofstream(path) << "# comment\n\n"
                      << alice << " alice max_priority=2 max_jobs=3 max_streams=4 weight=3\n  " << bob << "  \n"
                      << carol << " max_jobs=5\n";
  const ApiKeys keys = ApiKeys::load(path);
  EXPECT_TRUE(keys.enabled());
  EXPECT_EQ(keys.size(), 3u);
  const auto a = keys.identify(alice);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->name, "alice");
  EXPECT_EQ(a->limits.max_priority, std::optional<int>(2));
  EXPECT_EQ(a->limits.max_jobs, std::optional<int64_t>(3));
  EXPECT_EQ(a->limits.max_streams, std::optional<int64_t>(4));
  EXPECT_EQ(a->limits.weight, std::optional<int>(3));
  const auto b = keys.identify(bob);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->name, "client-4");
  EXPECT_FALSE(b->limits.max_priority.has_value());
  EXPECT_EQ(keys.identify(carol)->limits.max_jobs, std::optional<int64_t>(5));
  EXPECT_FALSE(keys.identify(alice.substr(1)).has_value());
  EXPECT_FALSE(keys.identify("").has_value());
  EXPECT_FALSE(ApiKeys().enabled());
}

TEST(ApiKeys, BadFilesAreRefusedNamingTheLine) {
  const std::string dir = test::temp_dir("bad-keys");
  const std::string key(32, 'k');
  std::ofstream(dir + "/short") << std::string(31, 's') << "\n";
  std::ofstream(dir + "/dup") << key << "\n" << key << "\n";
  std::ofstream(dir + "/empty") << "# nothing\n";
  std::ofstream(dir + "/limit") << key << " x max_priority=11\n";
  std::ofstream(dir + "/words") << key << " x y\n";
  std::ofstream(dir + "/unknown") << key << " x max_things=1\n";
  std::ofstream(dir + "/weight0") << key << " x weight=0\n";
  std::ofstream(dir + "/weight_big") << key << " x weight=101\n";
  std::ofstream(dir + "/weight_word") << key << " x weight=heavy\n";
  for (const auto& [file, needle] :
       std::vector<std::pair<std::string, std::string>>{{"short", ":1: key is shorter than 32"},
                                                        {"dup", ":2: duplicate"},
                                                        {"empty", "no key"},
                                                        {"missing", "cannot read"},
                                                        {"limit", ":1: max_priority must be an integer in [-10, 10]"},
                                                        {"words", ":1: expected 'KEY [CLIENT_NAME]"},
                                                        {"unknown", ":1: expected 'KEY [CLIENT_NAME]"},
                                                        {"weight0", ":1: weight must be an integer in [1, 100]"},
                                                        {"weight_big", ":1: weight must be an integer in [1, 100]"},
                                                        {"weight_word", ":1: weight must be an integer in [1, 100]"}}) {
    try {
      ApiKeys::load(dir + "/" + file);
      ADD_FAILURE() << file << " accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
}

TEST(ApiKeys, ReloadSwapsInTheFilesKeysAndKeepsTheOldOnesWhenTheFileIsBroken) {
  const std::string path = test::temp_dir("reload-keys") + "/keys";
  const std::string first(32, '1'), second(32, '2');
  std::ofstream(path) << first << " one\n";
  ApiKeys keys = ApiKeys::load(path);
  std::ofstream(path) << second << " two\n";
  keys.reload();
  EXPECT_FALSE(keys.identify(first).has_value());
  EXPECT_EQ(keys.identify(second)->name, "two");
  std::ofstream(path) << "short\n";
  EXPECT_THROW(keys.reload(), std::runtime_error);
  EXPECT_EQ(keys.identify(second)->name, "two") << "a broken file keeps the keys in use";
}

TEST(ApiKeys, KeyComesFromBearerAuthorizationOrXApiKey) {
  EXPECT_EQ(presented_key(std::string("Bearer abc"), std::nullopt), "abc");
  EXPECT_EQ(presented_key(std::string("bearer  abc"), std::nullopt), "abc");
  EXPECT_EQ(presented_key(std::string("Basic xyz"), std::string("k2")), "k2");
  EXPECT_EQ(presented_key(std::nullopt, std::string("k3")), "k3");
  EXPECT_EQ(presented_key(std::nullopt, std::nullopt), "");
}

TEST(HostPort, SplitsHostsPortsAndBracketedIpv6) {
  EXPECT_EQ(split_host_port("0.0.0.0:9090", "--x"), (std::pair<std::string, int>{"0.0.0.0", 9090}));
  EXPECT_EQ(split_host_port("[::1]:50051", "--x"), (std::pair<std::string, int>{"::1", 50051}));
  EXPECT_EQ(split_host_port(":80", "--x").first, "0.0.0.0");
  EXPECT_THROW(split_host_port("localhost", "--x"), std::invalid_argument);
  EXPECT_THROW(split_host_port("h:99999", "--x"), std::invalid_argument);
  EXPECT_THROW(split_host_port("h:8a", "--x"), std::invalid_argument);
}

TEST(ResultBlobs, ChunksJoinAlongTheFrameAxisChannelByChannel) {
  // Chunk A: [1, 2 channels, 2 frames, 1, 1]; chunk B: [1, 2, 1, 1, 1]. Values encode (channel, frame).
  const std::vector<float> a = {0, 1, 10, 11};
  const std::vector<float> b = {2, 12};
  const std::string joined = concat_latent_chunks({safetensors_bytes("latents", {1, 2, 2, 1, 1}, a.data()),
                                                   safetensors_bytes("latents", {1, 2, 1, 1, 1}, b.data())},
                                                  {{"job_id", "j-1"}});
  const F32View view = parse_f32_tensor(joined, "latents");
  EXPECT_EQ(view.shape, (std::vector<int64_t>{1, 2, 3, 1, 1}));
  const auto* values = reinterpret_cast<const float*>(view.data);
  EXPECT_EQ(std::vector<float>(values, values + 6), (std::vector<float>{0, 1, 2, 10, 11, 12}));
  EXPECT_EQ(view.metadata.at("job_id"), "j-1");
  EXPECT_THROW(parse_f32_tensor("short", "latents"), std::runtime_error);
  EXPECT_THROW(parse_f32_tensor(joined, "other"), std::runtime_error);
}

// A safetensors blob from a raw header (what a hostile server or client could send).
std::string raw_blob(const std::string& header, const std::string& data = "", int64_t announced = -1) {
  const uint64_t len = announced >= 0 ? static_cast<uint64_t>(announced) : header.size();
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  return out + header + data;
}

std::string result_error(const std::string& blob) {
  try {
    parse_f32_tensor(blob, "latents");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(ResultBlobs, HostileHeadersAreRefusedBeforeParsingAndProductsDoNotWrap) {
  // Over the header limit (checked before parsing), and deeply nested under it.
  EXPECT_NE(result_error(raw_blob(std::string(70000, '['))).find("over the limit of 65536"), std::string::npos);
  EXPECT_NE(result_error(raw_blob("{\"latents\":" + std::string(1000, '['))).find("nests too deep"), std::string::npos);
  // A shape whose byte size wraps around 64 bits to the 0 bytes it announces.
  EXPECT_NE(
      result_error(raw_blob(R"({"latents":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})"))
          .find("overflows"),
      std::string::npos);
  // Offsets past the data, a negative dimension, wrong JSON types: errors, never a crash or a read past the end.
  EXPECT_NE(result_error(raw_blob(R"({"latents":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", ""))
                .find("inconsistent data offsets"),
            std::string::npos);
  EXPECT_NE(result_error(raw_blob(R"({"latents":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "abcd"))
                .find("negative dimension"),
            std::string::npos);
  EXPECT_NE(result_error(raw_blob(R"({"latents":{"dtype":"F32","shape":"x","data_offsets":[0,4]}})", "abcd"))
                .find("malformed"),
            std::string::npos);
  EXPECT_NE(result_error(raw_blob(R"([1,2])")).find("not an object"), std::string::npos);
}

TEST(Guards, StreamCapsCountPerClientAndInTotalAndFreeOnRelease) {
  StreamLimiter limiter(3, 2);
  int64_t observed = -1;
  limiter.on_change([&](int64_t open) { observed = open; });
  StreamLimiter::Refusal why = StreamLimiter::Refusal::None;
  auto a1 = limiter.acquire("a", std::nullopt, &why);
  auto a2 = limiter.acquire("a", std::nullopt, &why);
  ASSERT_TRUE(a1 && a2);
  EXPECT_EQ(limiter.acquire("a", std::nullopt, &why), nullptr);
  EXPECT_EQ(why, StreamLimiter::Refusal::PerClient);
  EXPECT_TRUE(limiter.acquire("a", 3, &why)) << "a per-key cap overrides the default";  // released at once
  auto b1 = limiter.acquire("b", std::nullopt, &why);
  ASSERT_TRUE(b1);
  EXPECT_EQ(observed, 3);
  EXPECT_EQ(limiter.acquire("c", std::nullopt, &why), nullptr);
  EXPECT_EQ(why, StreamLimiter::Refusal::Total);
  a1.reset();
  EXPECT_EQ(limiter.open(), 2);
  EXPECT_TRUE(limiter.acquire("c", std::nullopt, &why));
}

TEST(Guards, ConcurrencyGateNeverWaits) {
  ConcurrencyGate gate(2);
  auto p1 = gate.try_enter();
  auto p2 = gate.try_enter();
  EXPECT_TRUE(p1 && p2);
  EXPECT_EQ(gate.try_enter(), nullptr);
  p1.reset();
  EXPECT_EQ(gate.inside(), 1);
  EXPECT_TRUE(gate.try_enter());
}

// Issue 46: text from files, names and errors is made valid UTF-8 before a proto3 string, a JSON body or a log line.
TEST(Utf8Escape, ValidUtf8IsKeptEveryByteOfAnInvalidSequenceIsEscaped) {
  using model::is_valid_utf8;
  using model::utf8_escape;
  const auto b = [](const char* text, size_t n) { return std::string(text, n); };
  // Valid text, ASCII and multi-byte (2, 3 and 4 bytes, the largest code point), is kept; so are backslashes.
  for (const std::string& valid : {std::string(""), std::string("style_v2 a\\xff"), std::string("caf\xc3\xa9"),
                                   std::string("\xe2\x82\xac \xed\x9f\xbf \xef\xbf\xbf"),
                                   std::string("\xf0\x9f\x8e\xac \xf4\x8f\xbf\xbf"), b("nul\0inside", 10)}) {
    EXPECT_TRUE(is_valid_utf8(valid)) << log_escape(valid);
    EXPECT_EQ(utf8_escape(valid), valid) << log_escape(valid);
  }
  const std::vector<std::pair<std::string, std::string>> invalid = {
      {"bad\xff", "bad\\xff"},                             // a byte that never occurs in UTF-8
      {"\x80\xbf", "\\x80\\xbf"},                          // continuation bytes with no lead
      {"\xc0\xaf", "\\xc0\\xaf"},                          // overlong '/'
      {"\xc1\xbf", "\\xc1\\xbf"},                          // overlong
      {"\xe0\x80\xaf", "\\xe0\\x80\\xaf"},                 // overlong, 3 bytes
      {"\xf0\x80\x80\xaf", "\\xf0\\x80\\x80\\xaf"},        // overlong, 4 bytes
      {"\xed\xa0\x80", "\\xed\\xa0\\x80"},                 // a surrogate (U+D800)
      {"\xed\xbf\xbf", "\\xed\\xbf\\xbf"},                 // a surrogate (U+DFFF)
      {"\xf4\x90\x80\x80", "\\xf4\\x90\\x80\\x80"},        // above U+10FFFF
      {"\xf5\x80\x80\x80", "\\xf5\\x80\\x80\\x80"},        // no such lead byte
      {"cut \xe2\x82", "cut \\xe2\\x82"},                  // a sequence cut short at the end
      {"cut \xf0\x9f\x8e x", "cut \\xf0\\x9f\\x8e x"},     // ... and before an ASCII byte
      {"\xe2\x82\xac\xff\xe2\x82\xac", "\xe2\x82\xac\\xff\xe2\x82\xac"},  // valid around invalid: kept
  };
  for (const auto& [given, expected] : invalid) {
    EXPECT_FALSE(is_valid_utf8(given)) << log_escape(given);
    const std::string escaped = utf8_escape(given);
    EXPECT_EQ(escaped, expected) << log_escape(given);
    EXPECT_TRUE(is_valid_utf8(escaped));
    EXPECT_EQ(utf8_escape(escaped), escaped) << "idempotent";
  }
  std::string every_byte;
  for (int c = 0; c < 256; ++c) every_byte += static_cast<char>(c);
  EXPECT_TRUE(is_valid_utf8(utf8_escape(every_byte)));
  // What a proto3 string takes: the escaped text serialises and parses back unchanged.
  v1::AvailableAdapter adapter;
  adapter.set_reason(utf8_escape(every_byte));
  v1::AvailableAdapter back;
  ASSERT_TRUE(back.ParseFromString(adapter.SerializeAsString()));
  EXPECT_EQ(back.reason(), adapter.reason());
}

TEST(Guards, ClientTextIsEscapedForOneLogLineAndCut) {
  EXPECT_EQ(log_escape("bh2\nevent=forged \"x\"\\"), "bh2\\nevent=forged \\\"x\\\"\\\\");
  EXPECT_EQ(log_escape(std::string("\x01\xff", 2)), "\\x01\\xff");
  EXPECT_EQ(log_escape(std::string(300, 'a'), 10), std::string(10, 'a') + "...(300 bytes)");
  EXPECT_EQ(peer_host("ipv4:127.0.0.1:50000"), "ipv4:127.0.0.1");
  EXPECT_EQ(peer_host("ipv6:[::1]:50000"), "ipv6:[::1]");
}

using test_requests::embeddings;
using test_requests::long_video;

ModelDescription tiny_model() {
  ModelDescription m;
  m.config.text_dim = 32;
  return m;
}

TEST(ModelJob, PlansChunksWhoseFramesAddUpToTheVideo) {
  const auto job = ModelJob::create(long_video(), tiny_model(), ServerLimits{}, 99);
  EXPECT_EQ(job->chunk_count(), 6);
  EXPECT_EQ(job->latent_shape(), (std::vector<int64_t>{1, 16, 15, 8, 12}));
  int64_t frames = 0;
  int64_t latent_end = 0;
  for (int64_t k = 0; k < job->chunk_count(); ++k) {
    frames += job->chunk_pixel_frames(k);
    const auto [begin, end] = job->chunk_latent_range(k);
    EXPECT_EQ(begin, latent_end);
    latent_end = end;
  }
  EXPECT_EQ(frames, 57);
  EXPECT_EQ(latent_end, 15);
  EXPECT_EQ(job->chunk_rows(), std::vector<int64_t>(6, 4)) << "synchronous: one row per step";
  EXPECT_EQ(job->params().seed, 5u);
  EXPECT_EQ(job->params().guidance_scale, 6.0) << "diffusers' default";
}

TEST(ModelJob, UnsetSeedTakesTheRandomOneAndTheFingerprintFollowsTheRequest) {
  JobRequest r = long_video();
  r.seed.reset();
  const auto a = ModelJob::create(r, tiny_model(), ServerLimits{}, 1234);
  EXPECT_EQ(a->params().seed, 1234u);
  const auto b = ModelJob::create(r, tiny_model(), ServerLimits{}, 99);
  EXPECT_EQ(a->fingerprint(), b->fingerprint()) << "the same request, whatever seed the server drew";
  r.seed = 7;
  EXPECT_NE(ModelJob::create(r, tiny_model(), ServerLimits{}, 1)->fingerprint(), a->fingerprint());
}

TEST(ModelJob, LimitsAndTheModelBoundTheRequest) {
  ServerLimits limits;
  limits.max_frames = 33;
  try {
    ModelJob::create(long_video(), tiny_model(), limits, 1);
    FAIL() << "57 frames accepted with --max-frames 33";
  } catch (const ValidationError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("num_frames: 57 is outside [1, 33]", 0), 0u) << e.what();
  }
  ModelDescription other = tiny_model();
  other.config.text_dim = 64;
  EXPECT_THROW(ModelJob::create(long_video(), other, ServerLimits{}, 1), ValidationError);
  JobRequest text = long_video();
  text.prompt_embeds.reset();
  text.prompt = "a cat";
  EXPECT_THROW(ModelJob::create(text, tiny_model(), ServerLimits{}, 1), PreconditionError);
  for (int64_t step : {int64_t{-1}, int64_t{1} << 40}) {
    JobRequest corrector = long_video();
    corrector.disable_corrector = {step};
    try {
      ModelJob::create(corrector, tiny_model(), ServerLimits{}, 1);
      FAIL() << "disable_corrector " << step << " accepted";
    } catch (const ValidationError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("scheduler.disable_corrector: ", 0), 0u) << e.what();
    }
  }
}

// Two tensors in one safetensors file, built by hand: header, then the first tensor's data, then the second's.
std::string embeddings_file(const RawTensor& first, const char* first_name, const RawTensor& second,
                            const char* second_name) {
  const std::string header =
      std::string("{\"") + first_name + "\":{\"dtype\":\"F32\",\"shape\":[1,8,32],\"data_offsets\":[0," +
      std::to_string(first.data.size()) + "]},\"" + second_name +
      "\":{\"dtype\":\"F32\",\"shape\":[1,8,32],\"data_offsets\":[" + std::to_string(first.data.size()) + "," +
      std::to_string(first.data.size() + second.data.size()) + "]}}";
  std::string file;
  const uint64_t len = header.size();
  for (int i = 0; i < 8; ++i) file.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  return file + header + first.data + second.data;
}

TEST(ModelJob, EmbeddingsAlsoArriveAsASafetensorsFile) {
  JobRequest r = long_video();
  const RawTensor p = *r.prompt_embeds;
  const RawTensor n = *r.negative_prompt_embeds;
  ASSERT_NE(p.data, n.data);
  const std::string file = embeddings_file(p, "prompt_embeds", n, "negative_prompt_embeds");
  const uint64_t direct = ModelJob::create(r, tiny_model(), ServerLimits{}, 1)->chunk_count();
  r.prompt_embeds.reset();
  r.negative_prompt_embeds.reset();
  r.embeddings_safetensors = file;
  const auto from_file = ModelJob::create(r, tiny_model(), ServerLimits{}, 1);
  EXPECT_EQ(static_cast<uint64_t>(from_file->chunk_count()), direct);
  // The job conditions on exactly the file's tensors, each in its role.
  EXPECT_EQ(from_file->prompt_embeddings().data, p.data);
  EXPECT_EQ(from_file->prompt_embeddings().shape, (std::vector<int64_t>{1, 8, 32}));
  EXPECT_EQ(from_file->prompt_embeddings(true).data, n.data);
  // The roles follow the tensor names, not their order in the file.
  r.embeddings_safetensors = embeddings_file(n, "negative_prompt_embeds", p, "prompt_embeds");
  const auto reordered = ModelJob::create(r, tiny_model(), ServerLimits{}, 1);
  EXPECT_EQ(reordered->prompt_embeddings().data, p.data);
  EXPECT_EQ(reordered->prompt_embeddings(true).data, n.data);
  // Swapped names: swapped roles (a server that mixed them up fails the checks above).
  r.embeddings_safetensors = embeddings_file(n, "prompt_embeds", p, "negative_prompt_embeds");
  EXPECT_EQ(ModelJob::create(r, tiny_model(), ServerLimits{}, 1)->prompt_embeddings().data, n.data);
  r.embeddings_safetensors = file;
  // A header announcing more than 64 KiB is refused before it is copied or parsed.
  std::string huge = file.substr(0, 8) + std::string(70000, '[');
  huge[0] = static_cast<char>(70000 & 0xff);
  huge[1] = static_cast<char>((70000 >> 8) & 0xff);
  huge[2] = static_cast<char>(70000 >> 16);
  for (int i = 3; i < 8; ++i) huge[static_cast<size_t>(i)] = 0;
  r.embeddings_safetensors = huge;
  try {
    ModelJob::create(r, tiny_model(), ServerLimits{}, 1);
    FAIL() << "huge header accepted";
  } catch (const ValidationError& e) {
    EXPECT_NE(std::string(e.what()).find("header of 70000 bytes is over the limit of 65536"), std::string::npos)
        << e.what();
  }
  r.embeddings_safetensors = file.substr(0, file.size() - 4);
  try {
    ModelJob::create(r, tiny_model(), ServerLimits{}, 1);
    FAIL() << "truncated file accepted";
  } catch (const ValidationError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("embeddings_safetensors", 0), 0u) << e.what();
  }
}

// ---- issue 12: work limits, out-of-memory classification, fault kinds ---------------------------------------------

TEST(WorkLimits, ATokenHeavyChunkTooManyChunksOrTooMuchWorkAreRefusedNamingTheFlag) {
  auto refused = [](const JobRequest& r, const ServerLimits& limits) -> std::string {
    try {
      ModelJob::create(r, tiny_model(), limits, 1);
    } catch (const ValidationError& e) {
      return e.what();
    }
    return "accepted";
  };
  // The issue's request: 1457 frames at 1280x1280 in one chunk, 365 x 80 x 80 = 2,336,000 tokens.
  JobRequest huge = long_video();
  huge.num_frames = 1457;
  huge.base_num_frames = 1457;
  huge.overlap_history.reset();
  huge.height = 1280;
  huge.width = 1280;
  const std::string tokens = refused(huge, ServerLimits{});
  EXPECT_NE(tokens.find("2336000 transformer tokens, over --max-chunk-tokens 131072"), std::string::npos) << tokens;
  EXPECT_EQ(tokens.rfind("base_num_frames: ", 0), 0u) << tokens;

  JobRequest many = long_video();  // 57 frames in chunks of 17 with overlap 9: 6 chunks
  ServerLimits five_chunks;
  five_chunks.max_chunks = 5;
  EXPECT_NE(refused(many, five_chunks).find("6 chunks, over --max-chunks 5"), std::string::npos);

  const auto job = ModelJob::create(many, tiny_model(), ServerLimits{}, 1);
  // 6 chunks of 5 latent frames x (64/16) x (96/16) tokens, 4 rows each, 2 passes (guidance).
  EXPECT_EQ(job->max_chunk_tokens(), 5 * 4 * 6);
  EXPECT_EQ(job->total_work(), 6 * 120 * 4 * 2);
  ServerLimits little_work;
  little_work.max_job_work = job->total_work() - 1;
  EXPECT_NE(refused(many, little_work).find("over --max-job-work " + std::to_string(job->total_work() - 1)),
            std::string::npos);
  little_work.max_job_work = job->total_work();
  EXPECT_EQ(refused(many, little_work), "accepted");
}

TEST(WorkLimits, DefaultsComeFromTheDeviceMemoryAndTheModelUnderTheAttentionCeiling) {
  ModelFootprint df14b;  // DF-14B in bf16 (docs/OPERATIONS.md section 3)
  df14b.dim = 5120;
  df14b.ffn_dim = 13824;
  df14b.parameter_count = 14'290'000'000;
  df14b.weight_bytes = df14b.activation_bytes = 2;
  EXPECT_EQ(activation_bytes_per_token(df14b), 2 * 13824 * 2 + 4 * 5120 * 4);
  EXPECT_EQ(default_max_chunk_tokens(df14b, 80'000'000'000ULL), kAttentionTokenCeiling) << "80 GB: room to spare";
  const int64_t on_40gb = default_max_chunk_tokens(df14b, 40'000'000'000ULL);  // 32 - 28.6 - 1 GB left
  EXPECT_LT(on_40gb, kAttentionTokenCeiling);
  EXPECT_NEAR(static_cast<double>(on_40gb), (0.8 * 40e9 - 28.58e9 - 1e9) / 137216.0, 10.0);
  EXPECT_EQ(default_max_chunk_tokens(df14b, 20'000'000'000ULL), 1024) << "weights do not fit: the floor";
  EXPECT_EQ(default_max_chunk_tokens(df14b, 0), kAttentionTokenCeiling) << "unknown memory (CUDA): the ceiling";
  // Kept keys/values (exact savings) take a fifth of what is left, before the tokens are derived.
  const int64_t kv = default_kv_cache_bytes(df14b, 40'000'000'000ULL);
  EXPECT_NEAR(static_cast<double>(kv), (0.8 * 40e9 - 28.58e9 - 1e9) / 5, 1e6);
  EXPECT_NEAR(static_cast<double>(default_max_chunk_tokens(df14b, 40'000'000'000ULL, kv)),
              (0.8 * 40e9 - 28.58e9 - 1e9) * 0.8 / 137216.0, 10.0);
  EXPECT_EQ(default_kv_cache_bytes(df14b, 0), int64_t{4} << 30) << "unknown memory: the model's default";
  EXPECT_EQ(default_max_job_work(131072, 100), 24LL * 131072 * 100 * 2);
  EXPECT_GT(device_memory_bytes("cpu"), 0u);
  EXPECT_EQ(device_memory_bytes("cuda:0"), 0u);
}

TEST(OutOfMemory, LibTorchsCpuAndCudaAllocatorErrorsAndBadAllocAreOutOfMemory) {
  EXPECT_TRUE(is_out_of_memory(
      c10::Error({"f", "file", 1}, "DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes")));
  EXPECT_TRUE(is_out_of_memory(c10::Error({"f", "file", 1}, "CUDA out of memory. Tried to allocate 2.00 GiB")));
  EXPECT_TRUE(is_out_of_memory(std::bad_alloc()));
  EXPECT_FALSE(is_out_of_memory(c10::Error({"f", "file", 1}, "shape mismatch")));
  EXPECT_FALSE(is_out_of_memory(std::runtime_error("CUDA out of memory")))
      << "only LibTorch's own errors carry its allocator's message";
  EXPECT_FALSE(is_out_of_memory(std::runtime_error("device lost")));
}

TEST(FaultRules, KindsAreErrorOomAndDead) {
  const auto rules = parse_fault_rules("cpu:0@1:oom, cuda:0/1@2+:dead, cpu:1@3");
  ASSERT_EQ(rules.size(), 3u);
  EXPECT_EQ(rules[0].kind, FaultKind::OutOfMemory);
  EXPECT_EQ(rules[1].replica, "cuda:0/1");
  EXPECT_TRUE(rules[1].and_later);
  EXPECT_EQ(rules[1].kind, FaultKind::Dead);
  EXPECT_EQ(rules[2].kind, FaultKind::Error);
  EXPECT_THROW(parse_fault_rules("cpu:0@1:melt"), std::invalid_argument);
}

TEST(Metrics, BuildInfoNamesTheLoraAdaptersInEffectOnlyWhenThereAreAny) {
  EXPECT_NE(Metrics({"cpu:0"}, "9.9.9", "style.safetensors:0.8,fast.safetensors:1").render().find(
                "skyreels_build_info{loras=\"style.safetensors:0.8,fast.safetensors:1\",version=\"9.9.9\"} 1"),
            std::string::npos);
  EXPECT_NE(Metrics({"cpu:0"}, "9.9.9").render().find("skyreels_build_info{version=\"9.9.9\"} 1"), std::string::npos);
}

// A client can call any method name: the grpc_server_* series stay bounded, later names count as "unknown".
TEST(Metrics, RpcSeriesAreBoundedWhateverMethodNamesClientsSend) {
  Metrics metrics({"cpu:0"}, "test");
  for (int i = 0; i < 1000; ++i) {
    const std::string method = "Made" + std::to_string(i);
    metrics.rpc_started("unary", "evil.Service", method);
    metrics.rpc_handled("unary", "evil.Service", method, 12, 0.001);
  }
  const std::string text = metrics.render();
  size_t handled_series = 0;
  for (size_t at = text.find("\ngrpc_server_handled_total{"); at != std::string::npos;
       at = text.find("\ngrpc_server_handled_total{", at + 1)) {
    ++handled_series;
  }
  EXPECT_LE(handled_series, kMaxRpcSeries + 1) << "one per method series plus the shared unknown one";
  EXPECT_NE(text.find("grpc_method=\"unknown\""), std::string::npos);
  const std::string unknown_started =
      "grpc_server_started_total{grpc_method=\"unknown\",grpc_service=\"unknown\",grpc_type=\"unknown\"} ";
  const size_t at = text.find(unknown_started);
  ASSERT_NE(at, std::string::npos) << text.substr(0, 2000);
  EXPECT_EQ(std::stod(text.substr(at + unknown_started.size())), 1000.0 - static_cast<double>(kMaxRpcSeries))
      << "every call is still counted";
}

TEST(Metrics, FreshExpositionHasEveryLabelValueAtZero) {
  Metrics metrics({"cpu:0", "cuda:1"}, "9.9.9");
  const std::string text = metrics.render();
  for (const char* sample :
       {"skyreels_jobs_rejected_total{reason=\"draining\"} 0", "skyreels_jobs_finished_total{outcome=\"cancelled\"} 0",
        "skyreels_replica_busy{replica=\"cuda:1\"} 0", "skyreels_build_info{version=\"9.9.9\"} 1",
        "skyreels_chunk_duration_seconds_count{replica=\"cpu:0\"} 0",
        "skyreels_replica_recoveries_total{replica=\"cuda:1\"} 0", "skyreels_video_chunks_encoded_total 0",
        "skyreels_video_jobs_pending 0"}) {
    EXPECT_NE(text.find(sample), std::string::npos) << sample;
  }
  SchedulerEvent changed(SchedulerEventKind::ReplicaChanged);
  changed.replica = "cpu:0";
  changed.replica_status = ReplicaStatus{};
  changed.replica_status->name = "cpu:0";
  changed.replica_status->loaded = changed.replica_status->healthy = changed.replica_status->busy = true;
  metrics.consume(changed);
  metrics.rejected(kRejectQueueFull);
  const std::string after = metrics.render();
  EXPECT_NE(after.find("skyreels_replicas_ready 1"), std::string::npos);
  EXPECT_NE(after.find("skyreels_replica_busy{replica=\"cpu:0\"} 1"), std::string::npos);
  EXPECT_NE(after.find("skyreels_jobs_rejected_total{reason=\"queue_full\"} 1"), std::string::npos);
}

// ---- readiness follows whether unary calls are answered --------------------------------------------------------

// A VideoService whose GetJob blocks until released: what a starved sync thread pool looks like from outside.
class BlockingService final : public v1::VideoService::Service {
 public:
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::Job*) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++blocked_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
    return grpc::Status::OK;
  }
  grpc::Status GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*, v1::ServerInfo*) override {
    return grpc::Status::OK;
  }
  void wait_blocked(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return blocked_ >= n; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int blocked_ = 0;
  bool released_ = false;
};

TEST(UnaryProbe, SaysNoWhileEveryServerThreadIsTakenAndYesAfterwards) {
  BlockingService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  grpc::ResourceQuota quota("probe-test");
  quota.SetMaxThreads(4);
  builder.SetResourceQuota(quota);
  auto server = builder.BuildAndStart();
  ASSERT_TRUE(server);
  UnaryProbe probe(*server, std::chrono::milliseconds(200));
  EXPECT_TRUE(probe.answered());
  // Occupy the pool with calls that do not return.
  auto stub = v1::VideoService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  std::vector<std::thread> callers;
  for (int i = 0; i < 8; ++i) {
    callers.emplace_back([&] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      v1::Job job;
      stub->GetJob(&ctx, v1::GetJobRequest(), &job);
    });
  }
  service.wait_blocked(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the probe's period: it asks again
  EXPECT_FALSE(probe.answered()) << "every thread is held: readiness must not say SERVING";
  service.release();
  for (auto& t : callers) t.join();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_TRUE(probe.answered());
  server->Shutdown();
}

// ---- the job store: every backend answers the same ----------------------------------------------------------------

StoredJob stored_job(const std::string& id) {
  StoredJob job;
  job.id = id;
  job.owner = "alice";
  job.state = "QUEUED";
  job.chunk_count = 3;
  job.request = "request bytes";
  return job;
}

class JobStoreBackends : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<JobStore> open() {
    return open_job_store(GetParam() == "memory" ? "memory" : "sqlite:" + test::temp_dir("store") + "/jobs.sqlite");
  }
};

TEST_P(JobStoreBackends, CommittedChunkResultsReadBackByIndex) {
  auto store = open();
  store->insert_job(stored_job("j-1"));
  store->commit_chunk("j-1", {0, "cpu:0", 1, "latents of chunk 0"});
  store->commit_chunk("j-1", {1, "cpu:1", 2, "latents of chunk 1"});
  EXPECT_EQ(store->load_chunk_bytes("j-1", 0), "latents of chunk 0");
  EXPECT_EQ(store->load_chunk_bytes("j-1", 1), "latents of chunk 1");
  EXPECT_EQ(store->load_chunk_bytes("j-1", 2), std::nullopt) << "not committed";
  EXPECT_EQ(store->load_chunk_bytes("j-unknown", 0), std::nullopt);
  const auto chunks = store->load_chunks("j-1");
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[1].bytes, "latents of chunk 1");
  EXPECT_EQ(chunks[1].replica, "cpu:1");
  EXPECT_EQ(store->load_jobs().at(0).chunks_done, 2);
}

TEST_P(JobStoreBackends, SegmentsAreKeptUntilTheJobIsDropped) {
  auto store = open();
  store->insert_job(stored_job("j-1"));
  store->insert_job(stored_job("j-2"));
  store->commit_chunk("j-1", {0, "cpu:0", 1, "latents"});
  store->put_segment("j-1", 0, "init + fragment 0");
  store->put_segment("j-1", 1, "fragment 1");
  store->put_segment("j-2", 0, "another job's fragment");
  EXPECT_EQ(store->load_segment("j-1", 0), "init + fragment 0");
  EXPECT_EQ(store->load_segment("j-1", 1), "fragment 1");
  EXPECT_EQ(store->load_segment("j-1", 2), std::nullopt);
  store->put_segment("j-1", 1, "fragment 1, made again");  // a decode after a restart replaces it
  EXPECT_EQ(store->load_segment("j-1", 1), "fragment 1, made again");

  store->drop_job("j-1", "retention");
  EXPECT_EQ(store->load_segment("j-1", 0), std::nullopt);
  EXPECT_EQ(store->load_chunk_bytes("j-1", 0), std::nullopt);
  EXPECT_EQ(store->load_segment("j-2", 0), "another job's fragment") << "only the dropped job's segments go";
  // A segment finished after its job was dropped is not kept (it would never be dropped again).
  store->put_segment("j-1", 2, "late fragment");
  EXPECT_EQ(store->load_segment("j-1", 2), std::nullopt);
  EXPECT_EQ(store->dropped_reason("j-1", "alice"), "retention");
}

INSTANTIATE_TEST_SUITE_P(MemoryAndSqlite, JobStoreBackends, ::testing::Values("memory", "sqlite"),
                         [](const ::testing::TestParamInfo<std::string>& backend) { return backend.param; });

// Ranged reads of results (issue 36: downloads hold a piece at a time), on every backend; PostgreSQL a real one.
class JobStoreBlobRanges : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<JobStore> open() {
    if (GetParam() == "postgresql") {
      postgres_ = std::make_unique<test::PgServer>();
      return open_job_store(postgres_->url());
    }
    return open_job_store(GetParam() == "memory" ? "memory" : "sqlite:" + test::temp_dir("store-ranges") + "/jobs.sqlite");
  }
  std::unique_ptr<test::PgServer> postgres_;  // the fixture outlives the store the test body holds
};

// Bytes that are not text: every byte value, a size that is no power of two, over several MiB (SQLite overflow
// pages, PostgreSQL TOAST).
std::string binary_blob(size_t size, uint32_t seed) {
  std::string out(size, '\0');
  uint32_t x = seed;
  for (size_t i = 0; i < size; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<char>(x >> 24);
  }
  return out;
}

TEST_P(JobStoreBlobRanges, PiecesOfResultsAndSegmentsReadBackExactly) {
  auto store = open();
  using Blob = JobStore::Blob;
  store->insert_job(stored_job("j-1"));
  const std::string latents = binary_blob((3 << 20) + 12345, 1);
  const std::string segment = binary_blob((5 << 20) / 2 + 7, 2);
  store->commit_chunk("j-1", {0, "cpu:0", 1, latents});
  store->put_segment("j-1", 0, segment);
  EXPECT_EQ(store->blob_size("j-1", Blob::chunk, 0), static_cast<int64_t>(latents.size()));
  EXPECT_EQ(store->blob_size("j-1", Blob::segment, 0), static_cast<int64_t>(segment.size()));
  EXPECT_EQ(store->blob_size("j-1", Blob::chunk, 1), std::nullopt);
  EXPECT_EQ(store->blob_size("j-1", Blob::segment, 1), std::nullopt);
  EXPECT_EQ(store->blob_size("j-unknown", Blob::chunk, 0), std::nullopt);

  for (const auto& [kind, whole] : {std::pair<Blob, const std::string*>{Blob::chunk, &latents},
                                    std::pair<Blob, const std::string*>{Blob::segment, &segment}}) {
    std::string joined;
    const int64_t piece = 1 << 20;
    for (int64_t offset = 0; offset < static_cast<int64_t>(whole->size()); offset += piece) {
      const auto got = store->load_blob_range("j-1", kind, 0, offset, piece);
      ASSERT_TRUE(got.has_value());
      EXPECT_EQ(got->size(), std::min<size_t>(piece, whole->size() - offset));
      joined += *got;
    }
    EXPECT_TRUE(joined == *whole) << "the pieces joined differ from the blob";
    const int64_t size = static_cast<int64_t>(whole->size());
    EXPECT_EQ(store->load_blob_range("j-1", kind, 0, 0, 1), whole->substr(0, 1));
    EXPECT_EQ(store->load_blob_range("j-1", kind, 0, 1000, 37), whole->substr(1000, 37));
    EXPECT_EQ(store->load_blob_range("j-1", kind, 0, size - 5, 100), whole->substr(whole->size() - 5)) << "clipped";
    EXPECT_EQ(store->load_blob_range("j-1", kind, 0, size, 10), "") << "past the end";
    EXPECT_EQ(store->load_blob_range("j-1", kind, 0, -1, 10), "");
    EXPECT_EQ(store->load_blob_range("j-1", kind, 0, 0, 0), "");
    EXPECT_EQ(store->load_blob_range("j-1", kind, 1, 0, 10), std::nullopt) << "no such chunk";
    EXPECT_EQ(store->load_blob_range("j-unknown", kind, 0, 0, 10), std::nullopt);
  }
  store->drop_job("j-1", "retention");
  EXPECT_EQ(store->blob_size("j-1", Blob::segment, 0), std::nullopt);
  EXPECT_EQ(store->load_blob_range("j-1", Blob::chunk, 0, 0, 10), std::nullopt);
}

INSTANTIATE_TEST_SUITE_P(EveryStore, JobStoreBlobRanges, ::testing::Values("memory", "sqlite", "postgresql"),
                         [](const ::testing::TestParamInfo<std::string>& backend) { return backend.param; });

std::vector<std::string> j_adapters() { return {"style", "subject-2"}; }

TEST(SqliteJobStore, BothFingerprintVersionsAndTheAdapterNamesRoundTrip) {
  const std::string path = test::temp_dir("store-fingerprints") + "/jobs.sqlite";
  {
    SqliteJobStore store(path);
    StoredJob j;
    j.id = "j-1";
    j.state = "queued";
    j.error_kind = "none";
    j.fingerprint = 0xfedcba9876543210ULL;
    j.fingerprint_v2 = "sha256:0123456789abcdef";
    j.adapters = j_adapters();
    store.insert_job(j);
  }
  const auto jobs = SqliteJobStore(path).load_jobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].fingerprint, 0xfedcba9876543210ULL);
  EXPECT_EQ(jobs[0].fingerprint_v2, "sha256:0123456789abcdef");
  EXPECT_EQ(jobs[0].adapters, j_adapters());
}

TEST(SqliteJobStore, SynchronousFullIsAnOptionOfTheSpecAndIsReadBackFromSqlite) {
  const std::string path = test::temp_dir("store-sync") + "/jobs.sqlite";
  EXPECT_EQ(open_job_store("sqlite:" + path)->describe(), "sqlite:" + path) << "NORMAL by default";
  EXPECT_EQ(open_job_store("sqlite:" + path + "?synchronous=full")->describe(), "sqlite:" + path + "?synchronous=full");
  EXPECT_EQ(open_job_store("sqlite:" + path + "?synchronous=normal")->describe(), "sqlite:" + path);
  try {
    open_job_store("sqlite:" + path + "?synchronous=off");
    ADD_FAILURE() << "an unknown option was accepted";
  } catch (const StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown option 'synchronous=off'"), std::string::npos) << e.what();
  }
}

// A file written by schema version 2 (the last release without segments) as that release created it.
void write_version_two_store(const std::string& path) {
  sqlite::Database db(path, true);
  db.exec(
      "CREATE TABLE schema_version(version INTEGER NOT NULL); INSERT INTO schema_version VALUES(2);"
      "CREATE TABLE jobs(id TEXT PRIMARY KEY, ord INTEGER NOT NULL, vbase INTEGER NOT NULL, owner TEXT NOT NULL,"
      " client TEXT NOT NULL, priority INTEGER NOT NULL, deadline_ms INTEGER, idempotency_key TEXT NOT NULL,"
      " fingerprint INTEGER NOT NULL, state TEXT NOT NULL, error_kind TEXT NOT NULL, error TEXT NOT NULL,"
      " created_ms INTEGER NOT NULL, started_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL,"
      " chunk_count INTEGER NOT NULL, chunks_done INTEGER NOT NULL, retries INTEGER NOT NULL,"
      " handoffs INTEGER NOT NULL, request BLOB NOT NULL);"
      "CREATE TABLE chunks(job_id TEXT NOT NULL, idx INTEGER NOT NULL, replica TEXT NOT NULL,"
      " attempts INTEGER NOT NULL, bytes BLOB NOT NULL, PRIMARY KEY(job_id, idx));"
      "CREATE TABLE events(job_id TEXT NOT NULL, seq INTEGER NOT NULL, data TEXT NOT NULL, PRIMARY KEY(job_id, seq));"
      "CREATE TABLE dropped(id TEXT PRIMARY KEY, owner TEXT NOT NULL, reason TEXT NOT NULL,"
      " dropped_ms INTEGER NOT NULL);"
      "INSERT INTO jobs VALUES('j-old', 0, 0, 'alice', 'alice', 0, NULL, '', 0, 'SUCCEEDED', 'NONE', '', 1, 2, 3,"
      " 1, 1, 0, 0, x'00');"
      "INSERT INTO chunks VALUES('j-old', 0, 'cpu:0', 1, 'old latents');");
}

TEST(SqliteJobStore, AVersionTwoFileIsMigratedToTheCurrentVersionAndKeepsItsResults) {
  const std::string path = test::temp_dir("store-v2") + "/jobs.sqlite";
  write_version_two_store(path);
  {
    SqliteJobStore store(path);
    EXPECT_EQ(store.load_chunk_bytes("j-old", 0), "old latents");
    EXPECT_EQ(store.load_segment("j-old", 0), std::nullopt);
    store.put_segment("j-old", 0, "its MP4");  // the new table exists
    EXPECT_EQ(store.load_segment("j-old", 0), "its MP4");
    const auto jobs = store.load_jobs();
    ASSERT_EQ(jobs.size(), 1u);
    EXPECT_EQ(jobs[0].fingerprint_v2, "") << "a job stored before SHA-256 fingerprints keeps its 64-bit one only";
    EXPECT_TRUE(jobs[0].adapters.empty()) << "a job stored before adapters per request applies none";
  }
  sqlite::Database db(path, false);
  sqlite::Statement version(db, "SELECT version FROM schema_version");
  ASSERT_TRUE(version.step());
  EXPECT_EQ(version.int64(0), SqliteJobStore::kSchemaVersion);
  EXPECT_EQ(SqliteJobStore::kSchemaVersion, 5);
}

}  // namespace
}  // namespace skyreels::server
