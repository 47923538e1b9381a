// Issue 14, many pods on one queue: real skyreels-server processes on 127.0.0.1 sharing one real PostgreSQL 15
// (started by the test on a unix socket, tests/pg_fixture.h) with short chunk leases. Any pod accepts, answers and
// streams any job; a pod killed (SIGKILL) or paused (SIGSTOP) while it runs a chunk loses its lease and another pod
// runs that chunk again; the late pod cannot commit it (fencing); every video equals the single-process
// `skyreels generate` for the same seed exactly, and each chunk is committed once.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "model/video_mp4.h"
#include "tests/pg_fixture.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = skyreels::v1;
using namespace std::chrono_literals;

// A pod: one CPU replica (float32, as `skyreels generate` runs), slowed so that a kill or a pause lands mid-chunk
// (step_delay_ms > 0: a test hook, which a pod with API keys cannot take).
// The store's URL comes from $SKYREELS_JOB_STORE, as in the Kubernetes overlay (no password in the process list).
std::vector<std::string> pod_args(const std::string& pod, double lease_seconds, int step_delay_ms) {
  std::vector<std::string> args = {"--demo",  "--devices",       "cpu",
                                   "--dtype", "float32",         "--pod-name",
                                   pod,       "--lease-seconds", std::to_string(lease_seconds)};
  if (step_delay_ms > 0) {
    args.insert(args.end(), {"--enable-test-hooks", "--step-delay-ms", std::to_string(step_delay_ms)});
  }
  return args;
}

class Cluster {
 public:
  // `extra_args` and `api_key` go to every pod.
  Cluster(int pods, double lease_seconds, int step_delay_ms, std::vector<std::string> extra_args = {},
          std::string api_key = "")
      : lease_seconds_(lease_seconds), delay_(step_delay_ms), extra_(std::move(extra_args)), key_(std::move(api_key)) {
    ::setenv("SKYREELS_JOB_STORE", pg_.url().c_str(), 1);
    for (int i = 0; i < pods; ++i) add_pod();
  }
  ~Cluster() { ::unsetenv("SKYREELS_JOB_STORE"); }

  ServerProcess& add_pod() {
    const std::string name = "pod-" + std::to_string(pods_.size());
    std::vector<std::string> args = pod_args(name, lease_seconds_, delay_);
    args.insert(args.end(), extra_.begin(), extra_.end());
    pods_.push_back(std::make_unique<ServerProcess>(args, true, key_));
    return *pods_.back();
  }
  ServerProcess& pod(size_t i) { return *pods_.at(i); }
  size_t size() const { return pods_.size(); }
  PgServer& pg() { return pg_; }

 private:
  PgServer pg_;
  double lease_seconds_;
  int delay_;
  std::vector<std::string> extra_;
  std::string key_;
  std::vector<std::unique_ptr<ServerProcess>> pods_;
};

// 57 frames in chunks of 17 with overlap 9: six chunks.
pb::SubmitJobRequest six_chunk_request(uint64_t seed) {
  pb::SubmitJobRequest request = long_video_request(seed);
  request.mutable_spec()->mutable_params()->set_num_frames(57);
  return request;
}

