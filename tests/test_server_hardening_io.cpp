// Issue 12, the transport and input half: what a hostile or careless client does to the real skyreels-server binary
// on 127.0.0.1, and what the server must answer. Each test names the item it shows:
//   1 blobs bounded before parsing, 2 streams cannot starve the server, 7 text encoding behind admission,
//   8 /metrics cannot be held, 10 fair to many clients, 11 small wrong answers.
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "model/umt5_encoder.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;
using Steady = std::chrono::steady_clock;

const int kServing = grpc::health::v1::HealthCheckResponse::SERVING;

// ---- helpers ------------------------------------------------------------------------------------------------------

// A field of /proc/PID/status as a number (VmRSS in kB, Threads).
int64_t proc_status(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

grpc::Status get_job(server::Client& client, const std::string& id, pb::Job* out = nullptr) {
  auto ctx = client.context(10);
  pb::GetJobRequest request;
  request.set_job_id(id);
  pb::Job job;
  const grpc::Status status = client.stub().GetJob(ctx.get(), request, &job);
  if (out) *out = job;
  return status;
}

void cancel(server::Client& client, const std::string& id) {
  auto ctx = client.context(10);
  pb::CancelJobRequest request;
  request.set_job_id(id);
  pb::Job job;
  client.stub().CancelJob(ctx.get(), request, &job);
}

// A job that runs for tens of seconds on a server with --step-delay-ms (cancelled by the tests when done).
pb::SubmitJobRequest long_running_request(uint64_t seed) { return long_video_request(seed, 50, 1.0); }

// A server with API keys is a production server and takes no test hook (--step-delay-ms): its jobs last by their own
// work instead, 1000 steps per chunk (a minute or more of the demo model's CPU time; cancelled by the tests when done).
constexpr int64_t kLongComputingSteps = 1000;
pb::SubmitJobRequest long_computing_request(uint64_t seed) {
  return long_video_request(seed, kLongComputingSteps, 1.0);
}

double metric(const ServerProcess& server, const std::string& name) {
  return metric_value(http_get(server.metrics_port(), "/metrics"), name);
}

// Polls /metrics until `name` equals `value` (event-based on the server's own counter), or 10 s.
bool metric_reaches(const ServerProcess& server, const std::string& name, double value) {
  const auto until = Steady::now() + 10s;
  while (Steady::now() < until) {
    if (metric(server, name) == value) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// N WatchJob streams opened at once through the async API (the test holds no thread per stream). The constructor
// returns once every stream sent its first event (accepted) or finished (refused).
class WatchCrowd {
 public:
  WatchCrowd(server::Client& client, const std::string& job_id, int count) : streams_(static_cast<size_t>(count)) {
    pb::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_skip_steps(true);
    for (size_t i = 0; i < streams_.size(); ++i) {
      Stream& s = streams_[i];
      s.ctx = client.context(300);
      s.reader = client.stub().PrepareAsyncWatchJob(s.ctx.get(), request, &cq_);
      s.reader->StartCall(tag(i, kStart));
    }
    size_t unresolved = streams_.size();
    while (unresolved > 0 && step(60s)) {
      unresolved = 0;
      for (const Stream& s : streams_) unresolved += (!s.accepted && !s.finished) ? 1 : 0;
    }
    EXPECT_EQ(unresolved, 0u) << "streams that neither sent an event nor finished within 60 s";
  }

  ~WatchCrowd() {
    for (Stream& s : streams_) s.ctx->TryCancel();
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i].accepted && !streams_[i].finished)
        streams_[i].reader->Finish(&streams_[i].status, tag(i, kFinish));
    }
    while (std::any_of(streams_.begin(), streams_.end(), [](const Stream& s) { return !s.finished; })) {
      if (!step(30s)) break;
    }
    cq_.Shutdown();
    void* got = nullptr;
    bool ok = false;
    while (cq_.Next(&got, &ok)) {
    }
  }

  int accepted() const {
    return static_cast<int>(
        std::count_if(streams_.begin(), streams_.end(), [](const Stream& s) { return s.accepted; }));
  }
  // Statuses of the streams refused before their first event.
  std::vector<grpc::Status> refusals() const {
    std::vector<grpc::Status> out;
    for (const Stream& s : streams_) {
      if (!s.accepted && s.finished) out.push_back(s.status);
    }
    return out;
  }

 private:
  enum Kind { kStart, kRead, kFinish };
  struct Stream {
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientAsyncReader<pb::JobEvent>> reader;
    pb::JobEvent event;
    grpc::Status status;
    bool accepted = false, finished = false;
  };
  static void* tag(size_t i, Kind kind) { return reinterpret_cast<void*>(i * 4 + static_cast<size_t>(kind) + 4); }

  // Handles one completion; false on timeout.
  bool step(std::chrono::seconds timeout) {
    void* got = nullptr;
    bool ok = false;
    if (cq_.AsyncNext(&got, &ok, std::chrono::system_clock::now() + timeout) !=
        grpc::CompletionQueue::NextStatus::GOT_EVENT) {
      return false;
    }
    const size_t value = reinterpret_cast<size_t>(got) - 4;
    Stream& s = streams_[value / 4];
    switch (static_cast<Kind>(value % 4)) {
      case kStart:
        if (ok) {
          s.reader->Read(&s.event, tag(value / 4, kRead));
        } else {
          s.reader->Finish(&s.status, tag(value / 4, kFinish));
        }
        break;
      case kRead:
        if (ok) {
          s.accepted = true;
        } else {
          s.reader->Finish(&s.status, tag(value / 4, kFinish));
        }
        break;
      case kFinish:
        s.finished = true;
        break;
    }
    return true;
  }

  grpc::CompletionQueue cq_;
  std::vector<Stream> streams_;
};

