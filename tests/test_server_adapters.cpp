// Issue 33, served: LoRA adapters chosen per request from --lora-dir, applied unmerged on a two-replica server. Jobs
// with different adapters (and one with none) at once each equal `skyreels generate --lora-dir --adapter` bit for
// bit, with no restart and the loads counted; a job killed mid-run resumes bit-identical; a resumed job whose adapter
// file changed fails naming the adapter; bad choices are refused naming the field. Issue 46: files added or replaced
// in --lora-dir while serving are taken without a restart, and a file (adapter or model) rewritten in place under a
// running job changes nothing it computes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <cstdlib>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "model/safetensors.h"
#include "model/sha256.h"
#include "server/replica/demo_model.h"
#include "tests/pg_fixture.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;

// A rank-4 adapter (diffusers / PEFT keys) on the demo model's attention and feed-forward layers, random from `seed`.
void write_adapter(const std::string& path, uint64_t seed) {
  at::manual_seed(static_cast<int64_t>(seed));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  constexpr int64_t kInner = 24, kFfn = 48, kRank = 4;  // the demo model: 2 heads x 12, ffn 48
  for (int block = 0; block < 2; ++block) {
    const std::string p = "transformer.blocks." + std::to_string(block) + ".";
    for (const char* layer : {"attn1.to_q", "attn1.to_v", "attn2.to_k", "attn1.to_out.0"}) {
      tensors.emplace_back(p + layer + ".lora_A.weight", at::randn({kRank, kInner}) * 0.3);
      tensors.emplace_back(p + layer + ".lora_B.weight", at::randn({kInner, kRank}) * 0.3);
    }
    tensors.emplace_back(p + "ffn.net.0.proj.lora_A.weight", at::randn({kRank, kInner}) * 0.3);
    tensors.emplace_back(p + "ffn.net.0.proj.lora_B.weight", at::randn({kFfn, kRank}) * 0.3);
  }
  safetensors::save(path, tensors);
}

struct Setup {
  std::string dir, lora_dir, model_dir;
};

const Setup& setup() {
  static const Setup s = [] {
    Setup made;
    made.dir = temp_dir("adapters");
    made.lora_dir = made.dir + "/loras";
    std::filesystem::create_directories(made.lora_dir);
    write_adapter(made.lora_dir + "/style.safetensors", 11);
    write_adapter(made.lora_dir + "/subject.safetensors", 12);
    std::ofstream(made.lora_dir + "/broken.safetensors") << "not a safetensors file";
    made.model_dir = made.dir + "/model";
    server::write_tiny_model(made.model_dir);  // the --demo model: same seed, same bytes
    return made;
  }();
  return s;
}

pb::SubmitJobRequest with_adapters(uint64_t seed, const std::vector<std::pair<std::string, double>>& adapters) {
  pb::SubmitJobRequest request = long_video_request(seed);  // 4 chunks of 5 latent frames, 3 steps, guidance 5
  for (const auto& [name, scale] : adapters) {
    pb::AdapterRef* ref = request.mutable_spec()->mutable_params()->add_loras();
    ref->set_name(name);
    ref->set_scale(scale);
  }
  return request;
}

// `skyreels generate` for the same request in one process, the adapters from the same directory.
at::Tensor generate_reference(const pb::SubmitJobRequest& request, const std::string& lora_dir) {
  const std::string dir = temp_dir("adapters-reference");
  const auto [prompt, negative] = request_embeddings(request);
  safetensors::save(dir + "/inputs.safetensors", {{"prompt_embeds", prompt}, {"negative_prompt_embeds", negative}});
  const auto& p = request.spec().params();
  std::ostringstream command;
  command << bin_path("skyreels") << " generate --model " << setup().model_dir << " --inputs " << dir
          << "/inputs.safetensors --num-frames " << p.num_frames() << " --height " << p.height() << " --width "
          << p.width() << " --num-inference-steps " << p.num_inference_steps() << " --guidance-scale "
          << p.guidance_scale() << " --base-num-frames " << p.base_num_frames() << " --overlap-history "
          << p.overlap_history() << " --seed " << p.seed() << " --dtype float32";
  if (p.loras_size() > 0) command << " --lora-dir " << lora_dir;
  for (const auto& ref : p.loras()) command << " --adapter " << ref.name() << ":" << ref.scale();
  command << " --out " << dir << "/out.safetensors 2>&1";
  std::string log;
  EXPECT_EQ(run_command(command.str(), &log), 0) << log;
  return load_tensors(dir + "/out.safetensors").at("latents");
}

