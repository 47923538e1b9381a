// The scheduler's decisions as plain functions (server/dispatch_policy.h): no threads, no clocks, no executors.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "server/dispatch_policy.h"

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

}  // namespace
}  // namespace skyreels::server::policy
