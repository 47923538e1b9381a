// skyreels-server's assembly: the store, the replicas, the encoders, the scheduler, the transports, signals and the
// drain, in the order they start (serve(), below). Its flags are server_flags.h's; `main` is server/main.cpp. The steps
// are split by concept (app_steps.h, internal): the model side in app_model.cpp, the transports in app_transport.cpp,
// signals, readiness and the drain in app_lifecycle.cpp.
//
// Shutdown (SIGTERM or SIGINT): readiness turns NOT_SERVING at once and new jobs are refused (UNAVAILABLE); jobs
// already accepted, queued ones included, keep running until they are all done or --drain-timeout-seconds passes;
// then whatever is left is stopped at its next denoising step and ends FAILED/UNAVAILABLE ("drain timeout"). After
// the last job ends, reads (GetJob, WatchJob, DownloadResult) are still answered for a short grace period so clients
// can collect results, then the gRPC server shuts down and the process exits 0. A second signal skips the wait.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/service_type.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <mutex>

#include "model/runtime.h"
#include "server/app/app.h"
#include "server/app/app_steps.h"
#include "server/app/server_flags.h"
#include "server/http/http_server.h"
#include "server/http/metrics_port.h"
#include "server/metrics/metrics.h"
#include "server/app/restore_job.h"
#include "server/queue/scheduler.h"
#include "server/store/job_store_timed.h"

