#include "server/job_store_memory.h"

#include <algorithm>

namespace skyreels::server {

void MemoryJobStore::insert_job(const StoredJob& job) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& entry = jobs_[job.id];
  entry.job = job;
  entry.job.request.clear();  // never read back: nothing is resumed from memory
}

void MemoryJobStore::update_job(const StoredJob& job) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job.id);
  if (it == jobs_.end()) return;
  const int64_t done = it->second.job.chunks_done;
  std::string request = std::move(it->second.job.request);
  it->second.job = job;
  it->second.job.chunks_done = done;
  it->second.job.request = std::move(request);
}

void MemoryJobStore::commit_chunk(const std::string& job_id, const StoredChunk& chunk) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  StoredChunk meta = chunk;
  meta.bytes.clear();
  it->second.chunks.push_back(std::move(meta));
  it->second.job.chunks_done = chunk.index + 1;
}

void MemoryJobStore::append_event(const std::string& job_id, const StoredEvent& event) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it != jobs_.end()) it->second.events.push_back(event);
}

void MemoryJobStore::remove_job(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.erase(job_id);
}

std::vector<StoredJob> MemoryJobStore::load_jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StoredJob> out;
  for (const auto& [id, entry] : jobs_) out.push_back(entry.job);
  std::sort(out.begin(), out.end(), [](const StoredJob& a, const StoredJob& b) { return a.order < b.order; });
  return out;
}

std::vector<StoredChunk> MemoryJobStore::load_chunks(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? std::vector<StoredChunk>{} : it->second.chunks;
}

std::vector<StoredEvent> MemoryJobStore::load_events(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? std::vector<StoredEvent>{} : it->second.events;
}

}  // namespace skyreels::server
