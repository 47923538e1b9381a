// Wan VAE decode and encode: time, achieved GFLOP/s against this process's own matmul and convolution peaks, and
// peak memory against the number of latent frames, with a randomly initialised model of the released Wan 2.1 VAE's
// shape (or a narrower one with --base-dim).
//
//   bench_vae --mode compare [--frames 6] [--height 64] [--width 64] [--dtype float32|bfloat16] [--repeats 2]
//             [--frames-per-call 0] [--threads N]
//     One process: the peaks, then diffusers' order (one latent frame per decoder call, one chunk of 4 pixel frames
//     per encoder call) and the batched one (--frames-per-call latent frames, 0 = from kVaeMemoryBudgetBytes; the
//     encoder's chunks per call from the same budget) interleaved, repeat by repeat; best times, their ratio, the
//     max |difference| between the two, and in bfloat16 also against the float32 model with the same weights.
//   bench_vae --mode stream|whole [--frames 1,3,6,12] [--frames-per-call 0] [--device cpu|cuda:N] ...
//     Each length in a fresh process (this binary re-executed with --single), so its peak RSS (VmHWM) is its own.
//     "stream" hands every call's pixels on and drops them (what `skyreels decode --out x.mp4` and the server do);
//     "whole" keeps the full video tensor (decode()), so it also grows by the size of the output.
//
// FLOPs (multiply-add = 2) are those of the convolutions and attention matmuls, counted layer by layer from the
// config (vae_flops below); norms, activations, padding and upsampling copies are not counted.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_peak.h"
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
  int64_t height = 64, width = 64, base_dim = 96, frames_per_call = 0;
  std::string mode = "stream", dtype = "float32", device = "cpu";
  int threads = 0, repeats = 2;
  bool profile = false;
  int64_t single = -1;  // internal: run one length and print one RESULT line
};

Options parse(int argc, char** argv) {
  Options o;
  bool frames_given = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--frames") {
      o.frames.clear();
      frames_given = true;
      std::stringstream s(value);
      std::string item;
      while (std::getline(s, item, ',')) o.frames.push_back(std::stoll(item));
    } else if (flag == "--height") {
      o.height = std::stoll(value);
    } else if (flag == "--width") {
      o.width = std::stoll(value);
    } else if (flag == "--base-dim") {
      o.base_dim = std::stoll(value);
    } else if (flag == "--frames-per-call") {
      o.frames_per_call = std::stoll(value);
    } else if (flag == "--mode") {
      o.mode = value;
    } else if (flag == "--dtype") {
      o.dtype = value;
    } else if (flag == "--device") {
      o.device = value;
    } else if (flag == "--profile") {
      o.profile = value == "1";
    } else if (flag == "--repeats") {
      o.repeats = std::stoi(value);
    } else if (flag == "--threads") {
      o.threads = std::stoi(value);
    } else if (flag == "--single") {
      o.single = std::stoll(value);
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  if (o.height % 8 != 0 || o.width % 8 != 0) throw std::invalid_argument("--height/--width must be multiples of 8");
  if (o.mode != "stream" && o.mode != "whole" && o.mode != "compare") {
    throw std::invalid_argument("--mode is stream, whole or compare");
  }
  if (o.dtype != "float32" && o.dtype != "bfloat16") throw std::invalid_argument("--dtype is float32 or bfloat16");
  if (o.mode == "compare" && !frames_given) o.frames = {6};
  return o;
}

at::ScalarType dtype_of(const std::string& name) { return name == "bfloat16" ? at::kBFloat16 : at::kFloat; }

