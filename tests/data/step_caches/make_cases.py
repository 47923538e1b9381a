#!/usr/bin/env python3
"""diffusers' TaylorSeer and MagCache step caches (hooks/taylorseer_cache.py, hooks/mag_cache.py) through diffusers'
own SkyReelsV2Pipeline (text to video): the fixtures tests/test_step_caches.cpp replays (`--cache taylorseer`,
`--cache magcache`, `skyreels calibrate-magcache`).

Each case takes the golden T2V fixture pipeline_t2v/t1_cfg6_shift8 (its tiny transformer, prompt embeddings,
scheduler and recorded noise: "base" in case.json, never copied) and runs diffusers' pipeline (the snapshot the
golden fixtures name, from its source tree) with more steps and the cache enabled as a user enables it:
`pipe.transformer.enable_cache(TaylorSeerCacheConfig(...))` / `enable_cache(MagCacheConfig(...))`.

What diffusers needs for that (the smallest fixes, outside the caches' math):
  * MagCache stops with "SkyReelsV2TransformerBlock not registered": TransformerBlockRegistry has no entry for the
    SkyReels-V2 block. It is registered with WanTransformerBlock's metadata (return_hidden_states_index=0, no
    encoder hidden states returned), the registry line FirstBlockCache needed too (scripts/diffusers_env.py:
    register_skyreels_block). Nothing else changes.
  * TaylorSeer needs no fix, but its default module patterns ("^blocks.*attn", matched with re.fullmatch) match no
    module of this model (blocks.N.attn1 ends in "1"): stock TaylorSeer hooks nothing and equals the uncached run.
    The cases name the modules (cache_identifiers / skip_predict_identifiers) or use lite mode, as a user must.

Diffusion forcing (not made into cases): on diffusers' SkyReelsV2DiffusionForcingPipeline as shipped (the golden
pipeline_df cases, the registry line added) both hooks run on one-chunk videos, sync and async, counting transformer
calls (timestep-matrix rows) as steps: MagCache indexes mag_ratios by row and starts over every num_inference_steps
rows, TaylorSeer extrapolates over rows. On long videos their state crosses the chunk boundary: TaylorSeer raises
"The size of tensor a (30) must match the size of tensor b (24)" at the first call of a chunk of another length,
MagCache logs a dimension mismatch and returns the block input without any residual for the calls it skips.

Recorded per case: output.safetensors (`latents`), decisions.json (one entry per transformer call, in order:
{"step", "context", "decision": "computed" | "predicted" (TaylorSeer) | "skipped" (MagCache), MagCache's
"accumulated_err" where the hook computed one}), case.json (the config, the modules TaylorSeer hooked, counts;
MagCache calibration: the ratios of each context as diffusers prints them).

usage: DIFFUSERS_SRC=/path/to/diffusers /usr/bin/python3 make_cases.py [--out DIR]
(/usr/bin/python3 with Debian's python3-torch and the packages scripts/diffusers_env.py lists.) Numerics as the
golden harness: OPENBLAS_CORETYPE=Prescott ATEN_CPU_CAPABILITY=avx2, one thread.
"""
import importlib
import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "scripts"))
import python_deps  # noqa: E402  (standard library only)

python_deps.require()
from diffusers_env import (generator_arguments, import_diffusers, read_safetensors, register_skyreels_block,  # noqa: E402
                           write_safetensors)
import torch  # noqa: E402

GOLDEN = os.path.join(HERE, "..", "golden")
BASE = "pipeline_t2v/t1_cfg6_shift8"
I2V_BASE = "pipeline_i2v/i1_image_cfg5_shift5"
DF_SYNC = "pipeline_df_cache/c1_sync_cfg"
DF_LONG = "pipeline_df_cache/c3_long_sync_3chunks_overlap9_cfg"
STEPS = 12
ATTN = [r"blocks\.\d+\.attn1", r"blocks\.\d+\.attn2"]
LAYERS = 2  # every base case's tiny transformer

