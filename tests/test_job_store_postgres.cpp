// Issue 14, the PostgreSQL job store, against a real PostgreSQL 15 started for each test (tests/pg_fixture.h): the
// JobStore seam's contract as SQLite keeps it (fields, atomic chunk commits, tombstones, order, large blobs), schema
// migration (empty database, pods migrating together, a newer schema refused), a server restart mid-use (calls fail
// cleanly, then reconnect), and what only a shared store does with leases (placement across pods by the replicas'
// reports, a commit refused by the database, NOTIFY). The lease contract every store keeps (claim order, affinity,
// SKIP LOCKED under concurrent claims, takeover with fencing, release, cancel, admission) is test_lease_contract.cpp.
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
#include "tests/stored_jobs.h"

namespace skyreels::test {
namespace {

using server::ChunkLease;
using server::PostgresJobStore;
using server::PostgresLeaseStore;
using server::StoredChunk;
using server::StoredEvent;
using server::StoredJob;
using server::StoreError;
using server::policy::kLeaveToOtherPodFor;
using namespace std::chrono_literals;

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
  // A pod's store: its leases, holding its records (records()).
  std::unique_ptr<PostgresLeaseStore> open(const std::string& database = "postgres") {
    return std::make_unique<PostgresLeaseStore>(std::make_unique<PostgresJobStore>(pg.url(database)));
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
  store->records().insert_job(j);

  j.state = "failed";
  j.error_kind = "internal";
  j.error = "bad \xff\xfe bytes";
  j.started_ms = 2000;
  j.finished_ms = 3000;
  j.retries = 2;
  j.handoffs = 1;
  j.chunks_done = 5;  // not written by update_job
  store->records().update_job(j);

  const auto jobs = store->records().load_jobs();
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
  EXPECT_FALSE(store->records().load_jobs().empty());
  EXPECT_EQ(store->load_job("j-1")->request, j.request);
  EXPECT_FALSE(store->load_job("j-none").has_value());
}

TEST_F(PostgresStore, JobsLoadInSubmissionOrder) {
  auto store = open();
  for (uint64_t order : {3, 1, 2}) store->records().insert_job(make_job("j-" + std::to_string(order), order));
  std::vector<std::string> ids;
  for (const StoredJob& j : store->records().load_jobs()) ids.push_back(j.id);
  EXPECT_EQ(ids, (std::vector<std::string>{"j-1", "j-2", "j-3"}));
}

TEST_F(PostgresStore, CommitChunkStoresTheResultWithChunksDone) {
  auto store = open();
  store->records().insert_job(make_job("j-1", 1));
  store->records().commit_chunk("j-1", {0, "cpu:0", 1, "latents 0"});
  store->records().commit_chunk("j-1", {1, "cpu:1", 2, "latents 1"});
  EXPECT_EQ(store->records().load_jobs()[0].chunks_done, 2);
  const auto chunks = store->records().load_chunks("j-1");
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[1].index, 1);
  EXPECT_EQ(chunks[1].replica, "cpu:1");
  EXPECT_EQ(chunks[1].attempts, 2);
  EXPECT_EQ(chunks[1].bytes, "latents 1");
  EXPECT_EQ(store->records().load_chunk_bytes("j-1", 0), std::optional<std::string>("latents 0"));
  EXPECT_FALSE(store->records().load_chunk_bytes("j-1", 2).has_value());
}

TEST_F(PostgresStore, AChunkCommitThatFailsStoresNeitherResultNorChunksDone) {
  auto store = open();
  store->records().insert_job(make_job("j-1", 1));
  store->records().commit_chunk("j-1", {0, "cpu:0", 1, "latents 0"});
  // A real fault inside the transaction, after chunks_done was updated: the chunk's INSERT raises.
  pg.sql("CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'disk full (test)';"
         " END$$; CREATE TRIGGER refuse BEFORE INSERT ON chunks FOR EACH ROW EXECUTE FUNCTION refuse()");
  const std::string error = store_error_of([&] { store->records().commit_chunk("j-1", {1, "cpu:0", 1, "latents 1"}); });
  EXPECT_TRUE(contains(error, "disk full (test)")) << error;
  EXPECT_EQ(store->records().load_jobs()[0].chunks_done, 1);
  EXPECT_EQ(store->records().load_chunks("j-1").size(), 1u);
  pg.sql("DROP TRIGGER refuse ON chunks");
  store->records().commit_chunk("j-1", {1, "cpu:0", 1, "latents 1"});  // the connection is usable again
  EXPECT_EQ(store->records().load_jobs()[0].chunks_done, 2);
}

TEST_F(PostgresStore, EventsLoadInSequenceOrderAndTheAllocatorStaysAboveThem) {
  auto store = open();
  store->records().insert_job(make_job("j-1", 1));
  store->records().append_event("j-1", {5, "five"});
  store->records().append_event("j-1", {2, "two"});
  const auto events = store->records().load_events("j-1");
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
  store->records().insert_job(make_job("j-1", 1));
  store->records().commit_chunk("j-1", {0, "cpu:0", 1, "latents"});
  store->records().append_event("j-1", {1, "event"});
  store->records().put_segment("j-1", 0, "mp4");
  store->records().drop_job("j-1", "expired (--result-ttl-seconds)");
  EXPECT_TRUE(store->records().load_jobs().empty());
  EXPECT_TRUE(store->records().load_chunks("j-1").empty());
  EXPECT_TRUE(store->records().load_events("j-1").empty());
  EXPECT_FALSE(store->records().load_segment("j-1", 0).has_value());
  EXPECT_EQ(store->records().dropped_reason("j-1", "alice"),
            std::optional<std::string>("expired (--result-ttl-seconds)"));
  EXPECT_FALSE(store->records().dropped_reason("j-1", "mallory").has_value()) << "a tombstone answers its owner only";
  EXPECT_FALSE(store->records().dropped_reason("j-2", "alice").has_value());
  store->records().drop_job("j-unknown", "x");  // nothing to drop: no tombstone either
  EXPECT_FALSE(store->records().dropped_reason("j-unknown", "alice").has_value());
}

TEST_F(PostgresStore, LargeBlobsRoundTripByteForByte) {
  auto store = open();
  StoredJob j = make_job("j-big", 1);
  j.request = binary_bytes(size_t{64} << 20);            // a request with its embeddings, larger than DF-1.3B's
  const std::string latents = binary_bytes(13'056'512);  // one 540P chunk's latents
  store->records().insert_job(j);
  store->records().commit_chunk("j-big", {0, "cuda:0", 1, latents});
  store->records().put_segment("j-big", 0, latents);
  EXPECT_TRUE(store->records().load_jobs()[0].request == j.request);
  EXPECT_TRUE(store->records().load_chunks("j-big")[0].bytes == latents);
  EXPECT_TRUE(store->records().load_chunk_bytes("j-big", 0) == latents);
  EXPECT_TRUE(store->records().load_segment("j-big", 0) == latents);
}

TEST_F(PostgresStore, SegmentsAreStoredPerIndexAndReplaced) {
  auto store = open();
  store->records().insert_job(make_job("j-1", 1));
  store->records().put_segment("j-1", 0, "first");
  store->records().put_segment("j-1", 1, "second");
  store->records().put_segment("j-1", 0, "first again");
  EXPECT_EQ(store->records().load_segment("j-1", 0), std::optional<std::string>("first again"));
  EXPECT_EQ(store->records().load_segment("j-1", 1), std::optional<std::string>("second"));
  EXPECT_FALSE(store->records().load_segment("j-1", 2).has_value());
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
    store->records().insert_job(make_job("j-1", 1));
  }
  EXPECT_EQ(pg.sql("SELECT version FROM skyreels_schema_version", "fresh"),
            std::to_string(PostgresJobStore::kSchemaVersion));
  auto again = open("fresh");  // already current: nothing re-created, the job is still there
  EXPECT_EQ(again->records().load_jobs().size(), 1u);
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
        store->records().insert_job(make_job("j-" + std::to_string(i), static_cast<uint64_t>(i)));
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
  EXPECT_EQ(open("fresh")->records().load_jobs().size(), static_cast<size_t>(kPods));
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
  store->records().insert_job(make_job("j-1", 1));
  pg.restart();  // every connection is cut
  // The next call meets the dead connection: a StoreError, or (when it happened to reconnect) success.
  try {
    store->records().commit_chunk("j-1", {0, "cpu:0", 1, "latents"});
  } catch (const StoreError& e) {
    EXPECT_TRUE(contains(e.what(), pg.url())) << e.what();
  }
  EXPECT_TRUE(eventually([&] { return store->reachable(); })) << "never reconnected";
  store->records().commit_chunk("j-1", {0, "cpu:0", 1, "latents"});
  EXPECT_EQ(store->records().load_jobs()[0].chunks_done, 1);
  EXPECT_EQ(store->records().load_chunks("j-1").size(), 1u);
}

