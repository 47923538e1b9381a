#include "server/webhook/webhook_sender.h"

#include <curl/curl.h>
#include <openssl/hmac.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "server/job/base64.h"
#include "server/store/job_lease.h"
#include "skyreels/v1/video_service.pb.h"

namespace skyreels::server {

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// The host of an http(s) URL, lower case, without port; "" when the URL is not one a webhook may use.
std::string host_of(const std::string& url, std::string* why) {
  const std::string l = lower(url);
  size_t start = 0;
  if (l.rfind("https://", 0) == 0) {
    start = 8;
  } else if (l.rfind("http://", 0) == 0) {
    start = 7;
  } else {
    *why = "webhook.url: only http:// and https:// URLs";
    return "";
  }
  const size_t end = l.find_first_of("/?#", start);
  const std::string authority = l.substr(start, end == std::string::npos ? std::string::npos : end - start);
  if (authority.find('@') != std::string::npos) {
    *why = "webhook.url: no user name or password in the URL";
    return "";
  }
  std::string host = authority;
  if (!host.empty() && host.front() == '[') {
    const size_t close = host.find(']');
    host = close == std::string::npos ? "" : host.substr(1, close - 1);
  } else if (const size_t colon = host.rfind(':'); colon != std::string::npos) {
    host = host.substr(0, colon);
  }
  if (host.empty()) *why = "webhook.url: no host";
  return host;
}

bool allowed(const std::string& host, const std::vector<std::string>& allow_hosts) {
  for (const std::string& pattern : allow_hosts) {
    const std::string p = lower(pattern);
    if (p == host) return true;
    if (p.size() > 2 && p.rfind("*.", 0) == 0) {
      const std::string suffix = p.substr(1);  // ".example.com"
      if (host.size() > suffix.size() && host.compare(host.size() - suffix.size(), suffix.size(), suffix) == 0) {
        return true;
      }
    }
  }
  return false;
}

// What a stored event delivers: its type, or "" when it is not a deliverable event or not asked for.
std::string type_of(const JobEvent& e, const JobState state, const std::set<std::string>& wanted) {
  std::string name;
  if (e.type == EventType::ChunkStarted && e.chunk == 0 && e.attempt == 0) name = "started";
  if (e.type == EventType::ChunkFinished) name = "chunk_finished";
  if (e.type == EventType::Finished) name = state == JobState::Succeeded ? "completed" : "failed";
  if (name.empty() || !wanted.count(name)) return "";
  return "video." + name;
}

std::string body_of(const std::string& webhook_id, const std::string& type, const std::string& job_id,
                    const JobEvent& e, const StoredJob& job) {
  nlohmann::json data = {{"id", job_id}, {"sequence", e.sequence}};
  if (e.chunk >= 0) {
    data["chunk_index"] = e.chunk;
    data["chunk_count"] = job.chunk_count;
  }
  if (e.type == EventType::Finished) {
    data["status"] = job_state_name(parse_job_state(job.state));
    if (!job.error.empty()) data["error"] = job.error;
  }
  const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(e.time.time_since_epoch()).count();
  return nlohmann::json{{"id", webhook_id}, {"object", "event"}, {"type", type}, {"created_at", created}, {"data", data}}
      .dump();
}

size_t discard(char*, size_t size, size_t count, void*) { return size * count; }

std::chrono::milliseconds backoff(const WebhookOptions& o, int attempts) {
  auto wait = o.first_retry;
  for (int i = 1; i < attempts && wait < o.max_retry; ++i) wait *= 2;
  return std::min(wait, o.max_retry);
}

}  // namespace

std::string check_webhook_url(const std::string& url, const std::vector<std::string>& allow_hosts) {
  if (url.size() > 2048) return "webhook.url: longer than 2048 bytes";
  std::string why;
  const std::string host = host_of(url, &why);
  if (host.empty()) return why;
  if (!allowed(host, allow_hosts)) return "webhook.url: host '" + host + "' is not in --webhook-allow-hosts";
  return "";
}

std::string check_webhook_events(const std::vector<std::string>& events) {
  const auto& names = webhook_event_names();
  for (const std::string& e : events) {
    if (std::find(names.begin(), names.end(), e) == names.end()) {
      return "webhook.events: '" + e + "' is not one of started, chunk_finished, completed, failed";
    }
  }
  return "";
}