# name: cache kind, its config fields (as MagCacheConfig / TaylorSeerCacheConfig take them), call overrides.
# MagCache ratios "calibrated": the cond ratios of case mc0 (interpolated by diffusers where the lengths differ).
CASES = {
    "ts1_attn_order2_fp32": {"kind": "taylorseer", "steps": STEPS, "config": {
        "cache_interval": 3, "disable_cache_before_step": 2, "max_order": 2, "taylor_factors_dtype": "float32",
        "cache_identifiers": ATTN}},
    "ts2_lite_after9": {"kind": "taylorseer", "steps": STEPS, "config": {
        "cache_interval": 4, "disable_cache_before_step": 3, "disable_cache_after_step": 9, "max_order": 1,
        "taylor_factors_dtype": "float32", "use_lite_mode": True}},
    "ts3_block_skip_ffn": {"kind": "taylorseer", "steps": STEPS, "config": {
        "cache_interval": 2, "disable_cache_before_step": 2, "max_order": 1, "taylor_factors_dtype": "float32",
        "cache_identifiers": [r"blocks\.1"], "skip_predict_identifiers": [r"blocks\.0\.ffn"]}},
    # diffusers' default factor dtype: bf16 rounding of fp32 values ~1e-6 apart can land one bf16 ulp apart, so this
    # case is compared at bf16's resolution (tests/test_step_caches.cpp), decisions exactly.
    "ts4_attn_bf16_default_dtype": {"kind": "taylorseer", "steps": STEPS, "config": {
        "cache_interval": 3, "disable_cache_before_step": 3, "max_order": 1, "cache_identifiers": ATTN}},
    "mc0_calibrate": {"kind": "magcache", "steps": STEPS, "config": {"calibrate": True, "num_inference_steps": STEPS}},
    "mc1_threshold": {"kind": "magcache", "steps": STEPS, "ratios_from": "mc0_calibrate", "config": {
        "threshold": 0.25, "max_skip_steps": 2, "retention_ratio": 0.2, "num_inference_steps": STEPS}},
    "mc2_interpolated_9": {"kind": "magcache", "steps": 9, "ratios_from": "mc0_calibrate", "config": {
        "threshold": 0.5, "max_skip_steps": 3, "retention_ratio": 0.1, "num_inference_steps": 9}},
    # SkyReelsV2ImageToVideoPipeline on the pipeline_i2v fixture's I2V model (CLIP tokens and VAE condition as recorded).
    "i2v_ts1_attn_fp32": {"base": I2V_BASE, "kind": "taylorseer", "steps": 10, "config": {
        "cache_interval": 2, "disable_cache_before_step": 2, "max_order": 1, "taylor_factors_dtype": "float32",
        "cache_identifiers": ATTN}},
    "i2v_mc0_calibrate": {"base": I2V_BASE, "kind": "magcache", "steps": 10, "config": {
        "calibrate": True, "num_inference_steps": 10}},
    "i2v_mc1_threshold": {"base": I2V_BASE, "kind": "magcache", "steps": 10, "ratios_from": "i2v_mc0_calibrate",
                          "config": {"threshold": 0.3, "max_skip_steps": 2, "retention_ratio": 0.2,
                                     "num_inference_steps": 10}},
    # SkyReelsV2DiffusionForcingPipeline, synchronous (ar_step 0: every frame of a row at one noise level, one row per
    # step), the state reset at every chunk start (transformer._reset_stateful_cache(), as the pipeline_df_cache
    # fixtures' scope "chunk"); the golden pipeline_df_cache fixtures' weights, inputs and recorded noise.
    "df_ts1_sync_attn": {"df": DF_SYNC, "kind": "taylorseer", "config": {
        "cache_interval": 2, "disable_cache_before_step": 2, "max_order": 1, "taylor_factors_dtype": "float32",
        "cache_identifiers": ATTN}},
    "df_mc0_calibrate": {"df": DF_SYNC, "kind": "magcache", "config": {"calibrate": True}},
    "df_mc1_sync": {"df": DF_SYNC, "kind": "magcache", "ratios_from": "df_mc0_calibrate", "config": {
        "threshold": 0.3, "max_skip_steps": 2, "retention_ratio": 0.2}},
    "df_ts2_long_sync_3chunks": {"df": DF_LONG, "kind": "taylorseer", "config": {
        "cache_interval": 2, "disable_cache_before_step": 2, "max_order": 1, "taylor_factors_dtype": "float32",
        "cache_identifiers": ATTN}},
    "df_mc2_long_sync_3chunks": {"df": DF_LONG, "kind": "magcache", "ratios_from": "df_mc0_calibrate", "config": {
        "threshold": 0.3, "max_skip_steps": 2, "retention_ratio": 0.2}},
}


