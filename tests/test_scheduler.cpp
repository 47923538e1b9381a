// The chunk scheduler with fake executors: affinity, handoffs, fairness, priorities, retries, deadlines,
// cancellation, admission and drain; submissions stored outside the lock; the replica pool against a scripted chunk
// source. No model, no gRPC. The Scheduler* cases run over every store ($SKYREELS_TEST_STORE: memory, sqlite, or
// postgresql on a real PostgreSQL per harness; ctest names carry the store): one scheduler, the same answers.
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "server/job/fingerprint.h"
#include "server/store/job_lease.h"
#include "server/queue/replica_pool.h"
#include "server/queue/scheduler.h"
#include "tests/pg_fixture.h"

namespace skyreels::server {
namespace {

using namespace std::chrono_literals;

// A job's "latents": each chunk's output depends on the previous output, the chunk index and the seed only, never
// on the replica, like the real diffusion-forcing chunks.
struct FakePayload : JobPayload {
  explicit FakePayload(uint64_t s) : seed(s) {}
  uint64_t seed;
  std::mutex mu;
  std::vector<uint64_t> outputs;
};

struct RunLog {
  std::mutex mu;
  std::vector<std::string> entries;  // "job:chunk@replica"
  std::vector<Clock::time_point> probes;
  void add(const std::string& e) {
    std::lock_guard<std::mutex> lock(mu);
    entries.push_back(e);
  }
  void probed() {
    std::lock_guard<std::mutex> lock(mu);
    probes.push_back(Clock::now());
  }
  std::vector<Clock::time_point> probe_times() {
    std::lock_guard<std::mutex> lock(mu);
    return probes;
  }
  std::vector<std::string> snapshot() {
    std::lock_guard<std::mutex> lock(mu);
    return entries;
  }
};

// Holds a replica's chunks until the test opens it: what the test submits meanwhile is all queued at once, however
// slowly a loaded machine or a store answers.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  int waiting = 0;  // runs held at the gate now
  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    ++waiting;
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
    --waiting;
  }
  // Until `runs` runs are held at the gate (their chunks claimed and started).
  void wait_for_waiting(int runs) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return waiting >= runs; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
  void close() {
    std::lock_guard<std::mutex> lock(mu);
    open = false;
  }
};

struct FakeBehaviour {
  std::chrono::milliseconds step = 2ms;
  std::shared_ptr<Gate> gate;  // every run waits for it before its first step
  // Shared by replicas: the first run on any of them that finds it false sets it and fails (whichever claims first).
  std::shared_ptr<std::atomic<bool>> fail_first_run_anywhere;
  int64_t rows = 3;
  std::set<int> fail_calls;  // 1-based runs of this replica that throw (after their first step)
  bool always_fail = false;
  bool fail_to_load = false;
  bool reject = false;         // the request itself cannot run
  bool out_of_memory = false;  // every run: the request did not fit (ResourceExhausted)
  int probe_failures = 0;      // re-tests that fail before one passes
};

FakeBehaviour steps(std::chrono::milliseconds step, int64_t rows = 3) {
  FakeBehaviour b;
  b.step = step;
  b.rows = rows;
  return b;
}
FakeBehaviour failing_calls(std::set<int> calls) {
  FakeBehaviour b;
  b.fail_calls = std::move(calls);
  return b;
}
FakeBehaviour always_failing() {
  FakeBehaviour b;
  b.always_fail = true;
  return b;
}
FakeBehaviour rejecting() {
  FakeBehaviour b;
  b.reject = true;
  return b;
}
FakeBehaviour not_loading() {
  FakeBehaviour b;
  b.fail_to_load = true;
  return b;
}

class FakeExecutor : public ChunkExecutor {
 public:
  FakeExecutor(std::string name, FakeBehaviour behaviour, std::shared_ptr<RunLog> log)
      : name_(std::move(name)), behaviour_(std::move(behaviour)), log_(std::move(log)) {}
  std::string name() const override { return name_; }
  void start() override {
    if (behaviour_.fail_to_load) throw std::runtime_error("weights missing");
  }
  ChunkResult run(const ChunkWork& work, const ChunkCallbacks& callbacks) override {
    const int call = ++calls_;
    log_->add(work.job_id + ":" + std::to_string(work.chunk_index) + "@" + name_);
    if (behaviour_.reject) return {ChunkOutcome::Rejected, "prompt_embeds: bad shape", 0, {}, {}};
    if (behaviour_.out_of_memory) return {ChunkOutcome::ResourceExhausted, "out of memory (injected)", 0, {}, {}};
    if (behaviour_.gate) behaviour_.gate->wait();
    for (int64_t row = 1; row <= behaviour_.rows; ++row) {
      if (callbacks.should_stop()) return {ChunkOutcome::Stopped, "", 0, {}, {}};
      std::this_thread::sleep_for(behaviour_.step);
      const bool first_anywhere = row == 1 && behaviour_.fail_first_run_anywhere &&
                                  !behaviour_.fail_first_run_anywhere->exchange(true);
      if (first_anywhere || (row == 1 && (behaviour_.always_fail || behaviour_.fail_calls.count(call)))) {
        throw std::runtime_error("injected fault on " + name_);
      }
      callbacks.on_step(row, behaviour_.rows);
    }
    auto& payload = static_cast<FakePayload&>(*work.payload);
    std::lock_guard<std::mutex> lock(payload.mu);
    const uint64_t previous = payload.outputs.empty() ? payload.seed : payload.outputs.back();
    payload.outputs.push_back(previous * 6364136223846793005ULL + 1442695040888963407ULL +
                              static_cast<uint64_t>(work.chunk_index));
    ChunkResult done{ChunkOutcome::Succeeded, "", 4, {}, {}};
    done.bytes = std::to_string(payload.outputs.back());  // the chunk's stored result
    return done;
  }
  void probe() override {
    log_->probed();
    if (probes_++ < behaviour_.probe_failures) throw std::runtime_error("still broken");
  }

 private:
  std::string name_;
  FakeBehaviour behaviour_;
  std::shared_ptr<RunLog> log_;
  std::atomic<int> calls_{0};
  int probes_ = 0;
};

// Which store the Scheduler* cases run over (ctest sets $SKYREELS_TEST_STORE per registration).
std::string store_kind() {
  const char* kind = std::getenv("SKYREELS_TEST_STORE");
  return kind == nullptr || *kind == '\0' ? "memory" : kind;
}

// Re-creates a fake job's payload from its stored request (the seed) and committed results, as the service does.
RestoredJob load_fake_job(const StoredJob& job, std::vector<StoredChunk> chunks) {
  RestoredJob r;
  auto payload = std::make_shared<FakePayload>(std::stoull(job.request.empty() ? "1" : job.request));
  for (const StoredChunk& chunk : chunks) payload->outputs.push_back(std::stoull(chunk.bytes));
  r.payload = payload;
  r.chunk_rows.assign(static_cast<size_t>(job.chunk_count), 3);
  return r;
}

// A fresh directory, removed with everything in it.
struct ScratchDir {
  std::string path;
  ScratchDir() {
    char name[] = "/tmp/skyreels-scheduler-XXXXXX";
    if (::mkdtemp(name) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = name;
  }
  ~ScratchDir() { std::filesystem::remove_all(path); }
};

struct Harness {
  std::shared_ptr<RunLog> log = std::make_shared<RunLog>();
  std::unique_ptr<test::PgServer> postgres;
  std::unique_ptr<ScratchDir> dir;
  std::unique_ptr<LeaseStore> leases;  // holds the records the scheduler reads and writes
  std::unique_ptr<Scheduler> scheduler;