// Random weights with unit-variance activations (conv weights ~ N(0, 1/fan_in), norms 1, biases 0).
WanVae random_vae(const WanVaeConfig& config, at::ScalarType dtype,
                  const c10::Device& device = c10::Device(c10::kCPU)) {
  at::manual_seed(0);
  skyreels::checkpoint::StateDict weights;
  for (const auto& spec : skyreels::model::wan_vae_parameter_specs(config)) {
    const bool is_weight = spec.name.size() > 7 && spec.name.compare(spec.name.size() - 7, 7, ".weight") == 0;
    at::Tensor t;
    if (is_weight) {
      int64_t fan_in = 1;
      for (size_t d = 1; d < spec.shape.size(); ++d) fan_in *= spec.shape[d];
      t = at::randn(spec.shape).div_(std::sqrt(static_cast<double>(fan_in)));  // no temporary
    } else if (spec.name.find(".gamma") != std::string::npos) {
      t = at::ones(spec.shape);
    } else {
      t = at::zeros(spec.shape);
    }
    weights[spec.name] = t.to(device, dtype);
  }
  return WanVae(config, std::move(weights), device, dtype);
}

// ---- FLOPs of the layers, walked as the model is built (vae_wan_encoder_decoder.cpp) ------------------------------
struct Flops {
  double total = 0;
  void conv(double cin, double cout, double k, double positions) { total += 2 * cin * cout * k * positions; }
  // Per-frame single-head attention over `hw` pixels: qkv and proj (1x1), scores and values.
  void attention(double c, double hw, double frames) {
    total += frames * (2 * c * 3 * c * hw + 2 * c * c * hw + 4 * hw * hw * c);
  }
  void residual(double in, double out, double positions) {
    conv(in, out, 27, positions);
    conv(out, out, 27, positions);
    if (in != out) conv(in, out, 1, positions);
  }
};

// Decode of `latents` latent frames of h x w, as one sequence (the split into calls does not change the count).
double decode_flops(const WanVaeConfig& c, double latents, double h, double w) {
  Flops f;
  const double dim = static_cast<double>(c.decoder_dim());
  std::vector<double> dims{dim * static_cast<double>(c.dim_mult.back())};
  for (auto it = c.dim_mult.rbegin(); it != c.dim_mult.rend(); ++it) dims.push_back(dim * static_cast<double>(*it));
  const std::vector<bool> up(c.temperal_downsample.rbegin(), c.temperal_downsample.rend());
  const double z = static_cast<double>(c.z_dim);
  double t = latents;
  f.conv(z, z, 1, t * h * w);  // post_quant_conv
  f.conv(z, dims[0], 27, t * h * w);
  f.residual(dims[0], dims[0], t * h * w);
  f.attention(dims[0], h * w, t);
  f.residual(dims[0], dims[0], t * h * w);
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    double in = i > 0 ? dims[i] / 2 : dims[i];
    const double out = dims[i + 1];
    for (int64_t r = 0; r <= c.num_res_blocks; ++r) {
      f.residual(in, out, t * h * w);
      in = out;
    }
    if (i + 1 == dims.size() - 1) break;
    if (up[i]) {
      f.conv(out, 2 * out, 3, (t - 1) * h * w);  // time_conv: every frame but the first
      t = 1 + 2 * (t - 1);
    }
    h *= 2;
    w *= 2;
    f.conv(out, out / 2, 9, t * h * w);
  }
  f.conv(dims.back(), static_cast<double>(c.out_channels), 27, t * h * w);
  return f.total;
}

// Encode of `frames` = 1 + 4k pixel frames of H x W.
double encode_flops(const WanVaeConfig& c, double frames, double h, double w) {
  Flops f;
  std::vector<double> dims{static_cast<double>(c.base_dim)};
  for (int64_t m : c.dim_mult) dims.push_back(static_cast<double>(c.base_dim * m));
  double t = frames;
  f.conv(static_cast<double>(c.in_channels), dims[0], 27, t * h * w);
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    double in = dims[i];
    const double out = dims[i + 1];
    for (int64_t r = 0; r < c.num_res_blocks; ++r) {
      f.residual(in, out, t * h * w);
      in = out;
    }
    if (i + 1 == c.dim_mult.size()) break;
    h /= 2;
    w /= 2;
    f.conv(out, out, 9, t * h * w);
    if (c.temperal_downsample[i]) {
      t = 1 + (t - 1) / 2;
      f.conv(out, out, 3, (t - 1) * h * w);  // strided time_conv: every output frame but the first
    }
  }
  f.residual(dims.back(), dims.back(), t * h * w);
  f.attention(dims.back(), h * w, t);
  f.residual(dims.back(), dims.back(), t * h * w);
  const double z2 = 2 * static_cast<double>(c.z_dim);
  f.conv(dims.back(), z2, 27, t * h * w);
  f.conv(z2, z2, 1, t * h * w);  // quant_conv
  return f.total;
}

