// Chunk leases for a store only this server uses (memory, SQLite): the LeaseStore seam PostgreSQL offers many pods,
// kept in this process and written through to the store, so that one server runs the very scheduler a fleet runs.
//
// It holds the store (records()): the job rows (without their requests), their events and the leases live here, and
// every change, the leases' own and those made through records(), is written to the wrapped store as it happens
// (results and requests are read back from it). Opening over a durable store reads its
// jobs back: a job that was running when the server died has an expired lease, so its chunk is taken over (counted
// as a retry) like a dead pod's; a job killed between its last commit and its end is ended here, with
// `finished_event` (the scheduler's encoding of its Finished event: the store does not know the encoding). The clock is
// this process's wall clock. Event numbers of an unfinished job continue past every number it can have handed out
// before (step events are numbered but never stored), so that a watcher resuming with after_sequence misses nothing.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "server/store/job_lease.h"
#include "server/store/job_store.h"

namespace skyreels::server {

class LocalLeaseStore final : public LeaseStore {
 public:
  // Step events one chunk can number (LeaseStore::reserve_sequences): more than any chunk's rows (limits.h).
  static constexpr uint64_t kStepNumbersPerChunk = 1 << 16;

  // Both read the store's jobs back (StoreError when they cannot be read); `borrowed` must outlive this.
  LocalLeaseStore(std::unique_ptr<JobStore> owned, std::string finished_event);
  LocalLeaseStore(JobStore& borrowed, std::string finished_event);
  ~LocalLeaseStore() override;

  // The records as this store's leases see them: written through to the wrapped store; rows and events are answered
  // from here.
  JobStore& records() override { return records_; }

  // LeaseStore
  SKYREELS_LEASE_STORE_CALLS;
  bool shared() const override { return false; }
  std::unique_ptr<ChangeListener> listen() override;  // hears nothing: no other process writes here
  bool reachable() const override { return true; }  // a failing call is the caller's StoreError

 private:
  struct Entry {
    StoredJob job;  // without the request
    std::vector<StoredEvent> events;
    uint64_t next_sequence = 1;
    bool inserting = false;  // admitted, being written to the store: counted and keyed, not yet visible
    bool cancel_requested = false;
    std::string last_replica;  // ran the previous chunk
    // The lease: held when `leased`; live until expires_ms; `committing`: its result is being written (never expires).
    bool leased = false, committing = false;
    uint64_t token = 0;
    std::string lease_replica;
    int64_t expires_ms = 0;
  };
  struct Client {
    int64_t service = 0;
    int weight = 1;
  };

  // records(): every change goes through here first (the rows and events kept here), then to the wrapped store.
  class Records final : public JobStore {
   public:
    explicit Records(LocalLeaseStore& leases) : leases_(leases) {}
    std::string describe() const override;
    bool durable() const override;
    SKYREELS_JOB_STORE_CALLS;

   private:
    LocalLeaseStore& leases_;
  };

  void read_back(const std::string& finished_event);
  Entry* visible_locked(const std::string& job_id);
  const Entry* visible_locked(const std::string& job_id) const;
  bool ready_locked(const Entry& e, int64_t now) const;
  policy::AdmissionFacts admission_facts_locked(const std::string& client, const std::string& id) const;
  AdmissionCounts counts_locked(const std::string& client) const;  // unfinished jobs (being inserted too)
  uint64_t append_locked(Entry& e, const std::string& data);  // stored at once; returns its number

  std::unique_ptr<JobStore> owned_;
  JobStore& inner_;
  mutable std::mutex mu_;
  std::condition_variable inserted_;  // an insert finished (stored or refused)
  std::map<std::string, Entry> jobs_;
  std::map<std::pair<std::string, std::string>, std::string> keys_;  // (owner, idempotency key) -> id
  std::map<std::string, Client> clients_;
  std::set<std::string> dropped_;  // ids dropped while this process ran (never issued again)
  uint64_t next_order_ = 1;
  Records records_{*this};
};

}  // namespace skyreels::server