  // `start_now` false: the caller calls start(). `borrowed`: the store under the leases (else one of store_kind()).
  Harness(std::vector<FakeBehaviour> behaviours, SchedulerOptions options = {}, JobStore* borrowed = nullptr,
          bool start_now = true) {
    spdlog::set_level(spdlog::level::warn);  // per-chunk info logs would drown the test output
    std::vector<std::unique_ptr<ChunkExecutor>> executors;
    for (size_t i = 0; i < behaviours.size(); ++i) {
      executors.push_back(std::make_unique<FakeExecutor>("fake:" + std::to_string(i), behaviours[i], log));
    }
    leases = borrowed != nullptr ? with_leases(*borrowed) : open_store();
    PodOptions pod;
    pod.scheduling = options;
    scheduler = std::make_unique<Scheduler>(std::move(executors), pod, leases->records(), *leases, load_fake_job);
    if (start_now) start();
  }

  std::unique_ptr<LeaseStore> open_store() {
    const std::string kind = store_kind();
    if (kind == "sqlite") {
      dir = std::make_unique<ScratchDir>();
      return with_leases(open_job_store("sqlite:" + dir->path + "/jobs.sqlite"));
    }
    if (kind == "postgresql") {
      postgres = std::make_unique<test::PgServer>();
      return with_leases(open_job_store(postgres->url()));
    }
    if (kind != "memory") throw std::invalid_argument("SKYREELS_TEST_STORE: memory, sqlite or postgresql");
    return with_leases(open_job_store("memory"));
  }

  bool shared_store() { return leases->shared(); }

  void start() {
    scheduler->start();
    const auto until = Clock::now() + 5s;
    while (!scheduler->all_loaded() && Clock::now() < until) std::this_thread::sleep_for(1ms);
  }

  std::string submit(int64_t chunks, int priority = 0, uint64_t seed = 1, const std::string& owner = "",
                     std::optional<Clock::time_point> deadline = std::nullopt, const std::string& key = "",
                     uint64_t fingerprint = 0) {
    JobSpec spec;
    spec.owner = owner;
    spec.priority = priority;
    spec.deadline = deadline;
    spec.chunk_work.assign(static_cast<size_t>(chunks), 1.0);
    spec.chunk_rows.assign(static_cast<size_t>(chunks), 3);
    spec.idempotency_key = key;
    spec.fingerprint = fingerprint;
    spec.payload = std::make_shared<FakePayload>(seed);
    spec.durable_request = std::to_string(seed);
    return scheduler->submit(std::move(spec)).job.id;
  }

  // A job of `client` (a tenant: API key's client name or peer address) with that client's share weight.
  std::string submit_for(const std::string& client, int64_t chunks, int weight = 1) {
    JobSpec spec;
    spec.client = client;
    spec.client_weight = weight;
    spec.chunk_work.assign(static_cast<size_t>(chunks), 1.0);
    spec.chunk_rows.assign(static_cast<size_t>(chunks), 3);
    spec.payload = std::make_shared<FakePayload>(1);
    spec.durable_request = "1";
    return scheduler->submit(std::move(spec)).job.id;
  }

  JobSnapshot wait(const std::string& id, const std::string& owner = "", std::chrono::milliseconds limit = 10s) {
    const auto until = Clock::now() + limit;
    uint64_t seen = 0;
    while (Clock::now() < until) {
      EventBatch batch = scheduler->wait_events(id, owner, seen, until);
      if (!batch.events.empty()) seen = batch.events.back().sequence;
      if (batch.finished) break;
    }
    auto snapshot = scheduler->get(id, owner);
    EXPECT_TRUE(snapshot.has_value());
    return snapshot.value_or(JobSnapshot{});
  }

