// Checkpoint load time against the time to read the same bytes.
//
// Writes a DF-1.3B-shaped random checkpoint (diffusers layout, every tensor BF16: 2.87 GB) to a scratch folder,
// then times, on CPU:
//   read    read() of the whole file into one buffer (the floor for getting the bytes into memory)
//   fp32    load_transformer(float32): header parse, mapping, strict check, BF16 -> F32 conversion, model object
//   bf16    load_transformer(bfloat16): the same, but non-island tensors are copied as they are (no conversion; no
//           weight views the file's mapping since issue 46)
//   bf16+touch  bf16 followed by one pass over every weight (what the first forward would page in)
// and prints each time and its ratio to `read`. The page cache is not dropped (that needs root and would disturb
// other processes); the residency of the file in the page cache (mincore) is printed before each measurement.
//
// Then fp8 against bf16 (issue 23): the same checkpoint converted to F8_E4M3 (`convert --dtype float8_e4m3fn`), and a
// random rank-32 LoRA (diffusers keys, every attention and FFN linear of every block, BF16). Each of bf16, fp8,
// bf16+LoRA and fp8+LoRA is loaded as bfloat16 in a fresh process of its own (so that its peak RSS is its own),
// followed by one pass over every weight (the first forward's reads); printed: load seconds,
// touch seconds, and the child's peak RSS.
// The scratch folder is deleted at the end unless --keep.
//
// usage: bench_loader [--dir DIR] [--keep] [--repeat N] [--fp8-only]   (--fp8-only: skip read / fp32 / bf16)
//        bench_loader --child DIR DTYPE [LORA]   (one measured load; used by the above)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "model/lora.h"
#include "model/runtime.h"
#include "model/safetensors.h"
#include "model/transformer_loader.h"

namespace fs = std::filesystem;
using skyreels::model::TransformerConfig;

namespace {

double seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double peak_rss_gb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1e6;  // ru_maxrss is in KiB on Linux; ~GB
}

// Fraction of the file's pages in the page cache.
double resident_fraction(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st {};
  ::fstat(fd, &st);
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return -1;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((size + page - 1) / page);
  double fraction = -1;
  if (::mincore(map, size, vec.data()) == 0) {
    size_t resident = 0;
    for (unsigned char v : vec) resident += v & 1;
    fraction = static_cast<double>(resident) / static_cast<double>(vec.size());
  }
  ::munmap(map, size);
  return fraction;
}

void write_checkpoint(const std::string& dir, const TransformerConfig& config) {
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << config.to_diffusers_json() << "\n";
  std::vector<skyreels::safetensors::SaveItem> items;
  for (const auto& spec : skyreels::model::transformer_parameter_specs(config)) {
    const auto shape = spec.shape;
    items.push_back({spec.name, at::kBFloat16, shape, [shape] {
                       return at::randn(shape).mul_(0.02).to(at::kBFloat16);  // one tensor in memory at a time
                     }});
  }
  skyreels::safetensors::save_streaming(dir + "/diffusion_pytorch_model.safetensors", items, {{"format", "pt"}});
}

double read_whole_file(const std::string& path, uint64_t& bytes_read) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + path);
  struct stat st {};
  ::fstat(fd, &st);
  const size_t size = static_cast<size_t>(st.st_size);
  std::unique_ptr<char[]> buffer(new char[size]);
  bytes_read = 0;
  const double t = seconds([&] {
    while (bytes_read < size) {
      const ssize_t n = ::read(fd, buffer.get() + bytes_read, std::min<size_t>(size - bytes_read, 1u << 30));
      if (n <= 0) throw std::runtime_error("short read of " + path);
      bytes_read += static_cast<uint64_t>(n);
    }
  });
  ::close(fd);
  volatile char sink = buffer[size / 2];  // keep the read observable
  (void)sink;
  return t;
}

// Reads every byte of every weight once, like a first forward would.
double touch_all(const skyreels::model::SkyReelsV2Transformer& model) {
  double checksum = 0;
  const double t = seconds([&] {
    for (const auto& [name, tensor] : model.named_tensors()) checksum += tensor.abs().sum().item<double>();
  });
  if (checksum < 0) std::cout << "";  // never: keeps the sums from being optimised away
  return t;
}