class ServedAdapters : public SharedServerSuite<ServedAdapters> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    http_port_ = free_port();
    return std::make_unique<ServerProcess>(
        std::vector<std::string>{"--demo", "--devices", "cpu,cpu", "--dtype", "float32", "--lora-dir", setup().lora_dir,
                                 "--max-resident-adapters", "1", "--enable-test-hooks", "--step-delay-ms", "20",
                                 "--http-listen", "127.0.0.1:" + std::to_string(http_port_)});
  }
  static inline int http_port_ = 0;
};

TEST_F(ServedAdapters, GetServerInfoListsTheAdaptersWithTheirDigestsAndTheDamagedOneAsUnavailable) {
  auto ctx = server_->client().context(10);
  pb::ServerInfo info;
  ASSERT_TRUE(server_->client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  std::map<std::string, pb::AvailableAdapter> adapters;
  for (const auto& a : info.model().adapters()) adapters[a.name()] = a;
  ASSERT_EQ(adapters.size(), 3u);
  for (const char* name : {"style", "subject"}) {
    EXPECT_TRUE(adapters[name].available()) << adapters[name].reason();
    EXPECT_EQ(adapters[name].sha256().size(), 64u);
    EXPECT_EQ(adapters[name].format(), "diffusers");
    EXPECT_EQ(adapters[name].rank(), 4);
  }
  EXPECT_FALSE(adapters["broken"].available());
  EXPECT_FALSE(adapters["broken"].reason().empty());
  EXPECT_EQ(info.model().max_resident_adapters(), 1);
}

TEST_F(ServedAdapters, JobsWithDifferentAdaptersAtOnceEachEqualGenerateWithTheirAdapters) {
  const std::vector<pb::SubmitJobRequest> requests = {with_adapters(3301, {{"style", 0.8}}),
                                                      with_adapters(3302, {{"subject", 1.0}, {"style", -0.5}}),
                                                      with_adapters(3303, {})};
  std::vector<std::string> ids;
  for (const auto& r : requests) ids.push_back(submit(server_->client(), r).job_id());
  std::vector<at::Tensor> served;
  for (const auto& id : ids) {
    const pb::Job job = wait_job(server_->client(), id, 180s);
    ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
    served.push_back(download_latents(server_->client(), id));
  }
  const pb::Job first = get_job(server_->client(), ids[0]);
  ASSERT_EQ(first.params().loras_size(), 1);
  EXPECT_EQ(first.params().loras(0).sha256().size(), 64u) << "the job records the file it was accepted with";
  for (size_t i = 0; i < requests.size(); ++i) {
    const at::Tensor expected = generate_reference(requests[i], setup().lora_dir);
    EXPECT_TRUE(at::equal(served[i], expected))
        << "job " << i << ": max |served - generate| = " << max_abs_diff(served[i], expected);
  }
  EXPECT_FALSE(at::equal(served[0], served[2])) << "an adapter changes the video";

  // Loads are counted; with one resident adapter per replica, the two adapters' jobs made the replicas load.
  auto ctx = server_->client().context(10);
  pb::ServerInfo info;
  ASSERT_TRUE(server_->client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  int64_t loads = 0;
  for (const auto& r : info.replicas()) {
    loads += r.adapter_loads();
    EXPECT_LE(r.resident_adapters_size(), 1);
  }
  EXPECT_GE(loads, 2);
  const std::string metrics = http_get(server_->metrics_port(), "/metrics");
  double counted = 0;
  for (const char* replica : {"cpu:0", "cpu:1"}) {
    const double v = metric_value(metrics, std::string("skyreels_adapter_loads_total{replica=\"") + replica + "\"}");
    if (!std::isnan(v)) counted += v;
  }
  EXPECT_EQ(counted, static_cast<double>(loads));
  double resident = 0;
  for (const char* replica : {"cpu:0", "cpu:1"}) {
    const double v = metric_value(metrics, std::string("skyreels_adapters_resident{replica=\"") + replica + "\"}");
    if (!std::isnan(v)) resident += v;
  }
  EXPECT_GE(resident, 1.0) << "the replicas keep what they loaded";
  EXPECT_GE(metric_value(metrics, "skyreels_adapter_jobs_total{adapter=\"style\"}"), 2.0);
}

TEST_F(ServedAdapters, BadAdapterChoicesAreRefusedNamingTheFieldAndTheServerKeepsServing) {
  struct Bad {
    std::string what;
    std::vector<std::pair<std::string, double>> adapters;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {"an unknown name", {{"nosuch", 1.0}}, grpc::StatusCode::INVALID_ARGUMENT, "loras[0].name: unknown adapter 'nosuch'"},
      {"a damaged file", {{"broken", 1.0}}, grpc::StatusCode::INVALID_ARGUMENT, "loras[0].name: adapter 'broken' is unavailable"},
      {"a scale out of range", {{"style", 1e6}}, grpc::StatusCode::INVALID_ARGUMENT, "loras[0].scale"},
      {"a scale that is not finite", {{"style", std::nan("")}}, grpc::StatusCode::INVALID_ARGUMENT, "loras[0].scale"},
      {"one adapter twice", {{"style", 1.0}, {"style", 0.5}}, grpc::StatusCode::INVALID_ARGUMENT, "given twice"},
      {"nine adapters", std::vector<std::pair<std::string, double>>(9, {"style", 1.0}),
       grpc::StatusCode::INVALID_ARGUMENT, "loras: 9 given, at most 8"},
      {"a million adapters (refused at the door, before any is copied)",
       std::vector<std::pair<std::string, double>>(1000000, {"s", 1.0}), grpc::StatusCode::INVALID_ARGUMENT,
       "loras: 1000000 given, at most 8"},
      {"a name longer than any file name (not echoed)", {{std::string(4096, 'x'), 1.0}},
       grpc::StatusCode::INVALID_ARGUMENT, "loras[0].name: 4096 bytes, longer than any adapter's name"},
  };
  for (const Bad& bad : cases) {
    const grpc::Status status = submit_status(server_->client(), with_adapters(1, bad.adapters));
    EXPECT_EQ(status.error_code(), bad.code) << bad.what << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(bad.message), std::string::npos) << bad.what << ": " << status.error_message();
    EXPECT_LT(status.error_message().size(), 1024u) << bad.what << ": the message never echoes what it refuses";
  }
  // A client may pin the file's version: another digest is refused naming the adapter.
  pb::SubmitJobRequest pinned = with_adapters(1, {{"style", 1.0}});
  pinned.mutable_spec()->mutable_params()->mutable_loras(0)->set_sha256(std::string(64, '0'));
  const grpc::Status status = submit_status(server_->client(), pinned);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_NE(status.error_message().find("adapter 'style' is not the file"), std::string::npos) << status.error_message();

  // POST /v1/videos takes `lora` as vLLM-Omni names it, and reads no path from a request; a list of 10,000 names
  // is refused before any is copied.
  std::string many_names = "style", many_objects = R"([{"name": "style"})";
  for (int i = 1; i < 10000; ++i) {
    many_names += ",style";
    many_objects += R"(,{"name": "style"})";
  }
  many_objects += "]";
  for (const auto& [body, expected] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": "a cat", "size": "48x32", "lora": "nosuch:0.5"})", "unknown adapter 'nosuch'"},
           {R"({"prompt": "a cat", "size": "48x32", "lora": {"name": "x", "path": "/etc/passwd"}})", "reads no path"},
           {R"({"prompt": "a cat", "size": "48x32", "lora": ")" + many_names + "\"}", "at most 8 adapters per request"},
           {R"({"prompt": "a cat", "size": "48x32", "lora": )" + many_objects + "}", "at most 8 adapters per request"}}) {
    const RawExchange http = post_json(http_port_, "/v1/videos", body);
    EXPECT_EQ(http.bytes.rfind("HTTP/1.1 400", 0), 0u) << http.bytes;
    EXPECT_NE(http.bytes.find(expected), std::string::npos) << http.bytes;
  }
  const pb::Job job = wait_job(server_->client(), submit(server_->client(), with_adapters(9, {{"subject", 1}})).job_id(),
                               180s);
  EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << "the server still serves: " << job.error().message();
}

