#include "server/store/job_lease_local.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>


namespace skyreels::server {

namespace {

// Times here are LeaseStore::now_ms(): this process's clock, the one clock of a store one process holds.
bool unfinished(const StoredJob& job) { return job.state == "queued" || job.state == "running"; }

// Nobody else writes to a store this process holds: every change was made, and announced, by this process.
class QuietListener final : public ChangeListener {
 public:
  JobChanges wait(std::chrono::milliseconds timeout) override {
    std::this_thread::sleep_for(timeout);
    return {};
  }
};

}  // namespace

LocalLeaseStore::LocalLeaseStore(std::unique_ptr<JobStore> owned, std::string finished_event)
    : owned_(std::move(owned)), inner_(*owned_) {
  read_back(finished_event);
}

LocalLeaseStore::LocalLeaseStore(JobStore& borrowed, std::string finished_event) : inner_(borrowed) {
  read_back(finished_event);
}

LocalLeaseStore::~LocalLeaseStore() = default;

void LocalLeaseStore::read_back(const std::string& finished_event) {
  std::lock_guard<std::mutex> lock(mu_);
  for (StoredJob& job : inner_.load_jobs()) {
    Entry e;
    job.request = std::string();
    e.job = std::move(job);
    e.events = inner_.load_events(e.job.id);
    for (const StoredEvent& event : e.events) e.next_sequence = std::max(e.next_sequence, event.sequence + 1);
    next_order_ = std::max(next_order_, e.job.order + 1);
    if (unfinished(e.job) && e.job.chunks_done >= e.job.chunk_count) {  // killed between its last commit and its end
      e.job.state = "succeeded";
      e.job.finished_ms = now_ms();
      inner_.update_job(e.job);
      append_locked(e, finished_event);
    } else if (unfinished(e.job)) {
      e.next_sequence += kStepNumbersPerChunk;  // steps of the chunk that ran when the server stopped
      // The server died while the chunk ran: its lease has expired, so the next claim takes it over (a retry).
      e.leased = e.job.state == "running";
    }
    if (!e.job.idempotency_key.empty()) keys_[{e.job.owner, e.job.idempotency_key}] = e.job.id;
    const std::string id = e.job.id;
    jobs_.emplace(id, std::move(e));
  }
}

LocalLeaseStore::Entry* LocalLeaseStore::visible_locked(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() || it->second.inserting ? nullptr : &it->second;
}

const LocalLeaseStore::Entry* LocalLeaseStore::visible_locked(const std::string& job_id) const {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() || it->second.inserting ? nullptr : &it->second;
}

bool LocalLeaseStore::ready_locked(const Entry& e, int64_t now) const {
  return !e.inserting && unfinished(e.job) && !e.cancel_requested && e.job.chunks_done < e.job.chunk_count &&
         (!e.leased || (!e.committing && e.expires_ms <= now));
}

// Jobs being inserted count too: they are admitted.
policy::AdmissionFacts LocalLeaseStore::admission_facts_locked(const std::string& client, const std::string& id) const {
  policy::AdmissionFacts facts;
  const auto least = [](std::optional<int64_t>& so_far, int64_t v) { so_far = so_far ? std::min(*so_far, v) : v; };
  for (const auto& [job_id, e] : jobs_) {
    if (!unfinished(e.job)) continue;
    ++facts.unfinished;
    if (e.job.client == client) {
      ++facts.unfinished_for_client;
      least(facts.least_client_fair_key, e.job.vbase + e.job.chunks_done);
    }
    auto c = clients_.find(e.job.client);
    if (c != clients_.end()) least(facts.least_active_service, c->second.service);
  }
  facts.id_taken = jobs_.count(id) > 0 || dropped_.count(id) > 0;
  auto own = clients_.find(client);
  if (own != clients_.end()) facts.client_service = own->second.service;
  return facts;
}

AdmissionCounts LocalLeaseStore::counts_locked(const std::string& client) const {
  AdmissionCounts counts;
  for (const auto& [id, e] : jobs_) {
    if (!unfinished(e.job)) continue;
    ++counts.unfinished;
    if (e.job.client == client) ++counts.unfinished_for_client;
  }
  return counts;
}

// Kept here first: a write that fails (a full disk) is the caller's StoreError, but this server's watchers still hear
// the event; it is lost only to a restart.
uint64_t LocalLeaseStore::append_locked(Entry& e, const std::string& data) {
  const StoredEvent event{e.next_sequence, data};
  ++e.next_sequence;
  e.events.push_back(event);
  inner_.append_event(e.job.id, event);
  return event.sequence;
}

// ---- records() -------------------------------------------------------------------------------------------------

std::string LocalLeaseStore::Records::describe() const { return leases_.inner_.describe(); }
bool LocalLeaseStore::Records::durable() const { return leases_.inner_.durable(); }

void LocalLeaseStore::Records::insert_job(StoredJob job) {
  const std::string id = job.id;
  Entry e;
  e.job = job;
  e.job.request = std::string();
  leases_.inner_.insert_job(std::move(job));
  {
    std::lock_guard<std::mutex> lock(leases_.mu_);
    leases_.next_order_ = std::max(leases_.next_order_, e.job.order + 1);
    if (!e.job.idempotency_key.empty()) leases_.keys_[{e.job.owner, e.job.idempotency_key}] = id;
    leases_.jobs_[id] = std::move(e);
  }
}

void LocalLeaseStore::Records::update_job(const StoredJob& job) {
  {
    std::lock_guard<std::mutex> lock(leases_.mu_);
    Entry* e = leases_.visible_locked(job.id);
    if (e == nullptr) return;
    StoredJob& s = e->job;  // as append_locked: kept here even when the write fails
    s.state = job.state;
    s.error_kind = job.error_kind;
    s.error = job.error;
    s.started_ms = job.started_ms;
    s.finished_ms = job.finished_ms;
    s.retries = job.retries;
    s.handoffs = job.handoffs;
    leases_.inner_.update_job(job);
  }
}

void LocalLeaseStore::Records::commit_chunk(const std::string& job_id, const StoredChunk& chunk) {
  leases_.inner_.commit_chunk(job_id, chunk);
  {
    std::lock_guard<std::mutex> lock(leases_.mu_);
    if (Entry* e = leases_.visible_locked(job_id)) {
      e->job.chunks_done = chunk.index + 1;
      e->last_replica = chunk.replica;
    }
  }
}

void LocalLeaseStore::Records::append_event(const std::string& job_id, const StoredEvent& event) {
  {
    std::lock_guard<std::mutex> lock(leases_.mu_);
    leases_.inner_.append_event(job_id, event);
    if (Entry* e = leases_.visible_locked(job_id)) {
      e->events.push_back(event);
      e->next_sequence = std::max(e->next_sequence, event.sequence + 1);
    }
  }
}

void LocalLeaseStore::Records::drop_job(const std::string& job_id, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(leases_.mu_);
    leases_.inner_.drop_job(job_id, reason);
    auto it = leases_.jobs_.find(job_id);
    if (it != leases_.jobs_.end()) {
      leases_.keys_.erase({it->second.job.owner, it->second.job.idempotency_key});
      leases_.jobs_.erase(it);
    }
    std::set<std::string>& dropped = leases_.dropped_;
    dropped.insert(job_id);
    if (static_cast<int64_t>(dropped.size()) > kMaxTombstones) dropped.erase(dropped.begin());
  }
}

