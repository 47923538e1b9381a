// The doors of the assembly: TLS credentials (re-read by gRPC's file watcher), warnings about exposed
// configurations, the gRPC server (interceptors, thread quota, keepalive), the HTTP door over the in-process channel,
// and the webhook sender.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/service_type.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <grpcpp/support/server_interceptor.h>
#include <spdlog/spdlog.h>

#include <fstream>
#include <sstream>

#include "server/api/interceptors.h"
#include "server/app/app_steps.h"
#include "server/app/host_port.h"
#include "server/http/http_api.h"
#include "server/http/http_server.h"

namespace skyreels::server::assembly {

namespace {

std::string read_file(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(flag + ": cannot read '" + path + "'");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// The TLS certificate and key are re-read by gRPC's file watcher (a renewed certificate is served without a restart);
// both files are read once here first so that a wrong path fails the start.
constexpr unsigned kTlsRefreshSeconds = 10;

std::shared_ptr<grpc::ServerCredentials> tls_credentials(const Options& o) {
  read_file(o.tls_key, "--tls-key");
  read_file(o.tls_cert, "--tls-cert");
  auto provider =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(o.tls_key, o.tls_cert, kTlsRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  return grpc::experimental::TlsServerCredentials(options);
}

bool is_loopback_address(const std::string& listen, const char* flag) {
  const std::string host = split_host_port(listen, flag).first;
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

}  // namespace

// Configurations that work but expose more than an operator may think.
void warn_about_exposure(const Options& o) {
  if (o.api_keys.empty() && !is_loopback_address(o.listen, "--listen")) {
    spdlog::warn(
        "event=insecure_config listen={} problem=\"no --api-keys: any client that reaches this address can "
        "submit, watch, cancel and download every job\"",
        o.listen);
  }
  if (o.api_keys.empty() && !o.http_listen.empty() && !is_loopback_address(o.http_listen, "--http-listen")) {
    spdlog::warn(
        "event=insecure_config listen={} problem=\"no --api-keys: any client that reaches this HTTP address can "
        "submit, watch, cancel and download every job\"",
        o.http_listen);
  }
  if (!o.api_keys.empty() && o.tls_cert.empty()) {
    spdlog::warn(
        "event=insecure_config listen={} problem=\"--api-keys without --tls-cert: keys travel in plaintext; "
        "terminate TLS in front of this port or pass --tls-cert/--tls-key\"",
        o.listen);
  }
}

std::unique_ptr<grpc::Server> start_grpc(const Options& o, grpc::Service& service, int64_t max_request_bytes,
                                         Metrics& metrics, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!o.tls_cert.empty()) credentials = tls_credentials(o);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(o.listen, credentials, port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_request_bytes));
  builder.SetMaxSendMessageSize(16 << 20);
  grpc::ResourceQuota quota("skyreels-server");
  quota.SetMaxThreads(o.transport.max_threads());  // streams never take the last 64 threads
  builder.SetResourceQuota(quota);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(make_malformed_request_interceptor());
  interceptors.push_back(make_rpc_metrics_interceptor(metrics));  // after it: counts the status clients get
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *port == 0) throw std::runtime_error("--listen: cannot listen on " + o.listen);
  return server;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// Webhook deliveries (--webhook-secret-file, --webhook-allow-hosts), from the job store's event logs.
std::unique_ptr<WebhookSender> make_webhooks(const Options& o, JobStore& store, LeaseStore& leases, Metrics& metrics) {
  if (o.webhook_secret_file.empty()) return nullptr;
  WebhookOptions options;
  options.secret = read_webhook_secret(o.webhook_secret_file);
  options.allow_hosts = split_list(o.webhook_allow_hosts);
  options.takeover_grace = std::chrono::seconds(o.webhook_takeover_seconds);
  spdlog::info("event=webhooks allow_hosts=\"{}\"", o.webhook_allow_hosts);
  return std::make_unique<WebhookSender>(store, leases, std::move(options), &metrics);
}

// The HTTP door (--http-listen): its calls go into the gRPC service over the in-process channel.
std::unique_ptr<http::HttpServer> start_http(const Options& o, grpc::Server& server, const Health& health,
                                             Metrics& metrics, const ServiceConfig& service) {
  if (o.http_listen.empty()) return nullptr;
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  http::HttpApiConfig config;
  config.ready = [&health] { return health.ready.load(); };
  config.live = [&health] { return health.live.load(); };
  config.metrics = [&metrics] { return metrics.render(); };
  config.observe = [&metrics](const std::string& route, int status, double seconds) {
    metrics.http_handled(route, status, seconds);
  };
  config.vae_available = service.vae_available;
  config.result_ttl_seconds = o.scheduling.retention.count();
  auto api = std::make_shared<http::HttpApi>(server.InProcessChannel(arguments), std::move(config));
  http::HttpOptions options;
  options.listen = o.http_listen;
  if (!o.tls_cert.empty()) {
    options.tls_cert = read_file(o.tls_cert, "--tls-cert");
    options.tls_key = read_file(o.tls_key, "--tls-key");
  }
  options.max_body_bytes = service.max_request_bytes;
  options.max_connections = static_cast<unsigned>(o.transport.max_streams);
  options.max_connections_per_client = static_cast<unsigned>(o.transport.max_streams_per_client);
  options.idle_timeout_seconds = static_cast<unsigned>(o.http_idle_timeout_seconds);
  auto listener = std::make_unique<http::HttpServer>(
      options, [api](const http::Request& r) { return api->handle(r); }, &http::HttpApi::refuse);
  spdlog::info("event=http_listening address={} port={} tls={}", o.http_listen, listener->port(), !o.tls_cert.empty());
  return listener;
}

}  // namespace skyreels::server::assembly