namespace skyreels::server::assembly {

namespace {

std::chrono::milliseconds to_millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// The job store first: a store that cannot be used stops the start before a model is loaded. The leases hold the
// records; timing wraps the records once metrics exist (serve()).
std::unique_ptr<LeaseStore> open_store(const Options& o) {
  const std::string spec =
      o.job_store.empty() ? "sqlite:" + (std::filesystem::path(o.data_dir) / "jobs.sqlite").string() : o.job_store;
  std::unique_ptr<LeaseStore> leases = with_leases(open_job_store(spec, o.job_store_max_growth_pages));
  spdlog::info("event=job_store store={} durable={}", leases->records().describe(), leases->records().durable());
  return leases;
}

// Loud on purpose: a test server (--enable-test-hooks) must not pass for a production one in its log.
void announce_test_hooks(const Options& o) {
  if (!o.enable_test_hooks) return;
  std::string hooks;
  for (const std::string& hook : active_test_hooks(o)) hooks += (hooks.empty() ? "" : " ") + hook;
  spdlog::warn("event=test_hooks_enabled hooks=\"{}\" (--enable-test-hooks: jobs may fail or slow down on purpose; "
               "a test server, never a production one)",
               hooks);
}

// The one job queue over the store; payloads are re-created from the store (after a restart, where expired leases
// are taken over; on another pod; after this server evicted them).
std::unique_ptr<JobQueue> make_queue(const Options& o, Replicas& replicas, JobStore& store, LeaseStore& leases,
                                     const ServiceConfig& service_config) {
  PodOptions pod;
  pod.scheduling = o.scheduling;
  pod.pod = o.pod_name;
  pod.lease_ttl = to_millis(o.lease_seconds);
  auto loader = [&service_config](const StoredJob& job, std::vector<StoredChunk> chunks) {
    return restore_job(job, std::move(chunks), service_config.model, service_config.limits,
                       job_parts(service_config, service_config.text_encoder));
  };
  auto jobs = std::make_unique<Scheduler>(std::move(replicas.executors), pod, store, leases, loader);
  spdlog::info("event=scheduler store={} shared={} pod={} lease_seconds={}", store.describe(), leases.shared(),
               o.pod_name, o.lease_seconds);
  return jobs;
}

int serve(const Options& o, Signals& signals) {
  announce_test_hooks(o);
  const std::unique_ptr<LeaseStore> leases = open_store(o);
  const std::unique_ptr<CheckedModel> model = check_model(o);
  auto work_sink = std::make_shared<std::atomic<Metrics*>>(nullptr);
  Replicas replicas = make_replicas(o, *model, work_sink);

  // ---- metrics and the optional model parts ----
  Metrics metrics(replicas.names, SKYREELS_VERSION, skyreels::model::describe_loras(o.loras));
  metrics.set_test_hooks_enabled(o.enable_test_hooks);
  work_sink->store(&metrics);
  const std::shared_ptr<void> unsink(nullptr, [work_sink](void*) { work_sink->store(nullptr); });
  // The store as everything above uses it, timed (skyreels_job_store_seconds) from its first use on: the leases'
  // calls (claim, renew, commit, ...) and the records they hold (jobs, chunks, events, segments).
  TimedLeaseStore timed_leases(*leases, metrics.store_call_report());
  JobStore& store = timed_leases.records();
  ModelParts parts = load_model_parts(o, *model, replicas, store, metrics);
  const TextEncoderFn& text_encoder = parts.text_encoder;
  const std::unique_ptr<VideoEncoder>& video = parts.video;
  const std::shared_ptr<const ImageEncoder>& image_encoder = parts.image_encoder;
  std::unique_ptr<WebhookSender> webhooks = make_webhooks(o, store, timed_leases, metrics);
  const std::unique_ptr<http::HttpServer> metrics_port =
      http::serve_metrics(o.metrics_listen, [&metrics] { return metrics.render(); });

  // ---- the queue and the transport ----
  ApiKeys keys;
  if (!o.api_keys.empty()) {
    keys = ApiKeys::load(o.api_keys);
    spdlog::info("event=api_keys_loaded count={}", keys.size());
  }
  warn_about_exposure(o);
  ServiceConfig config = service_config(o, *model, replicas, keys, text_encoder, video.get(), metrics);
  config.image_encoder = image_encoder;
  if (webhooks) {
    config.check_webhook = [hosts = split_list(o.webhook_allow_hosts)](const std::string& url,
                                                                       const std::vector<std::string>& events) {
      std::string why = check_webhook_url(url, hosts);
      return why.empty() ? check_webhook_events(events) : why;
    };
  }
  // The service and the drain see only the JobQueue seam.
  std::unique_ptr<JobQueue> jobs = make_queue(o, replicas, store, timed_leases, config);
  // The queue's one stream of scheduler events, consumed by metrics, MP4s (every commit the queue sees, also those
  // of chunks another pod ran) and webhooks, each from now until the queue goes.
  EventStream& events = jobs->events();
  const Subscription metrics_events(events, events.subscribe([&metrics](const SchedulerEvent& e) { metrics.consume(e); }));
  if (video) {
    video->follow_with([&jobs](const std::string& id, const std::string& owner) { return jobs->get(id, owner); },
                       &events);
  }
  struct StopFollowing {  // destroyed before `jobs`, however serve() ends
    VideoEncoder* video;
    WebhookSender* webhooks;
    ~StopFollowing() {
      if (video) video->follow_with({}, nullptr);
      if (webhooks) webhooks->stop_following();
    }
  } stop_following{video.get(), webhooks.get()};
  jobs->start();
  if (webhooks) webhooks->start(&events);
  auto service = make_video_service(*jobs, config);
  int port = 0;
  const std::unique_ptr<grpc::Server> server = start_grpc(o, *service, config.max_request_bytes, metrics, &port);
  server->GetHealthCheckService()->SetServingStatus("", false);
  server->GetHealthCheckService()->SetServingStatus("liveness", true);
  spdlog::info("event=listening address={} port={} tls={} api_keys={} replicas={} version={}", o.listen, port,
               !o.tls_cert.empty(), keys.enabled(), replicas.names.size(), SKYREELS_VERSION);
  {
    std::lock_guard<std::mutex> lock(signals.mu);
    signals.on_reload = [&keys, catalogue = model->catalogue] {
      if (catalogue) rescan_adapters(*catalogue);
      keys.reload();
      spdlog::info("event=api_keys_loaded count={}", keys.size());
    };
  }

  Health health;
  std::unique_ptr<http::HttpServer> http_server = start_http(o, *server, health, metrics, config);
  serve_until_signal(o, signals, *jobs, *server, model->demo_dir, health);
  drain(o, signals, *jobs, *server, video.get(), health);
  {
    std::lock_guard<std::mutex> lock(signals.mu);
    signals.on_reload = nullptr;  // `keys` goes out of scope with this function
  }
  spdlog::info("event=shutdown");
  http_server.reset();  // its calls go through the gRPC server
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  return 0;
}

}  // namespace

}  // namespace skyreels::server::assembly

namespace skyreels::server {

using assembly::Options;
using assembly::serve;
using assembly::Signals;
using assembly::watch_signals;

int server_main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  Options options;
  try {
    bool print_flags = false;
    std::vector<char*> args{argv[0]};
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::cout << server_usage();
        return 0;
      }
      if (a == "--version") {
        std::cout << "skyreels-server " << SKYREELS_VERSION << "\n";
        return 0;
      }
      if (a == "--print-flags") {
        print_flags = true;
      } else {
        args.push_back(argv[i]);
      }
    }
    options = parse_server_flags(static_cast<int>(args.size()), args.data(), nullptr, !print_flags);
    if (print_flags) {
      std::cout << print_server_flags(options);
      return 0;
    }
  } catch (const UsageError& e) {
    std::cerr << "skyreels-server: " << e.what() << "\n\n" << server_usage();
    return 2;
  }
  const auto level = spdlog::level::from_str(options.log_level);
  spdlog::set_level(level == spdlog::level::off && options.log_level != "off" ? spdlog::level::info : level);

  Signals signals;
  try {
    watch_signals(signals);
    return serve(options, signals);
  } catch (const UsageError& e) {
    std::cerr << "skyreels-server: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    spdlog::critical("event=fatal error=\"{}\"", e.what());
    std::cerr << "skyreels-server: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace skyreels::server