// A random rank-`rank` adapter in diffusers keys for every attention and FFN linear of every block.
void write_lora(const std::string& path, const TransformerConfig& config, int64_t rank) {
  std::vector<skyreels::safetensors::SaveItem> items;
  for (const auto& spec : skyreels::model::transformer_parameter_specs(config)) {
    const std::string& n = spec.name;
    const bool linear = n.rfind("blocks.", 0) == 0 && spec.shape.size() == 2 &&
                        (n.find(".attn1.") != std::string::npos || n.find(".attn2.") != std::string::npos ||
                         n.find(".ffn.") != std::string::npos) &&
                        n.find("norm") == std::string::npos;
    if (!linear) continue;
    const std::string module = "transformer." + n.substr(0, n.size() - std::string(".weight").size());
    const std::vector<int64_t> a_shape = {rank, spec.shape[1]}, b_shape = {spec.shape[0], rank};
    items.push_back({module + ".lora_A.weight", at::kBFloat16, a_shape,
                     [a_shape] { return at::randn(a_shape).mul_(0.01).to(at::kBFloat16); }});
    items.push_back({module + ".lora_B.weight", at::kBFloat16, b_shape,
                     [b_shape] { return at::randn(b_shape).mul_(0.01).to(at::kBFloat16); }});
  }
  skyreels::safetensors::save_streaming(path, items);
}

// The child: one load, one touch, its own peak RSS.
int child(const std::string& dir, const std::string& dtype, const std::string& lora) {
  skyreels::model::TransformerLoadOptions options{"cpu", dtype};
  if (!lora.empty()) options.loras.push_back({lora, 1.0});
  skyreels::model::LoadedTransformer loaded;
  const double t_load = seconds([&] { loaded = skyreels::model::load_transformer(dir, options); });
  const double t_touch = touch_all(*loaded.model);
  std::printf("RESULT %.3f %.3f %.3f\n", t_load, t_touch, peak_rss_gb());
  return 0;
}

struct ChildResult {
  double load = 0, touch = 0, peak_gb = 0;
};

ChildResult measure(const std::string& dir, const std::string& dtype, const std::string& lora) {
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const std::string command = "'" + self + "' --child '" + dir + "' " + dtype + (lora.empty() ? "" : " '" + lora + "'") +
                              " 2>/dev/null";
  const auto [out, status] = skyreels::bench::command_output(command);
  ChildResult r;
  bool found = false;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (std::sscanf(line.c_str(), "RESULT %lf %lf %lf", &r.load, &r.touch, &r.peak_gb) == 3) found = true;
  }
  if (status != 0 || !found) throw std::runtime_error("measurement failed: " + command);
  return r;
}