std::optional<std::string> LocalLeaseStore::Records::dropped_reason(const std::string& job_id,
                                                                    const std::string& owner) const {
  return leases_.inner_.dropped_reason(job_id, owner);
}

std::vector<StoredJob> LocalLeaseStore::Records::load_jobs() const { return leases_.inner_.load_jobs(); }

std::vector<StoredChunk> LocalLeaseStore::Records::load_chunks(const std::string& job_id) const {
  return leases_.inner_.load_chunks(job_id);
}

std::vector<StoredEvent> LocalLeaseStore::Records::load_events(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(leases_.mu_);
  const Entry* e = leases_.visible_locked(job_id);
  return e == nullptr ? std::vector<StoredEvent>{} : e->events;
}

std::optional<std::string> LocalLeaseStore::Records::load_request(const std::string& job_id) const {
  return leases_.inner_.load_request(job_id);
}

std::optional<std::string> LocalLeaseStore::Records::load_chunk_bytes(const std::string& job_id, int64_t index) const {
  return leases_.inner_.load_chunk_bytes(job_id, index);
}

void LocalLeaseStore::Records::put_segment(const std::string& job_id, int64_t index, const std::string& bytes) {
  leases_.inner_.put_segment(job_id, index, bytes);
}

std::optional<std::string> LocalLeaseStore::Records::load_segment(const std::string& job_id, int64_t index) const {
  return leases_.inner_.load_segment(job_id, index);
}

