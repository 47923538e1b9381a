#!/usr/bin/env python3
"""The reference of the step cache per causal block (`--cache first-block-per-block`), run through diffusers' own
SkyReels-V2 diffusion-forcing pipeline, and the fixtures tests/test_step_savings.cpp replays.

The pipeline, the transformer, the UniPC scheduler and the hook machinery are diffusers' own (the snapshot the
pipeline_df_cache fixtures name, loaded from its source tree); what this file adds is the cache, written as
diffusers writes FirstBlockCache (hooks/first_block_cache.py): ModelHooks on the transformer's blocks, one state per
cache context ("cond" / "uncond", diffusers' StateManager), reset at the start of every chunk
(transformer._reset_stateful_cache(), as the pipeline_df_cache fixtures with scope "chunk" do).

The cache, per transformer call and context (what model/transformer_skyreels_v2.h PerBlockCache documents):
  * the call covers the pipeline's window [valid_start, valid_end) without its trailing blocks that the row does
    not update (nothing before them attends to them under the block-causal mask; the C++ exact savings drop them
    too, and the prediction of those frames is never read);
  * block 0 runs on every frame; r = block0(x) - x; for each causal block b (counted from the chunk's frame 0)
    rel_b = mean|r_b - r_prev_b| / mean|r_prev_b| against b's own last computed call (fp32 means, then a float);
  * b skips when the row updates it, it has a computed state, rel_b <= threshold and it skipped fewer than
    max_skips calls in a row; blocks the row does not update are computed, except the leading run of final blocks
    (every frame at timestep 0, not updated, not re-noised by addnoise_condition, and so every block before it) whose
    state was computed while they were final with the same window start: those are "reused" (their kept keys /
    values are what computing them would give: exact savings within the cache; no rel, not a skip);
  * blocks 1..L-1 run; in their self-attention the keys / values of a skipped block are those of its last
    computed call (kept after norm_k and before RoPE, RoPE'd at its place in this call); a skipped block's output
    is block0(x)_b + tail_b with tail_b = out_b - block0(x)_b of its last computed call (so what its own tokens do
    in those blocks is never used: computed tokens see it only through the substituted keys / values);
  * a computed block keeps r_b, tail_b and its keys (before RoPE) / values of every layer 1..L-1.

usage: DIFFUSERS_SRC=/path/to/diffusers /usr/bin/python3 make_cases.py [--out DIR]
(/usr/bin/python3 with Debian's python3-torch, python3-numpy, -packaging, -filelock, -requests, -regex, -pil,
-tqdm, -httpx, -yaml; huggingface_hub, safetensors and transformers are stubbed: nothing of them runs.)
Numerics as the golden harness: OPENBLAS_CORETYPE=Prescott ATEN_CPU_CAPABILITY=avx2, one thread.
"""
import importlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "scripts"))
import python_deps  # noqa: E402  (standard library only)

python_deps.require()  # every package diffusers needs, named in one line, before anything imports them
from diffusers_env import (generator_arguments, import_diffusers, read_safetensors, register_skyreels_block,  # noqa: E402
                           write_safetensors)
import torch  # noqa: E402  (after diffusers_env, which names a missing package in its first line)
GOLDEN = os.path.join(HERE, "..", "golden", "pipeline_df_cache")

# The cases: a fixture of pipeline_df_cache (its weights, inputs, noise and call) with the cache per causal block.
CASES = {
    "b1_async_ar2_cbs2": {"base": "c2_async_ar2_cbs2_cfg", "target": 0.35, "max_skips": 2},
    "b2_long_async_addnoise20": {"base": "c4_long_async_addnoise20_cfg", "target": 0.6, "max_skips": 3},
}


# ---- the cache per causal block, as diffusers hooks -----------------------------------------------------------------

class BlockEntry:
    def __init__(self):
        self.residual = self.tail = None
        self.k, self.v = [], []  # per layer 1..L-1: keys after norm_k, before RoPE; values ([B, tokens, H, Dh])
        self.skips = 0
        self.source = None       # [chunk, row] of its last computed call
        self.final = False       # computed while it and every block before it in the call were final
        self.window = 0          # the call's first block then


class PerBlockState:  # one per cache context (diffusers' StateManager)
    def __init__(self):
        self.reset()

    def reset(self):
        self.blocks = {}
        # of the call in flight
        self.call = None
        self.skipped = []       # call-relative skipped blocks
        self.block0_out = None
        self.fresh = {}         # layer -> (k_pre, v) of the whole call


class CallInfo:  # what the pipeline's loop knows of the call in flight (set by the transformer hook)
    chunk = 0
    row = 0
    first_block = 0
    updated = []  # per causal block of the call
    final = []    # per causal block of the call: every frame final
    block_tokens = 0
    layer = 0


