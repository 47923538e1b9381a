// The one feed of job changes: every change of every job, those made on this pod and those other pods commit (heard
// through the store's one ChangeListener). Followers outside the queue (the MP4 encoder, the webhook sender) follow
// it instead of polling the store on timers of their own. No store, no gRPC: a leaf media/ and webhook/ include.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace skyreels::server {

struct JobChange {
  std::string job_id;   // empty when `missed`
  bool missed = false;  // changes may have been lost (the store's listener was re-made): re-read what you follow
};

class JobFeed {
 public:
  using Follower = std::function<void(const JobChange&)>;
  virtual ~JobFeed() = default;
  // `follower` hears every job change from now on. It runs on the thread that made or heard the change, with the
  // queue's lock held, so it must only note the change and wake a thread of its own (never call the queue). A
  // follower catches up by itself when it starts: what changed before follow() is not replayed.
  virtual uint64_t follow(Follower follower) = 0;
  // Returns once the follower is not running and will not run again.
  virtual void unfollow(uint64_t token) = 0;
};

}  // namespace skyreels::server
