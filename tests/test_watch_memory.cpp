// Issue 46: a watcher of a job's previews holds no copy of them. 100 gRPC WatchJob streams whose clients never read
// and 100 Server-Sent Events readers taking a byte a second watch a 540P job that makes a preview every step: the
// server's resident memory grows by less than one preview per watcher (docs/OPERATIONS.md, Previews), and what they
// took is given back once they leave. The real binary on 127.0.0.1 (test_server_harness); memory, not time, is
// asserted, so a loaded machine only makes it slower.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = ::skyreels::v1;
using namespace std::chrono_literals;
using Steady = std::chrono::steady_clock;

constexpr int kGrpcWatchers = 100;
constexpr int kSseReaders = 100;
constexpr auto kHold = 10s;  // how long they all watch (at 1 byte a second)

// A 97-frame video at width x height (one chunk of 25 latent frames), a preview every step, more steps than the test
// waits for (it is cancelled at the end).
pb::SubmitJobRequest preview_job(int width, int height) {
  pb::SubmitJobRequest request = long_video_request(4601, 100, 1.0);
  auto* p = request.mutable_spec()->mutable_params();
  p->set_width(width);
  p->set_height(height);
  p->set_num_frames(97);
  p->set_base_num_frames(97);
  p->set_preview_every(1);
  p->mutable_scheduler()->set_type("euler");  // no history of earlier steps to grow the job's memory
  return request;
}

// A reading watcher: counts the job's previews, keeps the size of the last one. Destroyed, it cancels and joins.
class PreviewCounter {
 public:
  PreviewCounter(server::Client& client, const std::string& job_id) : context_(client.context(600)) {
    pb::WatchJobRequest request;
    request.set_job_id(job_id);
    reader_ = client.stub().WatchJob(context_.get(), request);
    thread_ = std::thread([this] {
      pb::JobEvent event;
      while (reader_->Read(&event)) {
        if (event.has_preview()) {
          image_bytes_ = static_cast<int64_t>(event.preview().image().size());
          ++previews_;
        }
        if (event.has_finished()) finished_ = true;
      }
      reader_->Finish();
      finished_ = true;
    });
  }
  ~PreviewCounter() {
    context_->TryCancel();
    thread_.join();
  }
  int previews() const { return previews_; }
  int64_t image_bytes() const { return image_bytes_; }
  bool finished() const { return finished_; }
  // Waits for the count to reach `count` (false when the stream ended or `seconds` passed first).
  bool wait_for(int count, std::chrono::seconds seconds) const {
    const auto until = Steady::now() + seconds;
    while (previews_ < count && !finished_ && Steady::now() < until) std::this_thread::sleep_for(20ms);
    return previews_ >= count;
  }

 private:
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReader<pb::JobEvent>> reader_;
  std::atomic<int> previews_{0};
  std::atomic<int64_t> image_bytes_{0};
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

// A WatchJob stream on a connection of its own whose client never reads: what the server writes backs up at the server.
class IdleGrpcWatcher {
 public:
  IdleGrpcWatcher(const std::string& address, const std::string& job_id) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a TCP connection of its own, not one shared by all
    stub_ = pb::VideoService::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    context_.set_deadline(std::chrono::system_clock::now() + 600s);
    pb::WatchJobRequest request;
    request.set_job_id(job_id);
    reader_ = stub_->WatchJob(&context_, request);
  }
  ~IdleGrpcWatcher() {
    context_.TryCancel();
    reader_->Finish();
  }

 private:
  std::unique_ptr<pb::VideoService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<pb::JobEvent>> reader_;
};

// GET /skyreels/v1/jobs/{id}/events with a small receive buffer: the headers are read at once, then a byte at a time
// (take_a_byte), so that what the server sends backs up at the server.
class SlowSseReader {
 public:
  SlowSseReader(int port, const std::string& job_id) : fd_(connect_loopback(port, 4096)) {
    if (fd_ < 0) return;
    const std::string request = "GET /skyreels/v1/jobs/" + job_id + "/events HTTP/1.1\r\nHost: x\r\n\r\n";
    ::send(fd_, request.data(), request.size(), MSG_NOSIGNAL);
  }
  ~SlowSseReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  SlowSseReader(const SlowSseReader&) = delete;
  SlowSseReader& operator=(const SlowSseReader&) = delete;

