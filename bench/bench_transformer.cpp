// SkyReels-V2 transformer forward: seconds, achieved GFLOP/s and peak RSS, for the DF-1.3B config
// (TransformerConfig::df_1_3b()) with random weights, in fp32 and bf16 (fp32 islands kept).
//
// Each dtype runs in a fresh process (this binary re-executed with --single), so its peak RSS (VmHWM) is its own.
//
//   bench_transformer [--dtype float32,bfloat16] [--frames 16] [--height 32] [--width 32] [--text 512]
//                     [--layers 30] [--num-frame-per-block 1] [--warmup 1] [--repeats 2] [--threads N]
//                     [--device cpu|cuda:N] [--config df-1.3b|df-14b] [--peak]
//
// --device cuda:N times each pass until the device is idle and reports the device's peak allocated memory;
// --config df-14b takes DF-14B's width (5120, 40 heads; with --layers a few of its 40 blocks); --peak measures the
// matmul rate of a large at::mm in the same dtype on the same device in this process and reports the model FLOP
// utilisation (MFU) of the pass against it.
//
// FLOPs (multiply-add = 2) of one pass, B = 1, L = F*(H/2)*(W/2) tokens, T text rows, D = 1536, Dff = 8960,
// K = L (no mask) or the mean key prefix under the block-causal mask:
//   per block   8*L*D^2 (q,k,v,o) + 4*L*K*D (QK^T, PV) + 4*L*D^2 + 4*T*D^2 (cross q,o and k,v) + 4*L*T*D (cross
//               attention) + 4*L*D*Dff (FFN)
//   once        2*L*(C*pt*ph*pw)*D (patch) + 2*T*(text_dim*D + D^2) (text) + 2*Fm*(freq*D + D^2 + 6*D^2) (time)
//               + 2*L*D*(pt*ph*pw*C_out) (head)
// Elementwise work (norms, RoPE, softmax, modulation) is not counted.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_peak.h"
#include "bench/bench_util.h"
#include "bench/random_transformer.h"
#include "model/runtime.h"
#include "model/transformer_skyreels_v2.h"

