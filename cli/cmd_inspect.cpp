// `skyreels inspect DIR`: what a transformer checkpoint is (layout, config, parameters, dtypes) and every problem that
// would stop it from loading. Problems are reported, not thrown: the exit status is 1 when there are any.
#include <ATen/ATen.h>

#include <filesystem>
#include <iostream>
#include <sstream>

#include "cli/command.h"
#include "model/transformer_loader.h"

namespace {

namespace fs = std::filesystem;
using skyreels::model::TransformerCheckpointAnalysis;
using skyreels::model::TransformerConfig;

std::string with_commas(uint64_t n) {
  std::string digits = std::to_string(n);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3) digits.insert(static_cast<size_t>(i), ",");
  return digits;
}

std::string describe_config(const TransformerConfig& c) {
  std::ostringstream os;
  os << "inner dim " << c.inner_dim() << " (" << c.num_attention_heads << " heads x " << c.attention_head_dim << "), "
     << c.num_layers << " layers, ffn " << c.ffn_dim << ", in/out channels " << c.in_channels << "/" << c.out_channels
     << ", text_dim " << c.text_dim << ", freq_dim " << c.freq_dim << ", patch [" << c.patch_size[0] << ", "
     << c.patch_size[1] << ", " << c.patch_size[2] << "], fps embedding " << (c.inject_sample_info ? "yes" : "no")
     << ", cross_attn_norm " << (c.cross_attn_norm ? "yes" : "no") << ", eps " << c.eps;
  if (c.image_dim) {  // image-to-video: the pipeline it runs by default, and what its image tokens must be
    os << "; image branch: image_dim " << *c.image_dim << ", added_kv_proj_dim " << *c.added_kv_proj_dim
       << (c.pos_embed_seq_len ? ", first-last-frame pos_embed " + std::to_string(*c.pos_embed_seq_len) + " tokens"
                               : std::string())
       << " (pipeline i2v)";
  }
  return os.str();
}

void print_row(const std::string& label, const std::string& value) {
  std::cout << label;
  for (size_t i = label.size(); i < 12; ++i) std::cout << ' ';
  std::cout << value << "\n";
}

void print_analysis(const TransformerCheckpointAnalysis& a) {
  print_row("checkpoint", a.path);
  for (const auto& f : a.report.files) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    print_row("file", f + (ec ? "" : " (" + with_commas(size) + " bytes)"));
  }
  print_row("layout", skyreels::model::layout_name(a.report.layout));
  print_row("config", a.report.config_source);
  if (a.config) print_row("", describe_config(*a.config));
  print_row("parameters", with_commas(static_cast<uint64_t>(a.report.parameter_count)) + " in " +
                              std::to_string(a.tensors.size()) + " tensors, " + with_commas(a.report.bytes) +
                              " bytes stored");
  std::string dtypes;
  for (const auto& [name, count] : a.report.stored_dtypes) {
    dtypes += (dtypes.empty() ? "" : ", ") + name + " x " + std::to_string(count);
  }
  print_row("stored", dtypes);
  if (a.report.fp8_tensors > 0 || a.report.scaled_tensors > 0) {
    print_row("fp8", std::to_string(a.report.fp8_tensors) + " tensors stored as fp8 codes, " +
                         std::to_string(a.report.scaled_tensors) + " with a scale tensor; decoded exactly at load");
  }
  for (const auto& note : a.report.notes) print_row("note", note);
  if (a.ok()) {
    print_row("problems", "none: this checkpoint loads");
    return;
  }
  print_row("problems", std::to_string(a.problems.size() + a.match.count()) + " found:");
  std::cout << a.error_message() << "\n";
}

int run_inspect(const std::vector<std::string>& raw) {
  skyreels::cli::Args args(raw);
  args.reject_unknown({});
  if (args.positional().size() != 1) throw skyreels::cli::UsageError("expected exactly one checkpoint path");
  const std::string path = args.positional()[0];
  try {
    const TransformerCheckpointAnalysis a = skyreels::model::analyze_transformer_checkpoint(path);
    print_analysis(a);
    return a.ok() ? 0 : 1;
  } catch (const std::exception& e) {
    // Unreadable input (damaged file, missing shard, unknown keys): still a report, not a crash.
    print_row("checkpoint", path);
    print_row("problems", e.what());
    return 1;
  }
}

}  // namespace

SKYREELS_COMMAND("inspect", "describe a transformer checkpoint: layout, config, parameters, dtypes, problems",
                 "usage: skyreels inspect PATH\n\n"
                 "PATH: a transformer folder (config.json + safetensors, single or sharded), a diffusers pipeline\n"
                 "folder (its transformer/ is read), a .safetensors file or a *.safetensors.index.json.\n"
                 "Accepts the diffusers, original SkyReels-V2/Wan and PR #11850 norm_out.linear layouts.\n"
                 "Exit status: 0 when the checkpoint loads, 1 when problems were found (all are listed).",
                 run_inspect);
