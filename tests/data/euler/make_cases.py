#!/usr/bin/env python3
"""The flow-matching Euler sampler (`scheduler.type` euler, `scheduler.timesteps`) through diffusers' own SkyReels-V2
diffusion-forcing pipelines: the fixtures tests/test_euler.cpp replays (the loop, `skyreels generate`).

Each case takes a golden pipeline fixture (its tiny transformer, prompt embeddings, pixels, VAE: "base" in case.json,
never copied) and runs diffusers' pipeline (the snapshot the golden fixtures name, from its source tree) with
diffusers' FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=S) in place of UniPC. Two things diffusers
needs for that, both outside the scheduler's math (scripts/diffusers_env.py: euler_for_df):
  * the DF pipelines pass step() the timestep as a 0-dim int64 tensor (t[idx] of the .long() step matrix), which
    FlowMatchEulerDiscreteScheduler.step refuses ("Passing integer indices ..."); the reference passes it as a float.
    The scheduler only uses it to find the first step index (index_for_timestep), every later step is its counter;
  * the pipeline calls set_timesteps(num_inference_steps) on its scheduler and on a deepcopy per frame, so an explicit
    timestep list is kept on the scheduler and handed to every set_timesteps (num_inference_steps = its length).
Everything else (the schedule, the shift, the sigmas, the update x + (sigma_next - sigma) * v) is diffusers' own.

Noise: every random tensor the pipeline draws comes from the real generators (torch.Generator().manual_seed(seed) for
prepare_latents, the global RNG seeded with global_seed for addnoise_condition) and is recorded in noise.safetensors
as noise_000, noise_001, ... in draw order (case.json: noise_draws_in_order), as the golden fixtures record theirs.

usage: DIFFUSERS_SRC=/path/to/diffusers /usr/bin/python3 make_cases.py [--out DIR]
(/usr/bin/python3 with Debian's python3-torch, -numpy, -packaging, -filelock, -requests, -regex, -pil, -tqdm, -httpx,
-yaml; see scripts/diffusers_env.py.) Numerics as the golden harness: OPENBLAS_CORETYPE=Prescott
ATEN_CPU_CAPABILITY=avx2, one thread.
"""
import copy
import importlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "scripts"))
import python_deps  # noqa: E402  (standard library only)

python_deps.require()  # every package diffusers needs, named in one line, before anything imports them
from diffusers_env import (euler_for_df, generator_arguments, import_diffusers, read_safetensors,  # noqa: E402
                           write_safetensors)
import torch  # noqa: E402  (after diffusers_env, which names a missing package in its first line)

GOLDEN = os.path.join(HERE, "..", "golden")
LIST4 = [1000, 750, 500, 250]  # LightX2V's 4-step recipe (before the shift)

# name: base golden case, shift, timesteps (None: num_inference_steps spaced), call overrides
CASES = {
    "e1_sync_list4_noguide": {"base": "pipeline_df/p1_sync_short", "shift": 5.0, "timesteps": LIST4,
                              "call": {"guidance_scale": 1.0}},
    "e2_async_list4_noguide": {"base": "pipeline_df/p2_async_cbs2_ar2", "shift": 5.0, "timesteps": LIST4,
                               "call": {"guidance_scale": 1.0}},
    "e3_async_spaced6_cfg": {"base": "pipeline_df/p2_async_cbs2_ar2", "shift": 5.0, "timesteps": None,
                             "call": {"num_inference_steps": 6}},
    "e4_long_addnoise20_list4_noguide": {"base": "pipeline_df/p4_long_addnoise20", "shift": 5.0, "timesteps": LIST4,
                                         "call": {"guidance_scale": 1.0}},
    "e5_long_addnoise20_spaced5_cfg_shift8": {"base": "pipeline_df/p4_long_addnoise20", "shift": 8.0,
                                              "timesteps": None, "call": {"num_inference_steps": 5}},
    "e6_i2v_last_image_list4_noguide": {"base": "pipeline_df_i2v/i1_sync_1chunk_last_image", "shift": 5.0,
                                        "timesteps": LIST4, "call": {"guidance_scale": 1.0}},
    "e7_i2v_long_async_addnoise20_list4_noguide": {"base": "pipeline_df_i2v/i3_long_async_cbs2_ar2_addnoise20",
                                                   "shift": 5.0, "timesteps": LIST4, "call": {"guidance_scale": 1.0}},
}


