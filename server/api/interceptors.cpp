#include "server/api/interceptors.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <memory>
#include <string>

#include "server/api/api_metrics.h"
#include "skyreels/v1/video_service.grpc.pb.h"

namespace skyreels::server {

using grpc::Status;
using grpc::StatusCode;

namespace {

// gRPC answers a request message it cannot deserialize with INTERNAL and the parser's (empty, for proto3) error
// string before any handler runs. Our handlers never send INTERNAL without a message, so that pair means "bad input".
class MalformedRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const Status status = methods->GetSendStatus();
      if (status.error_code() == StatusCode::INTERNAL && status.error_message().empty()) {
        methods->ModifySendStatus(Status(StatusCode::INVALID_ARGUMENT,
                                         "request: not a valid message of this method (malformed protobuf, or a "
                                         "string field that is not UTF-8)"));
      }
    }
    methods->Proceed();
  }
};

class MalformedRequestInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo*) override {
    return new MalformedRequestInterceptor();
  }
};

// grpc_server_* metrics per RPC (Metrics::rpc_started / rpc_handled): its status as the client gets it (after the
// malformed-request rewrite), timed from the interceptor's creation at the call's start. A call that ends without
// sending a status (the client went away) counts as Canceled.
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(ApiMetrics& metrics, std::string type, std::string service, std::string method)
      : metrics_(metrics), type_(std::move(type)), service_(std::move(service)), method_(std::move(method)) {
    metrics_.rpc_started(type_, service_, method_);
  }
  ~RpcMetricsInterceptor() override {
    if (!handled_) handled(static_cast<int>(StatusCode::CANCELLED));
  }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (!handled_ && methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      handled(static_cast<int>(methods->GetSendStatus().error_code()));
    }
    methods->Proceed();
  }

 private:
  void handled(int code) {
    handled_ = true;
    metrics_.rpc_handled(type_, service_, method_, code,
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  ApiMetrics& metrics_;
  std::string type_, service_, method_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  bool handled_ = false;
};

class RpcMetricsInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsInterceptorFactory(ApiMetrics& metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    using Type = grpc::experimental::ServerRpcInfo::Type;
    const char* type = "unary";
    switch (info->type()) {
      case Type::CLIENT_STREAMING:
        type = "client_stream";
        break;
      case Type::SERVER_STREAMING:
        type = "server_stream";
        break;
      case Type::BIDI_STREAMING:
        type = "bidi_stream";
        break;
      default:
        break;
    }
    // "/package.Service/Method"; anything else (or an unbounded variety: Metrics caps the series) is "unknown".
    const std::string name = info->method() != nullptr ? info->method() : "";
    const size_t slash = name.find('/', 1);
    if (name.size() > 128 || name.empty() || name[0] != '/' || slash == std::string::npos) {
      return new RpcMetricsInterceptor(metrics_, type, "unknown", "unknown");
    }
    return new RpcMetricsInterceptor(metrics_, type, name.substr(1, slash - 1), name.substr(slash + 1));
  }

 private:
  ApiMetrics& metrics_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> make_malformed_request_interceptor() {
  return std::make_unique<MalformedRequestInterceptorFactory>();
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> make_rpc_metrics_interceptor(
    ApiMetrics& metrics) {
  return std::make_unique<RpcMetricsInterceptorFactory>(metrics);
}

}  // namespace skyreels::server
