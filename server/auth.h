// API keys (--api-keys FILE). One key per line, optionally followed by whitespace and a client name; blank lines and
// lines starting with '#' are ignored. A job belongs to the client whose key submitted it; other clients get
// NOT_FOUND for it. Keys are compared in constant time.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace skyreels::server {

class ApiKeys {
 public:
  ApiKeys() = default;                           // disabled: every call is anonymous and sees every job
  static ApiKeys load(const std::string& path);  // throws std::runtime_error naming the file and line
  bool enabled() const { return !entries_.empty(); }
  size_t size() const { return entries_.size(); }
  // The client identity for a presented key; nullopt when the key is unknown.
  std::optional<std::string> identify(const std::string& key) const;

 private:
  struct Entry {
    std::string key;
    std::string client;
  };
  std::vector<Entry> entries_;
};

// The key from request metadata values: "authorization: Bearer KEY" (scheme case-insensitive) or "x-api-key: KEY".
// Empty when neither is present.
std::string presented_key(const std::optional<std::string>& authorization, const std::optional<std::string>& x_api_key);

}  // namespace skyreels::server