// Unary calls and readiness, answered within 5 s each.
void expect_unary_calls_answered(ServerProcess& server, const std::string& job_id) {
  server::Client& client = server.client();
  EXPECT_TRUE(get_job(client, job_id).ok());
  auto ctx = client.context(5);
  pb::ServerInfo info;
  EXPECT_TRUE(client.stub().GetServerInfo(ctx.get(), pb::GetServerInfoRequest(), &info).ok());
  pb::SubmitJobResponse submitted;
  const grpc::Status status = submit_status(client, long_video_request(9001, 1), &submitted);
  EXPECT_TRUE(status.ok()) << server::describe(status);
  EXPECT_EQ(health_status(server.address(), ""), kServing);
}

// ---- 1. request blobs are bounded before parsing --------------------------------------------------------------------

TEST(HardeningIo, Item1_NestedSafetensorsHeaderIsRefusedAtOnceWithoutGrowingTheServer) {
  ServerProcess server({"--demo", "--devices", "cpu"});
  const int64_t rss_before = proc_status(server.pid(), "VmRSS");
  // An 8-byte header announcing ~60 MB of "[[[[...": 18 s and +4 GB of RSS before the limit.
  const uint64_t len = 60u << 20;
  std::string blob(8, '\0');
  for (int i = 0; i < 8; ++i) blob[static_cast<size_t>(i)] = static_cast<char>((len >> (8 * i)) & 0xff);
  blob += std::string(len, '[');
  pb::SubmitJobRequest request = long_video_request(1, 1);
  request.mutable_spec()->set_embeddings_safetensors(blob);
  const auto t0 = Steady::now();
  const grpc::Status status = submit_status(server.client(), request);
  const double seconds = std::chrono::duration<double>(Steady::now() - t0).count();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_EQ(status.error_message().rfind("embeddings_safetensors: header of 62914560 bytes is over the limit", 0), 0u)
      << status.error_message();
  EXPECT_LT(seconds, 5.0) << "refused before parsing";
  const int64_t grown_mb = (proc_status(server.pid(), "VmRSS") - rss_before) / 1024;
  std::cout << "60 MB nested header: refused in " << seconds << " s, server RSS +" << grown_mb << " MB\n";
  EXPECT_LT(grown_mb, 400) << "the message itself is 60 MB; parsing it took +4 GB";
  EXPECT_EQ(wait_job(server.client(), submit(server.client(), long_video_request(2, 1)).job_id()).state(),
            pb::JOB_STATE_SUCCEEDED);
}

// ---- 2. streams cannot starve the server --------------------------------------------------------------------------

TEST(HardeningIo, Item2_SixHundredWatchersHoldNoThreadAndUnaryCallsKeepWorking) {
  ServerProcess server({"--demo", "--devices", "cpu", "--enable-test-hooks", "--step-delay-ms", "100", "--max-streams",
                        "1000", "--max-streams-per-client", "1000"});
  const std::string id = submit(server.client(), long_running_request(10)).job_id();
  const int64_t threads_before = proc_status(server.pid(), "Threads");
  {
    WatchCrowd crowd(server.client(), id, 600);
    EXPECT_EQ(crowd.accepted(), 600);
    const int64_t threads_open = proc_status(server.pid(), "Threads");
    std::cout << "threads: " << threads_before << " before, " << threads_open << " with 600 watchers open\n";
    EXPECT_LT(threads_open - threads_before, 100) << "a watcher must not hold a thread";
    EXPECT_EQ(metric(server, "skyreels_streams_open"), 600);
    expect_unary_calls_answered(server, id);
  }
  EXPECT_TRUE(metric_reaches(server, "skyreels_streams_open", 0)) << "closed streams give their places back";
  cancel(server.client(), id);
}

