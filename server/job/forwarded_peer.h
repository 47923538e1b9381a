// How the HTTP door names the client it calls the gRPC service for, over the in-process channel: one contract of the
// two doors (http/ writes it, api/ reads it), so it sits below both. No gRPC.
#pragma once

#include <sys/random.h>

#include <string>

namespace skyreels::server {

// Metadata naming the client on whose behalf this process calls its own gRPC service (the HTTP listener, over the
// in-process channel): "SECRET ADDRESS", where SECRET is forwarding_secret(), 128 random bits drawn at start that
// never leave the process, so a remote client cannot claim another address. ADDRESS kSelfPeer: the readiness probe.
inline constexpr const char* kForwardedPeerMetadata = "x-skyreels-forwarded-peer";
inline constexpr const char* kSelfPeer = "self";

inline const std::string& forwarding_secret() {
  static const std::string secret = [] {
    unsigned char bytes[16];
    size_t got = 0;
    while (got < sizeof bytes) {
      const ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
      if (n > 0) got += static_cast<size_t>(n);
    }
    static const char* digits = "0123456789abcdef";
    std::string hex;
    for (unsigned char b : bytes) hex += {digits[b >> 4], digits[b & 15]};
    return hex;
  }();
  return secret;
}

inline std::string forwarded_peer(const std::string& address) { return forwarding_secret() + " " + address; }

}  // namespace skyreels::server
