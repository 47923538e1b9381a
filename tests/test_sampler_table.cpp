// The sampler table (model/sampler_table.h): the lookups the door, the name mapping, the chunk plan and the timestep
// builder read route by a row's own properties, so a table with a third, test-only sampler is routed by its row (and
// not by its name, nor by "every sampler but UniPC is Euler").
#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>

#include "model/sampler_table.h"

namespace skyreels::model {
namespace {

const SamplerKind kThird = static_cast<SamplerKind>(2);  // no enum value: a sampler only this test knows

SamplerTable with_third(bool takes_timestep_list) {
  SamplerTable table = samplers();
  table.push_back({"third", "Third", kThird, takes_timestep_list, "ThirdScheduler", "a test-only sampler"});
  return table;
}

TEST(SamplerTable, EachKindHasOneRowAndTheDefaultIsFirst) {
  std::set<std::string> names;
  std::set<int> kinds;
  for (const SamplerRow& row : samplers()) {
    names.insert(row.name);
    kinds.insert(static_cast<int>(row.kind));
    EXPECT_EQ(&sampler_row(row.kind), &row);
    EXPECT_EQ(find_sampler(row.name), &row);
  }
  EXPECT_EQ(names.size(), samplers().size());
  EXPECT_EQ(kinds.size(), samplers().size());
  EXPECT_EQ(samplers().front().kind, SamplerKind::kUniPC) << "GenerationParams' default sampler";
  EXPECT_EQ(timestep_list_samplers(), "euler");
}

TEST(SamplerTable, AThirdRowIsRoutedByItsOwnProperties) {
  for (const bool takes_list : {true, false}) {
    const SamplerTable table = with_third(takes_list);
    EXPECT_EQ(sampler_kind("third", table), kThird);
    EXPECT_EQ(find_sampler("third", table), &table.back());
    EXPECT_EQ(&sampler_row(kThird, table), &table.back());
    EXPECT_EQ(timestep_list_refusal(kThird, true, table).empty(), takes_list) << takes_list;
    EXPECT_EQ(timestep_list_refusal(kThird, false, table), "") << "no list, nothing to refuse";
  }
  EXPECT_EQ(timestep_list_samplers(with_third(true), "\""), "\"euler\" or \"third\"");
  EXPECT_EQ(timestep_list_refusal(kThird, true, with_third(false)),
            "scheduler.timesteps: an explicit timestep list needs scheduler.type euler (Third spaces "
            "num_inference_steps itself)");
  EXPECT_THROW(sampler_kind("third"), std::invalid_argument) << "the real table has no such row";
  EXPECT_THROW(sampler_row(kThird), std::logic_error);
}

TEST(SamplerTable, TheListRuleIsTheRowsNotTheKinds) {
  SamplerTable swapped = samplers();
  for (SamplerRow& row : swapped) row.takes_timestep_list = !row.takes_timestep_list;
  EXPECT_EQ(timestep_list_refusal(SamplerKind::kUniPC, true, swapped), "");
  EXPECT_EQ(timestep_list_refusal(SamplerKind::kEuler, true, swapped),
            "scheduler.timesteps: an explicit timestep list needs scheduler.type unipc (Euler spaces "
            "num_inference_steps itself)");
  EXPECT_EQ(timestep_list_refusal(SamplerKind::kUniPC, true),
            "scheduler.timesteps: an explicit timestep list needs scheduler.type euler (UniPC spaces "
            "num_inference_steps itself)");
  EXPECT_EQ(timestep_list_refusal(SamplerKind::kEuler, true), "");
}

// --scheduler-config: each row reads the config of its own diffusers class; any other is refused naming it, the sampler
// it configures (when a row's) and the row's own.
TEST(SamplerTable, ASchedulerConfigClassIsTheRowsOwn) {
  EXPECT_EQ(config_class_refusal(SamplerKind::kUniPC, "UniPCMultistepScheduler"), "");
  EXPECT_EQ(config_class_refusal(SamplerKind::kEuler, "FlowMatchEulerDiscreteScheduler"), "");
  EXPECT_EQ(config_class_refusal(SamplerKind::kUniPC, "FlowMatchEulerDiscreteScheduler"),
            "\"FlowMatchEulerDiscreteScheduler\" configures scheduler.type euler, but the sampler is unipc, "
            "which reads a \"UniPCMultistepScheduler\" config");
  EXPECT_EQ(config_class_refusal(SamplerKind::kEuler, "DDIMScheduler"),
            "\"DDIMScheduler\" configures no sampler, but the sampler is euler, which reads a "
            "\"FlowMatchEulerDiscreteScheduler\" config");
  const SamplerTable table = with_third(false);
  EXPECT_EQ(config_class_refusal(kThird, "ThirdScheduler", table), "");
  EXPECT_EQ(config_class_refusal(SamplerKind::kEuler, "ThirdScheduler", table).rfind(
                "\"ThirdScheduler\" configures scheduler.type third, but the sampler is euler", 0),
            0u);
}

}  // namespace
}  // namespace skyreels::model