void fp8_section(const std::string& dir, const TransformerConfig& config) {
  const std::string fp8_dir = dir + "/fp8";
  const std::string lora = dir + "/adapters/lora_rank32.safetensors";  // outside the checkpoint folder's files
  if (!fs::exists(fp8_dir)) {
    const double t = seconds([&] {
      skyreels::model::convert_transformer_checkpoint(dir, fp8_dir, {"float8_e4m3fn", 5'000'000'000ull});
    });
    std::printf("converted to F8_E4M3 in %.1f s: %.2f GB\n", t,
                static_cast<double>(fs::file_size(fp8_dir + "/diffusion_pytorch_model.safetensors")) / 1e9);
  }
  if (!fs::exists(lora)) {
    fs::create_directories(dir + "/adapters");
    write_lora(lora, config, 32);
    std::printf("rank-32 LoRA (diffusers keys, BF16): %.1f MB\n", static_cast<double>(fs::file_size(lora)) / 1e6);
  }
  std::printf("bfloat16 loads, each in a fresh process:\n");
  std::printf("  %-12s %8s %8s %10s\n", "checkpoint", "load s", "touch s", "peak RSS");
  const std::pair<const char*, std::pair<std::string, std::string>> cases[] = {
      {"bf16", {dir, ""}}, {"fp8", {fp8_dir, ""}}, {"bf16+lora32", {dir, lora}}, {"fp8+lora32", {fp8_dir, lora}}};
  for (const auto& [name, c] : cases) {
    const ChildResult r = measure(c.first, "bfloat16", c.second);
    std::printf("  %-12s %8.3f %8.3f %7.2f GB\n", name, r.load, r.touch, r.peak_gb);
  }
}

}  // namespace

int main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  if (argc >= 4 && std::string(argv[1]) == "--child") {
    try {
      return child(argv[2], argv[3], argc >= 5 ? argv[4] : "");
    } catch (const std::exception& e) {
      std::cerr << "bench_loader --child: " << e.what() << "\n";
      return 1;
    }
  }
  std::string dir = "/tmp/skyreels-bench-loader-" + std::to_string(::getpid());
  bool keep = false;
  bool fp8_only = false;
  int repeat = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else if (a == "--keep") {
      keep = true;
    } else if (a == "--fp8-only") {
      fp8_only = true;
    } else if (a == "--repeat" && i + 1 < argc) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else {
      std::cerr << "usage: bench_loader [--dir DIR] [--keep] [--repeat N] [--fp8-only]\n";
      return 2;
    }
  }
  const TransformerConfig config = TransformerConfig::df_1_3b();
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  std::printf("threads %d, checkpoint %s (DF-1.3B shapes, BF16)\n", at::get_num_threads(), dir.c_str());

  try {
    if (!fs::exists(file)) {
      const double t = seconds([&] { write_checkpoint(dir, config); });
      std::printf("wrote %.2f GB in %.1f s\n", static_cast<double>(fs::file_size(file)) / 1e9, t);
    }
    for (int r = 0; r < (fp8_only ? 0 : repeat); ++r) {
      uint64_t bytes = 0;
      std::printf("page cache residency before read: %.0f%%\n", 100 * resident_fraction(file));
      const double t_read = read_whole_file(file, bytes);
      std::printf("read      %6.3f s  %.2f GB/s  (%.2f GB into one buffer)\n", t_read,
                  static_cast<double>(bytes) / 1e9 / t_read, static_cast<double>(bytes) / 1e9);

      std::printf("page cache residency before fp32 load: %.0f%%\n", 100 * resident_fraction(file));
      double t_fp32 = 0;
      int64_t params = 0;
      {
        skyreels::model::LoadedTransformer loaded;
        t_fp32 = seconds([&] { loaded = skyreels::model::load_transformer(dir, {"cpu", "float32"}); });
        params = loaded.report.parameter_count;
      }
      std::printf("fp32      %6.3f s  ratio %.2f x read  (%lld parameters)\n", t_fp32, t_fp32 / t_read,
                  static_cast<long long>(params));

      double t_bf16 = 0, t_touch = 0;
      {
        skyreels::model::LoadedTransformer loaded;
        t_bf16 = seconds([&] { loaded = skyreels::model::load_transformer(dir, {"cpu", "bfloat16"}); });
        t_touch = touch_all(*loaded.model);
      }
      std::printf("bf16      %6.3f s  ratio %.2f x read  (zero-copy views: pages are not read yet)\n", t_bf16,
                  t_bf16 / t_read);
      std::printf("bf16+touch %5.3f s  ratio %.2f x read  (one pass over every weight after the load)\n",
                  t_bf16 + t_touch, (t_bf16 + t_touch) / t_read);
      std::printf("peak RSS %.2f GB\n", peak_rss_gb());
    }
    for (int r = 0; r < repeat; ++r) fp8_section(dir, config);
  } catch (const std::exception& e) {
    std::cerr << "bench_loader: " << e.what() << "\n";
    if (!keep) fs::remove_all(dir);
    return 1;
  }
  if (!keep) fs::remove_all(dir);
  std::printf("%s %s\n", keep ? "kept" : "deleted", dir.c_str());
  return 0;
}
