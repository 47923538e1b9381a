// How one replica spreads one video over several devices (`--parallel cfg=C,ulysses=U`), stated once for the CLI and
// the server: C guidance-parallel halves (the conditional and the unconditional pass of a guided row at the same time)
// times U sequence-parallel ranks (DeepSpeed-Ulysses: tokens split across the ranks, heads exchanged around
// self-attention). Rank r of a replica is guidance half r / U and sequence rank r % U. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace skyreels::model {

// The largest degree accepted: beyond it a layout is a typo, not a deployment.
constexpr int64_t kMaxParallelDegree = 64;

struct ParallelLayout {
  int64_t cfg = 1;      // 1, or 2: guidance-parallel
  int64_t ulysses = 1;  // sequence-parallel degree; divides the model's attention heads
  int64_t ranks() const { return cfg * ulysses; }
  bool single() const { return ranks() == 1; }
  std::string text() const;  // "cfg=C,ulysses=U"
  bool operator==(const ParallelLayout& o) const { return cfg == o.cfg && ulysses == o.ulysses; }
};

// Parses "cfg=C,ulysses=U" (either key may be left out, each given at most once). Throws std::invalid_argument whose
// message starts with "--parallel".
ParallelLayout parse_parallel_layout(const std::string& text);

// The Ulysses degrees that split `heads` attention heads evenly, up to kMaxParallelDegree.
std::vector<int64_t> ulysses_degrees(int64_t heads);

// Refuses a layout `device_count` devices cannot be grouped into (not a multiple of its ranks) and a Ulysses degree
// that does not divide `heads` (naming the degrees that would); `--shard-weights` needs more than one rank.
// std::invalid_argument starting with the flag at fault.
void check_parallel_layout(const ParallelLayout& layout, int64_t device_count, int64_t heads,
                           bool shard_weights = false);

}  // namespace skyreels::model