  // The job's chunk outputs as the store holds them (whichever replica, or pod, ran each chunk).
  std::vector<uint64_t> outputs(const JobSnapshot& job) {
    std::vector<uint64_t> out;
    for (int64_t i = 0; i < job.chunks_done; ++i) {
      const std::optional<int64_t> size = scheduler->result_size(job.id, job.owner, JobStore::Blob::chunk, i);
      const std::optional<std::string> bytes =
          size ? scheduler->result_range(job.id, job.owner, JobStore::Blob::chunk, i, 0, *size) : std::nullopt;
      out.push_back(bytes ? std::stoull(*bytes) : 0);
    }
    return out;
  }
};

int count_changes(const std::vector<std::string>& replicas) {
  int changes = 0;
  for (size_t i = 1; i < replicas.size(); ++i) changes += replicas[i] != replicas[i - 1];
  return changes;
}

TEST(Scheduler, ChunksOfOneJobStayOnTheReplicaThatRanThePreviousChunk) {
  Harness h({FakeBehaviour{}, FakeBehaviour{}});
  const auto job = h.wait(h.submit(4));
  EXPECT_EQ(job.state, JobState::Succeeded);
  ASSERT_EQ(job.chunk_replicas.size(), 4u);
  EXPECT_EQ(count_changes(job.chunk_replicas), 0);
  EXPECT_EQ(job.handoffs, 0);
}

TEST(Scheduler, TwoJobsOnTwoReplicasEachKeepTheirReplica) {
  Harness h({FakeBehaviour{}, FakeBehaviour{}});
  const auto a = h.submit(3);
  const auto b = h.submit(3);
  const auto ja = h.wait(a);
  const auto jb = h.wait(b);
  EXPECT_EQ(ja.handoffs + jb.handoffs, 0);
  EXPECT_NE(ja.chunk_replicas.front(), jb.chunk_replicas.front());
}

TEST(Scheduler, MoreJobsThanReplicasHandOffAndCountEveryHandoff) {
  SchedulerOptions options;
  options.handoff_cost_seconds = 0;  // waiting for the holder is never worth it
  FakeBehaviour held = steps(3ms);
  held.gate = std::make_shared<Gate>();
  Harness h({held, held}, options);
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(h.submit(4, 0, static_cast<uint64_t>(i)));
  held.gate->release();  // the three jobs interleave however slowly the store took them
  int handoffs = 0;
  for (const auto& id : ids) {
    const auto job = h.wait(id);
    EXPECT_EQ(job.state, JobState::Succeeded);
    EXPECT_EQ(job.handoffs, count_changes(job.chunk_replicas)) << "every replica change is a counted handoff";
    handoffs += job.handoffs;
  }
  EXPECT_GT(handoffs, 0) << "3 interleaved jobs on 2 replicas must move at least once";
}

TEST(Scheduler, JobWaitsForItsBusyHolderWhenAHandoffCostsMoreThanWaiting) {
  SchedulerOptions options;
  options.handoff_cost_seconds = 1000;  // a handoff costs more than any wait here
  Harness h({steps(3ms), steps(3ms)}, options);
  h.wait(h.submit(1));  // one measured chunk, so the scheduler can estimate how long its holder stays busy
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(h.submit(4, 0, static_cast<uint64_t>(i)));
  for (const auto& id : ids) {
    const auto job = h.wait(id);
    EXPECT_EQ(job.state, JobState::Succeeded);
    EXPECT_EQ(job.handoffs, 0) << "job " << id << " moved although waiting for its holder was cheaper";
  }
}

TEST(Scheduler, OutputDoesNotDependOnWhichReplicaRanEachChunk) {
  Harness one({FakeBehaviour{}});
  const auto reference = one.outputs(one.wait(one.submit(5, 0, 42)));
  SchedulerOptions options;
  options.handoff_cost_seconds = 0;
  Harness two({steps(2ms), steps(3ms)}, options);
  std::vector<std::string> ids;
  for (uint64_t seed : {42, 7, 9}) ids.push_back(two.submit(5, 0, seed));
  const auto job = two.wait(ids[0]);
  EXPECT_EQ(two.outputs(job), reference);
}

TEST(Scheduler, LongVideoDoesNotStarveAShortOneSubmittedLater) {
  Harness h({steps(5ms)});
  const auto long_job = h.submit(4);
  const auto short_job = h.submit(1);
  EXPECT_EQ(h.wait(short_job).state, JobState::Succeeded);
  const auto log = h.log->snapshot();
  ASSERT_GE(log.size(), 2u);
  EXPECT_EQ(log[0], long_job + ":0@fake:0");
  EXPECT_EQ(log[1], short_job + ":0@fake:0") << "the short job runs at the first chunk boundary";
  EXPECT_EQ(h.wait(long_job).state, JobState::Succeeded);
}

TEST(Scheduler, JobsInterleaveAtChunkBoundaries) {
  FakeBehaviour held = steps(2ms);
  held.gate = std::make_shared<Gate>();
  Harness h({held});
  const auto a = h.submit(3);
  const auto b = h.submit(3);
  held.gate->release();  // both jobs are queued before a's first chunk ends, however slowly the store took b
  h.wait(a);
  h.wait(b);
  const auto log = h.log->snapshot();
  const std::vector<std::string> expected = {a + ":0@fake:0", b + ":0@fake:0", a + ":1@fake:0",
                                             b + ":1@fake:0", a + ":2@fake:0", b + ":2@fake:0"};
  EXPECT_EQ(log, expected);
}

// Chunks of `jobs` in the run log before the last chunk of `job` started.
int64_t chunks_of_before_last_of(const std::vector<std::string>& log, const std::set<std::string>& jobs,
                                 const std::string& job) {
  int64_t last = -1;
  for (size_t i = 0; i < log.size(); ++i) {
    if (log[i].rfind(job + ":", 0) == 0) last = static_cast<int64_t>(i);
  }
  int64_t count = 0;
  for (int64_t i = 0; i < last; ++i) {
    const std::string& entry = log[static_cast<size_t>(i)];
    count += jobs.count(entry.substr(0, entry.find(':'))) ? 1 : 0;
  }
  return count;
}

TEST(Scheduler, ATenantWithManyJobsGetsOneShareNotOnePerJob) {
  FakeBehaviour held = steps(3ms);
  held.gate = std::make_shared<Gate>();
  Harness h({held});
  std::set<std::string> a_jobs;
  for (int i = 0; i < 6; ++i) a_jobs.insert(h.submit_for("tenant-a", 6));
  const auto b_job = h.submit_for("tenant-b", 6);
  held.gate->release();  // A's first chunk ran no step yet: every job waits, however long the submissions took
  EXPECT_EQ(h.wait(b_job).state, JobState::Succeeded);
  for (const auto& id : a_jobs) EXPECT_EQ(h.wait(id).state, JobState::Succeeded);
  const int64_t a_before_b_ends = chunks_of_before_last_of(h.log->snapshot(), a_jobs, b_job);
  EXPECT_LT(a_before_b_ends, 18) << "B's job ends before half of A's 36 chunks ran";
  EXPECT_LE(a_before_b_ends, 8) << "the two tenants alternate chunk by chunk";
}

TEST(Scheduler, AClientsWeightBuysItThatManyChunksForEachOfAWeightOneClient) {
  Harness h({steps(5ms)});
  const auto light = h.submit_for("light", 6, 1);
  const auto heavy = h.submit_for("heavy", 6, 2);
  EXPECT_EQ(h.wait(heavy).state, JobState::Succeeded);
  EXPECT_EQ(h.wait(light).state, JobState::Succeeded);
  const int64_t light_before = chunks_of_before_last_of(h.log->snapshot(), {light}, heavy);
  EXPECT_LE(light_before, 4) << "weight 2 runs two chunks for each of weight 1's (equal weights: 5 or 6)";
  EXPECT_GE(light_before, 2) << "the weight-1 client still gets its share";
}

TEST(Scheduler, HigherPriorityJobsRunFirst) {
  Harness h({steps(10ms, 20)});
  const auto busy = h.submit(1);
  // Event-based: `busy` has run a step on the only replica before the others arrive.
  uint64_t seen = 0;
  bool stepped = false;
  const auto until = Clock::now() + 5s;
  while (!stepped && Clock::now() < until) {
    const EventBatch batch = h.scheduler->wait_events(busy, "", seen, until);
    for (const auto& e : batch.events) stepped = stepped || e.type == EventType::Step;
    if (!batch.events.empty()) seen = batch.events.back().sequence;
  }
  ASSERT_TRUE(stepped);
  const auto low_a = h.submit(1, 0);
  const auto low_b = h.submit(1, 0);
  const auto high = h.submit(1, 5);
  for (const auto& id : {busy, low_a, low_b, high}) h.wait(id);
  const auto log = h.log->snapshot();
  ASSERT_EQ(log.size(), 4u);
  EXPECT_EQ(log[1], high + ":0@fake:0");
  EXPECT_EQ(log[2], low_a + ":0@fake:0");
  EXPECT_EQ(log[3], low_b + ":0@fake:0");
}

TEST(Scheduler, FailedChunkIsRetriedOnAnotherReplicaAndTheOutputIsUnchanged) {
  Harness reference_harness({FakeBehaviour{}, FakeBehaviour{}});
  const auto reference = reference_harness.outputs(reference_harness.wait(reference_harness.submit(3, 0, 5)));

  // Whichever replica claims the chunk first fails it (on a shared store either may be first).
  FakeBehaviour fails_once;
  fails_once.fail_first_run_anywhere = std::make_shared<std::atomic<bool>>(false);
  Harness h({fails_once, fails_once});
  const auto job = h.wait(h.submit(3, 0, 5));
  EXPECT_EQ(job.state, JobState::Succeeded);
  EXPECT_EQ(job.retries, 1);
  EXPECT_EQ(h.outputs(job), reference);
  const auto log = h.log->snapshot();
  ASSERT_GE(log.size(), 2u);
  const std::string first = log[0].substr(log[0].find('@'));
  EXPECT_EQ(log[0].substr(0, log[0].find('@')), job.id + ":0");
  EXPECT_EQ(log[1].substr(0, log[1].find('@')), job.id + ":0") << "the failed chunk runs again";
  EXPECT_NE(log[1].substr(log[1].find('@')), first) << "the retry goes to the other replica";
}

TEST(Scheduler, ReplicaThatKeepsFailingIsTakenOutAndTheOthersKeepServing) {
  SchedulerOptions options;
  options.replica_failure_limit = 2;
  // Waiting jobs never wait for their holder, and the healthy replica is slow enough that the failing one, even when
  // a loaded machine delays its first failure, still finds a waiting job to fail a second time.
  options.handoff_cost_seconds = 0;
  Harness h({steps(10ms), always_failing()}, options);
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(h.submit(2, 0, static_cast<uint64_t>(i)));
  for (const auto& id : ids) EXPECT_EQ(h.wait(id).state, JobState::Succeeded);
  const auto replicas = h.scheduler->replicas();
  EXPECT_TRUE(replicas[0].healthy);
  EXPECT_FALSE(replicas[1].healthy);
  EXPECT_EQ(replicas[1].failures, 2);
  EXPECT_NE(replicas[1].error.find("injected fault"), std::string::npos);
  EXPECT_TRUE(h.scheduler->ready()) << "one healthy replica still serves";
}

TEST(Scheduler, ChunkFailingEverywhereFailsTheJobAfterBoundedRetries) {
  SchedulerOptions options;
  options.chunk_retries = 2;
  options.replica_failure_limit = 100;
  Harness h({always_failing(), always_failing()}, options);
  const auto job = h.wait(h.submit(2));
  EXPECT_EQ(job.state, JobState::Failed);
  EXPECT_EQ(job.error_kind, ErrorKind::Internal);
  EXPECT_EQ(job.retries, 2);
  EXPECT_EQ(h.log->snapshot().size(), 3u) << "first try + 2 retries";
  EXPECT_NE(job.error.find("injected fault"), std::string::npos) << job.error;
}

TEST(Scheduler, RejectedRequestFailsAtOnceWithoutRetriesOrBlamingTheReplica) {
  SchedulerOptions options;
  options.replica_failure_limit = 1;
  Harness h({rejecting()}, options);
  for (int i = 0; i < 3; ++i) {
    const auto job = h.wait(h.submit(2));
    EXPECT_EQ(job.state, JobState::Failed);
    EXPECT_EQ(job.error_kind, ErrorKind::InvalidArgument);
    EXPECT_EQ(job.error, "prompt_embeds: bad shape");
    EXPECT_EQ(job.retries, 0);
  }
  EXPECT_EQ(h.log->snapshot().size(), 3u) << "one attempt per job";
  EXPECT_TRUE(h.scheduler->replicas()[0].healthy) << "bad requests do not take replicas out";
}

TEST(Scheduler, NoHealthyReplicaLeftFailsWaitingJobsAndRefusesNewOnes) {
  SchedulerOptions options;
  options.replica_failure_limit = 1;
  options.chunk_retries = 5;
  Harness h({always_failing()}, options);
  const auto job = h.wait(h.submit(1));
  EXPECT_EQ(job.state, JobState::Failed);
  EXPECT_FALSE(h.scheduler->ready());
  try {
    h.submit(1);
    FAIL() << "expected AdmissionError";
  } catch (const AdmissionError& e) {
    EXPECT_EQ(e.reason(), AdmissionError::Reason::Unavailable);
  }
}

TEST(Scheduler, ReplicaThatFailsToLoadIsUnhealthyAndTheOthersServe) {
  Harness h({not_loading(), FakeBehaviour{}});
  const auto job = h.wait(h.submit(2));
  EXPECT_EQ(job.state, JobState::Succeeded);
  const auto replicas = h.scheduler->replicas();
  EXPECT_FALSE(replicas[0].healthy);
  EXPECT_EQ(replicas[0].error, "weights missing");
  EXPECT_TRUE(h.scheduler->ready());
}

TEST(Scheduler, CancellingAQueuedJobEndsItAtOnce) {
  Harness h({steps(20ms)});
  const auto busy = h.submit(1);
  const auto queued = h.submit(1);
  const auto snapshot = h.scheduler->cancel(queued, "");
  ASSERT_TRUE(snapshot.has_value());
  EXPECT_EQ(snapshot->state, JobState::Cancelled);
  h.wait(busy);
  for (const auto& entry : h.log->snapshot()) EXPECT_EQ(entry.find(queued), std::string::npos);
}

TEST(Scheduler, CancellingARunningJobStopsItAtTheNextStep) {
  Harness h({steps(10ms, 200)});
  const auto id = h.submit(3);
  // Wait for the first step, then cancel: the chunk would take 2 s more if it ignored the request.
  h.scheduler->wait_events(id, "", 2, Clock::now() + 2s);
  const auto t0 = Clock::now();
  h.scheduler->cancel(id, "");
  const auto job = h.wait(id);
  EXPECT_EQ(job.state, JobState::Cancelled);
  EXPECT_EQ(job.error_kind, ErrorKind::Cancelled);
  EXPECT_EQ(job.chunks_done, 0);
  EXPECT_LT(Clock::now() - t0, 1s);  // steps are 10 ms; the chunk's end is ~2 s away
}

TEST(Scheduler, DeadlinePassingWhileQueuedMeansTheJobNeverRuns) {
  Harness h({steps(20ms, 10)});
  const auto busy = h.submit(1);
  const auto late = h.submit(1, 0, 1, "", Clock::now() + 30ms);
  const auto job = h.wait(late);
  EXPECT_EQ(job.state, JobState::DeadlineExceeded);
  EXPECT_EQ(job.error_kind, ErrorKind::DeadlineExceeded);
  h.wait(busy);
  for (const auto& entry : h.log->snapshot()) EXPECT_EQ(entry.find(late), std::string::npos);
}

TEST(Scheduler, DeadlinePassingDuringAChunkStopsIt) {
  Harness h({steps(10ms, 100)});
  const auto t0 = Clock::now();
  const auto job = h.wait(h.submit(2, 0, 1, "", Clock::now() + 50ms));
  EXPECT_EQ(job.state, JobState::DeadlineExceeded);
  EXPECT_LT(Clock::now() - t0, 1s);  // the two chunks would take 2 s
}

TEST(Scheduler, FullQueueRefusesWithARetryHint) {
  SchedulerOptions options;
  options.max_jobs = 2;
  Harness h({steps(20ms, 20)}, options);
  const auto a = h.submit(1);
  const auto b = h.submit(1);
  try {
    h.submit(1);
    FAIL() << "expected AdmissionError";
  } catch (const AdmissionError& e) {
    EXPECT_EQ(e.reason(), AdmissionError::Reason::QueueFull);
    EXPECT_GE(e.retry_after_seconds(), 1.0);
  }
  h.wait(a);
  h.wait(b);
  EXPECT_NO_THROW(h.submit(1)) << "room again once jobs finished";
}

// Alone on its store the server finishes what it admitted; on a shared store it stops claiming and leaves the queue to
// the other pods (its running chunk still ends).
TEST(Scheduler, DrainRefusesNewJobsAndFinishesAdmittedOnes) {
  Harness h({steps(5ms)});
  const auto a = h.submit(2);
  const auto b = h.submit(2);
  h.scheduler->begin_drain();
  EXPECT_FALSE(h.scheduler->ready());
  try {
    h.submit(1);
    FAIL() << "expected AdmissionError";
  } catch (const AdmissionError& e) {
    EXPECT_EQ(e.reason(), AdmissionError::Reason::Draining);
  }
  EXPECT_TRUE(h.scheduler->wait_idle(Clock::now() + 5s));
  if (h.shared_store()) {
    EXPECT_EQ(h.scheduler->running_jobs(), 0);
    EXPECT_FALSE(is_terminal(h.scheduler->get(b, "")->state)) << "b waits in the store for another pod";
    return;
  }
  EXPECT_EQ(h.scheduler->get(a, "")->state, JobState::Succeeded);
  EXPECT_EQ(h.scheduler->get(b, "")->state, JobState::Succeeded);
}

TEST(Scheduler, AbortEndsEveryUnfinishedJobAsUnavailable) {
  Harness h({steps(10ms, 100)});
  const auto running = h.submit(1);
  const auto queued = h.submit(1);
  h.scheduler->wait_events(running, "", 2, Clock::now() + 2s);
  h.scheduler->abort_all("drain timeout");
  for (const auto& id : {running, queued}) {
    const auto job = h.wait(id);
    EXPECT_EQ(job.state, JobState::Failed);
    EXPECT_EQ(job.error_kind, ErrorKind::Unavailable);
    EXPECT_EQ(job.error, "drain timeout");
  }
}

TEST(Scheduler, IdempotencyKeyReturnsTheSameJobAndRefusesADifferentRequest) {
  Harness h({FakeBehaviour{}});
  const auto first = h.submit(1, 0, 1, "alice", std::nullopt, "key-1", 111);
  const auto again = h.submit(1, 0, 1, "alice", std::nullopt, "key-1", 111);
  EXPECT_EQ(first, again);
  const auto other_owner = h.submit(1, 0, 1, "bob", std::nullopt, "key-1", 111);
  EXPECT_NE(first, other_owner) << "keys are per client";
  try {
    h.submit(1, 0, 1, "alice", std::nullopt, "key-1", 222);
    FAIL() << "expected AdmissionError";
  } catch (const AdmissionError& e) {
    EXPECT_EQ(e.reason(), AdmissionError::Reason::IdempotencyConflict);
    EXPECT_NE(std::string(e.what()).find(first), std::string::npos);
  }
}

TEST(Scheduler, ClientsSeeOnlyTheirOwnJobs) {
  Harness h({FakeBehaviour{}});
  const auto alice = h.submit(1, 0, 1, "alice");
  const auto bob = h.submit(1, 0, 1, "bob");
  EXPECT_TRUE(h.scheduler->get(alice, "alice").has_value());
  EXPECT_FALSE(h.scheduler->get(alice, "bob").has_value());
  EXPECT_FALSE(h.scheduler->cancel(alice, "bob").has_value());
  EXPECT_FALSE(h.scheduler->wait_events(alice, "bob", 0, Clock::now()).found);
  const auto listed = h.scheduler->list("bob");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].id, bob);
  EXPECT_EQ(h.wait(alice, "alice").state, JobState::Succeeded);
}

