#include "server/job_lease.h"

#include <algorithm>

namespace skyreels::server {

std::vector<size_t> claim_preference(const std::vector<ClaimCandidate>& candidates, const std::string& replica) {
  std::vector<size_t> order;
  const size_t window = std::min(candidates.size(), static_cast<size_t>(LeaseStore::kAffinityWindow));
  const auto ties_first = [&](const ClaimCandidate& c) {
    return c.priority == candidates[0].priority && c.service == candidates[0].service;
  };
  for (size_t i = 0; i < window && ties_first(candidates[i]); ++i) {
    if (!replica.empty() && candidates[i].previous_replica == replica) order.push_back(i);
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
  }
  return order;
}

}  // namespace skyreels::server