TEST_F(PostgresStore, DuringAnOutageCallsThrowAndReachableIsFalseUntilItIsBack) {
  auto store = open();
  store->records().insert_job(make_job("j-1", 1));
  pg.stop();
  for (int i = 0; i < 5; ++i) {
    const std::string error = store_error_of([&] { store->records().load_jobs(); });
    EXPECT_TRUE(contains(error, "job store " + pg.url())) << error;
  }
  EXPECT_FALSE(store->reachable());
  pg.start();
  EXPECT_TRUE(eventually([&] { return store->reachable(); })) << "never reconnected";
  EXPECT_EQ(store->records().load_jobs().size(), 1u);
}

// ---- leases: what only a store shared by pods does (the lease contract of every store: test_lease_contract.cpp) ----

// Placement across pods (issue 33): a claim leaves a job with adapters to another pod's idle replica that holds them.
TEST_F(PostgresStore, AJobWithAdaptersWaitsBrieflyForAnIdleReplicaOfAnotherPodThatHoldsThem) {
  auto pod_a = open();
  auto pod_b = open();
  const std::vector<std::string> none, style = {"style"};
  // b/r0 holds "style" and is idle: its claim finds nothing yet, and reports it.
  EXPECT_FALSE(pod_b->claim("b/r0", kLongTtl, {}, &style).has_value());
  StoredJob styled = make_job("styled", 1);
  styled.adapters = style;
  pod_a->records().insert_job(styled);
  pod_a->records().insert_job(make_job("plain", 2));
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
  pod_a->records().insert_job(busy);
  auto a1 = pod_a->claim("a/r1", kLongTtl, {}, &none);
  ASSERT_TRUE(a1.has_value());
  EXPECT_EQ(a1->job_id, "styled-while-busy");

  // A report that turns out wrong (the idle holder never takes the job) costs kLeaveToOtherPodFor once, no more.
  EXPECT_FALSE(pod_b->claim("b/r1", kLongTtl, {}, &style).has_value());
  StoredJob left = make_job("left", 4);
  left.adapters = style;
  pod_a->records().insert_job(left);
  EXPECT_FALSE(pod_a->claim("a/r2", kLongTtl, {}, &none).has_value());
  std::this_thread::sleep_for(kLeaveToOtherPodFor + std::chrono::milliseconds(200));
  auto a2 = pod_a->claim("a/r2", kLongTtl, {}, &none);
  ASSERT_TRUE(a2.has_value());
  EXPECT_EQ(a2->job_id, "left");
}

