#include "server/store/job_lease.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace skyreels::server {

std::optional<ChunkLease> LeaseStore::claim(const std::string& replica, std::chrono::milliseconds ttl,
                                            const std::vector<std::string>& pass_over,
                                            const std::vector<std::string>* resident) {
  std::vector<policy::ReadyJob> ready = candidates(policy::kClaimWindow);
  policy::Claimant claimant{replica, resident, pass_over, {}};
  // Other pods' reports matter only to a job with adapters (policy::leave_to_other_pod).
  if (std::any_of(ready.begin(), ready.end(), [](const policy::ReadyJob& j) { return !j.adapters.empty(); })) {
    claimant.others = policy::other_pods(replica, replica_reports(ttl));
  }
  std::vector<size_t> order;
  {
    std::lock_guard<std::mutex> lock(left_mu_);
    order = policy::claim_order(ready, claimant, left_, now_ms());
  }
  std::optional<ChunkLease> lease;
  for (size_t i = 0; i < order.size() && !lease; ++i) {  // a job claimed by another replica meanwhile: the next
    const policy::ReadyJob& job = ready[order[i]];
    lease = try_lease(job.id, replica, ttl, policy::charge_chunk(job.client_weight));
  }
  // One report per claim, as it ended: idle when it leased nothing.
  if (resident) report_replica(replica, *resident, !lease.has_value());
  return lease;
}

LeaseStore::QueuePlace LeaseStore::queue_place(const std::string& job_id) const {
  const int64_t ahead = policy::dispatch_position(candidates(policy::kClaimWindow), job_id);
  if (ahead < 0) return {};
  return {ahead + 1, ahead};
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
