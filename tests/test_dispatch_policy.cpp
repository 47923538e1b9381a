// The scheduler's decisions as plain functions (server/dispatch_policy.h): no threads, no clocks, no executors.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "server/policy/dispatch_policy.h"

namespace skyreels::server::policy {
namespace {

ReplicaView idle() { return {true, true, 0, false}; }
ReplicaView busy(double remaining) { return {true, false, remaining, false}; }
ReplicaView unhealthy() { return {false, false, 0, false}; }

TEST(DispatchPolicy, OrderIsPriorityThenAttainedServiceThenSubmission) {
  std::vector<JobKey> jobs = {{0, 3, 0}, {1, 9, 1}, {0, 1, 2}, {0, 1, 3}, {-1, 0, 4}};
  std::sort(jobs.begin(), jobs.end(), dispatch_before);
  std::vector<uint64_t> order;
  for (const auto& j : jobs) order.push_back(j.order);
  EXPECT_EQ(order, (std::vector<uint64_t>{1, 2, 3, 0, 4}));
}

TEST(DispatchPolicy, AffinityKeepsAJobOnItsIdleHolder) {
  EXPECT_EQ(choose_replica({1, -1}, {idle(), idle()}, 0.25, true), 1);
}

TEST(DispatchPolicy, ABusyHolderAboutToFinishIsWaitedFor) {
  EXPECT_EQ(choose_replica({0, -1}, {busy(0.1), idle()}, 0.25, true), -1);
  // Longer than a handoff costs: move.
  EXPECT_EQ(choose_replica({0, -1}, {busy(5.0), idle()}, 0.25, true), 1);
  // No estimate yet, or a zero handoff cost: never wait.
  EXPECT_EQ(choose_replica({0, -1}, {busy(0.1), idle()}, 0.25, false), 1);
  EXPECT_EQ(choose_replica({0, -1}, {busy(0.0), idle()}, 0.0, true), 1);
}

TEST(DispatchPolicy, AHandoffPrefersAReplicaNoOtherJobIsAttachedTo) {
  ReplicaView held = idle();
  held.held_by_other_job = true;
  EXPECT_EQ(choose_replica({-1, -1}, {held, idle()}, 0.25, true), 1);
  EXPECT_EQ(choose_replica({-1, -1}, {held, held}, 0.25, true), 0);  // all held: any idle one
}

// Issue 33: an adapter load is a cost, like a handoff.
ReplicaView idle_with(int missing, int resident) {
  ReplicaView v = idle();
  v.missing_adapters = missing;
  v.resident_adapters = resident;
  return v;
}

TEST(DispatchPolicy, AJobWithAdaptersGoesWhereTheyAreResidentThenWhereFewestOthersWouldBeEvicted) {
  const JobPlacement with_adapters{-1, -1, true};
  EXPECT_EQ(choose_replica(with_adapters, {idle_with(1, 1), idle_with(0, 1)}, 0.25, true), 1);
  EXPECT_EQ(choose_replica(with_adapters, {idle_with(2, 0), idle_with(1, 3)}, 0.25, true), 1);  // fewer to load
  EXPECT_EQ(choose_replica(with_adapters, {idle_with(1, 1), idle_with(1, 0)}, 0.25, true), 1);  // keep the others
  // Another job's affinity still comes first, and a job without adapters ignores them.
  ReplicaView held = idle_with(0, 1);
  held.held_by_other_job = true;
  EXPECT_EQ(choose_replica(with_adapters, {held, idle_with(1, 1)}, 0.25, true), 1);
  EXPECT_EQ(choose_replica({-1, -1}, {idle_with(1, 1), idle_with(0, 1)}, 0.25, true), 0);
}

TEST(DispatchPolicy, ABusyHolderIsWaitedForWhileMovingWouldCostTheAdaptersLoadsAsWell) {
  // The holder needs 0.6 s more; a handoff costs 0.25 s, loading one adapter kAdapterLoadSeconds (0.5 s).
  EXPECT_EQ(choose_replica({0, -1, true}, {busy(0.6), idle_with(1, 0)}, 0.25, true), -1);
  EXPECT_EQ(choose_replica({0, -1, true}, {busy(0.6), idle_with(0, 1)}, 0.25, true), 1);  // resident there: move
  EXPECT_EQ(choose_replica({0, -1, false}, {busy(0.6), idle()}, 0.25, true), 1);
}

TEST(DispatchPolicy, AFailedReplicaIsRetriedOnlyWhenItIsTheLastHealthyOne) {
  EXPECT_EQ(choose_replica({0, 0}, {idle(), idle()}, 0.25, true), 1);
  EXPECT_EQ(choose_replica({0, 0}, {idle(), busy(3)}, 0.25, true), -1);  // wait for the other healthy replica
  EXPECT_EQ(choose_replica({0, 0}, {idle(), unhealthy()}, 0.25, true), 0);
  EXPECT_EQ(choose_replica({0, 0}, {idle()}, 0.25, true), 0);
}

TEST(DispatchPolicy, NothingIdleMeansWait) {
  EXPECT_EQ(choose_replica({-1, -1}, {busy(1), unhealthy()}, 0.25, true), -1);
  EXPECT_EQ(choose_replica({-1, -1}, {}, 0.25, true), -1);
}

TEST(DispatchPolicy, QueueEtaSpreadsTheWorkAheadOverHealthyReplicas) {
  EXPECT_DOUBLE_EQ(queue_eta(2.0, 10.0, 2, true), 7.0);
  EXPECT_DOUBLE_EQ(queue_eta(0.0, 0.0, 1, true), 0.0);
  EXPECT_EQ(queue_eta(2.0, 10.0, 2, false), -1);
  EXPECT_EQ(queue_eta(2.0, 10.0, 0, true), -1);
}

TEST(DispatchPolicy, ANewJobStartsAtTheLeastAttainedServiceOfTheActiveJobs) {
  EXPECT_EQ(fair_share_start({5, 2, 9}), 2);
  EXPECT_EQ(fair_share_start({}), 0) << "an idle queue starts from zero";
  // Started there, it goes before the longer-served jobs and after the job it ties with (submission order).
  const JobKey newcomer{0, fair_share_start({5, 2, 9}), 3};
  EXPECT_TRUE(dispatch_before(newcomer, {0, 5, 0}));
  EXPECT_FALSE(dispatch_before(newcomer, {0, 2, 1}));
}

TEST(DispatchPolicy, AFailedChunkIsRetriedAtMostChunkRetriesTimesAndOnlyWithAHealthyReplica) {
  EXPECT_TRUE(should_retry(1, 2, true));
  EXPECT_TRUE(should_retry(2, 2, true));
  EXPECT_FALSE(should_retry(3, 2, true)) << "first try + 2 retries, then the job fails";
  EXPECT_FALSE(should_retry(1, 0, true)) << "--chunk-retries 0";
  EXPECT_FALSE(should_retry(1, 2, false)) << "nowhere to run it";
}

TEST(DispatchPolicy, AChunkWhoseProcessDiedRunsAgainUpToTheTakeoverLimitWhateverItsRetries) {
  EXPECT_TRUE(should_take_over(1, 10));
  EXPECT_TRUE(should_take_over(10, 10)) << "the tenth death is still taken over";
  EXPECT_FALSE(should_take_over(11, 10)) << "a chunk that kills every process running it ends";
  EXPECT_FALSE(should_take_over(1, 0)) << "--chunk-takeover-limit 0: the first death fails the job";
  EXPECT_TRUE(should_take_over(3, 10) && !should_retry(3, 2, true))
      << "three deaths are not three failures: --chunk-retries 2 does not bound them";
}

TEST(DispatchPolicy, ABusyReplicaThatOverranItsEstimateIsAboutToFinish) {
  EXPECT_DOUBLE_EQ(remaining_seconds(3.0, 1.0), 2.0);
  EXPECT_DOUBLE_EQ(remaining_seconds(3.0, 5.0), 0.0);
}

TEST(DispatchPolicy, SecondsPerWorkStartAtTheFirstSampleAndThenMoveAThirdOfTheWay) {
  EXPECT_DOUBLE_EQ(update_seconds_per_work(0, 4.0, 2.0), 2.0);
  EXPECT_DOUBLE_EQ(update_seconds_per_work(2.0, 12.0, 2.0), 0.7 * 2.0 + 0.3 * 6.0);
  EXPECT_DOUBLE_EQ(update_seconds_per_work(2.0, 12.0, 0.0), 2.0) << "a chunk without work says nothing";
}

TEST(DispatchPolicy, TheRetryHintSpreadsTheWorkAheadOverHealthyReplicasAndIsAtLeastASecond) {
  EXPECT_DOUBLE_EQ(retry_after_seconds(10.0, 2, true), 5.0);
  EXPECT_DOUBLE_EQ(retry_after_seconds(10.0, 0, true), 10.0) << "no healthy replica counts as one";
  EXPECT_DOUBLE_EQ(retry_after_seconds(0.5, 1, true), 1.0);
  EXPECT_DOUBLE_EQ(retry_after_seconds(100.0, 1, false), 1.0) << "no estimate yet";
}

}  // namespace
}  // namespace skyreels::server::policy

