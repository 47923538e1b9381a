// The lease contract every store keeps (server/store/job_lease.h), the same cases on each: memory and SQLite (one
// process: LocalLeaseStore) and PostgreSQL (pods: a store per pod on one database, a real PostgreSQL 15 per test).
// Claim order (priority, the client's then the job's attained service, submission), affinity, fair shares between
// clients, concurrent claims that never get the same job, takeover of an expired lease with fencing, release,
// cancel, idempotent and limited admission across pods, the fair-share start, counts. The ctest names end in the
// store (e.g. Stores/LeaseContract.ReleaseGivesTheChunkBackWithoutARetry/sqlite).
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server/store/job_lease.h"
#include "server/store/job_lease_local.h"
#include "server/store/job_store_memory.h"
#include "server/store/job_store_postgres.h"
#include "server/store/job_store_sqlite.h"
#include "tests/pg_fixture.h"
#include "tests/stored_jobs.h"

namespace skyreels::test {
namespace {

using server::ChunkLease;
using server::LeaseStore;
using server::StoredJob;
using namespace std::chrono_literals;

// One pod's view of a store: its leases and the job records they hold (LocalLeaseStore, PostgresLeaseStore).
class Pod {
 public:
  explicit Pod(LeaseStore& store) : jobs_(store.records()), leases_(store) {}
  operator LeaseStore&() { return leases_; }  // NOLINT(google-explicit-constructor): insert_with_fresh_ids(*pod, ...)

  void insert_job(const StoredJob& job) { jobs_.insert_job(job); }
  void update_job(const StoredJob& job) { jobs_.update_job(job); }
  void commit_chunk(const std::string& id, const server::StoredChunk& chunk) { jobs_.commit_chunk(id, chunk); }
  void drop_job(const std::string& id, const std::string& reason) { jobs_.drop_job(id, reason); }
  std::vector<StoredJob> load_jobs() const { return jobs_.load_jobs(); }
  std::vector<server::StoredChunk> load_chunks(const std::string& id) const { return jobs_.load_chunks(id); }
  std::vector<server::StoredEvent> load_events(const std::string& id) const { return jobs_.load_events(id); }

  std::optional<ChunkLease> claim(const std::string& replica, std::chrono::milliseconds ttl) {
    return leases_.claim(replica, ttl);
  }
  server::LeaseRenewal renew(const ChunkLease& lease, std::chrono::milliseconds ttl) {
    return leases_.renew(lease, ttl);
  }
  server::LeaseCommit commit(const ChunkLease& lease, const server::StoredChunk& chunk,
                             const std::vector<std::string>& events) {
    return leases_.commit(lease, chunk, events);
  }
  bool release(const ChunkLease& lease) { return leases_.release(lease); }
  server::CancelState request_cancel(const std::string& id, const std::string& owner) {
    return leases_.request_cancel(id, owner);
  }
  server::InsertOutcome insert_job_once(const StoredJob& job, server::AdmissionLimits limits = {}) {
    return leases_.insert_job_once(job, limits);
  }
  server::AdmissionCounts admission_counts(const std::string& client) const {
    return leases_.admission_counts(client);
  }
  int64_t queue_depth() const { return leases_.queue_depth(); }
  std::optional<StoredJob> load_job(const std::string& id) const { return leases_.load_job(id); }

