// What keeps one client from taking the server down: caps on open streams (in total and per client), a gate that
// bounds concurrent text encodes, the heap given back once the streams have gone, and escaping of client text before
// it reaches a log line (job/log_escape.h). No gRPC, no LibTorch.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "server/job/log_escape.h"  // log_escape, for every RPC family

namespace skyreels::server {

// Open long streams (WatchJob, DownloadResult, Generate). Each holds a server thread while it is open, so the caps
// keep a reserve of threads for unary calls and probes.
class StreamLimiter {
 public:
  enum class Refusal { None, Total, PerClient };
  class Slot;  // an open stream; releases its place when destroyed

  StreamLimiter(int64_t max_total, int64_t max_per_client) : max_total_(max_total), max_per_client_(max_per_client) {}
  // A place for one more stream of `client`, or nullptr with the reason in *why. `client_cap` overrides the per-client
  // cap (per API key).
  std::unique_ptr<Slot> acquire(const std::string& client, std::optional<int64_t> client_cap, Refusal* why);
  int64_t open() const;
  int64_t max_total() const { return max_total_; }
  int64_t max_per_client() const { return max_per_client_; }
  // Told the number of open streams after every change (a metrics gauge); set before the first acquire().
  void on_change(std::function<void(int64_t open)> observer) { observer_ = std::move(observer); }

 private:
  void release(const std::string& client);
  std::function<void(int64_t)> observer_;
  const int64_t max_total_;
  const int64_t max_per_client_;
  mutable std::mutex mu_;
  int64_t open_ = 0;
  std::map<std::string, int64_t> per_client_;
};

class StreamLimiter::Slot {
 public:
  Slot(StreamLimiter* owner, std::string client) : owner_(owner), client_(std::move(client)) {}
  ~Slot() { owner_->release(client_); }
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;

 private:
  StreamLimiter* owner_;
  std::string client_;
};

// Runs `trim` (runtime::release_free_heap) on a thread of its own `delay` after a request, once for a burst of them:
// the last open stream closing asks, so that what a crowd of watchers freed goes back to the kernel once they have
// left rather than staying in glibc's arenas (issue 46). Never on the thread that asks: a trim walks every arena.
class IdleTrimmer {
 public:
  explicit IdleTrimmer(std::function<void()> trim, std::chrono::milliseconds delay = std::chrono::seconds(1));
  ~IdleTrimmer();
  IdleTrimmer(const IdleTrimmer&) = delete;
  IdleTrimmer& operator=(const IdleTrimmer&) = delete;
  void request();

 private:
  void loop();
  const std::function<void()> trim_;
  const std::chrono::milliseconds delay_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool requested_ = false;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest exists
};

// A counting semaphore that never waits: try_enter() takes a place or says no (the caller answers
// RESOURCE_EXHAUSTED with a retry hint instead of holding a server thread in a queue).
class ConcurrencyGate {
 public:
  class Pass;
  explicit ConcurrencyGate(int64_t limit) : limit_(limit) {}
  std::unique_ptr<Pass> try_enter();
  int64_t limit() const { return limit_; }
  int64_t inside() const;

 private:
  const int64_t limit_;
  mutable std::mutex mu_;
  int64_t inside_ = 0;
};

class ConcurrencyGate::Pass {
 public:
  explicit Pass(ConcurrencyGate* gate) : gate_(gate) {}
  ~Pass();
  Pass(const Pass&) = delete;
  Pass& operator=(const Pass&) = delete;

 private:
  ConcurrencyGate* gate_;
};

// The address part of a gRPC peer string ("ipv4:127.0.0.1:5000" -> "ipv4:127.0.0.1", "ipv6:[::1]:5000" ->
// "ipv6:[::1]"): the identity of a client that presents no API key.
std::string peer_host(const std::string& peer);

}  // namespace skyreels::server
