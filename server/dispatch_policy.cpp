#include "server/dispatch_policy.h"

namespace skyreels::server::policy {

bool dispatch_before(const JobKey& a, const JobKey& b) {
  if (a.priority != b.priority) return a.priority > b.priority;
  if (a.fair_key != b.fair_key) return a.fair_key < b.fair_key;
  return a.order < b.order;
}

int choose_replica(const JobPlacement& job, const std::vector<ReplicaView>& replicas, double handoff_cost_seconds,
                   bool have_estimate) {
  const int n = static_cast<int>(replicas.size());
  auto valid = [&](int r) { return r >= 0 && r < n; };
  auto idle = [&](int r) { return valid(r) && replicas[static_cast<size_t>(r)].idle; };
  if (job.holder != job.avoid && idle(job.holder)) return job.holder;

  std::vector<int> candidates;
  for (int r = 0; r < n; ++r) {
    if (r != job.avoid && idle(r)) candidates.push_back(r);
  }
  if (candidates.empty()) {
    if (!idle(job.avoid)) return -1;
    for (int r = 0; r < n; ++r) {
      if (r != job.avoid && replicas[static_cast<size_t>(r)].healthy) return -1;  // wait for a healthy other one
    }
    return job.avoid;
  }
  if (valid(job.holder) && job.holder != job.avoid && have_estimate) {
    const ReplicaView& holder = replicas[static_cast<size_t>(job.holder)];
    if (holder.healthy && !holder.idle && holder.remaining_seconds < handoff_cost_seconds) return -1;
  }
  for (int r : candidates) {
    if (!replicas[static_cast<size_t>(r)].held_by_other_job) return r;
  }
  return candidates.front();
}

double queue_eta(double soonest_free_seconds, double seconds_ahead, int64_t healthy_replicas, bool have_estimate) {
  if (!have_estimate || healthy_replicas <= 0) return -1;
  return soonest_free_seconds + seconds_ahead / static_cast<double>(healthy_replicas);
}

}  // namespace skyreels::server::policy