TEST(Scheduler, EventsTellTheWholeStoryInOrder) {
  Harness h({steps(2ms, 3)});
  const auto id = h.submit(2);
  h.wait(id);
  const auto batch = h.scheduler->wait_events(id, "", 0, Clock::now());
  ASSERT_FALSE(batch.events.empty());
  EXPECT_TRUE(batch.finished);
  std::vector<EventType> types;
  for (size_t i = 0; i < batch.events.size(); ++i) {
    EXPECT_EQ(batch.events[i].sequence, i + 1);
    types.push_back(batch.events[i].type);
  }
  const std::vector<EventType> expected = {EventType::Queued,       EventType::ChunkStarted,  EventType::Step,
                                           EventType::Step,         EventType::Step,          EventType::ChunkFinished,
                                           EventType::ChunkStarted, EventType::Step,          EventType::Step,
                                           EventType::Step,         EventType::ChunkFinished, EventType::Finished};
  EXPECT_EQ(types, expected);
  EXPECT_DOUBLE_EQ(batch.events[10 - 1].progress, 1.0) << "the last step of the last chunk is 100 %";
}

TEST(Scheduler, QueuedJobsKnowTheirPositionAndAnEstimate) {
  FakeBehaviour held = steps(5ms);
  held.gate = std::make_shared<Gate>();
  held.gate->release();
  Harness h({held});
  h.wait(h.submit(1));  // one measurement for the estimate
  held.gate->close();   // the next job holds the only replica: the later ones stay queued while the test looks
  const auto busy = h.submit(1);
  held.gate->wait_for_waiting(1);  // it holds it now: no claim moves the queue while the test reads it
  std::vector<std::string> queued;
  for (int i = 0; i < 3; ++i) queued.push_back(h.submit(1));
  int64_t previous_position = 0;
  double previous_eta = -1;
  for (size_t i = 0; i < queued.size(); ++i) {
    const auto job = h.scheduler->get(queued[i], "");
    ASSERT_TRUE(job.has_value());
    ASSERT_EQ(job->state, JobState::Queued) << "job " << i;
    EXPECT_GT(job->queue_position, previous_position) << "job " << i;
    EXPECT_GE(job->eta_seconds, 0.0) << "job " << i;
    EXPECT_GE(job->eta_seconds, previous_eta) << "job " << i;
    previous_position = job->queue_position;
    previous_eta = job->eta_seconds;
  }
  held.gate->release();
  for (const auto& id : queued) h.wait(id);
  h.wait(busy);
}

