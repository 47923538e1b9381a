// The scheduler's decisions as plain functions (server/policy/: dispatch order, placement, fair share, the claim
// order over what a store reports, admission): no threads, no clocks, no executors, no store.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include <string>

#include "server/policy/admission.h"
#include "server/policy/claim_order.h"
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

// A ready job as a store reports it: priority, attained service within the client, the replica of its last chunk.
ReadyJob ready(const std::string& id, int priority, int64_t service, const std::string& previous = "",
               uint64_t order = 0) {
  ReadyJob j;
  j.id = id;
  j.key = {priority, service, order, 0};
  j.previous_replica = previous;
  return j;
}

TEST(ClaimPreference, TheReplicasOwnJobFirstOnlyAmongJobsTiedWithTheFirst) {
  const std::vector<ReadyJob> tied = {ready("a", 5, 2, "r2"), ready("b", 5, 2, "r1"), ready("c", 5, 2),
                                      ready("d", 5, 3, "r1")};
  EXPECT_EQ(claim_preference(tied, "r1"), (std::vector<size_t>{1, 0, 2, 3}));
  EXPECT_EQ(claim_preference(tied, "r3"), (std::vector<size_t>{0, 1, 2, 3}));
  // Affinity never overrides priority or attained service.
  EXPECT_EQ(claim_preference({ready("a", 5, 2, "r2"), ready("b", 3, 2, "r1")}, "r1"), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(claim_preference({ready("a", 5, 2, "r2"), ready("b", 5, 3, "r1")}, "r1"), (std::vector<size_t>{0, 1}));
  std::vector<ReadyJob> wide(6, ready("x", 0, 0, "r2"));
  wide[5].previous_replica = "r1";  // beyond the affinity window
  EXPECT_EQ(claim_preference(wide, "r1")[0], 0u);
  EXPECT_EQ(claim_preference({ready("a", 0, 0)}, ""), (std::vector<size_t>{0}));
}

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

TEST(ClaimOrder, SortsTheReportedJobsThenSkipsThosePassedOverAndThoseLeftBrieflyToAnotherPod) {
  std::vector<ReadyJob> reported = {ready("low", 0, 0, "", 1), ready("high", 1, 9, "", 2), ready("styled", 1, 9, "", 3),
                                    ready("passed", 1, 0, "", 4)};
  reported[2].adapters = {"style"};
  Claimant claimant;
  claimant.replica = "a/r0";
  const std::vector<std::string> none;
  claimant.resident = &none;
  claimant.pass_over = {"passed"};
  claimant.others = {{"b/r0", true, {"style"}}};
  LeftChunks left;
  std::vector<ReadyJob> jobs = reported;
  std::vector<size_t> order = claim_order(jobs, claimant, left, 1000);
  std::vector<std::string> ids;
  for (size_t i : order) ids.push_back(jobs[i].id);
  EXPECT_EQ(ids, (std::vector<std::string>{"high", "low"})) << "passed over, and left to b/r0 which holds its adapter";

  // Left for kLeaveToOtherPodFor from the first claim that left it, then tried like any other job.
  jobs = reported;
  order = claim_order(jobs, claimant, left, 1000 + kLeaveToOtherPodFor.count());
  ids.clear();
  for (size_t i : order) ids.push_back(jobs[i].id);
  EXPECT_EQ(ids, (std::vector<std::string>{"high", "styled", "low"}));
}

TEST(ClaimOrder, AWaitingJobsPositionIsItsPlaceInDispatchOrder) {
  const std::vector<ReadyJob> reported = {ready("a", 0, 5, "", 1), ready("b", 0, 1, "", 2), ready("c", 2, 9, "", 3)};
  EXPECT_EQ(dispatch_position(reported, "c"), 0);
  EXPECT_EQ(dispatch_position(reported, "b"), 1);
  EXPECT_EQ(dispatch_position(reported, "a"), 2);
  EXPECT_EQ(dispatch_position(reported, "running"), -1);
}

TEST(ClaimOrder, OnlyReportsOfOtherPodsCount) {
  const auto others = other_pods("a/r0", {{"a/r1", true, {}}, {"b/r0", false, {}}, {"c/r3", true, {"x"}}});
  ASSERT_EQ(others.size(), 2u);
  EXPECT_EQ(others[0].name, "b/r0");
  EXPECT_EQ(others[1].name, "c/r3");
}

TEST(Admission, TheQueueLimitIsCheckedFirstThenTheClientsThenATakenId) {
  AdmissionFacts facts;
  facts.unfinished = 7;
  facts.unfinished_for_client = 3;
  facts.id_taken = true;
  AdmissionLimits limits{7, 3};
  Admission a = admit(facts, limits, 1);
  EXPECT_EQ(a.refused, Refusal::QueueFull);
  EXPECT_EQ(a.count_at_limit, 7);
  limits.max_unfinished = 0;
  a = admit(facts, limits, 1);
  EXPECT_EQ(a.refused, Refusal::ClientQueueFull);
  EXPECT_EQ(a.count_at_limit, 3);
  limits.max_for_client = 4;
  EXPECT_EQ(admit(facts, limits, 1).refused, Refusal::IdTaken);
  facts.id_taken = false;
  EXPECT_EQ(admit(facts, limits, 1).refused, Refusal::None);
}

TEST(Admission, AClientThatBecomesActiveStartsAtTheLeastActiveShareAndAnActiveOneKeepsItsOwn) {
  AdmissionFacts returning;
  returning.client_service = 10;
  returning.least_active_service = 50;
  Admission a = admit(returning, {}, 1);
  EXPECT_EQ(a.client_service, 50) << "no banked time for a client that was away";
  EXPECT_EQ(a.vbase, 0) << "its first job starts its own share at 0";
  returning.client_service = 80;
  EXPECT_EQ(admit(returning, {}, 1).client_service, 80) << "one that was ahead stays ahead";
  AdmissionFacts newcomer;
  EXPECT_EQ(admit(newcomer, {}, 1).client_service, 0);
  AdmissionFacts active;
  active.client_service = 10;
  active.least_active_service = 50;
  active.least_client_fair_key = 4;
  a = admit(active, {}, 1);
  EXPECT_EQ(a.client_service, 10) << "an active client keeps its service";
  EXPECT_EQ(a.vbase, 4) << "a new job starts at the least attained service of the client's unfinished ones";
  EXPECT_EQ(admit(active, {}, 0).client_weight, 1);
  EXPECT_EQ(admit(active, {}, 1000).client_weight, kMaxClientWeight);
}

}  // namespace
}  // namespace skyreels::server::policy
