// The server's small parts in isolation: replica planning, fault rules, API keys, addresses, result blobs, job
// validation and planning, metrics exposition.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>

#include "server/auth.h"
#include "server/blob.h"
#include "server/limits.h"
#include "server/metrics.h"
#include "server/model_job.h"
#include "server/replica.h"
#include "tests/test_util.h"

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

TEST(ApiKeys, FileLinesAreKeysWithOptionalClientNames) {
  const std::string path = test::temp_dir("keys") + "/keys";
  std::ofstream(path) << "# comment\n\nalice-key-0001 alice\n  bob-key-00002  \n";
  const ApiKeys keys = ApiKeys::load(path);
  EXPECT_TRUE(keys.enabled());
  EXPECT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys.identify("alice-key-0001"), std::optional<std::string>("alice"));
  EXPECT_EQ(keys.identify("bob-key-00002"), std::optional<std::string>("client-4"));
  EXPECT_FALSE(keys.identify("alice-key-000").has_value());
  EXPECT_FALSE(keys.identify("").has_value());
  EXPECT_FALSE(ApiKeys().enabled());
}

TEST(ApiKeys, BadFilesAreRefusedNamingTheLine) {
  const std::string dir = test::temp_dir("bad-keys");
  std::ofstream(dir + "/short") << "abc\n";
  std::ofstream(dir + "/dup") << "same-key-123\nsame-key-123\n";
  std::ofstream(dir + "/empty") << "# nothing\n";
  for (const auto& [file, needle] : std::vector<std::pair<std::string, std::string>>{{"short", ":1: key is shorter"},
                                                                                     {"dup", ":2: duplicate"},
                                                                                     {"empty", "no key"},
                                                                                     {"missing", "cannot read"}}) {
    try {
      ApiKeys::load(dir + "/" + file);
      ADD_FAILURE() << file << " accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
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

RawTensor embeddings(int64_t tokens, int64_t dim, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> normal;
  std::vector<float> v(static_cast<size_t>(tokens * dim));
  for (auto& x : v) x = normal(rng);
  RawTensor t;
  t.dtype = "F32";
  t.shape = {1, tokens, dim};
  t.data.assign(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  return t;
}

JobRequest long_video() {
  JobRequest r;
  r.prompt_embeds = embeddings(8, 32, 1);
  r.negative_prompt_embeds = embeddings(8, 32, 2);
  r.num_frames = 57;
  r.base_num_frames = 17;
  r.overlap_history = 9;
  r.height = 64;
  r.width = 96;
  r.num_inference_steps = 4;
  r.seed = 5;
  return r;
}

ModelDescription tiny_model() {
  ModelDescription m;
  m.text_dim = 32;
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
  other.text_dim = 64;
  EXPECT_THROW(ModelJob::create(long_video(), other, ServerLimits{}, 1), ValidationError);
  JobRequest text = long_video();
  text.prompt_embeds.reset();
  text.prompt = "a cat";
  EXPECT_THROW(ModelJob::create(text, tiny_model(), ServerLimits{}, 1), PreconditionError);
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
  // The request: 1457 frames at 1280x1280 in one chunk, 365 x 80 x 80 = 2,336,000 tokens.
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
  ReplicaStatus replica;
  replica.name = "cpu:0";
  replica.loaded = replica.healthy = replica.busy = true;
  metrics.replica_changed(replica);
  metrics.rejected(kRejectQueueFull);
  const std::string after = metrics.render();
  EXPECT_NE(after.find("skyreels_replicas_ready 1"), std::string::npos);
  EXPECT_NE(after.find("skyreels_replica_busy{replica=\"cpu:0\"} 1"), std::string::npos);
  EXPECT_NE(after.find("skyreels_jobs_rejected_total{reason=\"queue_full\"} 1"), std::string::npos);
}

}  // namespace
}  // namespace skyreels::server
