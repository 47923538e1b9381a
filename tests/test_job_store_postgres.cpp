// Issue 14, the PostgreSQL job store, against a real PostgreSQL 15 started for each test (tests/pg_fixture.h): the
// JobStore seam's contract as SQLite keeps it (fields, atomic chunk commits, tombstones, order, large blobs), schema
// migration (empty database, pods migrating together, a newer schema refused), a server restart mid-use (calls fail
// cleanly, then reconnect), and the chunk leases several servers share (claim order and affinity, SKIP LOCKED under
// concurrent claims, takeover of an expired lease with fencing, release, cancel, idempotent insert, counts, NOTIFY).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server/store/job_lease.h"
#include "server/store/job_store_postgres.h"
#include "server/store/pg_db.h"
#include "tests/pg_fixture.h"

namespace skyreels::test {
namespace {

using server::ChunkLease;
using server::kLeaveToOtherPodFor;
using server::leave_to_other_pod;
using server::ReplicaReport;
using server::PostgresJobStore;
using server::StoredChunk;
using server::StoredEvent;
using server::StoredJob;
using server::StoreError;
using namespace std::chrono_literals;

constexpr auto kLongTtl = std::chrono::milliseconds(600000);  // never expires within a test
constexpr auto kExpired = std::chrono::milliseconds(0);       // expired as soon as it is granted

StoredJob make_job(const std::string& id, uint64_t order, int priority = 0, int64_t vbase = 0, int64_t chunks = 3) {
  StoredJob j;
  j.id = id;
  j.order = order;
  j.vbase = vbase;
  j.owner = "alice";
  j.client = "alice";
  j.priority = priority;
  j.state = "queued";
  j.error_kind = "none";
  j.created_ms = 1000 + static_cast<int64_t>(order);
  j.chunk_count = chunks;
  j.request = "request of " + id;
  return j;
}

// Every byte value, repeated: NULs and invalid UTF-8 included.
std::string binary_bytes(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + i / 251) & 0xff);
  return s;
}

