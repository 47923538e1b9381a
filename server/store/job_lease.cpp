#include "server/store/job_lease.h"

#include <spdlog/spdlog.h>

#include <algorithm>

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