namespace {

using skyreels::bench::process_cpu_seconds;
using skyreels::bench::status_mb;

using skyreels::model::SkyReelsV2Transformer;
using skyreels::model::TransformerConfig;

struct Options {
  std::vector<std::string> dtypes{"float32", "bfloat16"};
  int64_t frames = 16, height = 32, width = 32, text = 512, layers = -1, nfpb = 1;
  int warmup = 1, repeats = 2, threads = 0;
  std::string device = "cpu", config = "df-1.3b";
  bool peak = false;
  bool single = false;  // internal: run the first dtype in this process
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--single") {
      o.single = true;
      continue;
    }
    if (flag == "--peak") {
      o.peak = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--dtype") {
      o.dtypes.clear();
      std::stringstream s(value);
      std::string item;
      while (std::getline(s, item, ',')) o.dtypes.push_back(item);
    } else if (flag == "--frames") {
      o.frames = std::stoll(value);
    } else if (flag == "--height") {
      o.height = std::stoll(value);
    } else if (flag == "--width") {
      o.width = std::stoll(value);
    } else if (flag == "--text") {
      o.text = std::stoll(value);
    } else if (flag == "--layers") {
      o.layers = std::stoll(value);
    } else if (flag == "--num-frame-per-block") {
      o.nfpb = std::stoll(value);
    } else if (flag == "--warmup") {
      o.warmup = std::stoi(value);
    } else if (flag == "--repeats") {
      o.repeats = std::stoi(value);
    } else if (flag == "--threads") {
      o.threads = std::stoi(value);
    } else if (flag == "--device") {
      o.device = value;
    } else if (flag == "--config") {
      if (value != "df-1.3b" && value != "df-14b") throw std::invalid_argument("--config df-1.3b|df-14b");
      o.config = value;
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  return o;
}

double forward_flops(const TransformerConfig& c, const Options& o) {
  const double d = static_cast<double>(c.inner_dim()), dff = static_cast<double>(c.ffn_dim);
  const double patch = static_cast<double>(c.patch_size[0] * c.patch_size[1] * c.patch_size[2]);
  const double ppf = static_cast<double>(o.frames / c.patch_size[0]);
  const double per_frame = static_cast<double>((o.height / c.patch_size[1]) * (o.width / c.patch_size[2]));
  const double l = ppf * per_frame, t = static_cast<double>(o.text);
  // Block-causal: query block b (of nb) sees (b + 1) blocks of keys; mean key count L * (nb + 1) / (2 nb).
  const double nb = o.nfpb > 1 ? ppf / static_cast<double>(o.nfpb) : 1.0;
  const double keys = o.nfpb > 1 ? l * (nb + 1.0) / (2.0 * nb) : l;
  const double block =
      8 * l * d * d + 4 * l * keys * d + 4 * l * d * d + 4 * t * d * d + 4 * l * t * d + 4 * l * d * dff;
  const double once = 2 * l * static_cast<double>(c.in_channels) * patch * d +
                      2 * t * (static_cast<double>(c.text_dim) * d + d * d) +
                      2 * ppf * (static_cast<double>(c.freq_dim) * d + d * d + 6 * d * d) +
                      2 * l * d * patch * static_cast<double>(c.out_channels);
  return static_cast<double>(c.num_layers) * block + once;
}

int run_single(const Options& o) {
  const std::string dtype_name = o.dtypes.front();
  const at::ScalarType dtype = dtype_name == "bfloat16" ? at::kBFloat16 : at::kFloat;
  if (dtype_name != "bfloat16" && dtype_name != "float32") throw std::invalid_argument("--dtype " + dtype_name);
  TransformerConfig c = o.config == "df-14b" ? TransformerConfig::df_14b() : TransformerConfig::df_1_3b();
  if (o.layers > 0) c.num_layers = o.layers;
  const c10::Device device(o.device);

  auto start = std::chrono::steady_clock::now();
  // Random weights made on the CPU (the same values on every device), then placed on the device.
  skyreels::checkpoint::StateDict weights = skyreels::bench::random_weights(c, dtype);
  for (auto& [name, t] : weights) t = t.to(device);
  SkyReelsV2Transformer model(c, std::move(weights), device, dtype);
  const double init_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  at::manual_seed(1);
  skyreels::model::TransformerForwardArgs args;
  args.hidden_states = at::randn({1, c.in_channels, o.frames, o.height, o.width}).to(device);
  args.timestep = at::randint(0, 1000, {1, o.frames / c.patch_size[0]}, at::kLong).to(device);
  args.encoder_hidden_states = (at::randn({1, o.text, c.text_dim}) * 0.1).to(device);
  if (c.inject_sample_info) args.fps = at::ones({1}, at::kLong).to(device);
  args.num_frame_per_block = o.nfpb;

  for (int i = 0; i < o.warmup; ++i) model.forward(args);
  skyreels::bench::sync_device(device);
  std::vector<std::pair<double, double>> times;  // (wall, cpu) seconds
  bool finite = true;
  for (int i = 0; i < std::max(1, o.repeats); ++i) {
    start = std::chrono::steady_clock::now();
    const double cpu_start = process_cpu_seconds();
    const at::Tensor out = model.forward(args);
    skyreels::bench::sync_device(device);
    times.emplace_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                       process_cpu_seconds() - cpu_start);
    finite = finite && out.isfinite().all().item<bool>();
  }
  if (!finite) std::cerr << "warning: non-finite output\n";
  const double peak_device_mib = skyreels::bench::peak_device_mib(device);
  const double matmul_tflops =
      o.peak ? skyreels::bench::measure_peaks(dtype, 5, device.is_cuda() ? 8192 : 1024, device).matmul_gflops / 1e3
             : 0.0;
  std::sort(times.begin(), times.end());
  const double best = times.front().first, median = times[times.size() / 2].first, cpu = times.front().second;
  const double flops = forward_flops(c, o);
  const int64_t tokens = (o.frames / c.patch_size[0]) * (o.height / c.patch_size[1]) * (o.width / c.patch_size[2]);
  std::printf(
      "RESULT dtype=%s config=%s device=%s layers=%lld latent=[1,16,%lld,%lld,%lld] tokens=%lld text=%lld nfpb=%lld "
      "threads=%d init_s=%.1f forward_s(best)=%.3f forward_s(median)=%.3f cpu_s(best)=%.3f tflop=%.4g "
      "gflops(best)=%.1f peak_rss_mib=%.0f peak_device_mib=%.0f matmul_tflops=%.4g mfu=%.3f finite=%d\n",
      dtype_name.c_str(), o.config.c_str(), device.str().c_str(), static_cast<long long>(c.num_layers),
      static_cast<long long>(o.frames), static_cast<long long>(o.height), static_cast<long long>(o.width),
      static_cast<long long>(tokens), static_cast<long long>(o.text), static_cast<long long>(o.nfpb),
      at::get_num_threads(), init_s, best, median, cpu, flops / 1e12, flops / best / 1e9, status_mb("VmHWM"),
      peak_device_mib, matmul_tflops, matmul_tflops > 0 ? flops / best / 1e12 / matmul_tflops : 0.0,
      finite ? 1 : 0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  try {
    const Options o = parse(argc, argv);
    if (o.threads > 0) skyreels::runtime::configure_threads(o.threads);
    if (o.single) return run_single(o);
    // One fresh process per dtype so each peak RSS is its own.
    std::string base = std::string(argv[0]);
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--dtype") {
        ++i;
        continue;
      }
      base += " '" + a + "'";
    }
    int status = 0;
    for (const auto& dtype : o.dtypes) {
      std::cout.flush();
      status |= std::system((base + " --single --dtype " + dtype).c_str());
    }
    return status == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "bench_transformer: " << e.what() << "\n";
    return 2;
  }
}
