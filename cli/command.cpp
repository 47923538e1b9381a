#include "cli/command.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <variant>

#include "model/adapter_bank.h"
#include "model/lora.h"
#include "model/scheduler_config.h"
#include "server/job/generation_params.h"
#include "server/job/generation_params_model.h"

namespace skyreels::cli {

std::map<std::string, Command>& registry() {
  static std::map<std::string, Command> commands;
  return commands;
}

bool register_command(Command command) {
  registry()[command.name] = std::move(command);
  return true;
}

Args::Args(const std::vector<std::string>& args, const std::vector<std::string>& switches) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0 || a == "--") {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      flags_.emplace(name.substr(0, eq), name.substr(eq + 1));
    } else if (std::find(switches.begin(), switches.end(), name) != switches.end()) {
      flags_.emplace(name, "true");
    } else if (i + 1 < args.size()) {
      flags_.emplace(name, args[++i]);
    } else {
      throw UsageError("flag --" + name + " needs a value");
    }
  }
}

bool Args::has(const std::string& name) const { return flags_.count(name) != 0; }

std::string Args::get(const std::string& name, const std::string& fallback) const {
  auto it = flags_.find(name);
  return it == flags_.end() ? fallback : it->second;
}

std::string Args::require(const std::string& name) const {
  auto it = flags_.find(name);
  if (it == flags_.end()) throw UsageError("missing required flag --" + name);
  return it->second;
}

std::vector<std::string> Args::all(const std::string& name) const {
  std::vector<std::string> out;
  auto range = flags_.equal_range(name);
  for (auto it = range.first; it != range.second; ++it) out.push_back(it->second);
  return out;
}

int Args::get_int(const std::string& name, int fallback) const {
  if (!has(name)) return fallback;
  const std::string v = get(name);
  try {
    size_t used = 0;
    const int out = std::stoi(v, &used);
    if (used != v.size()) throw std::invalid_argument(v);
    return out;
  } catch (const std::exception&) {
    throw UsageError("flag --" + name + " expects an integer, got '" + v + "'");
  }
}

double Args::get_double(const std::string& name, double fallback) const {
  if (!has(name)) return fallback;
  const std::string v = get(name);
  try {
    size_t used = 0;
    const double out = std::stod(v, &used);
    if (used != v.size()) throw std::invalid_argument(v);
    return out;
  } catch (const std::exception&) {
    throw UsageError("flag --" + name + " expects a number, got '" + v + "'");
  }
}

void Args::reject_unknown(const std::vector<std::string>& known) const {
  for (const auto& [name, value] : flags_) {
    if (std::find(known.begin(), known.end(), name) == known.end()) throw UsageError("unknown flag --" + name);
  }
}

// --no-FLAG for every boolean parameter that is on by default (--no-exact-savings).
std::vector<std::string> generation_switches() {
  std::vector<std::string> names;
  for (const auto& param : server::generation_params()) {
    if (param.kind == server::ParamKind::kBool && param.default_rule == server::DefaultRule::kValue &&
        std::get<bool>(param.default_value)) {
      names.push_back("no-" + param.flag);
    }
  }
  return names;
}

std::vector<std::string> with_generation_switches(std::vector<std::string> switches) {
  for (const auto& name : generation_switches()) switches.push_back(name);
  return switches;
}

namespace {

std::vector<std::string> generation_flags() {
  std::vector<std::string> flags = {"prompt", "negative-prompt", "image",     "last-image",
                                    "video",  "prompt-at",       "inputs-at", "scheduler-config"};
  for (const auto& param : server::generation_params()) flags.push_back(param.flag);
  for (const auto& name : generation_switches()) flags.push_back(name);
  return flags;
}

}  // namespace

const std::vector<std::string> kGenerationFlags = generation_flags();

std::vector<std::string> with_generation_flags(std::vector<std::string> known) {
  known.insert(known.end(), kGenerationFlags.begin(), kGenerationFlags.end());
  return known;
}

namespace {

// The sampler --sampler names (the table's default when it is not given): the one --scheduler-config configures.
model::SamplerKind flag_sampler(const Args& args) {
  const server::GenerationParam& param = server::generation_param("scheduler.type");
  try {
    const server::ParamValue name =
        args.has(param.flag) ? server::parse_param_value(param, args.get(param.flag)) : param.default_value;
    return model::sampler_kind(std::get<std::string>(name));
  } catch (const std::invalid_argument& e) {
    throw UsageError("flag --" + param.flag + " " + e.what());
  }
}

}  // namespace

server::JobRequest generation_request_from_flags(const Args& args) {
  server::JobRequest request;
  if (args.has("scheduler-config")) {
    server::request_scheduler_config(model::read_scheduler_config(args.get("scheduler-config"), flag_sampler(args)),
                                     request);
  }
  for (const auto& param : server::generation_params()) {
    if (param.kind == server::ParamKind::kBool && args.has("no-" + param.flag)) {
      if (args.has(param.flag)) throw UsageError("--" + param.flag + " and --no-" + param.flag + " are exclusive");
      param.set_requested(request, false);
      continue;
    }
    if (!args.has(param.flag)) continue;
    try {
      param.set_requested(request, server::parse_param_value(param, args.get(param.flag)));
    } catch (const std::invalid_argument& e) {
      throw UsageError("flag --" + param.flag + " " + e.what());
    }
  }
  return request;
}

std::vector<model::LoraSpec> lora_specs_from_flags(const Args& args) {
  std::vector<model::LoraSpec> out;
  for (const auto& text : args.all("lora")) {
    try {
      out.push_back(model::parse_lora_spec(text));
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  }
  return out;
}

void check_adapter_flags(const Args& args) {
  if (args.has("adapter") && !args.has("lora-dir")) throw UsageError("--adapter needs --lora-dir DIR");
  for (const auto& text : args.all("adapter")) {
    try {
      model::parse_adapter_request(text);
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  }
}

std::vector<model::ActiveAdapter> adapters_from_flags(const Args& args, const model::SkyReelsV2Transformer& model) {
  check_adapter_flags(args);
  if (!args.has("lora-dir")) return {};
  std::vector<model::AdapterRequest> requests;
  for (const auto& text : args.all("adapter")) requests.push_back(model::parse_adapter_request(text));
  auto catalogue = std::make_shared<const model::AdapterCatalogue>(args.get("lora-dir"), model.config());
  model::AdapterBank bank(catalogue, model.device(), model.compute_dtype(),
                          std::max(requests.size(), model::kDefaultMaxResident));
  try {
    return bank.activate(requests);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--adapter: ") + e.what());
  }
}

std::pair<int64_t, std::string> frame_and_value(const std::string& flag, const std::string& text) {
  const size_t colon = text.find(':');
  try {
    if (colon == std::string::npos || colon == 0) throw std::invalid_argument(text);
    size_t used = 0;
    const long long frame = std::stoll(text.substr(0, colon), &used);
    if (used != colon || frame < 0) throw std::invalid_argument(text);
    return {frame, text.substr(colon + 1)};
  } catch (const std::exception&) {
    throw UsageError("flag --" + flag + " expects FRAME:VALUE with FRAME a pixel frame >= 0, got '" + text + "'");
  }
}

}  // namespace skyreels::cli