int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// Waits until the pod's log holds `needle` more than `already` times; false after `timeout`.
bool wait_for_log(ServerProcess& pod, const std::string& needle, int already, std::chrono::seconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (count_of(pod.log(), needle) > already) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

bool finished(const pb::JobEvent& e) { return e.has_finished(); }

// Chunk index -> how many ChunkFinished events the job has for it (each chunk is committed exactly once: 1).
std::map<int64_t, int> finished_chunks(const std::vector<pb::JobEvent>& events) {
  std::map<int64_t, int> count;
  for (const auto& e : events) {
    if (e.has_chunk_finished()) ++count[e.chunk_finished().chunk_index()];
  }
  return count;
}

void expect_each_chunk_once(const std::vector<pb::JobEvent>& events, int64_t chunks, const std::string& id) {
  const auto count = finished_chunks(events);
  EXPECT_EQ(static_cast<int64_t>(count.size()), chunks) << id;
  for (const auto& [chunk, n] : count) EXPECT_EQ(n, 1) << id << " chunk " << chunk << " committed " << n << " times";
  for (size_t i = 1; i < events.size(); ++i) EXPECT_GT(events[i].sequence(), events[i - 1].sequence()) << id;
}

TEST(Peers, ThreePodsShareOneQueueAndAPodKilledMidChunkLosesNothing) {
  Cluster cluster(3, /*lease_seconds=*/2.0, /*step_delay_ms=*/40);
  std::vector<pb::SubmitJobRequest> requests;
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    requests.push_back(six_chunk_request(1401 + static_cast<uint64_t>(i)));
    ids.push_back(submit(cluster.pod(static_cast<size_t>(i) % 3).client(), requests.back()).job_id());  // round robin
  }
  // Kill pod 1 while it runs a chunk (its log says so as the chunk starts; a chunk takes many 40 ms steps).
  ASSERT_TRUE(wait_for_log(cluster.pod(1), "event=chunk_started", 0, 120s)) << cluster.pod(1).log();
  cluster.pod(1).signal(SIGKILL);
  ASSERT_NE(cluster.pod(1).wait_exit(10s), -1);

  const std::vector<size_t> alive = {0, 2};
  int retries = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    // Watched through a pod the job was not submitted to, downloaded through the other one.
    ServerProcess& watcher = cluster.pod(alive[(i + 1) % 2]);
    ServerProcess& downloader = cluster.pod(alive[i % 2]);
    const pb::Job done = wait_job(watcher.client(), ids[i], 240s);
    ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << ids[i] << ": " << done.error().message();
    EXPECT_EQ(done.chunks_done(), 6);
    retries += static_cast<int>(done.retries());
    expect_each_chunk_once(watch_until(watcher.client(), ids[i], 0, finished), 6, ids[i]);
    const at::Tensor served = download_latents(downloader.client(), ids[i]);
    const at::Tensor expected = reference_latents(requests[i]);
    ASSERT_TRUE(served.defined());
    EXPECT_TRUE(at::equal(served, expected)) << ids[i] << ": max |served - generate| = " << max_abs_diff(served, expected);
  }
  EXPECT_GE(retries, 1) << "the chunk pod 1 was running is taken over as a retry";
  double takeovers = 0;
  for (size_t p : alive) {
    takeovers += metric_value(http_get(cluster.pod(p).metrics_port(), "/metrics"), "skyreels_lease_takeovers_total");
  }
  EXPECT_GE(takeovers, 1) << "skyreels_lease_takeovers_total counts the takeover";
  std::cout << "3 pods, 4 jobs x 6 chunks, pod 1 killed mid-chunk: all succeeded, retries " << retries << "\n";
}

TEST(Peers, APodPausedPastItsLeaseCannotCommitTheChunkAnotherPodTookOver) {
  Cluster cluster(2, /*lease_seconds=*/1.5, /*step_delay_ms=*/120);
  ServerProcess& late = cluster.pod(0);
  ServerProcess& other = cluster.pod(1);
  const std::vector<pb::SubmitJobRequest> requests = {six_chunk_request(1411), six_chunk_request(1412)};
  std::vector<std::string> ids;
  for (const auto& request : requests) ids.push_back(submit(other.client(), request).job_id());
  // Pause pod 0 as soon as it starts a chunk, so that it holds a lease it cannot renew.
  ASSERT_TRUE(wait_for_log(late, "event=chunk_started", 0, 60s)) << "pod 0 ran no chunk";
  late.signal(SIGSTOP);
  const bool taken_over = wait_for_log(other, "event=lease_takeover", 0, 60s);
  late.signal(SIGCONT);
  ASSERT_TRUE(taken_over) << other.log();
  // Awake again, pod 0 learns that its lease is gone (heartbeat) or has its commit refused (fence).
  const bool fenced = wait_for_log(late, "event=lease_lost", 0, 60s) || count_of(late.log(), "event=commit_fenced") > 0;
  EXPECT_TRUE(fenced) << late.log();

  int retries = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const pb::Job done = wait_job(other.client(), ids[i], 240s);
    ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
    retries += static_cast<int>(done.retries());
    expect_each_chunk_once(watch_until(late.client(), ids[i], 0, finished), 6, ids[i]);
    EXPECT_TRUE(at::equal(download_latents(late.client(), ids[i]), reference_latents(requests[i]))) << ids[i];
  }
  EXPECT_GE(retries, 1) << "the taken-over chunk counts as a retry";
}

