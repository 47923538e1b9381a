#include "server/api/guards.h"

#include <algorithm>
#include <cstdio>

namespace skyreels::server {

std::unique_ptr<StreamLimiter::Slot> StreamLimiter::acquire(const std::string& client,
                                                            std::optional<int64_t> client_cap, Refusal* why) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t& mine = per_client_[client];
  if (mine >= client_cap.value_or(max_per_client_)) {
    if (mine == 0) per_client_.erase(client);
    *why = Refusal::PerClient;
    return nullptr;
  }
  if (open_ >= max_total_) {
    if (mine == 0) per_client_.erase(client);
    *why = Refusal::Total;
    return nullptr;
  }
  ++mine;
  ++open_;
  if (observer_) observer_(open_);
  *why = Refusal::None;
  return std::make_unique<Slot>(this, client);
}

void StreamLimiter::release(const std::string& client) {
  std::lock_guard<std::mutex> lock(mu_);
  --open_;
  if (observer_) observer_(open_);
  auto it = per_client_.find(client);
  if (it != per_client_.end() && --it->second <= 0) per_client_.erase(it);
}

IdleTrimmer::IdleTrimmer(std::function<void()> trim, std::chrono::milliseconds delay)
    : trim_(std::move(trim)), delay_(delay), thread_([this] { loop(); }) {}

IdleTrimmer::~IdleTrimmer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void IdleTrimmer::request() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    requested_ = true;
  }
  cv_.notify_all();
}

// Waits for a request, lets the burst pass (`delay`, the requests in it join this one), then trims.
void IdleTrimmer::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return requested_ || stopping_; });
    if (stopping_ || cv_.wait_for(lock, delay_, [&] { return stopping_; })) return;
    requested_ = false;
    lock.unlock();
    trim_();
    lock.lock();
  }
}

int64_t StreamLimiter::open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_;
}

std::unique_ptr<ConcurrencyGate::Pass> ConcurrencyGate::try_enter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (inside_ >= limit_) return nullptr;
  ++inside_;
  return std::make_unique<Pass>(this);
}

int64_t ConcurrencyGate::inside() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inside_;
}

ConcurrencyGate::Pass::~Pass() {
  std::lock_guard<std::mutex> lock(gate_->mu_);
  --gate_->inside_;
}

std::string peer_host(const std::string& peer) {
  const auto colon = peer.rfind(':');
  const auto scheme = peer.find(':');
  if (colon == std::string::npos || colon == scheme) return peer;  // "unix:/path" and the like
  return peer.substr(0, colon);
}

}  // namespace skyreels::server
