#include "server/policy/dispatch_policy.h"

#include <algorithm>
#include <tuple>

namespace skyreels::server::policy {

bool dispatch_before(const JobKey& a, const JobKey& b) {
  if (a.priority != b.priority) return a.priority > b.priority;
  if (a.client_service != b.client_service) return a.client_service < b.client_service;
  if (a.fair_key != b.fair_key) return a.fair_key < b.fair_key;
  return a.order < b.order;
}

int64_t fair_share_start(const std::vector<int64_t>& active_fair_keys) {
  if (active_fair_keys.empty()) return 0;
  return *std::min_element(active_fair_keys.begin(), active_fair_keys.end());
}

int64_t charge_chunk(int weight) { return kServicePerChunk / std::clamp(weight, 1, kMaxClientWeight); }

int64_t client_share_start(int64_t own, const std::vector<int64_t>& active_client_services) {
  if (active_client_services.empty()) return std::max<int64_t>(own, 0);
  const int64_t least = *std::min_element(active_client_services.begin(), active_client_services.end());
  return std::max(own, least);
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
  // The best idle replica: no other job's affinity first; for a job with adapters, the fewest to load, then the
  // fewest resident ones disturbed; the lowest index on ties.
  auto cost = [&](int r) {
    const ReplicaView& v = replicas[static_cast<size_t>(r)];
    return std::make_tuple(v.held_by_other_job, job.adapters ? v.missing_adapters : 0,
                           job.adapters ? v.resident_adapters : 0);
  };
  const int best = *std::min_element(candidates.begin(), candidates.end(),
                                     [&](int a, int b) { return cost(a) < cost(b); });
  if (valid(job.holder) && job.holder != job.avoid && have_estimate) {
    const ReplicaView& holder = replicas[static_cast<size_t>(job.holder)];
    const double moving = handoff_cost_seconds +
                          kAdapterLoadSeconds * (job.adapters ? replicas[static_cast<size_t>(best)].missing_adapters : 0);
    if (holder.healthy && !holder.idle && holder.remaining_seconds < moving) return -1;
  }
  return best;
}

bool should_retry(int failed_attempts, int chunk_retries, bool any_healthy_replica) {
  return any_healthy_replica && failed_attempts <= chunk_retries;
}

bool should_take_over(int takeovers, int chunk_takeover_limit) { return takeovers <= chunk_takeover_limit; }

double remaining_seconds(double expected_seconds, double elapsed_seconds) {
  return std::max(0.0, expected_seconds - elapsed_seconds);
}

double update_seconds_per_work(double average, double seconds, double work) {
  if (work <= 0) return average;
  const double sample = seconds / work;
  return average == 0 ? sample : 0.7 * average + 0.3 * sample;
}

double queue_eta(double soonest_free_seconds, double seconds_ahead, int64_t healthy_replicas, bool have_estimate) {
  if (!have_estimate || healthy_replicas <= 0) return -1;
  return soonest_free_seconds + seconds_ahead / static_cast<double>(healthy_replicas);
}

double retry_after_seconds(double seconds_ahead, int64_t healthy_replicas, bool have_estimate) {
  if (!have_estimate) return 1.0;
  return std::max(1.0, seconds_ahead / static_cast<double>(std::max<int64_t>(1, healthy_replicas)));
}

}  // namespace skyreels::server::policy