TEST_F(PostgresStore, ALeasedCommitIsAllOrNothingAndKeepsTheLease) {
  auto store = open();
  store->records().insert_job(make_job("j-1", 1));
  auto lease = store->claim("r1", kLongTtl);
  ASSERT_TRUE(lease.has_value());
  pg.sql("CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'disk full (test)';"
         " END$$; CREATE TRIGGER refuse BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION refuse()");
  EXPECT_THROW(store->commit(*lease, {0, "r1", 1, "latents"}, {"finished"}), StoreError);
  EXPECT_EQ(store->load_job("j-1")->chunks_done, 0);
  EXPECT_TRUE(store->records().load_chunks("j-1").empty());
  EXPECT_TRUE(store->renew(*lease, kLongTtl).held);
  pg.sql("DROP TRIGGER refuse ON events");
  EXPECT_TRUE(store->commit(*lease, {0, "r1", 1, "latents"}, {"finished"}).committed);
  EXPECT_EQ(store->load_job("j-1")->chunks_done, 1);
}

TEST_F(PostgresStore, ChangesInOnePodWakeAListenerInAnother) {
  auto pod_a = open();
  auto pod_b = open();
  auto listener = pod_a->listen();
  EXPECT_TRUE(listener->wait(10ms).job_ids.empty()) << "nothing happened yet";
  pod_b->records().insert_job(make_job("j-1", 1));
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
    pod_b->records().update_job(make_job("j-1", 1));
    const auto c = listener->wait(1000ms);
    return std::find(c.job_ids.begin(), c.job_ids.end(), "j-1") != c.job_ids.end();
  })) << "no notification after the restart";
}

}  // namespace
}  // namespace skyreels::test
