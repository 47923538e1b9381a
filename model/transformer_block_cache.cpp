// The transformer's cache per causal block (TransformerForwardArgs::per_block_cache, beyond diffusers): block 0 runs
// on every token, then each causal block decides on its own residual whether blocks 1..L-1 run for it or its last
// tail residual and kept keys / values stand in; the plan of one call, the layers over the computed blocks, and the
// blocks' states within the memory budget. Separate from the forward because it is a second path through the layers
// that only this cache takes.
#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <map>
#include <vector>

#include "model/transformer_impl.h"

namespace skyreels::model {

namespace transformer_impl {

using BlockEntry = TransformerCallState::Impl::BlockEntry;

// What the cache per causal block does with each block of a call: its decisions, and the blocks that run (computed)
// or lend their kept keys / values (stale: skipped or reused), with the stale blocks' states.
struct BlockPlan {
  std::vector<TransformerCallStats::BlockDecision> decisions;
  std::vector<int64_t> computed, stale;
  std::vector<BlockEntry*> stale_entries;
  std::vector<bool> leading_final;  // per block: it and every block before it are final
};

}  // namespace transformer_impl

namespace {

BlockPlan plan_blocks(const PerBlockCache& cache, TransformerCallState::Impl& state, const Tensor& residual,
                      int64_t blocks, int64_t block_tokens, int64_t layers) {
  BlockPlan plan;
  std::vector<BlockEntry*> entries(static_cast<size_t>(blocks), nullptr);
  std::vector<bool> reused(static_cast<size_t>(blocks), false);
  std::vector<Tensor> rels;  // of the blocks with a state that are not reused, read to the host once for the call
  bool leading_final = true;
  for (int64_t j = 0; j < blocks; ++j) {
    leading_final = leading_final && cache.final_blocks[static_cast<size_t>(j)] != 0;
    plan.leading_final.push_back(leading_final);
    auto found = state.blocks.find(cache.first_block + j);
    if (found == state.blocks.end()) continue;
    BlockEntry& e = found->second;
    entries[static_cast<size_t>(j)] = &e;
    // A final block computed while final in this window: its kept keys / values are exact.
    reused[static_cast<size_t>(j)] = static_cast<int64_t>(e.k.size()) == layers - 1 && leading_final && e.final &&
                                     e.window == cache.first_block;
    if (!reused[static_cast<size_t>(j)]) {
      rels.push_back(relative_change(residual.narrow(1, j * block_tokens, block_tokens), e.residual));
    }
  }
  const Tensor host_rels = rels.empty() ? Tensor() : at::stack(rels).to(at::kCPU, at::kDouble);
  size_t next_rel = 0;
  for (int64_t j = 0; j < blocks; ++j) {
    TransformerCallStats::BlockDecision d;
    d.block = cache.first_block + j;
    d.updated = cache.updated_blocks[static_cast<size_t>(j)] != 0;
    d.reused = reused[static_cast<size_t>(j)];
    BlockEntry* e = entries[static_cast<size_t>(j)];
    if (e != nullptr && !d.reused) {
      d.rel = host_rels.data_ptr<double>()[next_rel++];
      d.skipped = static_cast<int64_t>(e->k.size()) == layers - 1 && d.updated && *d.rel <= cache.threshold &&
                  e->skips < cache.max_skips;
    }
    if (d.skipped || d.reused) {
      plan.stale.push_back(j);
      plan.stale_entries.push_back(e);
    } else {
      plan.computed.push_back(j);
    }
    plan.decisions.push_back(d);
  }
  return plan;
}

// Keys / values the states of blocks other than `computed` keep.
int64_t kept_bytes_besides(const TransformerCallState::Impl& state, const PerBlockCache& cache,
                           const std::vector<int64_t>& computed) {
  int64_t kept = 0;
  for (const auto& [block, entry] : state.blocks) {
    if (std::find(computed.begin(), computed.end(), block - cache.first_block) != computed.end()) continue;
    for (const auto* list : {&entry.k, &entry.v}) {
      for (const Tensor& t : *list) kept += t.numel() * static_cast<int64_t>(t.element_size());
    }
  }
  return kept;
}

}  // namespace

Tensor SkyReelsV2Transformer::Impl::per_block_layers(const std::vector<BlockWeights>& blocks, Tensor x,
                                                     const PerBlockCache& cache, TransformerCallState::Impl& state,
                                                     const CrossContext& context, const Tensor& modulation,
                                                     const RopeTables& rope, const Geometry& g,
                                                     int64_t frames_per_block, const std::function<void()>& after_block,
                                                     TransformerCallStats& stats) const {
  const int64_t layers = static_cast<int64_t>(blocks.size()), bt = frames_per_block * g.tokens_per_frame;
  const int64_t nb = g.frames / frames_per_block;
  // Blocks before the call's window never come back in this chunk (the window only moves forward).
  state.blocks.erase(state.blocks.begin(), state.blocks.lower_bound(cache.first_block));

  const Tensor block_in = x;
  x = block_forward(ready(blocks, 0), std::move(x), context, modulation, rope, g, bt);
  stats.token_blocks_computed += g.batch * g.tokens;
  if (after_block) after_block();
  const Tensor block0_out = x, residual = x - block_in;

  const BlockPlan plan = plan_blocks(cache, state, residual, nb, bt, layers);
  int64_t cache_skips = 0;
  for (const auto& d : plan.decisions) cache_skips += d.skipped ? 1 : 0;
  stats.blocks = plan.decisions;
  stats.skipped = cache_skips == nb;                                     // every block of the call skipped
  stats.token_blocks_cached = g.batch * cache_skips * bt * (layers - 1);  // reused final blocks: exact savings

  // Stale blocks: block 0's output plus their own last tail residual.
  Tensor out = block0_out.clone();
  for (size_t i = 0; i < plan.stale.size(); ++i) {
    out.narrow(1, plan.stale[i] * bt, bt).add_(plan.stale_entries[i]->tail);
  }
  std::vector<std::vector<Tensor>> fresh_k(static_cast<size_t>(layers)), fresh_v(static_cast<size_t>(layers));
  if (!plan.computed.empty()) {
    out = computed_blocks(blocks, block0_out, std::move(out), plan, context, modulation, rope, g, frames_per_block,
                          after_block, fresh_k, fresh_v, stats);
  }

  // The computed blocks' states, within the memory budget (what the other blocks keep counts first).
  for (size_t i = 0; i < plan.stale.size(); ++i) {
    if (plan.decisions[static_cast<size_t>(plan.stale[i])].skipped) ++plan.stale_entries[i]->skips;
  }
  int64_t kept = kept_bytes_besides(state, cache, plan.computed);
  const int64_t bytes = 2 * (layers - 1) * g.batch * bt * g.dim * static_cast<int64_t>(out.element_size());
  for (size_t i = 0; i < plan.computed.size(); ++i) {
    const int64_t j = plan.computed[i];
    BlockEntry& e = state.blocks[cache.first_block + j];
    e.residual = residual.narrow(1, j * bt, bt).clone(at::MemoryFormat::Contiguous);
    e.tail = (out.narrow(1, j * bt, bt) - block0_out.narrow(1, j * bt, bt)).contiguous();
    e.skips = 0;
    e.final = plan.leading_final[static_cast<size_t>(j)];
    e.window = cache.first_block;
    e.k.clear();
    e.v.clear();
    if (kept + bytes > cache.max_kv_bytes) continue;  // no keys / values kept: this block cannot skip
    kept += bytes;
    for (int64_t l = 1; l < layers; ++l) {
      e.k.push_back(fresh_k[static_cast<size_t>(l)][i]);
      e.v.push_back(fresh_v[static_cast<size_t>(l)][i]);
    }
  }
  return out;
}

Tensor SkyReelsV2Transformer::Impl::computed_blocks(const std::vector<BlockWeights>& blocks, const Tensor& block0_out,
                                                    Tensor out, const BlockPlan& plan, const CrossContext& context,
                                                    const Tensor& modulation, const RopeTables& rope, const Geometry& g,
                                                    int64_t frames_per_block, const std::function<void()>& after_block,
                                                    std::vector<std::vector<Tensor>>& fresh_k,
                                                    std::vector<std::vector<Tensor>>& fresh_v,
                                                    TransformerCallStats& stats) const {
  const int64_t layers = static_cast<int64_t>(blocks.size()), bt = frames_per_block * g.tokens_per_frame;
  const size_t nc = plan.computed.size();
  const bool all = nc == plan.decisions.size();
  std::vector<int64_t> frame_index, token_index;
  for (int64_t j : plan.computed) {
    for (int64_t f = 0; f < frames_per_block; ++f) frame_index.push_back(j * frames_per_block + f);
    for (int64_t t = 0; t < bt; ++t) token_index.push_back(j * bt + t);
  }
  const Tensor frames = at::tensor(frame_index, at::TensorOptions().dtype(at::kLong)).to(device);
  const Tensor tokens = at::tensor(token_index, at::TensorOptions().dtype(at::kLong)).to(device);
  Tensor xc = all ? block0_out.clone() : block0_out.index_select(1, tokens);  // the blocks write in place
  const Tensor mod_c = all || modulation.size(1) == 1 ? modulation : modulation.index_select(1, frames);
  const RopeTables rope_c =
      all ? rope : RopeTables{rope.cos.index_select(1, tokens), rope.signed_sin.index_select(1, tokens)};
  BlockSparseAttention sparse;
  sparse.block_tokens = bt;
  sparse.computed = plan.computed;
  sparse.stale = plan.stale;
  for (int64_t j : plan.stale) {
    sparse.stale_rope.push_back({rope.cos.narrow(1, j * bt, bt), rope.signed_sin.narrow(1, j * bt, bt)});
  }
  Geometry sub = g;
  sub.frames = sub.ppf = static_cast<int64_t>(nc) * frames_per_block;
  sub.tokens = static_cast<int64_t>(nc) * bt;
  for (int64_t l = 1; l < layers; ++l) {
    sparse.stale_k.clear();
    sparse.stale_v.clear();
    for (BlockEntry* e : plan.stale_entries) {
      sparse.stale_k.push_back(&e->k[static_cast<size_t>(l - 1)]);
      sparse.stale_v.push_back(&e->v[static_cast<size_t>(l - 1)]);
    }
    sparse.fresh_k = &fresh_k[static_cast<size_t>(l)];
    sparse.fresh_v = &fresh_v[static_cast<size_t>(l)];
    xc = block_forward(ready(blocks, static_cast<size_t>(l)), std::move(xc), context, mod_c, rope_c, sub, bt, nullptr,
                       &sparse);
    stats.token_blocks_computed += g.batch * sub.tokens;
    if (after_block) after_block();
  }
  if (all) return xc;
  out.index_copy_(1, tokens, xc);
  return out;
}

}  // namespace skyreels::model
