// RankGroup over torch's c10d: ProcessGroupGloo per group, ranks as threads of this process rendezvousing through an
// in-process HashStore, each group under its own key prefix. Gloo exchanges host memory: a device tensor is copied to
// the host and back around each exchange (NCCL would exchange device memory directly; not wired in yet).
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "model/rank_group.h"

namespace skyreels::model {

namespace {

class GlooRankGroup final : public RankGroup {
 public:
  GlooRankGroup(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name, int rank, int size,
                std::chrono::milliseconds timeout)
      : name_(name), rank_(rank), size_(size), timeout_(timeout) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    options->threads = 1;
    group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>(name, store), rank,
                                                         size, options);
  }

  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }

  at::Tensor all_to_all(const at::Tensor& input) override {
    if (input.dim() < 1 || input.size(0) != size_) {
      throw std::invalid_argument("all_to_all: expected [" + std::to_string(size_) + ", ...], one slice per rank");
    }
    at::Tensor in = input.to(at::kCPU).contiguous();  // Gloo exchanges host memory: device tensors are staged
    const c10::InferenceMode normal_tensors(false);  // Gloo's own thread writes the output, outside any mode
    at::Tensor out = at::empty_like(in);
    std::vector<int64_t> equal_splits;
    wait(group_->alltoall_base(out, in, equal_splits, equal_splits), "all_to_all");
    return out.to(input.device());
  }

  at::Tensor all_gather(const at::Tensor& input) override { return start_all_gather(input)(); }

  std::function<at::Tensor()> start_all_gather(const at::Tensor& input) override {
    const c10::InferenceMode normal_tensors(false);  // Gloo's own thread writes the outputs, outside any mode
    const at::Tensor host = input.to(at::kCPU).contiguous();  // Gloo exchanges host memory: device tensors are staged
    auto outputs = std::make_shared<std::vector<std::vector<at::Tensor>>>(1);
    for (int i = 0; i < size_; ++i) (*outputs)[0].push_back(at::empty_like(host));
    std::vector<at::Tensor> inputs{host};
    c10::intrusive_ptr<c10d::Work> work = group_->allgather(*outputs, inputs);
    return [this, work, outputs, device = input.device()] {
      wait(work, "all_gather");
      return at::stack((*outputs)[0]).to(device);
    };
  }

 private:
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* op) {
    try {
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw RankGroupError(std::string(op) + " in group " + name_ + " (rank " + std::to_string(rank_) + " of " +
                           std::to_string(size_) + "): " + e.what());
    }
  }

  std::string name_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};

// The first failure in time among the ranks.
class FirstFailure {
 public:
  void record(int64_t rank, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) {
      error_ = std::move(error);
      rank_ = rank;
    }
  }
  // The root cause as it was thrown (its type tells a caller what happened: a cancel, a refused request, a fault).
  void rethrow() const {
    if (!error_) return;
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      spdlog::warn("event=rank_failed rank={} error={}", rank_, e.what());
    } catch (...) {
    }
    std::rethrow_exception(error_);
  }

 private:
  std::mutex mutex_;
  std::exception_ptr error_;
  int64_t rank_ = -1;
};

}  // namespace

void run_on_ranks(const ParallelLayout& layout, std::chrono::milliseconds collective_timeout,
                  const std::function<void(int64_t rank, const RankGroups& groups)>& body) {
  if (layout.single()) {
    body(0, RankGroups{});
    return;
  }
  const auto store = c10::make_intrusive<c10d::HashStore>();
  FirstFailure failure;
  auto run_rank = [&](int64_t rank) {
    // Destroyed after the failure is on record: a peer still waiting sees its group go and fails second.
    std::unique_ptr<GlooRankGroup> ulysses, cfg, all;
    try {
      const int64_t half = rank / layout.ulysses, seq = rank % layout.ulysses;
      if (layout.ulysses > 1) {
        ulysses = std::make_unique<GlooRankGroup>(store, "ulysses" + std::to_string(half), static_cast<int>(seq),
                                                  static_cast<int>(layout.ulysses), collective_timeout);
      }
      if (layout.cfg > 1) {
        cfg = std::make_unique<GlooRankGroup>(store, "cfg" + std::to_string(seq), static_cast<int>(half),
                                              static_cast<int>(layout.cfg), collective_timeout);
      }
      all = std::make_unique<GlooRankGroup>(store, "all", static_cast<int>(rank), static_cast<int>(layout.ranks()),
                                            collective_timeout);
      body(rank, RankGroups{ulysses.get(), cfg.get(), all.get()});
    } catch (...) {
      failure.record(rank, std::current_exception());
    }
  };
  std::vector<std::thread> threads;
  for (int64_t r = 1; r < layout.ranks(); ++r) threads.emplace_back(run_rank, r);
  run_rank(0);  // rank 0 on the caller's thread (its thread-local settings: intra-op threads, grad mode)
  for (std::thread& t : threads) t.join();
  failure.rethrow();
}

}  // namespace skyreels::model
