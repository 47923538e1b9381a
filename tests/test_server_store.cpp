// Issue 13, jobs that survive: the real skyreels-server binary on 127.0.0.1 with `--job-store sqlite:PATH`, killed
// with SIGKILL at chosen moments and restarted on the same store file. A killed job resumes at the chunk after its
// last committed one and its video equals the uninterrupted single-process result bit for bit; queued jobs keep
// their order; WatchJob continues with after_sequence; results download after another restart, MP4 included without
// decoding again; text prompts are never encoded again; a deadline that passed while the server was down ends its
// job; a corrupt, newer-schema or locked store file stops the start.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "server/store/job_store_sqlite.h"
#include "server/store/sqlite_db.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;

// One replica (all cores, float32) as `skyreels generate` runs, slowed so that a kill lands mid-job (test hooks on:
// the tests below add others).
std::vector<std::string> store_args(const std::string& store, int step_delay_ms = 60) {
  return {"--demo", "--devices", "cpu", "--dtype", "float32", "--job-store", "sqlite:" + store, "--enable-test-hooks",
          "--step-delay-ms", std::to_string(step_delay_ms)};
}

std::string new_store() { return temp_dir("job-store") + "/jobs.sqlite"; }

// 57 frames in chunks of 17 with overlap 9: six chunks.
pb::SubmitJobRequest six_chunk_request(uint64_t seed) {
  pb::SubmitJobRequest request = long_video_request(seed);
  request.mutable_spec()->mutable_params()->set_num_frames(57);
  return request;
}

void kill_server(ServerProcess& server) {
  server.signal(SIGKILL);
  ASSERT_NE(server.wait_exit(10s), -1) << "the server did not die";
}