// The StoreError `call` throws (fails the test when it throws none).
std::string store_error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const StoreError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no StoreError";
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Polls `ok` every 20 ms until it holds or a generous deadline passes.
bool eventually(const std::function<bool()>& ok, std::chrono::seconds deadline = 60s) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (std::chrono::steady_clock::now() < until) {
    if (ok()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return ok();
}

class PostgresStore : public ::testing::Test {
 protected:
  std::unique_ptr<PostgresJobStore> open(const std::string& database = "postgres") {
    return std::make_unique<PostgresJobStore>(pg.url(database));
  }
  PgServer pg;
};

// ---- the seam's contract ----

TEST_F(PostgresStore, EveryFieldRoundTripsAndUpdateLeavesChunksDoneAlone) {
  auto store = open();
  StoredJob j = make_job("j-1", 7, 3, 11, 6);
  j.client = "10.0.0.1:5000";
  j.deadline_ms = 123456789;
  j.idempotency_key = std::string("key\0with nul", 12);
  j.fingerprint = 0xfedcba9876543210ULL;  // above INT64_MAX
  j.fingerprint_v2 = "sha256:00ff";
  j.request = binary_bytes(4096);
  j.adapters = {"style", "subject-2"};
  store->insert_job(j);

  j.state = "failed";
  j.error_kind = "internal";
  j.error = "bad \xff\xfe bytes";
  j.started_ms = 2000;
  j.finished_ms = 3000;
  j.retries = 2;
  j.handoffs = 1;
  j.chunks_done = 5;  // not written by update_job
  store->update_job(j);

  const auto jobs = store->load_jobs();
  ASSERT_EQ(jobs.size(), 1u);
  const StoredJob& got = jobs[0];
  EXPECT_EQ(got.id, "j-1");
  EXPECT_EQ(got.order, 7u);
  EXPECT_EQ(got.vbase, 11);
  EXPECT_EQ(got.owner, "alice");
  EXPECT_EQ(got.fingerprint_v2, "sha256:00ff");
  EXPECT_EQ(store->load_job("j-1", false)->fingerprint_v2, "sha256:00ff") << "also without the request";
  EXPECT_EQ(got.client, "10.0.0.1:5000");
  EXPECT_EQ(got.priority, 3);
  EXPECT_EQ(got.deadline_ms, std::optional<int64_t>(123456789));
  EXPECT_EQ(got.idempotency_key, j.idempotency_key);
  EXPECT_EQ(got.fingerprint, 0xfedcba9876543210ULL);
  EXPECT_EQ(got.state, "failed");
  EXPECT_EQ(got.error_kind, "internal");
  EXPECT_EQ(got.error, j.error);
  EXPECT_EQ(got.created_ms, j.created_ms);
  EXPECT_EQ(got.started_ms, 2000);
  EXPECT_EQ(got.finished_ms, 3000);
  EXPECT_EQ(got.chunk_count, 6);
  EXPECT_EQ(got.chunks_done, 0) << "update_job wrote chunks_done";
  EXPECT_EQ(got.retries, 2);
  EXPECT_EQ(got.handoffs, 1);
  EXPECT_EQ(got.request, j.request);
  EXPECT_EQ(got.adapters, j.adapters);
  EXPECT_FALSE(store->load_jobs().empty());
  EXPECT_EQ(store->load_job("j-1")->request, j.request);
  EXPECT_FALSE(store->load_job("j-none").has_value());
}

TEST_F(PostgresStore, JobsLoadInSubmissionOrder) {
  auto store = open();
  for (uint64_t order : {3, 1, 2}) store->insert_job(make_job("j-" + std::to_string(order), order));
  std::vector<std::string> ids;
  for (const StoredJob& j : store->load_jobs()) ids.push_back(j.id);
  EXPECT_EQ(ids, (std::vector<std::string>{"j-1", "j-2", "j-3"}));
}

TEST_F(PostgresStore, CommitChunkStoresTheResultWithChunksDone) {
  auto store = open();
  store->insert_job(make_job("j-1", 1));
  store->commit_chunk("j-1", {0, "cpu:0", 1, "latents 0"});
  store->commit_chunk("j-1", {1, "cpu:1", 2, "latents 1"});
  EXPECT_EQ(store->load_jobs()[0].chunks_done, 2);
  const auto chunks = store->load_chunks("j-1");
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[1].index, 1);
  EXPECT_EQ(chunks[1].replica, "cpu:1");
  EXPECT_EQ(chunks[1].attempts, 2);
  EXPECT_EQ(chunks[1].bytes, "latents 1");
  EXPECT_EQ(store->load_chunk_bytes("j-1", 0), std::optional<std::string>("latents 0"));
  EXPECT_FALSE(store->load_chunk_bytes("j-1", 2).has_value());
}

TEST_F(PostgresStore, AChunkCommitThatFailsStoresNeitherResultNorChunksDone) {
  auto store = open();
  store->insert_job(make_job("j-1", 1));
  store->commit_chunk("j-1", {0, "cpu:0", 1, "latents 0"});
  // A real fault inside the transaction, after chunks_done was updated: the chunk's INSERT raises.
  pg.sql("CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'disk full (test)';"
         " END$$; CREATE TRIGGER refuse BEFORE INSERT ON chunks FOR EACH ROW EXECUTE FUNCTION refuse()");
  const std::string error = store_error_of([&] { store->commit_chunk("j-1", {1, "cpu:0", 1, "latents 1"}); });
  EXPECT_TRUE(contains(error, "disk full (test)")) << error;
  EXPECT_EQ(store->load_jobs()[0].chunks_done, 1);
  EXPECT_EQ(store->load_chunks("j-1").size(), 1u);
  pg.sql("DROP TRIGGER refuse ON chunks");
  store->commit_chunk("j-1", {1, "cpu:0", 1, "latents 1"});  // the connection is usable again
  EXPECT_EQ(store->load_jobs()[0].chunks_done, 2);
}

