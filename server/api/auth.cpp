#include "server/api/auth.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "server/job/limits.h"
#include "server/policy/dispatch_policy.h"

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

// "name=value" with an integer value in [lo, hi] into *out; false when `word` is not "name=...".
template <typename T>
bool take_limit(const std::string& word, const std::string& name, int64_t lo, int64_t hi, std::optional<T>* out,
                const std::string& where) {
  if (word.rfind(name + "=", 0) != 0) return false;
  const std::string value = word.substr(name.size() + 1);
  try {
    size_t used = 0;
    const int64_t v = std::stoll(value, &used);
    if (used == value.size() && v >= lo && v <= hi) {
      *out = static_cast<T>(v);
      return true;
    }
  } catch (const std::exception&) {
  }
  throw std::runtime_error(where + ": " + name + " must be an integer in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "], got '" + value + "'");
}

}  // namespace

std::shared_ptr<const ApiKeys::Table> ApiKeys::read(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("--api-keys: cannot read '" + path + "'");
  auto table = std::make_shared<Table>();
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const std::string where = "--api-keys: " + path + ":" + std::to_string(number);
    std::istringstream words(line);
    std::string key, word;
    if (!(words >> key) || key[0] == '#') continue;
    if (key.size() < kMinApiKeyLength) {
      throw std::runtime_error(where + ": key is shorter than " + std::to_string(kMinApiKeyLength) + " characters");
    }
    Entry entry{key, {}};
    while (words >> word) {
      ClientLimits& l = entry.client.limits;
      if (take_limit(word, "max_priority", kMinPriority, kMaxPriority, &l.max_priority, where) ||
          take_limit(word, "max_jobs", 1, 1000000, &l.max_jobs, where) ||
          take_limit(word, "max_streams", 1, 1000000, &l.max_streams, where) ||
          take_limit(word, "weight", 1, policy::kMaxClientWeight, &l.weight, where)) {
        continue;
      }
      if (!entry.client.name.empty() || word.find('=') != std::string::npos) {
        throw std::runtime_error(where + ": expected 'KEY [CLIENT_NAME] [max_priority=N] [max_jobs=N] " +
                                 "[max_streams=N] [weight=N]', found '" + word + "'");
      }
      entry.client.name = word;
    }
    if (entry.client.name.empty()) entry.client.name = "client-" + std::to_string(number);
    for (const auto& e : *table) {
      if (e.key == key) throw std::runtime_error(where + ": duplicate key");
    }
    table->push_back(std::move(entry));
  }
  if (table->empty()) throw std::runtime_error("--api-keys: '" + path + "' holds no key");
  return table;
}

ApiKeys ApiKeys::load(const std::string& path) {
  ApiKeys keys;
  keys.path_ = path;
  keys.table_ = read(path);
  return keys;
}

void ApiKeys::reload() {
  if (path_.empty()) return;
  std::atomic_store(&table_, read(path_));
}

std::shared_ptr<const ApiKeys::Table> ApiKeys::table() const { return std::atomic_load(&table_); }

std::optional<ClientIdentity> ApiKeys::identify(const std::string& key) const {
  const auto entries = table();
  std::optional<ClientIdentity> found;
  for (const auto& e : *entries) {  // no early exit: the time does not depend on which key matched
    if (constant_time_equal(e.key, key) && !found) found = e.client;
  }
  return found;
}

std::optional<std::string> forwarded_address(const std::string& value) {
  const std::string& secret = forwarding_secret();
  if (value.size() <= secret.size() || value[secret.size()] != ' ') return std::nullopt;
  if (!constant_time_equal(value.substr(0, secret.size()), secret)) return std::nullopt;
  return value.substr(secret.size() + 1);
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