std::string read_webhook_secret(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("--webhook-secret-file: cannot read '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  s.erase(0, s.find_first_not_of(" \t\r\n"));
  s.erase(s.find_last_not_of(" \t\r\n") + 1);
  if (s.rfind("whsec_", 0) == 0) {
    const auto key = base64_decode(s.substr(6));
    if (!key) throw std::runtime_error("--webhook-secret-file: '" + path + "' has a whsec_ secret that is not base64");
    s = *key;
  }
  if (s.size() < 16) throw std::runtime_error("--webhook-secret-file: the secret in '" + path + "' is under 16 bytes");
  return s;
}

std::string webhook_signature(const std::string& secret, const std::string& id, int64_t timestamp,
                              const std::string& body) {
  const std::string signed_text = id + "." + std::to_string(timestamp) + "." + body;
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(signed_text.data()), signed_text.size(), mac, &length);
  return "v1," + base64_encode(std::string(reinterpret_cast<const char*>(mac), length));
}

WebhookSender::WebhookSender(JobStore& store, LeaseStore& leases, WebhookOptions options, WebhookMetrics* metrics)
    : store_(store), leases_(leases), options_(std::move(options)), metrics_(metrics) {
  curl_global_init(CURL_GLOBAL_DEFAULT);
}

WebhookSender::~WebhookSender() {
  stop_following();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  scan_cv_.notify_all();
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void WebhookSender::start(EventStream* events) {
  if (events != nullptr) {  // before the jobs are read: a change after the read is heard
    following_ = true;
    subscription_ = Subscription(*events, events->subscribe([this](const SchedulerEvent& e) { consume(e); }));
  }
  std::vector<StoredJob> jobs;
  try {
    jobs = store_.load_jobs();
  } catch (const StoreError& e) {
    spdlog::warn("event=webhook_scan_failed error=\"{}\"", e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const StoredJob& job : jobs) followed_[job.id].next_check = Clock::now();  // those without a webhook drop out
    started_ = true;
  }
  threads_.emplace_back([this] { scan_loop(); });
  for (int i = 0; i < options_.workers; ++i) threads_.emplace_back([this] { work_loop(); });
}

void WebhookSender::look_at(const std::string& job_id, bool accepted_here) {
  std::lock_guard<std::mutex> lock(mu_);
  Followed& f = followed_[job_id];
  f.next_check = Clock::time_point::min();
  ++f.wakes;
  f.accepted_here = f.accepted_here || accepted_here;
  scan_cv_.notify_all();
}

void WebhookSender::stop_following() {
  subscription_.reset();  // outside mu_: consume() runs under the stream's lock and takes mu_
}

void WebhookSender::consume(const SchedulerEvent& event) {
  switch (event.kind) {
    case SchedulerEventKind::JobSubmitted:
      look_at(event.job_id, true);
      return;
    case SchedulerEventKind::ChunkStarted:
    case SchedulerEventKind::ChunkFinished:
    case SchedulerEventKind::JobFinished:
      look_at(event.job_id);
      return;
    case SchedulerEventKind::JobChanged:
      heard(event.job_id, false);
      return;
    case SchedulerEventKind::ChangesMissed:
      heard("", true);
      return;
    case SchedulerEventKind::JobStarted:  // a ChunkStarted comes with it
    case SchedulerEventKind::Handoff:
    case SchedulerEventKind::ChunkFailed:  // its retry event or the job's end comes as JobChanged
    case SchedulerEventKind::StepTimed:    // no webhook for progress
    case SchedulerEventKind::StepProgress:
    case SchedulerEventKind::PreviewMade:
    case SchedulerEventKind::LeaseTakeover:
    case SchedulerEventKind::ReplicaChanged:
    case SchedulerEventKind::ReplicaRecovered:
    case SchedulerEventKind::QueueChanged:
    case SchedulerEventKind::LookAgain:  // retries and takeovers keep timers of their own
      return;
  }
}

void WebhookSender::heard(const std::string& job_id, bool missed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (missed) {
    for (auto& [id, f] : followed_) {
      f.next_check = Clock::time_point::min();
      ++f.wakes;
    }
  } else if (auto it = followed_.find(job_id); it != followed_.end()) {
    it->second.next_check = Clock::time_point::min();
    ++it->second.wakes;
  } else {
    return;  // not followed: a job without deliveries left (or one this pod never followed)
  }
  scan_cv_.notify_all();
}

Clock::time_point WebhookSender::recheck(Clock::time_point now, Clock::duration period) const {
  return following_ ? Clock::time_point::max() : now + period;
}

// Reads the followed jobs that are due: changed (look_at, the feed), a retry or a takeover due, a failed read.
void WebhookSender::scan_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    const auto now = Clock::now();
    std::vector<std::string> due;
    auto next = recheck(now, options_.poll);
    for (const auto& [id, f] : followed_) {
      if (f.next_check <= now) due.push_back(id);
      else next = std::min(next, f.next_check);
    }
    if (due.empty()) {
      if (next == Clock::time_point::max()) {
        scan_cv_.wait(lock);  // nothing due: the next event, look_at() or delivery's end wakes it
      } else {
        scan_cv_.wait_until(lock, next);
      }
      continue;
    }
    lock.unlock();
    for (const std::string& id : due) scan(id, now);
    lock.lock();
  }
}

