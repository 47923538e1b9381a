// Reading a diffusers scheduler_config.json: the checks both samplers' configs (FlowUniPCConfig, FlowEulerConfig)
// share, every error as "key: what (in origin)". Internal to model/; no LibTorch.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>

namespace skyreels::model::scheduler_json {

using Json = nlohmann::json;

[[noreturn]] inline void config_error(const std::string& origin, const std::string& key, const std::string& what) {
  throw std::invalid_argument(key + ": " + what + " (in " + origin + ")");
}

// The text as a JSON object ("origin: not valid JSON: ..." otherwise).
inline Json parse_object(const std::string& text, const std::string& origin) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(origin + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(origin + ": expected a JSON object");
  return j;
}

// The file's text ("path: cannot open scheduler config" when it cannot be read).
inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(path + ": cannot open scheduler config");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A _class_name, when present, must be `expected`.
inline void require_class(const Json& j, const std::string& origin, const std::string& expected) {
  if (j.contains("_class_name") && j.at("_class_name") != expected) {
    config_error(origin, "_class_name", "expected \"" + expected + "\", got " + j.at("_class_name").dump());
  }
}

// A key whose value, when present, must equal what SkyReels-V2 uses.
inline void require_value(const Json& j, const std::string& origin, const std::string& key, const Json& expected) {
  if (!j.contains(key)) return;
  if (j.at(key) != expected) {
    config_error(origin, key, "only " + expected.dump() + " is supported, got " + j.at(key).dump());
  }
}

// A key that must be absent, null, false or 0 (a feature `sampler`, "the flow UniPC sampler", does not implement;
// diffusers tests these keys for truth, so false, 0 and null all mean off).
inline void require_falsy(const Json& j, const std::string& origin, const std::string& key,
                          const std::string& sampler) {
  if (!j.contains(key)) return;
  const Json& v = j.at(key);
  const bool falsy = v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_number() && v.get<double>() == 0.0);
  if (!falsy) config_error(origin, key, "is not supported by " + sampler + ", got " + v.dump());
}

template <typename T>
T get_typed(const Json& j, const std::string& origin, const std::string& key, T fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  try {
    return j.at(key).get<T>();
  } catch (const std::exception&) {
    config_error(origin, key, "has the wrong type: " + j.at(key).dump());
  }
}

}  // namespace skyreels::model::scheduler_json
