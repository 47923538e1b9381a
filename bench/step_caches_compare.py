#!/usr/bin/env python3
"""TaylorSeer and MagCache (issue 45), ours next to diffusers' hooks, on the same random weights in the same run: per
cache setting the wall time of one T2V video, the transformer calls / token-blocks computed, the distance of the
latents to the uncached run, and the distance between ours and diffusers'.

  /usr/bin/python3 bench/step_caches_compare.py --diffusers-src DIR [--bin build/bin] [--layers 8] [--dim 128]
      [--frames 17] [--size 128] [--steps 20] [--threads 2] [--out DIR]

The model: a SkyReelsV2Transformer3DModel made by diffusers (its own random init, seed 0; T2V config, fp32) and
written as a diffusers checkpoint, read by `skyreels generate`. MagCache's ratios come from `skyreels
calibrate-magcache` on the same weights and prompt, and both sides use that file. Each row runs diffusers'
SkyReelsV2Pipeline (pipeline call timed, construction excluded) and `skyreels generate --pipeline t2v` (its logged
"generated in" time, model load excluded) with the same recorded noise. Prints a markdown table.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import python_deps  # noqa: E402

python_deps.require()
from diffusers_env import import_diffusers, read_safetensors, register_skyreels_block, write_safetensors  # noqa: E402
import importlib  # noqa: E402
import torch  # noqa: E402

SCHEDULER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "golden",
                         "pipeline_t2v", "t1_cfg6_shift8", "scheduler", "scheduler_config.json")
ATTN = r"blocks\.\d+\.attn1,blocks\.\d+\.attn2"

# name: (ours: flags, diffusers: config kwargs)
ROWS = {
    "none": ("", None),
    "taylorseer attn, interval 5, order 1 (diffusers' example)": (
        "--cache taylorseer --taylorseer-cache-interval 5 --taylorseer-disable-cache-before-step 3 "
        "--taylorseer-max-order 1 --taylorseer-factors-dtype float32",
        ("taylorseer", dict(cache_interval=5, disable_cache_before_step=3, max_order=1,
                            taylor_factors_dtype=torch.float32, cache_identifiers=ATTN.split(",")))),
    "taylorseer attn, interval 3, order 2": (
        "--cache taylorseer --taylorseer-cache-interval 3 --taylorseer-disable-cache-before-step 3 "
        "--taylorseer-max-order 2 --taylorseer-factors-dtype float32",
        ("taylorseer", dict(cache_interval=3, disable_cache_before_step=3, max_order=2,
                            taylor_factors_dtype=torch.float32, cache_identifiers=ATTN.split(",")))),
    "taylorseer lite, interval 3": (
        "--cache taylorseer --taylorseer-lite true --taylorseer-cache-interval 3 --taylorseer-disable-cache-before-step 3 "
        "--taylorseer-factors-dtype float32",
        ("taylorseer", dict(cache_interval=3, disable_cache_before_step=3, max_order=1,
                            taylor_factors_dtype=torch.float32, use_lite_mode=True))),
    "magcache 0.06, K 3 (diffusers' defaults)": (
        "--cache magcache --magcache-threshold 0.06 --magcache-max-skip-steps 3 --magcache-retention-ratio 0.2",
        ("magcache", dict(threshold=0.06, max_skip_steps=3, retention_ratio=0.2))),
    "magcache 0.12, K 2 (MagCache's Wan setting)": (
        "--cache magcache --magcache-threshold 0.12 --magcache-max-skip-steps 2 --magcache-retention-ratio 0.2",
        ("magcache", dict(threshold=0.12, max_skip_steps=2, retention_ratio=0.2))),
}


def make_model(d, dir_, layers, dim):
    config = dict(patch_size=[1, 2, 2], num_attention_heads=dim // 32, attention_head_dim=32, in_channels=16,
                  out_channels=16, text_dim=64, freq_dim=256, ffn_dim=4 * dim, num_layers=layers, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                  rope_max_seq_len=1024, pos_embed_seq_len=None, inject_sample_info=False, num_frame_per_block=1)
    torch.manual_seed(0)
    model = d.transformer.SkyReelsV2Transformer3DModel(**config).eval()
    os.makedirs(dir_, exist_ok=True)
    write_safetensors(os.path.join(dir_, "diffusion_pytorch_model.safetensors"), model.state_dict())
    with open(os.path.join(dir_, "config.json"), "w") as f:
        json.dump(dict(config, _class_name="SkyReelsV2Transformer3DModel"), f)
    return config


def run_diffusers(d, args, work, config, cache, ratios):
    transformer = d.transformer.SkyReelsV2Transformer3DModel(**config)
    transformer.load_state_dict(read_safetensors(os.path.join(work, "model", "diffusion_pytorch_model.safetensors")))
    transformer.eval()
    scheduler = d.unipc.UniPCMultistepScheduler.from_config(json.load(open(SCHEDULER)))
    vae = d.vae.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    module = importlib.import_module("diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2")
    pipe = module.SkyReelsV2Pipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae,
                                     scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    if cache is not None:
        kind, kwargs = cache
        if kind == "taylorseer":
            config_cls = importlib.import_module("diffusers.hooks.taylorseer_cache").TaylorSeerCacheConfig
            pipe.transformer.enable_cache(config_cls(**kwargs))
        else:
            config_cls = importlib.import_module("diffusers.hooks.mag_cache").MagCacheConfig
            pipe.transformer.enable_cache(config_cls(mag_ratios=ratios, num_inference_steps=args.steps, **kwargs))
    inputs = read_safetensors(os.path.join(work, "inputs.safetensors"))
    noise = read_safetensors(os.path.join(work, "noise.safetensors"))["noise_000"]
    start = time.perf_counter()
    with torch.no_grad():
        latents = pipe(prompt_embeds=inputs["prompt_embeds"], negative_prompt_embeds=inputs["negative_prompt_embeds"],
                       height=args.size, width=args.size, num_frames=args.frames, num_inference_steps=args.steps,
                       guidance_scale=6.0, latents=noise.clone(), output_type="latent").frames
    return time.perf_counter() - start, latents


def skyreels(args, work, command, flags):
    line = (f"{args.bin}/skyreels {command} --model {work}/model --inputs {work}/inputs.safetensors "
            f"--scheduler-config {SCHEDULER} --num-frames {args.frames} --height {args.size} --width {args.size} "
            f"--num-inference-steps {args.steps} --guidance-scale 6 {flags}")
    out = subprocess.run(line, shell=True, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    if out.returncode != 0:
        sys.exit(line + "\n" + out.stdout + out.stderr)
    return out.stdout + out.stderr


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--diffusers-src", default=os.environ.get("DIFFUSERS_SRC"), required=False)
    parser.add_argument("--bin", default="build/bin")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not args.diffusers_src:
        sys.exit("give --diffusers-src or $DIFFUSERS_SRC")
    torch.set_num_threads(args.threads)
    d = import_diffusers(args.diffusers_src)
    register_skyreels_block(d)
    work = args.out or tempfile.mkdtemp(prefix="step-caches-bench-")
    config = make_model(d, os.path.join(work, "model"), args.layers, args.dim)
    g = torch.Generator().manual_seed(1)
    write_safetensors(os.path.join(work, "inputs.safetensors"),
                      {"prompt_embeds": torch.randn(1, 16, 64, generator=g),
                       "negative_prompt_embeds": torch.randn(1, 16, 64, generator=g)})
    latent = args.size // 8
    write_safetensors(os.path.join(work, "noise.safetensors"),
                      {"noise_000": torch.randn(1, 16, (args.frames - 1) // 4 + 1, latent, latent, generator=g)})
    skyreels(args, work, "calibrate-magcache", f"--noise {work}/noise.safetensors --out {work}/ratios.json")
    ratios = json.load(open(os.path.join(work, "ratios.json")))["ratios_cond"]

    rows, plain = [], {}
    for name, (flags, cache) in ROWS.items():
        seconds_d, latents_d = run_diffusers(d, args, work, config, cache, ratios)
        if "magcache" in flags:
            flags += f" --magcache-ratios {work}/ratios.json"
        log = skyreels(args, work, "generate",
                       f"--pipeline t2v --noise {work}/noise.safetensors {flags} --out {work}/out.safetensors")
        seconds_o = float(re.search(r"generated in ([0-9.]+) s", log).group(1))
        saved = float(re.search(r"([0-9.]+) % of token-rows saved", log).group(1))
        latents_o = read_safetensors(os.path.join(work, "out.safetensors"))["latents"]
        if not plain:
            plain = {"ours": latents_o, "diffusers": latents_d}
        rows.append((name, seconds_o, seconds_d, saved, (latents_o - plain["ours"]).abs().max().item(),
                     (latents_d - plain["diffusers"]).abs().max().item(), (latents_o - latents_d).abs().max().item()))
    print(f"T2V, {args.layers} layers, dim {args.dim}, {args.frames} frames at {args.size}x{args.size}, "
          f"{args.steps} steps, CFG 6, fp32, {args.threads} threads")
    print("| setting | ours s | diffusers s | token-blocks saved | max abs vs uncached, ours | same, diffusers | "
          "ours vs diffusers |")
    print("|---|---|---|---|---|---|---|")
    for name, so, sd, saved, do, dd, od in rows:
        print(f"| {name} | {so:.2f} | {sd:.2f} | {saved:.1f} % | {do:.3g} | {dd:.3g} | {od:.2g} |")


if __name__ == "__main__":
    main()