TEST_F(PostgresStore, EventsLoadInSequenceOrderAndTheAllocatorStaysAboveThem) {
  auto store = open();
  store->insert_job(make_job("j-1", 1));
  store->append_event("j-1", {5, "five"});
  store->append_event("j-1", {2, "two"});
  const auto events = store->load_events("j-1");
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].sequence, 2u);
  EXPECT_EQ(events[1].data, "five");
  // Numbers the store hands out continue above the highest one stored, whoever chose it.
  EXPECT_EQ(store->append_events("j-1", {"six", "seven"}), (std::vector<uint64_t>{6, 7}));
  EXPECT_EQ(store->reserve_sequences("j-1", 10), 8u);
  EXPECT_EQ(store->append_events("j-1", {"eighteen"}), (std::vector<uint64_t>{18}));
  EXPECT_THROW(store->append_events("j-none", {"x"}), StoreError);
}

TEST_F(PostgresStore, DropKeepsATombstoneForTheOwnerAndRemovesEverythingElse) {
  auto store = open();
  store->insert_job(make_job("j-1", 1));
  store->commit_chunk("j-1", {0, "cpu:0", 1, "latents"});
  store->append_event("j-1", {1, "event"});
  store->put_segment("j-1", 0, "mp4");
  store->drop_job("j-1", "expired (--result-ttl-seconds)");
  EXPECT_TRUE(store->load_jobs().empty());
  EXPECT_TRUE(store->load_chunks("j-1").empty());
  EXPECT_TRUE(store->load_events("j-1").empty());
  EXPECT_FALSE(store->load_segment("j-1", 0).has_value());
  EXPECT_EQ(store->dropped_reason("j-1", "alice"), std::optional<std::string>("expired (--result-ttl-seconds)"));
  EXPECT_FALSE(store->dropped_reason("j-1", "mallory").has_value()) << "a tombstone answers its owner only";
  EXPECT_FALSE(store->dropped_reason("j-2", "alice").has_value());
  store->drop_job("j-unknown", "x");  // nothing to drop: no tombstone either
  EXPECT_FALSE(store->dropped_reason("j-unknown", "alice").has_value());
}

TEST_F(PostgresStore, LargeBlobsRoundTripByteForByte) {
  auto store = open();
  StoredJob j = make_job("j-big", 1);
  j.request = binary_bytes(size_t{64} << 20);            // a request with its embeddings, larger than DF-1.3B's
  const std::string latents = binary_bytes(13'056'512);  // one 540P chunk's latents
  store->insert_job(j);
  store->commit_chunk("j-big", {0, "cuda:0", 1, latents});
  store->put_segment("j-big", 0, latents);
  EXPECT_TRUE(store->load_jobs()[0].request == j.request);
  EXPECT_TRUE(store->load_chunks("j-big")[0].bytes == latents);
  EXPECT_TRUE(store->load_chunk_bytes("j-big", 0) == latents);
  EXPECT_TRUE(store->load_segment("j-big", 0) == latents);
}

TEST_F(PostgresStore, SegmentsAreStoredPerIndexAndReplaced) {
  auto store = open();
  store->insert_job(make_job("j-1", 1));
  store->put_segment("j-1", 0, "first");
  store->put_segment("j-1", 1, "second");
  store->put_segment("j-1", 0, "first again");
  EXPECT_EQ(store->load_segment("j-1", 0), std::optional<std::string>("first again"));
  EXPECT_EQ(store->load_segment("j-1", 1), std::optional<std::string>("second"));
  EXPECT_FALSE(store->load_segment("j-1", 2).has_value());
}

TEST_F(PostgresStore, OpenJobStoreTakesBothSchemesAndNeverShowsThePassword) {
  const std::string with_password = "postgresql://postgres:s3cret@/postgres?host=" + pg.dir();
  auto store = server::open_job_store(with_password);
  EXPECT_TRUE(store->durable());
  EXPECT_FALSE(contains(store->describe(), "s3cret")) << store->describe();
  EXPECT_TRUE(contains(store->describe(), "postgres:***@")) << store->describe();
  auto short_scheme = server::open_job_store("postgres://postgres@/postgres?host=" + pg.dir() + "&password=s3cret");
  EXPECT_FALSE(contains(short_scheme->describe(), "s3cret")) << short_scheme->describe();
  EXPECT_EQ(server::pg::redact_url("postgresql://u:p%40ss@db.example:5432/jobs?sslmode=require"),
            "postgresql://u:***@db.example:5432/jobs?sslmode=require");
  EXPECT_EQ(server::pg::redact_url("postgres://u:pa/ss@db/jobs"), "postgres://u:***@db/jobs");
  EXPECT_EQ(server::pg::redact_url("postgresql:///jobs?host=/run/pg&user=a@b"), "postgresql:///jobs?host=/run/pg&user=a@b");
  EXPECT_EQ(server::pg::redact_url("postgresql://db/jobs?user=u&password=p&sslmode=require"),
            "postgresql://db/jobs?user=u&password=***&sslmode=require");
}