 private:
  server::JobStore& jobs_;
  LeaseStore& leases_;
};

class LeaseContract : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "postgresql") {
      pg_ = std::make_unique<PgServer>();
      return;
    }
    std::unique_ptr<server::JobStore> inner;
    if (GetParam() == "sqlite") {
      char dir[] = "/tmp/skyreels-lease-contract-XXXXXX";
      ASSERT_NE(mkdtemp(dir), nullptr);
      dir_ = dir;
      inner = std::make_unique<server::SqliteJobStore>(dir_ + "/jobs.db");
    } else {
      inner = std::make_unique<server::MemoryJobStore>();
    }
    local_ = std::make_unique<server::LocalLeaseStore>(std::move(inner), "finished");
  }
  void TearDown() override {
    views_.clear();
    pods_.clear();
    local_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // Pod `i`'s store: on PostgreSQL a store of its own on the shared database; a store one process holds is the only
  // pod there is, so every pod is that store (and its "pods" are threads of one server).
  Pod& pod(int i) {
    while (static_cast<int>(views_.size()) <= i) {
      if (local_) {
        views_.push_back(std::make_unique<Pod>(*local_));
      } else {
        pods_.push_back(
            std::make_unique<server::PostgresLeaseStore>(std::make_unique<server::PostgresJobStore>(pg_->url())));
        views_.push_back(std::make_unique<Pod>(*pods_.back()));
      }
    }
    return *views_[static_cast<size_t>(i)];
  }

 private:
  std::unique_ptr<PgServer> pg_;
  std::vector<std::unique_ptr<server::PostgresLeaseStore>> pods_;
  std::unique_ptr<server::LocalLeaseStore> local_;
  std::vector<std::unique_ptr<Pod>> views_;
  std::string dir_;
};

TEST_P(LeaseContract, ClaimsFollowPriorityThenAttainedServiceThenSubmissionOrder) {
  Pod* store = &pod(0);
  store->insert_job(make_job("a", 1, 0, 2));  // priority 0, service 2
  store->insert_job(make_job("b", 2, 1, 9));  // priority 1: first despite its service
  store->insert_job(make_job("c", 3, 0, 0));  // priority 0, service 0
  store->insert_job(make_job("d", 4, 0, 0));  // priority 0, service 0, submitted after c
  StoredJob done = make_job("e", 5, 9, 0, 1);
  done.chunks_done = 1;  // no chunk left
  store->insert_job(done);
  StoredJob finished = make_job("f", 6, 9);
  finished.state = "succeeded";
  store->insert_job(finished);

  std::vector<std::string> order;
  for (int i = 0; i < 4; ++i) {
    auto lease = store->claim("r" + std::to_string(i), kLongTtl);
    ASSERT_TRUE(lease.has_value()) << "claim " << i;
    order.push_back(lease->job_id);
    EXPECT_EQ(lease->chunk_index, 0);
    EXPECT_EQ(lease->chunk_count, 3);
    EXPECT_FALSE(lease->takeover);
    EXPECT_FALSE(lease->handoff);
  }
  EXPECT_EQ(order, (std::vector<std::string>{"b", "c", "d", "a"}));
  EXPECT_FALSE(store->claim("r9", kLongTtl).has_value()) << "leased, finished and complete jobs are not ready";
  const auto b = store->load_job("b");
  EXPECT_EQ(b->state, "running");
  EXPECT_GT(b->started_ms, 0);
}

TEST_P(LeaseContract, AttainedServiceGrowsWithEachCommittedChunk) {
  Pod* store = &pod(0);
  store->insert_job(make_job("a", 1));
  store->insert_job(make_job("b", 2));
  auto first = store->claim("r1", kLongTtl);
  ASSERT_EQ(first->job_id, "a");
  ASSERT_TRUE(store->commit(*first, {0, "r1", 1, "a0"}, {}).committed);
  // a has run one chunk, b none: b goes first even for the replica that holds a's state (service beats affinity),
  // so jobs interleave at chunk boundaries.
  EXPECT_EQ(store->claim("r1", kLongTtl)->job_id, "b");
}

TEST_P(LeaseContract, ClaimsShareTheReplicasBetweenClientsBeforeJobs) {
  Pod* store = &pod(0);
  for (const char* id : {"a1", "a2", "a3"}) {
    StoredJob j = make_job(id, 0, 0, 0, 2);
    j.client = "tenant-a";
    store->insert_job_once(j);
  }
  StoredJob b = make_job("b1", 0, 0, 0, 2);
  b.client = "tenant-b";
  store->insert_job_once(b);
  std::vector<std::string> order;
  for (int i = 0; i < 8; ++i) {
    auto lease = store->claim("r0", kLongTtl);
    ASSERT_TRUE(lease.has_value()) << "claim " << i;
    order.push_back(lease->job_id);
    ASSERT_TRUE(store->commit(*lease, {lease->chunk_index, "r0", 1, "x"}, {}).committed);
  }
  EXPECT_EQ(order, (std::vector<std::string>{"a1", "b1", "a2", "b1", "a3", "a1", "a2", "a3"}))
      << "tenant B's one job gets every other chunk while tenant A's three jobs share the rest";
  EXPECT_FALSE(store->claim("r0", kLongTtl).has_value());
}

