// API keys (--api-keys FILE). One key per line, optionally followed by a client name and per-client limits:
//   KEY [CLIENT_NAME] [max_priority=N] [max_jobs=N] [max_streams=N] [weight=N]
// weight: the client's share of the replicas against other clients' (1 to policy::kMaxClientWeight, default 1).
// Blank lines and lines starting with '#' are ignored; keys have at least kMinApiKeyLength characters. A job belongs
// to the client whose key submitted it; other clients get NOT_FOUND for it. Keys are compared in constant time.
// reload() (SIGHUP) swaps in the file's current content atomically; a broken file keeps the old keys.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/job/forwarded_peer.h"

namespace skyreels::server {

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
