// Webhooks (--webhook-secret-file, --webhook-allow-hosts): every event a job asked for arrives signed, each under one
// webhook-id, in order; a server SIGKILLed while its receiver fails still delivers everything after a restart, a
// duplicate only ever being a retry the server numbered; a hanging receiver delays no other job's webhooks; URLs
// outside the allow-list are refused at submit. The receiver is the project's own HTTP listener on 127.0.0.1.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "model/umt5_encoder.h"
#include "server/http/http_server.h"
#include "server/webhook/webhook_sender.h"
#include "tests/pg_fixture.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = ::skyreels::v1;

// The key's bytes: Standard Webhooks' "whsec_" + base64 of them is what the server is given.
const std::string kKey = "a webhook signing key of 32 byte";
const std::string kSecretText = "whsec_YSB3ZWJob29rIHNpZ25pbmcga2V5IG9mIDMyIGJ5dGU=";

struct Received {
  std::string id, type, path;
  int attempt = 0;
  bool signature_ok = false;
  int answered = 0;
};

server::http::HttpOptions loopback() {
  server::http::HttpOptions options;
  options.listen = "127.0.0.1:0";
  return options;
}

// Answers by path: /ok 200; /flaky 500 while `failing`, then 200; /hang after 12 s.
class Receiver {
 public:
  Receiver()
      : server_(loopback(), [this](const server::http::Request& r) { return answer(r); },
                [](int status, const std::string& m) { return server::http::Response{status, "text/plain", m, {}, {}}; }) {}
  std::string url(const std::string& path) const { return "http://127.0.0.1:" + std::to_string(server_.port()) + path; }
  std::vector<Received> received() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }
  // Waits until `count` distinct webhook-ids were answered 2xx on `path`.
  bool wait_delivered(const std::string& path, size_t count, double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < until) {
      if (delivered_ids(path).size() >= count) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  std::vector<std::string> delivered_ids(const std::string& path) {
    std::vector<std::string> ids;
    for (const Received& r : received()) {
      if (r.path == path && r.answered == 200 && std::find(ids.begin(), ids.end(), r.id) == ids.end()) ids.push_back(r.id);
    }
    return ids;
  }
  std::atomic<bool> failing{true};

 private:
  server::http::Response answer(const server::http::Request& r) {
    Received got;
    got.path = r.path;
    got.id = r.header("webhook-id").value_or("");
    got.attempt = std::atoi(r.header("skyreels-webhook-attempt").value_or("0").c_str());
    const std::string timestamp = r.header("webhook-timestamp").value_or("0");
    got.signature_ok = r.header("webhook-signature").value_or("") ==
                       server::webhook_signature(kKey, got.id, std::atoll(timestamp.c_str()), r.body);
    got.type = nlohmann::json::parse(r.body, nullptr, false).value("type", "");
    if (r.path == "/hang") std::this_thread::sleep_for(std::chrono::seconds(12));
    got.answered = r.path == "/flaky" && failing ? 500 : 200;
    {
      std::lock_guard<std::mutex> lock(mu_);
      received_.push_back(got);
    }
    return {got.answered, "text/plain", "", {}, {}};
  }
  std::mutex mu_;
  std::vector<Received> received_;
  server::http::HttpServer server_;
};

std::string secret_file() {
  const std::string path = temp_dir("webhook-secret") + "/secret";
  std::ofstream(path) << kSecretText << "\n";
  return path;
}

pb::SubmitJobRequest with_webhook(pb::SubmitJobRequest request, const std::string& url) {
  request.mutable_webhook()->set_url(url);
  for (const char* e : {"started", "chunk_finished", "completed", "failed"}) request.mutable_webhook()->add_events(e);
  return request;
}

// The 4-chunk long video: started, 4 chunks finished, completed.
constexpr size_t kEventsPerJob = 6;

// The sender's own count of deliveries that ended `outcome` (skyreels_webhook_deliveries_total).
double deliveries(ServerProcess& server, const std::string& outcome = "delivered") {
  const double value = metric_value(http_get(server.metrics_port(), "/metrics"),
                                    "skyreels_webhook_deliveries_total{outcome=\"" + outcome + "\"}");
  return std::isnan(value) ? 0 : value;
}

