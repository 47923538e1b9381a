// The gRPC transport: skyreels.v1.VideoService on top of a JobQueue. Converts messages, authenticates, maps
// errors to status codes; no policy and no model code here.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "server/api/auth.h"
#include "server/queue/job_queue.h"
#include "server/api/api_metrics.h"
#include "server/replica/model_job.h"

namespace skyreels::model {
class AdapterCatalogue;
}  // namespace skyreels::model

namespace grpc {
class Service;
class Server;
namespace experimental {
class ServerInterceptorFactoryInterface;
}
}  // namespace grpc

namespace skyreels::server {

struct ReplicaDescription {
  std::string name;
  std::string device;
  int threads = 0;
  std::vector<std::string> devices;  // a replica of several devices: rank r's is devices[r]
  std::string parallel = "cfg=1,ulysses=1";
};

// The model as GetServerInfo describes it, beside its transformer config (ServiceConfig::model).
struct ModelSummary {
  std::string source;  // path or "demo"
  std::string dtype;
  int64_t parameter_count = 0;
  struct Lora {
    std::string path;
    double scale = 1.0;
    std::string format;
    int64_t parameters = 0;
    int64_t max_rank = 0;
  };
  std::vector<Lora> loras;  // --lora adapters merged at load, in order
};

// Caps that keep one client from starving the others or the server (flags of the same names; defaults here only).
struct TransportLimits {
  int64_t max_streams = 256;            // --max-streams: open WatchJob/DownloadResult/Generate streams in total
  int64_t max_streams_per_client = 16;  // --max-streams-per-client (an API key line's max_streams overrides)
  int64_t max_concurrent_encodes = 2;   // --max-concurrent-encodes: text prompts encoded at once
  static constexpr int kUnaryThreadReserve = 64;  // server threads streams can never take
  // The sync server's thread cap: an open DownloadResult or Generate holds a thread (WatchJob, a callback stream, does
  // not), so even --max-streams of them leave the reserve to unary calls and probes.
  int max_threads() const { return static_cast<int>(max_streams) + kUnaryThreadReserve; }
};

struct ServiceConfig {
  std::string version;
  ServerLimits limits;
  ModelDescription model;
  ModelSummary summary;
  std::vector<ReplicaDescription> replicas;
  int64_t max_request_bytes = 64 << 20;
  bool vae_available = false;
  // Starts (or keeps) the MP4 decode of a job's chunks: called when a job asks for MP4 at submit or when an MP4
  // download finds a segment missing from the job store. Unset without a VAE.
  std::function<void(const JobSnapshot&)> want_video;
  // Waits (until the deadline given) for segment `chunk` of job `id` to be stored (VideoEncoder::wait_segment). Unset
  // without a VAE.
  std::function<SegmentWait(const std::string& id, int64_t chunk, Clock::time_point until)> wait_video;
  TextEncoderFn text_encoder;  // unset: text prompts answer FAILED_PRECONDITION
  std::shared_ptr<const model::WanVae>
      vae;  // encodes image / video conditioning; null: they answer FAILED_PRECONDITION
  std::shared_ptr<const ImageEncoder> image_encoder;  // the i2v pipeline's CLIP encoder; null: i2v answers
                                                      // FAILED_PRECONDITION
  std::shared_ptr<const model::AdapterCatalogue> adapters;  // --lora-dir; null: loras answer FAILED_PRECONDITION
  size_t max_resident_adapters = 0;                          // --max-resident-adapters (GetServerInfo)
  const ApiKeys* api_keys = nullptr;
  ApiMetrics* metrics = nullptr;
  TransportLimits transport;
  bool test_hooks_enabled = false;      // --enable-test-hooks (GetServerInfo)
  std::vector<std::string> test_hooks;  // the test hooks in effect, "--step-delay-ms=50" (GetServerInfo)
  // Why a job's webhook (URL, event names) is refused, "" when it is fine; unset: this server sends no webhooks.
  std::function<std::string(const std::string& url, const std::vector<std::string>& events)> check_webhook;
};

// What a job may use of this server's model parts, with `text_encoder` (the submit path's is gated).
JobParts job_parts(const ServiceConfig& config, TextEncoderFn text_encoder);

// The skyreels.v1.VideoService implementation, to register with a grpc::ServerBuilder. `jobs` must outlive it.
std::unique_ptr<grpc::Service> make_video_service(JobQueue& jobs, ServiceConfig config);

}  // namespace skyreels::server