  // Reads until the end of the response's headers; true when they say 200 and an event stream.
  bool read_headers(Steady::time_point until) {
    if (fd_ < 0) return false;
    char c = 0;
    while (received_.find("\r\n\r\n") == std::string::npos && Steady::now() < until) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      if (::recv(fd_, &c, 1, 0) != 1) return false;
      received_ += c;
    }
    return received_.rfind("HTTP/1.1 200", 0) == 0 && received_.find("text/event-stream") != std::string::npos;
  }
  void take_a_byte() {
    char c = 0;
    (void)::recv(fd_, &c, 1, MSG_DONTWAIT);
  }
  const std::string& headers() const { return received_; }

 private:
  int fd_;
  std::string received_;
};

// The server's resident set around the watchers, in bytes.
struct WatchMemory {
  int64_t preview_bytes = 0;  // the job's latest preview when the watchers came
  int64_t before = 0;         // before they came
  int64_t grpc = 0;           // once the gRPC watchers were open
  int64_t sse = 0;            // once the SSE readers were too
  int64_t peak = 0;           // the largest while they watched
  int64_t after = 0;          // after they left
};

// Waits until the server has ended every stream (an SSE stream waiting for its next event sees its client gone at
// the next keep-alive, within 15 s).
bool wait_streams_closed(const ServerProcess& server) {
  const auto until = Steady::now() + 60s;
  while (Steady::now() < until) {
    if (metric_value(http_get(server.metrics_port(), "/metrics"), "skyreels_streams_open") == 0) return true;
    std::this_thread::sleep_for(200ms);
  }
  return false;
}

int64_t settled_rss(const ServerProcess& server) {
  std::this_thread::sleep_for(2s);
  return resident_bytes(server.pid());
}

// Watches a job of width x height from its first preview on with kGrpcWatchers idle gRPC streams and kSseReaders slow
// SSE readers for kHold, then lets them go.
void measure(ServerProcess& server, int http_port, int width, int height, WatchMemory* out) {
  WatchMemory& m = *out;
  const pb::Job job = submit(server.client(), preview_job(width, height));
  ASSERT_FALSE(job.job_id().empty());
  auto counter = std::make_unique<PreviewCounter>(server.client(), job.job_id());
  ASSERT_TRUE(counter->wait_for(1, 600s)) << "the job made no preview";
  m.preview_bytes = counter->image_bytes();
  m.before = settled_rss(server);

  RssSampler sampler(server.pid());
  std::vector<std::unique_ptr<IdleGrpcWatcher>> idle;
  for (int i = 0; i < kGrpcWatchers; ++i) {
    idle.push_back(std::make_unique<IdleGrpcWatcher>(server.address(), job.job_id()));
  }
  m.grpc = settled_rss(server);
  std::vector<std::unique_ptr<SlowSseReader>> slow;
  for (int i = 0; i < kSseReaders; ++i) slow.push_back(std::make_unique<SlowSseReader>(http_port, job.job_id()));
  int streaming = 0;
  for (auto& reader : slow) {
    const bool ok = reader->read_headers(Steady::now() + 120s);
    EXPECT_TRUE(ok) << reader->headers();
    streaming += ok ? 1 : 0;
  }
  EXPECT_EQ(streaming, kSseReaders);
  m.sse = settled_rss(server);
  for (auto until = Steady::now() + kHold; Steady::now() < until;) {
    for (auto& reader : slow) reader->take_a_byte();
    std::this_thread::sleep_for(1s);
  }
  EXPECT_FALSE(counter->finished()) << "the job ended while watched: give it more steps";
  sampler.stop();
  m.peak = sampler.peak();

  idle.clear();
  slow.clear();
  counter.reset();
  EXPECT_TRUE(wait_streams_closed(server)) << "the server still has streams open";
  m.after = settled_rss(server);  // it trims its heap a second after the last stream closed
  pb::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  pb::Job cancelled;
  auto ctx = server.client().context(30);
  EXPECT_TRUE(server.client().stub().CancelJob(ctx.get(), cancel, &cancelled).ok());
}

