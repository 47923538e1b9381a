// Wan VAE decode: time and peak memory against the number of latent frames, with a randomly initialised model of
// the released Wan 2.1 VAE's shape (or a narrower one with --base-dim).
//
// Each length runs in a fresh process (this binary re-executed with --single), so its peak RSS (VmHWM) is its own.
// "stream" hands every latent frame's pixels on and drops them (what `skyreels decode --out x.mp4` and the server
// do); "whole" keeps the full video tensor (decode()), so it also grows by the size of the output.
//
//   bench_vae [--frames 1,3,6,12] [--height 64] [--width 64] [--base-dim 96] [--mode stream|whole] [--threads N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "model/runtime.h"
#include "model/vae_wan.h"

namespace {

using skyreels::bench::process_cpu_seconds;
using skyreels::bench::status_mb;

using skyreels::model::WanVae;
using skyreels::model::WanVaeConfig;

struct Options {
  std::vector<int64_t> frames{1, 3, 6, 12};
  int64_t height = 64, width = 64, base_dim = 96;
  std::string mode = "stream";
  int threads = 0;
  int64_t single = -1;  // internal: run one length and print one RESULT line
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--frames") {
      o.frames.clear();
      std::stringstream s(value);
      std::string item;
      while (std::getline(s, item, ',')) o.frames.push_back(std::stoll(item));
    } else if (flag == "--height") {
      o.height = std::stoll(value);
    } else if (flag == "--width") {
      o.width = std::stoll(value);
    } else if (flag == "--base-dim") {
      o.base_dim = std::stoll(value);
    } else if (flag == "--mode") {
      o.mode = value;
    } else if (flag == "--threads") {
      o.threads = std::stoi(value);
    } else if (flag == "--single") {
      o.single = std::stoll(value);
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  if (o.height % 8 != 0 || o.width % 8 != 0) throw std::invalid_argument("--height/--width must be multiples of 8");
  if (o.mode != "stream" && o.mode != "whole") throw std::invalid_argument("--mode is stream or whole");
  return o;
}

// Random weights with unit-variance activations (conv weights ~ N(0, 1/fan_in), norms 1, biases 0).
WanVae random_vae(const WanVaeConfig& config) {
  at::manual_seed(0);
  skyreels::checkpoint::StateDict weights;
  for (const auto& spec : skyreels::model::wan_vae_parameter_specs(config)) {
    const bool is_weight = spec.name.size() > 7 && spec.name.compare(spec.name.size() - 7, 7, ".weight") == 0;
    if (is_weight) {
      int64_t fan_in = 1;
      for (size_t d = 1; d < spec.shape.size(); ++d) fan_in *= spec.shape[d];
      weights[spec.name] = at::randn(spec.shape).div_(std::sqrt(static_cast<double>(fan_in)));  // no temporary
    } else if (spec.name.find(".gamma") != std::string::npos) {
      weights[spec.name] = at::ones(spec.shape);
    } else {
      weights[spec.name] = at::zeros(spec.shape);
    }
  }
  return WanVae(config, std::move(weights), c10::Device(c10::kCPU), at::kFloat);
}

int run_single(const Options& o) {
  skyreels::runtime::configure_threads(o.threads);
  WanVaeConfig config = WanVaeConfig::wan_2_1();
  config.base_dim = o.base_dim;
  const WanVae vae = random_vae(config);
  const at::Tensor z = at::randn({1, config.z_dim, o.single, o.height / 8, o.width / 8});
  // Start the peak from here: model creation must not hide a decode peak below its own.
  std::ofstream clear_refs("/proc/self/clear_refs");
  const bool reset = static_cast<bool>(clear_refs << "5" << std::flush);  // "5": reset VmHWM (Linux >= 4.0)
  const double base_mb = reset ? status_mb("VmRSS") : status_mb("VmHWM");

  const double cpu_start = process_cpu_seconds();
  const auto start = std::chrono::steady_clock::now();
  int64_t pixel_frames = 0;
  double checksum = 0.0;
  if (o.mode == "stream") {
    skyreels::model::WanVaeDecodeSession session(vae);
    for (int64_t f = 0; f < o.single; ++f) {
      const at::Tensor pixels = session.decode(z.narrow(2, f, 1));
      pixel_frames += pixels.size(2);
      checksum += pixels.mean().item<double>();
    }
  } else {
    const at::Tensor video = vae.decode(z);
    pixel_frames = video.size(2);
    checksum = video.mean().item<double>();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("RESULT %lld %lld %.3f %.3f %.1f %.1f %d %.6f\n", static_cast<long long>(o.single),
              static_cast<long long>(pixel_frames), seconds, process_cpu_seconds() - cpu_start, base_mb,
              status_mb("VmHWM"), at::get_num_threads(), checksum);
  return 0;
}

int run_driver(const Options& o, const std::string& self) {
  std::printf("Wan VAE decode (%s), random weights, base_dim %lld (Wan 2.1: 96), %lldx%lld pixels, fp32 CPU\n",
              o.mode.c_str(), static_cast<long long>(o.base_dim), static_cast<long long>(o.width),
              static_cast<long long>(o.height));
  std::printf("%8s %8s %10s %10s %12s %12s %12s %12s\n", "latents", "frames", "wall s", "cpu s", "cpu s/latent",
              "before MiB", "peak MiB", "decode MiB");
  for (const int64_t n : o.frames) {
    std::ostringstream cmd;
    cmd << self << " --single " << n << " --height " << o.height << " --width " << o.width << " --base-dim "
        << o.base_dim << " --mode " << o.mode << " --threads " << o.threads;
    FILE* pipe = ::popen(cmd.str().c_str(), "r");
    if (pipe == nullptr) throw std::runtime_error("cannot run " + cmd.str());
    char line[512];
    long long latents = 0, frames = 0;
    int threads = 0;
    double seconds = 0, cpu = 0, base = 0, peak = 0, checksum = 0;
    bool found = false;
    while (std::fgets(line, sizeof(line), pipe) != nullptr) {
      if (std::sscanf(line, "RESULT %lld %lld %lf %lf %lf %lf %d %lf", &latents, &frames, &seconds, &cpu, &base, &peak,
                      &threads, &checksum) == 8) {
        found = true;
      }
    }
    ::pclose(pipe);
    if (!found) throw std::runtime_error("no result from " + cmd.str());
    std::printf("%8lld %8lld %10.2f %10.2f %12.2f %12.1f %12.1f %12.1f\n", latents, frames, seconds, cpu,
                cpu / static_cast<double>(latents), base, peak, peak - base);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  skyreels::runtime::ensure_openblas_coretype(argc, argv);
  try {
    const Options o = parse(argc, argv);
    if (o.single > 0) return run_single(o);
    // Resolved here: inside popen's shell, /proc/self/exe would be the shell.
    return run_driver(o, std::filesystem::read_symlink("/proc/self/exe").string());
  } catch (const std::exception& e) {
    std::cerr << "bench_vae: " << e.what() << "\n";
    return 1;
  }
}
