// --parallel: parsing and the checks against the devices and the model (parallel_layout.h).
#include "model/parallel_layout.h"

#include <cerrno>
#include <cstdlib>
#include <stdexcept>

namespace skyreels::model {

std::string ParallelLayout::text() const {
  return "cfg=" + std::to_string(cfg) + ",ulysses=" + std::to_string(ulysses);
}

namespace {

int64_t parse_degree(const std::string& key, const std::string& value) {
  const std::string what = "--parallel: " + key + "=" + value;
  if (value.empty() || value.size() > 4 || value.find_first_not_of("0123456789") != std::string::npos) {
    throw std::invalid_argument(what + " is not a degree (a whole number from 1 to " +
                                std::to_string(kMaxParallelDegree) + ")");
  }
  const int64_t degree = std::strtoll(value.c_str(), nullptr, 10);
  if (degree < 1 || degree > kMaxParallelDegree) {
    throw std::invalid_argument(what + ": the degree must be from 1 to " + std::to_string(kMaxParallelDegree));
  }
  return degree;
}

}  // namespace

ParallelLayout parse_parallel_layout(const std::string& text) {
  if (text.empty() || text.size() > 64) {
    throw std::invalid_argument("--parallel: expected cfg=C,ulysses=U (e.g. cfg=2,ulysses=2), got '" +
                                text.substr(0, 64) + "'");
  }
  ParallelLayout layout;
  bool seen_cfg = false, seen_ulysses = false;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = text.find(',', at);
    const std::string item = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    if (eq == std::string::npos || (key != "cfg" && key != "ulysses")) {
      throw std::invalid_argument("--parallel: unknown item '" + item + "' (keys: cfg, ulysses; e.g. cfg=2,ulysses=2)");
    }
    bool& seen = key == "cfg" ? seen_cfg : seen_ulysses;
    if (seen) throw std::invalid_argument("--parallel: " + key + " given twice");
    seen = true;
    const int64_t degree = parse_degree(key, item.substr(eq + 1));
    (key == "cfg" ? layout.cfg : layout.ulysses) = degree;
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  if (layout.cfg > 2) {
    throw std::invalid_argument("--parallel: cfg=" + std::to_string(layout.cfg) +
                                ": guidance has two passes per row (cfg=1 or cfg=2)");
  }
  return layout;
}

std::vector<int64_t> ulysses_degrees(int64_t heads) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= kMaxParallelDegree && d <= heads; ++d) {
    if (heads % d == 0) out.push_back(d);
  }
  return out;
}

void check_parallel_layout(const ParallelLayout& layout, int64_t device_count, int64_t heads, bool shard_weights) {
  if (device_count < 1 || device_count % layout.ranks() != 0) {
    throw std::invalid_argument("--devices: " + std::to_string(device_count) + " device(s) cannot be grouped into " +
                                "replicas of " + std::to_string(layout.ranks()) + " (--parallel " + layout.text() +
                                "); give a multiple of " + std::to_string(layout.ranks()) + " devices");
  }
  if (heads % layout.ulysses != 0) {
    std::string degrees;
    for (int64_t d : ulysses_degrees(heads)) degrees += (degrees.empty() ? "" : ", ") + std::to_string(d);
    throw std::invalid_argument("--parallel: ulysses=" + std::to_string(layout.ulysses) + " does not divide the " +
                                std::to_string(heads) + " attention heads of this model (degrees that do: " +
                                degrees + ")");
  }
  if (shard_weights && layout.single()) {
    throw std::invalid_argument("--shard-weights: needs a replica of more than one device (--parallel cfg=2 or "
                                "ulysses > 1)");
  }
}

}  // namespace skyreels::model
