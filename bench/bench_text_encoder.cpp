// UMT5 text encoder forward at UMT5-XXL width (d_model 4096, 64 heads, d_ff 10240; --layers of its 24, a smaller
// embedding table: a lookup costs no FLOPs) with random weights: seconds and achieved GFLOP/s against the matmul peak
// measured in the same process, per dtype, for what a submission encodes (a prompt and a negative prompt):
//   - diffusers' way: rows padded to max_sequence_length (512), one batch of 2, and two single rows;
//   - pad-aware (what TextEncoder::encode_uncached does): each batch cut to its longest row, which gives the same
//     rows (padded keys are masked to exactly zero weight and every other op is per position), as one batch of 2
//     and as two single rows.
//
//   bench_text_encoder [--dtype float32,bfloat16] [--layers 2] [--lengths 60,120] [--repeats 2] [--threads N]
//
// FLOPs (multiply-add = 2) per layer, B rows of T tokens: 8*B*T*d*inner (q, k, v, o) + 4*B*T*T*inner (scores and
// values) + 6*B*T*d*d_ff (wi_0, wi_1, wo). Norms, GELU and softmax are not counted.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_peak.h"
#include "bench/bench_util.h"
#include "model/runtime.h"
#include "model/umt5_encoder.h"

namespace {

using skyreels::bench::best_seconds;
using skyreels::model::UMT5Config;
using skyreels::model::UMT5Encoder;

struct Options {
  std::vector<std::string> dtypes{"float32", "bfloat16"};
  std::vector<int64_t> lengths{60, 120};  // tokens of the prompt and of the negative prompt
  int64_t layers = 2, max_len = 512;
  int repeats = 2, threads = 0;
};

std::vector<std::string> split(const std::string& value) {
  std::vector<std::string> out;
  std::stringstream s(value);
  std::string item;
  while (std::getline(s, item, ',')) out.push_back(item);
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--dtype") {
      o.dtypes = split(value);
    } else if (flag == "--lengths") {
      o.lengths.clear();
      for (const auto& v : split(value)) o.lengths.push_back(std::stoll(v));
    } else if (flag == "--layers") {
      o.layers = std::stoll(value);
    } else if (flag == "--repeats") {
      o.repeats = std::stoi(value);
    } else if (flag == "--threads") {
      o.threads = std::stoi(value);
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  if (o.lengths.size() != 2) throw std::invalid_argument("--lengths takes two token counts (prompt, negative)");
  return o;
}

double forward_flops(const UMT5Config& c, double rows, double tokens) {
  const double d = static_cast<double>(c.d_model), inner = static_cast<double>(c.inner_dim());
  const double dff = static_cast<double>(c.d_ff);
  return static_cast<double>(c.num_layers) * rows *
         (8 * tokens * d * inner + 4 * tokens * tokens * inner + 6 * tokens * d * dff);
}

std::unique_ptr<UMT5Encoder> random_encoder(const UMT5Config& c, at::ScalarType dtype) {
  at::manual_seed(0);
  skyreels::checkpoint::StateDict weights;
  for (const auto& spec : skyreels::model::umt5_parameter_specs(c)) {
    at::Tensor t = at::empty(spec.shape, at::kFloat);
    if (spec.name.find("layer_norm") != std::string::npos) {
      t.fill_(1.0);
    } else {
      t.normal_(0.0, spec.shape.size() == 2 ? 1.0 / std::sqrt(static_cast<double>(spec.shape[1])) : 1.0);
    }
    weights[spec.name] = t.to(spec.keep_fp32 ? at::kFloat : dtype);
  }
  return std::make_unique<UMT5Encoder>(c, std::move(weights), c10::Device(c10::kCPU), dtype);
}

// Token ids and the mask of rows with `lengths[i]` real tokens, padded to `width`.
std::pair<at::Tensor, at::Tensor> rows(const std::vector<int64_t>& lengths, int64_t width) {
  at::Tensor ids = at::zeros({static_cast<int64_t>(lengths.size()), width}, at::kLong);
  at::Tensor mask = at::zeros_like(ids);
  for (size_t i = 0; i < lengths.size(); ++i) {
    ids[static_cast<int64_t>(i)].narrow(0, 0, lengths[i]).random_(1, 1000);
    mask[static_cast<int64_t>(i)].narrow(0, 0, lengths[i]).fill_(1);
  }
  return {ids, mask};
}

void run(const Options& o, const std::string& dtype_name) {
  const at::ScalarType dtype = dtype_name == "bfloat16" ? at::kBFloat16 : at::kFloat;
  UMT5Config c = UMT5Config::umt5_xxl();
  c.num_layers = o.layers;
  c.vocab_size = 1024;
  skyreels::bench::Peaks peaks = skyreels::bench::measure_peaks(dtype);
  const auto encoder = random_encoder(c, dtype);
  const int64_t la = o.lengths[0], lb = o.lengths[1], longest = std::max(la, lb);
  std::printf("\nUMT5-XXL width, %lld layers, %s, %d threads; matmul peak before the encodes %.1f GFLOP/s\n",
              static_cast<long long>(c.num_layers), dtype_name.c_str(), at::get_num_threads(), peaks.matmul_gflops);
  struct Row {
    std::string what, shape;
    double seconds, flops;
  };
  std::vector<Row> table;
  auto report = [&](const char* what, const std::vector<std::pair<int64_t, int64_t>>& calls) {
    std::vector<std::pair<at::Tensor, at::Tensor>> inputs;
    double flops = 0;
    std::string shape;
    for (const auto& [n, width] : calls) {
      std::vector<int64_t> lengths = n == 2 ? std::vector<int64_t>{la, lb}
                                            : std::vector<int64_t>{std::min(width, inputs.empty() ? la : lb)};
      inputs.push_back(rows(lengths, width));
      flops += forward_flops(c, static_cast<double>(n), static_cast<double>(width));
      shape += (shape.empty() ? "" : " + ") + std::to_string(n) + "x" + std::to_string(width);
    }
    const double s = best_seconds(o.repeats, [&] {
      for (const auto& [ids, mask] : inputs) encoder->forward(ids, mask);
    });
    table.push_back({what, shape, s, flops});
  };
  report("padded to 512, one batch of 2", {{2, o.max_len}});
  report("padded to 512, two singles", {{1, o.max_len}, {1, o.max_len}});
  report("pad-aware, one batch of 2", {{2, longest}});
  report("pad-aware, two singles", {{1, la}, {1, lb}});
  const skyreels::bench::Peaks after = skyreels::bench::measure_peaks(dtype);
  std::printf("matmul peak after the encodes %.1f GFLOP/s (the better of before/after is used)\n",
              after.matmul_gflops);
  peaks.matmul_gflops = std::max(peaks.matmul_gflops, after.matmul_gflops);
  std::printf("| encode (prompt %lld + negative %lld tokens) | rows x tokens | best s | GFLOP/s | of matmul peak |\n"
              "|---|---|---|---|---|\n",
              static_cast<long long>(la), static_cast<long long>(lb));
  for (const Row& r : table) {
    const double gflops = r.flops / r.seconds / 1e9;
    std::printf("| %s | %s | %.3f | %.1f | %.0f %% |\n", r.what.c_str(), r.shape.c_str(), r.seconds, gflops,
                100 * gflops / peaks.matmul_gflops);
  }
  std::fflush(stdout);
  if (dtype != at::kFloat) {
    // The same weights in float32: how far this dtype's rows are (UMT5-XXL's final norm makes rows of ~unit RMS).
    const auto reference = random_encoder(c, at::kFloat);
    const auto [ids, mask] = rows({la, lb}, longest);
    const at::Tensor a = encoder->forward(ids, mask).to(at::kFloat), b = reference->forward(ids, mask);
    std::printf("%s vs float32, same weights: max |diff| %.3e, mean |diff| %.3e, max |float32| %.3e\n",
                dtype_name.c_str(), (a - b).abs().max().item<double>(), (a - b).abs().mean().item<double>(),
                b.abs().max().item<double>());
  }
}

}  // namespace

int main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  try {
    const Options o = parse(argc, argv);
    if (o.threads > 0) skyreels::runtime::configure_threads(o.threads);
    for (const auto& dtype : o.dtypes) run(o, dtype);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_text_encoder: " << e.what() << "\n";
    return 1;
  }
}