std::optional<int64_t> LocalLeaseStore::Records::blob_size(const std::string& job_id, Blob kind, int64_t index) const {
  return leases_.inner_.blob_size(job_id, kind, index);
}

std::optional<std::string> LocalLeaseStore::Records::load_blob_range(const std::string& job_id, Blob kind,
                                                                     int64_t index, int64_t offset,
                                                                     int64_t length) const {
  return leases_.inner_.load_blob_range(job_id, kind, index, offset, length);
}

// ---- LeaseStore -----------------------------------------------------------------------------------------------

std::vector<policy::ReadyJob> LocalLeaseStore::candidates(int64_t limit) const {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = now_ms();
  std::vector<const Entry*> ready;
  for (const auto& [id, e] : jobs_) {
    if (ready_locked(e, now)) ready.push_back(&e);
  }
  std::sort(ready.begin(), ready.end(), [](const Entry* a, const Entry* b) {
    return a->job.priority != b->job.priority ? a->job.priority > b->job.priority : a->job.order < b->job.order;
  });
  if (static_cast<int64_t>(ready.size()) > limit) ready.resize(static_cast<size_t>(std::max<int64_t>(limit, 0)));
  std::vector<policy::ReadyJob> out;
  for (const Entry* e : ready) {
    auto client = clients_.find(e->job.client);
    policy::ReadyJob j;
    j.id = e->job.id;
    j.key = {e->job.priority, e->job.vbase + e->job.chunks_done, e->job.order,
             client == clients_.end() ? 0 : client->second.service};
    j.client_weight = client == clients_.end() ? 1 : client->second.weight;
    j.previous_replica = e->last_replica;
    j.adapters = e->job.adapters;
    j.chunks_done = e->job.chunks_done;
    out.push_back(std::move(j));
  }
  return out;
}

std::optional<ChunkLease> LocalLeaseStore::try_lease(const std::string& job_id, const std::string& replica,
                                                     std::chrono::milliseconds ttl, int64_t charge) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = now_ms();
  Entry* ready = visible_locked(job_id);
  if (ready == nullptr || !ready_locked(*ready, now)) return std::nullopt;
  Entry& e = *ready;

  ChunkLease lease;
  lease.job_id = e.job.id;
  lease.takeover = e.leased;  // ready while leased: the lease expired unreleased
  lease.previous_replica = e.last_replica;
  lease.handoff = !lease.previous_replica.empty() && lease.previous_replica != replica;
  StoredJob updated = e.job;
  updated.retries += lease.takeover ? 1 : 0;
  updated.handoffs += lease.handoff ? 1 : 0;
  updated.state = "running";
  if (updated.started_ms == 0) updated.started_ms = now;
  inner_.update_job(updated);  // before anything changes here: a failed write claims nothing
  e.job = std::move(updated);
  e.leased = true;
  e.committing = false;
  e.token += 1;
  e.lease_replica = replica;
  e.expires_ms = now + ttl.count();
  clients_[e.job.client].service += charge;

  lease.chunk_index = e.job.chunks_done;
  lease.chunk_count = e.job.chunk_count;
  lease.token = e.token;
  lease.expires_ms = e.expires_ms;
  return lease;
}

LeaseRenewal LocalLeaseStore::renew(const ChunkLease& lease, std::chrono::milliseconds ttl) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = visible_locked(lease.job_id);
  if (e == nullptr || !e->leased || e->token != lease.token) return {};
  e->expires_ms = std::max(e->expires_ms, now_ms() + ttl.count());
  return {true, e->cancel_requested};
}