TEST(JobStore, KilledAfterChunkTwoResumesAtChunkThreeAndEqualsGenerate) {
  const std::string store = new_store();
  const pb::SubmitJobRequest request = six_chunk_request(1301);
  std::string id;
  uint64_t last_seen = 0;
  {
    ServerProcess server(store_args(store));
    const pb::Job submitted = submit(server.client(), request);
    id = submitted.job_id();
    ASSERT_EQ(submitted.chunks_total(), 6);
    // Follow the job until chunk 2 (the third) has finished, then kill the server while chunk 3 runs.
    const auto events = watch_until(server.client(), id, 0, [](const pb::JobEvent& e) {
      return e.has_chunk_finished() && e.chunk_finished().chunk_index() == 2;
    });
    ASSERT_FALSE(events.empty());
    ASSERT_TRUE(events.back().has_chunk_finished()) << "the job ended before chunk 2 finished";
    last_seen = events.back().sequence();
    kill_server(server);
  }

  ServerProcess restarted(store_args(store));
  const pb::Job resumed = get_job(restarted.client(), id);
  EXPECT_GE(resumed.chunks_done(), 3) << "committed chunks are lost";
  EXPECT_LE(resumed.chunks_done(), 4);  // chunk 3 may have committed between the event and the kill
  const int64_t resume_chunk = resumed.chunks_done();

  // WatchJob with the last sequence seen before the kill: no event repeats, nothing of chunks 0-2 runs again, and
  // the next chunk starts where the store left off.
  const auto after =
      watch_until(restarted.client(), id, last_seen, [](const pb::JobEvent& e) { return e.has_finished(); });
  ASSERT_FALSE(after.empty());
  EXPECT_GT(after.front().sequence(), last_seen);
  for (size_t i = 1; i < after.size(); ++i) EXPECT_GT(after[i].sequence(), after[i - 1].sequence());
  int64_t first_started = -1;
  for (const auto& e : after) {
    if (e.has_chunk_finished()) {
      EXPECT_GE(e.chunk_finished().chunk_index(), 3);
    }
    if (e.has_chunk_started() && first_started < 0) first_started = e.chunk_started().chunk_index();
  }
  EXPECT_EQ(first_started, resume_chunk) << "the resumed job did not start at its first uncommitted chunk";
  ASSERT_TRUE(after.back().has_finished());
  const pb::Job done = after.back().finished().job();
  std::cout << "killed after chunk 2 finished; resumed at chunk " << resume_chunk << ", retries " << done.retries()
            << ", events after sequence " << last_seen << ": " << after.size() << "\n";
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  EXPECT_EQ(done.chunks_done(), 6);
  if (resume_chunk == 3) {
    EXPECT_GE(done.retries(), 1) << "the chunk in flight at the kill counts as a retry";
  }

  const at::Tensor expected = reference_latents(request);
  const at::Tensor served = download_latents(restarted.client(), id);
  ASSERT_TRUE(served.defined());
  EXPECT_TRUE(at::equal(served, expected)) << "max |resumed - generate| = " << max_abs_diff(served, expected);

  // Another restart: the finished job and its results are still there; an id the store never had is NOT_FOUND.
  kill_server(restarted);
  ServerProcess again(store_args(store));
  EXPECT_EQ(get_job(again.client(), id).state(), pb::JOB_STATE_SUCCEEDED);
  const at::Tensor downloaded = download_latents(again.client(), id);
  ASSERT_TRUE(downloaded.defined());
  EXPECT_TRUE(at::equal(downloaded, expected));
  grpc::Status status;
  get_job(again.client(), "j-0000000000000000", &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
}

double metric(ServerProcess& server, const std::string& name);

// Issue 21: the step cache's state belongs to one chunk's loop, so a cached long video whose chunks run on two
// replicas, and whose server is killed mid-run and restarted, equals the single-process cached run bit for bit:
// with diffusers' FirstBlockCache, and with the cache per causal block (an async video, block-causal mask).
pb::SubmitJobRequest cached_six_chunk_request(const std::string& cache) {
  pb::SubmitJobRequest request = six_chunk_request(2101);
  auto* p = request.mutable_spec()->mutable_params();
  p->set_cache(cache);
  p->set_cache_threshold(0.5);
  if (cache == "first-block-per-block") {  // 6 chunks of 6 latent frames, 3 causal blocks each
    p->set_num_frames(81);
    p->set_base_num_frames(21);
    p->set_ar_step(2);
    p->set_causal_block_size(2);
    p->set_cache_max_skips(3);
  }
  return request;
}

class CachedLongVideo : public ::testing::TestWithParam<std::string> {};

TEST_P(CachedLongVideo, OnTwoReplicasKilledMidRunEqualsTheSingleProcessCachedRun) {
  const std::string store = new_store();
  const pb::SubmitJobRequest request = cached_six_chunk_request(GetParam());
  std::vector<std::string> args = store_args(store);
  args[2] = "cpu,cpu";  // --devices: two replicas share the chunks
  std::string id;
  {
    ServerProcess server(args);
    pb::SubmitJobRequest per_request = request;
    per_request.mutable_spec()->mutable_params()->set_cache_scope("request");
    EXPECT_EQ(submit_status(server.client(), per_request).error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << "a request-scoped cache cannot follow chunks across replicas";
    if (GetParam() == "first-block-per-block") {
      pb::SubmitJobRequest full_attention = request;
      full_attention.mutable_spec()->mutable_params()->set_causal_block_size(1);
      EXPECT_EQ(submit_status(server.client(), full_attention).error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << "the cache per causal block needs the block-causal mask";
    }
    id = submit(server.client(), request).job_id();
    const auto events = watch_until(server.client(), id, 0, [](const pb::JobEvent& e) {
      return e.has_chunk_finished() && e.chunk_finished().chunk_index() == 2;
    });
    ASSERT_TRUE(!events.empty() && events.back().has_chunk_finished()) << "the job ended before chunk 2 finished";
    kill_server(server);
  }
  ServerProcess restarted(args);
  const pb::Job done = wait_job(restarted.client(), id);
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  EXPECT_GT(metric(restarted, "skyreels_transformer_token_blocks_total{kind=\"saved_cache\"}"), 0)
      << "the cache skipped nothing: the test would not see a state that travelled";
  // The job reports its own work, the chunks run before the kill included (their ChunkFinished events are stored).
  const pb::TransformerWork& work = done.transformer_work();
  EXPECT_GT(work.saved_cache(), 0);
  EXPECT_GT(work.computed(), 0);
  EXPECT_EQ(work.full(), work.computed() + work.saved_exact() + work.saved_cache());
  pb::TransformerWork summed;
  int chunks_reported = 0;
  for (const auto& e : watch_until(restarted.client(), id, 0, [](const pb::JobEvent& e) { return e.has_finished(); })) {
    if (!e.has_chunk_finished()) continue;
    const pb::TransformerWork& w = e.chunk_finished().transformer_work();
    chunks_reported += w.full() > 0 ? 1 : 0;
    summed.set_full(summed.full() + w.full());
    summed.set_computed(summed.computed() + w.computed());
    summed.set_saved_cache(summed.saved_cache() + w.saved_cache());
  }
  EXPECT_EQ(chunks_reported, 6) << "every chunk's ChunkFinished carries its work";
  EXPECT_EQ(summed.full(), work.full());
  EXPECT_EQ(summed.computed(), work.computed());
  EXPECT_EQ(summed.saved_cache(), work.saved_cache());
  const at::Tensor expected = reference_latents(request);
  const at::Tensor served = download_latents(restarted.client(), id);
  ASSERT_TRUE(served.defined());
  EXPECT_TRUE(at::equal(served, expected)) << "max |served - generate| = " << max_abs_diff(served, expected);
}

INSTANTIATE_TEST_SUITE_P(JobStore, CachedLongVideo, ::testing::Values("first-block", "first-block-per-block"),
                         [](const ::testing::TestParamInfo<std::string>& kind) {
                           return kind.param == "first-block" ? std::string("FirstBlock") : std::string("PerBlock");
                         });

double metric(ServerProcess& server, const std::string& name) {
  return metric_value(http_get(server.metrics_port(), "/metrics"), name);
}

// Every chunk's MP4 segment of a finished job, joined in order (one playable fragmented MP4).
std::string download_mp4(server::Client& client, const std::string& id) {
  pb::DownloadResultRequest download;
  download.set_job_id(id);
  download.set_format(pb::RESULT_FORMAT_MP4);
  std::string mp4;
  const grpc::Status status =
      server::download_chunks(client, download, [&](int32_t, int32_t, std::string bytes) { mp4 += bytes; });
  EXPECT_TRUE(status.ok()) << server::describe(status);
  return mp4;
}

TEST(JobStore, AnMp4MadeBeforeARestartIsReadBackNotDecodedAgain) {
  const std::string store = new_store();
  std::vector<std::string> args = store_args(store, 0);
  args.insert(args.end(), {"--vae", "demo"});
  std::string id, before;
  {
    ServerProcess server(args);
    id = submit(server.client(), long_video_request(1360, 2)).job_id();
    ASSERT_EQ(wait_job(server.client(), id).state(), pb::JOB_STATE_SUCCEEDED);
    before = download_mp4(server.client(), id);
    EXPECT_EQ(metric(server, "skyreels_video_chunks_encoded_total"), 4) << "made on the first download";
    EXPECT_EQ(metric(server, "skyreels_vae_seconds_count{op=\"decode\"}"), 4) << "one VAE decode per chunk";
    EXPECT_EQ(metric(server, "skyreels_model_load_seconds_count{component=\"vae\"}"), 1);
    EXPECT_EQ(metric(server, "skyreels_job_store_seconds_count{op=\"put_segment\"}"), 4) << "each segment stored";
    kill_server(server);
  }
  ServerProcess restarted(args);
  const std::string after = download_mp4(restarted.client(), id);
  ASSERT_FALSE(before.empty());
  EXPECT_EQ(after, before) << "the MP4 read back differs from the one made before the restart";
  EXPECT_EQ(metric(restarted, "skyreels_video_chunks_encoded_total"), 0) << "decoded again instead of read back";
  EXPECT_EQ(metric(restarted, "skyreels_video_jobs_pending"), 0);
}

// The text encoder only runs at submit: the stored request holds the embeddings of the prompt and of every prompt
// change given as text, so a server without a text encoder resumes the job and makes the same video.
TEST(JobStore, TextPromptChangesResumeBitIdenticallyOnAServerWithoutATextEncoder) {
  pb::SubmitJobRequest request = six_chunk_request(1370);
  pb::JobSpec& spec = *request.mutable_spec();
  spec.mutable_text()->set_prompt("A cat walks on the grass, realistic style.");
  spec.mutable_text()->set_negative_prompt("blurry");
  for (const auto& [frame, text] : {std::pair<int64_t, const char*>{25, "The cat sits down."},
                                    std::pair<int64_t, const char*>{45, "The cat falls asleep in the sun."}}) {
    pb::PromptChange* change = spec.add_prompt_changes();
    change->set_from_frame(frame);  // chunks 2 and 4 of 0-5: one before the kill, one after
    change->set_text(text);
  }
  const std::vector<std::string> text_encoder = {"--text-encoder", "demo", "--tokenizer",
                                                 golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer")};
  at::Tensor expected;
  {
    std::vector<std::string> args = {"--demo", "--devices", "cpu", "--dtype", "float32", "--job-store", "memory"};
    args.insert(args.end(), text_encoder.begin(), text_encoder.end());
    ServerProcess reference(args);
    const std::string id = submit(reference.client(), request).job_id();
    ASSERT_EQ(wait_job(reference.client(), id, 180s).state(), pb::JOB_STATE_SUCCEEDED);
    expected = download_latents(reference.client(), id);
  }

  const std::string store = new_store();
  std::string id;
  uint64_t last_seen = 0;
  {
    std::vector<std::string> args = store_args(store);
    args.insert(args.end(), text_encoder.begin(), text_encoder.end());
    ServerProcess server(args);
    id = submit(server.client(), request).job_id();
    const auto events = watch_until(server.client(), id, 0, [](const pb::JobEvent& e) {
      return e.has_chunk_finished() && e.chunk_finished().chunk_index() == 1;
    });
    ASSERT_TRUE(!events.empty() && events.back().has_chunk_finished()) << "the job ended before chunk 1 finished";
    last_seen = events.back().sequence();
    kill_server(server);
  }
  ServerProcess restarted(store_args(store));
  {
    auto ctx = restarted.client().context(10);
    pb::ServerInfo info;
    ASSERT_TRUE(restarted.client().stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
    ASSERT_FALSE(info.text_encoder_available());
  }
  const auto after = watch_until(
      restarted.client(), id, last_seen, [](const pb::JobEvent& e) { return e.has_finished(); }, 180);
  ASSERT_TRUE(!after.empty() && after.back().has_finished());
  const pb::Job done = after.back().finished().job();
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  const auto resumed_at = std::find_if(after.begin(), after.end(), [](const auto& e) { return e.has_chunk_started(); });
  ASSERT_NE(resumed_at, after.end());
  EXPECT_LE(resumed_at->chunk_started().chunk_index(), 4) << "the change from frame 45 (chunk 4) ran before the kill";
  const at::Tensor served = download_latents(restarted.client(), id);
  ASSERT_TRUE(served.defined() && expected.defined());
  EXPECT_TRUE(at::equal(served, expected)) << "max |resumed - uninterrupted| = " << max_abs_diff(served, expected);
}

// Issue 36: a crash is not the chunk's fault. Six SIGKILLs with default flags (two chunk retries), each at an early
// step of the first unfinished job's running chunk, so that the same chunk loses its process six times: before the
// takeover limit this failed the job ("chunk N failed 3 time(s)"). Every job succeeds and equals `skyreels generate`.
TEST(JobStore, SixKillsDuringThreeJobsFailNoJobAndEveryVideoEqualsGenerate) {
  const std::string store = new_store();
  std::vector<pb::SubmitJobRequest> requests;
  for (uint64_t seed : {3601, 3602, 3603}) requests.push_back(long_video_request(seed));
  std::vector<std::string> ids;
  for (int kill = 0; kill < 6; ++kill) {
    // Rows of 500 ms: the kill lands while the chunk still runs even when this machine is slow to deliver it (a
    // chunk that committed first would leave its job between chunks, and the restart would count a takeover for it
    // too: the SQLite store does not record whether a chunk was running when the process died).
    ServerProcess server(store_args(store, 500));
    if (ids.empty()) {
      for (const auto& request : requests) ids.push_back(submit(server.client(), request).job_id());
    }
    const auto unfinished = std::find_if(ids.begin(), ids.end(), [&](const std::string& id) {
      return get_job(server.client(), id).state() != pb::JOB_STATE_SUCCEEDED;
    });
    ASSERT_NE(unfinished, ids.end()) << "every job ended before kill " << kill;
    const int64_t at_step = 1 + kill % 2;  // the first or the second row of the chunk
    const auto events = watch_until(server.client(), *unfinished, 0, [&](const pb::JobEvent& e) {
      return e.has_finished() || (e.has_step() && e.step().step() >= at_step);
    });
    ASSERT_TRUE(!events.empty() && events.back().has_step()) << "the job ended before kill " << kill;
    kill_server(server);
  }
  ServerProcess restarted(store_args(store, 0));
  int takeovers = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const pb::Job done = wait_job(restarted.client(), ids[i], 180s);
    ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << "job " << i << ": " << done.error().message();
    for (const auto& e : watch_until(restarted.client(), ids[i], 0, [](const pb::JobEvent& e) { return e.has_finished(); })) {
      if (e.has_chunk_retry()) {
        EXPECT_TRUE(e.chunk_retry().takeover()) << "no chunk raised an error: " << e.chunk_retry().error();
        takeovers += e.chunk_retry().takeover() ? 1 : 0;
      }
    }
    const at::Tensor served = download_latents(restarted.client(), ids[i]);
    ASSERT_TRUE(served.defined());
    const at::Tensor expected = reference_latents(requests[i]);
    EXPECT_TRUE(at::equal(served, expected)) << "job " << i << ": max |served - generate| = "
                                             << max_abs_diff(served, expected);
  }
  EXPECT_EQ(takeovers, 6) << "each kill mid-chunk is one takeover, recorded as such";
}

// ... and the one real danger, a chunk that kills every process running it, still ends: after
// --chunk-takeover-limit takeovers its job fails with a message that says the processes died.
TEST(JobStore, AChunkThatKillsEveryProcessFailsItsJobAfterTheTakeoverLimit) {
  const std::string store = new_store();
  std::vector<std::string> args = store_args(store, 0);
  // A slow first row: the submission is answered before the chunk kills the process.
  args.insert(args.end(), {"--chunk-takeover-limit", "2", "--fault-inject", "cpu:0@1:kill", "--block-delay-ms", "200"});
  std::string id;
  int deaths = 0;
  for (int start = 0; start < 3; ++start) {
    ServerProcess server(args, /*wait_ready=*/start == 0);
    if (start == 0) id = submit(server.client(), long_video_request(3610)).job_id();
    if (server.wait_exit(90s) == 128 + SIGKILL) {
      ++deaths;
      continue;
    }
    FAIL() << "start " << start << " did not die; log:\n" << server.log();
  }
  ASSERT_EQ(deaths, 3) << "the first run and two takeovers each kill the process";
  std::vector<std::string> healthy = store_args(store, 0);
  healthy.insert(healthy.end(), {"--chunk-takeover-limit", "2"});  // a fourth run of the chunk would succeed
  ServerProcess last(healthy);
  const pb::Job done = wait_job(last.client(), id, 60s);
  EXPECT_EQ(done.state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(done.error().message(), "the processes running chunk 0 died 3 times");
}

TEST(JobStore, QueuedJobsSurviveInTheirOrder) {
  const std::string store = new_store();
  std::vector<std::string> ids;
  {
    ServerProcess server(store_args(store, 100));
    ids.push_back(submit(server.client(), six_chunk_request(1310)).job_id());
    watch_until(server.client(), ids[0], 0, [](const pb::JobEvent& e) { return e.has_chunk_started(); });
    for (uint64_t seed : {1311, 1312, 1313}) ids.push_back(submit(server.client(), long_video_request(seed)).job_id());
    for (size_t i = 1; i < ids.size(); ++i) {
      EXPECT_EQ(get_job(server.client(), ids[i]).state(), pb::JOB_STATE_QUEUED);
    }
    kill_server(server);
  }
  ServerProcess restarted(store_args(store, 0));
  {
    auto ctx = restarted.client().context(10);
    pb::ListJobsRequest request;
    pb::ListJobsResponse response;
    ASSERT_TRUE(restarted.client().stub().ListJobs(ctx.get(), request, &response).ok());
    std::vector<std::string> listed;
    for (const auto& job : response.jobs()) listed.push_back(job.job_id());
    EXPECT_EQ(listed, ids) << "jobs are not listed in submission order after the restart";
  }
  std::vector<pb::Job> done;
  for (const auto& id : ids) done.push_back(wait_job(restarted.client(), id, 180s));
  for (const auto& job : done) EXPECT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED) << job.error().message();
  // The queued jobs started in their order.
  for (size_t i = 2; i < done.size(); ++i) {
    const auto started = [](const pb::Job& j) {
      return j.started_at().seconds() * 1000000000LL + j.started_at().nanos();
    };
    EXPECT_LT(started(done[i - 1]), started(done[i])) << "job " << i;
  }
}

TEST(JobStore, ADeadlineThatPassedWhileDownEndsTheJob) {
  const std::string store = new_store();
  std::string id;
  auto deadline_passed_at = std::chrono::steady_clock::now();
  {
    ServerProcess server(store_args(store, 200));
    pb::SubmitJobRequest request = six_chunk_request(1320);
    request.mutable_timeout()->set_seconds(3);
    const pb::Job job = submit(server.client(), request);
    id = job.job_id();
    deadline_passed_at = std::chrono::steady_clock::now() + 3s;
    kill_server(server);
  }
  std::this_thread::sleep_until(deadline_passed_at + 200ms);  // the deadline passes while no server runs
  ServerProcess restarted(store_args(store, 0));
  const pb::Job done = wait_job(restarted.client(), id, 60s);
  EXPECT_EQ(done.state(), pb::JOB_STATE_DEADLINE_EXCEEDED);
  EXPECT_EQ(done.error().code(), static_cast<int>(grpc::StatusCode::DEADLINE_EXCEEDED));
}

TEST(JobStore, AJobDroppedByRetentionSaysSoAcrossARestart) {
  const std::string store = new_store();
  std::vector<std::string> args = store_args(store, 0);
  args.insert(args.end(), {"--result-ttl-seconds", "1"});
  pb::SubmitJobRequest request = long_video_request(1330);
  request.mutable_spec()->mutable_params()->set_num_frames(17);  // one chunk
  std::string id;
  {
    ServerProcess server(args);
    id = submit(server.client(), request).job_id();
    EXPECT_EQ(wait_job(server.client(), id).state(), pb::JOB_STATE_SUCCEEDED);
    grpc::Status status;
    const auto until = std::chrono::steady_clock::now() + 30s;  // retention runs on the scheduler's 100 ms timer
    while (std::chrono::steady_clock::now() < until) {
      get_job(server.client(), id, &status);
      if (!status.ok()) break;
      std::this_thread::sleep_for(100ms);
    }
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_NE(status.error_message().find("dropped by retention"), std::string::npos) << status.error_message();
    kill_server(server);
  }
  ServerProcess restarted(args);
  grpc::Status status;
  get_job(restarted.client(), id, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(status.error_message().find("--result-ttl-seconds"), std::string::npos) << status.error_message();
  get_job(restarted.client(), "j-00000000000000ff", &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message().find("dropped"), std::string::npos) << status.error_message();
}

// A full disk (the store capped by --job-store-max-growth-pages, so SQLite answers SQLITE_FULL): a job whose
// chunk cannot be committed fails INTERNAL naming the reason, a submission that cannot be stored is refused with
// UNAVAILABLE, and the process keeps serving.
TEST(JobStore, AFullDiskFailsTheJobOrTheSubmitNeverTheProcess) {
  const std::string store = new_store();
  std::vector<std::string> args = store_args(store, 0);
  args.insert(args.end(), {"--job-store-max-growth-pages", "24"});  // a small job fits; its 320 KiB chunk does not
  ServerProcess server(args);
  pb::SubmitJobRequest request = long_video_request(1340);
  auto* p = request.mutable_spec()->mutable_params();
  p->set_num_frames(17);
  p->set_height(256);
  p->set_width(256);
  const pb::Job job = submit(server.client(), request);
  const pb::Job done = wait_job(server.client(), job.job_id());
  EXPECT_EQ(done.state(), pb::JOB_STATE_FAILED);
  EXPECT_EQ(done.error().code(), static_cast<int>(grpc::StatusCode::INTERNAL));
  EXPECT_NE(done.error().message().find("could not be stored"), std::string::npos) << done.error().message();
  EXPECT_NE(done.error().message().find("full"), std::string::npos) << done.error().message();

  // Fill what is left, then a submission is refused and the server still answers.
  grpc::Status status = grpc::Status::OK;
  for (int i = 0; i < 64 && status.ok(); ++i) {
    auto ctx = server.client().context(30);
    pb::SubmitJobResponse response;
    pb::SubmitJobRequest big = long_video_request(1341 + static_cast<uint64_t>(i));
    big.mutable_spec()->mutable_params()->set_num_frames(17);
    status = server.client().stub().SubmitJob(ctx.get(), big, &response);
    if (status.ok()) wait_job(server.client(), response.job().job_id());
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << server::describe(status);
  EXPECT_NE(status.error_message().find("could not be stored"), std::string::npos) << status.error_message();
  std::cout << "job: " << done.error().message() << "\nsubmit: " << status.error_message() << "\n";
  EXPECT_TRUE(server.running());
  EXPECT_EQ(health_status(server.address(), ""), grpc::health::v1::HealthCheckResponse::SERVING);
}

// Starts the server on `store` expecting it to refuse: exit code != 0 and a message naming the file and `why`.
void expect_refused(const std::string& store, const std::string& why) {
  ServerProcess server(store_args(store), false);
  const int code = server.wait_exit(60s);
  EXPECT_NE(code, -1) << "the server did not exit:\n" << server.log();
  EXPECT_NE(code, 0);
  EXPECT_NE(server.log().find(store), std::string::npos) << server.log();
  EXPECT_NE(server.log().find(why), std::string::npos) << server.log();
}

TEST(JobStore, ACorruptStoreFileStopsTheStartNamingIt) {
  const std::string store = new_store();
  {
    std::ofstream out(store, std::ios::binary);
    out << std::string(8192, 'x');
  }
  expect_refused(store, "corrupt");
  EXPECT_EQ(std::filesystem::file_size(store), 8192u) << "the corrupt file was re-initialised";
}

TEST(JobStore, ANewerSchemaOrALockedStoreStopsTheStart) {
  const std::string store = new_store();
  {
    ServerProcess first(store_args(store));
    expect_refused(store, "held by another process");  // one server per store file
    first.signal(SIGTERM);
    ASSERT_EQ(first.wait_exit(30s), 0) << first.log();
  }
  {
    server::sqlite::Database db(store, false);
    db.exec("UPDATE schema_version SET version = 99");
  }
  expect_refused(store, "schema version 99 is newer");
}

// A store written by schema version 1 (before tombstones) is migrated forward in place, and keeps its jobs' rows.
TEST(JobStore, AnOlderSchemaIsMigratedForward) {
  const std::string store = new_store();
  {
    server::sqlite::Database db(store, true);
    db.exec(
        "CREATE TABLE schema_version(version INTEGER NOT NULL); INSERT INTO schema_version VALUES(1);"
        "CREATE TABLE jobs(id TEXT PRIMARY KEY, ord INTEGER NOT NULL, vbase INTEGER NOT NULL, owner TEXT NOT NULL,"
        " client TEXT NOT NULL, priority INTEGER NOT NULL, deadline_ms INTEGER, idempotency_key TEXT NOT NULL,"
        " fingerprint INTEGER NOT NULL, state TEXT NOT NULL, error_kind TEXT NOT NULL, error TEXT NOT NULL,"
        " created_ms INTEGER NOT NULL, started_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL,"
        " chunk_count INTEGER NOT NULL, chunks_done INTEGER NOT NULL, retries INTEGER NOT NULL,"
        " handoffs INTEGER NOT NULL, request BLOB NOT NULL);"
        "CREATE TABLE chunks(job_id TEXT NOT NULL, idx INTEGER NOT NULL, replica TEXT NOT NULL,"
        " attempts INTEGER NOT NULL, bytes BLOB NOT NULL, PRIMARY KEY(job_id, idx));"
        "CREATE TABLE events(job_id TEXT NOT NULL, seq INTEGER NOT NULL, data TEXT NOT NULL,"
        " PRIMARY KEY(job_id, seq));");
  }
  {
    ServerProcess server(store_args(store, 0));
    EXPECT_NE(server.log().find("event=job_store_migrated path=" + store + " from=1 to=2"), std::string::npos)
        << server.log();
    const std::string id = submit(server.client(), long_video_request(1350)).job_id();
    EXPECT_EQ(wait_job(server.client(), id).state(), pb::JOB_STATE_SUCCEEDED);
    server.signal(SIGTERM);
    ASSERT_EQ(server.wait_exit(30s), 0) << server.log();
  }
  server::sqlite::Database db(store, false);
  server::sqlite::Statement version(db, "SELECT version FROM schema_version");
  ASSERT_TRUE(version.step());
  EXPECT_EQ(version.int64(0), server::SqliteJobStore::kSchemaVersion);
  server::sqlite::Statement jobs(db, "SELECT count(*) FROM jobs");
  ASSERT_TRUE(jobs.step());
  EXPECT_EQ(jobs.int64(0), 1);
}

}  // namespace
}  // namespace skyreels::test