def run_df_case(d, spec, ratios):
    """The DF pipeline with recorded noise, the cache enabled as a user enables it, and its state reset per chunk."""
    base_dir = os.path.join(GOLDEN, spec["df"])
    case = json.load(open(os.path.join(base_dir, "case.json")))
    kwargs = dict(case["call_defaults_in_effect"])
    kwargs.update(case["call_kwargs"])
    steps = kwargs["num_inference_steps"]
    weights_dir = os.path.join(base_dir, "weights", "diffusers")
    config = {k: v for k, v in json.load(open(os.path.join(weights_dir, "config.json"))).items()
              if not k.startswith("_")}
    transformer = d.transformer.SkyReelsV2Transformer3DModel(**config)
    transformer.load_state_dict(read_safetensors(os.path.join(weights_dir, "diffusion_pytorch_model.safetensors")))
    transformer.eval()
    transformer.config.num_frame_per_block = case["transformer_config_before_call"]["num_frame_per_block"]
    scheduler = d.unipc.UniPCMultistepScheduler.from_config(
        json.load(open(os.path.join(base_dir, "scheduler", "scheduler_config.json"))))
    vae = d.vae.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    pipe = d.pipeline.SkyReelsV2DiffusionForcingPipeline(tokenizer=None, text_encoder=None, transformer=transformer,
                                                         vae=vae, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    states, probe, hooked = None, None, None
    if spec["kind"] == "taylorseer":
        hooked, states = enable_taylorseer(d, pipe, spec)
    elif spec["kind"] == "magcache":
        mag = importlib.import_module("diffusers.hooks.mag_cache")
        probe = MagProbe(mag)
        probe.install(pipe)
        cfg = dict(spec["config"], num_inference_steps=steps)
        if ratios is not None:
            cfg["mag_ratios"] = ratios
        pipe.transformer.enable_cache(mag.MagCacheConfig(**cfg))

    noise = read_safetensors(os.path.join(base_dir, "noise.safetensors"))
    draws = iter([noise[n["name"]] for n in case["noise_draws_in_order"]])
    d.pipeline.randn_tensor = lambda shape, generator=None, device=None, dtype=None, **k: next(draws).clone()
    real_randn_like = torch.randn_like
    torch.randn_like = lambda t, **k: next(draws).clone()
    chunk = {"index": -1, "calls": 0}
    real_prepare = pipe.prepare_latents

    def prepare_latents(*a, **k):
        transformer._reset_stateful_cache()
        chunk["index"] += 1
        chunk["calls"] = 0
        return real_prepare(*a, **k)

    pipe.prepare_latents = prepare_latents
    decisions = []
    real_forward = transformer.forward

    def forward(*a, **k):
        out = real_forward(*a, **k)
        context = "cond" if chunk["calls"] % 2 == 0 else "uncond"
        entry = {"chunk": chunk["index"], "step": chunk["calls"] // 2, "context": context}
        chunk["calls"] += 1
        if states is not None:
            entry["decision"] = taylorseer_decision(states)
        elif probe is not None:
            entry["decision"] = probe.last["decision"]
            entry["accumulated_err"] = probe.last["accumulated_err"]
        else:
            entry["decision"] = "computed"
        decisions.append(entry)
        return out

    transformer.forward = forward
    inputs = read_safetensors(os.path.join(base_dir, "inputs.safetensors"))
    call = {k: v for k, v in kwargs.items() if k not in ("generator", "prompt_embeds", "negative_prompt_embeds",
                                                          "callback_on_step_end_tensor_inputs")}
    call["prompt_embeds"] = inputs["prompt_embeds"]
    call["negative_prompt_embeds"] = inputs["negative_prompt_embeds"]
    assert kwargs["guidance_scale"] > 1.0 and kwargs["ar_step"] == 0
    torch.manual_seed(case.get("global_seed", 0))
    try:
        with torch.no_grad():
            latents = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    finally:
        torch.randn_like = real_randn_like
    return case, latents, decisions, steps, hooked, (probe.calibration if probe else None)


PIPELINES = {"t2v": "SkyReelsV2Pipeline", "i2v": "SkyReelsV2ImageToVideoPipeline",
             "df": "SkyReelsV2DiffusionForcingPipeline (state reset at every chunk start)"}


def summary_pipeline(spec):
    return "df" if "df" in spec else "t2v" if spec.get("base", BASE) == BASE else "i2v"


def commit_of(case):
    return case.get("environment", {}).get("diffusers_commit") or case["diffusers_commit"]


def load_pipe(d, steps, base=BASE):
    base_dir = os.path.join(GOLDEN, base)
    case = json.load(open(os.path.join(base_dir, "case.json")))
    weights = case["weights"]["transformer"]
    config = json.load(open(os.path.join(GOLDEN, weights["dir"], "config.json")))
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    transformer = d.transformer.SkyReelsV2Transformer3DModel(**config)
    state = {}
    for f in weights["safetensors"]:
        state.update(read_safetensors(os.path.join(GOLDEN, f)))
    transformer.load_state_dict(state)
    transformer.eval()
    sched_config = json.load(open(os.path.join(base_dir, "scheduler", "scheduler_config.json")))
    scheduler = d.unipc.UniPCMultistepScheduler.from_config(sched_config)
    vae = d.vae.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    call = dict(case["call_kwargs"])
    call.update({"num_inference_steps": steps})
    inputs = read_f32(os.path.join(base_dir, "inputs.safetensors"))
    noise = read_safetensors(os.path.join(base_dir, "noise.safetensors"))["noise_000"]
    call = {k: v for k, v in call.items()
            if k not in ("generator", "callback_on_step_end_tensor_inputs", "prompt", "image")}
    if base == BASE:
        t2v = importlib.import_module("diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2")
        pipe = t2v.SkyReelsV2Pipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae,
                                      scheduler=scheduler)
        call.update(prompt_embeds=inputs["prompt_embeds"], negative_prompt_embeds=inputs["negative_prompt_embeds"],
                    latents=noise.clone())
    else:
        pipe = i2v_pipe(d, base_dir, transformer, vae, scheduler, inputs, noise, call)
    pipe.set_progress_bar_config(disable=True)
    return case, pipe, call


def i2v_pipe(d, base_dir, transformer, vae, scheduler, inputs, noise, call):
    """SkyReelsV2ImageToVideoPipeline with its two encoders' outputs as the golden case recorded them (the CLIP
    image tokens: image_encoder.safetensors; the VAE condition: condition.safetensors): the caches see the
    transformer only. The prompt rows zero-padded to 512 as the case says."""
    module = importlib.import_module("diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_i2v")
    pipe = module.SkyReelsV2ImageToVideoPipeline(tokenizer=None, text_encoder=None, image_encoder=None,
                                                 image_processor=None, transformer=transformer, vae=vae,
                                                 scheduler=scheduler)
    tokens = read_safetensors(os.path.join(base_dir, "image_encoder.safetensors"))["image_embeds"]
    condition = read_safetensors(os.path.join(base_dir, "condition.safetensors"))["condition"]
    pipe.encode_image = lambda image, device: tokens.clone()
    pipe.prepare_latents = lambda *a, **k: (noise.clone(), condition.clone())

    def padded(rows):
        out = torch.zeros(rows.shape[0], 512, rows.shape[2])
        out[:, :rows.shape[1]] = rows
        return out

    # The image itself only feeds the two encoders replaced above; its preprocessing still runs.
    height, width = call["height"], call["width"]
    call.update(prompt_embeds=padded(inputs["prompt_embeds_rows"]),
                negative_prompt_embeds=padded(inputs["negative_prompt_embeds_rows"]),
                image=torch.zeros(1, 3, height, width))
    return pipe


def read_f32(path):
    """The float32 tensors of a safetensors file (read_safetensors refuses the uint8 pixels the I2V cases hold)."""
    import struct
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    kept = {k: v for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32"}
    out = {}
    for name, entry in kept.items():
        b, e = entry["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[8 + n + b:8 + n + e]), dtype=torch.float32).reshape(entry["shape"])
    return out


def hook_of(module, name):
    return module._diffusers_hook.get_hook(name)


def enable_taylorseer(d, pipe, spec):
    cfg = dict(spec["config"])
    if "taylor_factors_dtype" in cfg:
        cfg["taylor_factors_dtype"] = getattr(torch, cfg["taylor_factors_dtype"])
    config = importlib.import_module("diffusers.hooks.taylorseer_cache").TaylorSeerCacheConfig(**cfg)
    pipe.transformer.enable_cache(config)
    hooked = [n for n, m in pipe.transformer.named_modules()
              if getattr(m, "_diffusers_hook", None) is not None and hook_of(m, "taylorseer_cache") is not None]
    states = [hook_of(m, "taylorseer_cache").state_manager for n, m in pipe.transformer.named_modules() if n in hooked]
    return hooked, states


def taylorseer_decision(states):
    """computed / predicted of the call that just ran (every hooked module must agree)."""
    seen = set()
    for sm in states:
        st = sm.get_state()
        seen.add("computed" if st.last_update_step == st.current_step else "predicted")
    assert len(seen) == 1, seen
    return seen.pop()


class MagProbe:
    """Per call: the decision and the accumulated error the head hook compared with the threshold."""

    def __init__(self, mag):
        self.mag = mag
        self.last = None
        self.calibration = {}

    def install(self, pipe):
        head_cls = self.mag.MagCacheHeadHook
        real_head, real_advance = head_cls.new_forward, self.mag.MagCacheBlockHook._advance_step
        probe = self

        def head_forward(hook, module, *args, **kwargs):
            st = hook.state_manager.get_state()
            # Copies: once fp32 tensors, the hook updates the accumulators in place (*=, +=).
            copy = lambda v: v.clone() if torch.is_tensor(v) else v
            before = (copy(st.accumulated_err), copy(st.accumulated_ratio), st.step_index)
            out = real_head(hook, module, *args, **kwargs)
            err = None
            cfg = hook.config
            if not cfg.calibrate:
                retention = int(cfg.retention_ratio * cfg.num_inference_steps + 0.5)
                step = before[2]
                if step >= retention:
                    scale = cfg.mag_ratios[step] if step < len(cfg.mag_ratios) else 1.0
                    ratio = before[1] * scale
                    err = float(before[0] + abs(1.0 - ratio))
            probe.last = {"step": before[2], "decision": "computed" if st.should_compute else "skipped",
                          "accumulated_err": err}
            return out

        def advance(hook, st):
            if hook.config.calibrate and st.step_index + 1 >= hook.config.num_inference_steps:
                probe.calibration[hook.state_manager._current_context] = [float(r) for r in st.calibration_ratios]
            return real_advance(hook, st)

        head_cls.new_forward = head_forward
        self.mag.MagCacheBlockHook._advance_step = advance


def run_case(d, name, spec, ratios):
    case, pipe, call = load_pipe(d, spec["steps"], spec.get("base", BASE))
    decisions, hooked, probe = [], None, None
    mag = importlib.import_module("diffusers.hooks.mag_cache")
    if spec["kind"] == "taylorseer":
        hooked, states = enable_taylorseer(d, pipe, spec)
    elif spec["kind"] == "magcache":
        cfg = dict(spec["config"])
        if ratios is not None:
            cfg["mag_ratios"] = ratios
        probe = MagProbe(mag)
        probe.install(pipe)
        pipe.transformer.enable_cache(mag.MagCacheConfig(**cfg))
    transformer = pipe.transformer
    real_forward = transformer.forward
    counter = {"cond": 0, "uncond": 0}

    def forward(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        context = "cond" if len(decisions) % 2 == 0 else "uncond"  # CFG: cond, then uncond, per step
        entry = {"step": counter[context], "context": context}
        counter[context] += 1
        if spec["kind"] == "taylorseer":
            entry["decision"] = taylorseer_decision(states)
        elif spec["kind"] == "magcache":
            entry["decision"] = probe.last["decision"]
            entry["accumulated_err"] = probe.last["accumulated_err"]
            assert probe.last["step"] == entry["step"]
        else:
            entry["decision"] = "computed"
        decisions.append(entry)
        return out

    transformer.forward = forward
    torch.manual_seed(case.get("global_seed", 0))
    with torch.no_grad():
        latents = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    return case, latents, decisions, hooked, (probe.calibration if probe else None)


VAE = "pipeline_df_i2v/i1_sync_1chunk_last_image/weights/vae"  # a tiny golden AutoencoderKLWan (z_dim 16)


def load_vae(d):
    config = {k: v for k, v in json.load(open(os.path.join(GOLDEN, VAE, "config.json"))).items()
              if not k.startswith("_")}
    vae = d.vae.AutoencoderKLWan(**config)
    vae.load_state_dict(read_safetensors(os.path.join(GOLDEN, VAE, "diffusion_pytorch_model.safetensors")))
    return vae.eval()


def decoded(vae, latents):
    """The pipelines' decode (output_type != "latent"): de-normalised, VAE-decoded, in [0, 1]."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents * std + mean, return_dict=False)[0]
    return ((video + 1) / 2).clamp(0, 1)


def distance(vae, latents, plain):
    """How far a cache moved the output: max |Δ| of the latents, PSNR (dB) of the decoded frames."""
    a, b = decoded(vae, latents), decoded(vae, plain)
    mse = ((a - b) ** 2).mean().item()
    return {"latents_max_abs": (latents - plain).abs().max().item(),
            "decoded_psnr_db": None if mse == 0 else 10 * math.log10(1.0 / mse)}


def skipped_share(spec, decisions, hooked, layers):
    """Token-blocks whose transformer block did not run its self-attention (what the C++ side counts as saved):
    MagCache's skipped calls (every block); TaylorSeer's predicted calls times the blocks whose attn1 (or the whole
    block) is hooked."""
    calls = len(decisions)
    if spec["kind"] == "magcache":
        return sum(c["decision"] == "skipped" for c in decisions) / calls
    lite = spec["config"].get("use_lite_mode", False)
    blocks = layers if lite else sum(1 for m in (hooked or []) if re.fullmatch(r"blocks\.\d+(\.attn1)?", m))
    return sum(c["decision"] == "predicted" for c in decisions) / calls * blocks / layers


def uncached(d, spec, memo):
    """The same call without a cache (memoised per base case and step count)."""
    key = (spec.get("df", spec.get("base", BASE)), spec.get("steps"))
    if key not in memo:
        bare = dict(spec, kind="none", config={})
        bare.pop("ratios_from", None)
        memo[key] = run_df_case(d, bare, None)[1] if "df" in spec else run_case(d, "uncached", bare, None)[1]
    return memo[key]


def main():
    args = generator_arguments(HERE)
    torch.set_num_threads(1)
    d = import_diffusers(args.diffusers_src)
    register_skyreels_block(d)
    calibrations, plain = {}, {}
    vae = load_vae(d)
    for name, spec in CASES.items():
        ratios = calibrations[spec["ratios_from"]]["cond"] if "ratios_from" in spec else None
        hooked = None
        if "df" in spec:
            case, latents, decisions, steps, hooked, calibration = run_df_case(d, spec, ratios)
            spec = dict(spec, steps=steps, base=spec["df"])
        else:
            case, latents, decisions, hooked, calibration = run_case(d, name, spec, ratios)
        if calibration:
            calibrations[name] = calibration
        out_dir = os.path.join(args.out, name)
        os.makedirs(out_dir, exist_ok=True)
        write_safetensors(os.path.join(out_dir, "output.safetensors"), {"latents": latents})
        with open(os.path.join(out_dir, "decisions.json"), "w") as f:
            f.write("[\n" + ",\n".join(json.dumps(c) for c in decisions) + "\n]\n")
        errs = [c["accumulated_err"] for c in decisions if c.get("accumulated_err") is not None]
        threshold = spec["config"].get("threshold")
        summary = {
            "base": "../../golden/" + spec.get("base", BASE),
            "pipeline": summary_pipeline(spec),
            "num_inference_steps": spec["steps"],
            "cache": dict(spec["config"], kind=spec["kind"]),
            "produced_by": "tests/data/step_caches/make_cases.py over diffusers' " + PIPELINES[summary_pipeline(spec)] +
                           " (commit " + commit_of(case) + ") with transformer.enable_cache(" +
                           ("TaylorSeerCacheConfig" if spec["kind"] == "taylorseer" else "MagCacheConfig") + ")",
            "calls": len(decisions),
            "counts": {k: sum(c["decision"] == k for c in decisions) for k in ("computed", "predicted", "skipped")},
        }
        if hooked is not None:
            summary["hooked_modules"] = hooked
        if ratios is not None:
            summary["cache"]["mag_ratios"] = ratios
            summary["cache"]["mag_ratios_from"] = spec["ratios_from"] + " (its cond context)"
        if calibration:
            summary["calibration"] = calibration
        if not calibration:
            reference = uncached(d, CASES[name], plain)
            summary["vs_uncached"] = dict(distance(vae, latents, reference),
                                          token_blocks_skipped=skipped_share(spec, decisions, hooked, LAYERS))
        if threshold is not None and errs:
            summary["threshold_margin"] = min(abs(threshold - e) for e in errs)
        with open(os.path.join(out_dir, "case.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        print(name, json.dumps(summary["counts"]), summary.get("threshold_margin"))


if __name__ == "__main__":
    main()
