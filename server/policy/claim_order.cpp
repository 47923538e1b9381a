#include "server/policy/claim_order.h"

#include <algorithm>

namespace skyreels::server::policy {

void sort_in_dispatch_order(std::vector<ReadyJob>& ready) {
  std::stable_sort(ready.begin(), ready.end(),
                   [](const ReadyJob& a, const ReadyJob& b) { return dispatch_before(a.key, b.key); });
}

namespace {

// claim_preference over the jobs `eligible` names (indices into `jobs`, in dispatch order); returns indices into jobs.
std::vector<size_t> preference_among(const std::vector<ReadyJob>& jobs, const std::vector<size_t>& eligible,
                                     const std::string& replica) {
  std::vector<size_t> order;
  if (eligible.empty()) return order;
  const JobKey& first = jobs[eligible[0]].key;
  const auto ties_first = [&](const ReadyJob& j) {
    return j.key.priority == first.priority && j.key.fair_key == first.fair_key &&
           j.key.client_service == first.client_service;
  };
  const size_t window = std::min(eligible.size(), static_cast<size_t>(kAffinityWindow));
  std::vector<bool> taken(eligible.size(), false);
  for (size_t e = 0; e < window && ties_first(jobs[eligible[e]]); ++e) {
    if (!replica.empty() && jobs[eligible[e]].previous_replica == replica) {
      order.push_back(eligible[e]);
      taken[e] = true;
    }
  }
  for (size_t e = 0; e < eligible.size(); ++e) {
    if (!taken[e]) order.push_back(eligible[e]);
  }
  return order;
}

}  // namespace

std::vector<size_t> claim_preference(const std::vector<ReadyJob>& in_order, const std::string& replica) {
  std::vector<size_t> all(in_order.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  return preference_among(in_order, all, replica);
}

std::vector<ReplicaReport> other_pods(const std::string& replica, const std::vector<ReplicaReport>& reports) {
  const auto pod_of = [](const std::string& name) { return name.substr(0, name.find('/')); };
  std::vector<ReplicaReport> others;
  for (const ReplicaReport& r : reports) {
    if (pod_of(r.name) != pod_of(replica)) others.push_back(r);
  }
  return others;
}

bool leave_to_other_pod(const std::vector<std::string>& job_adapters, const std::string& previous_replica,
                        const std::string& replica, const std::vector<std::string>& resident,
                        const std::vector<ReplicaReport>& others) {
  if (job_adapters.empty() || others.empty()) return false;
  const auto missing = [&](const std::vector<std::string>& held) {
    return static_cast<int>(std::count_if(job_adapters.begin(), job_adapters.end(), [&](const std::string& a) {
      return std::find(held.begin(), held.end(), a) == held.end();
    }));
  };
  // The claimant is view 0: among equals the policy keeps the first, so a tie never leaves a job.
  std::vector<ReplicaView> views;
  JobPlacement job;
  job.adapters = true;
  views.push_back({true, true, 0, false, missing(resident), static_cast<int>(resident.size())});
  if (previous_replica == replica) job.holder = 0;
  for (const ReplicaReport& r : others) {
    if (r.name == previous_replica) job.holder = static_cast<int>(views.size());
    views.push_back({true, r.idle, 0, false, missing(r.adapters), static_cast<int>(r.adapters.size())});
  }
  return choose_replica(job, views, 0.0, false) > 0;
}

bool LeftChunks::still_leaving(const std::string& key, int64_t now_ms) {
  for (auto it = since_ms_.begin(); it != since_ms_.end();) {  // forget chunks long since claimed
    it = now_ms - it->second > 60000 ? since_ms_.erase(it) : std::next(it);
  }
  const int64_t since = since_ms_.emplace(key, now_ms).first->second;
  return now_ms - since < kLeaveToOtherPodFor.count();
}

std::vector<size_t> claim_order(std::vector<ReadyJob>& ready, const Claimant& claimant, LeftChunks& left,
                                int64_t now_ms) {
  sort_in_dispatch_order(ready);
  const std::vector<std::string> none;
  const std::vector<std::string>& resident = claimant.resident ? *claimant.resident : none;
  std::vector<size_t> eligible;  // the jobs this claim may take, in order
  for (size_t i = 0; i < ready.size(); ++i) {
    const ReadyJob& j = ready[i];
    const auto& pass = claimant.pass_over;
    if (std::find(pass.begin(), pass.end(), j.id) != pass.end()) continue;
    if (leave_to_other_pod(j.adapters, j.previous_replica, claimant.replica, resident, claimant.others) &&
        left.still_leaving(j.id + "#" + std::to_string(j.chunks_done), now_ms)) {
      continue;
    }
    eligible.push_back(i);
  }
  return preference_among(ready, eligible, claimant.replica);
}

int64_t dispatch_position(std::vector<ReadyJob> ready, const std::string& job_id) {
  sort_in_dispatch_order(ready);
  for (size_t i = 0; i < ready.size(); ++i) {
    if (ready[i].id == job_id) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace skyreels::server::policy