// ---- issue 12: per-client admission and per-job wake-ups ------------------------------------------------------------

JobSpec client_job(const std::string& client, int64_t client_max_jobs = 0, const std::string& key = "") {
  JobSpec spec;
  spec.owner = client;
  spec.client = client;
  spec.client_max_jobs = client_max_jobs;
  spec.idempotency_key = key;
  spec.chunk_work = {1.0};
  spec.chunk_rows = {3};
  spec.payload = std::make_shared<FakePayload>(1);
  return spec;
}

TEST(Scheduler, OneClientCannotFillTheQueueAndAKeysCapOverridesTheDefault) {
  SchedulerOptions options;
  options.max_jobs = 10;
  options.max_jobs_per_client = 2;
  Harness h({steps(20ms, 50)}, options);
  h.scheduler->submit(client_job("alice"));
  h.scheduler->submit(client_job("alice", 0, "k"));
  try {
    h.scheduler->submit(client_job("alice"));
    FAIL() << "expected AdmissionError";
  } catch (const AdmissionError& e) {
    EXPECT_EQ(e.reason(), AdmissionError::Reason::ClientQueueFull);
    EXPECT_GE(e.retry_after_seconds(), 1.0);
  }
  EXPECT_THROW(h.scheduler->check_admission(client_job("alice")), AdmissionError) << "checked before the work";
  EXPECT_NO_THROW(h.scheduler->check_admission(client_job("alice", 0, "k"))) << "a known key is deduplicated";
  EXPECT_NO_THROW(h.scheduler->submit(client_job("bob"))) << "other clients are not affected";
  EXPECT_NO_THROW(h.scheduler->submit(client_job("carol", 3)));
  EXPECT_NO_THROW(h.scheduler->submit(client_job("carol", 3)));
  EXPECT_NO_THROW(h.scheduler->submit(client_job("carol", 3))) << "carol's key allows 3";
  h.scheduler->abort_all("test over");
}

TEST(Scheduler, AWatcherIsToldAboutItsOwnJobOnlyAndWhenTheJobIsDropped) {
  SchedulerOptions options;
  options.max_retained_jobs = 0;  // finished jobs are dropped at once
  Harness h({steps(20ms, 10)}, options);
  const std::string running = h.submit(1);
  const std::string queued = h.submit(1);  // behind `running` on the only replica: no event of its own meanwhile
  std::atomic<int> told{0};
  const uint64_t token = h.scheduler->subscribe(queued, [&] { ++told; });
  ASSERT_NE(token, 0u);
  std::atomic<int> told_unknown{0};  // subscribing asks nothing of the store: an unknown job is just never told
  const uint64_t unknown = h.scheduler->subscribe("j-unknown", [&] { ++told_unknown; });
  // Five step events of the other job: the watcher of `queued` is not woken by them.
  uint64_t seen = 0;
  while (seen < 6) {
    const EventBatch batch = h.scheduler->wait_events(running, "", seen, Clock::now() + 5s);
    ASSERT_FALSE(batch.events.empty());
    seen = batch.events.back().sequence;
  }
  EXPECT_EQ(told.load(), 0);
  // Its own events, and its end and removal, do reach it.
  const auto until = Clock::now() + 5s;
  while (h.scheduler->get(queued, "") && Clock::now() < until) std::this_thread::sleep_for(1ms);
  EXPECT_FALSE(h.scheduler->get(queued, "").has_value()) << "dropped after it finished";
  EXPECT_GE(told.load(), 4) << "queued, chunk started, steps, chunk finished, finished, dropped";
  h.scheduler->unsubscribe(queued, token);  // a dropped job: nothing to do, no error
  EXPECT_EQ(told_unknown.load(), 0);
  h.scheduler->unsubscribe("j-unknown", unknown);
}

// The one stream of scheduler events (JobQueue::events()): a consumer hears every job's changes until it
// unsubscribes.
TEST(Scheduler, TheEventStreamTellsItsConsumersOfEveryJobUntilTheyUnsubscribe) {
  Harness h({steps(1ms)});
  std::mutex mu;
  std::condition_variable cv;
  std::multiset<std::string> heard;
  const uint64_t token = h.scheduler->events().subscribe([&](const SchedulerEvent& event) {
    if (event.kind != SchedulerEventKind::JobChanged) return;
    std::lock_guard<std::mutex> lock(mu);
    heard.insert(event.job_id);
    cv.notify_all();
  });
  const std::string first = h.submit(2);
  h.wait(first);
  {
    // Queued, two chunks started and committed, and the end: each is a change (the end may land after wait()).
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return heard.count(first) >= 5; });
  }
  h.scheduler->events().unsubscribe(token);
  const std::string second = h.submit(1);
  h.wait(second);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(heard.count(second), 0u) << "no call once unsubscribe() returned";
}

}  // namespace
}  // namespace skyreels::server

