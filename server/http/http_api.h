// The HTTP door into the service (--http-listen): OpenAI's Videos API (/v1/videos), the service's own API in JSON
// (/skyreels/v1/...), the probes (/healthz, /readyz) and /metrics. Every job call goes through the gRPC service over the server's in-process channel, so HTTP gets the
// very same authentication, per-client caps, admission and answers as gRPC (one implementation of each); this layer
// only maps requests and statuses. The client's address travels as metadata only this process can send (inproc).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "server/http/http_server.h"

namespace grpc {
class Channel;
}

namespace skyreels::server::http {

struct HttpApiConfig {
  std::function<bool()> ready;  // readiness and liveness as the gRPC health service reports them
  std::function<bool()> live;
  std::function<std::string()> metrics;  // the Prometheus exposition
  // Each answer: the route's template, the status, seconds from the request to its answer (may be unset).
  std::function<void(const std::string& route, int status, double seconds)> observe;
  bool vae_available = false;            // jobs made here produce MP4 as they go
  int64_t result_ttl_seconds = 86400;    // expires_at of a finished video
  std::string model_id = "skyreels-v2-df";
  int64_t call_timeout_ms = 30000;       // deadline of every call into the service
  int64_t download_timeout_ms = 300000;  // of a video download (the VAE may still be making its last segment)
};

class HttpApi {
 public:
  HttpApi(std::shared_ptr<grpc::Channel> channel, HttpApiConfig config);
  ~HttpApi();
  Response handle(const Request& request) const;  // answers and reports it to config.observe
  // What the listener answers by itself (413, a malformed multipart): OpenAI's error shape.
  static Response refuse(int status, const std::string& message);

  struct Impl;

 private:
  Response route(const Request& request, std::string* route) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace skyreels::server::http
