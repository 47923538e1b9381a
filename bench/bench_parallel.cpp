// One video on several devices (issue 43): what a transformer pass costs each rank of a replica on CPU with Gloo
// ranks, at DF-1.3B width (dim 1536, 12 heads, a few layers) and at 14B width (dim 5120, 40 heads, one or two
// layers), random weights:
//   - bytes each rank sends per pass (counted at the RankGroup seam) for ulysses=2, ulysses=4 and cfg=2 (one guided
//     row: the two passes and the exchange of their predictions);
//   - weight bytes held per rank, whole and with --shard-weights (measured on the few layers, derived at full depth);
//   - wall time of one pass on 1 rank x N threads against N ranks x 1 thread (the exchange's overhead on equal
//     hardware), and of a guided row (two passes) against cfg=2.
//
//   bench_parallel [--frames 4] [--height 32] [--width 32] [--text 64] [--repeats 3] [--widths 1.3B,14B]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "bench/random_transformer.h"
#include "model/guided_prediction.h"
#include "model/rank_group.h"
#include "model/runtime.h"
#include "model/transformer_skyreels_v2.h"

namespace {

using namespace skyreels::model;

struct Options {
  int64_t frames = 4, height = 32, width = 32, text = 64;
  int repeats = 3;
  std::vector<std::string> widths{"1.3B", "14B"};
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--frames") {
      o.frames = std::stoll(value);
    } else if (flag == "--height") {
      o.height = std::stoll(value);
    } else if (flag == "--width") {
      o.width = std::stoll(value);
    } else if (flag == "--text") {
      o.text = std::stoll(value);
    } else if (flag == "--repeats") {
      o.repeats = std::stoi(value);
    } else if (flag == "--widths") {
      o.widths.clear();
      for (size_t at = 0; at <= value.size();) {
        const size_t comma = std::min(value.find(',', at), value.size());
        o.widths.push_back(value.substr(at, comma - at));
        at = comma + 1;
      }
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  return o;
}

TransformerConfig config_of(const std::string& width) {
  TransformerConfig c;
  c.in_channels = c.out_channels = 16;
  c.text_dim = 4096;
  c.freq_dim = 256;
  c.attention_head_dim = 128;
  c.inject_sample_info = true;
  c.num_frame_per_block = 1;
  if (width == "1.3B") {
    c.num_attention_heads = 12;
    c.ffn_dim = 8960;
    c.num_layers = 2;
  } else if (width == "14B") {
    c.num_attention_heads = 40;
    c.ffn_dim = 13824;
    c.num_layers = 1;
  } else {
    throw std::invalid_argument("--widths: 1.3B or 14B, got " + width);
  }
  return c;
}

// Counts what this rank sends through a group: all-to-all keeps its own slice, all-gather (a ring) forwards every
// other rank's share once.
class CountingGroup final : public RankGroup {
 public:
  explicit CountingGroup(RankGroup* inner) : inner_(inner) {}
  int64_t rank() const override { return inner_->rank(); }
  int64_t size() const override { return inner_->size(); }
  at::Tensor all_to_all(const at::Tensor& input) override {
    sent += input.numel() * input.element_size() * (size() - 1) / size();
    return inner_->all_to_all(input);
  }
  at::Tensor all_gather(const at::Tensor& input) override {
    sent += input.numel() * input.element_size() * (size() - 1);
    return inner_->all_gather(input);
  }
  int64_t sent = 0;

