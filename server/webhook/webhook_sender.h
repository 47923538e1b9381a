// Webhooks: a job's events POSTed to the URL it gave (SubmitJobRequest.webhook), signed as Standard Webhooks (the
// scheme OpenAI's webhooks use): headers webhook-id, webhook-timestamp and webhook-signature = "v1," + base64 of
// HMAC-SHA256(secret, id + "." + timestamp + "." + body).
//
// The outbox is the job's own event log in the job store, so it is as durable as the job: each deliverable event
// (the first chunk started, a chunk finished, the job completed or failed) has one webhook-id
// ("msg_<job id>_<event sequence>") for good; every attempt is recorded in the log before it is made (a
// WebhookDelivery event, attempt N), and its end after (delivered, or abandoned once retries are exhausted). After a
// crash or restart the sender reads the logs again and carries on: nothing is lost, and an event that reaches the
// receiver twice does so under the same webhook-id with a higher attempt number (header skyreels-webhook-attempt),
// which the log recorded. Deliveries run on the sender's own threads with a timeout each, so a slow or dead receiver
// delays nothing but its own retries; retries back off exponentially up to a cap.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server/queue/event_stream.h"
#include "server/queue/job_types.h"
#include "server/store/job_lease.h"
#include "server/store/job_store.h"
#include "server/webhook/webhook_metrics.h"

namespace skyreels::server {


struct WebhookOptions {
  std::string secret;                    // the signing key's bytes (read_webhook_secret)
  std::vector<std::string> allow_hosts;  // host names a webhook may call: exact, or "*.example.com"
  int max_attempts = 8;
  std::chrono::milliseconds first_retry{1000};  // then twice as long each time, up to max_retry
  std::chrono::milliseconds max_retry{60000};
  std::chrono::milliseconds timeout{10000};     // one attempt, connection included
  // After a store read failed, the job is read again this much later. Changes wake the sender through the queue's
  // feed (start()); without one (no queue), followed jobs are also read again this often.
  std::chrono::milliseconds poll{1000};
  // Shared store (pods on PostgreSQL): a job's deliveries are the pod's that accepted it; another pod makes an
  // attempt only this long after it was due (the accepting pod stopped, or is gone).
  std::chrono::milliseconds takeover_grace{30000};
  int workers = 4;                              // deliveries at once
};

// The webhook event filter names, and the event type each delivers.
inline const std::vector<std::string>& webhook_event_names() {
  static const std::vector<std::string> names = {"started", "chunk_finished", "completed", "failed"};
  return names;
}

// "" when a webhook may call `url` (http or https, a host in the allow-list, no user info), else why not.
std::string check_webhook_url(const std::string& url, const std::vector<std::string>& allow_hosts);
// "" when every name is one of webhook_event_names(), else why not.
std::string check_webhook_events(const std::vector<std::string>& events);
// The key in --webhook-secret-file: "whsec_" + base64 (as Standard Webhooks and OpenAI print secrets) is decoded;
// anything else is used as it is (surrounding whitespace removed). Throws std::runtime_error.
std::string read_webhook_secret(const std::string& path);
// "v1," + base64(HMAC-SHA256(secret, id.timestamp.body)).
std::string webhook_signature(const std::string& secret, const std::string& id, int64_t timestamp,
                              const std::string& body);

class WebhookSender {
 public:
  // `store` (the records of `leases`, or a wrapper of them) and `leases` outlive the sender; `metrics` may be null.
  WebhookSender(JobStore& store, LeaseStore& leases, WebhookOptions options, WebhookMetrics* metrics = nullptr);
  ~WebhookSender();
  // Reads every stored job with a webhook (deliveries a restart interrupted), then consumes `events` (JobQueue::
  // events(), may be null): this pod's jobs as they are submitted, start and finish chunks and end, and every change
  // of a followed job, other pods' too; ChangesMissed reads every followed job again. stop_following() before the
  // stream goes.
  void start(EventStream* events = nullptr);
  void stop_following();
  void consume(const SchedulerEvent& event);

 private:
  struct Delivery {
    std::string job_id;
    uint64_t target = 0;  // the event's sequence
    int attempt = 1;
    std::string url;
    std::string type;
    std::string body;
  };
  struct Webhook {
    std::string url;
    std::set<std::string> events;  // the filter names wanted
  };
  struct Followed {
    Clock::time_point next_check;
    // Counts the calls that asked for a look (a change, a delivery's end): a scan that ran meanwhile read too early,
    // so it leaves the job due instead of writing its own next check over the request.
    uint64_t wakes = 0;
    bool accepted_here = false;
    // The job's webhook, read once from its stored request (which may be megabytes of embeddings); `read` with a
    // null `webhook`: the job has none (kept until the job ends, so that its events read no request again).
    bool read = false;
    std::shared_ptr<const Webhook> webhook;
    // Per undelivered event: its attempts so far and when this pod first saw that count, on this pod's monotonic
    // clock. Retries and takeovers wait from there, never from another pod's wall-clock times (a pod whose clock
    // runs ahead would take over live deliveries at once).
    struct Pending {
      int attempts = -1;
      Clock::time_point since;
    };
    std::map<uint64_t, Pending> pending;
  };
  // The job's webhook from its stored request; null when it has none. StoreError when the store cannot answer.
  std::shared_ptr<const Webhook> webhook_of(const std::string& job_id);

  void look_at(const std::string& job_id, bool accepted_here = false);
  void heard(const std::string& job_id, bool missed);  // a followed job (every one, `missed`) is read again now
  // When a followed job with nothing due is read again: never with a feed (its next change wakes it), else `period`.
  Clock::time_point recheck(Clock::time_point now, Clock::duration period) const;
  void scan_loop();
  void scan(const std::string& job_id, Clock::time_point now);
  uint64_t wakes_of(const std::string& job_id);
  // The next check a scan asks for, unless a wake came while it read (f.wakes moved on from `wakes`): then at once.
  static void set_next_check(Followed& f, uint64_t wakes, Clock::time_point next);
  void work_loop();
  void deliver(const Delivery& delivery);
  void record(const Delivery& delivery, const std::string& outcome, int status);

  JobStore& store_;
  LeaseStore& leases_;
  WebhookOptions options_;
  WebhookMetrics* metrics_;
  std::mutex mu_;
  std::condition_variable scan_cv_, work_cv_;
  std::map<std::string, Followed> followed_;        // jobs with deliveries not all ended
  std::set<std::string> busy_;                       // jobs with a delivery queued or in flight
  std::deque<Delivery> queue_;
  bool stopping_ = false;
  bool started_ = false;
  std::vector<std::thread> threads_;
  Subscription subscription_;  // start() and stop_following(), on the caller's thread
  bool following_ = false;  // set by start(), before its threads: the stream wakes followed jobs
};

}  // namespace skyreels::server
