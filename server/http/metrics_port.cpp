#include "server/http/metrics_port.h"

#include <spdlog/spdlog.h>

namespace skyreels::server::http {

namespace {

// Plain text, and the connection closed after it: a scraper opens one per scrape, never one a deadline cuts.
Response plain(int status, std::string body, std::string content_type = "text/plain; charset=utf-8") {
  Response r;
  r.status = status;
  r.content_type = std::move(content_type);
  r.body = std::move(body);
  r.headers = {{"Connection", "close"}};
  return r;
}

HttpOptions scrape_options(const std::string& listen) {
  HttpOptions options;
  options.listen = listen;
  options.flag = "--metrics-listen";
  options.max_body_bytes = kMaxScrapeRequestBytes;
  options.max_connections = kMaxScrapeConnections;
  options.max_connections_per_client = kMaxScrapeConnections;  // scrapers come from few addresses
  options.idle_timeout_seconds = static_cast<unsigned>(kScrapeDeadline.count());
  options.connection_deadline_seconds = static_cast<unsigned>(kScrapeDeadline.count());
  options.header_memory_bytes = kMaxScrapeRequestBytes;
  options.max_form_parts = 0;
  return options;
}

}  // namespace

Handler metrics_port_handler(std::function<std::string()> render) {
  return [render = std::move(render)](const Request& request) {
    if (request.method != "GET") return plain(405, "only GET\n");
    if (request.path != "/metrics") return plain(404, "not found: only GET /metrics is served here\n");
    return plain(200, render(), "text/plain; version=0.0.4; charset=utf-8");
  };
}

std::unique_ptr<HttpServer> serve_metrics(const std::string& listen, std::function<std::string()> render) {
  auto server = std::make_unique<HttpServer>(
      scrape_options(listen), metrics_port_handler(std::move(render)),
      [](int status, const std::string& message) { return plain(status, message + "\n"); });
  spdlog::info("event=metrics_listening address={} port={} path=/metrics", listen, server->port());
  return server;
}

}  // namespace skyreels::server::http