TEST_F(PostgresStore, AnUnreachableStoreIsAStoreErrorNamingItWithoutThePassword) {
  const std::string url = "postgresql://postgres:s3cret@/postgres?host=" + pg.dir() + "/nowhere";
  const std::string error = store_error_of([&] { server::open_job_store(url); });
  EXPECT_TRUE(contains(error, "postgresql://postgres:***@/postgres")) << error;
  EXPECT_TRUE(contains(error, "cannot connect")) << error;
  EXPECT_FALSE(contains(error, "s3cret")) << error;
}

// ---- schema ----

TEST_F(PostgresStore, AnEmptyDatabaseIsMigratedToTheCurrentVersionOnce) {
  pg.create_database("fresh");
  {
    auto store = open("fresh");
    store->insert_job(make_job("j-1", 1));
  }
  EXPECT_EQ(pg.sql("SELECT version FROM skyreels_schema_version", "fresh"),
            std::to_string(PostgresJobStore::kSchemaVersion));
  auto again = open("fresh");  // already current: nothing re-created, the job is still there
  EXPECT_EQ(again->load_jobs().size(), 1u);
  EXPECT_EQ(pg.sql("SELECT count(*) FROM skyreels_schema_version", "fresh"), "1");
}

TEST_F(PostgresStore, PodsMigratingTogetherAgree) {
  pg.create_database("fresh");
  constexpr int kPods = 6;
  std::vector<std::thread> threads;
  std::atomic<int> opened{0};
  std::vector<std::string> errors(kPods);
  for (int i = 0; i < kPods; ++i) {
    threads.emplace_back([&, i] {
      try {
        auto store = open("fresh");
        store->insert_job(make_job("j-" + std::to_string(i), static_cast<uint64_t>(i)));
        ++opened;
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(i)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(opened.load(), kPods);
  EXPECT_EQ(pg.sql("SELECT version FROM skyreels_schema_version", "fresh"),
            std::to_string(PostgresJobStore::kSchemaVersion));
  EXPECT_EQ(open("fresh")->load_jobs().size(), static_cast<size_t>(kPods));
}

TEST_F(PostgresStore, ANewerSchemaIsRefusedNamingTheStore) {
  open();
  pg.sql("UPDATE skyreels_schema_version SET version = 99");
  const std::string error = store_error_of([&] { open(); });
  EXPECT_TRUE(contains(error, pg.url())) << error;
  EXPECT_TRUE(contains(error, "schema version 99 is newer")) << error;
}

TEST_F(PostgresStore, ADatabaseWithAnotherJobsTableIsNotAJobStore) {
  pg.sql("CREATE TABLE jobs(name text)");
  const std::string error = store_error_of([&] { open(); });
  EXPECT_TRUE(contains(error, "not a job store")) << error;
  EXPECT_EQ(pg.sql("SELECT count(*) FROM jobs"), "0");  // left alone
}

// ---- outages ----

TEST_F(PostgresStore, ARestartMidUseFailsAtMostOneCallCleanlyThenReconnects) {
  auto store = open();
  store->insert_job(make_job("j-1", 1));
  pg.restart();  // every connection is cut
  // The next call meets the dead connection: a StoreError, or (when it happened to reconnect) success.
  try {
    store->commit_chunk("j-1", {0, "cpu:0", 1, "latents"});
  } catch (const StoreError& e) {
    EXPECT_TRUE(contains(e.what(), pg.url())) << e.what();
  }
  EXPECT_TRUE(eventually([&] { return store->reachable(); })) << "never reconnected";
  store->commit_chunk("j-1", {0, "cpu:0", 1, "latents"});
  EXPECT_EQ(store->load_jobs()[0].chunks_done, 1);
  EXPECT_EQ(store->load_chunks("j-1").size(), 1u);
}

TEST_F(PostgresStore, DuringAnOutageCallsThrowAndReachableIsFalseUntilItIsBack) {
  auto store = open();
  store->insert_job(make_job("j-1", 1));
  pg.stop();
  for (int i = 0; i < 5; ++i) {
    const std::string error = store_error_of([&] { store->load_jobs(); });
    EXPECT_TRUE(contains(error, "job store " + pg.url())) << error;
  }
  EXPECT_FALSE(store->reachable());
  pg.start();
  EXPECT_TRUE(eventually([&] { return store->reachable(); })) << "never reconnected";
  EXPECT_EQ(store->load_jobs().size(), 1u);
}

// ---- leases: the policy as a pure function ----

TEST(ClaimPreference, TheReplicasOwnJobFirstOnlyAmongJobsTiedWithTheFirst) {
  using server::ClaimCandidate;
  const std::vector<ClaimCandidate> tied = {{5, 2, "r2"}, {5, 2, "r1"}, {5, 2, ""}, {5, 3, "r1"}};
  EXPECT_EQ(server::claim_preference(tied, "r1"), (std::vector<size_t>{1, 0, 2, 3}));
  EXPECT_EQ(server::claim_preference(tied, "r3"), (std::vector<size_t>{0, 1, 2, 3}));
  // Affinity never overrides priority or attained service.
  const std::vector<ClaimCandidate> priority = {{5, 2, "r2"}, {3, 2, "r1"}};
  EXPECT_EQ(server::claim_preference(priority, "r1"), (std::vector<size_t>{0, 1}));
  const std::vector<ClaimCandidate> service = {{5, 2, "r2"}, {5, 3, "r1"}};
  EXPECT_EQ(server::claim_preference(service, "r1"), (std::vector<size_t>{0, 1}));
  std::vector<ClaimCandidate> wide(6, {0, 0, "r2"});
  wide[5].previous_replica = "r1";  // beyond the affinity window
  EXPECT_EQ(server::claim_preference(wide, "r1")[0], 0u);
  EXPECT_EQ(server::claim_preference({{0, 0, ""}}, ""), (std::vector<size_t>{0}));
}

// ---- leases on PostgreSQL ----

TEST_F(PostgresStore, ClaimsFollowPriorityThenAttainedServiceThenSubmissionOrder) {
  auto store = open();
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

TEST_F(PostgresStore, AttainedServiceGrowsWithEachCommittedChunk) {
  auto store = open();
  store->insert_job(make_job("a", 1));
  store->insert_job(make_job("b", 2));
  auto first = store->claim("r1", kLongTtl);
  ASSERT_EQ(first->job_id, "a");
  ASSERT_TRUE(store->commit(*first, {0, "r1", 1, "a0"}, {}).committed);
  // a has run one chunk, b none: b goes first even for the replica that holds a's state (service beats affinity),
  // so jobs interleave at chunk boundaries.
  EXPECT_EQ(store->claim("r1", kLongTtl)->job_id, "b");
}

TEST_F(PostgresStore, ClaimsShareTheReplicasBetweenClientsBeforeJobs) {
  auto store = open();
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

TEST_F(PostgresStore, AnInsertUnderATakenIdStoresNothingAndIsRetriedUnderAFreshOne) {
  auto store = open();
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

TEST_F(PostgresStore, AffinityPrefersTheReplicaThatRanThePreviousChunk) {
  auto store = open();
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

// Placement across pods (issue 33): the pure rule a claim applies to a job with adapters.
TEST(LeaveToOtherPod, AJobWithAdaptersIsLeftOnlyToAnIdleReplicaThePolicyPrefers) {
  const std::vector<std::string> none;
  const std::vector<std::string> style = {"style"};
  const std::vector<ReplicaReport> holder_idle = {{"b/r0", true, {"style"}}};
  const std::vector<ReplicaReport> holder_busy = {{"b/r0", false, {"style"}}};
  EXPECT_TRUE(leave_to_other_pod(style, "", "a/r0", none, holder_idle)) << "it holds the adapter, the claimant not";
  EXPECT_FALSE(leave_to_other_pod(style, "", "a/r0", none, holder_busy)) << "a busy holder is not waited for";
  EXPECT_FALSE(leave_to_other_pod(style, "", "a/r0", style, holder_idle)) << "a tie stays with the claimant";
  EXPECT_FALSE(leave_to_other_pod(none, "", "a/r0", none, holder_idle)) << "a job without adapters: the order decides";
  EXPECT_FALSE(leave_to_other_pod(style, "", "a/r0", none, {})) << "nobody else reported";
  // Another pod's idle replica that ran the job's previous chunk keeps it, adapters or not.
  EXPECT_TRUE(leave_to_other_pod(style, "b/r0", "a/r0", style, {{"b/r0", true, {}}}));
  EXPECT_FALSE(leave_to_other_pod(style, "a/r0", "a/r0", none, holder_idle)) << "the claimant ran it: it keeps it";
  // Of two candidates that both miss it, the one that would evict fewer of its own adapters.
  EXPECT_TRUE(leave_to_other_pod(style, "", "a/r0", {"subject"}, {{"b/r0", true, {}}}));
  EXPECT_FALSE(leave_to_other_pod(style, "", "a/r0", none, {{"b/r0", true, {"subject"}}}));
}

TEST_F(PostgresStore, AJobWithAdaptersWaitsBrieflyForAnIdleReplicaOfAnotherPodThatHoldsThem) {
  auto pod_a = open();
  auto pod_b = open();
  const std::vector<std::string> none, style = {"style"};
  // b/r0 holds "style" and is idle: its claim finds nothing yet, and reports it.
  EXPECT_FALSE(pod_b->claim("b/r0", kLongTtl, {}, &style).has_value());
  StoredJob styled = make_job("styled", 1);
  styled.adapters = style;
  pod_a->insert_job(styled);
  pod_a->insert_job(make_job("plain", 2));
  // a/r0 serves adapters but holds none: it takes the plain job, although the styled one is first in order.
  auto a0 = pod_a->claim("a/r0", kLongTtl, {}, &none);
  ASSERT_TRUE(a0.has_value());
  EXPECT_EQ(a0->job_id, "plain");
  auto b0 = pod_b->claim("b/r0", kLongTtl, {}, &style);
  ASSERT_TRUE(b0.has_value());
  EXPECT_EQ(b0->job_id, "styled") << "the replica that holds its adapter runs it";

  // The holder is busy now: a styled job is not kept waiting for it.
  StoredJob busy = make_job("styled-while-busy", 3);
  busy.adapters = style;
  pod_a->insert_job(busy);
  auto a1 = pod_a->claim("a/r1", kLongTtl, {}, &none);
  ASSERT_TRUE(a1.has_value());
  EXPECT_EQ(a1->job_id, "styled-while-busy");

  // A report that turns out wrong (the idle holder never takes the job) costs kLeaveToOtherPodFor once, no more.
  EXPECT_FALSE(pod_b->claim("b/r1", kLongTtl, {}, &style).has_value());
  StoredJob left = make_job("left", 4);
  left.adapters = style;
  pod_a->insert_job(left);
  EXPECT_FALSE(pod_a->claim("a/r2", kLongTtl, {}, &none).has_value());
  std::this_thread::sleep_for(kLeaveToOtherPodFor + std::chrono::milliseconds(200));
  auto a2 = pod_a->claim("a/r2", kLongTtl, {}, &none);
  ASSERT_TRUE(a2.has_value());
  EXPECT_EQ(a2->job_id, "left");
}

TEST_F(PostgresStore, ConcurrentClaimsFromManyPodsGetDistinctJobs) {
  constexpr int kJobs = 40, kPods = 4, kThreadsPerPod = 3;
  std::vector<std::unique_ptr<PostgresJobStore>> pods;
  for (int p = 0; p < kPods; ++p) pods.push_back(open());
  for (int i = 0; i < kJobs; ++i) pods[0]->insert_job(make_job("j-" + std::to_string(i), static_cast<uint64_t>(i)));
  std::mutex mu;
  std::vector<std::string> claimed;
  std::vector<std::thread> threads;
  for (int p = 0; p < kPods; ++p) {
    for (int t = 0; t < kThreadsPerPod; ++t) {
      threads.emplace_back([&, p, t] {
        PostgresJobStore& store = *pods[static_cast<size_t>(p)];
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

TEST_F(PostgresStore, AnExpiredLeaseIsTakenOverAndTheStaleHolderIsFenced) {
  auto pod_a = open();
  auto pod_b = open();
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

TEST_F(PostgresStore, ALeasedCommitIsAllOrNothingAndKeepsTheLease) {
  auto store = open();
  store->insert_job(make_job("j-1", 1));
  auto lease = store->claim("r1", kLongTtl);
  ASSERT_TRUE(lease.has_value());
  pg.sql("CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'disk full (test)';"
         " END$$; CREATE TRIGGER refuse BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION refuse()");
  EXPECT_THROW(store->commit(*lease, {0, "r1", 1, "latents"}, {"finished"}), StoreError);
  EXPECT_EQ(store->load_job("j-1")->chunks_done, 0);
  EXPECT_TRUE(store->load_chunks("j-1").empty());
  EXPECT_TRUE(store->renew(*lease, kLongTtl).held);
  pg.sql("DROP TRIGGER refuse ON events");
  EXPECT_TRUE(store->commit(*lease, {0, "r1", 1, "latents"}, {"finished"}).committed);
  EXPECT_EQ(store->load_job("j-1")->chunks_done, 1);
}

TEST_F(PostgresStore, ReleaseGivesTheChunkBackWithoutARetry) {
  auto store = open();
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

TEST_F(PostgresStore, CancelFromAnyPodReachesTheHolderAtItsRenew) {
  auto pod_a = open();
  auto pod_b = open();
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

TEST_F(PostgresStore, AnIdempotentInsertFromTwoPodsStoresOneJob) {
  auto pod_a = open();
  auto pod_b = open();
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

TEST_F(PostgresStore, TheQueueLimitHoldsForInsertsRacingFromManyPods) {
  constexpr int kPods = 4, kPerPod = 10, kLimit = 7;
  std::vector<std::unique_ptr<server::PostgresJobStore>> pods;
  for (int p = 0; p < kPods; ++p) pods.push_back(open());
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

TEST_F(PostgresStore, TheStoreAllocatesOrderAndFairShareStartAcrossPods) {
  auto pod_a = open();
  auto pod_b = open();
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

TEST_F(PostgresStore, AdmissionCountsAndQueueDepthSpanEveryPod) {
  auto pod_a = open();
  auto pod_b = open();
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

TEST_F(PostgresStore, ChangesInOnePodWakeAListenerInAnother) {
  auto pod_a = open();
  auto pod_b = open();
  auto listener = pod_a->listen();
  EXPECT_TRUE(listener->wait(10ms).job_ids.empty()) << "nothing happened yet";
  pod_b->insert_job(make_job("j-1", 1));
  const auto changes = listener->wait(60000ms);
  ASSERT_FALSE(changes.job_ids.empty()) << "no notification";
  EXPECT_EQ(changes.job_ids[0], "j-1");

  // A lost LISTEN connection is re-made, and says that changes may have been missed.
  pg.restart();
  bool missed = false;
  ASSERT_TRUE(eventually([&] {
    const auto c = listener->wait(100ms);
    missed = missed || c.missed;
    return missed && pod_b->reachable();
  }));
  ASSERT_TRUE(eventually([&] {
    pod_b->update_job(make_job("j-1", 1));
    const auto c = listener->wait(1000ms);
    return std::find(c.job_ids.begin(), c.job_ids.end(), "j-1") != c.job_ids.end();
  })) << "no notification after the restart";
}

}  // namespace
}  // namespace skyreels::test
