// Weights sharded across a replica's ranks (SkyReelsV2Transformer::shard_blocks, --shard-weights): each rank keeps
// 1/ranks of every block's parameters, and a block's whole weights are gathered into one of two buffers just before
// it runs. Separate from the forward: the forward only asks for a block through Impl::ready.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/rank_group.h"
#include "model/transformer_impl.h"

namespace skyreels::model {

void SkyReelsV2Transformer::shard_blocks(int64_t rank, int64_t ranks) {
  Impl& m = *impl_;
  if (m.shards) throw std::invalid_argument("shard_blocks: the blocks are sharded already");
  if (ranks < 2 || rank < 0 || rank >= ranks) {
    throw std::invalid_argument("shard_blocks: rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                                " (sharding needs 2 ranks or more)");
  }
  const c10::InferenceMode normal_tensors(false);  // the slots are written in calls made outside any mode too
  Impl::BlockShards s;
  s.rank = rank;
  s.ranks = ranks;
  // One flat buffer per dtype (the compute dtype and the fp32 islands), the same layout in every block.
  for_each_block_tensor(m.base_layers.blocks.front(), [&](const Tensor& t) {
    if (!t.defined()) return;
    auto g = std::find_if(s.groups.begin(), s.groups.end(), [&](const auto& x) { return x.dtype == t.scalar_type(); });
    if (g == s.groups.end()) {
      Impl::BlockShards::Group added;
      added.dtype = t.scalar_type();
      g = s.groups.insert(s.groups.end(), std::move(added));
    }
    g->numel += t.numel();
  });
  for (auto& g : s.groups) {
    g.per_rank = (g.numel + ranks - 1) / ranks;
    for (Tensor& slot : g.slots) slot = at::empty({g.numel}, at::TensorOptions().dtype(g.dtype).device(m.device));
  }
  for (size_t l = 0; l < m.base_layers.blocks.size(); ++l) {
    BlockWeights& b = m.base_layers.blocks[l];
    for (auto& g : s.groups) {
      Tensor padded = at::zeros({g.per_rank * ranks}, at::TensorOptions().dtype(g.dtype).device(m.device));
      int64_t offset = 0;
      for_each_block_tensor(b, [&](Tensor& t) {
        if (!t.defined() || t.scalar_type() != g.dtype) return;
        padded.narrow(0, offset, t.numel()).copy_(t.reshape({-1}));
        t = g.slots[l % 2].narrow(0, offset, t.numel()).view(t.sizes());  // the block now computes from its slot
        offset += t.numel();
      });
      g.shards.push_back(padded.narrow(0, rank * g.per_rank, g.per_rank).clone());
    }
  }
  for (auto it = m.weights.begin(); it != m.weights.end();) {  // the whole copies go
    it = it->first.rfind("blocks.", 0) == 0 ? m.weights.erase(it) : std::next(it);
  }
  m.shards = std::move(s);
}

std::vector<std::function<Tensor()>> SkyReelsV2Transformer::Impl::BlockShards::start_gather(size_t block) {
  std::vector<std::function<Tensor()>> pending;
  for (auto& g : groups) pending.push_back(gather->start_all_gather(g.shards[block]));
  return pending;
}

void SkyReelsV2Transformer::Impl::BlockShards::finish_gather(std::vector<std::function<Tensor()>>& pending,
                                                             size_t block) {
  filled[block % 2] = -1;  // until every group is in: a failed gather leaves no half-written block behind
  for (size_t i = 0; i < groups.size(); ++i) {
    auto& g = groups[i];
    g.slots[block % 2].copy_(pending[i]().reshape({-1}).narrow(0, 0, g.numel));  // [ranks, per_rank] -> the block
  }
  pending.clear();
  filled[block % 2] = static_cast<int64_t>(block);
}

const BlockWeights& SkyReelsV2Transformer::Impl::ready(const std::vector<BlockWeights>& blocks, size_t l) const {
  if (!shards) return blocks[l];
  BlockShards& s = *shards;
  if (s.gather == nullptr) throw std::logic_error("a sharded transformer ran a block without its weight ranks");
  if (s.prefetching == static_cast<int64_t>(l)) {
    s.finish_gather(s.prefetch, l);
    s.prefetching = -1;
  } else if (s.filled[l % 2] != static_cast<int64_t>(l)) {
    end_gathers();  // a prefetch of another block (never here: blocks run in order) is finished first
    auto pending = s.start_gather(l);
    s.finish_gather(pending, l);
  }
  // The next block's weights travel while this one computes; its slot's block (l - 1) has run.
  const size_t next = l + 1;
  if (next < blocks.size() && s.filled[next % 2] != static_cast<int64_t>(next) && s.prefetching < 0) {
    s.prefetch = s.start_gather(next);
    s.prefetching = static_cast<int64_t>(next);
  }
  return blocks[l];
}

void SkyReelsV2Transformer::Impl::end_gathers() const {
  if (!shards || shards->prefetching < 0) return;
  BlockShards& s = *shards;
  s.finish_gather(s.prefetch, static_cast<size_t>(s.prefetching));
  s.prefetching = -1;
}

int64_t SkyReelsV2Transformer::held_weight_bytes() const {
  const Impl& m = *impl_;
  int64_t bytes = 0;
  for (const auto& [name, t] : m.weights) bytes += t.numel() * t.element_size();
  if (m.shards) {
    for (const auto& g : m.shards->groups) {
      for (const Tensor& t : g.shards) bytes += t.numel() * t.element_size();
      for (const Tensor& t : g.slots) bytes += t.numel() * t.element_size();
    }
  }
  return bytes;
}

}  // namespace skyreels::model