class CappedServerTest : public SharedServerSuite<CappedServerTest> {
 public:
  static inline const std::string kAlice = "alice-" + std::string(32, 'a');
  static inline const std::string kBob = "bob-" + std::string(32, 'b');
  static std::unique_ptr<ServerProcess> start() {
    const std::string dir = temp_dir("capped-keys");
    std::ofstream(dir + "/keys") << kAlice << " alice max_priority=2 max_jobs=2 max_streams=3\n" << kBob << " bob\n";
    return std::make_unique<ServerProcess>(
        std::vector<std::string>{"--demo", "--devices", "cpu", "--max-steps", std::to_string(kLongComputingSteps),
                                 "--api-keys", dir + "/keys", "--max-streams", "6", "--max-streams-per-client", "4",
                                 "--max-jobs-per-client", "3"},
        true, kAlice);
  }
};

TEST_F(CappedServerTest, Item2_StreamsAreCappedPerClientAndInTotalAndOnlyTheNewStreamIsRefused) {
  auto bob = server_->client_with_key(kBob);
  const std::string alice_job = submit(server_->client(), long_computing_request(20)).job_id();
  const std::string bob_job = submit(*bob, long_computing_request(21)).job_id();
  const double per_client_before = metric(*server_, "skyreels_streams_rejected_total{reason=\"per_client\"}");
  const double total_before = metric(*server_, "skyreels_streams_rejected_total{reason=\"total\"}");
  {
    WatchCrowd alice_watchers(server_->client(), alice_job, 5);
    EXPECT_EQ(alice_watchers.accepted(), 3) << "alice's key says max_streams=3";
    for (const auto& s : alice_watchers.refusals()) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      EXPECT_NE(s.error_message().find("for this client"), std::string::npos) << s.error_message();
    }
    WatchCrowd bob_watchers(*bob, bob_job, 5);
    EXPECT_EQ(bob_watchers.accepted(), 3) << "--max-streams 6, 3 taken by alice";
    for (const auto& s : bob_watchers.refusals()) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      EXPECT_NE(s.error_message().find("on this server (--max-streams 6)"), std::string::npos) << s.error_message();
    }
    // DownloadResult and Generate count against the same caps.
    pb::DownloadResultRequest download;
    download.set_job_id(bob_job);
    EXPECT_EQ(server::download_chunks(*bob, download, [](int32_t, int32_t, std::string) {}).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
    pb::GenerateRequest generate;
    *generate.mutable_job() = long_video_request(22, 1);
    auto ctx = bob->context(10);
    auto reader = bob->stub().Generate(ctx.get(), generate);
    pb::GenerateResponse item;
    EXPECT_FALSE(reader->Read(&item));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    // Unary calls are unaffected.
    EXPECT_TRUE(get_job(*bob, bob_job).ok());
    EXPECT_EQ(health_status(server_->address(), ""), kServing);
    EXPECT_EQ(metric(*server_, "skyreels_streams_open"), 6);
  }
  EXPECT_EQ(metric(*server_, "skyreels_streams_rejected_total{reason=\"per_client\"}") - per_client_before, 2);
  EXPECT_GE(metric(*server_, "skyreels_streams_rejected_total{reason=\"total\"}") - total_before, 4);
  EXPECT_TRUE(metric_reaches(*server_, "skyreels_streams_open", 0));
  cancel(server_->client(), alice_job);
  cancel(*bob, bob_job);
  EXPECT_EQ(wait_job(server_->client(), alice_job).state(), pb::JOB_STATE_CANCELLED);  // no longer counts
  EXPECT_EQ(wait_job(*bob, bob_job).state(), pb::JOB_STATE_CANCELLED);
}

// ---- 10. fair to many clients -------------------------------------------------------------------------------------

