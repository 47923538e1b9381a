// `skyreels convert SRC DST`: rewrites any accepted transformer checkpoint in the diffusers layout.
#include <cctype>
#include <iostream>

#include "cli/command.h"
#include "model/transformer_loader.h"

namespace {

// "5GB" (10^9, as diffusers/huggingface_hub read it), "5GiB" (2^30), "500MB", "64KB", or plain bytes.
uint64_t parse_size(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string unit = text.substr(digits);
  static const std::pair<const char*, uint64_t> units[] = {{"", 1},
                                                           {"B", 1},
                                                           {"KB", 1000ull},
                                                           {"MB", 1000000ull},
                                                           {"GB", 1000000000ull},
                                                           {"KiB", 1ull << 10},
                                                           {"MiB", 1ull << 20},
                                                           {"GiB", 1ull << 30}};
  for (const auto& [name, scale] : units) {
    if (digits > 0 && digits <= 15 && unit == name) return std::stoull(text.substr(0, digits)) * scale;
  }
  throw skyreels::cli::UsageError("--max-shard-size '" + text +
                                  "': expected bytes, or a number with KB/MB/GB/KiB/MiB/GiB");
}

int run_convert(const std::vector<std::string>& raw) {
  skyreels::cli::Args args(raw);
  args.reject_unknown({"dtype", "max-shard-size"});
  if (args.positional().size() != 2) throw skyreels::cli::UsageError("expected SRC and DST");
  skyreels::model::ConvertOptions options;
  options.dtype = args.get("dtype");
  if (!options.dtype.empty() && options.dtype != "float32" && options.dtype != "bfloat16" &&
      options.dtype != "float8_e4m3fn") {
    throw skyreels::cli::UsageError("--dtype '" + options.dtype + "': expected float32, bfloat16 or float8_e4m3fn");
  }
  if (args.has("max-shard-size")) options.max_shard_size = parse_size(args.get("max-shard-size"));
  if (options.max_shard_size == 0) throw skyreels::cli::UsageError("--max-shard-size must be > 0");

  const auto result =
      skyreels::model::convert_transformer_checkpoint(args.positional()[0], args.positional()[1], options);
  std::cout << "read " << args.positional()[0] << " (layout " << skyreels::model::layout_name(result.source.layout)
            << ", config " << result.source.config_source << ")\n";
  for (const auto& note : result.source.notes) std::cout << "  " << note << "\n";
  std::cout << "wrote " << result.bytes << " bytes of tensors" << (options.dtype.empty() ? "" : " as " + options.dtype)
            << ":\n";
  for (const auto& f : result.files) std::cout << "  " << f << "\n";
  return 0;
}

}  // namespace

SKYREELS_COMMAND("convert", "rewrite a transformer checkpoint in the diffusers layout (optionally sharded, recast)",
                 "usage: skyreels convert SRC DST [--dtype float32|bfloat16|float8_e4m3fn] [--max-shard-size BYTES]\n\n"
                 "SRC: any checkpoint `skyreels inspect` accepts (diffusers, original SkyReels-V2/Wan, PR #11850\n"
                 "norm_out.linear; single, sharded or a pipeline folder). It is checked strictly first.\n"
                 "DST: a new or empty folder; receives config.json and diffusion_pytorch_model.safetensors, or\n"
                 "diffusion_pytorch_model-0000k-of-0000n.safetensors shards plus\n"
                 "diffusion_pytorch_model.safetensors.index.json when the tensors exceed --max-shard-size\n"
                 "(default 5GB; accepts bytes or KB/MB/GB/KiB/MiB/GiB).\n"
                 "--dtype: store float32 or bfloat16 (fp32 islands stay float32); default keeps stored dtypes.\n"
                 "  float8_e4m3fn: matrix weights (2+ dims, not fp32 islands) as F8_E4M3 codes without scales,\n"
                 "  rounded to nearest, ties to even, as PyTorch's .to(torch.float8_e4m3fn); a value PyTorch would\n"
                 "  turn into NaN (|x| >= 464) is an error naming the tensor; other tensors keep their dtype.\n"
                 "  An fp8 or scaled source needs --dtype.",
                 run_convert);
