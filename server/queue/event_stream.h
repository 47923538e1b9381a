// The one stream of scheduler events (scheduler_event.h): the job queue publishes, consumers subscribe. It replaces
// the observer hooks, their hand-written fan-out, the feed of job changes and the hub's per-job watcher lists: an
// event travels one way, and a consumer reads every kind through one function.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "server/queue/scheduler_event.h"

namespace skyreels::server {

class EventStream {
 public:
  // Runs on the publishing thread, with locks of the queue and of this stream held: note the record, wake a thread of
  // your own, never call back into the queue or the stream.
  using Consumer = std::function<void(const SchedulerEvent&)>;

  // `consumer` hears every record published from now on; with `job_id`, only the records of that job and those about
  // every job (about_every_job()).
  uint64_t subscribe(Consumer consumer, const std::string& job_id = {});
  // Returns once the consumer is not running and will not run again (an unknown token: nothing).
  void unsubscribe(uint64_t token);
  void publish(const SchedulerEvent& event) const;

 private:
  mutable std::mutex mu_;  // held while a record is delivered, so that unsubscribe() waits for it
  std::map<uint64_t, Consumer> all_;
  std::map<std::string, std::map<uint64_t, Consumer>> by_job_;
  std::map<uint64_t, std::string> job_of_;  // tokens of by_job_
  uint64_t next_token_ = 1;
};

// Unsubscribes when it goes (a consumer whose lifetime is a scope).
class Subscription {
 public:
  Subscription() = default;
  Subscription(EventStream& stream, uint64_t token) : stream_(&stream), token_(token) {}
  Subscription(Subscription&& other) noexcept : stream_(other.stream_), token_(other.token_) { other.stream_ = nullptr; }
  Subscription& operator=(Subscription&& other) noexcept;
  Subscription(const Subscription&) = delete;
  Subscription& operator=(const Subscription&) = delete;
  ~Subscription() { reset(); }
  void reset();

 private:
  EventStream* stream_ = nullptr;
  uint64_t token_ = 0;
};

}  // namespace skyreels::server
