// HOST:PORT of a listen flag (--listen, --http-listen, --metrics-listen), split the one way every listener reads it.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace skyreels::server {

// Splits "HOST:PORT" / "[V6]:PORT" (an empty host is 0.0.0.0); throws std::invalid_argument naming `flag`.
inline std::pair<std::string, int> split_host_port(const std::string& text, const std::string& flag) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos) throw std::invalid_argument(flag + ": '" + text + "' is not HOST:PORT");
  std::string host = text.substr(0, colon);
  const std::string port = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (port.empty() || port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5 ||
      std::stoi(port) > 65535) {
    throw std::invalid_argument(flag + ": '" + text + "' has no valid port");
  }
  return {host.empty() ? "0.0.0.0" : host, std::stoi(port)};
}

}  // namespace skyreels::server