namespace skyreels::server {
namespace {

// ---- issue 12, item 3: replicas heal, liveness means something ---------------------------------------------------

TEST(SchedulerHealing, OutOfMemoryFailsTheJobResourceExhaustedWithoutRetriesOrBlamingTheReplica) {
  FakeBehaviour oom;
  oom.out_of_memory = true;
  SchedulerOptions options;
  options.replica_failure_limit = 1;
  Harness h({oom}, options);
  for (int i = 0; i < 3; ++i) {
    const JobSnapshot job = h.wait(h.submit(2));
    EXPECT_EQ(job.state, JobState::Failed);
    EXPECT_EQ(job.error_kind, ErrorKind::ResourceExhausted);
    EXPECT_EQ(job.retries, 0);
  }
  EXPECT_TRUE(h.scheduler->replicas()[0].healthy) << "three out-of-memory chunks in a row, limit 1: still healthy";
  EXPECT_TRUE(h.scheduler->ready());
  EXPECT_TRUE(h.scheduler->live());
}

TEST(SchedulerHealing, AReplicaTakenOutIsReTestedWithADoublingCappedBackOffAndComesBack) {
  FakeBehaviour broken = failing_calls({1});
  broken.probe_failures = 3;
  SchedulerOptions options;
  options.replica_failure_limit = 1;
  options.chunk_retries = 0;
  options.retest_backoff = 100ms;
  options.retest_backoff_max = 250ms;
  Harness h({broken}, options);
  const auto taken_out = Clock::now();
  EXPECT_EQ(h.wait(h.submit(1)).state, JobState::Failed);
  EXPECT_FALSE(h.scheduler->replicas()[0].healthy);
  EXPECT_FALSE(h.scheduler->ready());
  EXPECT_THROW(h.submit(1), AdmissionError) << "no healthy replica: UNAVAILABLE";

  const auto until = Clock::now() + 5s;
  while (!h.scheduler->ready() && Clock::now() < until) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(h.scheduler->ready()) << "the fourth re-test passes";
  const auto probes = h.log->probe_times();
  ASSERT_EQ(probes.size(), 4u);
  auto ms = [](Clock::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); };
  const std::vector<int64_t> waits = {ms(probes[0] - taken_out), ms(probes[1] - probes[0]), ms(probes[2] - probes[1]),
                                      ms(probes[3] - probes[2])};
  // Lower bounds are exact (never earlier than the back-off); upper bounds leave room for a loaded machine.
  EXPECT_GE(waits[1], 200) << "doubled";
  EXPECT_GE(waits[2], 250) << "capped at 250 ms, not 400";
  EXPECT_LT(waits[2], 390) << "capped at 250 ms, not 400";
  EXPECT_GE(waits[3], 250);
  EXPECT_LT(waits[3], 390);
  const ReplicaStatus replica = h.scheduler->replicas()[0];
  EXPECT_TRUE(replica.healthy);
  EXPECT_EQ(replica.recoveries, 1);
  EXPECT_EQ(h.wait(h.submit(2)).state, JobState::Succeeded) << "it serves again";
}

TEST(SchedulerHealing, LivenessFailsOnlyAfterTheGraceWithoutAHealthyReplicaAndReturnsWithOne) {
  SchedulerOptions options;
  options.replica_failure_limit = 1;
  options.chunk_retries = 0;
  options.liveness_grace = 200ms;
  options.retest_backoff = 1500ms;
  Harness h({failing_calls({1})}, options);
  const auto taken_out = Clock::now();
  EXPECT_EQ(h.wait(h.submit(1)).state, JobState::Failed);
  EXPECT_FALSE(h.scheduler->ready());
  auto until = Clock::now() + 5s;
  while (h.scheduler->live() && Clock::now() < until) std::this_thread::sleep_for(5ms);
  EXPECT_FALSE(h.scheduler->live());
  EXPECT_GE(Clock::now() - taken_out, 200ms) << "not before the grace";
  until = Clock::now() + 5s;
  while (!h.scheduler->live() && Clock::now() < until) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(h.scheduler->live()) << "the re-test passed: a healthy replica again";
  EXPECT_TRUE(h.scheduler->ready());
}

TEST(SchedulerHealing, AReplicaThatNeverLoadedCountsAgainstLivenessAndIsNotReTested) {
  SchedulerOptions options;
  options.liveness_grace = 100ms;
  options.retest_backoff = 10ms;
  Harness h({not_loading()}, options);
  const auto until = Clock::now() + 5s;
  while (h.scheduler->live() && Clock::now() < until) std::this_thread::sleep_for(5ms);
  EXPECT_FALSE(h.scheduler->live());
  EXPECT_TRUE(h.log->probe_times().empty());
}

}  // namespace
}  // namespace skyreels::server

namespace skyreels::server {
namespace {

// ---- issue 13: a submission is stored without the scheduler's lock ------------------------------------------------

// A memory store whose next insert_job can be held until release() (a latch), or made to fail.
class GatedStore : public JobStore {
 public:
  std::string describe() const override { return "gated"; }
  bool durable() const override { return false; }
  void insert_job(StoredJob job) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (fail_next_) {
        fail_next_ = false;
        throw StoreError("jobs.sqlite: disk full (test)");
      }
      if (hold_next_) {
        hold_next_ = false;
        held_ = true;
        cv_.notify_all();
        cv_.wait(lock, [&] { return released_; });
      }
      ++inserts_;
    }
    inner_->insert_job(std::move(job));
  }
  void update_job(const StoredJob& job) override { inner_->update_job(job); }
  void commit_chunk(const std::string& id, const StoredChunk& chunk) override { inner_->commit_chunk(id, chunk); }
  void append_event(const std::string& id, const StoredEvent& event) override { inner_->append_event(id, event); }
  void drop_job(const std::string& id, const std::string& reason) override { inner_->drop_job(id, reason); }
  std::optional<std::string> dropped_reason(const std::string& id, const std::string& owner) const override {
    return inner_->dropped_reason(id, owner);
  }
  std::vector<StoredJob> load_jobs() const override { return inner_->load_jobs(); }
  std::vector<StoredChunk> load_chunks(const std::string& id) const override { return inner_->load_chunks(id); }
  std::vector<StoredEvent> load_events(const std::string& id) const override { return inner_->load_events(id); }
  std::optional<std::string> load_chunk_bytes(const std::string& id, int64_t index) const override {
    return inner_->load_chunk_bytes(id, index);
  }
  void put_segment(const std::string& id, int64_t index, const std::string& bytes) override {
    inner_->put_segment(id, index, bytes);
  }
  std::optional<std::string> load_segment(const std::string& id, int64_t index) const override {
    return inner_->load_segment(id, index);
  }

  void hold_next_insert() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_next_ = true;
  }
  void fail_next_insert() {
    std::lock_guard<std::mutex> lock(mu_);
    fail_next_ = true;
  }
  void wait_until_held() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return held_; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  int inserts() {
    std::lock_guard<std::mutex> lock(mu_);
    return inserts_;
  }

 private:
  std::unique_ptr<JobStore> inner_ = open_job_store("memory");
  std::mutex mu_;
  std::condition_variable cv_;
  bool hold_next_ = false, held_ = false, released_ = false, fail_next_ = false;
  int inserts_ = 0;
};