std::set<std::string> replicas_of(const pb::Job& job) {
  return std::set<std::string>(job.chunk_replicas().begin(), job.chunk_replicas().end());
}

// Placement knows adapters: with one resident adapter per replica, a job goes where its adapter already is, and a job
// with another adapter goes to the replica whose adapter it would not push out.
TEST(ServedAdaptersPlacement, AJobRunsWhereItsAdapterIsResidentAndAnotherAdapterDoesNotEvictIt) {
  ServerProcess server({"--demo", "--devices", "cpu,cpu", "--dtype", "float32", "--lora-dir", setup().lora_dir,
                        "--max-resident-adapters", "1"});
  auto run = [&](uint64_t seed, const std::string& adapter) {
    const pb::Job job =
        wait_job(server.client(), submit(server.client(), with_adapters(seed, {{adapter, 1.0}})).job_id(), 180s);
    EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
    EXPECT_EQ(replicas_of(job).size(), 1u) << "its chunks stay where its adapter is";
    return job;
  };
  auto loads = [&] {
    auto ctx = server.client().context(10);
    pb::ServerInfo info;
    EXPECT_TRUE(server.client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
    int64_t total = 0;
    for (const auto& r : info.replicas()) total += r.adapter_loads();
    return total;
  };
  const pb::Job first = run(3321, "style");
  const pb::Job other = run(3322, "subject");
  EXPECT_NE(replicas_of(other), replicas_of(first)) << "subject would have pushed style out of its replica";
  const int64_t loads_before = loads();
  EXPECT_EQ(loads_before, 2);
  const pb::Job again = run(3323, "style");
  EXPECT_EQ(replicas_of(again), replicas_of(first)) << "style is resident there";
  EXPECT_EQ(loads(), loads_before) << "no adapter was read again";
}

// The same across pods: two servers of one replica each on one PostgreSQL. A claim leaves a job to the other pod's
// idle replica that holds its adapter (or would evict less), and a job's next chunk to the replica that ran the last.
TEST(ServedAdaptersPlacement, AcrossPodsAJobRunsWhereItsAdapterIsResident) {
  PgServer pg;
  ::setenv("SKYREELS_JOB_STORE", pg.url().c_str(), 1);
  std::vector<std::unique_ptr<ServerProcess>> pods;
  for (const char* name : {"pod-a", "pod-b"}) {
    pods.push_back(std::make_unique<ServerProcess>(std::vector<std::string>{
        "--demo", "--devices", "cpu", "--dtype", "float32", "--pod-name", name, "--lora-dir", setup().lora_dir,
        "--max-resident-adapters", "1"}));
  }
  ::unsetenv("SKYREELS_JOB_STORE");
  auto run = [&](uint64_t seed, const std::string& adapter) {
    ServerProcess& entry = *pods[seed % 2];  // submitted to either pod: the store is the queue
    const pb::Job job = wait_job(entry.client(), submit(entry.client(), with_adapters(seed, {{adapter, 1.0}})).job_id(),
                                 180s);
    EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
    EXPECT_EQ(replicas_of(job).size(), 1u) << "its chunks stay where its adapter is";
    return job;
  };
  auto loads = [&] {
    int64_t total = 0;
    for (auto& pod : pods) {
      auto ctx = pod->client().context(10);
      pb::ServerInfo info;
      EXPECT_TRUE(pod->client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
      for (const auto& r : info.replicas()) total += r.adapter_loads();
    }
    return total;
  };
  const pb::Job first = run(4321, "style");
  const pb::Job other = run(4322, "subject");
  EXPECT_NE(replicas_of(other), replicas_of(first)) << "subject would have pushed style out of its replica";
  EXPECT_EQ(loads(), 2);
  const pb::Job again = run(4323, "style");
  EXPECT_EQ(replicas_of(again), replicas_of(first)) << "style is resident on the other pod";
  EXPECT_EQ(loads(), 2) << "no adapter was read again";
}

// A job with adapters on a store that survives a SIGKILL: it resumes bit-identical; with its adapter file changed
// meanwhile, the resumed job fails naming the adapter instead of making another video.
std::vector<std::string> durable_args(const std::string& store, const std::string& lora_dir) {
  return {"--demo", "--devices", "cpu", "--dtype", "float32", "--lora-dir", lora_dir, "--enable-test-hooks",
          "--step-delay-ms", "60", "--job-store", "sqlite:" + store};
}

// Submits, waits for chunk 0 to finish, SIGKILLs the server; returns the job id.
std::string submit_and_kill_after_chunk_0(const std::vector<std::string>& args, const pb::SubmitJobRequest& request) {
  ServerProcess server(args);
  const std::string id = submit(server.client(), request).job_id();
  const auto events = watch_until(server.client(), id, 0, [](const pb::JobEvent& e) {
    return e.has_chunk_finished() && e.chunk_finished().chunk_index() == 0;
  });
  EXPECT_TRUE(!events.empty() && events.back().has_chunk_finished()) << "the job ended before chunk 0 finished";
  server.signal(SIGKILL);
  EXPECT_NE(server.wait_exit(10s), -1) << "the server did not die";
  return id;
}

TEST(ServedAdaptersDurable, AKilledJobResumesBitIdenticalAndAChangedAdapterFailsItByName) {
  // Their own directory: the second half rewrites a file.
  const std::string lora_dir = temp_dir("adapters-durable");
  std::filesystem::copy_file(setup().lora_dir + "/style.safetensors", lora_dir + "/style.safetensors");
  const pb::SubmitJobRequest request = with_adapters(3311, {{"style", 0.7}});
  {
    const std::string store = temp_dir("adapters-store") + "/jobs.sqlite";
    const std::string id = submit_and_kill_after_chunk_0(durable_args(store, lora_dir), request);
    ServerProcess restarted(durable_args(store, lora_dir));
    const pb::Job done = wait_job(restarted.client(), id, 180s);
    ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
    const at::Tensor served = download_latents(restarted.client(), id);
    const at::Tensor expected = generate_reference(request, lora_dir);
    EXPECT_TRUE(at::equal(served, expected)) << "max |resumed - generate| = " << max_abs_diff(served, expected);
  }
  {
    const std::string store = temp_dir("adapters-store") + "/jobs.sqlite";
    const std::string id = submit_and_kill_after_chunk_0(durable_args(store, lora_dir), request);
    write_adapter(lora_dir + "/style.safetensors", 99);  // the same name, other weights
    ServerProcess restarted(durable_args(store, lora_dir));
    const pb::Job done = wait_job(restarted.client(), id, 180s);
    EXPECT_EQ(done.state(), pb::JOB_STATE_FAILED);
    EXPECT_NE(done.error().message().find("adapter 'style' is not the file this job was accepted with"),
              std::string::npos)
        << done.error().message();
  }
}

// `cp other.safetensors FILE`: the same inode truncated and written again, as operators replace files in place.
void rewrite_in_place(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

pb::Job get_job(ServerProcess& server, const std::string& id) {
  auto ctx = server.client().context(10);
  pb::GetJobRequest request;
  request.set_job_id(id);
  pb::Job job;
  EXPECT_TRUE(server.client().stub().GetJob(ctx.get(), request, &job).ok());
  return job;
}

// A job accepted with one file computes with that file or fails naming it: the file replaced before the replica
// reads it fails that job (never a video of other weights; the replica is not blamed), a job without adapters still
// succeeds, and the next job naming the adapter takes the new file by its new digest, without a restart.
TEST(ServedAdaptersLive, AFileReplacedAfterItsJobWasAcceptedFailsThatJobByNameAndTheNextJobTakesTheNewFile) {
  const std::string lora_dir = temp_dir("adapters-replaced");
  std::filesystem::copy_file(setup().lora_dir + "/style.safetensors", lora_dir + "/style.safetensors");
  ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32", "--lora-dir", lora_dir,
                        "--enable-test-hooks", "--step-delay-ms", "200"});
  // A job without adapters holds the one replica for seconds (4 chunks of 3 steps of at least 200 ms)...
  const std::string plain = submit(server.client(), with_adapters(3332, {})).job_id();
  watch_until(server.client(), plain, 0, [](const pb::JobEvent& e) { return e.has_chunk_started(); });
  // ...while a job with `style` is accepted and its file replaced before any replica reads it.
  const std::string accepted = submit(server.client(), with_adapters(3331, {{"style", 1.0}})).job_id();
  write_adapter(lora_dir + "/style.safetensors", 98);
  const pb::Job failed = wait_job(server.client(), accepted, 180s);
  EXPECT_EQ(failed.state(), pb::JOB_STATE_FAILED);
  EXPECT_NE(failed.error().message().find("adapter 'style' is not the file this job was accepted with"),
            std::string::npos)
      << failed.error().message();
  EXPECT_EQ(failed.retries(), 0) << "the job's fault, not the replica's: " << failed.error().message();
  EXPECT_EQ(wait_job(server.client(), plain, 180s).state(), pb::JOB_STATE_SUCCEEDED);

  const pb::SubmitJobRequest next = with_adapters(3333, {{"style", 1.0}});
  const std::string id = submit(server.client(), next).job_id();
  const pb::Job done = wait_job(server.client(), id, 180s);
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  const pb::Job record = get_job(server, id);  // GetJob: the resolved params, with each adapter's digest
  ASSERT_EQ(record.params().loras_size(), 1) << record.DebugString();
  EXPECT_EQ(record.params().loras(0).sha256(), model::sha256_file(lora_dir + "/style.safetensors"));
  const at::Tensor served = download_latents(server.client(), id);
  const at::Tensor expected = generate_reference(next, lora_dir);  // the new file
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);
  auto ctx = server.client().context(10);
  pb::ServerInfo info;
  ASSERT_TRUE(server.client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  ASSERT_EQ(info.replicas_size(), 1);
  EXPECT_TRUE(info.replicas(0).healthy());
  EXPECT_EQ(info.replicas(0).failures(), 0);
}

// An adapter dropped into --lora-dir while serving: the first job naming it runs with it (equal to generate with
// it), and SIGHUP lists new files in GetServerInfo without a job.
TEST(ServedAdaptersLive, AnAdapterAddedWhileServingIsUsableWithoutARestartAndSighupListsIt) {
  const std::string lora_dir = temp_dir("adapters-added");
  std::filesystem::copy_file(setup().lora_dir + "/style.safetensors", lora_dir + "/style.safetensors");
  ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32", "--lora-dir", lora_dir});
  std::filesystem::copy_file(setup().lora_dir + "/subject.safetensors", lora_dir + "/subject.safetensors");
  const pb::SubmitJobRequest request = with_adapters(3341, {{"subject", 0.9}});
  const std::string id = submit(server.client(), request).job_id();
  const pb::Job done = wait_job(server.client(), id, 180s);
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  const at::Tensor served = download_latents(server.client(), id);
  const at::Tensor expected = generate_reference(request, lora_dir);
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);

  write_adapter(lora_dir + "/late.safetensors", 13);
  auto listed = [&] {
    auto ctx = server.client().context(10);
    pb::ServerInfo info;
    EXPECT_TRUE(server.client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
    std::set<std::string> names;
    for (const auto& a : info.model().adapters()) {
      if (a.available()) names.insert(a.name());
    }
    return names;
  };
  EXPECT_EQ(listed(), (std::set<std::string>{"style", "subject"}));
  server.signal(SIGHUP);
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (listed().count("late") == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(listed(), (std::set<std::string>{"late", "style", "subject"}));
}

// The bytes a job computes with are the bytes that were hashed: the adapter file and the model file rewritten in
// place (truncated, then other bytes) while a float32 job runs on CPU change nothing it computes and crash nothing.
// (Before, both were views of the files' private mappings: the job went on with the new bytes under the old digest,
// and some rewrites killed the server with SIGBUS.)
TEST(ServedAdaptersLive, AnAdapterAndTheModelRewrittenInPlaceUnderARunningJobChangeNothingItComputes) {
  const std::string dir = temp_dir("adapters-rewritten");
  const std::string lora_dir = dir + "/loras", model_dir = dir + "/model", kept = dir + "/kept";
  for (const auto& d : {lora_dir, kept}) std::filesystem::create_directories(d);
  std::filesystem::copy_file(setup().lora_dir + "/style.safetensors", lora_dir + "/style.safetensors");
  std::filesystem::copy_file(setup().lora_dir + "/style.safetensors", kept + "/style.safetensors");
  server::write_tiny_model(model_dir);
  ServerProcess server({"--model", model_dir, "--devices", "cpu", "--dtype", "float32", "--lora-dir", lora_dir,
                        "--enable-test-hooks", "--step-delay-ms", "100"});
  const pb::SubmitJobRequest request = with_adapters(3351, {{"style", 0.8}});
  const std::string id = submit(server.client(), request).job_id();
  watch_until(server.client(), id, 0, [](const pb::JobEvent& e) { return e.has_chunk_finished(); });
  const pb::Job accepted = get_job(server, id);  // the resolved params, with the digest it was accepted with
  ASSERT_EQ(accepted.params().loras_size(), 1) << accepted.DebugString();
  EXPECT_EQ(accepted.params().loras(0).sha256(), model::sha256_file(kept + "/style.safetensors"));

  const std::string other_adapter = dir + "/other.safetensors";
  write_adapter(other_adapter, 99);
  std::string model_file;
  for (const auto& entry : std::filesystem::directory_iterator(model_dir)) {
    if (entry.path().extension() == ".safetensors") model_file = entry.path().string();
  }
  ASSERT_FALSE(model_file.empty());
  const std::string model_bytes = bytes_of(model_file);
  rewrite_in_place(lora_dir + "/style.safetensors", "");  // truncated first, as `cp` does
  rewrite_in_place(model_file, model_bytes.substr(0, 64));
  std::this_thread::sleep_for(300ms);
  rewrite_in_place(lora_dir + "/style.safetensors", bytes_of(other_adapter));
  rewrite_in_place(model_file, std::string(model_bytes.size(), '\x7f'));

  const pb::Job done = wait_job(server.client(), id, 180s);
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  EXPECT_EQ(done.retries(), 0);
  const at::Tensor served = download_latents(server.client(), id);
  const at::Tensor expected = generate_reference(request, kept);  // the files as they were when it was accepted
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);
  EXPECT_EQ(get_job(server, id).state(), pb::JOB_STATE_SUCCEEDED) << "the server still answers";
}

TEST(ServedAdaptersStart, AServerWithoutLoraDirRefusesAdaptersAndStrictRefusesADamagedFile) {
  {
    ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32"});
    const grpc::Status status = submit_status(server.client(), with_adapters(1, {{"style", 1.0}}));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
    EXPECT_NE(status.error_message().find("start it with --lora-dir"), std::string::npos) << status.error_message();
  }
  ServerProcess strict({"--demo", "--devices", "cpu", "--lora-dir", setup().lora_dir, "--strict-adapters"}, false);
  EXPECT_EQ(strict.wait_exit(60s), 2) << strict.log();
  EXPECT_NE(strict.log().find("broken"), std::string::npos) << strict.log();
}

// Issue 46: a --lora-dir holding a file whose name is not UTF-8 and one whose header quotes bytes that are not UTF-8
// serves. Both are listed unavailable with their text escaped (\xNN) on the gRPC and the HTTP door, readiness is
// SERVING, and a job with the good adapter runs. (Before: the reason and the name went verbatim into proto3 strings,
// every GetServerInfo failed to parse on the client's side, and readiness, which called it, never said SERVING.)
TEST(ServedAdaptersStart, ALoraDirWithANonUtf8NameAndANonUtf8HeaderServesListingThemEscaped) {
  const std::string lora_dir = temp_dir("adapters-utf8");
  write_adapter(lora_dir + "/good.safetensors", 21);
  write_adapter(lora_dir + "/bad\xff.safetensors", 22);  // a fine adapter under a name no request can spell
  const std::string header = "{\"transformer.blocks.0.\xff\xfe\xc0\xaf\": 1}";  // not UTF-8: 0xff, 0xfe, overlong '/'
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  bytes += header;
  std::ofstream(lora_dir + "/garbled.safetensors", std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const int http_port = free_port();
  ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32", "--lora-dir", lora_dir, "--http-listen",
                        "127.0.0.1:" + std::to_string(http_port)});  // waits for readiness SERVING

  auto ctx = server.client().context(10);
  pb::ServerInfo info;
  const grpc::Status status = server.client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info);
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::map<std::string, pb::AvailableAdapter> adapters;
  for (const auto& a : info.model().adapters()) adapters[a.name()] = a;
  ASSERT_EQ(adapters.size(), 3u);
  EXPECT_TRUE(adapters["good"].available()) << adapters["good"].reason();
  ASSERT_EQ(adapters.count("bad\\xff"), 1u) << "the name's byte 0xff is listed as \\xff";
  EXPECT_FALSE(adapters["bad\\xff"].available());
  EXPECT_NE(adapters["bad\\xff"].reason().find("not valid UTF-8"), std::string::npos) << adapters["bad\\xff"].reason();
  EXPECT_FALSE(adapters["garbled"].available());
  EXPECT_NE(adapters["garbled"].reason().find("blocks.0.\\xff"), std::string::npos) << adapters["garbled"].reason();

  int code = 0;
  const std::string json = http_get(http_port, "/skyreels/v1/server-info", &code);
  EXPECT_EQ(code, 200) << json;
  EXPECT_NE(json.find("bad\\\\xff"), std::string::npos) << json;  // JSON writes the backslash as \\.

  const pb::Job job =
      wait_job(server.client(), submit(server.client(), with_adapters(3341, {{"good", 1.0}})).job_id(), 180s);
  EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  const grpc::Status bad = submit_status(server.client(), with_adapters(3342, {{"bad\\xff", 1.0}}));
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.error_message();
}

}  // namespace
}  // namespace skyreels::test
