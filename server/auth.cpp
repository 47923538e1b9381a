#include "server/auth.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace skyreels::server {

namespace {

bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

}  // namespace

ApiKeys ApiKeys::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("--api-keys: cannot read '" + path + "'");
  ApiKeys keys;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    std::istringstream words(line);
    std::string key, client, extra;
    if (!(words >> key) || key[0] == '#') continue;
    words >> client;
    if (words >> extra) {
      throw std::runtime_error("--api-keys: " + path + ":" + std::to_string(number) +
                               ": expected 'KEY [CLIENT_NAME]', found more words");
    }
    if (key.size() < 8) {
      throw std::runtime_error("--api-keys: " + path + ":" + std::to_string(number) +
                               ": key is shorter than 8 characters");
    }
    if (client.empty()) client = "client-" + std::to_string(number);
    for (const auto& e : keys.entries_) {
      if (e.key == key)
        throw std::runtime_error("--api-keys: " + path + ":" + std::to_string(number) + ": duplicate key");
    }
    keys.entries_.push_back({key, client});
  }
  if (keys.entries_.empty()) throw std::runtime_error("--api-keys: '" + path + "' holds no key");
  return keys;
}

std::optional<std::string> ApiKeys::identify(const std::string& key) const {
  std::optional<std::string> found;
  for (const auto& e : entries_) {  // no early exit: the time does not depend on which key matched
    if (constant_time_equal(e.key, key) && !found) found = e.client;
  }
  return found;
}

std::string presented_key(const std::optional<std::string>& authorization,
                          const std::optional<std::string>& x_api_key) {
  if (authorization) {
    const std::string& v = *authorization;
    std::string scheme = v.substr(0, std::min<size_t>(7, v.size()));
    std::transform(scheme.begin(), scheme.end(), scheme.begin(), [](unsigned char c) { return std::tolower(c); });
    if (scheme == "bearer ") {
      std::string key = v.substr(7);
      key.erase(0, key.find_first_not_of(' '));
      return key;
    }
  }
  if (x_api_key) return *x_api_key;
  return "";
}

}  // namespace skyreels::server
