#include "server/policy/admission.h"

#include <algorithm>
#include <vector>

#include "server/policy/dispatch_policy.h"

namespace skyreels::server::policy {

namespace {

std::vector<int64_t> one_or_none(const std::optional<int64_t>& v) {
  return v ? std::vector<int64_t>{*v} : std::vector<int64_t>{};
}

}  // namespace

Admission admit(const AdmissionFacts& facts, const AdmissionLimits& limits, int requested_weight) {
  Admission a;
  if (limits.max_unfinished > 0 && facts.unfinished >= limits.max_unfinished) {
    a.refused = Refusal::QueueFull;
    a.count_at_limit = facts.unfinished;
    return a;
  }
  if (limits.max_for_client > 0 && facts.unfinished_for_client >= limits.max_for_client) {
    a.refused = Refusal::ClientQueueFull;
    a.count_at_limit = facts.unfinished_for_client;
    return a;
  }
  if (facts.id_taken) {
    a.refused = Refusal::IdTaken;
    return a;
  }
  const bool active = facts.least_client_fair_key.has_value();
  const int64_t own = facts.client_service.value_or(-1);
  a.client_service =
      std::max<int64_t>(active ? own : client_share_start(own, one_or_none(facts.least_active_service)), 0);
  a.client_weight = std::clamp(requested_weight, 1, kMaxClientWeight);
  a.vbase = fair_share_start(one_or_none(facts.least_client_fair_key));
  return a;
}

}  // namespace skyreels::server::policy
