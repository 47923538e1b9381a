// Probes of the transport itself, for readiness.
#pragma once

#include <chrono>
#include <memory>

namespace grpc {
class Server;
}  // namespace grpc

namespace skyreels::server {

// Readiness must not say SERVING while unary calls cannot be answered (e.g. every server thread taken). Calls
// GetServerInfo through the server's in-process channel, which shares the server's threads, at most once a `period`;
// answered() is true when the last call came back (OK or UNAUTHENTICATED both prove a thread took it). The answer is
// taken as bytes and never parsed: readiness does not depend on the text it carries (issue 46).
class UnaryProbe {
 public:
  explicit UnaryProbe(grpc::Server& server, std::chrono::milliseconds period = std::chrono::milliseconds(1000));
  ~UnaryProbe();
  bool answered();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace skyreels::server
