// gRPC server interceptors of the transport: malformed requests answered INVALID_ARGUMENT, every RPC counted and
// timed (grpc_server_* metrics).
#pragma once

#include <memory>

namespace grpc::experimental {
class ServerInterceptorFactoryInterface;
}  // namespace grpc::experimental

namespace skyreels::server {

class ApiMetrics;

// A server interceptor that turns gRPC's answer to a request it could not parse (INTERNAL with an empty message: a
// malformed protobuf, or a string field that is not UTF-8) into INVALID_ARGUMENT saying so.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> make_malformed_request_interceptor();
// Counts and times every RPC into `metrics` (grpc_server_started_total, grpc_server_handled_total, ...).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> make_rpc_metrics_interceptor(
    ApiMetrics& metrics);

}  // namespace skyreels::server