TEST_F(CappedServerTest, Item10_QueuedJobsAreCappedPerClientAndPriorityPerKey) {
  auto bob = server_->client_with_key(kBob);
  std::vector<std::pair<server::Client*, std::string>> admitted;
  // alice: max_jobs=2 from her key line.
  std::string retry_after;
  grpc::Status status;
  for (int i = 0; i < 3; ++i) {
    pb::SubmitJobResponse response;
    status = submit_status(server_->client(), long_computing_request(30 + i), &response, &retry_after);
    if (status.ok()) admitted.emplace_back(&server_->client(), response.job().job_id());
  }
  EXPECT_EQ(admitted.size(), 2u);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("client queue full"), std::string::npos) << status.error_message();
  EXPECT_FALSE(retry_after.empty()) << "trailing metadata retry-after-ms";
  // bob: --max-jobs-per-client 3, unaffected by alice's jobs.
  for (int i = 0; i < 4; ++i) {
    pb::SubmitJobResponse response;
    status = submit_status(*bob, long_computing_request(40 + i), &response);
    if (status.ok()) admitted.emplace_back(bob.get(), response.job().job_id());
  }
  EXPECT_EQ(admitted.size(), 5u);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // alice may not use priority 3 (max_priority=2); bob may.
  pb::SubmitJobRequest urgent = long_video_request(50, 1);
  urgent.set_priority(3);
  status = submit_status(server_->client(), urgent);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  EXPECT_EQ(status.error_message().rfind("priority: 3 is above this client's max_priority 2", 0), 0u);
  EXPECT_GE(metric(*server_, "skyreels_jobs_rejected_total{reason=\"client_limit\"}"), 3);
  for (const auto& [client, id] : admitted) cancel(*client, id);
  for (const auto& [client, id] : admitted) EXPECT_EQ(wait_job(*client, id).state(), pb::JOB_STATE_CANCELLED);
}

TEST_F(CappedServerTest, Item11_ApiKeysWithoutTlsAreWarnedAbout) {
  EXPECT_NE(server_->log().find("event=insecure_config"), std::string::npos);
  EXPECT_NE(server_->log().find("--api-keys without --tls-cert"), std::string::npos);
}

// Without --api-keys on a non-loopback address the log says so. (Started by hand: the harness listens on loopback.)
TEST(HardeningIo, Item10_NoApiKeysBeyondLoopbackIsWarnedAbout) {
  const std::string log = temp_dir("open-server") + "/server.log";
  // $! is the server itself (no wrapper whose death would leave it running); the guard kills it on every path.
  const std::string command = "exec " + bin_path("skyreels-server") +
                              " --demo --devices cpu --job-store memory --listen 0.0.0.0:" + std::to_string(free_port()) +
                              " --metrics-listen 127.0.0.1:" + std::to_string(free_port()) + " > " + log +
                              " 2>&1 < /dev/null & echo $!";
  std::string pid_text;
  ASSERT_EQ(run_command(command, &pid_text), 0);
  const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
  const std::shared_ptr<void> stop(nullptr, [pid](void*) {
    ::kill(pid, SIGKILL);
    for (int i = 0; i < 200 && ::kill(pid, 0) == 0; ++i) std::this_thread::sleep_for(10ms);
  });
  std::string text;
  const auto until = Steady::now() + 60s;
  while (Steady::now() < until && text.find("event=listening") == std::string::npos) {
    std::this_thread::sleep_for(50ms);
    std::ifstream in(log);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  EXPECT_NE(text.find("event=insecure_config listen=0.0.0.0"), std::string::npos) << text;
  EXPECT_NE(text.find("no --api-keys"), std::string::npos) << text;
}

// ---- 7. text encoding behind admission ----------------------------------------------------------------------------

class TextServerIoTest : public SharedServerSuite<TextServerIoTest> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    const std::string encoder_dir = temp_dir("tiny-umt5-io");
    model::write_tiny_text_encoder(encoder_dir, 32, 7);
    return std::make_unique<ServerProcess>(
        std::vector<std::string>{"--demo", "--devices", "cpu", "--enable-test-hooks", "--step-delay-ms", "100",
                                 "--max-queue", "1", "--max-concurrent-encodes", "1", "--text-encoder", encoder_dir,
                                 "--tokenizer", golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer")});
  }
};

pb::SubmitJobRequest text_request(uint64_t seed) {
  pb::SubmitJobRequest request = long_video_request(seed, 1);
  request.mutable_spec()->mutable_text()->set_prompt("A cat walks on the grass, realistic style.");
  return request;
}

TEST_F(TextServerIoTest, Item7_AFullQueueRefusesATextPromptBeforeEncodingIt) {
  const double encodes_before = metric(*server_, "skyreels_text_encode_seconds_count");
  const std::string id = submit(server_->client(), long_running_request(60)).job_id();  // fills --max-queue 1
  std::string retry_after;
  const grpc::Status status = submit_status(server_->client(), text_request(61), nullptr, &retry_after);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("queue full"), std::string::npos) << status.error_message();
  EXPECT_FALSE(retry_after.empty());
  EXPECT_EQ(metric(*server_, "skyreels_text_encode_seconds_count"), encodes_before) << "no encode for a refused job";
  cancel(server_->client(), id);
  EXPECT_EQ(wait_job(server_->client(), id).state(), pb::JOB_STATE_CANCELLED);
}