std::shared_ptr<const WebhookSender::Webhook> WebhookSender::webhook_of(const std::string& job_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = followed_.find(job_id); it != followed_.end() && it->second.read) return it->second.webhook;
  }
  const std::optional<std::string> bytes = store_.load_request(job_id);
  v1::SubmitJobRequest request;
  std::shared_ptr<const Webhook> webhook;
  if (bytes && request.ParseFromString(*bytes) && !request.webhook().url().empty()) {
    std::set<std::string> wanted(request.webhook().events().begin(), request.webhook().events().end());
    if (wanted.empty()) wanted = {"completed", "failed"};
    webhook = std::make_shared<const Webhook>(Webhook{request.webhook().url(), std::move(wanted)});
  }
  std::lock_guard<std::mutex> lock(mu_);
  Followed& f = followed_[job_id];
  f.read = true;
  f.webhook = webhook;
  return webhook;
}

// Reads one job's log: queues each delivery that is due, and stops following the job once every one has ended.
uint64_t WebhookSender::wakes_of(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  return followed_[job_id].wakes;
}

void WebhookSender::set_next_check(Followed& f, uint64_t wakes, Clock::time_point next) {
  f.next_check = f.wakes != wakes ? Clock::time_point::min() : next;
}

void WebhookSender::scan(const std::string& job_id, Clock::time_point now) {
  const uint64_t wakes = wakes_of(job_id);
  std::optional<StoredJob> job;
  std::shared_ptr<const Webhook> webhook;
  std::vector<StoredEvent> stored;
  try {
    job = leases_.load_job(job_id, false);
    if (job) webhook = webhook_of(job_id);
    if (webhook) stored = store_.load_events(job_id);
  } catch (const StoreError& e) {
    spdlog::warn("job={} event=webhook_read_failed error=\"{}\"", job_id, e.what());
    std::lock_guard<std::mutex> lock(mu_);
    set_next_check(followed_[job_id], wakes, now + options_.poll);
    return;
  }
  const JobState state = job ? parse_job_state(job->state) : JobState::Failed;
  if (!job || !webhook) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!job || is_terminal(state)) {
      followed_.erase(job_id);  // gone or ended
    } else {
      // No webhook: its next change looks again and drops it once it ended (maybe on another pod; without a feed, a
      // slow re-check does).
      set_next_check(followed_[job_id], wakes, recheck(now, std::chrono::minutes(1)));
    }
    return;
  }
  const std::set<std::string>& wanted = webhook->events;
  struct Progress {
    int attempts = 0;
    bool ended = false;
  };
  std::map<uint64_t, Progress> progress;
  std::vector<JobEvent> events;
  for (const StoredEvent& s : stored) {
    try {
      JobEvent e = decode_stored_event(s);
      if (e.type == EventType::Webhook) {
        Progress& p = progress[e.target];
        if (e.message == "attempting") {
          p.attempts = std::max(p.attempts, e.attempt);
        } else {
          p.ended = true;
        }
      } else {
        events.push_back(std::move(e));
      }
    } catch (const StoreError&) {  // an unreadable row is skipped, not retried forever
    }
  }
  // In order, one at a time per job: the first event not delivered yet goes when it is due, the later ones wait
  // for it (so a receiver sees started, the chunks, then the end, and a hanging one holds one sender thread at most).
  bool open = !is_terminal(state);
  auto next_check = recheck(now, options_.poll);  // a retry or takeover due sooner brings it forward
  bool mine = true;
  std::map<uint64_t, Followed::Pending> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Followed& f = followed_[job_id];
    mine = !leases_.shared() || f.accepted_here;
    pending.swap(f.pending);
  }
  const auto grace = mine ? Clock::duration::zero() : Clock::duration(options_.takeover_grace);
  std::map<uint64_t, Followed::Pending> still_pending;
  for (const JobEvent& e : events) {
    const std::string type = type_of(e, state, wanted);
    if (type.empty()) continue;
    const Progress& p = progress[e.sequence];
    if (p.ended) continue;
    open = true;
    Followed::Pending& seen = still_pending[e.sequence] = pending[e.sequence];
    if (seen.attempts != p.attempts) seen = {p.attempts, now};  // new here, or some pod made another attempt
    const Clock::duration wait = p.attempts == 0 ? Clock::duration::zero() : backoff(options_, p.attempts);
    const Clock::time_point due = seen.since + wait + grace;
    if (due > now) {
      next_check = std::min(next_check, due);
      break;
    }
    const std::string webhook_id = "msg_" + job_id + "_" + std::to_string(e.sequence);
    Delivery d{job_id, e.sequence, p.attempts + 1, webhook->url, type,
               body_of(webhook_id, type, job_id, e, *job)};
    std::lock_guard<std::mutex> lock(mu_);
    // A delivery of this job that ended after its log was read (its end moves `wakes`) may be this very one: the read
    // is stale and would send it again, so the job is read again at once instead (set_next_check below).
    if (followed_[job_id].wakes == wakes && busy_.insert(job_id).second) {
      queue_.push_back(std::move(d));
      work_cv_.notify_one();
    }
    break;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (open) {
    Followed& f = followed_[job_id];
    set_next_check(f, wakes, next_check);
    f.pending.swap(still_pending);
  } else {
    followed_.erase(job_id);
  }
}

