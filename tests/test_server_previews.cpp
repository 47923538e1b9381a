// Previews of the running chunk served (issue 35): WatchJob carries them between each chunk's start and its frames,
// each a PNG of the chunk's new frames at latent resolution; they change nothing in the video; out-of-range
// `preview_every` is refused naming it; `skyreels watch --previews DIR` writes them; a watcher may leave them out.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "model/video_mp4.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;

class ServedPreviews : public SharedServerSuite<ServedPreviews> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    return std::make_unique<ServerProcess>(std::vector<std::string>{"--demo", "--devices", "cpu", "--dtype", "float32",
                                                                    "--enable-test-hooks", "--step-delay-ms", "60"});
  }
};

bool finished(const pb::JobEvent& e) { return e.has_finished(); }

pb::SubmitJobRequest with_previews(uint64_t seed, int64_t every, int64_t steps = 6) {
  pb::SubmitJobRequest request = long_video_request(seed, steps);  // 4 chunks, 48x32
  request.mutable_spec()->mutable_params()->set_preview_every(every);
  return request;
}

// The previews each chunk of `job` showed before its frames, for the chunks that had not started when the watch's
// first event came (its events are left in `events`); the chunks checked are [first_checked, 4).
struct WatchedPreviews {
  std::vector<pb::JobEvent> events;
  int first_checked = 4;
};