// "Nothing more arrives", shown without sleeping it out: the pods' senders say they delivered `count` (and so have
// nothing in flight that would be another delivery), then one short grace for a request still on the wire.
void expect_senders_delivered(const std::vector<ServerProcess*>& pods, size_t count) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  double total = 0;
  while (std::chrono::steady_clock::now() < until) {
    total = 0;
    for (ServerProcess* pod : pods) total += deliveries(*pod);
    if (total >= static_cast<double>(count)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(total, static_cast<double>(count)) << "deliveries the senders counted";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
}

TEST(Webhooks, EveryEventArrivesSignedOnceInOrder) {
  Receiver receiver;
  ServerProcess server({"--demo", "--devices", "cpu", "--webhook-secret-file", secret_file(), "--webhook-allow-hosts",
                        "127.0.0.1"});
  const pb::Job job = wait_job(server.client(), submit(server.client(), with_webhook(long_video_request(1, 1),
                                                                                      receiver.url("/ok"))).job_id());
  ASSERT_EQ(job.state(), pb::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(receiver.wait_delivered("/ok", kEventsPerJob, 30)) << server.log();
  expect_senders_delivered({&server}, kEventsPerJob);
  const auto got = receiver.received();
  ASSERT_EQ(got.size(), kEventsPerJob);
  std::vector<std::string> types;
  for (const Received& r : got) {
    EXPECT_TRUE(r.signature_ok) << r.id;
    EXPECT_EQ(r.attempt, 1) << r.id;
    EXPECT_EQ(r.id.rfind("msg_" + job.job_id() + "_", 0), 0u) << r.id;
    types.push_back(r.type);
  }
  EXPECT_EQ(types, (std::vector<std::string>{"video.started", "video.chunk_finished", "video.chunk_finished",
                                             "video.chunk_finished", "video.chunk_finished", "video.completed"}));
}

TEST(Webhooks, AServerKilledWhileItsReceiverFailsDeliversEverythingAfterARestart) {
  Receiver receiver;
  const std::string data = temp_dir("webhook-data");
  const std::vector<std::string> args = {"--demo", "--devices", "cpu", "--data-dir", data, "--webhook-secret-file",
                                         secret_file(), "--webhook-allow-hosts", "127.0.0.1"};
  std::string id;
  {
    ServerProcess server(args);
    id = submit(server.client(), with_webhook(long_video_request(2, 1), receiver.url("/flaky"))).job_id();
    ASSERT_EQ(wait_job(server.client(), id).state(), pb::JOB_STATE_SUCCEEDED);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);  // a few refused attempts
    while (deliveries(server, "failed") < 2 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_GE(deliveries(server, "failed"), 2) << server.log();
    EXPECT_EQ(deliveries(server), 0) << "the receiver refused every attempt";
    server.signal(SIGKILL);
    server.wait_exit(std::chrono::seconds(10));
  }
  EXPECT_FALSE(receiver.received().empty()) << "no attempt before the kill";
  receiver.failing = false;
  ServerProcess restarted(args);
  ASSERT_TRUE(receiver.wait_delivered("/flaky", kEventsPerJob, 60)) << restarted.log();
  expect_senders_delivered({&restarted}, kEventsPerJob);
  // Each id delivered exactly once; any id seen more often came with higher attempt numbers each time.
  std::map<std::string, std::vector<Received>> by_id;
  for (const Received& r : receiver.received()) by_id[r.id].push_back(r);
  EXPECT_EQ(by_id.size(), kEventsPerJob);
  for (const auto& [webhook_id, deliveries] : by_id) {
    int ok = 0, attempt = 0;
    for (const Received& r : deliveries) {
      EXPECT_TRUE(r.signature_ok);
      EXPECT_GT(r.attempt, attempt) << webhook_id << ": a repeat the server did not number as a retry";
      attempt = r.attempt;
      ok += r.answered == 200 ? 1 : 0;
    }
    EXPECT_EQ(ok, 1) << webhook_id;
  }
}

TEST(Webhooks, AHangingReceiverDelaysNoOtherJob) {
  Receiver receiver;
  ServerProcess server({"--demo", "--devices", "cpu", "--webhook-secret-file", secret_file(), "--webhook-allow-hosts",
                        "127.0.0.1"});
  const std::string hanging = submit(server.client(), with_webhook(long_video_request(3, 1), receiver.url("/hang"))).job_id();
  const std::string fine = submit(server.client(), with_webhook(long_video_request(4, 1), receiver.url("/ok"))).job_id();
  ASSERT_EQ(wait_job(server.client(), fine).state(), pb::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(receiver.wait_delivered("/ok", kEventsPerJob, 8)) << "the other job's webhooks waited";
  EXPECT_TRUE(receiver.delivered_ids("/hang").empty());
}

// Two pods on PostgreSQL, the job's chunks on both: the pod that accepted it delivers its webhooks, each once (the
// other pod, which sees the same outbox, stays out of it while the accepting pod is alive).
// Two pods with webhooks on one PostgreSQL (chunk leases of 2 s); `extra` goes to both.
// pod-1 may run with its wall clock moved (libfaketime's FAKETIME, e.g. "+90s"; its monotonic clock stays true).
struct TwoPods {
  PgServer pg;
  std::unique_ptr<ServerProcess> pod0, pod1;
  TwoPods(int step_delay_ms, const std::vector<std::string>& extra = {}, const std::string& pod1_faketime = "") {
    ::setenv("SKYREELS_JOB_STORE", pg.url().c_str(), 1);
    const std::string secret = secret_file();
    auto pod = [&](const std::string& name) {
      std::vector<std::string> args = {"--demo",
                                       "--devices",
                                       "cpu",
                                       "--pod-name",
                                       name,
                                       "--lease-seconds",
                                       "2",
                                       "--enable-test-hooks",
                                       "--step-delay-ms",
                                       std::to_string(step_delay_ms),
                                       "--webhook-secret-file",
                                       secret,
                                       "--webhook-allow-hosts",
                                       "127.0.0.1"};
      args.insert(args.end(), extra.begin(), extra.end());
      return std::make_unique<ServerProcess>(args);
    };
    pod0 = pod("pod-0");
    if (!pod1_faketime.empty()) {
      faked_ = true;
      ::setenv("LD_PRELOAD", kLibFaketime, 1);
      ::setenv("FAKETIME", pod1_faketime.c_str(), 1);
      ::setenv("FAKETIME_DONT_FAKE_MONOTONIC", "1", 1);
    }
    pod1 = pod("pod-1");
    for (const char* name : {"LD_PRELOAD", "FAKETIME", "FAKETIME_DONT_FAKE_MONOTONIC", "SKYREELS_JOB_STORE"}) {
      ::unsetenv(name);
    }
  }
  // libfaketime removes its shared memory and semaphore (named by the process id) only when the process exits
  // normally; a pod stopped by SIGKILL leaves them in /dev/shm.
  ~TwoPods() {
    if (!faked_ || !pod1) return;
    const std::string pid = std::to_string(pod1->pid());
    pod1.reset();
    std::error_code ec;
    for (const std::string& name : {"faketime_shm_" + pid, "sem.faketime_sem_" + pid}) {
      std::filesystem::remove("/dev/shm/" + name, ec);
    }
  }
  static constexpr const char* kLibFaketime = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
  bool faked_ = false;
};

// Deliveries that pod `log` made, by job id.
std::map<std::string, int> deliveries_by_job(const std::string& log) {
  std::map<std::string, int> count;
  static const std::regex delivered("job=(\\S+) event=webhook_delivered");
  for (std::sregex_iterator it(log.begin(), log.end(), delivered), end; it != end; ++it) ++count[(*it)[1]];
  return count;
}

// Issue 36: no wall clock across pods. pod-1's clock runs 90 s ahead (leases are timed by PostgreSQL's clock, the
// webhook takeover on this pod's monotonic clock): every event is delivered once, by the pod that accepted its job,
// while both pods run chunks. Before, pod-1 read pod-0's event times as 90 s old and took every delivery over.
TEST(Webhooks, APodWhoseClockRunsAheadTakesNoLiveDeliveryOver) {
  ASSERT_TRUE(std::filesystem::exists(TwoPods::kLibFaketime)) << "Debian's faketime package (scripts/setup.sh)";
  Receiver receiver;
  TwoPods pods(20, {}, "+90s");
  auto& pod0 = pods.pod0;
  auto& pod1 = pods.pod1;
  std::map<std::string, ServerProcess*> accepted_by;
  for (int i = 0; i < 3; ++i) {
    ServerProcess* pod = i < 2 ? pod0.get() : pod1.get();
    const std::string id = submit(pod->client(), with_webhook(long_video_request(60 + static_cast<uint64_t>(i), 2),
                                                              receiver.url("/ok"))).job_id();
    accepted_by[id] = pod;
  }
  // The premise: pod-1's clock is 90 s ahead (it measured PostgreSQL's clock 90 s behind its own); yet it stamps
  // what it accepts on the store's clock, as pod-0 does.
  const std::string pod1_log = pod1->log();
  std::smatch offset;
  ASSERT_TRUE(std::regex_search(pod1_log, offset, std::regex("clock_offset_ms=(-?[0-9]+)"))) << pod1_log;
  EXPECT_LE(std::stoll(offset[1]), -85000) << "libfaketime did not move pod-1's clock";
  for (const auto& [id, pod] : accepted_by) {
    const int64_t created = get_job(pod->client(), id).created_at().seconds();
    EXPECT_LE(std::abs(created - static_cast<int64_t>(std::time(nullptr))), 10) << id << ": not the store's clock";
  }
  for (const auto& [id, pod] : accepted_by) ASSERT_EQ(wait_job(pod0->client(), id).state(), pb::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(receiver.wait_delivered("/ok", 3 * kEventsPerJob, 60)) << pod0->log();
  expect_senders_delivered({pod0.get(), pod1.get()}, 3 * kEventsPerJob);
  std::map<std::string, int> count;
  for (const Received& r : receiver.received()) ++count[r.id];
  EXPECT_EQ(count.size(), 3 * kEventsPerJob);
  for (const auto& [id, n] : count) EXPECT_EQ(n, 1) << id << " delivered more than once";
  const auto by_pod0 = deliveries_by_job(pod0->log());
  const auto by_pod1 = deliveries_by_job(pod1->log());
  for (const auto& [id, pod] : accepted_by) {
    const auto& owner = pod == pod0.get() ? by_pod0 : by_pod1;
    const auto& other = pod == pod0.get() ? by_pod1 : by_pod0;
    EXPECT_EQ(owner.count(id) ? owner.at(id) : 0, static_cast<int>(kEventsPerJob)) << id;
    EXPECT_EQ(other.count(id), 0u) << id << ": delivered by the pod that did not accept it";
  }
  EXPECT_NE(pod1->log().find("event=chunk_finished"), std::string::npos) << "pod-1 ran no chunk: the test shows less";
}

TEST(Webhooks, OnPeersThePodThatAcceptedAJobDeliversEachEventOnce) {
  Receiver receiver;
  TwoPods pods(20);
  auto& pod0 = pods.pod0;
  auto& pod1 = pods.pod1;
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    ids.push_back(submit(pod0->client(), with_webhook(long_video_request(40 + static_cast<uint64_t>(i), 2),
                                                      receiver.url("/ok"))).job_id());
  }
  for (const std::string& id : ids) ASSERT_EQ(wait_job(pod0->client(), id).state(), pb::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(receiver.wait_delivered("/ok", 3 * kEventsPerJob, 30)) << pod0->log();
  expect_senders_delivered({pod0.get(), pod1.get()}, 3 * kEventsPerJob);
  std::map<std::string, int> count;
  for (const Received& r : receiver.received()) {
    EXPECT_TRUE(r.signature_ok);
    ++count[r.id];
  }
  EXPECT_EQ(count.size(), 3 * kEventsPerJob);
  for (const auto& [id, n] : count) EXPECT_EQ(n, 1) << id;
  EXPECT_NE(pod1->log().find("event=chunk_finished"), std::string::npos) << "pod-1 ran no chunk: the test shows less";
}

// The accepting pod SIGKILLed mid-job: the other pod runs the rest of the job and, once an event is
// --webhook-takeover-seconds overdue, delivers what is left; every event arrives, in order, and a repeat only ever as
// a higher numbered attempt of the same webhook-id (the dead pod may have been answered before it could record it).
TEST(Webhooks, WhenTheAcceptingPodDiesAnotherPodDeliversTheRestInOrder) {
  Receiver receiver;
  TwoPods pods(150, {"--webhook-takeover-seconds", "3"});
  auto& pod0 = pods.pod0;
  auto& pod1 = pods.pod1;
  const std::string id = submit(pod0->client(), with_webhook(long_video_request(47, 3), receiver.url("/ok"))).job_id();
  ASSERT_TRUE(receiver.wait_delivered("/ok", 2, 60)) << pod0->log();  // started, the first chunk finished
  ASSERT_NE(get_job(pod1->client(), id).state(), pb::JOB_STATE_SUCCEEDED) << "the job ended before the kill";
  pod0->signal(SIGKILL);
  pod0->wait_exit(std::chrono::seconds(10));
  ASSERT_EQ(wait_job(pod1->client(), id, std::chrono::seconds(120)).state(), pb::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(receiver.wait_delivered("/ok", kEventsPerJob, 60)) << pod1->log();
  // A stray repeat could only come once an event is --webhook-takeover-seconds overdue: waiting past that is the
  // check itself (pod-0's counters died with it, so the senders' counts cannot close it).
  std::this_thread::sleep_for(std::chrono::seconds(4));

  std::map<std::string, std::vector<Received>> by_id;
  std::vector<uint64_t> first_seen;  // event sequences in the order their ids first arrived
  for (const Received& r : receiver.received()) {
    EXPECT_TRUE(r.signature_ok) << r.id;
    if (by_id[r.id].empty()) first_seen.push_back(std::stoull(r.id.substr(r.id.rfind('_') + 1)));
    by_id[r.id].push_back(r);
  }
  EXPECT_EQ(by_id.size(), kEventsPerJob);
  EXPECT_TRUE(std::is_sorted(first_seen.begin(), first_seen.end())) << "events out of order";
  for (const auto& [webhook_id, deliveries] : by_id) {
    EXPECT_EQ(webhook_id.rfind("msg_" + id + "_", 0), 0u) << webhook_id;
    int attempt = 0;
    for (const Received& r : deliveries) {
      EXPECT_GT(r.attempt, attempt) << webhook_id << ": a repeat the pods did not number as a retry";
      attempt = r.attempt;
    }
  }
  EXPECT_EQ(receiver.received().back().type, "video.completed");
  EXPECT_NE(pod1->log().find("event=webhook_delivered"), std::string::npos) << "pod-1 delivered nothing: the test shows less";
}

// The same webhooks from OpenAI's create: webhook_url and webhook_events as extra body fields.
TEST(Webhooks, TheVideosApiTakesAWebhookUrlAndItsEvents) {
  Receiver receiver;
  const std::string encoder_dir = temp_dir("webhook-umt5");
  model::write_tiny_text_encoder(encoder_dir, 32, 7);
  const int http_port = free_port();
  ServerProcess server({"--demo", "--devices", "cpu", "--text-encoder", encoder_dir, "--tokenizer",
                        golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer"), "--http-listen",
                        "127.0.0.1:" + std::to_string(http_port), "--webhook-secret-file", secret_file(),
                        "--webhook-allow-hosts", "127.0.0.1"});
  const std::string body = R"({"prompt":"A dog runs.","size":"48x32","seconds":2,"fps":8,"num_inference_steps":1,)"
                           R"("webhook_url":")" + receiver.url("/ok") + R"(","webhook_events":["completed"]})";
  const std::string out = temp_dir("webhook-http") + "/video.json";
  const std::string command = "curl -s -o " + out + " -H 'Content-Type: application/json' -d '" + body +
                              "' http://127.0.0.1:" + std::to_string(http_port) + "/v1/videos";
  ASSERT_EQ(std::system(command.c_str()), 0);
  std::ifstream created(out);
  const auto video = nlohmann::json::parse(created, nullptr, false);
  ASSERT_TRUE(video.contains("id")) << video.dump();
  ASSERT_TRUE(receiver.wait_delivered("/ok", 1, 30)) << server.log();
  expect_senders_delivered({&server}, 1);
  const auto got = receiver.received();
  ASSERT_EQ(got.size(), 1u) << "only the events asked for";
  EXPECT_EQ(got[0].type, "video.completed");
  EXPECT_TRUE(got[0].signature_ok);
  EXPECT_EQ(got[0].id.rfind("msg_" + video["id"].get<std::string>() + "_", 0), 0u) << got[0].id;
}

TEST(Webhooks, UrlsOutsideTheAllowListAndServersWithoutWebhooksRefuseAtSubmit) {
  ServerProcess server({"--demo", "--devices", "cpu", "--webhook-secret-file", secret_file(), "--webhook-allow-hosts",
                        "127.0.0.1,*.hooks.example.com"});
  for (const std::string url : {"http://10.0.0.1/x", "http://169.254.169.254/latest", "ftp://127.0.0.1/x",
                                "http://user:pw@127.0.0.1/x", "http://hooks.example.com.evil.net/x"}) {
    const grpc::Status status = submit_status(server.client(), with_webhook(long_video_request(5, 1), url));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << url;
    EXPECT_EQ(status.error_message().rfind("webhook.url:", 0), 0u) << status.error_message();
  }
  pb::SubmitJobRequest bad_event = with_webhook(long_video_request(5, 1), "https://a.hooks.example.com/h");
  bad_event.mutable_webhook()->add_events("everything");
  EXPECT_EQ(submit_status(server.client(), bad_event).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  pb::SubmitJobRequest allowed = with_webhook(long_video_request(5, 1), "https://a.hooks.example.com/h");
  EXPECT_TRUE(submit_status(server.client(), allowed).ok());

  ServerProcess without({"--demo", "--devices", "cpu"});
  EXPECT_EQ(submit_status(without.client(), with_webhook(long_video_request(6, 1), "http://127.0.0.1/x")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

}  // namespace
}  // namespace skyreels::test
