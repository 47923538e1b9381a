#include "model/scheduler_config.h"

#include <stdexcept>

#include "model/scheduler_config_json.h"

namespace skyreels::model {

SchedulerConfig parse_scheduler_config(const std::string& text, SamplerKind sampler, const std::string& origin) {
  const scheduler_json::Json j = scheduler_json::parse_object(text, origin);
  if (j.contains("_class_name")) {
    const scheduler_json::Json& name = j.at("_class_name");
    if (!name.is_string()) scheduler_json::config_error(origin, "_class_name", "must be a string, got " + name.dump());
    const std::string refusal = config_class_refusal(sampler, name.get<std::string>());
    if (!refusal.empty()) scheduler_json::config_error(origin, "_class_name", refusal);
  }
  switch (sampler) {
    case SamplerKind::kUniPC:
      return FlowUniPCConfig::from_json(text, origin);
    case SamplerKind::kEuler:
      return FlowEulerConfig::from_json(text, origin);
  }
  throw std::logic_error("sampler " + sampler_row(sampler).name + " reads no scheduler config");
}

SchedulerConfig read_scheduler_config(const std::string& path, SamplerKind sampler) {
  return parse_scheduler_config(scheduler_json::read_text(path), sampler, path);
}

}  // namespace skyreels::model
