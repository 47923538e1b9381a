// Internal to app/ (included by server/app/app*.cpp only): the start-up steps server_main's serve() runs in order,
// split by concept. app.cpp: server_main, serve() itself, the job store and the job queue; app_model.cpp: the checked
// model, the replicas, the optional model parts and what the service knows of them (ServiceConfig); app_transport.cpp:
// TLS, the gRPC server, the HTTP door, webhooks; app_lifecycle.cpp: signals, readiness and liveness until a signal,
// the drain.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include "model/adapter_bank.h"
#include "model/lora.h"
#include "model/transformer_loader.h"
#include "server/api/auth.h"
#include "server/api/service.h"
#include "server/app/server_flags.h"
#include "server/media/encoders.h"
#include "server/metrics/metrics.h"
#include "server/replica/replica.h"
#include "server/store/job_lease.h"
#include "server/store/job_store.h"
#include "server/webhook/webhook_sender.h"

#ifndef SKYREELS_VERSION
#define SKYREELS_VERSION "dev"
#endif

namespace grpc {
class Server;
class Service;
}  // namespace grpc

namespace skyreels::server::http {
class HttpServer;
}  // namespace skyreels::server::http

namespace skyreels::server::assembly {

using Options = ServerOptions;

// ---- signals, readiness and the drain (app_lifecycle.cpp) ------------------------------------------------------

// SIGTERM / SIGINT, counted; SIGHUP calls on_reload (looks at --lora-dir again, re-reads the API key file).
struct Signals {
  std::mutex mu;
  std::condition_variable cv;
  int count = 0;
  int last = 0;
  std::function<void()> on_reload;  // set under mu
};

void watch_signals(Signals& signals);

// What the health service says, for the HTTP probes too.
struct Health {
  std::atomic<bool> ready{false};
  std::atomic<bool> live{true};
};

struct TempDir {
  std::string path;
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// Until a signal: readiness follows the queue and whether unary calls are answered, liveness the replicas.
void serve_until_signal(const Options& o, Signals& signals, JobQueue& jobs, grpc::Server& server, TempDir& demo_dir,
                        Health& state);

// Readiness off, no new jobs; admitted ones finish within the drain timeout, else they stop (kept in the store).
void drain(const Options& o, Signals& signals, JobQueue& jobs, grpc::Server& server, VideoEncoder* video,
           Health& state);

// ---- the model side (app_model.cpp) ------------------------------------------------------------------------------

// The transformer checkpoint (or the demo's tiny one) and the LoRA adapters, checked before any replica loads.
struct CheckedModel {
  TempDir demo_dir;  // the demo's weights, removed once every replica holds them
  std::string path;
  skyreels::model::MappedTransformerCheckpoint mapped;
  std::vector<skyreels::model::LoraAdapter> adapters;  // only checked here: the replicas read their own copies
  std::shared_ptr<const skyreels::model::AdapterCatalogue> catalogue;  // --lora-dir, shared by every replica
  std::vector<float> magcache_ratios;  // --magcache-ratios (cond context), checked against the model
};

std::unique_ptr<CheckedModel> check_model(const Options& o);
// SIGHUP: the whole --lora-dir looked at again (new, changed and removed files); a failure is logged, not thrown.
void rescan_adapters(const skyreels::model::AdapterCatalogue& catalogue);

// One ModelReplica per planned device. Metrics come later (`work_sink`); replicas only report once they run chunks.
struct Replicas {
  std::vector<ReplicaOptions> plans;
  std::vector<FaultRule> faults;
  std::vector<std::unique_ptr<ChunkExecutor>> executors;
  std::vector<std::string> names;
  std::vector<ReplicaDescription> descriptions;
};

Replicas make_replicas(const Options& o, const CheckedModel& model,
                       const std::shared_ptr<std::atomic<Metrics*>>& work_sink);

// The model's parts besides the transformer, each loaded once when its flag names it, its load time reported.
struct ModelParts {
  TextEncoderFn text_encoder;
  std::unique_ptr<VideoEncoder> video;
  std::shared_ptr<const ImageEncoder> image_encoder;
};

ModelParts load_model_parts(const Options& o, const CheckedModel& model, const Replicas& replicas, JobStore& store,
                            Metrics& metrics);

// What the transport knows of the model, the limits and the optional parts.
ServiceConfig service_config(const Options& o, const CheckedModel& model, const Replicas& replicas,
                             const ApiKeys& keys, TextEncoderFn text_encoder, VideoEncoder* video,
                             Metrics& metrics);

// ---- the transports and webhooks (app_transport.cpp) -----------------------------------------------------------

// Configurations that work but expose more than an operator may think.
void warn_about_exposure(const Options& o);

std::unique_ptr<grpc::Server> start_grpc(const Options& o, grpc::Service& service, int64_t max_request_bytes,
                                         Metrics& metrics, int* port);

std::vector<std::string> split_list(const std::string& text);

// Webhook deliveries (--webhook-secret-file, --webhook-allow-hosts), from the job store's event logs.
std::unique_ptr<WebhookSender> make_webhooks(const Options& o, JobStore& store, LeaseStore& leases, Metrics& metrics);

// The HTTP door (--http-listen): its calls go into the gRPC service over the in-process channel.
std::unique_ptr<http::HttpServer> start_http(const Options& o, grpc::Server& server, const Health& health,
                                             Metrics& metrics, const ServiceConfig& service);

}  // namespace skyreels::server::assembly