class PerBlockHeadHook:  # on blocks[0]
    _is_stateful = True

    def __init__(self, state_manager, info, threshold, max_skips, log):
        super().__init__()  # diffusers' ModelHook (the class is made with it as the next base)
        self.state_manager, self.info, self.threshold, self.max_skips, self.log = (
            state_manager, info, threshold, max_skips, log)

    def new_forward(self, module, hidden_states, *args, **kwargs):
        out = self.fn_ref.original_forward(hidden_states, *args, **kwargs)
        residual = out - hidden_states
        st = self.state_manager.get_state()
        info, bt = self.info, self.info.block_tokens
        for b in [b for b in st.blocks if b < info.first_block]:
            del st.blocks[b]  # the window only moves forward
        st.skipped, st.block0_out, st.fresh = [], out, {}
        decisions = []
        leading_final = True
        st.final_here = []
        for j, updated in enumerate(info.updated):
            block = info.first_block + j
            e = st.blocks.get(block)
            rel, skipped, reused = None, False, False
            leading_final = leading_final and info.final[j]
            st.final_here.append(leading_final)
            if e is not None and leading_final and e.final and e.window == info.first_block and len(e.k) > 0:
                reused = True
            elif e is not None:
                r = residual[:, j * bt:(j + 1) * bt]
                rel = ((r - e.residual).abs().mean() / e.residual.abs().mean()).item()
                skipped = bool(updated) and rel <= self.threshold and e.skips < self.max_skips and len(e.k) > 0
            if skipped or reused:
                st.skipped.append(j)  # both lend their kept keys / values
            decisions.append({"block": block, "updated": bool(updated), "rel": rel, "skipped": skipped,
                              "reused": reused, "source": list(e.source) if skipped else None})
        st.call = {"residual": residual, "decisions": decisions}
        self.log.append(decisions)
        return out

    def reset_state(self, module):
        self.state_manager.reset()
        return module


class PerBlockTailHook:  # on blocks[1..L-1]: the layer index for the attention, and the skipped blocks' output
    def __init__(self, state_manager, info, layer, is_tail):
        super().__init__()
        self.state_manager, self.info, self.layer, self.is_tail = state_manager, info, layer, is_tail

    def new_forward(self, module, *args, **kwargs):
        self.info.layer = self.layer
        out = self.fn_ref.original_forward(*args, **kwargs)
        if not self.is_tail:
            return out
        st = self.state_manager.get_state()
        bt, info = self.info.block_tokens, self.info
        result = out.clone()
        for j in st.skipped:
            e = st.blocks[info.first_block + j]
            result[:, j * bt:(j + 1) * bt] = st.block0_out[:, j * bt:(j + 1) * bt] + e.tail
        decisions = st.call["decisions"]
        for j in range(len(info.updated)):
            if j in st.skipped:
                st.blocks[info.first_block + j].skips += 1 if decisions[j]["skipped"] else 0
                continue
            e = st.blocks.setdefault(info.first_block + j, BlockEntry())
            sl = slice(j * bt, (j + 1) * bt)
            e.residual = st.call["residual"][:, sl].clone()
            e.tail = result[:, sl] - st.block0_out[:, sl]
            e.skips = 0
            e.source = (info.chunk, info.row)
            e.final = st.final_here[j]
            e.window = info.first_block
            e.k = [st.fresh[l][0][:, sl].clone() for l in sorted(st.fresh)]
            e.v = [st.fresh[l][1][:, sl].clone() for l in sorted(st.fresh)]
        return result