TEST_P(LeaseContract, AnInsertUnderATakenIdStoresNothingAndIsRetriedUnderAFreshOne) {
  Pod* store = &pod(0);
  store->insert_job_once(make_job("j-live", 0));
  store->insert_job_once(make_job("j-dropped", 0));
  store->drop_job("j-dropped", "test");
  for (const char* taken : {"j-live", "j-dropped"}) {
    StoredJob again = make_job(taken, 0);
    again.request = "another request";
    EXPECT_EQ(store->insert_job_once(again).refused, server::InsertOutcome::Refusal::IdTaken) << taken;
  }
  EXPECT_EQ(store->load_job("j-live")->request, "request of j-live") << "the job that had the id is untouched";

  std::vector<std::string> ids = {"j-live", "j-dropped", "j-fresh"};  // the first two collide (injected)
  size_t next = 0;
  StoredJob job = make_job("", 0);
  const auto outcome = server::insert_with_fresh_ids(*store, job, {}, [&] { return ids.at(next++); });
  EXPECT_TRUE(outcome.inserted);
  EXPECT_EQ(outcome.job_id, "j-fresh");
  EXPECT_EQ(next, 3u) << "one attempt per id";
  EXPECT_EQ(store->load_job("j-fresh")->request, job.request);
}

TEST_P(LeaseContract, AffinityPrefersTheReplicaThatRanThePreviousChunk) {
  Pod* store = &pod(0);
  store->insert_job(make_job("x", 1));
  store->insert_job(make_job("y", 2));
  store->commit_chunk("x", {0, "r2", 1, "x0"});
  store->commit_chunk("y", {0, "r1", 1, "y0"});
  // Same priority and service: x is first in order, but r1 holds y's state.
  auto r1 = store->claim("r1", kLongTtl);
  ASSERT_TRUE(r1.has_value());
  EXPECT_EQ(r1->job_id, "y");
  EXPECT_FALSE(r1->handoff);
  EXPECT_EQ(r1->previous_replica, "r1");
  auto r3 = store->claim("r3", kLongTtl);
  ASSERT_TRUE(r3.has_value());
  EXPECT_EQ(r3->job_id, "x");
  EXPECT_TRUE(r3->handoff);
  EXPECT_EQ(r3->previous_replica, "r2");
  EXPECT_EQ(store->load_job("x")->handoffs, 1);
  EXPECT_EQ(store->load_job("y")->handoffs, 0);

  // Never across priorities: a higher-priority job goes first even to a replica with affinity elsewhere.
  store->insert_job(make_job("z", 3, 1));
  store->commit_chunk("z", {0, "r2", 1, "z0"});
  ASSERT_TRUE(store->commit(*r1, {1, "r1", 1, "y1"}, {}).committed);
  EXPECT_EQ(store->claim("r1", kLongTtl)->job_id, "z");
}

