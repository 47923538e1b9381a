// API keys (--api-keys FILE). One key per line, optionally followed by a client name and per-client limits:
//   KEY [CLIENT_NAME] [max_priority=N] [max_jobs=N] [max_streams=N] [weight=N]
// weight: the client's share of the replicas against other clients' (1 to policy::kMaxClientWeight, default 1).
// Blank lines and lines starting with '#' are ignored; keys have at least kMinApiKeyLength characters. A job belongs
// to the client whose key submitted it; other clients get NOT_FOUND for it. Keys are compared in constant time.
// reload() (SIGHUP) swaps in the file's current content atomically; a broken file keeps the old keys.
#pragma once

#include <sys/random.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

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

// The address a kForwardedPeerMetadata value names, when its secret is this process's; nullopt otherwise.
std::optional<std::string> forwarded_address(const std::string& value);

inline constexpr size_t kMinApiKeyLength = 32;  // 32 random characters: not guessable online

// Per-client caps from the key file; unset: the server-wide default (--max-jobs-per-client, ...).
struct ClientLimits {
  std::optional<int> max_priority;
  std::optional<int64_t> max_jobs;
  std::optional<int64_t> max_streams;
  std::optional<int> weight;
};

struct ClientIdentity {
  std::string name;
  ClientLimits limits;
};

class ApiKeys {
 public:
  ApiKeys() = default;                           // disabled: every call is anonymous and sees every job
  static ApiKeys load(const std::string& path);  // throws std::runtime_error naming the file and line
  // Reads the file again and replaces the keys (thread-safe); on error throws and keeps the current keys.
  void reload();
  bool enabled() const { return !table()->empty(); }
  size_t size() const { return table()->size(); }
  // The client for a presented key; nullopt when the key is unknown.
  std::optional<ClientIdentity> identify(const std::string& key) const;

 private:
  struct Entry {
    std::string key;
    ClientIdentity client;
  };
  using Table = std::vector<Entry>;
  static std::shared_ptr<const Table> read(const std::string& path);
  std::shared_ptr<const Table> table() const;
  std::string path_;
  std::shared_ptr<const Table> table_ = std::make_shared<Table>();
};

// The key from request metadata values: "authorization: Bearer KEY" (scheme case-insensitive) or "x-api-key: KEY".
// Empty when neither is present.
std::string presented_key(const std::optional<std::string>& authorization, const std::optional<std::string>& x_api_key);

}  // namespace skyreels::server
