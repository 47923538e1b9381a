// The metrics port (--metrics-listen): GET /metrics and nothing else, served by the same listener as the HTTP port
// (http_server.*) on its own socket, with the bounds of a port only scrapers use. The exposition comes from a function
// the assembly passes in, so this layer never includes the metrics registry.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "server/http/http_server.h"

namespace skyreels::server::http {

// Every scrape connection is closed this long after it was accepted, whatever the client sends; at most this many are
// open at once; a request (line and headers) may be this long.
inline constexpr std::chrono::seconds kScrapeDeadline{5};
inline constexpr unsigned kMaxScrapeConnections = 64;
inline constexpr size_t kMaxScrapeRequestBytes = 16384;

// The answers of the metrics port: 200 with the exposition for GET /metrics, 405 for another method, 404 elsewhere.
Handler metrics_port_handler(std::function<std::string()> render);

// Binds HOST:PORT (port 0 picks a free one) and serves metrics_port_handler(render). Throws std::runtime_error.
std::unique_ptr<HttpServer> serve_metrics(const std::string& listen, std::function<std::string()> render);

}  // namespace skyreels::server::http
