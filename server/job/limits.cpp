#include "server/job/limits.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "model/diffusion_forcing.h"  // model::kDefaultKvCacheBytes

namespace skyreels::server {

namespace {

// cgroup v2 (memory.max) or v1 (memory.limit_in_bytes); 0 when unlimited or unreadable.
uint64_t cgroup_memory_limit() {
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string text;
    if (!(in >> text) || text == "max") continue;
    try {
      return std::stoull(text);
    } catch (const std::exception&) {
    }
  }
  return 0;
}

}  // namespace

int64_t activation_bytes_per_token(const ModelFootprint& model) {
  return 2 * model.ffn_dim * model.activation_bytes + 4 * model.dim * 4;
}

uint64_t device_memory_bytes(const std::string& device) {
  if (device != "cpu") return 0;
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGE_SIZE);
  uint64_t bytes = pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
  const uint64_t limit = cgroup_memory_limit();
  if (limit > 0 && (bytes == 0 || limit < bytes)) bytes = limit;
  return bytes;
}

namespace {

// 80 % of the device memory less the weights and 1 GB (score blocks, latents).
double spare_bytes(const ModelFootprint& model, uint64_t device_memory) {
  const double weights = static_cast<double>(model.parameter_count) * static_cast<double>(model.weight_bytes);
  return 0.8 * static_cast<double>(device_memory) - weights - 1e9;
}

}  // namespace

int64_t default_kv_cache_bytes(const ModelFootprint& model, uint64_t device_memory) {
  if (device_memory == 0) return model::kDefaultKvCacheBytes;
  return static_cast<int64_t>(std::max(0.0, spare_bytes(model, device_memory) / 5));
}

int64_t default_max_chunk_tokens(const ModelFootprint& model, uint64_t device_memory, int64_t kv_cache_bytes) {
  if (device_memory == 0) return kAttentionTokenCeiling;
  const double spare = spare_bytes(model, device_memory) - static_cast<double>(kv_cache_bytes);
  const double per_token = static_cast<double>(std::max<int64_t>(1, activation_bytes_per_token(model)));
  const double fits = spare > 0 ? spare / per_token : 0.0;
  return std::clamp<int64_t>(static_cast<int64_t>(fits), 1024, kAttentionTokenCeiling);
}

}  // namespace skyreels::server