WatchedPreviews watch_previews(server::Client& client, const std::string& job_id) {
  WatchedPreviews watched;
  std::atomic<bool> attached{false};
  std::thread watcher([&] {
    watched.events = watch_until(client, job_id, 0, [&](const pb::JobEvent& e) {
      attached = true;
      return finished(e);
    }, 120);
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!attached && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (attached) watched.first_checked = static_cast<int>(get_job(client, job_id).chunks_done()) + 1;
  watcher.join();
  return watched;
}

// Bounded retries until a watch attaches while at least one chunk is still to start (as test_server_peers does), so
// that a chunk is really checked.
TEST_F(ServedPreviews, EveryChunkShowsPreviewsBeforeItsFramesAndTheVideoIsTheSameWithout) {
  const auto metrics_before = http_get(server_->metrics_port(), "/metrics");
  pb::Job job;
  WatchedPreviews watched;
  uint64_t seed = 3501;
  for (uint64_t attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 5u) << "the watch never attached before the job's last chunk started";
    seed = 3501 + attempt * 100;
    job = submit(server_->client(), with_previews(seed, 1));
    watched = watch_previews(server_->client(), job.job_id());
    if (watched.first_checked < 4) break;
  }
  const std::vector<pb::JobEvent>& events = watched.events;
  ASSERT_FALSE(events.empty());
  ASSERT_TRUE(events.back().has_finished());
  ASSERT_EQ(events.back().finished().job().state(), pb::JOB_STATE_SUCCEEDED);

  std::map<int, int> previews_of;  // chunk -> previews seen while it ran
  std::set<int> running, done;
  uint64_t last_sequence = 0;
  int64_t preview_bytes = 0;
  int checked = 0;
  for (const pb::JobEvent& e : events) {
    if (e.has_preview()) {
      const pb::ChunkPreview& p = e.preview();
      EXPECT_EQ(e.sequence(), 0u) << "a preview is not in the job's log";
      EXPECT_TRUE(running.count(p.chunk_index()) && !done.count(p.chunk_index()))
          << "preview of chunk " << p.chunk_index() << " outside its run";
      EXPECT_EQ(p.mime_type(), "image/png");
      EXPECT_EQ(p.frame_width(), 48 / 8);
      EXPECT_EQ(p.frame_height(), 32 / 8);
      EXPECT_GE(p.step(), 1);
      EXPECT_LE(p.step(), p.steps());
      const video::DecodedVideo image =
          video::read_video_bytes(std::vector<uint8_t>(p.image().begin(), p.image().end()));
      EXPECT_EQ(image.frames.sizes(), (std::vector<int64_t>{1, p.frame_height(),
                                                            (p.latent_frame_end() - p.latent_frame_begin()) *
                                                                p.frame_width(),
                                                            3}));
      ++previews_of[p.chunk_index()];
      preview_bytes += static_cast<int64_t>(p.image().size());
      continue;
    }
    EXPECT_GT(e.sequence(), last_sequence);
    last_sequence = e.sequence();
    if (e.has_chunk_started()) running.insert(e.chunk_started().chunk_index());
    if (e.has_chunk_finished()) {
      done.insert(e.chunk_finished().chunk_index());
      const int chunk = e.chunk_finished().chunk_index();
      if (chunk >= watched.first_checked) {
        EXPECT_GE(previews_of[chunk], 1) << "chunk " << chunk;
        ++checked;
      }
    }
  }
  EXPECT_EQ(done.size(), 4u);
  EXPECT_EQ(checked, 4 - watched.first_checked) << "every chunk that started after the watch attached was checked";
  EXPECT_GE(checked, 1);

  // The pod counted what its replicas made (the watch saw some of them; it may skip to the latest).
  const auto metrics_after = http_get(server_->metrics_port(), "/metrics");
  const auto moved = [&](const char* name) {
    const double before = metric_value(metrics_before, name);
    return metric_value(metrics_after, name) - (std::isnan(before) ? 0 : before);
  };
  EXPECT_GE(moved("skyreels_previews_total"), static_cast<double>(
                                                  std::accumulate(previews_of.begin(), previews_of.end(), 0,
                                                                  [](int n, const auto& p) { return n + p.second; })));
  EXPECT_GE(moved("skyreels_preview_bytes_total"), static_cast<double>(preview_bytes));
  EXPECT_GT(preview_bytes, 0);

  // The same request without previews: the same latents, bit for bit.
  const at::Tensor with = download_latents(server_->client(), job.job_id());
  const pb::Job plain = submit(server_->client(), with_previews(seed, 0));
  ASSERT_EQ(wait_job(server_->client(), plain.job_id()).state(), pb::JOB_STATE_SUCCEEDED);
  const at::Tensor without = download_latents(server_->client(), plain.job_id());
  EXPECT_TRUE(at::equal(with, without));
}

TEST_F(ServedPreviews, PreviewEveryBelowZeroOrBeyondTheStepsIsRefusedNamingIt) {
  for (const int64_t every : {int64_t{-1}, int64_t{7}}) {  // the request has 6 steps
    const grpc::Status status = submit_status(server_->client(), with_previews(3502, every));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << every;
    EXPECT_NE(status.error_message().find("preview_every"), std::string::npos) << status.error_message();
  }
  EXPECT_TRUE(submit_status(server_->client(), with_previews(3502, 6)).ok());
}

TEST_F(ServedPreviews, AWatcherThatSkipsPreviewsGetsNoneAndSkyreelsWatchWritesThemAsPngFiles) {
  const pb::Job job = submit(server_->client(), with_previews(3503, 10, 20));  // rows 10 and 20 of each chunk
  const std::string dir = temp_dir("watch-previews");
  std::string output;
  const int rc = run_command(std::string(SKYREELS_BIN_DIR) + "/skyreels watch " + job.job_id() + " --server " +
                                 server_->address() + " --no-progress --previews " + dir + " 2>&1",
                             &output);
  EXPECT_EQ(rc, 0) << output;
  // What it wrote are previews of the rows asked for (a watcher that joins late or falls behind skips some).
  int written = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(name.size() == 20 && name.rfind("chunk00", 0) == 0 &&
                (name.substr(8) == "_row0009.png" || name.substr(8) == "_row0019.png"))
        << name;
    EXPECT_EQ(video::read_video(entry.path().string()).frames.size(1), 32 / 8) << name;
    ++written;
  }
  EXPECT_GE(written, 1) << output;

  // A watcher that leaves previews out, watching while the job runs (bounded retries until its first event came
  // with a chunk still to start, so that previews were being offered while it watched).
  for (uint64_t attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 5u) << "the skip_previews watch never attached before the job's last chunk started";
    const pb::Job running = submit(server_->client(), with_previews(3603 + attempt, 10, 20));
    pb::WatchJobRequest request;
    request.set_job_id(running.job_id());
    request.set_skip_previews(true);
    auto ctx = server_->client().context(60);
    auto reader = server_->client().stub().WatchJob(ctx.get(), request);
    pb::JobEvent event;
    int events = 0, previews = 0;
    int64_t chunks_done_at_attach = -1;
    while (reader->Read(&event)) {
      if (chunks_done_at_attach < 0) chunks_done_at_attach = get_job(server_->client(), running.job_id()).chunks_done();
      previews += event.has_preview() ? 1 : 0;
      ++events;
    }
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_EQ(previews, 0);
    EXPECT_GT(events, 3);
    if (chunks_done_at_attach >= 0 && chunks_done_at_attach < 3) break;
  }
}

}  // namespace
}  // namespace skyreels::test