TEST(SchedulerSubmit, WhileAJobIsBeingStoredOtherCallsAnswerAndItsKeyStillGivesOneJob) {
  GatedStore store;
  Harness h({steps(1ms)}, {}, &store);
  const std::string earlier = h.submit(1);
  h.wait(earlier);

  store.hold_next_insert();
  SubmitResult first, duplicate;
  std::thread slow([&] { first = h.scheduler->submit(client_job("alice", 0, "k")); });
  store.wait_until_held();
  std::thread same_key([&] { duplicate = h.scheduler->submit(client_job("alice", 0, "k")); });

  // The insert is blocked: reads and other submissions are answered meanwhile.
  EXPECT_EQ(h.scheduler->get(earlier, "")->state, JobState::Succeeded);
  EXPECT_TRUE(h.scheduler->list("alice").empty()) << "a job is visible once it is stored";
  const std::string other = h.submit(1);
  EXPECT_EQ(h.wait(other).state, JobState::Succeeded) << "and the replicas keep working";

  store.release();
  slow.join();
  same_key.join();
  EXPECT_FALSE(first.deduplicated);
  EXPECT_TRUE(duplicate.deduplicated);
  EXPECT_EQ(duplicate.job.id, first.job.id);
  EXPECT_EQ(h.scheduler->list("alice").size(), 1u);
  EXPECT_EQ(store.inserts(), 3) << "earlier, other, and the keyed job once";
  EXPECT_EQ(h.wait(first.job.id, "alice").state, JobState::Succeeded);
}

TEST(SchedulerSubmit, AJobTheStoreRefusesLeavesNoTraceAndFreesItsSlotAndKey) {
  GatedStore store;
  SchedulerOptions options;
  options.max_jobs = 1;
  Harness h({steps(1ms)}, options, &store);
  store.fail_next_insert();
  try {
    h.scheduler->submit(client_job("alice", 0, "k"));
    FAIL() << "expected AdmissionError";
  } catch (const AdmissionError& e) {
    EXPECT_EQ(e.reason(), AdmissionError::Reason::Unavailable);
    EXPECT_NE(std::string(e.what()).find("disk full"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(h.scheduler->list("alice").empty());
  EXPECT_EQ(h.scheduler->queued_jobs(), 0);
  EXPECT_TRUE(store.load_jobs().empty());
  EXPECT_TRUE(h.scheduler->wait_idle(Clock::now())) << "no reservation left behind";

  const SubmitResult again = h.scheduler->submit(client_job("alice", 0, "k"));
  EXPECT_FALSE(again.deduplicated) << "the key went with the reservation";
  EXPECT_EQ(h.wait(again.job.id, "alice").state, JobState::Succeeded) << "the only admission slot was free again";
}

// ---- the replica pool against a scripted source -----------------------------------------------------------------

// An executor whose every run (1-based call number) and probe is scripted by the test.
class ScriptedExecutor : public ChunkExecutor {
 public:
  using Run = std::function<ChunkResult(int call, const ChunkCallbacks&)>;
  explicit ScriptedExecutor(Run run) : run_(std::move(run)) {}
  std::string name() const override { return "scripted:0"; }
  ChunkResult run(const ChunkWork&, const ChunkCallbacks& callbacks) override { return run_(++calls_, callbacks); }

 private:
  Run run_;
  int calls_ = 0;
};

// Hands out `chunks` chunks (chunk i asks to stop when stop_chunk == i), then blocks until interrupted; records what
// the pool asked and reported, and how the replica looked to the source at that moment.
class ScriptedSource : public ChunkSource {
 public:
  struct Ask {
    bool healthy;
    int64_t recoveries;
  };
  struct Report {
    ChunkOutcome outcome;
    std::string error;
    bool healthy;
  };
  ScriptedSource(ReplicaPool& pool, int chunks, int64_t stop_chunk = -1)
      : pool_(pool), left_(chunks), stop_chunk_(stop_chunk) {}

  std::optional<ChunkAssignment> next_chunk(size_t replica) override {
    std::unique_lock<std::mutex> lock(mu_);
    asks_.push_back({pool_.healthy(replica), pool_.status(replica).recoveries});
    cv_.wait(lock, [&] { return left_ > 0 || interrupted_; });
    if (left_ == 0) return std::nullopt;
    --left_;
    ChunkAssignment assignment;
    assignment.work.job_id = "job";
    assignment.work.chunk_index = handed_++;
    const bool stop = assignment.work.chunk_index == stop_chunk_;
    assignment.callbacks.should_stop = [stop] { return stop; };
    return assignment;
  }
  void chunk_done(size_t replica, ChunkAssignment, ChunkResult result, double) override {
    std::lock_guard<std::mutex> lock(mu_);
    reports_.push_back({result.outcome, result.error, pool_.healthy(replica)});
    cv_.notify_all();
  }
  void replicas_changed() override {}
  void interrupt() override {
    std::lock_guard<std::mutex> lock(mu_);
    interrupted_ = true;
    cv_.notify_all();
  }

  std::vector<Report> wait_for_reports(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return reports_.size() >= n; });
    return reports_;
  }
  std::vector<Ask> asks() {
    std::lock_guard<std::mutex> lock(mu_);
    return asks_;
  }

 private:
  ReplicaPool& pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  int left_;
  int64_t stop_chunk_;
  int64_t handed_ = 0;
  bool interrupted_ = false;
  std::vector<Ask> asks_;
  std::vector<Report> reports_;
};

std::vector<std::unique_ptr<ChunkExecutor>> one_executor(ScriptedExecutor::Run run) {
  spdlog::set_level(spdlog::level::warn);
  std::vector<std::unique_ptr<ChunkExecutor>> executors;
  executors.push_back(std::make_unique<ScriptedExecutor>(std::move(run)));
  return executors;
}

TEST(StoredEvents, RoundTripAndADamagedRowIsAStoreErrorNamingItsSequence) {
  JobEvent event;
  event.type = EventType::ChunkFinished;
  event.chunk = 3;
  event.replica = "pod-1/cpu:0";
  event.time = from_wall_ms(1700000000123);
  const JobEvent back = decode_stored_event({7, encode_stored_event(event)});
  EXPECT_EQ(back.sequence, 7u);
  EXPECT_EQ(back.type, EventType::ChunkFinished);
  EXPECT_EQ(back.chunk, 3);
  EXPECT_EQ(back.replica, "pod-1/cpu:0");
  EXPECT_EQ(wall_ms(back.time), 1700000000123);
  JobEvent step;
  step.type = EventType::Step;
  step.chunk = 2;
  step.step = 4;
  step.steps = 9;
  step.progress = 0.375;
  const JobEvent step_back = decode_stored_event({8, encode_stored_event(step)});
  EXPECT_EQ(step_back.step, 4) << "step progress crosses pods in this form";
  EXPECT_EQ(step_back.steps, 9);
  EXPECT_DOUBLE_EQ(step_back.progress, 0.375);
  // Readers on every pod meet rows other servers wrote: a damaged one is the store's error, never a crash.
  for (const std::string& damaged : {std::string("{\"type\": 3"), std::string("[]"), std::string("{}"),
                                     std::string("{\"type\": \"x\"}")}) {
    try {
      decode_stored_event({9, damaged});
      ADD_FAILURE() << "accepted " << damaged;
    } catch (const StoreError& e) {
      EXPECT_NE(std::string(e.what()).find("stored event 9"), std::string::npos) << e.what();
    }
  }
}

// ---- idempotency fingerprints ----

TEST(Fingerprints, VersionTwoIsSha256InHexAndVersionOneTheFnvOfTheSameBytes) {
  FingerprintHasher empty;
  EXPECT_EQ(empty.v1(), 1469598103934665603ULL);
  EXPECT_EQ(empty.v2(), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  FingerprintHasher abc;
  abc.bytes("abc", 3);
  EXPECT_EQ(abc.v2(), "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Fingerprints, AJobStoredWithOnlyVersionOneIsMatchedByItAndANewerOneByVersionTwo) {
  EXPECT_TRUE(same_fingerprint(7, "", 7, "sha256:aa")) << "stored before the upgrade: v1 decides";
  EXPECT_FALSE(same_fingerprint(7, "", 8, "sha256:aa"));
  EXPECT_TRUE(same_fingerprint(7, "sha256:aa", 7, "sha256:aa"));
  EXPECT_FALSE(same_fingerprint(7, "sha256:aa", 7, "sha256:bb")) << "a v1 collision does not pass once v2 exists";
}

TEST(Fingerprints, ARetryOfAJobRestoredFromBeforeTheUpgradeIsDeduplicatedByItsOldFingerprint) {
  RestoredJob old;
  old.stored.id = "j-old";
  old.stored.owner = "alice";
  old.stored.idempotency_key = "retry-me";
  old.stored.fingerprint = 4242;  // v1 only, as stored before SHA-256 fingerprints
  old.stored.state = "succeeded";
  old.stored.chunk_count = 1;
  old.stored.chunks_done = 1;
  old.stored.created_ms = 1;
  old.stored.finished_ms = 2;
  const std::unique_ptr<JobStore> stored = open_job_store("memory");  // the store is the queue: the job is in it
  stored->insert_job(old.stored);
  Harness fresh({steps(2ms)}, {}, stored.get());
  JobSpec retry;
  retry.owner = "alice";
  retry.idempotency_key = "retry-me";
  retry.fingerprint = 4242;
  retry.fingerprint_v2 = "sha256:0123";
  retry.chunk_work = {1.0};
  retry.chunk_rows = {3};
  retry.payload = std::make_shared<FakePayload>(1);
  const SubmitResult again = fresh.scheduler->submit(retry);
  EXPECT_TRUE(again.deduplicated);
  EXPECT_EQ(again.job.id, "j-old");
  retry.fingerprint = 4243;
  EXPECT_THROW(fresh.scheduler->submit(retry), AdmissionError) << "another request under the key";
}

// ---- job ids ----

TEST(JobIds, AreJPlus32HexDigitsOf128RandomBits) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = new_job_id();
    ASSERT_EQ(id.size(), 34u) << id;
    EXPECT_EQ(id.substr(0, 2), "j-");
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef", 2), std::string::npos) << id;
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 1000u);
}

// Eight processes forked from one state, released by one pipe write, draw 1,250 ids each: a generator seeded from a
// shared or a small state (a 32-bit seed, the time) would repeat across them.
TEST(JobIds, TenThousandIdsFromEightProcessesStartedAtTheSameInstantAreDistinct) {
  constexpr int kProcesses = 8, kEach = 1250;
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  std::vector<int> results;
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(go[1]);
      ::close(out[0]);
      char byte;
      if (::read(go[0], &byte, 1) != 1) ::_exit(2);
      std::string all;
      for (int i = 0; i < kEach; ++i) all += new_job_id() + "\n";
      for (size_t at = 0; at < all.size();) {
        const ssize_t n = ::write(out[1], all.data() + at, all.size() - at);
        if (n <= 0) ::_exit(3);
        at += static_cast<size_t>(n);
      }
      ::_exit(0);
    }
    ::close(out[1]);
    results.push_back(out[0]);
    children.push_back(pid);
  }
  ::close(go[0]);
  const std::string release(kProcesses, 'x');
  ASSERT_EQ(::write(go[1], release.data(), release.size()), static_cast<ssize_t>(release.size()));
  ::close(go[1]);
  std::set<std::string> ids;
  size_t lines = 0;
  for (int fd : results) {
    std::string text;
    char buffer[4096];
    for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) text.append(buffer, static_cast<size_t>(n));
    ::close(fd);
    for (size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1, ++lines) {
      ids.insert(text.substr(at, end - at));
    }
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_EQ(lines, static_cast<size_t>(kProcesses * kEach));
  EXPECT_EQ(ids.size(), static_cast<size_t>(kProcesses * kEach)) << "duplicate ids";
}