// --profile 1: seconds per outermost ATen op (nested ops are inside their caller's time), all threads.
class OpProfile {
 public:
  OpProfile() {
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (depth()++ != 0) return nullptr;
              auto ctx = std::make_unique<Ctx>();
              ctx->name = fn.name();
              ctx->start = std::chrono::steady_clock::now();
              return ctx;
            },
            [](const at::RecordFunction&, at::ObserverContext* ctx) {
              --depth();
              if (ctx == nullptr) return;
              auto* c = static_cast<Ctx*>(ctx);
              const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - c->start).count();
              std::lock_guard<std::mutex> lock(mu());
              table()[c->name] += s;
            })
            .scopes({at::RecordScope::FUNCTION}));
  }
  ~OpProfile() { at::removeCallback(handle_); }
  static void print(const char* title) {
    std::lock_guard<std::mutex> lock(mu());
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [name, s] : table()) rows.emplace_back(s, name);
    std::sort(rows.rbegin(), rows.rend());
    std::printf("%s: seconds per outermost op\n", title);
    for (size_t i = 0; i < std::min<size_t>(rows.size(), 14); ++i) {
      std::printf("  %-40s %8.3f\n", rows[i].second.c_str(), rows[i].first);
    }
    table().clear();
  }

 private:
  struct Ctx : at::ObserverContext {
    std::string name;
    std::chrono::steady_clock::time_point start;
  };
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::map<std::string, double>& table() {
    static std::map<std::string, double> t;
    return t;
  }
  at::CallbackHandle handle_;
};

