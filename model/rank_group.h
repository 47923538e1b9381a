// The ranks of one replica that work on one video together, and the two collectives the model needs of them
// (all-to-all for Ulysses attention, all-gather for the token shards and the guidance halves' predictions). The
// model's math sees only this seam; model/rank_group_gloo.cpp joins ranks with torch's c10d (Gloo).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

#include "model/parallel_layout.h"

namespace skyreels::model {

// One rank's view of a group. Every rank of the group calls each collective in the same order with tensors of the
// same shape and dtype; a collective that a rank never joins fails on the others within the group's timeout
// (RankGroupError), it never blocks them for good.
class RankGroup {
 public:
  virtual ~RankGroup() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t size() const = 0;
  // `input` [size(), ...]: slice j goes to rank j. Returns [size(), ...]: slice i came from rank i.
  virtual at::Tensor all_to_all(const at::Tensor& input) = 0;
  // Every rank's `input` stacked in rank order: [size(), ...input's shape].
  virtual at::Tensor all_gather(const at::Tensor& input) = 0;
  // all_gather started now and finished by the returned call (while the caller computes meanwhile). Every rank
  // starts and finishes the same gathers in the same order. By default it gathers at once.
  virtual std::function<at::Tensor()> start_all_gather(const at::Tensor& input) {
    at::Tensor gathered = all_gather(input);
    return [gathered] { return gathered; };
  }
};

struct RankGroupError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What a rank's model calls use: its sequence-parallel group (Ulysses), its guidance-parallel pair and the whole
// replica. Each may be null (degree 1; `all` on a one-device replica).
struct RankGroups {
  RankGroup* ulysses = nullptr;
  RankGroup* cfg = nullptr;
  RankGroup* all = nullptr;  // every rank of the replica, rank r = r (sharded weights are gathered from it)
  // Rank 0 of the replica (also the only rank of a one-device replica): the one whose results are kept.
  bool first() const { return (ulysses == nullptr || ulysses->rank() == 0) && (cfg == nullptr || cfg->rank() == 0); }
  // The first sequence rank of its guidance half: the one that reports its half's transformer calls, so that every
  // call of the replica is counted once.
  bool reports_calls() const { return ulysses == nullptr || ulysses->rank() == 0; }
};

// Runs body(rank, groups) for every rank of `layout` at once, one thread per rank, the ranks joined by c10d Gloo
// process groups over an in-process store. Returns when every rank's body has returned. When any rank throws, the
// others' pending collectives fail (their peer is gone, or the timeout passes), and the first error in time is
// rethrown here as it was thrown (logged with its rank), after every thread has ended.
void run_on_ranks(const ParallelLayout& layout, std::chrono::milliseconds collective_timeout,
                  const std::function<void(int64_t rank, const RankGroups& groups)>& body);

// The default time a rank waits for its peers in one collective before the chunk fails.
constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{120000};

}  // namespace skyreels::model