def run_case(d, name, spec):
    base_dir = os.path.join(GOLDEN, spec["base"])
    case = json.load(open(os.path.join(base_dir, "case.json")))
    kwargs = dict(case["call_defaults_in_effect"])
    kwargs.update(case["call_kwargs"])
    kwargs.update(spec["call"])
    if spec["timesteps"] is not None:
        kwargs["num_inference_steps"] = len(spec["timesteps"])

    weights_dir = os.path.join(base_dir, "weights", "diffusers")
    config = json.load(open(os.path.join(weights_dir, "config.json")))
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    transformer = d.transformer.SkyReelsV2Transformer3DModel(**config)
    transformer.load_state_dict(read_safetensors(os.path.join(weights_dir, "diffusion_pytorch_model.safetensors")))
    transformer.eval()
    transformer.config.num_frame_per_block = case["transformer_config_before_call"]["num_frame_per_block"]

    scheduler = euler_for_df(d)(num_train_timesteps=1000, shift=spec["shift"])
    scheduler.fixed_timesteps = spec["timesteps"]
    i2v = "image" in kwargs
    if i2v:
        pipeline_module = importlib.import_module(
            "diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing_i2v")
        vae_dir = os.path.join(base_dir, "weights", "vae")
        vae_config = {k: v for k, v in json.load(open(os.path.join(vae_dir, "config.json"))).items()
                      if not k.startswith("_")}
        vae = d.vae.AutoencoderKLWan(**vae_config)
        vae.load_state_dict(read_safetensors(os.path.join(vae_dir, "diffusion_pytorch_model.safetensors")))
        vae.eval()
        pipe = pipeline_module.SkyReelsV2DiffusionForcingImageToVideoPipeline(
            tokenizer=None, text_encoder=None, transformer=transformer, vae=vae, scheduler=scheduler)
    else:
        pipeline_module = d.pipeline
        vae = d.vae.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
        pipe = pipeline_module.SkyReelsV2DiffusionForcingPipeline(tokenizer=None, text_encoder=None,
                                                                  transformer=transformer, vae=vae,
                                                                  scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)

    # Record every draw, in order, from the real generators.
    draws, state = [], {"chunk": -1, "row": None}
    real_randn_tensor = pipeline_module.randn_tensor
    real_randn_like = torch.randn_like

    def randn_tensor(shape, generator=None, device=None, dtype=None, **k):
        t = real_randn_tensor(shape, generator=generator, device=device, dtype=dtype, **k)
        draws.append(("prepare_latents -> randn_tensor (user generator)", state["chunk"] + 1, None, t.clone()))
        return t

    def randn_like(t, **k):
        out = real_randn_like(t, **k)
        draws.append(("torch.randn_like (addnoise_condition; GLOBAL torch RNG)", state["chunk"], state["row"],
                      out.clone()))
        return out

    pipeline_module.randn_tensor = randn_tensor
    torch.randn_like = randn_like

    # Chunk ends: the latents after each chunk's last row (a new chunk starts at prepare_latents).
    chunk_ends, last = [], {"latents": None}
    real_prepare = pipe.prepare_latents

    def prepare_latents(*a, **k):
        if last["latents"] is not None:
            chunk_ends.append(last["latents"])
            last["latents"] = None
        result = real_prepare(*a, **k)
        state["chunk"] += 1
        state["row"] = 0
        return result

    pipe.prepare_latents = prepare_latents
    calls = {"n": 0}
    real_forward = transformer.forward

    def forward(*a, **k):
        calls["n"] += 1
        return real_forward(*a, **k)

    transformer.forward = forward

    def on_step_end(pipeline, i, t, callback_kwargs):
        last["latents"] = callback_kwargs["latents"].clone()
        state["row"] = i + 1
        return {}

    inputs = read_safetensors(os.path.join(base_dir, "inputs.safetensors"))
    call = {k: v for k, v in kwargs.items() if k not in ("generator", "prompt_embeds", "negative_prompt_embeds",
                                                          "callback_on_step_end_tensor_inputs", "image",
                                                          "last_image")}
    call["prompt_embeds"] = inputs["prompt_embeds"]
    if kwargs["guidance_scale"] > 1.0:
        call["negative_prompt_embeds"] = inputs["negative_prompt_embeds"]
    for key in ("image", "last_image"):
        if kwargs.get(key) is not None:
            call[key] = inputs[key]
    seed = int(kwargs["generator"].split("manual_seed(")[1].rstrip(")"))
    torch.manual_seed(case.get("global_seed", 0))
    try:
        with torch.no_grad():
            latents = pipe(**call, generator=torch.Generator().manual_seed(seed), callback_on_step_end=on_step_end,
                           callback_on_step_end_tensor_inputs=["latents"]).frames
    finally:
        pipeline_module.randn_tensor = real_randn_tensor
        torch.randn_like = real_randn_like
    chunk_ends.append(last["latents"])

    # The schedule every per-frame scheduler ran.
    probe = copy.deepcopy(scheduler)
    probe.set_timesteps(kwargs["num_inference_steps"])
    return case, kwargs, latents, chunk_ends, draws, calls["n"], probe


