#!/usr/bin/env python3
"""diffusers' own SkyReels-V2 diffusion-forcing pipeline, timed on given weights: what bench_step_savings compares
its rows with (it writes the weights and the prompt embeddings, runs this, and reads the one JSON line it prints).

  /usr/bin/python3 bench/diffusers_pipeline_time.py --diffusers-src DIR --weights DIR --embeds FILE.safetensors
      --num-frames 97 --base-num-frames 97 [--overlap-history 17] --ar-step 5 --causal-block-size 5 --steps 30
      --height 64 --width 64 --seed 42 [--fbc-threshold T] [--threads N] [--out latents.safetensors]
      [--guidance-scale G] [--sampler unipc|euler] [--flow-shift S] [--timesteps 1000,750,500,250]

Guidance 1 by default (one transformer call per row; above 1 the embeds file needs negative_prompt_embeds), fp32,
the scheduler config of the golden fixtures (flow UniPC, shift 8; --flow-shift changes it). --sampler euler:
diffusers' FlowMatchEulerDiscreteScheduler(shift=--flow-shift) with the DF pipeline's int64 timestep passed to
step() as a float, and --timesteps handed to every per-frame copy (scripts/diffusers_env.py: euler_for_df); bench_samplers.
With --fbc-threshold: diffusers' FirstBlockCache (the registry line it lacks added, state reset at every chunk start
as `--cache-scope chunk` does). Prints {"seconds", "calls", "skipped"}: the pipeline call only (model construction
and loading excluded), every transformer call and the ones FirstBlockCache skipped. `--check` alone only checks the
Python packages (scripts/python_deps.py): a missing one is named, with the apt-get line, in the first line of stderr.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import python_deps  # noqa: E402  (standard library only)

python_deps.require()  # every package diffusers needs, named in one line, before anything imports them
from diffusers_env import (euler_for_df, import_diffusers, read_safetensors, register_skyreels_block,  # noqa: E402
                           write_safetensors)
import torch  # noqa: E402  (after diffusers_env, which names a missing package in its first line)

SCHEDULER = {  # the golden fixtures' scheduler_config.json (diffusers' flow UniPC as SkyReels-V2 configures it)
    "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001, "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero", "flow_shift": 8.0, "lower_order_final": True,
    "num_train_timesteps": 1000, "predict_x0": True, "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False, "sample_max_value": 1.0, "shift_terminal": None, "sigma_max": None,
    "sigma_min": None, "solver_order": 2, "solver_p": None, "solver_type": "bh2", "steps_offset": 0,
    "thresholding": False, "time_shift_type": "exponential", "timestep_spacing": "linspace", "trained_betas": None,
    "use_beta_sigmas": False, "use_dynamic_shifting": False, "use_exponential_sigmas": False, "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}


def main():
    if sys.argv[1:] == ["--check"]:  # the benches run this first; the packages were checked on import
        print("{}")
        return
    p = argparse.ArgumentParser()
    p.add_argument("--diffusers-src", default=os.environ.get("DIFFUSERS_SRC"), required=False)
    p.add_argument("--weights", required=True)
    p.add_argument("--embeds", required=True)
    for name, default in [("num-frames", 97), ("base-num-frames", 97), ("ar-step", 0), ("causal-block-size", 1),
                          ("steps", 30), ("height", 64), ("width", 64), ("seed", 42), ("threads", 0)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--overlap-history", type=int, default=None)
    p.add_argument("--fbc-threshold", type=float, default=None)
    p.add_argument("--guidance-scale", type=float, default=1.0)
    p.add_argument("--sampler", choices=["unipc", "euler"], default="unipc")
    p.add_argument("--flow-shift", type=float, default=None)
    p.add_argument("--timesteps", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not a.diffusers_src:
        sys.exit("--diffusers-src (or DIFFUSERS_SRC): a diffusers source tree")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    d = import_diffusers(a.diffusers_src)

    config = json.load(open(os.path.join(a.weights, "config.json")))
    transformer = d.transformer.SkyReelsV2Transformer3DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    missing, unexpected = transformer.load_state_dict(
        read_safetensors(os.path.join(a.weights, "diffusion_pytorch_model.safetensors")), strict=False)
    if unexpected or [k for k in missing if "rope" not in k]:
        sys.exit("weights do not fit diffusers' model: missing %s, unexpected %s" % (missing[:5], unexpected[:5]))
    transformer.eval()
    vae = d.vae.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])  # only its scale factors (4, 8) are used
    if a.sampler == "euler":
        scheduler = euler_for_df(d)(num_train_timesteps=1000, shift=a.flow_shift if a.flow_shift else 1.0)
        if a.timesteps:
            scheduler.fixed_timesteps = [int(t) for t in a.timesteps.split(",")]
            a.steps = len(scheduler.fixed_timesteps)
    else:
        sched_config = dict(SCHEDULER)
        if a.flow_shift:
            sched_config["flow_shift"] = a.flow_shift
        scheduler = d.unipc.UniPCMultistepScheduler.from_config(sched_config)
    pipe = d.pipeline.SkyReelsV2DiffusionForcingPipeline(tokenizer=None, text_encoder=None, transformer=transformer,
                                                         vae=vae, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)

    calls, skipped = [0], [0]
    real_forward = transformer.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return real_forward(*args, **kwargs)

    transformer.forward = counted
    if a.fbc_threshold is not None:
        register_skyreels_block(d)
        transformer.enable_cache(d.fbc.FirstBlockCacheConfig(threshold=a.fbc_threshold))
        real_should = d.fbc.FBCHeadBlockHook._should_compute_remaining_blocks

        def should(self, residual):
            compute = real_should(self, residual)
            skipped[0] += 0 if compute else 1
            return compute

        d.fbc.FBCHeadBlockHook._should_compute_remaining_blocks = should
        real_prepare = pipe.prepare_latents

        def prepare_latents(*args, **kwargs):  # scope chunk: no state crosses a chunk
            transformer._reset_stateful_cache()
            return real_prepare(*args, **kwargs)

        pipe.prepare_latents = prepare_latents

    embeds = read_safetensors(a.embeds)
    negative = embeds.get("negative_prompt_embeds") if a.guidance_scale > 1.0 else None
    kwargs = dict(prompt=None, prompt_embeds=embeds["prompt_embeds"], negative_prompt_embeds=negative, height=a.height,
                  width=a.width, num_frames=a.num_frames, num_inference_steps=a.steps,
                  guidance_scale=a.guidance_scale, output_type="latent", fps=24,
                  base_num_frames=a.base_num_frames, ar_step=a.ar_step, causal_block_size=a.causal_block_size,
                  overlap_history=a.overlap_history, addnoise_condition=0,
                  generator=torch.Generator().manual_seed(a.seed))
    with torch.no_grad():
        start = time.perf_counter()
        latents = pipe(**kwargs).frames
        seconds = time.perf_counter() - start
    if a.out:
        write_safetensors(a.out, {"latents": latents})
    print(json.dumps({"seconds": seconds, "calls": calls[0], "skipped": skipped[0]}))


if __name__ == "__main__":
    main()