 private:
  RankGroup* inner_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Result {
  double seconds = 0;
  int64_t bytes_sent = 0;  // rank 0, per pass (or per guided row)
};

// One pass (guided: a guided row of two) on every rank of `layout`, each with `threads` intra-op threads.
Result measure(const SkyReelsV2Transformer& model, const TransformerForwardArgs& args, const ParallelLayout& layout,
               int threads, bool guided_row, int repeats) {
  std::vector<double> times;
  Result r;
  run_on_ranks(layout, kDefaultCollectiveTimeout, [&](int64_t rank, const RankGroups& groups) {
    at::set_num_threads(threads);
    CountingGroup ulysses(groups.ulysses), cfg(groups.cfg);
    TransformerForwardArgs a = args;
    a.sequence_parallel = groups.ulysses ? &ulysses : nullptr;
    auto run = [&] {
      if (!guided_row) return model.forward(a);
      return guided_prediction([&](bool) { return model.forward(a); }, 5.0, groups.cfg ? &cfg : nullptr);
    };
    run();  // warm-up
    const int64_t before = ulysses.sent + cfg.sent;
    for (int i = 0; i < repeats; ++i) {
      const auto start = std::chrono::steady_clock::now();
      run();
      if (rank == 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    if (rank == 0) r.bytes_sent = (ulysses.sent + cfg.sent - before) / repeats;
  });
  r.seconds = median(times);
  return r;
}

int64_t weight_bytes(const SkyReelsV2Transformer& model) {
  int64_t total = 0;
  for (const auto& [name, t] : model.named_tensors()) total += t.numel() * t.element_size();
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const int cores = skyreels::runtime::available_cores();  // what one rank gets alone, and N ranks share
    std::printf("bench_parallel: %d cores; latent %lld x %lld x %lld, text %lld, fp32, median of %d\n",
                cores, static_cast<long long>(o.frames), static_cast<long long>(o.height),
                static_cast<long long>(o.width), static_cast<long long>(o.text), o.repeats);
    for (const std::string& width : o.widths) {
      const TransformerConfig c = config_of(width);
      SkyReelsV2Transformer model(c, skyreels::bench::random_weights(c, at::kFloat), c10::kCPU, at::kFloat);
      TransformerForwardArgs args;
      at::manual_seed(1);
      args.hidden_states = at::randn({1, 16, o.frames, o.height, o.width});
      args.timestep = at::randint(0, 1000, {1, o.frames}, at::kLong);
      args.encoder_hidden_states = at::randn({1, o.text, c.text_dim});
      args.fps = at::zeros({1}, at::kLong);
      const int64_t tokens = o.frames * (o.height / 2) * (o.width / 2);
      std::printf("\n%s width: dim %lld, %lld heads, ffn %lld, %lld layer(s), %lld tokens; weights %.1f MB per rank "
                  "without --shard-weights\n",
                  width.c_str(), static_cast<long long>(c.inner_dim()), static_cast<long long>(c.num_attention_heads),
                  static_cast<long long>(c.ffn_dim), static_cast<long long>(c.num_layers),
                  static_cast<long long>(tokens), weight_bytes(model) / 1e6);
      std::printf("  %-34s %10s %14s %16s\n", "layout", "wall s", "sent/rank MB", "sent/layer/token");
      auto row = [&](const std::string& name, const Result& r) {
        std::printf("  %-34s %10.3f %14.3f %16.1f\n", name.c_str(), r.seconds, r.bytes_sent / 1e6,
                    static_cast<double>(r.bytes_sent) / static_cast<double>(c.num_layers * tokens));
      };
      // --shard-weights: what rank 0 holds with 2 and 4 ranks (measured on these few layers), and the same rule
      // at the model's full depth (derived: everything outside the blocks, 1/N of the blocks, two block buffers).
      const int64_t whole = weight_bytes(model);
      int64_t block_bytes = 0;
      for (const auto& [name, t] : model.named_tensors()) {
        if (name.rfind("blocks.", 0) == 0) block_bytes += t.numel() * t.element_size();
      }
      const int64_t per_block = block_bytes / c.num_layers, depth = width == "1.3B" ? 30 : 40;
      const double outside = static_cast<double>(whole - block_bytes);
      for (int64_t ranks : {2, 4}) {
        SkyReelsV2Transformer sharded(c, skyreels::bench::random_weights(c, at::kFloat), c10::kCPU, at::kFloat);
        sharded.shard_blocks(0, ranks);
        const double full_depth_whole = outside + static_cast<double>(per_block * depth);
        const double full_depth_sharded =
            outside + static_cast<double>(per_block * depth) / static_cast<double>(ranks) + 2.0 * per_block;
        std::printf("  --shard-weights, %lld ranks: rank 0 holds %.1f MB here (%.1f MB whole); at %lld layers "
                    "(derived, fp32): %.1f MB of %.1f MB, bf16 half of that\n",
                    static_cast<long long>(ranks), sharded.held_weight_bytes() / 1e6, whole / 1e6,
                    static_cast<long long>(depth), full_depth_sharded / 1e6, full_depth_whole / 1e6);
      }
      const int n = std::max(2, cores);
      row("pass: 1 rank x " + std::to_string(n) + " threads", measure(model, args, {1, 1}, n, false, o.repeats));
      row("pass: ulysses=2, 2 ranks x " + std::to_string(n / 2) + " thread(s)",
          measure(model, args, {1, 2}, std::max(1, n / 2), false, o.repeats));
      if (c.num_attention_heads % 4 == 0) {
        row("pass: ulysses=4, 4 ranks x 1 thread", measure(model, args, {1, 4}, 1, false, o.repeats));
      }
      row("guided row: 1 rank x " + std::to_string(n) + " threads", measure(model, args, {1, 1}, n, true, o.repeats));
      row("guided row: cfg=2, 2 ranks x " + std::to_string(n / 2) + " thread(s)",
          measure(model, args, {2, 1}, std::max(1, n / 2), true, o.repeats));
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_parallel: " << e.what() << "\n";
    return 1;
  }
}
