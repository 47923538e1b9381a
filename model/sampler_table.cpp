#include "model/sampler_table.h"

#include <stdexcept>

namespace skyreels::model {

const SamplerTable& samplers() {
  static const SamplerTable table = {
      {"unipc", "UniPC", SamplerKind::kUniPC, false, "UniPCMultistepScheduler", "flow UniPC"},
      {"euler", "Euler", SamplerKind::kEuler, true, "FlowMatchEulerDiscreteScheduler",
       "flow-matching Euler (diffusers' FlowMatchEulerDiscreteScheduler, shift = flow_shift)"},
  };
  return table;
}

const SamplerRow* find_sampler(std::string_view name, const SamplerTable& table) {
  for (const SamplerRow& row : table) {
    if (row.name == name) return &row;
  }
  return nullptr;
}

const SamplerRow& sampler_row(SamplerKind kind, const SamplerTable& table) {
  for (const SamplerRow& row : table) {
    if (row.kind == kind) return row;
  }
  throw std::logic_error("sampler " + std::to_string(static_cast<int>(kind)) + " has no row in the sampler table");
}

SamplerKind sampler_kind(std::string_view name, const SamplerTable& table) {
  if (const SamplerRow* row = find_sampler(name, table)) return row->kind;
  throw std::invalid_argument("scheduler.type: '" + std::string(name) + "' is not a sampler");
}

std::string timestep_list_samplers(const SamplerTable& table, std::string_view quote) {
  std::string names;
  for (const SamplerRow& row : table) {
    if (!row.takes_timestep_list) continue;
    names += (names.empty() ? "" : " or ") + std::string(quote) + row.name + std::string(quote);
  }
  return names;
}

std::string timestep_list_refusal(SamplerKind kind, bool has_list, const SamplerTable& table) {
  const SamplerRow& row = sampler_row(kind, table);
  if (!has_list || row.takes_timestep_list) return "";
  return "scheduler.timesteps: an explicit timestep list needs scheduler.type " + timestep_list_samplers(table) + " (" +
         row.label + " spaces num_inference_steps itself)";
}

std::string config_class_refusal(SamplerKind kind, std::string_view config_class, const SamplerTable& table) {
  const SamplerRow& row = sampler_row(kind, table);
  if (config_class == row.config_class) return "";
  std::string configures = "configures no sampler";
  for (const SamplerRow& other : table) {
    if (other.config_class == config_class) configures = "configures scheduler.type " + other.name;
  }
  return "\"" + std::string(config_class) + "\" " + configures + ", but the sampler is " + row.name +
         ", which reads a \"" + row.config_class + "\" config";
}

}  // namespace skyreels::model