TEST_F(TextServerIoTest, Item7_ConcurrentEncodesAreBoundedAndTheRestToldWhenToRetry) {
  // 8 text submissions at once against --max-concurrent-encodes 1 (and --max-queue 1): each is admitted, refused
  // because the queue is full, or refused because the encoder is busy, and the last two carry a retry hint.
  const double busy_before = metric(*server_, "skyreels_jobs_rejected_total{reason=\"encoder_busy\"}");
  std::vector<grpc::Status> statuses(8);
  std::vector<std::string> hints(8);
  std::vector<std::string> ids(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < statuses.size(); ++i) {
    threads.emplace_back([&, i] {
      pb::SubmitJobResponse response;
      statuses[i] = submit_status(server_->client(), text_request(70 + i), &response, &hints[i]);
      ids[i] = response.job().job_id();
    });
  }
  for (auto& t : threads) t.join();
  int busy = 0;
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (statuses[i].ok()) continue;
    EXPECT_EQ(statuses[i].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << statuses[i].error_message();
    EXPECT_FALSE(hints[i].empty()) << statuses[i].error_message();
    busy += statuses[i].error_message().find("text encoder busy") != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(metric(*server_, "skyreels_jobs_rejected_total{reason=\"encoder_busy\"}") - busy_before, busy);
  for (const auto& id : ids) {
    if (!id.empty()) cancel(server_->client(), id);
  }
  std::cout << busy << " of 8 concurrent text submissions found the encoder busy\n";
}

// ---- 8. /metrics cannot be held -------------------------------------------------------------------------------------

TEST(HardeningIo, Item8_SlowAndIdleScrapeConnectionsNeitherBlockScrapesNorShutdown) {
  ServerProcess server({"--demo", "--devices", "cpu"});
  // A client sending one byte every second, and 20 that send nothing.
  const int slow = connect_loopback(server.metrics_port());
  ASSERT_GE(slow, 0);
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) idle.push_back(connect_loopback(server.metrics_port()));
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    const std::string request = "GET /metrics HTTP/1.1\r\n";
    for (size_t i = 0; i < request.size() && !stop; ++i) {
      if (::send(slow, &request[i], 1, MSG_NOSIGNAL) <= 0) return;
      std::this_thread::sleep_for(1s);
    }
  });
  // Scrapes are answered at once meanwhile.
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Steady::now();
    int status = 0;
    const std::string body = http_get(server.metrics_port(), "/metrics", &status);
    EXPECT_EQ(status, 200);
    EXPECT_LT(Steady::now() - t0, 1s) << "scrape " << i << " waited for the slow connection";
    std::this_thread::sleep_for(300ms);
  }
  // A client that closes its sending side after the request (nc -N, some probes) still gets its answer.
  {
    const int fd = connect_loopback(server.metrics_port());
    // A whole request: the metrics port is the HTTP port's listener (libmicrohttpd), which closes a connection that
    // ends before its request does, as RFC 9112 lets it.
    const std::string request = "GET /metrics HTTP/1.0\r\n\r\n";
    ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
    ::shutdown(fd, SHUT_WR);
    std::string response;
    char buffer[4096];
    ssize_t got = 0;
    while ((got = ::recv(fd, buffer, sizeof buffer, 0)) > 0) response.append(buffer, static_cast<size_t>(got));
    ::close(fd);
    EXPECT_EQ(response.rfind("HTTP/1.1 200 OK", 0), 0u) << response.substr(0, 80);
  }
  // The slow connection is closed at its total deadline (5 s), not kept alive byte by byte.
  char byte = 0;
  timeval timeout{8, 0};
  ::setsockopt(slow, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  const auto t0 = Steady::now();
  const ssize_t n = ::recv(slow, &byte, 1, 0);
  const bool closed = n == 0 || (n < 0 && errno == ECONNRESET);  // RST when a trickled byte was still unread
  EXPECT_TRUE(closed) << "recv gave " << n << ", errno " << errno;
  EXPECT_LT(Steady::now() - t0, 7s) << "closed at the 5 s deadline";
  stop = true;
  trickle.join();
  // Shutdown is not held by open scrape connections either.
  for (int i = 0; i < 5; ++i) idle.push_back(connect_loopback(server.metrics_port()));
  const auto stop_t0 = Steady::now();
  server.signal(SIGTERM);
  EXPECT_EQ(server.wait_exit(10s), 0) << server.log();
  std::cout << "exit " << std::chrono::duration<double>(Steady::now() - stop_t0).count()
            << " s after SIGTERM with 25 scrape connections open\n";
  ::close(slow);
  for (int fd : idle) ::close(fd);
}

// ---- 11. small wrong answers ----------------------------------------------------------------------------------------

class IoServerTest : public SharedServerSuite<IoServerTest> {
 public:
  static std::unique_ptr<ServerProcess> start() {
    return std::make_unique<ServerProcess>(std::vector<std::string>{"--demo", "--devices", "cpu"});
  }
};

