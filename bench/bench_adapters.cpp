// Adapters per call (issue 33): what an unmerged adapter costs a forward pass, against no adapter and the same adapter
// merged into the weights, at DF-1.3B width (dim 1536, 12 heads, ffn 8960) with a few layers; and what switching to
// an adapter that is not resident costs (AdapterBank::acquire reading, hashing and placing it).
//
//   bench_adapters [--layers 2] [--frames 4] [--height 32] [--width 32] [--text 64] [--ranks 32,64,128]
//                  [--dtype float32|bfloat16] [--warmup 1] [--repeats 3] [--switches 4]
//
// Adapters are random (diffusers keys), touching every linear layer of the model (attention, FFN, time, text, fps,
// head), rank min(r, in, out). Per rank, the three variants run in turn, a pass each per round; times are the median
// wall (and CPU) seconds per pass over --repeats rounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/random_transformer.h"
#include "model/adapter_bank.h"
#include "model/lora.h"
#include "model/runtime.h"
#include "model/safetensors.h"
#include "model/transformer_skyreels_v2.h"

namespace {

using namespace skyreels::model;
using skyreels::bench::process_cpu_seconds;

struct Options {
  int64_t layers = 2, frames = 4, height = 32, width = 32, text = 64;
  std::vector<int64_t> ranks{32, 64, 128};
  std::string dtype = "float32";
  int warmup = 1, repeats = 3, switches = 4;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--layers") {
      o.layers = std::stoll(value);
    } else if (flag == "--frames") {
      o.frames = std::stoll(value);
    } else if (flag == "--height") {
      o.height = std::stoll(value);
    } else if (flag == "--width") {
      o.width = std::stoll(value);
    } else if (flag == "--text") {
      o.text = std::stoll(value);
    } else if (flag == "--ranks") {
      o.ranks.clear();
      std::stringstream s(value);
      std::string item;
      while (std::getline(s, item, ',')) o.ranks.push_back(std::stoll(item));
    } else if (flag == "--dtype") {
      o.dtype = value;
    } else if (flag == "--warmup") {
      o.warmup = std::stoi(value);
    } else if (flag == "--repeats") {
      o.repeats = std::stoi(value);
    } else if (flag == "--switches") {
      o.switches = std::stoi(value);
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  return o;
}

// A random rank-r adapter of every linear layer, as diffusers-key tensors (float32, CPU).
std::vector<std::pair<std::string, at::Tensor>> random_adapter_tensors(const TransformerConfig& c, int64_t rank) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& spec : transformer_parameter_specs(c)) shapes[spec.name] = spec.shape;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& module : transformer_linear_modules(c)) {
    const auto& shape = shapes.at(module + ".weight");
    const int64_t r = std::min({rank, shape[0], shape[1]});
    out.emplace_back("transformer." + module + ".lora_A.weight", at::randn({r, shape[1]}) / std::sqrt(shape[1]));
    out.emplace_back("transformer." + module + ".lora_B.weight", at::randn({shape[0], r}) * 0.01);
  }
  return out;
}

