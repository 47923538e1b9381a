// --devices LIST --parallel cfg=C,ulysses=U for the commands that run the transformer (generate, forward): the ranks
// of the one replica a command runs, the transformer once per distinct device, and the body run on every rank.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cli/command.h"
#include "model/parallel_layout.h"
#include "model/rank_group.h"
#include "model/transformer_loader.h"

namespace skyreels::cli {

// One device per rank, rank r on the r-th of --devices; without --parallel, rank 0 alone on --device.
struct Ranks {
  model::ParallelLayout layout;
  std::vector<std::string> devices;
  bool shard_weights = false;  // --shard-weights
  bool several() const { return !layout.single(); }
};
Ranks ranks_from_flags(const Args& args);  // UsageError naming the flag

// Ranks on one device share its transformer (the forward is const); with --shard-weights every rank has its own,
// holding its shard of the blocks.
struct RankModels {
  std::map<std::string, model::LoadedTransformer> by_device;
  std::vector<model::LoadedTransformer> by_rank;  // --shard-weights
  const model::SkyReelsV2Transformer& of(const Ranks& ranks, int64_t rank) const {
    if (!by_rank.empty()) return *by_rank.at(static_cast<size_t>(rank)).model;
    return *by_device.at(ranks.devices[static_cast<size_t>(rank)]).model;
  }
};
// load(device) once per distinct device (once per rank, then sharded, with --shard-weights); the layout is checked
// against the model's heads (UsageError).
RankModels load_per_device(const Ranks& ranks, const Args& args,
                           const std::function<model::LoadedTransformer(const std::string& device)>& load);

// body(rank, groups) on every rank (rank 0 alone without --parallel), each rank's intra-op threads a share of this
// process's.
void on_every_rank(const Ranks& ranks, const std::function<void(int64_t, const model::RankGroups&)>& body);

}  // namespace skyreels::cli
