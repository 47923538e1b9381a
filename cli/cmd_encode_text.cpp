// `skyreels encode-text`: prompts -> prompt_embeds [prompts, N, d_model] with the UMT5 text encoder, exactly as the
// diffusers pipeline's _get_t5_prompt_embeds (prompt_clean, T5 tokenizer, encoder, zero padding after each prompt).
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "model/runtime.h"
#include "model/safetensors.h"
#include "model/text_encoding.h"

namespace {

constexpr const char* kUsage =
    "usage: skyreels encode-text --text-encoder DIR [--tokenizer DIR] --prompt TEXT [--prompt TEXT ...]\n"
    "                            [--max-sequence-length N] [--dtype auto|float32|bfloat16] [--device cpu|cuda:N]\n"
    "                            --out OUT.safetensors\n"
    "\n"
    "Encodes prompts with the UMT5 text encoder as the SkyReels-V2 pipeline does (prompt_clean with the ftfy port,\n"
    "T5 tokenizer with EOS / truncation / padding, encoder, rows after each prompt's tokens set to zero) and writes\n"
    "`prompt_embeds` [prompts, N, d_model] (plus `input_ids` and `attention_mask`, int64 [prompts, N]).\n"
    "\n"
    "  --text-encoder DIR         text_encoder folder (transformers or original Wan T5 names; sharded or not), a\n"
    "                             diffusers pipeline folder, or a .safetensors file\n"
    "  --tokenizer DIR            folder with spiece.model (default: next to the text encoder, or ../tokenizer)\n"
    "  --prompt TEXT              a prompt; repeat for several (an empty prompt is allowed)\n"
    "  --max-sequence-length N    tokens per prompt, EOS included (default 512, as the pipeline)\n"
    "  --dtype D                  compute and output dtype (default float32; auto = bf16 where the CPU/GPU has it)\n"
    "  --device D                 cpu (default), cuda, cuda:N\n"
    "  --out FILE                 output safetensors file";

int run_encode_text(const std::vector<std::string>& argv) {
  using skyreels::cli::UsageError;
  const skyreels::cli::Args args(argv);
  args.reject_unknown({"text-encoder", "tokenizer", "prompt", "max-sequence-length", "dtype", "device", "out"});
  const std::string encoder_dir = args.require("text-encoder");
  const std::string out = args.require("out");
  const std::vector<std::string> prompts = args.all("prompt");
  if (prompts.empty()) throw UsageError("at least one --prompt is required");
  const int max_len = args.get_int("max-sequence-length", 512);
  if (max_len < 1) throw UsageError("--max-sequence-length must be at least 1");
  if (!args.positional().empty()) throw UsageError("unexpected argument '" + args.positional().front() + "'");

  skyreels::model::TextEncoderOptions options;
  options.device = args.get("device", "cpu");
  options.dtype = args.get("dtype", "float32");
  options.cache_bytes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto encoder = skyreels::model::TextEncoder::load(encoder_dir, args.get("tokenizer", ""), options);
  const auto t1 = std::chrono::steady_clock::now();
  const auto tokens = encoder->tokenize(prompts, max_len);
  const at::Tensor embeds = encoder->encode_uncached(tokens);
  const auto t2 = std::chrono::steady_clock::now();

  const at::Tensor seq_lens = tokens.attention_mask.sum(1);
  for (size_t i = 0; i < prompts.size(); ++i) {
    spdlog::info("prompt {}: {} tokens{} | {}", i, seq_lens[static_cast<int64_t>(i)].item<int64_t>(),
                 seq_lens[static_cast<int64_t>(i)].item<int64_t>() == max_len ? " (truncated or full)" : "",
                 tokens.cleaned[i]);
  }
  nlohmann::json meta_prompts = prompts;
  skyreels::safetensors::save(out,
                              {{"prompt_embeds", embeds.to(at::kCPU)},
                               {"input_ids", tokens.input_ids},
                               {"attention_mask", tokens.attention_mask}},
                              {{"prompts", meta_prompts.dump()}, {"max_sequence_length", std::to_string(max_len)}});
  std::cout << "wrote " << out << ": prompt_embeds [" << embeds.size(0) << ", " << embeds.size(1) << ", "
            << embeds.size(2) << "] " << c10::toString(embeds.scalar_type()) << " (load "
            << std::chrono::duration<double>(t1 - t0).count() << " s, encode "
            << std::chrono::duration<double>(t2 - t1).count() << " s)\n";
  return 0;
}

}  // namespace

SKYREELS_COMMAND("encode-text", "prompts -> prompt_embeds with the UMT5 text encoder (as the pipeline)", kUsage,
                 run_encode_text);
