// The real skyreels-server binary on 127.0.0.1 with two CPU replicas and the --demo model, driven over gRPC:
// results, concurrency, validation, cancellation, admission, faults, drain, health, reflection, metrics, API keys.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "model/safetensors.h"
#include "model/text_encoding.h"
#include "model/umt5_encoder.h"
#include "model/vae_wan.h"
#include "model/video_mp4.h"
#include "server/job/blob.h"
#include "server/replica/demo_model.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;

constexpr double kAtol = 1e-5;  // same math, other thread counts: float32 reductions may round differently

// ---- two CPU replicas, the demo model, float32 ------------------------------------------------------------------

class ServerTest : public SharedServerSuite<ServerTest> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    return std::make_unique<ServerProcess>(std::vector<std::string>{"--demo", "--devices", "cpu,cpu", "--dtype",
                                                                    "float32", "--handoff-cost-seconds", "0"});
  }
};

TEST_F(ServerTest, HealthReportsReadinessAndLiveness) {
  EXPECT_EQ(health_status(server_->address(), ""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(health_status(server_->address(), "liveness"), grpc::health::v1::HealthCheckResponse::SERVING);
  int code = 0;
  EXPECT_EQ(health_status(server_->address(), "no.such.Service", &code), -1);
  EXPECT_EQ(code, static_cast<int>(grpc::StatusCode::NOT_FOUND));
}

TEST_F(ServerTest, ReflectionListsTheVideoServiceAndHealth) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(server_->client().channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::set<std::string> services;
  for (const auto& s : response.list_services_response().service()) services.insert(s.name());
  EXPECT_TRUE(services.count("skyreels.v1.VideoService"));
  EXPECT_TRUE(services.count("grpc.health.v1.Health"));
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServerTest, ServerInfoDescribesTheModelAndBothReplicas) {
  auto ctx = server_->client().context(10);
  pb::ServerInfo info;
  ASSERT_TRUE(server_->client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.model().source(), "demo");
  EXPECT_EQ(info.model().text_dim(), 32);
  EXPECT_EQ(info.model().dtype(), "float32");
  ASSERT_EQ(info.replicas_size(), 2);
  EXPECT_EQ(info.replicas(0).name(), "cpu:0");
  EXPECT_EQ(info.replicas(1).name(), "cpu:1");
  for (const auto& r : info.replicas()) {
    EXPECT_TRUE(r.loaded() && r.healthy()) << r.name();
    EXPECT_GE(r.threads(), 1);
  }
  EXPECT_TRUE(info.ready());
  EXPECT_FALSE(info.text_encoder_available());
  EXPECT_FALSE(info.test_hooks_enabled());
  EXPECT_EQ(info.test_hooks_size(), 0);
}

// ---- two CPU replicas, each step slowed down so that submitted jobs overlap --------------------------------------

class HandoffServerTest : public SharedServerSuite<HandoffServerTest> {
 public:
  // 25 ms per step, 3 steps per chunk: a 4-chunk job runs >= 300 ms, far longer than submitting three jobs, so all
  // three compete and fairness must move one mid-video (without the delay a tiny-model job can end before the next
  // one arrives, and nothing moves).
  static std::unique_ptr<ServerProcess> start() {
    return std::make_unique<ServerProcess>(std::vector<std::string>{"--demo", "--devices", "cpu,cpu", "--dtype",
                                                                    "float32", "--handoff-cost-seconds", "0",
                                                                    "--enable-test-hooks", "--step-delay-ms", "25"});
  }
};

TEST_F(HandoffServerTest, LongVideosSplitAcrossReplicasEqualTheSingleProcessResult) {
  // Three 4-chunk videos on two replicas: chunks interleave, so jobs move between replicas mid-video.
  std::vector<pb::SubmitJobRequest> requests = {long_video_request(11), long_video_request(12), long_video_request(13)};
  requests[1].mutable_spec()->mutable_params()->mutable_scheduler()->set_solver_order(1);  // sampler settings travel
  requests[1].mutable_spec()->mutable_params()->mutable_scheduler()->set_lower_order_final(false);
  requests[2].mutable_spec()->mutable_params()->set_addnoise_condition(20);  // chunk-indexed condition noise too
  std::vector<std::string> ids;
  for (const auto& r : requests) ids.push_back(submit(server_->client(), r).job_id());
  int moved = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const pb::Job job = wait_job(server_->client(), ids[i]);
    ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
    ASSERT_EQ(job.chunks_total(), 4);
    std::set<std::string> replicas(job.chunk_replicas().begin(), job.chunk_replicas().end());
    moved += replicas.size() > 1 ? 1 : 0;
    const at::Tensor served = download_latents(server_->client(), ids[i]);
    const at::Tensor expected = reference_latents(requests[i]);
    const double diff = max_abs_diff(served, expected);
    std::cout << "job " << i << " chunks on " << ::testing::PrintToString(job.chunk_replicas()) << ", handoffs "
              << job.handoffs() << ": max |served - single process| = " << diff << "\n";
    EXPECT_TRUE(all_close(served, expected, kAtol)) << "job " << i << ", max diff " << diff;
  }
  EXPECT_GE(moved, 1) << "no job ran on both replicas; the handoff path was not exercised";
}

TEST_F(ServerTest, ConcurrentJobsFromManyClientsAllSucceed) {
  std::vector<std::thread> threads;
  std::vector<pb::Job> jobs(6);
  for (size_t i = 0; i < jobs.size(); ++i) {
    threads.emplace_back([&, i] {
      server::ConnectionOptions options;
      options.server = server_->address();
      server::Client client(options);
      const pb::Job submitted = submit(client, long_video_request(100 + i, 2));
      jobs[i] = wait_job(client, submitted.job_id());
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& job : jobs) EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.job_id();
}

TEST_F(ServerTest, WatchTellsQueuedStartedStepsChunksAndTheEnd) {
  const pb::Job job = submit(server_->client(), long_video_request(21, 2));
  auto ctx = server_->client().context(30);
  pb::WatchJobRequest request;
  request.set_job_id(job.job_id());
  auto reader = server_->client().stub().WatchJob(ctx.get(), request);
  std::vector<pb::JobEvent::EventCase> kinds;
  pb::JobEvent event;
  uint64_t sequence = 0;
  while (reader->Read(&event)) {
    EXPECT_EQ(event.sequence(), ++sequence);
    kinds.push_back(event.event_case());
  }
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_FALSE(kinds.empty());
  EXPECT_EQ(kinds.front(), pb::JobEvent::kQueued);
  EXPECT_EQ(kinds.back(), pb::JobEvent::kFinished);
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), pb::JobEvent::kChunkStarted), 4);
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), pb::JobEvent::kChunkFinished), 4);
  EXPECT_GE(std::count(kinds.begin(), kinds.end(), pb::JobEvent::kStep), 8) << "2 rows per chunk at least";
}

