// Which ready chunk a replica claims, as pure functions over what the stores report: the window of ready jobs a claim
// looks at, the dispatch order within it, the affinity rule, and when a job with adapters is left to a replica of
// another pod. A store only reports (LeaseStore::candidates, LeaseStore::replica_reports) and leases atomically
// (LeaseStore::try_lease); LeaseStore::claim (store/job_lease.cpp) joins the three with these functions.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "server/policy/dispatch_policy.h"

namespace skyreels::server::policy {

// A claim looks at the first kClaimWindow ready jobs, highest priority first and by submission order within a
// priority (the order a store's index gives cheaply), and orders those by dispatch_before.
inline constexpr int64_t kClaimWindow = 4096;
// Affinity looks this far into the leading run of jobs that tie with the first (see claim_preference).
inline constexpr int kAffinityWindow = 4;

// A ready job (unfinished, not being cancelled, a chunk left, no live lease) as a store reports it.
struct ReadyJob {
  std::string id;
  JobKey key;                    // priority, fair_key = vbase + chunks_done, order, client_service
  int client_weight = 1;         // what a chunk charges its client: charge_chunk(client_weight)
  std::string previous_replica;  // ran the job's previous chunk ("" when none)
  std::vector<std::string> adapters;
  int64_t chunks_done = 0;
};

// `ready` sorted by dispatch_before (stable: a store's order breaks exact ties).
void sort_in_dispatch_order(std::vector<ReadyJob>& ready);

// The affinity rule. `in_order` is sorted by dispatch_before; returns the indices to try, best first: within the
// leading run of jobs that tie with in_order[0] on priority and attained service (at most kAffinityWindow), the ones
// whose previous chunk ran on `replica`, then every job in order. Affinity never overrides the order itself, so jobs
// still interleave at chunk boundaries (a long video cannot starve short ones).
std::vector<size_t> claim_preference(const std::vector<ReadyJob>& in_order, const std::string& replica);

// A replica as its last claim reported it (within the lease ttl): idle, and the adapters it holds.
struct ReplicaReport {
  std::string name;  // "<pod>/<replica>"
  bool idle = false;
  std::vector<std::string> adapters;
};
// The reports of replicas of pods other than `replica`'s (a pod places its own replicas itself).
std::vector<ReplicaReport> other_pods(const std::string& replica, const std::vector<ReplicaReport>& reports);

// Whether `replica` (idle, holding `resident`) leaves a ready job that applies `job_adapters` to a replica of another
// pod: choose_replica over the claimant and `others`, the job's holder being the one named `previous_replica`, picks
// one of `others`. A job without adapters is never left (the order decides it).
bool leave_to_other_pod(const std::vector<std::string>& job_adapters, const std::string& previous_replica,
                        const std::string& replica, const std::vector<std::string>& resident,
                        const std::vector<ReplicaReport>& others);
// How long claims leave one ready chunk to another pod's replica at most: several of that replica's claim polls
// (1 s), so it takes the chunk if it still can, and short against a chunk, so a report that is wrong (the replica
// passes the job over for its own reasons) costs this much once.
inline constexpr std::chrono::milliseconds kLeaveToOtherPodFor{3000};

// The chunks a pod's claims have left to other pods, and since when (times are the caller's, ms).
class LeftChunks {
 public:
  // Whether the chunk `key` (job and chunk) may still be left: kLeaveToOtherPodFor from the first time it was.
  bool still_leaving(const std::string& key, int64_t now_ms);

 private:
  std::map<std::string, int64_t> since_ms_;
};

// What one claim knows besides the ready jobs.
struct Claimant {
  std::string replica;
  const std::vector<std::string>* resident = nullptr;  // adapters it holds; null when it serves none
  std::vector<std::string> pass_over;                  // jobs its server's own placement sends elsewhere
  std::vector<ReplicaReport> others;                   // replicas of other pods (other_pods)
};

// The whole claim decision: sorts `ready` in dispatch order and returns the indices (into the sorted list) to try,
// best first. Jobs passed over, and jobs left to another pod (leave_to_other_pod while `left` still allows it), are
// not tried.
std::vector<size_t> claim_order(std::vector<ReadyJob>& ready, const Claimant& claimant, LeftChunks& left,
                                int64_t now_ms);

// Where a waiting job stands: its 0-based index in `ready` sorted in dispatch order, -1 when it is not there.
int64_t dispatch_position(std::vector<ReadyJob> ready, const std::string& job_id);

}  // namespace skyreels::server::policy
