// Jobs as the store tests write them directly (test_job_store_postgres, test_lease_contract): alice's, queued, with
// the given submission order, priority, fair-share start and chunk count; and lease lengths for those tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "server/store/job_store.h"

namespace skyreels::test {

inline constexpr auto kLongTtl = std::chrono::milliseconds(600000);  // never expires within a test
inline constexpr auto kExpired = std::chrono::milliseconds(0);       // expired as soon as it is granted

inline server::StoredJob make_job(const std::string& id, uint64_t order, int priority = 0, int64_t vbase = 0,
                                  int64_t chunks = 3) {
  server::StoredJob j;
  j.id = id;
  j.order = order;
  j.vbase = vbase;
  j.owner = "alice";
  j.client = "alice";
  j.priority = priority;
  j.state = "queued";
  j.error_kind = "none";
  j.created_ms = 1000 + static_cast<int64_t>(order);
  j.chunk_count = chunks;
  j.request = "request of " + id;
  return j;
}

}  // namespace skyreels::test