void WebhookSender::work_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    Delivery d = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    deliver(d);
    lock.lock();
    busy_.erase(d.job_id);
    Followed& f = followed_[d.job_id];
    f.next_check = Clock::time_point::min();  // look again: the next retry, or the end
    ++f.wakes;
    scan_cv_.notify_all();
  }
}

void WebhookSender::record(const Delivery& d, const std::string& outcome, int status) {
  JobEvent e;
  e.type = EventType::Webhook;
  e.time = from_wall_ms(leases_.now_ms());
  e.target = d.target;
  e.attempt = d.attempt;
  e.message = outcome;
  e.status = status;
  leases_.append_events(d.job_id, {encode_stored_event(e)});  // StoreError: the caller's
}

void WebhookSender::deliver(const Delivery& d) {
  try {
    record(d, "attempting", 0);  // before the attempt: a crash after it still counts it
  } catch (const StoreError& e) {
    spdlog::warn("job={} event=webhook_record_failed error=\"{}\"", d.job_id, e.what());
    return;  // not recorded, not sent: the next scan tries again
  }
  const std::string webhook_id = "msg_" + d.job_id + "_" + std::to_string(d.target);
  const int64_t timestamp =
      std::chrono::duration_cast<std::chrono::seconds>(WallClock::now().time_since_epoch()).count();
  curl_slist* headers = nullptr;
  for (const std::string& h :
       {std::string("Content-Type: application/json"), "webhook-id: " + webhook_id,
        "webhook-timestamp: " + std::to_string(timestamp),
        "webhook-signature: " + webhook_signature(options_.secret, webhook_id, timestamp, d.body),
        "skyreels-webhook-attempt: " + std::to_string(d.attempt), std::string("User-Agent: skyreels-server")}) {
    headers = curl_slist_append(headers, h.c_str());
  }
  CURL* curl = curl_easy_init();
  long status = 0;
  CURLcode rc = CURLE_FAILED_INIT;
  if (curl != nullptr) {
    curl_easy_setopt(curl, CURLOPT_URL, d.url.c_str());
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, d.body.data());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE, static_cast<long>(d.body.size()));
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(options_.timeout.count()));
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(std::min<int64_t>(options_.timeout.count(), 5000)));
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 0L);  // a redirect could lead outside the allow-list
    curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &discard);
    rc = curl_easy_perform(curl);
    if (rc == CURLE_OK) curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(curl);
  }
  curl_slist_free_all(headers);
  const bool delivered = rc == CURLE_OK && status >= 200 && status < 300;
  const bool last = d.attempt >= options_.max_attempts;
  if (metrics_) metrics_->webhook_attempted(delivered ? "delivered" : last ? "abandoned" : "failed");
  if (!delivered) {
    spdlog::warn("job={} event=webhook_failed webhook_id={} attempt={} type={} status={} error=\"{}\"", d.job_id,
                 webhook_id, d.attempt, d.type, status, rc == CURLE_OK ? "" : curl_easy_strerror(rc));
  } else {
    spdlog::info("job={} event=webhook_delivered webhook_id={} attempt={} type={} status={}", d.job_id, webhook_id,
                 d.attempt, d.type, status);
  }
  if (!delivered && !last) return;  // the attempt is recorded: the next one is due after its back-off
  try {
    record(d, delivered ? "delivered" : "abandoned", static_cast<int>(status));
  } catch (const StoreError& e) {
    spdlog::warn("job={} event=webhook_record_failed error=\"{}\"", d.job_id, e.what());
  }
}

}  // namespace skyreels::server