TEST_P(LeaseContract, ConcurrentClaimsFromManyPodsGetDistinctJobs) {
  constexpr int kJobs = 40, kPods = 4, kThreadsPerPod = 3;
  std::vector<Pod*> pods;
  for (int p = 0; p < kPods; ++p) pods.push_back(&pod(p));
  for (int i = 0; i < kJobs; ++i) pods[0]->insert_job(make_job("j-" + std::to_string(i), static_cast<uint64_t>(i)));
  std::mutex mu;
  std::vector<std::string> claimed;
  std::vector<std::thread> threads;
  for (int p = 0; p < kPods; ++p) {
    for (int t = 0; t < kThreadsPerPod; ++t) {
      threads.emplace_back([&, p, t] {
        Pod& store = *pods[static_cast<size_t>(p)];
        const std::string replica = "pod" + std::to_string(p) + "/r" + std::to_string(t);
        // A claim may come back empty while others hold every ready row locked: stop once nothing is ready.
        while (true) {
          auto lease = store.claim(replica, kLongTtl);
          if (lease) {
            std::lock_guard<std::mutex> lock(mu);
            claimed.push_back(lease->job_id);
          } else if (store.queue_depth() == 0) {
            break;
          }
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(claimed.size(), static_cast<size_t>(kJobs));
  EXPECT_EQ(std::set<std::string>(claimed.begin(), claimed.end()).size(), claimed.size()) << "a job claimed twice";
}

TEST_P(LeaseContract, AnExpiredLeaseIsTakenOverAndTheStaleHolderIsFenced) {
  Pod* pod_a = &pod(0);
  Pod* pod_b = &pod(1);
  pod_a->insert_job(make_job("j-1", 1));
  auto dead = pod_a->claim("a/r0", kExpired);  // its holder "dies": the lease is never renewed
  ASSERT_TRUE(dead.has_value());
  auto taken = pod_b->claim("b/r0", kLongTtl);
  ASSERT_TRUE(taken.has_value()) << "the expired lease was not taken over";
  EXPECT_EQ(taken->job_id, "j-1");
  EXPECT_EQ(taken->chunk_index, 0);
  EXPECT_GT(taken->token, dead->token);
  EXPECT_TRUE(taken->takeover);
  EXPECT_EQ(pod_b->load_job("j-1")->retries, 1) << "a takeover counts as a retry";

  EXPECT_FALSE(pod_a->renew(*dead, kLongTtl).held);
  EXPECT_FALSE(pod_a->commit(*dead, {0, "a/r0", 1, "stale"}, {"stale event"}).committed);
  EXPECT_FALSE(pod_a->release(*dead));
  EXPECT_TRUE(pod_b->renew(*taken, kLongTtl).held);
  const auto committed = pod_b->commit(*taken, {0, "b/r0", 2, "fresh"}, {"chunk 0 finished"});
  EXPECT_TRUE(committed.committed);
  EXPECT_FALSE(pod_b->commit(*taken, {0, "b/r0", 2, "again"}, {}).committed) << "a lease commits once";
  EXPECT_FALSE(pod_b->renew(*taken, kLongTtl).held) << "the commit ended the lease";

  const auto chunks = pod_a->load_chunks("j-1");
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].bytes, "fresh");
  EXPECT_EQ(chunks[0].replica, "b/r0");
  EXPECT_EQ(pod_a->load_job("j-1")->chunks_done, 1);
  const auto events = pod_a->load_events("j-1");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].data, "chunk 0 finished");
  EXPECT_EQ(committed.sequences, (std::vector<uint64_t>{events[0].sequence}));
}

TEST_P(LeaseContract, ReleaseGivesTheChunkBackWithoutARetry) {
  Pod* store = &pod(0);
  store->insert_job(make_job("j-1", 1));
  auto first = store->claim("r1", kLongTtl);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(store->queue_depth(), 0);
  EXPECT_TRUE(store->release(*first));
  EXPECT_EQ(store->queue_depth(), 1);
  auto second = store->claim("r2", kLongTtl);
  ASSERT_TRUE(second.has_value());
  EXPECT_FALSE(second->takeover);
  EXPECT_GT(second->token, first->token);
  EXPECT_EQ(store->load_job("j-1")->retries, 0);
  EXPECT_FALSE(store->release(*first)) << "an old token releases nothing";
}

TEST_P(LeaseContract, CancelFromAnyPodReachesTheHolderAtItsRenew) {
  Pod* pod_a = &pod(0);
  Pod* pod_b = &pod(1);
  pod_a->insert_job(make_job("running", 1));
  pod_a->insert_job(make_job("queued", 2));
  StoredJob finished = make_job("finished", 3);
  finished.state = "succeeded";
  pod_a->insert_job(finished);
  auto lease = pod_a->claim("a/r0", kLongTtl);
  ASSERT_EQ(lease->job_id, "running");
  EXPECT_FALSE(pod_a->renew(*lease, kLongTtl).cancel_requested);

  EXPECT_EQ(pod_b->request_cancel("running", "alice"), server::CancelState::Running);
  const auto renewal = pod_a->renew(*lease, kLongTtl);
  EXPECT_TRUE(renewal.held);
  EXPECT_TRUE(renewal.cancel_requested);

  EXPECT_EQ(pod_b->request_cancel("queued", "alice"), server::CancelState::Idle);
  EXPECT_FALSE(pod_b->claim("b/r0", kLongTtl).has_value()) << "a job being cancelled is not claimed";
  EXPECT_EQ(pod_b->request_cancel("finished", "alice"), server::CancelState::AlreadyFinished);
  EXPECT_EQ(pod_b->request_cancel("running", "mallory"), server::CancelState::Unknown);
  EXPECT_EQ(pod_b->request_cancel("j-none", "alice"), server::CancelState::Unknown);
}

TEST_P(LeaseContract, AnIdempotentInsertFromTwoPodsStoresOneJob) {
  Pod* pod_a = &pod(0);
  Pod* pod_b = &pod(1);
  constexpr int kRounds = 20;
  for (int round = 0; round < kRounds; ++round) {
    const std::string key = "key-" + std::to_string(round);
    server::InsertOutcome outcome_a, outcome_b;
    std::thread a([&] {
      StoredJob j = make_job("a-" + std::to_string(round), 0);
      j.idempotency_key = key;
      j.fingerprint = 1;
      j.fingerprint_v2 = "sha256:a";
      outcome_a = pod_a->insert_job_once(j);
    });
    std::thread b([&] {
      StoredJob j = make_job("b-" + std::to_string(round), 0);
      j.idempotency_key = key;
      j.fingerprint = 2;
      j.fingerprint_v2 = "sha256:b";
      outcome_b = pod_b->insert_job_once(j);
    });
    a.join();
    b.join();
    EXPECT_NE(outcome_a.inserted, outcome_b.inserted) << "round " << round;
    EXPECT_EQ(outcome_a.job_id, outcome_b.job_id);
    EXPECT_EQ(outcome_a.fingerprint, outcome_b.fingerprint) << "both see the stored job's fingerprint";
    EXPECT_EQ(outcome_a.fingerprint_v2, outcome_b.fingerprint_v2);
    EXPECT_EQ(outcome_a.fingerprint_v2, outcome_a.fingerprint == 1 ? "sha256:a" : "sha256:b");
  }
  EXPECT_EQ(pod_a->load_jobs().size(), static_cast<size_t>(kRounds));
  // Without a key every insert stores a job; the store allocates the submission order.
  const auto one = pod_a->insert_job_once(make_job("n-1", 0));
  const auto two = pod_b->insert_job_once(make_job("n-2", 0));
  EXPECT_TRUE(one.inserted && two.inserted);
  EXPECT_GT(two.order, one.order);
  // Another owner may use the same key.
  StoredJob bob = make_job("bob-1", 0);
  bob.owner = "bob";
  bob.idempotency_key = "key-0";
  EXPECT_TRUE(pod_a->insert_job_once(bob).inserted);
}

TEST_P(LeaseContract, TheQueueLimitHoldsForInsertsRacingFromManyPods) {
  constexpr int kPods = 4, kPerPod = 10, kLimit = 7;
  std::vector<Pod*> pods;
  for (int p = 0; p < kPods; ++p) pods.push_back(&pod(p));
  std::atomic<int> inserted{0}, refused{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < kPods; ++p) {
    threads.emplace_back([&, p] {
      for (int i = 0; i < kPerPod; ++i) {
        server::AdmissionLimits limits;
        limits.max_unfinished = kLimit;
        const auto outcome = pods[static_cast<size_t>(p)]->insert_job_once(
            make_job("race-" + std::to_string(p) + "-" + std::to_string(i), 0), limits);
        if (outcome.inserted) ++inserted;
        if (outcome.refused == server::InsertOutcome::Refusal::QueueFull) ++refused;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(inserted.load(), kLimit) << "a check and its insert are one step across pods";
  EXPECT_EQ(refused.load(), kPods * kPerPod - kLimit);
  // Per client, and a key naming a stored job returns it even when the queue is full.
  server::AdmissionLimits per_client;
  per_client.max_for_client = 100;
  StoredJob other = make_job("other-client", 0);
  other.client = "somebody-else";
  EXPECT_TRUE(pods[0]->insert_job_once(other, per_client).inserted);
  per_client.max_for_client = 1;
  StoredJob second = make_job("other-client-2", 0);
  second.client = "somebody-else";
  EXPECT_EQ(pods[1]->insert_job_once(second, per_client).refused, server::InsertOutcome::Refusal::ClientQueueFull);
  StoredJob keyed = make_job("keyed", 0);
  keyed.idempotency_key = "k";
  ASSERT_TRUE(pods[0]->insert_job_once(keyed).inserted);
  server::AdmissionLimits full;
  full.max_unfinished = 1;
  StoredJob again = make_job("keyed-again", 0);
  again.idempotency_key = "k";
  const auto dedup = pods[1]->insert_job_once(again, full);
  EXPECT_FALSE(dedup.inserted);
  EXPECT_EQ(dedup.job_id, "keyed");
}

TEST_P(LeaseContract, TheStoreAllocatesOrderAndFairShareStartAcrossPods) {
  Pod* pod_a = &pod(0);
  Pod* pod_b = &pod(1);
  const auto first = pod_a->insert_job_once(make_job("a", 99, 0, 42));
  EXPECT_EQ(first.vbase, 0) << "no unfinished job: service starts at 0 (the caller's 42 is ignored)";
  auto lease = pod_a->claim("a/r0", kLongTtl);
  ASSERT_TRUE(pod_a->commit(*lease, {0, "a/r0", 1, "a0"}, {}).committed);
  lease = pod_a->claim("a/r0", kLongTtl);
  ASSERT_TRUE(pod_a->commit(*lease, {1, "a/r0", 1, "a1"}, {}).committed);
  const auto second = pod_b->insert_job_once(make_job("b", 0));
  EXPECT_EQ(second.vbase, 2) << "a new job starts at the least attained service of the unfinished ones";
  EXPECT_GT(second.order, first.order);
  StoredJob a = *pod_b->load_job("a");
  a.state = "succeeded";
  pod_b->update_job(a);
  EXPECT_EQ(pod_a->insert_job_once(make_job("c", 0)).vbase, 2) << "b (service 2) is the only unfinished job";
}

TEST_P(LeaseContract, AdmissionCountsAndQueueDepthSpanEveryPod) {
  Pod* pod_a = &pod(0);
  Pod* pod_b = &pod(1);
  for (int i = 0; i < 3; ++i) pod_a->insert_job(make_job("alice-" + std::to_string(i), static_cast<uint64_t>(i)));
  StoredJob bob = make_job("bob-0", 10);
  bob.client = "bob";
  pod_b->insert_job(bob);
  StoredJob finished = make_job("alice-done", 11);
  finished.state = "succeeded";
  pod_b->insert_job(finished);

  const auto counts = pod_b->admission_counts("alice");
  EXPECT_EQ(counts.unfinished, 4);
  EXPECT_EQ(counts.unfinished_for_client, 3);
  EXPECT_EQ(pod_a->admission_counts("carol").unfinished_for_client, 0);
  EXPECT_EQ(pod_a->queue_depth(), 4);
  ASSERT_TRUE(pod_b->claim("b/r0", kLongTtl).has_value());
  EXPECT_EQ(pod_a->queue_depth(), 3) << "a leased job is not waiting";
  EXPECT_EQ(pod_a->admission_counts("alice").unfinished, 4) << "but it is unfinished";
}

INSTANTIATE_TEST_SUITE_P(Stores, LeaseContract, ::testing::Values("memory", "sqlite", "postgresql"),
                         [](const ::testing::TestParamInfo<std::string>& store) { return store.param; });

}  // namespace
}  // namespace skyreels::test