TEST(Peers, OneIdempotencyKeyOnTwoPodsGivesOneJob) {
  Cluster cluster(2, 2.0, 0);
  pb::SubmitJobRequest request = long_video_request(1421);
  request.set_idempotency_key("peers-key-1");
  pb::SubmitJobResponse first, second;
  ASSERT_TRUE(submit_status(cluster.pod(0).client(), request, &first).ok());
  ASSERT_TRUE(submit_status(cluster.pod(1).client(), request, &second).ok());
  EXPECT_EQ(first.job().job_id(), second.job().job_id());
  request.mutable_spec()->mutable_params()->set_seed(1422);  // the same key for another request
  EXPECT_EQ(submit_status(cluster.pod(1).client(), request).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(wait_job(cluster.pod(1).client(), first.job().job_id()).state(), pb::JOB_STATE_SUCCEEDED);
}

TEST(Peers, TheQueueLimitCountsTheJobsOfEveryPod) {
  PgServer pg;
  ::setenv("SKYREELS_JOB_STORE", pg.url().c_str(), 1);
  const auto args = [](const std::string& pod) {
    std::vector<std::string> a = pod_args(pod, 2.0, 200);
    a.insert(a.end(), {"--max-queue", "2"});
    return a;
  };
  ServerProcess first(args("pod-0"));
  ServerProcess second(args("pod-1"));
  ::unsetenv("SKYREELS_JOB_STORE");
  ASSERT_TRUE(submit_status(first.client(), six_chunk_request(1461)).ok());
  ASSERT_TRUE(submit_status(first.client(), six_chunk_request(1462)).ok());
  // Two unfinished jobs in the store: the other pod, which accepted none, is full too.
  EXPECT_EQ(submit_status(second.client(), six_chunk_request(1463)).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

TEST(Peers, ADrainingPodGivesItsChunkBackAndAnotherPodFinishesTheJobWithoutARetry) {
  PgServer pg;
  ::setenv("SKYREELS_JOB_STORE", pg.url().c_str(), 1);
  const auto args = [](const std::string& pod) {
    std::vector<std::string> a = pod_args(pod, 2.0, 150);
    a.insert(a.end(), {"--drain-timeout-seconds", "1"});
    return a;
  };
  ServerProcess draining(args("pod-0"));
  const pb::SubmitJobRequest request = six_chunk_request(1471);
  const std::string id = submit(draining.client(), request).job_id();
  ASSERT_TRUE(wait_for_log(draining, "event=chunk_started", 0, 60s));
  ServerProcess other(args("pod-1"));
  ::unsetenv("SKYREELS_JOB_STORE");
  // A rolling update: the old pod stops claiming, and its running chunk finishes or, after the drain timeout, stops
  // and goes back to the store at once (no lease expiry, no retry).
  draining.signal(SIGTERM);
  EXPECT_EQ(draining.wait_exit(60s), 0) << draining.log();
  const pb::Job done = wait_job(other.client(), id, 240s);
  ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
  EXPECT_EQ(done.retries(), 0) << "a chunk given back by a drain is not a retry";
  expect_each_chunk_once(watch_until(other.client(), id, 0, finished), 6, id);
  EXPECT_TRUE(at::equal(download_latents(other.client(), id), reference_latents(request)));
}

TEST(Peers, CancelFromAnotherPodStopsTheRunningChunk) {
  Cluster cluster(2, 2.0, 100);
  const pb::SubmitJobRequest request = six_chunk_request(1431);
  const std::string id = submit(cluster.pod(0).client(), request).job_id();
  first_event_of_type(cluster.pod(1).client(), id, pb::JobEvent::kChunkStarted);
  auto ctx = cluster.pod(1).client().context(10);
  pb::CancelJobRequest cancel;
  cancel.set_job_id(id);
  pb::Job answer;
  ASSERT_TRUE(cluster.pod(1).client().stub().CancelJob(ctx.get(), cancel, &answer).ok());
  const pb::Job done = wait_job(cluster.pod(0).client(), id, 60s);
  EXPECT_EQ(done.state(), pb::JOB_STATE_CANCELLED);
  EXPECT_LT(done.chunks_done(), 6);
}

// Three jobs over two pods, the first with a chunk committed: what the store outages below interrupt.
struct RunningJobs {
  std::vector<pb::SubmitJobRequest> requests;
  std::vector<std::string> ids;
};
RunningJobs three_jobs_under_way(Cluster& cluster, uint64_t seed) {
  RunningJobs jobs;
  for (int i = 0; i < 3; ++i) {
    jobs.requests.push_back(long_video_request(seed + static_cast<uint64_t>(i)));
    jobs.ids.push_back(submit(cluster.pod(static_cast<size_t>(i) % 2).client(), jobs.requests.back()).job_id());
  }
  first_event_of_type(cluster.pod(0).client(), jobs.ids[0], pb::JobEvent::kChunkFinished);
  return jobs;
}

void expect_every_pod_ready_again(Cluster& cluster, std::chrono::seconds within, const std::string& after) {
  for (size_t p = 0; p < cluster.size(); ++p) {
    const auto until = std::chrono::steady_clock::now() + within;
    int status = -1;
    while (std::chrono::steady_clock::now() < until && (status = health_status(cluster.pod(p).address(), "")) != 1) {
      std::this_thread::sleep_for(100ms);
    }
    EXPECT_EQ(status, 1) << "pod " << p << " is not ready again after " << after;
  }
}

// Each job succeeds (read through the other pod) with the single-process `skyreels generate` video.
void expect_every_job_equals_generate(Cluster& cluster, const RunningJobs& jobs) {
  for (size_t i = 0; i < jobs.ids.size(); ++i) {
    const pb::Job done = wait_job(cluster.pod((i + 1) % 2).client(), jobs.ids[i], 240s);
    ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
    EXPECT_TRUE(at::equal(download_latents(cluster.pod(i % 2).client(), jobs.ids[i]),
                          reference_latents(jobs.requests[i])));
  }
}

TEST(Peers, PostgresDownMidRunTurnsReadinessOffThenEveryJobFinishes) {
  Cluster cluster(2, 2.0, 40);
  const RunningJobs jobs = three_jobs_under_way(cluster, 1441);
  // While the store is down the pods say NOT_SERVING (readiness asks the store), then come back by themselves.
  cluster.pg().stop();
  int down = -1;
  for (auto until = std::chrono::steady_clock::now() + 30s; std::chrono::steady_clock::now() < until;) {
    down = health_status(cluster.pod(0).address(), "");
    if (down == 2) break;  // NOT_SERVING
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(down, 2) << "readiness stayed SERVING with the store unreachable";
  cluster.pg().start();
  expect_every_pod_ready_again(cluster, 60s, "the PostgreSQL restart");
  expect_every_job_equals_generate(cluster, jobs);
}

// A kubelet-style gRPC health probe with its own channel (connected once) and a per-check timeout.
class HealthProbe {
 public:
  explicit HealthProbe(const std::string& address)
      : stub_(grpc::health::v1::Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}
  // The status (1 SERVING, 2 NOT_SERVING), or -1 with the gRPC code in *code when the check failed.
  int check(const std::string& service, std::chrono::milliseconds timeout, int* code) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = stub_->Check(&ctx, request, &response);
    *code = static_cast<int>(status.error_code());
    return status.ok() ? static_cast<int>(response.status()) : -1;
  }

 private:
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
};

// Frozen, not down: every PostgreSQL process SIGSTOPped, so connections stay open and nothing ever answers. Health
// checks answer within their timeout all along, also while clients open watches that wait for the store.
TEST(Peers, AFrozenStoreTurnsReadinessOffWhileProbesAnswerThenEveryJobSucceedsUnchanged) {
  Cluster cluster(2, 2.0, 40);
  const RunningJobs jobs = three_jobs_under_way(cluster, 1461);
  std::vector<std::unique_ptr<HealthProbe>> probes;
  for (size_t p = 0; p < 2; ++p) {
    probes.push_back(std::make_unique<HealthProbe>(cluster.pod(p).address()));
    int code = 0;  // connected and answering before the freeze: what follows measures the server, not the channel
    ASSERT_EQ(probes[p]->check("", 10000ms, &code), 1) << "pod " << p << " (grpc code " << code << ")";
  }
  cluster.pg().freeze();
  const auto frozen_at = std::chrono::steady_clock::now();
  // Clients keep opening watches on both pods meanwhile (each gives up after 1 s): their lookups wait for the store,
  // and must not hold the threads that answer the probes.
  std::atomic<bool> freeze_over{false};
  std::atomic<int> watches_opened{0};
  std::vector<std::thread> watchers;
  for (int w = 0; w < 4; ++w) {
    watchers.emplace_back([&, w] {
      server::Client& client = cluster.pod(static_cast<size_t>(w) % 2).client();
      while (!freeze_over) {
        const auto ctx = client.context(1.0);
        pb::WatchJobRequest request;
        request.set_job_id(jobs.ids[static_cast<size_t>(w) % jobs.ids.size()]);
        request.set_after_sequence(1u << 30);  // nothing to replay: the watch waits for the store
        auto reader = client.stub().WatchJob(ctx.get(), request);
        pb::JobEvent event;
        while (reader->Read(&event)) {
        }
        reader->Finish();
        ++watches_opened;
      }
    });
  }
  double slowest_probe = 0, slowest_at = 0;
  bool probe_failed = false;
  bool ready_late_in_freeze[2] = {false, false}, not_ready_seen[2] = {false, false}, liveness_lost = false;
  while (std::chrono::steady_clock::now() < frozen_at + 20s) {
    for (size_t p = 0; p < 2; ++p) {
      // Each check must answer within 2 s (the probes' timeout); a late answer is a failed check.
      const auto t0 = std::chrono::steady_clock::now();
      int ready_code = 0, code = 0;
      const int ready = probes[p]->check("", 2000ms, &ready_code);
      const auto t1 = std::chrono::steady_clock::now();
      const int live = probes[p]->check("liveness", 2000ms, &code);
      const auto t2 = std::chrono::steady_clock::now();
      if (ready < 0) {
        probe_failed = true;
        std::cout << "pod " << p << " readiness check failed (grpc code " << ready_code << ") at "
                  << std::chrono::duration<double>(t1 - frozen_at).count() << " s into the freeze\n";
      }
      for (const double seconds : {std::chrono::duration<double>(t1 - t0).count(),
                                   std::chrono::duration<double>(t2 - t1).count()}) {
        if (seconds > slowest_probe) {
          slowest_probe = seconds;
          slowest_at = std::chrono::duration<double>(t1 - frozen_at).count();
        }
      }
      if (live != 1) {
        liveness_lost = true;
        std::cout << "pod " << p << " liveness " << live << " (grpc code " << code << ") at "
                  << std::chrono::duration<double>(t2 - frozen_at).count() << " s into the freeze\n";
      }
      not_ready_seen[p] = not_ready_seen[p] || ready == 2;
      if (t1 - frozen_at > 10s && ready != 2) ready_late_in_freeze[p] = true;
    }
    std::this_thread::sleep_for(200ms);
  }
  freeze_over = true;
  for (auto& t : watchers) t.join();
  cluster.pg().thaw();
  EXPECT_GE(watches_opened.load(), 40) << "the watchers did not keep opening watches";
  EXPECT_FALSE(probe_failed) << "a health check did not answer within 2 s";
  std::cout << "slowest health check during the freeze: " << slowest_probe << " s (" << slowest_at << " s in)\n";
  EXPECT_FALSE(liveness_lost) << "liveness does not depend on the store";
  for (size_t p = 0; p < 2; ++p) {
    EXPECT_TRUE(not_ready_seen[p]) << "pod " << p << " stayed SERVING with its store frozen";
    EXPECT_FALSE(ready_late_in_freeze[p]) << "pod " << p << " was not NOT_SERVING 10 s into the freeze";
  }
  expect_every_pod_ready_again(cluster, 30s, "SIGCONT");
  expect_every_job_equals_generate(cluster, jobs);
}

TEST(Peers, ManyJobsOverThreePodsAllFinishAndInterleave) {
  Cluster cluster(3, 2.0, 0);
  std::vector<std::string> ids;
  for (int i = 0; i < 12; ++i) {
    ids.push_back(submit(cluster.pod(static_cast<size_t>(i) % 3).client(), long_video_request(1451 + static_cast<uint64_t>(i))).job_id());
  }
  std::map<std::string, int> chunks_by_pod;
  for (const std::string& id : ids) {
    const pb::Job done = wait_job(cluster.pod(0).client(), id, 240s);
    ASSERT_EQ(done.state(), pb::JOB_STATE_SUCCEEDED) << done.error().message();
    for (const auto& e : watch_until(cluster.pod(2).client(), id, 0, finished)) {
      if (e.has_chunk_finished()) ++chunks_by_pod[e.chunk_finished().replica().substr(0, 5)];
    }
  }
  // Every pod took part (one queue, not three).
  EXPECT_EQ(chunks_by_pod.size(), 3u);
  for (const auto& [pod, n] : chunks_by_pod) std::cout << pod << ": " << n << " chunks\n";
}

// Step progress is not stored: the pod running a chunk publishes it (coalesced, the last row always), and watchers
// on every pod see it in sequence between the chunk's start and its end. A watch subscribes before it replays, so
// every chunk that starts after both watchers received their first event is checked; a job that ran (nearly) to its
// end before they did is submitted again.
TEST(Peers, StepProgressOfEveryChunkReachesWatchersOnEveryPod) {
  Cluster cluster(2, 2.0, 100);
  for (uint64_t attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 5u) << "the watchers never attached before the job's last chunk";
    const std::string id = submit(cluster.pod(0).client(), six_chunk_request(1481 + attempt)).job_id();
    std::vector<pb::JobEvent> seen[2];
    std::atomic<int> attached{0};
    std::thread watchers[2];
    for (size_t p = 0; p < 2; ++p) {
      watchers[p] = std::thread([&, p] {
        bool first = true;
        seen[p] = watch_until(cluster.pod(p).client(), id, 0, [&](const pb::JobEvent& e) {
          if (std::exchange(first, false)) ++attached;
          return finished(e);
        }, 240);
      });
    }
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (attached < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
    // The chunk after the ones done now had not started stepping when both watchers were subscribed.
    const int first_checked = get_job(cluster.pod(0).client(), id).chunks_done() + 1;
    for (auto& w : watchers) w.join();
    ASSERT_EQ(attached.load(), 2);
    if (first_checked >= 6) continue;
    // Whichever pods ran the chunks, at least one watcher is on a pod that did not run some of them.
    for (size_t p = 0; p < 2; ++p) {
      ASSERT_FALSE(seen[p].empty());
      ASSERT_TRUE(seen[p].back().has_finished()) << "watcher on pod " << p;
      std::map<int, int> steps_of_chunk;
      for (const auto& e : seen[p]) {
        if (e.has_step()) {
          ++steps_of_chunk[e.step().chunk_index()];
          EXPECT_GE(e.step().step(), 1);
          EXPECT_LE(e.step().step(), e.step().steps());
          EXPECT_GT(e.step().progress(), 0.0);
        }
      }
      for (int chunk = first_checked; chunk < 6; ++chunk) {
        EXPECT_GE(steps_of_chunk[chunk], 1) << "watcher on pod " << p << " saw no step of chunk " << chunk;
      }
      for (size_t i = 1; i < seen[p].size(); ++i) EXPECT_GT(seen[p][i].sequence(), seen[p][i - 1].sequence());
    }
    std::cout << "checked chunks " << first_checked << "..5 (attempt " << attempt + 1 << ")\n";
    return;
  }
}

// The MP4 of a job, read with a deadline; "" when the download did not complete in time or failed.
std::string download_mp4(server::Client& client, const std::string& id, double seconds) {
  auto ctx = client.context(seconds);
  pb::DownloadResultRequest request;
  request.set_job_id(id);
  request.set_format(pb::RESULT_FORMAT_MP4);
  auto reader = client.stub().DownloadResult(ctx.get(), request);
  std::string mp4;
  pb::ResultPart part;
  while (reader->Read(&part)) mp4 += part.data();
  const grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << id << ": " << status.error_message();
  return status.ok() ? mp4 : "";
}

// The chunks of these jobs run on both pods, but each pod's MP4 encoder hears directly only of the commits of its own
// replicas: the rest it catches up from the store.
TEST(Peers, Mp4sOfJobsWhoseChunksRanOnAnyPodDownloadCompletelyFromEitherPod) {
  Cluster cluster(2, 2.0, 20, {"--vae", "demo"});
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    pb::SubmitJobRequest request = long_video_request(1471 + static_cast<uint64_t>(i));
    request.set_produce_mp4(true);
    ids.push_back(submit(cluster.pod(0).client(), request).job_id());
  }
  std::set<std::string> pods_that_ran;
  for (const std::string& id : ids) {
    ASSERT_EQ(wait_job(cluster.pod(0).client(), id, 240s).state(), pb::JOB_STATE_SUCCEEDED);
    for (const auto& e : watch_until(cluster.pod(1).client(), id, 0, finished)) {
      if (e.has_chunk_finished()) pods_that_ran.insert(e.chunk_finished().replica().substr(0, 5));
    }
  }
  EXPECT_EQ(pods_that_ran.size(), 2u) << "both pods ran chunks (else the test shows nothing)";
  for (const std::string& id : ids) {
    for (size_t p = 0; p < 2; ++p) {
      const std::string mp4 = download_mp4(cluster.pod(p).client(), id, 60);
      ASSERT_FALSE(mp4.empty()) << id << " from pod " << p;
      EXPECT_EQ(video::read_video_bytes(std::vector<uint8_t>(mp4.begin(), mp4.end())).info.frames, 37)
          << id << " from pod " << p;
    }
  }
}

// ---- fair share between tenants (issue 19) ----

constexpr const char* kAliceKey = "alice-key-0123456789abcdef0123456789";
constexpr const char* kBobKey = "bob-key-0123456789abcdef0123456789ab";

std::vector<std::string> tenant_key_args() {
  const std::string file = temp_dir("tenant-keys") + "/keys";
  std::ofstream(file) << kAliceKey << " alice\n" << kBobKey << " bob\n";
  return {"--api-keys", file};
}

// Six chunks of 10 steps: a chunk takes far longer than the seven submissions, so that B's job competes with A's from
// their start. By the chunks' own work: servers with API keys take no test hook (--step-delay-ms).
pb::SubmitJobRequest tenant_request(uint64_t seed) {
  pb::SubmitJobRequest request = six_chunk_request(seed);
  request.mutable_spec()->mutable_params()->set_num_inference_steps(10);
  return request;
}

// Tenant A (alice) submits 6 jobs of 6 chunks, spread over `pods`, then tenant B (bob) one job of 6 chunks through
// the last pod. Returns how many of A's 36 chunks were done when B's job finished.
int64_t a_chunks_done_when_b_finishes(const std::vector<ServerProcess*>& pods) {
  std::vector<std::string> a_jobs;
  for (int i = 0; i < 6; ++i) {
    ServerProcess& pod = *pods[static_cast<size_t>(i) % pods.size()];
    a_jobs.push_back(submit(pod.client(), tenant_request(1900 + static_cast<uint64_t>(i))).job_id());
  }
  auto bob = pods.back()->client_with_key(kBobKey);
  const std::string b_job = submit(*bob, tenant_request(1999)).job_id();
  const pb::Job b_done = wait_job(*bob, b_job, 240s);
  EXPECT_EQ(b_done.state(), pb::JOB_STATE_SUCCEEDED) << b_done.error().message();
  int64_t a_done = 0;
  for (const std::string& id : a_jobs) a_done += get_job(pods[0]->client(), id).chunks_done();
  std::cout << "tenant A's chunks done when tenant B's job finished: " << a_done << " of 36\n";
  for (const std::string& id : a_jobs) {
    EXPECT_EQ(wait_job(pods[0]->client(), id, 240s).state(), pb::JOB_STATE_SUCCEEDED) << id;
  }
  return a_done;
}

TEST(FairShare, ATenantsOneJobFinishesBeforeHalfOfAnotherTenantsSixOnOneServer) {
  std::vector<std::string> args = {"--demo", "--devices", "cpu", "--dtype", "float32"};
  const auto keys = tenant_key_args();
  args.insert(args.end(), keys.begin(), keys.end());
  ServerProcess server(args, true, kAliceKey);
  EXPECT_LT(a_chunks_done_when_b_finishes({&server}), 18);
}

TEST(FairShare, ATenantsOneJobFinishesBeforeHalfOfAnotherTenantsSixOverTwoPods) {
  Cluster cluster(2, 5.0, /*step_delay_ms=*/0, tenant_key_args(), kAliceKey);
  EXPECT_LT(a_chunks_done_when_b_finishes({&cluster.pod(0), &cluster.pod(1)}), 18);
}

}  // namespace
}  // namespace skyreels::test