def main():
    args = generator_arguments(HERE)
    torch.set_num_threads(1)
    d = import_diffusers(args.diffusers_src)
    for name, spec in CASES.items():
        case, kwargs, latents, chunk_ends, draws, calls, probe = run_case(d, name, spec)
        out_dir = os.path.join(args.out, name)
        os.makedirs(out_dir, exist_ok=True)
        outputs = {"latents": latents}
        for k, t in enumerate(chunk_ends):
            outputs["chunk%d_latents_end" % k] = t
        write_safetensors(os.path.join(out_dir, "output.safetensors"), outputs)
        write_safetensors(os.path.join(out_dir, "noise.safetensors"),
                          {"noise_%03d" % i: t for i, (_, _, _, t) in enumerate(draws)})
        call_kwargs = {k: v for k, v in kwargs.items() if k in case["call_kwargs"] or k in spec["call"]}
        call_kwargs["num_inference_steps"] = kwargs["num_inference_steps"]
        if kwargs["guidance_scale"] <= 1.0:
            call_kwargs.pop("negative_prompt_embeds", None)
        summary = {
            "base": os.path.relpath(os.path.join(GOLDEN, spec["base"]), os.path.join(HERE, name)),
            "kind": case["kind"],
            "case": name,
            "produced_by": "tests/data/euler/make_cases.py: diffusers' " + case["pipeline_construction"].split("(")[0] +
                           ".__call__ (commit " + case["diffusers_commit"] + ") with diffusers' "
                           "FlowMatchEulerDiscreteScheduler (step() given the DF pipeline's int64 timestep as a float;"
                           " set_timesteps given the timestep list on every deepcopy)",
            "diffusers_commit": case["diffusers_commit"],
            "torch_version": torch.__version__,
            "sampler": {"type": "euler", "shift": spec["shift"], "num_train_timesteps": 1000,
                        "timesteps": spec["timesteps"]},
            "schedule": {"timesteps": [float(t) for t in probe.timesteps], "sigmas": [float(s) for s in probe.sigmas]},
            "call_kwargs": call_kwargs,
            "call_defaults_in_effect": case["call_defaults_in_effect"],
            "global_seed": case.get("global_seed", 0),
            "transformer_config_before_call": case["transformer_config_before_call"],
            "noise_draws_in_order": [{"name": "noise_%03d" % i, "source": s, "chunk": c, "row": r,
                                      "shape": list(t.shape), "dtype": "float32"}
                                     for i, (s, c, r, t) in enumerate(draws)],
            "stats": {"num_transformer_calls": calls, "chunks": len(chunk_ends),
                      "latents_abs_mean": float(latents.abs().mean())},
        }
        with open(os.path.join(out_dir, "case.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        print(name, json.dumps(summary["schedule"]), summary["stats"])


if __name__ == "__main__":
    main()