TEST_F(ServerTest, GenerateStreamsEventsAndEveryChunkOfTheResult) {
  pb::GenerateRequest request;
  *request.mutable_job() = long_video_request(31, 2);
  request.set_skip_steps(true);
  auto ctx = server_->client().context(60);
  auto reader = server_->client().stub().Generate(ctx.get(), request);
  pb::GenerateResponse item;
  std::vector<std::string> chunks;
  std::string current;
  std::string id;
  bool finished = false;
  while (reader->Read(&item)) {
    if (item.has_event()) {
      id = item.event().job_id();
      if (item.event().has_finished()) {
        finished = true;
        EXPECT_EQ(chunks.size(), 4u) << "every chunk arrives before the final event";
      }
    } else {
      current += item.result().data();
      if (item.result().last_part()) chunks.push_back(std::move(current)), current.clear();
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(finished);
  const at::Tensor streamed = [&] {
    const std::string joined = server::concat_latent_chunks(chunks);
    const auto view = server::parse_f32_tensor(joined, "latents");
    return at::from_blob(const_cast<char*>(view.data), view.shape, at::kFloat).clone();
  }();
  EXPECT_TRUE(at::equal(streamed, download_latents(server_->client(), id)));
}

TEST_F(ServerTest, IdempotencyKeyReturnsTheSameJobAndRefusesAnotherRequest) {
  pb::SubmitJobRequest request = long_video_request(41, 1);
  request.set_idempotency_key("demo-key-41");
  pb::SubmitJobResponse first, second;
  ASSERT_TRUE(submit_status(server_->client(), request, &first).ok());
  ASSERT_TRUE(submit_status(server_->client(), request, &second).ok());
  EXPECT_EQ(first.job().job_id(), second.job().job_id());
  EXPECT_TRUE(second.deduplicated());
  request.mutable_spec()->mutable_params()->set_seed(42);
  const grpc::Status conflict = submit_status(server_->client(), request);
  EXPECT_EQ(conflict.error_code(), grpc::StatusCode::ALREADY_EXISTS) << conflict.error_message();
}

TEST_F(ServerTest, JobWithoutSeedGetsARandomSeedRecordedInTheJob) {
  pb::SubmitJobRequest request = long_video_request(51, 1);
  request.mutable_spec()->mutable_params()->clear_seed();
  const pb::Job a = submit(server_->client(), request);
  const pb::Job b = submit(server_->client(), request);
  EXPECT_TRUE(a.params().has_seed());
  EXPECT_NE(a.params().seed(), b.params().seed());
  const pb::Job done = wait_job(server_->client(), a.job_id());
  EXPECT_EQ(done.params().seed(), a.params().seed());
  // Resubmitting with the recorded seed reproduces the video.
  request.mutable_spec()->mutable_params()->set_seed(a.params().seed());
  const pb::Job again = wait_job(server_->client(), submit(server_->client(), request).job_id());
  EXPECT_TRUE(
      at::equal(download_latents(server_->client(), a.job_id()), download_latents(server_->client(), again.job_id())));
}

TEST_F(ServerTest, ListJobsPagesThroughJobsOldestFirst) {
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(submit(server_->client(), long_video_request(60 + i, 1)).job_id());
  std::vector<std::string> listed;
  std::string token;
  do {
    pb::ListJobsRequest request;
    request.set_page_size(2);
    request.set_page_token(token);
    pb::ListJobsResponse response;
    auto ctx = server_->client().context(10);
    ASSERT_TRUE(server_->client().stub().ListJobs(ctx.get(), request, &response).ok());
    for (const auto& j : response.jobs()) listed.push_back(j.job_id());
    token = response.next_page_token();
  } while (!token.empty());
  std::vector<size_t> positions;
  for (const auto& id : ids) {
    const auto it = std::find(listed.begin(), listed.end(), id);
    ASSERT_NE(it, listed.end()) << id;
    positions.push_back(static_cast<size_t>(it - listed.begin()));
  }
  EXPECT_TRUE(std::is_sorted(positions.begin(), positions.end()));
}

struct BadInput {
  std::string name;
  std::function<void(pb::SubmitJobRequest&)> mutate;
  grpc::StatusCode code;
  std::string field;  // the message must start with it
};

TEST_F(ServerTest, EveryBadInputIsRefusedWithItsStatusNamingTheField) {
  auto params = [](pb::SubmitJobRequest& r) { return r.mutable_spec()->mutable_params(); };
  auto prompt = [](pb::SubmitJobRequest& r) { return r.mutable_spec()->mutable_embeddings()->mutable_prompt_embeds(); };
  const grpc::StatusCode invalid = grpc::StatusCode::INVALID_ARGUMENT;
  // The Euler sampler with a timestep list (num_inference_steps left to the list unless `steps`).
  auto euler = [&](pb::SubmitJobRequest& r, const std::vector<int64_t>& list, int64_t steps = 0) {
    auto* scheduler = params(r)->mutable_scheduler();
    scheduler->set_type("euler");
    for (int64_t t : list) scheduler->add_timesteps(t);
    if (steps > 0) {
      params(r)->set_num_inference_steps(steps);
    } else {
      params(r)->clear_num_inference_steps();
    }
  };
  std::vector<int64_t> ten_thousand(10000);
  for (size_t i = 0; i < ten_thousand.size(); ++i) ten_thousand[i] = 1000 - static_cast<int64_t>(i % 1000);
  const std::vector<BadInput> cases = {
      {"timestep list of 10,000", [&](auto& r) { euler(r, ten_thousand); }, invalid, "scheduler.timesteps"},
      {"timestep repeated", [&](auto& r) { euler(r, {1000, 750, 750}); }, invalid, "scheduler.timesteps"},
      {"timesteps increasing", [&](auto& r) { euler(r, {250, 500, 1000}); }, invalid, "scheduler.timesteps"},
      {"timestep zero", [&](auto& r) { euler(r, {1000, 500, 0}); }, invalid, "scheduler.timesteps"},
      {"timestep over num_train_timesteps", [&](auto& r) { euler(r, {1001, 500}); }, invalid, "scheduler.timesteps"},
      {"first timestep not an integer after the shift", [&](auto& r) { euler(r, {999, 500}); }, invalid,
       "scheduler.timesteps"},
      {"timestep list with UniPC",
       [&](auto& r) {
         euler(r, {1000, 750, 500, 250});
         params(r)->mutable_scheduler()->set_type("unipc");
       },
       invalid, "scheduler.timesteps"},
      {"timestep list against explicit steps", [&](auto& r) { euler(r, {1000, 750, 500, 250}, 3); }, invalid,
       "scheduler.timesteps"},
      {"unknown sampler", [&](auto& r) { params(r)->mutable_scheduler()->set_type("ddim"); }, invalid,
       "scheduler.type"},
      {"frames not 4k+1", [&](auto& r) { params(r)->set_num_frames(36); }, invalid, "num_frames"},
      {"frames over --max-frames", [&](auto& r) { params(r)->set_num_frames(100001); }, invalid, "num_frames"},
      {"height not a multiple of 16", [&](auto& r) { params(r)->set_height(40); }, invalid, "height"},
      {"width over --max-width", [&](auto& r) { params(r)->set_width(4096); }, invalid, "width"},
      {"zero steps", [&](auto& r) { params(r)->set_num_inference_steps(0); }, invalid, "num_inference_steps"},
      {"steps over --max-steps", [&](auto& r) { params(r)->set_num_inference_steps(101); }, invalid,
       "num_inference_steps"},
      {"negative guidance", [&](auto& r) { params(r)->set_guidance_scale(-1); }, invalid, "guidance_scale"},
      {"NaN shift", [&](auto& r) { params(r)->set_flow_shift(std::nan("")); }, invalid, "flow_shift"},
      {"fps zero", [&](auto& r) { params(r)->set_fps(0); }, invalid, "fps"},
      {"long video without overlap", [&](auto& r) { params(r)->clear_overlap_history(); }, invalid, "overlap_history"},
      {"overlap not below base", [&](auto& r) { params(r)->set_overlap_history(17); }, invalid, "overlap_history"},
      {"block size not dividing the chunks", [&](auto& r) { params(r)->set_causal_block_size(2); }, invalid,
       "base_num_frames"},
      {"unknown solver type", [&](auto& r) { params(r)->mutable_scheduler()->set_solver_type("bh3"); }, invalid,
       "scheduler.solver_type"},
      {"ar_step over the step count", [&](auto& r) { params(r)->set_ar_step(2); }, invalid, "ar_step"},
      {"addnoise out of range", [&](auto& r) { params(r)->set_addnoise_condition(5000); }, invalid,
       "addnoise_condition"},
      {"wrong text_dim", [&](auto& r) { *prompt(r) = server::random_embeddings(16, 31, 1); }, invalid, "prompt_embeds"},
      {"batch of two", [&](auto& r) { prompt(r)->set_shape(0, 2); }, invalid, "prompt_embeds"},
      {"2-D embeddings",
       [&](auto& r) {
         prompt(r)->clear_shape();
         prompt(r)->add_shape(16);
         prompt(r)->add_shape(32);
       },
       invalid, "prompt_embeds"},
      {"too many tokens", [&](auto& r) { *prompt(r) = server::random_embeddings(513, 32, 1); }, invalid,
       "prompt_embeds"},
      {"no dtype", [&](auto& r) { prompt(r)->set_dtype(pb::DTYPE_UNSPECIFIED); }, invalid, "prompt_embeds"},
      {"short data", [&](auto& r) { prompt(r)->mutable_data()->resize(10); }, invalid, "prompt_embeds"},
      {"NaN in embeddings",
       [&](auto& r) {
         float nan = std::nanf("");
         prompt(r)->mutable_data()->replace(0, 4, reinterpret_cast<const char*>(&nan), 4);
       },
       invalid, "prompt_embeds"},
      {"guidance without negative",
       [&](auto& r) { r.mutable_spec()->mutable_embeddings()->clear_negative_prompt_embeds(); }, invalid,
       "negative_prompt_embeds"},
      {"garbage safetensors", [&](auto& r) { r.mutable_spec()->set_embeddings_safetensors("not a safetensors file"); },
       invalid, "embeddings_safetensors"},
      {"no conditioning", [&](auto& r) { r.mutable_spec()->clear_conditioning(); }, invalid, "conditioning"},
      {"priority out of range", [&](auto& r) { r.set_priority(11); }, invalid, "priority"},
      {"negative timeout", [&](auto& r) { r.mutable_timeout()->set_seconds(-1); }, invalid, "timeout"},
      {"text without encoder", [&](auto& r) { r.mutable_spec()->mutable_text()->set_prompt("a cat"); },
       grpc::StatusCode::FAILED_PRECONDITION, "text"},
  };
  const double rejected_before = metric_value(http_get(server_->metrics_port(), "/metrics"),
                                              "skyreels_jobs_rejected_total{reason=\"invalid_argument\"}");
  for (const auto& c : cases) {
    pb::SubmitJobRequest request = long_video_request(70, 1);
    c.mutate(request);
    const grpc::Status status = submit_status(server_->client(), request);
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    EXPECT_EQ(status.error_message().rfind(c.field, 0), 0u)
        << c.name << ": message does not start with '" << c.field << "': " << status.error_message();
  }
  const double rejected_after = metric_value(http_get(server_->metrics_port(), "/metrics"),
                                             "skyreels_jobs_rejected_total{reason=\"invalid_argument\"}");
  EXPECT_EQ(rejected_after - rejected_before, static_cast<double>(cases.size() - 1));

  // Unknown ids, bad downloads.
  auto ctx = server_->client().context(10);
  pb::GetJobRequest get;
  get.set_job_id("j-doesnotexist");
  pb::Job job;
  EXPECT_EQ(server_->client().stub().GetJob(ctx.get(), get, &job).error_code(), grpc::StatusCode::NOT_FOUND);
  const pb::Job done = wait_job(server_->client(), submit(server_->client(), long_video_request(71, 1)).job_id());
  EXPECT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << "the server still serves after every bad request";
  pb::DownloadResultRequest mp4;
  mp4.set_job_id(done.job_id());
  mp4.set_format(pb::RESULT_FORMAT_MP4);
  EXPECT_EQ(server::download_chunks(server_->client(), mp4, [](int32_t, int32_t, std::string) {}).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  pb::DownloadResultRequest out_of_range;
  out_of_range.set_job_id(done.job_id());
  out_of_range.set_from_chunk(4);
  EXPECT_EQ(server::download_chunks(server_->client(), out_of_range, [](int32_t, int32_t, std::string) {}).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ServerTest, OversizedRequestIsRefusedByTheTransport) {
  pb::SubmitJobRequest request = long_video_request(80, 1);
  request.mutable_spec()->mutable_embeddings()->mutable_prompt_embeds()->mutable_data()->resize(70u << 20);
  const grpc::Status status = submit_status(server_->client(), request);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_EQ(health_status(server_->address(), ""), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(ServerTest, MetricsExposeEveryContractMetric) {
  wait_job(server_->client(), submit(server_->client(), long_video_request(90, 1)).job_id());
  int status = 0;
  const std::string text = http_get(server_->metrics_port(), "/metrics", &status);
  EXPECT_EQ(status, 200);
  for (const char* name : {"skyreels_jobs_submitted_total",
                           "skyreels_jobs_finished_total{outcome=\"succeeded\"}",
                           "skyreels_jobs_finished_total{outcome=\"failed\"}",
                           "skyreels_jobs_finished_total{outcome=\"cancelled\"}",
                           "skyreels_jobs_finished_total{outcome=\"deadline_exceeded\"}",
                           "skyreels_jobs_rejected_total{reason=\"invalid_argument\"}",
                           "skyreels_jobs_rejected_total{reason=\"queue_full\"}",
                           "skyreels_jobs_rejected_total{reason=\"unauthenticated\"}",
                           "skyreels_jobs_rejected_total{reason=\"draining\"}",
                           "skyreels_jobs_running",
                           "skyreels_queue_depth",
                           "skyreels_queue_wait_seconds_count",
                           "skyreels_chunk_duration_seconds_count{replica=\"cpu:0\"}",
                           "skyreels_step_duration_seconds_count{replica=\"cpu:1\"}",
                           "skyreels_frames_generated_total",
                           "skyreels_replica_busy{replica=\"cpu:0\"}",
                           "skyreels_replica_healthy{replica=\"cpu:1\"}",
                           "skyreels_chunk_handoffs_total",
                           "skyreels_chunk_retries_total",
                           "skyreels_replicas_ready",
                           "skyreels_build_info{version=\"0.1.0\"}"}) {
    EXPECT_FALSE(std::isnan(metric_value(text, name))) << name << " missing from /metrics";
  }
  EXPECT_GE(metric_value(text, "skyreels_jobs_submitted_total"), 1);
  EXPECT_GE(metric_value(text, "skyreels_frames_generated_total"), 37);
  // What a finished job moves (besides the counts above).
  EXPECT_GE(metric_value(text, "skyreels_job_duration_seconds_count{outcome=\"succeeded\"}"), 1);
  EXPECT_GE(metric_value(text, "skyreels_time_to_first_chunk_seconds_count"), 1);
  EXPECT_GE(metric_value(text, "skyreels_queue_wait_seconds_count"), 1);
  EXPECT_GE(metric_value(text, "skyreels_model_load_seconds_count{component=\"transformer\"}"), 2) << "each replica";
  const std::string submit_rpc =
      "{grpc_method=\"SubmitJob\",grpc_service=\"skyreels.v1.VideoService\",grpc_type=\"unary\"}";
  EXPECT_GE(metric_value(text, "grpc_server_started_total" + submit_rpc), 1);
  EXPECT_GE(metric_value(text, "grpc_server_handling_seconds_count" + submit_rpc), 1);
  EXPECT_GE(metric_value(text, "grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"SubmitJob\","
                               "grpc_service=\"skyreels.v1.VideoService\",grpc_type=\"unary\"}"),
            1);
  EXPECT_EQ(metric_value(text, "skyreels_replicas_ready"), 2);
  EXPECT_EQ(metric_value(text, "skyreels_replica_healthy{replica=\"cpu:0\"}"), 1);
  EXPECT_EQ(metric_value(text, "skyreels_test_hooks_enabled"), 0) << "started without --enable-test-hooks";
  http_get(server_->metrics_port(), "/other", &status);
  EXPECT_EQ(status, 404);
}

// ---- slow steps: cancellation, deadlines, a full queue ----------------------------------------------------------

class SlowServerTest : public SharedServerSuite<SlowServerTest> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    return std::make_unique<ServerProcess>(std::vector<std::string>{
        "--demo", "--devices", "cpu,cpu", "--enable-test-hooks", "--step-delay-ms", "40", "--max-queue", "3"});
  }
};

TEST_F(SlowServerTest, CancellingARunningJobStopsItAtTheNextStep) {
  const pb::Job job = submit(server_->client(), long_video_request(200, 50));  // ~2 s per chunk, 4 chunks
  first_event_of_type(server_->client(), job.job_id(), pb::JobEvent::kStep);
  const auto t0 = std::chrono::steady_clock::now();
  pb::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  pb::Job response;
  auto ctx = server_->client().context(10);
  ASSERT_TRUE(server_->client().stub().CancelJob(ctx.get(), cancel, &response).ok());
  const pb::Job done = wait_job(server_->client(), job.job_id());
  EXPECT_EQ(done.state(), pb::JOB_STATE_CANCELLED);
  EXPECT_EQ(done.error().code(), static_cast<int>(grpc::StatusCode::CANCELLED));
  EXPECT_LT(done.chunks_done(), 4);
  // A step is 40 ms, the chunk's end ~2 s away: a second leaves room for a loaded machine and still tells them apart.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "stopped at a step boundary, not at the chunk's end";
}

TEST_F(SlowServerTest, JobPastItsDeadlineEndsDeadlineExceeded) {
  pb::SubmitJobRequest request = long_video_request(201, 20);
  request.mutable_timeout()->set_nanos(300000000);  // 0.3 s, the video needs ~3 s
  const pb::Job done = wait_job(server_->client(), submit(server_->client(), request).job_id());
  EXPECT_EQ(done.state(), pb::JOB_STATE_DEADLINE_EXCEEDED);
  EXPECT_EQ(done.error().code(), static_cast<int>(grpc::StatusCode::DEADLINE_EXCEEDED));
}

TEST_F(SlowServerTest, FullQueueAnswersResourceExhaustedWithARetryHint) {
  std::vector<std::string> admitted;
  grpc::Status status;
  std::string retry_after;
  for (int i = 0; i < 10 && status.ok(); ++i) {
    pb::SubmitJobResponse response;
    status = submit_status(server_->client(), long_video_request(210 + i, 20), &response, &retry_after);
    if (status.ok()) admitted.push_back(response.job().job_id());
  }
  EXPECT_EQ(admitted.size(), 3u) << "--max-queue 3";
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  ASSERT_FALSE(retry_after.empty()) << "trailing metadata retry-after-ms";
  EXPECT_GE(std::stoll(retry_after), 1000);
  const std::string text = http_get(server_->metrics_port(), "/metrics");
  EXPECT_GE(metric_value(text, "skyreels_jobs_rejected_total{reason=\"queue_full\"}"), 1);
  EXPECT_GE(metric_value(text, "skyreels_queue_depth") + metric_value(text, "skyreels_jobs_running"), 3);
  EXPECT_GE(metric_value(text, "skyreels_global_queue_depth"), 1) << "3 admitted, 2 replicas: one job waits";
  for (const auto& id : admitted) {
    pb::CancelJobRequest cancel;
    cancel.set_job_id(id);
    pb::Job job;
    auto ctx = server_->client().context(10);
    server_->client().stub().CancelJob(ctx.get(), cancel, &job);
  }
  for (const auto& id : admitted) EXPECT_EQ(wait_job(server_->client(), id).state(), pb::JOB_STATE_CANCELLED);
}

// ---- fault injection: the second replica fails every chunk --------------------------------------------------------

TEST(FaultServerTest, ChunksFailingOnAReplicaAreRetriedElsewhereWithAnUnchangedResultAndTheReplicaIsTakenOut) {
  ServerProcess server({"--demo", "--devices", "cpu,cpu", "--dtype", "float32", "--enable-test-hooks", "--fault-inject",
                        "cpu:1@1+", "--replica-failure-limit", "2", "--chunk-retries", "2", "--handoff-cost-seconds",
                        "0"});
  std::vector<pb::SubmitJobRequest> requests;
  std::vector<std::string> ids;
  for (uint64_t seed : {301, 302, 303}) {
    requests.push_back(long_video_request(seed));
    ids.push_back(submit(server.client(), requests.back()).job_id());
  }
  int retries = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const pb::Job job = wait_job(server.client(), ids[i]);
    ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
    retries += job.retries();
    for (const auto& r : job.chunk_replicas()) EXPECT_EQ(r, "cpu:0") << "no chunk can succeed on cpu:1";
    EXPECT_TRUE(all_close(download_latents(server.client(), ids[i]), reference_latents(requests[i]), kAtol)) << i;
  }
  EXPECT_EQ(retries, 2) << "cpu:1 failed twice, then was taken out";
  auto ctx = server.client().context(10);
  pb::ServerInfo info;
  ASSERT_TRUE(server.client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  EXPECT_TRUE(info.replicas(0).healthy());
  EXPECT_FALSE(info.replicas(1).healthy());
  EXPECT_NE(info.replicas(1).error().find("injected fault"), std::string::npos) << info.replicas(1).error();
  const std::string text = http_get(server.metrics_port(), "/metrics");
  EXPECT_EQ(metric_value(text, "skyreels_replica_healthy{replica=\"cpu:1\"}"), 0);
  EXPECT_EQ(metric_value(text, "skyreels_replicas_ready"), 1);
  EXPECT_EQ(metric_value(text, "skyreels_chunk_retries_total"), 2);
  EXPECT_EQ(health_status(server.address(), ""), grpc::health::v1::HealthCheckResponse::SERVING)
      << "one healthy replica still serves";
}

// Each replica's second chunk fails: the job's chunk 1 fails where chunk 0 ran (its payload keeps it there), and its
// retry runs on the other replica, whose previous chunk for this job ran elsewhere: a handoff; chunk 2 the same way
// back. The video is unchanged.
TEST(FaultServerTest, AChunkRetriedOnTheOtherReplicaCountsAHandoff) {
  ServerProcess server({"--demo", "--devices", "cpu,cpu", "--dtype", "float32", "--enable-test-hooks", "--fault-inject",
                        "cpu:0@2,cpu:1@2", "--replica-failure-limit", "3", "--chunk-retries", "2"});
  const pb::SubmitJobRequest request = long_video_request(311);
  const pb::Job job = wait_job(server.client(), submit(server.client(), request).job_id());
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  EXPECT_EQ(job.retries(), 2);
  EXPECT_TRUE(all_close(download_latents(server.client(), job.job_id()), reference_latents(request), kAtol));
  const std::string text = http_get(server.metrics_port(), "/metrics");
  EXPECT_EQ(metric_value(text, "skyreels_chunk_handoffs_total"), 2) << "each retry moved the job";
  EXPECT_EQ(metric_value(text, "skyreels_chunk_retries_total"), 2);
}

// ---- LoRA adapters (issue 23) -----------------------------------------------------------------------------------

TEST(LoraServerTest, GetServerInfoAndBuildInfoListTheAdaptersInEffect) {
  const std::string model = golden_path("transformer_forward/t1_tiny_df_fps/weights/diffusers");
  const std::string musubi = data_path("lora/musubi_format.safetensors");
  const std::string original = data_path("lora/original_format.safetensors");
  ServerProcess server({"--model", model, "--devices", "cpu", "--lora", musubi + ":0.5", "--lora", original});
  auto ctx = server.client().context(10);
  pb::ServerInfo info;
  ASSERT_TRUE(server.client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  ASSERT_EQ(info.model().loras_size(), 2);
  EXPECT_EQ(info.model().loras(0).path(), musubi);
  EXPECT_EQ(info.model().loras(0).scale(), 0.5);
  EXPECT_EQ(info.model().loras(0).format(), "musubi");
  EXPECT_EQ(info.model().loras(0).parameters(), 20);
  EXPECT_EQ(info.model().loras(0).max_rank(), 4);
  EXPECT_EQ(info.model().loras(1).format(), "original");
  EXPECT_EQ(info.model().loras(1).scale(), 1.0);
  const std::string text = http_get(server.metrics_port(), "/metrics");
  EXPECT_NE(text.find("skyreels_build_info{loras=\"musubi_format.safetensors:0.5,original_format.safetensors:1\","),
            std::string::npos)
      << text.substr(0, 2000);
}

TEST(LoraServerTest, ADamagedAdapterStopsTheStartNamingItsKey) {
  const std::string bad = temp_dir("lora") + "/bad.safetensors";
  auto tensors = load_tensors(data_path("lora/musubi_format.safetensors"));
  tensors.erase("lora_unet_blocks_1_ffn_2.alpha");
  safetensors::save(bad, {tensors.begin(), tensors.end()});
  ServerProcess server({"--model", golden_path("transformer_forward/t1_tiny_df_fps/weights/diffusers"), "--devices",
                        "cpu", "--lora", bad},
                       false);
  EXPECT_NE(server.wait_exit(60s), 0);
  EXPECT_NE(server.log().find("key 'lora_unet_blocks_1_ffn_2.lora_down.weight': module 'blocks_1_ffn_2' has no "
                              "'.alpha'"),
            std::string::npos)
      << server.log();
}

// ---- drain on SIGTERM -------------------------------------------------------------------------------------------

TEST(DrainTest, SigtermRefusesNewJobsFinishesAcceptedOnesAndExitsZero) {
  ServerProcess server({"--demo", "--devices", "cpu,cpu", "--enable-test-hooks", "--step-delay-ms", "20"});
  std::vector<std::string> ids;
  for (uint64_t seed : {400, 401, 402}) ids.push_back(submit(server.client(), long_video_request(seed, 5)).job_id());
  first_event_of_type(server.client(), ids[0], pb::JobEvent::kStep);
  server.signal(SIGTERM);
  // Event-based: readiness turns NOT_SERVING within the main loop's 100 ms poll; 5 s covers a loaded machine.
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (health_status(server.address(), "") != grpc::health::v1::HealthCheckResponse::NOT_SERVING &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(health_status(server.address(), ""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(health_status(server.address(), "liveness"), grpc::health::v1::HealthCheckResponse::SERVING);
  const grpc::Status refused = submit_status(server.client(), long_video_request(403, 1));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  for (const auto& id : ids) {
    EXPECT_EQ(wait_job(server.client(), id).state(), pb::JOB_STATE_SUCCEEDED) << "accepted jobs, queued ones too";
  }
  EXPECT_EQ(server.wait_exit(15s), 0) << server.log();
  EXPECT_NE(server.log().find("event=shutdown"), std::string::npos);
}

TEST(DrainTest, JobsStillRunningAtTheDrainTimeoutEndUnavailable) {
  ServerProcess server(
      {"--demo", "--devices", "cpu", "--enable-test-hooks", "--step-delay-ms", "50", "--drain-timeout-seconds", "1"});
  const std::string id = submit(server.client(), long_video_request(410, 50)).job_id();  // ~10 s of work
  first_event_of_type(server.client(), id, pb::JobEvent::kStep);
  server.signal(SIGTERM);
  const pb::Job job = wait_job(server.client(), id);
  EXPECT_EQ(job.state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(job.error().code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  EXPECT_NE(job.error().message().find("drain timeout"), std::string::npos);
  EXPECT_EQ(server.wait_exit(15s), 0) << server.log();
}

// ---- API keys (and TLS) -------------------------------------------------------------------------------------------

class AuthServerTest : public SharedServerSuite<AuthServerTest> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    const std::string dir = temp_dir("api-keys");
    std::ofstream(dir + "/keys")
        << "# test keys\nalice-key-0123456789abcdef0123456789 alice\nbob-key-0123456789abcdef0123456789ab bob\n";
    return std::make_unique<ServerProcess>(
        std::vector<std::string>{"--demo", "--devices", "cpu,cpu", "--api-keys", dir + "/keys"}, true,
        "alice-key-0123456789abcdef0123456789");
  }
};

TEST_F(AuthServerTest, MissingOrWrongKeyIsUnauthenticated) {
  for (const std::string key : {"", "wrong-key-0123456789abcdef0123456789"}) {
    auto client = server_->client_with_key(key);
    const grpc::Status status = submit_status(*client, long_video_request(500, 1));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "key '" << key << "'";
    auto ctx = client->context(10);
    pb::ListJobsResponse list;
    EXPECT_EQ(client->stub().ListJobs(ctx.get(), pb::ListJobsRequest(), &list).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(health_status(server_->address(), ""), grpc::health::v1::HealthCheckResponse::SERVING)
      << "probes need no key";
  EXPECT_GE(metric_value(http_get(server_->metrics_port(), "/metrics"),
                         "skyreels_jobs_rejected_total{reason=\"unauthenticated\"}"),
            2);
}

TEST_F(AuthServerTest, AnotherClientsJobIsNotFoundForEveryCall) {
  const pb::Job job = submit(server_->client(), long_video_request(501, 1));  // alice's
  auto bob = server_->client_with_key("bob-key-0123456789abcdef0123456789ab");
  pb::Job out;
  {
    auto ctx = bob->context(10);
    pb::GetJobRequest r;
    r.set_job_id(job.job_id());
    EXPECT_EQ(bob->stub().GetJob(ctx.get(), r, &out).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    auto ctx = bob->context(10);
    pb::CancelJobRequest r;
    r.set_job_id(job.job_id());
    EXPECT_EQ(bob->stub().CancelJob(ctx.get(), r, &out).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    auto ctx = bob->context(10);
    pb::WatchJobRequest r;
    r.set_job_id(job.job_id());
    auto reader = bob->stub().WatchJob(ctx.get(), r);
    pb::JobEvent e;
    EXPECT_FALSE(reader->Read(&e));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    pb::DownloadResultRequest r;
    r.set_job_id(job.job_id());
    EXPECT_EQ(server::download_chunks(*bob, r, [](int32_t, int32_t, std::string) {}).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    auto ctx = bob->context(10);
    pb::ListJobsResponse list;
    ASSERT_TRUE(bob->stub().ListJobs(ctx.get(), pb::ListJobsRequest(), &list).ok());
    for (const auto& j : list.jobs()) EXPECT_NE(j.job_id(), job.job_id());
  }
  EXPECT_EQ(wait_job(server_->client(), job.job_id()).state(), pb::JOB_STATE_SUCCEEDED) << "alice still sees it";
  EXPECT_TRUE(download_latents(server_->client(), job.job_id()).defined());
}

TEST(TlsServerTest, ServesOverTlsWithTheGivenCertificate) {
  // openssl is one of scripts/setup.sh's packages: without it the test fails rather than skips.
  ASSERT_EQ(run_command("openssl version"), 0) << "openssl command not available to make a certificate";
  const std::string dir = temp_dir("tls");
  ASSERT_EQ(run_command("openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext "
                        "subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
                        dir + "/key.pem -out " + dir + "/cert.pem"),
            0);
  ServerProcess server({"--demo", "--devices", "cpu", "--tls-cert", dir + "/cert.pem", "--tls-key", dir + "/key.pem"},
                       false);
  server::ConnectionOptions options;
  options.server = server.address();
  options.tls = true;
  options.tls_ca = dir + "/cert.pem";
  server::Client client(options);
  std::string why;
  ASSERT_TRUE(client.wait_ready(30, &why)) << why << "\n" << server.log();
  EXPECT_EQ(wait_job(client, submit(client, long_video_request(600, 1)).job_id()).state(), pb::JOB_STATE_SUCCEEDED);
  EXPECT_NE(health_status(server.address(), ""), grpc::health::v1::HealthCheckResponse::SERVING)
      << "a plaintext client cannot talk to the TLS port";
}

// ---- the optional parts: VAE (MP4 results) and text encoder (text prompts) -----------------------------------------

TEST(VideoServerTest, Mp4ResultDecodedChunkByChunkMatchesDecodingTheWholeLatentVideo) {
  ServerProcess server({"--demo", "--vae", "demo", "--devices", "cpu,cpu", "--dtype", "float32"});
  pb::SubmitJobRequest request = long_video_request(700, 2);
  request.mutable_spec()->mutable_params()->set_height(64);
  request.mutable_spec()->mutable_params()->set_width(64);
  const pb::Job job = wait_job(server.client(), submit(server.client(), request).job_id());
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(job.video_available());

  pb::DownloadResultRequest download;
  download.set_job_id(job.job_id());
  download.set_format(pb::RESULT_FORMAT_MP4);
  std::string mp4;
  int chunks = 0;
  ASSERT_TRUE(server::download_chunks(server.client(), download, [&](int32_t, int32_t, std::string bytes) {
                ++chunks;
                mp4 += bytes;
              }).ok());
  EXPECT_EQ(chunks, 4);
  const auto decoded = video::read_video_bytes(std::vector<uint8_t>(mp4.begin(), mp4.end()));
  EXPECT_EQ(decoded.info.codec, "h264");
  EXPECT_EQ(decoded.info.width, 64);
  EXPECT_EQ(decoded.info.height, 64);
  ASSERT_EQ(decoded.info.frames, 37) << "the joined chunks are one playable video of every frame";

  // Generate streams the same MP4 fragments inline.
  pb::GenerateRequest generate;
  *generate.mutable_job() = request;
  generate.set_format(pb::RESULT_FORMAT_MP4);
  generate.set_skip_steps(true);
  auto ctx = server.client().context(60);
  auto reader = server.client().stub().Generate(ctx.get(), generate);
  pb::GenerateResponse item;
  std::string streamed;
  while (reader->Read(&item)) {
    if (item.has_result()) {
      EXPECT_EQ(item.result().format(), pb::RESULT_FORMAT_MP4);
      streamed += item.result().data();
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(video::read_video_bytes(std::vector<uint8_t>(streamed.begin(), streamed.end())).info.frames, 37);

  // The same latents decoded in one go by the same tiny VAE: equal up to what H.264 loses on this (noise-like,
  // random-model) content anyway, measured by encoding the whole decoded video once.
  const std::string dir = temp_dir("tiny-vae");
  server::write_tiny_vae(dir);
  const model::WanVae vae = model::WanVae::load(dir);
  const at::Tensor latents = download_latents(server.client(), job.job_id());
  const at::Tensor whole = vae.decode(vae.denormalize(latents));
  const at::Tensor expected = video::to_rgb_uint8(whole.select(0, 0));
  const auto codec_only = video::read_video_bytes(video::encode_mp4_segment(whole.select(0, 0)));
  const double codec_psnr = video::psnr(codec_only.frames, expected);
  EXPECT_GT(video::psnr(decoded.frames, expected), codec_psnr - 1.0) << "codec alone: " << codec_psnr << " dB";
}

TEST(TextServerTest, TextPromptGivesTheVideoOfItsEncodedEmbeddings) {
  const std::string encoder_dir = temp_dir("tiny-umt5");
  model::write_tiny_text_encoder(encoder_dir, 32, 7);  // d_model = the demo transformer's text_dim
  const std::string tokenizer = golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer");
  ServerProcess server({"--demo", "--devices", "cpu,cpu", "--dtype", "float32", "--text-encoder", encoder_dir,
                        "--tokenizer", tokenizer});
  pb::SubmitJobRequest by_text = long_video_request(800, 2);
  by_text.mutable_spec()->mutable_text()->set_prompt("A cat walks on the grass, realistic style.");
  const pb::Job text_job = wait_job(server.client(), submit(server.client(), by_text).job_id());
  ASSERT_EQ(text_job.state(), pb::JOB_STATE_SUCCEEDED) << text_job.error().message();

  // The same prompt encoded here and sent as embeddings (negative prompt "" as diffusers defaults it).
  const auto encoder = model::TextEncoder::load(encoder_dir, tokenizer);
  auto to_proto = [](const at::Tensor& t) {
    const at::Tensor c = t.to(at::kCPU, at::kFloat).contiguous();
    pb::Tensor out;
    out.set_dtype(pb::DTYPE_FLOAT32);
    for (int64_t d : c.sizes()) out.add_shape(d);
    out.set_data(c.data_ptr<float>(), static_cast<size_t>(c.numel()) * sizeof(float));
    return out;
  };
  pb::SubmitJobRequest by_embeddings = long_video_request(800, 2);
  *by_embeddings.mutable_spec()->mutable_embeddings()->mutable_prompt_embeds() =
      to_proto(encoder->encode({"A cat walks on the grass, realistic style."}));
  *by_embeddings.mutable_spec()->mutable_embeddings()->mutable_negative_prompt_embeds() =
      to_proto(encoder->encode({""}));
  const pb::Job embeddings_job = wait_job(server.client(), submit(server.client(), by_embeddings).job_id());
  ASSERT_EQ(embeddings_job.state(), pb::JOB_STATE_SUCCEEDED);
  const at::Tensor a = download_latents(server.client(), text_job.job_id());
  const at::Tensor b = download_latents(server.client(), embeddings_job.job_id());
  EXPECT_TRUE(all_close(a, b, kAtol)) << max_abs_diff(a, b);
}

// Issue 24: a text is encoded once per server, whether it comes back in a resubmission, as the negative prompt of
// every job, or as a prompt change repeated within a job (skyreels_text_embedding_cache_*_total).
TEST(TextServerTest, AResubmittedPromptAndRepeatedPromptChangesAreEncodedOnce) {
  const std::string encoder_dir = temp_dir("tiny-umt5-cache");
  model::write_tiny_text_encoder(encoder_dir, 32, 7);
  ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32", "--text-encoder", encoder_dir,
                        "--tokenizer", golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer")});
  auto metric = [&](const std::string& name) { return metric_value(http_get(server.metrics_port(), "/metrics"), name); };
  const std::string cat = "A cat walks on the grass, realistic style.", dog = "A dog runs along the beach.";
  auto request = [&](uint64_t seed) {
    pb::SubmitJobRequest r = long_video_request(seed, 1);  // guidance 5: the negative prompt "" is encoded too
    r.mutable_spec()->mutable_text()->set_prompt(cat);
    int64_t from = 17;
    for (const std::string& text : {dog, cat, dog}) {  // changes back and forth
      auto* change = r.mutable_spec()->add_prompt_changes();
      change->set_from_frame(from);
      change->set_text(text);
      from += 8;
    }
    return r;
  };
  EXPECT_EQ(metric("skyreels_text_embedding_cache_misses_total"), 0);
  const pb::Job first = wait_job(server.client(), submit(server.client(), request(901)).job_id());
  ASSERT_EQ(first.state(), pb::JOB_STATE_SUCCEEDED) << first.error().message();
  // Five texts, three distinct: the cat prompt, "", the dog change.
  EXPECT_EQ(metric("skyreels_text_embedding_cache_misses_total"), 3);
  EXPECT_EQ(metric("skyreels_text_embedding_cache_hits_total"), 2);
  EXPECT_GT(metric("skyreels_text_embedding_cache_bytes"), 0);

  // Resubmitted (another seed, so another job): nothing is encoded again.
  const pb::Job second = wait_job(server.client(), submit(server.client(), request(902)).job_id());
  ASSERT_EQ(second.state(), pb::JOB_STATE_SUCCEEDED) << second.error().message();
  EXPECT_EQ(metric("skyreels_text_embedding_cache_misses_total"), 3);
  EXPECT_EQ(metric("skyreels_text_embedding_cache_hits_total"), 7);
  EXPECT_EQ(metric("skyreels_text_encode_seconds_count"), 2) << "one encoder call per submission";
}

}  // namespace
}  // namespace skyreels::test
