#include "server/store/job_lease.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "server/policy/dispatch_policy.h"

namespace skyreels::server {

std::vector<size_t> claim_preference(const std::vector<ClaimCandidate>& candidates, const std::string& replica) {
  std::vector<size_t> order;
  const size_t window = std::min(candidates.size(), static_cast<size_t>(LeaseStore::kAffinityWindow));
  const auto ties_first = [&](const ClaimCandidate& c) {
    return c.priority == candidates[0].priority && c.service == candidates[0].service &&
           c.client_service == candidates[0].client_service;
  };
  for (size_t i = 0; i < window && ties_first(candidates[i]); ++i) {
    if (!replica.empty() && candidates[i].previous_replica == replica) order.push_back(i);
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
  }
  return order;
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
  std::vector<policy::ReplicaView> views;
  policy::JobPlacement job;
  job.adapters = true;
  views.push_back({true, true, 0, false, missing(resident), static_cast<int>(resident.size())});
  if (previous_replica == replica) job.holder = 0;
  for (const ReplicaReport& r : others) {
    if (r.name == previous_replica) job.holder = static_cast<int>(views.size());
    views.push_back({true, r.idle, 0, false, missing(r.adapters), static_cast<int>(r.adapters.size())});
  }
  return policy::choose_replica(job, views, 0.0, false) > 0;
}

InsertOutcome insert_with_fresh_ids(LeaseStore& store, StoredJob& job, const AdmissionLimits& limits,
                                    const std::function<std::string()>& new_id) {
  InsertOutcome outcome;
  for (int attempt = 0; attempt < kIdAttempts; ++attempt) {
    job.id = new_id();
    outcome = store.insert_job_once(job, limits);
    if (outcome.refused != InsertOutcome::Refusal::IdTaken) return outcome;
    spdlog::warn("job={} event=job_id_taken attempt={}", job.id, attempt + 1);
  }
  return outcome;
}

}  // namespace skyreels::server