// Runs the measure on a fresh server and holds it to docs/OPERATIONS.md's bound: each watcher holds at most one
// preview (200 watchers of a 540P job: ~122 MB); in fact none of them holds a copy. What they took is given back once
// they have left.
void expect_within_the_documented_bound(int width, int height) {
  const int http_port = free_port();
  ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32", "--http-listen",
                        "127.0.0.1:" + std::to_string(http_port), "--http-idle-timeout-seconds", "300", "--max-streams",
                        "400", "--max-streams-per-client", "400"});
  WatchMemory m;
  measure(server, http_port, width, height, &m);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_GT(m.preview_bytes, 100000) << "the preview is too small to tell a copy per watcher from none";
  ASSERT_GT(m.before, 0);
  const int64_t documented = (kGrpcWatchers + kSseReaders) * m.preview_bytes;
  const double mib = 1 << 20;
  std::printf("[ watch-memory ] %dx%d, preview %.2f MiB; RSS before %.0f MiB; %d gRPC watchers that never read +%.1f "
              "MiB; and %d SSE readers at 1 byte/s +%.1f MiB in all; peak +%.1f MiB (documented bound +%.0f MiB); "
              "after they left %+.1f MiB\n",
              width, height, m.preview_bytes / mib, m.before / mib, kGrpcWatchers, (m.grpc - m.before) / mib,
              kSseReaders, (m.sse - m.before) / mib, (m.peak - m.before) / mib, documented / mib,
              (m.after - m.before) / mib);
  EXPECT_LT(m.peak - m.before, documented);
  EXPECT_LT(m.after - m.before, documented / 4) << "what the watchers took stayed after they left";
}

TEST(WatchMemory, NeverReadingGrpcWatchersAndSlowSseReadersOfA540pPreviewJobStayWithinTheDocumentedBound) {
  expect_within_the_documented_bound(960, 544);
}

// The same at 720P for docs/BENCHMARKS.md (its first step takes a few minutes on 2 cores):
// test_watch_memory --gtest_also_run_disabled_tests --gtest_filter='*720p*'
TEST(WatchMemory, DISABLED_NeverReadingGrpcWatchersAndSlowSseReadersOfA720pPreviewJobStayWithinTheDocumentedBound) {
  expect_within_the_documented_bound(1280, 720);
}

// A watcher that stops reading skips to the latest preview when it reads again, and the server counts what it
// skipped (skyreels_previews_dropped_total). The watcher announces a small HTTP/2 window (no BDP growth), so one
// preview of a small job stalls its writes; the job makes many previews while it does not read.
TEST(PreviewsDropped, AWatcherThatStopsReadingSkipsToTheLatestPreviewAndTheSkipsAreCounted) {
  ServerProcess server({"--demo", "--devices", "cpu", "--dtype", "float32", "--max-steps", "1000"});
  pb::SubmitJobRequest request = long_video_request(4611, 1000, 1.0);
  auto* p = request.mutable_spec()->mutable_params();
  p->set_width(256);
  p->set_height(256);
  p->set_num_frames(33);
  p->set_base_num_frames(33);
  p->set_preview_every(1);
  const pb::Job job = submit(server.client(), request);
  ASSERT_FALSE(job.job_id().empty());

  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto stub = pb::VideoService::NewStub(grpc::CreateCustomChannel(server.address(), grpc::InsecureChannelCredentials(),
                                                                  args));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 300s);
  pb::WatchJobRequest watch;
  watch.set_job_id(job.job_id());
  watch.set_skip_steps(true);
  auto reader = stub->WatchJob(&context, watch);
  auto next_preview = [&] {
    pb::JobEvent event;
    while (reader->Read(&event)) {
      if (event.has_preview()) return event.preview();
    }
    return pb::ChunkPreview();
  };
  const pb::ChunkPreview first = next_preview();
  ASSERT_GT(first.image().size(), 4096u) << "a preview must overflow the watcher's window";
  const auto dropped = [&] {
    return metric_value(http_get(server.metrics_port(), "/metrics"), "skyreels_previews_dropped_total");
  };
  EXPECT_EQ(dropped(), 0);
  // Not reading: the previews made meanwhile wait at the server as one (the latest), the rest are skipped.
  const auto made = [&] { return metric_value(http_get(server.metrics_port(), "/metrics"), "skyreels_previews_total"); };
  const double made_before = made();
  for (auto until = Steady::now() + 120s; made() < made_before + 5 && Steady::now() < until;) {
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_GE(made(), made_before + 5) << "the job made no previews while the watcher did not read";
  const pb::ChunkPreview later = next_preview();  // the stalled write, then the latest one
  const pb::ChunkPreview latest = next_preview();
  EXPECT_GT(latest.step(), first.step() + 1) << "the watcher was sent previews it had no room for";
  EXPECT_GE(dropped(), 1) << "skipped previews were not counted";
  context.TryCancel();
  reader->Finish();
  pb::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  pb::Job cancelled;
  auto ctx = server.client().context(30);
  EXPECT_TRUE(server.client().stub().CancelJob(ctx.get(), cancel, &cancelled).ok());
  (void)later;
}

}  // namespace
}  // namespace skyreels::test
