// The samplers, one row each: the name the API spells (scheduler.type), the model's SamplerKind and whether it takes a
// timestep list (scheduler.timesteps). The door (server/job/generation_params.cpp), the name mapping
// (generation_params_model.cpp), the chunk plan (df_chunk_plan.cpp) and the timestep builder (df_timesteps.cpp) read
// the rows instead of naming samplers. Adding a sampler: its SamplerKind here, its row in sampler_table.cpp, its
// factory in df_timesteps.cpp. Torch-free: the server's parameter table, which has no LibTorch, reads it.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace skyreels::model {

// The generation parameter `scheduler.type`; the rows name them.
enum class SamplerKind { kUniPC, kEuler };

struct SamplerRow {
  std::string name;   // scheduler.type as the API spells it: "unipc"
  std::string label;  // in messages: "UniPC"
  SamplerKind kind = SamplerKind::kUniPC;
  bool takes_timestep_list = false;  // false: the sampler spaces num_inference_steps itself
  // The diffusers scheduler whose scheduler_config.json (its _class_name) configures it (`--scheduler-config`,
  // model/scheduler_config.h): "UniPCMultistepScheduler".
  std::string config_class;
  std::string help;                  // the --sampler flag's words for it
};
using SamplerTable = std::vector<SamplerRow>;

// Every sampler, the default first. The lookups take a table so that a test can hand them another one.
const SamplerTable& samplers();

// The row named `name`, nullptr when none.
const SamplerRow* find_sampler(std::string_view name, const SamplerTable& table = samplers());
// The row of `kind` (std::logic_error when none: a SamplerKind without a row).
const SamplerRow& sampler_row(SamplerKind kind, const SamplerTable& table = samplers());
// The SamplerKind named `name`; std::invalid_argument naming scheduler.type when no row has it.
SamplerKind sampler_kind(std::string_view name, const SamplerTable& table = samplers());

// The samplers that take a timestep list, each between `quote`s, joined by " or ": `euler`.
std::string timestep_list_samplers(const SamplerTable& table = samplers(), std::string_view quote = "");
// The plan's refusal of a timestep list given to `kind` ("" when it takes one, or no list was given).
std::string timestep_list_refusal(SamplerKind kind, bool has_list, const SamplerTable& table = samplers());

// Why a scheduler_config.json of diffusers class `config_class` does not configure `kind` ("" when it does: the
// row's config_class), naming the class, the sampler it configures (if any) and `kind`'s own.
std::string config_class_refusal(SamplerKind kind, std::string_view config_class,
                                 const SamplerTable& table = samplers());

}  // namespace skyreels::model