namespace skyreels::server::policy {
namespace {

TEST(DispatchPolicy, TheClientsAttainedServiceComesAfterPriorityAndBeforeTheJobsOwn) {
  const JobKey busy_client{0, 0, 0, 3 * kServicePerChunk};
  const JobKey idle_client{0, 5, 9, kServicePerChunk};
  EXPECT_TRUE(dispatch_before(idle_client, busy_client)) << "the client that got less goes first";
  const JobKey urgent{1, 9, 9, 9 * kServicePerChunk};
  EXPECT_TRUE(dispatch_before(urgent, idle_client)) << "priority still comes first";
  const JobKey sibling{0, 1, 0, kServicePerChunk};
  EXPECT_TRUE(dispatch_before(sibling, idle_client)) << "within one client's service: the job's own, then age";
}

TEST(DispatchPolicy, AWeightDividesTheChargeOfEachChunkExactly) {
  EXPECT_EQ(charge_chunk(1), kServicePerChunk);
  for (int w = 1; w <= 16; ++w) EXPECT_EQ(charge_chunk(w) * w, kServicePerChunk) << "weight " << w;
  EXPECT_EQ(charge_chunk(0), kServicePerChunk) << "no weight below 1";
  EXPECT_EQ(charge_chunk(1000), kServicePerChunk / kMaxClientWeight);
}

TEST(DispatchPolicy, AClientStartsFromTheActiveClientsLeastServiceUnlessItWasAhead) {
  EXPECT_EQ(client_share_start(-1, {}), 0) << "a first client starts at zero";
  EXPECT_EQ(client_share_start(-1, {7, 4, 9}), 4) << "a new client ties with the least served, no jump ahead";
  EXPECT_EQ(client_share_start(2, {7, 4, 9}), 4) << "time away is not banked";
  EXPECT_EQ(client_share_start(8, {7, 4, 9}), 8) << "a client that was ahead stays ahead";
  EXPECT_EQ(client_share_start(5, {}), 5);
}

}  // namespace
}  // namespace skyreels::server::policy
