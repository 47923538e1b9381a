// The scheduler's decisions as pure functions: which ready job goes first (and where a new job starts in the fair
// share), which replica a job's next chunk runs on (affinity and handoff cost), whether a failed chunk runs again,
// and the time estimates (queue ETA, retry hint, seconds per unit of work). No threads, no clocks, no locks: a job
// queue passes in what it knows (tests/test_dispatch_policy.cpp checks them as plain functions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace skyreels::server::policy {

// What the order of ready jobs depends on.
struct JobKey {
  int priority = 0;      // higher first
  int64_t fair_key = 0;  // the job's attained service within its client (vbase + chunks run): fewer first
  uint64_t order = 0;    // submission order: earlier first
  int64_t client_service = 0;  // its client's attained service (see charge_chunk): less first, after priority
};

// True when `a` is dispatched before `b`: priority, then the least attained service of the job's client (API key,
// else peer address), then the least attained service of the job within its client, then submission order. A tenant
// with many jobs therefore gets its share of the replicas, not one share per job.
bool dispatch_before(const JobKey& a, const JobKey& b);

// Where a new job starts in its client's share (its JobKey::fair_key before any chunk): the least attained service
// among the client's active jobs, 0 when there is none. It then neither jumps ahead of them nor waits for the
// service they had.
int64_t fair_share_start(const std::vector<int64_t>& active_fair_keys);

// Client shares. A client's service grows by charge_chunk(weight) per chunk run for it: weight N (the key file's
// `weight=N`, 1 by default) buys N times the chunks of a weight-1 client while both wait. The unit divides evenly by
// every weight up to 16, so equal weights tie exactly.
inline constexpr int64_t kServicePerChunk = 720720;
inline constexpr int kMaxClientWeight = 100;
int64_t charge_chunk(int weight);  // weight clamped to [1, kMaxClientWeight]
// The service a client starts from when it becomes active (it had no unfinished job): its own service when it has
// one, but never below the least service among the clients that are active now (a client that was away does not
// bank the time it was away; one that was ahead stays ahead). `own` < 0: the client has no service on record.
int64_t client_share_start(int64_t own, const std::vector<int64_t>& active_client_services);

struct ReplicaView {
  bool healthy = false;
  bool idle = false;               // loaded, healthy and not busy
  double remaining_seconds = 0;    // busy: expected time until its chunk ends (0 when unknown)
  bool held_by_other_job = false;  // another waiting job ran its previous chunk here (affinity to keep)
  int missing_adapters = 0;        // of the job's adapters, those this replica would have to load first
  int resident_adapters = 0;       // adapters it keeps now (a job's loads may push them out)
};

struct JobPlacement {
  int holder = -1;        // replica that ran the job's previous chunk
  int avoid = -1;         // replica that just failed the job's current chunk
  bool adapters = false;  // the job applies adapters (--lora-dir): where they are resident matters
};

// What loading one adapter onto a replica is assumed to cost, like a handoff: about a rank-128 adapter at DF-1.3B
// width read and placed (bench_adapters: 0.48 s); a model reload is minutes.
inline constexpr double kAdapterLoadSeconds = 0.5;

// The replica for the job's next chunk, or -1 to wait:
//  1. the holder when it is idle (and not the one to avoid): no handoff;
//  2. none when the holder is busy but will be free sooner than what moving costs: `handoff_cost_seconds`, plus
//     kAdapterLoadSeconds for each adapter the best idle replica would load (only with an estimate);
//  3. an idle replica no other waiting job has affinity to, else any idle replica (a handoff); a job with adapters
//     prefers the one missing the fewest of them, then the one keeping the fewest others (their loads evict);
//  4. the replica that just failed only when no other healthy replica exists at all.
int choose_replica(const JobPlacement& job, const std::vector<ReplicaView>& replicas, double handoff_cost_seconds,
                   bool have_estimate);

// Whether a chunk that failed `failed_attempts` times (this one included) runs again: at most `chunk_retries` retries,
// and only while some replica is healthy. (A stop request or a job's own fault ends it before this question.)
bool should_retry(int failed_attempts, int chunk_retries, bool any_healthy_replica);

// Whether a chunk whose lease has been taken over `takeovers` times (this one included: each time the process running
// it died or went silent) runs again. A drain gives a chunk back and is never a takeover.
bool should_take_over(int takeovers, int chunk_takeover_limit);

// The time a busy replica still needs for its chunk: never negative (a chunk that overran is "about to finish").
double remaining_seconds(double expected_seconds, double elapsed_seconds);

// The moving average of seconds per unit of work after one more chunk: the first sample sets it, later ones weigh
// 0.3. `average` 0 means no sample yet; a chunk without work (0) leaves it unchanged.
double update_seconds_per_work(double average, double seconds, double work);

// Estimated seconds until a queued job starts: the soonest a replica is free plus the work queued ahead of it spread
// over the healthy replicas; -1 when unknown (no estimate yet or no healthy replica).
double queue_eta(double soonest_free_seconds, double seconds_ahead, int64_t healthy_replicas, bool have_estimate);

// Retry hint of a refused submission (queue or client share full): about when the next job should end, as the
// unfinished work (`seconds_ahead`: each active job's next chunk) spread over the healthy replicas; at least 1 s, and
// 1 s without an estimate.
double retry_after_seconds(double seconds_ahead, int64_t healthy_replicas, bool have_estimate);

}  // namespace skyreels::server::policy
