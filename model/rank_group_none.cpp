// run_on_ranks where this build has no Gloo headers (rank_group.h): one rank only.
#include <stdexcept>

#include "model/rank_group.h"

namespace skyreels::model {

void run_on_ranks(const ParallelLayout& layout, std::chrono::milliseconds /*collective_timeout*/,
                  const std::function<void(int64_t rank, const RankGroups& groups)>& body) {
  if (!layout.single()) {
    throw std::invalid_argument("--parallel: " + layout.text() +
                                " needs torch's c10d with Gloo, which this build lacks (install libgloo-dev and "
                                "rebuild)");
  }
  body(0, RankGroups{});
}

}  // namespace skyreels::model