// A unary call with raw request bytes (what a broken or hostile client sends), through the generic stub.
grpc::Status raw_unary(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                       const std::string& bytes) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  return status;
}

TEST_F(IoServerTest, Item11_MalformedProtobufAndNonUtf8StringsAreInvalidArgument) {
  const auto channel = server_->client().channel();
  // Field 1 (job_id, string) with a length past the end; and with bytes that are not UTF-8.
  const grpc::Status truncated = raw_unary(channel, "/skyreels.v1.VideoService/GetJob", std::string("\x0a\x50", 2));
  EXPECT_EQ(truncated.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << truncated.error_message();
  EXPECT_NE(truncated.error_message().find("malformed protobuf"), std::string::npos);
  const grpc::Status latin1 =
      raw_unary(channel, "/skyreels.v1.VideoService/GetJob", std::string("\x0a\x02\xff\xfe", 4));
  EXPECT_EQ(latin1.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << latin1.error_message();
  // A text prompt that is not UTF-8 (JobSpec.text = 3, TextPrompt.prompt = 1) inside SubmitJobRequest.spec = 1.
  const std::string prompt = std::string("\x0a\x02\xc3\x28", 4);  // TextPrompt{prompt: C3 28}
  const std::string spec = "\x1a" + std::string(1, static_cast<char>(prompt.size())) + prompt;  // JobSpec{text}
  const std::string submit = "\x0a" + std::string(1, static_cast<char>(spec.size())) + spec;  // SubmitJobRequest{spec}
  const grpc::Status bad_prompt = raw_unary(channel, "/skyreels.v1.VideoService/SubmitJob", submit);
  EXPECT_EQ(bad_prompt.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad_prompt.error_message();
  EXPECT_EQ(health_status(server_->address(), ""), kServing);
}

// WatchJob parses its request itself (a raw method, issue 46): truncated bytes or a job id that is not UTF-8 end the
// stream INVALID_ARGUMENT before anything is sent, as the generated methods do.
TEST_F(IoServerTest, Item11_AMalformedWatchJobRequestIsInvalidArgument) {
  const auto channel = server_->client().channel();
  const grpc::Status truncated = raw_unary(channel, "/skyreels.v1.VideoService/WatchJob", std::string("\x0a\x50", 2));
  EXPECT_EQ(truncated.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << truncated.error_message();
  const grpc::Status latin1 =
      raw_unary(channel, "/skyreels.v1.VideoService/WatchJob", std::string("\x0a\x02\xff\xfe", 4));
  EXPECT_EQ(latin1.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << latin1.error_message();
  const grpc::Status fine = raw_unary(channel, "/skyreels.v1.VideoService/WatchJob", std::string("\x0a\x01x", 3));
  EXPECT_EQ(fine.error_code(), grpc::StatusCode::NOT_FOUND) << fine.error_message();  // parsed: no such job
}

TEST_F(IoServerTest, Item11_ClientStringsCannotForgeLogLines) {
  pb::SubmitJobRequest request = long_video_request(100, 1);
  request.mutable_spec()->mutable_params()->mutable_scheduler()->set_solver_type("bh2\nevent=forged job=j-0");
  const grpc::Status status = submit_status(server_->client(), request);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const std::string log = server_->log();
  EXPECT_EQ(log.find("\nevent=forged"), std::string::npos) << "a client string started a log line";
  EXPECT_NE(log.find("bh2\\nevent=forged"), std::string::npos) << "the escaped value is logged";
}

TEST_F(IoServerTest, Item11_TimestampsAndDurationsAreRangeChecked) {
  struct Case {
    std::string name;
    std::function<void(pb::SubmitJobRequest&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"timeout 1e10 s", [](auto& r) { r.mutable_timeout()->set_seconds(10000000000); }, "timeout: longer than"},
      {"timeout nanos -2^31", [](auto& r) { r.mutable_timeout()->set_nanos(INT32_MIN); },
       "timeout: not a valid google.protobuf.Duration"},
      {"timeout of mixed signs",
       [](auto& r) {
         r.mutable_timeout()->set_seconds(5);
         r.mutable_timeout()->set_nanos(-1);
       },
       "timeout: not a valid"},
      {"zero timeout", [](auto& r) { r.mutable_timeout()->set_seconds(0); }, "timeout: must be positive"},
      {"deadline in year 10000", [](auto& r) { r.mutable_deadline()->set_seconds(253402300800); },
       "deadline: not a valid google.protobuf.Timestamp"},
      {"deadline nanos -1",
       [](auto& r) {
         r.mutable_deadline()->set_seconds(4000000000);
         r.mutable_deadline()->set_nanos(-1);
       },
       "deadline: not a valid"},
      {"deadline in 2096", [](auto& r) { r.mutable_deadline()->set_seconds(4000000000); }, "deadline: more than"},
      {"deadline passed", [](auto& r) { r.mutable_deadline()->set_seconds(1000); }, "deadline: already passed"},
  };
  for (const auto& c : cases) {
    pb::SubmitJobRequest request = long_video_request(110, 1);
    c.mutate(request);
    const grpc::Status status = submit_status(server_->client(), request);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name << ": " << status.error_message();
    EXPECT_EQ(status.error_message().rfind(c.message, 0), 0u) << c.name << ": " << status.error_message();
  }
}

TEST_F(IoServerTest, Item11_FormatsPageTokensIdsAndCorrectorStepsAreChecked) {
  server::Client& client = server_->client();
  const pb::Job done = wait_job(client, submit(client, long_video_request(120, 1)).job_id());
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED);
  pb::DownloadResultRequest download;
  download.set_job_id(done.job_id());
  download.set_format(static_cast<pb::ResultFormat>(99));
  const grpc::Status format = server::download_chunks(client, download, [](int32_t, int32_t, std::string) {});
  EXPECT_EQ(format.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << format.error_message();
  EXPECT_EQ(format.error_message().rfind("format: 99", 0), 0u) << format.error_message();
  {
    pb::GenerateRequest generate;
    *generate.mutable_job() = long_video_request(121, 1);
    generate.set_format(static_cast<pb::ResultFormat>(99));
    auto ctx = client.context(10);
    auto reader = client.stub().Generate(ctx.get(), generate);
    pb::GenerateResponse item;
    EXPECT_FALSE(reader->Read(&item));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  for (const std::string token : {"-1", "+1", " 1", "1e3", "99999999999999999999999"}) {
    pb::ListJobsRequest list;
    list.set_page_token(token);
    pb::ListJobsResponse response;
    auto ctx = client.context(10);
    EXPECT_EQ(client.stub().ListJobs(ctx.get(), list, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << "page_token '" << token << "'";
  }
  // A 10 KB id is refused by length, and never echoed whole; a short unknown one is echoed escaped.
  pb::Job job;
  const grpc::Status long_id = get_job(client, std::string(10000, 'x'), &job);
  EXPECT_EQ(long_id.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(long_id.error_message().size(), 200u);
  const grpc::Status odd_id = get_job(client, "j-\n\"x", &job);
  EXPECT_EQ(odd_id.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(odd_id.error_message(), "job 'j-\\n\\\"x' not found");
  for (int64_t step : {int64_t{-1}, int64_t{1}, int64_t{1} << 40}) {  // one step: only index 0 exists
    pb::SubmitJobRequest request = long_video_request(122, 1);
    request.mutable_spec()->mutable_params()->mutable_scheduler()->add_disable_corrector(step);
    const grpc::Status status = submit_status(client, request);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << step;
    EXPECT_EQ(status.error_message().rfind("scheduler.disable_corrector", 0), 0u) << status.error_message();
  }
}

TEST_F(IoServerTest, Item11_AnotherTimeoutUnderTheSameIdempotencyKeyIsAnotherRequest) {
  pb::SubmitJobRequest request = long_video_request(130, 1);
  request.set_idempotency_key("io-key-130");
  request.mutable_timeout()->set_seconds(600);
  pb::SubmitJobResponse first, again;
  ASSERT_TRUE(submit_status(server_->client(), request, &first).ok());
  ASSERT_TRUE(submit_status(server_->client(), request, &again).ok());
  EXPECT_TRUE(again.deduplicated());
  EXPECT_EQ(again.job().job_id(), first.job().job_id());
  request.mutable_timeout()->set_seconds(601);
  const grpc::Status conflict = submit_status(server_->client(), request);
  EXPECT_EQ(conflict.error_code(), grpc::StatusCode::ALREADY_EXISTS) << conflict.error_message();
}

TEST(HardeningIo, Item11_AFailedMp4EndsGenerateWithInternalNotClientWentAway) {
  ServerProcess server(
      {"--demo", "--vae", "demo", "--devices", "cpu", "--enable-test-hooks", "--fault-inject", "vae@1"});
  pb::GenerateRequest generate;
  *generate.mutable_job() = long_video_request(140, 1);
  generate.mutable_job()->mutable_spec()->mutable_params()->set_height(64);
  generate.mutable_job()->mutable_spec()->mutable_params()->set_width(64);
  generate.set_format(pb::RESULT_FORMAT_MP4);
  generate.set_skip_steps(true);
  auto ctx = server.client().context(60);
  auto reader = server.client().stub().Generate(ctx.get(), generate);
  pb::GenerateResponse item;
  std::string id;
  while (reader->Read(&item)) {
    if (item.has_event()) id = item.event().job_id();
  }
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL) << status.error_message();
  EXPECT_NE(status.error_message().find("video encoding failed at chunk 0: injected fault"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(status.error_message().find("client went away"), std::string::npos);
  // DownloadResult says the same; the latents are still there.
  ASSERT_FALSE(id.empty());
  pb::DownloadResultRequest download;
  download.set_job_id(id);
  download.set_format(pb::RESULT_FORMAT_MP4);
  const grpc::Status mp4 = server::download_chunks(server.client(), download, [](int32_t, int32_t, std::string) {});
  EXPECT_EQ(mp4.error_code(), grpc::StatusCode::INTERNAL) << mp4.error_message();
}

TEST(HardeningIo, Item11_ShortApiKeysAreRefusedAtStart) {
  const std::string dir = temp_dir("short-keys");
  std::ofstream(dir + "/keys") << "only-twenty-chars-xx alice\n";
  ServerProcess server({"--demo", "--devices", "cpu", "--api-keys", dir + "/keys"}, false);
  EXPECT_EQ(server.wait_exit(60s), 1);
  EXPECT_NE(server.log().find("key is shorter than 32 characters"), std::string::npos) << server.log();
}

TEST(HardeningIo, Item11_SighupReloadsTheApiKeyFile) {
  const std::string dir = temp_dir("reload-keys");
  const std::string old_key = "old-" + std::string(32, 'o'), new_key = "new-" + std::string(32, 'n');
  std::ofstream(dir + "/keys") << old_key << " alice\n";
  ServerProcess server({"--demo", "--devices", "cpu", "--api-keys", dir + "/keys"}, true, old_key);
  EXPECT_TRUE(get_job(server.client(), "j-0").error_code() == grpc::StatusCode::NOT_FOUND);
  std::ofstream(dir + "/keys") << new_key << " alice\n";
  server.signal(SIGHUP);
  const auto until = Steady::now() + 10s;
  while (Steady::now() < until && server.log().find("event=reloaded") == std::string::npos) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(get_job(server.client(), "j-0").error_code(), grpc::StatusCode::UNAUTHENTICATED) << "old key dropped";
  EXPECT_EQ(get_job(*server.client_with_key(new_key), "j-0").error_code(), grpc::StatusCode::NOT_FOUND);
  // A broken file keeps the keys in use, and the server up.
  std::ofstream(dir + "/keys") << "short\n";
  server.signal(SIGHUP);
  const auto until2 = Steady::now() + 10s;
  while (Steady::now() < until2 && server.log().find("event=reload_failed") == std::string::npos) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_NE(server.log().find("event=reload_failed"), std::string::npos);
  EXPECT_EQ(get_job(*server.client_with_key(new_key), "j-0").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(server.running());
}

// The TLS key pair is re-read by gRPC's file watcher (every 10 s): a renewed certificate is served without a restart.
TEST(HardeningIo, Item11_ARenewedTlsCertificateIsServedWithoutARestart) {
  ASSERT_EQ(run_command("openssl version"), 0) << "openssl makes the test certificates";
  const std::string dir = temp_dir("tls-reload");
  auto make_cert = [&](const std::string& name) {
    return run_command(
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext "
        "subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
        dir + "/" + name + ".key -out " + dir + "/" + name + ".pem 2>/dev/null");
  };
  ASSERT_EQ(make_cert("old"), 0);
  ASSERT_EQ(make_cert("new"), 0);
  ASSERT_EQ(run_command("cp " + dir + "/old.key " + dir + "/key.pem && cp " + dir + "/old.pem " + dir + "/cert.pem"),
            0);
  ServerProcess server({"--demo", "--devices", "cpu", "--tls-cert", dir + "/cert.pem", "--tls-key", dir + "/key.pem"},
                       false);
  auto client_trusting = [&](const std::string& ca) {
    server::ConnectionOptions options;
    options.server = server.address();
    options.tls = true;
    options.tls_ca = dir + "/" + ca + ".pem";
    return std::make_unique<server::Client>(options);
  };
  std::string why;
  ASSERT_TRUE(client_trusting("old")->wait_ready(60, &why)) << why << "\n" << server.log();
  // Renew: the key first, then the certificate (as cert-manager and certbot write them).
  ASSERT_EQ(run_command("cp " + dir + "/new.key " + dir + "/key.pem && cp " + dir + "/new.pem " + dir + "/cert.pem"),
            0);
  EXPECT_TRUE(client_trusting("new")->wait_ready(30, &why)) << "the new certificate was not served: " << why;
  EXPECT_FALSE(client_trusting("old")->wait_ready(2, &why)) << "the old certificate is still served";
}

}  // namespace
}  // namespace skyreels::test
