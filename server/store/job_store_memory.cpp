#include "server/store/job_store_memory.h"

#include <algorithm>

namespace skyreels::server {

void MemoryJobStore::insert_job(StoredJob job) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& entry = jobs_[job.id];
  entry.job = std::move(job);
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
  it->second.chunks[chunk.index] = chunk;
  it->second.job.chunks_done = chunk.index + 1;
}

void MemoryJobStore::append_event(const std::string& job_id, const StoredEvent& event) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it != jobs_.end()) it->second.events.push_back(event);
}

void MemoryJobStore::drop_job(const std::string& job_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  tombstones_[job_id] = {it->second.job.owner, reason};
  tombstone_order_.push_back(job_id);
  jobs_.erase(it);
  while (static_cast<int64_t>(tombstone_order_.size()) > kMaxTombstones) {
    tombstones_.erase(tombstone_order_.front());
    tombstone_order_.pop_front();
  }
}

std::optional<std::string> MemoryJobStore::dropped_reason(const std::string& job_id, const std::string& owner) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tombstones_.find(job_id);
  if (it == tombstones_.end() || it->second.first != owner) return std::nullopt;
  return it->second.second;
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
  std::vector<StoredChunk> out;
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return out;
  for (const auto& [index, chunk] : it->second.chunks) out.push_back(chunk);
  return out;
}

std::optional<std::string> MemoryJobStore::load_chunk_bytes(const std::string& job_id, int64_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return std::nullopt;
  auto chunk = it->second.chunks.find(index);
  if (chunk == it->second.chunks.end()) return std::nullopt;
  return chunk->second.bytes;
}

void MemoryJobStore::put_segment(const std::string& job_id, int64_t index, const std::string& bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it != jobs_.end()) it->second.segments[index] = bytes;
}

std::optional<std::string> MemoryJobStore::load_segment(const std::string& job_id, int64_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return std::nullopt;
  auto segment = it->second.segments.find(index);
  if (segment == it->second.segments.end()) return std::nullopt;
  return segment->second;
}

// The blob, or null; with mu_ held.
static const std::string* find_blob(const std::map<std::string, MemoryJobStore::Entry>& jobs, const std::string& job_id,
                                    JobStore::Blob kind, int64_t index) {
  auto it = jobs.find(job_id);
  if (it == jobs.end()) return nullptr;
  if (kind == JobStore::Blob::chunk) {
    auto chunk = it->second.chunks.find(index);
    return chunk == it->second.chunks.end() ? nullptr : &chunk->second.bytes;
  }
  auto segment = it->second.segments.find(index);
  return segment == it->second.segments.end() ? nullptr : &segment->second;
}

std::optional<int64_t> MemoryJobStore::blob_size(const std::string& job_id, Blob kind, int64_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string* blob = find_blob(jobs_, job_id, kind, index);
  if (blob == nullptr) return std::nullopt;
  return static_cast<int64_t>(blob->size());
}

std::optional<std::string> MemoryJobStore::load_blob_range(const std::string& job_id, Blob kind, int64_t index,
                                                           int64_t offset, int64_t length) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string* blob = find_blob(jobs_, job_id, kind, index);
  if (blob == nullptr) return std::nullopt;
  return blob_slice(*blob, offset, length);
}

std::vector<StoredEvent> MemoryJobStore::load_events(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? std::vector<StoredEvent>{} : it->second.events;
}

std::optional<std::string> MemoryJobStore::load_request(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return std::nullopt;
  return it->second.job.request;
}

}  // namespace skyreels::server