LeaseCommit LocalLeaseStore::commit(const ChunkLease& lease, const StoredChunk& chunk,
                                    const std::vector<std::string>& events) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry* e = visible_locked(lease.job_id);
    if (e == nullptr || !e->leased || e->token != lease.token || e->job.chunks_done != chunk.index ||
        chunk.index != lease.chunk_index) {
      return {};
    }
    e->committing = true;  // the result is megabytes: written without the lock, and the lease cannot expire meanwhile
  }
  try {
    inner_.commit_chunk(lease.job_id, chunk);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    if (Entry* e = visible_locked(lease.job_id)) e->committing = false;
    throw;
  }
  LeaseCommit out{true, {}};
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = jobs_.at(lease.job_id);  // a leased job is never dropped (it is unfinished)
    e.job.chunks_done = chunk.index + 1;
    e.last_replica = chunk.replica;
    e.leased = false;
    e.committing = false;
    // The result is stored: what follows is kept here whatever the store says (a write that fails is logged; only a
    // restart would miss it, and read_back ends a job whose every chunk is stored).
    auto written = [&](const std::function<void()>& write) {
      try {
        write();
      } catch (const StoreError& error) {
        spdlog::error("job={} event=store_write_failed after=commit error=\"{}\"", lease.job_id, error.what());
      }
    };
    if (e.job.chunks_done >= e.job.chunk_count) {
      e.job.state = "succeeded";  // the job ends right after its last result
      e.job.finished_ms = now_ms();
      written([&] { inner_.update_job(e.job); });
    }
    for (const std::string& data : events) {
      out.sequences.push_back(e.next_sequence);
      written([&] { append_locked(e, data); });
    }
  }
  return out;
}

bool LocalLeaseStore::release(const ChunkLease& lease) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry* e = visible_locked(lease.job_id);
    if (e == nullptr || !e->leased || e->committing || e->token != lease.token) return false;
    e->leased = false;
  }
  return true;
}

std::vector<std::string> LocalLeaseStore::expire_deadlines() {
  std::vector<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t now = now_ms();
    for (auto& [id, e] : jobs_) {
      const bool live_lease = e.leased && (e.committing || e.expires_ms > now);
      if (e.inserting || !unfinished(e.job) || !e.job.deadline_ms || *e.job.deadline_ms > now || live_lease) continue;
      StoredJob ended = e.job;
      ended.state = "deadline_exceeded";
      ended.error_kind = "deadline_exceeded";
      ended.error = "deadline passed while queued";
      ended.finished_ms = now;
      inner_.update_job(ended);
      e.job = std::move(ended);
      e.leased = false;
      ids.push_back(id);
    }
  }
  return ids;
}

std::vector<LeaseStore::Retired> LocalLeaseStore::finished_to_retire(int64_t finished_before_ms, int64_t keep) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const StoredJob*> finished;
  for (const auto& [id, e] : jobs_) {
    if (!e.inserting && !unfinished(e.job)) finished.push_back(&e.job);
  }
  std::sort(finished.begin(), finished.end(),
            [](const StoredJob* a, const StoredJob* b) { return a->finished_ms > b->finished_ms; });  // newest first
  std::vector<Retired> out;
  for (size_t i = 0; i < finished.size(); ++i) {
    const bool expired = finished[i]->finished_ms < finished_before_ms;
    if (expired || static_cast<int64_t>(i) >= keep) out.push_back({finished[i]->id, expired});
  }
  std::reverse(out.begin(), out.end());  // oldest first
  return out;
}

CancelState LocalLeaseStore::request_cancel(const std::string& job_id, const std::string& owner) {
  CancelState state = CancelState::Unknown;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry* e = visible_locked(job_id);
    if (e == nullptr || e->job.owner != owner) return CancelState::Unknown;
    if (!unfinished(e->job)) return CancelState::AlreadyFinished;
    e->cancel_requested = true;
    state = e->leased && (e->committing || e->expires_ms > now_ms()) ? CancelState::Running : CancelState::Idle;
  }
  return state;
}