double seconds_of(const std::function<void()>& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

int run_compare(const Options& o) {
  skyreels::runtime::configure_threads(o.threads);
  const at::ScalarType dtype = dtype_of(o.dtype);
  WanVaeConfig config = WanVaeConfig::wan_2_1();
  config.base_dim = o.base_dim;
  const int64_t latents = o.frames.front(), h = o.height / 8, w = o.width / 8;
  skyreels::bench::Peaks peaks = skyreels::bench::measure_peaks(dtype);
  const WanVae vae = random_vae(config, dtype);
  at::manual_seed(1);
  const at::Tensor z = at::randn({1, config.z_dim, latents, h, w}).to(dtype);
  const int64_t fpc = o.frames_per_call > 0 ? o.frames_per_call : vae.decode_frames_per_call(1, h, w);
  const int64_t pixel_frames = config.pixel_frames(latents);
  const int64_t cpc = vae.encode_chunks_per_call(1, o.height, o.width);
  std::printf(
      "Wan VAE %s, random weights, base_dim %lld, %lld latent frames (%lld pixel frames) of %lldx%lld, %d threads\n"
      "peaks in this process: matmul %.1f GFLOP/s, conv3d %.1f GFLOP/s\n"
      "batched: %lld latent frames per decoder call, %lld chunks of 4 frames per encoder call\n",
      o.dtype.c_str(), static_cast<long long>(o.base_dim), static_cast<long long>(latents),
      static_cast<long long>(pixel_frames), static_cast<long long>(o.width), static_cast<long long>(o.height),
      at::get_num_threads(), peaks.matmul_gflops, peaks.conv_gflops, static_cast<long long>(fpc),
      static_cast<long long>(cpc));
  if (o.profile) {
    OpProfile profile;
    vae.decode(z, 1);
    OpProfile::print("decode, 1 latent frame per call");
    vae.decode(z, fpc);
    OpProfile::print("decode, batched");
  }
  double dec_old = 1e30, dec_new = 1e30, enc_old = 1e30, enc_new = 1e30, dec_diff = 0, enc_diff = 0;
  at::Tensor video_new;
  auto timed = [](const std::function<void()>& f, double* best) {
    const double cpu = process_cpu_seconds();
    const double wall = seconds_of(f);
    *best = std::min(*best, wall);
    return std::make_pair(wall, process_cpu_seconds() - cpu);
  };
  // Repeat 0 warms both paths up (first-touch pages, oneDNN primitives); it is printed, not counted.
  for (int r = 0; r <= std::max(1, o.repeats); ++r) {
    double ignore = 1e30;
    at::Tensor video_old;
    const auto d1 = timed([&] { video_old = vae.decode(z, 1); }, r == 0 ? &ignore : &dec_old);
    const auto d2 = timed([&] { video_new = vae.decode(z, fpc); }, r == 0 ? &ignore : &dec_new);
    dec_diff = std::max(dec_diff, max_abs(video_old, video_new));
    WanVae::Posterior p_old, p_new;
    const auto e1 = timed([&] { p_old = vae.encode(video_old, 1); }, r == 0 ? &ignore : &enc_old);
    const auto e2 = timed([&] { p_new = vae.encode(video_old, cpc); }, r == 0 ? &ignore : &enc_new);
    enc_diff = std::max(enc_diff, max_abs(p_old.mean, p_new.mean));
    std::printf("repeat %d%s: decode %.2f s (cpu %.2f) -> %.2f s (cpu %.2f), encode %.2f s (cpu %.2f) -> %.2f s (cpu %.2f)\n",
                r, r == 0 ? " (warm-up)" : "", d1.first, d1.second, d2.first, d2.second, e1.first, e1.second,
                e2.first, e2.second);
    std::fflush(stdout);
  }
  // Peaks again after the work (the machine may be shared): the better of the two runs is the limit.
  const skyreels::bench::Peaks after = skyreels::bench::measure_peaks(dtype);
  peaks.matmul_gflops = std::max(peaks.matmul_gflops, after.matmul_gflops);
  peaks.conv_gflops = std::max(peaks.conv_gflops, after.conv_gflops);
  std::printf("peaks after: matmul %.1f GFLOP/s, conv3d %.1f GFLOP/s (the better of before/after is used)\n",
              after.matmul_gflops, after.conv_gflops);
  const double dflops = decode_flops(config, static_cast<double>(latents), static_cast<double>(h),
                                     static_cast<double>(w));
  const double eflops = encode_flops(config, static_cast<double>(pixel_frames), static_cast<double>(o.height),
                                     static_cast<double>(o.width));
  auto row = [&](const char* stage, const char* order, double flops, double seconds) {
    const double gflops = flops / seconds / 1e9;
    std::printf("| %s | %s | %.2f | %.1f | %.1f | %.0f %% | %.0f %% |\n", stage, order, seconds, flops / 1e9, gflops,
                100 * gflops / peaks.matmul_gflops, 100 * gflops / peaks.conv_gflops);
  };
  std::printf("| stage | order | best s | GFLOP | GFLOP/s | of matmul peak | of conv peak |\n|---|---|---|---|---|---|---|\n");
  row("decode", "1 latent frame per call", dflops, dec_old);
  row("decode", "batched", dflops, dec_new);
  row("encode", "1 chunk per call", eflops, enc_old);
  row("encode", "batched", eflops, enc_new);
  std::printf("decode speed-up %.2fx (max |diff| %.2e), encode speed-up %.2fx (max |diff| of the mean %.2e)\n",
              dec_old / dec_new, dec_diff, enc_old / enc_new, enc_diff);
  if (dtype != at::kFloat) {
    const WanVae reference = random_vae(config, at::kFloat);
    const at::Tensor video32 = reference.decode(z.to(at::kFloat), fpc);
    std::printf("%s decode vs float32 with the same weights: max |diff| %.3e, mean |diff| %.3e (video in [-1, 1])\n",
                o.dtype.c_str(), max_abs(video_new, video32),
                (video_new.to(at::kFloat) - video32).abs().mean().item<double>());
  }
  return 0;
}

int run_single(const Options& o) {
  skyreels::runtime::configure_threads(o.threads);
  WanVaeConfig config = WanVaeConfig::wan_2_1();
  config.base_dim = o.base_dim;
  const at::ScalarType dtype = dtype_of(o.dtype);
  const c10::Device device(o.device);
  const WanVae vae = random_vae(config, dtype, device);
  const at::Tensor z = at::randn({1, config.z_dim, o.single, o.height / 8, o.width / 8}).to(device, dtype);
  skyreels::bench::sync_device(device);
  skyreels::bench::reset_peak_device_memory(device);
  // Start the peak from here: model creation must not hide a decode peak below its own.
  std::ofstream clear_refs("/proc/self/clear_refs");
  const bool reset = static_cast<bool>(clear_refs << "5" << std::flush);  // "5": reset VmHWM (Linux >= 4.0)
  const double base_mb = reset ? status_mb("VmRSS") : status_mb("VmHWM");

  const double cpu_start = process_cpu_seconds();
  const auto start = std::chrono::steady_clock::now();
  int64_t pixel_frames = 0;
  double checksum = 0.0;
  if (o.mode == "stream") {
    skyreels::model::WanVaeDecodeSession session(vae, o.frames_per_call);
    const int64_t step = o.frames_per_call > 0 ? o.frames_per_call
                                               : vae.decode_frames_per_call(1, o.height / 8, o.width / 8);
    for (int64_t f = 0; f < o.single; f += step) {
      const at::Tensor pixels = session.decode(z.narrow(2, f, std::min(step, o.single - f)));
      pixel_frames += pixels.size(2);
      checksum += pixels.to(at::kFloat).mean().item<double>();
    }
  } else {
    const at::Tensor video = vae.decode(z, o.frames_per_call);
    pixel_frames = video.size(2);
    checksum = video.to(at::kFloat).mean().item<double>();
  }
  skyreels::bench::sync_device(device);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The last field: peak device memory (MiB) of the decode on a CUDA device, 0 on the CPU.
  std::printf("RESULT %lld %lld %.3f %.3f %.1f %.1f %d %.6f %.0f\n", static_cast<long long>(o.single),
              static_cast<long long>(pixel_frames), seconds, process_cpu_seconds() - cpu_start, base_mb,
              status_mb("VmHWM"), at::get_num_threads(), checksum, skyreels::bench::peak_device_mib(device));
  return 0;
}

int run_driver(const Options& o, const std::string& self) {
  std::printf("Wan VAE decode (%s, %s, frames per call %s), random weights, base_dim %lld (Wan 2.1: 96), %lldx%lld "
              "pixels, CPU\n",
              o.mode.c_str(), o.dtype.c_str(),
              o.frames_per_call > 0 ? std::to_string(o.frames_per_call).c_str() : "from the memory budget",
              static_cast<long long>(o.base_dim), static_cast<long long>(o.width), static_cast<long long>(o.height));
  std::printf("%8s %8s %10s %10s %12s %12s %12s %12s\n", "latents", "frames", "wall s", "cpu s", "cpu s/latent",
              "before MiB", "peak MiB", "decode MiB");
  for (const int64_t n : o.frames) {
    std::ostringstream cmd;
    cmd << self << " --single " << n << " --height " << o.height << " --width " << o.width << " --base-dim "
        << o.base_dim << " --mode " << o.mode << " --threads " << o.threads << " --dtype " << o.dtype
        << " --device " << o.device
        << " --frames-per-call " << o.frames_per_call;
    const std::string out = skyreels::bench::command_output(cmd.str()).text;
    long long latents = 0, frames = 0;
    int threads = 0;
    double seconds = 0, cpu = 0, base = 0, peak = 0, checksum = 0;
    bool found = false;
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      if (std::sscanf(line.c_str(), "RESULT %lld %lld %lf %lf %lf %lf %d %lf", &latents, &frames, &seconds, &cpu,
                      &base, &peak, &threads, &checksum) == 8) {
        found = true;
      }
    }
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
    if (o.mode == "compare") return run_compare(o);
    // Resolved here: inside popen's shell, /proc/self/exe would be the shell.
    return run_driver(o, std::filesystem::read_symlink("/proc/self/exe").string());
  } catch (const std::exception& e) {
    std::cerr << "bench_vae: " << e.what() << "\n";
    return 1;
  }
}