TEST(ReplicaPool, PullsChunksFromItsSourceAndReportsEachResultBack) {
  ReplicaPool pool(one_executor([](int, const ChunkCallbacks&) { return ChunkResult{}; }), {});
  ScriptedSource source(pool, 3);
  pool.start(source);
  const auto reports = source.wait_for_reports(3);
  for (const auto& r : reports) EXPECT_EQ(r.outcome, ChunkOutcome::Succeeded);
  EXPECT_EQ(pool.status(0).chunks_run, 3);
  pool.stop();
  EXPECT_EQ(source.asks().size(), 4u) << "three chunks, then a wait the stop ended";
}

TEST(ReplicaPool, AReplicaTakenOutIsAskedForWorkAgainOnlyAfterAReTestBroughtItBack) {
  SchedulerOptions options;
  options.replica_failure_limit = 2;
  options.retest_backoff = 1ms;
  ReplicaPool pool(one_executor([](int call, const ChunkCallbacks&) {
                     if (call <= 2) throw std::runtime_error("device lost");
                     return ChunkResult{};
                   }),
                   options);
  ScriptedSource source(pool, 3);
  pool.start(source);
  const auto reports = source.wait_for_reports(3);
  pool.stop();
  EXPECT_EQ(reports[0].outcome, ChunkOutcome::Failed);
  EXPECT_TRUE(reports[0].healthy) << "one failure is under the limit";
  EXPECT_EQ(reports[1].outcome, ChunkOutcome::Failed);
  EXPECT_FALSE(reports[1].healthy) << "the source learns the replica is out before it decides the job's retry";
  EXPECT_EQ(reports[2].outcome, ChunkOutcome::Succeeded);
  const auto asks = source.asks();
  ASSERT_GE(asks.size(), 3u);
  for (const auto& ask : asks) EXPECT_TRUE(ask.healthy) << "an unhealthy replica is never asked for work";
  EXPECT_EQ(asks[2].recoveries, 1) << "the third chunk was asked for after the re-test";
  EXPECT_EQ(pool.status(0).failures, 2);
  EXPECT_EQ(pool.status(0).error, "device lost");
}

TEST(ReplicaPool, AnExceptionOrAStopNobodyAskedForArrivesAsFailedAndARequestedStopAsStopped) {
  SchedulerOptions options;
  options.replica_failure_limit = 100;
  ReplicaPool pool(
      one_executor([](int call, const ChunkCallbacks& callbacks) {
        if (call == 1) throw std::runtime_error("device lost");
        if (call == 2) return ChunkResult{ChunkOutcome::Stopped, "", 0, {}, {}};
        return ChunkResult{callbacks.should_stop() ? ChunkOutcome::Stopped : ChunkOutcome::Succeeded, "", 0, {}, {}};
      }),
      options);
  ScriptedSource source(pool, 3, /*stop_chunk=*/2);
  pool.start(source);
  const auto reports = source.wait_for_reports(3);
  pool.stop();
  EXPECT_EQ(reports[0].outcome, ChunkOutcome::Failed);
  EXPECT_EQ(reports[0].error, "device lost");
  EXPECT_EQ(reports[1].outcome, ChunkOutcome::Failed);
  EXPECT_EQ(reports[1].error, "chunk stopped without a request");
  EXPECT_EQ(reports[2].outcome, ChunkOutcome::Stopped);
  EXPECT_EQ(pool.status(0).failures, 2) << "a requested stop is not the replica's fault";
}

}  // namespace
}  // namespace skyreels::server