// Reserves the job here (counted against the limits, its key taken), writes it to the store without the lock (the
// request may be megabytes; other calls are answered meanwhile), then makes it visible, or forgets it when the store
// refused it. A second insert under the same key waits for the first to end either way.
InsertOutcome LocalLeaseStore::insert_job_once(const StoredJob& job, AdmissionLimits limits) {
  std::unique_lock<std::mutex> lock(mu_);
  const std::pair<std::string, std::string> key{job.owner, job.idempotency_key};
  while (!job.idempotency_key.empty()) {
    auto it = keys_.find(key);
    if (it == keys_.end()) break;
    const Entry& existing = jobs_.at(it->second);
    if (existing.inserting) {
      inserted_.wait(lock);
      continue;
    }
    InsertOutcome found;
    found.job_id = existing.job.id;
    found.fingerprint = existing.job.fingerprint;
    found.fingerprint_v2 = existing.job.fingerprint_v2;
    found.order = existing.job.order;
    found.vbase = existing.job.vbase;
    return found;
  }
  const policy::Admission admission =
      policy::admit(admission_facts_locked(job.client, job.id), limits, job.client_weight);
  if (admission.refused != policy::Refusal::None) {
    InsertOutcome refused;
    refused.refused = admission.refused;
    refused.unfinished = admission.count_at_limit;
    return refused;
  }
  Client& client = clients_[job.client];
  client.service = admission.client_service;
  client.weight = admission.client_weight;

  StoredJob stored = job;
  stored.order = next_order_++;
  stored.vbase = admission.vbase;
  Entry& e = jobs_[job.id];
  e.job = stored;
  e.job.request = std::string();
  e.inserting = true;
  if (!job.idempotency_key.empty()) keys_[key] = job.id;
  lock.unlock();

  try {
    inner_.insert_job(stored);
  } catch (...) {
    lock.lock();
    jobs_.erase(job.id);
    if (!job.idempotency_key.empty()) keys_.erase(key);
    inserted_.notify_all();
    throw;
  }
  lock.lock();
  Entry& visible = jobs_.at(job.id);
  visible.inserting = false;
  InsertOutcome outcome;
  outcome.job_id = job.id;
  outcome.inserted = true;
  outcome.fingerprint = stored.fingerprint;
  outcome.fingerprint_v2 = stored.fingerprint_v2;
  outcome.order = stored.order;
  outcome.vbase = stored.vbase;
  inserted_.notify_all();
  lock.unlock();
  return outcome;
}

AdmissionCounts LocalLeaseStore::admission_counts(const std::string& client) const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_locked(client);
}

int64_t LocalLeaseStore::queue_depth() const {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = now_ms();
  return std::count_if(jobs_.begin(), jobs_.end(), [&](const auto& j) { return ready_locked(j.second, now); });
}

std::vector<StoredJob> LocalLeaseStore::jobs_of(const std::string& owner) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StoredJob> out;
  for (const auto& [id, e] : jobs_) {
    if (!e.inserting && e.job.owner == owner) out.push_back(e.job);
  }
  std::sort(out.begin(), out.end(), [](const StoredJob& a, const StoredJob& b) { return a.order < b.order; });
  return out;
}

std::optional<StoredJob> LocalLeaseStore::load_job(const std::string& job_id, bool with_request) const {
  std::optional<StoredJob> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Entry* e = visible_locked(job_id);
    if (e == nullptr) return std::nullopt;
    job = e->job;
  }
  if (with_request) job->request = inner_.load_request(job_id).value_or(std::string());
  return job;
}

std::vector<uint64_t> LocalLeaseStore::append_events(const std::string& job_id, const std::vector<std::string>& events) {
  std::vector<uint64_t> sequences;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry* e = visible_locked(job_id);
    if (e == nullptr) throw StoreError("job store " + inner_.describe() + ": append_events: no job " + job_id);
    for (const std::string& data : events) sequences.push_back(append_locked(*e, data));
  }
  return sequences;
}

uint64_t LocalLeaseStore::reserve_sequences(const std::string& job_id, int64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = visible_locked(job_id);
  if (e == nullptr) throw StoreError("job store " + inner_.describe() + ": reserve_sequences: no job " + job_id);
  const uint64_t first = e->next_sequence;
  e->next_sequence += static_cast<uint64_t>(std::max<int64_t>(count, 0));
  return first;
}

// Only this process watches the store, and its scheduler already holds its own steps.
void LocalLeaseStore::publish_step(const std::string&, const StoredEvent&) {}

std::unique_ptr<ChangeListener> LocalLeaseStore::listen() { return std::make_unique<QuietListener>(); }

}  // namespace skyreels::server
