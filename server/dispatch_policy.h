// The scheduler's decisions as pure functions: which ready job goes first, which replica a job's next chunk runs on
// (affinity and handoff cost), and when a queued job should start. No threads, no clocks, no locks: the Scheduler
// passes in what it knows (tests/test_dispatch_policy.cpp checks them as plain functions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace skyreels::server::policy {

// What the order of ready jobs depends on.
struct JobKey {
  int priority = 0;      // higher first
  int64_t fair_key = 0;  // attained service (vbase + chunks run): fewer first
  uint64_t order = 0;    // submission order: earlier first
};

// True when `a` is dispatched before `b`: priority, then least attained service, then submission order.
bool dispatch_before(const JobKey& a, const JobKey& b);

struct ReplicaView {
  bool healthy = false;
  bool idle = false;               // loaded, healthy and not busy
  double remaining_seconds = 0;    // busy: expected time until its chunk ends (0 when unknown)
  bool held_by_other_job = false;  // another waiting job ran its previous chunk here (affinity to keep)
};

struct JobPlacement {
  int holder = -1;  // replica that ran the job's previous chunk
  int avoid = -1;   // replica that just failed the job's current chunk
};

// The replica for the job's next chunk, or -1 to wait:
//  1. the holder when it is idle (and not the one to avoid): no handoff;
//  2. none when the holder is busy but will be free sooner than `handoff_cost_seconds` (only with an estimate);
//  3. an idle replica no other waiting job has affinity to, else any idle replica (a handoff);
//  4. the replica that just failed only when no other healthy replica exists at all.
int choose_replica(const JobPlacement& job, const std::vector<ReplicaView>& replicas, double handoff_cost_seconds,
                   bool have_estimate);

// Estimated seconds until a queued job starts: the soonest a replica is free plus the work queued ahead of it spread
// over the healthy replicas; -1 when unknown (no estimate yet or no healthy replica).
double queue_eta(double soonest_free_seconds, double seconds_ahead, int64_t healthy_replicas, bool have_estimate);

}  // namespace skyreels::server::policy