def make_attention_processor(d, state_manager, info):
    """diffusers' SkyReelsV2AttnProcessor for the self-attention of blocks 1..L-1, with the skipped blocks' keys /
    values replaced by those of their last computed call (and every block's kept for the next calls)."""

    class PerBlockAttnProcessor:
        _attention_backend = None
        _parallel_config = None

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            assert encoder_hidden_states is None and attn.add_k_proj is None
            query, key, value = d.transformer._get_qkv_projections(attn, hidden_states, None)
            query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
            key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
            value = value.unflatten(2, (attn.heads, -1))
            st = state_manager.get_state()
            bt = info.block_tokens
            key, value = key.clone(), value.clone()
            for j in st.skipped:
                e = st.blocks[info.first_block + j]
                key[:, j * bt:(j + 1) * bt] = e.k[info.layer - 1]
                value[:, j * bt:(j + 1) * bt] = e.v[info.layer - 1]
            st.fresh[info.layer] = (key, value)

            def apply_rotary_emb(x, freqs_cos, freqs_sin):  # diffusers' own (transformer_skyreels_v2.py)
                x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
                cos = freqs_cos[..., 0::2]
                sin = freqs_sin[..., 1::2]
                out = torch.empty_like(x)
                out[..., 0::2] = x1 * cos - x2 * sin
                out[..., 1::2] = x1 * sin + x2 * cos
                return out.type_as(x)

            query = apply_rotary_emb(query, *rotary_emb)
            key = apply_rotary_emb(key, *rotary_emb)
            out = importlib.import_module("diffusers.models.attention_dispatch").dispatch_attention_fn(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
            out = out.flatten(2, 3).type_as(query)
            out = attn.to_out[0](out)
            return attn.to_out[1](out)

    return PerBlockAttnProcessor()


def enable_per_block_cache(d, pipe, threshold, max_skips, info, log):
    transformer = pipe.transformer
    state_manager = d.hooks.StateManager(PerBlockState)
    head_class = type("PerBlockHead", (PerBlockHeadHook, d.hooks.ModelHook), {})
    tail_class = type("PerBlockTail", (PerBlockTailHook, d.hooks.ModelHook), {})
    head_hook = head_class(state_manager, info, threshold, max_skips, log)
    d.hooks.HookRegistry.check_if_exists_or_initialize(transformer.blocks[0]).register_hook(head_hook, "per_block_head")
    n = len(transformer.blocks)
    for l in range(1, n):
        hook = tail_class(state_manager, info, l, l == n - 1)
        d.hooks.HookRegistry.check_if_exists_or_initialize(transformer.blocks[l]).register_hook(hook, "per_block")
        transformer.blocks[l].attn1.processor = make_attention_processor(d, state_manager, info)
    # The cache context of the pipeline's `with transformer.cache_context(...)` reaches the state manager through
    # the registries (diffusers' CacheMixin), as for FirstBlockCache.
    return state_manager


# ---- the pipeline with recorded noise ------------------------------------------------------------------------------

def run_case(d, base_dir, threshold, max_skips):
    case = json.load(open(os.path.join(base_dir, "case.json")))
    kwargs = dict(case["call_defaults_in_effect"])
    kwargs.update(case["call_kwargs"])
    weights_dir = os.path.join(base_dir, "weights", "diffusers")
    config = json.load(open(os.path.join(weights_dir, "config.json")))
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    transformer = d.transformer.SkyReelsV2Transformer3DModel(**config)
    transformer.load_state_dict(read_safetensors(os.path.join(weights_dir, "diffusion_pytorch_model.safetensors")))
    transformer.eval()
    sched_config = json.load(open(os.path.join(base_dir, "scheduler", "scheduler_config.json")))
    scheduler = d.unipc.UniPCMultistepScheduler.from_config(sched_config)
    vae = d.vae.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    pipe = d.pipeline.SkyReelsV2DiffusionForcingPipeline(tokenizer=None, text_encoder=None, transformer=transformer,
                                                         vae=vae, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)

    info = CallInfo()
    log_blocks, calls = [], []
    state_manager = enable_per_block_cache(d, pipe, threshold, max_skips, info, log_blocks)

    # Recorded noise, in draw order.
    noise = read_safetensors(os.path.join(base_dir, "noise.safetensors"))
    draws = iter([noise[n["name"]] for n in case["noise_draws_in_order"]])
    d.pipeline.randn_tensor = lambda shape, generator=None, device=None, dtype=None, **k: next(draws).clone()
    real_randn_like = torch.randn_like
    torch.randn_like = lambda t, **k: next(draws).clone()

    # The timestep matrices of each chunk (for the rows' update masks and windows), and a reset per chunk.
    chunk_state = {"chunk": -1, "matrix": None, "calls": 0}
    real_matrix = pipe.generate_timestep_matrix

    def capture_matrix(*a, **k):
        result = real_matrix(*a, **k)
        chunk_state["matrix"] = result
        chunk_state["pre_ready"] = a[4] if len(a) > 4 else k.get("num_pre_ready", 0)
        return result

    pipe.generate_timestep_matrix = capture_matrix
    real_prepare = pipe.prepare_latents

    def prepare_latents(*a, **k):
        transformer._reset_stateful_cache()
        chunk_state["chunk"] += 1
        chunk_state["calls"] = 0
        return real_prepare(*a, **k)

    pipe.prepare_latents = prepare_latents
    block = kwargs["causal_block_size"]
    cfg = kwargs["guidance_scale"] > 1.0
    real_forward = transformer.forward

    def forward(hidden_states, timestep, encoder_hidden_states, **kw):
        step_matrix, _, update_mask, valid_interval = chunk_state["matrix"]
        row = chunk_state["calls"] // (2 if cfg else 1)
        context = "uncond" if cfg and chunk_state["calls"] % 2 == 1 else "cond"
        chunk_state["calls"] += 1
        start, end = valid_interval[row]
        mask = update_mask[row][start:end]
        updated = [bool(mask[f:f + block].any()) for f in range(0, end - start, block)]
        renoised = chunk_state["pre_ready"] if kwargs.get("addnoise_condition", 0) > 0 else 0
        frame_final = [not bool(update_mask[row][f]) and int(step_matrix[row][f]) == 0 and f >= renoised
                       for f in range(start, end)]
        final = [all(frame_final[f:f + block]) for f in range(0, end - start, block)]
        last = max([j for j, u in enumerate(updated) if u], default=-1)
        keep_blocks = last + 1
        info.chunk, info.row = chunk_state["chunk"], row
        info.first_block = start // block
        info.updated = updated[:keep_blocks]
        info.final = final[:keep_blocks]
        h, w = hidden_states.shape[3] // 2, hidden_states.shape[4] // 2
        info.block_tokens = block * h * w
        frames = keep_blocks * block
        before = len(log_blocks)
        if frames == 0:
            out = torch.zeros_like(hidden_states)
        else:
            out = real_forward(hidden_states[:, :, :frames], timestep[:, :frames], encoder_hidden_states, **kw)[0]
            if frames != hidden_states.shape[2]:
                full = torch.zeros_like(hidden_states)
                full[:, :, :frames] = out
                out = full
        blocks = log_blocks[before] if len(log_blocks) > before else []
        all_skipped = len(blocks) > 0 and all(b["skipped"] for b in blocks)
        calls.append({"chunk": info.chunk, "row": row, "context": context, "rel": None, "skipped": all_skipped,
                      "source": None, "blocks": blocks})
        return (out,)

    transformer.forward = forward
    transformer.config.num_frame_per_block = case["transformer_config_before_call"]["num_frame_per_block"]

    inputs = read_safetensors(os.path.join(base_dir, "inputs.safetensors"))
    call = {k: v for k, v in kwargs.items() if k not in ("generator", "prompt_embeds", "negative_prompt_embeds",
                                                          "callback_on_step_end_tensor_inputs")}
    call["prompt_embeds"] = inputs["prompt_embeds"]
    if "negative_prompt_embeds" in inputs:
        call["negative_prompt_embeds"] = inputs["negative_prompt_embeds"]
    torch.manual_seed(case.get("global_seed", 0))
    with torch.no_grad():
        latents = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    torch.randn_like = real_randn_like
    return case, latents, calls


def rels_of(calls):
    return [b["rel"] for c in calls for b in c["blocks"] if b["rel"] is not None]


def pick_threshold(rels, target=0.35, margin=1e-3):
    """A threshold near `target` at least `margin` away from every rel of the run (fp32 cannot flip a decision)."""
    for step in range(0, 2000):
        for t in (target + step * 1e-4, target - step * 1e-4):
            if t > 0 and all(abs(t - r) >= margin for r in rels):
                return round(t, 4)
    raise RuntimeError("no threshold with a margin")


def main():
    args = generator_arguments(HERE)
    torch.set_num_threads(1)
    d = import_diffusers(args.diffusers_src)
    register_skyreels_block(d)
    for name, spec in CASES.items():
        base_dir = os.path.join(GOLDEN, spec["base"])
        # A threshold near the target that is at least 1e-3 away from every rel of the run it makes.
        seen, threshold = [], 0.0
        for _ in range(8):
            case, latents, calls = run_case(d, base_dir, threshold, spec["max_skips"])
            rels = rels_of(calls)
            if threshold > 0 and all(abs(threshold - r) >= 1e-3 for r in rels):
                break
            seen += rels
            threshold = pick_threshold(seen, spec["target"])
        else:
            raise RuntimeError(name + ": no threshold clear of its run's rels")
        out_dir = os.path.join(args.out, name)
        os.makedirs(out_dir, exist_ok=True)
        write_safetensors(os.path.join(out_dir, "output.safetensors"), {"latents": latents})
        with open(os.path.join(out_dir, "decisions.json"), "w") as f:
            f.write("[\n" + ",\n".join(json.dumps(c) for c in calls) + "\n]\n")
        blocks = [b for c in calls for b in c["blocks"]]
        summary = {
            "base": "../../golden/pipeline_df_cache/" + spec["base"],
            "cache": {"kind": "first_block_per_block", "threshold": threshold, "max_skips": spec["max_skips"],
                      "scope": "chunk"},
            "produced_by": "tests/data/per_block_cache/make_cases.py over diffusers' SkyReelsV2DiffusionForcingPipeline "
                           "(commit " + case["diffusers_commit"] + ") with the recorded noise of the base case",
            "calls": len(calls),
            "block_decisions": len(blocks),
            "blocks_skipped": sum(b["skipped"] for b in blocks),
            "threshold_margin": min(abs(threshold - r) for r in rels) if rels else None,
        }
        with open(os.path.join(out_dir, "case.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        print(name, json.dumps(summary))


if __name__ == "__main__":
    main()
