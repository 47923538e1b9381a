// A diffusers scheduler_config.json read for the sampler a generation runs (`--scheduler-config`): its _class_name
// must be the one the sampler's row of model/sampler_table.h names (config_class), else it is refused naming both the
// class and the sampler; then the sampler's own config reads it (FlowUniPCConfig for unipc, FlowEulerConfig for
// euler), refusing what that sampler does not implement. A config without _class_name is read as the sampler's.
#pragma once

#include <string>
#include <variant>

#include "model/sampler_flow_euler.h"
#include "model/sampler_flow_unipc.h"
#include "model/sampler_table.h"

namespace skyreels::model {

using SchedulerConfig = std::variant<FlowUniPCConfig, FlowEulerConfig>;

// Throws std::invalid_argument ("key: what (in origin)") naming the key.
SchedulerConfig parse_scheduler_config(const std::string& text, SamplerKind sampler,
                                       const std::string& origin = "scheduler_config.json");
SchedulerConfig read_scheduler_config(const std::string& path, SamplerKind sampler);

}  // namespace skyreels::model