struct Timing {
  double wall = 0, cpu = 0;  // seconds per pass, medians
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Passes of each (model, args) in turn, --repeats rounds after --warmup ones: a load that drifts during the run falls
// on every variant alike, so the ratios within one call hold even on a shared machine.
std::vector<Timing> time_interleaved(
    const std::vector<std::pair<const SkyReelsV2Transformer*, TransformerForwardArgs>>& runs, const Options& o) {
  std::vector<std::vector<double>> walls(runs.size()), cpus(runs.size());
  for (int round = 0; round < o.warmup + o.repeats; ++round) {
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto start = std::chrono::steady_clock::now();
      const double cpu0 = process_cpu_seconds();
      runs[i].first->forward(runs[i].second);
      if (round < o.warmup) continue;
      walls[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      cpus[i].push_back(process_cpu_seconds() - cpu0);
    }
  }
  std::vector<Timing> out;
  for (size_t i = 0; i < runs.size(); ++i) out.push_back({median(walls[i]), median(cpus[i])});
  return out;
}

std::unique_ptr<SkyReelsV2Transformer> model_of(const TransformerConfig& c, skyreels::checkpoint::StateDict weights,
                                                at::ScalarType dtype) {
  return std::make_unique<SkyReelsV2Transformer>(c, std::move(weights), c10::Device(c10::kCPU), dtype);
}

// The base weights with `adapter` merged in float32, then cast (what --lora does at load).
skyreels::checkpoint::StateDict merged_weights(const skyreels::checkpoint::StateDict& base,
                                               const LoraAdapter& adapter) {
  skyreels::checkpoint::StateDict out = base;
  for (const auto& [name, u] : adapter.updates) {
    at::Tensor value = base.at(name).to(at::kFloat);
    merge_loras({adapter}, name, value);
    out[name] = value.to(base.at(name).scalar_type());
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  const Options o = parse(argc, argv);
  TransformerConfig c = TransformerConfig::df_1_3b();
  c.num_layers = o.layers;
  const at::ScalarType dtype = skyreels::checkpoint::parse_dtype(o.dtype);
  const auto specs = transformer_parameter_specs(c);
  const auto base_weights = skyreels::bench::random_weights(c, dtype);
  const auto model = model_of(c, base_weights, dtype);

  at::manual_seed(1);
  TransformerForwardArgs args;
  args.hidden_states = at::randn({1, c.in_channels, o.frames, o.height, o.width});
  args.timestep = at::full({1, o.frames}, 500, at::kLong);
  args.encoder_hidden_states = at::randn({1, o.text, c.text_dim}) * 0.1;
  args.fps = at::ones({1}, at::kLong);
  const int64_t tokens = o.frames * (o.height / 2) * (o.width / 2);
  std::printf("DF-1.3B width, %lld layers, %lld tokens, %lld text rows, %s, %d threads; median of %d rounds\n",
              static_cast<long long>(o.layers), static_cast<long long>(tokens), static_cast<long long>(o.text),
              o.dtype.c_str(), at::get_num_threads(), o.repeats);
  std::printf(
      "| rank | none s / pass | merged s / pass | unmerged s / pass | unmerged / none | unmerged / merged |\n"
      "|---|---|---|---|---|---|\n");
  const std::string dir = std::filesystem::temp_directory_path() / ("bench-adapters-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (const int64_t rank : o.ranks) {
    const std::string path = dir + "/r" + std::to_string(rank) + ".safetensors";
    skyreels::safetensors::save(path, random_adapter_tensors(c, rank));
    const LoraAdapter adapter = read_lora({path, 1.0});
    const auto merged = model_of(c, merged_weights(base_weights, adapter), dtype);
    TransformerForwardArgs with = args;
    with.adapters = {{std::make_shared<const LoraAdapter>(place_lora(adapter, specs, model->device(), dtype)), 1.0}};
    const auto t = time_interleaved({{model.get(), args}, {merged.get(), args}, {model.get(), with}}, o);
    std::printf("| %lld | %.3f (CPU %.3f) | %.3f (CPU %.3f) | %.3f (CPU %.3f) | %.2fx | %.2fx |\n",
                static_cast<long long>(rank), t[0].wall, t[0].cpu, t[1].wall, t[1].cpu, t[2].wall, t[2].cpu,
                t[2].wall / t[0].wall, t[2].wall / t[1].wall);
    std::fflush(stdout);
  }

  // Switching: a bank of one alternates between two files, so every acquire reads, hashes, checks and places one.
  const int64_t switch_rank = o.ranks.back();
  skyreels::safetensors::save(dir + "/other.safetensors", random_adapter_tensors(c, switch_rank));
  std::filesystem::rename(dir + "/r" + std::to_string(switch_rank) + ".safetensors", dir + "/this.safetensors");
  for (const int64_t rank : o.ranks) std::filesystem::remove(dir + "/r" + std::to_string(rank) + ".safetensors");
  const auto catalogue_start = std::chrono::steady_clock::now();
  auto catalogue = std::make_shared<const AdapterCatalogue>(dir, c);
  const double catalogue_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - catalogue_start).count();
  AdapterBank bank(catalogue, model->device(), dtype, 1);
  std::vector<double> loads;
  for (int i = 0; i < o.switches; ++i) {
    const auto start = std::chrono::steady_clock::now();
    bank.acquire(i % 2 == 0 ? "this" : "other");
    loads.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(loads.begin(), loads.end());
  const double mb = static_cast<double>(catalogue->adapters()[0].bytes) / (1 << 20);
  std::printf(
      "\nswitch to a non-resident r%lld adapter (%.1f MiB file, %lld parameters): median %.3f s over %d acquires "
      "(min %.3f, max %.3f); cataloguing the 2 files (headers + SHA-256): %.3f s\n",
      static_cast<long long>(switch_rank), mb, static_cast<long long>(catalogue->adapters()[0].parameters),
      loads[loads.size() / 2], o.switches, loads.front(), loads.back(), catalogue_s);
  std::filesystem::remove_all(dir);
  return 0;
}
