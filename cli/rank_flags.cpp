// --devices / --parallel for the CLI (rank_flags.h).
#include "cli/rank_flags.h"

#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>

namespace skyreels::cli {

Ranks ranks_from_flags(const Args& args) {
  Ranks r;
  try {
    if (args.has("parallel")) r.layout = model::parse_parallel_layout(args.get("parallel"));
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (args.has("devices") && args.has("device")) throw UsageError("give --device or --devices, not both");
  r.shard_weights = args.has("shard-weights");
  if (r.shard_weights && !r.several()) {
    throw UsageError("--shard-weights: needs a replica of more than one device (--parallel cfg=2 or ulysses > 1)");
  }
  if (!args.has("devices")) {
    if (r.several()) throw UsageError("--parallel " + r.layout.text() + " needs --devices (one device per rank)");
    r.devices = {args.get("device", "cpu")};
    return r;
  }
  const std::string list = args.get("devices");
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string device = list.substr(at, comma - at);
    if (device.empty()) throw UsageError("--devices: an empty entry in '" + list + "'");
    r.devices.push_back(device);
    at = comma + 1;
  }
  if (static_cast<int64_t>(r.devices.size()) != r.layout.ranks()) {
    throw UsageError("--devices: " + std::to_string(r.devices.size()) + " device(s) for --parallel " + r.layout.text() +
                     " (" + std::to_string(r.layout.ranks()) + " ranks): give one device per rank");
  }
  return r;
}

RankModels load_per_device(const Ranks& ranks, const Args& args,
                           const std::function<model::LoadedTransformer(const std::string& device)>& load) {
  RankModels models;
  for (size_t r = 0; r < ranks.devices.size(); ++r) {
    const std::string& device = ranks.devices[r];
    if (ranks.shard_weights) {  // one at a time: the whole model is on the device once, briefly, per rank
      models.by_rank.push_back(load(device));
      models.by_rank.back().model->shard_blocks(static_cast<int64_t>(r), static_cast<int64_t>(ranks.devices.size()));
    } else if (!models.by_device.count(device)) {
      models.by_device.emplace(device, load(device));
    }
  }
  const model::TransformerConfig& config = models.of(ranks, 0).config();
  try {
    model::check_parallel_layout(ranks.layout, static_cast<int64_t>(ranks.devices.size()), config.num_attention_heads,
                                 ranks.shard_weights);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (ranks.shard_weights) {
    spdlog::info("weights sharded: rank 0 holds {:.1f} MB of the transformer's parameters",
                 static_cast<double>(models.of(ranks, 0).held_weight_bytes()) / 1e6);
  }
  if (ranks.several()) {
    spdlog::info("one replica of {} ranks ({}) on {}", ranks.layout.ranks(), ranks.layout.text(),
                 args.get("devices"));
  }
  return models;
}

void on_every_rank(const Ranks& ranks, const std::function<void(int64_t, const model::RankGroups&)>& body) {
  const int threads = std::max<int>(1, at::get_num_threads() / static_cast<int>(ranks.layout.ranks()));
  model::run_on_ranks(ranks.layout, model::kDefaultCollectiveTimeout,
                      [&](int64_t rank, const model::RankGroups& groups) {
                        if (ranks.several()) at::set_num_threads(threads);
                        body(rank, groups);
                      });
}

}  // namespace skyreels::cli
