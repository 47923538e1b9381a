// What the gRPC service reports, declared where it reports it (Metrics implements it; the process wires it in), so
// that api/ never includes the metrics registry. Also the label values it reports with. Torch-free.
#pragma once

#include <cstdint>
#include <string>

namespace skyreels::server {

// Rejection reasons (label values of skyreels_jobs_rejected_total).
inline constexpr const char* kRejectInvalidArgument = "invalid_argument";
inline constexpr const char* kRejectQueueFull = "queue_full";
inline constexpr const char* kRejectUnauthenticated = "unauthenticated";
inline constexpr const char* kRejectDraining = "draining";
inline constexpr const char* kRejectClientLimit = "client_limit";  // per-client job cap or max_priority
inline constexpr const char* kRejectEncoderBusy = "encoder_busy";  // --max-concurrent-encodes reached
// Reasons of skyreels_streams_rejected_total.
inline constexpr const char* kStreamRejectTotal = "total";
inline constexpr const char* kStreamRejectPerClient = "per_client";

class ApiMetrics {
 public:
  virtual ~ApiMetrics() = default;
  virtual void rejected(const std::string& reason) = 0;         // a submission refused (kReject*)
  virtual void stream_rejected(const std::string& reason) = 0;  // a stream refused by a cap (kStreamReject*)
  virtual void set_streams_open(int64_t open) = 0;
  virtual void text_encoded(double seconds) = 0;  // one text prompt encode in the submitting call
  // Previews a watcher skipped because it was still sending an older one (a slow watcher drops previews, never events).
  virtual void previews_dropped(int64_t count) = 0;
  virtual void vae_call(const char* op, double seconds) = 0;  // "encode": conditioning frames to latents
  // One RPC, as go-grpc-prometheus counts it: started, then handled with its code (grpc::StatusCode) and duration.
  // `type` is unary / client_stream / server_stream / bidi_stream; `service` and `method` as in "/service/method".
  virtual void rpc_started(const std::string& type, const std::string& service, const std::string& method) = 0;
  virtual void rpc_handled(const std::string& type, const std::string& service, const std::string& method, int code,
                           double seconds) = 0;
};

}  // namespace skyreels::server
